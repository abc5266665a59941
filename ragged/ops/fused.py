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
it runs the chosen backend's kernels. The eager ``autograd.Function`` and the
``torch.library`` op's registered autograd share one rule.

Implementations (:mod:`ragged.backends`): ``"torch"`` (:func:`reference_bias_act`,
:func:`reference_add_layer_norm` and written-out backward formulas; the CPU path and
the tests' oracle) and ``"triton"`` (:mod:`ragged.kernels.triton.fused`; float16,
bfloat16 and float32). ``"auto"`` takes the CUDA C++ forward (``csrc/fused.cu``, with the Triton backward) where
it can, then Triton, on CUDA tensors. No op reads the GPU
from the host.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .. import backends
from .._utils import check_tensor, check_vector, describe, eager

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "none")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _no_autocast(fn):
    """A reference computes in the precision it names, never in autocast's lower one."""

    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        with torch.autocast(device_type=x.device.type, enabled=False):
            return fn(x, *args, **kwargs)

    return wrapper


def _activation(z: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu":
        return F.relu(z)
    if activation == "gelu":
        return F.gelu(z)
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    return z


# --------------------------------------------------------------------------------------
# References (pure torch; CPU product path and test oracle)


@_no_autocast
def reference_bias_act(x: torch.Tensor, bias: torch.Tensor | None, activation: str = "gelu") -> torch.Tensor:
    """``act(x + bias)`` in float32 (float64 if x or bias is float64), returned in x's dtype.

    ``x [..., F]``, ``bias [F]`` or None. Differentiable through torch autograd."""
    dtype = _compute_dtype(x.dtype, *([] if bias is None else [bias.dtype]))
    z = x.to(dtype)
    if bias is not None:
        z = z + bias.to(dtype)
    return _activation(z, activation).to(x.dtype)


@_no_autocast
def reference_bias_act_backward(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
                                activation: str = "gelu") -> tuple[torch.Tensor, torch.Tensor | None]:
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
    y, mean, rstd = torch.native_layer_norm(s.to(dtype), (n_cols,), None if weight is None else weight.to(dtype),
                                            None if bias is None else bias.to(dtype), eps)
    return y, s, mean, rstd, dtype


@_no_autocast
def reference_add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                             bias: torch.Tensor | None, eps: float = 1e-5, return_sum: bool = False):
    """``LayerNorm(x + residual)`` over the last dim, in float32 (float64 if any input is float64).

    ``x [..., F]``, ``residual`` x's shape or None, ``weight [F]`` / ``bias [F]`` or None.
    The sum is stored in the dtype of ``x + residual`` and normalised as stored; ``y`` is
    returned in that dtype too. Returns ``y``, or ``(y, s)`` with ``return_sum``.
    Differentiable through torch autograd."""
    y, s, _, _, _ = _stats(x, residual, weight, bias, eps)
    y = y.to(s.dtype)
    return (y, s) if return_sum else y


@_no_autocast
def reference_add_layer_norm_backward(dy: torch.Tensor, ds: torch.Tensor | None, s: torch.Tensor,
                                      weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor,
                                      rstd: torch.Tensor, need_weight: bool = True, need_bias: bool = True):
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
# Backends. Every implementation is a pair (forward, backward) over 2-D inputs.


def _dtype_reasons(what: str, **tensors) -> list[str]:
    return [f"triton {what} takes float16, bfloat16 and float32, got {name} of dtype {t.dtype}"
            for name, t in tensors.items() if t is not None and t.dtype not in _KERNEL_DTYPES]


def _bias_act_triton_reasons(x, bias, activation) -> list[str]:
    reasons = [r for r in (backends.triton_reason(x.device),) if r]
    return reasons + _dtype_reasons("bias_act", x=x, bias=bias)


def _add_layer_norm_triton_reasons(x, residual, weight, bias) -> list[str]:
    reasons = [r for r in (backends.triton_reason(x.device),) if r]
    return reasons + _dtype_reasons("add_layer_norm", x=x, residual=residual, weight=weight, bias=bias)


def _no_reasons(*_) -> list[str]:
    return []


def _fresh(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # An op's output never aliases its input ("none" without a bias computes nothing).
    return out.clone() if out is x else out.contiguous()


def _bias_act_torch_forward(x, bias, activation):
    with torch.no_grad():
        return _fresh(reference_bias_act(x, bias, activation), x)


def _bias_act_torch_backward(grad, x, bias, activation, need_bias):
    dx, dbias = reference_bias_act_backward(grad, x, bias, activation)
    # "none" passes grad through: still a new tensor (the backward op may not alias its input)
    return _fresh(dx, grad), dbias if need_bias else None


@_no_autocast
def _add_layer_norm_torch_forward(x, residual, weight, bias, eps, return_sum):
    with torch.no_grad():
        y, s, mean, rstd, dtype = _stats(x, residual, weight, bias, eps)
        stat = _stat_dtype(dtype)
        s = _fresh(s, x) if return_sum else s.new_empty(0)
        return y.to(_sum_dtype(x, residual)).contiguous(), s, mean.reshape(-1).to(stat), rstd.reshape(-1).to(stat)


def _add_layer_norm_torch_backward(dy, ds, a, b, weight, bias, mean, rstd, need_weight, need_bias):
    dtype = _compute_dtype(a.dtype, *([] if b is None else [b.dtype]))
    s = a if b is None else (a.to(dtype) + b.to(dtype)).to(_sum_dtype(a, b))
    dsum, dweight, dbias = reference_add_layer_norm_backward(dy, ds, s, weight, bias, mean, rstd, need_weight,
                                                             need_bias)
    return dsum.contiguous(), dweight, dbias


def _bias_act_triton_forward(*args):
    from ..kernels.triton.fused import bias_act_forward

    return bias_act_forward(*args)


def _bias_act_triton_backward(*args):
    from ..kernels.triton.fused import bias_act_backward

    return bias_act_backward(*args)


def _add_layer_norm_triton_forward(*args):
    from ..kernels.triton.fused import add_layer_norm_forward

    return add_layer_norm_forward(*args)


def _add_layer_norm_triton_backward(*args):
    from ..kernels.triton.fused import add_layer_norm_backward

    return add_layer_norm_backward(*args)


def _bias_act_cuda_forward(*args):
    from ..kernels.cuda.fused import bias_act_forward

    return bias_act_forward(*args)


def _add_layer_norm_cuda_forward(*args):
    from ..kernels.cuda.fused import add_layer_norm_forward

    return add_layer_norm_forward(*args)


# The "cuda" implementations run the CUDA C++ forward (csrc/fused.cu: about 5 us of host time
# per launch against 25-40 us for Triton on the H200 machine) and the Triton backward, which
# reads the same saved tensors; so they need what both need. An input the CUDA kernel takes
# (CUDA tensor, float16/bfloat16/float32) passes the Triton dtype checks too: only Triton's
# import is left to ask about.
def _with_triton_reasons(cuda_reasons: list[str], triton_reasons, x, *args) -> list[str]:
    if not cuda_reasons:
        r = backends.triton_reason(x.device)
        return [r] if r else []
    return cuda_reasons + triton_reasons(x, *args)


def _bias_act_cuda_reasons(x, bias, activation) -> list[str]:
    from ..kernels.cuda.fused import bias_act_reasons

    return _with_triton_reasons(bias_act_reasons(x, bias, activation), _bias_act_triton_reasons, x, bias, activation)


def _add_layer_norm_cuda_reasons(x, residual, weight, bias) -> list[str]:
    from ..kernels.cuda.fused import add_layer_norm_reasons

    return _with_triton_reasons(add_layer_norm_reasons(x, residual, weight, bias), _add_layer_norm_triton_reasons,
                                x, residual, weight, bias)


backends.register("bias_act", "torch", (_bias_act_torch_forward, _bias_act_torch_backward), _no_reasons)
backends.register("bias_act", "triton", (_bias_act_triton_forward, _bias_act_triton_backward),
                  _bias_act_triton_reasons)
backends.register("add_layer_norm", "torch", (_add_layer_norm_torch_forward, _add_layer_norm_torch_backward),
                  _no_reasons)
backends.register("add_layer_norm", "triton", (_add_layer_norm_triton_forward, _add_layer_norm_triton_backward),
                  _add_layer_norm_triton_reasons)
backends.register("bias_act", "cuda", (_bias_act_cuda_forward, _bias_act_triton_backward), _bias_act_cuda_reasons)
backends.register("add_layer_norm", "cuda", (_add_layer_norm_cuda_forward, _add_layer_norm_triton_backward),
                  _add_layer_norm_cuda_reasons)
backends.set_auto_order("bias_act", ("cuda", "triton", "torch"))
backends.set_auto_order("add_layer_norm", ("cuda", "triton", "torch"))


def _impl(op: str, name: str):
    return backends._OPS[op].impls[name].fn


def _present(*tensors):
    return [t for t in tensors if t is not None]


def _empty_to_none(t: torch.Tensor, wanted: bool) -> torch.Tensor | None:
    return t if wanted else None


# --------------------------------------------------------------------------------------
# bias_act: torch.library ops, autograd, eager path


@torch.library.custom_op("ragged::bias_act", mutates_args=())
def _bias_act_op(x: torch.Tensor, bias: torch.Tensor | None, activation: str, backend: str) -> torch.Tensor:
    return _impl("bias_act", backend)[0](x, bias, activation)


@_bias_act_op.register_fake
def _bias_act_fake(x, bias, activation, backend):
    return x.new_empty(x.shape)


@torch.library.custom_op("ragged::bias_act_backward", mutates_args=())
def _bias_act_backward_op(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, activation: str,
                          need_bias: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dbias = _impl("bias_act", backend)[1](grad, x, bias, activation, need_bias)
    # An op returns tensors only: a gradient not asked for is an empty tensor.
    return dx, x.new_empty(0) if dbias is None else dbias


@_bias_act_backward_op.register_fake
def _bias_act_backward_fake(grad, x, bias, activation, need_bias, backend):
    wanted = need_bias and bias is not None
    return x.new_empty(x.shape), bias.new_empty(bias.shape) if wanted else x.new_empty(0)


def _bias_act_setup(ctx, inputs, output):
    x, bias, activation, backend = inputs
    ctx.save_for_backward(x, bias)
    ctx.activation, ctx.backend = activation, backend


def _bias_act_backward(ctx, grad):
    x, bias = ctx.saved_tensors
    need_bias = bias is not None and bool(ctx.needs_input_grad[1])
    if torch.is_grad_enabled():
        # create_graph=True: the gradient must be differentiable itself. The reference's
        # written-out formulas are torch ops that autograd records (gelu_backward has its own
        # derivative); a kernel's output would be a constant to autograd, and a second
        # derivative through it silently zero.
        dx, dbias = reference_bias_act_backward(grad, x, bias, ctx.activation)
        return dx, dbias if need_bias else None, None, None
    dx, dbias = _call_bias_act_backward(grad, x, bias, ctx.activation, need_bias, ctx.backend)
    return dx, dbias, None, None


_bias_act_op.register_autograd(_bias_act_backward, setup_context=_bias_act_setup)


class _BiasActFunction(torch.autograd.Function):
    """Eager path: the same forward/backward without the torch.library dispatcher."""

    @staticmethod
    def forward(ctx, x, bias, activation, backend):
        _bias_act_setup(ctx, (x, bias, activation, backend), None)
        return _impl("bias_act", backend)[0](x, bias, activation)

    backward = staticmethod(_bias_act_backward)


def _call_bias_act(x, bias, activation, backend):
    if eager(*_present(x, bias)):
        if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
            return _BiasActFunction.apply(x, bias, activation, backend)
        return _impl("bias_act", backend)[0](x, bias, activation)
    return _bias_act_op(x, bias, activation, backend)


def _call_bias_act_backward(grad, x, bias, activation, need_bias, backend):
    grad = _unit_feature_stride(grad)
    if eager(*_present(grad, x, bias)):
        return _impl("bias_act", backend)[1](grad, x, bias, activation, need_bias)
    dx, dbias = _bias_act_backward_op(grad, x, bias, activation, need_bias, backend)
    return dx, _empty_to_none(dbias, need_bias)


# --------------------------------------------------------------------------------------
# add_layer_norm: torch.library ops, autograd, eager path


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("ragged::add_layer_norm", mutates_args=())
def _add_layer_norm_op(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                       bias: torch.Tensor | None, eps: float, return_sum: bool,
                       backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _impl("add_layer_norm", backend)[0](x, residual, weight, bias, eps, return_sum)


@_add_layer_norm_op.register_fake
def _add_layer_norm_fake(x, residual, weight, bias, eps, return_sum, backend):
    dtype = _sum_dtype(x, residual)
    stat = _stat_dtype(_compute_dtype(x.dtype, *[t.dtype for t in (residual, weight, bias) if t is not None]))
    n_rows = x.shape[0]
    return (x.new_empty(x.shape, dtype=dtype), x.new_empty(x.shape if return_sum else (0,), dtype=dtype),
            x.new_empty((n_rows,), dtype=stat), x.new_empty((n_rows,), dtype=stat))


@torch.library.custom_op("ragged::add_layer_norm_backward", mutates_args=())
def _add_layer_norm_backward_op(dy: torch.Tensor, ds: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor | None,
                                weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor,
                                rstd: torch.Tensor, need_weight: bool, need_bias: bool,
                                backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dsum, dweight, dbias = _impl("add_layer_norm", backend)[1](dy, ds, a, b, weight, bias, mean, rstd, need_weight,
                                                               need_bias)
    return dsum, a.new_empty(0) if dweight is None else dweight, a.new_empty(0) if dbias is None else dbias


@_add_layer_norm_backward_op.register_fake
def _add_layer_norm_backward_fake(dy, ds, a, b, weight, bias, mean, rstd, need_weight, need_bias, backend):
    return (a.new_empty(a.shape, dtype=_sum_dtype(a, b)),
            weight.new_empty(weight.shape) if need_weight and weight is not None else a.new_empty(0),
            bias.new_empty(bias.shape) if need_bias and bias is not None else a.new_empty(0))


def _add_layer_norm_setup(ctx, inputs, output):
    x, residual, weight, bias, eps, return_sum, backend = inputs
    _y, s, mean, rstd = output
    # The backward recomputes the sum from what is saved: s itself when it is an output
    # anyway, else x and residual (no extra write in the forward).
    a, b = (s, None) if return_sum else (x, residual)
    ctx.save_for_backward(a, b, weight, bias, mean, rstd)
    ctx.dtypes = (x.dtype, None if residual is None else residual.dtype)
    ctx.backend, ctx.return_sum, ctx.eps = backend, return_sum, eps
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
    need = ctx.needs_input_grad
    need_weight = weight is not None and bool(need[2])
    need_bias = bias is not None and bool(need[3])
    if not ctx.return_sum:  # s was an empty placeholder
        ds = None
    if dy is None:  # only the returned sum was used
        dsum, dweight, dbias = ds, None, None
        if need_weight:
            dweight = torch.zeros_like(weight)
        if need_bias:
            dbias = torch.zeros_like(bias)
    elif torch.is_grad_enabled():  # create_graph=True: a differentiable gradient
        dsum, dweight, dbias = _differentiable_add_layer_norm_backward(dy, ds, a, b, weight, bias, ctx.eps,
                                                                       need_weight, need_bias)
    else:
        dsum, dweight, dbias = _call_add_layer_norm_backward(dy, ds, a, b, weight, bias, mean, rstd, need_weight,
                                                             need_bias, ctx.backend)
    x_dtype, r_dtype = ctx.dtypes
    dx = dsum.to(x_dtype) if need[0] and dsum is not None else None
    dres = dsum.to(r_dtype) if r_dtype is not None and need[1] and dsum is not None else None
    return dx, dres, dweight, dbias, None, None, None


_add_layer_norm_op.register_autograd(_add_layer_norm_backward, setup_context=_add_layer_norm_setup)


class _AddLayerNormFunction(torch.autograd.Function):
    """Eager path: the same forward/backward without the torch.library dispatcher."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, return_sum, backend):
        out = _impl("add_layer_norm", backend)[0](x, residual, weight, bias, eps, return_sum)
        _add_layer_norm_setup(ctx, (x, residual, weight, bias, eps, return_sum, backend), out)
        _y, s, mean, rstd = out
        ctx.mark_non_differentiable(mean, rstd)
        if not return_sum:
            ctx.mark_non_differentiable(s)
        return out

    backward = staticmethod(_add_layer_norm_backward)


def _call_add_layer_norm(x, residual, weight, bias, eps, return_sum, backend):
    if eager(*_present(x, residual, weight, bias)):
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, residual, weight, bias)):
            return _AddLayerNormFunction.apply(x, residual, weight, bias, eps, return_sum, backend)
        return _impl("add_layer_norm", backend)[0](x, residual, weight, bias, eps, return_sum)
    return _add_layer_norm_op(x, residual, weight, bias, eps, return_sum, backend)


def _call_add_layer_norm_backward(dy, ds, a, b, weight, bias, mean, rstd, need_weight, need_bias, backend):
    dy = _unit_feature_stride(dy)
    ds = None if ds is None else _unit_feature_stride(ds)
    if eager(*_present(dy, ds, a, b, weight, bias, mean, rstd)):
        return _impl("add_layer_norm", backend)[1](dy, ds, a, b, weight, bias, mean, rstd, need_weight, need_bias)
    dsum, dweight, dbias = _add_layer_norm_backward_op(dy, ds, a, b, weight, bias, mean, rstd, need_weight,
                                                       need_bias, backend)
    return dsum, _empty_to_none(dweight, need_weight), _empty_to_none(dbias, need_bias)


# --------------------------------------------------------------------------------------
# Public API


def _unit_feature_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[N, F]`` rows with unit stride along F (any row stride): a view when it can."""
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
    check_tensor(fn, "x", x)
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


def _validate_add_layer_norm(fn, x, residual, weight, bias, eps,
                             return_sum) -> tuple[torch.Tensor | None, torch.Tensor | None]:
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


def bias_act(x: torch.Tensor, bias: torch.Tensor | None, activation: str = "gelu", *,
             backend: str | None = None) -> torch.Tensor:
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
    impl = backends.select("bias_act", backend, x.device, x2, bias, activation, fn=fn)
    y = _call_bias_act(x2, bias, activation, impl.name)
    return y.view(x.shape)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, eps: float = 1e-5, *, return_sum: bool = False,
                   backend: str | None = None):
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
    impl = backends.select("add_layer_norm", backend, x.device, x2, r2, weight, bias, fn=fn)
    keep_sum = return_sum and residual is not None
    y, s, _, _ = _call_add_layer_norm(x2, r2, weight, bias, float(eps), keep_sum, impl.name)
    y = y.view(x.shape)
    if not return_sum:
        return y
    return y, (s.view(x.shape) if keep_sum else x)
