"""bias_act and add_layer_norm on the GPU (``pytest -m gpu``): the Triton kernels at real sizes.

Error rule (as flash-attn's tests): the kernel's error against a float64 oracle is at
most twice the error of the same computation done by torch in the input's precision,
plus a small atol relative to the largest reference value.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

import ragged
from ragged import backends

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}
ACTIVATIONS = ["relu", "gelu", "gelu_tanh", "none"]
N_ROWS = 20000


def _needs_triton():
    reason = backends.triton_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)


def _gen(*key) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(key).encode()))


def _randn(shape, dtype, gen, shift=0.0):
    return (torch.randn(shape, generator=gen, device="cuda") + shift).to(dtype)


def _assert_rule(what: str, out: torch.Tensor, ref: torch.Tensor, low: torch.Tensor, dtype: torch.dtype):
    assert out.shape == ref.shape, what
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    scale = max(1.0, ref.abs().max().item())
    err = (out.double() - ref).abs().max().item()
    low_err = (low.double() - ref).abs().max().item()
    bound = 2 * low_err + ATOL[dtype] * scale
    assert err <= bound, f"{what}: error {err:.3g} > {bound:.3g} (torch in {dtype}: {low_err:.3g})"


def _act(z, activation):
    if activation == "relu":
        return F.relu(z)
    if activation == "gelu":
        return F.gelu(z)
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    return z


def _grads(outs, inputs, gouts):
    present = [t for t in inputs if t is not None]
    it = iter(torch.autograd.grad(outs, present, gouts))
    return [None if t is None else next(it) for t in inputs]


def _leaf(t, dtype=None):
    return None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(True)


# --------------------------------------------------------------------------------------
# Accuracy at real sizes


def _check_bias_act(backend, dtype, n_rows, n_cols, activation, has_bias=True):
    """Forward and gradients of ``backend`` against the float64 oracle (the error rule); returns
    (x, bias, y) for further comparisons."""
    gen = _gen("bias_act", str(dtype), n_cols, activation, *(() if has_bias else ("no_bias",)))
    x = _randn((n_rows, n_cols), dtype, gen).requires_grad_(True)
    b = _randn((n_cols,), dtype, gen).requires_grad_(True) if has_bias else None
    g = _randn((n_rows, n_cols), dtype, gen)
    y = ragged.bias_act(x, b, activation, backend=backend)
    dx, db = _grads(y, (x, b), g)
    outs = {}
    for name, dt in (("ref", torch.float64), ("low", dtype)):
        xx, bb = _leaf(x, dt), _leaf(b, dt)
        out = _act(xx if bb is None else xx + bb, activation)
        outs[name] = (out, *_grads(out, (xx, bb), g.to(dt)))
    for i, what in enumerate(("y", "dx", "dbias")):
        if i < 2 or has_bias:
            _assert_rule(f"{what} F={n_cols}", (y, dx, db)[i], outs["ref"][i].detach(), outs["low"][i].detach(),
                         dtype)
    assert y.dtype == dx.dtype == dtype and (db is None or db.dtype == dtype)
    return x, b, y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_cols", [768, 3072])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_bias_act_accuracy(dtype, n_cols, activation):
    _needs_triton()
    _check_bias_act("triton", dtype, N_ROWS, n_cols, activation)


# (residual, weight, bias, return_sum)
LN_VARIANTS = {
    "full_sum": (True, True, True, True),
    "full": (True, True, True, False),
    "no_residual": (False, True, True, False),
    "no_affine_sum": (True, False, False, True),
}
# ... and the other combinations the CUDA kernel distinguishes (null pointers for absent tensors)
CUDA_LN_VARIANTS = {
    **LN_VARIANTS,
    "bare": (False, False, False, False),
    "weight_only": (True, True, False, False),
    "bias_only_sum": (False, False, True, True),
}


def _check_add_layer_norm(backend, dtype, n_rows, n_cols, variant):
    """Forward and gradients of ``backend`` against the float64 oracle (the error rule); returns
    ((x, residual, weight, bias), y, s or None) for further comparisons."""
    has_r, has_w, has_b, return_sum = CUDA_LN_VARIANTS[variant]
    gen = _gen("ln", str(dtype), n_cols, variant)
    x = _randn((n_rows, n_cols), dtype, gen, shift=1.0).requires_grad_(True)
    r = _randn((n_rows, n_cols), dtype, gen).requires_grad_(True) if has_r else None
    w = (1 + 0.5 * _randn((n_cols,), dtype, gen)).requires_grad_(True) if has_w else None
    b = _randn((n_cols,), dtype, gen).requires_grad_(True) if has_b else None
    gy = _randn((n_rows, n_cols), dtype, gen)
    gs = _randn((n_rows, n_cols), dtype, gen) if return_sum else None
    out = ragged.add_layer_norm(x, r, w, b, return_sum=return_sum, backend=backend)
    y, s = out if return_sum else (out, None)
    outs, gouts = ([y, s], [gy, gs]) if return_sum else ([y], [gy])
    got = _grads(outs, (x, r, w, b), gouts)
    results = {}
    for name, dt in (("ref", torch.float64), ("low", dtype)):
        leaves = [_leaf(t, dt) for t in (x, r, w, b)]
        s_ref = leaves[0] if leaves[1] is None else leaves[0] + leaves[1]
        if dt == torch.float64:  # the op normalises the sum as stored in the input dtype
            s_ref = s_ref + (s_ref.detach().to(dtype).double() - s_ref.detach())
        y_ref = F.layer_norm(s_ref, (n_cols,), leaves[2], leaves[3])
        o = [y_ref, s_ref] if return_sum else [y_ref]
        results[name] = (y_ref.detach(), s_ref.detach(), _grads(o, leaves, [g.to(dt) for g in gouts]))
    _assert_rule("y", y, results["ref"][0], results["low"][0], dtype)
    if return_sum:
        _assert_rule("s", s, results["ref"][1], results["low"][1], dtype)
    for name, g, g_ref, g_low, t in zip(("x", "residual", "weight", "bias"), got, results["ref"][2],
                                        results["low"][2], (x, r, w, b)):
        if t is not None:
            assert g.dtype == t.dtype
            _assert_rule(f"d{name}", g, g_ref, g_low, dtype)
    return (x, r, w, b), y, s


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_cols", [768, 3072, 16385])
@pytest.mark.parametrize("variant", list(LN_VARIANTS))
def test_add_layer_norm_accuracy(dtype, n_cols, variant):
    """F = 16385 streams rows in chunks (the parameter gradients then come from the column kernel)."""
    _needs_triton()
    _check_add_layer_norm("triton", dtype, N_ROWS if n_cols <= 3072 else 1000, n_cols, variant)


def test_mixed_dtypes_under_autocast():
    """A bf16 branch into a float32 residual stream with float32 parameters: nothing is cast,
    the sum and the output are float32 (torch's promotion), each gradient in its input's dtype."""
    _needs_triton()
    lin = torch.nn.Linear(768, 768, device="cuda")
    w = torch.randn(768, device="cuda", requires_grad=True)
    stream = torch.randn(4096, 768, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        pre = F.linear(stream, lin.weight)
        h = ragged.bias_act(pre, lin.bias, "gelu")
        y, s = ragged.add_layer_norm(h, stream, w, None, return_sum=True)
    assert pre.dtype == h.dtype == torch.bfloat16 and y.dtype == s.dtype == torch.float32
    ref_h = F.gelu(pre.detach().float() + lin.bias.detach())
    torch.testing.assert_close(h.float(), ref_h, atol=1e-2, rtol=1e-2)
    ref_y = F.layer_norm(h.detach().float() + stream.detach(), (768,), w.detach())
    torch.testing.assert_close(y, ref_y, atol=1e-4, rtol=1e-4)
    (y.square().sum() + s.sum()).backward()
    assert lin.bias.grad.dtype == w.grad.dtype == stream.grad.dtype == torch.float32
    assert torch.isfinite(stream.grad).all() and torch.isfinite(lin.bias.grad).all()


def test_strided_rows_and_leading_dims():
    _needs_triton()
    gen = _gen("strided")
    big = _randn((8, 512, 2 * 768), torch.bfloat16, gen)
    x = big[..., :768]
    r = _randn((8, 512, 768), torch.bfloat16, gen)
    w, b = _randn((768,), torch.float32, gen), _randn((768,), torch.float32, gen)
    y = ragged.add_layer_norm(x, r, w, b, backend="triton")
    ref = ragged.add_layer_norm(x.contiguous(), r, w, b, backend="triton")
    assert torch.equal(y, ref)
    h = ragged.bias_act(x, b, "gelu_tanh", backend="triton")
    assert torch.equal(h, ragged.bias_act(x.contiguous(), b, "gelu_tanh", backend="triton"))


def test_backward_is_deterministic():
    _needs_triton()
    gen = _gen("determinism")
    x = _randn((N_ROWS, 768), torch.bfloat16, gen).requires_grad_(True)
    r = _randn((N_ROWS, 768), torch.bfloat16, gen)
    w = torch.randn(768, device="cuda", requires_grad=True)
    b = torch.randn(768, device="cuda", requires_grad=True)
    g = _randn((N_ROWS, 768), torch.bfloat16, gen)

    def grads():
        y = ragged.add_layer_norm(ragged.bias_act(x, b, "gelu", backend="triton"), r, w, b, backend="triton")
        return torch.autograd.grad(y, (x, w, b), g)

    first, second = grads(), grads()
    assert all(torch.equal(a, c) for a, c in zip(first, second))


# --------------------------------------------------------------------------------------
# int64 offsets


@pytest.mark.slow
def test_int64_offsets():
    """N * F past 2**31: the last rows must still be right (int32 offsets would wrap)."""
    _needs_triton()
    free, _ = torch.cuda.mem_get_info()
    n_cols = 768
    n_rows = 2**31 // n_cols + 4096
    if free < 6 * n_rows * n_cols * 2:
        pytest.skip("needs about 20 GB of free GPU memory")
    x = torch.empty((n_rows, n_cols), dtype=torch.bfloat16, device="cuda").normal_().requires_grad_(True)
    b = torch.randn(n_cols, device="cuda", requires_grad=True)
    tail = slice(n_rows - 2048, n_rows)
    y = ragged.bias_act(x, b, "gelu", backend="triton")
    torch.testing.assert_close(y[tail], ragged.bias_act(x[tail].detach(), b.detach(), "gelu", backend="torch"))
    g = torch.ones_like(y)
    dx, db = torch.autograd.grad(y, (x, b), g)
    del y
    xt, bt = x[tail].detach().float().requires_grad_(True), b.detach().clone().requires_grad_(True)
    ref_dx, _ = torch.autograd.grad(F.gelu(xt + bt), (xt, bt), torch.ones_like(xt))
    torch.testing.assert_close(dx[tail].float(), ref_dx, atol=1e-2, rtol=1e-2)
    db_ref = torch.zeros(n_cols, dtype=torch.float64, device="cuda")
    for i in range(0, n_rows, 1 << 20):
        z = x[i:i + (1 << 20)].detach().float() + b.detach()
        db_ref += torch.ops.aten.gelu_backward(torch.ones_like(z), z).sum(0).double()
    torch.testing.assert_close(db.double(), db_ref, atol=1e-3 * db_ref.abs().max().item(), rtol=1e-4)
    del dx, g
    w = torch.randn(n_cols, device="cuda", requires_grad=True)
    y = ragged.add_layer_norm(x, None, w, b, backend="triton")
    torch.testing.assert_close(y[tail], ragged.add_layer_norm(x[tail].detach(), None, w.detach(), b.detach(),
                                                              backend="torch"))
    dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    xt, wt = x[tail].detach().float().requires_grad_(True), w.detach().clone().requires_grad_(True)
    ref_dx, = torch.autograd.grad(F.layer_norm(xt, (n_cols,), wt, b.detach()), xt, torch.ones_like(xt))
    torch.testing.assert_close(dx[tail].float(), ref_dx, atol=2e-2, rtol=2e-2)
    assert torch.isfinite(dw).all()


# --------------------------------------------------------------------------------------
# No host sync, torch.compile, auto


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_no_host_sync(backend):
    if backend == "triton":
        _needs_triton()
    gen = _gen("sync", backend)
    x = _randn((3000, 768), torch.bfloat16, gen).requires_grad_(True)
    stream = _randn((3000, 768), torch.bfloat16, gen).requires_grad_(True)
    w = torch.randn(768, device="cuda", requires_grad=True)
    b = torch.randn(768, device="cuda", requires_grad=True)

    def step():
        h = ragged.bias_act(x, b, "gelu", backend=backend)
        y, s = ragged.add_layer_norm(h, stream, w, b, return_sum=True, backend=backend)
        z = ragged.add_layer_norm(y, None, None, None, backend=backend)
        (z.float().square().sum() + s.float().sum()).backward()

    step()                       # warm up: compile the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(w.grad).all() and torch.isfinite(x.grad.float()).all()


def test_compile_fullgraph():
    _needs_triton()
    torch._dynamo.reset()
    lin1 = torch.nn.Linear(768, 3072, device="cuda", dtype=torch.bfloat16)
    lin2 = torch.nn.Linear(3072, 768, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, device="cuda", requires_grad=True)
    b = torch.randn(768, device="cuda", requires_grad=True)

    def block(x, stream):
        h, stream = ragged.add_layer_norm(x, stream, w, b, return_sum=True)
        h = ragged.bias_act(F.linear(h, lin1.weight), lin1.bias, "gelu_tanh")
        return ragged.add_layer_norm(F.linear(h, lin2.weight), stream, None, lin2.bias)

    gen = _gen("compile")
    x = _randn((2048, 768), torch.bfloat16, gen).requires_grad_(True)
    stream = _randn((2048, 768), torch.bfloat16, gen).requires_grad_(True)
    compiled = torch.compile(block, fullgraph=True)
    out = compiled(x, stream)
    ref = block(x, stream)
    torch.testing.assert_close(out, ref)
    params = (x, stream, w, b, lin1.weight, lin1.bias, lin2.weight, lin2.bias)
    g_out = torch.autograd.grad(out.float().square().sum(), params)
    g_ref = torch.autograd.grad(ref.float().square().sum(), params)
    for a, c in zip(g_out, g_ref):  # inductor may order the surrounding sums differently
        assert a.dtype == c.dtype
        assert (a.float() - c.float()).abs().max() <= 2e-2 * c.float().abs().max()


def test_auto_takes_triton_on_cuda():
    """Triton where the CUDA kernels cannot go: a float32 parameter with bfloat16 activations
    (the CUDA kernels take one dtype), or CuPy missing."""
    _needs_triton()
    x = torch.randn(4, 768, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, device="cuda")
    assert backends.select("bias_act", None, x.device, x, w, "gelu").name == "triton"
    assert backends.select("add_layer_norm", None, x.device, x, x, w, None).name == "triton"
    x64 = x.double()
    assert backends.select("add_layer_norm", None, x.device, x64, None, None, None).name == "torch"


# --------------------------------------------------------------------------------------
# The "cuda" backend: CUDA C++ forward (csrc/fused.cu), Triton backward


def _needs_cuda_kernels():
    _needs_triton()
    reason = backends.cuda_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)


def _cuda_fused():
    from ragged.kernels.cuda import fused as cuda_fused

    return cuda_fused


def _triton_fused():
    from ragged.kernels.triton import fused

    return fused


def _assert_within_one_ulp(what: str, out: torch.Tensor, other: torch.Tensor, dtype: torch.dtype):
    """``out`` within one ulp (of ``dtype``, at ``other``'s magnitude) of ``other``, plus some
    float32 roundings: the two kernels sum a row in different orders (a row mean differs by up to
    about 4e-7 at F = 4096, times rstd * |weight|) and take tanh / rsqrt from different formulas,
    so their fp32 values may differ in the last few bits before the final rounding. For 16-bit
    outputs that slack is far below an ulp."""
    assert out.shape == other.shape and out.dtype == other.dtype, what
    a, b = out.double(), other.double()
    mag = b.abs().clamp_min(torch.finfo(dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(mag))) * torch.finfo(dtype).eps
    tol = ulp + 32 * torch.finfo(torch.float32).eps * b.abs().clamp_min(1.0)
    excess = ((a - b).abs() - tol).max().item()
    assert excess <= 0, f"{what}: {excess:.3g} past one ulp of {dtype} (max diff {(a - b).abs().max().item():.3g})"


def _forward_only(backend, fn, *args, **kwargs):
    with torch.no_grad():
        return fn(*args, **kwargs, backend=backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_cols", [768, 1024, 3072])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no_bias"])
def test_cuda_bias_act_accuracy(dtype, n_cols, activation, has_bias):
    """The error rule against float64 (forward CUDA, gradients from the Triton backward), and y
    within one ulp of the Triton kernel's."""
    _needs_cuda_kernels()
    x, b, y = _check_bias_act("cuda", dtype, N_ROWS, n_cols, activation, has_bias)
    assert ragged.explain("bias_act", x.detach(), None if b is None else b.detach(), activation)["cuda"] == []
    y_triton = _forward_only("triton", ragged.bias_act, x.detach(), None if b is None else b.detach(), activation)
    _assert_within_one_ulp(f"y vs triton, {activation}", y.detach(), y_triton, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_cols", [768, 1024, 4096])
@pytest.mark.parametrize("variant", list(CUDA_LN_VARIANTS))
def test_cuda_add_layer_norm_accuracy(dtype, n_cols, variant):
    """The error rule against float64 (forward CUDA, gradients from the Triton backward); y within
    one ulp of the Triton kernel's, s bit-identical, mean / rstd to float32 rounding."""
    _needs_cuda_kernels()
    if n_cols > _cuda_fused().max_layer_norm_features(dtype):  # float32 past 2048 features: Triton's
        x = torch.zeros((4, n_cols), dtype=dtype, device="cuda")
        reasons = ragged.explain("add_layer_norm", x, x, None, None)["cuda"]
        assert any(f"at most {_cuda_fused().max_layer_norm_features(dtype)} features" in r for r in reasons), reasons
        assert backends.select("add_layer_norm", None, x.device, x, x, None, None).name == "triton"
        return
    (x, r, w, b), y, s = _check_add_layer_norm("cuda", dtype, N_ROWS, n_cols, variant)
    inputs = [None if t is None else t.detach() for t in (x, r, w, b)]
    assert ragged.explain("add_layer_norm", *inputs)["cuda"] == []
    return_sum = s is not None
    out = _forward_only("triton", ragged.add_layer_norm, *inputs, return_sum=return_sum)
    y_triton, s_triton = out if return_sum else (out, None)
    _assert_within_one_ulp(f"y vs triton, {variant}", y.detach(), y_triton, dtype)
    if return_sum:
        assert torch.equal(s.detach(), s_triton)
    x2, r2, w2, b2 = inputs
    ours = _cuda_fused().add_layer_norm_forward(x2, r2, w2, b2, 1e-5, False)
    theirs = _triton_fused().add_layer_norm_forward(x2, r2, w2, b2, 1e-5, False)
    torch.testing.assert_close(ours[2], theirs[2], rtol=1e-6, atol=1e-6)   # mean
    torch.testing.assert_close(ours[3], theirs[3], rtol=1e-5, atol=0)      # rstd


def _nan_padded(n_rows, n_cols, dtype, gen, pad=64, shift=0.0):
    """An [n_rows, n_cols] view with row stride n_cols + pad whose padding columns are NaN:
    a kernel that reads past a row poisons its output."""
    buf = torch.full((n_rows, n_cols + pad), float("nan"), dtype=dtype, device="cuda")
    buf[:, :n_cols] = _randn((n_rows, n_cols), dtype, gen, shift)
    return buf[:, :n_cols]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_rows", [1, 7, 20001])
@pytest.mark.parametrize("n_cols", [768, 1024])
def test_cuda_odd_rows_and_strided_inputs(dtype, n_rows, n_cols):
    """Row counts that leave warps of the last block idle, strided x / residual rows with NaN in
    the gaps: the CUDA forward equals the Triton one (within one ulp; the sum bit for bit)."""
    _needs_cuda_kernels()
    gen = _gen("cuda_odd", str(dtype), n_rows, n_cols)
    x = _nan_padded(n_rows, n_cols, dtype, gen, shift=1.0)
    r = _nan_padded(n_rows, n_cols, dtype, gen, pad=32)
    w = 1 + 0.5 * _randn((n_cols,), dtype, gen)
    b = _randn((n_cols,), dtype, gen)
    assert ragged.explain("add_layer_norm", x, r, w, b)["cuda"] == []
    y, s = _forward_only("cuda", ragged.add_layer_norm, x, r, w, b, return_sum=True)
    y_t, s_t = _forward_only("triton", ragged.add_layer_norm, x, r, w, b, return_sum=True)
    assert torch.isfinite(y).all() and torch.equal(s, s_t)
    _assert_within_one_ulp("y", y, y_t, dtype)
    xc = x.contiguous()
    for activation in ACTIVATIONS:
        h = _forward_only("cuda", ragged.bias_act, xc, b, activation)
        _assert_within_one_ulp(f"bias_act {activation}", h, _forward_only("triton", ragged.bias_act, xc, b,
                                                                           activation), dtype)
    if n_rows == 1:
        return
    # strided x goes to Triton for bias_act (the CUDA kernel walks x as one contiguous run)
    assert any("contiguous x" in m for m in ragged.explain("bias_act", x, b, "gelu")["cuda"])
    assert backends.select("bias_act", None, x.device, x, b, "gelu").name == "triton"


def test_cuda_inference_statistics_are_optional():
    _needs_cuda_kernels()
    gen = _gen("cuda_stats")
    x = _randn((3000, 768), torch.bfloat16, gen)
    r = _randn((3000, 768), torch.bfloat16, gen)
    y, s, mean, rstd = _cuda_fused().add_layer_norm_forward(x, r, None, None, 1e-5, True)
    y2, s2, mean2, rstd2 = _cuda_fused().add_layer_norm_forward(x, r, None, None, 1e-5, True, stats=False)
    assert torch.equal(y, y2) and torch.equal(s, s2)
    assert mean.shape == rstd.shape == (3000,) and mean2.numel() == rstd2.numel() == 0
    y3, s3, _, _ = _cuda_fused().add_layer_norm_forward(x, r, None, None, 1e-5, False)
    assert torch.equal(y3, y) and s3.shape == (0,)


def test_cuda_misaligned_inputs_go_to_triton():
    _needs_cuda_kernels()
    gen = _gen("cuda_misaligned")
    buf = _randn((64, 776), torch.float16, gen)
    x = buf[:, 1:769]                      # 2 bytes past a 16-byte boundary
    reasons = ragged.explain("add_layer_norm", x, None, None, None)["cuda"]
    assert any("16-byte aligned" in r for r in reasons), reasons
    assert backends.select("add_layer_norm", None, x.device, x, None, None, None).name == "triton"
    with pytest.raises(ValueError, match=r"backend 'cuda' cannot take this input: .*16-byte aligned"):
        ragged.add_layer_norm(x, None, None, None, backend="cuda")
    xb = buf.view(-1)[1:1 + 64 * 768].view(64, 768)
    assert any("x 16-byte aligned" in r for r in ragged.explain("bias_act", xb, None, "gelu")["cuda"])
    assert backends.select("bias_act", None, x.device, xb, None, "gelu").name == "triton"
    # the launchers themselves (reached with fake tensors under torch.compile, where the reasons
    # see no pointers) read an aligned copy: the results of an aligned input
    y = _cuda_fused().add_layer_norm_forward(x, None, None, None, 1e-5, False)[0]
    assert torch.equal(y, _cuda_fused().add_layer_norm_forward(x.clone(), None, None, None, 1e-5, False)[0])
    h = _cuda_fused().bias_act_forward(xb, None, "gelu")
    assert torch.equal(h, _cuda_fused().bias_act_forward(xb.clone(), None, "gelu"))


def test_cuda_no_host_sync():
    _needs_cuda_kernels()
    gen = _gen("cuda_sync")
    x = _randn((3000, 768), torch.bfloat16, gen).requires_grad_(True)
    stream = _randn((3000, 768), torch.bfloat16, gen).requires_grad_(True)
    w = _randn((768,), torch.bfloat16, gen).requires_grad_(True)
    b = _randn((768,), torch.bfloat16, gen).requires_grad_(True)

    def step():
        h = ragged.bias_act(x, b, "gelu", backend="cuda")
        y, s = ragged.add_layer_norm(h, stream, w, b, return_sum=True, backend="cuda")
        z = ragged.add_layer_norm(y, None, None, None, backend="cuda")
        (z.float().square().sum() + s.float().sum()).backward()
        with torch.no_grad():
            _cuda_fused().add_layer_norm_forward(y, None, w, b, 1e-5, False, stats=False)

    step()                       # warm up: compile the kernels (NVRTC and Triton)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(w.grad.float()).all() and torch.isfinite(x.grad.float()).all()


def test_auto_takes_cuda():
    _needs_cuda_kernels()
    x = torch.randn(N_ROWS, 768, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, device="cuda", dtype=torch.bfloat16)
    assert backends.select("bias_act", None, x.device, x, w, "gelu").name == "cuda"
    assert backends.select("add_layer_norm", None, x.device, x, x, w, w).name == "cuda"
    assert backends.select("add_layer_norm", None, x.device, x, None, None, None).name == "cuda"
    # what it declines: float32 parameters with bfloat16 activations, F not a multiple of 8
    assert backends.select("add_layer_norm", None, x.device, x, x, w.float(), None).name == "triton"
    x770 = torch.randn(16, 770, device="cuda", dtype=torch.bfloat16)
    assert backends.select("bias_act", None, x.device, x770, None, "relu").name == "triton"


@pytest.mark.slow
def test_cuda_int64_offsets():
    """N * F past 2**31 elements: the last rows of the CUDA forward must still be right."""
    _needs_cuda_kernels()
    free, _ = torch.cuda.mem_get_info()
    n_cols = 768
    n_rows = 2**31 // n_cols + 4096
    if free < 4 * n_rows * n_cols * 2:
        pytest.skip("needs about 18 GB of free GPU memory")
    x = torch.empty((n_rows, n_cols), dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.randn(n_cols, device="cuda", dtype=torch.bfloat16)
    tail = slice(n_rows - 2048, n_rows)
    with torch.no_grad():
        y = ragged.bias_act(x, b, "gelu", backend="cuda")
        torch.testing.assert_close(y[tail], ragged.bias_act(x[tail], b, "gelu", backend="torch"))
        del y
        y = ragged.add_layer_norm(x, None, b, b, backend="cuda")
        torch.testing.assert_close(y[tail], ragged.add_layer_norm(x[tail], None, b, b, backend="torch"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_gelu_against_torch(dtype):
    """The CUDA bias_act's gelu over a dense grid of z (both tails, zero, signed zeros, inf, NaN)
    against torch's own (fp32 erf, rounded to ``dtype``): within one ulp plus the fp32 noise of
    ``1 + erf`` (about |z| * 6e-8 absolute, which both formulas carry in the negative tail). bf16
    (a rational erf) equals torch's for all but a small fraction of |z| <= 4 (about 2e-3 of this
    uniform grid, where the negative half's fp32 noise weighs more; about 4e-5 of normally
    distributed z); fp16 and fp32 take erff, torch's formula."""
    _needs_cuda_kernels()
    z = torch.linspace(-12.0, 12.0, 8 * 200_001, dtype=torch.float64)
    z = torch.cat([z, torch.tensor([0.0, -0.0, 1e-30, -1e-30, float("inf"), 2.5, float("nan"), -0.75],
                                   dtype=torch.float64)])
    x = z.to(dtype).view(-1, 8).to("cuda")
    with torch.no_grad():
        y = ragged.bias_act(x, None, "gelu", backend="cuda").view(-1).double()
        ref = F.gelu(x.view(-1).float()).to(dtype).double()
    zz = x.view(-1).double()
    assert torch.equal(torch.isnan(y), torch.isnan(ref)), "NaN where torch has none, or the other way"
    finite = torch.isfinite(ref)
    assert torch.equal(y[~finite & ~torch.isnan(ref)], ref[~finite & ~torch.isnan(ref)])
    a, b, zf = y[finite], ref[finite], zz[finite]
    mag = b.abs().clamp_min(torch.finfo(dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(mag))) * torch.finfo(dtype).eps
    excess = ((a - b).abs() - ulp - 2e-7 * zf.abs()).max().item()
    assert excess <= 0, f"{excess:.3g} past one ulp (max diff {(a - b).abs().max().item():.3g})"
    core = zf.abs() <= 4
    mismatched = (a[core] != b[core]).double().mean().item()
    assert mismatched <= 5e-3, f"{mismatched:.2e} of outputs differ from torch's"
    normal = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)).to("cuda", dtype).view(-1, 8)
    with torch.no_grad():
        got = ragged.bias_act(normal, None, "gelu", backend="cuda")
    normal_mismatched = (got != F.gelu(normal.float()).to(dtype)).double().mean().item()
    assert normal_mismatched <= 5e-4, f"{normal_mismatched:.2e} of N(0, 1) outputs differ from torch's"


# --------------------------------------------------------------------------------------
# Every backend: strided / expanded parameters, odd layouts of x and residual, second
# derivatives (CPU versions in test_fused_regressions.py)

ALL_BACKENDS = ["torch", "triton", "cuda", "auto"]


def _needs_backend(backend):
    if backend == "triton":
        _needs_triton()
    elif backend == "cuda":
        _needs_cuda_kernels()


def _param_view(kind, f, dtype, gen, shift=0.0):
    """(leaf requiring grad, a [f] view of it with stride != 1, the view as a function)."""
    if kind == "strided":
        leaf, view = _randn((2 * f,), dtype, gen, shift), lambda t: t[::2]
    else:  # expanded: stride 0 over a one-element storage
        leaf, view = _randn((1,), dtype, gen, shift), lambda t: t.expand(f)
    leaf.requires_grad_(True)
    return leaf, view(leaf), view


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["strided", "expanded"])
def test_strided_and_expanded_parameters(backend, dtype, kind):
    """The op hands every backend the parameters with unit stride (the CUDA kernels then take
    them; before, they declined them and "auto" fell back to a Triton kernel that read them with
    stride 1). Results and the gradients of the views' bases equal those of contiguous copies on
    the same backend, and follow the float64 error rule."""
    _needs_backend(backend)
    n_rows, n_cols = 1001, 768
    gen = _gen("strided params", backend, str(dtype), kind)
    x = _randn((n_rows, n_cols), dtype, gen, shift=1.0).requires_grad_(True)
    r = _randn((n_rows, n_cols), dtype, gen).requires_grad_(True)
    w_leaf, w, w_view = _param_view(kind, n_cols, dtype, gen, shift=1.0)
    b_leaf, b, b_view = _param_view(kind, n_cols, dtype, gen)
    gy, gs, gh = (_randn((n_rows, n_cols), dtype, gen) for _ in range(3))

    def run(w, b):
        y, s = ragged.add_layer_norm(x, r, w, b, return_sum=True, backend=backend)
        h = ragged.bias_act(x, b, "gelu", backend=backend)
        return y, s, h

    y, s, h = run(w, b)
    got = torch.autograd.grad((y, s, h), (x, r, w_leaf, b_leaf), (gy, gs, gh))
    wc, bc = (t.detach().contiguous().requires_grad_(True) for t in (w, b))
    dense = run(wc, bc)
    dx, dr, dwc, dbc = torch.autograd.grad(dense, (x, r, wc, bc), (gy, gs, gh))
    for name, out, ref in zip(("y", "s", "bias_act"), (y, s, h), dense):
        assert torch.equal(out, ref), f"{name} ({kind}, {backend})"
    want = (dx, dr, torch.autograd.grad(w_view(w_leaf), w_leaf, dwc)[0],
            torch.autograd.grad(b_view(b_leaf), b_leaf, dbc)[0])
    for name, g, g_ref in zip(("x", "residual", "weight's base", "bias's base"), got, want):
        assert torch.equal(g, g_ref), f"d{name} ({kind}, {backend})"
    outs = {}
    for name, dt in (("ref", torch.float64), ("low", dtype)):
        xx, rr, wl, bl = (_leaf(t, dt) for t in (x, r, w_leaf, b_leaf))
        yy = F.layer_norm(xx + rr, (n_cols,), w_view(wl), b_view(bl))
        hh = _act(xx + b_view(bl), "gelu")
        outs[name] = (yy.detach(), hh.detach())
    _assert_rule(f"y ({kind}, {backend})", y, outs["ref"][0], outs["low"][0], dtype)
    _assert_rule(f"bias_act ({kind}, {backend})", h, outs["ref"][1], outs["low"][1], dtype)


# x (and the residual) as views of a leaf: (leaf shape from (N, F), view giving [N, F])
_LAYOUTS = {
    "transposed": (lambda n, f: (f, n), lambda t, n, f: t.t()),
    "column_slice": (lambda n, f: (n, f + 16), lambda t, n, f: t[:, 8:8 + f]),   # 16-byte aligned
    "misaligned_slice": (lambda n, f: (n, f + 3), lambda t, n, f: t[:, 1:1 + f]),
    "expanded_rows": (lambda n, f: (1, f), lambda t, n, f: t.expand(n, f)),
    "every_other_row": (lambda n, f: (2 * n, f), lambda t, n, f: t[::2]),
}


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_odd_layouts_of_x_and_residual(backend, dtype, layout):
    """x (and a transposed residual) with any strides: the error rule against float64 for the
    output and the gradients of the views' bases. A forced "cuda" may decline a layout (it says
    why; never a transposed one, which the op copies first); it never reads one wrong."""
    _needs_backend(backend)
    n_rows, n_cols = 777, 768
    gen = _gen("layouts", backend, str(dtype), layout)
    shape, view = _LAYOUTS[layout]
    x_leaf = _randn(shape(n_rows, n_cols), dtype, gen, shift=1.0).requires_grad_(True)
    r_leaf = _randn((n_cols, n_rows), dtype, gen).requires_grad_(True)
    x, r = view(x_leaf, n_rows, n_cols), r_leaf.t()
    w = _randn((n_cols,), dtype, gen).requires_grad_(True)
    b = _randn((n_cols,), dtype, gen).requires_grad_(True)
    g = _randn((n_rows, n_cols), dtype, gen)

    def layer_norm(xx, rr, ww, bb, be=None):
        if be is None:
            return F.layer_norm(xx + rr, (n_cols,), ww, bb)
        return ragged.add_layer_norm(xx, rr, ww, bb, backend=be)

    def act(xx, bb, be=None):
        return _act(xx + bb, "gelu_tanh") if be is None else ragged.bias_act(xx, bb, "gelu_tanh", backend=be)

    for op, fn, leaves in (("add_layer_norm", layer_norm, (x_leaf, r_leaf, w, b)), ("bias_act", act, (x_leaf, b))):
        views = (x, r, w, b) if op == "add_layer_norm" else (x, b)
        try:
            out = fn(*views, be=backend)
        except ValueError as e:
            assert backend == "cuda" and layout != "transposed", str(e)
            assert "backend 'cuda' cannot take this input" in str(e), str(e)
            continue
        got = torch.autograd.grad(out, leaves, g)
        refs = {}
        for name, dt in (("ref", torch.float64), ("low", dtype)):
            ls = [_leaf(t, dt) for t in leaves]
            vs = [view(ls[0], n_rows, n_cols)] + ([ls[1].t(), ls[2], ls[3]] if op == "add_layer_norm" else [ls[1]])
            o = fn(*vs)
            refs[name] = [o.detach(), *torch.autograd.grad(o, ls, g.to(dt))]
        names = ("x's base", "residual's base", "weight", "bias") if op == "add_layer_norm" else ("x's base", "bias")
        for i, (what, t) in enumerate(zip(("output", *(f"d{n}" for n in names)), (out, *got))):
            _assert_rule(f"{op} {what} ({layout}, {backend})", t.detach(), refs["ref"][i], refs["low"][i], dtype)


def _hessian_vector(outs, inputs, gouts, vs):
    """The first gradients of ``sum(out * g)`` (create_graph=True) and the gradients of
    ``sum(first * v)``: what a gradient penalty needs."""
    first = torch.autograd.grad(outs, inputs, [g.to(o.dtype) for g, o in zip(gouts, outs)], create_graph=True)
    penalty = sum((g.double() * v).sum() for g, v in zip(first, vs))
    second = torch.autograd.grad(penalty, inputs, allow_unused=True)
    return first, [torch.zeros_like(t) if g is None else g for g, t in zip(second, inputs)]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("return_sum", [False, True], ids=["y", "y_and_sum"])
def test_second_derivatives(backend, return_sum):
    """create_graph=True then a penalty on the gradients, float32 on every backend against
    float64 torch: the first gradients are differentiable, and right (before, the layer norm's
    missed how the row statistics depend on the sum, and the kernels' were constants)."""
    _needs_backend(backend)
    n_rows, n_cols = 333, 256
    gen = _gen("second derivatives", backend, return_sum)
    x = _randn((n_rows, n_cols), torch.float32, gen, shift=0.5).requires_grad_(True)
    r = _randn((n_rows, n_cols), torch.float32, gen).requires_grad_(True)
    w = (1 + 0.5 * _randn((n_cols,), torch.float32, gen)).requires_grad_(True)
    b = _randn((n_cols,), torch.float32, gen).requires_grad_(True)
    inputs = [x, r, w, b]
    x64, r64, w64, b64 = inputs64 = [t.detach().double().requires_grad_(True) for t in inputs]
    out = ragged.add_layer_norm(x, r, w, b, return_sum=return_sum, backend=backend)
    y, s = out if return_sum else (out, None)
    h = ragged.bias_act(y, b, "gelu", backend=backend)
    s64 = x64 + r64
    h64 = _act(F.layer_norm(s64, (n_cols,), w64, b64) + b64, "gelu")
    outs, outs64 = ([h, s], [h64, s64]) if return_sum else ([h], [h64])
    gouts = [torch.randn(o.shape, generator=gen, device="cuda", dtype=torch.float64) for o in outs]
    vs = [torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float64) for t in inputs]
    first, second = _hessian_vector(outs, inputs, gouts, vs)
    first64, second64 = _hessian_vector(outs64, inputs64, gouts, vs)
    for name, a, a64, c, c64 in zip(("x", "residual", "weight", "bias"), first, first64, second, second64):
        for what, got, ref in ((f"d{name}", a, a64), (f"second derivative, {name}", c, c64)):
            scale = max(1.0, ref.abs().max().item())
            torch.testing.assert_close(got.detach().double(), ref.detach(), atol=1e-4 * scale, rtol=1e-4,
                                       msg=lambda m: f"{what} ({backend}): {m}")
