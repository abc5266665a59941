"""Gated activations (the GLU family): ``y = act(x[:, :F]) * x[:, F:]``.

The feed-forward block of GeGLU / ReGLU models (ModernBERT's MLP among them) projects each
token to ``2F`` features with one Linear and splits them into an input half and a gate half:
``input, gate = Wi(h).chunk(2, dim=-1)``, ``y = act(input) * gate``. :func:`gated_act` does the
split, the activation and the product in one pass over the packed tokens ``x [T, 2F]`` (the
``values`` of a RaggedTensor, or any rows), and its backward in one more.

Coordinates: a row of ``x`` is a packed token; its columns ``[0, F)`` are the input half,
``[F, 2F)`` the gate half. Column ``j`` of the output pairs column ``j`` of each half.

Activations: the names :func:`ragged.bias_act` takes (``"relu"``, ``"gelu"``: exact erf form,
``F.gelu``'s default; ``"gelu_tanh"``: ``F.gelu(approximate="tanh")``; ``"none"``: the
bilinear GLU), computed by the same functions as there (:data:`ragged.ops.fused.ACTIVATION_FNS`
in the reference, the same Triton helpers in the kernels). A caller with a HuggingFace
activation name (``config.hidden_activation``) maps it to one of these.

Numerics: float32 arithmetic (float64 for float64 inputs), the result rounded once to x's dtype.
Gradient, with ``a = x[:, :F]``, ``b = x[:, F:]`` and ``g`` the output's gradient:
``dx = [g * b * act'(a), g * act(a)]``, in float32 and returned in x's dtype. The backward
recomputes ``act(a)`` from ``x`` (only ``x`` is saved, never the output). Under
``create_graph=True`` it runs as the reference's torch ops, so the op is twice differentiable on
every backend.

The op ``ragged::gated_act`` (:data:`GATED_ACT`, with ``ragged::gated_act_backward``; its
operands the record :class:`~ragged.records.gated.GatedActArgs`) has two implementations
(:mod:`ragged.backends`), whose reasons read :class:`GatedActSpec`: ``"torch"``
(:func:`reference_gated_act`, :func:`reference_gated_act_backward`; the CPU path and the tests'
oracle; any floating dtype) and ``"triton"`` (:mod:`ragged.kernels.triton.gated`; float16,
bfloat16 and float32; ``"auto"`` takes it on CUDA tensors). A per-token op: the grid comes from
``T`` alone, no offsets are read and nothing reads the GPU from the host; spare rows past the
real tokens are computed like any other row.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .. import backends, opdef
from ..records.gated import GatedActArgs, GatedActBackwardInputs, GatedActGrads, GatedActOutput
from ..utils import check_tensor, describe, no_autocast
from .fused import ACTIVATIONS, reference_bias_act, reference_bias_act_backward

__all__ = [
    "GATED_ACT",
    "GatedActSpec",
    "gated_act",
    "gated_act_spec",
    "reference_gated_act",
    "reference_gated_act_backward",
]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------
# References (pure torch; CPU product path and test oracle)


@no_autocast
def reference_gated_act(x: Tensor, activation: str = "gelu") -> Tensor:
    """``act(x[..., :F]) * x[..., F:]`` for ``x [..., 2F]``, in float32 (float64 for float64),
    returned in x's dtype, shape ``[..., F]``. Differentiable through torch autograd."""
    a, b = x.to(_compute_dtype(x.dtype)).chunk(2, dim=-1)
    return (reference_bias_act(a, None, activation) * b).to(x.dtype)


@no_autocast
def reference_gated_act_backward(grad: Tensor, x: Tensor, activation: str = "gelu") -> Tensor:
    """``dx [..., 2F]`` of :func:`reference_gated_act` for ``grad [..., F]``, written out:
    ``[grad * b * act'(a), grad * act(a)]`` with ``a, b = x.chunk(2, -1)``. In float32 (float64
    for float64), returned in x's dtype. Explicit formulas rather than autograd: this also runs
    inside the ``ragged::gated_act_backward`` op, where autograd is off; they are torch ops that
    autograd records under ``create_graph=True``."""
    dtype = _compute_dtype(x.dtype)
    a, b = x.to(dtype).chunk(2, dim=-1)
    g = grad.to(dtype)
    da, _ = reference_bias_act_backward(g * b, a, None, activation)
    db = g * reference_bias_act(a, None, activation)
    return torch.cat((da, db), dim=-1).to(x.dtype)


# --------------------------------------------------------------------------------------
# The "torch" implementation (over the op's 2-D operand)


def _gated_act_torch_forward(args: GatedActArgs) -> GatedActOutput:
    x, activation = args.x, args.activation
    if torch.is_grad_enabled() and x.requires_grad:
        with torch.no_grad():
            return GatedActOutput(reference_gated_act(x, activation).contiguous())
    return GatedActOutput(reference_gated_act(x, activation).contiguous())


def _gated_act_torch_backward(args: GatedActArgs, inputs: GatedActBackwardInputs) -> GatedActGrads:
    return GatedActGrads(reference_gated_act_backward(inputs.grad_out, args.x, args.activation).contiguous())


# --------------------------------------------------------------------------------------
# Spec and op


@dataclasses.dataclass(frozen=True)
class GatedActSpec:
    """``gated_act(x [N, 2F], activation)`` as the implementations see it."""

    device: torch.device
    dtype: torch.dtype  # x's
    activation: str
    features: int  # F, the output's columns (half of x's)


def gated_act_spec(x: Tensor, activation: str) -> GatedActSpec:
    """The spec of ``gated_act``'s operands (the arguments of ``ragged.explain("gated_act", ...)``)."""
    return GatedActSpec(x.device, x.dtype, activation, x.shape[-1] // 2)


def _gated_act_fake(args: GatedActArgs) -> GatedActOutput:
    x = args.x
    return GatedActOutput(x.new_empty((x.shape[0], x.shape[1] // 2)))


def _gated_act_setup(ctx, args: GatedActArgs, output: GatedActOutput) -> None:
    ctx.save_for_backward(args.x)
    ctx.activation = args.activation


def _gated_act_backward(ctx, grad: Tensor) -> GatedActGrads:
    (x,) = ctx.saved_tensors
    if torch.is_grad_enabled():
        # create_graph=True: the gradient must be differentiable itself; a kernel's output
        # would be a constant to autograd (a second derivative through it silently zero).
        return GatedActGrads(reference_gated_act_backward(grad, x, ctx.activation))
    args = GatedActArgs(x, ctx.activation)
    return GATED_ACT.call_backward(args, GatedActBackwardInputs(_unit_cols(grad)), ctx.impl)


GATED_ACT = opdef.define(
    "gated_act",
    GatedActArgs,
    GatedActOutput,
    spec=gated_act_spec,
    setup=_gated_act_setup,
    backward=_gated_act_backward,
    fake=_gated_act_fake,
    backward_inputs=GatedActBackwardInputs,
    grads=GatedActGrads,
    backward_fake=lambda args, inputs: GatedActGrads(args.x.new_empty(args.x.shape)),
)

backends.register(backends.Implementation("gated_act", "torch", _gated_act_torch_forward, _gated_act_torch_backward))


# --------------------------------------------------------------------------------------
# Public function


def _unit_cols(t: Tensor) -> Tensor:
    """``t`` with unit stride along its columns (any row stride): itself, or a copy."""
    return t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


def _validate_gated_act(fn: str, x: object, activation: object) -> None:
    x = check_tensor(fn, "x", x)
    if x.dim() != 2:
        raise ValueError(f"{fn}(): expected x of shape [T, 2F] (2-D), got shape {tuple(x.shape)}")
    if x.shape[1] % 2:
        raise ValueError(
            f"{fn}(): expected x with an even last dim 2F (input and gate halves), got shape {tuple(x.shape)}"
        )
    if not x.dtype.is_floating_point:
        raise TypeError(f"{fn}(): expected x of a floating-point dtype, got {x.dtype}")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"{fn}(): expected activation to be one of {ACTIVATIONS}, got {describe(activation)}")


def gated_act(x: Tensor, activation: str = "gelu", *, backend: str | None = None) -> Tensor:
    """``act(x[:, :F]) * x[:, F:]``: a GLU-family activation (GeGLU with ``"gelu"``) in one pass.

    ``x``: ``[T, 2F]`` floating point, the input half then the gate half of each row (a Linear's
    output, or a view of one with any row stride; columns of another stride are copied first).
    ``activation``: ``"gelu"`` (exact erf form, as ``F.gelu``), ``"gelu_tanh"``
    (``F.gelu(approximate="tanh")``), ``"relu"`` or ``"none"``, as :func:`ragged.bias_act`.
    Returns a contiguous ``[T, F]`` tensor of x's dtype, computed in float32 (float64 for
    float64). Differentiable in ``x``, twice too (see :mod:`ragged.ops.gated`). No host sync.

    >>> import torch, ragged
    >>> x = torch.tensor([[1.0, -2.0, 3.0, 4.0]])
    >>> ragged.gated_act(x, "relu")
    tensor([[3., 0.]])
    """
    fn = "ragged.gated_act"
    _validate_gated_act(fn, x, activation)
    x = _unit_cols(x)
    impl = backends.select_spec("gated_act", backend, gated_act_spec(x, activation), fn=fn)
    return GATED_ACT(GatedActArgs(x, activation), impl.name).out
