"""The records of ``ragged::rotary_embedding`` (see :mod:`ragged.ops.rotary` for the convention)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class RotaryEmbeddingArgs(NamedTuple):
    """The operands of one call: ``x [T, N, D]`` (any strides), ``positions [T]`` int32/int64,
    ``inv_freq [D/2]`` (read as float32) and ``scaling``, the factor of cos and sin."""

    x: Tensor
    positions: Tensor
    inv_freq: Tensor
    scaling: float


class RotaryEmbeddingOutput(NamedTuple):
    """``out [T, N, D]``, contiguous, in x's dtype."""

    out: Tensor


class RotaryEmbeddingBackwardInputs(NamedTuple):
    """The gradient of ``out`` (``[T, N, D]``, any strides): the backward rotates it by the
    opposite angle and reads nothing of ``x``, which the autograd rule does not keep."""

    grad_out: Tensor


class RotaryEmbeddingGrads(NamedTuple):
    """The gradient of ``x`` (``[T, N, D]``, contiguous, the gradient's dtype); ``positions`` and
    ``inv_freq`` get none."""

    x: Tensor
