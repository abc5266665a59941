"""Projection onto per-sequence candidate vocabularies (varying-vocabulary output layer).

Each sequence ``b`` of a batch scores its tokens only against its own candidate ids
(vocabulary selection, per-request allowed tokens, short-lists): with ``hidden [T, d]``,
``weight [V, d]`` (``nn.Linear`` / tied-embedding layout) and ``bias [V]``, sequence ``b``
gets the ``[T_b, V_b]`` block ``hidden_b @ weight[ids_b].T + bias[ids_b]`` and nothing
else is computed. The blocks are stored flat, row-major per sequence (the layout of
:mod:`ragged.logits`)::

    l_off[b] = sum_{j<b} T_j * V_j        (int64 [B+1] on the device)
    logits[l_off[b] + t * V_b + c]      = token t of sequence b against candidate c

``vocab`` is a :class:`RaggedTensor` of int32/int64 ids (sequence ``b``'s sorted, unique
candidates, offsets ``v_off``) or a 1-D id tensor shared by the whole batch (then every
``V_b = S`` and ``v_off`` is None).

Two ops carry the work (defined through :mod:`ragged.opdef`, each with its backward op):
``ragged::vocab_projection`` (the flat logits) and ``ragged::vocab_cross_entropy`` (per-token
losses for global target ids, the targets located among the candidates by the op). Every
implementation of an op takes the same records (:mod:`ragged.records.vocab`: the operands, and
for a backward its inputs) and returns the op's output or gradient record:

* ``"torch"`` (:mod:`ragged.ops.vocab_reference`): one gather of the candidate rows of
  ``weight`` and one GEMM per sequence, float32 accumulation, the cross-entropy a segmented
  log-softmax over those logits; the CPU path and the tests' oracle;
* ``"triton"`` (:mod:`ragged.kernels.triton.vocab`, declared in :mod:`ragged.kernels.triton`):
  a segmented GEMM reading the weight rows through the id lists; its cross-entropy is
  fused (:mod:`ragged.kernels.triton.vocab_cross_entropy`: no logits stored).

``"auto"`` takes Triton on CUDA tensors.

Host syncs: none on the hot path when the RaggedTensors carry host offsets (built from
host lengths or lists) or the vocabulary is shared; otherwise the offsets are read once
(and cached on the RaggedTensors) to size the output. ``vocab_cross_entropy`` with
``out_of_vocab="error"`` (the default) reads one flag to raise on a target that is not
among its sequence's candidates.

Candidate ids. ``validate=True`` checks them (sorted, unique per sequence, in ``[0, V)``)
with one read. Without it they are checked only where that costs no wait for the device:
ids on the host (range; for the cross-entropy also order), ids of a call that reads the
device anyway (the offsets' read above, the ``out_of_vocab="error"`` flag, the ``"torch"``
backend, which reads the offsets itself) get the same checks folded into that read. An id
outside ``[0, V)`` then raises ``ValueError`` naming the function and the argument.
Elsewhere (CUDA ids on the hot path) the ids are trusted, and the kernels still never
read outside ``weight`` / ``bias``: a candidate id outside ``[0, V)`` scores 0 (no weight
row, no bias) and passes no gradient on; unsorted ids make the cross-entropy miss targets
that are among them (``out_of_vocab="ignore"`` then ignores those tokens).

Gradients are first order: a backward through the gradient (``create_graph=True`` then
a second backward, ``gradgradcheck``) raises ``NotImplementedError`` naming the function.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .. import backends, opdef
from ..logits import RaggedLogits, compute_dtype
from ..records.vocab import (
    VocabCrossEntropyArgs,
    VocabCrossEntropyBackwardInputs,
    VocabCrossEntropyOutput,
    VocabGrads,
    VocabProjectionArgs,
    VocabProjectionBackwardInputs,
    VocabProjectionOutput,
)
from ..tensor import RaggedTensor
from ..utils import describe, first_order_only
from . import vocab_reference as _reference
from .vocab_checks import (
    CE_ID_CHECKS,
    check_backend_name,
    check_ids_dtype,
    check_ids_now,
    check_target,
    late_id_flags,
    prepare,
    raise_out_of_vocab,
)
from .vocab_reference import reference_vocab_projection, reference_vocab_projection_backward

__all__ = [
    "VOCAB_CROSS_ENTROPY",
    "VOCAB_PROJECTION",
    "VocabSpec",
    "reference_vocab_projection",
    "reference_vocab_projection_backward",
    "union_vocab",
    "vocab_cross_entropy",
    "vocab_projection",
    "vocab_spec",
]

REDUCTIONS = ("mean", "sum", "none")
OUT_OF_VOCAB = ("error", "ignore")


@dataclasses.dataclass(frozen=True)
class VocabSpec:
    """What an implementation of the vocab ops is asked to take: hidden's device and dtype
    (weight and bias share them)."""

    device: torch.device
    dtype: torch.dtype


def vocab_spec(hidden, h_off, weight, bias, ids, v_off) -> VocabSpec:
    """The spec of both vocab ops for ``hidden [T, d], h_off [B+1], weight [V, d], bias [V] or
    None, ids [N], v_off [B+1] or None``."""
    return VocabSpec(hidden.device, hidden.dtype)


# --------------------------------------------------------------------------------------
# First-order gradients only. The backward kernels (and the reference backward, which
# writes into preallocated buffers) are not differentiable: under create_graph=True their
# results pass through _FirstOrderOnly, whose own backward raises with the function's name,
# instead of an unrelated error from deep inside (or a silently missing second-order term).

_PROJECTION_FN = "ragged.vocab_projection()"
_CROSS_ENTROPY_FN = "ragged.vocab_cross_entropy()"


def _gradient_fakes(args, inputs) -> VocabGrads:
    hidden, weight = args.hidden, args.weight
    return VocabGrads(
        hidden.new_empty(hidden.shape) if inputs.need_hidden else None,
        weight.new_empty(weight.shape) if inputs.need_weight else None,
        weight.new_empty(weight.shape[0]) if inputs.need_bias else None,
    )


# --------------------------------------------------------------------------------------
# ragged::vocab_projection: the flat logits [total] in hidden's dtype (VocabProjectionArgs:
# l_off int64 [B+1]; total, max_t, max_v host ints: number of logits, longest sequence, most
# candidates).


def _projection_setup(ctx, args: VocabProjectionArgs, output: VocabProjectionOutput) -> None:
    ctx.save_for_backward(args.hidden, args.h_off, args.weight, args.bias, args.ids, args.v_off, args.l_off)
    ctx.sizes = (args.total, args.max_t, args.max_v)


def _projection_backward(ctx, grad: Tensor) -> VocabGrads:
    hidden, h_off, weight, bias, ids, v_off, l_off = ctx.saved_tensors
    total, max_t, max_v = ctx.sizes
    need = ctx.needs_grad
    args = VocabProjectionArgs(hidden, h_off, weight, bias, ids, v_off, l_off, total, max_t, max_v)
    inputs = VocabProjectionBackwardInputs(
        grad.contiguous(),
        need_hidden=need.hidden,
        need_weight=need.weight,
        need_bias=need.bias,
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )
    with torch.no_grad():
        grads = VOCAB_PROJECTION.call_backward(args, inputs, ctx.impl)
    return VocabGrads._make(first_order_only(_PROJECTION_FN, grads, grad, hidden, weight))


VOCAB_PROJECTION = opdef.define(
    "vocab_projection",
    VocabProjectionArgs,
    VocabProjectionOutput,
    spec=vocab_spec,
    setup=_projection_setup,
    backward=_projection_backward,
    fake=lambda args: VocabProjectionOutput(args.hidden.new_empty((args.total,))),
    backward_inputs=VocabProjectionBackwardInputs,
    grads=VocabGrads,
    backward_fake=_gradient_fakes,
)
# ragged::vocab_cross_entropy: per-token losses for global target ids [T] (VocabCrossEntropyOutput:
# loss and lse in the compute dtype, each target's local index, the count of missing ones).
# The backward takes the host offsets when the call knew them (eager), so that it can take
# the batch in chunks without a device read, and the flat logits when the forward's
# implementation kept them (an eager call whose forward outputs carry them as .logits, as
# the torch reference's do): None has them recomputed. It reads no target (local stands for it).


def _ce_fake(args: VocabCrossEntropyArgs) -> VocabCrossEntropyOutput:
    hidden = args.hidden
    tokens, dtype = hidden.shape[0], compute_dtype(hidden.dtype)
    return VocabCrossEntropyOutput(
        hidden.new_empty((tokens,), dtype=dtype),
        hidden.new_empty((tokens,), dtype=dtype),
        hidden.new_empty((tokens,), dtype=torch.int32),
        hidden.new_empty((), dtype=torch.int64),
    )


def _ce_setup(ctx, args: VocabCrossEntropyArgs, output: VocabCrossEntropyOutput) -> None:
    ctx.save_for_backward(
        args.hidden, args.h_off, args.weight, args.bias, args.ids, args.v_off, args.l_off, output.local, output.lse
    )
    ctx.sizes = (args.total, args.max_t, args.max_v, args.ignore_index, args.label_smoothing)
    ctx.logits = getattr(output, "logits", None)


def _ce_backward(ctx, grad: Tensor, *_) -> VocabGrads:
    hidden, h_off, weight, bias, ids, v_off, l_off, local, lse = ctx.saved_tensors
    total, max_t, max_v, ignore_index, smoothing = ctx.sizes
    host_h, host_v = ctx.context or (None, None)
    need = ctx.needs_grad
    # no target: the backward reads the forward's local targets instead
    args = VocabCrossEntropyArgs(
        hidden,
        h_off,
        weight,
        bias,
        ids,
        v_off,
        l_off,
        total,
        max_t,
        max_v,
        target=None,  # type: ignore[arg-type]
        ignore_index=ignore_index,
        label_smoothing=smoothing,
    )
    # the loss gradient may be a broadcast scalar (mean, sum): implementations read it with its stride
    inputs = VocabCrossEntropyBackwardInputs(
        grad,
        local,
        lse,
        ctx.logits,
        need_hidden=need.hidden,
        need_weight=need.weight,
        need_bias=bias is not None and need.bias,
        deterministic=torch.are_deterministic_algorithms_enabled(),
        host_h_off=host_h,
        host_v_off=host_v,
    )
    with torch.no_grad():
        grads = VOCAB_CROSS_ENTROPY.call_backward(args, inputs, ctx.impl)
    return VocabGrads._make(first_order_only(_CROSS_ENTROPY_FN, grads, grad, hidden, weight, bias))


VOCAB_CROSS_ENTROPY = opdef.define(
    "vocab_cross_entropy",
    VocabCrossEntropyArgs,
    VocabCrossEntropyOutput,
    spec=vocab_spec,
    setup=_ce_setup,
    backward=_ce_backward,
    fake=_ce_fake,
    backward_inputs=VocabCrossEntropyBackwardInputs,
    grads=VocabGrads,
    backward_fake=_gradient_fakes,
    backward_unread=("target",),
    non_differentiable=lambda args, output: (output.lse, output.local, output.missing),
)

# The torch implementations (ragged.ops.vocab_reference) read the offsets on the host
# anyway: the ids' checks run before them ("check_ids"), at no extra wait.
backends.register(
    backends.Implementation(
        "vocab_projection",
        "torch",
        _reference.projection_forward,
        _reference.projection_backward,
        extras={"check_ids": check_ids_now},
    ),
    backends.Implementation(
        "vocab_cross_entropy",
        "torch",
        _reference.cross_entropy_forward,
        _reference.cross_entropy_backward,
        extras={"check_ids": check_ids_now},
    ),
)


# --------------------------------------------------------------------------------------
# Public API


def vocab_projection(
    hidden: RaggedTensor,
    weight: torch.Tensor,
    vocab,
    bias: torch.Tensor | None = None,
    *,
    validate: bool = False,
    backend: str | None = None,
) -> RaggedLogits:
    """Logits of every token against its own sequence's candidate ids only.

    * ``hidden``: RaggedTensor, ``values [T, d]`` (float16, bfloat16, float32, float64);
    * ``weight``: ``[V, d]`` (``nn.Linear`` / tied-embedding layout), hidden's dtype;
    * ``vocab``: RaggedTensor of int32/int64 ids, sequence ``b``'s sorted unique candidates
      (batch size of hidden), or a 1-D id tensor shared by the whole batch;
    * ``bias``: ``[V]`` or None.

    Returns a :class:`ragged.RaggedLogits` (flat ``values [sum_b T_b * V_b]`` in hidden's
    dtype, accumulated in float32; ``to_padded``, ``to_full``, ``argmax``, ``topk``,
    ``log_softmax``). Differentiable in hidden, weight and bias; rows of ``weight`` that
    no sequence lists get a zero gradient.

    ``validate=True`` checks the ids (sorted and unique within each sequence, in
    ``[0, V)``) at the cost of one device read. Without it an id outside ``[0, V)`` still
    raises ``ValueError`` where the ids are read at no cost (host ids, a call that reads the
    offsets or runs the ``"torch"`` backend); CUDA ids on the hot path are trusted, and
    an id outside ``[0, V)`` scores 0 there (no weight row or bias is read for it; see
    the module docstring). Any tensor argument may be a strided view.
    """
    fn = "ragged.vocab_projection"
    check_backend_name(fn, backend)
    layout = prepare(fn, hidden, weight, vocab, bias, validate)
    h, h_off, ids, v_off = layout.hidden, layout.h_off, layout.ids, layout.v_off
    impl = backends.select("vocab_projection", backend, h.device, h, h_off, weight, layout.bias, ids, v_off, fn=fn)
    if not layout.ids_checked:
        check_ids = impl.extra("check_ids")
        if check_ids is not None:
            check_ids(fn, layout, checks=("range",))
    args = VocabProjectionArgs(
        h, h_off, weight, layout.bias, ids, v_off, layout.l_off, layout.total, layout.max_t, layout.max_v
    )
    values = VOCAB_PROJECTION(args, impl.name).logits
    return RaggedLogits(
        values,
        h_off,
        h.shape[0],
        layout.max_t,
        ids,
        v_off,
        layout.max_v,
        layout.l_off,
        weight.shape[0],
        layout.host_h,
        layout.host_v,
    )


def vocab_cross_entropy(
    hidden: RaggedTensor,
    weight: torch.Tensor,
    vocab,
    target,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    out_of_vocab: str = "error",
    validate: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """Cross-entropy of each token's target over its own sequence's candidates.

    Arguments as :func:`vocab_projection`, plus ``target``: ``[T]`` int64/int32 *global*
    vocabulary ids (a tensor, or a RaggedTensor with hidden's tokens). It equals
    ``F.cross_entropy`` on each sequence's ``[T_b, V_b]`` logits with the target mapped to
    its position in the sequence's candidates, with the same ``ignore_index``,
    ``reduction`` (``"mean"`` over the tokens not ignored, ``"sum"``, ``"none"`` ->
    ``[T]`` with 0 at ignored tokens) and ``label_smoothing`` (spread over the token's
    candidates). Returned in hidden's dtype (computed in float32).

    ``out_of_vocab``: what a target outside its sequence's candidates means.
    ``"error"`` (default) raises ``ValueError`` naming the first such token, which costs one
    device read (under ``torch.compile`` a device-side assert instead, raising
    ``RuntimeError``); ``"ignore"`` treats such tokens like ``ignore_index`` (no read).

    Targets are located with a binary search, so each sequence's ids must be sorted.
    ``validate=True`` checks them; so does every call on host ids, and the read of
    ``out_of_vocab="error"`` (the same copy, no extra sync): unsorted ids raise
    ``ValueError`` there rather than a report of targets outside their candidates. With
    ``out_of_vocab="ignore"`` on CUDA ids and no read (the hot path), unsorted ids are
    trusted: targets the search misses count as ignored, and if that is every token the
    ``"mean"`` is NaN (as ``F.cross_entropy`` with every target ignored) -- pass
    ``validate=True`` once to check the ids.
    """
    fn = "ragged.vocab_cross_entropy"
    check_backend_name(fn, backend)
    layout = prepare(fn, hidden, weight, vocab, bias, validate, sorted_ids=True)
    h, h_off, ids, v_off = layout.hidden, layout.h_off, layout.ids, layout.v_off
    tokens = h.shape[0]
    target = check_target(fn, target, tokens, h.device)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{fn}(): expected ignore_index to be an int, got {describe(ignore_index)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{fn}(): expected reduction to be one of {REDUCTIONS}, got {reduction!r}")
    if (
        isinstance(label_smoothing, bool)
        or not isinstance(label_smoothing, (int, float))
        or not 0.0 <= label_smoothing <= 1.0
    ):
        raise ValueError(f"{fn}(): expected label_smoothing in [0, 1], got {describe(label_smoothing)}")
    if out_of_vocab not in OUT_OF_VOCAB:
        raise ValueError(f"{fn}(): expected out_of_vocab to be one of {OUT_OF_VOCAB}, got {out_of_vocab!r}")
    impl = backends.select("vocab_cross_entropy", backend, h.device, h, h_off, weight, layout.bias, ids, v_off, fn=fn)
    # ids not checked yet (CUDA ids): checked before an implementation that asks for it, else
    # folded into the read of out_of_vocab="error"
    fold = out_of_vocab == "error" and tokens > 0
    id_flags = None
    if not layout.ids_checked:
        check_ids = impl.extra("check_ids")
        if check_ids is not None:
            check_ids(fn, layout, checks=CE_ID_CHECKS)
        elif fold:
            id_flags = late_id_flags(layout, CE_ID_CHECKS)
    args = VocabCrossEntropyArgs(
        h,
        h_off,
        weight,
        layout.bias,
        ids,
        v_off,
        layout.l_off,
        layout.total,
        layout.max_t,
        layout.max_v,
        target,
        ignore_index,
        float(label_smoothing),
    )
    out = VOCAB_CROSS_ENTROPY(args, impl.name, context=(layout.host_h, layout.host_v))
    losses, local, missing = out.loss, out.local, out.missing
    if fold:
        raise_out_of_vocab(fn, missing, local, target, ignore_index, layout, id_flags)
    dtype = h.dtype
    if reduction == "none":
        return losses.to(dtype)
    if reduction == "sum":
        return losses.sum().to(dtype)
    return (losses.sum() / (local >= 0).sum()).to(dtype)


def union_vocab(vocab) -> torch.Tensor:
    """One sorted 1-D tensor of every id any sequence lists (their union).

    ``vocab``: a RaggedTensor of ids, a 1-D id tensor, or a list of 1-D id tensors.
    Projecting onto the union as a shared vocabulary (every token scored against the
    batch's candidates, as Marian's vocabulary short-lists do) trades some extra logits
    for one dense GEMM. ``torch.unique`` sizes its output on the host: one sync on CUDA.
    """
    fn = "ragged.union_vocab"
    if isinstance(vocab, RaggedTensor):
        ids, name = vocab.values, "vocab.values"
    elif isinstance(vocab, torch.Tensor):
        ids, name = vocab, "vocab"
    elif isinstance(vocab, (list, tuple)) and vocab and all(isinstance(t, torch.Tensor) for t in vocab):
        for i, t in enumerate(vocab):
            if t.dim() != 1:
                raise ValueError(f"{fn}(): expected 1-D id tensors, got shape {tuple(t.shape)} at index {i}")
            check_ids_dtype(fn, f"vocab[{i}]", t)
        ids, name = torch.cat([t.to(torch.int64) for t in vocab]), "vocab"
    else:
        raise TypeError(
            f"{fn}(): expected vocab to be a RaggedTensor of ids, a 1-D id tensor or a list of them, "
            f"got {describe(vocab)}"
        )
    if ids.dim() != 1:
        raise ValueError(f"{fn}(): expected {name} to be 1-D, got shape {tuple(ids.shape)}")
    check_ids_dtype(fn, name, ids)
    return torch.unique(ids, sorted=True)
