"""Compiling ahead: ``compile_only`` turns cached launches into compiles (CPU: the launch
routing; the GPU tests run the layer's pass that uses it for real)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")


def _kernel(x_ptr, n, BLOCK: triton.language.constexpr):  # never compiled here
    pass


class _Recorder:
    """Stands in for a JITFunction's ``run`` and its normal launch path."""

    def __init__(self):
        self.calls = []

    def run(self, *args, grid, warmup, **meta):
        self.calls.append(("run", warmup, args, grid, meta))
        return "compiled"

    def __getitem__(self, grid):
        return lambda *args, **meta: self.calls.append(("launch", grid, args, meta))


def _cached(dry: bool):
    from ragged.kernels.triton.launch import CachedLaunch

    launch = CachedLaunch(triton.runtime.JITFunction(_kernel), dry=dry)
    assert launch._direct
    rec = _Recorder()
    launch.jit = rec  # route the wrapper's calls to the recorder (its key tables stay empty)
    return launch, rec


def test_compile_only_compiles_and_does_not_launch(monkeypatch):
    from ragged.kernels.triton import launch as L

    monkeypatch.setattr(L, "_FAST", False)  # the normal path: the recorder sees every launch
    kernel, rec = _cached(dry=True)
    x = torch.zeros(4)
    kernel[(3,)](x, 4, BLOCK=16)
    assert rec.calls == [("launch", (3,), (x, 4), {"BLOCK": 16})]
    with L.compile_only(workers=1):
        out = kernel[(5,)](x, 7, BLOCK=32)
    assert out == "compiled"
    assert rec.calls[1] == ("run", True, (x, 7), (5,), {"BLOCK": 32})
    kernel[(3,)](x, 4, BLOCK=16)  # after the block: launches again
    assert rec.calls[2][0] == "launch" and len(rec.calls) == 3


def test_compile_only_runs_kernels_declared_not_dry(monkeypatch):
    from ragged.kernels.triton import launch as L

    monkeypatch.setattr(L, "_FAST", False)
    kernel, rec = _cached(dry=False)
    x = torch.zeros(4)
    with L.compile_only(workers=1):
        kernel[(2,)](x, 4, BLOCK=16)
    assert [c[0] for c in rec.calls] == ["launch"]


def test_compile_only_is_not_reentrant_and_ends_on_error():
    from ragged.kernels.triton import launch as L

    with pytest.raises(RuntimeError, match="already inside"):
        with L.compile_only(workers=1):
            with L.compile_only(workers=1):
                pass
    assert not L._dry_here()
    with pytest.raises(KeyError):
        with L.compile_only(workers=2):
            assert L._dry_here()
            raise KeyError("x")
    assert not L._dry_here()


def test_index_writing_kernels_are_declared_not_dry():
    from ragged.kernels.triton import attention_kernels, pool, vocab_cross_entropy

    assert not attention_kernels._block_cum_kernel.dry  # block counts the attention kernels index by
    assert not pool._pool_kernel.dry  # max pooling's argmax, read by its backward
    assert not vocab_cross_entropy._ce_fwd_kernel.dry  # each target's local index
    assert attention_kernels._fwd_kernel.dry and attention_kernels._bwd_dq_kernel.dry


def test_per_batch_integers_are_not_specialised():
    """Integers that change from batch to batch (token and sequence counts, the dropout seed)
    would otherwise give a new kernel variant, and a compile, whenever their divisibility by 16
    changes: every 16th dropout seed, say."""
    from ragged.kernels.triton import attention_kernels as A
    from ragged.kernels.triton import fused_kernels as F

    def unspecialised(kernel) -> set:
        jit = kernel.jit  # a JITFunction, or the interpreter's function (which keeps the options)
        given = getattr(jit, "do_not_specialize", None)
        if given is None:
            given = jit.kwargs["do_not_specialize"] or []
        return {jit.arg_names[i] if isinstance(i, int) else i for i in given}

    for kernel in (A._fwd_kernel, A._bwd_dkdv_kernel, A._bwd_dq_kernel):
        assert {"seed", "total_q", "batch", "n_steps", "max_k"} <= unspecialised(kernel)
    for kernel in (F._ln_fwd_kernel, F._ln_bwd_kernel, F._bias_act_fwd_kernel, F._bias_act_bwd_kernel):
        assert "n_rows" in unspecialised(kernel)


def test_compile_only_is_per_thread(monkeypatch):
    """Replicas of torch.nn.DataParallel run in threads at once: one thread's compile-only
    pass must not turn another thread's launches into compiles (they would silently not run)."""
    import threading

    from ragged.kernels.triton import launch as L

    monkeypatch.setattr(L, "_FAST", False)
    kernel, rec = _cached(dry=True)
    x = torch.zeros(4)
    inside, done = threading.Event(), threading.Event()

    def other():
        inside.wait(10)
        kernel[(1,)](x, 4, BLOCK=16)  # while the main thread is inside compile_only
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with L.compile_only(workers=1):
        inside.set()
        assert done.wait(10)
    t.join()
    assert [c[0] for c in rec.calls] == ["launch"], rec.calls


def test_the_public_compile_only_is_the_launchers(monkeypatch):
    """``ragged.warmup.compile_only``, what ``ragged.nn`` compiles ahead with: the launcher's
    context (compiles, launches nothing), or None where Triton cannot be imported."""
    import sys

    from ragged.kernels.triton import launch as L
    from ragged.warmup import compile_only

    monkeypatch.setattr(L, "_FAST", False)
    kernel, rec = _cached(dry=True)
    x = torch.zeros(4)
    with compile_only(workers=1):
        assert kernel[(5,)](x, 7, BLOCK=32) == "compiled"
    assert [c[0] for c in rec.calls] == ["run"]
    monkeypatch.setitem(sys.modules, "ragged.kernels.triton.launch", None)
    assert compile_only() is None
