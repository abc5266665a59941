"""HuggingFace decoder base models read into :class:`ragged.nn.decoder_layer.DecoderSpec` s, and
their forward on a packed batch through the decoder core (:func:`run_packed_core`).

Families (the base model classes, exactly): Llama, Mistral, Qwen2, Qwen3 (per-head q/k norms),
Gemma (norms of ``1 + weight``, GeGLU with tanh GELU, embeddings times ``sqrt(d)``), Gemma2
(the same, plus the norms around the attention and the MLP outputs, ``query_pre_attn_scalar``
and per-layer sliding windows) and Gemma3's text model (Gemma2's layer with q/k norms, a rotary
table per layer type, and EmbeddingGemma's ``use_bidirectional_attention``: each token attends
both ways, within ``|i - j| < sliding_window`` on sliding layers). Refused with the reason
(:func:`why_not_core`): other classes, attention logit soft-capping, rotary scalings whose
frequencies depend on the position (``dynamic``/``longrope``), attention dropout, projections
that are neither a ``torch.nn.Linear`` nor peft's LoRA Linear over one (LoRA adapters are read
as the Linear they compute, :mod:`ragged.nn.hf.lora`; their refusals apply: dropout, DoRA),
hooks on modules the core does not call.

The specs read the model's own Parameters on every call (nothing cached), so a write to them is
seen and an optimizer keeps training the model.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ragged import RaggedTensor

from ..decoder_layer import DecoderSpec, DecoderWeights, run_stack
from .lora import effective_linear, linear_reason

__all__ = ["CORE_FAMILIES", "run_packed_core", "specs_of", "why_not_core"]

# base model class name -> family
CORE_FAMILIES = {
    "LlamaModel": "llama",
    "MistralModel": "llama",
    "Qwen2Model": "llama",
    "Qwen3Model": "llama",
    "GemmaModel": "gemma",
    "Gemma2Model": "gemma2",
    "Gemma3TextModel": "gemma3",
}
_GEMMAS = ("gemma", "gemma2", "gemma3")  # norms of 1 + weight
_SANDWICH = ("gemma2", "gemma3")  # norms on the attention and MLP outputs too
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _family(model: Any) -> str | None:
    cls = type(model)
    name = CORE_FAMILIES.get(cls.__name__)
    if name is None or not cls.__module__.startswith("transformers.models."):
        return None
    return name


def why_not_core(model: Any) -> str | None:
    """Why the decoder core cannot run ``model`` (a base model); None when it can."""
    family = _family(model)
    if family is None:
        return f"{type(model).__name__} is not a base model the decoder core reads ({', '.join(CORE_FAMILIES)})"
    config = model.config
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return f"attention logit soft-capping ({config.attn_logit_softcapping}) is not computed by ragged's attention"
    rope = getattr(model.rotary_emb, "rope_type", "default")
    for kind in rope.values() if isinstance(rope, dict) else (rope,):  # Gemma3: one per layer type
        if kind in ("dynamic", "longrope"):
            return f"rotary scaling {kind!r} changes the frequencies with the position"
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in _ACTIVATIONS:
        return f"activation {act!r} (the core takes {sorted(_ACTIVATIONS)})"
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout"
    return _why_not_modules(model)


_LINEARS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def _why_not_modules(model: Any) -> str | None:
    """The core reads the layers' Parameters instead of calling their modules: each projection
    must be a torch.nn.Linear or peft's LoRA Linear over one (read as the Linear it computes:
    :func:`ragged.nn.hf.lora.effective_linear`), and no module it does not call may have a hook or
    a parametrization (the model and its embeddings are called as modules, so theirs run:
    ``enable_input_require_grads``'s, NEFTune's)."""
    for i, layer in enumerate(model.layers):
        for block, names in _LINEARS.items():
            for name in names:
                why = linear_reason(getattr(getattr(layer, block), name), f"layers.{i}.{block}.{name}")
                if why is not None:
                    return why
    for name, m in model.named_modules():
        if name == "" or name == "embed_tokens" or name.startswith("embed_tokens."):
            continue  # called as modules: the model by its caller, the embeddings by the core
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return f"{name or 'the model'} has a hook, which the core would not run"
        if getattr(m, "parametrizations", None):
            return f"{name} has a parametrization, which the core would not apply"
    return None


def _eps(norm: Any) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _read(block: Any, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection's ``(weight, bias)``: a Linear's own, a LoRA Linear's effective pair."""
    return effective_linear(getattr(block, name), name)


def specs_of(model: Any) -> list[DecoderSpec]:
    """One spec per layer of a base model :func:`why_not_core` takes."""
    family = _family(model)
    config = model.config
    act = _ACTIVATIONS[getattr(config, "hidden_activation", None) or config.hidden_act]
    rotary = model.rotary_emb
    specs = []
    for layer in model.layers:
        att, mlp = layer.self_attn, layer.mlp
        (qw, qb), (kw, kb), (vw, vb), (ow, ob) = (_read(att, n) for n in _LINEARS["self_attn"])
        (gw, gb), (uw, ub), (dw, db) = (_read(mlp, n) for n in _LINEARS["mlp"])
        sandwich = family in _SANDWICH
        kind = getattr(att, "layer_type", None)
        if family == "gemma3":  # a table per layer type
            inv_freq = getattr(rotary, f"{kind}_inv_freq")
            scaling = float(getattr(rotary, f"{kind}_attention_scaling", 1.0))
        else:
            inv_freq, scaling = rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0))
        weights = DecoderWeights(
            in_norm=layer.input_layernorm.weight,
            q_w=qw,
            k_w=kw,
            v_w=vw,
            q_b=qb,
            k_b=kb,
            v_b=vb,
            o_w=ow,
            o_b=ob,
            q_norm=getattr(att, "q_norm", None) and att.q_norm.weight,
            k_norm=getattr(att, "k_norm", None) and att.k_norm.weight,
            post_attn_norm=layer.post_attention_layernorm.weight if sandwich else None,
            mlp_norm=layer.pre_feedforward_layernorm.weight if sandwich else layer.post_attention_layernorm.weight,
            post_ff_norm=layer.post_feedforward_layernorm.weight if sandwich else None,
            gate_w=gw,
            up_w=uw,
            down_w=dw,
            gate_b=gb,
            up_b=ub,
            down_b=db,
        )
        # the layer's window: its attention module's (Qwen2/3, Gemma2: per layer type), or the
        # config's for Mistral, whose module passes config.sliding_window to every call
        if type(model).__name__ == "MistralModel":
            window = getattr(config, "sliding_window", None)
        else:
            window = getattr(att, "sliding_window", None)
        specs.append(
            DecoderSpec(
                heads=config.num_attention_heads,
                kv_heads=config.num_key_value_heads,
                head_dim=att.head_dim,
                eps=_eps(layer.input_layernorm),
                unit_offset=family in _GEMMAS,
                activation=act,
                scale=float(att.scaling),
                window=int(window) if window else None,
                inv_freq=inv_freq,
                rope_scaling=scaling,
                weights=weights,
                causal=bool(getattr(att, "is_causal", True)),
            )
        )
    return specs


def run_packed_core(
    model: Any, ids: RaggedTensor, positions: torch.Tensor | None = None, hidden_states: list | None = None
) -> RaggedTensor:
    """The last hidden states of a base model on a packed batch of ids, through the decoder
    core: a RaggedTensor ``[T, d]`` with the ids' offsets. ``positions [T]``: each token's
    rotary position (default: each sequence from 0). ``hidden_states``: a list that receives
    HuggingFace's ``hidden_states`` (the stream before each layer, then the final norm's output),
    each ``[T, d]``. HuggingFace's gradient checkpointing, where switched on
    (``gradient_checkpointing_enable``), checkpoints each layer."""
    why = why_not_core(model)
    if why is not None:
        raise NotImplementedError(f"ragged.nn decoder core: {why}")
    family = _family(model)
    x = model.embed_tokens(ids.values)
    if family in _GEMMAS and not hasattr(model.embed_tokens, "embed_scale"):
        # transformers before the scaled embedding module: the model scales by sqrt(d), rounded
        # to the embeddings' dtype
        x = x * torch.tensor(math.sqrt(model.config.hidden_size), dtype=x.dtype, device=x.device)
    if positions is None:
        positions = ids.position_ids()
    norm = model.norm
    # HuggingFace's gradient checkpointing (gradient_checkpointing_enable sets it on the layers)
    saving = any(getattr(layer, "gradient_checkpointing", False) and layer.training for layer in model.layers)
    out = run_stack(
        specs_of(model),
        x,
        ids.offsets,
        ids.max_len,
        positions,
        norm.weight,
        _eps(norm),
        family in _GEMMAS,
        hidden_states,
        checkpoint_layers=saving,
    )
    if hidden_states is not None:
        hidden_states.append(out)
    return ids.with_values(out)
