"""ragged.nn's transformer modules on the GPU (pytest -m gpu): the Triton / CUDA attention
kernels behind them against torch.nn, no sync on ragged input, compile and autocast, every
fused backend; and the layer hooks inside the encoder."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from transformer_cases import (
    ACTIVATION_MODULES,
    D,
    _check,
    _padded,
    _randomise,
    _run_ragged,
    _run_torch,
    _torch_encoder,
)

import ragged

# --------------------------------------------------------------------------------------
# GPU (pytest -m gpu): the Triton / CUDA attention kernels behind the modules

GPU_D, GPU_HEADS = 128, 2  # head dim 64
GPU_LENGTHS = [37, 0, 130, 1, 64]


def _gpu_pair(dtype, dropout=0.0, norm_first=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = nn.TransformerEncoderLayer(
            GPU_D,
            GPU_HEADS,
            2 * GPU_D,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
            norm_first=norm_first,
            device="cuda",
            dtype=dtype,
        )
        enc = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(GPU_D, device="cuda", dtype=dtype))
    _randomise(enc, 83, scale=GPU_D**-0.5)
    return enc, ragged.nn.TransformerEncoder.from_torch(enc, copy=True)


def _gpu_input(dtype, lengths=GPU_LENGTHS):
    g = torch.Generator().manual_seed(84)
    width = max(lengths)
    x = torch.randn(len(lengths), width, GPU_D, generator=g).to("cuda", dtype)
    pad = torch.arange(width).unsqueeze(0) >= torch.tensor(lengths).unsqueeze(1)
    return x, pad.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_gpu_encoder_matches_torch(dtype, causal, norm_first):
    """Both run against a float64 copy of the torch model on the GPU: ragged's error is at
    most three times torch.nn's own in the same dtype (plus a small floor), for values
    and, in fp32, every gradient. The float64 reference always takes torch.nn's plain ops
    (train mode, dropout 0): in eval mode torch.nn's GPU fast path differs from them by
    about 1e-3 in fp32, and ragged follows the plain ops."""
    enc, ours = _gpu_pair(dtype, norm_first=norm_first)
    ref = copy.deepcopy(enc).double()
    x, pad = _gpu_input(dtype)
    floor = 2e-5 if dtype == torch.float32 else 2e-3

    def close(got, theirs, want, what):
        ours_err = (got.double() - want).abs().max().item()
        torch_err = (theirs.double() - want).abs().max().item()
        assert ours_err <= 3 * torch_err + floor * max(1.0, want.abs().max().item()), (what, ours_err, torch_err)

    real = ~pad.unsqueeze(-1)
    for training in (True, False):
        for m in (enc, ours):
            m.train(training)
        ref.train()
        with torch.no_grad():  # torch.nn's rows of an empty sequence are NaN: compare real positions
            want = torch.where(real, _run_torch(ref, x.double(), pad, causal, True), 0.0)
            theirs = torch.where(real, _run_torch(enc, x, pad, causal, True), 0.0)
            got = _run_ragged(ours, x, pad, causal, True)
        assert torch.all(got[~real.expand_as(got)] == 0), "padding is not zero"
        close(got, theirs, want, f"values, training={training}")
    if dtype != torch.float32:
        return
    # gradients (no empty sequence: torch's NaN rows would poison its gradients)
    lengths = [37, 3, 130, 1, 64]
    x, pad = _gpu_input(dtype, lengths)
    w = torch.randn_like(x).masked_fill(pad.unsqueeze(-1), 0.0)
    leaves = {}
    for name, m, inp in (("ref", ref, x.double()), ("torch", enc, x), ("ours", ours, x)):
        m.train()
        m.zero_grad()
        leaf = inp.clone().requires_grad_(True)
        run = _run_ragged if name == "ours" else _run_torch
        (run(m, leaf, pad, causal, True) * w.to(leaf.dtype)).sum().backward()
        leaves[name] = (leaf.grad, dict(m.named_parameters()))
    close(leaves["ours"][0], leaves["torch"][0], leaves["ref"][0], "d input")
    for name, p in leaves["ours"][1].items():
        close(p.grad, leaves["torch"][1][name].grad, leaves["ref"][1][name].grad, f"d {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_ragged_input_does_not_sync(dtype):
    """Training (with dropout) and inference on a RaggedTensor input never read the GPU."""
    _, ours = _gpu_pair(dtype, dropout=0.1)
    rt = ragged.pack([torch.randn(n, GPU_D, device="cuda", dtype=dtype) for n in GPU_LENGTHS])
    for mode in (True, False):  # first calls: kernel compilation and tuning may read the GPU
        ours.train(mode)
        out = ours(rt, is_causal=True)
        if mode:
            out.values.float().sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ours.train()
        out = ours(rt, is_causal=True)
        out.values.float().sum().backward()
        ours.eval()
        with torch.no_grad():
            ours(rt, is_causal=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
def test_gpu_compile_and_autocast():
    torch._dynamo.reset()
    enc, ours = _gpu_pair(torch.float32)
    ours.train()
    rt = ragged.pack([torch.randn(n, GPU_D, device="cuda") for n in GPU_LENGTHS])
    compiled = torch.compile(ours, fullgraph=True)
    v = rt.values.clone().requires_grad_(True)
    out = compiled(rt.with_values(v), is_causal=True)
    ref = ours(rt, is_causal=True)
    torch.testing.assert_close(out.values, ref.values, rtol=2e-4, atol=2e-4)
    out.values.sum().backward()
    assert torch.isfinite(v.grad).all()
    x, pad = _gpu_input(torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        got = ours(x, src_key_padding_mask=pad)
        expected = enc.train()(x, src_key_padding_mask=pad)
    assert got.dtype == expected.dtype
    _check(got.float(), expected.float(), GPU_LENGTHS, tol={"rtol": 0.05, "atol": 0.05})


FUSED_BACKENDS = ["torch", "triton", "cuda", "auto"]


def _force_fused(monkeypatch, backend: str) -> None:
    """The per-token ops (residual + LayerNorm; bias + activation where it fuses) on
    ``backend``; "auto" keeps the layer's own choice. Attention stays on "auto"."""
    from ragged.nn import transformer as rt_mod

    if backend != "auto":
        monkeypatch.setattr(rt_mod, "fused_backend", lambda x: backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("activation", list(ACTIVATION_MODULES))
def test_gpu_fused_path_calls_custom_activation_modules(monkeypatch, backend, activation):
    """A ReLU subclass or a hooked GELU module is called, never replaced by the fused op:
    values against torch.nn (plain path) in float32, training and inference."""
    _force_fused(monkeypatch, backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = nn.TransformerEncoderLayer(
            GPU_D,
            GPU_HEADS,
            2 * GPU_D,
            dropout=0.0,
            activation=ACTIVATION_MODULES[activation](),
            batch_first=True,
            device="cuda",
        )
        enc = nn.TransformerEncoder(layer, 2)
    _randomise(enc, 89, scale=GPU_D**-0.5)
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True)
    x, pad = _gpu_input(torch.float32)
    enc.train()
    for training in (True, False):
        ours.train(training)
        with torch.no_grad():
            expected = enc(x, src_key_padding_mask=pad)
            got = ours(x, src_key_padding_mask=pad)
        _check(got, expected, GPU_LENGTHS, tol={"rtol": 1e-3, "atol": 1e-3})


@pytest.mark.gpu
@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_gpu_compile_inference_every_backend(monkeypatch, backend):
    """torch.compile(fullgraph=True) of inference (eval, no grad: the path that calls the
    kernels directly in eager mode) and of training, per fused-op backend, against eager."""
    torch._dynamo.reset()
    _force_fused(monkeypatch, backend)
    _, ours = _gpu_pair(torch.float32)
    rt = ragged.pack([torch.randn(n, GPU_D, device="cuda") for n in GPU_LENGTHS])
    compiled = torch.compile(ours, fullgraph=True)
    ours.eval()
    with torch.no_grad():
        out = compiled(rt, is_causal=True)
        ref = ours(rt, is_causal=True)
    torch.testing.assert_close(out.values, ref.values, rtol=2e-4, atol=2e-4)
    ours.train()
    v = rt.values.clone().requires_grad_(True)
    out = compiled(rt.with_values(v), is_causal=True)
    torch.testing.assert_close(out.values, ours(rt, is_causal=True).values, rtol=2e-4, atol=2e-4)
    out.values.sum().backward()
    assert torch.isfinite(v.grad).all()


def test_layer_hooks_fire_inside_the_encoder():
    """The encoder calls a layer's body directly only when the layer has no hooks."""
    enc = _torch_encoder(seed=31)
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True).eval()
    x, pad = _padded([3, 5], seed=31)
    seen = []
    handle = ours.layers[1].register_forward_hook(lambda mod, args, out: seen.append(out.values.shape))
    try:
        with torch.no_grad():
            hooked = ours(x, src_key_padding_mask=pad)
    finally:
        handle.remove()
    assert seen == [(8, D)]
    with torch.no_grad():
        torch.testing.assert_close(ours(x, src_key_padding_mask=pad), hooked, rtol=0, atol=0)
