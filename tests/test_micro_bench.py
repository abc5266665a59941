"""pytest-benchmark micro-benchmarks of pack / unpack, one per backend.

pyproject's addopts pass ``--benchmark-disable``: each test then runs its op once, as
a plain correctness test against the reference. ``--benchmark-enable`` times them.
The full comparison with the torch baselines is ``python -m bench``.

Sizes are tiny without CUDA: there the Triton kernels run in the interpreter.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import HAS_CUDA

import ragged

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
BACKENDS = ("torch", "triton", "cuda")

# (id, dtype, B, M, feature shape): B sequences of lengths in [1, M], padded to M.
CASES = (
    [("fp32", torch.float32, 4, 16, (8,)), ("int64-ids", torch.int64, 4, 16, ())]
    if not HAS_CUDA
    else [("bf16", torch.bfloat16, 64, 256, (512,)), ("int64-ids", torch.int64, 256, 512, ())]
)


def _batch(dtype, batch, width, feat, seed=0):
    """``padded [B, M, *feat]``, int32 ``offsets [B+1]`` and ``T``; lengths uniform in [1, M]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=gen).tolist()
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)
    size = (batch, width, *feat)
    if dtype.is_floating_point:
        padded = torch.randn(size, generator=gen).to(dtype)
    else:
        padded = torch.randint(0, 50_000, size, generator=gen, dtype=dtype)
    return padded.to(DEVICE), offsets, sum(lengths)


def _skip_unless_runnable(op, backend, *args):
    reasons = ragged.explain(op, *args).get(backend)
    if reasons:
        pytest.skip(f"{backend}: " + "; ".join(reasons))


def _timed(fn):
    """``fn`` with a device sync, so that a benchmark round measures finished work."""

    def run(*args, **kwargs):
        out = fn(*args, **kwargs)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        return out

    return run


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_pack_micro(benchmark, case, backend):
    _, dtype, batch, width, feat = case
    padded, offsets, total = _batch(dtype, batch, width, feat)
    _skip_unless_runnable("pack", backend, padded, offsets)
    out = benchmark(_timed(ragged.pack_values), padded, offsets, total, backend=backend)
    assert torch.equal(out, ragged.reference_pack(padded, offsets, total))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_unpack_micro(benchmark, case, backend):
    _, dtype, batch, width, feat = case
    padded, offsets, total = _batch(dtype, batch, width, feat)
    values = ragged.reference_pack(padded, offsets, total)
    _skip_unless_runnable("unpack", backend, values, offsets)
    out = benchmark(_timed(ragged.unpack_values), values, offsets, width, backend=backend)
    assert torch.equal(out, ragged.reference_unpack(values, offsets, width))
