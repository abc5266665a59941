"""The records of ``ragged::bias_act`` and ``ragged::add_layer_norm`` (see :mod:`ragged.ops.fused`
for the numerics), and of the fused dropout backward the layer core calls."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class BiasActArgs(NamedTuple):
    """The operands of one bias_act call: ``x [N, F]`` (unit stride along the features),
    ``bias [F]`` (unit stride) or None, and the ``activation``'s name."""

    x: Tensor
    bias: Tensor | None
    activation: str


class BiasActOutput(NamedTuple):
    """``out [N, F]``, contiguous, in x's dtype: ``act(x + bias)``."""

    out: Tensor


class BiasActBackwardInputs(NamedTuple):
    """What the backward reads besides the operands: the gradient of ``out`` (``[N, F]``, unit
    stride along the features) and whether the bias's gradient is wanted."""

    grad_out: Tensor
    need_bias: bool = True


class BiasActGrads(NamedTuple):
    """The gradients, each in its operand's dtype: ``bias``'s None unless there is a bias and
    it is wanted."""

    x: Tensor
    bias: Tensor | None = None


class AddLayerNormArgs(NamedTuple):
    """The operands of one add_layer_norm call: ``x [N, F]`` and ``residual`` (x's shape, or
    None) with unit stride along the features, ``weight`` / ``bias [F]`` (unit stride) or
    None, ``eps``, and ``return_sum``: whether ``x + residual`` is written out."""

    x: Tensor
    residual: Tensor | None
    weight: Tensor | None
    bias: Tensor | None
    eps: float
    return_sum: bool = False


class AddLayerNormOutput(NamedTuple):
    """``out``: ``LayerNorm(x + residual)`` ``[N, F]`` and ``sum``: ``x + residual`` (an empty
    ``(0,)`` tensor unless ``return_sum``), both in the dtype of ``x + residual``; ``mean`` /
    ``rstd`` ``[N]``, the row statistics in the compute dtype (constants of the autograd
    graph, as ``sum`` is when it is not returned)."""

    out: Tensor
    sum: Tensor
    mean: Tensor
    rstd: Tensor


class AddLayerNormBackwardInputs(NamedTuple):
    """What the backward reads besides the operands: the gradients of ``out`` and of ``sum``
    (None: the sum was not used; both ``[N, F]`` with unit stride along the features), the
    forward's ``mean`` and ``rstd``, and which parameter gradients are wanted. The backward
    reads only the sum of ``x`` and ``residual``: a caller that kept the sum passes it as
    ``x`` with no residual."""

    grad_out: Tensor
    grad_sum: Tensor | None
    mean: Tensor
    rstd: Tensor
    need_weight: bool = True
    need_bias: bool = True


class AddLayerNormGrads(NamedTuple):
    """The gradients. ``x`` and ``residual`` receive the same gradient, that of their sum: the
    implementations compute it once, in the sum's dtype, as ``x`` (``residual`` left None);
    the autograd rule hands it to each summand in its own dtype. ``weight`` / ``bias``: in the
    parameters' dtypes, None when absent or not wanted."""

    x: Tensor
    residual: Tensor | None = None
    weight: Tensor | None = None
    bias: Tensor | None = None


class AddLayerNormDropoutGrads(NamedTuple):
    """The backward of ``add_layer_norm(dropout(z) + residual, ...)`` (the implementations'
    ``extras["dropout_backward"]``): ``x``, the gradient of both summands (as
    :class:`AddLayerNormGrads`' ``x``); ``z``, taken back through the dropout; ``weight`` /
    ``bias`` as in :class:`AddLayerNormGrads`; ``z_sum``, ``z``'s gradient summed over the
    rows (the gradient of the bias of the Linear that made ``z``), None unless asked for. The
    sums written into a shared partial-sum buffer instead come back as None."""

    x: Tensor
    z: Tensor
    weight: Tensor | None
    bias: Tensor | None
    z_sum: Tensor | None
