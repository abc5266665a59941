"""One way to define an op: the ``torch.library`` ops, one autograd rule, the eager path.

An op of ragged is written once, as data handed to :func:`define`:

* ``signature``: an annotated stub of the forward's operands (``def f(x: Tensor, n: int) ->
  Tensor: ...``); the ``torch.library`` op ``ragged::<name>`` takes those operands and the
  name of the backend to run (a ``str``, last);
* ``fake``: the forward's fake implementation (shapes and dtypes only), for torch.compile;
* ``setup(ctx, inputs, output)`` and ``backward(ctx, *grads)``: the one autograd rule, where
  ``inputs`` are the forward's operands followed by the backend and ``backward`` returns a
  gradient per operand (the backend gets none). The same two functions serve the
  ``torch.library`` op (``register_autograd``) and the eager path below;
* optionally ``backward_signature`` / ``backward_fake``: a second op ``ragged::<name>_backward``
  for the backward kernels, so that a traced backward is one node too. Outputs a kernel may
  leave out (``None``, or trailing outputs it does not return: a gradient of an optional
  operand that was not given) travel through it as empty tensors, restored to None by
  :meth:`OpDef.call_backward` from ``backward_present(*operands)``;
* ``spec``: a function from the operands to the op's frozen spec object, which every
  implementation's ``reasons`` reads (see :mod:`ragged.backends`).

Calling the op (``OP(*operands, backend)``) takes one of three paths, the same result on each:

* traced (torch.compile, fake tensors, tensor subclasses, dispatch modes): the
  ``torch.library`` op, which carries the autograd rule;
* eager, with a gradient to record: an ``autograd.Function`` made by :func:`define` from the
  same ``setup`` / ``backward``; it skips the dispatcher, whose host time per call is more
  than a small kernel runs (``python -m bench.overhead`` measures both paths);
* eager, no gradient: the implementation's forward, called straight.

The implementations themselves are declared beside their kernels
(:class:`ragged.backends.Implementation`) and registered by name; :func:`define` does not
know them.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import backends
from .utils import eager

_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_dispatch_depth = torch._C._len_torch_dispatch_stack

__all__ = ["OpDef", "define"]


def _schema(signature: Callable) -> str:
    """The schema of ``signature`` with a trailing ``str backend`` operand."""
    schema = torch.library.infer_schema(signature, mutates_args=())
    head, arrow, tail = schema.rpartition(") ->")
    joiner = ", " if not head.endswith("(") else ""
    return f"{head}{joiner}str backend{arrow}{tail}"


def _tensor_positions(signature: Callable) -> tuple[int, ...]:
    """Positions of the operands annotated as tensors (``Tensor`` or ``Tensor | None``; a list
    of tensors is not one: the eager path tests each operand's type)."""
    import inspect
    import typing

    hints = typing.get_type_hints(signature)
    out = []
    for i, name in enumerate(inspect.signature(signature).parameters):
        hint = hints.get(name)
        if hint is torch.Tensor or (
            typing.get_origin(hint) in (typing.Union, types.UnionType) and torch.Tensor in typing.get_args(hint)
        ):
            out.append(i)
    return tuple(out)


def _output_count(signature: Callable) -> int:
    """How many tensors ``signature`` returns (1 for a lone tensor)."""
    import typing

    hint = typing.get_type_hints(signature).get("return")
    return len(typing.get_args(hint)) if typing.get_origin(hint) is tuple else 1


@dataclasses.dataclass(frozen=True, eq=False)
class OpDef:
    """An op defined by :func:`define`: call it with the operands and a backend name."""

    name: str
    impls: dict  # backend name -> Implementation (the registry's own dict)
    forward_op: Any  # torch.library CustomOpDef of ragged::<name>
    backward_op: Any | None  # ragged::<name>_backward, when declared
    function: type  # the eager autograd.Function
    tensor_positions: tuple[int, ...]  # operands that may hold a tensor
    backward_tensor_positions: tuple[int, ...]
    backward_present: Callable[..., Sequence[bool]] | None

    def __call__(self, *args, context: Any = None):
        """``OP(*operands, backend)``: the forward's outputs (see the module docstring).

        ``context``: host-side facts that spare the backward a device read in eager calls
        (host offsets, say), stored as ``ctx.context`` for the autograd rule; traced calls
        (and the rule's ``ctx`` there) have ``ctx.context = None``."""
        # eager() inlined, and the gradient test folded into the same loop: this runs on every call
        if _is_compiling():
            return self.forward_op(*args)
        grad = False
        for i in self.tensor_positions:
            t = args[i]
            if t is not None:
                kind = type(t)
                if kind is not _Tensor and kind is not _Parameter:
                    return self.forward_op(*args)
                grad = grad or t.requires_grad
        if _dispatch_depth():
            return self.forward_op(*args)
        if grad and _grad_enabled():
            return self.function.apply(*args, context)
        return self.impls[args[-1]].forward_fn(*args[:-1])

    def call_backward(self, *args):
        """``OP.call_backward(*operands, backend)``: the backward implementation of ``backend``
        (or the ``ragged::<name>_backward`` op while tracing). Eager calls may leave out trailing
        operands the implementations give defaults."""
        last = len(args) - 1
        tensors = [args[i] for i in self.backward_tensor_positions if i < last and args[i] is not None]
        if self.backward_op is None or eager(*tensors):
            return self.impls[args[-1]].backward_fn(*args[:-1])
        out = self.backward_op(*args)
        if self.backward_present is None:
            return out
        return tuple(t if keep else None for t, keep in zip(out, self.backward_present(*args[:-1])))


def define(
    name: str,
    signature: Callable,
    *,
    fake: Callable,
    setup: Callable,
    backward: Callable,
    spec: Callable,
    backward_signature: Callable | None = None,
    backward_fake: Callable | None = None,
    backward_present: Callable[..., Sequence[bool]] | None = None,
    non_differentiable: Callable[[tuple, Any], Sequence[torch.Tensor]] | None = None,
) -> OpDef:
    """Define op ``name`` (see the module docstring) and register it with :mod:`ragged.backends`.

    ``non_differentiable(inputs, outputs)``: the outputs autograd must treat as constants
    (statistics, indices); the ``torch.library`` op's outputs get a None gradient for them.
    Which implementation ``"auto"`` prefers on CUDA tensors is each implementation's measured
    ``rank``, declared beside its kernels (:class:`ragged.backends.Implementation`).
    """

    backends.declare_op(name, spec)
    impls = backends.implementations(name)  # filled as implementations are registered

    def run_forward(*args):
        return impls[args[-1]].forward_fn(*args[:-1])

    forward_op = torch.library.custom_op(f"ragged::{name}", run_forward, mutates_args=(), schema=_schema(signature))
    forward_op.register_fake(lambda *args: fake(*args[:-1]))

    def rule(ctx, *grads):
        return (*backward(ctx, *grads), None)

    def traced_setup(ctx, inputs, output):
        ctx.context = None
        setup(ctx, inputs, output)

    forward_op.register_autograd(rule, setup_context=traced_setup)

    backward_op = None
    backward_positions: tuple[int, ...] = ()
    if backward_signature is not None:
        backward_positions = _tensor_positions(backward_signature)
        outputs = _output_count(backward_signature)

        def run_backward(*args):
            out = tuple(impls[args[-1]].backward_fn(*args[:-1]))
            # an op returns tensors only: a gradient a kernel leaves out travels as an empty tensor
            like = args[backward_positions[0]]
            out += (None,) * (outputs - len(out))
            return tuple(like.new_empty(0) if t is None else t for t in out)

        backward_op = torch.library.custom_op(
            f"ragged::{name}_backward", run_backward, mutates_args=(), schema=_schema(backward_signature)
        )
        backward_op.register_fake(lambda *args: backward_fake(*args[:-1]))

    def eager_forward(ctx, *args):
        ctx.context = args[-1]
        args = args[:-1]
        out = impls[args[-1]].forward_fn(*args[:-1])
        setup(ctx, args, out)
        if non_differentiable is not None:
            constants = non_differentiable(args, out)
            if constants:
                ctx.mark_non_differentiable(*constants)
        return out

    function = type(
        f"{name.title().replace('_', '')}Function",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(eager_forward),
            "backward": staticmethod(lambda ctx, *grads: (*rule(ctx, *grads), None)),
            "__doc__": f"The eager path of ragged::{name}: its autograd rule without the dispatcher.",
            "__module__": __name__,
        },
    )
    return OpDef(
        name,
        impls,
        forward_op,
        backward_op,
        function,
        _tensor_positions(signature),
        backward_positions,
        backward_present,
    )
