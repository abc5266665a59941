"""``ragged.nn.convert`` of HuggingFace decoders: the base models, ``ForCausalLM`` and
``ForSequenceClassification`` heads of Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2 and Gemma3's
text model (``Gemma3ForCausalLM``, ``Gemma3TextForSequenceClassification``), computed by the decoder
core
(:mod:`ragged.nn.hf.decoder_core`) on packed tokens.

As for the encoder families (:mod:`ragged.nn.hf.forward`), conversion sets an instance
``forward`` (:class:`DecoderForward`) on the model and on its base model; classes, modules,
Parameters and ``state_dict`` stay HuggingFace's.

**Inputs.** ``input_ids`` as a :class:`ragged.RaggedTensor` (values ``[T]``; each sequence's
positions from 0 unless ``position_ids`` is given, packed ``[T]`` or a RaggedTensor), or padded
``[B, M]`` with an optional 2-D ``attention_mask`` (right or left padding; the mask is read on
the host three times: the ids' layout, the positions' and the padding side, to pad the outputs
back): positions are then the padded columns, as HuggingFace numbers them. A RaggedTensor input
reads nothing. A flattened row as ``DataCollatorWithFlattening`` and TRL's ``padding_free`` make
it (``input_ids [1, T]`` with ``cu_seq_lens_q`` / ``cu_seq_lens_k``, ``max_length_q`` and
``position_ids``) runs as its sequences, outputs ``[1, T, ...]``, labels shifted along the row as
HuggingFace shifts them (the collators put -100 at each sequence's first label).
``labels``: padded ``[B, M]`` (shifted per row as HuggingFace shifts them) or a RaggedTensor
(shifted per sequence: :func:`ragged.shift_labels`); ``num_items_in_batch`` and ``ignore_index``
as HuggingFace's loss takes them.

**Outputs.** HuggingFace's output classes. For a RaggedTensor input, ``last_hidden_state``,
``logits`` and ``hidden_states`` are RaggedTensors; for a padded one they are padded like the
input, zeros at padding. In training with ``labels`` the loss comes from the hidden states
through :func:`ragged.linear_cross_entropy` and ``logits`` is None (:mod:`ragged.nn.hf.lm_loss`);
otherwise the logits are computed (Gemma2's and Gemma3's final soft cap included) and the loss from them in
float32, as HuggingFace does. A sequence classifier scores each sequence's last real token
(HuggingFace: the rightmost token that is not ``pad_token_id``, the same token wherever the padding
holds the pad id and no real sequence ends with it; an empty sequence scores zeros) and takes the
model's own ``loss_function`` (regression, single- or multi-label, as the config says).

**Left to HuggingFace's forward** (the converted forward calls the model's own): a call with a
cache (``cache`` / ``past_key_values``), ``use_cache=True`` passed explicitly (generation), or
``inputs_embeds``. **Refused** at conversion (:func:`why_not_decoder`): what the decoder core
refuses (attention soft-capping, position-dependent rotary scalings, other activations).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ragged
from ragged import RaggedTensor
from ragged.utils import describe

from .decoder_core import CORE_FAMILIES, run_packed_core, why_not_core
from .lm_loss import head_loss

__all__ = ["DecoderForward", "convert_decoder", "identify_decoder_model", "why_not_decoder"]

# head class -> (kind, its base model's class): <Family>ForCausalLM and
# <Family>ForSequenceClassification over <Family>Model; Gemma3's text heads over Gemma3TextModel
_HEADS = {
    f"{base.removesuffix('Model')}{suffix}": (kind, base)
    for base in CORE_FAMILIES
    if base != "Gemma3TextModel"
    for suffix, kind in (("ForCausalLM", "causal_lm"), ("ForSequenceClassification", "sequence"))
}
_HEADS.update({
    "Gemma3ForCausalLM": ("causal_lm", "Gemma3TextModel"),
    "Gemma3TextForSequenceClassification": ("sequence", "Gemma3TextModel"),
})  # fmt: skip
_CACHE_NAMES = ("cache", "past_key_values")


def identify_decoder_model(model: object) -> str | None:
    """``"base"``, ``"causal_lm"`` or ``"sequence"`` for a class the decoder conversion takes
    (exactly), else None."""
    cls = type(model)
    mod = sys.modules.get(cls.__module__)
    if not cls.__module__.startswith("transformers.models.") or getattr(mod, cls.__name__, None) is not cls:
        return None
    if cls.__name__ in CORE_FAMILIES:
        return "base"
    head = _HEADS.get(cls.__name__)
    return None if head is None else head[0]


def why_not_decoder(model: Any) -> str | None:
    kind = identify_decoder_model(model)
    if kind is None:
        return f"{type(model).__name__} is not a decoder class the conversion takes"
    base = model if kind == "base" else getattr(model, model.base_model_prefix)
    want = _HEADS[type(model).__name__][1] if kind != "base" else type(base).__name__
    if type(base).__name__ != want:
        return f"its base model is a {type(base).__name__}"
    return why_not_core(base)


class DecoderForward:
    """The ``forward`` of a converted decoder (see the module docstring)."""

    def __init__(self, module: nn.Module, kind: str) -> None:
        self.module = module
        self.kind = kind

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def __repr__(self) -> str:
        return f"DecoderForward({type(self.module).__name__}, kind={self.kind!r})"

    def __call__(self, *args, **kwargs):
        model: Any = self.module
        bound = self.__signature__.bind(*args, **kwargs)
        given = dict(bound.arguments)
        extra = dict(given.pop("kwargs", {}))
        if (
            any(given.get(n, extra.get(n)) is not None for n in _CACHE_NAMES)
            or given.get("use_cache", extra.get("use_cache")) is True
            or given.get("inputs_embeds") is not None
            or given.get("input_ids") is None
        ):
            return type(model).forward(model, *args, **kwargs)
        return _forward(model, self.kind, given, extra)


def _pack_batch(given: dict, extra: dict) -> tuple[RaggedTensor, torch.Tensor, Any]:
    """``(ids, positions, layout)``: layout None for a RaggedTensor input, ``"flat"`` for a
    flattened row with its offsets (``cu_seq_lens_q``), else ``(mask, M, padding side)`` to pad
    the outputs back."""
    ids = given["input_ids"]
    positions = given.get("position_ids")
    cu = extra.pop("cu_seq_lens_q", None)
    cu_k = extra.pop("cu_seq_lens_k", None)
    longest = extra.pop("max_length_q", None)
    extra.pop("max_length_k", None)
    if cu is not None:  # DataCollatorWithFlattening / TRL padding_free: one row, the offsets beside it
        if cu_k is not None and cu_k is not cu and not torch.equal(cu_k, cu):
            raise ValueError("ragged.nn: a converted decoder takes cu_seq_lens_k equal to cu_seq_lens_q")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(f"ragged.nn: cu_seq_lens_q goes with input_ids of one row [1, T], got {describe(ids)}")
        if longest is None:
            longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0  # one read
        rt = RaggedTensor(ids[0], cu.to(ids.device), int(longest))
        flat_positions = rt.position_ids() if positions is None else positions.reshape(-1)
        return rt, flat_positions, "flat"
    if isinstance(ids, RaggedTensor):
        if isinstance(positions, RaggedTensor):
            positions = positions.values
        return ids, ids.position_ids() if positions is None else positions, None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(
            f"ragged.nn: a converted {given.get('_name', 'decoder')} takes input_ids as a RaggedTensor or "
            f"a padded [B, M] tensor, got {describe(ids)}"
        )
    mask = given.get("attention_mask")
    b, m = ids.shape
    columns = torch.arange(m, device=ids.device).expand(b, m) if positions is None else positions.expand(b, m)
    if mask is None:
        return ragged.pack(ids), ragged.pack(columns).values, (None, m, "right")
    rt = ragged.pack(ids, attention_mask=mask)
    side = "left" if bool(mask[:, 0].lt(mask[:, -1]).any()) else "right"
    return rt, ragged.pack(columns, attention_mask=mask).values, (mask, m, side)


def _out(rt: RaggedTensor, values: torch.Tensor, layout):
    if layout is None:
        return rt.with_values(values)
    if layout == "flat":
        return values[None]
    _, m, side = layout
    return ragged.unpack(rt.with_values(values), total_length=m, padding_side=side)


def _targets(given: dict, extra: dict, rt: RaggedTensor, layout, ignore_index: int) -> torch.Tensor | None:
    labels = given.get("labels")
    shift = extra.pop("shift_labels", None)
    if labels is None and shift is None:
        return None
    if shift is not None:
        labels_rt = shift
        if isinstance(labels_rt, RaggedTensor):
            return labels_rt.values
        if layout is None or layout == "flat" or layout[0] is None:
            return labels_rt.reshape(-1)
        return ragged.pack(labels_rt, attention_mask=layout[0]).values
    if isinstance(labels, RaggedTensor):
        return ragged.shift_labels(labels, ignore_index)
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"ragged.nn: expected labels as a tensor or a RaggedTensor, got {describe(labels)}")
    if layout is None:  # packed labels [T] with a RaggedTensor input: per sequence
        return ragged.shift_labels(rt.with_values(labels.reshape(-1)), ignore_index)
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # each padded row, as HF shifts it
    if layout == "flat" or layout[0] is None:
        return shifted.reshape(-1)
    return ragged.pack(shifted, attention_mask=layout[0]).values


def _forward(model: Any, kind: str, given: dict, extra: dict):
    from transformers.modeling_outputs import (
        BaseModelOutputWithPast,
        CausalLMOutputWithPast,
        SequenceClassifierOutputWithPast,
    )

    base = model if kind == "base" else getattr(model, model.base_model_prefix)
    rt, positions, layout = _pack_batch(given, extra)
    want_hidden = bool(given.get("output_hidden_states", extra.get("output_hidden_states")))
    states: list | None = [] if want_hidden else None
    hidden = run_packed_core(base, rt, positions, states)
    all_hidden = None if states is None else tuple(_out(rt, s, layout) for s in states)
    if kind == "base":
        return BaseModelOutputWithPast(last_hidden_state=_out(rt, hidden.values, layout), hidden_states=all_hidden)
    if kind == "sequence":  # each sequence's last real token (HF: the last that is not the pad id)
        lengths = rt.offsets[1:] - rt.offsets[:-1]
        last = (rt.offsets[1:] - 1).clamp_min(0).long()
        if rt.num_tokens:
            pooled = hidden.values.index_select(0, last)
        else:
            pooled = hidden.values.new_zeros((lengths.shape[0], hidden.values.shape[1]))
        pooled = torch.where((lengths > 0)[:, None], pooled, torch.zeros((), dtype=pooled.dtype, device=pooled.device))
        logits = model.score(pooled)
        labels = given.get("labels")
        if isinstance(labels, RaggedTensor):
            labels = labels.values
        loss = None
        if labels is not None:
            loss = model.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=model.config)
        return SequenceClassifierOutputWithPast(loss=loss, logits=logits, hidden_states=all_hidden)
    ignore_index = extra.pop("ignore_index", -100)
    num_items = extra.pop("num_items_in_batch", None)
    targets = _targets(given, extra, rt, layout, ignore_index)
    if targets is not None and model.training and torch.is_grad_enabled():
        loss = head_loss(model, hidden.values, targets, num_items, ignore_index)
        return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=all_hidden)
    logits = model.lm_head(hidden.values)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    loss = None
    if targets is not None:
        flat = logits.float()
        if num_items is None:
            loss = F.cross_entropy(flat, targets.to(flat.device), ignore_index=ignore_index)
        else:
            loss = F.cross_entropy(flat, targets.to(flat.device), ignore_index=ignore_index, reduction="sum")
            loss = loss / (num_items.to(loss.device) if isinstance(num_items, torch.Tensor) else num_items)
    return CausalLMOutputWithPast(loss=loss, logits=_out(rt, logits, layout), hidden_states=all_hidden)


def _set(module: nn.Module, kind: str) -> None:
    module.forward = DecoderForward(module, kind)


def is_converted_decoder(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, DecoderForward) and forward.module is module


def convert_decoder(model: nn.Module, copy: bool) -> nn.Module:
    """``ragged.nn.convert`` of a decoder (see the module docstring): refused with
    NotImplementedError (the model unchanged), or converted in place (``copy=True``: a converted
    deep copy)."""
    import copy as copying

    why = why_not_decoder(model)
    if why is not None:
        raise NotImplementedError(
            f"ragged.nn.convert(): cannot convert {type(model).__name__}: {why}; the model is unchanged"
        )
    target: Any = copying.deepcopy(model) if copy else model
    kind = identify_decoder_model(target)
    assert kind is not None
    if not is_converted_decoder(target):
        _set(target, kind)
    if kind != "base":
        base = getattr(target, target.base_model_prefix)
        if not is_converted_decoder(base):
            _set(base, "base")
    return target
