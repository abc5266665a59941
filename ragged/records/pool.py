"""The records of ``ragged::pool`` (see :mod:`ragged.ops.pool` for the modes and numerics)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class PoolArgs(NamedTuple):
    """The operands of one pool call: ``values [T, F]`` (the features flattened), ``offsets
    [B+1]`` and ``mode`` (``"mean"``, ``"sum"``, ``"max"``, ``"first"`` or ``"last"``)."""

    values: Tensor
    offsets: Tensor
    mode: str


class PoolOutput(NamedTuple):
    """``out [B, F]`` in the values' dtype, and ``argmax``: for ``"max"`` the ``[B, F]`` token
    (row of ``values``) of each maximum (the offsets' dtype, -1 for a length-0 sequence; a
    constant of the autograd graph), an empty tensor for the other modes."""

    out: Tensor
    argmax: Tensor


class PoolBackwardInputs(NamedTuple):
    """What the backward reads besides the offsets and the mode: the gradient of ``out``
    (``[B, F]``, any strides), the forward's ``argmax`` and ``total``, the rows of ``values``
    (the backward reads no other part of ``values``, which the autograd rule does not keep)."""

    grad_out: Tensor
    argmax: Tensor
    total: int


class PoolGrads(NamedTuple):
    """The gradient of ``values`` (``[T, F]``, the gradient's dtype)."""

    values: Tensor
