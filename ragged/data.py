"""Feeding ragged models from a ``torch.utils.data.DataLoader``: batches by token budget, collated
without padding.

.. code-block:: python

    from ragged.data import TokenBudgetSampler, collate
    sampler = TokenBudgetSampler(lengths, max_tokens=16384, shuffle=True, seed=0)
    loader = DataLoader(tokenized, batch_sampler=sampler, collate_fn=collate)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader:            # a RaggedBatch: key -> RaggedTensor / tensor [B] / list
            loss = model(**batch.to("cuda", non_blocking=True)).loss

:class:`TokenBudgetSampler` yields lists of dataset indices whose token counts stay within a
budget, spread over data-parallel replicas so that every replica takes the same number of steps
and each step's batches carry similar loads. :func:`collate` concatenates the tokenizer's
per-token fields into :class:`ragged.RaggedTensor` s (no padding step) and stacks per-sequence
fields. Both run on the host with numpy; this module is not imported by ``import ragged``.

Coordinates: a **sequence index** ``i`` names a dataset item; a **batch** is a list of sequence
indices; a **step** is one batch per replica (``num_replicas`` batches run at the same time).
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

from .tensor import RaggedTensor, exact_ragged
from .utils import check_int, describe, offsets_dtype_for, to_device

__all__ = ["RaggedBatch", "StepBalance", "TokenBudgetSampler", "collate"]

_SAMPLER = "ragged.data.TokenBudgetSampler"
_COLLATE = "ragged.data.collate"


# --------------------------------------------------------------------------------------
# The sampler


@dataclass(frozen=True)
class StepBalance:
    """How evenly an epoch's steps load the replicas (:meth:`TokenBudgetSampler.balance`).

    ``loads``: ``[steps, num_replicas]`` load of each batch (tokens, or the cost asked for);
    ``ratio``: ``[steps]`` max over mean load of each step (1.0 for an empty step);
    ``worst`` / ``mean``: the largest and the average ratio; ``efficiency``: the share of the
    replicas' time spent working if a step lasts as long as its heaviest batch,
    ``loads.sum() / (num_replicas * loads.max(1).sum())`` (1.0 is perfect balance).
    """

    loads: np.ndarray
    ratio: np.ndarray
    worst: float
    mean: float
    efficiency: float


@dataclass(frozen=True)
class _Plan:
    order: np.ndarray      # [n] sequence indices in packing order
    starts: np.ndarray     # [batches + 1] batch b is order[starts[b]:starts[b + 1]]
    steps: np.ndarray      # [steps, num_replicas] batch ids (a repeated batch appears twice)
    repeated: int          # batch slots filled by a repeat
    dropped: int           # sequences left out (drop_last)


class TokenBudgetSampler(Sampler):
    """A batch sampler: each iteration yields a list of dataset indices (one batch).

    * Budget: a batch's token count (the sum of its lengths) is at most ``max_tokens``, and it
      holds at most ``max_batch_size`` sequences when given. A sequence longer than
      ``max_tokens`` forms a batch alone. Sequences of length 0 count 0 tokens and are yielded
      like any other.
    * Packing: the epoch's order (a permutation from ``seed`` and the epoch when ``shuffle``,
      else dataset order) is cut greedily: a batch ends where the next sequence would break
      the budget. With ``sort_window=W`` the order is first sorted by length within
      consecutive windows of ``W`` sequences: batches are then length-homogeneous (fuller, and
      with even attention costs), while which sequences share a window stays random.
    * Replicas: every replica derives the same plan from ``seed`` and the epoch and takes its
      share, ``len(sampler)`` batches each. The batches are sorted by cost and dealt in
      groups of ``num_replicas`` consecutive ones, one group per step, so a step's batches
      carry similar loads (``cost="tokens"``: token counts; ``"attention"``: sums of
      ``L_i ** 2``; a callable: per-sequence costs from the lengths array). With ``shuffle``
      the steps come in random order, and the batches of a step go to random replicas;
      without it, steps follow the packing order.
    * Equal counts without ``drop_last``: while the batch count is not a multiple of
      ``num_replicas``, the costliest batches of two or more sequences are split in two (at
      the middle of their cost), so every index is yielded exactly once over all replicas.
      Only where that cannot be done (every batch holds one sequence, e.g. fewer sequences
      than replicas) are the cheapest batches repeated to fill the last step: every index is
      then yielded at least once, and :attr:`num_repeated` counts the repeated batches.
    * ``drop_last``: the last batch of the packing is left out when under budget (fewer than
      ``max_tokens`` tokens and ``max_batch_size`` sequences), then the cheapest batches until
      the count is a multiple of ``num_replicas`` (:attr:`num_dropped` counts the sequences
      left out); every other index is yielded exactly once.

    Call :meth:`set_epoch` before each epoch (as with ``DistributedSampler``): the plan is a
    function of ``seed`` and the epoch only, so an epoch repeats exactly (given the same lengths,
    options and numpy version on every replica). ``num_replicas`` and ``rank`` default to
    ``torch.distributed``'s world size and rank when it is initialized, else 1 and 0.
    """

    def __init__(self, lengths, max_tokens: int, *, shuffle: bool = True, seed: int = 0,
                 num_replicas: int | None = None, rank: int | None = None, drop_last: bool = False,
                 max_batch_size: int | None = None, sort_window: int | None = None,
                 cost: str | Callable[[np.ndarray], np.ndarray] = "tokens"):
        self.lengths = _as_lengths(lengths)
        self.max_tokens = check_int(_SAMPLER, "max_tokens", max_tokens, minimum=1)
        self.shuffle = _check_bool("shuffle", shuffle)
        self.drop_last = _check_bool("drop_last", drop_last)
        self.seed = check_int(_SAMPLER, "seed", seed, minimum=0)
        self.max_batch_size, self.sort_window = (
            None if v is None else check_int(_SAMPLER, name, v, minimum=1)
            for name, v in (("max_batch_size", max_batch_size), ("sort_window", sort_window)))
        self.num_replicas, self.rank = _replicas(num_replicas, rank)
        self.cost = cost
        self._costs = _sequence_costs(cost, self.lengths)
        self.epoch = 0
        self._plan: _Plan | None = None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose plan the next iteration follows."""
        epoch = check_int(f"{_SAMPLER}.set_epoch", "epoch", epoch, minimum=0)
        if epoch != self.epoch:
            self.epoch, self._plan = epoch, None

    def __len__(self) -> int:
        """Batches per replica in the current epoch (the same on every replica)."""
        return self._current().steps.shape[0]

    def __iter__(self) -> Iterator[list[int]]:
        plan = self._current()
        order, starts = plan.order, plan.starts
        for b in plan.steps[:, self.rank].tolist():
            yield order[starts[b]:starts[b + 1]].tolist()

    @property
    def num_repeated(self) -> int:
        """Batch slots of the current epoch filled by repeating a batch (0 unless unavoidable)."""
        return self._current().repeated

    @property
    def num_dropped(self) -> int:
        """Sequences the current epoch leaves out (only with ``drop_last``)."""
        return self._current().dropped

    def step_loads(self, cost: str | Callable | None = None) -> np.ndarray:
        """``[steps, num_replicas]`` load of every replica's batch at every step of the current
        epoch, in ``cost`` (default: the sampler's own; int64 for ``"tokens"``, else float64)."""
        plan = self._current()
        costs = self._costs if cost is None else _sequence_costs(cost, self.lengths)
        cum = np.concatenate((np.zeros(1, dtype=costs.dtype), np.cumsum(costs[plan.order])))
        return (cum[plan.starts[1:]] - cum[plan.starts[:-1]])[plan.steps]

    def balance(self, cost: str | Callable | None = None) -> StepBalance:
        """Per-step max/mean load over the replicas of the current epoch (see :class:`StepBalance`)."""
        loads = self.step_loads(cost)
        top, mean = loads.max(1, initial=0).astype(np.float64), loads.mean(1)
        ratio = np.divide(top, mean, out=np.ones_like(top), where=mean > 0)
        busy = float(top.sum()) * self.num_replicas
        return StepBalance(loads, ratio, float(ratio.max(initial=1.0)), float(ratio.mean()) if ratio.size else 1.0,
                           float(loads.sum()) / busy if busy > 0 else 1.0)

    def _current(self) -> _Plan:
        if self._plan is None:
            self._plan = _make_plan(self.lengths, self._costs, self.max_tokens, self.max_batch_size,
                                    self.sort_window, self.shuffle, self.drop_last, self.num_replicas,
                                    self.seed, self.epoch)
        return self._plan

    def __repr__(self) -> str:
        return f"TokenBudgetSampler(sequences={self.lengths.size}, max_tokens={self.max_tokens}, epoch={self.epoch})"


def _check_bool(name: str, value: object) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{_SAMPLER}(): expected {name} to be a bool, got {describe(value)}")


def _as_lengths(lengths: object) -> np.ndarray:
    """``lengths`` (list, tuple, numpy array, tensor) as a 1-D int64 numpy array of values >= 0."""
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
            raise TypeError(f"{_SAMPLER}(): expected integer lengths, got a {lengths.dtype} tensor")
        if lengths.device.type == "meta":
            raise ValueError(f"{_SAMPLER}(): expected lengths with values, got a tensor on the meta device")
        arr = lengths.detach().to("cpu", torch.int64).numpy()
    elif isinstance(lengths, (str, bytes, Mapping)) or not hasattr(lengths, "__len__"):
        raise TypeError(f"{_SAMPLER}(): expected lengths as a list of ints, a numpy array or a tensor, "
                        f"got {describe(lengths)}")
    else:
        arr = np.asarray(lengths)
        if arr.size == 0 and arr.dtype == np.float64 and not isinstance(lengths, np.ndarray):
            arr = arr.astype(np.int64)              # [] reads as float64
    if arr.ndim != 1:
        raise ValueError(f"{_SAMPLER}(): expected 1-D lengths, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{_SAMPLER}(): expected integer lengths, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > 2**62):
        i = int(np.argmax((arr < 0) | (arr > 2**62)))
        raise ValueError(f"{_SAMPLER}(): expected lengths in [0, 2**62], got lengths[{i}] = {int(arr[i])}")
    return arr.astype(np.int64, copy=True)


def _replicas(num_replicas, rank) -> tuple[int, int]:
    dist = torch.distributed
    initialized = dist.is_available() and dist.is_initialized()
    num_replicas = check_int(_SAMPLER, "num_replicas", num_replicas if num_replicas is not None else
                             dist.get_world_size() if initialized else 1, minimum=1)
    rank = check_int(_SAMPLER, "rank", rank if rank is not None else dist.get_rank() if initialized else 0,
                     minimum=0)
    if rank >= num_replicas:
        raise ValueError(f"{_SAMPLER}(): expected rank in [0, num_replicas) = [0, {num_replicas}), got {rank}")
    return num_replicas, rank


def _sequence_costs(cost, lengths: np.ndarray) -> np.ndarray:
    """Per-sequence cost: int64 tokens, float64 ``L ** 2`` or a callable's float64 costs."""
    if isinstance(cost, str) and cost in ("tokens", "attention"):
        return lengths if cost == "tokens" else lengths.astype(np.float64) ** 2
    if not callable(cost):
        raise (ValueError if isinstance(cost, str) else TypeError)(
            f"{_SAMPLER}(): expected cost 'tokens', 'attention' or a callable, got {describe(cost)}")
    out = np.asarray(cost(lengths.copy()), dtype=np.float64)
    if out.shape != lengths.shape:
        raise ValueError(f"{_SAMPLER}(): expected cost(lengths) of shape {lengths.shape}, got {out.shape}")
    if out.size and not (np.isfinite(out).all() and out.min() >= 0):
        raise ValueError(f"{_SAMPLER}(): expected cost(lengths) finite and >= 0, got min {out.min()}, "
                         f"max {out.max()}")
    return out


def _make_plan(lengths, costs, max_tokens, max_batch_size, sort_window, shuffle, drop_last, replicas,
               seed, epoch) -> _Plan:
    n = lengths.size
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(n) if shuffle else np.arange(n, dtype=np.int64)
    if sort_window is not None and sort_window > 1 and n > 1:
        order = _sort_windows(order, np.take(lengths, order), sort_window)
    tokens = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.take(lengths, order), out=tokens[1:])   # np.take: 4x faster than lengths[order]
    starts = _pack(tokens, max_tokens, max_batch_size)
    cum = tokens if costs is lengths else np.concatenate(([0.0], np.cumsum(np.take(costs, order))))
    dropped = repeated = 0
    if drop_last:
        ids, dropped = _drop(starts, tokens, cum, max_tokens, max_batch_size, replicas)
    elif replicas > 1:
        starts = _split(starts, cum, replicas)
        ids = np.arange(starts.size - 1, dtype=np.int64)
        repeated = (-ids.size) % replicas
    else:
        ids = np.arange(starts.size - 1, dtype=np.int64)
    cost = cum[starts[1:]] - cum[starts[:-1]]
    if repeated:   # every batch holds one sequence: the cheapest ones run again (class docstring)
        ids = np.concatenate((ids, np.resize(_ascending(cost), repeated)))
    # Heaviest first; stable sorts give the same plan on every machine.
    steps = ids[_ascending(cost[ids])[::-1]].reshape(-1, replicas)
    if shuffle:
        steps = rng.permuted(steps[rng.permutation(steps.shape[0])], axis=1)
    else:
        steps = steps[_ascending(steps.min(1))]
    return _Plan(order, starts, np.ascontiguousarray(steps), repeated, dropped)


def _ascending(key: np.ndarray) -> np.ndarray:
    """Stable argsort; integer keys below 2**16 by radix (10x faster than int64 on millions)."""
    if key.dtype.kind in "iu" and key.size and 0 <= key.min() and key.max() < 2**16:
        key = key.astype(np.uint16)
    return np.argsort(key, kind="stable")


def _sort_windows(order: np.ndarray, lens: np.ndarray, window: int) -> np.ndarray:
    """``order`` sorted by length (stably) within consecutive windows of ``window`` sequences."""
    n = order.size
    key = lens.astype(np.uint16) if lens.max() < 2**16 else lens   # radix sort: 15x faster at 10M
    full = n // window * window
    out = np.empty_like(order)
    if full:
        rows = np.argsort(key[:full].reshape(-1, window), axis=1, kind="stable")
        rows += np.arange(0, full, window, dtype=rows.dtype)[:, None]
        out[:full] = order[rows.reshape(-1)]
    if full < n:
        out[full:] = order[full:][_ascending(key[full:])]
    return out


def _pack(tokens: np.ndarray, max_tokens: int, max_batch_size: int | None) -> np.ndarray:
    """Greedy cut of the packing order: batch starts ``[batches + 1]`` (the last entry is n).

    ``tokens`` is the running token count (``tokens[k]``: tokens of the first k sequences).
    Each batch from ``s`` ends at the largest ``e`` with ``tokens[e] - tokens[s] <= max_tokens``
    (and ``e - s <= max_batch_size``), at least ``s + 1``.
    """
    n, starts, max_tokens = tokens.size - 1, [0], min(max_tokens, 2**62)   # no int64 overflow below
    cap = max(n, 1) if max_batch_size is None else max_batch_size
    estimate = max(int(tokens[-1]) // max_tokens, n // cap) + 1
    if estimate * 32 < n:
        # Few batches: one binary search per batch (16k batches for 10M sequences: ~30 ms).
        s = 0
        while s < n:
            e = int(np.searchsorted(tokens, tokens[s] + max_tokens, side="right")) - 1
            s = max(min(e, s + cap, n), s + 1)
            starts.append(s)
    else:
        # Many batches: every sequence's batch end at once, then one walk along the chain.
        first = np.arange(n, dtype=np.int64)
        ends = np.searchsorted(tokens, tokens[:-1] + max_tokens, side="right") - 1
        ends = np.maximum(np.minimum(ends, first + cap), first + 1).tolist()
        s = 0
        while s < n:
            s = ends[s]
            starts.append(s)
    return np.asarray(starts, dtype=np.int64)


def _split(starts: np.ndarray, cum: np.ndarray, replicas: int) -> np.ndarray:
    """Split the costliest batches of two or more sequences in two, at the middle of their cost,
    until the batch count is a multiple of ``replicas`` or no batch can be split."""
    need = (-(starts.size - 1)) % replicas
    while need:
        splittable = np.flatnonzero(np.diff(starts) >= 2)
        if splittable.size == 0:
            break
        cost = cum[starts[1:]] - cum[starts[:-1]]
        pick = splittable[np.argsort(-cost[splittable], kind="stable")[:need]]
        s, e = starts[pick], starts[pick + 1]
        mid = np.clip(np.searchsorted(cum, (cum[s] + cum[e]) / 2, side="left"), s + 1, e - 1)
        starts = np.sort(np.concatenate((starts, mid)), kind="stable")
        need -= pick.size
    return starts


def _drop(starts, tokens, cum, max_tokens, max_batch_size, replicas) -> tuple[np.ndarray, int]:
    """drop_last: the ids of the batches kept (an under-budget last batch left out, then the
    cheapest ones until the count is a multiple of ``replicas``) and the sequences left out."""
    count = starts.size - 1
    keep = np.ones(count, dtype=bool)
    if count:
        size = int(starts[-1] - starts[-2])
        under = tokens[starts[-1]] - tokens[starts[-2]] < max_tokens
        keep[-1] = not (under and (max_batch_size is None or size < max_batch_size))
    kept = np.flatnonzero(keep)
    surplus = kept.size % replicas
    if surplus:
        cost = cum[starts[kept + 1]] - cum[starts[kept]]
        keep[kept[np.argsort(cost, kind="stable")[:surplus]]] = False
    return np.flatnonzero(keep).astype(np.int64), int(np.diff(starts)[~keep].sum())


# --------------------------------------------------------------------------------------
# collate


class RaggedBatch(dict):
    """:func:`collate`'s output: a dict (key -> RaggedTensor, tensor or list) that
    ``DataLoader(pin_memory=True)`` pins (it calls ``pin_memory()``; a bare RaggedTensor it
    would pass through unpinned) and that moves to a device in one call. Per-token fields
    share one offsets tensor, and still do after either."""

    def pin_memory(self) -> "RaggedBatch":
        """A copy with every tensor in page-locked memory (needs a CUDA build of torch)."""
        return self._map(lambda t: t.pin_memory())

    def to(self, device, non_blocking: bool = False) -> "RaggedBatch":
        """A copy with every tensor on ``device`` (``non_blocking`` from pinned memory)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def _map(self, move) -> "RaggedBatch":
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
        raise TypeError(f"{_COLLATE}(): expected per_sequence as an iterable of keys, "
                        f"got {describe(per_sequence)}") from None
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
            raise ValueError(f"{_COLLATE}(): expected {key!r} of sequence {i} to have as many tokens as {ref!r} "
                             f"({int(lengths[i])}), got {int(lens[i])}")
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
            on[v.device] = (torch.from_numpy(offsets).to(dtype) if v.device.type == "cpu"
                            else to_device(host, dtype, v.device))
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
            if not isinstance(column, (list, tuple)) and not (isinstance(column, (torch.Tensor, np.ndarray))
                                                              and column.ndim >= 1):
                raise TypeError(f"{_COLLATE}(): expected column {key!r} as a list, tuple, array or tensor with "
                                f"one entry per sequence, got {describe(column)}")
            if batch is not None and len(column) != batch:
                raise ValueError(f"{_COLLATE}(): expected every column to hold {batch} sequences, "
                                 f"got {len(column)} in {key!r}")
            batch = len(column)
        return dict(features), batch or 0
    if not isinstance(features, (list, tuple)):
        raise TypeError(f"{_COLLATE}(): expected a list of mappings (one per sequence) or a mapping of "
                        f"columns, got {describe(features)}")
    keys = features[0].keys() if features and isinstance(features[0], Mapping) else {}.keys()
    for i, f in enumerate(features):
        if type(f) is not dict and not isinstance(f, Mapping):
            raise TypeError(f"{_COLLATE}(): expected features[{i}] to be a mapping, got {describe(f)}")
        if f.keys() != keys:
            raise ValueError(f"{_COLLATE}(): expected every sequence to have the keys of sequence 0 {list(keys)}, "
                             f"got sequence {i} with {list(f.keys())}")
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
        raise ValueError(f"{_COLLATE}(): expected the per-sequence values of {key!r} to stack into one "
                         f"tensor: {err}") from None


def _concat(key: str, column, batch: int) -> tuple[torch.Tensor | None, np.ndarray]:
    """Per-token values ``[T, ...]`` from one concatenation (None for a list mask of all ones), and
    the lengths ``[B]`` int64."""
    if isinstance(column, (torch.Tensor, np.ndarray)):   # padded [B, M, ...]
        t = _int64(column) if isinstance(column, torch.Tensor) else _numeric(key, column, False)
        return t.reshape(batch * t.shape[1], *t.shape[2:]), np.full(batch, t.shape[1], dtype=np.int64)
    try:
        lengths = np.fromiter(map(len, column), dtype=np.int64, count=batch)
    except TypeError:   # no len(): a scalar, a 0-d array or tensor
        bad = next(i for i, x in enumerate(column) if not hasattr(x, "__len__") or np.ndim(x) == 0)
        raise ValueError(f"{_COLLATE}(): expected {key!r} of sequence {bad} to hold one value per token, "
                         f"got {describe(column[bad])}") from None
    try:
        if all(type(x) is list or type(x) is tuple for x in column):
            rows = [x for x in column if x]
            if key == "attention_mask" and sum(map(sum, rows)) == lengths.sum() and max(map(max, rows), default=0) <= 1:
                return None, lengths   # all ones (each <= 1, summing to T), read in C: 4x faster than converting
            return _from_lists(key, column, int(lengths.sum())), lengths
        if all(isinstance(x, torch.Tensor) for x in column):
            return _int64(torch.cat(list(column))), lengths
        if all(isinstance(x, np.ndarray) for x in column):
            return _numeric(key, np.concatenate(column), False), lengths
        return _int64(torch.cat([x if isinstance(x, torch.Tensor) else _numeric(key, np.asarray(x), True)
                                 for x in column])), lengths
    except (RuntimeError, ValueError, TypeError) as err:
        if str(err).startswith(_COLLATE):
            raise
        raise ValueError(f"{_COLLATE}(): expected the per-token values of {key!r} to concatenate into one "
                         f"tensor: {err}") from None


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
