"""ragged.opdef and the declared implementations of ragged.backends, on a toy op of their own
over typed records: one definition gives the eager path, the autograd Function and the
torch.library ops, and all three compute the same values and gradients; a backend is one
registration."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

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


# the op: y = x * factor, and a row statistic that autograd must treat as a constant; its
# backward reads nothing of x (an unread operand)
class ScaleArgs(NamedTuple):
    x: Tensor
    factor: float


class ScaleOutput(NamedTuple):
    y: Tensor
    stat: Tensor


class ScaleBackwardInputs(NamedTuple):
    grad_y: Tensor
    need_x: bool


class ScaleGrads(NamedTuple):
    x: Tensor | None


CALLS: list[tuple] = []


def _forward(args: ScaleArgs) -> ScaleOutput:
    CALLS.append(("forward", args.x.requires_grad, torch.is_grad_enabled()))
    return ScaleOutput(args.x * args.factor, args.x.detach().sum(-1))


def _backward(args: ScaleArgs, inputs: ScaleBackwardInputs) -> ScaleGrads:
    CALLS.append(("backward", args.x is None))
    return ScaleGrads(inputs.grad_y * args.factor if inputs.need_x else None)


def _setup(ctx, args, output):
    ctx.factor = args.factor
    CALLS.append(("context", ctx.context))


def _rule(ctx, grad, _dstat):
    CALLS.append(("needs", tuple(ctx.needs_grad)))
    args = ScaleArgs(None, ctx.factor)  # the backward reads no x: the rule keeps none
    return OP.call_backward(args, ScaleBackwardInputs(grad, ctx.needs_grad.x), ctx.impl)


OP = opdef.define(
    NAME,
    ScaleArgs,
    ScaleOutput,
    spec=toy_spec,
    setup=_setup,
    backward=_rule,
    fake=lambda args: ScaleOutput(torch.empty_like(args.x), args.x.new_empty(args.x.shape[:-1])),
    backward_inputs=ScaleBackwardInputs,
    grads=ScaleGrads,
    backward_fake=lambda args, inputs: ScaleGrads(torch.empty_like(inputs.grad_y) if inputs.need_x else None),
    backward_unread=("x",),
    non_differentiable=lambda args, out: (out.stat,),
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
    out = OP(ScaleArgs(x, 2.5), "torch")
    assert isinstance(out, ScaleOutput)
    y, stat = out
    torch.testing.assert_close(y, x * 2.5, rtol=0, atol=0)
    torch.testing.assert_close(stat, x.sum(-1), rtol=0, atol=0)
    assert CALLS == [("forward", False, True)]  # no setup: nothing is recorded
    assert library_calls == []  # the dispatcher is skipped


def test_eager_with_grad_is_one_generated_function_with_the_context(library_calls):
    CALLS.clear()
    x = _x(requires_grad=True)
    out = OP(ScaleArgs(x, -1.5), "torch", context="host facts")
    assert isinstance(out, ScaleOutput)
    assert type(out.y.grad_fn).__name__ == "OpdefTestScaleFunctionBackward"
    assert not out.stat.requires_grad  # marked non-differentiable
    (gx,) = torch.autograd.grad(out.y.sum(), x)
    torch.testing.assert_close(gx, torch.full_like(x, -1.5), rtol=0, atol=0)
    assert ("context", "host facts") in CALLS and ("backward", True) in CALLS
    assert ("needs", (True, False)) in CALLS  # ctx.needs_grad, by operand
    assert library_calls == []


def test_traced_calls_go_through_the_library_ops_with_the_same_rule():
    x = _x(requires_grad=True)
    want_y = x.detach() * 3.0

    def f(x):
        y, stat = OP(ScaleArgs(x, 3.0), "torch")
        return y * 1.0, stat

    CALLS.clear()
    y, stat = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(y, want_y, rtol=0, atol=0)
    torch.testing.assert_close(stat, x.detach().sum(-1), rtol=0, atol=0)
    (gx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(gx, torch.full_like(x, 3.0), rtol=0, atol=0)
    assert ("context", None) in CALLS  # the traced rule has no host context
    assert ("needs", (True, False)) in CALLS


def test_the_backward_op_restores_the_gradients_left_out():
    from torch._subclasses.fake_tensor import FakeTensorMode

    grad = _x()
    args = ScaleArgs(None, 2.0)  # an unread operand
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(grad)
        assert OP.call_backward(args, ScaleBackwardInputs(fake, False), "torch") == (None,)
        got = OP.call_backward(args, ScaleBackwardInputs(fake, True), "torch")
        assert isinstance(got, ScaleGrads)
        assert got.x.shape == grad.shape and type(got.x) is not torch.Tensor  # the backward op's fake
    # eager: the implementation's own None
    assert OP.call_backward(args, ScaleBackwardInputs(grad, False), "torch") == (None,)


def test_the_backward_op_takes_no_unread_operand():
    schema = torch.ops.ragged.opdef_test_scale_backward.default._schema
    assert [a.name for a in schema.arguments] == ["factor", "grad_y", "need_x", "impl"]
    schema = torch.ops.ragged.opdef_test_scale.default._schema
    assert [a.name for a in schema.arguments] == ["x", "factor", "impl"]


def test_definitions_are_checked():
    common = dict(spec=toy_spec, setup=_setup, backward=_rule, fake=lambda args: None)
    with pytest.raises(ValueError, match=r"\['nope'\] name no operand of ScaleArgs"):
        opdef.define("opdef_test_unread", ScaleArgs, ScaleOutput, backward_unread=("nope",), **common)
    with pytest.raises(TypeError, match=r"expected a typing.NamedTuple record class"):
        opdef.define("opdef_test_tuple", tuple, ScaleOutput, **common)
    assert backends.op_entry("opdef_test_unread") is None and backends.op_entry("opdef_test_tuple") is None


def test_a_new_backend_is_one_registration(toy_backend):
    x = _x()
    assert "toy" in backends.BACKENDS
    assert ragged.explain(NAME, x, 1.0) == {"torch": [], "toy": []}
    y, _ = OP(ScaleArgs(x, 2.0), backends.select_spec(NAME, "toy", toy_spec(x, 2.0)).name)
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


class _Mixed(NamedTuple):
    a: Tensor
    b: Tensor | None
    c: list[Tensor]
    d: int


def test_operands_that_are_lists_are_not_taken_for_tensors():
    assert [opdef._is_tensor(hint) for _, hint in opdef._record_fields(_Mixed)] == [True, True, False, False]


def test_ragged_backends_lists_a_registered_backend(toy_backend):
    import ragged

    assert "toy" in ragged.BACKENDS and ragged.BACKENDS == backends.BACKENDS
    ragged.set_backend("toy")  # a registered name is a valid choice
    try:
        assert ragged.get_backend() == "toy"
    finally:
        ragged.set_backend(None)
