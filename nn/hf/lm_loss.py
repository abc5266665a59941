"""A HuggingFace causal LM's training loss without its logits: :func:`fuse_lm_loss`.

In training, ``LlamaForCausalLM(input_ids, labels=...)`` computes the logits of every token,
``[B, M, V]`` in the head's dtype, upcasts them to float32 and takes the cross-entropy: for a
vocabulary of 150k-250k ids these are the largest tensors of the step (with their gradient,
more than the rest of a small model's activations). :func:`fuse_lm_loss` makes the model compute
the same loss from the last hidden states with :func:`ragged.linear_cross_entropy`, one slice of
the vocabulary at a time, whenever the forward is given ``labels`` in training mode; the
output's ``logits`` is then None. Everything else stays HuggingFace's: the base model's forward,
its attention implementation (``attn_implementation="ragged"`` on flattened batches included), the
labels' shift (``labels`` padded by one ``ignore_index`` and shifted, or the ``shift_labels``
keyword), ``ignore_index``, ``num_items_in_batch`` (what ``Trainer`` passes) and Gemma's
``final_logit_softcapping``. In eval mode, without labels, or with ``logits_to_keep`` set, the
model's own forward runs, logits and all.

Mechanism, as :mod:`ragged.nn.hf.forward`'s: an instance attribute ``forward`` (class, modules,
Parameters and ``state_dict`` untouched; :func:`unfuse_lm_loss` removes it); its signature is
the class forward's, which ``Trainer`` reads. Taken: the classes of :data:`CAUSAL_LMS` exactly
(their forward is ``self.model(...)``, then ``self.lm_head``, then the soft cap where the config
sets one); anything else raises ``TypeError`` naming it.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ragged

from .lora import effective_linear, linear_reason

__all__ = ["CAUSAL_LMS", "fuse_lm_loss", "fused", "head_loss", "unfuse_lm_loss"]

# (transformers module under transformers.models, class)
CAUSAL_LMS = (
    ("llama.modeling_llama", "LlamaForCausalLM"),
    ("mistral.modeling_mistral", "MistralForCausalLM"),
    ("qwen2.modeling_qwen2", "Qwen2ForCausalLM"),
    ("qwen3.modeling_qwen3", "Qwen3ForCausalLM"),
    ("gemma.modeling_gemma", "GemmaForCausalLM"),
    ("gemma2.modeling_gemma2", "Gemma2ForCausalLM"),
    ("gemma3.modeling_gemma3", "Gemma3ForCausalLM"),
)
_FN = "ragged.nn.fuse_lm_loss"


def _taken(model: object) -> bool:
    cls = type(model)
    for module, name in CAUSAL_LMS:
        mod = sys.modules.get(f"transformers.models.{module}")
        if mod is not None and cls.__name__ == name and getattr(mod, name, None) is cls:
            return True
    return False


class _FusedLossForward:
    """The forward of a model under :func:`fuse_lm_loss` (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        self.module = model
        original = type(model).forward
        self.__signature__ = inspect.signature(original.__get__(model))
        base: Any = model.get_decoder()
        self._base_params = set(inspect.signature(type(base).forward).parameters)

    def __call__(self, *args, **kwargs):
        model: Any = self.module
        original = type(model).forward.__get__(model)
        bound = self.__signature__.bind(*args, **kwargs)
        given = dict(bound.arguments)
        extra = dict(given.pop("kwargs", {}))
        labels = given.pop("labels", None)
        keep = given.pop("logits_to_keep", 0)
        if labels is None or not model.training or keep not in (0, None):
            return original(*args, **kwargs)
        num_items = extra.pop("num_items_in_batch", None)
        shift = extra.pop("shift_labels", None)
        ignore_index = extra.pop("ignore_index", -100)
        base: Any = model.get_decoder()
        call = {k: v for k, v in given.items() if k in self._base_params}
        outputs = base(**call, **extra)
        hidden = outputs.last_hidden_state
        if shift is None:
            shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        loss = head_loss(model, hidden.reshape(-1, hidden.shape[-1]), shift.reshape(-1), num_items, ignore_index)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        names = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
        rest = {k: v for k, v in outputs.items() if k in names and k not in ("loss", "logits")}
        return CausalLMOutputWithPast(loss=loss, logits=None, **rest)


def head_loss(model: Any, hidden: torch.Tensor, targets: torch.Tensor, num_items, ignore_index: int = -100):
    """HF's causal-LM loss of ``model``'s head on ``hidden [T, d]`` against next-token
    ``targets [T]`` (already shifted), through :func:`ragged.linear_cross_entropy`: the head's GEMM
    in autocast's dtype where autocast is on (as HF's ``lm_head``), the soft cap of the config,
    the sum over ``num_items`` where given, else the mean."""
    head = model.get_output_embeddings()
    if linear_reason(head, "its output embeddings") is not None:
        return _head_loss_from_logits(model, head, hidden, targets, num_items, ignore_index)
    w, b = effective_linear(head, "its output embeddings")  # a LoRA'd head: the Linear it computes
    h = hidden
    device = h.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        h, w = h.to(dtype), w.to(dtype)
        b = None if b is None else b.to(dtype)
    with torch.autocast(device, enabled=False):
        return ragged.linear_cross_entropy(
            h,
            w,
            targets.to(h.device),
            b,
            ignore_index=ignore_index,
            num_items_in_batch=num_items,
            softcap=getattr(model.config, "final_logit_softcapping", None),
        )


_WARNED: set[str] = set()


def _head_loss_from_logits(model: Any, head: nn.Module, hidden, targets, num_items, ignore_index: int):
    """The loss through the logits, for a head the fused loss cannot read as a Linear (peft's
    ``modules_to_save`` wrapper, a quantized head): HF's computation, with a one-time warning."""
    why = linear_reason(head, "its output embeddings")
    if type(model).__name__ not in _WARNED:
        _WARNED.add(type(model).__name__)
        warnings.warn(f"ragged.nn: {type(model).__name__}'s loss goes through the [T, V] logits: {why}", stacklevel=3)
    logits = head(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    targets = targets.to(logits.device)
    if num_items is None:
        return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)
    loss = F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")
    return loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)


def fused(model: nn.Module) -> bool:
    """Whether ``model`` computes its training loss through :func:`fuse_lm_loss`."""
    return isinstance(model.__dict__.get("forward"), _FusedLossForward)


def fuse_lm_loss(model: nn.Module) -> nn.Module:
    """Make a causal LM (one of :data:`CAUSAL_LMS`) compute its training loss from the hidden
    states with :func:`ragged.linear_cross_entropy`, never the logits (see the module docstring);
    returns ``model``. Calling it again changes nothing."""
    if not isinstance(model, nn.Module) or not _taken(model):
        names = ", ".join(name for _, name in CAUSAL_LMS)
        raise TypeError(f"{_FN}(): expected model to be one of {names}, got {type(model).__name__}")
    if "forward" in model.__dict__ and not fused(model):
        raise ValueError(f"{_FN}(): {type(model).__name__} already has a forward of its own (converted or patched)")
    if not fused(model):
        model.forward = _FusedLossForward(model)
    return model


def unfuse_lm_loss(model: nn.Module) -> nn.Module:
    """Undo :func:`fuse_lm_loss` (nothing where it was not applied); returns ``model``."""
    if fused(model):
        del model.forward
    return model
