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

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Sampler

from .collate import RaggedBatch, collate
from .utils import check_int, describe

__all__ = ["RaggedBatch", "StepBalance", "TokenBudgetSampler", "collate"]

_SAMPLER = "ragged.data.TokenBudgetSampler"


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
    order: np.ndarray  # [n] sequence indices in packing order
    starts: np.ndarray  # [batches + 1] batch b is order[starts[b]:starts[b + 1]]
    steps: np.ndarray  # [steps, num_replicas] batch ids (a repeated batch appears twice)
    repeated: int  # batch slots filled by a repeat
    dropped: int  # sequences left out (drop_last)


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

    def __init__(
        self,
        lengths,
        max_tokens: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        max_batch_size: int | None = None,
        sort_window: int | None = None,
        cost: str | Callable[[np.ndarray], np.ndarray] = "tokens",
    ):
        self.lengths = _as_lengths(lengths)
        self.max_tokens = check_int(_SAMPLER, "max_tokens", max_tokens, minimum=1)
        self.shuffle = _check_bool("shuffle", shuffle)
        self.drop_last = _check_bool("drop_last", drop_last)
        self.seed = check_int(_SAMPLER, "seed", seed, minimum=0)
        self.max_batch_size, self.sort_window = (
            None if v is None else check_int(_SAMPLER, name, v, minimum=1)
            for name, v in (("max_batch_size", max_batch_size), ("sort_window", sort_window))
        )
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
            yield order[starts[b] : starts[b + 1]].tolist()

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
        return StepBalance(
            loads,
            ratio,
            float(ratio.max(initial=1.0)),
            float(ratio.mean()) if ratio.size else 1.0,
            float(loads.sum()) / busy if busy > 0 else 1.0,
        )

    def _current(self) -> _Plan:
        if self._plan is None:
            self._plan = _make_plan(
                self.lengths,
                self._costs,
                self.max_tokens,
                self.max_batch_size,
                self.sort_window,
                self.shuffle,
                self.drop_last,
                self.num_replicas,
                self.seed,
                self.epoch,
            )
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
        raise TypeError(
            f"{_SAMPLER}(): expected lengths as a list of ints, a numpy array or a tensor, got {describe(lengths)}"
        )
    else:
        arr = np.asarray(lengths)
        if arr.size == 0 and arr.dtype == np.float64 and not isinstance(lengths, np.ndarray):
            arr = arr.astype(np.int64)  # [] reads as float64
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
    num_replicas = check_int(
        _SAMPLER,
        "num_replicas",
        num_replicas if num_replicas is not None else dist.get_world_size() if initialized else 1,
        minimum=1,
    )
    rank = check_int(_SAMPLER, "rank", rank if rank is not None else dist.get_rank() if initialized else 0, minimum=0)
    if rank >= num_replicas:
        raise ValueError(f"{_SAMPLER}(): expected rank in [0, num_replicas) = [0, {num_replicas}), got {rank}")
    return num_replicas, rank


def _sequence_costs(cost, lengths: np.ndarray) -> np.ndarray:
    """Per-sequence cost: int64 tokens, float64 ``L ** 2`` or a callable's float64 costs."""
    if isinstance(cost, str) and cost in ("tokens", "attention"):
        return lengths if cost == "tokens" else lengths.astype(np.float64) ** 2
    if not callable(cost):
        raise (ValueError if isinstance(cost, str) else TypeError)(
            f"{_SAMPLER}(): expected cost 'tokens', 'attention' or a callable, got {describe(cost)}"
        )
    out = np.asarray(cost(lengths.copy()), dtype=np.float64)
    if out.shape != lengths.shape:
        raise ValueError(f"{_SAMPLER}(): expected cost(lengths) of shape {lengths.shape}, got {out.shape}")
    if out.size and not (np.isfinite(out).all() and out.min() >= 0):
        raise ValueError(f"{_SAMPLER}(): expected cost(lengths) finite and >= 0, got min {out.min()}, max {out.max()}")
    return out


def _make_plan(
    lengths, costs, max_tokens, max_batch_size, sort_window, shuffle, drop_last, replicas, seed, epoch
) -> _Plan:
    n = lengths.size
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(n) if shuffle else np.arange(n, dtype=np.int64)
    if sort_window is not None and sort_window > 1 and n > 1:
        order = _sort_windows(order, np.take(lengths, order), sort_window)
    tokens = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.take(lengths, order), out=tokens[1:])  # np.take: 4x faster than lengths[order]
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
    if repeated:  # every batch holds one sequence: the cheapest ones run again (class docstring)
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
    key = lens.astype(np.uint16) if lens.max() < 2**16 else lens  # radix sort: 15x faster at 10M
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
    n, starts, max_tokens = tokens.size - 1, [0], min(max_tokens, 2**62)  # no int64 overflow below
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
