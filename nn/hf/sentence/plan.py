"""What converting a SentenceTransformer does, read before anything changes (for
:mod:`ragged.nn.hf.sentence`): the reasons a model is refused, the Pooling modules that pool the
packed tokens and the modules left on padded token embeddings. Nothing here writes to a model."""

from __future__ import annotations

import dataclasses

from torch import nn

from .. import decoder as hf_decoder
from .. import forward as hf_forward
from .pooling import RaggedPooling

__all__ = ["TEXT", "Plan", "plan_conversion", "replaced", "st_classes"]

TEXT = {"method": "forward", "method_output_name": "last_hidden_state"}  # the text modality the forward runs


def st_classes() -> dict[str, type]:
    """sentence-transformers' module classes that conversion tells apart, by name."""
    from sentence_transformers.sentence_transformer import modules

    return {
        name: getattr(modules, name)
        for name in ("Transformer", "Pooling", "Dense", "Normalize", "Dropout", "LayerNorm")
    }


@dataclasses.dataclass
class Plan:
    transformer: nn.Module
    poolings: list[nn.Module]  # Pooling modules that read the Transformer's token embeddings
    padded: list[tuple[str, str, str]]  # (name, class, why) of modules left on padded token embeddings
    decoder: bool = False  # the auto_model is a decoder run packed (ragged.nn.hf.decoder)


def replaced(module: nn.Module, name: str, ours: type) -> bool:
    """Whether ``module`` has an instance attribute ``name`` that is not a ``ours`` patch."""
    value = module.__dict__.get(name)
    return value is not None and not isinstance(value, ours)


def plan_conversion(model: nn.Module, patches: tuple[type, type, type]) -> Plan | str:
    """What conversion does to the SentenceTransformer ``model``, or why it cannot be converted
    (reads only). ``patches``: the classes of the Transformer's ``forward`` and ``preprocess``
    and of the model's ``encode`` patches (an instance attribute of another class is refused)."""
    if len(model) == 0:
        return "it has no modules"
    c = st_classes()
    first = model[0]
    if type(first) is not c["Transformer"]:
        return (
            f"its first module is a {type(first).__name__}, not sentence-transformers' Transformer (ragged runs a "
            "Transformer over a model ragged.nn.convert converts)"
        )
    if first.backend != "torch":
        return f"its Transformer runs the {first.backend!r} backend, not torch"
    if first.transformer_task != "feature-extraction":
        return f"its Transformer's task is {first.transformer_task!r}, not 'feature-extraction'"
    if first.module_output_name != "token_embeddings" or first.modality_config.get("text") != TEXT:
        return (
            f"its Transformer maps text to {first.modality_config.get('text')!r} -> {first.module_output_name!r}, "
            "not the model's forward's last_hidden_state -> token_embeddings"
        )
    message = first.modality_config.get("message")
    if message is not None and {k: v for k, v in message.items() if k != "format"} != TEXT:
        return f"its Transformer maps chat messages to {message!r}, not the model's forward's last_hidden_state"
    if getattr(first, "can_flatten_inputs", False):
        return "its Transformer flattens inputs for flash attention: set st[0].unpad_inputs = False first"
    expansion = getattr(first, "query_expansion", None)
    if expansion is not None and not expansion.get("attend", True):
        return "its Transformer uses query expansion with attend=False (embeddings read at padding positions)"
    forward, preprocess, encode = patches
    for owner, name, ours, where in (
        (first, "forward", forward, "its Transformer"),
        (first, "preprocess", preprocess, "its Transformer"),
        (model, "encode", encode, "it"),
    ):
        if replaced(owner, name, ours):
            return f"{where} has its {name} replaced, which the converted model would not run"
    auto = first._modules.get("model")
    if not hf_forward.is_hf_model(auto):
        return f"its auto_model is a {type(auto).__name__}, not a transformers model ragged.nn.convert converts"
    decoder = hf_decoder.identify_decoder(auto) is not None
    if decoder:
        why = hf_decoder.why_not(auto)
        if why is not None:
            return f"its auto_model cannot run on packed batches: {why}"
    else:
        if not hf_forward.is_done(auto):
            why = hf_forward.why_not(auto)
            if why is not None:
                also = (
                    f"; decoders run on packed batches: {hf_decoder.supported()}"
                    if isinstance(hf_forward.identify(auto), str)
                    else ""
                )
                return f"its auto_model cannot be converted: {why}{also}"
        ident = hf_forward.identify(auto)
        if isinstance(ident, str) or ident[1] != "base":
            return f"its auto_model is a {type(auto).__name__}, not a base model (AutoModel)"
    poolings, padded, changed_by = [], [], None
    for name, module in list(model._modules.items())[1:]:
        kind = type(module)
        if kind is c["Pooling"] and changed_by is None and not replaced(module, "forward", RaggedPooling):
            poolings.append(module)
        elif kind in (c["Dropout"], c["LayerNorm"]) or (
            kind in (c["Dense"], c["Normalize"])
            and "token_embeddings" not in (module.module_input_name, module.module_output_name)
        ):
            pass  # sentence-level: [B, d] in, [B, d] out
        else:
            if kind is c["Pooling"] and changed_by is not None:
                why = f"it pools the token embeddings module {changed_by!r} wrote (sentence-transformers' pooling)"
            else:
                why = "it may read or change the token embeddings (it gets them padded)"
                changed_by = name if changed_by is None else changed_by
            padded.append((name, kind.__name__, why))
    return Plan(first, poolings, padded, decoder)
