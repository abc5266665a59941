"""gated_act against a float64 oracle written here with plain torch ops.

CPU: the "torch" backend, and the Triton kernels under the interpreter at small sizes (the
interpreted tiles are small: F = 300 takes several column blocks, T = 70 at F = 5 several row
blocks). GPU sizes are in test_gpu_gated_act.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_backends
from test_fused import _close, _gen, _no_worse_than_torch, _randn

import ragged
from ragged.ops.gated import GATED_ACT, reference_gated_act_backward
from ragged.records.gated import GatedActArgs, GatedActBackwardInputs, GatedActGrads, GatedActOutput

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACTIVATIONS = ["gelu", "gelu_tanh", "relu", "silu", "none"]
SHAPES = [(0, 8), (1, 1), (1, 7), (70, 5), (33, 300)]  # (T tokens, F output features); x is [T, 2F]


def _act64(z: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(z)
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if activation == "relu":
        return F.relu(z)
    if activation == "silu":
        return z * torch.sigmoid(z)
    return z


def _oracle(x: torch.Tensor, activation: str) -> torch.Tensor:
    """What ModernBERT's MLP does after Wi: ``input, gate = x.chunk(2, -1)``, ``act(input) * gate``."""
    a, gate = x.chunk(2, dim=-1)
    return _act64(a, activation) * gate


def _case(backend, dtype, activation, t, f, x=None):
    """(x, y, y64, dx, dx64, gradient) for fresh inputs (or ``x``) of ``[t, 2f]``."""
    gen = _gen("gated_act", backend, str(dtype), activation, t, f)
    if x is None:
        x = _randn((t, 2 * f), dtype, gen)
    x = x.requires_grad_(True) if x.is_leaf else x
    y = ragged.gated_act(x, activation, backend=backend)
    g = _randn(y.shape, dtype, gen)
    (dx,) = torch.autograd.grad(y, x, g)
    x64 = x.detach().double().requires_grad_(True)
    y64 = _oracle(x64, activation)
    (dx64,) = torch.autograd.grad(y64, x64, g.double())
    return x, y, y64, dx, dx64, g


# --------------------------------------------------------------------------------------
# Values and gradients


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matches_float64(backend, dtype, activation):
    for t, f in SHAPES:
        x, y, y64, dx, dx64, _ = _case(backend, dtype, activation, t, f)
        what = f"T={t} F={f}"
        assert y.shape == (t, f) and y.dtype == dtype and y.is_contiguous(), what
        assert dx.shape == x.shape and dx.dtype == dtype, what
        _close(y, y64, f"y {what}")
        _close(dx, dx64, f"dx {what}")
        if t and dtype != torch.float32:  # torch's own error in the same precision
            a, gate = x.detach().chunk(2, dim=-1)
            _no_worse_than_torch(y, _act64(a, activation) * gate, y64, f"y {what}", backend)


def test_float64_on_the_reference():
    for activation in ACTIVATIONS:
        x, y, y64, dx, dx64, _ = _case("torch", torch.float64, activation, 9, 13)
        assert y.dtype == dx.dtype == torch.float64
        _close(y, y64, activation)
        _close(dx, dx64, activation)
    x = torch.randn(4, 6, dtype=torch.float64)
    assert torch.equal(ragged.reference_gated_act(x, "relu"), F.relu(x[:, :3]) * x[:, 3:])


@pytest.mark.parametrize("backend", cpu_backends())
def test_strided_views_and_gradient_layouts(backend):
    """x a view of a wider Linear output (row stride past 2F) and at an odd element offset; x with
    columns of stride 2 (copied first); an expanded upstream gradient (``y.sum()``)."""
    gen = _gen("gated strided", backend)
    big = _randn((21, 2 * 100 + 37), torch.float32, gen).requires_grad_(True)
    x = big[:, 3:203]
    assert x.stride() == (237, 1)
    _, y, y64, dx, dx64, _ = _case(backend, torch.float32, "gelu", 21, 100, x=x)
    _close(y, y64, "y of a row-strided view")
    _close(dx, dx64, "dx of a row-strided view")
    (dbig,) = torch.autograd.grad(ragged.gated_act(x, "gelu", backend=backend), big, torch.ones(21, 100))
    assert torch.equal(dbig[:, :3], torch.zeros(21, 3)) and torch.equal(dbig[:, 203:], torch.zeros(21, 34))
    xs = _randn((6, 40), torch.float32, gen)[:, ::2]  # [6, 20], column stride 2
    _close(ragged.gated_act(xs, "gelu_tanh", backend=backend), _oracle(xs.double(), "gelu_tanh"), "column stride 2")
    xg = _randn((5, 18), torch.float32, gen).requires_grad_(True)
    (dx,) = torch.autograd.grad(ragged.gated_act(xg, "gelu", backend=backend).sum(), xg)
    x64 = xg.detach().double().requires_grad_(True)
    (dx64,) = torch.autograd.grad(_oracle(x64, "gelu").sum(), x64)
    _close(dx, dx64, "dx of y.sum()")


@pytest.mark.parametrize("backend", cpu_backends())
def test_empty_and_featureless(backend):
    x = torch.randn(0, 16, requires_grad=True)
    y = ragged.gated_act(x, backend=backend)
    assert y.shape == (0, 8)
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert dx.shape == (0, 16)
    x = torch.randn(3, 0, requires_grad=True)
    y = ragged.gated_act(x, backend=backend)
    assert y.shape == (3, 0)
    (dx,) = torch.autograd.grad(y.sum(), x, allow_unused=True)
    assert dx is None or dx.shape == (3, 0)


@pytest.mark.parametrize("backend", cpu_backends())
def test_rows_are_batch_invariant_and_spare_rows_stay_apart(backend):
    """A token alone gives bit for bit what it gives in a batch, and NaN in spare rows (a graph's
    bucket past the real tokens) touches no real row, forward or backward."""
    gen = _gen("gated invariance", backend)
    x = _randn((40, 2 * 150), torch.bfloat16, gen)
    y_all = ragged.gated_act(x, "gelu", backend=backend)
    for i in (0, 17, 39):
        assert torch.equal(ragged.gated_act(x[i : i + 1], "gelu", backend=backend), y_all[i : i + 1])
    padded = torch.cat([x, torch.full((8, 300), float("nan"), dtype=torch.bfloat16)]).requires_grad_(True)
    y = ragged.gated_act(padded, "gelu", backend=backend)
    assert torch.equal(y[:40], y_all)
    g = torch.ones_like(y)
    g[40:] = float("nan")
    (dx,) = torch.autograd.grad(y, padded, g)
    x1 = x.clone().requires_grad_(True)
    (dx_real,) = torch.autograd.grad(ragged.gated_act(x1, "gelu", backend=backend), x1, torch.ones_like(y_all))
    assert torch.equal(dx[:40], dx_real)


def test_backends_agree_bit_for_bit_where_the_product_is_exact():
    """relu and none: a product of two float16 values is exact in float32, so both backends store
    the same bits (float16: the interpreter rounds as the GPU does)."""
    if "triton" not in cpu_backends():
        pytest.skip("the Triton interpreter is off")
    x = _randn((9, 2 * 130), torch.float16, _gen("gated agree"))
    for activation in ("relu", "none"):
        assert torch.equal(
            ragged.gated_act(x, activation, backend="torch"), ragged.gated_act(x, activation, backend="triton")
        )


@pytest.mark.parametrize("backend", cpu_backends())
def test_autocast_leaves_it_alone(backend):
    x = _randn((7, 24), torch.bfloat16, _gen("gated autocast", backend))
    y = ragged.gated_act(x, "gelu", backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(ragged.gated_act(x, "gelu", backend=backend), y)
    x32 = x.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y32 = ragged.gated_act(x32, "gelu", backend=backend)
    assert y32.dtype == torch.float32
    _close(y32, _oracle(x32.double(), "gelu"), "float32 under autocast")


# --------------------------------------------------------------------------------------
# Autograd, custom ops, compile


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_and_gradgradcheck(activation):
    x = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    if activation == "relu":  # keep away from the kink
        x = (x.detach() + 0.2 * x.detach().sign()).requires_grad_(True)

    def f(x):
        return ragged.gated_act(x, activation, backend="torch")

    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))


@pytest.mark.parametrize("backend", cpu_backends())
def test_second_derivative_on_every_backend(backend):
    """create_graph=True: the backward runs as the reference's torch ops on every backend."""
    x = _randn((6, 2 * 9), torch.float32, _gen("gated second", backend)).requires_grad_(True)
    (dx,) = torch.autograd.grad(ragged.gated_act(x, "gelu", backend=backend).square().sum(), x, create_graph=True)
    (ddx,) = torch.autograd.grad(dx.square().sum(), x)
    x64 = x.detach().double().requires_grad_(True)
    (dx64,) = torch.autograd.grad(_oracle(x64, "gelu").square().sum(), x64, create_graph=True)
    (ddx64,) = torch.autograd.grad(dx64.square().sum(), x64)
    _close(dx, dx64, "dx")
    _close(ddx, ddx64, "d2x")


@pytest.mark.parametrize("backend", cpu_backends())
def test_compile_fullgraph_forward_backward(backend):
    """ModernBERT's MLP (Wi, GeGLU, Wo) on packed tokens: no graph break, eager's values and gradients."""
    torch._dynamo.reset()
    wi, wo = torch.nn.Linear(16, 2 * 24, bias=False), torch.nn.Linear(24, 16, bias=False)

    def mlp(h):
        return wo(ragged.gated_act(wi(h), "gelu", backend=backend))

    h = torch.randn(11, 16, requires_grad=True)
    out = torch.compile(mlp, fullgraph=True, backend="aot_eager")(h)
    ref = mlp(h)
    torch.testing.assert_close(out, ref)
    params = (h, wi.weight, wo.weight)
    for a, c in zip(torch.autograd.grad(out.square().sum(), params), torch.autograd.grad(ref.square().sum(), params)):
        torch.testing.assert_close(a, c)


def test_opcheck():
    ops = torch.ops.ragged
    x = torch.randn(5, 12, requires_grad=True)
    for activation in ACTIVATIONS:
        torch.library.opcheck(ops.gated_act.default, (x, activation, "torch"))
    torch.library.opcheck(ops.gated_act.default, (torch.randn(0, 4, dtype=torch.float64), "gelu", "torch"))
    # the backward op: the operands, then the gradient
    torch.library.opcheck(ops.gated_act_backward.default, (x.detach(), "gelu_tanh", torch.randn(5, 6), "torch"))


@pytest.mark.parametrize("backend", cpu_backends())
def test_the_op_takes_and_returns_records(backend):
    x = torch.randn(5, 12)
    args = GatedActArgs(x=x, activation="gelu_tanh")
    out = GATED_ACT(args, backend)
    assert isinstance(out, GatedActOutput)
    torch.testing.assert_close(out.out, ragged.reference_gated_act(x, "gelu_tanh"))
    g = torch.randn(5, 6)
    got = GATED_ACT.call_backward(args, GatedActBackwardInputs(grad_out=g), backend)
    assert isinstance(got, GatedActGrads)
    torch.testing.assert_close(got.x, reference_gated_act_backward(g, x, "gelu_tanh"))


def test_public_api_under_fake_tensors_uses_the_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = ragged.gated_act(torch.empty(37, 2 * 1152, dtype=torch.bfloat16), "gelu", backend="torch")
    assert y.shape == (37, 1152) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", cpu_backends())
def test_eager_path_and_op_path_agree(backend):
    x = torch.randn(5, 12, requires_grad=True)
    eager = ragged.gated_act(x, "gelu", backend=backend)
    via_op = torch.ops.ragged.gated_act(x, "gelu", backend)
    assert torch.equal(eager, via_op)
    g = torch.randn(5, 6)
    assert torch.equal(torch.autograd.grad(eager, x, g)[0], torch.autograd.grad(via_op, x, g)[0])


# --------------------------------------------------------------------------------------
# Backend choice, explain and bad inputs


def test_auto_and_explain():
    from ragged import backends

    x = torch.randn(3, 8)
    assert backends.select("gated_act", None, x.device, x, "gelu").name == "torch"
    by_name = ragged.explain("gated_act", x, "gelu")
    assert by_name == ragged.explain(ragged.gated_act, x, "gelu")
    assert set(by_name) == set(backends.op_entry("gated_act").impls) and by_name["torch"] == []
    assert by_name.chosen == "torch"
    reasons = ragged.explain(ragged.gated_act, x.double(), "relu")
    assert reasons["torch"] == [] and any("float64" in r for r in reasons["triton"])
    with pytest.raises(ValueError, match=r"ragged\.gated_act\(\): backend 'triton' cannot take this input.*float64"):
        ragged.gated_act(x.double(), backend="triton")
    with pytest.raises(ValueError, match=r"ragged\.gated_act\(\): backend 'cuda' has no implementation"):
        ragged.gated_act(x, backend="cuda")
    with pytest.raises(ValueError, match=r"ragged\.gated_act\(\): expected activation"):
        ragged.explain(ragged.gated_act, x, "swish")
    with ragged.use_backend("torch"):
        torch.testing.assert_close(ragged.gated_act(x), F.gelu(x[:, :4]) * x[:, 4:])


GA = r"ragged\.gated_act\(\)"
_x = torch.randn(4, 8)
_bad = [
    (lambda b: ragged.gated_act([1.0], backend=b), TypeError, GA + r".*x.*torch\.Tensor.*list"),
    (lambda b: ragged.gated_act(torch.randn(8), backend=b), ValueError, GA + r".*x.*\[T, 2F\].*\(8,\)"),
    (lambda b: ragged.gated_act(torch.randn(2, 3, 8), backend=b), ValueError, GA + r".*x.*\[T, 2F\].*\(2, 3, 8\)"),
    (lambda b: ragged.gated_act(torch.tensor(1.0), backend=b), ValueError, GA + r".*x.*\[T, 2F\].*\(\)"),
    (lambda b: ragged.gated_act(torch.randn(4, 7), backend=b), ValueError, GA + r".*x.*even last dim.*\(4, 7\)"),
    (
        lambda b: ragged.gated_act(torch.ones(4, 8, dtype=torch.int64), backend=b),
        TypeError,
        GA + r".*x.*floating.*int64",
    ),
    (lambda b: ragged.gated_act(torch.ones(4, 8, dtype=torch.bool), backend=b), TypeError, GA + r".*x.*floating.*bool"),
    (lambda b: ragged.gated_act(_x.to(torch.complex64), backend=b), TypeError, GA + r".*x.*floating.*complex64"),
    (lambda b: ragged.gated_act(_x, "swish", backend=b), ValueError, GA + r".*activation.*'gelu'.*'swish'"),
    (lambda b: ragged.gated_act(_x, "gelu_new", backend=b), ValueError, GA + r".*activation.*'gelu_new'"),
    (lambda b: ragged.gated_act(_x, None, backend=b), ValueError, GA + r".*activation.*None"),
]


@pytest.mark.parametrize("backend", [*cpu_backends(), "cuda", "auto"])
@pytest.mark.parametrize("call,exc,pattern", _bad, ids=[str(i) for i in range(len(_bad))])
def test_bad_inputs_raise_the_same_on_every_backend(backend, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(backend)


def test_bad_backend_name():
    with pytest.raises(ValueError, match=GA + r".*backend.*'numpy'"):
        ragged.gated_act(_x, backend="numpy")


def test_token_count_is_not_specialised():
    """T changes with every batch: it must not make a new kernel variant (see test_compile_ahead)."""
    pytest.importorskip("triton")
    from ragged.kernels.triton import gated

    for kernel in (gated._gated_act_fwd_kernel, gated._gated_act_bwd_kernel):
        jit = kernel.jit
        given = getattr(jit, "do_not_specialize", None)
        if given is None:
            given = jit.kwargs["do_not_specialize"] or []
        assert "n_rows" in {jit.arg_names[i] if isinstance(i, int) else i for i in given}
