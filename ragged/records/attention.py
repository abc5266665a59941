"""The records of ``ragged::attention`` (see :mod:`ragged.ops.attention` for the semantics)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class AttentionArgs(NamedTuple):
    """The operands of one attention call.

    ``q [Tq, H, D]``, ``k`` / ``v [Tk, H_kv, D]`` (``H % H_kv == 0``); ``cu_q`` / ``cu_k [B+1]``
    the offsets of the query and key sequences; ``max_q`` / ``max_k`` the longest of each (host
    ints); ``causal``: bottom-right aligned causal masking; ``scale``: the factor of the scores;
    ``dropout_p``: the probability of dropping an attention probability and ``seed`` its mask's
    seed (a host int, or a one-element int64 device tensor while a CUDA graph is captured:
    :func:`ragged.ops.attention.dropout_seed`); ``window_left`` / ``window_right``: a sliding
    window (``-1``: unbounded); ``bias_table [num_buckets, H]`` / ``bias_buckets
    [max_q + max_k - 1]``: a relative-position bias (None: none)."""

    q: Tensor
    k: Tensor
    v: Tensor
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    causal: bool
    scale: float
    dropout_p: float = 0.0
    seed: int | Tensor = 0
    window_left: int = -1
    window_right: int = -1
    bias_table: Tensor | None = None
    bias_buckets: Tensor | None = None


class AttentionOutput(NamedTuple):
    """``out [Tq, H, D]`` in q's dtype and ``lse [Tq, H]`` float32, the natural-log normaliser of
    each query row (``-inf`` for a query that sees no key; a constant of the autograd graph)."""

    out: Tensor
    lse: Tensor


class AttentionBackwardInputs(NamedTuple):
    """What the backward reads besides the forward's operands: the gradient of ``out`` and the
    forward's ``out`` and ``lse``."""

    grad_out: Tensor
    out: Tensor
    lse: Tensor


class AttentionGrads(NamedTuple):
    """The gradients, each named after its operand: ``bias_table``'s only where a table was given."""

    q: Tensor
    k: Tensor
    v: Tensor
    bias_table: Tensor | None = None
