"""ModernBERT (``transformers.models.modernbert``): pre-norm layers with rotary positions,
alternating global and local (sliding-window) attention, a gated feed-forward (GeGLU) and no
biases, then a final norm.

One layer, on packed values ``x [T, d]`` with ``h = attn_norm(x)`` (the first layer has no
attention norm, as in HuggingFace):

* ``qkv = h Wqkv^T``; the rotary rotation of q and k in one call
  (:func:`ragged.rotary_embedding` on the ``[T, 2H, D]`` view of the projection's q and k, at
  each token's position, with the layer type's frequencies: global and local layers have
  their own ``rope_theta``); attention by :func:`ragged.varlen_attention`, over the whole
  sequence in global layers and over the keys at most ``config.sliding_window`` (half of
  ``local_attention``) tokens away in local ones; ``x = x + out_drop(o Wo^T)``;
* ``x = x + Wo(drop(act(a) * g))`` with ``(a, g) = mlp_norm(x) Wi^T`` split in halves
  (:func:`ragged.gated_act`; an activation it does not take is called as the model's module).

Positions are the columns of the padded input (HuggingFace's default ``position_ids``, so a
left-padded row starts past 0) or, for a RaggedTensor input, each token's index in its
sequence; ``position_ids`` given are packed like the input. Under a scattered attention mask a
local layer's window counts tokens where HuggingFace counts columns.

Heads: ``head`` (dense, activation, norm) then ``drop`` and ``classifier`` for sequence
classification (on each sequence's first token, or on the mean of its tokens with
``config.classifier_pooling="mean"``), token classification and question answering; masked LM
is ``decoder(head(h))``, on the labelled tokens only with ``config.sparse_prediction`` and
labels (HuggingFace's flat ``[N, vocab]`` logits; selecting them reads their count on the host,
as HuggingFace's boolean indexing does).

Refused: rotary scaling types whose frequencies change with the length (``"dynamic"``,
``"longrope"``), layer types other than global and local attention, modules that are not
HuggingFace's (the checks of :meth:`ModernBertFamily.layer_reason`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

import ragged
from ragged import backends
from ragged.ops.attention import ATTENTION, NO_WINDOW, AttentionArgs, dropout_seed, effective_window, spec_of

from ..layer import attention_dtype
from .family import Family, exact, fused_activation, param, sub

__all__ = ["FAMILIES", "ModernBertFamily"]

_LAYER_TYPES = ("full_attention", "sliding_attention")
_MOVING_ROPE = ("dynamic", "longrope")  # frequencies recomputed from the length at each call


@dataclasses.dataclass
class Context:
    """What every layer of one forward reads: the batch's offsets and longest length, each
    token's position, the rotary frequencies and scaling per layer type, the local window."""

    offsets: torch.Tensor
    max_len: int
    positions: torch.Tensor
    rotary: dict
    window: int


def _linear(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    return F.linear(x, param(linear, "weight"), param(linear, "bias"))


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Context, window: tuple[int, int], p: float
) -> torch.Tensor:
    """Attention of one layer over the batch's sequences: ``q, k, v [rows, H, D]``, ``window``
    (``(left, right)`` or ``NO_WINDOW``), dropout ``p``; ``[rows, H, D]``.

    The op itself, as the layer core calls it, not :func:`ragged.varlen_attention`: under
    :func:`ragged.nn.graphed` the rows past ``offsets[-1]`` are a bucket's spare rows (computed
    by the per-token steps, read by no real token), which the public function refuses where it
    checks offsets on the CPU. The offsets are the batch's own, as trusted as every layer trusts
    them."""
    max_len = ctx.max_len
    if window is not NO_WINDOW:
        window = effective_window(window, False, max_len, max_len)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    args = AttentionArgs(
        q=q,
        k=k,
        v=v,
        cu_q=ctx.offsets,
        cu_k=ctx.offsets,
        max_q=max_len,
        max_k=max_len,
        causal=False,
        scale=1.0 / math.sqrt(q.shape[2]),
        dropout_p=p,
        seed=dropout_seed(p, q.device),
        window_left=window[0],
        window_right=window[1],
    )
    impl = backends.select_spec("attention", None, spec_of(args, needs_grad))
    return ATTENTION(args, impl.name).out


class ModernBertFamily(Family):
    layer_path = "layers"
    base_output = "BaseModelOutput"
    loss_function_heads = ("masked_lm", "qa")
    head_modules: ClassVar[dict[str, tuple[str, ...]]] = {
        "sequence": ("head", "drop", "classifier"),
        "token": ("head", "drop", "classifier"),
        "masked_lm": ("head", "decoder"),
        "qa": ("head", "drop", "classifier"),
    }

    def bypassed(self, base):
        out = [
            (f"layers.{p}" if p else "layers", s)
            for p, s in base._modules["layers"].named_modules(remove_duplicate=False)
        ]
        rotary = base._modules.get("rotary_emb")
        return out + ([("rotary_emb", rotary)] if rotary is not None else [])

    # ---- what it refuses

    def config_reason(self, config):
        types = list(getattr(config, "layer_types", None) or ())
        other = sorted({t for t in types if t not in _LAYER_TYPES})
        if other:
            return f"config.layer_types holds {', '.join(other)}; ragged computes full_attention and sliding_attention"
        for kind, rope in (getattr(config, "rope_parameters", None) or {}).items():
            rope_type = (rope or {}).get("rope_type", "default")
            if rope_type in _MOVING_ROPE:
                return (
                    f"config.rope_parameters[{kind!r}] has rope_type={rope_type!r}, whose frequencies change with "
                    "the sequence length; ragged takes rotary types with fixed frequencies"
                )
        return None

    def model_reason(self, model, base, kind, prefix):
        rotary = base._modules.get("rotary_emb")
        if rotary is None:
            return f"its {prefix or 'model'} has no rotary_emb module"
        for layer_type in set(model.config.layer_types):
            if not isinstance(getattr(rotary, f"{layer_type}_inv_freq", None), torch.Tensor):
                return f"its rotary_emb has no {layer_type}_inv_freq frequencies"
        return None

    def layer_reason(self, layer, path, hidden):
        why = exact(layer, self.cls("ModernBertEncoderLayer"), path, "transformers ModernBertEncoderLayer")
        if why:
            return why
        try:
            attn, mlp = layer.get_submodule("attn"), layer.get_submodule("mlp")
            parts = {"attn": (attn, "ModernBertAttention"), "mlp": (mlp, "ModernBertMLP")}
            for name, (module, cls_name) in parts.items():
                why = exact(module, self.cls(cls_name), f"{path}.{name}", f"transformers {cls_name}")
                if why:
                    return why
            linears = {"attn.Wqkv": attn.Wqkv, "attn.Wo": attn.Wo, "mlp.Wi": mlp.Wi, "mlp.Wo": mlp.Wo}
            norms = {"attn_norm": layer.attn_norm, "mlp_norm": layer.mlp_norm}
            drops = {"attn.out_drop": attn.out_drop, "mlp.drop": mlp.drop}
        except AttributeError as err:
            return f"its {path} lacks a module HuggingFace's layer has ({err})"
        if getattr(layer, "attention_type", None) not in _LAYER_TYPES:
            return f"its {path} has attention_type {getattr(layer, 'attention_type', None)!r}"
        for name, linear in linears.items():
            why = exact(linear, nn.Linear, f"{path}.{name}", "torch.nn.Linear")
            if why:
                return why
        heads, head_dim = attn.config.num_attention_heads, attn.head_dim
        if heads * head_dim != hidden:
            return f"its {path} attention has {heads} heads of {head_dim} features, not the hidden size {hidden}"
        ff = mlp.Wo.in_features
        shapes = {
            "attn.Wqkv": (hidden, 3 * hidden),
            "attn.Wo": (hidden, hidden),
            "mlp.Wi": (hidden, 2 * ff),
            "mlp.Wo": (ff, hidden),
        }
        for name, shape in shapes.items():
            linear = linears[name]
            if (linear.in_features, linear.out_features) != shape:
                return f"its {path}.{name} is not a {shape[0]} x {shape[1]} Linear"
        for name, norm in norms.items():
            if name == "attn_norm" and type(norm) is nn.Identity:
                continue
            why = exact(norm, nn.LayerNorm, f"{path}.{name}", "torch.nn.LayerNorm")
            if why:
                return why
            if tuple(norm.normalized_shape) != (hidden,):
                return f"its {path}.{name} is not a LayerNorm over the {hidden} features"
        for name, drop in drops.items():
            if type(drop) is not nn.Identity:
                why = exact(drop, nn.Dropout, f"{path}.{name}", "torch.nn.Dropout")
                if why:
                    return why
        return None

    # ---- compute

    def embed(self, fn, base, batch, ids, embeds, token_type_ids, position_ids):
        row = lambda t: None if t is None else t.unsqueeze(0)
        return sub(base, "embeddings")(input_ids=row(ids), inputs_embeds=row(embeds))[0]

    def context(self, fn, base, batch, x, position_ids):
        positions = batch.pack(fn, "position_ids", position_ids, 0, broadcast=True)
        if positions is None:
            positions = batch.columns()
        rotary_emb = sub(base, "rotary_emb")
        rotary = {}
        for layer_type in _LAYER_TYPES:
            inv_freq = getattr(rotary_emb, f"{layer_type}_inv_freq", None)
            if inv_freq is not None:
                scaling = float(getattr(rotary_emb, f"{layer_type}_attention_scaling", 1.0))
                rotary[layer_type] = (inv_freq.to(device=x.device, dtype=torch.float32), scaling)
        rt = batch.rt
        return Context(rt.offsets, rt.max_len, positions, rotary, int(base.config.sliding_window))

    def run_layer(self, layer, x, ctx):
        m = layer._modules
        attn, mlp = m["attn"], m["mlp"]
        heads, head_dim = attn.config.num_attention_heads, attn.head_dim
        total = x.shape[0]
        norm = m["attn_norm"]
        h = x if type(norm) is nn.Identity else norm(x)
        qkv = _linear(h, attn._modules["Wqkv"]).view(total, 3, heads, head_dim)
        inv_freq, scaling = ctx.rotary[layer.attention_type]
        qk = ragged.rotary_embedding(qkv[:, :2].flatten(1, 2), ctx.positions, inv_freq, scaling)
        window = (ctx.window, ctx.window) if layer.attention_type == "sliding_attention" else NO_WINDOW
        p = attn.attention_dropout if attn.training else 0.0
        with attention_dtype(qk):
            o = _attention(qk[:, :heads], qk[:, heads:], qkv[:, 2], ctx, window, p)
        x = x + attn._modules["out_drop"](_linear(o.reshape(total, heads * head_dim), attn._modules["Wo"]))
        g = _linear(m["mlp_norm"](x), mlp._modules["Wi"])
        act = fused_activation(mlp.act)
        if isinstance(act, str):
            g = ragged.gated_act(g, act)
        else:
            a, gate = g.chunk(2, dim=-1)
            g = act(a) * gate
        return x + _linear(mlp._modules["drop"](g), mlp._modules["Wo"])

    def finish(self, base, y):
        return sub(base, "final_norm")(y)

    # ---- heads

    def sequence_logits(self, model, base, enc):
        pooling = "mean" if model.config.classifier_pooling == "mean" else "first"
        m = model._modules
        return m["classifier"](m["drop"](m["head"](ragged.pool(enc.rt, pooling))))

    def token_logits(self, model, h):
        m = model._modules
        return m["classifier"](m["drop"](m["head"](h)))

    qa_logits = token_logits

    def masked_lm_logits(self, model, h):
        m = model._modules
        return m["decoder"](m["head"](h))

    def masked_lm_tokens(self, model, target):
        if target is None or not getattr(model.config, "sparse_prediction", False):
            return None
        return (target != model.config.sparse_pred_ignore_index).nonzero()[:, 0]


FAMILIES = (ModernBertFamily("ModernBERT", "transformers.models.modernbert.modeling_modernbert", "ModernBert"),)
