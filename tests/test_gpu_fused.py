"""bias_act and add_layer_norm on the GPU (``pytest -m gpu``): the Triton kernels at real sizes.

Error rule (as flash-attn's tests): the kernel's error against a float64 oracle is at
most twice the error of the same computation done by torch in the input's precision,
plus a small atol relative to the largest reference value.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ragged
from ragged import backends

pytestmark = pytest.mark.gpu
from gpu_fused_cases import (
    ACTIVATIONS,
    DTYPES,
    LN_VARIANTS,
    N_ROWS,
    _check_add_layer_norm,
    _check_bias_act,
    _gen,
    _needs_triton,
    _randn,
)

# --------------------------------------------------------------------------------------
# Accuracy at real sizes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_cols", [768, 3072])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_bias_act_accuracy(dtype, n_cols, activation):
    _needs_triton()
    _check_bias_act("triton", dtype, N_ROWS, n_cols, activation)


# (residual, weight, bias, return_sum)
# ... and the other combinations the CUDA kernel distinguishes (null pointers for absent tensors)
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
        z = x[i : i + (1 << 20)].detach().float() + b.detach()
        db_ref += torch.ops.aten.gelu_backward(torch.ones_like(z), z).sum(0).double()
    torch.testing.assert_close(db.double(), db_ref, atol=1e-3 * db_ref.abs().max().item(), rtol=1e-4)
    del dx, g
    w = torch.randn(n_cols, device="cuda", requires_grad=True)
    y = ragged.add_layer_norm(x, None, w, b, backend="triton")
    torch.testing.assert_close(
        y[tail], ragged.add_layer_norm(x[tail].detach(), None, w.detach(), b.detach(), backend="torch")
    )
    dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    xt, wt = x[tail].detach().float().requires_grad_(True), w.detach().clone().requires_grad_(True)
    (ref_dx,) = torch.autograd.grad(F.layer_norm(xt, (n_cols,), wt, b.detach()), xt, torch.ones_like(xt))
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

    step()  # warm up: compile the kernels
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
