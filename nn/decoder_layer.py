"""The decoder layer written once, over a :class:`DecoderSpec`: Llama, Mistral, Qwen2/3 and Gemma
1-3 on packed tokens ``x [T, d]``, composed of ragged's fused ops (causal, or both ways for
EmbeddingGemma-style bidirectional models).

One layer (``s`` the residual stream, ``n(.)`` an RMSNorm)::

    h = n_in(s)                                      # add_rms_norm, fused with the add before it
    q, k, v = h Wq (+bq), h Wk (+bk), h Wv (+bv)     # one GEMM on the concatenated weights
    q, k = n_q(q), n_k(k)                            # Qwen3, Gemma3: per-head norms
    q, k = rope(q), rope(k)                          # rotary_embedding, positions per sequence
    a = attention(q, k, v) Wo                        # varlen_attention: causal, GQA, window
    a = n_post_attn(a)                               # Gemma2/3 ("sandwich" norms)
    s = s + a;  h = n_mlp(s)                         # add_rms_norm(a, s)
    m = down(act(h Wg) * h Wu)                       # gated_act(silu | gelu_tanh) on [Wg; Wu]
    m = n_post_ff(m)                                 # Gemma2/3
    s = s + m                                        # fused into the next layer's first norm

The residual add that ends a layer is carried to the next layer's input norm (``add_rms_norm``
with ``return_sum``), and the last one into the model's final norm (:func:`run_stack`). Norms
follow HuggingFace's numerics (``unit_offset``: Gemma's ``1 + weight``). In training, each layer
is one autograd node with a hand-written backward where its operands allow
(:mod:`ragged.nn.decoder_node`: one dtype, no autocast, nothing tracing); otherwise every step
is a ragged op with its own backward (:func:`run_layer`). The weights are read on every call
(Q/K/V and gate/up concatenated per call), so no write to them goes unseen.
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

import ragged

from .decoder_node import DecoderKernels, DecoderLayerFunction, node_applies
from .layer_spec import concatenated

# RAGGED_DECODER_NODE=0: every layer recorded op by op (the one-node layer off, for comparisons)
_NODE = os.environ.get("RAGGED_DECODER_NODE", "1") != "0"

__all__ = ["DecoderSpec", "DecoderWeights", "run_layer", "run_stack"]


class DecoderWeights(NamedTuple):
    """A layer's tensors (HuggingFace's Parameters, read as they are): norms' weights ``[d]`` (or
    ``[head_dim]`` for q/k), projections ``[out, in]``, biases ``[out]`` or None."""

    in_norm: Tensor
    q_w: Tensor
    k_w: Tensor
    v_w: Tensor
    q_b: Tensor | None
    k_b: Tensor | None
    v_b: Tensor | None
    o_w: Tensor
    o_b: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None
    post_attn_norm: Tensor | None  # Gemma2/3: on the attention output, before the add
    mlp_norm: Tensor  # post_attention_layernorm (Llama) / pre_feedforward_layernorm (Gemma2/3)
    post_ff_norm: Tensor | None  # Gemma2/3
    gate_w: Tensor
    up_w: Tensor
    down_w: Tensor
    gate_b: Tensor | None = None  # Llama's mlp_bias
    up_b: Tensor | None = None
    down_b: Tensor | None = None


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """What a layer computes besides its weights."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    unit_offset: bool  # Gemma's norms: 1 + weight
    activation: str  # gated_act's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    scale: float  # attention's softmax scale
    window: int | None  # sliding window in tokens, its own included (None: full)
    inv_freq: Tensor  # rotary frequencies [head_dim / 2]
    rope_scaling: float  # HuggingFace's attention_scaling
    weights: DecoderWeights
    causal: bool = True  # False: each token attends both ways (EmbeddingGemma), within the window


def _linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    return F.linear(x, w, b)


def _fused_bias(weights: tuple[Tensor, ...], biases: tuple[Tensor | None, ...]) -> Tensor | None:
    """The bias of the Linears concatenated along their outputs (zeros for those without)."""
    if all(b is None for b in biases):
        return None
    present = tuple(b for b in biases if b is not None)
    if len(present) == len(biases):
        return concatenated(present)
    return torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])


def _qkv(spec: DecoderSpec, h: Tensor) -> Tensor:
    """The fused projection ``[T, Hq + 2 Hkv, head_dim]``: q heads, then k, then v."""
    w = spec.weights
    ws = (w.q_w, w.k_w, w.v_w)
    qkv = _linear(h, concatenated(ws), _fused_bias(ws, (w.q_b, w.k_b, w.v_b)))
    return qkv.view(h.shape[0], spec.heads + 2 * spec.kv_heads, spec.head_dim)


def _common(*tensors: Tensor | None) -> torch.dtype:
    """The dtype HuggingFace's arithmetic would give these tensors (type promotion): under autocast
    the Linears return its dtype while the residual stream and the norms' weights keep theirs."""
    dtype = None
    for t in tensors:
        if t is not None:
            dtype = t.dtype if dtype is None else torch.promote_types(dtype, t.dtype)
    assert dtype is not None
    return dtype


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _maybe(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if t is None else _as(t, dtype)


def _head_norm(x: Tensor, weight: Tensor | None, spec: DecoderSpec) -> Tensor:
    if weight is None:
        return x
    t, n, dh = x.shape
    return _rms(x.reshape(t * n, dh), weight, spec).view(t, n, dh)


def _rms(x: Tensor, weight: Tensor, spec: DecoderSpec) -> Tensor:
    dtype = _common(x, weight)
    out = ragged.add_rms_norm(_as(x, dtype), None, _as(weight, dtype), spec.eps, unit_offset=spec.unit_offset)
    assert isinstance(out, Tensor)
    return out


def _norm(x: Tensor, residual: Tensor | None, weight: Tensor, spec: DecoderSpec):
    dtype = _common(x, residual, weight)
    return ragged.add_rms_norm(
        _as(x, dtype),
        _maybe(residual, dtype),
        _as(weight, dtype),
        spec.eps,
        return_sum=True,
        unit_offset=spec.unit_offset,
    )


def _attention_inputs(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v in one dtype: autocast's where it is on (as SDPA under autocast), else their
    promotion."""
    device = q.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else _common(q, k, v)
    return _as(q, dtype), _as(k, dtype), _as(v, dtype)


def run_layer(
    spec: DecoderSpec,
    x: Tensor,
    residual: Tensor | None,
    cu: Tensor,
    max_len: int,
    positions: Tensor,
) -> tuple[Tensor, Tensor]:
    """One layer on the residual stream ``residual + x`` (``residual`` None: ``x`` is the stream);
    returns ``(m, s)``: the layer's last branch output and the stream before its add, which the
    next layer (or the final norm) adds and normalises."""
    w = spec.weights
    h, s = _norm(x, residual, w.in_norm, spec)
    qkv = _qkv(spec, h)
    nq, nqk = spec.heads, spec.heads + spec.kv_heads
    v = qkv[:, nqk:]
    if w.q_norm is None and w.k_norm is None:  # rotary reads the q and k heads in place
        qk = qkv[:, :nqk]
    else:
        qk = torch.cat((_head_norm(qkv[:, :nq], w.q_norm, spec), _head_norm(qkv[:, nq:nqk], w.k_norm, spec)), 1)
    rot = ragged.rotary_embedding(qk, positions, spec.inv_freq, spec.rope_scaling)
    q, k = rot[:, :nq], rot[:, nq:]
    if spec.window is None:
        window = (-1, -1)
    else:  # the window counts the token itself: |i - j| < window (only j <= i when causal)
        window = (spec.window - 1, 0 if spec.causal else spec.window - 1)
    q, k, v = _attention_inputs(q, k, v)
    a = ragged.varlen_attention(
        q, k, v, cu, cu, max_len, max_len, causal=spec.causal, scale=spec.scale, window_size=window
    )
    a = _linear(a.reshape(a.shape[0], nq * spec.head_dim), w.o_w, w.o_b)
    if w.post_attn_norm is not None:
        a = _rms(a, w.post_attn_norm, spec)
    h, s = _norm(a, s, w.mlp_norm, spec)
    gu = _linear(h, concatenated((w.gate_w, w.up_w)), _fused_bias((w.gate_w, w.up_w), (w.gate_b, w.up_b)))
    m = _linear(ragged.gated_act(gu, spec.activation), w.down_w, w.down_b)
    if w.post_ff_norm is not None:
        m = _rms(m, w.post_ff_norm, spec)
    return m, s


def run_stack(
    specs: list[DecoderSpec],
    x: Tensor,
    cu: Tensor,
    max_len: int,
    positions: Tensor,
    final_norm: Tensor,
    eps: float,
    unit_offset: bool,
    hidden_states: list | None = None,
    checkpoint_layers: bool = False,
) -> Tensor:
    """Every layer, then the final norm: the last hidden states ``[T, d]``. ``hidden_states``: a
    list that receives the stream before each layer (HuggingFace's ``output_hidden_states``
    order; the final norm's output is appended by the caller). ``checkpoint_layers``: each layer
    under :func:`torch.utils.checkpoint.checkpoint` (non-reentrant) where a gradient is recorded:
    its activations are not kept but computed again in the backward (HuggingFace's gradient
    checkpointing)."""
    branch, stream = x, None
    kernels = DecoderKernels()  # the one-node layers' implementations, chosen once per call
    node = _NODE and x.shape[0] > 0

    def layer(spec: DecoderSpec, branch: Tensor, stream: Tensor | None) -> tuple[Tensor, Tensor]:
        if node and node_applies(branch, stream, spec.weights):
            return DecoderLayerFunction.apply(branch, stream, cu, positions, spec, kernels, max_len, *spec.weights)
        return run_layer(spec, branch, stream, cu, max_len, positions)

    saving = checkpoint_layers and torch.is_grad_enabled()
    for spec in specs:
        if hidden_states is not None:
            hidden_states.append(branch if stream is None else stream + branch)
        if saving:
            branch, stream = checkpoint(layer, spec, branch, stream, use_reentrant=False)
        else:
            branch, stream = layer(spec, branch, stream)
    dtype = _common(branch, stream, final_norm)
    out, _ = ragged.add_rms_norm(
        _as(branch, dtype), _maybe(stream, dtype), _as(final_norm, dtype), eps, return_sum=True, unit_offset=unit_offset
    )
    return out
