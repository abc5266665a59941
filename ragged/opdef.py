"""One way to define an op: the ``torch.library`` ops, one autograd rule, the eager path.

An op of ragged is written once, as data handed to :func:`define`, over typed records
(``typing.NamedTuple`` classes, :mod:`ragged.records`) that every part of it reads by name:

* ``args``: the operand record, whose annotations give the schema of the ``torch.library`` op
  ``ragged::<name>`` (the fields in order, then the name of the implementation to run, a
  ``str``); ``output``: the output record (one tensor per field);
* ``fake(args) -> output``: shapes and dtypes only, for torch.compile;
* ``setup(ctx, args, output)`` and ``backward(ctx, *output_grads) -> grads``: the one autograd
  rule, whose ``grads`` record names each gradient after its operand (on ``ctx``: ``impl``,
  the implementation's name, and ``needs_grad``, an ``args`` record of bools: whether each
  operand's gradient is wanted). The same two functions serve the ``torch.library`` op
  (``register_autograd``) and the eager path below;
* optionally ``backward_inputs`` / ``backward_fake``: the record the backward implementation
  takes besides the operands (the incoming gradients, what the forward saved, which
  gradients are wanted), and a second op ``ragged::<name>_backward`` of both, so that a
  traced backward is one node too. A gradient a kernel may leave out (a ``Tensor | None``
  field of ``grads``) travels through it as an empty tensor, restored to None by
  :meth:`RecordOp.call_backward`; operands no backward reads (``backward_unread``) are not
  its operands at all, and the rule need not keep them;
* ``spec``: a function from the operands to the op's frozen spec object, which every
  implementation's ``reasons`` reads (see :mod:`ragged.backends`).

Calling the op (``OP(args, impl)``, the output record back) takes one of three paths, the same
result on each:

* traced (torch.compile, fake tensors, tensor subclasses, dispatch modes): the
  ``torch.library`` op, which carries the autograd rule;
* eager, with a gradient to record: an ``autograd.Function`` made by :func:`define` from the
  same ``setup`` / ``backward``; it skips the dispatcher, whose host time per call is more
  than a small kernel runs (``python -m bench.overhead`` measures both paths);
* eager, no gradient: the implementation's forward, called straight with the record.

The implementations themselves (a forward ``(args) -> output`` and a backward ``(args, inputs)
-> grads``) are declared beside their kernels (:class:`ragged.backends.Implementation`) and
registered by name; :func:`define` does not know them.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import backends
from .utils import eager

_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_dispatch_depth = torch._C._len_torch_dispatch_stack

__all__ = ["RecordOp", "define"]


# --------------------------------------------------------------------------------------
# The records' fields as schema parameters


def _record_fields(record: type) -> tuple[tuple[str, Any], ...]:
    """``(name, annotation)`` of each field of a NamedTuple record, annotations resolved."""
    import typing

    if not (isinstance(record, type) and issubclass(record, tuple) and hasattr(record, "_fields")):
        raise TypeError(f"ragged.opdef: expected a typing.NamedTuple record class, got {record!r}")
    hints = typing.get_type_hints(record)
    return tuple((name, hints[name]) for name in record._fields)


def _is_tensor(hint: Any) -> bool:
    """``Tensor`` or ``Tensor | None``."""
    import typing

    if hint is torch.Tensor:
        return True
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and torch.Tensor in typing.get_args(hint)


def _is_optional(hint: Any) -> bool:
    import typing

    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _stub(name: str, params: Sequence[tuple[str, Any]], returns: Any) -> Callable:
    """A function object whose signature is ``params -> returns``: what ``torch.library`` infers
    an op's schema from."""
    import inspect

    def stub(*args):  # pragma: no cover - never called
        raise NotImplementedError

    stub.__name__ = name
    stub.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=h) for n, h in params],
        return_annotation=returns,
    )
    stub.__annotations__ = {**dict(params), "return": returns}
    return stub


def _tensor_tuple(n: int) -> Any:
    """The annotation ``tuple[Tensor, ...]`` of ``n`` tensors (a schema's return type)."""
    return tuple.__class_getitem__(tuple(torch.Tensor for _ in range(n)))


def _returns(record: type) -> Any:
    """The schema's return annotation of an output record: one tensor, or a tuple of them."""
    fields = _record_fields(record)
    if len(fields) == 1:
        return torch.Tensor
    return _tensor_tuple(len(fields))


@dataclasses.dataclass(frozen=True, eq=False)
class RecordOp:
    """An op defined by :func:`define` over typed records: ``OP(args, impl)`` runs it.

    ``args``: the op's operand record (a ``typing.NamedTuple``: every implementation, the
    reference and the callers read its fields by name); ``impl``: the name of the
    implementation to run (:func:`ragged.backends.select_spec` picks it). The result is an
    instance of the op's ``output`` record. ``OP.call_backward(args, inputs, impl)``: the
    backward implementation, given the forward's operands (None where the backward reads
    none: ``backward_unread``) and the op's ``backward_inputs`` record (the incoming gradients
    and what the forward saved); it returns the op's ``grads`` record, one field per
    differentiable operand, named after it."""

    name: str
    impls: dict  # implementation name -> Implementation (the registry's own dict)
    args: Any  # the operand record (a NamedTuple class)
    output: Any  # the output record
    backward_inputs: Any  # the backward's own inputs (incoming gradients, saved outputs), or None
    grads: Any  # the gradient record (fields named after operands), or None
    forward_op: Any  # torch.library CustomOpDef of ragged::<name>
    backward_op: Any | None  # ragged::<name>_backward, when declared
    function: Any  # the eager autograd.Function
    tensor_fields: tuple[int, ...]  # the fields of ``args`` that may hold a tensor
    backward_tensor_fields: tuple[int, ...]
    optional_grads: tuple[bool, ...]  # per field of ``grads``: may be None (travels as an empty tensor)
    backward_fields: tuple[int, ...] | None  # the fields of ``args`` the backward op takes (None: all)

    def __call__(self, args, impl: str, *, context: Any = None):
        """The forward's output record (see the module docstring for the three paths).

        ``context``: host-side facts that spare the backward a device read in eager calls
        (host offsets, say), stored as ``ctx.context`` for the autograd rule; traced calls
        have ``ctx.context = None``."""
        if _is_compiling():
            return self._traced(args, impl)
        grad = False
        for i in self.tensor_fields:
            t = args[i]
            if t is not None:
                kind = type(t)
                if kind is not _Tensor and kind is not _Parameter:
                    return self._traced(args, impl)
                grad = grad or t.requires_grad
        if _dispatch_depth():
            return self._traced(args, impl)
        if grad and _grad_enabled():
            out = self.function.apply(impl, context, *args)
            return self.output._make(out) if isinstance(out, tuple) else self.output(out)
        return self.impls[impl].forward_fn(args)

    def _traced(self, args, impl: str):
        out = self.forward_op(*args, impl)
        return self.output._make(out) if isinstance(out, tuple) else self.output(out)

    def call_backward(self, args, inputs, impl: str, **buffers):
        """The gradient record of the backward implementation ``impl`` (or of the
        ``ragged::<name>_backward`` op while tracing). ``buffers``: preallocated outputs an
        eager caller hands the implementation (``grads=`` of attention, say); traced calls
        ignore them."""
        tensors = [t for t in (*args, *inputs) if isinstance(t, torch.Tensor)]
        if self.backward_op is None or eager(*tensors):
            return self.impls[impl].backward_fn(args, inputs, **buffers)
        kept = self.backward_fields
        out = self.backward_op(*(args if kept is None else (args[i] for i in kept)), *inputs, impl)
        out = out if isinstance(out, tuple) else (out,)
        return self.grads._make(
            None if optional and t.numel() == 0 else t for t, optional in zip(out, self.optional_grads)
        )


def define(
    name: str,
    args: type,
    output: type,
    *,
    fake: Callable,
    setup: Callable,
    backward: Callable,
    spec: Callable,
    backward_inputs: type | None = None,
    grads: type | None = None,
    backward_fake: Callable | None = None,
    backward_unread: Sequence[str] = (),
    non_differentiable: Callable[[Any, Any], Sequence[torch.Tensor]] | None = None,
    schema_types: Mapping[str, Any] | None = None,
) -> RecordOp:
    """Define op ``name`` over typed records and register it with :mod:`ragged.backends`.

    ``args``: the operand record, a ``typing.NamedTuple`` whose annotations give the
    ``torch.library`` schema (``schema_types`` overrides a field's schema type, e.g. a seed
    that eager calls may also pass as a device tensor); ``output``: the output record.
    ``fake(args) -> output``: shapes and dtypes only, for torch.compile. ``setup(ctx, args,
    output)``: what the backward keeps (``ctx.impl`` holds the implementation's name);
    ``backward(ctx, *output_grads) -> grads``: the one autograd rule, a ``grads`` record whose
    fields are named after the operands they are the gradient of (the other operands get
    None; a None record: no operand gets one). The rule finds ``ctx.needs_grad``, an ``args``
    record of bools: whether each operand's gradient is wanted.

    ``backward_inputs``: the record the backward implementation takes besides ``args``; with
    ``backward_fake(args, inputs) -> grads`` the op ``ragged::<name>_backward`` is defined, so
    that a traced backward is one node too (a ``Tensor | None`` gradient travels through it
    as an empty tensor). ``backward_unread``: operands no backward implementation reads (a
    tensor of which the backward needs nothing, or only a size its inputs carry): the
    backward op does not take them, and the autograd rule need not keep them (it passes
    None in their place). ``non_differentiable(args, output)``: the outputs autograd must
    treat as constants. ``spec``: the op's spec function (see :mod:`ragged.backends`)."""
    fields = _record_fields(args)
    names = [n for n, _ in fields]
    overrides = dict(schema_types or {})
    params = [(n, overrides.get(n, h)) for n, h in fields]
    tensor_fields = tuple(i for i, (_, h) in enumerate(fields) if _is_tensor(h))
    n_args = len(fields)
    make_args = args._make  # type: ignore[attr-defined]
    unknown = [n for n in (*backward_unread, *overrides) if n not in names]
    if unknown:
        raise ValueError(f"ragged.opdef.define({name!r}): {unknown} name no operand of {args.__name__}")

    backends.declare_op(name, spec)
    impls = backends.implementations(name)  # filled as implementations are registered

    def run_forward(*flat):
        return tuple(impls[flat[-1]].forward_fn(make_args(flat[:-1])))

    def schema_of(params, returns):
        schema = torch.library.infer_schema(_stub(name, params, returns), mutates_args=())
        head, arrow, tail = schema.rpartition(") ->")
        joiner = ", " if not head.endswith("(") else ""
        return f"{head}{joiner}str impl{arrow}{tail}"

    single = len(output._fields) == 1  # type: ignore[attr-defined]
    make_output = output._make  # type: ignore[attr-defined]

    def run_forward_op(*flat):
        out = run_forward(*flat)
        return out[0] if single else out

    forward_op = torch.library.custom_op(
        f"ragged::{name}", run_forward_op, mutates_args=(), schema=schema_of(params, _returns(output))
    )

    def traced_fake(*flat):
        out = tuple(fake(make_args(flat[:-1])))
        return out[0] if single else out

    forward_op.register_fake(traced_fake)

    grad_index: tuple[int, ...] = ()
    optional_grads: tuple[bool, ...] = ()
    if grads is not None:
        grad_fields = _record_fields(grads)
        unknown = [g for g, _ in grad_fields if g not in names]
        if unknown:
            raise ValueError(f"ragged.opdef.define({name!r}): gradient fields {unknown} name no operand")
        grad_index = tuple(names.index(g) for g, _ in grad_fields)
        optional_grads = tuple(_is_optional(h) for _, h in grad_fields)

    def operand_grads(result) -> list:
        out: list = [None] * n_args
        if result is not None:  # None: no operand gets a gradient
            for i, g in zip(grad_index, result):
                out[i] = g
        return out

    def rule(ctx, *output_grads):
        ctx.needs_grad = make_args(ctx.needs_input_grad[:n_args])
        return (*operand_grads(backward(ctx, *output_grads)), None)

    def traced_setup(ctx, inputs, output):
        ctx.context = None
        ctx.impl = inputs[-1]
        out = output if isinstance(output, tuple) else (output,)
        setup(ctx, make_args(inputs[:-1]), make_output(out))

    forward_op.register_autograd(rule, setup_context=traced_setup)

    backward_op = None
    backward_tensor_fields: tuple[int, ...] = ()
    kept = tuple(i for i, n in enumerate(names) if n not in backward_unread)
    if backward_inputs is not None and backward_fake is not None and grads is not None:
        in_fields = _record_fields(backward_inputs)
        make_inputs = backward_inputs._make  # type: ignore[attr-defined]
        backward_tensor_fields = tuple(i for i, (_, h) in enumerate(in_fields) if _is_tensor(h))
        n_kept = len(kept)

        def split(flat):
            """The operand and input records of the backward op's operands (None for an unread operand)."""
            full: list = [None] * n_args
            for i, value in zip(kept, flat):
                full[i] = value
            a, i = make_args(full), make_inputs(flat[n_kept:-1])
            like = next(t for t in (*a, *i) if isinstance(t, torch.Tensor))
            return a, i, like

        def run_backward(*flat):
            a, i, like = split(flat)
            out = impls[flat[-1]].backward_fn(a, i)
            return tuple(like.new_empty(0) if t is None else t for t in out)

        def traced_backward_fake(*flat):
            a, i, like = split(flat)
            return tuple(like.new_empty(0) if t is None else t for t in backward_fake(a, i))

        backward_op = torch.library.custom_op(
            f"ragged::{name}_backward",
            run_backward,
            mutates_args=(),
            schema=schema_of([*(params[i] for i in kept), *in_fields], _tensor_tuple(len(grad_index))),
        )
        backward_op.register_fake(traced_backward_fake)

    def eager_forward(ctx, impl, context, *flat):
        ctx.context = context
        ctx.impl = impl
        a = make_args(flat)
        out = impls[impl].forward_fn(a)
        setup(ctx, a, out)
        if non_differentiable is not None:
            constants = non_differentiable(a, out)
            if constants:
                ctx.mark_non_differentiable(*constants)
        return out[0] if single else tuple(out)

    def eager_backward(ctx, *output_grads):
        ctx.needs_grad = make_args(ctx.needs_input_grad[2:])
        return (None, None, *operand_grads(backward(ctx, *output_grads)))

    function = type(
        f"{name.title().replace('_', '')}Function",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(eager_forward),
            "backward": staticmethod(eager_backward),
            "__doc__": f"The eager path of ragged::{name}: its autograd rule without the dispatcher.",
            "__module__": __name__,
        },
    )
    return RecordOp(
        name,
        impls,
        args,
        output,
        backward_inputs,
        grads,
        forward_op,
        backward_op,
        function,
        tensor_fields,
        backward_tensor_fields,
        optional_grads,
        None if len(kept) == n_args else kept,
    )
