"""The decoder layer of :mod:`ragged.nn.decoder_layer` as one autograd node, with a hand-written
backward: what eager decoder training runs (:func:`ragged.nn.decoder_layer.run_stack`).

:class:`DecoderLayerFunction` runs the layer's steps by calling the chosen implementations
straight (no autograd record per op) and keeps what its backward reads; the backward computes
every gradient in one pass, in the reverse order of the forward:

* the MLP: the down projection's GEMMs, the gated activation's backward, the gate/up
  projection's GEMMs on the one concatenated weight;
* the second RMSNorm's backward takes the gradient of its sum from the next layer (``ds``) as
  its ``grad_sum``, so the residual stream's gradient flows through it without an extra add;
* the attention: the out projection's GEMMs, the attention backward, the rotary backward (the
  rotation by the opposite angle) on the q and k heads at once, the q/k head norms' backward
  (Qwen3, Gemma3), and one GEMM of the QKV projection for the input's gradient and one for the
  concatenated weight's, split into the q, k and v weights' gradients;
* the first RMSNorm's backward, whose summands (the branch ``x`` and the stream ``residual``)
  both get the gradient of its sum.

Weights enter as operands (so that autograd sees them: LoRA's effective weights, tied or shared
tensors get their gradient through the graph as usual); the concatenations of Q/K/V and
gate/up weights are made per call, so no write to a Parameter goes unseen.

The node runs where every operand has one dtype and autocast is off (what the decoder core's
dtype promotion would otherwise decide per op), under no tracing or dispatch mode; elsewhere
the layer is recorded op by op (:func:`ragged.nn.decoder_layer.run_layer`), the same math.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ragged import backends
from ragged.ops.attention import ATTENTION, effective_window, spec_of
from ragged.ops.gated import GATED_ACT, gated_act_spec
from ragged.ops.rms_norm import ADD_RMS_NORM, add_rms_norm_spec
from ragged.ops.rotary import ROTARY_EMBEDDING, rotary_embedding_spec
from ragged.records.attention import AttentionArgs, AttentionBackwardInputs
from ragged.records.gated import GatedActArgs, GatedActBackwardInputs
from ragged.records.rms_norm import AddRmsNormArgs, AddRmsNormBackwardInputs
from ragged.records.rotary import RotaryEmbeddingArgs, RotaryEmbeddingBackwardInputs

__all__ = ["DecoderKernels", "DecoderLayerFunction", "node_applies"]

_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter


class DecoderKernels:
    """The implementation names a stack's layers run, chosen on first use from the operands of
    that step (one choice per stack call: every layer of a call has the same shapes; the
    attention's per window and direction, which differ between layers)."""

    def __init__(self) -> None:
        self.names: dict[Any, str] = {}

    def pick(self, key: Any, op: str, spec_fn, *operands) -> str:
        name = self.names.get(key)
        if name is None:
            name = self.names[key] = backends.select_spec(op, None, spec_fn(*operands)).name
        return name


def node_applies(x: torch.Tensor, residual: torch.Tensor | None, weights: tuple) -> bool:
    """Whether the one-node layer takes these operands: a gradient is wanted, every tensor is a
    plain tensor of x's dtype, autocast is off and nothing traces."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    if torch.is_autocast_enabled(x.device.type):
        return False
    dtype, grad = x.dtype, x.requires_grad
    for t in (x, residual, *weights):
        if t is None:
            continue
        if type(t) is not _Tensor and type(t) is not _Parameter:
            return False
        if t.dtype != dtype:
            return False
        grad = grad or t.requires_grad
    return grad


def _attention_args(spec: Any, q, k, v, cu, max_len: int) -> AttentionArgs:
    if spec.window is None:
        window = (-1, -1)
    else:
        window = (spec.window - 1, 0 if spec.causal else spec.window - 1)
    left, right = effective_window(window, spec.causal, max_len, max_len)
    return AttentionArgs(
        q=q, k=k, v=v, cu_q=cu, cu_k=cu, max_q=max_len, max_k=max_len, causal=spec.causal, scale=spec.scale,
        window_left=left, window_right=right,
    )  # fmt: skip


def _bias(weights: tuple, biases: tuple) -> torch.Tensor | None:
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])


def _head_norm(x: torch.Tensor, weight: torch.Tensor | None, spec: Any, impl: str | None):
    """RMSNorm over each head ``[T, N, D]``: ``(out [T, N, D], rstd)``; ``(x, None)`` without a weight."""
    if weight is None:
        return x, None
    assert impl is not None  # chosen where a head norm exists
    t, n, dh = x.shape
    out = ADD_RMS_NORM(AddRmsNormArgs(x.reshape(t * n, dh), None, weight, spec.eps, spec.unit_offset), impl)
    return out.out.view(t, n, dh), out.rstd


def _norm(x, residual, weight, spec, impl):
    out = ADD_RMS_NORM(AddRmsNormArgs(x, residual, weight, spec.eps, spec.unit_offset), impl)
    return out.out, (x if residual is None else out.sum), out.rstd


def _norm_backward(grad, grad_sum, s, rstd, weight, spec, impl, need_weight: bool, residual: bool):
    """``(d sum, d weight)`` of an RMSNorm of the sum ``s`` (``grad_sum``: the sum's own gradient)."""
    args = AddRmsNormArgs(s, s if residual else None, weight, spec.eps, spec.unit_offset)
    inputs = AddRmsNormBackwardInputs(
        grad.contiguous(), grad_sum.contiguous() if residual and grad_sum is not None else None, s, rstd, need_weight
    )
    grads = ADD_RMS_NORM.call_backward(args, inputs, impl)
    if not residual and grad_sum is not None:  # the sum is x itself: its own gradient adds
        return grads.x + grad_sum, grads.weight
    return grads.x, grads.weight


def _head_norm_backward(grad, x, rstd, weight, spec, impl, need_weight: bool):
    if weight is None:
        return grad, None
    t, n, dh = x.shape
    dx, dw = _norm_backward(
        grad.reshape(t * n, dh), None, x.reshape(t * n, dh), rstd, weight, spec, impl, need_weight, False
    )
    return dx.view(t, n, dh), dw


# DecoderWeights' fields, in order (the operands after the first seven of apply)
_FIELDS = (
    "in_norm", "q_w", "k_w", "v_w", "q_b", "k_b", "v_b", "o_w", "o_b", "q_norm", "k_norm", "post_attn_norm",
    "mlp_norm", "post_ff_norm", "gate_w", "up_w", "down_w", "gate_b", "up_b", "down_b",
)  # fmt: skip
_OPERANDS = 7  # x, residual, cu, positions, spec, kernels, max_len


class DecoderLayerFunction(torch.autograd.Function):
    """``apply(x, residual, cu, positions, spec, kernels, max_len, *weights) -> (m, s)``: one
    decoder layer (see :func:`ragged.nn.decoder_layer.run_layer` for the math and the outputs)
    as one autograd node; ``weights``: the fields of ``spec.weights`` in order."""

    @staticmethod
    def forward(ctx, x, residual, cu, positions, spec, kernels: DecoderKernels, max_len, *weights):
        w = dict(zip(_FIELDS, weights))
        t = x.shape[0]
        nq, nkv, dh = spec.heads, spec.kv_heads, spec.head_dim
        nqk = nq + nkv
        norm = kernels.pick("norm", "add_rms_norm", add_rms_norm_spec, x, x, w["in_norm"])
        h, s, r1 = _norm(x, residual, w["in_norm"], spec, norm)
        wqkv = torch.cat((w["q_w"], w["k_w"], w["v_w"]))
        qkv = F.linear(h, wqkv, _bias((w["q_w"], w["k_w"], w["v_w"]), (w["q_b"], w["k_b"], w["v_b"])))
        qkv = qkv.view(t, nqk + nkv, dh)
        head_norm = None
        if w["q_norm"] is not None or w["k_norm"] is not None:
            head = qkv[:, 0]
            head_norm = kernels.pick("head_norm", "add_rms_norm", add_rms_norm_spec, head, None, head[0])
        qn, rq = _head_norm(qkv[:, :nq], w["q_norm"], spec, head_norm)
        kn, rk = _head_norm(qkv[:, nq:nqk], w["k_norm"], spec, head_norm)
        qk = qkv[:, :nqk] if rq is None and rk is None else torch.cat((qn, kn), 1)
        rotary = kernels.pick(
            "rotary", "rotary_embedding", rotary_embedding_spec, qk, positions, spec.inv_freq, spec.rope_scaling
        )
        rot = ROTARY_EMBEDDING(RotaryEmbeddingArgs(qk, positions, spec.inv_freq, spec.rope_scaling), rotary).out
        v = qkv[:, nqk:]
        args = _attention_args(spec, rot[:, :nq], rot[:, nq:], v, cu, max_len)
        attention = kernels.pick(
            ("attention", args.window_left, args.window_right, args.causal), "attention", spec_of, args, True
        )
        o, lse = ATTENTION(args, attention)
        a = F.linear(o.reshape(t, nq * dh), w["o_w"], w["o_b"])
        a_in = a
        ra = None
        if w["post_attn_norm"] is not None:
            a, _, ra = _norm(a, None, w["post_attn_norm"], spec, norm)
        h2, s2, r2 = _norm(a, s, w["mlp_norm"], spec, norm)
        wgu = torch.cat((w["gate_w"], w["up_w"]))
        gu = F.linear(h2, wgu, _bias((w["gate_w"], w["up_w"]), (w["gate_b"], w["up_b"])))
        gated = kernels.pick("gated", "gated_act", gated_act_spec, gu, spec.activation)
        g = GATED_ACT(GatedActArgs(gu, spec.activation), gated).out
        m = F.linear(g, w["down_w"], w["down_b"])
        m_in = m
        rf = None
        if w["post_ff_norm"] is not None:
            m, _, rf = _norm(m, None, w["post_ff_norm"], spec, norm)
        ctx.spec, ctx.max_len = spec, max_len
        ctx.impls = (norm, head_norm, rotary, attention, gated)
        ctx.has_residual = residual is not None
        # the sublayers' outputs before a sandwich norm (Gemma 2/3) are read only by that norm's backward
        a_kept = a_in if ra is not None else None
        m_kept = m_in if rf is not None else None
        saved = (s, r1, h, qkv, rq, rk, rot, o, lse, a_kept, ra, s2, r2, h2, gu, g, m_kept, rf, cu, positions)
        ctx.n_saved = len(saved)
        ctx.save_for_backward(*saved, *weights)
        return m, s2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dm, ds2):
        tensors = ctx.saved_tensors
        s, r1, h, qkv, rq, rk, rot, o, lse, a_in, ra, s2, r2, h2, gu, g, m_in, rf, cu, positions = tensors[
            : ctx.n_saved
        ]
        w = dict(zip(_FIELDS, tensors[ctx.n_saved :]))
        need = dict(zip(_FIELDS, ctx.needs_input_grad[_OPERANDS:]))
        spec = ctx.spec
        norm, head_norm, rotary, attention, gated = ctx.impls
        t = h.shape[0]
        nq, nkv, dh = spec.heads, spec.kv_heads, spec.head_dim
        nqk = nq + nkv
        grads: dict[str, torch.Tensor | None] = dict.fromkeys(_FIELDS)
        if dm is None:
            dm = torch.zeros_like(s2)
        # --- MLP
        if w["post_ff_norm"] is not None:
            dm, grads["post_ff_norm"] = _norm_backward(
                dm, None, m_in, rf, w["post_ff_norm"], spec, norm, need["post_ff_norm"], False
            )
        if need["down_w"]:
            grads["down_w"] = dm.t().mm(g)
        if need["down_b"] and w["down_b"] is not None:
            grads["down_b"] = dm.sum(0)
        dg = dm.mm(w["down_w"])
        dgu = GATED_ACT.call_backward(GatedActArgs(gu, spec.activation), GatedActBackwardInputs(dg), gated).x
        width = w["gate_w"].shape[0]
        if need["gate_w"] or need["up_w"]:
            dwgu = dgu.t().mm(h2)
            grads["gate_w"], grads["up_w"] = dwgu[:width], dwgu[width:]
        if (need["gate_b"] and w["gate_b"] is not None) or (need["up_b"] and w["up_b"] is not None):
            dbgu = dgu.sum(0)
            grads["gate_b"] = dbgu[:width] if w["gate_b"] is not None else None
            grads["up_b"] = dbgu[width:] if w["up_b"] is not None else None
        dh2 = dgu.mm(torch.cat((w["gate_w"], w["up_w"])))
        # --- the second norm: its sum's gradient comes from the next layer as ds2
        dsum2, grads["mlp_norm"] = _norm_backward(dh2, ds2, s2, r2, w["mlp_norm"], spec, norm, need["mlp_norm"], True)
        da = dsum2
        if w["post_attn_norm"] is not None:
            da, grads["post_attn_norm"] = _norm_backward(
                da, None, a_in, ra, w["post_attn_norm"], spec, norm, need["post_attn_norm"], False
            )
        # --- attention
        o_flat = o.reshape(t, nq * dh)
        if need["o_w"]:
            grads["o_w"] = da.t().mm(o_flat)
        if need["o_b"] and w["o_b"] is not None:
            grads["o_b"] = da.sum(0)
        do = da.mm(w["o_w"]).view(t, nq, dh)
        args = _attention_args(spec, rot[:, :nq], rot[:, nq:], qkv[:, nqk:], cu, ctx.max_len)
        dqkv = torch.empty((t, nqk + nkv, dh), dtype=h.dtype, device=h.device)
        att = ATTENTION.call_backward(args, AttentionBackwardInputs(do, o, lse), attention)
        dqk = torch.cat((att.q, att.k), 1)
        dqk = ROTARY_EMBEDDING.call_backward(
            RotaryEmbeddingArgs(None, positions, spec.inv_freq, spec.rope_scaling),
            RotaryEmbeddingBackwardInputs(dqk),
            rotary,
        ).x
        dq, grads["q_norm"] = _head_norm_backward(
            dqk[:, :nq], qkv[:, :nq], rq, w["q_norm"], spec, head_norm, need["q_norm"]
        )
        dk, grads["k_norm"] = _head_norm_backward(
            dqk[:, nq:], qkv[:, nq:nqk], rk, w["k_norm"], spec, head_norm, need["k_norm"]
        )
        dqkv[:, :nq] = dq
        dqkv[:, nq:nqk] = dk
        dqkv[:, nqk:] = att.v
        dqkv2 = dqkv.view(t, (nqk + nkv) * dh)
        rows = (w["q_w"].shape[0], w["k_w"].shape[0], w["v_w"].shape[0])
        if need["q_w"] or need["k_w"] or need["v_w"]:
            grads["q_w"], grads["k_w"], grads["v_w"] = dqkv2.t().mm(h).split(rows)
        if any(need[n] and w[n] is not None for n in ("q_b", "k_b", "v_b")):
            db = dqkv2.sum(0).split(rows)
            for n, part in zip(("q_b", "k_b", "v_b"), db):
                grads[n] = part if w[n] is not None else None
        dh_ = dqkv2.mm(torch.cat((w["q_w"], w["k_w"], w["v_w"])))
        # --- the first norm: the stream's gradient (through the second norm's sum) adds to its sum's
        dx, grads["in_norm"] = _norm_backward(
            dh_, dsum2, s, r1, w["in_norm"], spec, norm, need["in_norm"], ctx.has_residual
        )
        out = [grads[n] if need[n] else None for n in _FIELDS]
        return (dx, dx if ctx.has_residual else None, None, None, None, None, None, *out)
