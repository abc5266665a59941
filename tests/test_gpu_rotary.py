"""ragged.rotary_embedding on the GPU: every backend against the float64 oracle of the CPU tests
at model sizes (ModernBERT-base heads on a fused QKV layout, long-tailed lengths), plus strided
inputs, positions in the hundreds of thousands, no host sync, CUDA graphs, torch.compile and
64-bit indexing.

Error rule (as flash-attn's tests): the kernel's error against the float64 oracle is at most
twice the error of HuggingFace's computation in the input's precision (cos and sin rounded to
the dtype, then the rotation in it), plus a small atol.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from test_rotary import _inv_freq, _oracle  # the float64 oracle of the CPU tests

import ragged
from ragged import backends
from ragged.ops.rotary import ROTARY_EMBEDDING
from ragged.records.rotary import RotaryEmbeddingArgs, RotaryEmbeddingBackwardInputs

pytestmark = pytest.mark.gpu

BACKENDS = ["triton", "torch"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ATOL = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}


def _needs(backend):
    if backend in ("triton", "auto"):
        reason = backends.triton_reason(torch.device("cuda"))
        if reason:
            pytest.skip(reason)


def _gen(*parts):
    return torch.Generator(device="cuda").manual_seed(zlib.crc32(" ".join(map(str, parts)).encode()))


def _batch(batch, longest, heads, dim, dtype, gen):
    """A fused QKV output ``[T, 3 * heads * dim]`` of long-tailed lengths (the v heads NaN), its
    q/k view ``[T, 2 * heads, dim]`` and the packed positions."""
    u = torch.rand(batch, generator=gen, device="cuda").cpu()
    lengths = (longest * u**3).long().tolist()
    lengths[0], lengths[1], lengths[-1] = longest, 0, 1
    total = sum(lengths)
    qkv = torch.randn(total, 3, heads, dim, generator=gen, device="cuda").to(dtype)
    qkv[:, 2] = float("nan")
    x = qkv[:, :2].flatten(1, 2)  # [T, 2H, D], row stride 3 * H * D
    rt = ragged.pack([torch.zeros(n, device="cuda") for n in lengths])
    return qkv, x, rt.position_ids()


def _low_precision(x, positions, inv_freq, scaling):
    """HuggingFace's computation in x's dtype: cos / sin rounded to it, then the rotation in it."""
    angle = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((angle, angle), dim=-1)
    cos = (emb.cos() * scaling).to(x.dtype)[:, None, :]
    sin = (emb.sin() * scaling).to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _check(out, expected, baseline, dtype):
    err = (out.double() - expected).abs().max().item()
    base = (baseline.double() - expected).abs().max().item()
    assert err <= 2 * base + ATOL[dtype], (err, base)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_model_sizes_against_the_oracle(backend, dtype):
    _needs(backend)
    gen = _gen("model", backend, dtype)
    heads, dim, scaling = 12, 64, 1.0
    _, x, positions = _batch(64, 1024, heads, dim, dtype, gen)
    inv_freq = _inv_freq(dim, 160000.0).cuda()
    xg = x.detach().requires_grad_(True)
    ref = x.detach().double().requires_grad_(True)
    out = ragged.rotary_embedding(xg, positions, inv_freq, scaling, backend=backend)
    expected = _oracle(ref, positions, inv_freq, scaling)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert not out.isnan().any(), "the NaN v heads leaked in"
    _check(out, expected.detach(), _low_precision(x, positions, inv_freq, scaling), dtype)
    g = torch.randn(out.shape, generator=gen, device="cuda").to(dtype)
    (got,) = torch.autograd.grad(out, xg, g)
    (want,) = torch.autograd.grad(expected, ref, g.double())
    assert not got.isnan().any()
    _check(got, want, _low_precision(g, positions, -inv_freq, scaling), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(1, 1, 2), (37, 5, 6), (300, 7, 80), (129, 3, 256), (50, 2, 600)], ids=str)
def test_shapes_strides_and_expanded_gradients(backend, shape):
    _needs(backend)
    gen = _gen("shapes", backend, shape)
    total, heads, dim = shape
    buf = torch.full((total, heads + 1, 2 * dim), float("nan"), device="cuda")
    x = buf[:, 1:, ::2]  # strides everywhere, last-dim stride 2
    x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
    positions = torch.randint(0, 4096, (total,), generator=gen, device="cuda", dtype=torch.int32)
    inv_freq = _inv_freq(dim).cuda()
    xg = x.detach().requires_grad_(True)
    ref = x.detach().double().requires_grad_(True)
    out = ragged.rotary_embedding(xg, positions, inv_freq, 0.75, backend=backend)
    expected = _oracle(ref, positions, inv_freq, 0.75)
    torch.testing.assert_close(out.double(), expected.detach(), rtol=1e-5, atol=1e-5)
    (got,) = torch.autograd.grad(out.sum(), xg)  # an expanded gradient
    (want,) = torch.autograd.grad(expected.sum(), ref)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_far_positions_keep_float32_accuracy(backend):
    """Angles up to 5e5 radians: cos and sin of the float32 angle, to float32 accuracy."""
    _needs(backend)
    gen = _gen("far", backend)
    x = torch.randn(4096, 2, 128, generator=gen, device="cuda")
    positions = torch.randint(0, 500_000, (4096,), generator=gen, device="cuda")
    inv_freq = _inv_freq(128, 1e6).cuda()
    out = ragged.rotary_embedding(x, positions, inv_freq, backend=backend)
    torch.testing.assert_close(out.double(), _oracle(x, positions, inv_freq), rtol=1e-5, atol=1e-5)


def test_kernel_agrees_with_the_torch_backend_in_float32():
    _needs("triton")
    gen = _gen("agree")
    _, x, positions = _batch(32, 512, 12, 64, torch.float32, gen)
    inv_freq = _inv_freq(64).cuda()
    a = ragged.rotary_embedding(x, positions, inv_freq, 1.1, backend="triton")
    b = ragged.rotary_embedding(x, positions, inv_freq, 1.1, backend="torch")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch", "auto"])
def test_no_host_sync(backend):
    _needs(backend)
    gen = _gen("sync", backend)
    _, x, positions = _batch(64, 300, 12, 64, torch.bfloat16, gen)
    inv_freq = _inv_freq(64).cuda()
    xg = x.detach().requires_grad_(True)
    ragged.rotary_embedding(xg, positions, inv_freq, backend=backend).float().sum().backward()  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ragged.rotary_embedding(xg, positions, inv_freq, backend=backend).float().sum().backward()
        with torch.no_grad():
            ragged.rotary_embedding(x, positions, inv_freq, 0.5, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_auto_takes_the_kernel_on_cuda_where_it_can():
    x = torch.randn(9, 4, 8, device="cuda")
    positions, inv_freq = torch.arange(9, device="cuda"), _inv_freq(8).cuda()
    expected = "triton" if not backends.triton_reason(x.device) else "torch"
    for dtype in DTYPES:
        assert (
            backends.select("rotary_embedding", "auto", x.device, x.to(dtype), positions, inv_freq).backend == expected
        )
    assert backends.select("rotary_embedding", "auto", x.device, x.double(), positions, inv_freq).backend == "torch"
    out = ragged.rotary_embedding(x.double(), positions, inv_freq)
    torch.testing.assert_close(out, _oracle(x.double(), positions, inv_freq), rtol=1e-6, atol=1e-6)  # float32 tables


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph(backend):
    _needs(backend)
    torch._dynamo.reset()
    heads, dim = 4, 32
    lin = torch.nn.Linear(128, 3 * heads * dim, device="cuda")
    inv_freq = _inv_freq(dim).cuda()

    def f(h, positions):
        qkv = lin(h)
        x = qkv.view(h.shape[0], 3, heads, dim)[:, :2].flatten(1, 2)
        return ragged.rotary_embedding(x, positions, inv_freq, 0.9, backend=backend)

    h = torch.randn(67, 128, device="cuda", requires_grad=True)
    positions = torch.arange(67, device="cuda") % 23
    out = torch.compile(f, fullgraph=True)(h, positions)
    ref = f(h, positions)
    torch.testing.assert_close(out, ref)
    (g1,) = torch.autograd.grad(out.square().sum(), h)
    (g2,) = torch.autograd.grad(ref.square().sum(), h)
    torch.testing.assert_close(g1, g2)
    torch._dynamo.reset()


def test_cuda_graph_capture():
    """Forward and backward captured once, replayed on new values and new positions."""
    _needs("triton")
    gen = _gen("graph")
    qkv, x, positions = _batch(16, 100, 6, 64, torch.bfloat16, gen)
    inv_freq = _inv_freq(64).cuda()
    g = torch.randn(x.shape, generator=gen, device="cuda").to(torch.bfloat16)
    args = RotaryEmbeddingArgs(x, positions, inv_freq, 1.0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ragged.rotary_embedding(x, positions, inv_freq, backend="triton")  # warm-up on the side stream
        ROTARY_EMBEDDING.call_backward(args, RotaryEmbeddingBackwardInputs(g), "triton")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ragged.rotary_embedding(x, positions, inv_freq, backend="triton")
        dx = ROTARY_EMBEDDING.call_backward(args, RotaryEmbeddingBackwardInputs(g), "triton").x
    qkv[:, :2].copy_(torch.randn(qkv[:, :2].shape, generator=gen, device="cuda").to(torch.bfloat16))
    positions.copy_(torch.randint(0, 1000, positions.shape, generator=gen, device="cuda"))
    g.copy_(torch.randn(g.shape, generator=gen, device="cuda").to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, _oracle(x, positions, inv_freq), _low_precision(x, positions, inv_freq, 1.0), torch.bfloat16)
    _check(dx, _oracle(g, positions, -inv_freq), _low_precision(g, positions, -inv_freq, 1.0), torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_indexing(backend):
    """Token rows past 2**31 elements of a fused QKV buffer: index arithmetic must not wrap."""
    _needs(backend)
    heads, dim = 16, 128
    total = 2**31 // (3 * heads * dim) + 1000  # 2.1e9 bf16 elements, 4.3 GB (+2.9 GB out)
    free, _ = torch.cuda.mem_get_info()
    if free < (40 if backend == "torch" else 12) * 2**30:
        pytest.skip("needs 12 GiB (40 for the reference) of free GPU memory")
    qkv = torch.zeros(total, 3, heads, dim, dtype=torch.bfloat16, device="cuda")
    tail = torch.randn(5, 3, heads, dim, generator=_gen("int64"), device="cuda").to(torch.bfloat16)
    qkv[-5:] = tail
    x = qkv[:, :2].flatten(1, 2)
    positions = torch.arange(total, device="cuda") % 8192
    inv_freq = _inv_freq(dim).cuda()
    out = ragged.rotary_embedding(x, positions, inv_freq, backend=backend)
    want = _oracle(tail[:, :2].flatten(1, 2), positions[-5:], inv_freq)
    torch.testing.assert_close(out[-5:].double(), want, rtol=1.6e-2, atol=1e-2)
    assert out[:-5].abs().max() == 0
