"""MPNet (``transformers.models.mpnet``): BERT's post-norm layers with a relative-position bias
added to every layer's attention scores, RoBERTa's positions, no token types.

The bias: ``encoder.relative_attention_bias`` (an Embedding of ``[num_buckets, heads]``) read
at the bucket of ``j - i`` for query ``i`` and key ``j`` of a sequence, in T5's bidirectional
log buckets (32 of them, exact below 8 tokens apart in either direction, logarithmic up to 128,
as HuggingFace computes it whatever ``relative_attention_num_buckets`` says). It is computed in
the attention kernels from the table and a ``[2 L - 1]`` bucket per distance built once per
forward (:func:`ragged.varlen_attention`'s ``position_bias``), never as a ``[B, H, L, L]``
tensor; its gradient reaches the Embedding's weight.

One layer is the layer core's post-norm layer (:func:`ragged.nn.layer.run_layer`, and
:func:`ragged.nn.layer.run_stack` in inference) with the bias in its spec: inference runs the
fused kernels; a training step is one autograd node per layer (the layer core's hand-written
backward, whose attention backward also returns the table's gradient; the table, shared by
every layer, gets their sum).

Heads: the sequence classifier (``MPNetClassificationHead``) reads each sequence's first
token; token classification, masked LM (``lm_head``) and question answering on the packed
tokens.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .family import param, sub
from .roberta import RobertaFamily

__all__ = ["FAMILIES", "MPNetFamily", "relative_buckets"]

NUM_BUCKETS, MAX_DISTANCE = 32, 128  # HuggingFace's compute_position_bias


def relative_buckets(
    distance: torch.Tensor, num_buckets: int = NUM_BUCKETS, max_distance: int = MAX_DISTANCE
) -> torch.Tensor:
    """The bucket of each key-minus-query distance ``j - i`` (int64 tensor), bidirectional:
    half the buckets for keys before the query, half for keys after; in each half, distances
    below a quarter of the buckets exactly, then logarithmically up to ``max_distance``."""
    half = num_buckets // 2
    ahead = -distance  # HuggingFace buckets n = -(j - i)
    out = (ahead < 0).to(torch.long) * half
    n = ahead.abs()
    exact = half // 2
    scaled = torch.log(n.float() / exact) / math.log(max_distance / exact) * (half - exact)
    large = torch.clamp(exact + scaled.to(torch.long), max=half - 1)
    return out + torch.where(n < exact, n, large)


@dataclasses.dataclass
class Context:
    """What every layer of one forward reads: the offsets, the longest length, the bias table
    and the bucket of each distance ``j - i`` from ``-(max_len - 1)`` to ``max_len - 1``."""

    offsets: torch.Tensor
    max_len: int
    table: torch.Tensor
    buckets: torch.Tensor


class MPNetFamily(RobertaFamily):
    base_output = "BaseModelOutputWithPooling"
    layer_parts = {"attention": "MPNetAttention", "intermediate": "MPNetIntermediate", "output": "MPNetOutput"}

    def layer_modules(self, layer):
        attention = sub(layer, "attention")
        attn = sub(attention, "attn")
        inter, out = sub(layer, "intermediate"), sub(layer, "output")
        return {
            "attn": attn,
            "q": sub(attn, "q"),
            "k": sub(attn, "k"),
            "v": sub(attn, "v"),
            "out": sub(attn, "o"),
            "norm1": sub(attention, "LayerNorm"),
            "drop1": sub(attention, "dropout"),
            "ff1": sub(inter, "dense"),
            "act": inter.intermediate_act_fn,
            "ff2": sub(out, "dense"),
            "drop2": sub(out, "dropout"),
            "norm2": sub(out, "LayerNorm"),
        }

    def config_reason(self, config):
        buckets = getattr(config, "relative_attention_num_buckets", NUM_BUCKETS)
        if buckets < NUM_BUCKETS:
            return (
                f"config.relative_attention_num_buckets={buckets}: HuggingFace's MPNet reads {NUM_BUCKETS} "
                "buckets of its relative attention bias"
            )
        return None

    def model_reason(self, model, base, kind, prefix):
        table = getattr(base._modules.get("encoder"), "relative_attention_bias", None)
        if type(table) is not torch.nn.Embedding or table.embedding_dim != model.config.num_attention_heads:
            return "its encoder.relative_attention_bias is not an Embedding of one value per head"
        return super().model_reason(model, base, kind, prefix)

    def embed(self, fn, base, batch, ids, embeds, token_type_ids, position_ids):
        # no token types (MPNet has none)
        pos = batch.pack(fn, "position_ids", position_ids, 0, broadcast=True)
        if pos is None:
            pos = self.embed_positions(base, batch, ids)
        row = lambda t: None if t is None else t.unsqueeze(0)
        return sub(base, "embeddings")(input_ids=row(ids), position_ids=row(pos), inputs_embeds=row(embeds))[0]

    def context(self, fn, base, batch, x, position_ids):
        rt = batch.rt
        longest = max(int(rt.max_len), 1)
        distance = torch.arange(-(longest - 1), longest, device=x.device)
        table = param(sub(sub(base, "encoder"), "relative_attention_bias"), "weight")
        return Context(rt.offsets, rt.max_len, table, relative_buckets(distance).to(torch.int32))

    def spec_of(self, layer, ctx):
        spec = self.layer_spec(layer)
        if not ctx.max_len:  # no keys: nothing to bias
            return spec
        return dataclasses.replace(spec, position_bias=(ctx.table, ctx.buckets))


FAMILIES = (MPNetFamily("MPNet", "transformers.models.mpnet.modeling_mpnet", "MPNet"),)
