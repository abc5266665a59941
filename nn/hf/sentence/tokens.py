"""Texts to flat id arrays through a fast tokenizer, for the encode pipeline
(:mod:`ragged.nn.hf.sentence.pipeline`).

sentence-transformers' ``preprocess`` calls the HuggingFace tokenizer, which runs the Rust
tokenizer over the batch (on every core, the interpreter released) and then converts each
text's encoding to a dict of Python lists, and the batch to a ``BatchEncoding``: about 7 us of
Python per text, more than the Rust part on a many-core host, and all of it under the
interpreter's lock, where it competes with the thread driving the GPU. The pipeline wants one
flat ``int64`` array of ids and the lengths. :func:`flat_ids` gives it that: while it is
active, the module's tokenizer call for plain texts without padding (the call the pipeline
makes) sets the tokenizer's truncation and special-token state the way the tokenizer's own
call does (its own methods), encodes with the Rust tokenizer, and reads only the ids (and the
token types where the tokenizer returns them) into arrays. A list of strings for a model that
takes no media is text without sentence-transformers' per-string search for a media URL or
file name (which ends in text for such a model anyway). Everything else stays
sentence-transformers' own: prompts, the text modality's handling, the truncation length.
Any other call (a padded one, pairs, a slow tokenizer, extra tokenizer arguments, no
truncation) goes to sentence-transformers unchanged.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from collections.abc import Iterator

import numpy as np
from torch import nn

__all__ = ["Flat", "flat_ids"]

# the tokenizer arguments of the pipeline's call (batch.UNPADDED over sentence-transformers'
# text defaults); any other argument sends the call to sentence-transformers
_PLAIN = {"padding": False, "return_tensors": None, "return_attention_mask": False}
_TAKEN = {*_PLAIN, "truncation", "max_length"}
_MEDIA = {"image", "video", "audio"}
# the methods between a tokenizer's __call__ and its Rust tokenizer
_CALL_PATH = (
    "__call__",
    "_call_one",
    "encode_plus",
    "batch_encode_plus",
    "_encode_plus",
    "_batch_encode_plus",
    "_convert_encoding",
    "set_truncation_and_padding",
    "_get_padding_truncation_strategies",
    "prepare_for_tokenization",
    "tokenize",
    "_tokenize",
)


class Flat:
    """The ids of a batch of texts: ``lengths [n]``, ``ids [sum(lengths)]`` and ``types`` (the
    token types, or None where the tokenizer returns none), int64 arrays."""

    __slots__ = ("lengths", "ids", "types")

    def __init__(self, lengths: np.ndarray, ids: np.ndarray, types: np.ndarray | None) -> None:
        self.lengths, self.ids, self.types = lengths, ids, types

    def __len__(self) -> int:
        return int(self.lengths.size)


def _fast(tokenizer) -> bool:
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - sentence-transformers needs transformers
        return False
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or not all(
        callable(getattr(tokenizer, name, None))
        for name in ("_get_padding_truncation_strategies", "set_truncation_and_padding")
    ):
        return False
    # a tokenizer class that changes the call on its way to the Rust tokenizer (CodeLlama's, the
    # layout models', ...) keeps its own call
    cls = type(tokenizer)
    return all(
        getattr(cls, name, None) is getattr(PreTrainedTokenizerFast, name)
        for name in _CALL_PATH
        if hasattr(PreTrainedTokenizerFast, name)
    )


def _flatten(rows: list, total: int) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total)


def encode(tokenizer, texts: list[str], truncation, max_length) -> Flat | None:
    """``texts`` tokenized as ``tokenizer(texts, padding=False, truncation=truncation,
    max_length=max_length)`` tokenizes them, as a :class:`Flat`; None where that call would
    not truncate (it then warns about long texts: the caller makes the call itself)."""
    from transformers.tokenization_utils_base import TruncationStrategy

    padding, truncating, max_length, _ = tokenizer._get_padding_truncation_strategies(
        padding=False, truncation=truncation, max_length=max_length
    )
    if truncating == TruncationStrategy.DO_NOT_TRUNCATE:
        return None
    tokenizer.set_truncation_and_padding(
        padding_strategy=padding,
        truncation_strategy=truncating,
        max_length=max_length,
        stride=0,
        pad_to_multiple_of=None,
        padding_side=None,
    )
    backend = tokenizer._tokenizer
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    if backend.encode_special_tokens != split:
        backend.encode_special_tokens = split
    run = getattr(backend, "encode_batch_fast", None)  # the same ids, no character offsets
    encodings = (
        run(texts, add_special_tokens=True)
        if run is not None
        else backend.encode_batch(texts, add_special_tokens=True, is_pretokenized=False)
    )
    rows = [e.ids for e in encodings]
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    total = int(lengths.sum())
    types = None
    if "token_type_ids" in tokenizer.model_input_names:
        types = _flatten([e.type_ids for e in encodings], total)
    return Flat(lengths, _flatten(rows, total), types)


@contextlib.contextmanager
def flat_ids(module: nn.Module) -> Iterator[None]:
    """While inside, ``module``'s (a sentence-transformers Transformer) tokenizer call for a
    list of plain texts without padding or tensors returns ``{"input_ids": Flat}``. The caller
    holds the lock its preprocess calls are made under (the tokenizer's state is shared)."""
    tokenizer = getattr(module, "processor", None)
    original = getattr(module, "_call_single_modality_processor", None)
    if not _fast(tokenizer) or original is None or "_call_single_modality_processor" in module.__dict__:
        yield
        return

    def call(modality, processor_inputs, modality_kwargs, common_kwargs):
        kwargs = {**modality_kwargs.get("text", {}), **common_kwargs}
        texts = processor_inputs.get("text")
        if (
            modality == "text"
            and module.processor is tokenizer
            and set(processor_inputs) == {"text"}
            and set(kwargs) <= _TAKEN
            and all(k in kwargs and kwargs[k] is v for k, v in _PLAIN.items())
            and isinstance(texts, list)
            and all(type(t) is str for t in texts)
        ):
            flat = encode(tokenizer, texts, kwargs.get("truncation"), kwargs.get("max_length"))
            if flat is not None:
                return {"input_ids": flat}
        return original(modality, processor_inputs, modality_kwargs, common_kwargs)

    formatter = getattr(module, "input_formatter", None)
    parse = getattr(formatter, "parse_inputs", None)
    supported = getattr(formatter, "supported_modalities", None)
    text_only = (
        parse is not None
        and "parse_inputs" not in vars(formatter)
        and supported is not None
        and not _MEDIA & set(supported)
    )

    def parse_inputs(inputs):
        # sentence-transformers reads each string for a media URL or file name first (several us a
        # text), then calls it text anyway when the model takes no media: a list of strings for
        # such a model is text, without the reading
        if isinstance(inputs, list) and inputs and all(type(t) is str for t in inputs):
            return "text", {"text": list(inputs)}, collections.defaultdict(dict)
        return parse(inputs)

    module.__dict__["_call_single_modality_processor"] = call
    if text_only:
        formatter.__dict__["parse_inputs"] = parse_inputs
    try:
        yield
    finally:
        module.__dict__.pop("_call_single_modality_processor", None)
        if text_only:
            formatter.__dict__.pop("parse_inputs", None)
