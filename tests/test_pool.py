"""ragged.pool against a float64 oracle built here from per-sequence slices of the input.

Each case runs on every backend that can take CPU tensors here (``conftest.cpu_backends``:
the torch reference, and the Triton kernels under TRITON_INTERPRET=1). The values are a
view into a larger buffer whose other rows (and, for the strided layout, other columns)
hold NaN (or an extreme integer), so that anything read outside the batch shows.
"""

from __future__ import annotations

import dataclasses
import doctest
import zlib

import pytest
import torch
from conftest import cpu_backends

import ragged
from ragged import RaggedTensor
from ragged.ops import pool as pool_module
from ragged.ops.pool import POOL
from ragged.records.pool import PoolArgs, PoolBackwardInputs, PoolGrads, PoolOutput

BACKENDS = cpu_backends()
MODES = ["mean", "sum", "max", "first", "last"]
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LENGTHS = {
    "mixed": [5, 0, 31, 12],
    "single1": [1],
    "single0": [0],
    "odd": [7, 97, 1, 0, 3],
    "one_long": [1, 300, 2],
}
FEATURES = {"T": (), "TF": (6,), "TF1F2": (3, 4)}
# Output rounding of each dtype, and for float32 the float32 sums of up to 300 terms of
# size ~1 (the oracle is float64; the Triton interpreter rounds float32 -> bfloat16 toward
# zero, one unit in the last place off round-to-nearest).
TOL = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 3e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def _seed(*parts) -> int:
    return zlib.crc32(" ".join(map(str, parts)).encode())


def _poison(dtype):
    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).max


def _random(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, shape, generator=gen).to(dtype)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _values(total, feat, dtype, seed, layout="slice"):
    """Fresh random ``[total, *feat]`` values: rows ``[3, 3 + total)`` of a poisoned buffer
    (``"slice"``) or every other row and last-dim column of one (``"strided"``)."""
    gen = torch.Generator().manual_seed(seed)
    data = _random((total, *feat), dtype, gen)
    if layout == "slice":
        buf = torch.full((total + 5, *feat), _poison(dtype), dtype=dtype)
        buf[3 : 3 + total] = data
        return buf[3 : 3 + total]
    wide = (*feat[:-1], 2 * feat[-1]) if feat else (2,)
    buf = torch.full((2 * total + 1, *wide), _poison(dtype), dtype=dtype)
    view = buf[1::2, ..., ::2] if feat else buf[1::2, 0]
    view.copy_(data)
    assert not view.is_contiguous() or total <= 1
    return view


def _ragged(values, lengths):
    return RaggedTensor.from_lengths(values, lengths)


def _oracle(values, lengths, mode):
    """float64 ``[B, *F]`` from per-sequence slices (differentiable w.r.t. ``values``);
    max takes the first maximal token per feature (the first NaN where there is one)."""
    x = values.to(torch.float64) if values.dtype != torch.bool else values.to(torch.int64).to(torch.float64)
    rows, start = [], 0
    for n in lengths:
        seq = x[start : start + n]
        start += n
        if n == 0 or mode == "sum":
            rows.append(seq.sum(0))  # an empty sum is 0, the fill of every mode
        elif mode == "mean":
            rows.append(seq.sum(0) / n)
        elif mode == "first":
            rows.append(seq[0])
        elif mode == "last":
            rows.append(seq[-1])
        else:
            top = seq.detach().amax(0)
            hit = (seq.detach() == top) | (seq.detach().isnan() & top.isnan())
            first = hit.to(torch.int64).argmax(0)  # the first True
            rows.append(seq.gather(0, first.unsqueeze(0)).squeeze(0))
    if not rows:
        return x.new_zeros((0, *x.shape[1:]))
    return torch.stack(rows)


def _assert_close(out, expected, dtype):
    rtol, atol = TOL.get(dtype, (0, 0))
    torch.testing.assert_close(out.to(torch.float64), expected.to(torch.float64), rtol=rtol, atol=atol, equal_nan=True)


def _supported(backend, dtype):
    return backend == "torch" or dtype in KERNEL_DTYPES


# --------------------------------------------------------------------------------------
# Forward


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("feat", FEATURES.values(), ids=FEATURES.keys())
def test_forward_matches_the_oracle(backend, mode, dtype, feat):
    if not _supported(backend, dtype):
        pytest.skip(f"{backend} does not take {dtype}")
    for name, lengths in LENGTHS.items():
        layout = "strided" if name in ("mixed", "odd") else "slice"
        values = _values(sum(lengths), feat, dtype, _seed(backend, mode, dtype, feat, name), layout)
        out = ragged.pool(_ragged(values, lengths), mode, backend=backend)
        assert out.shape == (len(lengths), *feat) and out.dtype == dtype, name
        assert not out.isnan().any(), f"poison outside the batch leaked in ({name})"
        _assert_close(out, _oracle(values, lengths, mode), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_empty_batch_and_empty_features(backend, mode):
    rt = RaggedTensor.from_lengths(torch.zeros(0, 3, 2), [])
    out = ragged.pool(rt, mode, backend=backend)
    assert out.shape == (0, 3, 2) and out.dtype == torch.float32
    rt = RaggedTensor.from_lengths(torch.zeros(0, 5), [0, 0])
    assert torch.equal(ragged.pool(rt, mode, backend=backend), torch.zeros(2, 5))
    rt = RaggedTensor.from_lengths(torch.zeros(4, 0), [3, 1])
    assert ragged.pool(rt, mode, backend=backend).shape == (2, 0)


@pytest.mark.parametrize("mode", ["sum", "max", "first", "last"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool], ids=str)
def test_integer_and_bool_values(mode, dtype):
    if mode == "sum" and dtype == torch.bool:
        pytest.skip("sum does not take bool")
    lengths = [5, 0, 31, 1]
    values = _values(sum(lengths), (4,), dtype, _seed(mode, dtype))
    for backend in ("torch", "auto"):
        out = ragged.pool(_ragged(values, lengths), mode, backend=backend)
        assert out.dtype == dtype
        expected = _oracle(values, lengths, mode).to(torch.int64)
        assert torch.equal(out, expected.to(dtype)), (backend, out, expected)  # integer sums wrap like torch
    reasons = ragged.explain(ragged.pool, _ragged(values, lengths), mode)
    assert reasons["torch"] == [] and any(str(dtype) in r for r in reasons["triton"])


def test_integer_sum_accumulates_in_int64():
    values = torch.full((300, 2), 100, dtype=torch.int8)
    out = ragged.pool(_ragged(values, [300]), "sum")
    assert torch.equal(out, torch.tensor([[30000, 30000]], dtype=torch.int64).to(torch.int8))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16_bit_sums_accumulate_in_float32(backend, dtype):
    # 4096 ones plus 1 are beyond 16-bit accumulation (it stalls at 2048 in float16, 256 in bfloat16)
    values = torch.ones(4097, 3, dtype=dtype)
    rt = _ragged(values, [4097])
    assert ragged.pool(rt, "sum", backend=backend).tolist() == [[4096.0, 4096.0, 4096.0]]
    assert ragged.pool(rt, "mean", backend=backend).tolist() == [[1.0, 1.0, 1.0]]


# --------------------------------------------------------------------------------------
# NaN, infinities, ties


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_nan_propagates_like_amax_and_its_gradient_goes_to_the_first_nan(backend, dtype):
    lengths = [6, 4, 3, 0]
    values = _values(sum(lengths), (5,), dtype, _seed("nan", backend, dtype)).clone()
    values[1, 0] = values[4, 0] = float("nan")  # sequence 0, feature 0: two NaNs
    values[8, 2] = float("nan")  # sequence 1, feature 2
    values[11, 1] = float("-inf")  # sequence 2 ends with -inf
    values[10, 3] = float("inf")
    x = values.detach().requires_grad_(True)
    rt = _ragged(x, lengths)
    for mode in MODES:
        out = ragged.pool(rt, mode, backend=backend)
        expected = _oracle(values, lengths, mode)
        assert torch.equal(out.isnan(), expected.isnan()), mode
        _assert_close(out, expected, dtype)
    out = ragged.pool(rt, "max", backend=backend)
    assert out[0, 0].isnan() and out[1, 2].isnan() and not out[2].isnan().any()
    assert out[2, 3] == float("inf")
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    assert grad[1, 0] == 1 and grad[4, 0] == 0 and grad[8, 2] == 1
    assert grad.sum() == sum(1 for n in lengths if n) * 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_ties_send_the_gradient_to_the_first_maximal_token(backend):
    lengths = [9, 1, 40, 0, 7]
    gen = torch.Generator().manual_seed(3)
    values = torch.randint(-2, 3, (sum(lengths), 6), generator=gen).float()  # many ties
    values[49:57, 5] = float("-inf")  # a sequence of -inf only in one feature
    x = values.clone().requires_grad_(True)
    ref = values.to(torch.float64).requires_grad_(True)
    out = ragged.pool(_ragged(x, lengths), "max", backend=backend)
    expected = _oracle(ref, lengths, "max")
    _assert_close(out, expected, torch.float32)
    g = torch.randn(out.shape, generator=gen)
    (got,) = torch.autograd.grad(out, x, g)
    (want,) = torch.autograd.grad(expected, ref, g.double())
    assert torch.equal(got.double(), want)
    assert torch.equal((got != 0).sum(0), torch.full((6,), 4))  # one token per nonempty sequence


# --------------------------------------------------------------------------------------
# Gradients


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_gradients_match_the_oracle(backend, mode, dtype):
    if not _supported(backend, dtype):
        pytest.skip(f"{backend} does not take {dtype}")
    for name, lengths in LENGTHS.items():
        feat = (3, 4) if name == "mixed" else (6,)
        layout = "strided" if name == "odd" else "slice"
        seed = _seed("grad", backend, mode, dtype, name)
        values = _values(sum(lengths), feat, dtype, seed, layout)
        x = values.detach().requires_grad_(True)
        ref = values.detach().to(torch.float64).requires_grad_(True)
        out = ragged.pool(_ragged(x, lengths), mode, backend=backend)
        expected = _oracle(ref, lengths, mode)
        gen = torch.Generator().manual_seed(seed + 1)
        g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        (got,) = torch.autograd.grad(out, x, g.to(dtype))
        (want,) = torch.autograd.grad(expected, ref, g.to(dtype).to(torch.float64))
        assert got.shape == values.shape and got.dtype == dtype
        _assert_close(got, want, dtype)
        # an expanded gradient (the one of .sum())
        (got,) = torch.autograd.grad(ragged.pool(_ragged(x, lengths), mode, backend=backend).sum(), x)
        (want,) = torch.autograd.grad(_oracle(ref, lengths, mode).sum(), ref)
        _assert_close(got, want, dtype)


@pytest.mark.parametrize("mode", MODES)
def test_gradcheck_float64(mode):
    lengths = [3, 0, 1, 6]
    gen = torch.Generator().manual_seed(_seed("gradcheck", mode))
    # distinct values well apart: max keeps its argmax under gradcheck's perturbation
    values = (torch.randperm(sum(lengths) * 4, generator=gen).to(torch.float64) / 7).view(-1, 2, 2)
    values.requires_grad_(True)
    offsets = _ragged(values.detach(), lengths).offsets
    assert torch.autograd.gradcheck(
        lambda v: ragged.pool(RaggedTensor(v, offsets, 6), mode, backend="torch"), (values,)
    )
    # the reference itself, called directly, is differentiable by torch autograd
    flat = values.detach().view(-1, 4).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: pool_module.reference_pool(v, offsets, mode)[0], (flat,))


@pytest.mark.parametrize("mode", MODES)
def test_reference_backward_is_the_autograd_of_the_reference(mode):
    lengths = [4, 0, 2, 9]
    values = _values(sum(lengths), (5,), torch.float64, _seed("refbwd", mode)).contiguous()
    offsets = _ragged(values, lengths).offsets
    x = values.clone().requires_grad_(True)
    out, index = pool_module.reference_pool(x, offsets, mode)
    g = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    (want,) = torch.autograd.grad(out, x, g)
    (got,) = pool_module.reference_pool_backward(g, offsets, index, mode, values.shape[0])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)


# --------------------------------------------------------------------------------------
# The op: torch.compile, opcheck, explain


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_compile_fullgraph(backend, mode):
    torch._dynamo.reset()
    lin = torch.nn.Linear(4, 4)

    def f(rt):
        return ragged.pool(rt.with_values(lin(rt.values)), mode, backend=backend) * 2

    lengths = [3, 0, 7, 1]
    values = _values(sum(lengths), (4,), torch.float32, _seed("compile", backend, mode)).contiguous()
    x = values.clone().requires_grad_(True)
    x_ref = values.clone().requires_grad_(True)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(_ragged(x, lengths))
    ref = f(_ragged(x_ref, lengths))
    torch.testing.assert_close(out, ref)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", MODES)
def test_opcheck(mode):
    values = _values(10, (3,), torch.float64, _seed("opcheck", mode)).contiguous().requires_grad_(True)
    offsets = torch.tensor([0, 4, 4, 5, 10], dtype=torch.int32)
    torch.library.opcheck(torch.ops.ragged.pool.default, (*PoolArgs(values, offsets, mode), "torch"))
    out, index = torch.ops.ragged.pool(values.detach(), offsets, mode, "torch")
    # the backward op: the operands it reads (no values), then its inputs
    torch.library.opcheck(
        torch.ops.ragged.pool_backward.default,
        (offsets, mode, *PoolBackwardInputs(torch.ones_like(out), index, 10), "torch"),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_op_takes_and_returns_records(backend):
    values = _values(10, (3,), torch.float32, _seed("records", backend)).contiguous()
    offsets = torch.tensor([0, 4, 4, 5, 10], dtype=torch.int32)
    args = PoolArgs(values=values, offsets=offsets, mode="max")
    out = POOL(args, backend)
    assert isinstance(out, PoolOutput)
    want, want_index = pool_module.reference_pool(values, offsets, "max")
    torch.testing.assert_close(out.out, want)
    assert torch.equal(out.argmax, want_index)
    grad = torch.randn(4, 3, generator=torch.Generator().manual_seed(3))
    # the backward reads no values: an unread operand may be None
    got = POOL.call_backward(args._replace(values=None), PoolBackwardInputs(grad, out.argmax, 10), backend)
    assert isinstance(got, PoolGrads)
    (want_grad,) = pool_module.reference_pool_backward(grad, offsets, out.argmax, "max", 10)
    torch.testing.assert_close(got.values, want_grad)
    assert [a.name for a in torch.ops.ragged.pool_backward.default._schema.arguments] == [
        "offsets",
        "mode",
        "grad_out",
        "argmax",
        "total",
        "impl",
    ]


def test_fake_tensors_reach_the_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        values = torch.empty(11, 2, 3)
        offsets = torch.empty(5, dtype=torch.int32)
        rt = RaggedTensor(values, offsets, 7)
        out = ragged.pool(rt, "max", backend="torch")
        pair = torch.ops.ragged.pool(values.view(11, 6), offsets, "max", "torch")
    assert out.shape == (4, 2, 3)
    assert pair[0].shape == (4, 6) and pair[1].shape == (4, 6) and pair[1].dtype == torch.int32


def test_explain():
    rt = _ragged(_values(8, (4,), torch.float32, 1), [3, 0, 5])
    reasons = ragged.explain(ragged.pool, rt, "max")
    assert set(reasons) == {"torch", "triton"}
    assert reasons["torch"] == []
    assert (reasons["triton"] == []) == ("triton" in BACKENDS)
    assert ragged.explain("pool", rt.values, rt.offsets, "max") == reasons
    rt64 = _ragged(_values(8, (4,), torch.float64, 1), [3, 0, 5])
    assert any("float64" in r for r in ragged.explain(ragged.pool, rt64, "mean")["triton"])
    with pytest.raises(ValueError, match=r"ragged.pool\(\): expected mode"):
        ragged.explain(ragged.pool, rt, "median")


def test_auto_takes_the_reference_on_cpu(monkeypatch):
    from ragged import backends

    ran = []
    entry = backends._OPS["pool"]
    impl = entry.impls["torch"]
    monkeypatch.setitem(
        entry.impls,
        "torch",
        dataclasses.replace(impl, forward=lambda args: ran.append("torch") or impl.forward_fn(args)),
    )
    ragged.pool(_ragged(torch.randn(4, 2), [1, 3]), "sum")
    assert ran == ["torch"]
    assert entry.gpu_preference(None) == ("triton", "torch")  # on CUDA inputs


def test_docstring_examples_run():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    tests = finder.find(pool_module.pool, "pool", globs={})
    assert tests and tests[0].examples
    for test in tests:
        runner.run(test)
    assert runner.failures == 0


# --------------------------------------------------------------------------------------
# Errors


def test_errors_name_the_function_the_argument_and_what_came():
    rt = _ragged(torch.randn(4, 2), [1, 3])
    with pytest.raises(TypeError, match=r"ragged.pool\(\): expected rt to be a RaggedTensor, got Tensor"):
        ragged.pool(rt.values)
    with pytest.raises(ValueError, match=r"ragged.pool\(\): expected mode to be one of .*'mean'.*got 'avg'"):
        ragged.pool(rt, "avg")
    with pytest.raises(TypeError, match=r"ragged.pool\(\): expected mode to be a str.*got None"):
        ragged.pool(rt, None)
    with pytest.raises(TypeError, match=r"ragged.pool\(\): expected mode to be a str.*got \['mean'\]"):
        ragged.pool(rt, ["mean"])
    ints = _ragged(torch.arange(4), [1, 3])
    with pytest.raises(
        TypeError,
        match=r"ragged.pool\(\): expected rt.values of a floating-point dtype .* "
        r"for mode='mean', got torch.int64",
    ):
        ragged.pool(ints, "mean")
    flags = _ragged(torch.ones(4, dtype=torch.bool), [1, 3])
    with pytest.raises(TypeError, match=r"for mode='sum', got torch.bool"):
        ragged.pool(flags, "sum")
    cplx = _ragged(torch.ones(4, dtype=torch.complex64), [1, 3])
    for mode in MODES:
        with pytest.raises(TypeError, match=rf"for mode='{mode}', got torch.complex64"):
            ragged.pool(cplx, mode)
    with pytest.raises(ValueError, match=r"ragged.pool\(\): expected backend to be one of"):
        ragged.pool(rt, "mean", backend="numpy")
    with pytest.raises(ValueError, match=r"ragged.pool\(\): expected rt.values of shape \[T, \*F\], got a 0-d"):
        ragged.pool(RaggedTensor(torch.tensor(1.0), torch.zeros(1, dtype=torch.int32), 0))
    rt64 = _ragged(torch.randn(4, 2, dtype=torch.float64), [1, 3])
    with pytest.raises(ValueError, match=r"ragged.pool\(\): backend 'triton' cannot take this input: .*float64"):
        ragged.pool(rt64, "max", backend="triton")
    with pytest.raises(ValueError, match=r"ragged.pool\(\): backend 'cuda' has no implementation"):
        ragged.pool(rt, "max", backend="cuda")
