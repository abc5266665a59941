"""Padding-free attention: each query attends only to the keys of its own sequence.

Shapes (packed token index ``t``, see :mod:`ragged.tensor`):

* ``q``: ``[Tq, H, D]``, ``k``: ``[Tk, H_kv, D]``, ``v``: ``[Tk, H_kv, D]`` with
  ``H % H_kv == 0`` (GQA/MQA: query head ``h`` reads key/value head ``h // (H / H_kv)``);
* ``cu_seqlens_q [B+1]``, ``cu_seqlens_k [B+1]`` (the offsets; q and k may differ, as in
  cross-attention, but the batch size is shared);
* output ``[Tq, H, D]`` in q's dtype and ``lse [Tq, H]`` float32, the natural-log
  normaliser of each query row (``-inf`` for a query that sees no key).

Causal masking with ``Lq != Lk`` is aligned to the bottom right (flash-attn >= 2.1):
query ``i`` sees keys ``j <= i + Lk - Lq``. For Lq = 2, Lk = 5 (``x`` = attends)::

        k0 k1 k2 k3 k4
    q0   x  x  x  x  .
    q1   x  x  x  x  x

and for Lq = 5, Lk = 2 the first three queries see no key and get zeros::

        k0 k1
    q0   .  .
    q1   .  .
    q2   .  .
    q3   x  .
    q4   x  x

Sliding windows (``window_size=(left, right)``, flash-attn's convention) use the same
alignment: with ``a = i + Lk - Lq`` the aligned position of query ``i``, it sees the keys
``a - left <= j <= a + right``; ``-1`` leaves a side unbounded, ``(-1, -1)`` (the default) is
no window. ``causal=True`` bounds the right side at 0 whatever ``right`` says (a causal
window is ``(left, 0)``). For Lq = Lk = 5 and ``window_size=(1, 2)``::

        k0 k1 k2 k3 k4
    q0   x  x  x  .  .
    q1   x  x  x  x  .
    q2   .  x  x  x  x
    q3   .  .  x  x  x
    q4   .  .  .  x  x

A query whose window holds no key of its sequence (Lq > Lk, say) gets zeros and ``lse = -inf``,
as under causal masking.

Relative-position bias (``position_bias=(table, buckets)``, MPNet's and T5's bucketed form):
``table [num_buckets, H]`` (any float dtype, read as float32; one column per query head),
``buckets [max_q + max_k - 1]`` int32/int64 on q's device, and the score of query ``i`` and key
``j`` of a sequence (positions within it, no causal alignment) under head ``h`` is
``scale * q_i . k_j + table[buckets[j - i + max_q - 1], h]``, before masking and the softmax.
The kernels read it per tile from ``j - i``; no ``[B, H, L, L]`` bias exists. The gradient
flows to ``table`` (``buckets`` is an index).

One op carries the work, :data:`ATTENTION` (``ragged::attention`` and
``ragged::attention_backward``, defined through :mod:`ragged.opdef`): operands ``(q, k, v,
cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed, window_left, window_right,
bias_table, bias_buckets)`` -> ``(out, lse)``, ``lse`` a constant of the autograd graph; its
backward takes ``(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p,
seed, window_left, window_right, bias_table, bias_buckets)`` -> ``(dq, dk, dv, dtable)``. Every
backward implementation returns ``(dq, dk, dv)``, with ``dtable`` after them when given a table,
and also takes ``grads=(dq, dk, dv)``, preallocated buffers it fills and returns. Every
implementation gives ``window_left`` / ``window_right`` the default ``-1`` (no window) and
``bias_table`` / ``bias_buckets`` the default None (no bias), so callers of an implementation's
functions that use neither may leave them out.
Implementations (:mod:`ragged.backends`, chosen from :class:`AttentionSpec`): ``"torch"``
(forward on the CPU: :mod:`ragged.ops.attention_cpu`, lengths grouped into calls of torch's
fused CPU kernel; elsewhere, with dropout, and every backward: :func:`reference_attention`, a
loop of per-sequence attention in float32, the tests' oracle; declared here), ``"triton"`` (varlen
flash attention, forward and backward, key blocks outside a window skipped, the position bias
read per tile; declared in :mod:`ragged.kernels.triton`) and
``"cuda"`` (a fused kernel for short sequences, forward only, its backward Triton's, no window,
the position bias read per score; declared in :mod:`ragged.kernels.cuda`; ``"auto"`` takes it
only where it is measured faster).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from .. import backends, opdef
from ..records.attention import AttentionArgs, AttentionBackwardInputs, AttentionGrads, AttentionOutput
from ..tensor import RaggedTensor
from ..utils import check_int, check_offsets_tensor, check_tensor, describe, eager
from . import attention_cpu
from .attention_reference import (
    NO_WINDOW,
    check_bucket_values,
    check_position_bias,
    check_window,
    effective_window,
    reference_attention,
    reference_attention_backward,
    reference_dropout_mask,
)

# --------------------------------------------------------------------------------------
# The op: ragged::attention (+ ragged::attention_backward), one autograd rule


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What an implementation of attention is asked to take: q's device and dtype, the head dim
    ``D``, the query and key/value heads, the batch size ``B``, the longest query and key
    sequences (host ints), bottom-right causal masking, the dropout probability, whether a
    backward will follow (some query, key, value or bias table requires grad), the sliding window
    ``(left, right)`` as :func:`effective_window` gives it (``(-1, -1)``: none), the rows of
    the relative-position bias table (0: no position bias), and whether q, k and v may be moved
    by TMA (16-byte aligned addresses and row strides, unit feature stride; None where the
    addresses are unknown: traced by torch.compile); ``operands_used``: the optional operands of
    :class:`AttentionArgs` the call gives a value other than their default (an implementation
    that does not read one declines the call, :attr:`ragged.backends.Implementation.operands`)."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    heads: int
    kv_heads: int
    batch: int
    max_q: int
    max_k: int
    causal: bool
    dropout_p: float
    needs_grad: bool
    window_size: tuple[int, int] = NO_WINDOW
    bias_buckets: int = 0
    tma_aligned: bool | None = None
    operands_used: frozenset[str] = frozenset()


def attention_spec(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    dropout_p: float,
    needs_grad: bool,
    window_size: tuple[int, int] = NO_WINDOW,
    position_bias: tuple[Tensor, Tensor] | None = None,
) -> AttentionSpec:
    """The spec of attention over ``q [Tq, H, D]``, ``k, v [Tk, H_kv, D]``, ``cu_q, cu_k [B+1]``
    (these are also the arguments of ``ragged.explain("attention", ...)``); ``window_size`` is
    taken as :func:`effective_window` makes it; ``position_bias``: ``(table, buckets)`` or None."""
    window = (
        NO_WINDOW
        if window_size is NO_WINDOW
        else effective_window((int(window_size[0]), int(window_size[1])), bool(causal), max_q, max_k)
    )
    table, buckets = position_bias if position_bias is not None else (None, None)
    args = AttentionArgs(
        q=q,
        k=k,
        v=v,
        cu_q=cu_q,
        cu_k=cu_k,
        max_q=max_q,
        max_k=max_k,
        causal=bool(causal),
        scale=1.0,
        dropout_p=float(dropout_p),
        window_left=window[0],
        window_right=window[1],
        bias_table=table,
        bias_buckets=buckets,
    )
    return spec_of(args, needs_grad)


_OPTIONAL = tuple(AttentionArgs._field_defaults.items())


def _operands_used(args: AttentionArgs) -> frozenset[str]:
    used = []
    for name, default in _OPTIONAL:
        value = getattr(args, name)
        if value is not default and (isinstance(value, Tensor) or value != default):
            used.append(name)
    return frozenset(used)


def spec_of(args: AttentionArgs, needs_grad: bool) -> AttentionSpec:
    """The spec of a call with operands ``args`` (the window already as :func:`effective_window`
    gives it)."""
    q, k, v = args.q, args.k, args.v
    window = (args.window_left, args.window_right)
    return AttentionSpec(
        q.device,
        q.dtype,
        q.shape[2],
        q.shape[1],
        k.shape[1],
        args.cu_q.shape[0] - 1,
        args.max_q,
        args.max_k,
        bool(args.causal),
        float(args.dropout_p),
        bool(needs_grad),
        NO_WINDOW if window == NO_WINDOW else window,
        0 if args.bias_table is None else int(args.bias_table.shape[0]),
        (_tma_aligned(q) and _tma_aligned(k) and _tma_aligned(v)) if eager(q, k, v) else None,
        _operands_used(args),
    )


def _tma_aligned(t: Tensor) -> bool:
    size = t.element_size()
    return (
        t.data_ptr() % 16 == 0
        and t.stride(-1) == 1
        and (t.stride(0) * size) % 16 == 0
        and (t.stride(1) * size) % 16 == 0
    )


# The operands the autograd rule keeps on its context as they are (the tensors go through
# save_for_backward).
_SCALARS = ("max_q", "max_k", "causal", "scale", "dropout_p", "seed", "window_left", "window_right")


def _setup(ctx, args: AttentionArgs, output: AttentionOutput) -> None:
    ctx.save_for_backward(
        args.q, args.k, args.v, output.out, output.lse, args.cu_q, args.cu_k, args.bias_table, args.bias_buckets
    )
    ctx.scalars = {name: getattr(args, name) for name in _SCALARS}


def _backward(ctx, grad_out: Tensor, _grad_lse: Tensor) -> AttentionGrads:
    # lse is a constant of the graph (non_differentiable below): its gradient is never used.
    q, k, v, out, lse, cu_q, cu_k, bias_table, bias_buckets = ctx.saved_tensors
    args = AttentionArgs(
        q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, bias_table=bias_table, bias_buckets=bias_buckets, **ctx.scalars
    )
    # The implementation's backward follows its declaration (the forward-only CUDA kernel: Triton's).
    inputs = AttentionBackwardInputs(grad_out.contiguous(), out, lse)
    return ATTENTION.call_backward(args, inputs, ctx.impl)


def _fake(args: AttentionArgs) -> AttentionOutput:
    q = args.q
    return AttentionOutput(torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32))


def _backward_fake(args: AttentionArgs, inputs: AttentionBackwardInputs) -> AttentionGrads:
    table = None if args.bias_table is None else torch.empty_like(args.bias_table)
    return AttentionGrads(torch.empty_like(args.q), torch.empty_like(args.k), torch.empty_like(args.v), table)


ATTENTION = opdef.define(
    "attention",
    AttentionArgs,
    AttentionOutput,
    spec=attention_spec,
    setup=_setup,
    backward=_backward,
    fake=_fake,
    backward_inputs=AttentionBackwardInputs,
    grads=AttentionGrads,
    backward_fake=_backward_fake,
    non_differentiable=lambda args, output: (output.lse,),
    schema_types={"seed": int},  # eager calls under CUDA-graph capture pass a device tensor
)


def _reference_mask(args: AttentionArgs):
    if args.dropout_p == 0:
        return None
    q = args.q
    return reference_dropout_mask(
        int(args.seed), args.dropout_p, args.cu_q, q.shape[1], q.shape[0], args.max_k, q.device
    )


def _reference_forward(args: AttentionArgs) -> AttentionOutput:
    q = args.q
    window = (args.window_left, args.window_right)
    bias = None if args.bias_table is None else (args.bias_table, args.bias_buckets)
    if attention_cpu.available(q, args.dropout_p):  # one fused call per group of lengths, not per sequence
        with torch.no_grad():
            out, lse = attention_cpu.grouped_attention(
                q,
                args.k,
                args.v,
                args.cu_q.tolist(),
                args.cu_k.tolist(),
                args.causal,
                args.scale,
                window,
                None
                if args.bias_table is None or args.bias_buckets is None
                else (args.bias_table, args.bias_buckets, args.max_q),
            )
    else:
        with torch.no_grad():
            out, lse = reference_attention(
                q,
                args.k,
                args.v,
                args.cu_q,
                args.cu_k,
                args.causal,
                args.scale,
                _reference_mask(args),
                args.dropout_p,
                window_size=window,
                position_bias=bias,
                max_seqlen_q=args.max_q,
            )
    spare = q.shape[0] - out.shape[0]  # rows past the last offset (a graphed bucket's): zeros, as the op's shape
    if spare > 0:
        out = torch.cat([out, out.new_zeros((spare, *out.shape[1:]))])
        lse = torch.cat([lse, lse.new_zeros((spare, lse.shape[1]))])
    return AttentionOutput(out, lse)


def _reference_backward(
    args: AttentionArgs, inputs: AttentionBackwardInputs, grads: AttentionGrads | None = None
) -> AttentionGrads:
    """The op's backward by :func:`reference_attention_backward`; ``grads``: optional preallocated
    ``q``, ``k``, ``v`` gradients (shapes of q, k, v, any strides) copied into and returned."""
    bias = None if args.bias_table is None else (args.bias_table, args.bias_buckets)
    result = reference_attention_backward(
        inputs.grad_out,
        args.q,
        args.k,
        args.v,
        args.cu_q,
        args.cu_k,
        args.causal,
        args.scale,
        _reference_mask(args),
        args.dropout_p,
        (args.window_left, args.window_right),
        position_bias=bias,
        max_seqlen_q=args.max_q,
    )
    computed = AttentionGrads(*result)
    if grads is None:
        return computed
    fn = "ragged.ops.attention._reference_backward"
    if not isinstance(grads, AttentionGrads):
        raise TypeError(f"{fn}(): expected grads as an AttentionGrads record, got {type(grads).__name__}")
    for name in ("q", "k", "v"):
        buf, grad = getattr(grads, name), getattr(computed, name)
        if not isinstance(buf, torch.Tensor) or buf.shape != grad.shape:
            raise ValueError(
                f"{fn}(): expected the gradient of {name} of shape {tuple(grad.shape)}, got "
                f"{tuple(buf.shape) if isinstance(buf, torch.Tensor) else type(buf).__name__}"
            )
        buf.copy_(grad)
    return computed._replace(q=grads.q, k=grads.k, v=grads.v)


backends.register(
    backends.Implementation(
        "attention",
        "torch",
        _reference_forward,
        _reference_backward,
        # the optional operands of AttentionArgs the reference reads: an operand added to the record
        # is declined until the reference reads it and names it here
        operands=frozenset({"dropout_p", "seed", "window_left", "window_right", "bias_table", "bias_buckets"}),
    )
)


def dropout_seed(dropout_p: float, device: torch.device | None = None) -> int | Tensor:
    """The seed of one call's attention dropout mask: 0 without dropout, else a fresh int in
    ``[0, 2**31 - 1)`` drawn from torch's CPU generator, so that ``torch.manual_seed`` makes runs
    reproducible and no GPU value is read. Every backend draws its mask from this seed (the
    kernels' counter-based hash; see :func:`reference_dropout_mask`).

    While a CUDA graph is captured on ``device``'s current stream the seed is instead a
    one-element int64 tensor drawn there by torch's CUDA generator: a host int would be frozen
    into the graph (every replay the same mask), whereas each replay redraws the tensor
    (reproducible under ``torch.manual_seed`` as every graphed random op) and the Triton kernels
    read it on the device."""
    if dropout_p == 0.0:
        return 0
    if device is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())


# --------------------------------------------------------------------------------------
# Public API


@dataclasses.dataclass(frozen=True)
class _Caller:
    """A public function and the names its error messages give the offsets, the maxima and the
    token counts: one set of checks serves both forms (built once, at import)."""

    fn: str
    cu_q: str
    cu_k: str
    max_q: str
    max_k: str
    total_q: str
    total_k: str


_VARLEN = _Caller(
    "ragged.varlen_attention",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "q.shape[0]",
    "k.shape[0]",
)
_RAGGED = _Caller(
    "ragged.attention", "q.offsets", "k.offsets", "q.max_len", "k.max_len", "q.num_tokens", "k.num_tokens"
)


def _validate(caller, q, k, v, cu_q, cu_k, max_q, max_k, scale, dropout_p):
    """Checks every argument every backend takes; returns ``(cu_q, cu_k, max_q, max_k)`` as the
    backends must get them: offsets contiguous (every kernel reads them with unit stride, and a
    RaggedTensor from the plain constructor may hold a strided view), maxima as Python ints.
    Reads no tensor's values (see :func:`_check_offset_values` for those)."""
    fn = caller.fn
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(fn, name, t)
        if t.dim() != 3:
            raise ValueError(f"{fn}(): expected {name} of shape [T, H, D], got {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}(): expected q, k and v of one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"{fn}(): expected floating-point q, k, v, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}(): expected q, k and v on one device, got {q.device}, {k.device} and {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"{fn}(): expected k and v of the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{fn}(): expected q and k of the same head dim, got {q.shape[2]} and {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"{fn}(): expected the query heads ({q.shape[1]}) to be a multiple of the key/value heads ({k.shape[1]})"
        )
    cu_q = check_offsets_tensor(fn, cu_q, q, name=caller.cu_q)
    cu_k = check_offsets_tensor(fn, cu_k, k, name=caller.cu_k)
    if cu_q.shape != cu_k.shape:
        raise ValueError(
            f"{fn}(): expected {caller.cu_q} and {caller.cu_k} of the same batch size, got "
            f"{cu_q.shape[0] - 1} and {cu_k.shape[0] - 1} sequences"
        )
    max_q = check_int(fn, caller.max_q, max_q, minimum=0)
    max_k = check_int(fn, caller.max_k, max_k, minimum=0)
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"{fn}(): expected scale to be a float or None, got {describe(scale)}")
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{fn}(): expected dropout_p in [0, 1), got {describe(dropout_p)}")
    return cu_q, cu_k, max_q, max_k


def _check_host_ends(fn, host, total, name, total_name):
    """O(1) checks of offsets already on the host (a RaggedTensor's): first 0, last T. The rest
    (non-decreasing, max_len) the RaggedTensor constructors have checked; a loop over the B
    lengths here would cost host time on every call."""
    if host[0] != 0:
        raise ValueError(f"{fn}(): expected {name}[0] == 0, got {host[0]}")
    if host[-1] != total:
        raise ValueError(f"{fn}(): expected {name}[-1] == {total_name} ({total}), got {host[-1]}")


def _summary(cu: torch.Tensor) -> torch.Tensor:
    """``[4]`` int64 on cu's device: first offset, last offset, shortest and longest length (0 for
    B = 0), so that checking a batch reads four numbers, whatever B."""
    cu = cu.to(torch.int64)
    lengths = torch.cat([cu[1:] - cu[:-1], cu.new_zeros(1)])
    return torch.stack([cu[0], cu[-1], lengths.min(), lengths.max()])


def _check_offset_values(caller, cu_q, cu_k, total_q, total_k, max_q, max_k):
    """The offsets against the data contract: ``[0] == 0``, non-decreasing, ``[-1] == T`` and no
    sequence longer than its max. One device-to-host read of 8 numbers (a sync on CUDA)."""
    fn = caller.fn
    first_q, last_q, low_q, high_q, first_k, last_k, low_k, high_k = torch.cat(
        [_summary(cu_q), _summary(cu_k)]
    ).tolist()
    for cu, (first, last, low, high), total, longest, (name, max_name, total_name) in (
        (cu_q, (first_q, last_q, low_q, high_q), total_q, max_q, (caller.cu_q, caller.max_q, caller.total_q)),
        (cu_k, (first_k, last_k, low_k, high_k), total_k, max_k, (caller.cu_k, caller.max_k, caller.total_k)),
    ):
        if first != 0:
            raise ValueError(f"{fn}(): expected {name}[0] == 0, got {first}")
        if low < 0:  # the error path: reading all of them to name the first decrease is fine here
            host = cu.tolist()
            i = next(i for i in range(len(host) - 1) if host[i + 1] < host[i])
            raise ValueError(
                f"{fn}(): expected non-decreasing {name}, got {name}[{i}] = {host[i]} > {name}[{i + 1}] = {host[i + 1]}"
            )
        if last != total:
            raise ValueError(f"{fn}(): expected {name}[-1] == {total_name} ({total}), got {last}")
        if high > longest:
            raise ValueError(f"{fn}(): expected {max_name} >= the longest sequence ({high}), got {longest}")


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str | None = None,
    *,
    window_size: tuple[int, int] = NO_WINDOW,
    position_bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    validate: bool = False,
):
    """Attention in flash-attn's varlen convention (see the module docstring for shapes).

    ``max_seqlen_q`` / ``max_seqlen_k`` are host ints (Python or numpy; no sync). ``dropout_p > 0``
    drops attention probabilities (reproducible under ``torch.manual_seed``).
    ``window_size=(left, right)``: sliding-window attention, flash-attn's convention (query ``i``
    of a sequence, aligned as causal masking aligns it, sees keys ``i + Lk - Lq - left`` to
    ``i + Lk - Lq + right``; ``-1``: unbounded; with ``causal=True`` the right side is 0); it
    combines with ``causal``, ``dropout_p``, GQA and ``scale``. Queries whose window holds no
    key get zeros and ``lse = -inf``. The Triton kernels skip the key blocks outside every
    window; the CUDA short-sequence kernel takes no window (``ragged.explain`` says so).
    ``position_bias=(table, buckets)``: a relative-position bias added to every score, MPNet's
    and T5's bucketed form: ``table [num_buckets, H]`` float (one column per query head; any
    float dtype, read as float32; it may require grad), ``buckets [max_seqlen_q + max_seqlen_k -
    1]`` int32/int64, both on q's device, and query ``i`` and key ``j`` of a sequence (positions
    within it) under head ``h`` score ``scale * q_i . k_j + table[buckets[j - i + max_seqlen_q -
    1], h]``, masked (causal, window) after. It combines with everything above and gives the
    table its gradient. The Triton kernels read it per tile from ``j - i`` (no ``[B, H, L, L]``
    bias is built), and so does the CUDA short-sequence kernel's forward (inference; a gradient
    goes to Triton). Buckets outside ``[0, num_buckets)`` raise ``ValueError`` where
    that reads no GPU memory (CPU buckets, the ``"torch"`` backend, ``validate=True``); unchecked
    CUDA buckets out of range are the caller's error (a device-side indexing assert).
    Returns ``out [Tq, H, D]``, or ``(out, lse [Tq, H] float32)`` with ``return_lse``.

    Contract on the offsets: ``cu_seqlens_*[0] == 0``, non-decreasing, ``cu_seqlens_q[-1] ==
    q.shape[0]``, ``cu_seqlens_k[-1] == k.shape[0]``, and no sequence longer than its
    ``max_seqlen_*``. It is checked (``ValueError``, the same on every backend) wherever that reads
    no GPU memory: offsets on the CPU, and the ``"torch"`` backend (which reads them anyway).
    CUDA offsets are not read by default, since that would cost a host sync per call;
    ``validate=True`` checks them with one device-to-host read (a sync; a graph break under
    ``torch.compile``). Unchecked CUDA offsets that break the contract are the caller's error:
    the CUDA short-sequence kernel clips each sequence to the rows of q and k, but the Triton
    kernels trust the offsets (clipping there slowed the causal forward markedly) and may then
    read or write out of bounds. Pass ``validate=True`` (or host offsets through
    :func:`attention`) where they may be wrong.
    """
    return _varlen(
        _VARLEN,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        scale,
        dropout_p,
        return_lse,
        backend,
        validate,
        window_size,
        position_bias,
    )


def _varlen(
    caller,
    q,
    k,
    v,
    cu_q,
    cu_k,
    max_q,
    max_k,
    causal,
    scale,
    dropout_p,
    return_lse,
    backend,
    validate,
    window_size,
    position_bias,
    host_q=None,
    host_k=None,
):
    """Both public forms: ``caller`` names their arguments; ``host_q`` / ``host_k``: the offsets
    as host ints when known (a RaggedTensor's), else None."""
    cu_q, cu_k, max_q, max_k = _validate(caller, q, k, v, cu_q, cu_k, max_q, max_k, scale, dropout_p)
    if window_size is NO_WINDOW:  # the default, spared the checks
        window = NO_WINDOW
    else:
        window = effective_window(check_window(caller.fn, window_size), bool(causal), max_q, max_k)
    table = buckets = None
    if position_bias is not None:
        table, buckets = check_position_bias(
            caller.fn,
            position_bias,
            q.shape[1],
            q.device,
            max(max_q + max_k - 1, 0),
            f"{caller.max_q} + {caller.max_k} - 1",
        )
    # Offsets on the CPU cost nothing to read (and cannot be read while tracing: eager() is False).
    checked = bool(validate) or (cu_q.device.type == "cpu" and eager(cu_q, cu_k))
    if checked:
        _check_offset_values(caller, cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
        if buckets is not None:
            check_bucket_values(caller.fn, table, buckets)
    else:
        if host_q is not None:
            _check_host_ends(caller.fn, host_q, q.shape[0], caller.cu_q, caller.total_q)
        if host_k is not None:
            _check_host_ends(caller.fn, host_k, k.shape[0], caller.cu_k, caller.total_k)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    causal, dropout_p = bool(causal), float(dropout_p)
    needs_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (table is not None and table.requires_grad)
    )
    args = AttentionArgs(
        q=q,
        k=k,
        v=v,
        cu_q=cu_q,
        cu_k=cu_k,
        max_q=max_q,
        max_k=max_k,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        window_left=window[0],
        window_right=window[1],
        bias_table=table,
        bias_buckets=buckets,
    )
    impl = backends.select_spec("attention", backend, spec_of(args, needs_grad), fn=caller.fn)
    if not checked and impl.backend == "torch" and eager(cu_q, cu_k):
        # The reference reads the offsets on the host anyway: check them rather than return
        # a wrong number of rows (and the buckets rather than index out of the table).
        _check_offset_values(caller, cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
        if buckets is not None:
            check_bucket_values(caller.fn, table, buckets)
    if dropout_p:
        args = args._replace(seed=dropout_seed(dropout_p, q.device))
    out, lse = ATTENTION(args, impl.name)
    return (out, lse) if return_lse else out


def attention(
    q: RaggedTensor,
    k: RaggedTensor,
    v: RaggedTensor,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str | None = None,
    *,
    window_size: tuple[int, int] = NO_WINDOW,
    position_bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    validate: bool = False,
):
    """Padding-free attention over RaggedTensors (``values [T, H, D]``).

    ``k`` and ``v`` share their sequences; ``q`` may have other lengths (cross-attention)
    with the same batch size. Returns a RaggedTensor with q's sequences, or
    ``(out, lse)`` with ``return_lse`` (``lse``: ``[Tq, H]`` float32 tensor).
    ``window_size=(left, right)``: sliding-window attention, and ``position_bias=(table,
    buckets)``: a relative-position bias (``buckets [q.max_len + k.max_len - 1]``), as in
    :func:`varlen_attention`.

    The offsets are checked as in :func:`varlen_attention`; in addition, offsets the
    RaggedTensors hold on the host (from :func:`ragged.pack`, ``from_lengths``, ...) are checked
    against ``values.shape[0]`` at no cost. ``validate=True`` checks all of the data contract
    with one device-to-host read.
    """
    fn = _RAGGED.fn
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, RaggedTensor):
            raise TypeError(
                f"{fn}(): expected {name} to be a RaggedTensor, got {describe(t)}; "
                "for packed tensors with cu_seqlens use ragged.varlen_attention"
            )
    if k.offsets is not v.offsets:
        if (
            k.offsets.shape != v.offsets.shape
            or k.num_tokens != v.num_tokens
            or (
                k.known_host_offsets is not None
                and v.known_host_offsets is not None
                and k.known_host_offsets != v.known_host_offsets
            )
        ):
            raise ValueError(
                f"{fn}(): expected k and v with the same sequences, got lengths "
                f"{k.batch_size}/{k.num_tokens} and {v.batch_size}/{v.num_tokens} (batch/tokens)"
            )
    if q.batch_size != k.batch_size:
        raise ValueError(f"{fn}(): expected q and k with the same batch size, got {q.batch_size} and {k.batch_size}")
    result = _varlen(
        _RAGGED,
        q.values,
        k.values,
        v.values,
        q.offsets,
        k.offsets,
        q.max_len,
        k.max_len,
        causal,
        scale,
        dropout_p,
        return_lse,
        backend,
        validate,
        window_size,
        position_bias,
        q.known_host_offsets,
        k.known_host_offsets,
    )
    if return_lse:
        out, lse = result
        return q.with_values(out), lse
    return q.with_values(result)
