"""add_rms_norm on the GPU (``pytest -m gpu``): the Triton kernels at decoder widths against
float64 and against HuggingFace's RMSNorm modules in bfloat16, without a host sync."""

from __future__ import annotations

import pytest
import torch

import ragged

pytestmark = pytest.mark.gpu

WIDTHS = [896, 1024, 2304, 4096, 8192, 16384]


def _inputs(dtype, n, f, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((n, f), generator=g, device="cuda").to(dtype)
    r = torch.randn((n, f), generator=g, device="cuda").to(dtype)
    w = (torch.randn((f,), generator=g, device="cuda") * 0.3 + 1).to(dtype)
    return x, r, w


@pytest.mark.parametrize("f", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_against_float64(f, dtype, unit_offset):
    x, r, w = _inputs(dtype, 3001, f, seed=f)
    leaves = [t.requires_grad_(True) for t in (x, r, w)]
    out, s = ragged.add_rms_norm(x, r, w, 1e-6, return_sum=True, unit_offset=unit_offset, backend="triton")
    g = torch.randn_like(out)
    got = torch.autograd.grad((out, s), leaves, (g, g))
    l64 = [t.detach().double().requires_grad_(True) for t in leaves]
    s64 = l64[0] + l64[1]
    n64 = s64 * torch.rsqrt(s64.square().mean(-1, keepdim=True) + 1e-6)
    want = n64 * ((1 + l64[2]) if unit_offset else l64[2])
    ref = torch.autograd.grad((want, s64), l64, (g.double(), g.double()))
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.double(), want.detach(), atol=tol * 4, rtol=tol * 2)
    for name, a, c in zip(("x", "residual", "weight"), got, ref):
        sc = c.abs().max().item()
        torch.testing.assert_close(a.double(), c, atol=tol * sc * 2, rtol=tol * 4, msg=name)


def test_huggingface_modules_in_bfloat16_without_a_sync():
    pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    f = 896
    x, r, w = _inputs(torch.bfloat16, 4096, f, seed=3)
    for module, unit in ((LlamaRMSNorm(f, eps=1e-6), False), (GemmaRMSNorm(f, eps=1e-6), True)):
        module = module.to("cuda", torch.bfloat16)
        with torch.no_grad():
            module.weight.copy_(w - 1 if unit else w)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out, s = ragged.add_rms_norm(x, r, module.weight, 1e-6, return_sum=True, unit_offset=unit)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(s, x + r)
        want = module(x + r)
        diff = (out.float() - want.float()).abs()
        # the row's sum of squares is reduced in another order: at most one bf16 ulp apart
        assert (diff <= want.float().abs().clamp_min(1e-3) * 2**-7).all(), type(module).__name__
        assert (out == want).float().mean() > 0.99
