"""Triton steps of ``linear_cross_entropy`` (:mod:`ragged.ops.linear_ce`): the chunked driver of
:mod:`ragged.kernels.linear_ce` with each step one kernel, the ``"triton"`` implementation declared
in :mod:`ragged.kernels.triton`.

* ``_lse_kernel``: one program per token row of a logits slice ``z [T, n]`` (the GEMM's output,
  row stride ``stride_z``, unit column stride): reads the row once in blocks, soft-caps it,
  folds its maximum and its sum of exponentials into the running ``M``/``S`` of the row, and
  picks the target's logit where the target falls in the slice;
* ``_grad_kernel``: one program per row again: ``g * (exp(y - lse) - [col == target])``, times
  ``1 - (y / cap)^2`` under a soft cap (``y`` the capped logit), written over the slice in its
  own dtype (the GEMMs of the weight's and the hidden states' gradients read it there).

float32 arithmetic; ``tanh`` as ``2 * sigmoid(2x) - 1``. Row offsets are int64 (``T * n`` passes
2**31). The grid comes from ``T`` alone; no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends import triton_interpreted
from ...records.linear_ce import (
    LinearCrossEntropyArgs,
    LinearCrossEntropyBackwardInputs,
    LinearCrossEntropyGrads,
    LinearCrossEntropyOutput,
)
from .. import linear_ce as _driver
from .launch import cached_launch

__all__ = ["linear_cross_entropy_backward", "linear_cross_entropy_forward"]


@triton.jit
def _cap(z, cap, HAS_CAP: tl.constexpr):
    if HAS_CAP:
        z = cap * (2.0 * tl.sigmoid(2.0 * z / cap) - 1.0)
    return z


@cached_launch
@triton.jit(do_not_specialize=["v0"])
def _lse_kernel(Z, stride_z, n_cols, TARGET, v0, M, S, ZT, cap, HAS_CAP: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_z
    top = -float("inf")
    acc = 0.0
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        keep = cols < n_cols
        z = _cap(tl.load(base + cols, mask=keep, other=0.0).to(tl.float32), cap, HAS_CAP)
        z = tl.where(keep, z, -float("inf"))
        new_top = tl.maximum(top, tl.max(z, axis=0))
        acc = acc * tl.exp(top - new_top) + tl.sum(tl.exp(z - new_top), axis=0)
        top = new_top
    m_old = tl.load(M + row)
    s_old = tl.load(S + row)
    both = tl.maximum(m_old, top)
    tl.store(S + row, s_old * tl.exp(m_old - both) + acc * tl.exp(top - both))
    tl.store(M + row, both)
    local = tl.load(TARGET + row) - v0
    if (local >= 0) & (local < n_cols):
        zt = _cap(tl.load(base + local).to(tl.float32), cap, HAS_CAP)
        tl.store(ZT + row, zt)


@cached_launch
@triton.jit(do_not_specialize=["v0"])
def _grad_kernel(Z, stride_z, n_cols, TARGET, v0, LSE, G, cap, HAS_CAP: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_z
    lse = tl.load(LSE + row)
    g = tl.load(G + row)
    local = tl.load(TARGET + row) - v0
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        keep = cols < n_cols
        y = _cap(tl.load(base + cols, mask=keep, other=0.0).to(tl.float32), cap, HAS_CAP)
        d = tl.exp(y - lse) - tl.where(cols == local, 1.0, 0.0)
        d = d * g
        if HAS_CAP:
            r = y / cap
            d = d * (1.0 - r * r)
        tl.store(base + cols, d.to(Z.dtype.element_ty), mask=keep)


def _block(n: int) -> int:
    cap = 128 if triton_interpreted() else 2048
    return max(16, min(cap, triton.next_power_of_2(max(n, 1))))


def _lse_step(z, target, v0, m, s, zt, softcap) -> None:
    n = z.shape[1]
    _lse_kernel[(z.shape[0],)](
        z, z.stride(0), n, target, v0, m, s, zt, float(softcap or 1.0),
        HAS_CAP=bool(softcap), BLOCK_V=_block(n), num_warps=8 if n >= 2048 else 4,
    )  # fmt: skip


def _grad_step(z, target, v0, lse, g, softcap) -> torch.Tensor:
    n = z.shape[1]
    _grad_kernel[(z.shape[0],)](
        z, z.stride(0), n, target, v0, lse, g, float(softcap or 1.0),
        HAS_CAP=bool(softcap), BLOCK_V=_block(n), num_warps=8 if n >= 2048 else 4,
    )  # fmt: skip
    return z


STEPS = _driver.Steps(_lse_step, _grad_step)


def linear_cross_entropy_forward(args: LinearCrossEntropyArgs) -> LinearCrossEntropyOutput:
    return _driver.forward(args, STEPS)


def linear_cross_entropy_backward(
    args: LinearCrossEntropyArgs, inputs: LinearCrossEntropyBackwardInputs
) -> LinearCrossEntropyGrads:
    return _driver.backward(args, inputs, STEPS)
