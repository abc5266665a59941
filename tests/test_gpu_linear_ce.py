"""linear_cross_entropy on the GPU (``pytest -m gpu``): the Triton steps and the torch steps at
LM-head sizes against a float32 computation from the same low-precision logits (what HF's loss
computes), no host sync, and the memory the chunks save."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ragged

pytestmark = pytest.mark.gpu

BACKENDS = ["triton", "torch"]


def _case(dtype, t, d, v, seed, ignore_every=5):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn((t, d), generator=g, device="cuda").to(dtype)
    w = (torch.randn((v, d), generator=g, device="cuda") * d**-0.5).to(dtype)
    b = (torch.randn((v,), generator=g, device="cuda") * 0.1).to(dtype)
    target = torch.randint(0, v, (t,), generator=g, device="cuda")
    target[::ignore_every] = -100
    return h, w, b, target


def _hf(h, w, b, target, softcap):
    z = F.linear(h, w, b).float()
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    return F.cross_entropy(z, target, reduction="sum")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,d,v,softcap", [(1, 64, 1000, None), (777, 256, 32001, None), (2048, 512, 50257, 30.0)])
def test_against_the_float32_loss_of_the_same_logits(backend, dtype, t, d, v, softcap):
    h, w, b, target = _case(dtype, t, d, v, seed=t + v)
    leaves = [x.requires_grad_(True) for x in (h, w, b)]
    got = ragged.linear_cross_entropy(h, w, target, b, reduction="sum", softcap=softcap, backend=backend)
    grads = torch.autograd.grad(got, leaves)
    ref_leaves = [x.detach().float().requires_grad_(True) for x in leaves]
    # the reference reads the same rounded logits (a bf16 head's), then works in float32
    want = _hf(h.detach(), w.detach(), b.detach(), target, softcap)
    want32 = _hf(*ref_leaves, target, softcap)
    ref = torch.autograd.grad(want32, ref_leaves)
    torch.testing.assert_close(got, want, rtol=2e-5 if dtype != torch.float32 else 1e-4, atol=1e-3)
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    for name, a, c in zip(("hidden", "weight", "bias"), grads, ref):
        assert a.dtype == dtype
        scale = c.abs().max().item()
        torch.testing.assert_close(a.float(), c, atol=tol * scale, rtol=tol, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_host_sync_and_fewer_bytes_than_the_logits(backend):
    t, d, v = 4096, 512, 128256
    h, w, _, target = _case(torch.bfloat16, t, d, v, seed=1)
    h.requires_grad_(True)
    w.requires_grad_(True)
    ragged.linear_cross_entropy(h, w, target, backend=backend).backward()  # compiles
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = ragged.linear_cross_entropy(h, w, target, backend=backend)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    peak = torch.cuda.max_memory_allocated() - before
    logits32 = t * v * 4
    # the gradients (h, w) and one slice of logits at a time, far below the float32 logits
    assert peak < logits32 / 2, (peak, logits32)
    assert torch.isfinite(loss)


def test_backends_agree_on_a_qwen_sized_head():
    h, w, _, target = _case(torch.bfloat16, 3000, 896, 151936, seed=7)
    out = {}
    for backend in BACKENDS:
        hh, ww = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
        loss = ragged.linear_cross_entropy(hh, ww, target, backend=backend)
        out[backend] = (loss, *torch.autograd.grad(loss, (hh, ww)))
    for a, c in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(a.float(), c.float(), atol=2e-2 * c.abs().max().item(), rtol=2e-2)
