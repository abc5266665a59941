"""A batch of texts packed on the host for the converted sentence-transformers models
(:mod:`ragged.nn.hf.sentence`): :class:`PackedInput` (the token ids as a RaggedTensor, where they
sat in the padded batch), packing a padded batch (:func:`pack_input`) or the tokenizer's
per-sequence lists (:func:`from_lists`), and when tokenizing without padding gives the padded
batch's tokens and positions (:func:`unpadded_side`)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch
from torch import nn

from ragged import RaggedTensor
from ragged.padding import PaddedLayout

from ..batch import read_batch

__all__ = ["INPUT_KEY", "UNPADDED", "PackedInput", "from_lists", "host_padded", "pack_input", "unpadded_side"]

INPUT_KEY = "ragged_input"  # the host-packed batch from preprocess, consumed by the Transformer's forward


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
        return isinstance(input_ids, torch.Tensor) and tuple(input_ids.shape) == (
            self.ids.batch_size,
            self.layout.width,
        )

    def to(self, device: torch.device) -> PackedInput:
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


def pack_input(fn: str, from_ids: bool, input_ids, attention_mask, token_type_ids, position_ids) -> PackedInput:
    """Pack padded ``input_ids [B, M]`` with their ``attention_mask`` (one read of the mask:
    free on the host, one device-to-host read on a GPU). Positions follow HuggingFace: the
    columns of the padded batch for BERT, ELECTRA and DistilBERT (a left-padded row starts
    past 0), counted from the ids for RoBERTa-style models (the converted model does that)."""
    batch = read_batch(fn, "input_ids", input_ids, attention_mask, 0)
    types = batch.pack(fn, "token_type_ids", token_type_ids, 0, broadcast=True)
    positions = batch.pack(fn, "position_ids", position_ids, 0, broadcast=True)
    if positions is None and batch.layout.side != "right" and not from_ids:
        positions = batch.columns()
    return PackedInput(batch.rt, types, positions, batch.layout)


UNPADDED = {"padding": False, "return_tensors": None, "return_attention_mask": False}


def unpadded_side(module: nn.Module, kwargs: dict) -> str | None:
    """The padding side of the batch when tokenizing without padding gives the padded batch's
    tokens and positions (their columns follow from the lengths and the side); None when it may
    not: a tokenizer that is not the processor, text rendered as chat messages, query expansion
    (it rewrites the padded tensors), padding settings in the processing kwargs (a padding side;
    for left padding a width other than the longest text's too)."""
    side = getattr(module.tokenizer, "padding_side", "right")
    if (
        getattr(module, "query_expansion", None) is not None
        or side not in ("right", "left")
        or module.processor is not module.tokenizer
        or "message" in module.modality_config
    ):
        return None
    if side == "left" and getattr(module.tokenizer, "pad_to_multiple_of", None) is not None:
        return None
    keys = {"padding_side"} if side == "right" else {"padding_side", "padding", "pad_to_multiple_of"}
    for pk in (module.processing_kwargs, kwargs.get("processing_kwargs")):
        if pk is not None and (
            not isinstance(pk, dict) or any(isinstance(v, dict) and keys & set(v) for v in pk.values())
        ):
            return None
    return side


def from_lists(ids: list, types: list | None, side: str, columns: bool) -> PackedInput:
    """A PackedInput from the tokenizer's per-sequence lists (host tensors) laid out as the
    tokenizer pads on ``side``; ``columns``: positions are the padded batch's columns (given
    where they are not each sequence's from 0: left padding)."""
    lengths = [len(row) for row in ids]
    total = sum(lengths)

    def flat(rows):
        return torch.from_numpy(np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total))

    rt = RaggedTensor.from_lengths(flat(ids), lengths)
    if types is not None and [len(row) for row in types] != lengths:
        types = None
    positions = None
    if side == "left" and columns and total:
        n = np.asarray(lengths, dtype=np.int64)
        starts = np.repeat(np.cumsum(n) - n, n)  # each token's sequence start, then its column
        positions = torch.from_numpy(np.arange(total, dtype=np.int64) - starts + np.repeat(rt.max_len - n, n))
    return PackedInput(rt, None if types is None else flat(types), positions, PaddedLayout(rt.max_len, side))


def host_padded(features) -> bool:
    """Whether ``features`` holds a padded batch on the host that can be packed there."""
    ids = features.get("input_ids")
    tensors = [features.get(k) for k in ("input_ids", "attention_mask", "token_type_ids", "position_ids")]
    return (
        isinstance(ids, torch.Tensor)
        and ids.dim() == 2
        and all(t is None or (isinstance(t, torch.Tensor) and t.device.type == "cpu") for t in tensors)
    )
