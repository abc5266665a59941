"""The transformer encoder layer, written once, over a :class:`LayerSpec`.

A model adapter (``ragged.nn.transformer`` for torch.nn's layers) describes a layer as a
:class:`LayerSpec`, its weights and configuration; everything below computes it. The
math of one layer, for values ``x [T, d]`` of a batch with offsets ``cu [B+1]``:

* post-norm: ``qkv = x W_in^T + b_in``; attention; ``sa = o W_out^T + b_out``;
  ``x1 = LN1(drop1(sa) + x)``; ``g = act(x1 W_1^T + b_1)``; ``f = drop(g) W_2^T + b_2``;
  ``y = LN2(drop2(f) + x1)``;
* pre-norm: ``h1 = LN1(x)``, the attention block on ``h1``, ``(h2, x1) = (LN2(s), s)`` with
  ``s = drop1(sa) + x``, ``y = x1 + drop2(FF(h2))``.

It is written once, in :func:`_forward`, over a kernel set that says how each step runs:

* :class:`Recorded`: every step a ragged op (or torch op) that autograd records: the path of
  CPU tensors, autocast, activations the fused kernel does not have, and torch.compile;
* :class:`Saved`: the chosen implementations called straight, with everything the backward
  needs kept: :class:`LayerFunction`, one autograd node per layer in eager training, whose
  hand-written backward (:mod:`ragged.nn.layer_backward`) computes every gradient;
* :class:`Direct`: the implementations called straight with nothing kept (inference): no
  LayerNorm statistics or attention lse where an implementation can skip them
  (``extras["inference"]``, ``extras["packed_self_attention"]``), the residual added in place.

Implementations are chosen through :mod:`ragged.backends` (the one place a backend is chosen);
this module asks them for their declared extras, never for a backend's name.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ragged import backends
from ragged.backends import Implementation
from ragged.ops.attention import ATTENTION, AttentionArgs, dropout_seed, spec_of
from ragged.ops.fused import ACTIVATION_FNS, ADD_LAYER_NORM, BIAS_ACT, add_layer_norm_spec
from ragged.records.fused import AddLayerNormArgs, BiasActArgs

from .layer_backward import layer_backward
from .layer_spec import LayerKernels, LayerNeeds, LayerSpec, LayerWeights

__all__ = ["LayerKernels", "LayerSpec", "LayerWeights", "attention_dtype", "fused_backend", "run_layer", "run_stack"]

_linear = F.linear  # 2-D: addmm(b, x, w^T) or mm(x, w^T), the transpose taken in C++

FUSED_ACTIVATIONS = ("relu", "gelu", "gelu_tanh")


# --------------------------------------------------------------------------------------
# The layer, once


def _forward(
    spec: LayerSpec, x: torch.Tensor, cu: torch.Tensor, max_len: int, causal: bool, steps, saved: list | None = None
) -> torch.Tensor:
    """The layer on ``values x [T, d]`` through the kernel set ``steps``; with ``saved``, everything the
    backward reads is appended to it (see :data:`SAVED`)."""
    w = spec.weights
    p_attn, p1, p_ff, p2 = spec.dropout
    eps1, eps2 = spec.eps
    if spec.norm_first:
        h1, _, mean1, rstd1 = steps.norm(AddLayerNormArgs(x, None, w.norm1_w, w.norm1_b, eps1))
    else:
        h1, mean1, rstd1 = x, None, None
    a, attn = steps.attention(_linear(h1, w.in_w, w.in_b), cu, max_len, spec, causal, p_attn)
    sa, m1 = _linear(a, w.out_w, w.out_b), None
    if p1:
        sa, m1 = steps.dropout(sa, p1)
    if spec.norm_first:
        h2, x1, mean2, rstd2 = steps.norm(AddLayerNormArgs(sa, x, w.norm2_w, w.norm2_b, eps2, return_sum=True))
    else:
        x1, _, mean2, rstd2 = steps.norm(AddLayerNormArgs(sa, x, w.norm1_w, w.norm1_b, eps1))
        h2 = x1
    g, hid = steps.ff_in(h2, w.ff1_w, w.ff1_b, spec.activation)
    m2 = m3 = None
    if p_ff:
        g, m2 = steps.dropout(g, p_ff)
    f = _linear(g, w.ff2_w, w.ff2_b)
    if p2:
        f, m3 = steps.dropout(f, p2)
    if spec.norm_first:
        y, mean3, rstd3 = steps.residual(x1, f), None, None
    else:
        y, _, mean3, rstd3 = steps.norm(AddLayerNormArgs(f, x1, w.norm2_w, w.norm2_b, eps2))
    if saved is not None:
        saved += (x, cu, h1, mean1, rstd1, *attn, a, sa, m1, x1, h2, mean2, rstd2, hid, g, m2, f, m3, mean3, rstd3)
    return y


# The tensors _forward saves, in order (attn: q, k, v, o, lse of the attention).
SAVED = (
    "x",
    "cu",
    "h1",
    "mean1",
    "rstd1",
    "q",
    "k",
    "v",
    "o",
    "lse",
    "a",
    "sa",
    "m1",
    "x1",
    "h2",
    "mean2",
    "rstd2",
    "hid",
    "g",
    "m2",
    "f",
    "m3",
    "mean3",
    "rstd3",
)


class Saved:
    """The chosen implementations called straight, keeping what the backward reads."""

    def __init__(self, kernels: LayerKernels) -> None:
        self.kernels = kernels
        self._attention = kernels.attention.forward_fn
        self._norm = kernels.add_layer_norm.forward_fn
        self._bias_act = kernels.bias_act.forward_fn
        self.seed = 0

    def norm(self, args: AddLayerNormArgs):
        """``(y, s, mean, rstd)`` of the LayerNorm of ``args`` (``s``: the sum, where returned)."""
        return self._norm(args)

    def attention(self, qkv, cu, max_len, spec, causal, p):
        n_tok = qkv.shape[0]
        q, k, v = qkv.view(n_tok, 3, spec.heads, spec.head_dim).unbind(1)
        self.seed = dropout_seed(p, q.device)
        table, buckets = spec.position_bias or (None, None)
        args = AttentionArgs(
            q=q,
            k=k,
            v=v,
            cu_q=cu,
            cu_k=cu,
            max_q=max_len,
            max_k=max_len,
            causal=causal,
            scale=spec.scale,
            dropout_p=p,
            seed=self.seed,
            bias_table=table,
            bias_buckets=buckets,
        )
        o, lse = self._attention(args)
        return o.reshape(n_tok, spec.d_model), (q, k, v, o, lse)

    def ff_in(self, h, w1, b1, act):
        hid = _linear(h, w1, None)
        return self._bias_act(BiasActArgs(hid, b1, act)).out, hid

    @staticmethod
    def dropout(x, p):
        return torch.native_dropout(x, p, True)

    @staticmethod
    def residual(x1, f):
        return x1 + f


class Direct(Saved):
    """Inference: the implementations called straight, nothing kept, no dropout."""

    def __init__(self, kernels: LayerKernels) -> None:
        super().__init__(kernels)
        self._packed = kernels.attention.extra("packed_self_attention")
        self._lean_norm = kernels.add_layer_norm.extra("inference")
        self._lean_params: dict[tuple[int, int], bool] = {}  # per (weight, bias) of this forward

    def norm(self, args: AddLayerNormArgs):
        # The layer's activations are contiguous and of the weights' dtype (run_layer and
        # run_stack check it): per call only their addresses are left to check; the parameters
        # once per forward.
        lean = self._lean_norm
        if lean is not None:
            weight, bias, residual = args.weight, args.bias, args.residual
            key = (id(weight), id(bias))
            params_ok = self._lean_params.get(key)
            if params_ok is None:
                params_ok = self._lean_params[key] = all(
                    t is None or (t.dim() == 1 and t.stride(0) == 1 and not t.data_ptr() & 15) for t in (weight, bias)
                )
            if params_ok and not (args.x.data_ptr() | (0 if residual is None else residual.data_ptr())) & 15:
                y, s = lean(args)
                return y, s, None, None
        out = self._norm(args)
        return out.out, (out.sum if args.return_sum else None), None, None

    def attention(self, qkv, cu, max_len, spec, causal, p):
        bias = spec.position_bias
        if self._packed is not None and bias is None:
            return self._packed(qkv, cu, max_len, spec.heads, causal, spec.scale), ()
        n_tok = qkv.shape[0]
        q, k, v = qkv.view(n_tok, 3, spec.heads, spec.head_dim).unbind(1)
        table, buckets = bias or (None, None)
        args = AttentionArgs(
            q=q,
            k=k,
            v=v,
            cu_q=cu,
            cu_k=cu,
            max_q=max_len,
            max_k=max_len,
            causal=causal,
            scale=spec.scale,
            bias_table=table,
            bias_buckets=buckets,
        )
        return self._attention(args).out.reshape(n_tok, spec.d_model), ()

    @staticmethod
    def residual(x1, f):
        return x1.add_(f)  # x1 is the fresh sum of the second LayerNorm


class Recorded:
    """Every step an op autograd records: ``fused`` names the implementation of the fused
    per-token ops (None: torch's own LayerNorm, activation and dropout), ``attention`` and
    ``bias_act`` those of the attention and of the bias + activation (None: torch's)."""

    def __init__(self, fused: str | None, attention: str, bias_act: str | None) -> None:
        self.fused = fused
        self.attention_impl = attention
        self.bias_act_impl = bias_act

    def norm(self, args: AddLayerNormArgs):
        if self.fused is not None:
            # this path also runs weights the stack's choice was not made for (LayerNorm
            # parameters of another dtype, say): the implementation is confirmed for these operands
            spec = add_layer_norm_spec(args.x, args.residual, args.weight, args.bias)
            impl = self.fused
            if backends.implementation("add_layer_norm", impl).reasons(spec):
                impl = backends.select_spec("add_layer_norm", "auto", spec).name
            out = ADD_LAYER_NORM(args, impl)
            return out.out, (out.sum if args.return_sum else None), None, None
        x, residual = args.x, args.residual
        s = x if residual is None else x + residual
        return F.layer_norm(s, (s.shape[-1],), args.weight, args.bias, args.eps), s, None, None

    def attention(self, qkv, cu, max_len, spec, causal, p):
        n_tok = qkv.shape[0]
        q, k, v = qkv.view(n_tok, 3, spec.heads, spec.head_dim).unbind(1)
        with attention_dtype(q):
            table, buckets = spec.position_bias or (None, None)
            args = AttentionArgs(
                q=q,
                k=k,
                v=v,
                cu_q=cu,
                cu_k=cu,
                max_q=max_len,
                max_k=max_len,
                causal=causal,
                scale=spec.scale,
                dropout_p=p,
                seed=dropout_seed(p, q.device),
                bias_table=table,
                bias_buckets=buckets,
            )
            o = ATTENTION(args, self.attention_impl).out
        return o.reshape(n_tok, spec.d_model), ()

    def ff_in(self, h, w1, b1, act):
        if self.bias_act_impl is not None:
            return BIAS_ACT(BiasActArgs(_linear(h, w1), b1, act), self.bias_act_impl).out, None
        return (ACTIVATION_FNS[act] if isinstance(act, str) else act)(_linear(h, w1, b1)), None

    @staticmethod
    def dropout(x, p):
        return F.dropout(x, p, True), None

    @staticmethod
    def residual(x1, f):
        return x1 + f


# --------------------------------------------------------------------------------------
# One autograd node per layer


def attention_dtype(q: torch.Tensor) -> contextlib.AbstractContextManager:
    """The block around an attention call on projections ``q`` (and k, v): under autocast the
    projections already carry autocast's dtype (F.linear's output) and attention runs in it, as
    SDPA does, with autocast off so that its float32 internals stay float32; otherwise nothing.
    The layer core and ``ragged.nn.MultiheadAttention`` both call it."""
    device = q.device.type
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()


# LayerFunction.apply's operands before the weights, in order (backward returns a gradient for each).
_APPLY_OPERANDS = ("x", "cu", "spec", "kernels", "max_len", "causal", "table")


class LayerFunction(torch.autograd.Function):
    """``apply(x, cu, spec, kernels, max_len, causal, table, *spec.weights) -> y``: the layer's
    training forward as one autograd node (the weights, and the position bias's table or None,
    are passed again so that autograd sees them; a table shared by several layers gets the sum
    of their gradients)."""

    @staticmethod
    def forward(ctx, x, cu, spec, kernels, max_len, causal, table, *weights):
        steps = Saved(kernels)
        saved: list = []
        y = _forward(spec, x, cu, max_len, causal, steps, saved)
        ctx.spec, ctx.kernels, ctx.max_len, ctx.causal, ctx.seed = spec, kernels, max_len, causal, steps.seed
        ctx.save_for_backward(*saved, *weights)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable  # a second backward raises instead of a constant
    def backward(ctx, dy):
        tensors = ctx.saved_tensors
        saved = dict(zip(SAVED, tensors[: len(SAVED)]))
        weights = LayerWeights._make(tensors[len(SAVED) :])
        need = dict(zip(_APPLY_OPERANDS, ctx.needs_input_grad))
        need_weights = LayerNeeds._make(ctx.needs_input_grad[len(_APPLY_OPERANDS) :])
        grads = layer_backward(
            ctx.spec, weights, ctx.kernels, saved, ctx.max_len, ctx.causal, ctx.seed, dy, need["x"], need_weights
        )
        operands = {"x": grads.x, "table": grads.table if need["table"] else None}
        return (*(operands.get(name) for name in _APPLY_OPERANDS), *grads.weights)


# --------------------------------------------------------------------------------------
# Choosing how a layer runs


def choose_kernels(
    spec: LayerSpec, x: torch.Tensor, cu: torch.Tensor, max_len: int, causal: bool, fused: str, needs_grad: bool
) -> LayerKernels:
    """The implementations of a layer's steps for values like ``x [T, d]``: the attention chosen
    for the layer's heads (and dropout, and whether a gradient is needed), the LayerNorm of
    backend ``fused`` (chosen once per stack by :func:`fused_backend`), and the bias +
    activation for the feed-forward width (cached: its reasons depend on nothing else here)."""
    attention = attention_for(spec, x, cu, max_len, causal, needs_grad)
    width = spec.weights.ff1_w.shape[0]
    return LayerKernels(
        attention,
        backends.implementation("add_layer_norm", fused),
        bias_act_for(x, width, spec.weights.ff1_b, cast(str, spec.activation)),  # fused: a named activation
    )


def attention_for(
    spec: LayerSpec, x: torch.Tensor, cu: torch.Tensor, max_len: int, causal: bool, needs_grad: bool
) -> Implementation:
    """The attention implementation for the layer's heads over values like ``x [T, d]``: q, k and
    v are views of the packed in-projection, strided like ``x`` viewed as heads."""
    heads = x.view(x.shape[0], spec.heads, spec.head_dim)
    table, buckets = spec.position_bias or (None, None)
    args = AttentionArgs(
        q=heads,
        k=heads,
        v=heads,
        cu_q=cu,
        cu_k=cu,
        max_q=max_len,
        max_k=max_len,
        causal=causal,
        scale=spec.scale,
        dropout_p=spec.dropout[0],
        bias_table=table,
        bias_buckets=buckets,
    )
    return backends.select_spec("attention", None, spec_of(args, needs_grad))


_BIAS_ACT: dict[tuple, Implementation] = {}


def bias_act_for(x: torch.Tensor, width: int, bias: torch.Tensor | None, act: str) -> Implementation:
    """The bias + activation implementation for the ``[T, width]`` output of a Linear applied
    to ``x`` (contiguous and aligned, as every F.linear output is), chosen once per (device,
    dtypes, width, activation, backend selection) with a one-row probe."""
    key = (x.device, x.dtype, None if bias is None else bias.dtype, width, act, backends.get_backend())
    impl = _BIAS_ACT.get(key)
    if impl is None:
        impl = backends.select("bias_act", None, x.device, x.new_empty((1, width)), bias, act)
        if not torch.compiler.is_compiling():
            _BIAS_ACT[key] = impl
    return impl


def fused_backend(x: torch.Tensor) -> str | None:
    """Backend of the fused per-token ops for values ``x``, or None to run torch's own ops: off
    the GPU (there the fused ops would run their float32 reference, slower than torch's
    kernels) and under autocast (torch runs LayerNorm in float32 there, which the plain ops
    reproduce exactly)."""
    if x.device.type != "cuda" or torch.is_autocast_enabled("cuda"):
        return None
    impl = backends.select("add_layer_norm", None, x.device, x, None, None, None)
    return impl.name if impl.backend != "torch" else None


def weights_match_input(spec: LayerSpec, x: torch.Tensor, plain_only: bool) -> tuple[bool, bool]:
    """``(ok, needs_grad)``: whether every weight is a tensor of ``x``'s dtype and device (with
    ``plain_only``, a plain Tensor or Parameter: no subclass), and whether one needs a gradient."""
    dtype, index = x.dtype, x.get_device()
    grad = torch.is_grad_enabled()
    needs_grad = grad and x.requires_grad
    parameter = torch.nn.Parameter
    for p in spec.weights:
        if p is not None:
            if p.dtype != dtype or p.get_device() != index:
                return False, needs_grad
            if plain_only and type(p) is not torch.Tensor and type(p) is not parameter:
                return False, needs_grad
            needs_grad = needs_grad or (grad and p.requires_grad)
    return True, needs_grad


_AHEAD: set[tuple] = set()  # the layer variants whose kernels _compile_ahead compiled
_AHEAD_ON = os.environ.get("RAGGED_COMPILE_AHEAD", "1") != "0"  # 0: compile each kernel as it first launches


def _variant(spec: LayerSpec, x: torch.Tensor, max_len: int, causal: bool, kernels: LayerKernels) -> tuple:
    """What a layer's kernel variants depend on (the key of :data:`_AHEAD`, with the pass's kind)."""
    w = spec.weights
    return (
        id(kernels.attention),
        id(kernels.add_layer_norm),
        id(kernels.bias_act),
        x.dtype,
        x.device,
        x.shape[1],
        spec.heads,
        spec.norm_first,
        spec.activation,
        tuple(p > 0 for p in spec.dropout),
        tuple(t is None for t in w),
        w.ff1_w.shape[0],
        causal,
        max_len.bit_length(),
        spec.position_bias is None,
    )


def _ahead(key: tuple, x: torch.Tensor, body: Callable[[], object], what: str) -> None:
    """``body()`` once per ``key`` in a pass where every kernel launch compiles instead of
    running (Triton's and NVRTC's compiles at once on thread pools: :func:`ragged.warmup.compile_only`),
    so that a fresh process's first call waits for the slowest compile instead of their sum. The
    pass's outputs are dropped; nothing the caller sees changes (no gradient is stored, and the
    random state that dropout's seed draws from is put back). Not under CUDA-graph capture; off
    with the environment variable ``RAGGED_COMPILE_AHEAD=0``."""
    if not _AHEAD_ON or x.device.type != "cuda" or key in _AHEAD:
        return
    if torch.cuda.is_current_stream_capturing():
        return
    _AHEAD.add(key)  # once, whether the pass compiles or fails
    from ragged.warmup import compile_only

    compiling = compile_only()
    if compiling is None:  # no Triton: nothing to compile ahead
        return
    devices = [x.device.index if x.device.index is not None else torch.cuda.current_device()]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices), compiling:
            body()
    except Exception as exc:  # the real call compiles as it launches (and raises what is wrong)
        warnings.warn(
            f"ragged.nn: compiling a layer's kernels ahead of its first {what} failed "
            f"({type(exc).__name__}: {exc}); they compile as they launch",
            RuntimeWarning,
            stacklevel=4,
        )


def _compile_ahead(
    spec: LayerSpec, x: torch.Tensor, cu: torch.Tensor, max_len: int, causal: bool, kernels: LayerKernels
) -> None:
    """Before the first training call of a layer variant (kernels, dtype, shapes, dropout on or
    off, the longest sequence's power of two): one pass of its forward and backward compiling
    its kernels (:func:`_ahead`)."""

    def body() -> None:
        w = spec.weights
        saved: list = []
        steps = Saved(kernels)
        y = _forward(spec, x, cu, max_len, causal, steps, saved)
        need = LayerNeeds._make(t is not None and t.requires_grad for t in w)
        layer_backward(
            spec,
            w,
            kernels,
            dict(zip(SAVED, saved)),
            max_len,
            causal,
            steps.seed,
            torch.empty_like(y),
            x.requires_grad,
            need,
        )

    _ahead(("training", *_variant(spec, x, max_len, causal, kernels)), x, body, "training step")


def run_layer(
    spec: LayerSpec, x: torch.Tensor, cu: torch.Tensor, max_len: int, causal: bool, fused: str | None, eager: bool
) -> torch.Tensor:
    """One layer on ``values x [T, d]``: one autograd node in eager training, the kernels called
    straight in inference, every op recorded otherwise (see the module docstring). ``fused``:
    :func:`fused_backend` of the stack; ``eager``: no tracing, fake tensors or dispatch modes."""
    if fused is not None and eager and spec.fused_activation and x.shape[0] and x.is_contiguous():
        ok, needs_grad = weights_match_input(spec, x, plain_only=False)
        if ok:
            kernels = choose_kernels(spec, x, cu, max_len, causal, fused, needs_grad)
            if needs_grad:
                _compile_ahead(spec, x, cu, max_len, causal, kernels)
                table = None if spec.position_bias is None else spec.position_bias[0]
                return LayerFunction.apply(x, cu, spec, kernels, max_len, causal, table, *spec.weights)
            if not needs_grad:
                if spec.dropout == (0.0, 0.0, 0.0, 0.0) and weights_match_input(spec, x, plain_only=True)[0]:
                    return _forward(spec, x, cu, max_len, causal, Direct(kernels))
                return _forward(spec, x, cu, max_len, causal, Saved(kernels))
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or any(p is not None and p.requires_grad for p in spec.weights)
    )
    attention = attention_for(spec, x, cu, max_len, causal, needs_grad).name
    bias_act = None
    if fused is not None and spec.fused_activation:
        activation = cast(str, spec.activation)  # spec.fused_activation: a named activation
        bias_act = bias_act_for(x, spec.weights.ff1_w.shape[0], spec.weights.ff1_b, activation).name
    return _forward(spec, x, cu, max_len, causal, Recorded(fused, attention, bias_act))


def run_stack(
    specs: list[LayerSpec], x: torch.Tensor, cu: torch.Tensor, max_len: int, causal: bool, fused: str
) -> torch.Tensor | None:
    """Inference through a stack of layers with the kernels called straight and the choices
    made once per distinct layer shape; None when that path does not apply (a gradient is
    needed, dropout is active, an activation the fused kernel lacks, a weight of another dtype
    or device or a tensor subclass, no tokens): the caller then runs the layers one by one."""
    if x.shape[0] == 0 or not x.is_contiguous() or (torch.is_grad_enabled() and x.requires_grad):
        return None
    sets: dict[tuple, Direct] = {}
    plan = []
    for spec in specs:
        if not spec.fused_activation or spec.dropout != (0.0, 0.0, 0.0, 0.0):
            return None
        ok, needs_grad = weights_match_input(spec, x, plain_only=True)
        if not ok or needs_grad:
            return None
        key = (
            spec.heads,
            spec.head_dim,
            spec.activation,
            spec.weights.ff1_w.shape[0],
            None if spec.weights.ff1_b is None else spec.weights.ff1_b.dtype,
            spec.position_bias is None,
        )
        direct = sets.get(key)
        if direct is None:
            direct = sets[key] = Direct(choose_kernels(spec, x, cu, max_len, causal, fused, False))
        plan.append((spec, direct))
    seen: set[int] = set()
    for spec, direct in plan:  # each distinct layer's kernels compiled at once, ahead of the first call
        if id(direct) not in seen:
            seen.add(id(direct))
            key = ("inference", *_variant(spec, x, max_len, causal, direct.kernels))
            _ahead(key, x, functools.partial(_forward, spec, x, cu, max_len, causal, direct), "inference")
    for spec, direct in plan:
        x = _forward(spec, x, cu, max_len, causal, direct)
    return x


# --------------------------------------------------------------------------------------
# Modules with hooks (FSDP2 units, user hooks)


def plain_call(module: nn.Module) -> bool:
    """True when calling ``module`` would only run its forward: no hooks on it, no global
    module hooks (then an encoder may run the layer's body directly)."""
    from torch.nn.modules import module as m

    return not (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or m._global_forward_hooks
        or m._global_forward_pre_hooks
        or m._global_backward_hooks
        or m._global_backward_pre_hooks
    )


def call_with_hooks(module: nn.Module, body: Callable, *args):
    """``module(*args)`` with ``body`` in place of its forward: the hooks registered on the
    module run around ``body`` as around its own forward. An FSDP2 unit (``fully_shard``)
    gathers its parameters before ``body`` reads them, reshards after, and registers its
    backward hooks on the tensors that cross the call; an encoder that reads a layer's
    parameters without calling the layer (the fused paths do) calls it through here when
    :func:`plain_call` says it has hooks."""
    own = module.__dict__.get("forward", _NONE)
    module.forward = body
    try:
        return module(*args)
    finally:
        if own is _NONE:
            del module.forward
        else:
            module.forward = own


_NONE = object()
