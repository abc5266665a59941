"""gated_act on the GPU (``pytest -m gpu``): the Triton kernels at model sizes.

Error rule (as the fused ops' GPU tests): the kernel's error against a float64 oracle is at
most twice the error of the same computation done by torch in the input's precision, plus a
small atol relative to the largest reference value. Sizes: ModernBERT-base's intermediate
width (F = 1152), ModernBERT-large's (2624), and a width past the widest column block.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_fused_cases import DTYPES, _act, _assert_rule, _gen, _needs_triton, _randn

import ragged
from ragged import backends

pytestmark = pytest.mark.gpu

ACTIVATIONS = ["gelu", "gelu_tanh", "relu", "silu", "none"]
N_ROWS = 20000


def _oracle(x: torch.Tensor, activation: str) -> torch.Tensor:
    a, gate = x.chunk(2, dim=-1)
    return _act(a, activation) * gate


def _check(backend, dtype, n_rows, n_cols, activation, x=None):
    gen = _gen("gated_act", str(dtype), n_rows, n_cols, activation)
    if x is None:
        x = _randn((n_rows, 2 * n_cols), dtype, gen).requires_grad_(True)
    g = _randn((n_rows, n_cols), dtype, gen)
    y = ragged.gated_act(x, activation, backend=backend)
    (dx,) = torch.autograd.grad(y, x, g)
    assert y.dtype == dx.dtype == dtype and y.is_contiguous()
    outs = {}
    for name, dt in (("ref", torch.float64), ("low", dtype)):
        xx = x.detach().to(dt).requires_grad_(True)
        out = _oracle(xx, activation)
        outs[name] = (out.detach(), torch.autograd.grad(out, xx, g.to(dt))[0])
    _assert_rule(f"y F={n_cols}", y, outs["ref"][0], outs["low"][0], dtype)
    _assert_rule(f"dx F={n_cols}", dx, outs["ref"][1], outs["low"][1], dtype)
    return x, y, dx


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_cols", [1152, 2624, 3000])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_accuracy(dtype, n_cols, activation):
    _needs_triton()
    _check("triton", dtype, N_ROWS, n_cols, activation)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_odd_and_tiny_sizes(dtype):
    _needs_triton()
    for n_rows, n_cols in ((1, 1), (1, 7), (97, 5), (1025, 129), (3, 1027)):
        _check("triton", dtype, n_rows, n_cols, "gelu")
    x = torch.empty((0, 2304), device="cuda", dtype=dtype, requires_grad=True)
    y = ragged.gated_act(x, backend="triton")
    assert y.shape == (0, 1152)
    assert torch.autograd.grad(y.sum(), x)[0].shape == (0, 2304)


def test_strided_view_of_a_linear_output():
    """x a column slice of a wider projection: read in place (row stride past 2F), same bits as
    the contiguous copy, and its gradient lands in the right columns."""
    _needs_triton()
    gen = _gen("gated strided")
    big = _randn((4096, 2 * 1152 + 64), torch.bfloat16, gen).requires_grad_(True)
    x = big[:, 32 : 32 + 2 * 1152]
    y = ragged.gated_act(x, "gelu", backend="triton")
    assert torch.equal(y, ragged.gated_act(x.detach().contiguous(), "gelu", backend="triton"))
    g = _randn(y.shape, torch.bfloat16, gen)
    (dbig,) = torch.autograd.grad(y, big, g)
    xc = x.detach().contiguous().requires_grad_(True)
    (dxc,) = torch.autograd.grad(ragged.gated_act(xc, "gelu", backend="triton"), xc, g)
    assert torch.equal(dbig[:, 32 : 32 + 2 * 1152], dxc)
    assert not dbig[:, :32].any() and not dbig[:, 32 + 2 * 1152 :].any()


def test_triton_and_torch_agree():
    _needs_triton()
    gen = _gen("gated agree")
    x = _randn((3000, 2 * 1152), torch.float32, gen)
    for activation in ACTIVATIONS:
        a = ragged.gated_act(x, activation, backend="triton")
        b = ragged.gated_act(x, activation, backend="torch")
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_auto_takes_triton_on_cuda_and_the_reference_for_float64():
    _needs_triton()
    x = torch.randn(4, 2304, device="cuda", dtype=torch.bfloat16)
    assert backends.select("gated_act", None, x.device, x, "gelu").name == "triton"
    assert backends.select("gated_act", None, x.device, x.double(), "gelu").name == "torch"
    assert ragged.explain(ragged.gated_act, x, "gelu").chosen == "triton"


@pytest.mark.slow
def test_int64_offsets():
    """N * 2F past 2**31: the last rows must still be right (int32 offsets would wrap)."""
    _needs_triton()
    free, _ = torch.cuda.mem_get_info()
    n_cols = 1024
    n_rows = 2**31 // (2 * n_cols) + 4096
    if free < 4 * n_rows * 2 * n_cols * 2:
        pytest.skip("needs about 20 GB of free GPU memory")
    x = torch.empty((n_rows, 2 * n_cols), dtype=torch.bfloat16, device="cuda").normal_().requires_grad_(True)
    tail = slice(n_rows - 2048, n_rows)
    y = ragged.gated_act(x, "gelu", backend="triton")
    torch.testing.assert_close(y[tail], ragged.gated_act(x[tail].detach(), "gelu", backend="torch"))
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    del y
    xt = x[tail].detach().requires_grad_(True)
    (ref,) = torch.autograd.grad(
        ragged.gated_act(xt, "gelu", backend="torch"), xt, torch.ones(2048, n_cols, dtype=torch.bfloat16, device="cuda")
    )
    torch.testing.assert_close(dx[tail], ref)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_no_host_sync(backend):
    if backend == "triton":
        _needs_triton()
    gen = _gen("gated sync", backend)
    wi = torch.nn.Linear(768, 2 * 1152, bias=False, device="cuda", dtype=torch.bfloat16)
    wo = torch.nn.Linear(1152, 768, bias=False, device="cuda", dtype=torch.bfloat16)
    h = _randn((3000, 768), torch.bfloat16, gen).requires_grad_(True)

    def step():
        out = wo(ragged.gated_act(wi(h), "gelu", backend=backend))
        out.float().square().sum().backward()

    step()  # warm up: compile the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(wi.weight.grad.float()).all() and torch.isfinite(h.grad.float()).all()


def test_compile_fullgraph():
    """ModernBERT's MLP under torch.compile (inductor): no graph break, eager's values and gradients."""
    _needs_triton()
    torch._dynamo.reset()
    wi = torch.nn.Linear(768, 2 * 1152, bias=False, device="cuda", dtype=torch.bfloat16)
    wo = torch.nn.Linear(1152, 768, bias=False, device="cuda", dtype=torch.bfloat16)

    def mlp(h):
        return wo(ragged.gated_act(wi(h), "gelu"))

    h = _randn((2048, 768), torch.bfloat16, _gen("gated compile")).requires_grad_(True)
    out = torch.compile(mlp, fullgraph=True)(h)
    ref = mlp(h)
    torch.testing.assert_close(out, ref)
    params = (h, wi.weight, wo.weight)
    g_out = torch.autograd.grad(out.float().square().sum(), params)
    g_ref = torch.autograd.grad(ref.float().square().sum(), params)
    for a, c in zip(g_out, g_ref):  # inductor may order the surrounding sums differently
        assert a.dtype == c.dtype
        assert (a.float() - c.float()).abs().max() <= 2e-2 * c.float().abs().max()


def test_matches_hf_geglu():
    """What transformers' ModernBERT MLP computes after Wi (``ACT2FN["gelu"]`` is the erf GELU)."""
    _needs_triton()
    x = _randn((512, 2 * 1152), torch.float32, _gen("gated hf"))
    a, gate = x.chunk(2, dim=-1)
    torch.testing.assert_close(ragged.gated_act(x, "gelu"), F.gelu(a) * gate, atol=1e-6, rtol=1e-6)
