"""Sentence-transformers models computed padding-free (what :func:`ragged.nn.convert` does to a
``SentenceTransformer`` whose first module is a ``Transformer`` over a BERT-family model)::

    st = ragged.nn.convert(SentenceTransformer(path))
    emb = st.encode(texts)          # the original's embeddings, computed on the real tokens only

**Mechanism.** As for HuggingFace models (:mod:`ragged.nn.hf_bert`), conversion sets instance
attributes and nothing else: the ``auto_model`` is converted by :mod:`ragged.nn.hf_bert`; the
Transformer gets a ``forward`` (:class:`RaggedTransformerForward`) and a ``preprocess``
(:class:`RaggedPreprocess`), each Pooling that reads the Transformer's token embeddings a
``forward`` (:class:`RaggedPooling`), the model an ``encode`` (:class:`RaggedEncode`). Classes,
module tree, Parameters and ``state_dict`` keys stay: ``save`` writes the original's files (a loaded
model is a plain SentenceTransformer until converted again), an optimizer built before keeps
training the model, ``copy.deepcopy`` / ``pickle`` give a converted model. Converting a converted
model changes nothing.

**Data flow.** In ``encode`` each batch is packed on the host: for sentence embeddings the texts are
tokenized without padding (sentence-transformers' preprocess with ``padding=False`` and no tensors,
when the tokenizer pads on the right and no module reads padded token embeddings: faster than the
tokenizer's padding and tensor conversion), otherwise as sentence-transformers tokenizes them and
packed from the host mask. The Transformer moves the packed ids to the device (pinned, non-blocking
on CUDA): no device read. Outside ``encode`` (``st(features)`` in training, losses, evaluators) the
padded ``input_ids`` are packed with their ``attention_mask`` on the device: one device-to-host read
of the mask (its lengths and layout, :func:`ragged.interop.read_mask_layout`). The ``auto_model``
returns a RaggedTensor, which Pooling reduces with :func:`ragged.pool`; Dense, Normalize, Dropout
and LayerNorm act on the ``[B, d]`` sentence embeddings as they are.

**Features** after the converted Transformer:

* ``"ragged_token_embeddings"``: a :class:`TokenEmbeddings` (``.rt``: the last hidden state as a
  RaggedTensor ``[T, d]``; ``tokens[b]``: sequence ``b``'s ``[L_b, d]``);
* ``"token_embeddings"``: ``[B, M, d]`` padded like ``attention_mask`` (zeros at padding) only
  for ``encode(output_value="token_embeddings")`` or ``output_value=None``, or on every call
  when a module after the Transformer may read it (below) or
  ``st[0].forward.pad_token_embeddings`` is True; absent otherwise;
* ``"all_layer_embeddings"``: padded hidden states, when the model's config asks for them;
* ``input_ids``, ``token_type_ids``, ``attention_mask`` as the tokenizer made them (absent
  when ``encode`` tokenized without padding).

**Pooling** (``cls``, ``max``, ``mean``, ``mean_sqrt_len_tokens``, ``weightedmean``, ``lasttoken``
and tuples of them; ``include_prompt=False`` with a prompt) runs on the packed tokens when the
features' ``token_embeddings`` is the one the Transformer wrote (or absent); a loss or module that
put others there gets sentence-transformers' own padded pooling. ``weightedmean`` weighs by the
columns of the padded batch, as sentence-transformers does. A sequence with no token pools to zeros
(sentence-transformers: ``-inf`` for ``max``); tokenizers always add special tokens, so ``encode``
never meets one.

**Other modules** after the Transformer (LSTM, CNN, WordWeights, custom modules, Dense or
Normalize on token embeddings, a Pooling after one of those, a Pooling subclass) keep working
on padded ``token_embeddings`` written on every call; conversion lists them in a warning
(``strict=True``: NotImplementedError instead).

**Refused**, with the model untouched: a first module other than sentence-transformers'
``Transformer`` (a Router, StaticEmbedding, a subclass), a backend other than torch, a task other
than feature extraction, a text modality other than the model's forward to ``last_hidden_state``,
flattened inputs for flash attention (``unpad_inputs``: set ``st[0].unpad_inputs = False`` first),
query expansion with ``attend=False``, an ``auto_model`` that :mod:`ragged.nn.hf_bert` refuses (its
reason is given), ``forward`` / ``preprocess`` / ``encode`` already replaced by something else. At
call time, inputs of another modality than text and flattened inputs (``cu_seq_lens_q``) raise
NotImplementedError.
"""

from __future__ import annotations

import copy as copying
import dataclasses
import inspect
import itertools
import sys
import warnings
from collections.abc import MutableMapping

import numpy as np
import torch
from torch import nn

import ragged
from ragged import RaggedTensor
from ragged.utils import describe

from . import hf_bert
from .activation import PaddedLayout
from .hf_encoder import read_batch

__all__ = ["INPUT_KEY", "TOKENS_KEY", "PackedInput", "RaggedEncode", "RaggedPooling", "RaggedPreprocess",
           "RaggedTransformerForward", "TokenEmbeddings", "convert_sentence_transformer", "is_converted",
           "is_sentence_transformer", "pool_tokens", "why_not"]

TOKENS_KEY = "ragged_token_embeddings"
INPUT_KEY = "ragged_input"  # the host-packed batch from preprocess, consumed by the Transformer's forward
_FN = "ragged.nn.convert"
_TEXT = {"method": "forward", "method_output_name": "last_hidden_state"}


def is_sentence_transformer(model: object) -> bool:
    """Whether ``model`` is a ``SentenceTransformer`` (or a subclass). Never imports
    sentence-transformers: a model of it exists only once the package is loaded."""
    mod = sys.modules.get("sentence_transformers.sentence_transformer.model")
    return mod is not None and isinstance(model, mod.SentenceTransformer)


def _classes() -> dict[str, type]:
    from sentence_transformers.sentence_transformer import modules

    return {name: getattr(modules, name) for name in ("Transformer", "Pooling", "Dense", "Normalize", "Dropout",
                                                      "LayerNorm")}


# --------------------------------------------------------------------------------------
# Packed inputs and outputs


@dataclasses.dataclass
class PackedInput:
    """One batch of token ids packed: ``ids`` (RaggedTensor of ``[T]`` ids), ``token_type_ids``
    and ``position_ids`` (``[T]`` or None) and ``layout`` (where the tokens sat in the padded
    ``[B, M]`` batch)."""

    ids: RaggedTensor
    token_type_ids: torch.Tensor | None
    position_ids: torch.Tensor | None
    layout: PaddedLayout

    def matches(self, input_ids: object) -> bool:
        """Whether this batch was packed from padded ids of ``input_ids``' shape."""
        return isinstance(input_ids, torch.Tensor) and tuple(input_ids.shape) == (self.ids.batch_size,
                                                                                  self.layout.width)

    def to(self, device: torch.device) -> "PackedInput":
        """On ``device``; host tensors go to CUDA through pinned memory, without blocking."""
        if self.ids.device == device:
            return self
        cuda = device.type == "cuda" and self.ids.device.type == "cpu"

        def move(t):
            if t is None:
                return None
            if cuda:
                t = t.pin_memory()
            return t.to(device, non_blocking=cuda)

        index = self.layout.index
        layout = self.layout if index is None else dataclasses.replace(self.layout, index=tuple(move(i) for i in index))
        return PackedInput(move(self.ids), move(self.token_type_ids), move(self.position_ids), layout)


def pack_input(fn: str, style: str, input_ids, attention_mask, token_type_ids, position_ids) -> PackedInput:
    """Pack padded ``input_ids [B, M]`` with their ``attention_mask`` (one read of the mask:
    free on the host, one device-to-host read on a GPU). Positions follow HuggingFace: the
    columns of the padded batch for BERT, ELECTRA and DistilBERT (a left-padded row starts
    past 0), counted from the ids for RoBERTa-style models (the converted model does that)."""
    batch = read_batch(fn, "input_ids", input_ids, attention_mask, 0)
    types = batch.pack(fn, "token_type_ids", token_type_ids, 0, broadcast=True)
    positions = batch.pack(fn, "position_ids", position_ids, 0, broadcast=True)
    if positions is None and batch.layout.side != "right" and style != "roberta":
        positions = batch.columns()
    return PackedInput(batch.rt, types, positions, batch.layout)


class TokenEmbeddings:
    """``features["ragged_token_embeddings"]``: ``rt``, the Transformer's token embeddings as a
    RaggedTensor ``[T, d]``; ``layout``, where they sat in the padded batch; ``padded``, the
    padded ``features["token_embeddings"]`` written with them (None when none was).
    ``tokens[b]`` is sequence ``b``'s ``[L_b, d]``."""

    __slots__ = ("rt", "layout", "padded")

    def __init__(self, rt: RaggedTensor, layout: PaddedLayout, padded: torch.Tensor | None) -> None:
        self.rt, self.layout, self.padded = rt, layout, padded

    def __getitem__(self, index):
        return self.rt[index]

    def columns(self) -> torch.Tensor:
        """``[T]`` int64: each token's column in the padded batch."""
        return self.layout.positions(self.rt)

    def __repr__(self) -> str:
        return f"TokenEmbeddings({self.rt!r}, side={self.layout.side!r})"


# --------------------------------------------------------------------------------------
# The converted Transformer


class RaggedTransformerForward:
    """The ``forward`` of a converted Transformer module (an instance attribute). Set
    ``pad_token_embeddings`` to True to have ``features["token_embeddings"]`` written on every
    call (conversion sets it when a module after the Transformer may read it)."""

    def __init__(self, module: nn.Module, style: str, takes_types: bool, pad_token_embeddings: bool) -> None:
        self.module = module
        self.style = style
        self.takes_types = takes_types
        self.pad_token_embeddings = pad_token_embeddings
        self.encoding: list[str] = []  # innermost last: "sentence" or "tokens" while encode runs
        self.graphed = None  # a ragged.nn.Graphed of the model (set by ragged.nn.graphed): run when it can

    def __call__(self, features: dict, **kwargs) -> dict:
        return _transformer_forward(self, features, kwargs)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "encoding": [], "graphed": None}  # graphs are of this process

    def __repr__(self) -> str:
        return f"RaggedTransformerForward(pad_token_embeddings={self.pad_token_embeddings})"


def _transformer_forward(self: RaggedTransformerForward, features: dict, kwargs: dict) -> dict:
    fn = "Transformer.forward"
    if not isinstance(features, MutableMapping):
        raise TypeError(f"{fn}(): expected the features dict, got {describe(features)}")
    merged = {**features, **kwargs} if kwargs else features
    modality = merged.get("modality", "text")
    if modality != "text":
        raise NotImplementedError(f"{fn}(): the ragged forward takes text inputs, got modality {modality!r}")
    if merged.get("cu_seq_lens_q") is not None:
        raise NotImplementedError(f"{fn}(): flattened inputs (cu_seq_lens_q, from unpad_inputs) are not taken by the "
                                  "ragged forward: set unpad_inputs = False on the Transformer")
    if merged.get("inputs_embeds") is not None:
        raise NotImplementedError(f"{fn}(): inputs_embeds is not supported by the ragged forward; pass input_ids")
    model = self.module._modules["model"]
    ids = merged.get("input_ids")
    packed = features.pop(INPUT_KEY, None)
    if isinstance(packed, PackedInput) and (ids is None or packed.matches(ids)):
        packed = packed.to(model.device if ids is None else ids.device)
    elif not isinstance(ids, torch.Tensor):
        raise ValueError(f"{fn}(): expected features['input_ids'] to be a tensor [B, M], got {describe(ids)}")
    else:
        packed = pack_input(fn, self.style, ids, merged.get("attention_mask"),
                            merged.get("token_type_ids") if self.takes_types else None, merged.get("position_ids"))
    inputs = {k: t for k, t in (("input_ids", packed.ids), ("token_type_ids", packed.token_type_ids),
                                ("position_ids", packed.position_ids)) if t is not None}
    run = model
    if self.graphed is not None and not model.training and packed.ids.values.is_cuda:  # RaggedTensors of one batch
        run, inputs = self.graphed, {k: t if k == "input_ids" else packed.ids.with_values(t) for k, t in inputs.items()}
    out = run(**inputs, return_dict=True)
    rt = out["last_hidden_state"]
    if not isinstance(rt, RaggedTensor):
        raise NotImplementedError(f"{fn}(): its auto_model returned {describe(rt)}, not a RaggedTensor: its converted "
                                  "forward was removed; convert the SentenceTransformer again")
    pad = self.pad_token_embeddings or (bool(self.encoding) and self.encoding[-1] == "tokens")
    padded = packed.layout.unpack(rt) if pad else None
    features[TOKENS_KEY] = TokenEmbeddings(rt, packed.layout, padded)
    if padded is None:
        features.pop("token_embeddings", None)
    else:
        features["token_embeddings"] = padded
    hidden = out.get("hidden_states")
    if hidden is not None and getattr(model.config, "output_hidden_states", False):
        features["all_layer_embeddings"] = tuple(None if h is None else packed.layout.unpack(h) for h in hidden)
    return features


class RaggedPreprocess:
    """The ``preprocess`` of a converted Transformer: sentence-transformers' own, except while
    ``encode`` runs, when the batch is also packed on the host (``features["ragged_input"]``,
    consumed by the forward). For sentence embeddings of a right-padding tokenizer, with no
    module on padded token embeddings (they read the attention mask), the text is tokenized
    without padding (sentence-transformers' preprocess with ``padding=False`` and no
    tensors: the tokenizer's own padding and tensor conversion cost more than the packing)
    and the per-token lists are dropped from the features; otherwise the padded batch is kept
    and packed from its host mask."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.busy = False  # inside the original preprocess (it calls preprocess for a prompt's length)

    def __call__(self, *args, **kwargs) -> dict:
        module = self.module
        original = type(module).preprocess
        forward = module.__dict__.get("forward")
        if self.busy or not isinstance(forward, RaggedTransformerForward) or not forward.encoding:
            return original(module, *args, **kwargs)
        if forward.encoding[-1] == "sentence" and not forward.pad_token_embeddings and len(args) <= 2 \
                and _unpadded_ok(module, kwargs):
            # the common kwargs override the text ones in sentence-transformers' tokenizer call
            pk = dict(kwargs.get("processing_kwargs") or {})
            kwargs = {**kwargs, "processing_kwargs": {**pk, "common": {**pk.get("common", {}), **_UNPADDED}}}
        self.busy = True
        try:
            features = original(module, *args, **kwargs)
        finally:
            self.busy = False
        if not isinstance(features, MutableMapping) or features.get("modality", "text") != "text" \
                or "cu_seq_lens_q" in features:
            return features
        ids = features.get("input_ids")
        types = features.get("token_type_ids") if forward.takes_types else None
        if isinstance(ids, list) and all(isinstance(row, list) for row in ids):
            features[INPUT_KEY] = _from_lists(ids, types if isinstance(types, list) else None)
            for name in ("input_ids", "token_type_ids", "attention_mask"):
                features.pop(name, None)
        elif _host_padded(features):
            features[INPUT_KEY] = pack_input("Transformer.preprocess", forward.style, ids,
                                             features.get("attention_mask"), types, features.get("position_ids"))
        return features

    def __getstate__(self) -> dict:
        return {**self.__dict__, "busy": False}

    def __repr__(self) -> str:
        return "RaggedPreprocess()"


_UNPADDED = {"padding": False, "return_tensors": None, "return_attention_mask": False}


def _unpadded_ok(module: nn.Module, kwargs: dict) -> bool:
    """Whether tokenizing without padding gives the padded batch's tokens and positions: a
    tokenizer padding on the right, no padding side set through processing kwargs, and no
    query expansion (it rewrites the padded tensors)."""
    if getattr(module, "query_expansion", None) is not None:
        return False
    if getattr(module.tokenizer, "padding_side", "right") != "right" or module.processor is not module.tokenizer:
        return False
    for pk in (module.processing_kwargs, kwargs.get("processing_kwargs")):
        if pk is not None and (not isinstance(pk, dict) or any(
                isinstance(v, dict) and "padding_side" in v for v in pk.values())):
            return False
    return True


def _from_lists(ids: list, types: list | None) -> PackedInput:
    """A PackedInput from the tokenizer's per-sequence lists (host tensors, right-padding layout)."""
    lengths = [len(row) for row in ids]
    total = sum(lengths)

    def flat(rows):
        return torch.from_numpy(np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total))

    rt = RaggedTensor.from_lengths(flat(ids), lengths)
    if types is not None and [len(row) for row in types] != lengths:
        types = None
    return PackedInput(rt, None if types is None else flat(types), None, PaddedLayout(rt.max_len))


def _host_padded(features) -> bool:
    """Whether ``features`` holds a padded batch on the host that can be packed there."""
    ids = features.get("input_ids")
    tensors = [features.get(k) for k in ("input_ids", "attention_mask", "token_type_ids", "position_ids")]
    return isinstance(ids, torch.Tensor) and ids.dim() == 2 and all(
        t is None or (isinstance(t, torch.Tensor) and t.device.type == "cpu") for t in tensors)


class RaggedEncode:
    """The ``encode`` of a converted SentenceTransformer: sentence-transformers' own, with the
    batches packed on the host and the padded token embeddings written only when
    ``output_value`` asks for them."""

    _signatures: dict[type, inspect.Signature] = {}

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, *args, **kwargs):
        model = self.model
        encode = type(model).encode
        forward = model[0].__dict__.get("forward") if len(model) else None
        if not isinstance(forward, RaggedTransformerForward):
            return encode(model, *args, **kwargs)
        sig = self._signatures.get(type(model))
        if sig is None:
            sig = self._signatures[type(model)] = inspect.signature(encode)
        try:
            bound = sig.bind_partial(model, *args, **kwargs)
            value = bound.arguments.get("output_value", sig.parameters["output_value"].default)
        except (TypeError, KeyError):
            value = None  # let encode raise its own error; pad meanwhile
        forward.encoding.append("sentence" if value == "sentence_embedding" else "tokens")
        try:
            return encode(model, *args, **kwargs)
        finally:
            forward.encoding.pop()

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.model).encode.__get__(self.model))

    def __repr__(self) -> str:
        return "RaggedEncode()"


# --------------------------------------------------------------------------------------
# Pooling on packed tokens


class RaggedPooling:
    """The ``forward`` of a converted Pooling module: see the module docstring."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, features: dict, **kwargs) -> dict:
        tokens = features.get(TOKENS_KEY) if isinstance(features, MutableMapping) else None
        if not isinstance(tokens, TokenEmbeddings) or features.get("token_embeddings") is not tokens.padded:
            return type(self.module).forward(self.module, features, **kwargs)
        features["sentence_embedding"] = pool_tokens(self.module, tokens, features)
        return features

    def __repr__(self) -> str:
        return "RaggedPooling()"


def pool_tokens(pooling: nn.Module, tokens: TokenEmbeddings, features: dict) -> torch.Tensor:
    """``[B, modes * d]``: ``pooling``'s modes over the packed tokens, concatenated in its order
    (sentence-transformers' values; ``cls_token_embeddings`` and ``token_weights_sum`` in the
    features are used as sentence-transformers uses them)."""
    rt = tokens.rt
    x = rt.values
    modes = (pooling.pooling_mode,) if isinstance(pooling.pooling_mode, str) else tuple(pooling.pooling_mode)
    prompt = None  # the prompt is left out with include_prompt=False and its length given (an int, or a
    if not pooling.include_prompt and "prompt_length" in features:  # tensor read once, as sentence-transformers does)
        pl = features["prompt_length"]
        prompt = int(pl[0].item()) if isinstance(pl, torch.Tensor) else int(pl)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # sums and divisions
    lengths = rt.lengths.to(torch.int64)
    keep = None if prompt is None else rt.position_ids() >= prompt  # [T] tokens pooled
    weights_sum = features.get("token_weights_sum")
    count = None  # [B, 1] in acc: tokens pooled
    out = []
    for mode in modes:
        if mode == "cls":
            if "cls_token_embeddings" in features:
                out.append(features["cls_token_embeddings"])
            elif keep is None:
                out.append(ragged.pool(rt, "first"))
            else:
                out.append(_first_kept(x, rt, lengths, prompt))
        elif mode == "lasttoken":
            last = ragged.pool(rt, "last")
            out.append(last if keep is None else last * (lengths > prompt).unsqueeze(1).to(last.dtype))
        elif mode == "max":
            v = x if keep is None else x.masked_fill(~keep.unsqueeze(1), float("-inf"))
            out.append(ragged.pool(rt.with_values(v), "max"))
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            if keep is None and weights_sum is None and mode == "mean":
                out.append(ragged.pool(rt, "mean"))
                continue
            v = x if keep is None else x * keep.unsqueeze(1).to(x.dtype)
            total = ragged.pool(rt.with_values(v), "sum").to(acc)
            if count is None:
                if weights_sum is not None:
                    count = weights_sum.to(acc).unsqueeze(1)
                elif keep is None:
                    count = lengths.to(acc).unsqueeze(1)
                else:
                    count = ragged.pool(rt.with_values(keep.to(acc).unsqueeze(1)), "sum")
                count = count.clamp(min=1e-9)
            out.append((total / (count if mode == "mean" else count.sqrt())).to(x.dtype))
        elif mode == "weightedmean":
            w = ((tokens.columns() + 1).to(acc) * (1 if keep is None else keep)).unsqueeze(1)
            total = ragged.pool(rt.with_values(x.to(acc) * w), "sum")
            norm = weights_sum.to(acc).unsqueeze(1) if weights_sum is not None else \
                ragged.pool(rt.with_values(w), "sum")
            out.append((total / norm.clamp(min=1e-9)).to(x.dtype))
        else:
            raise NotImplementedError(f"Pooling.forward(): pooling mode {mode!r} is not supported by the ragged "
                                      f"pooling (supported: {', '.join(type(pooling).POOLING_MODES)})")
    return out[0] if len(out) == 1 else torch.cat(out, dim=-1)


def _first_kept(x: torch.Tensor, rt: RaggedTensor, lengths: torch.Tensor, prompt: int) -> torch.Tensor:
    """``[B, d]``: each sequence's first token past the prompt, as sentence-transformers picks it;
    its first token when the prompt covers it all (sentence-transformers: column 0, padding when
    left-padded); zeros for an empty sequence."""
    if x.shape[0] == 0:
        return x.new_zeros((rt.batch_size, *x.shape[1:]))
    start = rt.offsets[:-1].to(torch.int64)
    index = start + torch.where(lengths > prompt, prompt, 0)
    row = x.index_select(0, index.clamp(max=x.shape[0] - 1))
    return row * (lengths > 0).unsqueeze(1).to(x.dtype)


# --------------------------------------------------------------------------------------
# Conversion


@dataclasses.dataclass
class _Plan:
    transformer: nn.Module
    poolings: list[nn.Module]                 # Pooling modules that read the Transformer's token embeddings
    padded: list[tuple[str, str, str]]        # (name, class, why) of modules left on padded token embeddings


def _replaced(module: nn.Module, name: str, ours: type) -> bool:
    value = module.__dict__.get(name)
    return value is not None and not isinstance(value, ours)


def _plan(model: nn.Module) -> _Plan | str:
    """What conversion does to ``model``, or why it cannot be converted (reads only)."""
    if len(model) == 0:
        return "it has no modules"
    c = _classes()
    first = model[0]
    if type(first) is not c["Transformer"]:
        return (f"its first module is a {type(first).__name__}, not sentence-transformers' Transformer (ragged runs a "
                "Transformer over a BERT-family model)")
    if first.backend != "torch":
        return f"its Transformer runs the {first.backend!r} backend, not torch"
    if first.transformer_task != "feature-extraction":
        return f"its Transformer's task is {first.transformer_task!r}, not 'feature-extraction'"
    if first.module_output_name != "token_embeddings" or first.modality_config.get("text") != _TEXT:
        return (f"its Transformer maps text to {first.modality_config.get('text')!r} -> {first.module_output_name!r}, "
                "not the model's forward's last_hidden_state -> token_embeddings")
    if getattr(first, "can_flatten_inputs", False):
        return "its Transformer flattens inputs for flash attention: set st[0].unpad_inputs = False first"
    expansion = getattr(first, "query_expansion", None)
    if expansion is not None and not expansion.get("attend", True):
        return "its Transformer uses query expansion with attend=False (embeddings read at padding positions)"
    for owner, name, ours, where in ((first, "forward", RaggedTransformerForward, "its Transformer"),
                                     (first, "preprocess", RaggedPreprocess, "its Transformer"),
                                     (model, "encode", RaggedEncode, "it")):
        if _replaced(owner, name, ours):
            return f"{where} has its {name} replaced, which the converted model would not run"
    auto = first._modules.get("model")
    if not hf_bert.is_hf_model(auto):
        return f"its auto_model is a {type(auto).__name__}, not a transformers BERT-family model"
    if not hf_bert.is_done(auto):
        why = hf_bert.why_not(auto)
        if why is not None:
            return f"its auto_model cannot be converted: {why}"
    ident = hf_bert.identify(auto)
    if isinstance(ident, str) or ident[1] != "base":
        return f"its auto_model is a {type(auto).__name__}, not a base model (AutoModel)"
    poolings, padded, changed_by = [], [], None
    for name, module in list(model._modules.items())[1:]:
        kind = type(module)
        if kind is c["Pooling"] and changed_by is None and not _replaced(module, "forward", RaggedPooling):
            poolings.append(module)
        elif kind in (c["Dropout"], c["LayerNorm"]) or (kind in (c["Dense"], c["Normalize"]) and "token_embeddings"
                                                         not in (module.module_input_name, module.module_output_name)):
            pass  # sentence-level: [B, d] in, [B, d] out
        else:
            if kind is c["Pooling"] and changed_by is not None:
                why = f"it pools the token embeddings module {changed_by!r} wrote (sentence-transformers' pooling)"
            else:
                why = "it may read or change the token embeddings (it gets them padded)"
                changed_by = name if changed_by is None else changed_by
            padded.append((name, kind.__name__, why))
    return _Plan(first, poolings, padded)


def why_not(model: nn.Module) -> str | None:
    """Why the SentenceTransformer ``model`` cannot be converted; None when it can. Reads only."""
    plan = _plan(model)
    return plan if isinstance(plan, str) else None


def is_converted(model: nn.Module) -> bool:
    """Whether the SentenceTransformer ``model`` is converted."""
    return (isinstance(model.__dict__.get("encode"), RaggedEncode) and len(model) > 0
            and isinstance(model[0].__dict__.get("forward"), RaggedTransformerForward))


def convert_sentence_transformer(model: nn.Module, *, copy: bool = False, strict: bool = False) -> nn.Module:
    """:func:`ragged.nn.convert` on a SentenceTransformer (see the module docstring): converted
    in place and returned (``copy=True``: a converted deep copy, ``model`` untouched), or
    refused with NotImplementedError naming the reason, ``model`` unchanged. Modules left on
    padded token embeddings are listed in one warning; ``strict=True`` raises
    NotImplementedError with that list instead, before anything changes."""
    if not is_sentence_transformer(model):
        raise TypeError(f"{_FN}(): expected a SentenceTransformer, got {describe(model)}")
    for name, flag in (("copy", copy), ("strict", strict)):
        if not isinstance(flag, bool):
            raise TypeError(f"{_FN}(): expected {name} to be a bool, got {describe(flag)}")
    if is_converted(model):
        return copying.deepcopy(model) if copy else model
    plan = _plan(model)
    if isinstance(plan, str):
        raise NotImplementedError(f"{_FN}(): cannot convert {type(model).__name__}: {plan}; the model is unchanged")
    if plan.padded:
        listing = "; ".join(f"{name!r} ({cls}): {why}" for name, cls, why in plan.padded)
        if strict:
            raise NotImplementedError(f"{_FN}(): nothing converted: {len(plan.padded)} module(s) of "
                                      f"{type(model).__name__} would run on padded token embeddings: {listing}")
        warnings.warn(f"{_FN}(): {len(plan.padded)} module(s) of {type(model).__name__} run on padded token "
                      f"embeddings: {listing}", stacklevel=3)
    if copy:
        model = copying.deepcopy(model)
        plan = _plan(model)
    first = plan.transformer
    auto = first._modules["model"]
    family, _ = hf_bert.identify(auto)
    takes_types = "token_type_ids" in inspect.signature(type(auto).forward).parameters
    patched = [] if hf_bert.is_done(auto) else hf_bert.patch(auto)
    try:  # plain attribute settings: nothing here is expected to fail, but leave nothing half done
        first.forward = RaggedTransformerForward(first, family.style, takes_types, bool(plan.padded))
        first.preprocess = RaggedPreprocess(first)
        model.encode = RaggedEncode(model)
        for pooling in plan.poolings:
            pooling.forward = RaggedPooling(pooling)
    except BaseException:
        for module, name in [(first, "forward"), (first, "preprocess"), (model, "encode"),
                             *((pooling, "forward") for pooling in plan.poolings)]:
            module.__dict__.pop(name, None)
        hf_bert.unpatch(patched)
        raise
    return model
