"""ragged.opdef and the declared implementations of ragged.backends, on a toy op of their own:
one definition gives the eager path, the autograd Function and the torch.library ops, and all
three compute the same values and gradients; a backend is one registration."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

import ragged
from ragged import backends, opdef
from ragged.backends import Implementation

NAME = "opdef_test_scale"


@dataclasses.dataclass(frozen=True)
class ToySpec:
    device: torch.device
    dtype: torch.dtype
    width: int


def toy_spec(x, factor):
    return ToySpec(x.device, x.dtype, x.shape[-1])


# the op: y = x * factor, and a row statistic that autograd must treat as a constant
def _signature(x: Tensor, factor: float) -> tuple[Tensor, Tensor]: ...


def _backward_signature(grad: Tensor, factor: float, need: bool) -> tuple[Tensor]: ...


CALLS: list[tuple] = []


def _forward(x, factor):
    CALLS.append(("forward", x.requires_grad, torch.is_grad_enabled()))
    return x * factor, x.detach().sum(-1)


def _backward(grad, factor, need):
    CALLS.append(("backward",))
    return (grad * factor if need else None,)


def _setup(ctx, inputs, output):
    x, factor, backend = inputs
    ctx.factor, ctx.backend = factor, backend
    CALLS.append(("context", ctx.context))


def _rule(ctx, grad, _dstat):
    (dx,) = OP.call_backward(grad, ctx.factor, ctx.needs_input_grad[0], ctx.backend)
    return dx, None


OP = opdef.define(
    NAME,
    _signature,
    spec=toy_spec,
    setup=_setup,
    backward=_rule,
    fake=lambda x, factor: (torch.empty_like(x), x.new_empty(x.shape[:-1])),
    backward_signature=_backward_signature,
    backward_fake=lambda grad, factor, need: (torch.empty_like(grad),),
    backward_present=lambda grad, factor, need: (need,),
    non_differentiable=lambda inputs, out: (out[1],),
)
backends.register(Implementation(NAME, "torch", _forward, _backward))


@pytest.fixture
def toy_backend(monkeypatch):
    """A backend of the test's own ("toy"), taking only CPU tensors of float32 with width <= 8
    and even widths."""
    monkeypatch.setattr(backends, "BACKENDS", backends.BACKENDS)
    monkeypatch.setattr(backends, "_BACKEND_REASONS", dict(backends._BACKEND_REASONS))
    monkeypatch.setattr(backends._OPS[NAME], "impls", backends._OPS[NAME].impls)
    backends.register_backend("toy", lambda d: None if d.type == "cpu" else f"toy runs on the CPU, got {d.type}")
    impl = Implementation(
        NAME,
        "toy",
        f"{__name__}:_forward",
        f"{__name__}:_backward",
        dtypes=(torch.float32,),
        limits={"width": (2, 4, 6, 8)},
        maxima={"width": 6},
        rank=0,
    )
    monkeypatch.setitem(backends._OPS[NAME].impls, "toy", impl)
    yield impl
    monkeypatch.undo()


def _x(requires_grad=False, width=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(width)
    return torch.randn(3, width, generator=g, dtype=dtype).requires_grad_(requires_grad)


@pytest.fixture
def library_calls(monkeypatch):
    """The names of the torch.library ops called through their Python objects."""
    calls = []
    kind = type(OP.forward_op)
    real = kind.__call__

    def counting(self, *args, **kwargs):
        calls.append(self._name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(kind, "__call__", counting)
    return calls


def test_eager_without_grad_calls_the_implementation_straight(library_calls):
    CALLS.clear()
    x = _x()
    y, stat = OP(x, 2.5, "torch")
    torch.testing.assert_close(y, x * 2.5, rtol=0, atol=0)
    torch.testing.assert_close(stat, x.sum(-1), rtol=0, atol=0)
    assert CALLS == [("forward", False, True)]  # no setup: nothing is recorded
    assert library_calls == []  # the dispatcher is skipped


def test_eager_with_grad_is_one_generated_function_with_the_context(library_calls):
    CALLS.clear()
    x = _x(requires_grad=True)
    y, stat = OP(x, -1.5, "torch", context="host facts")
    assert type(y.grad_fn).__name__ == "OpdefTestScaleFunctionBackward"
    assert not stat.requires_grad  # marked non-differentiable
    (gx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(gx, torch.full_like(x, -1.5), rtol=0, atol=0)
    assert ("context", "host facts") in CALLS and ("backward",) in CALLS
    assert library_calls == []


def test_traced_calls_go_through_the_library_ops_with_the_same_rule():
    x = _x(requires_grad=True)
    want_y = x.detach() * 3.0

    def f(x):
        y, stat = OP(x, 3.0, "torch")
        return y * 1.0, stat

    CALLS.clear()
    y, stat = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(y, want_y, rtol=0, atol=0)
    torch.testing.assert_close(stat, x.detach().sum(-1), rtol=0, atol=0)
    (gx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(gx, torch.full_like(x, 3.0), rtol=0, atol=0)
    assert ("context", None) in CALLS  # the traced rule has no host context


def test_the_backward_op_restores_the_gradients_left_out():
    from torch._subclasses.fake_tensor import FakeTensorMode

    grad = _x()
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(grad)
        assert OP.call_backward(fake, 2.0, False, "torch") == (None,)
        (dx,) = OP.call_backward(fake, 2.0, True, "torch")
        assert dx.shape == grad.shape and type(dx) is not torch.Tensor  # the backward op's fake
    assert OP.call_backward(grad, 2.0, False, "torch") == (None,)  # eager: the implementation's own None


def test_a_new_backend_is_one_registration(toy_backend):
    x = _x()
    assert "toy" in backends.BACKENDS
    assert ragged.explain(NAME, x, 1.0) == {"torch": [], "toy": []}
    y, _ = OP(x, 2.0, backends.select_spec(NAME, "toy", toy_spec(x, 2.0)).backend)
    torch.testing.assert_close(y, x * 2.0, rtol=0, atol=0)
    with ragged.use_backend("toy"):
        assert backends.select(NAME, None, x.device, x, 2.0).backend == "toy"


def test_declared_support_gives_every_reason(toy_backend):
    x = _x(width=7, dtype=torch.float64)
    reasons = ragged.explain(NAME, x, 1.0)["toy"]
    assert reasons == [
        "toy opdef_test_scale takes float32, got torch.float64",
        "toy opdef_test_scale takes widths (2, 4, 6, 8), got 7",
        "toy opdef_test_scale takes width <= 6, got 7",
    ]
    with pytest.raises(
        ValueError,
        match=r"ragged\.opdef_test_scale\(\): backend 'toy' cannot take this input: "
        r"toy opdef_test_scale takes float32",
    ):
        backends.select_spec(NAME, "toy", toy_spec(x, 1.0))
    assert ragged.explain(NAME, _x(width=8), 1.0)["toy"] == ["toy opdef_test_scale takes width <= 6, got 8"]
    # "auto" off the GPU takes the reference, whatever the order says
    assert backends.select_spec(NAME, "auto", toy_spec(_x(), 1.0)).backend == "torch"


def test_implementations_are_imported_on_first_use(toy_backend):
    assert isinstance(toy_backend.forward, str)
    assert toy_backend.forward_fn is _forward and toy_backend.backward_fn is _backward
    lazy = Implementation(NAME, "toy", "ragged.no_such_module:f")
    with pytest.raises(ModuleNotFoundError):
        _ = lazy.forward_fn


def test_backend_names_are_checked():
    for bad in ("auto", "not an identifier", 3):
        with pytest.raises(ValueError, match=r"register_backend\(\): expected a backend name"):
            backends.register_backend(bad, lambda d: None)
    with pytest.raises(ValueError, match=r"register\(\): unknown backend 'nope'"):
        backends.register(Implementation(NAME, "nope", _forward))


def test_operands_that_are_lists_are_not_taken_for_tensors():
    def sig(a: Tensor, b: Tensor | None, c: list[Tensor], d: int) -> Tensor: ...

    assert opdef._tensor_positions(sig) == (0, 1)


def test_ragged_backends_lists_a_registered_backend(toy_backend):
    import ragged

    assert "toy" in ragged.BACKENDS and ragged.BACKENDS == backends.BACKENDS
    ragged.set_backend("toy")  # a registered name is a valid choice
    try:
        assert ragged.get_backend() == "toy"
    finally:
        ragged.set_backend(None)
