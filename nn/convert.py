"""``ragged.nn.convert``: swap torch.nn's transformer modules in a model for their ragged.nn
counterparts, transactionally (everything is checked and built before anything is swapped).

What is swapped is the table ``_SWAPS`` (torch.nn class -> ragged.nn class with a
``from_torch(module, copy=, memo=)`` classmethod); why a module of such a class stays as it is
comes from ``_why_not`` (extra hooks and parametrizations, then the class's own rules).

HuggingFace BERT-family models are converted by :mod:`ragged.nn.hf` (their forward is
patched, their modules stay); it is imported only when transformers is, so that converting a
torch.nn model never imports transformers. peft's wrappers are looked through to the model
inside them (:func:`_peft_inner`), and peft is never imported here either.
"""

from __future__ import annotations

import copy as _copy
import sys
import warnings
from typing import Any, Protocol, cast

from torch import nn
from torch.nn.utils import parametrize, prune

from ragged.utils import describe

from .accept import module_attention_features, reason_subject
from .multihead_attention import MultiheadAttention
from .transformer import TransformerEncoder, TransformerEncoderLayer


class _Swap(Protocol):
    """A ragged class of ``_SWAPS``: what conversion calls on it."""

    def from_torch(self, source: Any, /, *, copy: bool = ..., memo: dict | None = ...) -> nn.Module: ...


_SWAPS: dict[type[nn.Module], _Swap] = {
    nn.TransformerEncoder: TransformerEncoder,
    nn.TransformerEncoderLayer: TransformerEncoderLayer,
    nn.MultiheadAttention: MultiheadAttention,
}
_RAGGED = (TransformerEncoder, TransformerEncoderLayer, MultiheadAttention)
# Every per-module hook registry: the ragged modules call their submodules differently (or
# not at all: the fused paths read the Linear and LayerNorm parameters directly), so a hook
# anywhere inside a swapped module would silently stop running or see other arguments.
_HOOKS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_LAYER_CHILDREN: dict[str, type] = {
    "self_attn": nn.MultiheadAttention,
    "linear1": nn.Linear,
    "dropout": nn.Dropout,
    "linear2": nn.Linear,
    "norm1": nn.LayerNorm,
    "norm2": nn.LayerNorm,
    "dropout1": nn.Dropout,
    "dropout2": nn.Dropout,
}


def _extras_reason(module: nn.Module) -> str | None:
    """Why something inside ``module`` (itself included) would be lost by a ragged module
    built from its Parameters: a parametrization, pruning, or any hook."""
    for path, sub in module.named_modules(remove_duplicate=False):
        if parametrize.is_parametrized(sub):
            return f"{reason_subject(path)} has a parametrization (torch.nn.utils.parametrize)"
        if any(isinstance(h, prune.BasePruningMethod) for h in sub._forward_pre_hooks.values()):
            return f"{reason_subject(path)} is pruned (torch.nn.utils.prune)"
        kinds = [name.strip("_").replace("_", " ") for name in _HOOKS if getattr(sub, name, None)]
        if kinds:
            return f"{reason_subject(path)} has {', '.join(kinds)} (a ragged module would not run them)"
    return None


def _attention_reason(attn: nn.MultiheadAttention, path: str) -> str | None:
    unsupported = module_attention_features(attn)
    if unsupported:
        return f"{reason_subject(path)} uses {unsupported}, which is not supported"
    if set(attn._modules) != {"out_proj"} or not isinstance(attn._modules["out_proj"], nn.Linear):
        return f"{reason_subject(path)} has submodules {sorted(attn._modules)}, expected only the out_proj Linear"
    return None


def _layer_reason(layer: nn.TransformerEncoderLayer, path: str) -> str | None:
    prefix = f"{path}." if path else ""
    for name, kind in _LAYER_CHILDREN.items():
        child = layer._modules.get(name)
        if type(child) is not kind:
            return (
                f"its {prefix}{name} is a {type(child).__name__}, not a torch.nn.{kind.__name__} (the ragged "
                "layer would not run its code)"
            )
    extra = sorted(set(layer._modules) - set(_LAYER_CHILDREN) - {"activation"})
    if extra:
        return f"{reason_subject(path)} has submodules {extra} that the ragged layer would not run"
    attn = layer.self_attn
    why = _attention_reason(attn, prefix + "self_attn")
    if why:
        return why
    if not attn._qkv_same_embed_dim:
        return f"its {prefix}self_attn has kdim / vdim different from embed_dim"
    for name in ("norm1", "norm2"):
        norm = cast(nn.LayerNorm, layer._modules[name])  # its type checked above
        if tuple(norm.normalized_shape) != (attn.embed_dim,) or not norm.elementwise_affine:
            return f"its {prefix}{name} is not a LayerNorm over the {attn.embed_dim} features with a learned weight"
    return None


def _why_not(module: nn.Module) -> str | None:
    """Why ``module`` (of a type in ``_SWAPS``) stays as it is; None when it can be swapped."""
    why = _extras_reason(module)
    if why:
        return why
    if isinstance(module, nn.MultiheadAttention):
        return _attention_reason(module, "")
    if isinstance(module, nn.TransformerEncoderLayer):
        return _layer_reason(module, "")
    layers = module._modules.get("layers")
    if type(layers) is not nn.ModuleList or len(layers) == 0:
        return "its layers are not a non-empty torch.nn.ModuleList"
    first = cast(nn.TransformerEncoderLayer, layers[0])  # checked first in the loop
    for i, layer in enumerate(layers):
        if type(layer) is not nn.TransformerEncoderLayer:
            return f"its layers.{i} is a {type(layer).__name__}, not a torch.nn.TransformerEncoderLayer"
        why = _layer_reason(layer, f"layers.{i}")
        if why:
            return why
        if (layer.self_attn.embed_dim, layer.self_attn.batch_first) != (
            first.self_attn.embed_dim,
            first.self_attn.batch_first,
        ):
            return f"its layers.{i} differs from layers.0 in d_model or batch_first"
    return None


def _children_left_alone(module: nn.Module) -> bool:
    """Whether convert leaves everything inside ``module`` alone when it does not swap it: a
    torch.nn.TransformerEncoder (of any class) may hand its layers torch's nested tensors."""
    return isinstance(module, nn.TransformerEncoder)


def _hf_adapter():
    """:mod:`ragged.nn.hf` when transformers is loaded (a model of it can exist), else None."""
    if "transformers" not in sys.modules:
        return None
    from . import hf

    return hf


def _sentence_adapter():
    """:mod:`ragged.nn.hf.sentence` when sentence-transformers is loaded, else None."""
    if "sentence_transformers" not in sys.modules:
        return None
    from .hf import sentence

    return sentence


def _peft_inner(model: nn.Module) -> nn.Module | None:
    """The model inside peft's wrappers when ``model`` is one: a ``PeftModel`` (of any task) over
    LoRA adapters, or the ``LoraModel`` inside it; else None. A ``PeftModel`` of another tuner
    (prompt learning, IA3, ...) raises NotImplementedError. Never imports peft."""
    if "peft" not in sys.modules:
        return None
    wrapper = getattr(sys.modules.get("peft.peft_model"), "PeftModel", None)
    tuner = getattr(sys.modules.get("peft.tuners.lora.model"), "LoraModel", None)
    if isinstance(wrapper, type) and isinstance(model, wrapper):
        inner = model._modules.get("base_model")
        if not (isinstance(tuner, type) and isinstance(inner, tuner)):
            configs = getattr(model, "peft_config", None) or {}
            kinds = sorted({str(getattr(c.peft_type, "value", c.peft_type)) for c in configs.values()})
            raise NotImplementedError(
                f"ragged.nn.convert(): cannot convert {type(model).__name__}: its adapters are {', '.join(kinds)} "
                "ones; ragged converts models with LoRA adapters only; the model is unchanged"
            )
        model = cast(nn.Module, inner)  # a LoraModel, checked above
    if isinstance(tuner, type) and isinstance(model, tuner):
        return model._modules.get("model")
    return None


def convert(model: nn.Module, *, copy: bool = False, strict: bool = False) -> nn.Module:
    """Swap every ``torch.nn.TransformerEncoder``, ``TransformerEncoderLayer`` and
    ``MultiheadAttention`` in ``model`` (in place) for its ragged.nn counterpart; returns
    ``model`` (or the replacement when ``model`` itself is one of them).

    The whole model is checked and every replacement built before anything is swapped; the
    swaps then happen together. An exception (``strict=True`` with a module left, a bad
    argument, an unexpected error) leaves ``model`` exactly as it was; a replacement whose
    building raises TypeError, ValueError or NotImplementedError is a module left as it is, with
    that error as its reason.

    * Only those exact classes are swapped. A subclass (it may override ``forward``) is left
      alone, without a warning, and its children are visited, except those of a
      ``torch.nn.TransformerEncoder`` subclass (its forward may hand its layers torch's nested
      tensors, which the ragged layers do not take). Ragged modules already there stay.
    * A swapped module brings its children: the ragged module holds the same Parameter and
      buffer objects (``copy=False``, the default: an optimizer built before the swap keeps
      training the model) or copies of them (``copy=True``: same device and dtype, ties between
      tensors kept); the original module objects are not modified either way. A swapped
      module used at several places is one ragged module at all of them.
    * Modules the ragged versions cannot take are left as they are, with everything inside
      them: ``add_bias_kv`` / ``add_zero_attn`` attention, a parametrization
      (``torch.nn.utils.parametrize``), pruning (``torch.nn.utils.prune``) or any hook on the
      module or inside it, submodules of other classes than torch.nn builds (a custom layer
      class inside an encoder, a replaced Linear or LayerNorm), and a module that is also part
      of a module left as it is. Everything else is swapped, and one warning lists every
      module left with the reason. ``strict=True`` raises NotImplementedError with that list
      instead, before anything is swapped.

    A custom ``activation`` (a function or a module, called as torch.nn calls it) is kept.
    A final ``norm`` of an encoder is applied to the packed tokens ``[T, d_model]``: it must
    work token by token, as LayerNorm and RMSNorm do.

    HuggingFace models (BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, DistilBERT, ModernBERT,
    MPNet: base models and their sequence classification, token classification, masked LM and
    question answering heads; see :mod:`ragged.nn.hf`) keep their modules and Parameters: their
    forward is patched to run padding-free and to take RaggedTensors. ``model`` itself such a
    model: converted in place and returned (``copy=True``: a converted deep copy), or refused
    with NotImplementedError naming the class and the feature, the model unchanged (whatever
    ``strict`` says). Inside another model: converted like a swapped module (``copy=True``
    puts a converted deep copy in its place), or left with the reason as above. A converted
    model is left as it is.

    HuggingFace decoders (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2: base models,
    ``ForCausalLM`` and ``ForSequenceClassification``; see :mod:`ragged.nn.hf.decoder_convert`),
    as a model itself: their forward runs the decoder core on packed tokens (RaggedTensor,
    padded or flattened input), the training loss without logits; generation (a cache,
    ``use_cache=True``) stays on HuggingFace's forward.

    A sentence-transformers ``SentenceTransformer`` whose first module is a ``Transformer`` over
    one of these models, or over a decoder of :mod:`ragged.nn.hf.decoder` (Qwen3-Embedding,
    EmbeddingGemma: set to ``attn_implementation="ragged"``, its forward unpatched), is converted
    as a whole (see :mod:`ragged.nn.hf.sentence`): its
    Transformer, Pooling and ``encode`` run on the packed tokens; Dense, Normalize and the other
    modules act on the sentence embeddings as before.

    peft's wrappers (a ``PeftModel`` of any task over LoRA adapters, or its ``LoraModel``) over
    one of these HuggingFace models: the transformers model inside is converted in place (or
    refused as above), and ``model`` returned (``copy=True``: a deep copy of it, converted). Its
    LoRA Linears are read on every forward as the Linear they compute
    (:mod:`ragged.nn.hf.lora`: merging, unmerging, disabling and switching adapters act as in
    peft); the heads and ``modules_to_save`` run as peft's modules. Another tuner is refused.
    """
    fn = "ragged.nn.convert"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}(): expected an nn.Module, got {describe(model)}")
    for name, flag in (("copy", copy), ("strict", strict)):
        if not isinstance(flag, bool):
            raise TypeError(f"{fn}(): expected {name} to be a bool, got {describe(flag)}")
    st = _sentence_adapter()
    if st is not None and st.is_sentence_transformer(model):
        return st.convert_sentence_transformer(model, copy=copy, strict=strict)
    hf = _hf_adapter()
    if hf is not None and hf.is_hf_model(model):
        return hf.convert_model(model, copy)
    inner = _peft_inner(model)
    if hf is not None and inner is not None and hf.is_hf_model(inner):
        if copy:
            model = _copy.deepcopy(model)
            inner = _peft_inner(model)
        hf.convert_model(inner, False)  # in place: the wrappers call it
        return model
    memo: dict = {}
    built: dict[int, tuple[nn.Module, nn.Module]] = {}  # id(original) -> (original, replacement)
    refused: dict[int, tuple[nn.Module, str, str]] = {}  # id(original) -> (original, where, why)
    places: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, child name, original child)
    first_place: dict[int, str] = {}  # id(original) -> its qualified name where first met

    def plan(module: nn.Module, where: str) -> None:
        """Build the replacement of a swappable ``module`` (once), or record why not.
        Building touches nothing of ``module``: a failure is one more reason."""
        key = id(module)
        if key in built or key in refused:
            return
        first_place[key] = where
        why = _why_not(module)
        if why is None:
            try:
                built[key] = (module, _SWAPS[type(module)].from_torch(module, copy=copy, memo=memo))
                return
            except (TypeError, ValueError, NotImplementedError) as err:
                why = str(err)
        refused[key] = (module, where, why)

    visited: set[int] = {id(model)}
    whole: list[tuple[nn.Module, str]] = []  # (module left whole, where): subclasses of nn.TransformerEncoder
    hf_built: dict[int, tuple[nn.Module, nn.Module]] = {}  # id(HF model) -> (it, the model to patch)
    hf_places: list[tuple[nn.Module, str, nn.Module]] = []

    def plan_hf(module: nn.Module, where: str) -> None:
        key = id(module)
        if key in hf_built or key in refused or hf.is_done(module):
            return
        why = hf.why_not(module)
        if why is not None:
            refused[key] = (module, where, why)
            return
        try:
            hf_built[key] = (module, _copy.deepcopy(module, memo) if copy else module)
        except (TypeError, ValueError, RuntimeError) as err:
            refused[key] = (module, where, f"it cannot be copied ({err})")

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module._modules.items():
            if child is None or isinstance(child, _RAGGED):
                continue
            if hf is not None and hf.is_hf_model(child):
                plan_hf(child, prefix + name)
                hf_places.append((module, name, child))
            elif type(child) in _SWAPS:
                plan(child, prefix + name)
                places.append((module, name, child))
            elif id(child) not in visited:
                visited.add(id(child))
                if _children_left_alone(child):
                    whole.append((child, prefix + name))
                else:
                    visit(child, f"{prefix}{name}.")

    if type(model) in _SWAPS:
        plan(model, "")
    elif not isinstance(model, _RAGGED) and not _children_left_alone(model):
        visit(model, "")

    # A module inside one that stays must stay too, or it would become two modules (the
    # original there, the ragged one elsewhere): refuse until nothing changes.
    changed = True
    while changed:
        changed = False
        kept: dict[int, str] = {}  # id(module inside a module that stays) -> where that one is
        for original, where in [*whole, *((o, w) for o, w, _ in refused.values())]:
            for sub in original.modules():
                kept.setdefault(id(sub), where)
        for key, (original, _) in list(built.items()):
            hit = next(
                (
                    (path, kept[id(sub)])
                    for path, sub in original.named_modules(remove_duplicate=False)
                    if type(sub) in _SWAPS and id(sub) in kept
                ),
                None,
            )
            if hit is not None:
                del built[key]
                owner = repr(hit[1]) if hit[1] else "the model"
                refused[key] = (
                    original,
                    first_place[key],
                    f"{reason_subject(hit[0])} is also part of {owner}, which stays",
                )
                changed = True

    # A swapped module that also sits inside another swapped module: one ragged module at both.
    for original, new in built.values():
        for path, sub in original.named_modules(remove_duplicate=False):
            if path and type(sub) in _SWAPS and id(sub) in built:
                owner, _, leaf = path.rpartition(".")
                setattr(new.get_submodule(owner) if owner else new, leaf, built[id(sub)][1])

    if refused:
        listing = "; ".join(
            f"{repr(where) if where else 'the model'} ({type(m).__name__}): {why}"
            for m, where, why in sorted(refused.values(), key=lambda r: r[1])
        )
        if strict:
            raise NotImplementedError(
                f"{fn}(): nothing converted: {len(refused)} module(s) cannot be converted: {listing}"
            )
        warnings.warn(f"{fn}(): left {len(refused)} module(s) as torch.nn modules: {listing}", stacklevel=2)

    if type(model) in _SWAPS:
        return built[id(model)][1] if id(model) in built else model
    done: list[tuple[nn.Module, str, nn.Module]] = []
    patched: list[nn.Module] = []
    try:
        for parent, name, original in places:
            if id(original) in built:
                setattr(parent, name, built[id(original)][1])
                done.append((parent, name, original))
        for _original, target in hf_built.values():
            patched += hf.patch(target)
        for parent, name, original in hf_places:
            if id(original) in hf_built and hf_built[id(original)][1] is not original:
                setattr(parent, name, hf_built[id(original)][1])
                done.append((parent, name, original))
    except BaseException:
        for parent, name, original in reversed(done):
            setattr(parent, name, original)
        if patched:
            hf.unpatch(patched)
        raise
    return model
