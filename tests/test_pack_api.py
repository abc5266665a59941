"""ragged.pack / ragged.unpack / RaggedTensor.to_padded against per-sequence loops.

Each case runs on every backend that can take CPU tensors here (see
``conftest.cpu_backends``). The expected outputs are built with Python loops over the
sequences, never with ragged itself.
"""

import math
import warnings
import zlib

import pytest
import torch
from conftest import cpu_backends

import ragged
from ragged import RaggedTensor

BACKENDS = cpu_backends()

LENGTH_CASES = {
    "mixed": [5, 0, 31, 12],
    "single1": [1],
    "single0": [0],
    "odd": [7, 97, 1, 0, 3],
    "one_long": [1, 200, 2],
    "all_equal": [4, 4, 4],
}
FEATURES = {"T": (), "TF": (6,), "THD": (3, 4)}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _random(shape, dtype=torch.float32, seed=0):
    g = _gen(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, shape, generator=g, dtype=torch.int64).to(dtype)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _loop_pack(x, lengths, side="right"):
    width = x.shape[1]
    rows = []
    for b, n in enumerate(lengths):
        rows.append(x[b, :n] if side == "right" else x[b, width - n :])
    if not rows:
        return x.new_empty((0, *x.shape[2:]))
    return torch.cat(rows)


def _loop_unpack(values, lengths, width, fill=0.0, side="right"):
    out = torch.empty((len(lengths), width, *values.shape[1:]), dtype=values.dtype)
    t = 0
    for b, n in enumerate(lengths):
        start = 0 if side == "right" else width - n
        for j in range(width):
            if start <= j < start + n:
                out[b, j] = values[t]
                t += 1
            else:
                out[b, j] = fill
    assert t == values.shape[0]
    return out


def _offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _poisoned_padded(lengths, width, feat, side, seed, dtype=torch.float32, poison=float("nan")):
    """A padded batch with random tokens and ``poison`` at every padding position."""
    x = _random((len(lengths), width, *feat), dtype, seed)
    for b, n in enumerate(lengths):
        if side == "right":
            x[b, n:] = poison
        else:
            x[b, : width - n] = poison
    return x


# --------------------------------------------------------------------------------------
# pack from a padded batch with host lengths


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(LENGTH_CASES))
@pytest.mark.parametrize("feat", list(FEATURES))
@pytest.mark.parametrize("side", ["right", "left"])
def test_pack_lengths_matches_loop(backend, case, feat, side):
    lengths = LENGTH_CASES[case]
    shape = FEATURES[feat]
    width = max(lengths) + 2
    seed = zlib.crc32(f"{case}/{feat}/{side}".encode())
    x = _poisoned_padded(lengths, width, shape, side, seed)
    rt = ragged.pack(x, lengths=lengths, padding_side=side, backend=backend)
    expected = _loop_pack(x, lengths, side)
    assert rt.values.shape == (sum(lengths), *shape)
    assert torch.equal(rt.values, expected)
    assert not torch.isnan(rt.values).any()
    assert rt.offsets.dtype == torch.int32
    assert rt.offsets.tolist() == _offsets(lengths)
    assert rt.max_len == max(lengths)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(LENGTH_CASES))
@pytest.mark.parametrize("feat", list(FEATURES))
@pytest.mark.parametrize("side", ["right", "left"])
def test_unpack_matches_loop(backend, case, feat, side):
    lengths = LENGTH_CASES[case]
    shape = FEATURES[feat]
    seed = zlib.crc32(f"{case}/{feat}/{side}/u".encode())
    values = _random((sum(lengths), *shape), seed=seed)
    rt = RaggedTensor.from_lengths(values, lengths)
    width = max(lengths)
    got = rt.to_padded(padding_side=side, backend=backend)
    assert got.shape == (len(lengths), width, *shape)
    assert torch.equal(got, _loop_unpack(values, lengths, width, 0.0, side))
    got = ragged.unpack(rt, padding_value=-3.0, total_length=width + 3, padding_side=side, backend=backend)
    assert torch.equal(got, _loop_unpack(values, lengths, width + 3, -3.0, side))


@pytest.mark.parametrize("backend", BACKENDS)
def test_unpack_and_to_padded_agree(backend):
    rt = ragged.pack([_random((n, 2), seed=n) for n in (3, 0, 5)])
    for kwargs in ({}, {"padding_value": 7.0}, {"total_length": 8}, {"padding_side": "left"}):
        assert torch.equal(ragged.unpack(rt, backend=backend, **kwargs), rt.to_padded(backend=backend, **kwargs))


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_without_lengths_takes_full_rows(backend):
    x = _random((3, 5, 2), seed=1)
    rt = ragged.pack(x, backend=backend)
    assert rt.lengths.tolist() == [5, 5, 5]
    assert torch.equal(rt.values, x.reshape(15, 2))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["list", "tuple", "numpy", "tensor"])
def test_pack_lengths_forms(backend, form):
    import numpy as np

    lengths = [2, 0, 4]
    make = {"list": list, "tuple": tuple, "numpy": np.asarray, "tensor": torch.tensor}[form]
    x = _random((3, 4, 3), seed=2)
    rt = ragged.pack(x, lengths=make(lengths), backend=backend)
    assert torch.equal(rt.values, _loop_pack(x, lengths))
    assert rt.host_lengths() == lengths


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_unpack_round_trip_restores_padded(backend):
    lengths = [7, 97, 1, 0, 3]
    x = _random((5, 97, 4), seed=3)
    for side in ("right", "left"):
        rt = ragged.pack(x, lengths=lengths, padding_side=side, backend=backend)
        back = rt.to_padded(padding_value=0.0, padding_side=side, backend=backend)
        mask = torch.zeros(5, 97, dtype=torch.bool)
        for b, n in enumerate(lengths):
            if side == "right":
                mask[b, :n] = True
            else:
                mask[b, 97 - n :] = True
        assert torch.equal(back[mask], x[mask])
        assert torch.equal(back[~mask], torch.zeros_like(x[~mask]))


# --------------------------------------------------------------------------------------
# Padding value, total_length, dtypes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_value_nan(backend, side):
    lengths = [3, 0, 5, 1]
    values = _random((9, 2), seed=4)
    rt = RaggedTensor.from_lengths(values, lengths)
    got = rt.to_padded(padding_value=float("nan"), padding_side=side, backend=backend)
    expected = _loop_unpack(values, lengths, 5, float("nan"), side)
    assert torch.equal(torch.isnan(got), torch.isnan(expected))
    assert torch.isnan(got).all(-1).sum() == 4 * 5 - 9
    assert torch.isnan(got).any(-1).sum() == 4 * 5 - 9
    real = ~torch.isnan(expected)
    assert torch.equal(got[real], expected[real])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_total_length(backend, side):
    lengths = [2, 4, 0]
    values = _random((6, 3), seed=5)
    rt = RaggedTensor.from_lengths(values, lengths)
    got = rt.to_padded(total_length=9, padding_side=side, padding_value=1.5, backend=backend)
    assert got.shape == (3, 9, 3)
    assert torch.equal(got, _loop_unpack(values, lengths, 9, 1.5, side))
    same = rt.to_padded(total_length=4, padding_side=side, backend=backend)
    assert torch.equal(same, rt.to_padded(padding_side=side, backend=backend))


DTYPE_PADDING = [
    (torch.float32, [0.0, -1.25, 0.1, float("inf"), -7.0]),
    (torch.float16, [0.0, -1.25, 0.1, float("-inf"), 3.0]),
    (torch.bfloat16, [0.0, -1.25, 0.1, 1e30, 3.0]),
    (torch.float64, [0.0, -1.25, 0.1, 1e-300, 1 / 3]),
    (torch.int64, [0, -1, 7, 123456789, -100]),
    (torch.bool, [False, True]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,fills", DTYPE_PADDING, ids=[str(d).split(".")[1] for d, _ in DTYPE_PADDING])
def test_dtypes_pack_unpack_exact(backend, dtype, fills):
    lengths = [3, 0, 6, 1]
    width = 8
    for k, fill in enumerate(fills):
        x = _random((4, width, 5), dtype, seed=10 + k)
        for side in ("right", "left"):
            rt = ragged.pack(x, lengths=lengths, padding_side=side, backend=backend)
            assert rt.dtype == dtype
            assert torch.equal(rt.values, _loop_pack(x, lengths, side))
            got = rt.to_padded(padding_value=fill, total_length=width, padding_side=side, backend=backend)
            assert got.dtype == dtype
            expected = _loop_unpack(rt.values, lengths, width, fill, side)
            assert torch.equal(got, expected), (dtype, fill, side)
            # The padding is exactly padding_value as that dtype holds it.
            pad = torch.ones(4, width, dtype=torch.bool)
            for b, n in enumerate(lengths):
                if side == "right":
                    pad[b, :n] = False
                else:
                    pad[b, width - n :] = False
            want = torch.tensor(fill, dtype=dtype)
            assert (got[pad] == want).all(), (dtype, fill, side, got[pad].unique())


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_poison_never_reaches_values(backend):
    lengths = [7, 0, 1, 12, 5]
    for feat in ((), (4,), (2, 3)):
        for side in ("right", "left"):
            x = _poisoned_padded(lengths, 13, feat, side, seed=len(feat))
            rt = ragged.pack(x, lengths=lengths, padding_side=side, backend=backend)
            assert not torch.isnan(rt.values).any()
            assert torch.equal(rt.values, _loop_pack(x, lengths, side))


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    lengths = [3, 0, 5]
    big = _random((3, 12, 4, 6), seed=7)
    x = big[:, ::2, :, ::2]  # strided tokens and strided features
    assert not x.is_contiguous()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rt = ragged.pack(x, lengths=lengths, backend=backend)
    assert torch.equal(rt.values, _loop_pack(x, lengths))
    xt = big[:, :6, 0].transpose(1, 2).transpose(1, 2)  # contiguous features, strided batch
    rt = ragged.pack(xt, lengths=lengths, backend=backend)
    assert torch.equal(rt.values, _loop_pack(xt, lengths))
    values = _random((8, 6, 2), seed=8).transpose(1, 2)
    rt = RaggedTensor.from_lengths(values, lengths)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = rt.to_padded(backend=backend)
    assert torch.equal(got, _loop_unpack(values, lengths, 5))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_and_zero_lengths(backend):
    x = _random((0, 4, 3), seed=9)
    rt = ragged.pack(x, lengths=[], backend=backend)
    assert rt.batch_size == 0 and rt.values.shape == (0, 3) and rt.offsets.tolist() == [0]
    assert rt.to_padded(backend=backend).shape == (0, 0, 3)
    assert rt.to_padded(total_length=4, backend=backend).shape == (0, 4, 3)
    x = _random((3, 4, 3), seed=10)
    rt = ragged.pack(x, lengths=[0, 0, 0], backend=backend)
    assert rt.values.shape == (0, 3) and rt.max_len == 0
    assert torch.equal(rt.to_padded(total_length=4, padding_value=2.0, backend=backend), torch.full((3, 4, 3), 2.0))
    x = _random((2, 0, 3), seed=11)
    rt = ragged.pack(x, lengths=[0, 0], backend=backend)
    assert rt.values.shape == (0, 3)
    rt = ragged.pack(_random((2, 3, 0), seed=12), lengths=[1, 3], backend=backend)
    assert rt.values.shape == (4, 0)
    assert rt.to_padded(backend=backend).shape == (2, 3, 0)


# --------------------------------------------------------------------------------------
# pack from masks


def _right_mask(lengths, width):
    keep = torch.zeros(len(lengths), width, dtype=torch.bool)
    for b, n in enumerate(lengths):
        keep[b, :n] = True
    return keep


def _left_mask(lengths, width):
    keep = torch.zeros(len(lengths), width, dtype=torch.bool)
    for b, n in enumerate(lengths):
        keep[b, width - n :] = True
    return keep


MASK_LENGTHS = [[3, 0, 6, 1, 6], [1], [0, 0], [4, 4]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths", MASK_LENGTHS, ids=str)
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("kind", ["bool", "float_neg_inf"])
def test_pack_from_key_padding_mask(backend, lengths, side, kind):
    width = max(lengths) + 1
    keep = _right_mask(lengths, width) if side == "right" else _left_mask(lengths, width)
    x = _poisoned_padded(lengths, width, (3,), side, seed=sum(lengths))
    if kind == "bool":
        mask = ~keep
    else:
        mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    rt = ragged.pack(x, mask=mask, backend=backend)
    assert torch.equal(rt.values, _loop_pack(x, lengths, side))
    assert rt.offsets.tolist() == _offsets(lengths)
    assert rt.max_len == max(lengths)
    assert torch.equal(
        rt.to_padded(total_length=width, padding_side=side, backend=backend),
        torch.where(keep[..., None], x, torch.zeros(())),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths", MASK_LENGTHS, ids=str)
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.int32, torch.bool, torch.float32])
def test_pack_from_attention_mask(backend, lengths, side, mask_dtype):
    width = max(lengths) + 2
    keep = _right_mask(lengths, width) if side == "right" else _left_mask(lengths, width)
    x = _poisoned_padded(lengths, width, (2, 2), side, seed=7 * sum(lengths))
    am = keep.to(mask_dtype)
    rt = ragged.pack(x, attention_mask=am, backend=backend)
    assert torch.equal(rt.values, _loop_pack(x, lengths, side))
    assert rt.host_lengths() == lengths
    assert rt.max_len == max(lengths)
    assert torch.equal(ragged.from_attention_mask(x, am, backend=backend).values, rt.values)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_attention_mask_explicit_side(backend):
    lengths = [2, 5, 1]
    x = _random((3, 5, 2), seed=13)
    rt = ragged.pack(x, attention_mask=_left_mask(lengths, 5).long(), padding_side="left", backend=backend)
    assert torch.equal(rt.values, _loop_pack(x, lengths, "left"))
    rt = ragged.pack(x, attention_mask=_right_mask(lengths, 5).long(), padding_side="right", backend=backend)
    assert torch.equal(rt.values, _loop_pack(x, lengths, "right"))


@pytest.fixture
def fresh_warnings(monkeypatch):
    """The scattered-mask warning is issued once per process; start each test afresh."""
    import ragged.utils

    monkeypatch.setattr(ragged.utils, "_warned", set())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arg", ["mask", "attention_mask"])
def test_pack_mask_with_holes(backend, arg, fresh_warnings):
    keep = torch.tensor(
        [
            [1, 0, 1, 1, 0, 0],
            [0, 1, 0, 0, 0, 1],
            [0, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 1],
            [0, 0, 1, 0, 1, 0],
        ],
        dtype=torch.bool,
    )
    x = _random((5, 6, 3), seed=14)
    x[~keep] = float("nan")
    rows, lengths = [], []
    for b in range(5):
        picked = [x[b, j] for j in range(6) if keep[b, j]]
        lengths.append(len(picked))
        rows.extend(picked)
    expected = torch.stack(rows)
    kwargs = {"mask": ~keep} if arg == "mask" else {"attention_mask": keep.long()}
    with pytest.warns(UserWarning):
        rt = ragged.pack(x, backend=backend, **kwargs)
    assert torch.equal(rt.values, expected)
    assert rt.host_lengths() == lengths
    assert rt.offsets.tolist() == _offsets(lengths)
    assert rt.max_len == max(lengths)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_mask_mixed_sides(backend, fresh_warnings):
    """Some rows right-padded and some left-padded: still the right tokens."""
    keep = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    x = _random((3, 4, 2), seed=15)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rt = ragged.pack(x, attention_mask=keep.long(), backend=backend)
    expected = torch.cat([x[0, :2], x[1, 2:], x[2, :3]])
    assert torch.equal(rt.values, expected)
    assert rt.host_lengths() == [2, 2, 3]


# --------------------------------------------------------------------------------------
# Autograd


def _right_or_left_mask(lengths, width, side):
    return _right_mask(lengths, width) if side == "right" else _left_mask(lengths, width)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_gradcheck_pack(backend, side):
    lengths = [3, 0, 4, 1]
    x = _random((4, 5, 2), torch.float64, seed=16).requires_grad_()
    fn = lambda t: ragged.pack(t, lengths=lengths, padding_side=side, backend=backend).values
    assert torch.autograd.gradcheck(fn, (x,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_gradcheck_unpack(backend, side):
    lengths = [3, 0, 4, 1]
    v = _random((8, 2), torch.float64, seed=17).requires_grad_()
    fn = lambda t: RaggedTensor.from_lengths(t, lengths).to_padded(
        padding_value=2.0, total_length=6, padding_side=side, backend=backend
    )
    assert torch.autograd.gradcheck(fn, (v,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradgradcheck_pack_and_unpack(backend):
    lengths = [2, 0, 3]
    x = _random((3, 3, 2), torch.float64, seed=18).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: ragged.pack(t, lengths=lengths, backend=backend).values, (x,))
    v = _random((5, 2), torch.float64, seed=19).requires_grad_()
    assert torch.autograd.gradgradcheck(
        lambda t: RaggedTensor.from_lengths(t, lengths).to_padded(backend=backend), (v,)
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_pack_gradient_zero_at_padding(backend, side):
    lengths = [3, 0, 5, 1]
    width = 6
    x = _random((4, width, 3), seed=20).requires_grad_()
    rt = ragged.pack(x, lengths=lengths, padding_side=side, backend=backend)
    upstream = _random(rt.values.shape, seed=21)
    rt.values.backward(upstream)
    keep = _right_or_left_mask(lengths, width, side)
    expected = torch.zeros_like(x)
    t = 0
    for b in range(4):
        for j in range(width):
            if keep[b, j]:
                expected[b, j] = upstream[t]
                t += 1
    assert torch.equal(x.grad, expected)
    assert torch.equal(x.grad[~keep], torch.zeros_like(x.grad[~keep]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_from_mask_gradient(backend):
    lengths = [2, 4, 0]
    keep = _left_mask(lengths, 4)
    x = _random((3, 4, 2), seed=22).requires_grad_()
    rt = ragged.pack(x, attention_mask=keep.long(), backend=backend)
    rt.values.sum().backward()
    assert torch.equal(x.grad, keep[..., None].expand_as(x).float())


@pytest.mark.parametrize("backend", BACKENDS)
def test_unpack_gradient_ignores_padding(backend):
    lengths = [2, 0, 3]
    v = _random((5, 2), seed=23).requires_grad_()
    padded = RaggedTensor.from_lengths(v, lengths).to_padded(padding_value=math.pi, backend=backend)
    upstream = _random(padded.shape, seed=24)
    padded.backward(upstream)
    assert torch.equal(v.grad, _loop_pack(upstream, lengths))


# --------------------------------------------------------------------------------------
# Sizes that cross the kernels' tile boundaries


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype,feat",
    [(torch.float32, (1100,)), (torch.bool, (4100,)), (torch.float32, ()), (torch.float16, (3, 700))],
    ids=["wide_f32", "wide_bool", "T", "HD"],
)
def test_tile_boundaries(backend, dtype, feat):
    lengths = [3, 0, 2, 1] if feat else [1200, 0, 1300, 1]
    width = max(lengths) + 1
    for side in ("right", "left"):
        x = _random((len(lengths), width, *feat), dtype, seed=25)
        rt = ragged.pack(x, lengths=lengths, padding_side=side, backend=backend)
        assert torch.equal(rt.values, _loop_pack(x, lengths, side))
        fill = True if dtype == torch.bool else -2.0
        got = rt.to_padded(padding_value=fill, padding_side=side, backend=backend)
        keep = _right_or_left_mask(lengths, rt.max_len, side)
        assert torch.equal(got[keep], rt.values)
        assert (got[~keep] == torch.tensor(fill, dtype=dtype)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_sequences(backend):
    g = _gen(26)
    lengths = torch.randint(0, 6, (301,), generator=g).tolist()
    lengths[0] = 0
    lengths[-1] = 0
    width = max(lengths)
    x = _random((301, width, 2), seed=27)
    for side in ("right", "left"):
        rt = ragged.pack(x, lengths=lengths, padding_side=side, backend=backend)
        assert torch.equal(rt.values, _loop_pack(x, lengths, side))
        back = rt.to_padded(padding_side=side, backend=backend)
        assert torch.equal(back, _loop_unpack(rt.values, lengths, width, 0.0, side))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "dtype,fill",
    [
        (torch.float64, 0.1),
        (torch.float64, 1e-300),
        (torch.float64, 1 / 3),
        (torch.float32, 0.1),
        (torch.bfloat16, 0.1),
        (torch.int64, 2**40 + 1),
    ],
)
def test_padding_value_exact_on_gpu(backend, dtype, fill):
    lengths = [2, 0, 3]
    values = _random((5, 3), dtype, seed=28).cuda()
    rt = RaggedTensor.from_lengths(values, lengths)
    got = rt.to_padded(padding_value=fill, backend=backend).cpu()
    pad = ~_right_mask(lengths, 3)
    assert (got[pad] == torch.tensor(fill, dtype=dtype)).all(), got[pad].unique()
    assert torch.equal(got[~pad], values.cpu())
