"""HuggingFace decoder base models read into :class:`ragged.nn.decoder_layer.DecoderSpec` s, and
their forward on a packed batch through the decoder core (:func:`run_packed_core`).

Families (the base model classes, exactly): Llama, Mistral, Qwen2, Qwen3 (per-head q/k norms),
Gemma (norms of ``1 + weight``, GeGLU with tanh GELU, embeddings times ``sqrt(d)``) and Gemma2
(the same, plus the norms around the attention and the MLP outputs, ``query_pre_attn_scalar``
and per-layer sliding windows). Refused with the reason (:func:`why_not_core`): other classes,
attention logit soft-capping, rotary scalings whose frequencies depend on the position
(``dynamic``/``longrope``), Gemma3 (its per-layer-type rotary tables are not read yet).

The specs read the model's own Parameters on every call (nothing cached), so a write to them is
seen and an optimizer keeps training the model.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ragged import RaggedTensor

from ..decoder_layer import DecoderSpec, DecoderWeights, run_stack

__all__ = ["CORE_FAMILIES", "run_packed_core", "specs_of", "why_not_core"]

# base model class name -> family
CORE_FAMILIES = {
    "LlamaModel": "llama",
    "MistralModel": "llama",
    "Qwen2Model": "llama",
    "Qwen3Model": "llama",
    "GemmaModel": "gemma",
    "Gemma2Model": "gemma2",
}
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
    if rope in ("dynamic", "longrope"):
        return f"rotary scaling {rope!r} changes the frequencies with the position"
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in _ACTIVATIONS:
        return f"activation {act!r} (the core takes {sorted(_ACTIVATIONS)})"
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout"
    return _why_not_modules(model)


_LINEARS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def _why_not_modules(model: Any) -> str | None:
    """The core reads the layers' Parameters instead of calling their modules: each projection
    must be a torch.nn.Linear itself (not peft's LoRA layer, a quantized Linear or a subclass),
    and no module it does not call may have a hook or a parametrization (the model and its
    embeddings are called as modules, so theirs run: ``enable_input_require_grads``'s, NEFTune's)."""
    for i, layer in enumerate(model.layers):
        for block, names in _LINEARS.items():
            for name in names:
                m = getattr(getattr(layer, block), name)
                if type(m) is not nn.Linear:
                    return f"layers.{i}.{block}.{name} is a {type(m).__name__}, not a torch.nn.Linear"
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


def specs_of(model: Any) -> list[DecoderSpec]:
    """One spec per layer of a base model :func:`why_not_core` takes."""
    family = _family(model)
    config = model.config
    act = _ACTIVATIONS[getattr(config, "hidden_activation", None) or config.hidden_act]
    rotary = model.rotary_emb
    inv_freq, scaling = rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0))
    specs = []
    for layer in model.layers:
        att, mlp = layer.self_attn, layer.mlp
        sandwich = family == "gemma2"
        weights = DecoderWeights(
            in_norm=layer.input_layernorm.weight,
            q_w=att.q_proj.weight,
            k_w=att.k_proj.weight,
            v_w=att.v_proj.weight,
            q_b=att.q_proj.bias,
            k_b=att.k_proj.bias,
            v_b=att.v_proj.bias,
            o_w=att.o_proj.weight,
            q_norm=getattr(att, "q_norm", None) and att.q_norm.weight,
            k_norm=getattr(att, "k_norm", None) and att.k_norm.weight,
            post_attn_norm=layer.post_attention_layernorm.weight if sandwich else None,
            mlp_norm=layer.pre_feedforward_layernorm.weight if sandwich else layer.post_attention_layernorm.weight,
            post_ff_norm=layer.post_feedforward_layernorm.weight if sandwich else None,
            gate_w=mlp.gate_proj.weight,
            up_w=mlp.up_proj.weight,
            down_w=mlp.down_proj.weight,
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
                unit_offset=family in ("gemma", "gemma2"),
                activation=act,
                scale=float(att.scaling),
                window=int(window) if window else None,
                inv_freq=inv_freq,
                rope_scaling=scaling,
                weights=weights,
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
    each ``[T, d]``."""
    why = why_not_core(model)
    if why is not None:
        raise NotImplementedError(f"ragged.nn decoder core: {why}")
    family = _family(model)
    x = model.embed_tokens(ids.values)
    if family in ("gemma", "gemma2") and not hasattr(model.embed_tokens, "embed_scale"):
        # transformers before the scaled embedding module: the model scales by sqrt(d), rounded
        # to the embeddings' dtype
        x = x * torch.tensor(math.sqrt(model.config.hidden_size), dtype=x.dtype, device=x.device)
    if positions is None:
        positions = ids.position_ids()
    norm = model.norm
    out = run_stack(
        specs_of(model),
        x,
        ids.offsets,
        ids.max_len,
        positions,
        norm.weight,
        _eps(norm),
        family in ("gemma", "gemma2"),
        hidden_states,
    )
    if hidden_states is not None:
        hidden_states.append(out)
    return ids.with_values(out)
