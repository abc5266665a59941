"""Property tests: random batches (B from 0 to 8, lengths including 0 and 1, feature dims).

The oracle is always a per-sequence loop over the input; ragged's own reference
functions are not used as expectations here.
"""

import math

import pytest
import torch
from conftest import cpu_backends
from hypothesis import given, settings
from hypothesis import strategies as st

import ragged
from ragged import RaggedTensor

BACKENDS = cpu_backends()

SETTINGS = settings(max_examples=40)

lengths_st = st.lists(st.one_of(st.sampled_from([0, 1]), st.integers(0, 13)), min_size=0, max_size=8)
feat_st = st.sampled_from([(), (1,), (3,), (2, 3)])
dtype_st = st.sampled_from([torch.float32, torch.float64, torch.int64, torch.float16, torch.bfloat16])
seed_st = st.integers(0, 2**31 - 1)
pad_st = st.sampled_from([0.0, -1.0, 5.0, float("nan")])


def _random(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-50, 50, shape, generator=g)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _keep_mask(lengths, width, side):
    keep = torch.zeros(len(lengths), width, dtype=torch.bool)
    for b, n in enumerate(lengths):
        if side == "right":
            keep[b, :n] = True
        elif n:
            keep[b, width - n :] = True
    return keep


def _padded_from_seqs(seqs, width, feat, dtype, fill, side):
    out = torch.full((len(seqs), width, *feat), fill, dtype=dtype)
    for b, s in enumerate(seqs):
        n = s.shape[0]
        for j in range(n):
            out[b, j if side == "right" else width - n + j] = s[j]
    return out


def _assert_ragged_equal(a, b):
    assert a.batch_size == b.batch_size
    assert a.max_len == b.max_len
    assert a.offsets.dtype == b.offsets.dtype
    assert torch.equal(a.offsets, b.offsets)
    assert a.values.shape == b.values.shape
    assert torch.equal(a.values, b.values)


def _seqs(lengths, feat, dtype, seed):
    return [_random((n, *feat), dtype, seed + i) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(
    lengths=lengths_st,
    feat=feat_st,
    dtype=dtype_st,
    seed=seed_st,
    extra=st.integers(0, 3),
    side=st.sampled_from(["right", "left"]),
)
def test_pack_list_equals_pack_lengths_equals_pack_mask(backend, lengths, feat, dtype, seed, extra, side):
    seqs = _seqs(lengths, feat, dtype, seed)
    width = max(lengths, default=0) + extra
    poison = -7 if dtype == torch.int64 else float("nan")
    x = _padded_from_seqs(seqs, width, feat, dtype, poison, side)

    from_list = ragged.pack(seqs) if seqs else RaggedTensor.from_lengths(torch.empty(0, *feat, dtype=dtype), [])
    from_lengths = ragged.pack(x, lengths=lengths, padding_side=side, backend=backend)
    keep = _keep_mask(lengths, width, side)
    from_mask = ragged.pack(x, mask=~keep, backend=backend)
    from_hf = ragged.pack(x, attention_mask=keep.long(), backend=backend)

    assert from_list.offsets.tolist() == _offsets(lengths)
    assert from_list.max_len == max(lengths, default=0)
    for rt in (from_lengths, from_mask, from_hf):
        assert rt.host_lengths() == lengths
        _assert_ragged_equal(rt, from_list)
    if seqs:
        assert torch.equal(from_list.values, torch.cat(seqs))


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(
    lengths=lengths_st,
    feat=feat_st,
    dtype=dtype_st,
    seed=seed_st,
    extra=st.integers(0, 3),
    fill=pad_st,
    side=st.sampled_from(["right", "left"]),
)
def test_unpack_pack_round_trip(backend, lengths, feat, dtype, seed, extra, fill, side):
    if dtype == torch.int64:
        fill = 0.0 if math.isnan(fill) else fill
    width = max(lengths, default=0) + extra
    x = _random((len(lengths), width, *feat), dtype, seed)
    rt = ragged.pack(x, lengths=lengths, padding_side=side, backend=backend)
    total_length = width if extra else None
    back = ragged.unpack(rt, padding_value=fill, total_length=total_length, padding_side=side, backend=backend)
    assert back.shape == (len(lengths), width if extra else max(lengths, default=0), *feat)
    keep = _keep_mask(lengths, back.shape[1], side)
    src_keep = _keep_mask(lengths, width, side)
    assert torch.equal(back[keep], x[src_keep])
    pad = back[~keep]
    expected_fill = torch.tensor(fill, dtype=dtype)
    if math.isnan(fill):
        assert torch.isnan(pad).all()
    else:
        assert (pad == expected_fill).all()


@SETTINGS
@given(lengths=lengths_st, feat=feat_st, seed=seed_st, offsets_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_from_offsets_equals(lengths, feat, seed, offsets_dtype):
    seqs = _seqs(lengths, feat, torch.float32, seed)
    values = torch.cat(seqs) if seqs else torch.empty(0, *feat)
    rt = RaggedTensor.from_lengths(values, lengths)
    again = RaggedTensor.from_offsets(rt.values, rt.offsets)
    _assert_ragged_equal(again, rt)
    assert again.host_lengths() == lengths
    other = RaggedTensor.from_offsets(values, torch.tensor(_offsets(lengths), dtype=offsets_dtype))
    assert other.max_len == rt.max_len
    assert other.offsets.tolist() == rt.offsets.tolist()
    for part, s in zip(other.unbind(), seqs):
        assert torch.equal(part, s)
    assert [rt[i].shape[0] for i in range(len(lengths))] == lengths


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(lengths=lengths_st, feat=feat_st, seed=seed_st, extra=st.integers(0, 3))
def test_left_padding_round_trip(backend, lengths, feat, seed, extra):
    seqs = _seqs(lengths, feat, torch.float32, seed)
    values = torch.cat(seqs) if seqs else torch.empty(0, *feat)
    rt = RaggedTensor.from_lengths(values, lengths)
    width = rt.max_len + extra
    left = rt.to_padded(total_length=width, padding_side="left", padding_value=float("nan"), backend=backend)
    expected = _padded_from_seqs(seqs, width, feat, torch.float32, float("nan"), "left")
    assert torch.equal(torch.isnan(left), torch.isnan(expected))
    assert torch.equal(torch.nan_to_num(left), torch.nan_to_num(expected))
    am = rt.attention_mask(total_length=width, padding_side="left")
    for back in (
        ragged.pack(left, lengths=lengths, padding_side="left", backend=backend),
        ragged.pack(left, attention_mask=am, backend=backend),
    ):
        _assert_ragged_equal(back, rt)


@SETTINGS
@given(lengths=lengths_st, seed=seed_st)
def test_position_and_seq_ids_property(lengths, seed):
    rt = RaggedTensor.from_lengths(torch.randn(sum(lengths), 2), lengths)
    pos = rt.position_ids()
    sid = rt.seq_ids()
    expected_pos = [j for n in lengths for j in range(n)]
    expected_sid = [b for b, n in enumerate(lengths) for _ in range(n)]
    assert pos.tolist() == expected_pos
    assert sid.tolist() == expected_sid
    for side in ("right", "left"):
        pm = rt.padding_mask(padding_side=side)
        assert torch.equal(pm, ~_keep_mask(lengths, rt.max_len, side))
