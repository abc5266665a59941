"""Triton kernels of ``add_rms_norm`` (:mod:`ragged.ops.rms_norm`) and their launchers, the
``"triton"`` implementation declared in :mod:`ragged.kernels.triton`.

* forward: one program per row, the whole row in registers (``BLOCK_F``, the power of two at or
  above ``F``): ``s = x + residual`` rounded to x's dtype (written when there is a residual),
  ``rstd``, ``out``;
* backward: ``G`` programs, each taking rows ``pid, pid + G, ...``: each row's ``d s`` (written
  once, the gradient of both summands) and the weight gradient's partial sum over its rows in
  float32 registers, one ``[G, F]`` row per program, summed over ``G`` after.

float32 arithmetic; row offsets int64; the grid comes from ``N`` alone; no host sync.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...backends import triton_interpreted
from ...records.rms_norm import AddRmsNormArgs, AddRmsNormBackwardInputs, AddRmsNormGrads, AddRmsNormOutput
from .launch import cached_launch

__all__ = ["MAX_FEATURES", "add_rms_norm_backward", "add_rms_norm_forward"]

MAX_FEATURES = 16384  # one row in the registers of one program


@cached_launch
@triton.jit(do_not_specialize=["n_rows"])
def _fwd_kernel(
    X, R, W, Y, S, RSTD, n_rows, stride_x, stride_r, eps,
    N_COLS: tl.constexpr, HAS_R: tl.constexpr, HAS_W: tl.constexpr, UNIT_OFFSET: tl.constexpr,
    BLOCK_F: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_F)
    keep = cols < N_COLS
    s = tl.load(X + row * stride_x + cols, mask=keep, other=0.0)
    if HAS_R:  # added in float32 and rounded to x's dtype: torch's sum of two such tensors
        s = s.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=keep, other=0.0).to(tl.float32)
        s = s.to(Y.dtype.element_ty)
        tl.store(S + row * N_COLS + cols, s, mask=keep)
    sf = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / N_COLS + eps)
    tl.store(RSTD + row, rstd)
    n = sf * rstd
    if HAS_W:
        w = tl.load(W + cols, mask=keep, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            y = n * (1.0 + w)
        else:
            y = n.to(Y.dtype.element_ty).to(tl.float32) * w
    else:
        y = n
    tl.store(Y + row * N_COLS + cols, y.to(Y.dtype.element_ty), mask=keep)


@cached_launch
@triton.jit(do_not_specialize=["n_rows"])
def _bwd_kernel(
    DY, DS_IN, S, W, RSTD, DX, DW, n_rows, stride_dy, stride_ds, stride_s,
    N_COLS: tl.constexpr, HAS_DS: tl.constexpr, HAS_W: tl.constexpr, NEED_W: tl.constexpr,
    UNIT_OFFSET: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_F)
    keep = cols < N_COLS
    if HAS_W:
        w = tl.load(W + cols, mask=keep, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            w = w + 1.0
    dw = tl.zeros((BLOCK_F,), dtype=tl.float32)
    for r in range(pid, n_rows, step):
        row = tl.cast(r, tl.int64)
        s_raw = tl.load(S + row * stride_s + cols, mask=keep, other=0.0)
        sf = s_raw.to(tl.float32)
        rstd = tl.load(RSTD + row)
        n = sf * rstd
        dy = tl.load(DY + row * stride_dy + cols, mask=keep, other=0.0).to(tl.float32)
        if HAS_W:
            dn = dy * w
            if NEED_W:
                if UNIT_OFFSET:
                    dw += dy * n
                else:
                    dw += dy * n.to(s_raw.dtype).to(tl.float32)
        else:
            dn = dy
        ds = rstd * (dn - n * (tl.sum(dn * n, axis=0) / N_COLS))
        if HAS_DS:
            ds += tl.load(DS_IN + row * stride_ds + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(DX + row * N_COLS + cols, ds.to(DX.dtype.element_ty), mask=keep)
    if NEED_W:
        tl.store(DW + pid * N_COLS + cols, dw, mask=keep)


def _warps(block: int) -> int:
    return 1 if triton_interpreted() else max(1, min(16, block // 512))


@functools.cache
def _programs(device: torch.device) -> int:
    if triton_interpreted() or device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def add_rms_norm_forward(args: AddRmsNormArgs) -> AddRmsNormOutput:
    x, r, w = args.x, args.residual, args.weight
    n_rows, n_cols = x.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if r is not None else x.new_empty((0,))
    rstd = torch.empty((n_rows,), dtype=torch.float32, device=x.device)
    if n_rows == 0 or n_cols == 0:
        if n_rows:
            rstd.fill_(float(args.eps) ** -0.5 if args.eps > 0 else float("inf"))
        return AddRmsNormOutput(y, s, rstd)
    block = triton.next_power_of_2(n_cols)
    _fwd_kernel[(n_rows,)](
        x, x if r is None else r, x if w is None else w, y, y if r is None else s, rstd, n_rows,
        x.stride(0), x.stride(0) if r is None else r.stride(0), float(args.eps),
        N_COLS=n_cols, HAS_R=r is not None, HAS_W=w is not None, UNIT_OFFSET=args.unit_offset,
        BLOCK_F=block, num_warps=_warps(block),
    )  # fmt: skip
    return AddRmsNormOutput(y, s, rstd)


def add_rms_norm_backward(args: AddRmsNormArgs, inputs: AddRmsNormBackwardInputs) -> AddRmsNormGrads:
    s = inputs.sum if args.residual is not None else args.x
    w = args.weight
    n_rows, n_cols = s.shape
    dx = torch.empty((n_rows, n_cols), dtype=s.dtype, device=s.device)
    need_w = w is not None and inputs.need_weight
    if n_rows == 0 or n_cols == 0:
        dw = torch.zeros_like(w) if need_w else None  # type: ignore[arg-type]
        return AddRmsNormGrads(dx, None, dw)
    g = min(n_rows, _programs(s.device))
    partial = torch.empty((g, n_cols), dtype=torch.float32, device=s.device) if need_w else dx
    dy, ds_in = inputs.grad_out, inputs.grad_sum
    block = triton.next_power_of_2(n_cols)
    _bwd_kernel[(g,)](
        dy, dy if ds_in is None else ds_in, s, s if w is None else w, inputs.rstd, dx, partial, n_rows,
        dy.stride(0), dy.stride(0) if ds_in is None else ds_in.stride(0), s.stride(0),
        N_COLS=n_cols, HAS_DS=ds_in is not None, HAS_W=w is not None, NEED_W=need_w,
        UNIT_OFFSET=args.unit_offset, BLOCK_F=block, num_warps=_warps(block),
    )  # fmt: skip
    dw = partial.sum(dim=0).to(w.dtype) if need_w else None  # type: ignore[union-attr]
    return AddRmsNormGrads(dx, None, dw)
