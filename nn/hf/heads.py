"""The task heads of converted HuggingFace models (see :mod:`ragged.nn.hf`), the same for every
family: the family says which of its head modules give the logits
(:class:`ragged.nn.hf.family.Family`), this module lays them out and computes the losses.

Sequence-level heads read each sequence's pooled tokens (its first token, :func:`ragged.pool`
``"first"``, or its mean, ``[B, d]``), token-level heads the packed tokens ``[T, d]``.
Losses are HuggingFace's, on the real tokens:

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

**Loss keyword arguments.** Where HuggingFace computes a head's loss as
``self.loss_function(..., **kwargs)`` (the family's ``loss_function_heads``: ModernBERT's masked
LM and question answering), the converted head calls the model's ``loss_function`` too, on the
packed labelled tokens (question answering: on each sequence's logits laid out as above, the
positions outside its tokens set to the ignored index ``M``), with the keyword arguments of the
forward that its signature does not name, as HuggingFace hands them on: ``num_items_in_batch``
(the summed loss divided by it, what ``Trainer`` passes under gradient accumulation),
``ignore_index``, and whatever else (the default loss functions ignore the rest). The other
heads' HuggingFace losses are fixed and ignore such arguments; so do the converted ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ragged.utils import describe

from .encoder import Encoded
from .family import Family

__all__ = ["head_outputs"]


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


def _positions(fn: str, name: str, t, batch: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}(): expected {name} to be a tensor of shape [B], got {describe(t)}")
    if t.dim() > 1:
        t = t.squeeze(-1)
    if tuple(t.shape) != (batch,):
        raise ValueError(f"{fn}(): expected {name} of shape ({batch},), got {tuple(t.shape)}")
    return t


def _qa_loss(
    fn: str,
    enc: Encoded,
    start: torch.Tensor,
    end: torch.Tensor,
    start_positions,
    end_positions,
    loss_function=None,
    loss_kwargs=None,
) -> torch.Tensor:
    """See the module docstring. Each sequence's logits are laid out as in the caller's
    batch ``[B, M]`` with the dtype's lowest value at padding (no contribution to the softmax,
    and no NaN in the rows of empty sequences); targets outside the sequence's tokens become
    ``M``, the ignored index. ``loss_function``: HuggingFace's question-answering loss of the
    model, called with ``loss_kwargs`` (else its fixed cross-entropy)."""
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

    def laid_out(values: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        return logits, torch.where(inside, target, width)

    (start_logits, start_target), (end_logits, end_target) = laid_out(start, starts), laid_out(end, ends)
    if loss_function is not None:
        return loss_function(start_logits, end_logits, start_target, end_target, **loss_kwargs)
    return (
        F.cross_entropy(start_logits, start_target, ignore_index=width)
        + F.cross_entropy(end_logits, end_target, ignore_index=width)
    ) / 2


def head_outputs(
    fn: str,
    kind: str,
    family: Family,
    model: nn.Module,
    base: nn.Module,
    enc: Encoded,
    labels,
    start_positions,
    end_positions,
    loss_kwargs: dict | None = None,
) -> dict:
    """The output fields of head ``kind`` (``loss`` None without labels): logits in the
    caller's form (a RaggedTensor for a RaggedTensor input, padded with zeros otherwise).
    ``loss_kwargs``: for a head of ``family.loss_function_heads``, the keyword arguments
    HuggingFace's forward hands its ``loss_function`` (see the module docstring); None for the
    others, whose losses take none."""
    loss_function = None if loss_kwargs is None else model.loss_function
    if kind == "sequence":
        logits = family.sequence_logits(model, base, enc)
        loss = None if labels is None else _sequence_loss(model, logits, labels)
        return {"loss": loss, "logits": logits}
    h = enc.values
    if kind == "qa":
        logits = family.qa_logits(model, h)
        start, end = logits[:, 0].contiguous(), logits[:, 1].contiguous()
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = _qa_loss(fn, enc, start, end, start_positions, end_positions, loss_function, loss_kwargs)
        return {"loss": loss, "start_logits": enc.batch.out(start), "end_logits": enc.batch.out(end)}
    target = None if labels is None else enc.batch.pack(fn, "labels", labels, 0).to(h.device)
    if kind == "token":
        logits = family.token_logits(model, h)
        loss_function = None  # HuggingFace's token classification losses are fixed
    else:
        chosen = family.masked_lm_tokens(model, target)
        if chosen is not None:  # logits of the labelled tokens only, flat [N, V] (HuggingFace's sparse prediction)
            logits = family.masked_lm_logits(model, h.index_select(0, chosen))
            return {
                "loss": _token_loss(model, logits, target.index_select(0, chosen), loss_function, loss_kwargs),
                "logits": logits,
            }
        logits = family.masked_lm_logits(model, h)
    loss = None if target is None else _token_loss(model, logits, target, loss_function, loss_kwargs)
    return {"loss": loss, "logits": enc.batch.out(logits)}


def _token_loss(
    model: nn.Module, logits: torch.Tensor, target: torch.Tensor, loss_function, loss_kwargs: dict | None
) -> torch.Tensor:
    """The loss of the packed tokens' logits ``[T, V]`` against ``target [T]``: HuggingFace's
    masked-LM ``loss_function`` with ``loss_kwargs`` where the head computes it so, else the
    cross-entropy averaged over the labelled tokens (labels -100 ignored)."""
    if loss_function is not None:
        return loss_function(logits, target, vocab_size=model.config.vocab_size, **loss_kwargs)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.reshape(-1))
