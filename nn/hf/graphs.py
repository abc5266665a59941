"""The HuggingFace families' hooks for :func:`ragged.nn.graphed`, registered with it when this
module is imported (``ragged.nn`` imports it): the graph wrapper knows no model family, and asks
these (:class:`ragged.nn.graphed.GraphHooks`) about a module converted by :func:`ragged.nn.convert`.

* **The longest sequence a model takes** is its family's :meth:`~ragged.nn.hf.family.Family.max_len`:
  the rows of its position table (RoBERTa's positions count from ``padding_idx + 1``, so its
  family takes that many rows off).
* **Losses computed after the graph**: the regression and multi-label losses of a converted
  sequence-classification head (HuggingFace's ``problem_type`` rule) and the span loss of a
  question-answering head average over every sequence, so no ignored entry can keep a bucket's
  spare sequences out of them; the graph computes the logits without the targets, and the loss
  is computed from the logits cut to the caller's sequences, as the head computes it (integer
  labels of a single-label head stay in the graph: its cross-entropy ignores ``-100``).
* **A converted SentenceTransformer** is returned by :func:`ragged.nn.graphed` itself: its
  ``encode()`` (and forward) now replay graphs of its HuggingFace model (over a decoder, of a
  :class:`ragged.nn.hf.decoder.PackedDecoder` of it; the pooling and the modules after it run
  eagerly on the graph's output); ``ragged.nn.graphed(st, ...)`` again replaces those graphs, and
  ``st[0].forward.graphed = None`` turns them off.
"""

from __future__ import annotations

import inspect
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ragged import RaggedTensor

from ..graphed import Graphed, GraphHooks, register_hooks
from ..graphed_train import IGNORE, SPAN_POSITIONS, is_float
from . import sentence
from .forward import identify, is_converted, is_hf_model

__all__ = ["HOOKS", "HuggingFaceHooks", "OutsideLoss", "outside_loss"]

_NO_IGNORED_ENTRIES = ("regression", "multi_label_classification")  # problem types whose loss averages every row


def _converted(module: nn.Module):
    """``(family, head kind)`` of a HuggingFace model converted by :func:`ragged.nn.convert`, else None."""
    if not (is_hf_model(module) and is_converted(module)):
        return None
    ident = identify(module)
    return None if isinstance(ident, str) else ident


class OutsideLoss:
    """The loss of a converted HuggingFace head that no ignored entry keeps a bucket's spare
    sequences out of: ``kind`` (``"sequence"`` or ``"qa"``), its targets (the labels, or the
    start and end positions) and the call without them (``args``, ``kwargs``), whose logits,
    cut to the caller's batch, :meth:`finish` turns into the loss."""

    __slots__ = ("args", "kind", "kwargs", "targets")

    def __init__(self, kind: str, targets: tuple, args: tuple, kwargs: dict) -> None:
        self.kind, self.targets, self.args, self.kwargs = kind, targets, args, kwargs

    def finish(self, module, out):
        """``out`` (the head's output without a loss) with the loss first, as the head gives it."""
        tuple_out = not isinstance(out, dict)
        if self.kind == "sequence":
            from transformers.loss.loss_utils import ForSequenceClassificationLoss

            logits = out[0] if tuple_out else out["logits"]
            # HuggingFace's own loss (problem_type set on the config at the first call, as the head does)
            loss = ForSequenceClassificationLoss(self.targets[0], logits, module.config)
        else:
            start, end = (out[0], out[1]) if tuple_out else (out["start_logits"], out["end_logits"])
            loss = (_span_loss(start, self.targets[0]) + _span_loss(end, self.targets[1])) / 2
        if tuple_out:
            return (loss, *out)
        return type(out)(loss=loss, **out)  # a tensor first field: ModelOutput sets the fields as given


def _span_loss(logits: RaggedTensor, positions: torch.Tensor) -> torch.Tensor:
    """The converted question-answering head's loss of one end of the span over a RaggedTensor
    input: each sequence's softmax over its real tokens, positions clamped to ``[0, max_len]``,
    a position outside the sequence's tokens ignored (:mod:`ragged.nn.hf.heads`)."""
    width = logits.max_len
    padded = logits.to_padded(padding_value=torch.finfo(logits.values.dtype).min, total_length=width)
    target = positions.reshape(-1).to(padded.device).clamp(0, width)
    inside = target < logits.lengths.to(device=padded.device, dtype=torch.int64)
    return F.cross_entropy(padded, torch.where(inside, target, IGNORE), ignore_index=IGNORE)


_POSITIONAL: dict[type, tuple[str, ...]] = {}  # class -> its forward's positional parameter names


def _bound(module, args: tuple, kwargs: dict) -> dict | None:
    """The call's arguments by name (None: more positional ones than the forward takes)."""
    names = _POSITIONAL.get(type(module))
    if names is None:
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = _POSITIONAL[type(module)] = tuple(
            p.name for p in inspect.signature(module.forward).parameters.values() if p.kind in kinds
        )
    if len(args) > len(names):
        return None
    return {**dict(zip(names, args)), **kwargs}


def _problem_type(config, num_labels: int, labels: torch.Tensor) -> str:
    """HuggingFace's ``problem_type`` of a sequence-classification loss, read only (its loss sets it)."""
    if config.problem_type is not None:
        return config.problem_type
    if num_labels == 1:
        return "regression"
    if num_labels > 1 and labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def outside_loss(fn: str, module, args: tuple, kwargs: dict) -> OutsideLoss | None:
    """The loss of this call to compute outside the graph (see the module docstring), or None:
    no loss argument, not a converted HuggingFace sequence-classification or
    question-answering head, or a cross-entropy the graph computes. Refuses targets whose
    shape or dtype the loss cannot take, before anything runs. Host ints only."""
    if not args and all(kwargs.get(name) is None for name in ("labels", *SPAN_POSITIONS)):
        return None
    ident = _converted(module)
    if ident is None or ident[1] not in ("sequence", "qa"):
        return None
    kw = _bound(module, args, kwargs)
    batch = None if kw is None else next((v for v in kw.values() if isinstance(v, RaggedTensor)), None)
    if kw is None or batch is None:
        return None  # the graphed call refuses it
    size, cls = batch.batch_size, type(module).__name__
    if ident[1] == "qa":
        targets = tuple(kw.get(name) for name in SPAN_POSITIONS)
        if any(t is None for t in targets):
            return None  # no loss
        for name, t in zip(SPAN_POSITIONS, targets):
            if not isinstance(t, torch.Tensor) or is_float(t) or t.numel() != size or t.dim() > 2:
                raise ValueError(
                    f"{fn}(): expected {name} to be an integer tensor of shape ({size},) for the span "
                    f"loss of {cls}, got {_what(t)}"
                )
        rest = {k: v for k, v in kw.items() if k not in SPAN_POSITIONS}
        return OutsideLoss("qa", targets, (), rest)
    labels = kw.get("labels")
    if not isinstance(labels, torch.Tensor):
        return None
    n = module.num_labels
    problem = _problem_type(module.config, n, labels)
    if problem not in _NO_IGNORED_ENTRIES:
        return None  # a cross-entropy: -100 at the spare sequences
    shapes = [(size,), (size, 1)] if problem == "regression" and n == 1 else [(size, n)]
    if tuple(labels.shape) not in shapes:
        want = " or ".join(str(s) for s in shapes)
        if module.config.problem_type is None and problem == "multi_label_classification":
            want = f"integer labels (single-label classification) or floating labels of shape {want} (multi-label)"
        else:
            want = f"labels of shape {want} ({problem.replace('_', ' ')})"
        raise ValueError(f"{fn}(): expected {want} for {cls} with num_labels={n}, got labels of {_what(labels)}")
    return OutsideLoss("sequence", (labels,), (), {k: v for k, v in kw.items() if k != "labels"})


def _what(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"dtype {t.dtype} and shape {tuple(t.shape)}"
    return type(t).__name__


class HuggingFaceHooks(GraphHooks):
    """What the HuggingFace families tell :func:`ragged.nn.graphed` (see the module docstring)."""

    def max_len(self, module: nn.Module) -> tuple[int, str] | None:
        ident = _converted(module)
        return None if ident is None else ident[0].max_len(module)

    def outside_loss(self, fn: str, module: nn.Module, args: tuple, kwargs: dict) -> OutsideLoss | None:
        return outside_loss(fn, module, args, kwargs)

    def graphed(self, module: nn.Module, make) -> nn.Module | None:
        if not sentence.is_sentence_transformer(module):
            return None
        if not sentence.is_converted(module):
            raise ValueError(
                "ragged.nn.graphed(): expected a SentenceTransformer converted by ragged.nn.convert "
                "(its encode() packs the batches the graphs take), got one that is not converted"
            )
        forward = cast(nn.Sequential, module)[0].__dict__["forward"]
        graphs: Graphed = make(sentence.graph_target(module))
        forward.graphed = graphs
        return module


HOOKS = HuggingFaceHooks()
register_hooks(HOOKS)
