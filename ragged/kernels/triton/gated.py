"""Triton kernels of ``gated_act`` (:mod:`ragged.ops.gated`) and their launchers, the ``"triton"``
implementation declared in :mod:`ragged.kernels.triton`.

* forward: ``y = act(a) * b`` where ``a = x[:, :F]`` (input half) and ``b = x[:, F:]`` (gate
  half) of ``x [N, 2F]``;
* backward: ``dx[:, :F] = g * b * act'(a)``, ``dx[:, F:] = g * act(a)``, ``act(a)`` recomputed
  from ``x`` (the forward's output is never read).

The activations are those of ``bias_act`` (the same ``_act`` / ``_act_grad`` of
:mod:`.fused_kernels`, the same ``ACT`` codes). One program per tile of ``BLOCK_R`` rows by
``BLOCK_F`` output columns (the elementwise tiles of ``bias_act``); the program reads the two
halves at the same columns of its rows. fp32 arithmetic, each result rounded once to its
storage dtype.

Layout: ``x`` and the gradient are read with unit stride along the columns and any row stride
(``stride(0)``); outputs are written contiguous. Row offsets are int64 (``N * 2F`` passes 2**31
at realistic sizes). The grid comes from ``N`` and ``F`` only: spare rows of a graph's bucket
are computed like real ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends import triton_interpreted
from ...records.gated import GatedActArgs, GatedActBackwardInputs, GatedActGrads, GatedActOutput
from .fused import ACTIVATIONS, _bias_act_config
from .fused_kernels import _act, _act_grad
from .launch import cached_launch

__all__ = ["gated_act_backward", "gated_act_forward"]


@cached_launch
@triton.jit(do_not_specialize=["n_rows"])
def _gated_act_fwd_kernel(
    X, Y, n_rows, stride_x, N_COLS: tl.constexpr, ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m = (rows < n_rows)[:, None] & (cols < N_COLS)[None, :]
    src = X + rows[:, None] * stride_x + cols[None, :]
    a = tl.load(src, mask=m, other=0.0).to(tl.float32)
    b = tl.load(src + N_COLS, mask=m, other=0.0).to(tl.float32)
    y = _act(a, ACT) * b
    tl.store(Y + rows[:, None] * N_COLS + cols[None, :], y.to(Y.dtype.element_ty), mask=m)


@cached_launch
@triton.jit(do_not_specialize=["n_rows"])
def _gated_act_bwd_kernel(
    G,
    X,
    DX,
    n_rows,
    stride_g,
    stride_x,
    N_COLS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m = (rows < n_rows)[:, None] & (cols < N_COLS)[None, :]
    src = X + rows[:, None] * stride_x + cols[None, :]
    a = tl.load(src, mask=m, other=0.0).to(tl.float32)
    b = tl.load(src + N_COLS, mask=m, other=0.0).to(tl.float32)
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
    da = g * b * _act_grad(a, ACT)
    db = g * _act(a, ACT)
    dst = DX + rows[:, None] * (2 * N_COLS) + cols[None, :]
    tl.store(dst, da.to(DX.dtype.element_ty), mask=m)
    tl.store(dst + N_COLS, db.to(DX.dtype.element_ty), mask=m)


def _unit_cols(t: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor with unit stride along its columns (any row stride): the kernels' layout."""
    return t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


def _grid(n_rows: int, n_cols: int, dtype: torch.dtype) -> tuple[tuple[int, int], int, int, int]:
    block_r, block_f, warps = _bias_act_config(n_cols, dtype, triton_interpreted())
    return (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_f)), block_r, block_f, warps


def gated_act_forward(args: GatedActArgs) -> GatedActOutput:
    """``act(x[:, :F]) * x[:, F:]`` for ``x [N, 2F]``: a contiguous ``[N, F]`` tensor of x's dtype."""
    x, activation = _unit_cols(args.x), args.activation
    n_rows, n_cols = x.shape[0], x.shape[1] // 2
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return GatedActOutput(y)
    grid, block_r, block_f, warps = _grid(n_rows, n_cols, x.dtype)
    _gated_act_fwd_kernel[grid](
        x,
        y,
        n_rows,
        x.stride(0),
        N_COLS=n_cols,
        ACT=ACTIVATIONS[activation],
        BLOCK_R=block_r,
        BLOCK_F=block_f,
        num_warps=warps,
    )
    return GatedActOutput(y)


def gated_act_backward(args: GatedActArgs, inputs: GatedActBackwardInputs) -> GatedActGrads:
    """The gradient of :func:`gated_act_forward` for ``grad [N, F]``: ``dx``, a contiguous
    ``[N, 2F]`` tensor of x's dtype."""
    grad, x, activation = _unit_cols(inputs.grad_out), _unit_cols(args.x), args.activation
    n_rows, n_cols = x.shape[0], x.shape[1] // 2
    dx = torch.empty((n_rows, 2 * n_cols), dtype=x.dtype, device=x.device)
    if dx.numel() == 0:
        return GatedActGrads(dx)
    grid, block_r, block_f, warps = _grid(n_rows, n_cols, x.dtype)
    _gated_act_bwd_kernel[grid](
        grad,
        x,
        dx,
        n_rows,
        grad.stride(0),
        x.stride(0),
        N_COLS=n_cols,
        ACT=ACTIVATIONS[activation],
        BLOCK_R=block_r,
        BLOCK_F=block_f,
        num_warps=warps,
    )
    return GatedActGrads(dx)
