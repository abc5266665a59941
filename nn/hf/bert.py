"""BERT (``transformers.models.bert``): post-norm layers read into the layer core's LayerSpec,
learned absolute positions numbered by the columns of the padded input, token types, and a
pooler (``tanh(W h_first + b)``) that the base model's output and its sequence classifier read."""

from __future__ import annotations

from .family import SpecFamily, pooled_output

__all__ = ["BertFamily", "FAMILIES"]


class BertFamily(SpecFamily):
    head_modules = {
        "sequence": ("dropout", "classifier"),
        "token": ("dropout", "classifier"),
        "masked_lm": ("cls",),
        "qa": ("qa_outputs",),
    }

    def model_reason(self, model, base, kind, prefix):
        if kind == "sequence" and base._modules.get("pooler") is None:
            return f"its {prefix} has no pooler, which its classifier reads"
        return None

    def sequence_logits(self, model, base, enc):
        m = model._modules
        return m["classifier"](m["dropout"](pooled_output(base, enc)))

    def masked_lm_logits(self, model, h):
        return model._modules["cls"](h)


FAMILIES = (BertFamily("BERT", "transformers.models.bert.modeling_bert", "Bert"),)
