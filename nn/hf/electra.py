"""ELECTRA: BERT's layers and embeddings, with ``embeddings_project`` when ``embedding_size !=
hidden_size``; no pooler. The sequence classifier (``ElectraClassificationHead``) reads each
sequence's first token; the masked-LM head is the generator's
(``generator_predictions``, then ``generator_lm_head``)."""

from __future__ import annotations

from .family import SpecFamily

__all__ = ["ElectraFamily", "FAMILIES"]


class ElectraFamily(SpecFamily):
    base_output = "BaseModelOutputWithPastAndCrossAttentions"
    head_modules = {
        "sequence": ("classifier",),
        "token": ("dropout", "classifier"),
        "masked_lm": ("generator_predictions", "generator_lm_head"),
        "qa": ("qa_outputs",),
    }

    def embed(self, fn, base, batch, ids, embeds, token_type_ids, position_ids):
        h = super().embed(fn, base, batch, ids, embeds, token_type_ids, position_ids)
        project = base._modules.get("embeddings_project")
        return h if project is None else project(h)

    def base_fields(self, base, enc):
        return {}

    def masked_lm_logits(self, model, h):
        m = model._modules
        return m["generator_lm_head"](m["generator_predictions"](h))


FAMILIES = (ElectraFamily("ELECTRA", "transformers.models.electra.modeling_electra", "Electra"),)
