"""A training step of one encoder layer as one autograd node.

In eager training a ``TransformerEncoderLayer`` records about thirty autograd nodes
(linears and their transposes, views, the attention, three dropouts, two residual
LayerNorms, bias + activation) and the engine spends host time on each of them, forward
and backward. :class:`_LayerFunction` runs the same computation with the same kernels,
saves what the backward needs, and computes every gradient in a hand-written backward:

* forward, post-norm: ``qkv = x W_in^T + b_in``; attention; ``sa = o W_out^T + b_out``;
  ``y1 = LN1(drop1(sa) + x)``; ``g = act(y1 W_1^T + b_1)`` (one fused pass); ``f = drop(g)
  W_2^T + b_2``; ``y = LN2(drop2(f) + y1)``;
* pre-norm: ``h1 = LN1(x)``, the attention block on ``h1``, ``(h2, x1) = (LN2(s), s)`` with
  ``s = drop1(sa) + x`` (one pass returns both), ``y = x1 + drop2(FF(h2))``;
* backward: the residual gradients enter the GEMMs as their accumulators (``addmm``), the
  LayerNorm backward returns the gradient of both summands of its sum (with the Triton
  kernels also the gradient through the dropout in front of it, and that gradient's sum, the
  bias gradient of the Linear before the dropout, in the same pass; the bias + activation
  backward takes the feed-forward dropout back the same way), the per-group partial column
  sums of those launches (LayerNorm weights and biases, the Linear biases) go to one fp32
  buffer reduced by one ``sum`` at the end (:class:`_Sums`), and the attention backward
  writes dq, dk, dv into one ``[T, 3, H, D]`` buffer, so the input projection's gradient
  needs no stacking copy.

Dropout masks come from ``torch.native_dropout`` (torch's generator), the attention's from
its kernels' seed. The backends are chosen by the caller (the same choices the per-op path
makes), so on a CPU with the torch backends the function computes exactly what the per-op
path computes (the tests compare them in float64).
"""

from __future__ import annotations

import math

import torch

from ..ops.attention import _backward_backend
from ..ops.attention import _impl as _attention_impl
from ..ops.attention import _seed as _attention_seed
from ..ops.fused import _add_layer_norm_triton_backward, _bias_act_triton_backward
from ..ops.fused import _impl as _fused_impl


def _ln_dropout_backward_triton(*args):
    from ..kernels.triton.fused import add_layer_norm_dropout_backward

    return add_layer_norm_dropout_backward(*args)


def _bias_act_dropout_backward_triton(*args, **kwargs):
    from ..kernels.triton.fused import bias_act_backward

    return bias_act_backward(*args, **kwargs)


_linear = torch.nn.functional.linear  # 2-D: addmm(b, x, w^T) or mm(x, w^T), the transpose taken in C++


def _dropout(x: torch.Tensor, p: float):
    if p == 0.0:
        return x, None
    return torch.native_dropout(x, p, True)


def _dropout_backward(g: torch.Tensor, mask: torch.Tensor | None, p: float) -> torch.Tensor:
    return g if mask is None else torch.ops.aten.native_dropout_backward(g, mask, 1.0 / (1.0 - p))


def _bias_grad(g: torch.Tensor, b: torch.Tensor | None, need: bool) -> torch.Tensor | None:
    return g.sum(0).to(b.dtype) if need and b is not None else None


def _ln_dropout_backward(ln_bwd, dy, ds, a, b, weight, bias, mean, rstd, need_weight, need_bias, mask, p,
                         linear_bias, need_linear_bias, sums=None):
    """Backward of ``LN(dropout(z) + ...)``: ``(ds_total, dz, dweight, dbias, dlinear_bias)``
    with ``dlinear_bias`` the sum of ``dz`` over the tokens (the bias of the Linear that made
    ``z``). The Triton backward does it in one pass; any other backend: its LayerNorm
    backward, then torch's dropout backward and sum. ``sums`` (a :class:`_Sums`, Triton
    only): the three column sums are left in its buffer and come back as None."""
    colsum = linear_bias.dtype if need_linear_bias and linear_bias is not None else None
    if sums is not None:
        col = sums.take(need_weight and weight is not None, need_bias and bias is not None, colsum is not None)
        return _ln_dropout_backward_triton(dy, ds, a, b, weight, bias, mean, rstd, need_weight, need_bias, mask, p,
                                           colsum, sums.part, col)
    if ln_bwd is _add_layer_norm_triton_backward:
        return _ln_dropout_backward_triton(dy, ds, a, b, weight, bias, mean, rstd, need_weight, need_bias, mask, p,
                                           colsum)
    dsum, dweight, dbias = ln_bwd(dy, ds, a, b, weight, bias, mean, rstd, need_weight, need_bias)
    dz = _dropout_backward(dsum, mask, p)
    return dsum, dz, dweight, dbias, _bias_grad(dz, linear_bias, colsum is not None)


def _act_dropout_backward(ba_bwd, g, mask, p, hid, b1, act, need_b1, sums=None):
    """Backward of ``dropout(act(hid + b1))`` for the gradient ``g`` of its output: ``(dhid,
    db1)``; the Triton backward takes the dropout back in the same pass. ``sums``: as for
    :func:`_ln_dropout_backward` (``db1`` left in its buffer)."""
    if sums is not None:
        if need_b1 and b1 is not None:
            return _bias_act_dropout_backward_triton(g, hid, b1, act, True, mask=mask, p=p, part=sums.part,
                                                     part_col=sums.take(True))
        return _bias_act_dropout_backward_triton(g, hid, b1, act, False, mask=mask, p=p)
    if ba_bwd is _bias_act_triton_backward and mask is not None:
        return _bias_act_dropout_backward_triton(g, hid, b1, act, need_b1, mask=mask, p=p)
    return ba_bwd(_dropout_backward(g, mask, p), hid, b1, act, need_b1)


class _Sums:
    """One fp32 buffer ``[groups, W]`` for the per-group partial column sums of a layer's
    backward launches (LayerNorm weight and bias, the bias of each Linear before a dropout,
    the feed-forward bias), reduced by one ``sum`` at the end: three reductions, their casts
    and buffers become one of each. ``take(*wanted)`` hands out the next columns, F per
    wanted sum (F: the width of the call that takes them)."""

    def __init__(self, widths: list[int], device: torch.device) -> None:
        from ..kernels.triton.fused import partial_groups

        self.widths = widths  # one per sum, in the order the launches write them
        self.part = torch.empty((partial_groups(device), sum(widths)), dtype=torch.float32, device=device)
        self._col = 0
        self._next = 0

    def take(self, *wanted: bool) -> int:
        col = self._col
        for flag in wanted:
            if flag:
                self._col += self.widths[self._next]
                self._next += 1
        return col

    def reduce(self, dtype: torch.dtype) -> list[torch.Tensor]:
        return list(self.part.sum(0).to(dtype).split(self.widths))


def _shared_sums(ln_bwd, ba_bwd, x: torch.Tensor, widths: list[int]) -> _Sums | None:
    """A :class:`_Sums` with these widths (one per wanted sum, in launch order) when the
    layer's LayerNorm and bias + activation backwards are the Triton kernels and its rows fit
    one pass; None otherwise (each launch then reduces its own sums)."""
    if ln_bwd is not _add_layer_norm_triton_backward or ba_bwd is not _bias_act_triton_backward or not widths:
        return None
    from ..kernels.triton.fused import layer_norm_backward_fuses

    if not layer_norm_backward_fuses(x.shape[1], x.dtype):
        return None
    return _Sums(widths, x.device)


class _LayerFunction(torch.autograd.Function):
    """``forward(ctx, x, cu, config, *params) -> y``; ``config``: see :func:`layer_forward`."""

    @staticmethod
    def forward(ctx, x, cu, config, in_w, in_b, out_w, out_b, n1w, n1b, w1, b1, w2, b2, n2w, n2b):
        (norm_first, heads, max_len, causal, scale, p_attn, p1, p_ff, p2, eps1, eps2, act, attn_backend,
         ln_backend, act_backend) = config
        n_tok, d = x.shape
        ln_fwd = _fused_impl("add_layer_norm", ln_backend)[0]
        ba_fwd = _fused_impl("bias_act", act_backend)[0]
        if norm_first:
            h1, _, mean1, rstd1 = ln_fwd(x, None, n1w, n1b, eps1, False)
        else:
            h1, mean1, rstd1 = x, None, None
        qkv = _linear(h1, in_w, in_b)
        q, k, v = qkv.view(n_tok, 3, heads, d // heads).unbind(1)
        seed = _attention_seed(p_attn)
        o, lse = _attention_impl(attn_backend)[0](q, k, v, cu, cu, max_len, max_len, causal, scale, p_attn, seed)
        a = o.reshape(n_tok, d)
        sa, m1 = _dropout(_linear(a, out_w, out_b), p1)
        if norm_first:
            h2, x1, mean2, rstd2 = ln_fwd(sa, x, n2w, n2b, eps2, True)
        else:
            x1, _, mean2, rstd2 = ln_fwd(sa, x, n1w, n1b, eps1, False)
            h2 = x1
        hid = _linear(h2, w1, None)
        g, m2 = _dropout(ba_fwd(hid, b1, act), p_ff)
        f, m3 = _dropout(_linear(g, w2, b2), p2)
        if norm_first:
            y = x1 + f
            mean3 = rstd3 = None
        else:
            y, _, mean3, rstd3 = ln_fwd(f, x1, n2w, n2b, eps2, False)
        if isinstance(ctx, _NoSave):
            return y
        ctx.config = config
        ctx.seed = seed
        ctx.save_for_backward(x, cu, h1, mean1, rstd1, q, k, v, o, lse, a, sa, m1, x1, h2, mean2, rstd2, hid, g, m2,
                              f, m3, mean3, rstd3, in_w, in_b, out_w, out_b, n1w, n1b, w1, b1, w2, b2, n2w, n2b)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable  # a second backward raises instead of a constant
    def backward(ctx, dy):
        (norm_first, heads, max_len, causal, scale, p_attn, p1, p_ff, p2, eps1, eps2, act, attn_backend,
         ln_backend, act_backend) = ctx.config
        (x, cu, h1, mean1, rstd1, q, k, v, o, lse, a, sa, m1, x1, h2, mean2, rstd2, hid, g, m2, f, m3, mean3, rstd3,
         in_w, in_b, out_w, out_b, n1w, n1b, w1, b1, w2, b2, n2w, n2b) = ctx.saved_tensors
        need = ctx.needs_input_grad
        (need_x, _, _, need_in_w, need_in_b, need_out_w, need_out_b, need_n1w, need_n1b, need_w1, need_b1, need_w2,
         need_b2, need_n2w, need_n2b) = need
        ln_bwd = _fused_impl("add_layer_norm", ln_backend)[1]
        ba_bwd = _fused_impl("bias_act", act_backend)[1]
        dy = dy.contiguous()
        n_tok, d = x.shape
        dn1w = dn1b = dn2w = dn2b = None
        # the column sums (LayerNorm weights and biases, Linear biases) of the Triton launches
        # go to one buffer, reduced once at the end (see _Sums); wanted: in launch order
        want_n1 = (need_n1w and n1w is not None, need_n1b and n1b is not None)
        want_n2 = (need_n2w and n2w is not None, need_n2b and n2b is not None)
        want_b1, want_b2 = need_b1 and b1 is not None, need_b2 and b2 is not None
        want_out_b = need_out_b and out_b is not None
        if norm_first:
            wanted = [want_b1, *want_n2, want_out_b, *want_n1]
        else:
            wanted = [*want_n2, want_b2, want_b1, *want_n1, want_out_b]
        widths = [w1.shape[0] if i == (0 if norm_first else 3) else d for i, f in enumerate(wanted) if f]
        sums = _shared_sums(ln_bwd, ba_bwd, x, widths)
        # feed-forward block; d_res: the gradient of the block's residual input (x1). Each
        # LayerNorm backward also takes its input's dropout back and sums the result into the
        # bias gradient of the Linear before that dropout (one pass with the Triton kernels).
        if norm_first:
            d_res = dy
            df = _dropout_backward(dy, m3, p2)
            db2 = _bias_grad(df, b2, need_b2)
        else:
            d_res, df, dn2w, dn2b, db2 = _ln_dropout_backward(ln_bwd, dy, None, f, x1, n2w, n2b, mean3, rstd3,
                                                              need_n2w, need_n2b, m3, p2, b2, need_b2, sums)
        dw2 = torch.mm(df.t(), g) if need_w2 else None
        dhid, db1 = _act_dropout_backward(ba_bwd, torch.mm(df, w2), m2, p_ff, hid, b1, act, need_b1, sums)
        dw1 = torch.mm(dhid.t(), h2) if need_w1 else None
        # attention block; ds: the gradient of both summands of s = drop1(sa) + x, dsa: of the
        # output projection (through drop1)
        if norm_first:
            # h2 = LN2(s), x1 = s: the LayerNorm backward adds the returned sum's gradient
            dh2 = torch.mm(dhid, w1)
            ds, dsa, dn2w, dn2b, db_out = _ln_dropout_backward(ln_bwd, dh2, d_res, x1, None, n2w, n2b, mean2,
                                                               rstd2, need_n2w, need_n2b, m1, p1, out_b,
                                                               need_out_b, sums)
        else:
            dx1 = torch.addmm(d_res, dhid, w1)
            ds, dsa, dn1w, dn1b, db_out = _ln_dropout_backward(ln_bwd, dx1, None, sa, x, n1w, n1b, mean2, rstd2,
                                                               need_n1w, need_n1b, m1, p1, out_b, need_out_b, sums)
        dw_out = torch.mm(dsa.t(), a) if need_out_w else None
        da = torch.mm(dsa, out_w).view(n_tok, heads, d // heads)
        dqkv = torch.empty((n_tok, 3, heads, d // heads), dtype=q.dtype, device=q.device)
        grads = dqkv.unbind(1)
        bwd = _attention_impl(_backward_backend(attn_backend))[1]
        if attn_backend in ("cuda", "triton"):
            bwd(da, q, k, v, o, lse, cu, cu, max_len, max_len, causal, scale, p_attn, ctx.seed, grads)
        else:
            for buf, grad in zip(grads, bwd(da, q, k, v, o, lse, cu, cu, max_len, max_len, causal, scale, p_attn,
                                            ctx.seed)):
                buf.copy_(grad)
        dqkv = dqkv.view(n_tok, 3 * d)
        dw_in = torch.mm(dqkv.t(), h1) if need_in_w else None
        db_in = _bias_grad(dqkv, in_b, need_in_b)
        dx = None
        if need_x or (norm_first and any(want_n1)):
            if norm_first:
                dh1 = torch.mm(dqkv, in_w)
                if sums is not None:
                    dx_ln = _ln_dropout_backward(ln_bwd, dh1, None, x, None, n1w, n1b, mean1, rstd1, need_n1w,
                                                 need_n1b, None, 0.0, None, False, sums)[0]
                else:
                    dx_ln, dn1w, dn1b = ln_bwd(dh1, None, x, None, n1w, n1b, mean1, rstd1, need_n1w, need_n1b)
                dx = ds + dx_ln if need_x else None
            else:
                dx = torch.addmm(ds, dqkv, in_w)
        if sums is not None:  # one reduction for every column sum above
            reduced = iter(sums.reduce(x.dtype))
            if norm_first:
                names = ["b1", "n2w", "n2b", "out_b", "n1w", "n1b"]
            else:
                names = ["n2w", "n2b", "b2", "b1", "n1w", "n1b", "out_b"]
            got = {name: next(reduced) for name, flag in zip(names, wanted) if flag}
            db1, db_out = got.get("b1"), got.get("out_b")
            dn1w, dn1b, dn2w, dn2b = got.get("n1w"), got.get("n1b"), got.get("n2w"), got.get("n2b")
            if not norm_first:
                db2 = got.get("b2")
        return (dx, None, None, dw_in, db_in, dw_out, db_out, dn1w, dn1b, dw1, db1, dw2, db2, dn2w, dn2b)


class _NoSave:
    """Stands in for the autograd context when nothing needs a gradient (inference)."""

    def save_for_backward(self, *tensors) -> None:
        pass


def layer_forward(layer, x: torch.Tensor, cu: torch.Tensor, max_len: int, causal: bool, act: str,
                  attn_backend: str, ln_backend: str, act_backend: str, needs_grad: bool = True) -> torch.Tensor:
    """``layer``'s forward on ``values x [T, d]``: one autograd node (see the module
    docstring) when ``needs_grad``, else the same kernels called straight, with nothing
    saved (inference: no per-op wrappers, checks or RaggedTensors between the kernels);
    ``act``: a :func:`ragged.bias_act` activation name."""
    attn = _child(layer, "self_attn")
    training = layer.training
    norm1, norm2 = _child(layer, "norm1"), _child(layer, "norm2")
    p = (attn.dropout, _child(layer, "dropout1").p, _child(layer, "dropout").p, _child(layer, "dropout2").p) \
        if training else (0.0, 0.0, 0.0, 0.0)
    config = (layer.norm_first, attn.num_heads, max_len, causal, 1.0 / math.sqrt(attn.head_dim), *p, norm1.eps,
              norm2.eps, act, attn_backend, ln_backend, act_backend)
    params = layer_params(layer)
    if not needs_grad:
        return _LayerFunction.forward(_NoSave(), x, cu, config, *params)
    return _LayerFunction.apply(x, cu, config, *params)


# --------------------------------------------------------------------------------------
# Inference: the kernels called straight, with as little host work between them as possible
#
# At small batch an encoder forward is bound by the host (a 12-layer BERT-base forward on 256
# short sequences is about 2 ms of GPU work and, through the general path, about 2.8 ms of
# host time on the H200 machine). The direct path below runs a layer as its eight launches
# (four GEMMs, attention, two residual LayerNorms, bias + activation) with the choices made
# once per stack: the attention reads q, k, v in place from the input projection's output and
# writes no lse, the LayerNorms write no statistics, no views or RaggedTensors are built.

_MISSING = object()


def _param(module, name: str):
    # The module's own dict first (Module.__getattr__ costs about 0.3 us a read); a name that
    # is not a plain parameter there (a parametrization, say) goes through getattr.
    value = module._parameters.get(name, _MISSING)
    return getattr(module, name) if value is _MISSING else value


def _child(module, name: str):
    value = module._modules.get(name, _MISSING)
    return getattr(module, name) if value is _MISSING else value


def layer_params(layer) -> tuple:
    """``(in_w, in_b, out_w, out_b, n1w, n1b, w1, b1, w2, b2, n2w, n2b)`` of a layer (None
    where it has no bias), in :class:`_LayerFunction`'s order."""
    attn = _child(layer, "self_attn")
    out_proj = _child(attn, "out_proj")
    norm1, norm2 = _child(layer, "norm1"), _child(layer, "norm2")
    linear1, linear2 = _child(layer, "linear1"), _child(layer, "linear2")
    return (_param(attn, "in_proj_weight"), _param(attn, "in_proj_bias"), _param(out_proj, "weight"),
            _param(out_proj, "bias"), _param(norm1, "weight"), _param(norm1, "bias"), _param(linear1, "weight"),
            _param(linear1, "bias"), _param(linear2, "weight"), _param(linear2, "bias"), _param(norm2, "weight"),
            _param(norm2, "bias"))


class InferenceKernels:
    """The attention, add + LayerNorm and bias + activation of an inference stack, chosen once:
    ``attention(qkv, cu, max_len, heads, causal, scale) -> [T, d]``, ``layer_norm(x, residual,
    weight, bias, eps, return_sum) -> (y, s or None)``, ``bias_act(h, bias, act) -> g``.

    ``direct_layer_norm``: the CUDA LayerNorm without statistics, for layers whose LayerNorm
    parameters it takes (:func:`direct_layer_norm_takes`); other layers use ``layer_norm``."""

    def __init__(self, attn_backend: str, ln_backend: str, act_backend: str) -> None:
        self.attn_backend = attn_backend
        self.ln_backend = ln_backend
        self.bias_act = _fused_impl("bias_act", act_backend)[0]
        self._attention = _attention_impl(attn_backend)[0]
        self._ln = _fused_impl("add_layer_norm", ln_backend)[0]
        if attn_backend == "cuda":
            from ragged.kernels.cuda.attention import packed_self_attention

            self.attention = packed_self_attention
        else:
            self.attention = self._views_attention
        if ln_backend == "cuda":
            from ragged.kernels.cuda.fused import add_layer_norm_inference

            self.direct_layer_norm = add_layer_norm_inference
        else:
            self.direct_layer_norm = self.layer_norm

    def _views_attention(self, qkv, cu, max_len, heads, causal, scale):
        n_tok, width = qkv.shape
        q, k, v = qkv.view(n_tok, 3, heads, width // (3 * heads)).unbind(1)
        o = self._attention(q, k, v, cu, cu, max_len, max_len, causal, scale, 0.0, 0)[0]
        return o.reshape(n_tok, width // 3)

    def layer_norm(self, x, residual, weight, bias, eps, return_sum):
        y, s = self._ln(x, residual, weight, bias, eps, return_sum)[:2]
        return y, (s if return_sum else None)


def direct_layer_norm_takes(dtype: torch.dtype, *params) -> bool:
    """Whether the direct CUDA LayerNorm takes these LayerNorm parameters (None: absent): 1-D,
    contiguous, x's dtype, 16-byte aligned."""
    ptrs = 0
    for p in params:
        if p is not None:
            if p.dtype != dtype or p.dim() != 1 or p.stride(0) != 1:
                return False
            ptrs |= p.data_ptr()
    return not ptrs & 15


def infer_layer(x: torch.Tensor, cu: torch.Tensor, max_len: int, causal: bool, config: tuple, params: tuple,
                kernels: InferenceKernels) -> torch.Tensor:
    """One layer's inference forward on ``values x [T, d]`` (contiguous, 16-byte aligned when
    the direct LayerNorm runs): ``config = (norm_first, heads, scale, eps1, eps2, act,
    direct_ln)``, ``params`` as :func:`layer_params`; no dropout."""
    norm_first, heads, scale, eps1, eps2, act, direct_ln = config
    in_w, in_b, out_w, out_b, n1w, n1b, w1, b1, w2, b2, n2w, n2b = params
    ln = kernels.direct_layer_norm if direct_ln else kernels.layer_norm
    linear = torch.nn.functional.linear
    if norm_first:
        h1 = ln(x, None, n1w, n1b, eps1, False)[0]
        a = kernels.attention(linear(h1, in_w, in_b), cu, max_len, heads, causal, scale)
        h2, s = ln(linear(a, out_w, out_b), x, n2w, n2b, eps2, True)
        return s.add_(linear(kernels.bias_act(linear(h2, w1), b1, act), w2, b2))
    a = kernels.attention(linear(x, in_w, in_b), cu, max_len, heads, causal, scale)
    x1 = ln(linear(a, out_w, out_b), x, n1w, n1b, eps1, False)[0]
    f = linear(kernels.bias_act(linear(x1, w1), b1, act), w2, b2)
    return ln(f, x1, n2w, n2b, eps2, False)[0]
