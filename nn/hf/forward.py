"""The converted forward of a HuggingFace model and its installation: which classes are
converted (:func:`identify`), why a model cannot be (:func:`why_not`), the instance ``forward``
that replaces the class's (:class:`RaggedForward`, :func:`patch`) and what it computes
(:func:`encode` and the heads, over the model's :class:`ragged.nn.hf.family.Family`). The
package docstring (:mod:`ragged.nn.hf`) describes the contract."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
import sys
from collections.abc import Iterable

import torch
from torch import nn

from ragged import RaggedTensor

from .encoder import encode
from .families import FAMILIES
from .family import Family, hook_kinds
from .heads import head_outputs

__all__ = [
    "FAMILIES",
    "RaggedForward",
    "convert_model",
    "hidden_picks",
    "identify",
    "is_converted",
    "is_done",
    "is_hf_model",
    "loss_function_head",
    "loss_items",
    "patch",
    "unpatch",
    "why_not",
]

# Keyword arguments HuggingFace's forward takes whose meaning the converted forward does not compute.
_REFUSED = {
    "head_mask": "head_mask (masking attention heads)",
    "encoder_hidden_states": "cross-attention (encoder_hidden_states)",
    "encoder_attention_mask": "cross-attention (encoder_attention_mask)",
    "past_key_values": "past_key_values (a key/value cache)",
    "cu_seq_lens_q": "flash-attention packing arguments (cu_seq_lens_q); pass a RaggedTensor instead",
    "cu_seq_lens_k": "flash-attention packing arguments (cu_seq_lens_k); pass a RaggedTensor instead",
    "max_length_q": "flash-attention packing arguments (max_length_q); pass a RaggedTensor instead",
    "max_length_k": "flash-attention packing arguments (max_length_k); pass a RaggedTensor instead",
}
_HEAD_OUTPUTS = {
    "sequence": "SequenceClassifierOutput",
    "token": "TokenClassifierOutput",
    "masked_lm": "MaskedLMOutput",
    "qa": "QuestionAnsweringModelOutput",
}
# modeling-module fragment -> why no family converts its classes
_NOT_CONVERTED = {".deberta": "uses DeBERTa's disentangled relative attention, which ragged does not compute"}


def _supported() -> str:
    heads = dict.fromkeys(s for f in FAMILIES.values() for s in f.kinds if s != "Model")
    return ", ".join(f.name for f in FAMILIES.values()) + " (base models and " + ", ".join(heads) + " heads)"


def is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is a model class of transformers itself (a ``PreTrainedModel``
    defined in transformers; a subclass defined elsewhere is an ordinary container)."""
    utils = sys.modules.get("transformers.modeling_utils")
    return (
        utils is not None
        and type(module).__module__.startswith("transformers.")
        and isinstance(module, utils.PreTrainedModel)
    )


def identify(model: nn.Module) -> tuple[Family, str] | str:
    """``(family, kind)`` of a supported class (kind: ``"base"``, ``"sequence"``, ``"token"``,
    ``"masked_lm"`` or ``"qa"``), or why the class is not supported."""
    cls = type(model)
    family = FAMILIES.get(cls.__module__)
    if family is None:
        for fragment, why in _NOT_CONVERTED.items():
            if fragment in cls.__module__:
                return f"{cls.__name__} {why} (supported: {_supported()})"
        return f"{cls.__name__} is not a supported model class (supported: {_supported()})"
    for suffix, kind in family.kinds.items():
        if cls.__name__ == family.prefix + suffix and getattr(sys.modules[family.module], cls.__name__, None) is cls:
            return family, kind
    heads = ", ".join(family.prefix + s for s in family.kinds)
    return f"{cls.__name__} is not a supported {family.name} class (supported: {heads})"


def loss_function_head(model: nn.Module) -> str | None:
    """The head kind of ``model`` (a transformers model) when its HuggingFace loss is the model's
    ``loss_function`` with the forward's other keyword arguments (``num_items_in_batch``,
    ``ignore_index``: :mod:`ragged.nn.hf.heads`), as the converted head's is; None otherwise."""
    ident = identify(model)
    if isinstance(ident, str) or ident[1] not in ident[0].loss_function_heads:
        return None
    return ident[1]


def loss_items(model: nn.Module, labels) -> torch.Tensor | None:
    """What the masked-LM loss of ``model`` averages over when called without
    ``num_items_in_batch``: the count (a 0-d tensor on the labels' device, nothing read) of
    ``labels`` (padded with -100, or a RaggedTensor) that are not -100 among the tokens the head
    predicts. The loss times it, divided by ``num_items_in_batch``, is the loss with it. None
    unless ``model`` is a masked-LM head of :func:`loss_function_head` and ``labels`` a tensor."""
    if loss_function_head(model) != "masked_lm":
        return None
    values = labels.values if isinstance(labels, RaggedTensor) else labels
    if not isinstance(values, torch.Tensor):
        return None
    flat = values.reshape(-1)
    chosen = identify(model)[0].masked_lm_tokens(model, flat)
    if chosen is not None:
        flat = flat.index_select(0, chosen)
    return (flat != -100).sum()


def _its(path: str) -> str:
    return "it" if not path else f"its {path}"


def why_not(model: nn.Module) -> str | None:
    """Why ``model`` (a transformers model) cannot be converted; None when it can. Reads only."""
    ident = identify(model)
    if isinstance(ident, str):
        return ident
    family, kind = ident
    config = model.config
    why = family.config_reason(config)
    if why:
        return why
    prefix = type(model).base_model_prefix
    base = model if kind == "base" else model._modules.get(prefix)
    mod = sys.modules[family.module]
    base_cls = getattr(mod, f"{family.prefix}Model")
    if type(base) is not base_cls:
        return f"its {prefix} is a {type(base).__name__}, not a transformers {base_cls.__name__}"
    for path, sub in model.named_modules(remove_duplicate=False):
        if hasattr(sub, "_hf_hook"):
            return (
                f"{_its(path)} is dispatched by accelerate (device_map / offloading hooks), which ragged would bypass"
            )
    where = "" if kind == "base" else f"{prefix}."
    try:
        layers = family.layers(base)
    except (KeyError, AttributeError):
        layers = None
    if type(layers) is not nn.ModuleList:
        return f"its {where}{family.layer_path} is not a ModuleList of HuggingFace's layers"
    # the modules the converted forward does not call: a head's base model itself, and the family's own
    bypassed = [] if kind == "base" else [(prefix, base)]
    bypassed += [(where + p, s) for p, s in family.bypassed(base)]
    for path, sub in bypassed:
        kinds = hook_kinds(sub)
        if kinds:
            return f"{_its(path)} has {', '.join(kinds)} hooks, which the converted forward would not run"
        if "forward" in sub.__dict__ and not isinstance(sub.__dict__["forward"], RaggedForward):
            return f"{_its(path)} has its forward replaced, which the converted forward would not run"
    hidden = family.hidden_size(config)
    for i, layer in enumerate(layers):
        why = family.layer_reason(layer, f"{where}{family.layer_path}.{i}", hidden)
        if why:
            return why
    if kind != "base":
        for name in family.head_modules[kind]:
            if model._modules.get(name) is None:
                return f"it has no {name} module, which its head uses"
        last = family.head_modules[kind][-1]  # the head's output module
        if kind == "qa" and getattr(model._modules[last], "out_features", 2) != 2:
            return f"its {last} does not give 2 logits (start, end) per token"
        why = family.model_reason(model, base, kind, prefix)
        if why:
            return why
    return None


class RaggedForward:
    """The ``forward`` of a converted model (an instance attribute: see the module docstring):
    ``module`` is the model, ``kind`` its head kind (``"base"`` for a base model)."""

    def __init__(self, module: nn.Module, kind: str) -> None:
        self.module = module
        self.kind = kind

    def __call__(self, *args, **kwargs):
        return _forward(self.module, self.kind, args, kwargs)

    def replicate(self) -> nn.Module:
        """The module's ``_replicate_for_data_parallel``: ``torch.nn.parallel.replicate``
        (DataParallel) copies a module's ``__dict__`` into each replica and gives the replica
        its own parameters, so the replica gets a forward of its own (the copied one would
        run this module, with this module's parameters)."""
        replica = type(self.module)._replicate_for_data_parallel(self.module)
        _set_forward(replica, self.kind)
        return replica

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def __repr__(self) -> str:
        return f"RaggedForward({type(self.module).__name__}, kind={self.kind!r})"


_INSTANCE_NAMES = ("forward", "_replicate_for_data_parallel")  # what patch() sets on a module


def _set_forward(module: nn.Module, kind: str) -> None:
    forward = RaggedForward(module, kind)
    module.forward = forward
    module._replicate_for_data_parallel = forward.replicate


def is_converted(module: nn.Module) -> bool:
    """Whether ``module`` runs the converted forward of its own (a shallow copy of a converted
    module holds the original's, and is not)."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, RaggedForward) and forward.module is module


def is_done(model: nn.Module) -> bool:
    """Whether ``model`` (a transformers model) is converted, a head with its base model."""
    if not is_converted(model):
        return False
    ident = identify(model)
    return isinstance(ident, str) or ident[1] == "base" or is_converted(model._modules[type(model).base_model_prefix])


def patch(model: nn.Module) -> list[nn.Module]:
    """Set the converted forward on ``model`` (and its base model); returns the modules
    changed. ``model`` must have passed :func:`why_not`."""
    kind = identify(model)[1]
    targets = [(model, kind)]
    if kind != "base":
        targets.append((model._modules[type(model).base_model_prefix], "base"))
    changed = []
    for module, k in targets:
        if not is_converted(module):
            _set_forward(module, k)
            changed.append(module)
    return changed


def unpatch(modules: list[nn.Module]) -> None:
    """Undo :func:`patch` on the modules it changed."""
    for module in modules:
        for name in _INSTANCE_NAMES:
            module.__dict__.pop(name, None)


def convert_model(model: nn.Module, copy: bool) -> nn.Module:
    """:func:`ragged.nn.convert` on a transformers model: refused (NotImplementedError, the model
    unchanged) or patched in place (``copy=True``: a deep copy is patched and returned).
    Converting a converted model changes nothing."""
    import copy as copying

    from .decoder_convert import convert_decoder, identify_decoder_model

    if identify_decoder_model(model) is not None:  # Llama to Gemma3: the decoder core
        return convert_decoder(model, copy)
    if is_done(model):
        return copying.deepcopy(model) if copy else model
    why = why_not(model)
    if why is not None:
        raise NotImplementedError(
            f"ragged.nn.convert(): cannot convert {type(model).__name__}: {why}; the model is unchanged"
        )
    target = copying.deepcopy(model) if copy else model
    patch(target)
    return target


# --------------------------------------------------------------------------------------
# The converted forward

# class -> its forward's positional parameter names, and every name it declares (not **kwargs)
_PARAMETERS: dict[type, tuple[tuple[str, ...], frozenset[str]]] = {}


def _parameters(cls: type) -> tuple[tuple[str, ...], frozenset[str]]:
    names = _PARAMETERS.get(cls)
    if names is None:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
        names = _PARAMETERS[cls] = (
            tuple(
                p.name
                for p in params
                if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            ),
            frozenset(
                p.name
                for p in params
                if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
            ),
        )
    return names


def _loss_kwargs(cls: type, kw: dict) -> dict:
    """What HuggingFace's forward of ``cls`` hands its ``loss_function`` from the call's keyword
    arguments ``kw``: those its signature does not name (its ``**kwargs``), less ``return_dict``
    (taken by the output decorator, ``can_return_tuple``, before the forward runs)."""
    named = _parameters(cls)[1]
    return {k: v for k, v in kw.items() if k not in named and k != "return_dict"}


def _bind(fn: str, cls: type, args: tuple, kwargs: dict) -> dict:
    names = _parameters(cls)[0]
    if len(args) > len(names):
        raise TypeError(f"{fn}() takes {len(names)} positional arguments but {len(args)} were given")
    out = dict(kwargs)
    for name, value in zip(names, args):
        if name in out:
            raise TypeError(f"{fn}() got multiple values for argument {name!r}")
        out[name] = value
    return out


@functools.cache
def _selects_among_all_states() -> bool:
    """Whether the installed transformers reads indices in ``output_hidden_states`` among all
    ``N + 1`` hidden states (the embeddings' output first; an int selects one, negative
    indices count from the end). Earlier versions (5.17) read a list, tuple or set as layer
    indices and return ``N`` entries, entry ``i`` the output of layer ``i``; any other value
    is a flag. The newer rule comes with ``output_capturing.selected_hidden_states``."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return False
    return hasattr(output_capturing, "selected_hidden_states")


def _indices(fn: str, value) -> list[int]:
    try:
        return [operator.index(i) for i in value]
    except TypeError:
        raise TypeError(
            f"{fn}(): expected output_hidden_states to be a bool, an int or a list of ints (hidden "
            f"state indices), got {value!r}"
        ) from None


def hidden_picks(fn: str, hidden, layers: int) -> tuple | None:
    """The hidden states the output holds for ``output_hidden_states=hidden`` in a model of
    ``layers`` layers, selected as the installed transformers selects them: None (none) or,
    per entry of the output tuple, the index of the hidden state it holds (0: the embeddings'
    output, ``i``: layer ``i``'s) or None where the selection leaves it out."""
    if hidden is None or isinstance(hidden, bool):
        return tuple(range(layers + 1)) if hidden else None
    if _selects_among_all_states():
        scalar = not isinstance(hidden, Iterable)
        indices = _indices(fn, [hidden] if scalar else hidden)
        if not indices or (scalar and indices[0] == 0):
            return None  # a falsy value (0, an empty list) collects nothing, as False does
        n = layers + 1
        wanted = {i % n for i in indices if -n <= i < n}  # out of range selects nothing
        return tuple(i if i in wanted else None for i in range(n))
    if isinstance(hidden, (list, tuple, set)):
        if not hidden:
            return None
        wanted = set(_indices(fn, hidden))
        return tuple(i + 1 if i in wanted else None for i in range(layers))
    return tuple(range(layers + 1)) if hidden else None


def _output(name: str, fields: dict, return_dict: bool):
    """HuggingFace's output class ``name`` with ``fields`` set in its field order (built empty
    first: its constructor would iterate a RaggedTensor first field)."""
    from transformers import modeling_outputs

    cls = getattr(modeling_outputs, name)
    out = cls()
    for field in dataclasses.fields(cls):
        value = fields.get(field.name)
        if value is not None:
            out[field.name] = value
    return out if return_dict else out.to_tuple()


def _forward(model: nn.Module, kind: str, args: tuple, kwargs: dict):
    # the transformers class: FSDP2's fully_shard gives the model a subclass of it
    cls = next(c for c in type(model).__mro__ if c.__module__ in FAMILIES)
    family = FAMILIES[cls.__module__]
    fn = f"{cls.__name__}.forward"
    kw = _bind(fn, cls, args, kwargs) if args else kwargs
    config = model.config
    for name, what in _REFUSED.items():
        if kw.get(name) is not None:
            raise NotImplementedError(f"{fn}(): {what} is not supported by the ragged forward")
    attentions = kw.get("output_attentions")
    if attentions is None:
        attentions = getattr(config, "output_attentions", False)
    if attentions:
        raise NotImplementedError(
            f"{fn}(): output_attentions=True is not supported: ragged's attention never forms "
            "the attention probabilities"
        )
    if kw.get("is_causal"):
        raise NotImplementedError(f"{fn}(): is_causal=True is not supported: the converted encoder is bidirectional")
    return_dict = kw.get("return_dict")
    if return_dict is None:
        return_dict = getattr(config, "return_dict", True)
    hidden = kw.get("output_hidden_states")
    if hidden is None:
        hidden = getattr(config, "output_hidden_states", False)
    base = model if kind == "base" else model._modules[cls.base_model_prefix]
    layers = len(family.layers(base))
    enc = encode(
        fn,
        family,
        base,
        kw.get("input_ids"),
        kw.get("attention_mask"),
        kw.get("token_type_ids"),
        kw.get("position_ids"),
        kw.get("inputs_embeds"),
        hidden_picks(fn, hidden, layers),
    )
    if kind == "base":
        fields = {"last_hidden_state": enc.batch.out(enc.values), **family.base_fields(base, enc)}
        name = family.base_output
    else:
        loss_kwargs = _loss_kwargs(cls, kw) if kind in family.loss_function_heads else None
        fields = head_outputs(
            fn,
            kind,
            family,
            model,
            base,
            enc,
            kw.get("labels"),
            kw.get("start_positions"),
            kw.get("end_positions"),
            loss_kwargs,
        )
        name = _HEAD_OUTPUTS[kind]
    fields["hidden_states"] = enc.hidden_states()
    return _output(name, fields, return_dict)
