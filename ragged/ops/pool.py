"""pool: each sequence of a RaggedTensor ``[T, *F]`` reduced to one row of ``[B, *F]``.

The op behind sentence embeddings (``"mean"``), CLS pooling (``"first"``) and decoder
sequence classification (``"last"``). One op carries the work (``ragged::pool``, defined
through :mod:`ragged.opdef`) on the features flattened to ``values [T, F]``, its operands
one :class:`~ragged.records.pool.PoolArgs` record; its backward is a second op
(``ragged::pool_backward``). Implementations, picked by :mod:`ragged.backends`, each a forward
``(PoolArgs) -> PoolOutput`` and a backward ``(PoolArgs, PoolBackwardInputs) -> PoolGrads``:

* ``"torch"``: :func:`reference_pool` / :func:`reference_pool_backward`, segment ops of
  torch; the CPU path and an oracle of the tests (declared here);
* ``"triton"``: :mod:`ragged.kernels.triton.pool` (declared in :mod:`ragged.kernels.triton`),
  float16 / bfloat16 / float32; ``"auto"`` takes it on CUDA tensors.

Modes, for sequence ``b`` of length ``L_b`` with tokens ``x_0 .. x_{L_b - 1}``:

==========  ==========================================  ==================================
mode        row ``b``                                   gradient to the tokens
==========  ==========================================  ==================================
``mean``    ``sum_j x_j / L_b``                         ``grad_b / L_b`` to every token
``sum``     ``sum_j x_j``                               ``grad_b`` to every token
``max``     ``max_j x_j`` per feature                   ``grad_b`` to the first maximal
                                                        token per feature, 0 elsewhere
``first``   ``x_0``                                     ``grad_b`` to ``x_0``, 0 elsewhere
``last``    ``x_{L_b - 1}``                             ``grad_b`` to ``x_{L_b-1}``, 0 else
==========  ==========================================  ==================================

Length-0 sequences give a row of zeros in every mode (what pooling a zero-padded batch
under its mask gives: a masked sum is 0, and 0 is also the fill chosen for max / first /
last) and pass no gradient back.

Precision: the output has the input's dtype. Sums and means accumulate in float32 for
float16 / bfloat16 / float32 inputs and in float64 for float64 (integer sums in int64,
cast back to the input's dtype as torch casts: wrapping). ``max``, ``first`` and ``last``
copy an input element, exactly.

NaN: a NaN in a sequence makes its ``sum`` / ``mean`` NaN, and its ``max`` NaN as
``torch.amax`` does (the gradient goes to the sequence's first NaN token of that feature).
``first`` / ``last`` only see their own token.

Dtypes by mode: ``mean`` takes floating point (float16, bfloat16, float32, float64);
``sum`` also integers (uint8, int8, int16, int32, int64); ``max``, ``first`` and ``last``
also bool. Complex values are not taken. Only floating-point values carry a gradient.

The offsets are the RaggedTensor's contract (``offsets[0] == 0``, non-decreasing,
``offsets[-1] == T``) and are not read on the host: pool never syncs. The Triton kernels
clip every offset to ``[0, T]``, so broken offsets never make them read outside ``values``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .. import backends, opdef
from ..records.pool import PoolArgs, PoolBackwardInputs, PoolGrads, PoolOutput
from ..tensor import RaggedTensor
from ..utils import describe

MODES = ("mean", "sum", "max", "first", "last")

_FLOATS = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
_INTS = frozenset((torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64))
# The value dtypes each mode takes (see the module docstring).
_TAKES = {
    "mean": _FLOATS,
    "sum": _FLOATS | _INTS,
    "max": _FLOATS | _INTS | {torch.bool},
    "first": _FLOATS | _INTS | {torch.bool},
    "last": _FLOATS | _INTS | {torch.bool},
}
_TAKES_TEXT = {
    "mean": "a floating-point dtype (float16, bfloat16, float32, float64)",
    "sum": "a floating-point or integer dtype (not bool or complex)",
    "max": "a real dtype (floating point, integer or bool)",
    "first": "a real dtype (floating point, integer or bool)",
    "last": "a real dtype (floating point, integer or bool)",
}

# --------------------------------------------------------------------------------------
# Reference (pure torch; CPU product path and test oracle)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are accumulated in: float32 for 16-bit floats, float64 for float64,
    int64 for integers."""
    if dtype == torch.float64:
        return torch.float64
    if dtype.is_floating_point:
        return torch.float32
    return torch.int64


def _segments(offsets: Tensor, total: int) -> tuple[Tensor, Tensor, Tensor]:
    """(int64 offsets [B+1], lengths [B], sequence index of every token [T]).

    The index is found by a search of the offsets, so that a row past ``offsets[-1]`` (a spare
    row of a graphed bucket) gets ``B``, one past the last sequence: the callers reduce into
    ``B + 1`` rows and drop the last one, and read gradients from ``B`` rows and a row of zeros."""
    o = offsets.to(torch.int64)
    lengths = o[1:] - o[:-1]
    seg = torch.searchsorted(o[1:], torch.arange(total, device=offsets.device), right=True)
    return o, lengths, seg


def reference_pool(values: Tensor, offsets: Tensor, mode: str) -> tuple[Tensor, Tensor]:
    """``values [T, F]``, ``offsets [B+1]`` -> ``(out [B, F], index)``.

    ``out`` has the dtype of ``values`` (see the module docstring for the modes, the
    accumulation and the zeros of length-0 sequences). ``index`` is what the backward needs:
    for ``"max"``, ``[B, F]`` of the offsets' dtype, the token (row of ``values``) of each
    maximum, the first maximal one (the first NaN where there is one), -1 for length-0
    sequences; for the other modes an empty tensor. Differentiable by torch autograd when
    called directly (the gradient follows the table of the module docstring).
    """
    total, feat = values.shape
    batch = offsets.shape[0] - 1
    empty_index = offsets.new_empty(0)
    if mode == "first" or mode == "last":
        o = offsets.to(torch.int64)
        nonempty = (o[1:] > o[:-1]).unsqueeze(1)
        if total == 0:
            return values.new_zeros((batch, feat)), empty_index
        rows = o[:-1] if mode == "first" else o[1:] - 1
        picked = values.index_select(0, rows.clamp(0, total - 1))
        return torch.where(nonempty, picked, values.new_zeros(())), empty_index
    o, lengths, seg = _segments(offsets, total)
    if mode == "sum" or mode == "mean":
        acc = accumulation_dtype(values.dtype)
        out = values.new_zeros((batch + 1, feat), dtype=acc).index_add(0, seg, values.to(acc))[:batch]
        if mode == "mean":
            out = out / lengths.clamp(min=1).to(acc).unsqueeze(1)
        return out.to(values.dtype), empty_index
    if mode != "max":
        raise ValueError(f"ragged.reference_pool(): expected mode to be one of {MODES}, got {mode!r}")
    index = torch.full((batch, feat), -1, dtype=torch.int64, device=values.device)
    if total == 0:
        return values.new_zeros((batch, feat)), index.to(offsets.dtype)
    x = values.detach()
    x = x.to(torch.uint8) if x.dtype == torch.bool else x
    seg_rows = seg.unsqueeze(1).expand(total, feat)
    slots = batch + 1  # the last one collects the spare rows (see _segments)
    if x.dtype.is_floating_point:
        # The maximum over the non-NaN values, and apart whether a NaN is there: the result
        # does not hang on how scatter_reduce treats NaN on a device.
        nan = x.isnan()
        top = torch.zeros((slots, feat), dtype=x.dtype, device=x.device).scatter_reduce(
            0, seg_rows, x.masked_fill(nan, float("-inf")), "amax", include_self=False
        )
        has_nan = (
            torch.zeros((slots, feat), dtype=torch.int32, device=x.device).index_add(0, seg, nan.to(torch.int32)) > 0
        )
        hit = torch.where(has_nan.index_select(0, seg), nan, x == top.index_select(0, seg))
    else:
        top = torch.zeros((slots, feat), dtype=x.dtype, device=x.device).scatter_reduce(
            0, seg_rows, x, "amax", include_self=False
        )
        hit = x == top.index_select(0, seg)
    token = torch.arange(total, device=x.device).unsqueeze(1).expand(total, feat)
    first_hit = torch.full((slots, feat), total, dtype=torch.int64, device=x.device).scatter_reduce(
        0, seg_rows, torch.where(hit, token, total), "amin", include_self=True
    )[:batch]
    nonempty = (lengths > 0).unsqueeze(1)
    index = torch.where(nonempty, first_hit, index)
    # A gather of the input itself: exact, and its gradient goes to that one token.
    out = torch.where(nonempty, values.gather(0, index.clamp(min=0)), values.new_zeros(()))
    return out, index.to(offsets.dtype)


def reference_pool_backward(grad: Tensor, offsets: Tensor, index: Tensor, mode: str, total: int) -> tuple[Tensor]:
    """``grad [B, F]`` (any strides) -> ``(grad_values [T, F],)`` in the dtype of ``grad``.

    ``index``: the second output of the forward (the maxima's tokens for ``"max"``)."""
    batch, feat = grad.shape
    if mode == "sum" or mode == "mean":
        o, lengths, seg = _segments(offsets, total)
        g = grad
        if mode == "mean":
            acc = accumulation_dtype(grad.dtype)
            g = (grad.to(acc) / lengths.clamp(min=1).to(acc).unsqueeze(1)).to(grad.dtype)
        # a spare row (sequence index B) reads the row of zeros
        return (torch.cat([g, g.new_zeros((1, feat))]).index_select(0, seg),)
    o = offsets.to(torch.int64)
    lengths = o[1:] - o[:-1]
    out = grad.new_zeros((total, feat))
    if total == 0:
        return (out,)
    # Length-0 sequences pass nothing: their rows add zeros at a clamped (valid) token.
    g = torch.where((lengths > 0).unsqueeze(1), grad, grad.new_zeros(()))
    if mode == "max":
        return (out.scatter_add_(0, index.to(torch.int64).clamp(min=0), g),)
    rows = o[:-1] if mode == "first" else o[1:] - 1
    return (out.index_add_(0, rows.clamp(0, total - 1), g),)


# --------------------------------------------------------------------------------------
# The op


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """What an implementation of pool is asked to take: the values' device and dtype, the mode."""

    device: torch.device
    dtype: torch.dtype
    mode: str


def pool_spec(values: Tensor, offsets: Tensor, mode: str) -> PoolSpec:
    """The spec of ``pool(values [T, F], offsets [B+1], mode)``."""
    return PoolSpec(values.device, values.dtype, mode)


def _pool_fake(args: PoolArgs) -> PoolOutput:
    offsets = args.offsets
    batch, feat = offsets.shape[0] - 1, args.values.shape[1]
    index = offsets.new_empty((batch, feat) if args.mode == "max" else (0,))
    return PoolOutput(args.values.new_empty((batch, feat)), index)


def _pool_setup(ctx, args: PoolArgs, output: PoolOutput) -> None:
    ctx.save_for_backward(args.offsets, output.argmax)
    ctx.mode, ctx.total = args.mode, args.values.shape[0]


def _pool_backward(ctx, grad: Tensor | None, _grad_argmax: Tensor) -> PoolGrads | None:
    if grad is None:
        return None
    offsets, index = ctx.saved_tensors
    impl = ctx.impl
    spec = PoolSpec(grad.device, grad.dtype, ctx.mode)
    if backends.implementation("pool", impl).reasons(spec):
        impl = backends.select_spec("pool", "auto", spec).name
    # values is not kept: the backward reads only its row count
    args = PoolArgs(None, offsets, ctx.mode)  # type: ignore[arg-type]
    return POOL.call_backward(args, PoolBackwardInputs(grad, index, ctx.total), impl)


POOL = opdef.define(
    "pool",
    PoolArgs,
    PoolOutput,
    spec=pool_spec,
    fake=_pool_fake,
    setup=_pool_setup,
    backward=_pool_backward,
    backward_inputs=PoolBackwardInputs,
    grads=PoolGrads,
    backward_fake=lambda args, inputs: PoolGrads(inputs.grad_out.new_empty((inputs.total, inputs.grad_out.shape[1]))),
    backward_unread=("values",),
    non_differentiable=lambda args, output: (output.argmax,),
)


def _reference_forward(args: PoolArgs) -> PoolOutput:
    return PoolOutput(*reference_pool(args.values, args.offsets, args.mode))


def _reference_backward(args: PoolArgs, inputs: PoolBackwardInputs) -> PoolGrads:
    (grad_values,) = reference_pool_backward(inputs.grad_out, args.offsets, inputs.argmax, args.mode, inputs.total)
    return PoolGrads(grad_values)


backends.register(backends.Implementation("pool", "torch", _reference_forward, backward=_reference_backward))


# --------------------------------------------------------------------------------------
# Public function


def pool(rt: RaggedTensor, mode: str = "mean", *, backend: str | None = None) -> torch.Tensor:
    """Pool each sequence of ``rt`` (values ``[T, *F]``) to one row: a tensor ``[B, *F]``.

    ``mode``: ``"mean"`` (sentence embeddings), ``"sum"``, ``"max"`` (per feature),
    ``"first"`` (CLS token), ``"last"`` (decoder classification). The output has the dtype
    of ``rt.values``; sums and means accumulate in float32 for 16-bit inputs. A length-0
    sequence gives a row of zeros in every mode (the masked pooling of a zero-padded batch)
    and passes no gradient back. ``max`` propagates NaN like ``torch.amax`` and sends the
    gradient to the first maximal token of each feature (the first NaN if any). Dtypes:
    ``mean`` floating point; ``sum`` also integers; ``max`` / ``first`` / ``last`` also
    bool (see :mod:`ragged.ops.pool`). No host sync.

    >>> import torch, ragged
    >>> rt = ragged.pack([torch.tensor([[1.0, 4.0], [3.0, 2.0]]), torch.zeros(0, 2), torch.tensor([[5.0, 6.0]])])
    >>> ragged.pool(rt, "mean")
    tensor([[2., 3.],
            [0., 0.],
            [5., 6.]])
    >>> ragged.pool(rt, "max")[0], ragged.pool(rt, "last")[0]
    (tensor([3., 4.]), tensor([3., 2.]))
    """
    fn = "ragged.pool"
    if not isinstance(rt, RaggedTensor):
        raise TypeError(f"{fn}(): expected rt to be a RaggedTensor, got {describe(rt)}")
    values = rt.values
    takes = _TAKES.get(mode) if type(mode) is str else None
    if takes is None or values.dtype not in takes:
        _raise_bad_mode_or_dtype(fn, mode, values)
    shape = values.shape
    nd = len(shape)
    if nd == 0:
        raise ValueError(f"{fn}(): expected rt.values of shape [T, *F], got a 0-d tensor")
    offsets = rt.offsets
    impl = backends.select_spec("pool", backend, PoolSpec(values.device, values.dtype, mode), fn=fn)
    if nd == 2:
        return POOL(PoolArgs(values, offsets, mode), impl.name).out
    if nd == 1:
        return POOL(PoolArgs(values.unsqueeze(1), offsets, mode), impl.name).out.squeeze(1)
    feat = 1
    for s in shape[1:]:
        feat *= s
    out = POOL(PoolArgs(values.reshape(shape[0], feat), offsets, mode), impl.name).out
    return out.view(offsets.shape[0] - 1, *shape[1:])


def _raise_bad_mode_or_dtype(fn: str, mode: object, values: Tensor) -> None:
    if type(mode) is not str:
        raise TypeError(f"{fn}(): expected mode to be a str, one of {MODES}, got {describe(mode)}")
    if mode not in _TAKES:
        raise ValueError(f"{fn}(): expected mode to be one of {MODES}, got {mode!r}")
    raise TypeError(f"{fn}(): expected rt.values of {_TAKES_TEXT[mode]} for mode={mode!r}, got {values.dtype}")
