"""ragged.data: TokenBudgetSampler (budget, coverage, equal counts per replica, determinism,
balance) and collate (against a per-sequence reference; padded input with its mask; errors;
DataLoader with workers; pinning).

Oracles are written here from the definitions: a greedy packing loop in Python, per-sequence
``torch.tensor`` calls, sums over the yielded batches.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import ragged
from ragged.data import RaggedBatch, StepBalance, TokenBudgetSampler, collate

SETTINGS = settings(max_examples=60)
MANY = settings(max_examples=200)  # the sampler's examples are cheap (a few ms)

lengths_st = st.lists(
    st.one_of(st.sampled_from([0, 1]), st.integers(0, 30), st.integers(40, 90)), min_size=0, max_size=40
)
cost_st = st.sampled_from(["tokens", "attention", lambda lens: 3.0 * lens + 0.5])


def _all_ranks(lengths, max_tokens, replicas, epoch=0, **kw):
    """One sampler per rank (as each process would build it) and their batches."""
    samplers = [TokenBudgetSampler(lengths, max_tokens, num_replicas=replicas, rank=r, **kw) for r in range(replicas)]
    for s in samplers:
        s.set_epoch(epoch)
    return samplers, [list(s) for s in samplers]


def _greedy(lengths, max_tokens, max_batch_size=None):
    """The packing rule, one sequence at a time, in dataset order."""
    batches, cur, tokens = [], [], 0
    for i, n in enumerate(lengths):
        full = cur and (tokens + n > max_tokens or (max_batch_size is not None and len(cur) == max_batch_size))
        if full:
            batches.append(cur)
            cur, tokens = [], 0
        cur.append(i)
        tokens += n
    if cur:
        batches.append(cur)
    return batches


# --------------------------------------------------------------------------------------
# Sampler invariants


@MANY
@given(
    lengths=lengths_st,
    max_tokens=st.integers(1, 120),
    replicas=st.integers(1, 4),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    max_batch_size=st.one_of(st.none(), st.integers(1, 6)),
    sort_window=st.one_of(st.none(), st.integers(1, 12)),
    cost=cost_st,
    seed=st.integers(0, 5),
    epoch=st.integers(0, 3),
)
def test_sampler_invariants(
    lengths, max_tokens, replicas, shuffle, drop_last, max_batch_size, sort_window, cost, seed, epoch
):
    kw = dict(
        shuffle=shuffle,
        drop_last=drop_last,
        max_batch_size=max_batch_size,
        sort_window=sort_window,
        cost=cost,
        seed=seed,
    )
    samplers, per_rank = _all_ranks(lengths, max_tokens, replicas, epoch, **kw)
    n = len(lengths)
    counts = {len(b) for b in per_rank}
    assert counts == {len(s) for s in samplers} and len(counts) == 1, "equal batch counts on every replica"
    seen = np.zeros(n, dtype=np.int64)
    for batches in per_rank:
        for batch in batches:
            assert batch, "no empty batch"
            assert all(isinstance(i, int) for i in batch)
            assert len(batch) == 1 or sum(lengths[i] for i in batch) <= max_tokens
            assert max_batch_size is None or len(batch) <= max_batch_size
            np.add.at(seen, batch, 1)
    first = samplers[0]
    assert all(s.num_repeated == first.num_repeated and s.num_dropped == first.num_dropped for s in samplers)
    distinct = {tuple(b) for batches in per_rank for b in batches}
    if drop_last:
        assert first.num_repeated == 0 and seen.max(initial=0) <= 1
        assert n - seen.sum() == first.num_dropped
        # at most the last batch of the packing and num_replicas - 1 more are left out
        assert first.num_dropped <= (len(distinct) + replicas) * 90
    else:
        assert first.num_dropped == 0 and seen.min(initial=1) >= 1, "every index at least once"
        if first.num_repeated == 0:
            assert (seen == 1).all(), "every index exactly once"
        else:
            # repeats only where no batch can be split: every batch holds one sequence
            assert all(len(b) == 1 for b in distinct) and n % replicas != 0
            assert seen.sum() - n == first.num_repeated
    # the loads the sampler reports are those of the batches it yields
    loads = first.step_loads("tokens")
    assert loads.shape == (len(first), replicas) and loads.dtype == np.int64
    for r, batches in enumerate(per_rank):
        assert loads[:, r].tolist() == [sum(lengths[i] for i in b) for b in batches]


@MANY
@given(lengths=lengths_st, max_tokens=st.integers(1, 120), max_batch_size=st.one_of(st.none(), st.integers(1, 6)))
def test_packing_is_greedy_in_dataset_order(lengths, max_tokens, max_batch_size):
    sampler = TokenBudgetSampler(lengths, max_tokens, shuffle=False, max_batch_size=max_batch_size)
    assert list(sampler) == _greedy(lengths, max_tokens, max_batch_size)


def test_packing_many_small_batches_takes_the_vectorized_path():
    # max_tokens near the mean length: one batch per few sequences (the other branch of the packer)
    lengths = np.random.default_rng(1).integers(0, 20, 5000)
    for cap in (None, 2):
        sampler = TokenBudgetSampler(lengths, 25, shuffle=False, max_batch_size=cap)
        assert list(sampler) == _greedy(lengths.tolist(), 25, cap)


def test_sort_window_sorts_by_length_within_windows():
    lengths = np.random.default_rng(2).integers(0, 70000, 103)  # past 2**16: the int64 key path too
    for lens in (lengths, lengths % 300):
        sampler = TokenBudgetSampler(lens, 10**9, shuffle=False, sort_window=10)
        (batch,) = list(sampler)
        expected = np.concatenate([s + np.argsort(lens[s : s + 10], kind="stable") for s in range(0, 103, 10)])
        assert batch == expected.tolist()
    # shuffled: each window of the epoch's order is sorted
    sampler = TokenBudgetSampler(lengths % 300, 10**9, shuffle=True, sort_window=10, seed=3)
    (batch,) = list(sampler)
    got = (lengths % 300)[batch]
    assert sorted(batch) == list(range(103))
    assert all((np.diff(got[s : s + 10]) >= 0).all() for s in range(0, 103, 10))


def test_zero_length_and_over_budget_sequences():
    lengths = [0, 5, 100, 0, 3, 0, 250, 2]
    for shuffle in (False, True):
        batches = list(TokenBudgetSampler(lengths, 10, shuffle=shuffle))
        assert sorted(i for b in batches for i in b) == list(range(8))
        for big in (2, 6):
            assert [big] in batches, "a sequence over the budget forms a batch alone"
    assert list(TokenBudgetSampler([0, 0, 0], 1, shuffle=False)) == [[0, 1, 2]]
    sampler = TokenBudgetSampler([], 8)
    assert len(sampler) == 0 and list(sampler) == []
    assert sampler.balance().worst == 1.0 and sampler.balance().efficiency == 1.0


def test_fewer_sequences_than_replicas_repeat_the_cheapest():
    samplers, per_rank = _all_ranks([7, 3], 100, 4, shuffle=False)
    assert [len(b) for b in per_rank] == [1, 1, 1, 1]
    assert samplers[0].num_repeated == 2
    # split into [0], [1]; then the cheapest batches, cycled: [1], [0]
    assert sorted(tuple(b[0]) for b in per_rank) == [(0,), (0,), (1,), (1,)]


def test_split_instead_of_repeat():
    # 3 batches of two sequences, 2 replicas: one batch is split, nothing repeats
    samplers, per_rank = _all_ranks([5, 5, 4, 4, 3, 3], 10, 2, shuffle=False)
    assert samplers[0].num_repeated == 0 and [len(b) for b in per_rank] == [2, 2]
    assert sorted(i for b in per_rank for x in b for i in x) == list(range(6))
    assert sorted(len(x) for b in per_rank for x in b) == [1, 1, 2, 2]


def test_drop_last_rule():
    # 10-token budget: [4,4], [4,4], [4] under budget -> dropped with drop_last
    assert list(TokenBudgetSampler([4, 4, 4, 4, 4], 10, shuffle=False, drop_last=True)) == [[0, 1], [2, 3]]
    # a last batch exactly at the budget stays
    assert list(TokenBudgetSampler([5, 5, 5, 5], 10, shuffle=False, drop_last=True)) == [[0, 1], [2, 3]]
    # ... and one that ends on max_batch_size
    assert list(TokenBudgetSampler([1, 1, 1, 1], 10, shuffle=False, drop_last=True, max_batch_size=2)) == [
        [0, 1],
        [2, 3],
    ]
    # 2 replicas, batches [9], [8], [7], [6] + under-budget [5]: [5] dropped, 4 left
    samplers, per_rank = _all_ranks([9, 8, 7, 6, 5], 10, 2, shuffle=False, drop_last=True)
    assert samplers[0].num_dropped == 1 and sorted(i for b in per_rank for x in b for i in x) == [0, 1, 2, 3]
    # 3 replicas: [9], [8], [7], [6] kept; one more (the cheapest, [6]) must go
    samplers, per_rank = _all_ranks([9, 8, 7, 6, 5], 10, 3, shuffle=False, drop_last=True)
    assert samplers[0].num_dropped == 2 and sorted(i for b in per_rank for x in b for i in x) == [0, 1, 2]


def test_determinism_per_seed_and_epoch():
    lengths = np.random.default_rng(4).integers(0, 60, 600)
    a = TokenBudgetSampler(lengths, 200, seed=7, num_replicas=3, rank=1, sort_window=50)
    b = TokenBudgetSampler(torch.tensor(lengths), 200, seed=7, num_replicas=3, rank=1, sort_window=50)
    assert list(a) == list(b) == list(a)
    first = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b) != first
    a.set_epoch(0)
    assert list(a) == first, "an epoch repeats exactly"
    other = TokenBudgetSampler(lengths, 200, seed=8, num_replicas=3, rank=1, sort_window=50)
    assert list(other) != first
    fixed = TokenBudgetSampler(lengths, 200, shuffle=False)
    e0 = list(fixed)
    fixed.set_epoch(5)
    assert list(fixed) == e0 and [i for x in e0 for i in x] == list(range(600))


def test_shuffle_randomizes_batch_order_and_composition():
    lengths = np.full(400, 10)
    batches = list(TokenBudgetSampler(lengths, 100, seed=0))
    assert len(batches) == 40 and all(len(x) == 10 for x in batches)
    assert [i for x in batches for i in x] != list(range(400))
    assert sorted(i for x in batches for i in x) == list(range(400))


def test_balance_beats_dealing_in_order():
    lengths = np.random.default_rng(5).integers(1, 200, 3000)
    for cost, window in (("tokens", None), ("attention", 300)):
        samplers, per_rank = _all_ranks(lengths, 1000, 4, sort_window=window, cost=cost)
        stats = samplers[0].balance()
        assert isinstance(stats, StepBalance)
        weight = lengths.astype(np.float64) ** (1 if cost == "tokens" else 2)
        loads = np.array([[weight[b].sum() for b in batches] for batches in per_rank]).T
        np.testing.assert_allclose(stats.loads, loads)
        np.testing.assert_allclose(stats.ratio, loads.max(1) / loads.mean(1))
        assert stats.worst == pytest.approx(stats.ratio.max()) and stats.mean == pytest.approx(stats.ratio.mean())
        assert stats.efficiency == pytest.approx(loads.sum() / (4 * loads.max(1).sum()))
        # the same batches in a random order, dealt round-robin as a plain distributed sampler would
        pooled = [b for batches in per_rank for b in batches]
        order = np.random.default_rng(0).permutation(len(pooled))
        naive = np.array([weight[pooled[i]].sum() for i in order]).reshape(-1, 4)
        assert stats.efficiency > naive.sum() / (4 * naive.max(1).sum())
        assert stats.efficiency > 0.97


@pytest.mark.parametrize("cost", ["tokens", "attention"])
def test_step_loads_in_another_cost(cost):
    lengths = np.random.default_rng(6).integers(0, 50, 300)
    sampler = TokenBudgetSampler(lengths, 150, num_replicas=2, cost=cost)
    per = lengths.astype(np.float64) ** 2
    got = sampler.step_loads("attention")
    np.testing.assert_allclose(got[:, 0], [per[b].sum() for b in sampler])
    np.testing.assert_allclose(
        sampler.step_loads(lambda lens: lens * 2.0)[:, 0], [2.0 * lengths[b].sum() for b in sampler]
    )


def test_distributed_defaults(monkeypatch):
    s = TokenBudgetSampler([1, 2, 3], 4)
    assert (s.num_replicas, s.rank) == (1, 0)
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 4)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 2)
    s = TokenBudgetSampler([1, 2, 3], 4)
    assert (s.num_replicas, s.rank) == (4, 2)
    s = TokenBudgetSampler([1, 2, 3], 4, num_replicas=2, rank=1)
    assert (s.num_replicas, s.rank) == (2, 1)


def test_dataloader_with_the_sampler():
    lengths = [3, 0, 7, 1, 5, 2]
    data = [list(range(100 * i, 100 * i + n)) for i, n in enumerate(lengths)]
    loader = DataLoader(data, batch_sampler=TokenBudgetSampler(lengths, 8), collate_fn=lambda b: b)
    got = [seq for batch in loader for seq in batch]
    assert sorted(got) == sorted(data) and len(loader) == len(loader.batch_sampler)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(lengths=[1.5, 2]), TypeError, "integer lengths"),
        (dict(lengths=torch.tensor([1.0])), TypeError, "integer lengths"),
        (dict(lengths=[[1, 2]]), ValueError, "1-D lengths"),
        (dict(lengths=[3, -1]), ValueError, r"lengths\[1\] = -1"),
        (dict(lengths="12"), TypeError, "lengths as a list"),
        (dict(lengths=5), TypeError, "lengths as a list"),
        (dict(max_tokens=0), ValueError, "max_tokens >= 1"),
        (dict(max_tokens=2.0), TypeError, "max_tokens to be an int"),
        (dict(num_replicas=0), ValueError, "num_replicas >= 1"),
        (dict(num_replicas=2, rank=2), ValueError, r"rank in \[0, num_replicas\)"),
        (dict(rank=-1), ValueError, "rank >= 0"),
        (dict(max_batch_size=0), ValueError, "max_batch_size >= 1"),
        (dict(sort_window=0), ValueError, "sort_window >= 1"),
        (dict(seed=-1), ValueError, "seed >= 0"),
        (dict(shuffle=1), TypeError, "shuffle to be a bool"),
        (dict(drop_last="yes"), TypeError, "drop_last to be a bool"),
        (dict(cost="flops"), ValueError, "cost 'tokens', 'attention' or a callable"),
        (dict(cost=3), TypeError, "cost 'tokens', 'attention' or a callable"),
        (dict(cost=lambda lens: lens[:1]), ValueError, "cost\\(lengths\\) of shape"),
        (dict(cost=lambda lens: -lens), ValueError, "finite and >= 0"),
    ],
)
def test_sampler_errors(kwargs, error, match):
    args = dict(lengths=[1, 2, 3], max_tokens=4) | kwargs
    with pytest.raises(error, match=match) as info:
        TokenBudgetSampler(args.pop("lengths"), args.pop("max_tokens"), **args)
    assert "TokenBudgetSampler" in str(info.value)


def test_set_epoch_error():
    with pytest.raises(ValueError, match=r"TokenBudgetSampler.set_epoch\(\): expected epoch >= 0"):
        TokenBudgetSampler([1], 1).set_epoch(-1)


# --------------------------------------------------------------------------------------
# collate


def _features(lengths, seed, form="list"):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = rng.integers(0, 30000, n)
        f = {
            "input_ids": ids,
            "token_type_ids": rng.integers(0, 2, n),
            "attention_mask": np.ones(n, np.int64),
            "weights": rng.standard_normal(n),
            "label": int(rng.integers(0, 5)),
            "score": float(rng.random()),
            "text": f"seq{i}",
        }
        if form == "list":
            f = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in f.items()}
        elif form == "tensor":
            f = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in f.items()}
        out.append(f)
    return out


def _check_against_reference(batch, features, keys=("input_ids", "token_type_ids", "weights")):
    lengths = [len(f["input_ids"]) for f in features]
    offsets = np.concatenate(([0], np.cumsum(lengths))).tolist()
    assert isinstance(batch, RaggedBatch)
    assert "attention_mask" not in batch
    for key in keys:
        rt = batch[key]
        assert isinstance(rt, ragged.RaggedTensor)
        assert rt.offsets.dtype == torch.int32 and rt.offsets.tolist() == offsets
        assert rt.offsets is batch["input_ids"].offsets, "per-token fields share their offsets"
        assert rt.max_len == max(lengths, default=0) and rt.values.is_contiguous()
        for b, f in enumerate(features):
            value = f[key]
            expected = torch.tensor(value) if isinstance(value, list) else torch.as_tensor(np.asarray(value))
            assert rt[b].dtype == (torch.int64 if key != "weights" else expected.dtype) or not len(value)
            assert torch.equal(rt[b], expected.to(rt.dtype))
    assert batch["input_ids"].values.dtype == torch.int64
    assert batch["weights"].values.dtype in (torch.float32, torch.float64) or batch["weights"].num_tokens == 0
    assert batch["label"].tolist() == [f["label"] for f in features] and batch["label"].dtype == torch.int64
    assert torch.allclose(batch["score"].double(), torch.tensor([f["score"] for f in features], dtype=torch.float64))
    assert batch["text"] == [f["text"] for f in features]


@pytest.mark.parametrize("form", ["list", "numpy", "tensor"])
@SETTINGS
@given(
    lengths=st.lists(st.one_of(st.sampled_from([0, 1]), st.integers(0, 40)), min_size=1, max_size=12),
    seed=st.integers(0, 2**31 - 1),
)
def test_collate_against_per_sequence_reference(form, lengths, seed):
    features = _features(lengths, seed, form)
    batch = collate(features)
    _check_against_reference(batch, features)
    if form == "list" and sum(lengths):
        assert batch["weights"].values.dtype == torch.get_default_dtype()


def test_collate_one_long_sequence_and_odd_sizes():
    features = _features([1, 0, 1025, 97, 3], 0)
    _check_against_reference(collate(features), features)


def test_collate_mapping_of_columns():
    features = _features([4, 0, 9], 1)
    columns = {k: [f[k] for f in features] for k in features[0]}
    _check_against_reference(collate(columns), features)
    assert collate({"input_ids": []})["input_ids"].batch_size == 0


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("as_columns", [False, True])
def test_collate_honours_the_mask_of_padded_features(side, as_columns):
    lengths = [3, 0, 5, 1, 5]
    features = _features(lengths, 2)
    width = 6
    padded = []
    for f in features:
        n, pad = len(f["input_ids"]), width - len(f["input_ids"])

        def fill(v, x):
            return v + [x] * pad if side == "right" else [x] * pad + v

        padded.append(
            {
                "input_ids": fill(f["input_ids"], -999),
                "token_type_ids": fill(f["token_type_ids"], -999),
                "weights": fill(f["weights"], float("nan")),
                "attention_mask": fill([1] * n, 0),
                "label": f["label"],
                "score": f["score"],
                "text": f["text"],
            }
        )
    if as_columns:  # a tokenizer's padded output: [B, M] tensors
        padded = {k: torch.tensor([f[k] for f in padded]) if k != "text" else [f[k] for f in padded] for k in padded[0]}
    batch = collate(padded)
    _check_against_reference(batch, features)
    assert not torch.isnan(batch["weights"].values).any() and (batch["input_ids"].values != -999).all()


def test_collate_all_ones_mask_and_its_errors():
    f = [{"input_ids": [1, 2], "attention_mask": [True, True]}, {"input_ids": [3], "attention_mask": [True]}]
    assert list(collate(f)) == ["input_ids"]
    with pytest.raises(ValueError, match="'attention_mask' to hold one 0 or 1 per token"):
        collate([{"input_ids": [1, 2], "attention_mask": [1, 2]}])


def test_collate_length_mismatch_names_key_and_sequence():
    f = [
        {"input_ids": [1, 2], "labels": [0, 1]},
        {"input_ids": [3], "labels": [1]},
        {"input_ids": [4, 5, 6], "labels": [1, 1]},
    ]
    with pytest.raises(ValueError, match=r"'labels' of sequence 2 to have as many tokens as 'input_ids' \(3\), got 2"):
        collate(f)
    # per-sequence vectors are stacked when named
    f = [{"input_ids": [1, 2], "labels": [0, 1, 1]}, {"input_ids": [3], "labels": [1, 0, 0]}]
    out = collate(f, per_sequence=["labels"])
    assert torch.equal(out["labels"], torch.tensor([[0, 1, 1], [1, 0, 0]]))
    assert torch.equal(collate(f, per_sequence="labels")["labels"], out["labels"])


def test_collate_value_types():
    f = [
        {"input_ids": [2**60 + 1, 5], "x": [1, 2.5], "m": [True, False], "pos": [[0, 1], [1, 3]]},
        {"input_ids": [], "x": [], "m": [], "pos": []},
    ]
    out = collate(f)
    assert out["input_ids"].values.tolist() == [2**60 + 1, 5], "ints past 2**53 stay exact"
    assert out["x"].values.dtype == torch.get_default_dtype() and out["x"].values.tolist() == [1.0, 2.5]
    assert out["m"].values.dtype == torch.bool
    assert out["pos"].values.tolist() == [[0, 1], [1, 3]]
    empty = collate([{"input_ids": []}, {"input_ids": []}])["input_ids"]
    assert empty.values.dtype == torch.int64 and empty.offsets.tolist() == [0, 0, 0] and empty.max_len == 0
    small = collate([{"input_ids": np.array([1, 2], np.int32), "label": np.int16(3)}])
    assert small["input_ids"].values.dtype == torch.int64 and small["label"].dtype == torch.int64
    ro = np.array([4, 5, 6])
    ro.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert collate([{"input_ids": ro}])["input_ids"].values.tolist() == [4, 5, 6]
    assert collate([]) == {}


@pytest.mark.parametrize(
    "features, error, match",
    [
        ("abc", TypeError, "a list of mappings"),
        ([[1, 2]], TypeError, r"features\[0\] to be a mapping"),
        ([{"input_ids": [1]}, {"labels": [1]}], ValueError, "sequence 1 with"),
        ([{"input_ids": [1]}, {"input_ids": [1], "x": 1}], ValueError, "sequence 1 with"),
        ([{"input_ids": [1, "a"]}], ValueError, "numbers in 'input_ids'"),
        ([{"input_ids": [1]}, {"input_ids": 3}], ValueError, "'input_ids' of sequence 1 to hold one value per token"),
        ([{"label": 1}, {"label": [1, 2]}], ValueError, "per-sequence values of 'label'"),
        ({"input_ids": [[1], [2]], "label": [1]}, ValueError, "every column to hold 2 sequences"),
        ({"input_ids": 5}, TypeError, "column 'input_ids'"),
    ],
)
def test_collate_errors(features, error, match):
    with pytest.raises(error, match=match) as info:
        collate(features)
    assert "ragged.data.collate" in str(info.value)


def test_collate_per_sequence_error():
    with pytest.raises(TypeError, match=r"ragged.data.collate\(\): expected per_sequence as an iterable"):
        collate([{"input_ids": [1]}], per_sequence=3)


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_integration(workers):
    rng = np.random.default_rng(8)
    lengths = rng.integers(0, 40, 150)
    lengths[7] = 300  # over the budget: alone
    data = _features(lengths, 9)
    sampler = TokenBudgetSampler(lengths, 256, seed=1, sort_window=32)
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=collate, num_workers=workers)
    seen = []
    for batch, indices in zip(loader, sampler):
        assert isinstance(batch, RaggedBatch)
        rt = batch["input_ids"]
        assert rt.num_tokens <= 256 or rt.batch_size == 1
        for b, i in enumerate(indices):
            assert rt[b].tolist() == data[i]["input_ids"]
            assert batch["label"][b].item() == data[i]["label"]
        seen += indices
    assert sorted(seen) == list(range(150))


def test_pin_memory_and_to(monkeypatch):
    from torch.utils.data._utils.pin_memory import pin_memory

    batch = collate(_features([3, 0, 4], 3))
    pinned = []

    def fake_pin(t, *args, **kwargs):
        out = t.clone()
        pinned.append(out)
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    out = pin_memory(batch)  # what DataLoader(pin_memory=True) calls
    assert isinstance(out, RaggedBatch) and out.keys() == batch.keys()
    assert out["input_ids"].offsets is out["token_type_ids"].offsets, "still shared"
    for key in ("input_ids", "token_type_ids", "weights"):
        assert any(out[key].values is p for p in pinned) and any(out[key].offsets is p for p in pinned)
        assert torch.equal(out[key].values, batch[key].values)
        assert out[key].host_offsets() == batch[key].host_offsets()
    assert any(out["label"] is p for p in pinned) and out["text"] == batch["text"]
    moved = batch.to("meta")
    assert moved["input_ids"].values.is_meta and moved["input_ids"].offsets.is_meta
    assert moved["input_ids"].max_len == batch["input_ids"].max_len and moved["label"].is_meta


def test_one_copy_views_every_dtype_and_shape_back():
    """The staging of RaggedBatch.to: tensors of mixed dtypes, shapes (empty, 0-dim, strided,
    odd byte counts) packed into one buffer come back equal, each with its own storage range."""
    from ragged.collate import _one_copy

    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 5, generator=g, dtype=torch.float64)
    tensors = [
        torch.randint(0, 9, (7,), generator=g, dtype=torch.int64),
        torch.tensor([0, 3, 3, 7], dtype=torch.int32),
        torch.rand(3, generator=g) < 0.5,
        torch.randn(2, 3, generator=g).half(),
        torch.tensor(2.5),
        torch.empty(0, 4, dtype=torch.int16),
        base[:, 1::2],
        torch.randint(0, 5, (3,), dtype=torch.uint8),
    ]
    moved = _one_copy(tensors, torch.device("cpu"), False)
    for t in tensors:
        got = moved[id(t)]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
    got = [moved[id(t)] for t in tensors if t.numel()]
    got[0].fill_(-1)  # the views do not overlap
    assert all(torch.equal(moved[id(t)], t) for t in tensors[1:])


def test_import_ragged_does_not_import_data():
    code = (
        "import sys, ragged; assert 'ragged.data' not in sys.modules; import ragged.data; "
        "assert 'transformers' not in sys.modules and 'sentence_transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={"PATH": "", "PYTHONPATH": ":".join(sys.path)})


@pytest.mark.gpu
def test_gpu_pinned_batch_moves_without_blocking():
    rng = np.random.default_rng(10)
    lengths = rng.integers(0, 60, 64)
    data = _features(lengths, 11)
    loader = DataLoader(data, batch_sampler=TokenBudgetSampler(lengths, 512), collate_fn=collate, pin_memory=True)
    for batch in loader:
        assert batch["input_ids"].values.is_pinned() and batch["input_ids"].offsets.is_pinned()
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.set_sync_debug_mode("error")
            try:
                gpu = batch.to("cuda", non_blocking=True)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        assert gpu["input_ids"].offsets.device.type == "cuda"
        assert torch.equal(gpu["input_ids"].values.cpu(), batch["input_ids"].values)
        assert gpu["input_ids"].offsets is gpu["token_type_ids"].offsets


@pytest.mark.gpu
def test_gpu_unpinned_batch_moves_in_one_copy_without_blocking():
    """An unpinned batch moves through one page-locked staging buffer: no blocking copy, every
    field equal, the shared offsets still shared, the dtypes kept."""
    batch = collate(_features([5, 0, 17, 1, 9], 13))
    assert not batch["input_ids"].values.is_pinned()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = batch.to("cuda", non_blocking=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert gpu["input_ids"].offsets is gpu["token_type_ids"].offsets
    for key, value in batch.items():
        if isinstance(value, ragged.RaggedTensor):
            assert gpu[key].values.device.type == "cuda" and gpu[key].values.dtype == value.values.dtype
            assert torch.equal(gpu[key].values.cpu(), value.values)
            assert torch.equal(gpu[key].offsets.cpu(), value.offsets) and gpu[key].max_len == value.max_len
        elif isinstance(value, torch.Tensor):
            assert gpu[key].device.type == "cuda" and torch.equal(gpu[key].cpu(), value)
        else:
            assert gpu[key] == value
