"""Fused per-token ops of a transformer layer: bias + activation, residual add + LayerNorm.

They run on the ``values [T, F]`` of a RaggedTensor (any ``[..., F]`` tensor: the
leading dims are flattened into rows ``N`` and restored on the way out), so no padded
row is ever touched.

* :func:`bias_act`: ``y = act(x + bias)`` with ``act`` one of ``"relu"``, ``"gelu"``
  (exact, erf; ``F.gelu``'s default), ``"gelu_tanh"`` (``F.gelu(approximate="tanh")``),
  ``"none"``. One pass instead of an add and an activation, and a backward that also
  reduces the bias gradient.
* :func:`add_layer_norm`: ``s = x + residual``, ``y = LayerNorm(s)``; optionally returns
  ``s`` too (the residual stream of a pre-norm layer). ``weight`` / ``bias`` may be None
  (``elementwise_affine=False`` / ``bias=False``).

Dtypes (also under autocast, which leaves these ops alone): arithmetic is float32
(float64 for float64 inputs) whatever the storage dtypes. ``bias_act`` returns ``x``'s
dtype. ``add_layer_norm`` returns ``s`` and ``y`` in the dtype of ``x + residual``
(torch's type promotion; ``x``'s dtype without a residual), and ``y`` is the layer norm
of ``s`` as stored in that dtype. Parameters (``bias``, ``weight``) are never cast: a
float32 parameter with bfloat16 activations is read as float32, and its gradient is
reduced in float32 and returned in the parameter's dtype. Each input's gradient comes
in that input's dtype.

Layouts: ``x`` and ``residual`` may have any strides (rows with a unit feature stride are
read in place, other layouts are copied first). A parameter may be any 1-D view (``w[::2]``,
``b.expand(F)``): the op's validation hands every backend a unit-stride copy, and autograd
takes its gradient back to the view's base.

Second derivatives: both ops are twice differentiable on every backend. Under
``create_graph=True`` the backward runs as torch ops (the reference's written-out formulas,
the layer norm's row statistics recomputed from the sum), which autograd records; otherwise
it runs the chosen backend's kernels. One autograd rule per op serves the eager path and the
``torch.library`` op (:mod:`ragged.opdef`).

The ops ``ragged::bias_act`` (:data:`BIAS_ACT`) and ``ragged::add_layer_norm``
(:data:`ADD_LAYER_NORM`), each with a ``_backward`` op and each over the records of
:mod:`ragged.records.fused` (operands, outputs, the backward's inputs and the gradients, read
by name everywhere), have three implementations (:mod:`ragged.backends`), whose reasons read
the specs (:class:`BiasActSpec`, :class:`AddLayerNormSpec`): ``"torch"``
(:func:`reference_bias_act`, :func:`reference_add_layer_norm` and written-out backward
formulas; the CPU path and the tests' oracle), ``"triton"`` (:mod:`ragged.kernels.triton.fused`;
float16, bfloat16 and float32) and ``"cuda"`` (the CUDA C++ forward of ``csrc/fused.cu``, far
cheaper to launch than Triton's, then the Triton backward). ``"auto"`` takes CUDA, then
Triton, on CUDA tensors. No op reads the GPU from the host.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import backends, opdef
from ..records.fused import (
    AddLayerNormArgs,
    AddLayerNormBackwardInputs,
    AddLayerNormGrads,
    AddLayerNormOutput,
    BiasActArgs,
    BiasActBackwardInputs,
    BiasActGrads,
    BiasActOutput,
)
from ..utils import check_tensor, check_vector, describe, eager, no_autocast

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "none")


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _gelu_tanh(z: torch.Tensor) -> torch.Tensor:
    return F.gelu(z, approximate="tanh")


# Each activation name of bias_act as the torch function it computes (also what ragged.nn
# runs where the fused op does not: CPU tensors, autocast).
ACTIVATION_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
    "silu": F.silu,
    "none": lambda z: z,
}


def _activation(z: torch.Tensor, activation: str) -> torch.Tensor:
    return ACTIVATION_FNS[activation](z)


# --------------------------------------------------------------------------------------
# References (pure torch; CPU product path and test oracle)


@no_autocast
def reference_bias_act(x: torch.Tensor, bias: torch.Tensor | None, activation: str = "gelu") -> torch.Tensor:
    """``act(x + bias)`` in float32 (float64 if x or bias is float64), returned in x's dtype.

    ``x [..., F]``, ``bias [F]`` or None. Differentiable through torch autograd."""
    dtype = _compute_dtype(x.dtype, *([] if bias is None else [bias.dtype]))
    z = x.to(dtype)
    if bias is not None:
        z = z + bias.to(dtype)
    return _activation(z, activation).to(x.dtype)


@no_autocast
def reference_bias_act_backward(
    grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, activation: str = "gelu"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dx, dbias)`` of :func:`reference_bias_act` for ``grad`` (x's shape), written out:
    ``dx = grad * act'(x + bias)``, ``dbias = dx.sum(rows)`` (reduced before rounding).
    In float32 (float64 for float64), returned in x's and bias's dtypes (dbias None
    without a bias). Explicit formulas rather than autograd: this also runs inside the
    ``ragged::bias_act_backward`` op, where autograd is off."""
    dtype = _compute_dtype(x.dtype, *([] if bias is None else [bias.dtype]))
    z = x.to(dtype)
    if bias is not None:
        z = z + bias.to(dtype)
    g = grad.to(dtype)
    if activation == "relu":
        dz = torch.where(z > 0, g, torch.zeros((), dtype=dtype, device=g.device))
    elif activation in ("gelu", "gelu_tanh"):
        dz = torch.ops.aten.gelu_backward(g, z, approximate="tanh" if activation == "gelu_tanh" else "none")
    elif activation == "silu":  # z * s(z): s(z) * (1 + z * (1 - s(z)))
        s = torch.sigmoid(z)
        dz = g * s * (1 + z * (1 - s))
    else:
        dz = g
    dbias = None if bias is None else dz.reshape(-1, dz.shape[-1]).sum(0).to(bias.dtype)
    return dz.to(x.dtype), dbias


def _sum_dtype(x: torch.Tensor, residual: torch.Tensor | None) -> torch.dtype:
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


def _stats(x, residual, weight, bias, eps):
    """(y, s, mean, rstd, compute dtype): y in the compute dtype, s stored as ``x + residual``."""
    dtype = _compute_dtype(x.dtype, *[t.dtype for t in (residual, weight, bias) if t is not None])
    s = x if residual is None else (x.to(dtype) + residual.to(dtype)).to(_sum_dtype(x, residual))
    n_cols = x.shape[-1]
    y, mean, rstd = torch.native_layer_norm(
        s.to(dtype),
        (n_cols,),
        None if weight is None else weight.to(dtype),
        None if bias is None else bias.to(dtype),
        eps,
    )
    return y, s, mean, rstd, dtype


@no_autocast
def reference_add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    return_sum: bool = False,
):
    """``LayerNorm(x + residual)`` over the last dim, in float32 (float64 if any input is float64).

    ``x [..., F]``, ``residual`` x's shape or None, ``weight [F]`` / ``bias [F]`` or None.
    The sum is stored in the dtype of ``x + residual`` and normalised as stored; ``y`` is
    returned in that dtype too. Returns ``y``, or ``(y, s)`` with ``return_sum``.
    Differentiable through torch autograd."""
    y, s, _, _, _ = _stats(x, residual, weight, bias, eps)
    y = y.to(s.dtype)
    return (y, s) if return_sum else y


@no_autocast
def reference_add_layer_norm_backward(
    dy: torch.Tensor,
    ds: torch.Tensor | None,
    s: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    need_weight: bool = True,
    need_bias: bool = True,
):
    """Gradients of :func:`reference_add_layer_norm`, written out.

    With ``xhat = (s - mean) * rstd`` and ``g = dy * weight`` (``dy`` without a weight),
    per row: ``ds_total = rstd * (g - mean(g) - xhat * mean(g * xhat)) + ds``, the gradient
    of ``x`` and of ``residual`` alike; ``dweight = sum_rows dy * xhat``, ``dbias =
    sum_rows dy``. ``s [N, F]`` as stored, ``mean`` / ``rstd [N]`` (or ``[N, 1]``) from the
    forward. Returns ``(ds_total in s's dtype, dweight, dbias)`` (parameters' dtypes; None
    when absent or not asked for)."""
    dtype = _compute_dtype(s.dtype, *[t.dtype for t in (weight, bias) if t is not None])
    mean = mean.reshape(-1, 1).to(dtype)
    rstd = rstd.reshape(-1, 1).to(dtype)
    xhat = (s.to(dtype) - mean) * rstd
    dy = dy.to(dtype)
    g = dy if weight is None else dy * weight.to(dtype)
    n_cols = s.shape[-1]
    c1 = (g * xhat).sum(-1, keepdim=True) / n_cols
    c2 = g.sum(-1, keepdim=True) / n_cols
    dsum = (g - c2 - xhat * c1) * rstd
    if ds is not None:
        dsum = dsum + ds.to(dtype)
    dweight = (dy * xhat).sum(0).to(weight.dtype) if need_weight and weight is not None else None
    dbias = dy.sum(0).to(bias.dtype) if need_bias and bias is not None else None
    return dsum.to(s.dtype), dweight, dbias


# --------------------------------------------------------------------------------------
# The "torch" implementations (over the ops' 2-D operands)

# A torch.autocast(enabled=False) block or a torch.no_grad() one costs microseconds of host
# time per call, and neither is needed where an implementation usually runs (inside the op's
# autograd.Function, below the torch.library op's autograd, or with no input requiring grad,
# autocast off): the forwards enter them only when autograd could record or autocast is on.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _guarded(*tensors: torch.Tensor | None) -> bool:
    if _any_autocast():
        return True
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _fresh(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # An op's output never aliases its input ("none" without a bias computes nothing).
    return out.clone() if out is x else out.contiguous()


def _bias_act_torch_forward(args: BiasActArgs) -> BiasActOutput:
    x, bias, activation = args.x, args.bias, args.activation
    if _guarded(x, bias):
        with torch.no_grad():
            return BiasActOutput(_fresh(reference_bias_act(x, bias, activation), x))
    return BiasActOutput(_fresh(reference_bias_act.__wrapped__(x, bias, activation), x))


def _bias_act_torch_backward(args: BiasActArgs, inputs: BiasActBackwardInputs) -> BiasActGrads:
    grad = inputs.grad_out
    dx, dbias = reference_bias_act_backward(grad, args.x, args.bias, args.activation)
    # "none" passes grad through: still a new tensor (the backward op may not alias its input)
    return BiasActGrads(_fresh(dx, grad), dbias if inputs.need_bias else None)


def _add_layer_norm_torch(args: AddLayerNormArgs) -> AddLayerNormOutput:
    x, residual = args.x, args.residual
    y, s, mean, rstd, dtype = _stats(x, residual, args.weight, args.bias, args.eps)  # statistics in the compute dtype
    s = _fresh(s, x) if args.return_sum else s.new_empty(0)
    return AddLayerNormOutput(
        y.to(_sum_dtype(x, residual)).contiguous(), s, mean.reshape(-1).to(dtype), rstd.reshape(-1).to(dtype)
    )


@no_autocast
def _add_layer_norm_torch_no_autocast(x: Tensor, args: AddLayerNormArgs) -> AddLayerNormOutput:
    """:func:`_add_layer_norm_torch` with autocast off on the device of ``x`` (``args.x``)."""
    return _add_layer_norm_torch(args)


def _add_layer_norm_torch_forward(args: AddLayerNormArgs) -> AddLayerNormOutput:
    if _guarded(args.x, args.residual, args.weight, args.bias):
        with torch.no_grad():
            return _add_layer_norm_torch_no_autocast(args.x, args)
    return _add_layer_norm_torch(args)


def _add_layer_norm_torch_backward(args: AddLayerNormArgs, inputs: AddLayerNormBackwardInputs) -> AddLayerNormGrads:
    a, b = args.x, args.residual
    dtype = _compute_dtype(a.dtype, *([] if b is None else [b.dtype]))
    s = a if b is None else (a.to(dtype) + b.to(dtype)).to(_sum_dtype(a, b))
    dsum, dweight, dbias = reference_add_layer_norm_backward(
        inputs.grad_out,
        inputs.grad_sum,
        s,
        args.weight,
        args.bias,
        inputs.mean,
        inputs.rstd,
        inputs.need_weight,
        inputs.need_bias,
    )
    return AddLayerNormGrads(dsum.contiguous(), None, dweight, dbias)


# --------------------------------------------------------------------------------------
# Specs: what an implementation is asked to take (read by every implementation's reasons)

# A fault of the layout that keeps 16-byte vector loads off a tensor: (tensor, kind, value)
# with kind "stride" (its stride along the features, not 1), "row stride" (a row stride in
# bytes, not a multiple of 16) or "address" (its data's bytes past a multiple of 16).
LayoutFault = tuple[str, str, int]


@dataclasses.dataclass(frozen=True)
class BiasActSpec:
    """``bias_act(x [N, F], bias [F] or None, activation)`` as the implementations see it."""

    device: torch.device
    dtype: torch.dtype  # x's
    bias_dtype: torch.dtype | None
    activation: str
    features: int  # F
    contiguous: bool  # x one dense run of N * F elements
    layout: tuple[LayoutFault, ...] = ()  # of bias (and of x's address); see LayoutFault


@dataclasses.dataclass(frozen=True)
class AddLayerNormSpec:
    """``add_layer_norm(x [N, F], residual [N, F] or None, weight [F] or None, bias [F] or
    None)`` as the implementations see it."""

    device: torch.device
    dtype: torch.dtype  # x's
    residual_dtype: torch.dtype | None
    weight_dtype: torch.dtype | None
    bias_dtype: torch.dtype | None
    rows: int  # N
    features: int  # F
    layout: tuple[LayoutFault, ...] = ()  # of every tensor; see LayoutFault


def _layout(named, addresses: bool) -> tuple[LayoutFault, ...]:
    """The :data:`LayoutFault` s of ``(name, tensor or None)`` pairs; ``addresses``: their data
    pointers are read (plain tensors in eager mode; a traced tensor has none, and a kernel
    launched later on a misaligned one copies it)."""
    out = []
    for name, t in named:
        if t is None:
            continue
        shape, strides, size = t.shape, t.stride(), t.element_size()
        if shape and shape[-1] > 1 and strides[-1] != 1:
            out.append((name, "stride", strides[-1]))
        bad = [s * size for n, s in zip(shape[:-1], strides[:-1]) if n > 1 and (s * size) % 16]
        if bad:
            out.append((name, "row stride", bad[0]))
        if addresses and t.data_ptr() % 16:
            out.append((name, "address", t.data_ptr() % 16))
    return tuple(out)


def bias_act_spec(x: Tensor, bias: Tensor | None, activation: str) -> BiasActSpec:
    """The spec of ``bias_act``'s operands (the arguments of ``ragged.explain("bias_act", ...)``)."""
    if bias is None:
        addresses = eager(x)
        aligned = not (addresses and x.data_ptr() & 15)
    else:
        addresses = eager(x, bias)
        aligned = bias.is_contiguous() and not (addresses and (x.data_ptr() | bias.data_ptr()) & 15)
    layout: tuple[tuple[str, str, int], ...] = ()
    if not aligned:  # x is read as one run (its strides are the contiguous flag's): its address only
        layout = _layout((("bias", bias),), addresses)
        if addresses and x.data_ptr() % 16:
            layout = (("x", "address", x.data_ptr() % 16), *layout)
    return BiasActSpec(
        x.device, x.dtype, None if bias is None else bias.dtype, activation, x.shape[-1], x.is_contiguous(), layout
    )


def add_layer_norm_spec(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None
) -> AddLayerNormSpec:
    """The spec of ``add_layer_norm``'s operands (the arguments of
    ``ragged.explain("add_layer_norm", ...)``)."""
    shape = x.shape
    rows = shape[0] if len(shape) == 2 else math.prod(shape[:-1])
    present = (
        [x]
        if residual is None and weight is None and bias is None
        else [t for t in (x, residual, weight, bias) if t is not None]
    )
    addresses = eager(*present)
    # The common case (every tensor read in place) from a few integer reads: 2-D rows with unit
    # feature stride and 16-byte row strides, contiguous parameters, aligned data.
    pointers = strides = 0
    unit = True
    layout: tuple[tuple[str, str, int], ...]
    for t in present:
        if addresses:
            pointers |= t.data_ptr()
        s = t.stride()
        if len(s) == 2:
            unit = unit and (s[1] == 1 or t.shape[1] <= 1)
            if rows > 1:
                strides |= s[0] * t.element_size()
        else:
            unit = unit and len(s) == 1 and (s[0] == 1 or t.shape[0] <= 1)
    layout = ()
    if not unit or (pointers | strides) & 15:
        layout = _layout((("x", x), ("residual", residual), ("weight", weight), ("bias", bias)), addresses)
    return AddLayerNormSpec(
        x.device,
        x.dtype,
        None if residual is None else residual.dtype,
        None if weight is None else weight.dtype,
        None if bias is None else bias.dtype,
        rows,
        shape[-1],
        layout,
    )


# --------------------------------------------------------------------------------------
# bias_act: the op and its autograd rule


def _bias_act_backward_fake(args: BiasActArgs, inputs: BiasActBackwardInputs) -> BiasActGrads:
    x, bias = args.x, args.bias
    return BiasActGrads(
        x.new_empty(x.shape), bias.new_empty(bias.shape) if inputs.need_bias and bias is not None else None
    )


def _bias_act_setup(ctx, args: BiasActArgs, output: BiasActOutput) -> None:
    ctx.save_for_backward(args.x, args.bias)
    ctx.activation = args.activation


def _bias_act_backward(ctx, grad: Tensor) -> BiasActGrads:
    x, bias = ctx.saved_tensors
    need_bias = bias is not None and bool(ctx.needs_grad.bias)
    if torch.is_grad_enabled():
        # create_graph=True: the gradient must be differentiable itself. The reference's
        # written-out formulas are torch ops that autograd records (gelu_backward has its own
        # derivative); a kernel's output would be a constant to autograd, and a second
        # derivative through it silently zero.
        dx, dbias = reference_bias_act_backward(grad, x, bias, ctx.activation)
        return BiasActGrads(dx, dbias if need_bias else None)
    inputs = BiasActBackwardInputs(_unit_feature_stride(grad), need_bias)
    return BIAS_ACT.call_backward(BiasActArgs(x, bias, ctx.activation), inputs, ctx.impl)


BIAS_ACT = opdef.define(
    "bias_act",
    BiasActArgs,
    BiasActOutput,
    spec=bias_act_spec,
    setup=_bias_act_setup,
    backward=_bias_act_backward,
    fake=lambda args: BiasActOutput(args.x.new_empty(args.x.shape)),
    backward_inputs=BiasActBackwardInputs,
    grads=BiasActGrads,
    backward_fake=_bias_act_backward_fake,
)

# --------------------------------------------------------------------------------------
# add_layer_norm: the op and its autograd rule


def _add_layer_norm_fake(args: AddLayerNormArgs) -> AddLayerNormOutput:
    x, residual = args.x, args.residual
    dtype = _sum_dtype(x, residual)
    stat = _compute_dtype(x.dtype, *[t.dtype for t in (residual, args.weight, args.bias) if t is not None])
    n_rows = x.shape[0]
    return AddLayerNormOutput(
        x.new_empty(x.shape, dtype=dtype),
        x.new_empty(x.shape if args.return_sum else (0,), dtype=dtype),
        x.new_empty((n_rows,), dtype=stat),
        x.new_empty((n_rows,), dtype=stat),
    )


def _add_layer_norm_backward_fake(args: AddLayerNormArgs, inputs: AddLayerNormBackwardInputs) -> AddLayerNormGrads:
    a, weight, bias = args.x, args.weight, args.bias
    return AddLayerNormGrads(
        a.new_empty(a.shape, dtype=_sum_dtype(a, args.residual)),
        None,
        weight.new_empty(weight.shape) if inputs.need_weight and weight is not None else None,
        bias.new_empty(bias.shape) if inputs.need_bias and bias is not None else None,
    )


def _add_layer_norm_setup(ctx, args: AddLayerNormArgs, output: AddLayerNormOutput) -> None:
    x, residual = args.x, args.residual
    # The backward reads only the sum: s itself when it is an output anyway, else x and
    # residual (no extra write in the forward).
    a, b = (output.sum, None) if args.return_sum else (x, residual)
    ctx.save_for_backward(a, b, args.weight, args.bias, output.mean, output.rstd)
    ctx.dtypes = (x.dtype, None if residual is None else residual.dtype)
    ctx.return_sum, ctx.eps = args.return_sum, args.eps
    ctx.set_materialize_grads(False)


def _differentiable_add_layer_norm_backward(dy, ds, a, b, weight, bias, eps, need_weight, need_bias):
    """The backward under ``create_graph=True``, on every backend: the written-out formulas of
    :func:`reference_add_layer_norm_backward`, with the row statistics recomputed from the sum
    by torch ops. The saved ``mean`` / ``rstd`` are constants to autograd, so a second
    derivative through them would miss how they depend on the sum (and a kernel's gradient
    is a constant altogether)."""
    dtype = _compute_dtype(a.dtype, *[t.dtype for t in (b, weight, bias) if t is not None])
    s = a if b is None else (a.to(dtype) + b.to(dtype)).to(_sum_dtype(a, b))
    sc = s.to(dtype)
    mean = sc.mean(-1, keepdim=True)
    rstd = torch.rsqrt((sc - mean).square().mean(-1, keepdim=True) + eps)
    return reference_add_layer_norm_backward(dy, ds, s, weight, bias, mean, rstd, need_weight, need_bias)


def _add_layer_norm_backward(ctx, dy, ds, dmean, drstd):
    a, b, weight, bias, mean, rstd = ctx.saved_tensors
    need = ctx.needs_grad
    need_weight = weight is not None and bool(need.weight)
    need_bias = bias is not None and bool(need.bias)
    if not ctx.return_sum:  # s was an empty placeholder
        ds = None
    if dy is None:  # only the returned sum was used
        dsum, dweight, dbias = ds, None, None
        if need_weight:
            dweight = torch.zeros_like(weight)
        if need_bias:
            dbias = torch.zeros_like(bias)
    elif torch.is_grad_enabled():  # create_graph=True: a differentiable gradient
        dsum, dweight, dbias = _differentiable_add_layer_norm_backward(
            dy, ds, a, b, weight, bias, ctx.eps, need_weight, need_bias
        )
    else:
        # the sum's summands as kept (the sum itself as x where the forward returned it)
        args = AddLayerNormArgs(a, b, weight, bias, ctx.eps)
        inputs = AddLayerNormBackwardInputs(
            _unit_feature_stride(dy),
            None if ds is None else _unit_feature_stride(ds),
            mean,
            rstd,
            need_weight,
            need_bias,
        )
        grads = ADD_LAYER_NORM.call_backward(args, inputs, ctx.impl)
        dsum, dweight, dbias = grads.x, grads.weight, grads.bias
    x_dtype, r_dtype = ctx.dtypes
    dx = dsum.to(x_dtype) if need.x and dsum is not None else None
    dres = dsum.to(r_dtype) if r_dtype is not None and need.residual and dsum is not None else None
    return AddLayerNormGrads(dx, dres, dweight, dbias)


ADD_LAYER_NORM = opdef.define(
    "add_layer_norm",
    AddLayerNormArgs,
    AddLayerNormOutput,
    spec=add_layer_norm_spec,
    setup=_add_layer_norm_setup,
    backward=_add_layer_norm_backward,
    fake=_add_layer_norm_fake,
    backward_inputs=AddLayerNormBackwardInputs,
    grads=AddLayerNormGrads,
    backward_fake=_add_layer_norm_backward_fake,
    # constants to autograd: mean and rstd, and the sum unless it is returned (an empty placeholder)
    non_differentiable=lambda args, out: (out.mean, out.rstd) if args.return_sum else (out.sum, out.mean, out.rstd),
)

backends.register(
    backends.Implementation("bias_act", "torch", _bias_act_torch_forward, _bias_act_torch_backward),
    backends.Implementation("add_layer_norm", "torch", _add_layer_norm_torch_forward, _add_layer_norm_torch_backward),
)


# --------------------------------------------------------------------------------------
# Public API


def _unit_feature_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[N, F]`` rows with unit stride along F (any row stride): ``t`` itself or a view
    when it can."""
    if t.dim() != 2:
        t = t.reshape(math.prod(t.shape[:-1]), t.shape[-1])
    if t.shape[1] > 1 and t.stride(1) != 1:
        t = t.contiguous()
    return t


def _check_float(fn: str, name: str, t: torch.Tensor) -> None:
    if not t.dtype.is_floating_point:
        raise TypeError(f"{fn}(): expected {name} of a floating-point dtype, got {t.dtype}")


def _check_param(fn: str, name: str, t: object, x: torch.Tensor) -> torch.Tensor | None:
    """A ``[F]`` parameter of x's last dim (or None), returned with unit stride.

    Every backend goes through here, and every kernel reads a parameter as ``ptr + i``: a
    strided view (``w[::2]``) or an expanded one (``b.expand(F)``, stride 0) becomes a
    contiguous copy, whose gradient autograd takes back to the view's base. Callers must use
    the returned tensor."""
    if t is None:
        return None
    t = check_vector(fn, name, t, x.shape[-1], x.device, what=" (the last dim of x)")
    _check_float(fn, name, t)
    return t


def _check_x(fn: str, x: object) -> None:
    x = check_tensor(fn, "x", x)
    if x.dim() < 1:
        raise ValueError(f"{fn}(): expected x of shape [..., F], got a 0-d tensor")
    _check_float(fn, "x", x)


def _validate_bias_act(fn, x, bias, activation) -> torch.Tensor | None:
    """Checks the arguments; returns the bias to use (unit stride, see :func:`_check_param`)."""
    _check_x(fn, x)
    bias = _check_param(fn, "bias", bias, x)
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"{fn}(): expected activation to be one of {ACTIVATIONS}, got {describe(activation)}")
    return bias


def _validate_add_layer_norm(
    fn, x, residual, weight, bias, eps, return_sum
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Checks the arguments; returns ``(weight, bias)`` to use (unit stride, see :func:`_check_param`)."""
    _check_x(fn, x)
    if x.shape[-1] == 0:
        raise ValueError(f"{fn}(): expected x with at least one feature (last dim), got shape {tuple(x.shape)}")
    if residual is not None:
        check_tensor(fn, "residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"{fn}(): expected residual of x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        _check_float(fn, "residual", residual)
        if residual.device != x.device:
            raise ValueError(f"{fn}(): expected residual on {x.device} (the device of x), got {residual.device}")
    weight = _check_param(fn, "weight", weight, x)
    bias = _check_param(fn, "bias", bias, x)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{fn}(): expected eps to be a float, got {describe(eps)}")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"{fn}(): expected eps > 0 (and finite), got {eps!r}")
    if not isinstance(return_sum, bool):
        raise TypeError(f"{fn}(): expected return_sum to be a bool, got {describe(return_sum)}")
    return weight, bias


def bias_act(
    x: torch.Tensor, bias: torch.Tensor | None, activation: str = "gelu", *, backend: str | None = None
) -> torch.Tensor:
    """``act(x + bias)`` in one pass.

    ``x``: ``[..., F]`` floating point (rows may be strided; the features should be
    contiguous, else they are copied first). ``bias``: ``[F]`` or None (any floating
    dtype, read as it is; any stride). ``activation``: ``"relu"``, ``"gelu"`` (exact erf form, as
    ``F.gelu``), ``"gelu_tanh"`` (``F.gelu(approximate="tanh")``) or ``"none"``.
    Returns a contiguous tensor of x's shape and dtype, computed in float32 (float64 for
    float64). Differentiable in ``x`` and ``bias`` (``dbias`` reduced in float32), twice
    too (see the module docstring).
    """
    fn = "ragged.bias_act"
    bias = _validate_bias_act(fn, x, bias, activation)
    x2 = _unit_feature_stride(x)
    impl = backends.select_spec("bias_act", backend, bias_act_spec(x2, bias, activation), fn=fn)
    return BIAS_ACT(BiasActArgs(x2, bias, activation), impl.name).out.view(x.shape)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    return_sum: bool = False,
    backend: str | None = None,
):
    """``LayerNorm(x + residual)`` over the last dim, in one pass.

    ``x``: ``[..., F]`` floating point; ``residual``: x's shape or None; ``weight``,
    ``bias``: ``[F]`` or None (``nn.LayerNorm(elementwise_affine=False)`` / ``bias=False``),
    any floating dtype, read as they are, any stride. Statistics in float32 (float64 if an
    input is float64), ``eps`` added to the biased variance, as ``F.layer_norm``.

    Returns ``y``, or ``(y, s)`` with ``return_sum=True`` where ``s = x + residual`` (the
    residual stream of a pre-norm layer; ``x`` itself when ``residual`` is None). ``s``
    and ``y`` have the dtype of ``x + residual`` (torch's promotion) and ``y`` normalises
    ``s`` as stored in it. Differentiable in every tensor input, twice too (see the module
    docstring); ``x`` and ``residual`` receive the same gradient (each in its own dtype).
    """
    fn = "ragged.add_layer_norm"
    weight, bias = _validate_add_layer_norm(fn, x, residual, weight, bias, eps, return_sum)
    x2 = _unit_feature_stride(x)
    r2 = None if residual is None else _unit_feature_stride(residual)
    impl = backends.select_spec("add_layer_norm", backend, add_layer_norm_spec(x2, r2, weight, bias), fn=fn)
    keep_sum = return_sum and residual is not None
    out = ADD_LAYER_NORM(AddLayerNormArgs(x2, r2, weight, bias, float(eps), keep_sum), impl.name)
    y = out.out.view(x.shape)
    if not return_sum:
        return y
    return y, (out.sum.view(x.shape) if keep_sum else x)
