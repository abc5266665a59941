"""``collate``: tokenized features to RaggedTensors with no padding step, and the
:class:`RaggedBatch` it returns (one transfer to the GPU per batch). Re-exported by
:mod:`ragged.data`; this module is not imported by ``import ragged``."""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from .tensor import RaggedTensor, exact_ragged
from .utils import describe, offsets_dtype_for, to_device

__all__ = ["RaggedBatch", "collate"]

_COLLATE = "ragged.data.collate"


class RaggedBatch(dict):
    """:func:`collate`'s output: a dict (key -> RaggedTensor, tensor or list) that
    ``DataLoader(pin_memory=True)`` pins (it calls ``pin_memory()``; a bare RaggedTensor it
    would pass through unpinned) and that moves to a device in one call. Per-token fields
    share one offsets tensor, and still do after either."""

    def pin_memory(self) -> RaggedBatch:
        """A copy with every tensor in page-locked memory (needs a CUDA build of torch)."""
        return self._map(lambda t: t.pin_memory())

    def to(self, device, non_blocking: bool = False) -> RaggedBatch:
        """A copy with every tensor on ``device``. From the CPU to a GPU the batch's tensors
        travel as one copy (staged in one host buffer, page-locked when ``non_blocking``, so
        that the copy does not wait whether or not the batch was pinned) instead of one copy
        per tensor: a batch costs one transfer's host time."""
        device = torch.device(device)
        tensors = self._tensors()
        if (
            device.type == "cuda"
            and len(tensors) > 1
            and all(t.device.type == "cpu" and not t.requires_grad for t in tensors)
        ):
            moved = _one_copy(tensors, device, non_blocking)
            return self._map(lambda t: moved[id(t)])
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def _tensors(self) -> list[torch.Tensor]:
        """Every distinct tensor of the batch (a shared offsets tensor once)."""
        seen: dict[int, torch.Tensor] = {}
        for value in self.values():
            parts = (value.values, value.offsets) if isinstance(value, RaggedTensor) else (value,)
            for t in parts:
                if isinstance(t, torch.Tensor):
                    seen.setdefault(id(t), t)
        return list(seen.values())

    def _map(self, move) -> RaggedBatch:
        moved: dict[int, torch.Tensor] = {}

        def once(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in moved:
                moved[id(t)] = move(t)
            return moved[id(t)]

        out = RaggedBatch()
        for key, value in self.items():
            if isinstance(value, RaggedTensor):
                value = value._derived(once(value.values), once(value.offsets))
            out[key] = once(value) if isinstance(value, torch.Tensor) else value
        return out


_ALIGN = 16  # bytes: every tensor's place in the staging buffer can be viewed as any dtype


def _one_copy(tensors: list[torch.Tensor], device: torch.device, non_blocking: bool) -> dict[int, torch.Tensor]:
    """``{id(t): t on device}``: the CPU tensors packed byte-wise into one host buffer (from
    torch's caching pinned allocator when ``non_blocking``), copied once, and viewed back."""
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    starts, total = [], 0
    for f in flat:
        starts.append(total)
        total += -(-f.numel() // _ALIGN) * _ALIGN
    host = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=non_blocking)
    for f, start in zip(flat, starts):
        host[start : start + f.numel()].copy_(f)
    dev = host.to(device, non_blocking=non_blocking)
    return {
        id(t): dev[start : start + f.numel()].view(t.dtype).view(t.shape) for t, f, start in zip(tensors, flat, starts)
    }


def collate(features, *, per_sequence: Iterable[str] = ()) -> RaggedBatch:
    """A batch of tokenized sequences as RaggedTensors, with no padding step.

    ``features``: a list of B mappings as a tokenizer or ``datasets`` gives them (each value a
    list of numbers, a 1-D numpy array or tensor, or a scalar), or one mapping of B-long
    columns (a ``BatchEncoding`` of lists, or of padded ``[B, M]`` tensors with their
    ``attention_mask``). Returns a :class:`RaggedBatch` with the keys as given:

    * per-token fields (``input_ids``, ``token_type_ids``, token ``labels``, ...): one
      :class:`ragged.RaggedTensor` each, ``values [T, ...]`` from one concatenation and
      ``offsets [B+1]`` int32 (int64 past 2**31 - 1 tokens) shared by all of them. Each must
      have as many tokens per sequence as ``input_ids`` (else ``ValueError`` naming the key
      and the sequence);
    * per-sequence scalars (a class label) and the keys named in ``per_sequence`` (e.g.
      multi-label targets, a list per sequence): a tensor ``[B, ...]``; anything else
      (strings, None): a list of B values.

    ``attention_mask`` is consumed: the RaggedTensors carry the lengths. Where it holds zeros
    (padded features), only the positions where it is 1 are kept in every per-token field,
    wherever they are (right or left padding). It must hold only 0 and 1.

    Dtypes: Python ints become int64, Python floats the default float dtype, bools bool, as
    ``torch.tensor`` makes them; tensors and arrays keep their dtype, except integer ones,
    which become int64 (what embeddings and ``cross_entropy`` take). Outputs are on the
    inputs' device (CPU from a dataset). Sequences that are all empty give int64 values.
    """
    try:
        stacked = frozenset((per_sequence,) if isinstance(per_sequence, str) else per_sequence)
    except TypeError:
        raise TypeError(
            f"{_COLLATE}(): expected per_sequence as an iterable of keys, got {describe(per_sequence)}"
        ) from None
    columns, batch = _columns(features)
    kinds = {key: "scalar" if key in stacked else _kind(column) for key, column in columns.items()}
    tokens = {key: _concat(key, columns[key], batch) for key, kind in kinds.items() if kind == "token"}
    ragged = _ragged(tokens, batch)
    out = RaggedBatch()
    for key, kind in kinds.items():
        if kind == "scalar":
            out[key] = _stack(key, columns[key], batch)
        elif kind == "other":
            out[key] = list(columns[key])
        elif key in ragged:
            out[key] = ragged[key]
    return out


def _ragged(tokens: dict, batch: int) -> dict:
    """key -> RaggedTensor from key -> (values [T, ...], lengths [B]); the mask applied and dropped."""
    if not tokens:
        return {}
    ref = "input_ids" if "input_ids" in tokens else next(iter(tokens))
    lengths = tokens[ref][1]
    for key, (_, lens) in tokens.items():
        if not np.array_equal(lens, lengths):
            i = int(np.argmax(lens != lengths))
            raise ValueError(
                f"{_COLLATE}(): expected {key!r} of sequence {i} to have as many tokens as {ref!r} "
                f"({int(lengths[i])}), got {int(lens[i])}"
            )
    values = {key: v for key, (v, _) in tokens.items()}
    mask = values.pop("attention_mask", None)
    keep = None if mask is None else _mask_keep(mask)
    if keep is not None:
        cum = np.zeros(keep.numel() + 1, dtype=np.int64)
        np.cumsum(keep.cpu().numpy(), out=cum[1:])
        ends = np.cumsum(lengths)
        lengths = cum[ends] - cum[ends - lengths]
        values = {key: v[keep.to(v.device)] for key, v in values.items()}
    offsets = np.zeros(batch + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    host = tuple(offsets.tolist())
    longest = int(lengths.max()) if batch else 0
    dtype = offsets_dtype_for(host[-1])
    on: dict[torch.device, torch.Tensor] = {}
    for v in values.values():
        if v.device not in on:
            on[v.device] = (
                torch.from_numpy(offsets).to(dtype) if v.device.type == "cpu" else to_device(host, dtype, v.device)
            )
    return {key: exact_ragged(v, on[v.device], host, longest) for key, v in values.items()}


def _mask_keep(mask: torch.Tensor) -> torch.Tensor | None:
    """The positions to keep (bool ``[T]``), or None when the mask is all ones."""
    if mask.dtype.is_complex or mask.dim() != 1 or not bool(((mask == 0) | (mask == 1)).all()):
        bad = torch.unique(mask).tolist()[:8] if mask.dim() == 1 and not mask.dtype.is_complex else describe(mask)
        raise ValueError(f"{_COLLATE}(): expected 'attention_mask' to hold one 0 or 1 per token, got {bad}")
    keep = mask.bool()
    return None if bool(keep.all()) else keep


def _columns(features) -> tuple[dict, int]:
    """key -> column of B values (a list, or an array/tensor with B leading), and B."""
    if isinstance(features, Mapping):
        batch = None
        for key, column in features.items():
            if not isinstance(column, (list, tuple)) and not (
                isinstance(column, (torch.Tensor, np.ndarray)) and column.ndim >= 1
            ):
                raise TypeError(
                    f"{_COLLATE}(): expected column {key!r} as a list, tuple, array or tensor with "
                    f"one entry per sequence, got {describe(column)}"
                )
            if batch is not None and len(column) != batch:
                raise ValueError(
                    f"{_COLLATE}(): expected every column to hold {batch} sequences, got {len(column)} in {key!r}"
                )
            batch = len(column)
        return dict(features), batch or 0
    if not isinstance(features, (list, tuple)):
        raise TypeError(
            f"{_COLLATE}(): expected a list of mappings (one per sequence) or a mapping of "
            f"columns, got {describe(features)}"
        )
    keys = features[0].keys() if features and isinstance(features[0], Mapping) else {}.keys()
    for i, f in enumerate(features):
        if type(f) is not dict and not isinstance(f, Mapping):
            raise TypeError(f"{_COLLATE}(): expected features[{i}] to be a mapping, got {describe(f)}")
        if f.keys() != keys:
            raise ValueError(
                f"{_COLLATE}(): expected every sequence to have the keys of sequence 0 {list(keys)}, "
                f"got sequence {i} with {list(f.keys())}"
            )
    return {key: [f[key] for f in features] for key in keys}, len(features)


def _kind(column) -> str:
    """``"token"`` (a sequence per item), ``"scalar"`` (a number per item) or ``"other"``."""
    if isinstance(column, (torch.Tensor, np.ndarray)) and column.dtype != object:
        return "token" if column.ndim >= 2 else "scalar"
    first = column[0] if len(column) else []
    if isinstance(first, (torch.Tensor, np.ndarray)):
        return "token" if first.ndim >= 1 else "scalar"
    if isinstance(first, (list, tuple)):
        return "token"
    return "scalar" if isinstance(first, (numbers.Number, np.generic)) else "other"


def _int64(t: torch.Tensor) -> torch.Tensor:
    """Integer tensors as int64; others as they are."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype in (torch.bool, torch.int64):
        return t
    return t.to(torch.int64)


def _numeric(key: str, arr: np.ndarray, python: bool) -> torch.Tensor:
    """A numpy array of numbers as a tensor (from Python floats: the default float dtype)."""
    if arr.dtype.kind not in "biufc":
        raise ValueError(f"{_COLLATE}(): expected numbers in {key!r}, got values of dtype {arr.dtype}")
    t = torch.from_numpy(np.ascontiguousarray(arr) if arr.flags.writeable else arr.copy())
    return _int64(t.to(torch.get_default_dtype()) if python and t.dtype == torch.float64 else t)


def _stack(key: str, column, batch: int) -> torch.Tensor:
    """``[B, ...]`` from per-sequence values."""
    try:
        if isinstance(column, (torch.Tensor, np.ndarray)):
            return _int64(column) if isinstance(column, torch.Tensor) else _numeric(key, column, False)
        if batch and all(isinstance(x, torch.Tensor) for x in column):
            return _int64(torch.stack(list(column)))
        python = not any(isinstance(x, (np.ndarray, np.generic)) for x in column)
        return _numeric(key, np.array(column) if batch else np.zeros(0, dtype=np.int64), python)
    except (RuntimeError, ValueError, TypeError) as err:
        raise ValueError(
            f"{_COLLATE}(): expected the per-sequence values of {key!r} to stack into one tensor: {err}"
        ) from None


def _concat(key: str, column, batch: int) -> tuple[torch.Tensor | None, np.ndarray]:
    """Per-token values ``[T, ...]`` from one concatenation (None for a list mask of all ones), and
    the lengths ``[B]`` int64."""
    if isinstance(column, (torch.Tensor, np.ndarray)):  # padded [B, M, ...]
        t = _int64(column) if isinstance(column, torch.Tensor) else _numeric(key, column, False)
        return t.reshape(batch * t.shape[1], *t.shape[2:]), np.full(batch, t.shape[1], dtype=np.int64)
    try:
        lengths = np.fromiter(map(len, column), dtype=np.int64, count=batch)
    except TypeError:  # no len(): a scalar, a 0-d array or tensor
        bad = next(i for i, x in enumerate(column) if not hasattr(x, "__len__") or np.ndim(x) == 0)
        raise ValueError(
            f"{_COLLATE}(): expected {key!r} of sequence {bad} to hold one value per token, got {describe(column[bad])}"
        ) from None
    try:
        if all(type(x) is list or type(x) is tuple for x in column):
            rows = [x for x in column if x]
            if key == "attention_mask" and sum(map(sum, rows)) == lengths.sum() and max(map(max, rows), default=0) <= 1:
                return None, lengths  # all ones (each <= 1, summing to T), read in C: 4x faster than converting
            return _from_lists(key, column, int(lengths.sum())), lengths
        if all(isinstance(x, torch.Tensor) for x in column):
            return _int64(torch.cat(list(column))), lengths
        if all(isinstance(x, np.ndarray) for x in column):
            return _numeric(key, np.concatenate(column), False), lengths
        return _int64(
            torch.cat([x if isinstance(x, torch.Tensor) else _numeric(key, np.asarray(x), True) for x in column])
        ), lengths
    except (RuntimeError, ValueError, TypeError) as err:
        if str(err).startswith(_COLLATE):
            raise
        raise ValueError(
            f"{_COLLATE}(): expected the per-token values of {key!r} to concatenate into one tensor: {err}"
        ) from None


def _from_lists(key: str, column, total: int) -> torch.Tensor:
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    first = next(x for x in column if len(x))[0]
    if isinstance(first, (int, float, np.integer, np.floating)) and not isinstance(first, (bool, np.bool_)):
        # Through float64: about 7x faster than torch.tensor on 6.6k Python ints; exact below
        # 2**53, which is checked, and a column that starts with an int and is integral is int64.
        try:
            f = np.fromiter(itertools.chain.from_iterable(column), dtype=np.float64, count=total)
        except (TypeError, ValueError):  # nested or non-numeric values: np.array below says which
            f = None
        if f is not None and isinstance(first, (float, np.floating)):
            return torch.from_numpy(f).to(torch.get_default_dtype())
        if f is not None and np.abs(f).max() < 2**53:
            i = f.astype(np.int64)
            if np.array_equal(i, f):
                return torch.from_numpy(i)
    return _numeric(key, np.array(list(itertools.chain.from_iterable(column))), True)
