"""The records of ``ragged::gated_act`` (see :mod:`ragged.ops.gated` for the semantics)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class GatedActArgs(NamedTuple):
    """The operands of one call: ``x [N, 2F]`` (the input half, then the gate half of each row;
    unit stride along the columns, any row stride) and the ``activation``'s name."""

    x: Tensor
    activation: str


class GatedActOutput(NamedTuple):
    """``out [N, F]``, contiguous, in x's dtype: ``act(x[:, :F]) * x[:, F:]``."""

    out: Tensor


class GatedActBackwardInputs(NamedTuple):
    """The gradient of ``out`` (``[N, F]``, unit stride along the columns)."""

    grad_out: Tensor


class GatedActGrads(NamedTuple):
    """The gradient of ``x`` (``[N, 2F]``, contiguous, x's dtype)."""

    x: Tensor
