"""bias_act and add_layer_norm against a float64 oracle written here with plain torch ops.

CPU: the "torch" backend, and the Triton kernels under the interpreter at small sizes
(the interpreted configurations use small blocks, so F = 777 already takes the chunked
layer norm and several column blocks). GPU sizes are in test_gpu_fused.py.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F
from conftest import TRITON_ON_CPU, cpu_backends

import ragged
from ragged.ops.fused import ADD_LAYER_NORM, BIAS_ACT, reference_add_layer_norm_backward, reference_bias_act_backward
from ragged.records.fused import (
    AddLayerNormArgs,
    AddLayerNormBackwardInputs,
    AddLayerNormGrads,
    AddLayerNormOutput,
    BiasActArgs,
    BiasActBackwardInputs,
    BiasActGrads,
    BiasActOutput,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACTIVATIONS = ["relu", "gelu", "gelu_tanh", "silu", "none"]
SHAPES = [(0, 768), (1, 1), (7, 100), (33, 777)]  # (N rows, F features)
# Backstop tolerances (atol relative to the largest reference value, rtol) by output dtype.
TOL = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _randn(shape, dtype, gen, shift=0.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) + shift).to(dtype)


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0


def _close(out: torch.Tensor, ref: torch.Tensor, what: str, dtype: torch.dtype | None = None):
    """``out`` against the float64 oracle ``ref`` with the backstop tolerance of its dtype."""
    assert out.shape == ref.shape, what
    atol, rtol = TOL[dtype or out.dtype]
    scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    torch.testing.assert_close(
        out.double(), ref.detach().double(), atol=atol * scale, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def _no_worse_than_torch(out: torch.Tensor, lowp: torch.Tensor, ref: torch.Tensor, what: str, backend: str):
    """The kernel's error is at most twice that of torch itself in the same precision.

    Not for bfloat16 from the Triton interpreter: it truncates fp32 -> bf16 (the GPU
    rounds to nearest even), a full ulp where torch errs by half; the backstop
    tolerance still holds there, and the GPU tests make this check."""
    if backend == "triton" and TRITON_ON_CPU and out.dtype == torch.bfloat16:
        return
    atol, _ = TOL[out.dtype]
    scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    ours, theirs = _err(out, ref), _err(lowp, ref)
    assert ours <= 2 * theirs + 0.1 * atol * scale, f"{what}: error {ours:.3g} vs torch's {theirs:.3g}"


def _act64(z: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu":
        return F.relu(z)
    if activation == "gelu":
        return F.gelu(z)
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if activation == "silu":
        return z * torch.sigmoid(z)
    return z


def _leaf64(t):
    return None if t is None else t.detach().double().requires_grad_(True)


def _grads(out, inputs, grad):
    """Gradients of ``(out * grad).sum()`` for the inputs that are not None."""
    present = [t for t in inputs if t is not None]
    got = torch.autograd.grad(out, present, grad, allow_unused=True)
    it = iter(got)
    return [None if t is None else next(it) for t in inputs]


# --------------------------------------------------------------------------------------
# bias_act


def _bias_act_case(backend, dtype, activation, with_bias, n, f, param_dtype=None):
    gen = _gen("bias_act", backend, str(dtype), activation, with_bias, n, f)
    x = _randn((n, f), dtype, gen).requires_grad_(True)
    b = _randn((f,), param_dtype or dtype, gen).requires_grad_(True) if with_bias else None
    y = ragged.bias_act(x, b, activation, backend=backend)
    x64, b64 = _leaf64(x), _leaf64(b)
    ref = _act64(x64 + (0.0 if b64 is None else b64), activation)
    g = _randn((n, f), dtype, gen)
    dx, db = _grads(y, (x, b), g)
    dx64, db64 = _grads(ref, (x64, b64), g.double())
    return x, b, y, ref, (dx, db), (dx64, db64), g


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_bias_act_matches_float64(backend, dtype, activation, with_bias):
    for n, f in SHAPES:
        x, b, y, ref, (dx, db), (dx64, db64), _ = _bias_act_case(backend, dtype, activation, with_bias, n, f)
        what = f"N={n} F={f}"
        assert y.dtype == dtype and dx.dtype == dtype
        _close(y, ref, f"y {what}")
        _close(dx, dx64, f"dx {what}")
        if with_bias:
            assert db.dtype == dtype
            _close(db, db64, f"dbias {what}", dtype)
        if n and dtype != torch.float32:  # torch's own error in the same precision
            z = x.detach() + (0 if b is None else b.detach())
            _no_worse_than_torch(y, _act64(z, activation), ref, f"y {what}", backend)


@pytest.mark.parametrize("backend", cpu_backends())
def test_bias_act_shapes_strides_and_fresh_output(backend):
    gen = _gen("bias_act strides", backend)
    big = _randn((2, 3, 2 * 768), torch.float32, gen)
    x = big[..., :768]  # leading dims, row stride 2F
    b = _randn((768,), torch.float32, gen)
    y = ragged.bias_act(x, b, "gelu_tanh", backend=backend)
    assert y.shape == x.shape and y.is_contiguous()
    _close(y, F.gelu(x.double() + b.double(), approximate="tanh"), "strided")
    xt = _randn((100, 7), torch.float32, gen).t()  # features not contiguous: copied first
    _close(ragged.bias_act(xt, None, "relu", backend=backend), F.relu(xt.double()), "transposed")
    x0 = _randn((5, 8), torch.float32, gen)
    y0 = ragged.bias_act(x0, None, "none", backend=backend)
    assert torch.equal(y0, x0) and y0.data_ptr() != x0.data_ptr()
    assert ragged.bias_act(torch.empty(4, 0), torch.empty(0), backend=backend).shape == (4, 0)


@pytest.mark.parametrize("backend", cpu_backends())
def test_bias_act_mixed_dtypes_and_autocast(backend):
    """bfloat16 activations with a float32 bias (autocast's situation): nothing is cast."""
    x, b, y, ref, (dx, db), (dx64, db64), _ = _bias_act_case(
        backend, torch.bfloat16, "gelu", True, 33, 100, param_dtype=torch.float32
    )
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16 and db.dtype == torch.float32
    _close(y, ref, "y")
    _close(dx, dx64, "dx")
    _close(db, db64, "dbias", torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ac = ragged.bias_act(x, b, "gelu", backend=backend)
    assert torch.equal(y_ac, y)


@pytest.mark.parametrize("backend", cpu_backends())
def test_bias_act_gradient_layouts(backend):
    """An expanded (stride 0) or transposed upstream gradient, and an empty batch."""
    x = torch.randn(9, 100, requires_grad=True)
    b = torch.randn(100, requires_grad=True)
    y = ragged.bias_act(x, b, "gelu", backend=backend)
    dx, db = torch.autograd.grad(y.sum(), (x, b))
    z = x.detach().double() + b.detach().double()
    d = torch.ops.aten.gelu_backward(torch.ones_like(z), z)
    _close(dx, d, "dx")
    _close(db, d.sum(0), "dbias")
    x0 = torch.randn(0, 100, requires_grad=True)
    y0 = ragged.bias_act(x0, b, "relu", backend=backend)
    _, db0 = torch.autograd.grad(y0.sum(), (x0, b))
    assert torch.equal(db0, torch.zeros(100))


# --------------------------------------------------------------------------------------
# add_layer_norm

# (residual, weight, bias, return_sum)
LN_VARIANTS = {
    "full_sum": (True, True, True, True),
    "full": (True, True, True, False),
    "no_residual_sum": (False, True, True, True),
    "no_affine": (True, False, False, False),
    "weight_only_sum": (True, True, False, True),
}


def _ln_oracle(x64, r64, w64, b64, sum_dtype, eps):
    """float64 layer norm of the sum as stored in ``sum_dtype`` (the rounding is passed
    through as identity by autograd)."""
    s = x64 if r64 is None else x64 + r64
    s = s + (s.detach().to(sum_dtype).double() - s.detach())
    return F.layer_norm(s, (s.shape[-1],), w64, b64, eps), s


def _ln_case(backend, dtype, variant, n, f, res_dtype=None, param_dtype=None, eps=1e-5):
    has_r, has_w, has_b, return_sum = LN_VARIANTS[variant]
    gen = _gen("ln", backend, str(dtype), variant, n, f)
    x = _randn((n, f), dtype, gen, shift=1.5).requires_grad_(True)
    r = _randn((n, f), res_dtype or dtype, gen).requires_grad_(True) if has_r else None
    w = (1 + 0.5 * _randn((f,), param_dtype or dtype, gen)).requires_grad_(True) if has_w else None
    b = _randn((f,), param_dtype or dtype, gen).requires_grad_(True) if has_b else None
    out = ragged.add_layer_norm(x, r, w, b, eps, return_sum=return_sum, backend=backend)
    y, s = out if return_sum else (out, None)
    sum_dtype = dtype if r is None else torch.promote_types(dtype, r.dtype)
    leaves = [_leaf64(t) for t in (x, r, w, b)]
    y64, s64 = _ln_oracle(*leaves, sum_dtype, eps)
    gy = _randn((n, f), y.dtype, gen)
    gs = _randn((n, f), sum_dtype, gen) if return_sum else None
    outs, outs64, gouts = [y], [y64], [gy]
    if return_sum:
        outs.append(s)
        outs64.append(s64)
        gouts.append(gs)
    got = _grads(outs, (x, r, w, b), gouts)
    want = _grads(outs64, leaves, [g.double() for g in gouts])
    return (x, r, w, b), y, s, y64, s64, got, want


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", list(LN_VARIANTS))
def test_add_layer_norm_matches_float64(backend, dtype, variant):
    for n, f in SHAPES + [(2, 768)]:
        (x, r, w, b), y, s, y64, s64, got, want = _ln_case(backend, dtype, variant, n, f)
        what = f"N={n} F={f}"
        assert y.dtype == dtype
        _close(y, y64, f"y {what}")
        if s is not None:
            assert s.dtype == dtype
            _close(s, s64, f"s {what}")
            if r is None:
                assert s is x
        for name, g, g64, t in zip(("x", "residual", "weight", "bias"), got, want, (x, r, w, b)):
            if t is None:
                continue
            assert g.dtype == t.dtype, name
            _close(g, g64, f"d{name} {what}")
        if n and dtype != torch.float32:
            s_lowp = x.detach() if r is None else x.detach() + r.detach()
            lowp = F.layer_norm(s_lowp, (f,), None if w is None else w.detach(), None if b is None else b.detach())
            _no_worse_than_torch(y, lowp, y64, f"y {what}", backend)


@pytest.mark.parametrize("backend", cpu_backends())
def test_add_layer_norm_mixed_dtypes_and_autocast(backend):
    """autocast's situation: a bfloat16 branch added to a float32 residual stream with
    float32 parameters. The sum and the output are float32 (torch's promotion), the
    branch's gradient bfloat16, the parameters' float32."""
    _, y, s, y64, s64, got, want = _ln_case(
        backend, torch.bfloat16, "full_sum", 33, 100, res_dtype=torch.float32, param_dtype=torch.float32
    )
    assert y.dtype == s.dtype == torch.float32
    assert [g.dtype for g in got] == [torch.bfloat16, torch.float32, torch.float32, torch.float32]
    _close(y, y64, "y")
    _close(s, s64, "s")
    for name, g, g64 in zip(("x", "residual", "weight", "bias"), got, want):
        _close(g, g64, f"d{name}")
    # bfloat16 activations, float32 parameters, no residual: output in bfloat16
    (x, _, w, b), y, _, y64, _, got, want = _ln_case(
        backend, torch.bfloat16, "no_residual_sum", 7, 100, param_dtype=torch.float32
    )
    assert y.dtype == torch.bfloat16 and got[2].dtype == torch.float32
    _close(y, y64, "y (no residual)")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ac = ragged.add_layer_norm(x, None, w, b, backend=backend)
    assert torch.equal(y_ac, y)


@pytest.mark.parametrize("backend", cpu_backends())
def test_add_layer_norm_strided_leading_dims_and_unused_outputs(backend):
    gen = _gen("ln strided", backend)
    big = _randn((2, 5, 2 * 100), torch.float32, gen)
    x = big[..., 100:]  # row stride 2F, leading dims
    r = _randn((2, 5, 100), torch.float32, gen)
    w, b = _randn((100,), torch.float32, gen), _randn((100,), torch.float32, gen)
    y, s = ragged.add_layer_norm(x, r, w, b, 1e-3, return_sum=True, backend=backend)
    ref = F.layer_norm(x.double() + r.double(), (100,), w.double(), b.double(), 1e-3)
    assert y.shape == s.shape == x.shape
    _close(y, ref, "y")
    _close(s, x.double() + r.double(), "s")
    # Only the sum used (y gets no gradient), and only y used (s gets none).
    xg, rg = x.clone().requires_grad_(True), r.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    y, s = ragged.add_layer_norm(xg, rg, wg, b, return_sum=True, backend=backend)
    dx, dr, dw = torch.autograd.grad((s * 3).sum(), (xg, rg, wg), allow_unused=True)
    assert torch.equal(dx, torch.full_like(dx, 3.0)) and torch.equal(dr, dx)
    assert dw is None or torch.equal(dw, torch.zeros_like(dw))
    y, s = ragged.add_layer_norm(xg, rg, wg, b, return_sum=True, backend=backend)
    (dx,) = torch.autograd.grad(y.sum(), xg)  # expanded (stride 0) upstream gradient
    x64 = xg.detach().double().requires_grad_(True)
    y64 = F.layer_norm(x64 + rg.detach().double(), (100,), wg.detach().double(), b.double())
    (dx64,) = torch.autograd.grad(y64.sum(), x64)
    _close(dx, dx64, "dx of y.sum()")


@pytest.mark.parametrize("backend", cpu_backends())
def test_empty_batch_gives_zero_parameter_gradients(backend):
    x = torch.randn(0, 100, requires_grad=True)
    r = torch.randn(0, 100, requires_grad=True)
    w = torch.randn(100, requires_grad=True)
    b = torch.randn(100, requires_grad=True)
    y, s = ragged.add_layer_norm(x, r, w, b, return_sum=True, backend=backend)
    assert y.shape == s.shape == (0, 100)
    dx, dr, dw, db = torch.autograd.grad((y.sum() + s.sum()), (x, r, w, b))
    assert dx.shape == dr.shape == (0, 100) and torch.equal(dw, torch.zeros(100)) and torch.equal(db, torch.zeros(100))


@pytest.mark.parametrize("backend", cpu_backends())
def test_rows_are_batch_invariant(backend):
    """A row alone gives bit for bit what it gives inside a batch."""
    gen = _gen("invariance", backend)
    for f in (100, 777):
        x, r = _randn((33, f), torch.bfloat16, gen, shift=2.0), _randn((33, f), torch.bfloat16, gen)
        w, b = _randn((f,), torch.float32, gen), _randn((f,), torch.float32, gen)
        y_all = ragged.add_layer_norm(x, r, w, b, backend=backend)
        h_all = ragged.bias_act(x, b, "gelu", backend=backend)
        for i in (0, 13, 32):
            assert torch.equal(
                ragged.add_layer_norm(x[i : i + 1], r[i : i + 1], w, b, backend=backend), y_all[i : i + 1]
            )
            assert torch.equal(ragged.bias_act(x[i : i + 1], b, "gelu", backend=backend), h_all[i : i + 1])


def test_backends_agree():
    """Sums and relu are exact in fp32 before the rounding, so both backends store the same
    bits; the layer norm output agrees to an ulp (the fp32 reduction orders differ)."""
    if "triton" not in cpu_backends():
        pytest.skip("the Triton interpreter is off")
    gen = _gen("agree")  # float16: the interpreter rounds fp32 -> fp16 as the GPU does (not so bf16)
    x, r = _randn((7, 100), torch.float16, gen), _randn((7, 100), torch.float16, gen)
    w, b = _randn((100,), torch.float16, gen), _randn((100,), torch.float16, gen)
    for fn in (
        lambda be: ragged.add_layer_norm(x, r, w, b, return_sum=True, backend=be)[1],
        lambda be: ragged.bias_act(x, b, "relu", backend=be),
    ):
        assert torch.equal(fn("torch"), fn("triton"))
    ys = [ragged.add_layer_norm(x, r, w, b, backend=be).float() for be in ("torch", "triton")]
    assert (ys[0] - ys[1]).abs().max() <= 2**-10 * ys[0].abs().max()


# --------------------------------------------------------------------------------------
# Autograd, custom ops, compile


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_bias_act(activation):
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, b: ragged.bias_act(x, b, activation, backend="torch"), (x, b))


@pytest.mark.parametrize("variant", list(LN_VARIANTS))
def test_gradcheck_add_layer_norm(variant):
    has_r, has_w, has_b, return_sum = LN_VARIANTS[variant]
    gen = _gen("gradcheck", variant)
    x = _randn((4, 6), torch.float64, gen).requires_grad_(True)
    inputs = [x] + [
        _randn(shape, torch.float64, gen).requires_grad_(True) if on else None
        for shape, on in (((4, 6), has_r), ((6,), has_w), ((6,), has_b))
    ]

    def f(x, r, w, b):
        return ragged.add_layer_norm(x, r, w, b, 1e-5, return_sum=return_sum, backend="torch")

    assert torch.autograd.gradcheck(f, tuple(inputs))


@pytest.mark.parametrize("backend", cpu_backends())
def test_compile_fullgraph_forward_backward(backend):
    """A pre-norm feed-forward block: no graph break, same values and gradients as eager."""
    torch._dynamo.reset()
    lin1, lin2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16, bias=False)
    w, b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)

    def block(x, stream):
        h, stream = ragged.add_layer_norm(x, stream, w, b, return_sum=True, backend=backend)
        h = ragged.bias_act(h @ lin1.weight.t(), lin1.bias, "gelu", backend=backend)
        return ragged.add_layer_norm(h @ lin2.weight.t(), stream, None, None, backend=backend)

    x = torch.randn(2, 5, 16, requires_grad=True)
    stream = torch.randn(2, 5, 16, requires_grad=True)
    out = torch.compile(block, fullgraph=True, backend="aot_eager")(x, stream)
    ref = block(x, stream)
    torch.testing.assert_close(out, ref)
    params = (x, stream, w, b, lin1.weight, lin1.bias, lin2.weight)
    g_out = torch.autograd.grad(out.square().sum(), params)
    g_ref = torch.autograd.grad(ref.square().sum(), params)
    for a, c in zip(g_out, g_ref):
        torch.testing.assert_close(a, c)


def test_opcheck():
    x = torch.randn(4, 6, requires_grad=True)
    r = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w, b = torch.randn(6, requires_grad=True), torch.randn(6, requires_grad=True)
    ops = torch.ops.ragged
    torch.library.opcheck(ops.bias_act.default, (x, b, "gelu_tanh", "torch"))
    torch.library.opcheck(ops.bias_act.default, (x, None, "relu", "torch"))
    torch.library.opcheck(ops.add_layer_norm.default, (x, r, w, b, 1e-5, True, "torch"))
    torch.library.opcheck(ops.add_layer_norm.default, (x, None, None, b, 1e-5, False, "torch"))
    # The backward ops are not differentiable themselves: plain tensors.
    g, x, w, b = torch.randn(4, 6), x.detach(), w.detach(), b.detach()
    # a backward op takes the operands, then the backward's inputs
    torch.library.opcheck(
        ops.bias_act_backward.default, (*BiasActArgs(x, b, "gelu"), *BiasActBackwardInputs(g), "torch")
    )
    _, _, mean, rstd = ops.add_layer_norm(x, None, w, b, 1e-5, False, "torch")
    torch.library.opcheck(
        ops.add_layer_norm_backward.default,
        (*AddLayerNormArgs(x, None, w, b, 1e-5), *AddLayerNormBackwardInputs(g, g, mean, rstd, True, False), "torch"),
    )
    torch.library.opcheck(
        ops.add_layer_norm_backward.default,
        (
            *AddLayerNormArgs(x, r.detach(), None, None, 1e-5),
            *AddLayerNormBackwardInputs(g, None, mean, rstd, False, False),
            "torch",
        ),
    )


@pytest.mark.parametrize("backend", cpu_backends())
def test_the_ops_take_and_return_records(backend):
    gen = torch.Generator().manual_seed(11)
    x, r, g = (torch.randn(5, 8, generator=gen) for _ in range(3))
    w, b = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    ba = BiasActArgs(x=x, bias=b, activation="gelu")
    out = BIAS_ACT(ba, backend)
    assert isinstance(out, BiasActOutput)
    torch.testing.assert_close(out.out, ragged.reference_bias_act(x, b, "gelu"))
    grads = BIAS_ACT.call_backward(ba, BiasActBackwardInputs(grad_out=g, need_bias=False), backend)
    assert isinstance(grads, BiasActGrads) and grads.bias is None
    torch.testing.assert_close(grads.x, reference_bias_act_backward(g, x, b, "gelu")[0])
    ln = AddLayerNormArgs(x=x, residual=r, weight=w, bias=b, eps=1e-5, return_sum=True)
    out = ADD_LAYER_NORM(ln, backend)
    assert isinstance(out, AddLayerNormOutput)
    y, s = ragged.reference_add_layer_norm(x, r, w, b, 1e-5, return_sum=True)
    torch.testing.assert_close(out.out, y)
    torch.testing.assert_close(out.sum, s)
    inputs = AddLayerNormBackwardInputs(grad_out=g, grad_sum=None, mean=out.mean, rstd=out.rstd)
    grads = ADD_LAYER_NORM.call_backward(ln, inputs, backend)
    # the gradient of the sum, computed once, as x's; residual's is the same (left None)
    assert isinstance(grads, AddLayerNormGrads) and grads.residual is None
    want = reference_add_layer_norm_backward(g, None, s, w, b, out.mean, out.rstd)
    for got, ref in zip((grads.x, grads.weight, grads.bias), want):
        torch.testing.assert_close(got, ref)


def test_public_api_under_fake_tensors_uses_the_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 7, 10, dtype=torch.bfloat16)
        r = torch.empty(3, 7, 10)
        w = torch.empty(10)
        h = ragged.bias_act(x, w, "relu", backend="torch")
        y, s = ragged.add_layer_norm(x, r, w, None, return_sum=True, backend="torch")
    assert h.shape == (3, 7, 10) and h.dtype == torch.bfloat16
    assert y.shape == s.shape == (3, 7, 10) and y.dtype == s.dtype == torch.float32


@pytest.mark.parametrize("backend", cpu_backends())
def test_eager_path_and_op_path_agree(backend):
    x = torch.randn(5, 12, requires_grad=True)
    r = torch.randn(5, 12, requires_grad=True)
    w = torch.randn(12, requires_grad=True)
    eager = ragged.add_layer_norm(x, r, w, None, backend=backend)
    via_op = torch.ops.ragged.add_layer_norm(x, r, w, None, 1e-5, False, backend)[0]
    assert torch.equal(eager, via_op)
    g1 = torch.autograd.grad(eager.square().sum(), (x, r, w))
    g2 = torch.autograd.grad(via_op.square().sum(), (x, r, w))
    for a, c in zip(g1, g2):
        assert torch.equal(a, c)
    h1 = ragged.bias_act(x, w, "gelu", backend=backend)
    h2 = torch.ops.ragged.bias_act(x, w, "gelu", backend)
    assert torch.equal(h1, h2)
    assert all(
        torch.equal(a, c) for a, c in zip(torch.autograd.grad(h1.sum(), (x, w)), torch.autograd.grad(h2.sum(), (x, w)))
    )


# --------------------------------------------------------------------------------------
# Backend choice and bad inputs


def test_auto_takes_the_reference_on_cpu_and_triton_says_why_not():
    from ragged import backends

    x = torch.randn(3, 8, dtype=torch.float64)
    assert backends.select("bias_act", None, x.device, x, None, "gelu").name == "torch"
    reasons = ragged.explain("add_layer_norm", x, None, None, None)
    assert reasons["torch"] == [] and any("float64" in r for r in reasons["triton"])
    with pytest.raises(ValueError, match=r"ragged\.bias_act\(\): backend 'triton' cannot take this input.*float64"):
        ragged.bias_act(x, None, backend="triton")
    with pytest.raises(
        ValueError,
        match=r"ragged\.add_layer_norm\(\): backend 'cuda' cannot take this input: "
        r"the CUDA kernels need a CUDA tensor",
    ):
        ragged.add_layer_norm(x, None, None, None, backend="cuda")
    with ragged.use_backend("torch"):
        torch.testing.assert_close(ragged.add_layer_norm(x, None, None, None), F.layer_norm(x, (8,)))


BA = r"ragged\.bias_act\(\)"
LN = r"ragged\.add_layer_norm\(\)"
_x = torch.randn(4, 8)
_bad = [
    (lambda: ragged.bias_act([1.0], None), TypeError, BA + r".*x.*torch\.Tensor.*list"),
    (lambda: ragged.bias_act(torch.tensor(1.0), None), ValueError, BA + r".*x.*\[\.\.\., F\].*0-d"),
    (lambda: ragged.bias_act(torch.ones(4, 8, dtype=torch.int64), None), TypeError, BA + r".*x.*floating.*int64"),
    (lambda: ragged.bias_act(_x, torch.randn(7)), ValueError, BA + r".*bias.*\(8,\).*\(7,\)"),
    (lambda: ragged.bias_act(_x, torch.randn(1, 8)), ValueError, BA + r".*bias.*\(8,\).*\(1, 8\)"),
    (lambda: ragged.bias_act(_x, torch.ones(8, dtype=torch.int32)), TypeError, BA + r".*bias.*floating.*int32"),
    (lambda: ragged.bias_act(_x, torch.randn(8, device="meta")), ValueError, BA + r".*bias.*cpu.*meta"),
    (lambda: ragged.bias_act(_x, None, "swish"), ValueError, BA + r".*activation.*'relu'.*'swish'"),
    (lambda: ragged.bias_act(_x, None, None), ValueError, BA + r".*activation.*None"),
    (lambda: ragged.bias_act(_x, None, backend="numpy"), ValueError, BA + r".*backend.*'numpy'"),
    (lambda: ragged.add_layer_norm("x", None, None, None), TypeError, LN + r".*x.*torch\.Tensor.*str"),
    (lambda: ragged.add_layer_norm(torch.randn(4, 0), None, None, None), ValueError, LN + r".*x.*feature.*\(4, 0\)"),
    (
        lambda: ragged.add_layer_norm(_x, torch.randn(4, 7), None, None),
        ValueError,
        LN + r".*residual.*\(4, 8\).*\(4, 7\)",
    ),
    (lambda: ragged.add_layer_norm(_x, torch.randn(8), None, None), ValueError, LN + r".*residual.*\(4, 8\).*\(8,\)"),
    (
        lambda: ragged.add_layer_norm(_x, _x.to(torch.complex64), None, None),
        TypeError,
        LN + r".*residual.*floating.*complex64",
    ),
    (lambda: ragged.add_layer_norm(_x, [1.0], None, None), TypeError, LN + r".*residual.*torch\.Tensor"),
    (lambda: ragged.add_layer_norm(_x, None, torch.randn(4), None), ValueError, LN + r".*weight.*\(8,\).*\(4,\)"),
    (lambda: ragged.add_layer_norm(_x, None, None, torch.randn(8, 1)), ValueError, LN + r".*bias.*\(8,\).*\(8, 1\)"),
    (
        lambda: ragged.add_layer_norm(_x, None, torch.ones(8, dtype=torch.bool), None),
        TypeError,
        LN + r".*weight.*floating.*bool",
    ),
    (lambda: ragged.add_layer_norm(_x, None, None, None, 0.0), ValueError, LN + r".*eps > 0.*0\.0"),
    (lambda: ragged.add_layer_norm(_x, None, None, None, -1e-5), ValueError, LN + r".*eps > 0"),
    (lambda: ragged.add_layer_norm(_x, None, None, None, float("nan")), ValueError, LN + r".*eps"),
    (lambda: ragged.add_layer_norm(_x, None, None, None, "1e-5"), TypeError, LN + r".*eps.*float.*'1e-5'"),
    (lambda: ragged.add_layer_norm(_x, None, None, None, return_sum=1), TypeError, LN + r".*return_sum.*bool"),
]


@pytest.mark.parametrize("call,exc,pattern", _bad, ids=[str(i) for i in range(len(_bad))])
def test_bad_inputs(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()
