"""ragged.pool on the GPU: every backend against a float64 oracle from per-sequence slices,
at model sizes (B=256, lengths long-tailed up to 512, F=768), plus no host sync, CUDA
graphs, torch.compile and 64-bit indexing.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from test_pool import _oracle  # the float64 per-sequence oracle of the CPU tests

import ragged
from ragged import RaggedTensor, backends

pytestmark = pytest.mark.gpu

BACKENDS = ["triton", "torch"]
MODES = ["mean", "sum", "max", "first", "last"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# output rounding of the dtype; float32 also float32 sums of up to 512 terms of size ~1
TOL = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 5e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (8e-3, 8e-3),
}


def _needs(backend):
    if backend == "triton":
        reason = backends.triton_reason(torch.device("cuda"))
        if reason:
            pytest.skip(reason)


def _gen(*parts):
    return torch.Generator(device="cuda").manual_seed(zlib.crc32(" ".join(map(str, parts)).encode()))


def _long_tailed(batch, longest, gen):
    """Host lengths: mostly short, a long tail up to ``longest`` (which occurs), a few zeros."""
    u = torch.rand(batch, generator=gen, device="cuda").cpu()
    lengths = (longest * u**4).long().tolist()
    lengths[0], lengths[1], lengths[-1] = longest, 0, 1
    return lengths


def _values(total, feat, dtype, gen):
    """Random ``[total, *feat]`` values as rows ``[7, 7 + total)`` of a NaN-filled buffer."""
    buf = torch.full((total + 9, *feat), float("nan"), dtype=dtype, device="cuda")
    buf[7 : 7 + total] = torch.randn((total, *feat), generator=gen, device="cuda").to(dtype)
    return buf[7 : 7 + total]


def _assert_close(out, expected, dtype, longest=512):
    rtol, atol = TOL[dtype]
    if dtype == torch.float32:  # a float32 sum's rounding error grows as the root of its terms
        atol *= max(1.0, (longest / 512) ** 0.5)
    torch.testing.assert_close(out.to(torch.float64), expected, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_model_sizes_against_the_oracle(backend, mode, dtype):
    _needs(backend)
    gen = _gen("model", backend, mode, dtype)
    lengths = _long_tailed(256, 512, gen)
    values = _values(sum(lengths), (768,), dtype, gen)
    x = values.detach().requires_grad_(True)
    ref = values.detach().to(torch.float64).requires_grad_(True)
    out = ragged.pool(RaggedTensor.from_lengths(x, lengths), mode, backend=backend)
    expected = _oracle(ref, lengths, mode)
    assert out.shape == (256, 768) and out.dtype == dtype
    assert not out.isnan().any(), "the NaN rows outside the batch leaked in"
    _assert_close(out, expected.detach(), dtype)
    g = torch.randn(out.shape, generator=gen, device="cuda").to(dtype)
    (got,) = torch.autograd.grad(out, x, g)
    (want,) = torch.autograd.grad(expected, ref, g.to(torch.float64))
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feat", [(), (3,), (12, 64), (129,), (1000,)], ids=str)
def test_feature_shapes_strides_and_int64_offsets(backend, feat):
    _needs(backend)
    gen = _gen("feat", backend, feat)
    lengths = [5, 0, 31, 12, 1, 97, 7, 64, 1025]
    total = sum(lengths)
    wide = (*feat[:-1], 2 * feat[-1]) if feat else (2,)
    buf = torch.full((2 * total, *wide), float("nan"), device="cuda")
    values = buf[::2, ..., ::2] if feat else buf[::2, 0]  # every other row and column
    values.copy_(torch.randn(values.shape, generator=gen, device="cuda"))
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device="cuda")
    rt = RaggedTensor.from_offsets(values, offsets)
    for mode in MODES:
        x = values.detach().requires_grad_(True)
        ref = values.detach().to(torch.float64).requires_grad_(True)
        out = ragged.pool(RaggedTensor(x, rt.offsets, rt.max_len), mode, backend=backend)
        expected = _oracle(ref, lengths, mode)
        assert out.shape == (len(lengths), *feat)
        # 1025 terms in the longest sum (the torch backend's index_add adds in no fixed order)
        _assert_close(out, expected.detach(), torch.float32, max(lengths))
        (got,) = torch.autograd.grad(out.sum(), x)  # an expanded gradient
        (want,) = torch.autograd.grad(expected.sum(), ref)
        _assert_close(got, want, torch.float32, max(lengths))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_inf_and_ties(backend):
    _needs(backend)
    lengths = [6, 4, 3, 0, 200]
    gen = _gen("nan", backend)
    values = torch.randint(-2, 3, (sum(lengths), 130), generator=gen, device="cuda").float()  # many ties
    values[1, 0] = values[4, 0] = float("nan")
    values[8, 2] = float("nan")
    values[11, 1] = float("-inf")
    values[13:, 7] = float("-inf")
    x = values.clone().requires_grad_(True)
    ref = values.to(torch.float64).requires_grad_(True)
    for mode in MODES:
        out = ragged.pool(RaggedTensor.from_lengths(x, lengths), mode, backend=backend)
        expected = _oracle(ref, lengths, mode)
        assert torch.equal(out.isnan(), expected.isnan()), mode
        _assert_close(out, expected.detach(), torch.float32)
        g = torch.randn(out.shape, generator=gen, device="cuda")
        (got,) = torch.autograd.grad(out, x, g)
        (want,) = torch.autograd.grad(expected, ref, g.double())
        if mode == "mean":  # grad / L rounded to float32
            _assert_close(got, want, torch.float32)
        else:  # grad itself, at the one token or at every token
            assert torch.equal(got.double(), want), mode


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64_torch_and_float32_kernel(backend):
    _needs(backend)
    lengths = [3, 0, 1, 6]
    gen = _gen("gradcheck", backend)
    values = torch.randperm(sum(lengths) * 6, generator=gen, device="cuda").double().view(-1, 6) / 7
    offsets = RaggedTensor.from_lengths(values, lengths).offsets
    for mode in MODES:
        if backend == "torch":
            v = values.clone().requires_grad_(True)
            assert torch.autograd.gradcheck(
                lambda t: ragged.pool(RaggedTensor(t, offsets, 6), mode, backend="torch"), (v,)
            )
        else:  # the kernels take float32 at most: their backward against the reference's
            v = values.float().requires_grad_(True)
            out = ragged.pool(RaggedTensor(v, offsets, 6), mode, backend="triton")
            g = torch.randn(out.shape, generator=gen, device="cuda")
            (got,) = torch.autograd.grad(out, v, g)
            w = values.float().requires_grad_(True)
            (want,) = torch.autograd.grad(ragged.pool(RaggedTensor(w, offsets, 6), mode, backend="torch"), w, g)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["triton", "torch", "auto"])
def test_no_host_sync(backend):
    _needs("triton" if backend == "auto" else backend)
    gen = _gen("sync", backend)
    lengths = _long_tailed(64, 300, gen)
    values = torch.randn(sum(lengths), 96, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rt = RaggedTensor.from_lengths(values, lengths)
    for mode in MODES:  # warm up: compile the kernels
        ragged.pool(rt, mode, backend=backend).float().sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for mode in MODES:
            ragged.pool(rt, mode, backend=backend).float().sum().backward()
            with torch.no_grad():
                ragged.pool(rt, mode, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_auto_takes_the_kernel_on_cuda_where_it_can():
    values = torch.randn(9, 8, device="cuda")
    offsets = torch.tensor([0, 4, 9], dtype=torch.int32, device="cuda")
    expected = "triton" if not backends.triton_reason(values.device) else "torch"
    for dtype in DTYPES:
        assert backends.select("pool", "auto", values.device, values.to(dtype), offsets, "mean").backend == expected
    for dtype in (torch.float64, torch.int64, torch.bool):
        assert backends.select("pool", "auto", values.device, values.to(dtype), offsets, "max").backend == "torch"
    rt = RaggedTensor(values.to(torch.int32), offsets, 5)
    assert torch.equal(ragged.pool(rt, "sum"), torch.stack([rt.values[:4].sum(0), rt.values[4:].sum(0)]).int())


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph(backend):
    _needs(backend)
    torch._dynamo.reset()
    lin = torch.nn.Linear(64, 64, device="cuda")

    def f(rt):
        return torch.cat([ragged.pool(rt.with_values(lin(rt.values)), mode, backend=backend) for mode in MODES], 1)

    lengths = [17, 0, 9, 1]
    x = torch.randn(sum(lengths), 64, device="cuda", requires_grad=True)
    rt = RaggedTensor.from_lengths(x, lengths)
    out = torch.compile(f, fullgraph=True)(rt)
    ref = f(rt)
    torch.testing.assert_close(out, ref)
    (g1,) = torch.autograd.grad(out.square().sum(), x)
    (g2,) = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(g1, g2)
    torch._dynamo.reset()


def test_cuda_graph_capture():
    _needs("triton")
    lengths = [7, 0, 3, 40]
    x = torch.randn(sum(lengths), 48, device="cuda")
    rt = RaggedTensor.from_lengths(x, lengths)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for mode in MODES:
            ragged.pool(rt, mode, backend="triton")  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [ragged.pool(rt, mode, backend="triton") for mode in MODES]
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for mode, out in zip(MODES, outs):
        _assert_close(out, _oracle(x, lengths, mode), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_indexing(backend):
    """Token rows past 2**31 elements of values: index arithmetic must not wrap."""
    _needs(backend)
    free, _ = torch.cuda.mem_get_info()
    feat = 64
    total = 2**31 // feat + 1000  # 2.1e9 bf16 elements, 4.3 GB
    if free < (16 if backend == "torch" else 12) * 2**30:
        pytest.skip("needs 12 GiB (16 for the reference) of free GPU memory")
    values = torch.zeros(total, feat, dtype=torch.bfloat16, device="cuda")
    lengths = [5, total - 10, 5]
    tail = torch.randn(5, feat, generator=_gen("int64"), device="cuda").to(torch.bfloat16)
    values[-5:] = tail
    rt = RaggedTensor.from_lengths(values, lengths)
    # the reference's max materialises int64 [T, F] tensors (17 GB here): first / last only
    for mode in ("first", "last", "max") if backend == "triton" else ("first", "last"):
        out = ragged.pool(rt, mode, backend=backend)
        _assert_close(out[2], _oracle(tail, [5], mode)[0], torch.bfloat16)
    x = values.requires_grad_(True)
    out = ragged.pool(RaggedTensor(x, rt.offsets, rt.max_len), "last", backend=backend)
    (grad,) = torch.autograd.grad(out[2, 3], x)
    assert grad[-1, 3] == 1 and grad[-1].sum() == 1 and grad[-2].abs().sum() == 0
