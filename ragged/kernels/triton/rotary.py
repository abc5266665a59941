"""Triton rotary embedding kernel: ``x [T, N, D]`` (any strides) rotated by each token's angle.

One kernel serves the forward and the backward (``SIGN = -1``: the rotation by the opposite
angle, which is the gradient). A program takes a tile of ``BLOCK_T`` tokens x ``BLOCK_N``
heads x ``BLOCK_H`` of the ``D/2`` rotated pairs: it computes cos and sin once per (token,
pair) and applies them to its ``BLOCK_N`` heads, reading both halves of each head and writing
both halves of the contiguous output. The grid comes from host ints (``T``, ``N``, ``D``); the
positions are read on the device, so nothing syncs, and ``T`` is not specialised on (a new
batch size makes no new variant).

Angles: ``positions[t] * inv_freq[i]`` in float32, as the reference has them. ``tl.cos`` /
``tl.sin`` lower to libdevice's ``cosf`` / ``sinf`` on CUDA (seen in the PTX), accurate for
every float32 but slow past about 1e5 radians (a Payne-Hanek reduction, in the lanes of
positions in the hundreds of thousands, that holds up their warps). Angles past 2**16 are
therefore first brought back by the nearest multiple of ``2 pi`` here (two fused
multiply-adds; within 3e-7 of the float32 angle's cos / sin up to 2**24 radians, where the
angle's own rounding is already 0.004 radians or more); ``tests/test_gpu_rotary.py`` checks
angles up to 5e5.

Index arithmetic is int64 (``T * stride_t`` passes 2**31 at long packed batches of wide
fused QKV rows).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...backends import triton_interpreted
from ...records.rotary import (
    RotaryEmbeddingArgs,
    RotaryEmbeddingBackwardInputs,
    RotaryEmbeddingGrads,
    RotaryEmbeddingOutput,
)
from .launch import cached_launch

__all__ = ["rotary_embedding", "rotary_embedding_backward"]

# 2 pi as a float32, what that leaves out as a float32, 1 / (2 pi); the angle past which they are
# used (without the reduction, positions up to 5e5 made the kernel 2.5x slower than positions
# below 512: bf16, T=32768, 24 heads of 64, on an H200)
_TWO_PI_HI: tl.constexpr = tl.constexpr(6.2831854820251465)
_TWO_PI_LO: tl.constexpr = tl.constexpr(-1.7484555314695172e-07)
_INV_TWO_PI: tl.constexpr = tl.constexpr(0.15915494309189535)
_LARGE_ANGLE: tl.constexpr = tl.constexpr(65536.0)


@triton.jit
def _reduced(angle):
    """``angle`` less the nearest multiple of 2 pi where it is past _LARGE_ANGLE (see the module
    docstring), else ``angle`` itself."""
    turns = tl.floor(angle * _INV_TWO_PI + 0.5)
    r = tl.fma(turns, -_TWO_PI_HI, angle)
    r = tl.fma(turns, -_TWO_PI_LO, r)
    return tl.where(tl.abs(angle) > _LARGE_ANGLE, r, angle)


@cached_launch
@triton.jit(do_not_specialize=["total"])
def _rotary_kernel(
    x,
    out,
    positions,
    inv_freq,
    total,
    n_heads,
    half,
    stride_t,
    stride_n,
    stride_d,
    stride_pos,
    stride_freq,
    scaling,
    SIGN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    i = tl.program_id(2).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < total
    i_ok = i < half
    pos = tl.load(positions + t * stride_pos, mask=t_ok, other=0).to(tl.float32)
    freq = tl.load(inv_freq + i * stride_freq, mask=i_ok, other=0.0).to(tl.float32)
    angle = _reduced(pos[:, None] * freq[None, :])  # [BLOCK_T, BLOCK_H]
    c = (tl.cos(angle) * scaling)[:, None, :]
    s = (tl.sin(angle) * (scaling * SIGN))[:, None, :]
    ok = t_ok[:, None, None] & (n < n_heads)[None, :, None] & i_ok[None, None, :]
    src = x + (t[:, None, None] * stride_t + n[None, :, None] * stride_n + i[None, None, :] * stride_d)
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + half * stride_d, mask=ok, other=0.0).to(tl.float32)
    dst = out + ((t[:, None, None] * n_heads + n[None, :, None]) * (2 * half) + i[None, None, :])
    tl.store(dst, (x1 * c - x2 * s).to(out.dtype.element_ty), mask=ok)
    tl.store(dst + half, (x2 * c + x1 * s).to(out.dtype.element_ty), mask=ok)


@functools.cache
def _tile(n_heads: int, half: int, interpreted: bool) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_N, BLOCK_H, num_warps): up to 256 pairs of a head and all the heads that
    fit in a tile of 2048 pairs (4096 elements read), then tokens to fill it (up to 16).
    Interpreted (CPU tests): tiny tiles, so that small tests cover several blocks of each."""
    if interpreted:
        return 2, min(triton.next_power_of_2(n_heads), 2), min(triton.next_power_of_2(half), 4), 1
    block_h = min(triton.next_power_of_2(half), 256)
    block_n = min(triton.next_power_of_2(n_heads), max(1, 2048 // block_h))
    block_t = max(1, min(16, 2048 // (block_n * block_h)))
    return block_t, block_n, block_h, 4


def _launch(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, sign: int
) -> torch.Tensor:
    total, n_heads, dim = x.shape
    out = torch.empty((total, n_heads, dim), dtype=x.dtype, device=x.device)
    half = dim // 2
    if total == 0 or n_heads == 0 or half == 0:  # no kernel gets an empty tensor's pointer
        return out
    block_t, block_n, block_h, warps = _tile(n_heads, half, triton_interpreted())
    grid = (triton.cdiv(total, block_t), triton.cdiv(n_heads, block_n), triton.cdiv(half, block_h))
    _rotary_kernel[grid](
        x,
        out,
        positions,
        inv_freq,
        total,
        n_heads,
        half,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        positions.stride(0),
        inv_freq.stride(0),
        float(scaling),
        SIGN=sign,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_H=block_h,
        num_warps=warps,
    )
    return out


def rotary_embedding(args: RotaryEmbeddingArgs) -> RotaryEmbeddingOutput:
    """``x [T, N, D]`` (any strides), ``positions [T]``, ``inv_freq [D/2]`` (any strides and
    floating dtype, read as float32) -> ``out [T, N, D]`` contiguous, as
    :func:`ragged.ops.rotary.reference_rotary_embedding`."""
    return RotaryEmbeddingOutput(_launch(args.x, args.positions, args.inv_freq, args.scaling, 1))


def rotary_embedding_backward(args: RotaryEmbeddingArgs, inputs: RotaryEmbeddingBackwardInputs) -> RotaryEmbeddingGrads:
    """``grad [T, N, D]`` (any strides, expanded included) -> ``grad_x [T, N, D]``, as
    :func:`ragged.ops.rotary.reference_rotary_embedding_backward` (``args.x`` is not read)."""
    return RotaryEmbeddingGrads(_launch(inputs.grad_out, args.positions, args.inv_freq, args.scaling, -1))
