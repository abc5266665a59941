"""Regressions of bias_act and add_layer_norm (CPU; the Triton kernels under the interpreter).

* 1-D parameters of any layout: a strided view (``w[::2]``), an expanded one
  (``t.expand(F)``, stride 0). Every kernel reads them as ``ptr + i``; the op's validation
  hands them on with unit stride, and autograd takes their gradients back to the view's base.
* x and residual of odd layouts: transposed, a column slice, rows that cannot be flattened
  without a copy, expanded rows.
* Second derivatives (``create_graph=True``), through both ways into an op: the eager
  ``autograd.Function`` and the ``torch.library`` op with its registered autograd (taken
  under ``torch.compile``, with tensor subclasses, or while a dispatch mode is active).

Every result is compared with float64 torch computed from the same leaves. GPU variants
(every backend, "cuda" and "auto" included) are in test_gpu_fused.py.
"""

from __future__ import annotations

import contextlib
import zlib

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_backends
from torch.utils._python_dispatch import TorchDispatchMode

import ragged
from ragged.records.fused import AddLayerNormArgs, AddLayerNormBackwardInputs, BiasActArgs, BiasActBackwardInputs

ACTIVATIONS = ["relu", "gelu", "gelu_tanh", "silu", "none"]
# (N rows, F features): empty, a single feature, one column block / one layer norm pass,
# several column blocks / the chunked layer norm (the interpreted configurations cap blocks
# at 256 elements)
SHAPES = [(0, 13), (1, 1), (7, 100), (5, 300)]


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _randn(shape, gen, dtype=torch.float32, shift=0.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) + shift).to(dtype)


def _close(out, ref, what, tol=1e-5):
    """float32 results against float64: atol relative to the largest reference value."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    torch.testing.assert_close(
        out.detach().double(), ref.detach().double(), atol=tol * scale, rtol=tol, msg=lambda m: f"{what}: {m}"
    )


def _grads(outs, leaves, gouts):
    """Gradients of ``sum(out * g)`` for each leaf (zeros for a leaf nothing reached)."""
    got = torch.autograd.grad(outs, leaves, gouts, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(got, leaves)]


def _leaf64(t):
    return t.detach().double().requires_grad_(True)


def _act64(z, activation):
    if activation == "relu":
        return F.relu(z)
    if activation == "gelu":
        return F.gelu(z)
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if activation == "silu":
        return z * torch.sigmoid(z)
    return z


def _ln64(x, r, w, b, eps=1e-5):
    s = x if r is None else x + r
    return F.layer_norm(s, (s.shape[-1],), w, b, eps), s


# A 1-D parameter of F entries as a view of a leaf: F -> (leaf shape, view of the leaf).
PARAMS = {
    "strided": lambda f: ((2 * f,), lambda t: t[::2]),
    "offset_stride3": lambda f: ((3 * f + 1,), lambda t: t[1::3]),
    "expanded": lambda f: ((1,), lambda t: t.expand(f)),
    "matrix_column": lambda f: ((f, 3), lambda t: t[:, 1]),
}


def _param(kind, f, gen, shift=0.0):
    """(leaf requiring grad, the view the op is given)."""
    shape, view = PARAMS[kind](f)
    leaf = _randn(shape, gen, shift=shift).requires_grad_(True)
    p = view(leaf)
    assert p.shape == (f,) and (f <= 1 or p.stride(0) != 1)
    return leaf, p


def _view64(kind, leaf, f):
    leaf64 = _leaf64(leaf)
    return leaf64, PARAMS[kind](f)[1](leaf64)


# --------------------------------------------------------------------------------------
# 1. Strided and expanded 1-D parameters


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("kind", list(PARAMS))
@pytest.mark.parametrize("activation", ["gelu", "none"])
def test_bias_act_strided_or_expanded_bias(backend, kind, activation):
    for n, f in SHAPES:
        gen = _gen("bias_act param", backend, kind, activation, n, f)
        x = _randn((n, f), gen).requires_grad_(True)
        leaf, bias = _param(kind, f, gen)
        y = ragged.bias_act(x, bias, activation, backend=backend)
        x64 = _leaf64(x)
        leaf64, bias64 = _view64(kind, leaf, f)
        y64 = _act64(x64 + bias64, activation)
        what = f"{kind} N={n} F={f}"
        _close(y, y64, f"y {what}")
        g = _randn((n, f), gen)
        dx, dleaf = _grads(y, (x, leaf), g)
        dx64, dleaf64 = _grads(y64, (x64, leaf64), g.double())
        _close(dx, dx64, f"dx {what}")
        _close(dleaf, dleaf64, f"d(bias's base) {what}")


def test_bias_act_expanded_bias_is_not_read_past_its_storage():
    """The issue's case: a one-element storage expanded to 8 features."""
    for backend in cpu_backends():
        x = torch.randn(5, 8)
        bias = torch.tensor([0.5]).expand(8)
        torch.testing.assert_close(ragged.bias_act(x, bias, "none", backend=backend), x + 0.5)
        bias = torch.randn(16)[::2]
        torch.testing.assert_close(ragged.bias_act(x, bias, "none", backend=backend), x + bias)


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("kind", list(PARAMS))
@pytest.mark.parametrize("return_sum", [False, True], ids=["y", "y_and_sum"])
def test_add_layer_norm_strided_or_expanded_parameters(backend, kind, return_sum):
    for n, f in SHAPES:
        gen = _gen("ln param", backend, kind, return_sum, n, f)
        x = _randn((n, f), gen, shift=1.0).requires_grad_(True)
        r = _randn((n, f), gen).requires_grad_(True)
        w_leaf, w = _param(kind, f, gen, shift=1.0)
        b_leaf, b = _param(kind, f, gen)
        out = ragged.add_layer_norm(x, r, w, b, return_sum=return_sum, backend=backend)
        y, s = out if return_sum else (out, None)
        x64, r64 = _leaf64(x), _leaf64(r)
        (w_leaf64, w64), (b_leaf64, b64) = _view64(kind, w_leaf, f), _view64(kind, b_leaf, f)
        y64, s64 = _ln64(x64, r64, w64, b64)
        what = f"{kind} N={n} F={f}"
        _close(y, y64, f"y {what}")
        outs, outs64, gouts = [y], [y64], [_randn((n, f), gen)]
        if return_sum:
            _close(s, s64, f"s {what}")
            outs.append(s)
            outs64.append(s64)
            gouts.append(_randn((n, f), gen))
        got = _grads(outs, (x, r, w_leaf, b_leaf), gouts)
        want = _grads(outs64, (x64, r64, w_leaf64, b_leaf64), [g.double() for g in gouts])
        for name, g, g64 in zip(("x", "residual", "weight's base", "bias's base"), got, want):
            _close(g, g64, f"d{name} {what}")


@pytest.mark.parametrize("backend", cpu_backends())
def test_add_layer_norm_strided_weight_without_bias_and_the_reverse(backend):
    gen = _gen("ln one param", backend)
    x = _randn((7, 100), gen)
    w = _randn((300,), gen)[::3]
    b = _randn((200,), gen)[1::2]
    _close(
        ragged.add_layer_norm(x, None, w, None, backend=backend),
        F.layer_norm(x.double(), (100,), w.double()),
        "weight only",
    )
    _close(
        ragged.add_layer_norm(x, None, None, b, backend=backend),
        F.layer_norm(x.double(), (100,), None, b.double()),
        "bias only",
    )


@pytest.mark.parametrize("backend", cpu_backends())
def test_parameter_grad_accumulates_on_the_leaf(backend):
    """``.backward()``: ``w.grad`` of a leaf whose two halves are the LayerNorm weight and bias
    (``w[::2]``, ``w[1::2]``), and ``b.grad`` of a one-element leaf expanded into a bias."""
    gen = _gen("leaf grad", backend)
    x = _randn((7, 16), gen, shift=1.0)
    w = _randn((32,), gen).requires_grad_(True)
    b = _randn((1,), gen).requires_grad_(True)
    y = ragged.bias_act(
        ragged.add_layer_norm(x, None, w[::2], w[1::2], backend=backend), b.expand(16), "gelu", backend=backend
    )
    y.square().sum().backward()
    w64, b64 = _leaf64(w), _leaf64(b)
    y64 = F.gelu(F.layer_norm(x.double(), (16,), w64[::2], w64[1::2]) + b64.expand(16))
    y64.square().sum().backward()
    _close(y, y64, "y")
    _close(w.grad, w64.grad, "w.grad")
    _close(b.grad, b64.grad, "b.grad")


def test_strided_parameters_under_compile():
    """The copy to unit stride is traced (no graph break); values and gradients as eager."""
    torch._dynamo.reset()
    gen = _gen("compile strided")
    w = _randn((32,), gen).requires_grad_(True)
    x = _randn((2, 5, 16), gen).requires_grad_(True)

    def block(x):
        y = ragged.add_layer_norm(x, None, w[::2], w[1::2], backend="torch")
        return ragged.bias_act(y, w[:1].expand(16), "gelu", backend="torch")

    out = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
    ref = F.gelu(F.layer_norm(x, (16,), w[::2], w[1::2]) + w[:1].expand(16))
    torch.testing.assert_close(out, ref)
    for a, c in zip(torch.autograd.grad(out.square().sum(), (x, w)), torch.autograd.grad(ref.square().sum(), (x, w))):
        torch.testing.assert_close(a, c)


def test_the_parameters_reach_every_backend_with_unit_stride(monkeypatch):
    """The one place every backend goes through: the backend choice (the spec its reasons read)
    and the call into the op's implementation see the parameters contiguous."""
    import dataclasses

    from ragged import backends
    from ragged.ops import fused

    seen = []

    def spy(name, fn):
        def wrapper(*args, **kwargs):
            # the spec functions take the operands; an implementation, the op's operand record
            flat = [t for a in args for t in (a if isinstance(a, tuple) else (a,))]
            seen.append((name, [t for t in flat if isinstance(t, torch.Tensor) and t.dim() == 1]))
            return fn(*args, **kwargs)

        return wrapper

    for name in ("bias_act_spec", "add_layer_norm_spec"):
        monkeypatch.setattr(fused, name, spy(name, getattr(fused, name)))
    for op in ("bias_act", "add_layer_norm"):
        impls = backends._OPS[op].impls
        impl = impls["torch"]
        monkeypatch.setitem(impls, "torch", dataclasses.replace(impl, forward=spy(op, impl.forward_fn)))
    x = torch.randn(4, 8)
    ragged.bias_act(x, torch.randn(16)[::2], backend="torch")
    ragged.add_layer_norm(x, x, torch.randn(16)[::2], torch.tensor([1.0]).expand(8), backend="torch")
    assert [name for name, _ in seen] == ["bias_act_spec", "bias_act", "add_layer_norm_spec", "add_layer_norm"]
    assert [len(ts) for _, ts in seen] == [1, 1, 2, 2]
    assert all(t.stride(0) == 1 for _, ts in seen for t in ts)


@pytest.mark.parametrize("kind", ["strided", "expanded"])
def test_triton_launchers_take_any_layout(kind):
    """The launchers called directly (as the fused encoder layer does): strided or expanded
    parameters, transposed rows, an expanded upstream gradient give what contiguous copies give."""
    if "triton" not in cpu_backends():
        pytest.skip("the Triton interpreter is off")
    from ragged.kernels.triton import fused as tf

    gen = _gen("launchers", kind)
    for n, f in [(7, 100), (3, 300)]:
        x = _randn((f, n), gen, shift=1.0).t()
        r = _randn((n, f), gen)
        _, w = _param(kind, f, gen, shift=1.0)
        _, b = _param(kind, f, gen)
        w, b = w.detach(), b.detach()
        dense = [t.contiguous() for t in (x, r, w, b)]
        g = _randn((1, f), gen).expand(n, f)
        ba, ba_dense = BiasActArgs(x, b, "gelu"), BiasActArgs(dense[0], dense[3], "gelu")
        ours = tf.bias_act_forward(ba).out, tf.bias_act_backward(ba, BiasActBackwardInputs(g))
        theirs = (
            tf.bias_act_forward(ba_dense).out,
            tf.bias_act_backward(ba_dense, BiasActBackwardInputs(g.contiguous())),
        )
        assert torch.equal(ours[0], theirs[0]) and all(map(torch.equal, ours[1], theirs[1]))
        _close(ours[0], F.gelu(x.double() + b.double()), f"bias_act F={f}")
        y, s, mean, rstd = tf.add_layer_norm_forward(AddLayerNormArgs(x, r, w, b, 1e-5, True))
        ref = tf.add_layer_norm_forward(AddLayerNormArgs(*dense, 1e-5, True))
        assert all(map(torch.equal, (y, s, mean, rstd), ref))
        _close(y, _ln64(x.double(), r.double(), w.double(), b.double())[0], f"add_layer_norm F={f}")
        mean2 = torch.stack([mean, mean], 1)[:, 0]  # stride 2
        ours = tf.add_layer_norm_backward(
            AddLayerNormArgs(x, r, w, b, 1e-5), AddLayerNormBackwardInputs(g, g.t().contiguous().t(), mean2, rstd)
        )
        theirs = tf.add_layer_norm_backward(
            AddLayerNormArgs(*dense, 1e-5),
            AddLayerNormBackwardInputs(g.contiguous(), g.contiguous(), ref.mean, ref.rstd),
        )
        assert ours.residual is None and theirs.residual is None
        assert all(torch.equal(a, c) for a, c in zip(ours, theirs) if a is not None)


# --------------------------------------------------------------------------------------
# x and residual of odd layouts

# (leaf shape from (N, F), view giving an [N, F] tensor)
LAYOUTS = {
    "contiguous": (lambda n, f: (n, f), lambda t, n, f: t),
    "transposed": (lambda n, f: (f, n), lambda t, n, f: t.t()),
    "column_slice": (lambda n, f: (n, f + 5), lambda t, n, f: t[:, 3 : 3 + f]),
    "expanded_rows": (lambda n, f: (1, f), lambda t, n, f: t.expand(n, f)),
    "every_other_row": (lambda n, f: (2 * n, f), lambda t, n, f: t[::2]),
}


def _layout(kind, n, f, gen, shift=0.0):
    shape, view = LAYOUTS[kind]
    leaf = _randn(shape(n, f), gen, shift=shift).requires_grad_(True)
    return leaf, view(leaf, n, f)


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("x_kind", [k for k in LAYOUTS if k != "contiguous"])
@pytest.mark.parametrize("r_kind", ["contiguous", "transposed", "column_slice"])
def test_odd_layouts_of_x_and_residual(backend, x_kind, r_kind):
    for n, f in [(1, 13), (7, 100), (5, 300)]:
        gen = _gen("layouts", backend, x_kind, r_kind, n, f)
        x_leaf, x = _layout(x_kind, n, f, gen, shift=1.0)
        r_leaf, r = _layout(r_kind, n, f, gen)
        w, b = _randn((f,), gen).requires_grad_(True), _randn((f,), gen).requires_grad_(True)
        y, s = ragged.add_layer_norm(x, r, w, b, return_sum=True, backend=backend)
        h = ragged.bias_act(x, b, "gelu_tanh", backend=backend)
        leaves64 = [_leaf64(t) for t in (x_leaf, r_leaf, w, b)]
        x64 = LAYOUTS[x_kind][1](leaves64[0], n, f)
        r64 = LAYOUTS[r_kind][1](leaves64[1], n, f)
        y64, s64 = _ln64(x64, r64, leaves64[2], leaves64[3])
        h64 = F.gelu(x64 + leaves64[3], approximate="tanh")
        what = f"x {x_kind}, residual {r_kind}, N={n} F={f}"
        for name, out, ref in (("y", y, y64), ("s", s, s64), ("bias_act", h, h64)):
            _close(out, ref, f"{name} {what}")
        gouts = [_randn((n, f), gen) for _ in range(3)]
        got = _grads([y, s, h], (x_leaf, r_leaf, w, b), gouts)
        want = _grads([y64, s64, h64], leaves64, [g.double() for g in gouts])
        for name, g, g64 in zip(("x's base", "residual's base", "weight", "bias"), got, want):
            _close(g, g64, f"d{name} {what}")


@pytest.mark.parametrize("backend", cpu_backends())
def test_leading_dims_that_do_not_flatten_to_a_view(backend):
    gen = _gen("3-d", backend)
    base = _randn((4, 3, 100), gen).requires_grad_(True)
    x = base.transpose(0, 1)  # [3, 4, 100]: rows not evenly spaced
    res = _randn((3, 4, 100), gen)
    y, s = ragged.add_layer_norm(x, res, None, None, return_sum=True, backend=backend)
    h = ragged.bias_act(x, None, "relu", backend=backend)
    base64 = _leaf64(base)
    y64, s64 = _ln64(base64.transpose(0, 1), res.double(), None, None)
    h64 = F.relu(base64.transpose(0, 1))
    for name, out, ref in (("y", y, y64), ("s", s, s64), ("h", h, h64)):
        assert out.shape == (3, 4, 100)
        _close(out, ref, name)
    g = _randn((3, 4, 100), gen)
    _close(_grads([y, h], (base,), [g, g])[0], _grads([y64, h64], (base64,), [g.double(), g.double()])[0], "dbase")


# --------------------------------------------------------------------------------------
# 2. Second derivatives


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing: while it is active, the public functions go
    through the torch.library ops rather than the eager autograd.Function."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _run(path):
    """A context for calls through ``path``: "eager" (the autograd.Function), "dispatch_mode"
    (the public functions under a dispatch mode: the torch.library op and its registered
    autograd)."""
    return _PassThrough() if path == "dispatch_mode" else contextlib.nullcontext()


def _bias_act_fn(path, activation, backend):
    if path == "op":  # the torch.library op called directly: its registered autograd
        return lambda x, b: torch.ops.ragged.bias_act(x, b, activation, backend)
    return lambda x, b: ragged.bias_act(x, b, activation, backend=backend)


# (residual, weight, bias, return_sum)
LN_VARIANTS = {
    "full_sum": (True, True, True, True),
    "full": (True, True, True, False),
    "no_residual": (False, True, True, False),
    "no_affine_sum": (True, False, False, True),
}


def _ln_fn(path, variant, backend, eps=1e-5):
    _, _, _, return_sum = LN_VARIANTS[variant]

    def fn(x, r, w, b):
        if path == "op":
            y, s, _, _ = torch.ops.ragged.add_layer_norm(x, r, w, b, eps, return_sum and r is not None, backend)
            return (y, s) if return_sum and r is not None else y
        return ragged.add_layer_norm(x, r, w, b, eps, return_sum=return_sum, backend=backend)

    return fn


def _ln_inputs(variant, gen, n, f, dtype):
    has_r, has_w, has_b, _ = LN_VARIANTS[variant]
    x = _randn((n, f), gen, dtype, shift=0.5).requires_grad_(True)
    r = _randn((n, f), gen, dtype).requires_grad_(True) if has_r else None
    w = (1 + 0.5 * _randn((f,), gen, dtype)).requires_grad_(True) if has_w else None
    b = _randn((f,), gen, dtype).requires_grad_(True) if has_b else None
    return x, r, w, b


PATHS = ["eager", "op", "dispatch_mode"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_bias_act_gradgradcheck_torch_backend(path, activation):
    gen = _gen("bias_act gradgrad", path, activation)
    x = _randn((3, 5), gen, torch.float64).requires_grad_(True)
    b = _randn((5,), gen, torch.float64).requires_grad_(True)
    fn = _bias_act_fn(path, activation, "torch")
    with _run(path):
        assert torch.autograd.gradcheck(fn, (x, b))
        assert torch.autograd.gradgradcheck(fn, (x, b))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("variant", list(LN_VARIANTS))
def test_add_layer_norm_gradgradcheck_torch_backend(path, variant):
    """The saved row statistics are constants to autograd: the second derivative must also see
    how mean and rstd depend on the sum (before, a Jacobian mismatch of about 280)."""
    gen = _gen("ln gradgrad", path, variant)
    inputs = tuple(t for t in _ln_inputs(variant, gen, 4, 6, torch.float64))
    present = [t for t in inputs if t is not None]
    where = [i for i, t in enumerate(inputs) if t is not None]
    base = _ln_fn(path, variant, "torch")

    def fn(*args):
        full = [None] * 4
        for i, t in zip(where, args):
            full[i] = t
        return base(*full)

    with _run(path):
        assert torch.autograd.gradcheck(fn, tuple(present))
        assert torch.autograd.gradgradcheck(fn, tuple(present))


def _second_order(outs, inputs, gen):
    """First gradients of ``sum(out * g)`` (create_graph), then the gradients of
    ``sum(first * v)``: the Hessian-vector products a gradient penalty needs."""
    present = [t for t in inputs if t is not None]
    gouts = [_randn(o.shape, gen, torch.float64) for o in outs]
    vs = [_randn(t.shape, gen, torch.float64) for t in present]
    return gouts, vs


def _hvp(outs, inputs, gouts, vs):
    present = [t for t in inputs if t is not None]
    first = torch.autograd.grad(outs, present, [g.to(o.dtype) for g, o in zip(gouts, outs)], create_graph=True)
    penalty = sum((g.double() * v).sum() for g, v in zip(first, vs))
    if not penalty.requires_grad:  # "none": the first gradients do not depend on the inputs
        return first, [torch.zeros_like(t) for t in present]
    second = torch.autograd.grad(penalty, present, allow_unused=True)
    return first, [torch.zeros_like(t) if g is None else g for g, t in zip(second, present)]


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("variant", list(LN_VARIANTS))
def test_add_layer_norm_second_derivatives_match_float64(backend, path, variant):
    """float32 on every backend against float64 torch: the first gradients (taken with
    create_graph=True) and the gradients of a penalty on them."""
    for n, f in [(1, 7), (6, 100), (3, 300)]:
        gen = _gen("ln second", backend, path, variant, n, f)
        inputs = _ln_inputs(variant, gen, n, f, torch.float32)
        inputs64 = [None if t is None else _leaf64(t) for t in inputs]
        with _run(path):
            out = _ln_fn(path, variant, backend)(*inputs)
        outs = list(out) if isinstance(out, tuple) else [out]
        y64, s64 = _ln64(*inputs64)
        outs64 = [y64, s64][: len(outs)]
        gouts, vs = _second_order(outs, inputs, gen)
        with _run(path):
            first, second = _hvp(outs, inputs, gouts, vs)
        first64, second64 = _hvp(outs64, inputs64, gouts, vs)
        names = [name for name, t in zip(("x", "residual", "weight", "bias"), inputs) if t is not None]
        for name, a, a64, b, b64 in zip(names, first, first64, second, second64):
            _close(a, a64, f"d{name} (create_graph) N={n} F={f}", tol=1e-4)
            _close(b, b64, f"second derivative, {name} N={n} F={f}", tol=1e-4)


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_bias_act_second_derivatives_match_float64(backend, path, activation):
    for n, f in [(1, 7), (6, 300)]:
        gen = _gen("bias_act second", backend, path, activation, n, f)
        x = _randn((n, f), gen).requires_grad_(True)
        b = _randn((f,), gen).requires_grad_(True)
        with _run(path):
            y = _bias_act_fn(path, activation, backend)(x, b)
        x64, b64 = _leaf64(x), _leaf64(b)
        y64 = _act64(x64 + b64, activation)
        gouts, vs = _second_order([y], (x, b), gen)
        with _run(path):
            first, second = _hvp([y], (x, b), gouts, vs)
        first64, second64 = _hvp([y64], (x64, b64), gouts, vs)
        for name, a, a64, c, c64 in zip(("x", "bias"), first, first64, second, second64):
            _close(a, a64, f"d{name} (create_graph) N={n} F={f}", tol=1e-4)
            _close(c, c64, f"second derivative, {name} N={n} F={f}", tol=1e-4)


@pytest.mark.parametrize("backend", cpu_backends())
def test_second_derivatives_of_a_strided_parameter(backend):
    """Both fixes at once: a penalty on the gradient of a strided LayerNorm weight."""
    gen = _gen("strided second", backend)
    x = _randn((5, 100), gen, shift=0.5).requires_grad_(True)
    w_leaf = (1 + 0.5 * _randn((200,), gen)).requires_grad_(True)
    y = ragged.bias_act(
        ragged.add_layer_norm(x, None, w_leaf[::2], None, backend=backend), w_leaf[1::2], "gelu", backend=backend
    )
    x64, w64 = _leaf64(x), _leaf64(w_leaf)
    y64 = F.gelu(F.layer_norm(x64, (100,), w64[::2]) + w64[1::2])
    gouts, vs = _second_order([y], (x, w_leaf), gen)
    first, second = _hvp([y], (x, w_leaf), gouts, vs)
    first64, second64 = _hvp([y64], (x64, w64), gouts, vs)
    for a, a64, what in zip([*first, *second], [*first64, *second64], ("dx", "dw", "d2x", "d2w")):
        _close(a, a64, what, tol=1e-4)


@pytest.mark.parametrize("backend", cpu_backends())
def test_bias_act_backward_op_never_aliases_its_gradient(backend):
    """ "none" passes the gradient through unchanged: the backward op must still return a new
    tensor (a torch.library op may not alias its inputs)."""
    x = torch.randn(4, 6)
    g = torch.randn(4, 6)
    for bias in (None, torch.randn(6)):
        # the backward op: the operands, then the gradient and need_bias
        torch.library.opcheck(torch.ops.ragged.bias_act_backward.default, (x, bias, "none", g, True, backend))
    xg = x.clone().requires_grad_(True)
    with _PassThrough():
        y = ragged.bias_act(xg, None, "none", backend=backend)
        (dx,) = torch.autograd.grad(y, xg, g)
    assert torch.equal(dx, g)
