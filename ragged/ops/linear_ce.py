"""Linear cross-entropy over a full vocabulary: an LM head and its loss, never the ``[T, V]`` logits.

A causal LM's last step is ``logits = hidden @ weight.T (+ bias)`` for every token, ``[T, V]``
with ``V`` in the hundreds of thousands, then a cross-entropy. Its float32 logits and their
gradient are the largest tensors of a fine-tuning step. :func:`linear_cross_entropy` computes the
same loss and gradients one slice of the vocabulary at a time (:mod:`ragged.kernels.linear_ce`):
the slices' logits come from torch's GEMM in the operands' dtype, as the model's head would
return them, and are then read in float32 (float64 for float64): a soft cap
(``cap * tanh(z / cap)``, Gemma's ``final_logit_softcapping``), an online log-sum-exp, the
target's logit. The backward makes each slice again and turns it into its gradient in place.

For a packed batch of sequences (a RaggedTensor of tokens), :func:`shift_labels` makes the
next-token targets of each sequence on its own, as HuggingFace shifts each padded row: token
``i`` of a sequence predicts token ``i + 1`` of the same sequence, and its last token predicts
nothing (``ignore_index``).

Reductions as HuggingFace's causal-LM loss: ``"mean"`` over the tokens not ignored, ``"sum"``,
``"none"`` (``[T]``, 0 at ignored tokens), and ``num_items_in_batch`` (the sum over the tokens
divided by it: the count of a whole accumulated step, as transformers' ``Trainer`` passes it).

The op ``ragged::linear_cross_entropy`` (:data:`LINEAR_CROSS_ENTROPY`, with its backward op;
operands :class:`~ragged.records.linear_ce.LinearCrossEntropyArgs`) has two implementations:
``"torch"`` (the driver with its steps written in torch ops; any device and floating dtype) and
``"triton"`` (the same driver, each step one Triton kernel; float16, bfloat16 and float32; what
``"auto"`` takes on CUDA). The tests' oracle is :func:`reference_linear_cross_entropy`, the dense
computation. No host sync: a target outside ``[0, V)`` that is not ``ignore_index`` gives a NaN
loss (no slice holds it) rather than a device read.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import backends, opdef
from ..kernels import linear_ce as _driver
from ..records.linear_ce import (
    LinearCrossEntropyArgs,
    LinearCrossEntropyBackwardInputs,
    LinearCrossEntropyGrads,
    LinearCrossEntropyOutput,
)
from ..tensor import RaggedTensor
from ..utils import check_tensor, describe, first_order_only, no_autocast

__all__ = [
    "LINEAR_CROSS_ENTROPY",
    "LinearCrossEntropySpec",
    "linear_cross_entropy",
    "linear_cross_entropy_spec",
    "reference_linear_cross_entropy",
    "shift_labels",
]

REDUCTIONS = ("mean", "sum", "none")
_FN = "ragged.linear_cross_entropy()"


# --------------------------------------------------------------------------------------
# Reference (dense; the tests' oracle)


@no_autocast
def reference_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
) -> Tensor:
    """Per-token losses ``[T]`` (0 at ignored tokens) of the dense computation: the logits
    ``hidden @ weight.T + bias`` in float32 (float64 for float64), soft-capped, then
    ``F.cross_entropy(reduction="none")``. Differentiable through torch autograd."""
    dtype = _driver.compute_dtype(hidden.dtype)
    z = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        z = z + bias.to(dtype)
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    return F.cross_entropy(z, target.long(), ignore_index=ignore_index, reduction="none")


# --------------------------------------------------------------------------------------
# Spec and op


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropySpec:
    """``linear_cross_entropy(hidden [T, d], weight [V, d], ...)`` as the implementations see it."""

    device: torch.device
    dtype: torch.dtype  # hidden's (and weight's)
    tokens: int
    features: int
    vocab: int
    bias: bool
    softcap: bool


def linear_cross_entropy_spec(hidden: Tensor, weight: Tensor, bias: Tensor | None = None, softcap: float = 0.0):
    """The spec of the operands (the arguments of ``ragged.explain("linear_cross_entropy", ...)``)."""
    return LinearCrossEntropySpec(
        hidden.device, hidden.dtype, hidden.shape[0], hidden.shape[1], weight.shape[0], bias is not None, bool(softcap)
    )


def _fake(args: LinearCrossEntropyArgs) -> LinearCrossEntropyOutput:
    h = args.hidden
    dtype = _driver.compute_dtype(h.dtype)
    return LinearCrossEntropyOutput(h.new_empty((h.shape[0],), dtype=dtype), h.new_empty((h.shape[0],), dtype=dtype))


def _backward_fake(args: LinearCrossEntropyArgs, inputs: LinearCrossEntropyBackwardInputs) -> LinearCrossEntropyGrads:
    h, w, b = args.hidden, args.weight, args.bias
    return LinearCrossEntropyGrads(
        h.new_empty(h.shape) if inputs.need_hidden else None,
        w.new_empty(w.shape) if inputs.need_weight else None,
        b.new_empty(b.shape) if b is not None and inputs.need_bias else None,
    )


def _setup(ctx, args: LinearCrossEntropyArgs, output: LinearCrossEntropyOutput) -> None:
    ctx.save_for_backward(args.hidden, args.weight, args.bias, args.target, output.lse)
    ctx.sizes = (args.ignore_index, args.softcap, args.chunk)


def _backward(ctx, grad: Tensor, *_) -> LinearCrossEntropyGrads:
    hidden, weight, bias, target, lse = ctx.saved_tensors
    ignore_index, softcap, chunk = ctx.sizes
    need = ctx.needs_grad
    args = LinearCrossEntropyArgs(hidden, weight, bias, target, ignore_index, softcap, chunk)
    inputs = LinearCrossEntropyBackwardInputs(
        grad, lse, bool(need.hidden), bool(need.weight), bias is not None and bool(need.bias)
    )
    with torch.no_grad():
        grads = LINEAR_CROSS_ENTROPY.call_backward(args, inputs, ctx.impl)
    return LinearCrossEntropyGrads._make(first_order_only(_FN, grads, grad, hidden, weight, bias))


LINEAR_CROSS_ENTROPY = opdef.define(
    "linear_cross_entropy",
    LinearCrossEntropyArgs,
    LinearCrossEntropyOutput,
    spec=linear_cross_entropy_spec,
    setup=_setup,
    backward=_backward,
    fake=_fake,
    backward_inputs=LinearCrossEntropyBackwardInputs,
    grads=LinearCrossEntropyGrads,
    backward_fake=_backward_fake,
    non_differentiable=lambda args, output: (output.lse,),
)

backends.register(
    backends.Implementation(
        "linear_cross_entropy",
        "torch",
        lambda args: _driver.forward(args, _driver.TORCH_STEPS),
        lambda args, inputs: _driver.backward(args, inputs, _driver.TORCH_STEPS),
    )
)


# --------------------------------------------------------------------------------------
# Public functions


def _check_matrix(fn: str, name: str, t: object) -> Tensor:
    t = check_tensor(fn, name, t)
    if t.dim() != 2:
        raise ValueError(
            f"{fn}(): expected {name} of shape [{'T' if name == 'hidden' else 'V'}, d] (2-D), "
            f"got shape {tuple(t.shape)}"
        )
    if not t.dtype.is_floating_point:
        raise TypeError(f"{fn}(): expected {name} of a floating-point dtype, got {t.dtype}")
    return t


def _validate(fn, hidden, weight, target, bias, ignore_index, reduction, softcap, num_items_in_batch, chunk_size):
    h = hidden.values if isinstance(hidden, RaggedTensor) else hidden
    h = _check_matrix(fn, "hidden", h)
    weight = _check_matrix(fn, "weight", weight)
    if weight.shape[1] != h.shape[1]:
        raise ValueError(
            f"{fn}(): expected weight [V, d] with hidden's d = {h.shape[1]}, got shape {tuple(weight.shape)}"
        )
    if weight.dtype != h.dtype or weight.device != h.device:
        raise TypeError(
            f"{fn}(): expected weight of hidden's dtype and device ({h.dtype}, {h.device}), got "
            f"{weight.dtype} on {weight.device}"
        )
    t = target.values if isinstance(target, RaggedTensor) else target
    t = check_tensor(fn, "target", t)
    if t.dtype not in (torch.int64, torch.int32) or t.dim() != 1 or t.shape[0] != h.shape[0]:
        raise ValueError(
            f"{fn}(): expected target to be an int64/int32 tensor [T] with T = {h.shape[0]} (hidden's tokens), "
            f"got {describe(t)}"
        )
    if t.device != h.device:
        raise ValueError(f"{fn}(): expected target on hidden's device {h.device}, got {t.device}")
    if bias is not None:
        bias = check_tensor(fn, "bias", bias)
        if bias.shape != (weight.shape[0],) or bias.dtype != h.dtype or bias.device != h.device:
            raise ValueError(
                f"{fn}(): expected bias [V] = [{weight.shape[0]}] of hidden's dtype and device, got {describe(bias)}"
            )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{fn}(): expected ignore_index to be an int, got {describe(ignore_index)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{fn}(): expected reduction to be one of {REDUCTIONS}, got {describe(reduction)}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"{fn}(): expected softcap to be None or a number > 0, got {describe(softcap)}")
    if num_items_in_batch is not None:
        if reduction == "none":
            raise ValueError(
                f"{fn}(): num_items_in_batch divides a sum: it takes reduction='mean' or 'sum', not 'none'"
            )
        ok = isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() == 1
        ok = ok or (isinstance(num_items_in_batch, (int, float)) and not isinstance(num_items_in_batch, bool))
        if not ok:
            raise TypeError(
                f"{fn}(): expected num_items_in_batch to be None, a number or a one-element tensor, "
                f"got {describe(num_items_in_batch)}"
            )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 0:
        raise ValueError(f"{fn}(): expected chunk_size to be an int >= 0 (0: chosen), got {describe(chunk_size)}")
    if t.dtype != torch.int64:
        t = t.long()
    return h if h.stride(-1) == 1 or h.shape[1] <= 1 else h.contiguous(), weight, t, bias


def linear_cross_entropy(
    hidden: Tensor | RaggedTensor,
    weight: Tensor,
    target: Tensor | RaggedTensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: Tensor | int | float | None = None,
    softcap: float | None = None,
    chunk_size: int = 0,
    backend: str | None = None,
) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, target)`` without the ``[T, V]`` logits.

    ``hidden``: ``[T, d]`` (or a RaggedTensor of them: its values); ``weight``: ``[V, d]``, the LM
    head's (an ``nn.Linear``'s or the tied embedding's), of hidden's dtype and device; ``bias``:
    ``[V]`` or None; ``target``: ``[T]`` int64/int32 vocabulary ids (a RaggedTensor: its values),
    ``ignore_index`` where a token has none (for next-token prediction on a packed batch, see
    :func:`shift_labels`). ``softcap``: logits become ``softcap * tanh(logit / softcap)`` first.
    ``reduction``: ``"mean"`` over the tokens not ignored, ``"sum"``, or ``"none"`` (``[T]``);
    ``num_items_in_batch``: the sum divided by it instead (HuggingFace's causal-LM loss).
    ``chunk_size``: vocabulary rows per slice (0: as many as keep a slice near 32M logits).

    The logits are the GEMM's in hidden's dtype (what the model's head returns), read in
    float32; the loss is float32 (float64 for float64 operands). Differentiable in hidden,
    weight and bias (first order). No host sync; see :mod:`ragged.ops.linear_ce`.
    """
    fn = _FN[:-2]
    h, weight, t, bias = _validate(
        fn, hidden, weight, target, bias, ignore_index, reduction, softcap, num_items_in_batch, chunk_size
    )
    cap = float(softcap) if softcap else 0.0
    impl = backends.select_spec("linear_cross_entropy", backend, linear_cross_entropy_spec(h, weight, bias, cap), fn=fn)
    out = LINEAR_CROSS_ENTROPY(LinearCrossEntropyArgs(h, weight, bias, t, ignore_index, cap, chunk_size), impl.name)
    losses = out.loss
    if reduction == "none":
        return losses
    total = losses.sum()
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    if reduction == "sum":
        return total
    return total / (t != ignore_index).sum()


def shift_labels(labels: RaggedTensor, ignore_index: int = -100) -> Tensor:
    """The next-token targets ``[T]`` of a packed batch of label sequences: token ``i`` of a
    sequence gets label ``i + 1`` of the same sequence, the last token of each sequence
    ``ignore_index`` (as HuggingFace shifts each padded row, without reaching into the next
    sequence). ``labels``: a RaggedTensor of int ids (its values ``[T]``). No host sync."""
    fn = "ragged.shift_labels"
    if not isinstance(labels, RaggedTensor):
        raise TypeError(f"{fn}(): expected labels to be a RaggedTensor of ids, got {describe(labels)}")
    v = labels.values
    if v.dim() != 1 or v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool:
        raise ValueError(f"{fn}(): expected labels with integer values [T], got {describe(v)}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{fn}(): expected ignore_index to be an int, got {describe(ignore_index)}")
    tokens = v.shape[0]
    ends = torch.zeros(tokens + 1, dtype=torch.bool, device=v.device)
    # position j starts a sequence (or is the end, j = T); index_fill_, not ends[idx] = True, which
    # copies the value from host memory (a sync)
    ends.index_fill_(0, labels.offsets.long(), True)
    last = ends[1:]  # token i is its sequence's last when i + 1 starts the next one (or ends)
    nxt = torch.roll(v, -1) if tokens else v
    return nxt.masked_fill(last, ignore_index)
