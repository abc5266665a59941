"""RoBERTa, XLM-RoBERTa and CamemBERT: BERT's layers, with positions counted from the ids.

Positions: tokens that are not ``padding_idx`` count ``padding_idx + 1, padding_idx + 2, ...``
within their sequence and ``padding_idx`` tokens stay at ``padding_idx`` (HuggingFace's row
cumulative sum, here a segment cumulative sum on the packed tokens, on the device: the same
values whenever the padding holds the pad id, as tokenizers write it); ``inputs_embeds``
columns count from ``padding_idx + 1``. The sequence classifier
(``RobertaClassificationHead``) reads each sequence's first token; the masked-LM head is
``lm_head``."""

from __future__ import annotations

import torch

from .batch import Batch
from .family import SpecFamily, sub

__all__ = ["FAMILIES", "RobertaFamily"]


def roberta_positions(ids: torch.Tensor, batch: Batch, pad: int) -> torch.Tensor:
    """RoBERTa's positions of packed ids (see the module docstring)."""
    rt = batch.rt
    real = (ids != pad).to(torch.int64)
    run = torch.cumsum(real, 0)
    # each token's sequence start, as row - position (safe for the spare rows of a graphed bucket)
    starts = torch.arange(rt.num_tokens, device=ids.device) - rt.position_ids()
    before = (run - real).index_select(0, starts)  # the count before each token's sequence
    return (run - before) * real + pad


class RobertaFamily(SpecFamily):
    positions_from_ids = True
    head_modules = {
        "sequence": ("classifier",),
        "token": ("dropout", "classifier"),
        "masked_lm": ("lm_head",),
        "qa": ("qa_outputs",),
    }

    def embed_positions(self, base, batch, ids):
        pad = sub(base, "embeddings").padding_idx
        return roberta_positions(ids, batch, pad) if ids is not None else batch.columns() + (pad + 1)

    def masked_lm_logits(self, model, h):
        return model._modules["lm_head"](h)

    def max_len(self, model):
        """The position table's rows less ``padding_idx + 1``: positions count from there."""
        found = super().max_len(model)
        pad = getattr(getattr(model.base_model, "embeddings", None), "padding_idx", None)
        if found is None or not isinstance(pad, int):
            return found
        rows, what = found
        return rows - (pad + 1), f"{what}, positions from padding_idx + 1 = {pad + 1}"


FAMILIES = (
    RobertaFamily("RoBERTa", "transformers.models.roberta.modeling_roberta", "Roberta"),
    RobertaFamily("XLM-RoBERTa", "transformers.models.xlm_roberta.modeling_xlm_roberta", "XLMRoberta"),
    RobertaFamily("CamemBERT", "transformers.models.camembert.modeling_camembert", "Camembert"),
)
