"""pack / unpack on the GPU: every kernel backend against the reference, bit-exact.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import ragged
from ragged import backends

pytestmark = pytest.mark.gpu

KERNELS = ["cuda", "triton"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool]
FEATURES = [(), (768,), (12, 64), (129,), (3,), (1000,)]
LENGTH_SETS = {
    "mixed": [5, 0, 31, 12, 1, 97, 7, 64],
    "one_long": [1, 2, 1025, 0, 3],
    "all_zero": [0, 0, 0],
    "single": [1],
}


def _needs(backend: str):
    reason = backends.cuda_reason(torch.device("cuda")) if backend == "cuda" else \
        backends.triton_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)


def _random(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen, device="cuda") > 0.5
    if dtype == torch.int64:
        return torch.randint(-2**40, 2**40, shape, generator=gen, device="cuda")
    return torch.randn(shape, generator=gen, device="cuda").to(dtype)


def _padded_with_poison(lengths, feat, dtype, gen, side="right", width=None):
    width = max(lengths, default=0) if width is None else width
    x = _random((len(lengths), width, *feat), dtype, gen)
    if dtype.is_floating_point:
        pad = ragged.pack([torch.empty(n, device="cuda") for n in lengths]).padding_mask(width, side)
        x[pad] = float("nan")
    return x


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feat", FEATURES, ids=str)
@pytest.mark.parametrize("side", ["right", "left"])
def test_pack_unpack_bit_exact(backend, dtype, feat, side):
    _needs(backend)
    gen = torch.Generator(device="cuda").manual_seed(hash((backend, str(dtype), feat, side)) % 2**31)
    for name, lengths in LENGTH_SETS.items():
        x = _padded_with_poison(lengths, feat, dtype, gen, side, width=max(lengths) + 3)
        rt = ragged.pack(x, lengths=lengths, padding_side=side, backend=backend)
        ref = ragged.pack(x, lengths=lengths, padding_side=side, backend="torch")
        assert torch.equal(rt.values, ref.values), name
        if dtype.is_floating_point:
            assert not torch.isnan(rt.values).any(), f"padding leaked into values ({name})"
        fill = float("nan") if dtype.is_floating_point else 1
        out = rt.to_padded(padding_value=fill, total_length=max(lengths) + 5, padding_side=side, backend=backend)
        exp = ref.to_padded(padding_value=fill, total_length=max(lengths) + 5, padding_side=side, backend="torch")
        assert out.shape == exp.shape
        assert torch.equal(out, exp) if not dtype.is_floating_point else torch.allclose(
            out.double(), exp.double(), rtol=0, atol=0, equal_nan=True), name


@pytest.mark.parametrize("backend", KERNELS)
def test_offsets_int64_and_strided_padded(backend):
    _needs(backend)
    gen = torch.Generator(device="cuda").manual_seed(1)
    lengths = [3, 0, 17, 9, 1]
    seq_first = torch.randn(20, 5, 64, generator=gen, device="cuda")
    x = seq_first.transpose(0, 1)                      # [B, M, F] view with strided B/M dims
    offsets = torch.tensor([0, 3, 3, 20, 29, 30], dtype=torch.int64, device="cuda")
    got = ragged.pack_values(x, offsets, 30, backend=backend)
    assert torch.equal(got, ragged.reference_pack(x, offsets, 30))
    back = ragged.unpack_values(got, offsets, 20, padding_value=-1.0, backend=backend)
    assert torch.equal(back, ragged.reference_unpack(got, offsets, 20, -1.0))
    assert sum(lengths) == 30


@pytest.mark.parametrize("backend", KERNELS)
def test_misaligned_and_noncontiguous_features(backend):
    _needs(backend)
    gen = torch.Generator(device="cuda").manual_seed(2)
    base = torch.randn(4 * 9 * 10 + 1, generator=gen, device="cuda").half()
    x = base[1:].view(4, 9, 10)                       # data_ptr off 16-byte alignment
    lengths = [9, 2, 0, 5]
    got = ragged.pack(x, lengths=lengths, backend=backend)
    assert torch.equal(got.values, ragged.pack(x, lengths=lengths, backend="torch").values)
    y = torch.randn(4, 9, 6, 5, generator=gen, device="cuda").transpose(2, 3)   # features not contiguous
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = ragged.pack(y, lengths=lengths, backend=backend)
    assert torch.equal(got.values, ragged.pack(y, lengths=lengths, backend="torch").values)


@pytest.mark.parametrize("backend", KERNELS)
def test_gradients(backend):
    _needs(backend)
    lengths = [3, 0, 5, 1]
    x = torch.randn(4, 6, 3, device="cuda", dtype=torch.float64, requires_grad=True)
    fn = lambda t: ragged.pack(t, lengths=lengths, backend=backend).values  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))
    rt = ragged.pack(x.detach(), lengths=lengths)
    v = rt.values.clone().requires_grad_(True)
    fn2 = lambda t: ragged.unpack_values(t, rt.offsets, 7, padding_value=2.0, backend=backend)  # noqa: E731
    assert torch.autograd.gradcheck(fn2, (v,))


@pytest.mark.parametrize("backend", KERNELS)
def test_no_host_sync(backend):
    _needs(backend)
    lengths = [5, 0, 31, 12]
    x = torch.randn(4, 40, 32, device="cuda", requires_grad=True)
    ragged.pack(x, lengths=lengths, backend=backend)   # warm up: compile kernels, pin buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rt = ragged.pack(x, lengths=lengths, backend=backend)
        y = rt.with_values(rt.values * 2)
        out = y.to_padded(total_length=40, backend=backend)
        rt.position_ids(), rt.seq_ids(), rt.padding_mask(), rt.lengths, rt.attention_mask()
        ragged.pack([torch.randn(n, 32, device="cuda") for n in lengths])
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert x.grad is not None


@pytest.mark.parametrize("backend", KERNELS)
def test_compile_fullgraph(backend):
    _needs(backend)
    torch._dynamo.reset()
    lin = torch.nn.Linear(64, 64, device="cuda")

    def f(x, lengths):
        rt = ragged.pack(x, lengths=lengths, backend=backend)
        return rt.with_values(lin(rt.values)).to_padded(backend=backend)

    x = torch.randn(3, 17, 64, device="cuda", requires_grad=True)
    lengths = [17, 0, 9]
    out = torch.compile(f, fullgraph=True)(x, lengths)
    ref = f(x, lengths)
    torch.testing.assert_close(out, ref)
    out.sum().backward()


@pytest.mark.parametrize("backend", KERNELS)
def test_cuda_graph_capture(backend):
    _needs(backend)
    lengths = [7, 0, 3]
    x = torch.randn(3, 8, 16, device="cuda")
    rt = ragged.pack(x, lengths=lengths, backend=backend)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ragged.pack_values(x, rt.offsets, rt.num_tokens, backend=backend)   # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ragged.pack_values(x, rt.offsets, rt.num_tokens, backend=backend)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ragged.reference_pack(x, rt.offsets, rt.num_tokens))


def test_auto_prefers_a_kernel_on_cuda():
    x = torch.randn(2, 4, 8, device="cuda")
    offsets = torch.tensor([0, 1, 5], dtype=torch.int32, device="cuda")
    impl = backends.select("pack", "auto", x.device, x, offsets)
    assert impl.name in ("cuda", "triton")


@pytest.mark.parametrize("backend", KERNELS)
def test_int64_indexing(backend):
    """B * M * row > 2**31 elements: index arithmetic must not wrap."""
    _needs(backend)
    free, _ = torch.cuda.mem_get_info()
    batch, width, feat = 2, 2**20 + 7, 1100          # 2.3e9 elements of bf16 in the padded tensor
    if free < 12 * 2**30:
        pytest.skip("needs 12 GiB of free GPU memory")
    x = torch.empty(batch, width, feat, dtype=torch.bfloat16, device="cuda")
    x[0].fill_(1.0)
    x[1].fill_(2.0)
    x[1, -1].fill_(3.0)
    lengths = [5, width]
    rt = ragged.pack(x, lengths=lengths, backend=backend)
    assert rt.values.shape == (5 + width, feat)
    assert torch.all(rt.values[:5] == 1) and torch.all(rt.values[5:-1] == 2) and torch.all(rt.values[-1] == 3)
    del x
    out = rt.to_padded(padding_value=-1.0, backend=backend)
    assert torch.all(out[0, :5] == 1) and torch.all(out[0, 5:] == -1)
    assert torch.all(out[1, -1] == 3) and torch.all(out[1, :-1] == 2)
