"""What the GPU tests of bias_act and add_layer_norm share (test_gpu_fused.py, test_gpu_fused_cuda.py,
test_gpu_fused_layouts.py): dtypes and tolerances, seeded draws, the float64 error rule and the
reference activations."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

import ragged
from ragged import backends

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}
ACTIVATIONS = ["relu", "gelu", "gelu_tanh", "silu", "none"]
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
    if activation == "silu":
        return z * torch.sigmoid(z)
    return z


def _grads(outs, inputs, gouts):
    present = [t for t in inputs if t is not None]
    it = iter(torch.autograd.grad(outs, present, gouts))
    return [None if t is None else next(it) for t in inputs]


def _leaf(t, dtype=None):
    return None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(True)


# --------------------------------------------------------------------------------------


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
            _assert_rule(f"{what} F={n_cols}", (y, dx, db)[i], outs["ref"][i].detach(), outs["low"][i].detach(), dtype)
    assert y.dtype == dx.dtype == dtype and (db is None or db.dtype == dtype)
    return x, b, y


LN_VARIANTS = {
    "full_sum": (True, True, True, True),
    "full": (True, True, True, False),
    "no_residual": (False, True, True, False),
    "no_affine_sum": (True, False, False, True),
}


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
    for name, g, g_ref, g_low, t in zip(
        ("x", "residual", "weight", "bias"), got, results["ref"][2], results["low"][2], (x, r, w, b)
    ):
        if t is not None:
            assert g.dtype == t.dtype
            _assert_rule(f"d{name}", g, g_ref, g_low, dtype)
    return (x, r, w, b), y, s


def _needs_cuda_kernels():
    _needs_triton()
    reason = backends.cuda_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)
