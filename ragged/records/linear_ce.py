"""The records of ``ragged::linear_cross_entropy`` (see :mod:`ragged.ops.linear_ce` for the semantics)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class LinearCrossEntropyArgs(NamedTuple):
    """The operands of one call: ``hidden [T, d]`` (unit stride along the features),
    ``weight [V, d]`` (an ``nn.Linear``'s layout, the same dtype), ``bias [V]`` or None,
    ``target [T]`` (int64 ids in ``[0, V)``, or ``ignore_index``), ``ignore_index``,
    ``softcap`` (``cap * tanh(logit / cap)`` before the softmax; 0: none) and ``chunk``, the
    vocabulary rows of one slice of the logits (0: chosen from ``T``)."""

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None
    target: Tensor
    ignore_index: int
    softcap: float
    chunk: int


class LinearCrossEntropyOutput(NamedTuple):
    """``loss [T]`` (0 at ignored tokens) and ``lse [T]`` (the log-sum-exp of each token's
    logits), both in the compute dtype (float32; float64 for float64 operands)."""

    loss: Tensor
    lse: Tensor


class LinearCrossEntropyBackwardInputs(NamedTuple):
    """The gradient of ``loss`` (``[T]``, any stride: a broadcast scalar of a mean or a sum),
    the forward's ``lse`` and which gradients are wanted."""

    grad_loss: Tensor
    lse: Tensor
    need_hidden: bool
    need_weight: bool
    need_bias: bool


class LinearCrossEntropyGrads(NamedTuple):
    """The gradients of ``hidden``, ``weight`` and ``bias``, each in its operand's dtype, None
    where not wanted."""

    hidden: Tensor | None
    weight: Tensor | None
    bias: Tensor | None
