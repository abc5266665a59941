"""bias_act and add_layer_norm on the GPU (``pytest -m gpu``), every backend: strided and
expanded parameters, odd layouts of x and residual, second derivatives (CPU versions in
test_fused_regressions.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ragged

pytestmark = pytest.mark.gpu
from gpu_fused_cases import (
    _act,
    _assert_rule,
    _gen,
    _leaf,
    _needs_cuda_kernels,
    _needs_triton,
    _randn,
)

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
    want = (
        dx,
        dr,
        torch.autograd.grad(w_view(w_leaf), w_leaf, dwc)[0],
        torch.autograd.grad(b_view(b_leaf), b_leaf, dbc)[0],
    )
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
    "column_slice": (lambda n, f: (n, f + 16), lambda t, n, f: t[:, 8 : 8 + f]),  # 16-byte aligned
    "misaligned_slice": (lambda n, f: (n, f + 3), lambda t, n, f: t[:, 1 : 1 + f]),
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
            torch.testing.assert_close(
                got.detach().double(),
                ref.detach(),
                atol=1e-4 * scale,
                rtol=1e-4,
                msg=lambda m: f"{what} ({backend}): {m}",
            )
