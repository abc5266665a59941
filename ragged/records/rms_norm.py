"""The records of ``ragged::add_rms_norm`` (see :mod:`ragged.ops.rms_norm` for the semantics)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class AddRmsNormArgs(NamedTuple):
    """The operands of one call: ``x [N, F]`` and ``residual`` (x's shape and dtype, or None),
    both with unit stride along the features; ``weight [F]`` (x's dtype) or None; ``eps``;
    ``unit_offset``: Gemma's ``(1 + weight)`` in float32 (else Llama's: the normalised row cast
    to x's dtype, then times the weight)."""

    x: Tensor
    residual: Tensor | None
    weight: Tensor | None
    eps: float
    unit_offset: bool


class AddRmsNormOutput(NamedTuple):
    """``out [N, F]``, ``sum``: ``x + residual`` in x's dtype (``x`` itself without a residual),
    and ``rstd [N]``, each row's ``1 / sqrt(mean(sum^2) + eps)`` in float32 (float64 for
    float64), a constant of the autograd graph."""

    out: Tensor
    sum: Tensor
    rstd: Tensor


class AddRmsNormBackwardInputs(NamedTuple):
    """The gradients of ``out`` and of ``sum`` (None: the sum was not used), ``[N, F]`` with unit
    stride along the features; the forward's ``sum`` and ``rstd``; whether the weight's
    gradient is wanted."""

    grad_out: Tensor
    grad_sum: Tensor | None
    sum: Tensor
    rstd: Tensor
    need_weight: bool


class AddRmsNormGrads(NamedTuple):
    """``x``: the gradient of the sum, which both summands get (the implementations compute it
    once, as ``x``, and leave ``residual`` None; the autograd rule hands it to both);
    ``weight``: None where absent or not wanted."""

    x: Tensor
    residual: Tensor | None
    weight: Tensor | None
