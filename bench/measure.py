"""Measuring one callable: the timing budget (:class:`Timing`), median times with the warm-up
that lets GPU clocks settle, peak memory, the GPU's busy time without host gaps, and freeing
memory between rows."""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Timing:
    """Timing budget of one measurement, in milliseconds (see :func:`median_ms`), and of
    the warm-up before a row's first measurement (see :func:`settle`): short timings of
    ``settle_rep_ms`` each until two in a row agree within ``settle_tol`` (a fraction)
    plus ``settle_abs_ms``, for at most ``settle_max_s`` seconds (0: no such warm-up)."""

    warmup_ms: float
    rep_ms: float
    min_reps: int = 5
    settle_rep_ms: float = 0.0
    settle_tol: float = 0.03
    settle_abs_ms: float = 0.0
    settle_max_s: float = 0.0

    @classmethod
    def default(cls, device: torch.device, quick: bool) -> Timing:
        if device.type == "cuda":
            # A row measured right after its first call (Triton / NVRTC compiling, the GPU
            # idle for seconds) read 0.092 ms against 0.055 ms for the same kernel warm
            # (attention, causal forward, B=64 long-tailed to 512, H200): a few seconds of
            # settling per row at most. settle_abs_ms: CUDA events resolve about 0.5 us, 5%
            # of a 10 us kernel.
            return (
                cls(10, 40, settle_rep_ms=5, settle_abs_ms=0.001, settle_max_s=2.0)
                if quick
                else cls(25, 100, settle_rep_ms=10, settle_abs_ms=0.001, settle_max_s=4.0)
            )
        # CPU: no GPU clocks to wake; a short settle (50 ms a row at most) takes the
        # first-call effects (allocator, caches) out at little cost.
        return (
            cls(5, 20, settle_rep_ms=2, settle_max_s=0.02) if quick else cls(10, 50, settle_rep_ms=3, settle_max_s=0.05)
        )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], Any], device: torch.device, timing: Timing) -> float:
    """Median time of one call of ``fn``, in milliseconds.

    CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls).
    CPU: ``time.perf_counter`` around each call, after ``timing.warmup_ms`` of warm-up,
    for ``timing.rep_ms`` and at least ``timing.min_reps`` calls.
    """
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=timing.warmup_ms, rep=timing.rep_ms, return_mode="median"))
    fn()
    deadline = time.perf_counter() + timing.warmup_ms / 1e3
    while time.perf_counter() < deadline:
        fn()
    return _cpu_median_ms(fn, timing.rep_ms, timing.min_reps)


def _cpu_median_ms(fn: Callable[[], Any], rep_ms: float, min_reps: int) -> float:
    samples: list[float] = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(samples) < min_reps or (time.perf_counter() < deadline and len(samples) < 100_000):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def short_median_ms(fn: Callable[[], Any], device: torch.device, rep_ms: float) -> float:
    """A quick median of ``fn`` over about ``rep_ms`` of calls: one round of :func:`settle`.
    CUDA: ``do_bench`` with a 1 ms warm-up; CPU: at least 3 calls."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=1, rep=rep_ms, return_mode="median"))
    return _cpu_median_ms(fn, rep_ms, 3)


def settle(fn: Callable[[], Any], device: torch.device, timing: Timing) -> list[float]:
    """Warm ``fn`` up until its times settle; returns the medians of the rounds (ms).

    Rounds of :func:`short_median_ms` (``timing.settle_rep_ms`` each) until two in a row
    agree within ``timing.settle_tol`` of the smaller plus ``timing.settle_abs_ms``, or
    ``timing.settle_max_s`` has passed (then the last rounds are still drifting: the
    measurement is taken anyway). A GPU left idle while a first call compiled (Triton,
    NVRTC) runs slow until its clocks come back up; a measurement taken straight away read
    1.7x too slow on one attention row. Nothing runs when ``settle_max_s`` is 0.
    """
    if timing.settle_max_s <= 0:
        return []
    deadline = time.perf_counter() + timing.settle_max_s
    rounds = [short_median_ms(fn, device, timing.settle_rep_ms)]
    while time.perf_counter() < deadline:
        rounds.append(short_median_ms(fn, device, timing.settle_rep_ms))
        previous, last = rounds[-2], rounds[-1]
        if abs(last - previous) <= timing.settle_tol * min(last, previous) + timing.settle_abs_ms:
            break
    return rounds


def graphed_replay(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` (a forward, or a forward and ``autograd.grad``) captured once in a CUDA graph after
    three warm-up calls on a side stream; the returned callable replays it and returns the
    captured call's outputs: the kernels' own time, without the host's per-call work."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out

    return replay


def gb_per_s(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def peak_memory_bytes(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Peak memory allocated during one call of ``fn`` above what was allocated before it.

    The output of ``fn`` is alive until the call returns, so it counts. CUDA:
    ``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats``,
    minus ``torch.cuda.memory_allocated`` before the call. CPU: the running sum of the
    allocation and free events recorded by ``torch.profiler`` (``profile_memory=True``)
    during the call. ``None`` where it cannot be measured (other devices, or a torch
    whose profiler does not expose its events).
    """
    release_memory(device)
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del out
        return max(0, int(peak))
    if device.type == "cpu":
        return _cpu_peak_bytes(fn)
    return None


def gpu_busy_ms(fn: Callable[[], Any], device: torch.device, calls: int = 3) -> float | None:
    """GPU time of one call of ``fn`` with the host taken out: the union of the intervals of
    the kernels (and memsets / copies) ``torch.profiler`` records over ``calls`` calls, over
    ``calls``. Next to the timed median it tells a host-bound row (median well above this)
    from a GPU-bound one. ``None`` off CUDA or where the profiler records no device activity."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                out = fn()
                del out
            synchronize(device)
        spans = sorted(
            (e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
        )
    if not spans:
        return None
    busy, (start, end) = 0, spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return busy / calls / 1e3  # profiler times are in us


def _cpu_peak_bytes(fn: Callable[[], Any]) -> int | None:
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    # Some torch builds announce the profiler's start and stop on stderr: silenced for
    # the profiled call (restored even when it raises).
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
            del out
        from torch._C._autograd import DeviceType

        events = [
            (e.start_ns(), e.nbytes())
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
        ]
    except Exception:  # no profiler in this build, or its (private) event API changed
        return None
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    current = peak = 0
    for _, nbytes in sorted(events, key=lambda e: e[0]):  # stable: ties keep the recorded order
        current += nbytes
        peak = max(peak, current)
    return peak


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cuda_graph(run: Callable[[], Any], warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``(graph, outputs)``: ``run`` captured in a CUDA graph after ``warmup`` calls on a side
    stream (the allocator and lazy initialisations settle there); ``graph.replay()`` reruns it
    into the same outputs. Whatever ``run`` reads must outlive the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out
