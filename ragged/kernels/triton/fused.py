"""Launchers of the Triton kernels of the per-token ops (:mod:`.fused_kernels`): the
``"triton"`` implementations of ``bias_act`` and ``add_layer_norm`` (declared in
:mod:`ragged.kernels.triton`), and the entry points the fused encoder layer calls directly.

* :func:`bias_act_forward` / :func:`bias_act_backward`: ``act(x + bias)`` over ``x [N, F]``
  and its gradients (the backward also takes the gradient back through a dropout);
* :func:`add_layer_norm_forward` / :func:`add_layer_norm_backward`: ``LayerNorm(x + residual)``
  and its gradients; :func:`add_layer_norm_dropout_backward` fuses the backward of a dropout
  that fed ``x`` and the column sum of its gradient (a Linear's bias gradient);
* :func:`partial_groups`, :func:`layer_norm_backward_fuses`: what a caller that shares one
  partial-sum buffer between several backward launches needs to know.

Each takes the op's records (:mod:`ragged.records.fused`): a forward its operand record, a
backward the operand record and the backward's inputs; what only the fused backwards take
(a dropout mask, a shared partial-sum buffer) comes as keywords.

Layout: the kernels read 2-D inputs with unit stride along the features and any row stride,
1-D inputs with unit stride; the launchers copy any other layout first (a strided or
expanded parameter included), so a direct call takes any layout. Every output is
contiguous. Parameter gradients are reduced in fp32 from per-group partial sums (``[groups,
F]`` fp32, one row per program group, about two groups per multiprocessor), deterministic.

Layer norm rows up to ``_LN_MAX_BLOCK`` features (``_LN_BWD_MAX_BLOCK`` in the backward) sit
in registers; longer rows are streamed in chunks of ``_LN_CHUNK``.
"""

from __future__ import annotations

import functools
from typing import overload

import torch
import triton
import triton.language as tl

from ...backends import triton_interpreted
from ...records.fused import (
    AddLayerNormArgs,
    AddLayerNormBackwardInputs,
    AddLayerNormDropoutGrads,
    AddLayerNormGrads,
    AddLayerNormOutput,
    BiasActArgs,
    BiasActBackwardInputs,
    BiasActGrads,
    BiasActOutput,
)
from .fused_kernels import (
    _bias_act_bwd_kernel,
    _bias_act_fwd_kernel,
    _ln_bwd_dwdb_kernel,
    _ln_bwd_kernel,
    _ln_fwd_kernel,
)

__all__ = [
    "ACTIVATIONS",
    "add_layer_norm_backward",
    "add_layer_norm_dropout_backward",
    "add_layer_norm_forward",
    "bias_act_backward",
    "bias_act_forward",
    "layer_norm_backward_fuses",
    "partial_groups",
]

# activation name -> the ACT code of the kernels
ACTIVATIONS = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}

# --------------------------------------------------------------------------------------
# Launch configurations (tunable; one place each)

# Widest layer norm row kept in registers, in elements. Past it rows are streamed in
# chunks of _LN_CHUNK. The backward holds about twice the live values of the forward.
_LN_MAX_BLOCK = 16384
_LN_BWD_MAX_BLOCK = 8192
_LN_CHUNK = 4096
# Interpreted (CPU tests): small blocks, so that the tests cover several row blocks,
# several column blocks and the chunked layer norm at small sizes.
_INTERP_MAX_BLOCK = 256
_INTERP_TILE = 512


def _warps(elements: int) -> int:
    """One warp per 1024 elements of a program's tile (rounded up to a power of two), 4 to 16."""
    return max(4, min(16, triton.next_power_of_2(elements) // 1024))


def _col_block(n_cols: int, cap: int) -> int:
    """Column block of the elementwise kernels: the whole row up to 128 elements, else the
    widest power of two <= cap whose blocks cover the row with at most a quarter of the
    lanes masked off (768 -> 256: three full blocks rather than 1024 with a quarter idle)."""
    block = min(triton.next_power_of_2(max(n_cols, 1)), cap)
    while block > 128 and 4 * (-(-n_cols // block) * block - n_cols) > n_cols:
        block //= 2
    return block


@functools.cache
def _bias_act_config(n_cols: int, dtype: torch.dtype, interpreted: bool) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_F, num_warps) of the elementwise bias + activation kernels:
    tiles of about 4096 elements (8 KiB of bf16), rows of up to 1024 in one block."""
    if interpreted:
        block_f = _col_block(n_cols, _INTERP_MAX_BLOCK // 2)
        return max(1, _INTERP_TILE // block_f), block_f, 4
    block_f = _col_block(n_cols, 1024)
    return max(1, 4096 // block_f), block_f, 4


@functools.cache
def _layer_norm_config(n_cols: int, dtype: torch.dtype, interpreted: bool) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_F, N_CHUNKS, num_warps) of the layer norm forward: a whole row per
    block when it fits (several rows per program for small F, about 4096 elements per
    program), else one row per program streamed in chunks."""
    cap, chunk, tile = (
        (_INTERP_MAX_BLOCK, _INTERP_MAX_BLOCK, _INTERP_TILE) if interpreted else (_LN_MAX_BLOCK, _LN_CHUNK, 4096)
    )
    block_f = triton.next_power_of_2(max(n_cols, 1))
    if block_f <= cap:
        block_r = max(1, tile // block_f)
        return block_r, block_f, 1, 4 if interpreted else _warps(block_r * block_f)
    block_r = 2 if interpreted else 1
    return block_r, chunk, -(-n_cols // chunk), 4 if interpreted else _warps(chunk)


@functools.cache
def _layer_norm_backward_config(n_cols: int, dtype: torch.dtype, interpreted: bool) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_F, N_CHUNKS, num_warps) of the layer norm backward (row kernel):
    about 2048 elements per step (it keeps more values live than the forward)."""
    cap, chunk, tile = (
        (_INTERP_MAX_BLOCK, _INTERP_MAX_BLOCK, _INTERP_TILE) if interpreted else (_LN_BWD_MAX_BLOCK, _LN_CHUNK, 2048)
    )
    block_f = triton.next_power_of_2(max(n_cols, 1))
    if block_f <= cap:
        block_r = max(1, tile // block_f)
        return block_r, block_f, 1, 4 if interpreted else _warps(block_r * block_f * 2)
    block_r = 2 if interpreted else 1
    return block_r, chunk, -(-n_cols // chunk), 4 if interpreted else _warps(chunk * 2)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _row_groups(
    n_rows: int, block_r: int, n_col_blocks: int, device: torch.device, interpreted: bool, groups: int | None = None
) -> tuple[int, int]:
    """(groups, rows per group) of a backward with per-group partial sums: about two
    programs per SM in all (the partial buffer then stays small: [groups, F] fp32), each
    group a whole number of row blocks. ``groups`` given: exactly that many (the last ones
    may have no rows; their partial sums are zeros)."""
    blocks = -(-n_rows // block_r)
    if groups is not None:
        return groups, max(1, -(-blocks // groups)) * block_r
    target = 4 if interpreted or device.type != "cuda" else max(1, 2 * _multiprocessors(device) // max(n_col_blocks, 1))
    per_group = -(-blocks // target) * block_r
    return -(-n_rows // per_group), per_group


def partial_groups(device: torch.device) -> int:
    """Rows of a partial-sum buffer shared by several backward launches (``part=`` of
    :func:`bias_act_backward` and :func:`add_layer_norm_dropout_backward`): two per SM."""
    return 4 if triton_interpreted() or device.type != "cuda" else 2 * _multiprocessors(device)


def layer_norm_backward_fuses(n_cols: int, dtype: torch.dtype) -> bool:
    """Whether :func:`add_layer_norm_dropout_backward` takes rows this wide in one pass
    (then it can write its partial sums into a shared buffer)."""
    return _layer_norm_backward_config(n_cols, dtype, triton_interpreted())[2] == 1


def _check_part(fn: str, part: torch.Tensor, col: int, width: int, device: torch.device) -> None:
    if (
        part.dtype != torch.float32
        or part.dim() != 2
        or part.device != device
        or not part.is_contiguous()
        or col < 0
        or part.shape[1] < col + width
        or part.shape[0] < 1
    ):
        raise ValueError(
            f"{fn}(): expected part to be a contiguous float32 [groups, >= {col + width}] tensor on "
            f"{device} (part_col={col}, {width} columns written), got {part.dtype} "
            f"{tuple(part.shape)} (contiguous: {part.is_contiguous()}) on {part.device}"
        )


# --------------------------------------------------------------------------------------
# Launchers. The kernels index 2-D inputs as ``ptr + row * stride(0) + col`` and 1-D ones
# (parameters, statistics) as ``ptr + i``. ragged.ops.fused hands them over in that layout;
# these two guards make a launcher called directly take any layout too (a copy only when the
# layout is not one the kernels can read), so that no other stride is ever read as 1.


@overload
def _unit_cols(t: torch.Tensor) -> torch.Tensor: ...
@overload
def _unit_cols(t: None) -> None: ...
@overload
def _unit_cols(t: torch.Tensor | None) -> torch.Tensor | None: ...
def _unit_cols(t):
    """A 2-D tensor with unit stride along its columns (any row stride)."""
    return t if t is None or t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


@overload
def _unit_vec(t: torch.Tensor) -> torch.Tensor: ...
@overload
def _unit_vec(t: None) -> None: ...
@overload
def _unit_vec(t: torch.Tensor | None) -> torch.Tensor | None: ...
def _unit_vec(t):
    """A 1-D tensor with unit stride (a strided or expanded view becomes a copy)."""
    return t if t is None or t.shape[0] <= 1 or t.stride(0) == 1 else t.contiguous()


def _sum_dtype(a: torch.Tensor, b: torch.Tensor | None) -> torch.dtype:
    return a.dtype if b is None else torch.promote_types(a.dtype, b.dtype)


def _reduce(part: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if part is None else part.sum(0).to(dtype)


def bias_act_forward(args: BiasActArgs) -> BiasActOutput:
    """``act(x + bias)``: ``[N, F]`` contiguous, x's dtype."""
    n_rows, n_cols = args.x.shape
    x, bias = _unit_cols(args.x), _unit_vec(args.bias)
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return BiasActOutput(y)
    block_r, block_f, warps = _bias_act_config(n_cols, x.dtype, triton_interpreted())
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_f))
    _bias_act_fwd_kernel[grid](
        x,
        bias if bias is not None else x,
        y,
        n_rows,
        x.stride(0),
        N_COLS=n_cols,
        ACT=ACTIVATIONS[args.activation],
        HAS_BIAS=bias is not None,
        BLOCK_R=block_r,
        BLOCK_F=block_f,
        num_warps=warps,
    )
    return BiasActOutput(y)


def bias_act_backward(
    args: BiasActArgs,
    inputs: BiasActBackwardInputs,
    *,
    mask: torch.Tensor | None = None,
    p: float = 0.0,
    part: torch.Tensor | None = None,
    part_col: int = 0,
) -> BiasActGrads:
    """The gradients of ``x`` (x's dtype) and ``bias`` (bias's dtype; None unless wanted).
    ``mask`` (bool, ``x``'s shape, unit feature stride): ``grad_out`` is that of
    ``dropout(act(x + bias))`` with this keep mask and rate ``p``; it is taken back through the
    dropout in the same pass.

    ``part`` (float32 ``[groups, W]``, contiguous, a buffer shared with other backward
    launches): the per-group partial sums of the bias's gradient are written to its columns
    ``[part_col, part_col + F)`` instead, one row per group (see :func:`partial_groups`), and
    that gradient is returned as None: the caller sums the rows."""
    n_rows, n_cols = args.x.shape
    grad, x, mask, bias = _unit_cols(inputs.grad_out), _unit_cols(args.x), _unit_cols(mask), _unit_vec(args.bias)
    need_bias = inputs.need_bias and bias is not None
    if part is not None:
        _check_part("ragged.kernels.triton.fused.bias_act_backward", part, part_col, n_cols, x.device)
        need_bias = True
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if dx.numel() == 0:
        if part is not None:
            part[:, part_col : part_col + n_cols].zero_()
            return BiasActGrads(dx, None)
        return BiasActGrads(dx, torch.zeros_like(bias) if need_bias and bias is not None else None)
    interpreted = triton_interpreted()
    block_r, block_f, warps = _bias_act_config(n_cols, x.dtype, interpreted)
    n_col_blocks = triton.cdiv(n_cols, block_f)
    groups, per_group = _row_groups(
        n_rows, block_r, n_col_blocks, x.device, interpreted, part.shape[0] if part is not None else None
    )
    own = part is None and need_bias
    if own:
        part = torch.empty((groups, n_cols), dtype=torch.float32, device=x.device)
    _bias_act_bwd_kernel[(groups, n_col_blocks)](
        grad,
        x,
        bias if bias is not None else x,
        dx,
        part if part is not None else dx,
        mask if mask is not None else x,
        n_rows,
        per_group,
        grad.stride(0),
        x.stride(0),
        mask.stride(0) if mask is not None else 0,
        part.stride(0) if part is not None else 0,
        part_col,
        _drop_scale(p),
        N_COLS=n_cols,
        ACT=ACTIVATIONS[args.activation],
        HAS_BIAS=bias is not None,
        NEED_DBIAS=need_bias,
        HAS_MASK=mask is not None,
        BLOCK_R=block_r,
        BLOCK_F=block_f,
        MASK_VEC=16 // dx.element_size(),
        num_warps=warps,
    )
    return BiasActGrads(dx, _reduce(part, bias.dtype if bias is not None else torch.float32) if own else None)


def _drop_scale(p: float) -> float:
    return 1.0 / (1.0 - p) if p > 0.0 else 1.0


def add_layer_norm_forward(args: AddLayerNormArgs) -> AddLayerNormOutput:
    """``y`` and ``s`` in the dtype of ``x + residual`` (``s`` is an empty tensor unless
    ``return_sum``), ``mean`` / ``rstd`` ``[N]`` fp32."""
    n_rows, n_cols = args.x.shape
    x, residual = _unit_cols(args.x), _unit_cols(args.residual)
    weight, bias, return_sum = _unit_vec(args.weight), _unit_vec(args.bias), args.return_sum
    dtype = _sum_dtype(x, residual)
    y = torch.empty((n_rows, n_cols), dtype=dtype, device=x.device)
    s = torch.empty((n_rows, n_cols) if return_sum else (0,), dtype=dtype, device=x.device)
    mean = torch.empty((n_rows,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((n_rows,), dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return AddLayerNormOutput(y, s, mean, rstd)
    block_r, block_f, n_chunks, warps = _layer_norm_config(n_cols, dtype, triton_interpreted())
    r = residual if residual is not None else x
    _ln_fwd_kernel[(triton.cdiv(n_rows, block_r),)](
        x,
        r,
        weight if weight is not None else x,
        bias if bias is not None else x,
        y,
        s if return_sum else y,
        mean,
        rstd,
        n_rows,
        x.stride(0),
        r.stride(0),
        float(args.eps),
        N_COLS=n_cols,
        HAS_RES=residual is not None,
        HAS_W=weight is not None,
        HAS_B=bias is not None,
        STORE_SUM=return_sum,
        SUM_DTYPE=_TL_DTYPES[dtype],
        BLOCK_R=block_r,
        BLOCK_F=block_f,
        N_CHUNKS=n_chunks,
        num_warps=warps,
    )
    return AddLayerNormOutput(y, s, mean, rstd)


def add_layer_norm_backward(args: AddLayerNormArgs, inputs: AddLayerNormBackwardInputs) -> AddLayerNormGrads:
    """The gradients. The normalised sum is ``s = x + residual`` (residual optional, rounded as
    in the forward); its gradient (in s's dtype) is that of both summands, returned as ``x``;
    ``weight`` / ``bias`` in the parameters' dtypes, None unless asked for."""
    grads = _layer_norm_backward(args, inputs, mask=None, p=0.0, colsum_dtype=None, shared=False)
    return AddLayerNormGrads(grads.x, None, grads.weight, grads.bias)


def add_layer_norm_dropout_backward(
    args: AddLayerNormArgs,
    inputs: AddLayerNormBackwardInputs,
    *,
    mask: torch.Tensor | None,
    p: float,
    colsum_dtype: torch.dtype | None,
    part: torch.Tensor | None = None,
    part_col: int = 0,
) -> AddLayerNormDropoutGrads:
    """The backward of ``add_layer_norm(dropout(z) + residual, ...)`` where ``x = dropout(z)``
    was drawn with the bool keep ``mask`` (x's shape, unit feature stride; None: no dropout)
    at rate ``p``. ``z``'s gradient, ``ds_total * keep / (1 - p)`` (``ds_total`` itself without
    a mask), comes in one pass with the layer norm's backward, as does ``z_sum`` (it summed
    over the rows in fp32, in ``colsum_dtype``; None when that is None): the gradient of the
    bias of the Linear that produced ``z``. The parameter gradients may be views of one buffer
    (one reduction launch for all of them).

    ``part`` (float32 ``[groups, W]``, contiguous; rows that fit one pass,
    :func:`layer_norm_backward_fuses`): the per-group partial sums of the k wanted ones of
    ``weight``, ``bias``, ``z_sum`` (in that order, F columns each, from column ``part_col``
    on) go there instead, one row per group, and those three come back as None: the caller
    sums the rows."""
    return _layer_norm_backward(
        args, inputs, mask=mask, p=p, colsum_dtype=colsum_dtype, shared=True, part=part, part_col=part_col
    )


def _layer_norm_backward(
    args: AddLayerNormArgs,
    inputs: AddLayerNormBackwardInputs,
    *,
    mask: torch.Tensor | None,
    p: float,
    colsum_dtype: torch.dtype | None,
    shared: bool,
    part: torch.Tensor | None = None,
    part_col: int = 0,
) -> AddLayerNormDropoutGrads:
    """Both backward launchers; ``shared``: the partial sums in one buffer, reduced by one sum
    (the results are then views of one tensor, which torch.library ops may not return)."""
    n_rows, n_cols = args.x.shape
    dy, ds = _unit_cols(inputs.grad_out), _unit_cols(inputs.grad_sum)
    a, b, mask = _unit_cols(args.x), _unit_cols(args.residual), _unit_cols(mask)
    weight, bias = _unit_vec(args.weight), args.bias
    mean, rstd = _unit_vec(inputs.mean), _unit_vec(inputs.rstd)
    dtype = _sum_dtype(a, b)
    need_weight = inputs.need_weight and weight is not None
    need_bias = inputs.need_bias and bias is not None
    need_colsum = colsum_dtype is not None
    dsum = torch.empty((n_rows, n_cols), dtype=dtype, device=a.device)
    slots = (need_weight, need_bias, need_colsum)
    if part is not None:
        fn = "ragged.kernels.triton.fused.add_layer_norm_dropout_backward"
        _check_part(fn, part, part_col, sum(slots) * n_cols, a.device)
        if not layer_norm_backward_fuses(n_cols, dtype):
            raise ValueError(f"{fn}(): part= takes rows of at most {_LN_BWD_MAX_BLOCK} elements, got {n_cols}")
        if n_rows == 0:
            part[:, part_col : part_col + sum(slots) * n_cols].zero_()
            return AddLayerNormDropoutGrads(dsum, dsum if mask is None else torch.empty_like(dsum), None, None, None)
    if n_rows == 0:
        return AddLayerNormDropoutGrads(
            dsum,
            dsum if mask is None else torch.empty_like(dsum),
            torch.zeros_like(weight) if need_weight and weight is not None else None,
            torch.zeros_like(bias) if need_bias and bias is not None else None,
            torch.zeros((n_cols,), dtype=colsum_dtype, device=a.device) if need_colsum else None,
        )
    interpreted = triton_interpreted()
    block_r, block_f, n_chunks, warps = _layer_norm_backward_config(n_cols, dtype, interpreted)
    if n_chunks > 1 and (mask is not None or need_colsum):  # long rows: the dropout and the sum on their own
        plain = add_layer_norm_backward(args, inputs)
        dsum = plain.x
        dz = dsum if mask is None else torch.ops.aten.native_dropout_backward(dsum, mask, _drop_scale(p))
        dz_sum = dz.sum(0, dtype=torch.float32).to(colsum_dtype) if need_colsum else None
        return AddLayerNormDropoutGrads(dsum, dz, plain.weight, plain.bias, dz_sum)
    fused = n_chunks == 1
    groups, per_group = _row_groups(
        n_rows, block_r, 1, a.device, interpreted, part.shape[0] if part is not None else None
    )
    src_b = b if b is not None else a
    drop = torch.empty((n_rows, n_cols), dtype=dtype, device=a.device) if mask is not None else dsum
    # the partial column sums: fp32 [groups, k * F], F columns per wanted sum, in one buffer
    slots = (fused and need_weight, fused and need_bias, need_colsum)
    k = sum(slots)
    own = part is None and k > 0
    if own:
        part, part_col = torch.empty((groups, k * n_cols), dtype=torch.float32, device=a.device), 0
    _ln_bwd_kernel[(groups,)](
        dy,
        ds if ds is not None else dy,
        a,
        src_b,
        weight if weight is not None else a,
        mean,
        rstd,
        dsum,
        part if part is not None else dsum,
        mask if mask is not None else a,
        drop,
        n_rows,
        per_group,
        dy.stride(0),
        ds.stride(0) if ds is not None else 0,
        a.stride(0),
        src_b.stride(0),
        mask.stride(0) if mask is not None else 0,
        part.stride(0) if part is not None else 0,
        part_col,
        _drop_scale(p),
        N_COLS=n_cols,
        HAS_DS=ds is not None,
        HAS_BSRC=b is not None,
        HAS_W=weight is not None,
        NEED_DW=slots[0],
        NEED_DB=slots[1],
        HAS_MASK=mask is not None,
        NEED_DC=need_colsum,
        SUM_DTYPE=_TL_DTYPES[dtype],
        BLOCK_R=block_r,
        BLOCK_F=block_f,
        N_CHUNKS=n_chunks,
        MASK_VEC=16 // dsum.element_size(),
        num_warps=warps,
    )
    if not fused and (need_weight or need_bias):
        block_r2, block_f2, warps2 = _bias_act_config(n_cols, dtype, interpreted)
        n_col_blocks = triton.cdiv(n_cols, block_f2)
        groups2, per_group2 = _row_groups(n_rows, block_r2, n_col_blocks, a.device, interpreted)
        dw_part = torch.empty((groups2, n_cols), dtype=torch.float32, device=a.device) if need_weight else None
        db_part = torch.empty((groups2, n_cols), dtype=torch.float32, device=a.device) if need_bias else None
        _ln_bwd_dwdb_kernel[(groups2, n_col_blocks)](
            dy,
            a,
            src_b,
            mean,
            rstd,
            dw_part if dw_part is not None else dsum,
            db_part if db_part is not None else dsum,
            n_rows,
            per_group2,
            dy.stride(0),
            a.stride(0),
            src_b.stride(0),
            N_COLS=n_cols,
            HAS_BSRC=b is not None,
            NEED_DW=need_weight,
            NEED_DB=need_bias,
            SUM_DTYPE=_TL_DTYPES[dtype],
            BLOCK_R=block_r2,
            BLOCK_F=block_f2,
            num_warps=warps2,
        )
        return AddLayerNormDropoutGrads(
            dsum,
            drop,
            _reduce(dw_part, weight.dtype if weight is not None else torch.float32),
            _reduce(db_part, bias.dtype if bias is not None else torch.float32),
            None,
        )
    if not own:
        return AddLayerNormDropoutGrads(dsum, drop, None, None, None)
    assert part is not None  # made above when not the caller's
    dtypes = (weight.dtype if weight is not None else None, bias.dtype if bias is not None else None, colsum_dtype)
    wanted = [dt for dt, want in zip(dtypes, slots) if want]
    if shared and k > 1 and len(set(wanted)) == 1:  # one reduction; the results are views of one tensor
        rows = iter(part.sum(0).to(wanted[0]).split(n_cols))
    else:
        rows = iter(part[:, i * n_cols : (i + 1) * n_cols].sum(0).to(dt) for i, dt in enumerate(wanted))
    dweight, dbias, dcolsum = (next(rows) if want else None for want in slots)
    return AddLayerNormDropoutGrads(dsum, drop, dweight, dbias, dcolsum)
