"""DistilBERT: the layer core's post-norm layer under DistilBERT's own module names
(``TransformerBlock``: ``attention.{q,k,v,out}_lin``, ``sa_layer_norm``, ``ffn.lin1/lin2``,
``output_layer_norm``; no dropout module after the attention block), no token types, no
pooler. The sequence classifier is ``pre_classifier``, ReLU, ``dropout``, ``classifier`` on
each sequence's first token; the question-answering head applies ``dropout`` first."""

from __future__ import annotations

import torch.nn.functional as F

import ragged

from .family import SpecFamily, sub

__all__ = ["DistilBertFamily", "FAMILIES"]


class DistilBertFamily(SpecFamily):
    layer_path = "transformer.layer"
    base_output = "BaseModelOutput"
    layer_class = "TransformerBlock"
    layer_parts = {"ffn": "FFN"}
    head_modules = {
        "sequence": ("pre_classifier", "dropout", "classifier"),
        "token": ("dropout", "classifier"),
        "masked_lm": ("vocab_transform", "activation", "vocab_layer_norm", "vocab_projector"),
        "qa": ("dropout", "qa_outputs"),
    }

    def hidden_size(self, config):
        return config.dim

    def layer_modules(self, layer):
        attn, ffn = sub(layer, "attention"), sub(layer, "ffn")
        return {
            "attn": attn,
            "q": sub(attn, "q_lin"),
            "k": sub(attn, "k_lin"),
            "v": sub(attn, "v_lin"),
            "out": sub(attn, "out_lin"),
            "norm1": sub(layer, "sa_layer_norm"),
            "drop1": None,
            "ff1": sub(ffn, "lin1"),
            "act": ffn.activation,
            "ff2": sub(ffn, "lin2"),
            "drop2": sub(ffn, "dropout"),
            "norm2": sub(layer, "output_layer_norm"),
        }

    def attention_shape(self, attn):
        return attn.n_heads, attn.attention_head_size

    def embed(self, fn, base, batch, ids, embeds, token_type_ids, position_ids):
        # no token types (HuggingFace's forward ignores them too)
        pos = batch.pack(fn, "position_ids", position_ids, 0, broadcast=True)
        if pos is None:
            pos = batch.columns()
        one = lambda t: None if t is None else t.unsqueeze(0)
        return sub(base, "embeddings")(one(ids), one(embeds), one(pos))[0]

    def base_fields(self, base, enc):
        return {}

    def sequence_logits(self, model, base, enc):
        m = model._modules
        return m["classifier"](m["dropout"](F.relu(m["pre_classifier"](ragged.pool(enc.rt, "first")))))

    def masked_lm_logits(self, model, h):
        m = model._modules
        return m["vocab_projector"](m["vocab_layer_norm"](m["activation"](m["vocab_transform"](h))))

    def qa_logits(self, model, h):
        m = model._modules
        return m["qa_outputs"](m["dropout"](h))


FAMILIES = (DistilBertFamily("DistilBERT", "transformers.models.distilbert.modeling_distilbert", "DistilBert"),)
