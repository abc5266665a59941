"""The task heads of converted HuggingFace BERT-family models (see :mod:`ragged.nn.hf_bert`).

Each head runs the model's own head modules: sequence-level heads on each sequence's first
token (:func:`ragged.pool` ``"first"``, ``[B, d]``), token-level heads on the packed tokens
``[T, d]``. Losses are HuggingFace's, on the real tokens:

* sequence classification: HuggingFace's ``problem_type`` rule (set on the config at the
  first call with labels, as HuggingFace does) and its MSE / cross-entropy / BCE losses;
* token classification and masked LM: cross-entropy averaged over the labels that are not
  -100 (HuggingFace's value whenever the labels at padding are -100, as its collators write);
* question answering: ``(CE(start) + CE(end)) / 2`` where each sequence's softmax runs over
  its real tokens only. Positions are columns of the padded input (positions within the
  sequence for a RaggedTensor input); clamped to ``[0, M]`` as HuggingFace does, and a
  position outside the sequence's tokens (``M`` included) is ignored. Equal to HuggingFace's
  loss when no row has padding; with padding HuggingFace's softmax also spans the logits
  it computes at padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ragged
from ragged.utils import describe

from .hf_encoder import Encoded, Family

__all__ = ["HEAD_MODULES", "KINDS", "head_outputs", "pooled_output"]

# class-name suffix -> head kind
KINDS = {"Model": "base", "ForSequenceClassification": "sequence", "ForTokenClassification": "token",
         "ForMaskedLM": "masked_lm", "ForQuestionAnswering": "qa"}

# (kind, style) -> the head's submodules this file calls
HEAD_MODULES = {
    ("sequence", "bert"): ("dropout", "classifier"),
    ("sequence", "roberta"): ("classifier",),
    ("sequence", "electra"): ("classifier",),
    ("sequence", "distil"): ("pre_classifier", "dropout", "classifier"),
    ("token", "bert"): ("dropout", "classifier"),
    ("token", "roberta"): ("dropout", "classifier"),
    ("token", "electra"): ("dropout", "classifier"),
    ("token", "distil"): ("dropout", "classifier"),
    ("masked_lm", "bert"): ("cls",),
    ("masked_lm", "roberta"): ("lm_head",),
    ("masked_lm", "electra"): ("generator_predictions", "generator_lm_head"),
    ("masked_lm", "distil"): ("vocab_transform", "activation", "vocab_layer_norm", "vocab_projector"),
    ("qa", "bert"): ("qa_outputs",),
    ("qa", "roberta"): ("qa_outputs",),
    ("qa", "electra"): ("qa_outputs",),
    ("qa", "distil"): ("dropout", "qa_outputs"),
}


def pooled_output(base: nn.Module, enc: Encoded) -> torch.Tensor | None:
    """``[B, d]``: the base model's pooler on each sequence's first token (None without one).
    The pooler is called as HuggingFace calls it, on a ``[B, 1, d]`` batch."""
    pooler = base._modules.get("pooler")
    if pooler is None:
        return None
    return pooler(ragged.pool(enc.rt, "first").unsqueeze(1))


def _sequence_logits(family: Family, model: nn.Module, base: nn.Module, enc: Encoded) -> torch.Tensor:
    m = model._modules
    if family.style == "bert":
        return m["classifier"](m["dropout"](pooled_output(base, enc)))
    first = ragged.pool(enc.rt, "first")
    if family.style == "distil":
        return m["classifier"](m["dropout"](F.relu(m["pre_classifier"](first))))
    return m["classifier"](first.unsqueeze(1))  # RobertaClassificationHead / ElectraClassificationHead read [:, 0]


def _sequence_loss(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HuggingFace's loss of its sequence classification heads, problem type included."""
    config, num_labels = model.config, model.num_labels
    labels = labels.to(logits.device)
    if config.problem_type is None:
        if num_labels == 1:
            config.problem_type = "regression"
        elif num_labels > 1 and (labels.dtype == torch.long or labels.dtype == torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    if config.problem_type == "regression":
        if num_labels == 1:
            return F.mse_loss(logits.squeeze(), labels.squeeze())
        return F.mse_loss(logits, labels)
    if config.problem_type == "single_label_classification":
        return F.cross_entropy(logits.view(-1, num_labels), labels.view(-1))
    if config.problem_type == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits, labels)
    return None


def _masked_lm_logits(family: Family, model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    m = model._modules
    if family.style == "bert":
        return m["cls"](h)
    if family.style == "roberta":
        return m["lm_head"](h)
    if family.style == "electra":
        return m["generator_lm_head"](m["generator_predictions"](h))
    return m["vocab_projector"](m["vocab_layer_norm"](m["activation"](m["vocab_transform"](h))))


def _positions(fn: str, name: str, t, batch: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}(): expected {name} to be a tensor of shape [B], got {describe(t)}")
    if t.dim() > 1:
        t = t.squeeze(-1)
    if tuple(t.shape) != (batch,):
        raise ValueError(f"{fn}(): expected {name} of shape ({batch},), got {tuple(t.shape)}")
    return t


def _qa_loss(fn: str, enc: Encoded, start: torch.Tensor, end: torch.Tensor, start_positions,
             end_positions) -> torch.Tensor:
    """See the module docstring. Each sequence's logits are laid out as in the caller's
    batch with the dtype's lowest value at padding (no contribution to the softmax, and no
    NaN in the rows of empty sequences); targets outside the sequence's tokens become -100."""
    batch = enc.batch
    size = batch.rt.batch_size
    starts = _positions(fn, "start_positions", start_positions, size).to(start.device)
    ends = _positions(fn, "end_positions", end_positions, size).to(start.device)
    low = torch.finfo(start.dtype).min
    if batch.ragged:
        width = batch.rt.max_len
        lengths = batch.rt.lengths.to(torch.int64)
    else:
        width = batch.layout.width

    def loss(values: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = batch.out(values, fill=low)
        if batch.ragged:
            logits = logits.to_padded(padding_value=low, total_length=width)
        target = target.clamp(0, width)
        if batch.ragged:
            inside = target < lengths
        else:
            inside = target < width
            if batch.keep is not None and width:
                inside = inside & batch.keep.gather(1, target.clamp(max=width - 1).unsqueeze(1))[:, 0]
        return F.cross_entropy(logits, torch.where(inside, target, -100), ignore_index=-100)

    return (loss(start, starts) + loss(end, ends)) / 2


def head_outputs(fn: str, kind: str, family: Family, model: nn.Module, base: nn.Module, enc: Encoded,
                 labels, start_positions, end_positions) -> dict:
    """The output fields of head ``kind`` (``loss`` None without labels): logits in the
    caller's form (a RaggedTensor for a RaggedTensor input, padded with zeros otherwise)."""
    if kind == "sequence":
        logits = _sequence_logits(family, model, base, enc)
        loss = None if labels is None else _sequence_loss(model, logits, labels)
        return {"loss": loss, "logits": logits}
    h = enc.values
    if kind == "qa":
        if family.style == "distil":
            h = model._modules["dropout"](h)
        logits = model._modules["qa_outputs"](h)
        start, end = logits[:, 0].contiguous(), logits[:, 1].contiguous()
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = _qa_loss(fn, enc, start, end, start_positions, end_positions)
        return {"loss": loss, "start_logits": enc.batch.out(start), "end_logits": enc.batch.out(end)}
    if kind == "token":
        logits = model._modules["classifier"](model._modules["dropout"](h))
    else:
        logits = _masked_lm_logits(family, model, h)
    loss = None
    if labels is not None:
        target = enc.batch.pack(fn, "labels", labels, 0).to(logits.device)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), target.reshape(-1))
    return {"loss": loss, "logits": enc.batch.out(logits)}
