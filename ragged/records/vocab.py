"""The records of ``ragged::vocab_projection`` and ``ragged::vocab_cross_entropy`` (see
:mod:`ragged.ops.vocab` for the layout of the flat logits)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class VocabProjectionArgs(NamedTuple):
    """The operands of one projection: ``hidden [T, d]`` and its offsets ``h_off [B+1]``,
    ``weight [V, d]``, ``bias [V]`` or None, the candidate ``ids`` with their offsets ``v_off
    [B+1]`` (None: one vocabulary shared by the batch), ``l_off`` (int64 ``[B+1]``, the first
    logit of each sequence), and host ints: ``total`` logits, the longest sequence ``max_t``
    and the most candidates ``max_v``."""

    hidden: Tensor
    h_off: Tensor
    weight: Tensor
    bias: Tensor | None
    ids: Tensor
    v_off: Tensor | None
    l_off: Tensor
    total: int
    max_t: int
    max_v: int


class VocabProjectionOutput(NamedTuple):
    """The flat logits ``[total]`` in hidden's dtype."""

    logits: Tensor


class VocabProjectionBackwardInputs(NamedTuple):
    """What the backward reads besides the operands: the gradient of the logits (contiguous),
    which gradients are wanted, and ``deterministic`` (the weight gradient summed in a fixed
    order rather than by atomic adds)."""

    grad_logits: Tensor
    need_hidden: bool = True
    need_weight: bool = True
    need_bias: bool = True
    deterministic: bool = False


class VocabGrads(NamedTuple):
    """The gradients of both vocab ops, each in its operand's dtype, None where not wanted."""

    hidden: Tensor | None
    weight: Tensor | None
    bias: Tensor | None


class VocabCrossEntropyArgs(NamedTuple):
    """The operands of one cross-entropy: those of :class:`VocabProjectionArgs`, then
    ``target [T]`` (global ids), ``ignore_index`` and ``label_smoothing``."""

    hidden: Tensor
    h_off: Tensor
    weight: Tensor
    bias: Tensor | None
    ids: Tensor
    v_off: Tensor | None
    l_off: Tensor
    total: int
    max_t: int
    max_v: int
    target: Tensor
    ignore_index: int
    label_smoothing: float


class VocabCrossEntropyOutput(NamedTuple):
    """Per token ``loss [T]`` and ``lse [T]`` in the compute dtype, ``local [T]`` int32 (each
    target's index among its sequence's candidates, -1 for ``ignore_index`` or a target outside
    them), and ``missing``, int64 ``[]``: the tokens whose target is neither. All but ``loss``
    are constants of the autograd graph."""

    loss: Tensor
    lse: Tensor
    local: Tensor
    missing: Tensor


class VocabCrossEntropyBackwardInputs(NamedTuple):
    """What the backward reads besides the operands (of which it reads no ``target``: the
    forward's ``local`` has located it): the gradient of ``loss`` (``[T]``, maybe a broadcast
    scalar), the forward's ``local`` and ``lse``, its flat ``logits`` where its implementation
    kept them (None: recomputed), which gradients are wanted, ``deterministic`` as in
    :class:`VocabProjectionBackwardInputs`, and the host offsets when the call knew them
    (``host_v_off`` None for a shared vocabulary), which let the backward take the batch in
    chunks without a device read."""

    grad_loss: Tensor
    local: Tensor
    lse: Tensor
    logits: Tensor | None = None
    need_hidden: bool = True
    need_weight: bool = True
    need_bias: bool = True
    deterministic: bool = False
    host_h_off: list[int] | None = None
    host_v_off: list[int] | None = None
