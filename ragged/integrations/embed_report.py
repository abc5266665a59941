"""What ``python -m ragged.embed`` (:mod:`ragged.integrations.embed`) reports: the progress bar while it
embeds, and its last two lines: where the whole run's time went, then the texts embedded, their
rate while embedding and their rate over the whole run.

The whole run is timed from the start of the process, read from ``/proc/self/stat`` (Linux): the
interpreter's start and the imports that ``python -m ragged.embed`` does before any line of the
command runs (``import ragged``, torch) are in it. Where that cannot be read, or when
:func:`ragged.integrations.embed.main` is called from Python, the run starts at the call.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

__all__ = ["Clock", "Progress", "graphs_captured", "process_start", "quiet_loading"]

PHASES = ("imports", "input", "model", "embedding", "output")


def process_start() -> float | None:
    """The start of this process on :func:`time.perf_counter`'s clock, from ``/proc`` (to the
    kernel's clock tick); None where it cannot be read."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        # the fields after the command's name (in parentheses, which may hold spaces): state is
        # field 3, starttime (clock ticks after boot) field 22
        ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.perf_counter() - age if 0 <= age < 86400 else None


class Clock:
    """Seconds spent per phase of a run that started at ``start`` (``time.perf_counter``)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.end: float | None = None
        self.graphs = 0

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the block into phase ``name``; a phase inside another is taken out of the outer one."""
        begin = time.perf_counter()
        outer = dict(self.seconds)
        try:
            yield
        finally:
            inner = {k: self.seconds[k] - outer[k] for k in self.seconds}
            self.seconds[name] += time.perf_counter() - begin - sum(v for k, v in inner.items() if k != name)

    def stop(self) -> None:
        self.end = time.perf_counter()

    @property
    def whole(self) -> float:
        return (self.end if self.end is not None else time.perf_counter()) - self.start

    def breakdown(self) -> str:
        """``time: imports 3.21 s, input 0.01 s, model 0.40 s, embedding 1.03 s (4 CUDA graphs
        captured), output 0.10 s, other 0.12 s``: the phases add up to the whole run."""
        parts = [f"{name} {self.seconds[name]:.2f} s" for name in PHASES]
        parts[3] += f" ({self.graphs} CUDA graph{'s' if self.graphs != 1 else ''} captured)"
        other = self.whole - sum(self.seconds.values())
        return f"time: {', '.join(parts)}, other {other:.2f} s"


class Progress:
    """Texts and tokens this run has embedded, and the progress bar that shows them (if any)."""

    def __init__(self, total: int, done: int, show: bool):
        self.lock = threading.Lock()
        self.texts = self.tokens = 0
        self.start, self.seconds = time.perf_counter(), 0.0
        self.bar = self.task = None
        if show:
            try:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeRemainingColumn,
                )
            except ImportError:
                return
            self.bar = Progress(
                TextColumn("embedding"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("texts"),
                TextColumn("{task.fields[speed]}"),
                TimeRemainingColumn(),
            )
            self.task = self.bar.add_task("embedding", total=total, completed=done, speed="")

    @contextlib.contextmanager
    def running(self):
        """The bar shown (if any) and the time counted while the block runs."""
        if self.bar is not None:
            self.bar.start()
        self.start = time.perf_counter()
        try:
            yield self
        finally:
            self.seconds = time.perf_counter() - self.start
            if self.bar is not None:
                self.bar.stop()

    def __call__(self, texts: int, tokens: int) -> None:
        with self.lock:
            self.texts += int(texts)
            self.tokens += int(tokens)
            seconds = max(time.perf_counter() - self.start, 1e-9)
            speed = f"{self.texts / seconds:,.0f} texts/s, {self.tokens / seconds:,.0f} tokens/s"
        if self.bar is not None and self.task is not None:  # set together
            self.bar.update(self.task, advance=int(texts), speed=speed)

    def summary(self, whole: float) -> str:
        """``embedded N texts (T tokens) in S s: X texts/s, Y tokens/s; whole run W s: Z texts/s``."""
        s = self.seconds
        per_s = [n / s if s > 0 else 0.0 for n in (self.texts, self.tokens)]
        return (
            f"embedded {self.texts} texts ({self.tokens} tokens) in {s:.2f} s: {per_s[0]:.1f} texts/s, "
            f"{per_s[1]:.1f} tokens/s; whole run {whole:.2f} s: "
            f"{self.texts / whole if whole > 0 else 0.0:.1f} texts/s"
        )


@contextlib.contextmanager
def quiet_loading(quiet: bool):
    """transformers' and huggingface_hub's progress bars off (``quiet``), as they were after."""
    if not quiet:
        yield
        return
    from huggingface_hub import utils as hub
    from transformers.utils import logging as tf_logging

    hub_off, tf_on = hub.are_progress_bars_disabled(), tf_logging.is_progress_bar_enabled()
    tf_logging.disable_progress_bar()
    hub.disable_progress_bars()
    try:
        yield
    finally:
        if tf_on:
            tf_logging.enable_progress_bar()
        (hub.disable_progress_bars if hub_off else hub.enable_progress_bars)()


def graphs_captured(models: list) -> int:
    """CUDA graphs the pipeline holds for ``models`` (captured in this run: the models are new)."""
    count = 0
    for st in models:
        cache = getattr(getattr(st.__dict__.get("encode"), "pipeline", None), "cache", None) or {}
        count += sum(held[1].num_graphs for held in list(cache.values()) if held[1] is not None)
    return count
