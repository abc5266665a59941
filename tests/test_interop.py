"""Interop: torch.nested, PackedSequence, flash-attn varlen arguments, HF attention masks."""

import warnings

import pytest
import torch
from conftest import cpu_backends
from torch.nn.utils.rnn import (
    PackedSequence,
    pack_padded_sequence,
    pack_sequence,
    pad_packed_sequence,
)

import ragged
from ragged import RaggedTensor

BACKENDS = cpu_backends()


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _seqs(lengths, feat=(3,), seed=0, dtype=torch.float32):
    g = _gen(seed)
    return [torch.randn(n, *feat, generator=g, dtype=dtype) for n in lengths]


def _offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _loop_padded(seqs, width, feat, fill=0.0):
    out = torch.full((len(seqs), width, *feat), fill, dtype=seqs[0].dtype if seqs else torch.float32)
    for b, s in enumerate(seqs):
        out[b, : s.shape[0]] = s
    return out


# --------------------------------------------------------------------------------------
# torch.nested (jagged layout)


@pytest.mark.parametrize("lengths", [[5, 0, 31, 12], [1], [3, 3], [0, 4]], ids=str)
@pytest.mark.parametrize("feat", [(4,), (2, 3)], ids=str)
def test_to_nested(lengths, feat):
    seqs = _seqs(lengths, feat, seed=sum(lengths))
    rt = ragged.pack(seqs)
    nt = rt.to_nested()
    assert nt.is_nested and nt.layout == torch.jagged
    assert nt.size(0) == len(lengths)
    assert nt.values().data_ptr() == rt.values.data_ptr()
    assert nt.values().shape == rt.values.shape
    assert nt.offsets().tolist() == _offsets(lengths)
    for part, s in zip(nt.unbind(), seqs):
        assert torch.equal(part, s)
    padded = nt.to_padded_tensor(0.0)
    assert torch.equal(padded, _loop_padded(seqs, max(lengths), feat))


@pytest.mark.parametrize("feat", [(4,), (2, 3)], ids=str)
def test_nested_round_trip_shares_values(feat):
    lengths = [3, 0, 7, 2]
    rt = ragged.pack(_seqs(lengths, feat, seed=1))
    back = ragged.from_nested(rt.to_nested())
    assert back.values.data_ptr() == rt.values.data_ptr()
    assert back.offsets.dtype == torch.int32
    assert torch.equal(back.offsets, rt.offsets)
    assert back.max_len == rt.max_len
    assert torch.equal(back.values, rt.values)
    assert back.host_lengths() == lengths


def test_nested_round_trip_carries_max_len():
    # A max_len larger than the longest sequence can only come back if it was carried.
    values = torch.randn(6, 2, generator=_gen(2))
    rt = RaggedTensor.from_lengths(values, [2, 4], max_len=11)
    back = ragged.from_nested(rt.to_nested())
    assert back.max_len == 11
    assert back.to_padded().shape == (2, 11, 2)


def test_nested_round_trip_one_dim_values():
    """Values of shape [T] (no feature dims) are legal, and torch.nested takes them."""
    lengths = [2, 0, 3]
    values = torch.randn(5, generator=_gen(3))
    rt = RaggedTensor.from_lengths(values, lengths)
    nt = rt.to_nested()
    assert nt.values().data_ptr() == values.data_ptr()
    assert [p.tolist() for p in nt.unbind()] == [values[:2].tolist(), [], values[2:].tolist()]
    back = ragged.from_nested(nt)
    assert back.feature_shape == ()
    assert torch.equal(back.values, values)
    assert back.offsets.tolist() == _offsets(lengths)
    assert back.max_len == 3


def test_nested_round_trip_empty_batch():
    rt = RaggedTensor.from_lengths(torch.randn(0, 3), [])
    nt = rt.to_nested()
    assert nt.size(0) == 0
    back = ragged.from_nested(nt)
    assert back.batch_size == 0 and back.num_tokens == 0 and back.feature_shape == (3,)
    assert back.offsets.tolist() == [0]


def test_nested_round_trip_empty_list():
    """B = 0 works everywhere, including the batch that pack([]) gives."""
    rt = ragged.pack([])
    back = ragged.from_nested(rt.to_nested())
    assert back.batch_size == 0 and back.num_tokens == 0
    assert back.offsets.tolist() == [0]


def test_varlen_arguments_empty_batch():
    rt = RaggedTensor.from_lengths(torch.randn(0, 3), [])
    assert rt.cu_seqlens().tolist() == [0] and rt.cu_seqlens().dtype == torch.int32
    kw = rt.flash_kwargs()
    assert kw["max_seqlen_q"] == 0 == kw["max_seqlen_k"]
    back = ragged.from_cu_seqlens(rt.values, rt.cu_seqlens())
    assert back.batch_size == 0 and back.max_len == 0
    assert rt.attention_mask().shape == (0, 0)
    assert ragged.from_attention_mask(torch.randn(0, 4, 3), torch.ones(0, 4)).batch_size == 0


def test_from_nested_jagged_built_by_torch():
    lengths = [4, 0, 2, 6]
    seqs = _seqs(lengths, (5,), seed=4)
    nt = torch.nested.nested_tensor(seqs, layout=torch.jagged)
    rt = ragged.from_nested(nt)
    assert rt.values.data_ptr() == nt.values().data_ptr()
    assert torch.equal(rt.values, torch.cat(seqs))
    assert rt.offsets.dtype == torch.int32
    assert rt.offsets.tolist() == _offsets(lengths)
    assert rt.max_len == 6
    assert rt.host_lengths() == lengths
    nt = torch.nested.nested_tensor_from_jagged(torch.cat(seqs), torch.tensor(_offsets(lengths)))
    rt = ragged.from_nested(nt)
    assert rt.max_len == 6 and rt.offsets.tolist() == _offsets(lengths)


def test_from_nested_strided():
    lengths = [3, 1, 5]
    seqs = _seqs(lengths, (2, 2), seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the strided layout is a prototype
        nt = torch.nested.nested_tensor(seqs)
    assert nt.layout == torch.strided
    rt = ragged.from_nested(nt)
    assert torch.equal(rt.values, torch.cat(seqs))
    assert rt.offsets.dtype == torch.int32
    assert rt.offsets.tolist() == _offsets(lengths)
    assert rt.max_len == 5


def test_from_nested_with_holes():
    g = _gen(6)
    dense = torch.randn(3, 8, 2, generator=g)
    starts = torch.tensor([1, 0, 5])
    lengths = torch.tensor([4, 0, 3])
    nt = torch.nested.narrow(dense, 1, starts, lengths, layout=torch.jagged)
    rt = ragged.from_nested(nt)
    expected = torch.cat([dense[b, int(s) : int(s) + int(n)] for b, (s, n) in enumerate(zip(starts, lengths))])
    assert torch.equal(rt.values, expected)
    assert rt.offsets.dtype == torch.int32
    assert rt.offsets.tolist() == _offsets(lengths.tolist())
    assert rt.max_len == 4
    assert rt.host_lengths() == [4, 0, 3]


def test_from_nested_rejects_dense():
    with pytest.raises(TypeError, match=r"ragged\.from_nested.*nested"):
        ragged.from_nested(torch.randn(2, 3))


# --------------------------------------------------------------------------------------
# PackedSequence


def _padded_and_lengths(lengths, feat=(3,), seed=0):
    seqs = _seqs(lengths, feat, seed=seed)
    width = max(lengths)
    return seqs, _loop_padded(seqs, width, feat)


@pytest.mark.parametrize("lengths", [[3, 7, 1, 5], [2], [9, 4, 6], [1, 2, 3, 4, 5, 6]], ids=str)
def test_to_packed_sequence_matches_torch(lengths):
    seqs, x = _padded_and_lengths(lengths, seed=len(lengths))
    rt = ragged.pack(seqs)
    ps = rt.to_packed_sequence()
    ref = pack_padded_sequence(x, torch.tensor(lengths), batch_first=True, enforce_sorted=False)
    assert isinstance(ps, PackedSequence)
    assert torch.equal(ps.data, ref.data)
    assert torch.equal(ps.batch_sizes, ref.batch_sizes)
    assert torch.equal(ps.sorted_indices, ref.sorted_indices)
    assert torch.equal(ps.unsorted_indices, ref.unsorted_indices)
    restored, restored_lengths = pad_packed_sequence(ps, batch_first=True)
    assert torch.equal(restored, x)
    assert restored_lengths.tolist() == lengths


@pytest.mark.parametrize("lengths", [[3, 3, 1, 3], [2, 2, 2], [5, 1, 5, 1]], ids=str)
def test_to_packed_sequence_ties(lengths):
    # Among equal lengths the order is not fixed by torch; compare the restored batch.
    seqs, x = _padded_and_lengths(lengths, seed=7)
    ps = ragged.pack(seqs).to_packed_sequence()
    ref = pack_padded_sequence(x, torch.tensor(lengths), batch_first=True, enforce_sorted=False)
    assert torch.equal(ps.batch_sizes, ref.batch_sizes)
    restored, restored_lengths = pad_packed_sequence(ps, batch_first=True)
    assert torch.equal(restored, x)
    assert restored_lengths.tolist() == lengths


@pytest.mark.parametrize("lengths", [[3, 7, 1, 5], [1], [4, 4, 2], [6, 5, 4, 3, 2, 1]], ids=str)
def test_from_packed_sequence_matches_torch(lengths):
    seqs, x = _padded_and_lengths(lengths, feat=(2, 2), seed=8)
    ref = pack_padded_sequence(x, torch.tensor(lengths), batch_first=True, enforce_sorted=False)
    rt = ragged.from_packed_sequence(ref)
    assert rt.host_lengths() == lengths
    assert rt.offsets.dtype == torch.int32
    assert rt.offsets.tolist() == _offsets(lengths)
    assert rt.max_len == max(lengths)
    assert torch.equal(rt.values, torch.cat(seqs))
    assert torch.equal(rt.to_padded(), x)
    rt2 = ragged.from_packed_sequence(pack_sequence(seqs, enforce_sorted=False))
    assert torch.equal(rt2.values, torch.cat(seqs)) and rt2.host_lengths() == lengths


@pytest.mark.parametrize("lengths", [[3, 7, 1, 5], [4, 4, 2], [1]], ids=str)
def test_packed_sequence_round_trip(lengths):
    seqs = _seqs(lengths, (3,), seed=9)
    rt = ragged.pack(seqs)
    back = ragged.from_packed_sequence(rt.to_packed_sequence())
    assert torch.equal(back.values, rt.values)
    assert torch.equal(back.offsets, rt.offsets)
    assert back.max_len == rt.max_len


def test_packed_sequence_enforce_sorted():
    lengths = [7, 5, 5, 2, 1]
    seqs, x = _padded_and_lengths(lengths, seed=10)
    rt = ragged.pack(seqs)
    ps = rt.to_packed_sequence(enforce_sorted=True)
    ref = pack_padded_sequence(x, torch.tensor(lengths), batch_first=True, enforce_sorted=True)
    assert torch.equal(ps.data, ref.data)
    assert torch.equal(ps.batch_sizes, ref.batch_sizes)
    assert ps.sorted_indices is None and ps.unsorted_indices is None
    back = ragged.from_packed_sequence(ref)
    assert torch.equal(back.values, rt.values) and back.host_lengths() == lengths
    with pytest.raises(ValueError, match=r"to_packed_sequence.*enforce_sorted"):
        ragged.pack(_seqs([2, 5], seed=11)).to_packed_sequence(enforce_sorted=True)


@pytest.mark.parametrize("lengths", [[3, 0, 2], [0], [0, 0]], ids=str)
def test_packed_sequence_rejects_zero_lengths(lengths):
    rt = ragged.pack(_seqs(lengths, seed=12))
    with pytest.raises(ValueError, match=r"to_packed_sequence.*length 0"):
        rt.to_packed_sequence()


def test_packed_sequence_rejects_empty_batch():
    with pytest.raises(ValueError, match=r"to_packed_sequence"):
        RaggedTensor.from_lengths(torch.randn(0, 3), []).to_packed_sequence()


def test_from_packed_sequence_rejects_other_types():
    with pytest.raises(TypeError, match=r"ragged\.from_packed_sequence.*PackedSequence"):
        ragged.from_packed_sequence(torch.randn(3, 2))


# --------------------------------------------------------------------------------------
# flash-attn varlen arguments


def test_cu_seqlens_and_flash_kwargs():
    lengths = [5, 0, 31, 12]
    rt = ragged.pack(_seqs(lengths, seed=13))
    cu = rt.cu_seqlens()
    assert cu.dtype == torch.int32 and cu.device == rt.device
    assert cu.tolist() == _offsets(lengths)
    kw = rt.flash_kwargs()
    assert set(kw) == {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}
    assert kw["cu_seqlens_q"].dtype == torch.int32 and kw["cu_seqlens_k"].dtype == torch.int32
    assert kw["cu_seqlens_q"].tolist() == _offsets(lengths) == kw["cu_seqlens_k"].tolist()
    assert kw["max_seqlen_q"] == 31 == kw["max_seqlen_k"]
    assert type(kw["max_seqlen_q"]) is int

    other = ragged.pack(_seqs([2, 9, 0, 4], seed=14))
    kw = rt.flash_kwargs(other)
    assert kw["cu_seqlens_q"].tolist() == _offsets(lengths)
    assert kw["cu_seqlens_k"].tolist() == _offsets([2, 9, 0, 4])
    assert kw["max_seqlen_q"] == 31 and kw["max_seqlen_k"] == 9


def test_cu_seqlens_from_int64_offsets():
    values = torch.randn(6, 2)
    rt = RaggedTensor.from_offsets(values, torch.tensor([0, 2, 6], dtype=torch.int64))
    cu = rt.cu_seqlens()
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 6]


@pytest.mark.parametrize("max_seqlen", [None, 4, 10])
def test_from_cu_seqlens(max_seqlen):
    lengths = [1, 4, 0, 3]
    values = torch.randn(8, 2, 2, generator=_gen(15))
    cu = torch.tensor(_offsets(lengths), dtype=torch.int32)
    rt = ragged.from_cu_seqlens(values, cu, max_seqlen)
    assert rt.values is values
    assert torch.equal(rt.offsets, cu) and rt.offsets.dtype == torch.int32
    assert rt.max_len == (4 if max_seqlen is None else max_seqlen)
    assert rt.host_lengths() == lengths
    back = ragged.from_cu_seqlens(values, rt.cu_seqlens(), rt.max_len)
    assert torch.equal(back.values, values) and back.max_len == rt.max_len


def test_from_cu_seqlens_validates():
    with pytest.raises(ValueError, match=r"ragged\.from_cu_seqlens\(\).*cu_seqlens\[-1\]"):
        ragged.from_cu_seqlens(torch.randn(5, 2), torch.tensor([0, 2, 4], dtype=torch.int32))


# --------------------------------------------------------------------------------------
# HuggingFace attention masks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("total_length", [None, 12])
def test_attention_mask_round_trip(backend, side, total_length):
    lengths = [5, 0, 9, 1]
    seqs = _seqs(lengths, (4,), seed=16)
    rt = ragged.pack(seqs)
    width = total_length or 9
    am = rt.attention_mask(total_length=total_length, padding_side=side)
    assert am.dtype == torch.int64 and am.shape == (4, width)
    for b, n in enumerate(lengths):
        row = [0] * (width - n) + [1] * n if side == "left" else [1] * n + [0] * (width - n)
        assert am[b].tolist() == row
    x = rt.to_padded(total_length=total_length, padding_side=side, padding_value=float("nan"), backend=backend)
    for got in (ragged.from_attention_mask(x, am, backend=backend), ragged.pack(x, attention_mask=am, backend=backend)):
        assert torch.equal(got.values, rt.values)
        assert torch.equal(got.offsets, rt.offsets)
        assert got.max_len == rt.max_len
        assert got.host_lengths() == lengths


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_mask_round_trip(backend, side):
    lengths = [3, 6, 0]
    rt = ragged.pack(_seqs(lengths, (2,), seed=17))
    pm = rt.padding_mask(padding_side=side)
    x = rt.to_padded(padding_side=side, padding_value=float("nan"), backend=backend)
    got = ragged.pack(x, mask=pm, backend=backend)
    assert torch.equal(got.values, rt.values) and got.host_lengths() == lengths
