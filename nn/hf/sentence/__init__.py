"""Sentence-transformers models computed padding-free (what :func:`ragged.nn.convert` does to a
``SentenceTransformer`` whose first module is a ``Transformer`` over a model :mod:`ragged.nn.hf` converts,
or over a decoder :mod:`ragged.nn.hf.decoder` runs on packed batches: Qwen3-Embedding, EmbeddingGemma)::

    st = ragged.nn.convert(SentenceTransformer(path))
    emb = st.encode(texts)          # the original's embeddings, computed on the real tokens only

**Mechanism.** As for HuggingFace models (:mod:`ragged.nn.hf`), conversion sets instance
attributes and nothing else: the ``auto_model`` is converted by :mod:`ragged.nn.hf` (a decoder:
below); the
Transformer gets a ``forward`` (:class:`RaggedTransformerForward`) and a ``preprocess``
(:class:`RaggedPreprocess`), each Pooling that reads the Transformer's token embeddings a
``forward`` (:class:`RaggedPooling`), the model an ``encode`` (:class:`RaggedEncode`). Classes,
module tree, Parameters and ``state_dict`` keys stay: ``save`` writes the original's files (a loaded
model is a plain SentenceTransformer until converted again), an optimizer built before keeps
training the model, ``copy.deepcopy`` / ``pickle`` give a converted model. Converting a converted
model changes nothing. ``torch.nn.DataParallel`` (``torch.nn.parallel.replicate``) copies each module's
``__dict__`` into a replica that gets its own parameters: each patched module also gets an instance
``_replicate_for_data_parallel`` that remakes its patches for the replica, so that every replica runs
its own parameters (eagerly: graphs hold the original's); a replica's output has no
``"ragged_token_embeddings"``, which DataParallel's gather cannot concatenate. A shallow ``copy.copy``
is not converted (:func:`is_converted`) until ``convert`` is called on it.

**Decoders** (Qwen2, Qwen3, Llama, Mistral and Gemma 1 to 3 base models) keep their own forward:
conversion sets ``attn_implementation="ragged"`` on the ``auto_model``, its one change there (``save``
writes the original's config; ``copy=True`` and a refusal leave the original's implementation; one
set after conversion makes the call raise until converted again), and the Transformer runs the
model on the packed batch as one row with its offsets, each sequence attending within itself as
the model attends (causally, or both ways for EmbeddingGemma). Positions are the padded batch's
columns where it is left-padded (transformers' numbers), each sequence's from 0 otherwise.

**Data flow.** In ``encode`` each batch is packed on the host: for sentence embeddings the texts are
tokenized without padding (sentence-transformers' preprocess with ``padding=False`` and no tensors,
when no module reads padded token embeddings and the tokenizer pads on the right, or on the left
to the longest text, the columns then computed from the lengths: faster than the tokenizer's
padding and tensor conversion), otherwise (texts rendered as chat messages too) as
sentence-transformers tokenizes them and packed from the host mask. The Transformer moves the
packed ids to the device (pinned, non-blocking on CUDA): no device read (a decoder that builds its
own masks, Llama's, makes transformers' one read per forward: :mod:`ragged.nn.hf.decoder`).
Outside ``encode`` (``st(features)`` in training, losses, evaluators) the padded ``input_ids`` are
packed with their ``attention_mask`` on the device: one device-to-host read of the mask (its
lengths and layout, :func:`ragged.padding.read_mask_layout`). The ``auto_model`` returns a
RaggedTensor, which Pooling reduces with :func:`ragged.pool`; Dense, Normalize, Dropout and
LayerNorm act on the ``[B, d]`` sentence embeddings as they are.

**Threads.** What ``encode`` is doing (sentence or token embeddings) lives in the call's context
(a ``contextvars`` variable: each thread and asyncio task has its own), never on the shared
modules, so threads may call ``encode`` / ``tokenize`` / ``st(features)`` on one converted model at
once. Tokenizing without padding changes the fast tokenizer's shared padding setting, so the
converted Transformer's preprocess tokenizes one call at a time (its replicas share the tokenizer,
and that lock). The graphs (:func:`ragged.nn.graphed`) take one call at a time themselves; with
``copy_outputs=False`` the outputs are the graphs' buffers, which the next call from any thread
overwrites: one thread only.

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
put others there gets sentence-transformers' own padded pooling (:mod:`ragged.nn.hf.sentence.pooling`).
``lasttoken`` reads each sequence's last token whatever the padding side. ``weightedmean`` weighs
as the installed sentence-transformers does: by the columns of the padded batch before 6.2, by the
place in the sequence from 6.2 (the two differ under left padding), read from its Pooling once. A
sequence with no token (an empty text, where the tokenizer adds no special token) pools to zeros
(sentence-transformers: ``-inf`` for ``max``). ``encode(output_value=None)`` gives each row its own
text's ``[L, d]`` tokens as ``"ragged_token_embeddings"``.

**Other modules** after the Transformer (LSTM, CNN, WordWeights, custom modules, Dense or
Normalize on token embeddings, a Pooling after one of those, a Pooling subclass) keep working
on padded ``token_embeddings`` written on every call; conversion lists them in a warning
(``strict=True``: NotImplementedError instead).

**Refused**, with the model untouched: a first module other than sentence-transformers'
``Transformer`` (a Router, StaticEmbedding, a subclass), a backend other than torch, a task other
than feature extraction, a text or chat-message modality other than the model's forward to
``last_hidden_state``,
flattened inputs for flash attention (``unpad_inputs``: set ``st[0].unpad_inputs = False`` first),
query expansion with ``attend=False``, an ``auto_model`` that :mod:`ragged.nn.hf` refuses (its
reason is given; for a decoder :func:`ragged.nn.hf.decoder.why_not`'s), ``forward`` / ``preprocess``
/ ``encode`` already replaced by something else. At call time, inputs of another modality than
text (or text-only chat messages) and flattened inputs (``cu_seq_lens_q``) raise NotImplementedError.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy as copying
import inspect
import sys
import threading
import warnings
from collections.abc import MutableMapping

import torch
from torch import nn

from ragged import RaggedTensor
from ragged.utils import describe

from .. import forward as hf_forward
from ..decoder import PackedDecoder, restore_attention, run_packed, use_ragged_attention, uses_ragged_attention
from .batch import INPUT_KEY, UNPADDED, PackedInput, from_lists, host_padded, pack_input, unpadded_side
from .pipeline import MAX_BATCH, PackedRunner, Pipeline, finish, reason, run
from .plan import Plan, plan_conversion
from .pooling import (
    TOKENS_KEY,
    RaggedPooling,
    ReplicaForward,
    TokenEmbeddings,
    pool_tokens,
    set_patches,
    weightedmean_origin,
)

__all__ = [
    "INPUT_KEY",
    "TOKENS_KEY",
    "PackedInput",
    "RaggedEncode",
    "RaggedPooling",
    "RaggedPreprocess",
    "RaggedTransformerForward",
    "ReplicaForward",
    "TokenEmbeddings",
    "convert_sentence_transformer",
    "packed_runner",
    "encoding",
    "graph_target",
    "is_converted",
    "is_sentence_transformer",
    "pool_tokens",
    "why_not",
]

_TEXT_MODALITIES = ("text", "message")  # a message modality's features are text too, unless media come with them
_TEXT_KEYS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "token_type_ids",
        "position_ids",
        "prompt_length",
        "offset_mapping",
        "special_tokens_mask",
        "overflow_to_sample_mapping",
        "query_expansion_positions",
    }
)
_FN = "ragged.nn.convert"

# A call's state lives in its context (each thread and asyncio task has its own), never on shared modules:
# ((forward, "sentence" or "tokens"), ...) of the encodes running, innermost last; preprocesses in their original.
_ENCODING: contextvars.ContextVar[tuple] = contextvars.ContextVar("ragged_sentence_encoding", default=())
_PREPROCESSING: contextvars.ContextVar[tuple] = contextvars.ContextVar("ragged_sentence_preprocessing", default=())


@contextlib.contextmanager
def encoding(forward: RaggedTransformerForward, mode: str, graphed=None):
    """Within the block, in this thread or task only, the converted Transformer whose forward
    is ``forward`` runs as inside ``encode``: ``mode`` ``"sentence"`` (its preprocess packs the
    batch on the host, tokenizing without padding where it can) or ``"tokens"`` (the padded
    batch packed from its host mask; the forward writes padded ``token_embeddings``).
    ``graphed``: a :class:`ragged.nn.Graphed` of the model the forward replays in eval mode
    (the encode pipeline's own, :mod:`.pipeline`) where ``forward.graphed`` is None."""
    if not isinstance(forward, RaggedTransformerForward):
        raise TypeError(
            f"ragged.nn.hf.sentence.encoding(): expected the forward of a converted Transformer, got "
            f"{describe(forward)}"
        )
    if mode not in ("sentence", "tokens"):
        raise ValueError(f"ragged.nn.hf.sentence.encoding(): expected mode 'sentence' or 'tokens', got {mode!r}")
    token = _ENCODING.set((*_ENCODING.get(), (forward, mode, graphed)))
    try:
        yield
    finally:
        _ENCODING.reset(token)


def _mode(forward: RaggedTransformerForward, index: int = 1):
    """The mode (``index`` 2: the graphs) of the innermost encode of ``forward`` in this
    context; None outside encode."""
    for entry in reversed(_ENCODING.get()):
        if entry[0] is forward:
            return entry[index]
    return None


def is_sentence_transformer(model: object) -> bool:
    """Whether ``model`` is a ``SentenceTransformer`` (or a subclass). Never imports
    sentence-transformers: a model of it exists only once the package is loaded."""
    mod = sys.modules.get("sentence_transformers.sentence_transformer.model")
    return mod is not None and isinstance(model, mod.SentenceTransformer)


# --------------------------------------------------------------------------------------
# The converted Transformer


class RaggedTransformerForward:
    """The ``forward`` of a converted Transformer module (an instance attribute). Set
    ``pad_token_embeddings`` to True to have ``features["token_embeddings"]`` written on every
    call (conversion sets it when a module after the Transformer may read it). ``decoder``: the
    ``auto_model`` is a decoder run on the packed batch as one row (:mod:`ragged.nn.hf.decoder`),
    not a converted encoder."""

    decoder = False

    def __init__(
        self, module: nn.Module, from_ids: bool, takes_types: bool, pad_token_embeddings: bool, decoder: bool = False
    ) -> None:
        self.module = module
        self.from_ids = from_ids
        self.takes_types = takes_types
        self.pad_token_embeddings = pad_token_embeddings
        self.decoder = decoder
        self.graphed = None  # a ragged.nn.Graphed of the model (set by ragged.nn.graphed): run when it can

    def __call__(self, features: dict, **kwargs) -> dict:
        return _transformer_forward(self, features, kwargs)

    def for_replica(self, replica: nn.Module) -> dict:
        """The forward of ``replica``, a DataParallel replica of this module: no graphs (they
        hold this module's parameters)."""
        return {
            "forward": RaggedTransformerForward(
                replica, self.from_ids, self.takes_types, self.pad_token_embeddings, self.decoder
            )
        }

    def __getstate__(self) -> dict:
        return {**self.__dict__, "graphed": None}  # graphs are of this process

    def __repr__(self) -> str:
        return f"RaggedTransformerForward(pad_token_embeddings={self.pad_token_embeddings}, decoder={self.decoder})"


def _transformer_forward(self: RaggedTransformerForward, features: dict, kwargs: dict) -> dict:
    fn = "Transformer.forward"
    if not isinstance(features, MutableMapping):
        raise TypeError(f"{fn}(): expected the features dict, got {describe(features)}")
    merged = {**features, **kwargs} if kwargs else features
    modality = merged.get("modality", "text")
    if modality not in _TEXT_MODALITIES:
        raise NotImplementedError(f"{fn}(): the ragged forward takes text inputs, got modality {modality!r}")
    media = (
        [k for k, v in merged.items() if isinstance(v, torch.Tensor) and k not in _TEXT_KEYS]
        if modality == "message"
        else ()
    )
    if media:
        raise NotImplementedError(f"{fn}(): the ragged forward takes text-only messages, got inputs {media}")
    if merged.get("cu_seq_lens_q") is not None:
        raise NotImplementedError(
            f"{fn}(): flattened inputs (cu_seq_lens_q, from unpad_inputs) are not taken by the "
            "ragged forward: set unpad_inputs = False on the Transformer"
        )
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
        packed = pack_input(
            fn,
            self.from_ids,
            ids,
            merged.get("attention_mask"),
            merged.get("token_type_ids") if self.takes_types else None,
            merged.get("position_ids"),
        )
    # token types only for a model that takes them: the others' forward ignores them (its **kwargs),
    # and so must the graphs' module, which would take them as inputs of its bucket
    types = packed.token_type_ids if self.takes_types else None
    inputs = {
        k: t
        for k, t in (("input_ids", packed.ids), ("token_type_ids", types), ("position_ids", packed.position_ids))
        if t is not None
    }
    graphed = self.graphed if self.graphed is not None else _mode(self, 2)
    if graphed is not None and not model.training and packed.ids.values.is_cuda:  # RaggedTensors of one batch
        inputs = {k: t if k == "input_ids" else packed.ids.with_values(t) for k, t in inputs.items()}
        out = graphed(**inputs, return_dict=True)
    elif self.decoder:
        out = run_packed(model, packed.ids, packed.position_ids)
    else:
        out = model(**inputs, return_dict=True)
    rt = out["last_hidden_state"]
    if not isinstance(rt, RaggedTensor):
        raise NotImplementedError(
            f"{fn}(): its auto_model returned {describe(rt)}, not a RaggedTensor: its converted "
            "forward was removed; convert the SentenceTransformer again"
        )
    pad = self.pad_token_embeddings or _mode(self) == "tokens"
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

    def __init__(self, module: nn.Module, lock: threading.RLock | None = None) -> None:
        self.module = module
        # a fast tokenizer keeps its padding setting in shared state, set by every call before it
        # tokenizes, and encode's calls set another than the others': one call at a time (re-entrant:
        # the encode pipeline holds it around the original preprocess, which may call this one)
        self.lock = threading.RLock() if lock is None else lock

    def for_replica(self, replica: nn.Module) -> dict:
        """The preprocess of ``replica``, a DataParallel replica of this module: it holds the same
        tokenizer (a replica's ``__dict__`` is a shallow copy), so it takes the same lock."""
        return {"preprocess": RaggedPreprocess(replica, self.lock)}

    def __call__(self, *args, **kwargs) -> dict:
        module = self.module
        original = type(module).preprocess
        inside = _PREPROCESSING.get()
        if self in inside:  # the original calls preprocess (for a prompt's length) inside our call
            return original(module, *args, **kwargs)
        forward = _own(module, "forward", RaggedTransformerForward)
        mode = None if forward is None else _mode(forward)
        side = (
            unpadded_side(module, kwargs)
            if mode == "sentence" and not forward.pad_token_embeddings and len(args) <= 2
            else None
        )
        if side is not None:  # the common kwargs override the text ones in sentence-transformers' tokenizer call
            pk = dict(kwargs.get("processing_kwargs") or {})
            kwargs = {**kwargs, "processing_kwargs": {**pk, "common": {**pk.get("common", {}), **UNPADDED}}}
        token = _PREPROCESSING.set((*inside, self))
        try:
            with self.lock:
                features = original(module, *args, **kwargs)
        finally:
            _PREPROCESSING.reset(token)
        if (
            mode is None
            or not isinstance(features, MutableMapping)
            or "cu_seq_lens_q" in features
            or features.get("modality", "text") not in _TEXT_MODALITIES
        ):
            return features
        ids = features.get("input_ids")
        types = features.get("token_type_ids") if forward.takes_types else None
        if isinstance(ids, list) and all(isinstance(row, list) for row in ids):
            features[INPUT_KEY] = from_lists(
                ids, types if isinstance(types, list) else None, side or "right", not forward.from_ids
            )
            for name in ("input_ids", "token_type_ids", "attention_mask"):
                features.pop(name, None)
        elif host_padded(features):
            features[INPUT_KEY] = pack_input(
                "Transformer.preprocess",
                forward.from_ids,
                ids,
                features.get("attention_mask"),
                types,
                features.get("position_ids"),
            )
        return features

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()

    def __repr__(self) -> str:
        return "RaggedPreprocess()"


class RaggedEncode:
    """The ``encode`` of a converted SentenceTransformer: on a GPU the overlapped pipeline of
    :mod:`.pipeline` (settings in ``.pipeline``, a :class:`.pipeline.Pipeline`);
    otherwise, and for the calls the pipeline does not take, sentence-transformers' own, with the
    batches packed on the host and the padded token embeddings written only when
    ``output_value`` asks for them."""

    _signatures: dict[type, inspect.Signature] = {}

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.pipeline = Pipeline()

    def for_replica(self, replica: nn.Module) -> dict:
        return {"encode": RaggedEncode(replica), "forward": ReplicaForward(replica)}

    def pipelined(self, arguments: dict, settings: Pipeline | None = None, on_batch=None) -> torch.Tensor:
        """``[N, d]`` embeddings of ``arguments["inputs"]`` through the pipeline (``arguments``:
        encode's, by name), on the device, in the input order, before truncation and normalisation."""
        model = self.model
        return run(
            model,
            model[0].forward,
            self.pipeline if settings is None else settings,
            arguments,
            lambda: graph_target(model),
            encoding,
            on_batch,
        )

    def __call__(self, *args, **kwargs):
        model = self.model
        encode = type(model).encode
        forward = _own(model[0], "forward", RaggedTransformerForward) if len(model) else None
        if forward is None:
            return encode(model, *args, **kwargs)
        sig = self._signatures.get(type(model))
        if sig is None:
            sig = self._signatures[type(model)] = inspect.signature(encode)
        try:
            bound = sig.bind_partial(model, *args, **kwargs)
            value = bound.arguments.get("output_value", sig.parameters["output_value"].default)
        except (TypeError, KeyError):
            bound, value = None, "unknown"  # let encode raise its own error; pad meanwhile
        if bound is not None:
            arguments = {k: v for k, v in bound.arguments.items() if k != next(iter(sig.parameters))}
            if reason(model, forward, self.pipeline, arguments) is None:
                return finish(model, self.pipelined(arguments), arguments, isinstance(arguments["inputs"], str))
        with encoding(forward, "sentence" if value == "sentence_embedding" else "tokens"):
            out = encode(model, *args, **kwargs)
        if value is None and isinstance(out, list):
            for row in out:
                _own_tokens(row)
        return out

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.model).encode.__get__(self.model))

    def __repr__(self) -> str:
        return "RaggedEncode()"


def _own_tokens(row: object) -> None:
    """A row of ``encode(output_value=None)``: its ``ragged_token_embeddings`` made its own text's
    ``[L, d]`` tokens (sentence-transformers from 6.2 keeps objects other than tensors whole: the
    batch's TokenEmbeddings in every row), read from the row's padded ones and mask."""
    if not isinstance(row, MutableMapping) or not isinstance(row.get(TOKENS_KEY), TokenEmbeddings):
        return
    padded, mask = row.get("token_embeddings"), row.get("attention_mask")
    if (
        isinstance(padded, torch.Tensor)
        and isinstance(mask, torch.Tensor)
        and mask.dim() == 1
        and padded.dim() >= 2
        and padded.shape[0] == mask.shape[0]
    ):
        row[TOKENS_KEY] = padded[mask.bool()]
    else:
        del row[TOKENS_KEY]  # never another text's tokens


# --------------------------------------------------------------------------------------
# Conversion


def _plan(model: nn.Module) -> Plan | str:
    return plan_conversion(model, (RaggedTransformerForward, RaggedPreprocess, RaggedEncode))


def why_not(model: nn.Module) -> str | None:
    """Why the SentenceTransformer ``model`` cannot be converted; None when it can. Reads only."""
    plan = _plan(model)
    return plan if isinstance(plan, str) else None


def _own(module: nn.Module, name: str, cls: type):
    """``module``'s instance attribute ``name`` when it is a ``cls`` patch of ``module`` itself
    (a shallow copy or a replica holds another module's); None otherwise."""
    value = module.__dict__.get(name)
    if not isinstance(value, cls):
        return None
    return value if (value.model if cls is RaggedEncode else value.module) is module else None


def is_converted(model: nn.Module) -> bool:
    """Whether the SentenceTransformer ``model`` is converted: its encode, its Transformer's
    forward and preprocess and its Poolings' ragged forwards are patches of their own module."""
    own = len(model) > 0 and all(
        _own(m, name, cls) is not None
        for m, name, cls in (
            (model, "encode", RaggedEncode),
            (model[0], "forward", RaggedTransformerForward),
            (model[0], "preprocess", RaggedPreprocess),
            *(
                (m, "forward", RaggedPooling)
                for m in model._modules.values()
                if isinstance(m.__dict__.get("forward"), RaggedPooling)
            ),
        )
    )
    # a decoder runs packed under "ragged" attention only: another set since is not converted
    return own and (not model[0].forward.decoder or uses_ragged_attention(model[0]._modules["model"]))


def graph_target(model: nn.Module) -> nn.Module:
    """What :func:`ragged.nn.graphed` captures for the converted SentenceTransformer ``model``:
    its ``auto_model`` (a converted encoder) or a :class:`ragged.nn.hf.decoder.PackedDecoder` of it."""
    auto = model[0]._modules["model"]
    return PackedDecoder(auto) if model[0].forward.decoder else auto


def packed_runner(st: nn.Module, max_tokens: int, max_batch: int | None = None, graphs: bool = True) -> PackedRunner:
    """A :class:`.pipeline.PackedRunner` of ``st`` (a SentenceTransformer converted by
    :func:`ragged.nn.convert`): its tokenization and its packed batches, for a caller that forms
    the batches itself (``python -m ragged.serve``)."""
    forward = _own(st[0], "forward", RaggedTransformerForward) if len(st) else None
    if forward is None or not is_converted(st):
        raise ValueError(
            f"ragged.nn.hf.sentence.packed_runner(): expected a SentenceTransformer converted by ragged.nn.convert, "
            f"got {type(st).__name__} not converted"
        )
    return PackedRunner(
        st,
        forward,
        lambda: graph_target(st),
        encoding,
        max_tokens,
        MAX_BATCH if max_batch is None else max_batch,
        graphs,
    )


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
            raise NotImplementedError(
                f"{_FN}(): nothing converted: {len(plan.padded)} module(s) of "
                f"{type(model).__name__} would run on padded token embeddings: {listing}"
            )
        warnings.warn(
            f"{_FN}(): {len(plan.padded)} module(s) of {type(model).__name__} run on padded token "
            f"embeddings: {listing}",
            stacklevel=3,
        )
    if any(
        "weightedmean" in ((p.pooling_mode,) if isinstance(p.pooling_mode, str) else p.pooling_mode)
        for p in plan.poolings
    ):
        weightedmean_origin()  # read once here (or refused), not while a forward is traced or captured
    if copy:
        model = copying.deepcopy(model)
        plan = _plan(model)
    first = plan.transformer
    auto = first._modules["model"]
    takes_types = "token_type_ids" in inspect.signature(type(auto).forward).parameters
    if plan.decoder:  # its own forward, on the packed batch as one row, under "ragged" attention
        from_ids, patched, attention = False, [], use_ragged_attention(auto)
    else:
        from_ids, attention = hf_forward.identify(auto)[0].positions_from_ids, None
        patched = [] if hf_forward.is_done(auto) else hf_forward.patch(auto)
    # what a shallow copy shares with a converted model is its own already: kept as it is (graphs included)
    wanted = [
        (
            first,
            "forward",
            RaggedTransformerForward,
            lambda: RaggedTransformerForward(
                first, from_ids, takes_types and not plan.decoder, bool(plan.padded), plan.decoder
            ),
        ),
        (first, "preprocess", RaggedPreprocess, lambda: RaggedPreprocess(first)),
        (model, "encode", RaggedEncode, lambda: RaggedEncode(model)),
        *((p, "forward", RaggedPooling, lambda p=p: RaggedPooling(p)) for p in plan.poolings),
    ]
    done = []
    try:  # plain attribute settings: nothing here is expected to fail, but leave nothing half done
        for module in dict.fromkeys(m for m, *_ in wanted):
            patches = {name: make() for m, name, cls, make in wanted if m is module and _own(m, name, cls) is None}
            done.append((module, set_patches(module, patches)))
    except BaseException:
        for module, names in done:
            for name in names:
                module.__dict__.pop(name, None)
        hf_forward.unpatch(patched)
        if plan.decoder:
            restore_attention(auto, attention)
        raise
    return model
