"""add_rms_norm against float64 oracles written here, and against HuggingFace's RMSNorm modules.

CPU: the "torch" backend, and the Triton kernels under the interpreter at small sizes.
"""

from __future__ import annotations

import pytest
import torch
from conftest import cpu_backends
from test_fused import _gen, _randn

import ragged

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(0, 8), (1, 1), (7, 100), (5, 300), (33, 64)]
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _oracle(x, r, w, eps, unit_offset):
    """float64: ``(RMSNorm(x + r), x + r)``."""
    s = x if r is None else x + r
    n = s * torch.rsqrt(s.square().mean(dim=-1, keepdim=True) + eps)
    if w is None:
        return n, s
    return n * ((1 + w) if unit_offset else w), s


def _dtypes(backend):
    return ([torch.float64] if backend == "torch" else []) + DTYPES


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("n,f", SHAPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("weight", [False, True])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_values_and_gradients_against_float64(backend, n, f, residual, weight, unit_offset):
    if unit_offset and not weight:
        pytest.skip("unit_offset scales by 1 + weight")
    for dtype in _dtypes(backend):
        gen = _gen("rms", backend, n, f, residual, weight, unit_offset, str(dtype))
        x = _randn((n, f), dtype, gen, shift=0.3).requires_grad_(True)
        r = _randn((n, f), dtype, gen).requires_grad_(True) if residual else None
        w = (_randn((f,), dtype, gen) * 0.5).requires_grad_(True) if weight else None
        out, s = ragged.add_rms_norm(x, r, w, 1e-5, return_sum=True, unit_offset=unit_offset, backend=backend)
        assert out.dtype == dtype and out.shape == (n, f) and s.dtype == dtype
        leaves = [t for t in (x, r, w) if t is not None]
        leaves64 = [t.detach().double().requires_grad_(True) for t in leaves]
        it = iter(leaves64)
        x64, r64, w64 = next(it), next(it) if residual else None, next(it) if weight else None
        want, s64 = _oracle(x64, r64, w64, 1e-5, unit_offset)
        tol = TOL[dtype]
        scale = max(1.0, want.abs().max().item()) if n else 1.0
        torch.testing.assert_close(out.double(), want.detach(), atol=tol * scale * 2, rtol=tol * 2)
        torch.testing.assert_close(s.double(), s64.detach(), atol=tol * 2, rtol=tol)
        if n == 0:
            continue
        g = _randn((n, f), torch.float64, gen)
        gs = _randn((n, f), torch.float64, gen)
        got = torch.autograd.grad((out, s), leaves, (g.to(dtype), gs.to(dtype)))
        ref = torch.autograd.grad((want, s64), leaves64, (g, gs))
        for name, a, c in zip(("x", "residual", "weight")[: len(got)], got, ref):
            assert a.dtype == dtype
            sc = max(1.0, c.abs().max().item())
            torch.testing.assert_close(a.double(), c, atol=tol * sc * 4, rtol=tol * 4, msg=f"{name} {dtype}")


@pytest.mark.parametrize("backend", cpu_backends())
def test_equals_huggingface_rms_norms_in_bfloat16(backend):
    """The residual stream of a decoder layer in bf16: the sum, then LlamaRMSNorm / Gemma's
    RMSNorm on it, to the bit."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    del transformers
    if backend == "triton":  # (test_gpu_rms_norm.py runs this comparison on the GPU)
        pytest.skip("the Triton interpreter's float32 -> bfloat16 casts truncate: compared on the GPU")
    gen = _gen("hf rms", backend)
    f = 96
    x, r = _randn((9, f), torch.bfloat16, gen), _randn((9, f), torch.bfloat16, gen)
    for module, unit in ((LlamaRMSNorm(f, eps=1e-6), False), (GemmaRMSNorm(f, eps=1e-6), True)):
        module = module.to(torch.bfloat16)
        with torch.no_grad():
            module.weight.copy_(_randn((f,), torch.bfloat16, gen) * 0.3)
        out, s = ragged.add_rms_norm(x, r, module.weight, 1e-6, return_sum=True, unit_offset=unit, backend=backend)
        assert torch.equal(s, x + r)
        want = module(x + r)
        assert want.dtype == torch.bfloat16
        # the row's sum of squares may round differently in the last place: at most one bf16 ulp
        diff = (out.float() - want.float()).abs()
        ulp = want.float().abs().clamp_min(1e-3) * 2**-7
        assert (diff <= ulp).all(), type(module).__name__


@pytest.mark.parametrize("backend", cpu_backends())
def test_row_strided_inputs_and_qwen3_head_norms(backend):
    """Qwen3 normalises each head of q and k: the rows are token heads of a fused projection,
    read with a row stride."""
    gen = _gen("strided rms", backend)
    qkv = _randn((11, 3 * 4 * 16), torch.float32, gen)
    q = qkv[:, : 4 * 16].reshape(11 * 4, 16)  # contiguous rows of 16 inside a strided view? no: copy
    heads = qkv.view(11, 3, 4, 16)[:, 0].reshape(44, 16)
    w = _randn((16,), torch.float32, gen)
    got = ragged.add_rms_norm(qkv.view(11, 192)[:, 5:21], None, w, backend=backend)  # row stride 192
    want, _ = _oracle(qkv[:, 5:21].double(), None, w.double(), 1e-6, False)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ragged.add_rms_norm(heads, None, w, backend=backend), ragged.add_rms_norm(q, None, w))


def test_bad_arguments_name_the_function_and_argument():
    x = torch.randn(4, 8)
    fn = r"ragged\.add_rms_norm\(\)"
    cases = [
        (dict(x=x[0]), ValueError, "x"),
        (dict(x=x.long()), TypeError, "x"),
        (dict(residual=torch.randn(4, 7)), ValueError, "residual"),
        (dict(residual=x.double()), ValueError, "residual"),
        (dict(weight=torch.randn(7)), ValueError, "weight"),
        (dict(eps=-1.0), ValueError, "eps"),
        (dict(return_sum=1), TypeError, "return_sum"),
        (dict(unit_offset="yes"), TypeError, "unit_offset"),
    ]
    for change, kind, word in cases:
        kwargs = dict(x=x)
        kwargs.update(change)
        with pytest.raises(kind, match=rf"{fn}.*{word}"):
            ragged.add_rms_norm(**kwargs)


def test_second_order_raises():
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(ragged.add_rms_norm(x, None, w).square().sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        g.sum().backward()


@pytest.mark.parametrize("backend", cpu_backends())
def test_compile_fullgraph_forward_backward(backend):
    torch._dynamo.reset()
    x = torch.randn(6, 32, requires_grad=True)
    r = torch.randn(6, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)

    def f(x, r, w):
        out, s = ragged.add_rms_norm(x, r, w, return_sum=True, backend=backend)
        return out * 2 + s

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, r, w)
    want = f(x, r, w)
    torch.testing.assert_close(got, want)
    for a, c in zip(torch.autograd.grad(got.sum(), (x, r, w)), torch.autograd.grad(want.sum(), (x, r, w))):
        torch.testing.assert_close(a, c)


def test_opcheck():
    ops = torch.ops.ragged
    x = torch.randn(5, 12, requires_grad=True)
    r = torch.randn(5, 12, requires_grad=True)
    w = torch.randn(12, requires_grad=True)
    torch.library.opcheck(ops.add_rms_norm.default, (x, r, w, 1e-6, False, "torch"))
    torch.library.opcheck(ops.add_rms_norm.default, (x, None, w, 1e-6, True, "torch"))
    torch.library.opcheck(ops.add_rms_norm.default, (x, None, None, 1e-5, False, "torch"))
