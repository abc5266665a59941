"""HuggingFace BERT-family models computed padding-free (what :func:`ragged.nn.convert` does
to them).

Families: BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA and DistilBERT; for each the base
model (``AutoModel``) and its ``ForSequenceClassification``, ``ForTokenClassification``,
``ForMaskedLM`` and ``ForQuestionAnswering`` heads.

**Mechanism.** Conversion patches forward behaviour and nothing else: the model (and, for a
head, its base model) gets an instance attribute ``forward``, a :class:`RaggedForward`
that ``nn.Module.__call__`` finds before the class's method. The class, the module tree,
the Parameter objects, the ``state_dict`` keys and ``config.architectures`` stay as they
were, so ``save_pretrained`` / ``from_pretrained`` round-trip unchanged (a reloaded model is
a plain HuggingFace model until it is converted again), an optimizer built before keeps
training the model, and ``isinstance`` / ``type`` checks see HuggingFace's classes. A
subclass swapped in under the same name would do the same but break ``pickle`` (the name
would resolve to the original class); the instance attribute holds a reference to its
module only, so ``copy.deepcopy`` and ``pickle`` / ``torch.save`` of a converted model give
a converted model. Its ``__signature__`` is the original forward's (what ``Trainer`` reads).
``torch.nn.DataParallel`` (``torch.nn.parallel.replicate``) copies each module's ``__dict__``
into a replica: a converted module also gets an instance ``_replicate_for_data_parallel`` that
gives each replica a forward of its own, which runs the replica's parameters; a shallow
``copy.copy`` is not converted (:func:`is_converted`) until ``convert`` is called on it.

**Inputs** (keywords or HuggingFace's positional order):

* ``input_ids`` (or ``inputs_embeds``) padded ``[B, M]`` (``[B, M, E]``) with an optional
  2-D ``attention_mask`` (1 at tokens, 0 at padding; right, left or scattered): packed once
  at the top. Reading the mask costs one device-to-host read (its lengths and layout, in
  :func:`ragged.padding.read_mask_layout`); without a mask every row is full and nothing is
  read. ``token_type_ids``, ``position_ids`` (``[B, M]`` or ``[1, M]``) and token labels
  are packed with the same layout. Outputs come back padded like the input, with HuggingFace's
  output types and shapes; **padded positions hold zeros** (HuggingFace computes values
  there that no real token depends on).
* a :class:`ragged.RaggedTensor` of ids (values ``[T]``) or of embeddings (``[T, E]``):
  nothing is padded and nothing is read from the device; ``token_type_ids`` /
  ``position_ids`` / token labels as RaggedTensors (or packed ``[T]`` tensors);
  ``last_hidden_state``, hidden states and token-level logits come back as RaggedTensors,
  ``pooler_output`` and sequence-level logits as ``[B, ...]`` tensors.

**Positions.** As HuggingFace computes them: BERT, ELECTRA and DistilBERT number the columns
of the padded input (so a left-padded row starts past 0, as in HuggingFace), RoBERTa-style
models count the ids that are not ``padding_idx`` from ``padding_idx + 1`` (a segment
cumulative sum on the packed tokens, on the device: HuggingFace's values whenever the
padding holds the pad id, as tokenizers write it) and their ``inputs_embeds`` columns from
``padding_idx + 1``. A RaggedTensor input numbers each sequence from its first token.
Token types default to the embeddings' registered ``token_type_ids`` buffer, as in
HuggingFace.

**Differences from HuggingFace**, all at padding: sequence-level outputs (``pooler_output``,
sequence classification) read each sequence's first real token, where HuggingFace reads
column 0 (padding, for a left-padded row); token-level losses count the real tokens (the
same value when labels at padding are -100); the question-answering softmax spans the
sequence's real tokens (see :mod:`ragged.nn.hf_heads`).

**Sentence-transformers.** ``convert(st[0].auto_model)`` (a base model) accepts ``input_ids``
and ``token_type_ids`` as RaggedTensors and returns ``last_hidden_state`` as a RaggedTensor of
``[T, hidden]`` values with the input's offsets: the contract the sentence-transformers
adapter builds on.

**Compute.** The embeddings, the pooler and the heads are the model's own modules, called on
the packed tokens; the layers are read into :class:`ragged.nn.layer.LayerSpec` s once per
forward (Q, K and V concatenated on every forward, never cached, so that no write to the
weights goes unseen; see :func:`ragged.nn.hf_encoder.packed_in_projection`) and run by the
layer core, with the dropout rates of the layers' own Dropout modules in training (none in
the feed-forward hidden layer, as in HuggingFace) and HuggingFace's gradient checkpointing
honoured. ``output_hidden_states`` gives HuggingFace's tuple (the input of every layer, then
the last output), padded or ragged like the output; indices select as the installed
transformers selects them (see :func:`hidden_picks`). Other keyword arguments are accepted
and ignored, as HuggingFace's attention ignores them, except those below.

**Refused**, with the model untouched: other transformers classes (DeBERTa's relative
attention; causal-LM, pre-training, next-sentence and multiple-choice heads; a subclass
defined outside transformers is an ordinary container, whose supported models inside are
converted), ``is_decoder``, ``add_cross_attention``,
a ``position_embedding_type`` other than ``"absolute"``, layers whose modules are not
HuggingFace's (a LoRA Linear, a custom layer class), hooks on the modules the converted
forward does not call (the base model of a head, the encoder and everything in it; HuggingFace's
own output-capturing hooks are fine; hooks added there after conversion do not run, except on
the layers themselves, see below) and models dispatched by accelerate. A layer Linear replaced after conversion (an adapter) raises at the
next call instead of being read as a plain Linear. At call time:
``output_attentions=True`` (the attention probabilities are never formed), ``head_mask``,
cross-attention inputs, ``past_key_values``, ``is_causal=True`` and flash-attention packing
arguments raise NotImplementedError.

**Data parallel**: DDP wraps a converted model as any other. Under FSDP2, each layer may be a
unit (``fully_shard(layer)`` for every ``model.<base>.encoder.layer[i]``, then the model): a
layer with hooks is called as a module with the packed values ``[T, d]`` in and out (its
parameters are read inside the call, once FSDP2 has gathered them), so FSDP2's hooks gather,
reshard and reduce as around HuggingFace's own forward; hooks registered on a layer after
conversion see those packed values.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
import sys
from collections.abc import Iterable

from torch import nn

from .hf_encoder import Family, attention_shape, encode, hook_kinds, layer_modules
from .hf_heads import HEAD_MODULES, KINDS, head_outputs, pooled_output

__all__ = ["FAMILIES", "RaggedForward", "convert_model", "hidden_picks", "identify", "is_converted", "is_done",
           "is_hf_model", "patch", "unpatch", "why_not"]

FAMILIES = {f.module: f for f in (
    Family("BERT", "transformers.models.bert.modeling_bert", "Bert", "bert"),
    Family("RoBERTa", "transformers.models.roberta.modeling_roberta", "Roberta", "roberta"),
    Family("XLM-RoBERTa", "transformers.models.xlm_roberta.modeling_xlm_roberta", "XLMRoberta", "roberta"),
    Family("CamemBERT", "transformers.models.camembert.modeling_camembert", "Camembert", "roberta"),
    Family("ELECTRA", "transformers.models.electra.modeling_electra", "Electra", "electra"),
    Family("DistilBERT", "transformers.models.distilbert.modeling_distilbert", "DistilBert", "distil"),
)}

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
_POOLED = "BaseModelOutputWithPoolingAndCrossAttentions"
_OUTPUTS = {"bert": _POOLED, "roberta": _POOLED,
            "electra": "BaseModelOutputWithPastAndCrossAttentions", "distil": "BaseModelOutput",
            "sequence": "SequenceClassifierOutput", "token": "TokenClassifierOutput", "masked_lm": "MaskedLMOutput",
            "qa": "QuestionAnsweringModelOutput"}


def _supported() -> str:
    return ", ".join(f.name for f in FAMILIES.values()) + " (base models and " + \
        ", ".join(s for s in KINDS if s != "Model") + " heads)"


def is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is a model class of transformers itself (a ``PreTrainedModel``
    defined in transformers; a subclass defined elsewhere is an ordinary container)."""
    utils = sys.modules.get("transformers.modeling_utils")
    return (utils is not None and type(module).__module__.startswith("transformers.")
            and isinstance(module, utils.PreTrainedModel))


def identify(model: nn.Module) -> tuple[Family, str] | str:
    """``(family, kind)`` of a supported class (kind: ``"base"``, ``"sequence"``, ``"token"``,
    ``"masked_lm"`` or ``"qa"``), or why the class is not supported."""
    cls = type(model)
    family = FAMILIES.get(cls.__module__)
    if family is None:
        if ".deberta" in cls.__module__:
            return (f"{cls.__name__} uses DeBERTa's disentangled relative attention, which ragged does not compute "
                    f"(supported: {_supported()})")
        return f"{cls.__name__} is not a supported model class (supported: {_supported()})"
    for suffix, kind in KINDS.items():
        if cls.__name__ == family.prefix + suffix and getattr(sys.modules[family.module], cls.__name__, None) is cls:
            return family, kind
    heads = ", ".join(family.prefix + s for s in KINDS)
    return f"{cls.__name__} is not a supported {family.name} class (supported: {heads})"


def _its(path: str) -> str:
    return "it" if not path else f"its {path}"


def _exact(module, kind: type, path: str, what: str) -> str | None:
    if type(module) is not kind:
        return f"its {path} is a {type(module).__name__}, not a {what} (ragged would not run its code)"
    return None


def _layer_reason(family: Family, layer: nn.Module, path: str, hidden: int) -> str | None:
    mod = sys.modules[family.module]
    why = _exact(layer, getattr(mod, family.layer_class), path, f"transformers {family.layer_class}")
    if why:
        return why
    if family.style == "distil":
        parts = {"ffn": "FFN"}
    else:
        if "crossattention" in layer._modules:
            return f"its {path} has cross-attention, which is not supported"
        parts = {"attention": f"{family.prefix}Attention", "attention.output": f"{family.prefix}SelfOutput",
                 "intermediate": f"{family.prefix}Intermediate", "output": f"{family.prefix}Output"}
    try:
        for name, cls_name in parts.items():
            why = _exact(layer.get_submodule(name), getattr(mod, cls_name), f"{path}.{name}",
                         f"transformers {cls_name}")
            if why:
                return why
        m = layer_modules(family.style, layer)
    except AttributeError as err:
        return f"its {path} lacks a module HuggingFace's layer has ({err})"
    attn = m["attn"]
    why = _exact(attn, getattr(mod, family.attention_class), f"{path} attention",
                 f"transformers {family.attention_class}")
    if why:
        return why
    heads, head_dim = attention_shape(family.style, attn)
    if heads * head_dim != hidden:
        return f"its {path} attention has {heads} heads of {head_dim} features, not the hidden size {hidden}"
    for name in ("q", "k", "v", "out", "ff1", "ff2"):
        why = _exact(m[name], nn.Linear, f"{path} {name} projection", "torch.nn.Linear")
        if why:
            return why
    for name in ("q", "k", "v", "out"):
        if (m[name].in_features, m[name].out_features) != (hidden, hidden):
            return f"its {path} {name} projection is not a {hidden} x {hidden} Linear"
    if (m["q"].bias is None) != (m["k"].bias is None) or (m["q"].bias is None) != (m["v"].bias is None):
        return f"its {path} query, key and value projections do not all have biases, or all lack them"
    if m["ff1"].in_features != hidden or m["ff2"].out_features != hidden or \
            m["ff2"].in_features != m["ff1"].out_features:
        return f"its {path} feed-forward Linears do not map {hidden} -> ff -> {hidden}"
    for name in ("norm1", "norm2"):
        norm = m[name]
        why = _exact(norm, nn.LayerNorm, f"{path} {name}", "torch.nn.LayerNorm")
        if why:
            return why
        if tuple(norm.normalized_shape) != (hidden,) or not norm.elementwise_affine:
            return f"its {path} {name} is not a LayerNorm over the {hidden} features with a learned weight"
    drops = {"attention dropout": getattr(attn, "dropout", None), "output dropout": m["drop2"]}
    if m["drop1"] is not None:
        drops["attention output dropout"] = m["drop1"]
    for name, drop in drops.items():
        why = _exact(drop, nn.Dropout, f"{path} {name}", "torch.nn.Dropout")
        if why:
            return why
    return None


def why_not(model: nn.Module) -> str | None:
    """Why ``model`` (a transformers model) cannot be converted; None when it can. Reads only."""
    ident = identify(model)
    if isinstance(ident, str):
        return ident
    family, kind = ident
    config = model.config
    if getattr(config, "is_decoder", False):
        return "config.is_decoder=True (causal self-attention with a key/value cache) is not supported"
    if getattr(config, "add_cross_attention", False):
        return "config.add_cross_attention=True (cross-attention layers) is not supported"
    position = getattr(config, "position_embedding_type", "absolute")
    if position not in (None, "absolute"):
        return f"config.position_embedding_type={position!r} is not supported (absolute positions only)"
    prefix = type(model).base_model_prefix
    base = model if kind == "base" else model._modules.get(prefix)
    mod = sys.modules[family.module]
    base_cls = getattr(mod, f"{family.prefix}Model")
    if type(base) is not base_cls:
        return f"its {prefix} is a {type(base).__name__}, not a transformers {base_cls.__name__}"
    for path, sub in model.named_modules(remove_duplicate=False):
        if hasattr(sub, "_hf_hook"):
            return (f"{_its(path)} is dispatched by accelerate (device_map / offloading hooks), which ragged "
                    "would bypass")
    encoder = base._modules.get(family.encoder_name)
    # the modules the converted forward does not call: a head's base model itself, the encoder and its inside
    bypassed = [] if kind == "base" else [(prefix, base)]
    where = family.encoder_name if kind == "base" else f"{prefix}.{family.encoder_name}"
    if encoder is None or type(encoder._modules.get("layer")) is not nn.ModuleList:
        return f"its {where} is not HuggingFace's encoder with a ModuleList of layers"
    bypassed += [(f"{where}.{p}" if p else where, s) for p, s in encoder.named_modules(remove_duplicate=False)]
    for path, sub in bypassed:
        kinds = hook_kinds(sub)
        if kinds:
            return f"{_its(path)} has {', '.join(kinds)} hooks, which the converted forward would not run"
        if "forward" in sub.__dict__ and not isinstance(sub.__dict__["forward"], RaggedForward):
            return f"{_its(path)} has its forward replaced, which the converted forward would not run"
    hidden = config.dim if family.style == "distil" else config.hidden_size
    for i, layer in enumerate(encoder._modules["layer"]):
        why = _layer_reason(family, layer, f"{where}.layer.{i}", hidden)
        if why:
            return why
    if kind != "base":
        for name in HEAD_MODULES[(kind, family.style)]:
            if model._modules.get(name) is None:
                return f"it has no {name} module, which its head uses"
        if kind == "qa" and getattr(model._modules["qa_outputs"], "out_features", 2) != 2:
            return "its qa_outputs does not give 2 logits (start, end) per token"
        if kind == "sequence" and family.style == "bert" and base._modules.get("pooler") is None:
            return f"its {prefix} has no pooler, which its classifier reads"
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
    return isinstance(ident, str) or ident[1] == "base" or \
        is_converted(model._modules[type(model).base_model_prefix])


def patch(model: nn.Module) -> list[nn.Module]:
    """Set the converted forward on ``model`` (and its base model); returns the modules
    changed. ``model`` must have passed :func:`why_not`."""
    family, kind = identify(model)
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

    if is_done(model):
        return copying.deepcopy(model) if copy else model
    why = why_not(model)
    if why is not None:
        raise NotImplementedError(f"ragged.nn.convert(): cannot convert {type(model).__name__}: {why}; the model "
                                  "is unchanged")
    target = copying.deepcopy(model) if copy else model
    patch(target)
    return target


# --------------------------------------------------------------------------------------
# The converted forward

_PARAMETERS: dict[type, tuple[str, ...]] = {}  # class -> its forward's positional parameter names


def _bind(fn: str, cls: type, args: tuple, kwargs: dict) -> dict:
    names = _PARAMETERS.get(cls)
    if names is None:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
        names = _PARAMETERS[cls] = tuple(p.name for p in params if p.kind in (
            inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
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
        raise TypeError(f"{fn}(): expected output_hidden_states to be a bool, an int or a list of ints (hidden "
                        f"state indices), got {value!r}") from None


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
        raise NotImplementedError(f"{fn}(): output_attentions=True is not supported: ragged's attention never forms "
                                  "the attention probabilities")
    if kw.get("is_causal"):
        raise NotImplementedError(f"{fn}(): is_causal=True is not supported: the converted encoder is bidirectional")
    return_dict = kw.get("return_dict")
    if return_dict is None:
        return_dict = getattr(config, "return_dict", True)
    hidden = kw.get("output_hidden_states")
    if hidden is None:
        hidden = getattr(config, "output_hidden_states", False)
    base = model if kind == "base" else model._modules[cls.base_model_prefix]
    layers = len(base._modules[family.encoder_name]._modules["layer"])
    enc = encode(fn, family, base, kw.get("input_ids"), kw.get("attention_mask"), kw.get("token_type_ids"),
                 kw.get("position_ids"), kw.get("inputs_embeds"), hidden_picks(fn, hidden, layers))
    if kind == "base":
        fields = {"last_hidden_state": enc.batch.out(enc.values)}
        if family.style in ("bert", "roberta"):
            fields["pooler_output"] = pooled_output(base, enc)
        name = _OUTPUTS[family.style]
    else:
        fields = head_outputs(fn, kind, family, model, base, enc, kw.get("labels"), kw.get("start_positions"),
                              kw.get("end_positions"))
        name = _OUTPUTS[kind]
    fields["hidden_states"] = enc.hidden_states()
    return _output(name, fields, return_dict)
