"""Residual add + RMSNorm, as a decoder layer runs them: ``s = x + residual``, ``out = RMSNorm(s)``.

A Llama-family decoder layer adds each block's output to the residual stream and normalises
the sum before the next block: ``residual = x + residual; x = norm(residual)``.
:func:`add_rms_norm` does both in one pass over each token's row, and its backward in one
more, with HuggingFace's numerics:

* the sum is taken in x's dtype (HF adds two bf16 tensors), and is returned when asked
  (``return_sum``: the next residual);
* ``rstd = 1 / sqrt(mean(s^2) + eps)`` and ``n = s * rstd`` in float32 (float64 for float64);
* Llama, Qwen, Mistral (``unit_offset=False``): ``out = n.to(dtype) * weight`` (the normalised
  row rounded to x's dtype, then times the weight, as ``LlamaRMSNorm``);
  Gemma (``unit_offset=True``): ``out = (n * (1 + weight)).to(dtype)``, in float32.

Gradients (float32), with ``dy`` the output's gradient and ``w`` the effective weight
(``weight``, or ``1 + weight``): ``dn = dy * w``, ``ds = rstd * (dn - n * mean(dn * n)) +
d sum``, which ``x`` and ``residual`` both get; ``d weight = sum over rows (dy * n)`` (with
Llama's ``n`` rounded to x's dtype, as autograd sees it there).

The op ``ragged::add_rms_norm`` (:data:`ADD_RMS_NORM`; operands
:class:`~ragged.records.rms_norm.AddRmsNormArgs`) has two implementations: ``"torch"`` (the
formulas above in torch ops; any floating dtype; the CPU path) and ``"triton"``
(:mod:`ragged.kernels.triton.rms_norm`; float16, bfloat16, float32; what ``"auto"`` takes on
CUDA). A per-token op: the grid comes from the row count alone, no host sync.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .. import backends, opdef
from ..records.rms_norm import AddRmsNormArgs, AddRmsNormBackwardInputs, AddRmsNormGrads, AddRmsNormOutput
from ..utils import check_tensor, describe, first_order_only, no_autocast

__all__ = ["ADD_RMS_NORM", "AddRmsNormSpec", "add_rms_norm", "add_rms_norm_spec", "reference_add_rms_norm"]

_FN = "ragged.add_rms_norm"


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------
# Reference (torch ops: the "torch" implementation)


@no_autocast
def reference_add_rms_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, eps: float = 1e-6, unit_offset: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, sum, rstd)`` of the module docstring's formulas, in torch ops (differentiable
    through autograd in ``out`` and ``sum``)."""
    s = x if residual is None else x + residual
    dtype = _compute_dtype(s.dtype)
    sf = s.to(dtype)
    rstd = torch.rsqrt(sf.square().mean(dim=-1) + eps)
    n = sf * rstd[:, None]
    if weight is None:
        out = n.to(s.dtype)
    elif unit_offset:
        out = (n * (1.0 + weight.to(dtype))).to(s.dtype)
    else:
        out = n.to(s.dtype) * weight
    return out, s, rstd


def _torch_forward(args: AddRmsNormArgs) -> AddRmsNormOutput:
    with torch.no_grad():
        out, s, rstd = reference_add_rms_norm(args.x, args.residual, args.weight, args.eps, args.unit_offset)
    return AddRmsNormOutput(out, s if args.residual is not None else s.new_empty((0,)), rstd)


def _torch_backward(args: AddRmsNormArgs, inputs: AddRmsNormBackwardInputs) -> AddRmsNormGrads:
    s = inputs.sum if args.residual is not None else args.x
    dtype = _compute_dtype(s.dtype)
    sf, rstd = s.to(dtype), inputs.rstd
    n = sf * rstd[:, None]
    dy = inputs.grad_out.to(dtype)
    w = args.weight
    if w is None:
        dn, dw = dy, None
    elif args.unit_offset:
        dn = dy * (1.0 + w.to(dtype))
        dw = (dy * n).sum(dim=0) if inputs.need_weight else None
    else:
        dn = dy * w.to(dtype)
        dw = (dy * n.to(s.dtype).to(dtype)).sum(dim=0) if inputs.need_weight else None
    ds = rstd[:, None] * (dn - n * (dn * n).mean(dim=-1, keepdim=True))
    if inputs.grad_sum is not None:
        ds = ds + inputs.grad_sum.to(dtype)
    dx = ds.to(s.dtype)
    return AddRmsNormGrads(dx, None, None if dw is None else dw.to(w.dtype))  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------
# Spec and op


@dataclasses.dataclass(frozen=True)
class AddRmsNormSpec:
    """``add_rms_norm(x [N, F], ...)`` as the implementations see it."""

    device: torch.device
    dtype: torch.dtype
    features: int
    residual: bool
    weight: bool


def add_rms_norm_spec(x: Tensor, residual: Tensor | None = None, weight: Tensor | None = None) -> AddRmsNormSpec:
    """The spec of the operands (the arguments of ``ragged.explain("add_rms_norm", ...)``)."""
    return AddRmsNormSpec(x.device, x.dtype, x.shape[-1], residual is not None, weight is not None)


def _fake(args: AddRmsNormArgs) -> AddRmsNormOutput:
    x = args.x
    s = x.new_empty(x.shape) if args.residual is not None else x.new_empty((0,))
    return AddRmsNormOutput(x.new_empty(x.shape), s, x.new_empty((x.shape[0],), dtype=_compute_dtype(x.dtype)))


def _backward_fake(args: AddRmsNormArgs, inputs: AddRmsNormBackwardInputs) -> AddRmsNormGrads:
    x, w = args.x, args.weight
    return AddRmsNormGrads(
        x.new_empty(x.shape), None, None if w is None or not inputs.need_weight else w.new_empty(w.shape)
    )


def _setup(ctx, args: AddRmsNormArgs, output: AddRmsNormOutput) -> None:
    ctx.save_for_backward(args.x if args.residual is None else output.sum, args.weight, output.rstd)
    ctx.residual = args.residual is not None
    ctx.sizes = (args.eps, args.unit_offset)


def _backward(ctx, grad_out: Tensor, grad_sum: Tensor | None, *_) -> AddRmsNormGrads:
    s, weight, rstd = ctx.saved_tensors
    eps, unit_offset = ctx.sizes
    residual = s if ctx.residual else None  # stands for it: the backward reads only the sum
    args = AddRmsNormArgs(s, residual, weight, eps, unit_offset)
    if grad_out is None:
        grad_out = torch.zeros_like(s)
    inputs = AddRmsNormBackwardInputs(
        _unit_cols(grad_out),
        None if grad_sum is None or not ctx.residual else _unit_cols(grad_sum),
        s,
        rstd,
        weight is not None and bool(ctx.needs_grad.weight),
    )
    with torch.no_grad():
        grads = ADD_RMS_NORM.call_backward(args, inputs, ctx.impl)
    if ctx.residual:  # both summands get the sum's gradient (computed once, as x's)
        grads = grads._replace(residual=grads.x)
    return AddRmsNormGrads._make(first_order_only(_FN + "()", grads, grad_out, s, weight))


ADD_RMS_NORM = opdef.define(
    "add_rms_norm",
    AddRmsNormArgs,
    AddRmsNormOutput,
    spec=add_rms_norm_spec,
    setup=_setup,
    backward=_backward,
    fake=_fake,
    backward_inputs=AddRmsNormBackwardInputs,
    grads=AddRmsNormGrads,
    backward_fake=_backward_fake,
    non_differentiable=lambda args, output: (output.rstd,),
)

backends.register(backends.Implementation("add_rms_norm", "torch", _torch_forward, _torch_backward))


# --------------------------------------------------------------------------------------
# Public function


def _unit_cols(t: Tensor) -> Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def add_rms_norm(
    x: Tensor,
    residual: Tensor | None = None,
    weight: Tensor | None = None,
    eps: float = 1e-6,
    *,
    return_sum: bool = False,
    unit_offset: bool = False,
    backend: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``RMSNorm(x + residual)`` (and the sum with ``return_sum``), one pass each way.

    ``x``: ``[N, F]`` floating point (rows: tokens, or token heads for Qwen3's per-head norms);
    ``residual``: x's shape and dtype, or None; ``weight``: ``[F]`` of x's dtype, or None;
    ``unit_offset``: Gemma's ``1 + weight`` (see :mod:`ragged.ops.rms_norm` for the numerics).
    Returns ``out`` (x's dtype, contiguous), or ``(out, x + residual)``. Differentiable in x,
    residual and weight (first order). No host sync.
    """
    fn = _FN
    x = check_tensor(fn, "x", x)
    if x.dim() != 2:
        raise ValueError(f"{fn}(): expected x of shape [N, F] (2-D), got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{fn}(): expected x of a floating-point dtype, got {x.dtype}")
    if residual is not None:
        residual = check_tensor(fn, "residual", residual)
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"{fn}(): expected residual of x's shape, dtype and device, got {describe(residual)}")
    if weight is not None:
        weight = check_tensor(fn, "weight", weight)
        if weight.shape != (x.shape[1],) or weight.dtype != x.dtype or weight.device != x.device:
            raise ValueError(
                f"{fn}(): expected weight [F] = [{x.shape[1]}] of x's dtype and device, got {describe(weight)}"
            )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{fn}(): expected eps to be a number >= 0, got {describe(eps)}")
    for name, flag in (("return_sum", return_sum), ("unit_offset", unit_offset)):
        if not isinstance(flag, bool):
            raise TypeError(f"{fn}(): expected {name} to be a bool, got {describe(flag)}")
    x = _unit_cols(x)
    residual = None if residual is None else _unit_cols(residual)
    weight = None if weight is None else weight.contiguous()
    impl = backends.select_spec("add_rms_norm", backend, add_rms_norm_spec(x, residual, weight), fn=fn)
    out = ADD_RMS_NORM(AddRmsNormArgs(x, residual, weight, float(eps), unit_offset), impl.name)
    if not return_sum:
        return out.out
    return out.out, (out.sum if residual is not None else x)
