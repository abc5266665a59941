"""The encoder layer core (ragged.nn.layer): the one-autograd-node training step and the direct
inference path of ragged.nn.TransformerEncoderLayer.

Oracle: the per-op path of the same layer (the same LayerSpec through the Recorded kernel set)
(every op recorded by autograd), in float64 on
the CPU with the fused ops' torch backends: values and every gradient. With dropout the
two paths draw their masks in another order, so there the backward is checked by
``torch.autograd.gradcheck`` on a function that reseeds torch before each call.
"""

from __future__ import annotations

import itertools
import os
import zlib

import pytest
import torch
from torch import nn

import ragged
from ragged import RaggedTensor, backends
from ragged.nn import layer as layer_mod
from ragged.nn import transformer as tmod

D, HEADS, FF = 8, 2, 16
GRID = list(itertools.product([False, True], ["relu", "gelu", "gelu_tanh"], [True, False], [False, True]))
LENGTHS = [3, 0, 5, 1, 4]


def _layer(norm_first, activation, bias, dropout=0.0, seed=0):
    act = nn.GELU(approximate="tanh") if activation == "gelu_tanh" else activation
    layer = ragged.nn.TransformerEncoderLayer(
        D,
        HEADS,
        FF,
        dropout=dropout,
        activation=act,
        batch_first=True,
        norm_first=norm_first,
        bias=bias,
        dtype=torch.float64,
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1.0 + 0.1 * noise if name.startswith("norm") and name.endswith("weight") else 0.4 * noise)
    return layer.train()


def _input(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), D, generator=g, dtype=torch.float64, requires_grad=True)
    return x, RaggedTensor.from_lengths(x, lengths)


def _grads(layer, x, out, up):
    params = [p for p in layer.parameters()]
    return torch.autograd.grad(out, [x, *params], up, allow_unused=True)


@pytest.fixture
def torch_backends(monkeypatch):
    """The layer's GPU path (fused ops and the one-node step) on the CPU, through the torch backends."""
    monkeypatch.setattr(tmod, "fused_backend", lambda x: "torch")
    return monkeypatch


def _per_op(monkeypatch):
    """Every later call of the layers runs the per-op path (Recorded), as when a weight cannot be
    read by the fused kernels."""
    monkeypatch.setattr(layer_mod, "weights_match_input", lambda spec, x, plain_only: (False, False))


def _force_kernels(monkeypatch, ln, act):
    """The one-node step with the LayerNorm and bias + activation implementations of these
    backends (the attention stays as chosen)."""
    real = layer_mod.choose_kernels

    def choose(*args):
        found = real(*args)
        return layer_mod.LayerKernels(
            found.attention, backends.implementation("add_layer_norm", ln), backends.implementation("bias_act", act)
        )

    monkeypatch.setattr(layer_mod, "choose_kernels", choose)


@pytest.mark.parametrize("norm_first,activation,bias,causal", GRID, ids=["-".join(map(str, c)) for c in GRID])
def test_one_node_matches_per_op_path(torch_backends, norm_first, activation, bias, causal):
    seed = zlib.crc32(repr((norm_first, activation, bias, causal)).encode()) % 1000
    layer = _layer(norm_first, activation, bias, seed=seed)
    x, rt = _input(LENGTHS, seed)
    up = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)

    got = layer(rt, is_causal=causal).values
    assert type(got.grad_fn).__name__ == "LayerFunctionBackward", "the one-node step was not taken"
    got_grads = _grads(layer, x, got, up)

    _per_op(torch_backends)
    expected = layer(rt, is_causal=causal).values
    assert type(expected.grad_fn).__name__ != "LayerFunctionBackward"
    want_grads = _grads(layer, x, expected, up)

    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, g, w in zip(names, got_grads, want_grads):
        assert (g is None) == (w is None), name
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"{n}: {m}")


def _compiling_ahead() -> bool:
    try:
        from ragged.kernels.triton import launch
    except ImportError:  # no Triton: nothing compiles ahead
        return False
    return launch._DRY.active


def _spy_direct(monkeypatch):
    """The LayerSpecs of the layers computed through the direct inference kernel set."""
    calls = []
    real = layer_mod._forward

    def spy(spec, x, cu, max_len, causal, k, saved=None):
        # not the pass that compiles a layer's kernels ahead of its first call (it launches nothing)
        if type(k) is layer_mod.Direct and not _compiling_ahead():
            calls.append(spec)
        return real(spec, x, cu, max_len, causal, k, saved)

    monkeypatch.setattr(layer_mod, "_forward", spy)
    return calls


@pytest.mark.parametrize("norm_first,activation,bias,causal", GRID[::3], ids=["-".join(map(str, c)) for c in GRID[::3]])
def test_direct_inference_matches_per_op_path(torch_backends, norm_first, activation, bias, causal):
    """Without autograd (no_grad, eval) the layer calls the kernels straight: same values."""
    seed = zlib.crc32(repr(("inference", norm_first, activation, bias, causal)).encode()) % 1000
    layer = _layer(norm_first, activation, bias, seed=seed).eval()
    x, rt = _input(LENGTHS, seed)
    calls = _spy_direct(torch_backends)
    with torch.no_grad():
        got = layer(rt, is_causal=causal).values
        assert len(calls) == 1, "the direct inference path was not taken"
        _per_op(torch_backends)
        expected = layer(rt, is_causal=causal).values
    assert got.grad_fn is None
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_direct_inference_of_a_stack(torch_backends, norm_first):
    """An encoder runs every layer through the direct path (choices made once) with each
    layer's own weights and eps, and a final norm: same values as the per-op path; with
    parameters that require grad, grad mode off is what makes it inference."""
    layer = _layer(norm_first, "gelu", True, seed=5)
    enc = ragged.nn.TransformerEncoder(layer, 3, norm=nn.LayerNorm(D, dtype=torch.float64)).eval()
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    enc.layers[1].norm2.eps = 1e-2
    x, rt = _input([7, 1, 0, 4, 2], 8)
    calls = _spy_direct(torch_backends)
    with torch.no_grad():
        got = enc(rt).values
    assert len(calls) == 3
    assert enc(rt).values.grad_fn is not None, "with grad enabled the step keeps its graph"
    assert len(calls) == 3
    with torch.no_grad():
        _per_op(torch_backends)
        expected = enc(rt).values
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_direct_inference_only_where_it_applies(torch_backends):
    layer = _layer(False, "relu", True, dropout=0.25, seed=2)
    x, rt = _input([3, 2], 1)
    calls = _spy_direct(torch_backends)
    with torch.no_grad():
        layer(rt)  # training mode with dropout: the no-autograd forward of the one-node step, masks drawn
    callable_act = ragged.nn.TransformerEncoderLayer(
        D, HEADS, FF, dropout=0.0, activation=lambda t: t.tanh(), batch_first=True, dtype=torch.float64
    ).eval()
    with torch.no_grad():
        callable_act(rt)
        layer.eval()(RaggedTensor.from_lengths(torch.zeros(0, D, dtype=torch.float64), [0, 0]))
    assert calls == []
    with torch.no_grad():
        layer(rt)
    assert len(calls) == 1
    # a stack with a hooked layer: that layer is called as a module (its hook runs), the others
    # still go straight; the whole-stack path (choices made once) is not taken
    enc = ragged.nn.TransformerEncoder(_layer(False, "relu", True), 3).eval()
    seen = []
    enc.layers[1].register_forward_hook(lambda *a: seen.append(1))
    calls.clear()
    with torch.no_grad():
        enc(rt)
    assert seen == [1] and len(calls) == 3


def test_no_grad_training_forward_draws_the_masks_of_the_one_node_step(torch_backends):
    """Training mode with dropout under no_grad: the one-node forward without saving, so the
    same seed gives the same values as with autograd."""
    layer = _layer(True, "gelu", True, dropout=0.25, seed=9)
    x, rt = _input(LENGTHS, 9)
    torch.manual_seed(3)
    with torch.no_grad():
        got = layer(rt).values
    torch.manual_seed(3)
    expected = layer(rt).values
    assert type(expected.grad_fn).__name__ == "LayerFunctionBackward"
    torch.testing.assert_close(got, expected.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_one_node_with_dropout_passes_gradcheck(torch_backends, norm_first):
    layer = _layer(norm_first, "gelu", True, dropout=0.25, seed=3)
    x, rt = _input([3, 1, 4], 4)
    names = [n for n, _ in layer.named_parameters()]

    def reseeded(x_, *ps):
        # the same dropout masks (attention's included) on every call
        torch.manual_seed(0)
        out = torch.func.functional_call(layer, dict(zip(names, ps)), (rt.with_values(x_),)).values
        assert type(out.grad_fn).__name__ == "LayerFunctionBackward", "the one-node step was not taken"
        return out

    inputs = [x.detach().clone().requires_grad_(True)]
    inputs += [p.detach().clone().requires_grad_(True) for p in layer.parameters()]
    base = reseeded(*inputs)
    torch.testing.assert_close(base, reseeded(*inputs), rtol=0, atol=0)
    torch.manual_seed(1)
    assert not torch.equal(base, layer(rt).values), "dropout 0.25 drew the same masks for another seed"
    with torch.no_grad():
        layer.eval()
        plain = layer(rt).values
        layer.train()
    assert not torch.allclose(base, plain), "dropout 0.25 changed nothing"
    assert torch.autograd.gradcheck(reseeded, inputs, eps=1e-6, atol=1e-6, fast_mode=True)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_one_node_triton_backward_takes_dropout_back(monkeypatch, norm_first):
    """With dropout, the Triton backward passes that also take the dropout back (LayerNorm +
    dropout + the Linear's bias sum; bias_act + dropout) against the torch backends'
    LayerNorm backward, dropout backward and sum: the same masks (reseeded), float32 on CPU."""
    layer = _layer(norm_first, "gelu", True, dropout=0.25, seed=5).float()
    layer.self_attn.dropout = 0.0  # the attention stays on the torch backend; its masks are tested elsewhere
    x, rt = _input([3, 1, 6, 2], 6)
    x = x.detach().float().requires_grad_(True)
    rt = rt.with_values(x)
    up = torch.randn(x.shape, generator=torch.Generator().manual_seed(8))
    monkeypatch.setattr(tmod, "fused_backend", lambda x: "triton")

    def run(ln, act):
        monkeypatch.undo()
        monkeypatch.setattr(tmod, "fused_backend", lambda x: "triton")
        _force_kernels(monkeypatch, ln, act)
        torch.manual_seed(0)
        out = layer(rt).values
        assert type(out.grad_fn).__name__ == "LayerFunctionBackward"
        return out, _grads(layer, x, out, up)

    got, got_grads = run("triton", "triton")
    want, want_grads = run("torch", "torch")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, g, w in zip(names, got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
@pytest.mark.parametrize("frozen", ["none", "some", "input"])
def test_one_node_triton_backward_shared_sums(monkeypatch, norm_first, dropout, frozen):
    """The Triton backward leaves every column sum (LayerNorm weights and biases, Linear
    biases) in one buffer reduced at the end: against the torch backends with some parameters
    frozen (their sums skipped, the others in the right columns) and with the input not
    needing a gradient (the pre-norm first LayerNorm's backward then runs for its weights
    only); float32 on CPU, the same masks."""
    layer = _layer(norm_first, "gelu", True, dropout=dropout, seed=6).float()
    layer.self_attn.dropout = 0.0
    if frozen == "some":
        for name in ("norm1.weight", "linear1.bias", "self_attn.out_proj.bias", "norm2.bias"):
            layer.get_parameter(name).requires_grad_(False)
    x, rt = _input([4, 1, 5, 3], 9)
    x = x.detach().float().requires_grad_(frozen != "input")
    rt = rt.with_values(x)
    up = torch.randn(x.shape, generator=torch.Generator().manual_seed(10))
    params = [(n, p) for n, p in layer.named_parameters() if p.requires_grad]

    def run(backend):
        monkeypatch.undo()
        monkeypatch.setattr(tmod, "fused_backend", lambda x: "triton")
        _force_kernels(monkeypatch, backend, backend)
        torch.manual_seed(0)
        out = layer(rt).values
        assert type(out.grad_fn).__name__ == "LayerFunctionBackward"
        inputs = ([x] if x.requires_grad else []) + [p for _, p in params]
        return out, torch.autograd.grad(out, inputs, up)

    got, got_grads = run("triton")
    want, want_grads = run("torch")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    names = (["x"] if x.requires_grad else []) + [n for n, _ in params]
    for name, g, w in zip(names, got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_one_node_only_where_it_applies(torch_backends):
    layer = _layer(False, "relu", True)
    x, rt = _input([2, 3], 0)
    with torch.no_grad():
        assert layer(rt).values.grad_fn is None
    callable_act = ragged.nn.TransformerEncoderLayer(
        D, HEADS, FF, dropout=0.0, activation=lambda t: t.tanh(), batch_first=True, dtype=torch.float64
    ).train()
    out = callable_act(rt).values
    assert type(out.grad_fn).__name__ != "LayerFunctionBackward"
    frozen = _layer(False, "relu", True)
    for p in frozen.parameters():
        p.requires_grad_(False)
    plain = RaggedTensor.from_lengths(x.detach(), [2, 3])
    assert frozen(plain).values.grad_fn is None
    empty = RaggedTensor.from_lengths(torch.zeros(0, D, dtype=torch.float64, requires_grad=True), [0, 0])
    assert type(layer(empty).values.grad_fn).__name__ != "LayerFunctionBackward"


def test_one_node_leaves_frozen_parameters_without_grad(torch_backends):
    layer = _layer(True, "gelu", True)
    for name, p in layer.named_parameters():
        p.requires_grad_(name.startswith("linear"))
    x, rt = _input(LENGTHS, 7)
    out = layer(rt).values
    assert type(out.grad_fn).__name__ == "LayerFunctionBackward"
    out.sum().backward()
    for name, p in layer.named_parameters():
        assert (p.grad is not None) == name.startswith("linear"), name
    assert x.grad is not None and torch.isfinite(x.grad).all()


# --------------------------------------------------------------------------------------
# GPU (pytest -m gpu): the one-node step on the CUDA / Triton kernels


@pytest.mark.gpu
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_one_node_matches_per_op_path(monkeypatch, norm_first, dtype):
    """Same kernels, one autograd node against the per-op path: values and every gradient
    (dropout 0), then with dropout: reproducible, finite, no host sync."""
    d, heads = 128, 2
    layer = ragged.nn.TransformerEncoderLayer(
        d,
        heads,
        2 * d,
        dropout=0.0,
        activation="gelu",
        batch_first=True,
        norm_first=norm_first,
        device="cuda",
        dtype=dtype,
    ).train()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            noise = torch.randn(p.shape, generator=g).to("cuda", dtype)
            p.copy_(1.0 + 0.1 * noise if name.startswith("norm") and name.endswith("weight") else d**-0.5 * noise)
    lengths = [37, 0, 130, 1, 64]
    x = torch.randn(sum(lengths), d, generator=g).to("cuda", dtype).requires_grad_(True)
    rt = RaggedTensor.from_lengths(x, lengths)
    up = torch.randn(x.shape, generator=g).to("cuda", dtype)
    got = layer(rt).values
    assert type(got.grad_fn).__name__ == "LayerFunctionBackward"
    got_grads = _grads(layer, x, got, up)
    with monkeypatch.context() as m:
        _per_op(m)
        expected = layer(rt).values
        want_grads = _grads(layer, x, expected, up)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, expected, **tol)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, got_grads, want_grads):
        scale = b.abs().max().clamp_min(1e-3)
        torch.testing.assert_close(a / scale, b / scale, **tol, msg=lambda msg, n=name: f"{n}: {msg}")

    for module in layer.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.1
    layer.self_attn.dropout = 0.1
    torch.manual_seed(5)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layer(rt).values
        grads = _grads(layer, x, out, up)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.manual_seed(5)
    again = layer(rt).values
    assert torch.equal(out, again)
    assert all(torch.isfinite(t).all() for t in grads)


@pytest.mark.gpu
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("lengths", [[37, 0, 1, 20, 64], [37, 0, 300, 1, 64]], ids=["short", "long"])
def test_gpu_direct_inference_matches_per_op_path(monkeypatch, norm_first, dtype, lengths):
    """An eval encoder under no_grad: every layer through the direct path (CUDA short attention
    reading the input projection in place, LayerNorms without statistics; Triton attention for
    the long batch and for float32), no host sync, against the per-op path; the first layer's
    input misaligned (its LayerNorm then takes the general kernel)."""
    d, heads = 128, 2
    layer = ragged.nn.TransformerEncoderLayer(
        d,
        heads,
        2 * d,
        dropout=0.1,
        activation="gelu",
        batch_first=True,
        norm_first=norm_first,
        device="cuda",
        dtype=dtype,
    )
    enc = ragged.nn.TransformerEncoder(layer, 2).eval()
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, p in enc.named_parameters():
            noise = torch.randn(p.shape, generator=g).to("cuda", dtype)
            p.copy_(1.0 + 0.1 * noise if ".norm" in name and name.endswith("weight") else d**-0.5 * noise)
    total = sum(lengths)
    for misaligned in (False, True):
        buf = torch.full((total * d + 8,), float("nan"), dtype=dtype, device="cuda")
        x = buf[1 : 1 + total * d].view(total, d) if misaligned else buf[: total * d].view(total, d)
        x.copy_(torch.randn((total, d), generator=g).to("cuda", dtype))
        assert (x.data_ptr() % 16 != 0) == misaligned
        rt = RaggedTensor.from_lengths(x, lengths)
        calls = _spy_direct(monkeypatch)
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.no_grad():
                got = enc(rt).values
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert len(calls) == 2, "the direct inference path was not taken"
        with monkeypatch.context() as m, torch.no_grad():
            _per_op(m)
            expected = enc(rt).values
        monkeypatch.undo()
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, **tol)


def test_one_node_second_backward_raises(torch_backends):
    """The hand-written layer backward is first order: a second backward raises rather than
    returning gradients that treat the saved statistics as constants."""
    layer = _layer(False, "gelu", True, seed=3)
    x, rt = _input(LENGTHS, 3)
    out = layer(rt).values
    assert type(out.grad_fn).__name__ == "LayerFunctionBackward"
    (gx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.sum().backward()


@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_a_layer_spec_built_by_hand_runs_without_a_module(norm_first):
    """An adapter only describes a layer: weights taken out of a torch.nn layer into a hand-built
    LayerSpec, through run_layer on every path (recorded, one node, direct), give torch.nn's
    values and gradients (float64, CPU, the fused ops' torch backends)."""
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(
        D, HEADS, FF, dropout=0.0, activation="gelu", batch_first=True, norm_first=norm_first, dtype=torch.float64
    ).eval()
    attn = ref.self_attn
    weights = layer_mod.LayerWeights(
        attn.in_proj_weight,
        attn.in_proj_bias,
        attn.out_proj.weight,
        attn.out_proj.bias,
        ref.norm1.weight,
        ref.norm1.bias,
        ref.linear1.weight,
        ref.linear1.bias,
        ref.linear2.weight,
        ref.linear2.bias,
        ref.norm2.weight,
        ref.norm2.bias,
    )
    spec = layer_mod.LayerSpec(
        HEADS, D // HEADS, norm_first, "gelu", (ref.norm1.eps, ref.norm2.eps), (0.0, 0.0, 0.0, 0.0), weights
    )
    x, rt = _input(LENGTHS, 21)
    padded = rt.to_padded()
    want = ref(padded, src_key_padding_mask=rt.padding_mask())
    want = ragged.pack(want, lengths=rt.host_lengths()).values
    up = torch.randn(x.shape, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    (want_gx,) = torch.autograd.grad(want, x, up)
    for fused, eager in ((None, True), ("torch", True), ("torch", False)):
        got = layer_mod.run_layer(spec, x, rt.offsets, rt.max_len, False, fused, eager)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        (gx,) = torch.autograd.grad(got, x, up)
        torch.testing.assert_close(gx, want_gx, rtol=1e-9, atol=1e-11)
        with torch.no_grad():
            torch.testing.assert_close(
                layer_mod.run_layer(spec, x, rt.offsets, rt.max_len, False, fused, eager), want, rtol=1e-10, atol=1e-12
            )


@pytest.mark.gpu
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_gpu_layer_norm_parameters_of_another_dtype(norm_first):
    """bf16 activations with float32 LayerNorm parameters (a common mixed setup): the fused
    paths do not take them, the per-op path runs a LayerNorm implementation that does (the
    stack's CUDA choice is confirmed per call); values and gradients against the same layer run
    in float32."""
    d, heads = 64, 2
    layer = ragged.nn.TransformerEncoderLayer(
        d,
        heads,
        2 * d,
        dropout=0.0,
        activation="gelu",
        batch_first=True,
        norm_first=norm_first,
        device="cuda",
        dtype=torch.bfloat16,
    ).train()
    for norm in (layer.norm1, layer.norm2):
        norm.float()
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    ref = _copy_float(layer)
    lengths = [17, 0, 64, 1, 33]
    g = torch.Generator().manual_seed(31)
    x = torch.randn(sum(lengths), d, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
    rt = RaggedTensor.from_lengths(x, lengths)
    out = layer(rt).values
    xr = x.detach().float().requires_grad_(True)
    want = ref(rt.with_values(xr)).values
    torch.testing.assert_close(out.float(), want, rtol=3e-2, atol=3e-2)
    up = torch.randn(x.shape, generator=g).to("cuda")
    (gx,) = torch.autograd.grad(out, x, up.to(torch.bfloat16))
    (want_gx,) = torch.autograd.grad(want, xr, up)
    scale = want_gx.abs().max()
    torch.testing.assert_close(gx.float() / scale, want_gx / scale, rtol=3e-2, atol=3e-2)
    with torch.no_grad():
        torch.testing.assert_close(
            layer.eval()(rt).values.float(), ref.eval()(rt.with_values(xr)).values, rtol=3e-2, atol=3e-2
        )


def _copy_float(layer):
    import copy

    return copy.deepcopy(layer).float()


def test_concatenated_weights_kept_only_under_frozen_weights():
    """frozen_weights keeps the fused projections' concatenation per set of Parameters, where no
    gradient is recorded; a cast or moved Parameter, a tensor that is not a Parameter, a recorded
    gradient and the outside of the context each get a fresh concatenation, always equal to
    torch.cat's."""
    from ragged.nn.layer_spec import concatenated, frozen_weights

    g = torch.Generator().manual_seed(3)
    parts = tuple(nn.Parameter(torch.randn(5 + i, 7, generator=g)) for i in range(3))
    want = torch.cat([p.detach() for p in parts])

    def same(a, b):
        return a.data_ptr() == b.data_ptr()

    with torch.no_grad():
        a, b = concatenated(parts), concatenated(parts)
        assert torch.equal(a, want) and not same(a, b)  # outside the context: a copy per call
        cache: dict = {}
        with frozen_weights(cache):
            first = concatenated(parts)
            assert torch.equal(first, want) and same(first, concatenated(parts)) and len(cache) == 1
            plain = tuple(p.detach().clone() for p in parts)
            assert not same(concatenated(plain), concatenated(plain))  # not Parameters: never kept
        with frozen_weights(cache):  # the caller's cache, kept across calls
            assert same(first, concatenated(parts))
        with frozen_weights():
            assert not same(first, concatenated(parts))  # a fresh cache
        for p in parts:  # as module.to(dtype) casts: the same Parameters, a new storage
            p.data = p.data.double()
        with frozen_weights(cache):
            again = concatenated(parts)
            assert again.dtype == torch.float64 and torch.equal(again, want.double())
    with frozen_weights(cache):  # a recorded gradient reaches the Parameters through a fresh cat
        out = concatenated(parts)
        assert out.requires_grad and not same(out, again)
        out.sum().backward()
        assert all(torch.equal(p.grad, torch.ones_like(p)) for p in parts)
