"""Triton pool kernels: each sequence of ``values [T, F]`` reduced to a row of ``out [B, F]``.

Forward: one program per (sequence ``b``, block of ``BLOCK_F`` features). It reads its
sequence's bounds from ``offsets`` on the device (no host sync: the host knows B, F and
T, and picks the tile from the mean length T / B) and walks the tokens ``BLOCK_T`` rows
at a time, keeping a ``[BLOCK_T, BLOCK_F]`` float32 tile of partial results that it
reduces once at the end (``first`` / ``last`` read one row and no loop). ``max`` keeps,
per lane of the tile, the best value and its position in the sequence (int32: a sequence
is shorter than 2**31 tokens); a lane takes a later token only when it is strictly
larger (or the first NaN), and the final reduction takes the smallest position among the
lanes holding the maximum, so the argmax is the first maximal token, as the reference
has it.

Backward: one kernel of the same layout writes every row of ``grad_values [T, F]`` once:
``grad_b`` (over ``L_b`` for mean) broadcast over the sequence, or ``grad_b`` at the one
selected token and zeros at the others. A torch backward would need the token-to-sequence
map (a repeat_interleave), a gather, and for max / first / last a zero fill plus a
scatter: three to four passes over ``[T, F]`` where this kernel makes one write.

Offsets are clipped to ``[0, T]`` in the kernels (two scalar ops per program): offsets
that break the contract never make a kernel touch memory outside ``values`` and ``out``.
Index arithmetic is int64 (``T * stride`` passes 2**31 at realistic sizes).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...records.pool import PoolArgs, PoolBackwardInputs, PoolGrads, PoolOutput
from .launch import cached_launch

_MODE_IDS = {"sum": 0, "mean": 1, "max": 2, "first": 3, "last": 4}
_SUM: tl.constexpr = tl.constexpr(0)
_MEAN: tl.constexpr = tl.constexpr(1)
_MAX: tl.constexpr = tl.constexpr(2)
_FIRST: tl.constexpr = tl.constexpr(3)
_LAST: tl.constexpr = tl.constexpr(4)


@triton.jit
def _bounds(offsets, b, total):
    start = tl.load(offsets + b).to(tl.int64)
    end = tl.load(offsets + b + 1).to(tl.int64)
    start = tl.minimum(tl.maximum(start, 0), total)
    end = tl.minimum(tl.maximum(end, start), total)
    return start, end


@cached_launch(dry=False)  # writes indices other code reads
@triton.jit
def _pool_kernel(
    x,
    out,
    index,
    offsets,
    total,
    n_feat,
    stride_t,
    stride_f,
    MODE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    col_ok = cols < n_feat
    col_off = cols.to(tl.int64) * stride_f
    start, end = _bounds(offsets, b, total)
    out_row = out + b * n_feat + cols
    if MODE == _FIRST or MODE == _LAST:
        if MODE == _FIRST:
            t = start
        else:
            t = end - 1
        # the length compared as a block: a scalar condition in a mask is not taken everywhere
        nonempty = (tl.zeros([BLOCK_F], tl.int64) + end) > start
        v = tl.load(x + t * stride_t + col_off, mask=col_ok & nonempty, other=0)
        tl.store(out_row, v, mask=col_ok)
    elif MODE == _MAX:
        best = tl.full([BLOCK_T, BLOCK_F], float("-inf"), tl.float32)
        # positions in the sequence (int32: fewer registers than token indices)
        best_j = tl.full([BLOCK_T, BLOCK_F], -1, tl.int32)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            ok = (t < end)[:, None] & col_ok[None, :]
            v = tl.load(x + t[:, None] * stride_t + col_off[None, :], mask=ok, other=float("-inf")).to(tl.float32)
            # strictly larger, or the first NaN of the lane, or the lane's first token
            take = ok & ((v > best) | ((v != v) & (best == best)) | (best_j < 0))
            best = tl.where(take, v, best)
            best_j = tl.where(take, (t - start).to(tl.int32)[:, None], best_j)
        is_nan = best != best
        nan_any = tl.max(is_nan.to(tl.int32), axis=0) > 0
        finite = tl.where(is_nan, float("-inf"), best)
        top = tl.max(finite, axis=0)
        hit = (best_j >= 0) & tl.where(nan_any[None, :], is_nan, finite == top[None, :])
        arg = start + tl.min(tl.where(hit, best_j, 2147483647), axis=0).to(tl.int64)
        nonempty = end > start
        value = tl.where(nan_any, float("nan"), top)
        value = tl.where(nonempty, value, 0.0)
        arg = tl.where(nonempty, arg, -1)
        tl.store(out_row, value.to(out.dtype.element_ty), mask=col_ok)
        tl.store(index + b * n_feat + cols, arg.to(index.dtype.element_ty), mask=col_ok)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_F], tl.float32)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            ok = (t < end)[:, None] & col_ok[None, :]
            acc += tl.load(x + t[:, None] * stride_t + col_off[None, :], mask=ok, other=0).to(tl.float32)
        s = tl.sum(acc, axis=0)
        if MODE == _MEAN:
            s = s / tl.maximum(end - start, 1).to(tl.float32)
        tl.store(out_row, s.to(out.dtype.element_ty), mask=col_ok)


@cached_launch
@triton.jit
def _pool_backward_kernel(
    g,
    dx,
    index,
    offsets,
    total,
    n_feat,
    g_stride_b,
    g_stride_f,
    MODE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    col_ok = cols < n_feat
    start, end = _bounds(offsets, b, total)
    gv = tl.load(g + b * g_stride_b + cols.to(tl.int64) * g_stride_f, mask=col_ok, other=0).to(tl.float32)
    if MODE == _MEAN:
        gv = gv / tl.maximum(end - start, 1).to(tl.float32)
    if MODE == _MAX:
        pick = tl.load(index + b * n_feat + cols, mask=col_ok, other=-1).to(tl.int64)
    elif MODE == _FIRST:
        pick = tl.zeros([BLOCK_F], tl.int64) + start
    else:
        pick = tl.zeros([BLOCK_F], tl.int64) + (end - 1)
    # the gradient rounded to the output dtype once, as the reference rounds it
    gv = gv.to(dx.dtype.element_ty)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        ok = (t < end)[:, None] & col_ok[None, :]
        if MODE == _SUM or MODE == _MEAN:
            v = tl.zeros([BLOCK_T, BLOCK_F], dx.dtype.element_ty) + gv[None, :]
        else:
            v = tl.where(t[:, None] == pick[None, :], gv[None, :], 0.0).to(dx.dtype.element_ty)
        tl.store(dx + t[:, None] * n_feat + cols[None, :], v, mask=ok)


@functools.cache
def _tile(n_feat: int, size: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_F, num_warps) for rows of ``n_feat`` features and sequences of
    ``size`` (0: short, 1: medium, 2: long, see :func:`_size`).

    From a sweep on an H100 (bf16 / fp16 / fp32, F from 1 to 4096, mean lengths from 20
    to 2800): 64 features a program throughout (more programs a sequence than wider
    blocks give, which the long sequences of a long-tailed batch need), and token blocks
    that grow with the sequences: 8 tokens and 2 warps for short ones, 32 and 8 warps for
    long ones. Rows narrower than 64 take longer token blocks instead, up to the longest
    mean length of their class.
    """
    block_t, warps = ((8, 2), (16, 4), (32, 8))[size]
    block_f = min(triton.next_power_of_2(max(n_feat, 1)), 64)
    return min(block_t * (64 // block_f), (32, 256, 2048)[size]), block_f, warps


def _size(total: int, batch: int) -> int:
    """The mean sequence length as 0 (up to 32), 1 (up to 256) or 2 (longer): a host value,
    no read of the offsets."""
    mean = total // batch
    return 0 if mean <= 32 else 1 if mean <= 256 else 2


def pool(args: PoolArgs) -> PoolOutput:
    """``values [T, F]`` (any strides), ``offsets [B+1]`` -> ``(out [B, F], index)`` as
    :func:`ragged.ops.pool.reference_pool`."""
    values, offsets, mode = args.values, args.offsets, args.mode
    total, n_feat = values.shape
    batch = offsets.shape[0] - 1
    out = torch.empty((batch, n_feat), dtype=values.dtype, device=values.device)
    index = torch.empty((batch, n_feat) if mode == "max" else (0,), dtype=offsets.dtype, device=values.device)
    if batch == 0 or n_feat == 0:
        return PoolOutput(out, index)
    if total == 0:  # every sequence empty; and no kernel gets an empty tensor's pointer
        return PoolOutput(out.zero_(), index.fill_(-1))
    block_t, block_f, warps = _tile(n_feat, _size(total, batch))
    grid = (batch, triton.cdiv(n_feat, block_f))
    # the index is written by max only: the other modes get a placeholder pointer
    _pool_kernel[grid](
        values,
        out,
        index if mode == "max" else out,
        offsets.contiguous(),
        total,
        n_feat,
        values.stride(0),
        values.stride(1),
        MODE=_MODE_IDS[mode],
        BLOCK_T=block_t,
        BLOCK_F=block_f,
        num_warps=warps,
    )
    return PoolOutput(out, index)


def pool_backward(args: PoolArgs, inputs: PoolBackwardInputs) -> PoolGrads:
    """``grad [B, F]`` (any strides, expanded included) -> ``grad_values [T, F]`` as
    :func:`ragged.ops.pool.reference_pool_backward`. Every row of a valid ``[T, F]`` layout
    is written (the offsets cover ``[0, T)``); ``args.values`` is not read."""
    grad, index, total = inputs.grad_out, inputs.argmax, inputs.total
    offsets, mode = args.offsets, args.mode
    batch, n_feat = grad.shape
    dx = torch.empty((total, n_feat), dtype=grad.dtype, device=grad.device)
    if batch == 0 or n_feat == 0 or total == 0:
        return PoolGrads(dx)
    block_t, block_f, warps = _tile(n_feat, _size(total, batch))
    grid = (batch, triton.cdiv(n_feat, block_f))
    _pool_backward_kernel[grid](
        grad,
        dx,
        index.contiguous() if mode == "max" else dx,
        offsets.contiguous(),
        total,
        n_feat,
        grad.stride(0),
        grad.stride(1),
        MODE=_MODE_IDS[mode],
        BLOCK_T=block_t,
        BLOCK_F=block_f,
        num_warps=warps,
    )
    return PoolGrads(dx)
