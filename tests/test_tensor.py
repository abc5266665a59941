"""RaggedTensor: construction, metadata, views, conversions, serialisation.

Every expected value here is computed independently of ragged, with plain
per-sequence Python loops over the input tensors.
"""

import io
import re

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree

import ragged
from ragged import RaggedTensor
from ragged.utils import offsets_dtype_for


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _seqs(lengths, feat=(3,), dtype=torch.float32, seed=0):
    g = _gen(seed)
    return [torch.randn(n, *feat, generator=g).to(dtype) for n in lengths]


def _host_offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _loop_padded(seqs, width, feat, fill=0.0, side="right", dtype=torch.float32):
    out = torch.full((len(seqs), width, *feat), fill, dtype=dtype)
    for b, s in enumerate(seqs):
        n = s.shape[0]
        for j in range(n):
            out[b, j if side == "right" else width - n + j] = s[j]
    return out


def _assert_same_ragged(a, b):
    assert a.batch_size == b.batch_size
    assert a.max_len == b.max_len
    assert a.offsets.dtype == b.offsets.dtype
    assert torch.equal(a.offsets, b.offsets)
    assert a.values.dtype == b.values.dtype
    assert a.values.shape == b.values.shape
    assert torch.equal(a.values, b.values)


# --------------------------------------------------------------------------------------
# The example of the specification


def test_spec_example_properties():
    lengths = (5, 0, 31, 12)
    seqs = _seqs(lengths, feat=(768,), seed=11)
    rt = ragged.pack(seqs)
    assert isinstance(rt, RaggedTensor)
    assert rt.values.shape == (48, 768)
    assert torch.equal(rt.values, torch.cat(seqs))
    assert rt.offsets.dtype == torch.int32
    assert rt.offsets.device == rt.device == torch.device("cpu")
    assert rt.offsets.tolist() == [0, 5, 5, 36, 48]
    assert rt.lengths.device == rt.device
    assert rt.lengths.tolist() == list(lengths)
    assert type(rt.max_len) is int and rt.max_len == 31
    assert rt.batch_size == 4 and len(rt) == 4 and rt.num_tokens == 48
    assert rt.feature_shape == torch.Size([768])
    assert rt.dtype == torch.float32
    assert rt.requires_grad is False
    assert rt.is_cuda is False
    assert rt.host_lengths() == list(lengths)
    assert tuple(rt.host_offsets()) == (0, 5, 5, 36, 48)

    x = rt.to_padded()
    assert x.shape == (4, 31, 768)
    assert torch.equal(x, _loop_padded(seqs, 31, (768,)))
    assert torch.equal(ragged.unpack(rt), x)


@pytest.mark.parametrize("feat", [(), (4,), (2, 3), (2, 1, 3)])
def test_pack_list_any_feature_shape(feat):
    lengths = [3, 0, 1, 6]
    seqs = _seqs(lengths, feat=feat, seed=len(feat))
    rt = ragged.pack(seqs)
    assert rt.values.shape == (10, *feat)
    assert rt.feature_shape == torch.Size(feat)
    assert torch.equal(rt.values, torch.cat(seqs))
    assert rt.offsets.tolist() == _host_offsets(lengths)
    assert torch.equal(rt.to_padded(), _loop_padded(seqs, 6, feat))


def test_pack_list_accepts_tuple_and_keeps_grad():
    seqs = [s.requires_grad_() for s in _seqs([2, 4, 1], seed=3)]
    rt = ragged.pack(tuple(seqs))
    assert rt.requires_grad
    weights = torch.arange(rt.num_tokens, dtype=torch.float32)[:, None]
    (rt.values * weights).sum().backward()
    start = 0
    for s in seqs:
        n = s.shape[0]
        expected = torch.arange(start, start + n, dtype=torch.float32)[:, None].expand_as(s)
        assert torch.equal(s.grad, expected)
        start += n


# --------------------------------------------------------------------------------------
# from_lengths / from_offsets


@pytest.mark.parametrize("form", ["list", "tuple", "numpy32", "numpy64", "tensor32", "tensor64", "range"])
def test_from_lengths_host_forms(form):
    lengths = [4, 0, 2, 7, 1] if form != "range" else [0, 1, 2, 3, 4]
    make = {
        "list": list,
        "tuple": tuple,
        "numpy32": lambda v: np.asarray(v, dtype=np.int32),
        "numpy64": lambda v: np.asarray(v, dtype=np.int64),
        "tensor32": lambda v: torch.tensor(v, dtype=torch.int32),
        "tensor64": lambda v: torch.tensor(v, dtype=torch.int64),
        "range": lambda v: range(5),
    }[form]
    values = torch.randn(sum(lengths), 2, generator=_gen(5))
    rt = RaggedTensor.from_lengths(values, make(lengths))
    assert rt.values is values
    assert rt.offsets.dtype == torch.int32
    assert rt.offsets.tolist() == _host_offsets(lengths)
    assert rt.max_len == max(lengths)
    assert rt.lengths.tolist() == lengths
    assert rt.host_lengths() == lengths


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint16, np.uint64])
def test_from_lengths_numpy_arrays_match_lists(dtype):
    """Integer arrays take whole-array steps: the same offsets, max_len and host lengths as the
    list, an empty batch included, and the same error for a negative length."""
    rng = np.random.default_rng(11)
    for lengths in ([], [0], [3], rng.integers(0, 40, 57).tolist(), [0, 0, 5, 0]):
        values = torch.randn(sum(lengths), 3, generator=_gen(2))
        got = RaggedTensor.from_lengths(values, np.asarray(lengths, dtype=dtype))
        want = RaggedTensor.from_lengths(values, list(lengths))
        assert got.offsets.tolist() == want.offsets.tolist() and got.offsets.dtype == want.offsets.dtype
        assert got.max_len == want.max_len and got.host_lengths() == want.host_lengths() == list(lengths)
        assert all(type(n) is int for n in got.host_lengths())
    if np.issubdtype(dtype, np.signedinteger):
        values = torch.randn(4, 3)
        with pytest.raises(ValueError, match=r"from_lengths\(\): expected lengths >= 0, got lengths\[1\] = -2"):
            RaggedTensor.from_lengths(values, np.asarray([3, -2, 3], dtype=dtype))
        with pytest.raises(ValueError, match=r"expected lengths >= 0, got lengths\[1\] = -2"):
            RaggedTensor.from_lengths(values, [3, -2, 3])


def test_from_lengths_max_len_override():
    values = torch.randn(6, 2, generator=_gen(1))
    rt = RaggedTensor.from_lengths(values, [2, 4], max_len=9)
    assert rt.max_len == 9
    padded = rt.to_padded()
    assert padded.shape == (2, 9, 2)
    assert torch.equal(padded, _loop_padded([values[:2], values[2:]], 9, (2,)))


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_from_offsets_computes_max_len(offsets_dtype):
    lengths = [3, 0, 8, 2]
    values = torch.randn(13, 2, 2, generator=_gen(2))
    offsets = torch.tensor(_host_offsets(lengths), dtype=offsets_dtype)
    rt = RaggedTensor.from_offsets(values, offsets)
    assert rt.values is values
    assert rt.offsets is offsets
    assert rt.max_len == 8
    assert rt.batch_size == 4
    assert rt.lengths.tolist() == lengths
    assert rt.host_lengths() == lengths
    assert torch.equal(rt.to_padded(), _loop_padded(list(values.split(lengths)), 8, (2, 2)))


def test_from_offsets_with_max_len():
    values = torch.randn(5, 1, generator=_gen(3))
    offsets = torch.tensor([0, 1, 5], dtype=torch.int32)
    rt = RaggedTensor.from_offsets(values, offsets, max_len=7)
    assert rt.max_len == 7
    assert rt.to_padded().shape == (2, 7, 1)
    rt = RaggedTensor.from_offsets(values, offsets, 4)
    assert rt.max_len == 4


def test_from_offsets_validate_false_trusts_its_arguments():
    values = torch.randn(5, 1, generator=_gen(4))
    offsets = torch.tensor([0, 1, 5], dtype=torch.int32)
    rt = RaggedTensor.from_offsets(values, offsets, max_len=4, validate=False)
    assert rt.max_len == 4 and rt.offsets is offsets and rt.values is values
    assert rt.host_lengths() == [1, 4]
    # validate=False without max_len still has to find max_len (and checks the offsets).
    rt = RaggedTensor.from_offsets(values, offsets, validate=False)
    assert rt.max_len == 4


@pytest.mark.parametrize("bad", [[1, 2, 5], [0, 3, 2, 5], [0, 2, 4]])
def test_from_offsets_validate_rejects(bad):
    values = torch.randn(5, 1)
    with pytest.raises(ValueError, match=r"from_offsets.*offsets"):
        RaggedTensor.from_offsets(values, torch.tensor(bad, dtype=torch.int32))


# --------------------------------------------------------------------------------------
# repr


def test_repr_small_batch():
    rt = ragged.pack(_seqs([5, 0, 31, 12], feat=(768,)))
    text = repr(rt)
    assert text.startswith("RaggedTensor(")
    assert "batch_size=4" in text
    for n in ("5", "0", "31", "12"):
        assert n in text
    assert "768" in text
    assert "float32" in text
    assert "cpu" in text
    assert "\n" not in text and len(text) < 200


def test_repr_large_batch_is_short():
    lengths = [(7 * i) % 50 for i in range(1000)]
    rt = RaggedTensor.from_lengths(torch.zeros(sum(lengths), 2, 3, dtype=torch.bfloat16), lengths)
    text = repr(rt)
    assert "batch_size=1000" in text
    assert "bfloat16" in text and "cpu" in text
    assert "(2, 3)" in text
    assert str(max(lengths)) in text and str(min(lengths)) in text
    assert len(text) < 300


def test_repr_without_host_offsets_and_empty():
    values = torch.randn(5, 2)
    rt = RaggedTensor.from_offsets(values, torch.tensor([0, 2, 5], dtype=torch.int32), max_len=3, validate=False)
    text = repr(rt)
    assert "batch_size=2" in text and re.search(r"\b3\b", text) and "(2,)" in text
    empty = RaggedTensor.from_lengths(torch.randn(0, 4), [])
    text = repr(empty)
    assert "batch_size=0" in text and "(4,)" in text


# --------------------------------------------------------------------------------------
# unbind / __getitem__ / with_values


def test_unbind_views():
    lengths = [2, 0, 5, 1]
    seqs = _seqs(lengths, feat=(2, 2), seed=8)
    rt = ragged.pack(seqs)
    parts = rt.unbind()
    assert isinstance(parts, tuple) and len(parts) == 4
    base = rt.values.untyped_storage().data_ptr()
    for part, s in zip(parts, seqs):
        assert part.shape == s.shape
        assert torch.equal(part, s)
        assert part.untyped_storage().data_ptr() == base
    assert RaggedTensor.from_lengths(torch.randn(0, 3), []).unbind() == ()


def test_getitem_ints():
    lengths = [2, 0, 5, 1]
    seqs = _seqs(lengths, seed=9)
    rt = ragged.pack(seqs)
    for i in range(4):
        assert torch.equal(rt[i], seqs[i])
        assert torch.equal(rt[i - 4], seqs[i])
        assert torch.equal(rt[np.int64(i)], seqs[i])
    assert rt[1].shape == (0, 3)
    for bad in (4, -5, 100):
        with pytest.raises(IndexError):
            rt[bad]
    with pytest.raises(TypeError):
        rt[1.0]


@pytest.mark.parametrize(
    "index",
    [
        slice(None),
        slice(1, 3),
        slice(0, 1),
        slice(-2, None),
        slice(None, -1),
        slice(2, 2),
        slice(3, 1),
        slice(10, 20),
        slice(-100, 2),
        slice(1, None, 1),
    ],
)
def test_getitem_slices(index):
    lengths = [2, 0, 5, 1, 3]
    seqs = _seqs(lengths, feat=(2,), seed=10)
    rt = ragged.pack(seqs)
    sub = rt[index]
    assert isinstance(sub, RaggedTensor)
    chosen = seqs[index]
    sub_lengths = [s.shape[0] for s in chosen]
    assert sub.batch_size == len(chosen)
    assert sub.offsets.tolist() == _host_offsets(sub_lengths)
    assert sub.max_len == max(sub_lengths, default=0)
    assert sub.values.shape == (sum(sub_lengths), 2)
    if chosen:
        assert torch.equal(sub.values, torch.cat(chosen))
    assert sub.host_lengths() == sub_lengths
    assert torch.equal(sub.to_padded(), _loop_padded(chosen, sub.max_len, (2,)))


def test_getitem_slice_step_rejected():
    rt = ragged.pack(_seqs([1, 2, 3]))
    with pytest.raises(ValueError, match="step"):
        rt[::2]


def test_with_values():
    lengths = [3, 0, 2]
    rt = ragged.pack(_seqs(lengths, feat=(4,), seed=12))
    new = torch.randn(5, 2, 2, dtype=torch.float64, generator=_gen(13))
    out = rt.with_values(new)
    assert out.values is new
    assert out.offsets is rt.offsets
    assert out.max_len == rt.max_len
    assert out.feature_shape == (2, 2) and out.dtype == torch.float64
    assert torch.equal(out.to_padded(), _loop_padded(list(new.split(lengths)), 3, (2, 2), dtype=torch.float64))
    assert rt.values.shape == (5, 4)  # the original is untouched


# --------------------------------------------------------------------------------------
# to / dtype shortcuts / device moves


@pytest.mark.parametrize(
    "method,dtype",
    [("half", torch.float16), ("bfloat16", torch.bfloat16), ("float", torch.float32), ("double", torch.float64)],
)
def test_dtype_shortcuts(method, dtype):
    rt = ragged.pack(_seqs([3, 0, 4], dtype=torch.float64, seed=14))
    out = getattr(rt, method)()
    assert out.dtype == dtype
    assert torch.equal(out.values, rt.values.to(dtype))
    assert out.offsets.dtype == torch.int32
    assert torch.equal(out.offsets, rt.offsets)
    assert out.max_len == rt.max_len


def test_to_dtype_and_device():
    rt = ragged.pack(_seqs([3, 0, 4], seed=15))
    out = rt.to(torch.float16)
    assert out.dtype == torch.float16 and out.offsets.dtype == torch.int32
    out = rt.to(dtype=torch.int64)
    assert out.dtype == torch.int64 and torch.equal(out.offsets, rt.offsets)
    out = rt.to("cpu", torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.device.type == "cpu"
    cpu = rt.cpu()
    assert cpu.device.type == "cpu" and torch.equal(cpu.values, rt.values)
    meta = rt.to("meta")
    assert meta.device.type == "meta" and meta.offsets.device.type == "meta"
    assert meta.offsets.dtype == torch.int32
    assert meta.max_len == 4 and meta.batch_size == 3 and meta.num_tokens == 7
    meta = rt.to(device="meta", dtype=torch.float16)
    assert meta.values.device.type == "meta" and meta.offsets.device.type == "meta"
    assert meta.dtype == torch.float16


@pytest.mark.gpu
def test_cuda_round_trip():
    rt = ragged.pack(_seqs([3, 0, 4], seed=16))
    gpu = rt.cuda()
    assert gpu.is_cuda and gpu.offsets.is_cuda and gpu.offsets.dtype == torch.int32
    back = gpu.cpu()
    _assert_same_ragged(back, rt)


@pytest.mark.gpu
def test_pin_memory_keeps_the_sequences():
    rt = ragged.pack(_seqs([3, 0, 5], seed=18))
    pinned = rt.pin_memory()
    assert pinned.values.is_pinned() and pinned.offsets.is_pinned()
    assert pinned.max_len == rt.max_len and pinned.host_offsets() == rt.host_offsets()
    _assert_same_ragged(pinned.to("cuda", non_blocking=True).cpu(), rt)


def test_clone_and_detach():
    rt = ragged.pack([s.requires_grad_() for s in _seqs([2, 3], seed=17)])
    c = rt.clone()
    assert c.values.data_ptr() != rt.values.data_ptr()
    assert torch.equal(c.values, rt.values) and torch.equal(c.offsets, rt.offsets)
    d = rt.detach()
    assert not d.requires_grad and rt.requires_grad


# --------------------------------------------------------------------------------------
# Per-token metadata


def _loop_padding_mask(lengths, width, side):
    mask = torch.ones(len(lengths), width, dtype=torch.bool)
    for b, n in enumerate(lengths):
        for j in range(n):
            mask[b, j if side == "right" else width - n + j] = False
    return mask


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("total_length", [None, 9])
def test_padding_and_attention_mask(side, total_length):
    lengths = [3, 0, 7, 1]
    rt = RaggedTensor.from_lengths(torch.randn(11, 2), lengths)
    width = total_length or 7
    expected = _loop_padding_mask(lengths, width, side)
    pm = rt.padding_mask(total_length=total_length, padding_side=side)
    assert pm.dtype == torch.bool and pm.shape == (4, width)
    assert torch.equal(pm, expected)
    am = rt.attention_mask(total_length=total_length, padding_side=side)
    assert am.dtype == torch.int64
    assert torch.equal(am, (~expected).long())
    am = rt.attention_mask(total_length, side, dtype=torch.float32)
    assert am.dtype == torch.float32 and torch.equal(am, (~expected).float())


def test_padding_mask_matches_to_padded():
    lengths = [4, 1, 0, 2]
    rt = RaggedTensor.from_lengths(torch.rand(7, 3) + 1.0, lengths)  # strictly positive
    for side in ("right", "left"):
        padded = rt.to_padded(padding_value=0.0, padding_side=side)
        assert torch.equal(rt.padding_mask(padding_side=side), (padded == 0).all(-1))


@pytest.mark.parametrize("lengths", [[3, 0, 4, 1], [0, 0], [], [5]])
def test_position_and_seq_ids(lengths):
    rt = RaggedTensor.from_lengths(torch.randn(sum(lengths), 2), lengths)
    positions, seq = [], []
    for b, n in enumerate(lengths):
        for j in range(n):
            positions.append(j)
            seq.append(b)
    pos = rt.position_ids()
    sid = rt.seq_ids()
    assert pos.dtype == torch.int64 and sid.dtype == torch.int64
    assert pos.tolist() == positions
    assert sid.tolist() == seq
    assert rt.position_ids(dtype=torch.int32).dtype == torch.int32
    assert rt.position_ids(dtype=torch.int32).tolist() == positions
    assert rt.seq_ids(dtype=torch.int32).dtype == torch.int32
    assert rt.seq_ids(dtype=torch.int32).tolist() == seq


# --------------------------------------------------------------------------------------
# Serialisation and pytree


def _round_trip(obj, **load_kwargs):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, **load_kwargs)


@pytest.mark.parametrize("load_kwargs", [{}, {"weights_only": True}, {"weights_only": False}])
def test_save_load_round_trip(load_kwargs):
    lengths = [3, 0, 6, 2]
    rt = ragged.pack(_seqs(lengths, feat=(2, 3), dtype=torch.bfloat16, seed=18))
    back = _round_trip(rt, **load_kwargs)
    assert isinstance(back, RaggedTensor)
    _assert_same_ragged(back, rt)
    assert back.host_lengths() == lengths
    assert repr(back) == repr(rt)
    assert torch.equal(back.to_padded(), rt.to_padded())


def test_save_load_in_containers_and_without_host_offsets():
    a = ragged.pack(_seqs([1, 2], seed=19))
    b = RaggedTensor.from_offsets(
        torch.randn(5, 2), torch.tensor([0, 2, 5], dtype=torch.int32), max_len=3, validate=False
    )
    empty = RaggedTensor.from_lengths(torch.randn(0, 2), [])
    back = _round_trip({"a": a, "list": [b, empty], "n": 3})
    assert back["n"] == 3
    _assert_same_ragged(back["a"], a)
    _assert_same_ragged(back["list"][0], b)
    _assert_same_ragged(back["list"][1], empty)
    assert back["list"][0].host_lengths() == [2, 3]


def test_pytree_flatten_unflatten():
    lengths = [2, 0, 3]
    rt = ragged.pack(_seqs(lengths, seed=20))
    leaves, spec = pytree.tree_flatten(rt)
    assert len(leaves) == 2
    assert any(leaf is rt.values for leaf in leaves)
    assert any(leaf is rt.offsets for leaf in leaves)
    back = pytree.tree_unflatten(leaves, spec)
    assert isinstance(back, RaggedTensor)
    _assert_same_ragged(back, rt)
    assert back.host_lengths() == lengths

    tree = {"x": rt, "y": [torch.ones(2), rt]}
    leaves, spec = pytree.tree_flatten(tree)
    assert len(leaves) == 5
    mapped = pytree.tree_map(lambda t: t * 2 if t.is_floating_point() else t, tree)
    assert isinstance(mapped["x"], RaggedTensor) and isinstance(mapped["y"][1], RaggedTensor)
    assert torch.equal(mapped["x"].values, rt.values * 2)
    assert torch.equal(mapped["x"].offsets, rt.offsets)
    assert mapped["x"].max_len == rt.max_len


# --------------------------------------------------------------------------------------
# int32 / int64 offsets


def test_offsets_dtype_for_boundary():
    assert offsets_dtype_for(0) == torch.int32
    assert offsets_dtype_for(2**31 - 1) == torch.int32
    assert offsets_dtype_for(2**31) == torch.int64
    assert offsets_dtype_for(2**40) == torch.int64


def test_int64_switch_from_lengths_meta():
    values = torch.empty(2**31 + 5, 1, device="meta")
    rt = RaggedTensor.from_lengths(values, [2**31, 5])
    assert rt.offsets.dtype == torch.int64
    assert rt.offsets.device.type == "meta"
    assert rt.max_len == 2**31
    assert rt.num_tokens == 2**31 + 5
    assert rt.host_lengths() == [2**31, 5]
    with pytest.raises(ValueError, match="cu_seqlens"):
        rt.cu_seqlens()


def test_int32_right_at_the_limit_meta():
    values = torch.empty(2**31 - 1, device="meta")
    rt = RaggedTensor.from_lengths(values, [2**31 - 2, 1])
    assert rt.offsets.dtype == torch.int32


def test_int64_switch_pack_list_and_padded_meta():
    rt = ragged.pack([torch.empty(2**31, 1, device="meta"), torch.empty(5, 1, device="meta")])
    assert rt.offsets.dtype == torch.int64
    assert rt.num_tokens == 2**31 + 5
    rt = ragged.pack(torch.empty(2, 2**31, device="meta"), lengths=[2**31, 5])
    assert rt.offsets.dtype == torch.int64
    assert rt.values.shape == (2**31 + 5,)
    small = ragged.pack(torch.empty(2, 4, device="meta"), lengths=[4, 3])
    assert small.offsets.dtype == torch.int32


# --------------------------------------------------------------------------------------
# B = 0 and all-zero lengths


def test_empty_batch_from_list():
    rt = ragged.pack([])
    assert rt.batch_size == 0 and len(rt) == 0 and rt.num_tokens == 0
    assert rt.max_len == 0
    assert rt.offsets.tolist() == [0] and rt.offsets.dtype == torch.int32
    assert rt.lengths.shape == (0,)
    assert rt.unbind() == ()
    assert rt.to_padded().shape[:2] == (0, 0)
    assert rt.padding_mask().shape == (0, 0)
    assert rt.position_ids().shape == (0,)
    assert rt.seq_ids().shape == (0,)
    assert "batch_size=0" in repr(rt)


def test_empty_batch_from_lengths():
    rt = RaggedTensor.from_lengths(torch.randn(0, 2, 3), [])
    assert rt.batch_size == 0 and rt.num_tokens == 0 and rt.max_len == 0
    assert rt.feature_shape == (2, 3)
    assert rt.to_padded().shape == (0, 0, 2, 3)
    assert rt.to_padded(total_length=4).shape == (0, 4, 2, 3)
    assert rt.padding_mask(total_length=4).shape == (0, 4)
    assert rt.attention_mask().shape == (0, 0)
    assert rt[0:0].batch_size == 0
    with pytest.raises(IndexError):
        rt[0]
    _assert_same_ragged(_round_trip(rt), rt)


def test_all_zero_lengths():
    rt = RaggedTensor.from_lengths(torch.randn(0, 3), [0, 0, 0])
    assert rt.batch_size == 3 and rt.num_tokens == 0 and rt.max_len == 0
    assert rt.offsets.tolist() == [0, 0, 0, 0]
    assert rt.lengths.tolist() == [0, 0, 0]
    assert rt.to_padded().shape == (3, 0, 3)
    padded = rt.to_padded(padding_value=-2.5, total_length=2)
    assert torch.equal(padded, torch.full((3, 2, 3), -2.5))
    assert torch.equal(rt.padding_mask(total_length=2), torch.ones(3, 2, dtype=torch.bool))
    assert [t.shape for t in rt.unbind()] == [(0, 3)] * 3
    assert rt.position_ids().shape == (0,)
    back = ragged.pack(torch.randn(3, 2, 3), lengths=[0, 0, 0])
    _assert_same_ragged(back, rt)


def test_known_host_offsets_reads_nothing_and_remember_checks():
    values = torch.randn(7, 3)
    offsets = torch.tensor([0, 2, 2, 7])
    rt = ragged.RaggedTensor.from_offsets(values, offsets, 5, validate=False)  # nothing read
    assert rt.known_host_offsets is None
    with pytest.raises(ValueError, match=r"remember_host_offsets\(\): expected 4 offsets, got 3"):
        rt.remember_host_offsets([0, 2, 7])
    with pytest.raises(ValueError, match="remember_host_offsets"):
        rt.remember_host_offsets([0, 2, 2, 6])  # does not end at the 7 tokens
    assert rt.known_host_offsets is None  # a refused call leaves nothing
    rt.remember_host_offsets(torch.tensor([0, 2, 2, 7]).tolist())
    assert rt.known_host_offsets == (0, 2, 2, 7) and rt.host_lengths() == [2, 0, 5]
    fresh = ragged.RaggedTensor.from_offsets(values, offsets, 5, validate=False)
    assert fresh.host_offsets() == (0, 2, 2, 7) and fresh.known_host_offsets == (0, 2, 2, 7)
