"""The float32 / float64 reference of :mod:`ragged.ops.attention` (the tests' oracle and the
``"torch"`` backend wherever torch's fused CPU kernel does not serve): a loop of per-sequence
attention and its gradients written out, the sliding-window and position-bias helpers every
backend shares, and the dropout mask the kernels draw.

Coordinates: a query or key is named by its position within its sequence (``i`` for queries,
``j`` for keys, from 0); packed token indices appear only in slices of ``q`` / ``k`` / ``v``.

Relative-position bias (``position_bias=(table, buckets)``, MPNet's and T5's bucketed form):
``table [num_buckets, H]`` float, ``buckets [max_q + max_k - 1]`` int32/int64, and the score of
query ``i`` and key ``j`` of one sequence under head ``h`` gains
``table[buckets[j - i + max_q - 1], h]`` after the scale, before masking and the softmax. The
distance ``j - i`` is between positions within the sequence (no causal alignment shift);
``max_q`` is the longest query sequence the buckets were built for.
"""

from __future__ import annotations

import math

import torch

from .. import backends
from ..utils import check_int, describe, no_autocast
from . import attention_cpu

NO_WINDOW = (-1, -1)  # window_size of attention without a sliding window


def check_window(fn: str, window_size: object) -> tuple[int, int]:
    """``window_size`` as ``(left, right)`` Python ints, each ``>= -1`` (``-1``: that side is
    unbounded): a tuple or list of two ints, else ``TypeError`` / ``ValueError`` naming ``fn``."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(
            f"{fn}(): expected window_size to be a tuple (left, right) of two ints, got {describe(window_size)}"
        )
    left = check_int(fn, "window_size[0]", window_size[0], minimum=-1)
    right = check_int(fn, "window_size[1]", window_size[1], minimum=-1)
    return left, right


def effective_window(window_size: tuple[int, int], causal: bool, max_q: int, max_k: int) -> tuple[int, int]:
    """The window that masks the same keys with every side that bounds nothing set to ``-1``:
    ``causal`` already bounds the right side (at 0), a left side ``>= max_k - 1`` or a right side
    ``>= max_q - 1`` leaves every key of a sequence in reach of every query (the aligned
    position of query ``i`` of a sequence is ``i + Lk - Lq``, from ``Lk - Lq`` to ``Lk - 1``).
    ``(-1, -1)``: no window at all. Host ints only: no tensor is read."""
    left, right = window_size
    if left >= max_k - 1:
        left = -1
    if causal or right >= max_q - 1:
        right = -1
    return left, right


def _visible(lq: int, lk: int, causal: bool, window: tuple[int, int], device: torch.device) -> torch.Tensor | None:
    """``[Lq, Lk]`` bool, True where query ``i`` sees key ``j`` (positions within the sequence),
    or None where every query sees every key."""
    left, right = window
    if not causal and left < 0 and right < 0:
        return None
    i = torch.arange(lq, device=device).unsqueeze(1) + (lk - lq)  # aligned query positions
    j = torch.arange(lk, device=device).unsqueeze(0)
    return attention_cpu.band(i, j, causal, window)


def check_position_bias(
    fn: str, position_bias: object, heads: int, device: torch.device, span: int, span_name: str, exact: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``position_bias`` as ``(table, buckets)``: a tuple or list of two tensors on ``device``,
    ``table [num_buckets >= 1, heads]`` floating point, ``buckets`` int32/int64 of shape ``[span]``
    (``exact``) or at least ``span`` long; else ``TypeError`` / ``ValueError`` naming ``fn`` (and
    ``span_name``, what ``span`` is). Reads no tensor's values (:func:`check_bucket_values` does)."""
    if not isinstance(position_bias, (tuple, list)) or len(position_bias) != 2:
        raise TypeError(
            f"{fn}(): expected position_bias to be a tuple (table, buckets) of two tensors, got "
            f"{describe(position_bias)}"
        )
    table, buckets = position_bias
    for name, t in (("table", table), ("buckets", buckets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}(): expected position_bias {name} to be a torch.Tensor, got {describe(t)}")
    if not table.dtype.is_floating_point:
        raise TypeError(f"{fn}(): expected a floating-point position_bias table, got {table.dtype}")
    if buckets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}(): expected position_bias buckets of dtype int32 or int64, got {buckets.dtype}")
    if table.dim() != 2 or table.shape[1] != heads or table.shape[0] == 0:
        raise ValueError(
            f"{fn}(): expected a position_bias table of shape [num_buckets, {heads}] (num_buckets "
            f">= 1, one column per query head), got {tuple(table.shape)}"
        )
    if buckets.dim() != 1 or (buckets.shape[0] != span if exact else buckets.shape[0] < span):
        need = f"[{span}]" if exact else f"[n] with n >= {span}"
        raise ValueError(
            f"{fn}(): expected position_bias buckets of shape {need} ({span_name}), got {tuple(buckets.shape)}"
        )
    if table.device != device or buckets.device != device:
        raise ValueError(
            f"{fn}(): expected the position_bias table and buckets on q's device ({device}), got "
            f"{table.device} and {buckets.device}"
        )
    return table, buckets


def check_bucket_values(fn: str, table: torch.Tensor, buckets: torch.Tensor) -> None:
    """Every bucket a row of the table, ``0 <= buckets < num_buckets``, else ``ValueError``
    naming ``fn``. Reads two numbers (a sync on CUDA)."""
    if buckets.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(buckets)).tolist()
    if low < 0 or high >= table.shape[0]:
        raise ValueError(
            f"{fn}(): expected position_bias buckets in [0, {table.shape[0]}) (rows of the table), "
            f"got values from {low} to {high}"
        )


def bucket_block(buckets: torch.Tensor, lq: int, lk: int, max_q: int) -> torch.Tensor:
    """``[Lq, Lk]`` int64: the bucket of query ``i`` and key ``j`` of one sequence,
    ``buckets[j - i + max_q - 1]``."""
    rel = torch.arange(lk, device=buckets.device).unsqueeze(0) - torch.arange(lq, device=buckets.device).unsqueeze(1)
    return buckets[rel + (max_q - 1)].long()


def _bias_of(
    fn: str, position_bias, heads: int, device: torch.device, cq: list[int], ck: list[int], max_seqlen_q: int | None
):
    """``(table, buckets, max_q)`` of the reference's ``position_bias`` (checked), or None."""
    if position_bias is None:
        return None
    longest_q = max((cq[b + 1] - cq[b] for b in range(len(cq) - 1)), default=0)
    longest_k = max((ck[b + 1] - ck[b] for b in range(len(ck) - 1)), default=0)
    max_q = longest_q if max_seqlen_q is None else check_int(fn, "max_seqlen_q", max_seqlen_q, minimum=longest_q)
    table, buckets = check_position_bias(
        fn,
        position_bias,
        heads,
        device,
        max(max_q + longest_k - 1, 0),
        "max_seqlen_q + the longest key sequence - 1",
        exact=False,
    )
    return table, buckets, max_q


@no_autocast
def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    compute_dtype: torch.dtype | None = None,
    window_size: tuple[int, int] = (-1, -1),
    *,
    position_bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_seqlen_q: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence attention in ``compute_dtype`` (float32 by default; float64 for float64 inputs).

    Differentiable through torch autograd. Reads the offsets on the host (one sync on
    CUDA): this is an oracle and the CPU path, not the GPU hot path. ``dropout_mask``
    (optional, ``[H, Tq, max_k]`` bool, True = keep) applies attention dropout with
    probability ``dropout_p`` exactly as the kernels draw it. ``window_size``: ``(left, right)``
    sliding window (see the module docstring), combined with ``causal``. ``position_bias``:
    ``(table [num_buckets, H], buckets)``, the relative-position bias of the module docstring,
    its table read in ``compute_dtype`` (differentiable), its buckets built for queries of up
    to ``max_seqlen_q`` tokens (default: the longest query sequence).
    Returns ``(out [Tq, H, D] in q.dtype, lse [Tq, H] float32)``.
    """
    fn = "ragged.reference_attention"
    window = check_window(fn, window_size)
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    dtype = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    bias = _bias_of(fn, position_bias, heads, q.device, cq, ck, max_seqlen_q)
    table = None if bias is None else bias[0].to(dtype).t()  # [H, num_buckets]
    outs, lses = [], []
    for b in range(len(cq) - 1):
        qb = q[cq[b] : cq[b + 1]].to(dtype).transpose(0, 1)  # [H, Lq, D]
        kb = k[ck[b] : ck[b + 1]].to(dtype).transpose(0, 1).repeat_interleave(group, 0)
        vb = v[ck[b] : ck[b + 1]].to(dtype).transpose(0, 1).repeat_interleave(group, 0)
        lq, lk = qb.shape[1], kb.shape[1]
        s = torch.matmul(qb, kb.transpose(1, 2)) * scale  # [H, Lq, Lk]
        if bias is not None and table is not None:
            s = s + table[:, bucket_block(bias[1], lq, lk, bias[2])]
        seen = _visible(lq, lk, causal, window, q.device)
        if seen is not None:
            s = s.masked_fill(~seen, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [H, Lq]; -inf if no key
        p = torch.exp(s - lse.unsqueeze(-1).clamp_min(torch.finfo(dtype).min))
        p = torch.nan_to_num(p, nan=0.0)
        if dropout_mask is not None and dropout_p > 0:
            keep = dropout_mask[:, cq[b] : cq[b + 1], :lk]
            p = torch.where(keep, p / (1.0 - dropout_p), torch.zeros((), dtype=dtype, device=p.device))
        outs.append(torch.matmul(p, vb).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    if not outs:  # B = 0 (so T = 0): empty results that stay in the autograd graph
        out = q * 0 if table is None else q * 0 + table.sum() * 0
        return out, torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
    out = torch.cat(outs).to(q.dtype)
    return out, torch.cat(lses).to(torch.float32)


@no_autocast
def reference_attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    window_size: tuple[int, int] = (-1, -1),
    *,
    position_bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_seqlen_q: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of :func:`reference_attention` (float32; float64 for float64 inputs), written out:
    ``(dq, dk, dv)``, and ``dtable`` (the table's shape and dtype) after them with ``position_bias``.

    With ``P = softmax(S)``, ``Z`` the dropout keep mask scaled by ``1 / (1 - p)`` and
    ``O = (P * Z) V``: ``dV = (P * Z)^T dO``, ``dP = (dO V^T) * Z``,
    ``dS = P * (dP - rowsum(dO * O))``, ``dQ = scale * dS K``, ``dK = scale * dS^T Q``; for
    GQA the key/value gradients are summed over each group's query heads. The bias is added
    to ``S`` itself, so ``dtable[n, h]`` is the sum of ``dS`` of head ``h`` over the (query, key)
    pairs of bucket ``n``. Explicit formulas rather than autograd: this also runs inside the
    ``ragged::attention_backward`` op, where autograd is off.
    """
    fn = "ragged.reference_attention_backward"
    window = check_window(fn, window_size)
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    bias = _bias_of(fn, position_bias, heads, q.device, cq, ck, max_seqlen_q)
    if bias is not None:
        table = bias[0].to(dtype).t()  # [H, num_buckets]
        dtable = torch.zeros(bias[0].shape, dtype=dtype, device=q.device)
    for b in range(len(cq) - 1):
        qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
        lq, lk = qe - qs, ke - ks
        if lq == 0 or lk == 0:
            continue
        qb = q[qs:qe].to(dtype).transpose(0, 1)  # [H, Lq, D]
        kb = k[ks:ke].to(dtype).transpose(0, 1).repeat_interleave(group, 0)  # [H, Lk, D]
        vb = v[ks:ke].to(dtype).transpose(0, 1).repeat_interleave(group, 0)
        dob = do[qs:qe].to(dtype).transpose(0, 1)
        s = torch.matmul(qb, kb.transpose(1, 2)) * scale
        if bias is not None:
            rows = bucket_block(bias[1], lq, lk, bias[2])
            s = s + table[:, rows]
        seen = _visible(lq, lk, causal, window, q.device)
        if seen is not None:
            s = s.masked_fill(~seen, float("-inf"))
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.nan_to_num(torch.exp(s - lse.clamp_min(torch.finfo(dtype).min)), nan=0.0)
        zp = p
        if dropout_mask is not None and dropout_p > 0:
            keep = dropout_mask[:, qs:qe, :lk].to(dtype) / (1.0 - dropout_p)
            zp = p * keep
        out = torch.matmul(zp, vb)
        dvb = torch.matmul(zp.transpose(1, 2), dob)  # [H, Lk, D]
        dp = torch.matmul(dob, vb.transpose(1, 2))
        if zp is not p:
            dp = dp * keep
        ds = p * (dp - (dob * out).sum(-1, keepdim=True))
        if bias is not None:
            dtable.index_add_(0, rows.reshape(-1), ds.reshape(heads, -1).t())
        dq[qs:qe] = (torch.matmul(ds, kb) * scale).transpose(0, 1)
        dkb = torch.matmul(ds.transpose(1, 2), qb) * scale
        dk[ks:ke] = dkb.view(kv_heads, group, lk, head_dim).sum(1).transpose(0, 1)
        dv[ks:ke] = dvb.view(kv_heads, group, lk, head_dim).sum(1).transpose(0, 1)
    if bias is not None:
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dtable.to(bias[0].dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_M32 = 0xFFFFFFFF
_KEY_STEP = 0x9E3779B1  # the per-key increment of the element draws (2**32 / golden ratio, odd)
_HASH_ELEMENTS = 1 << 22  # elements per chunk of hashed_keep_mask (its int64 temporaries: 32 MiB)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for ``x`` in [0, 2**32) held in int64, without leaving int64's range
    (the high half of ``c`` only contributes its product's low 16 bits, shifted up)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """The kernels' 32-bit mixer (``attention_common._fmix32``) on int64 tensors in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def hashed_keep_mask(
    seed: int, dropout_p: float, heads: int, total_q: int, max_k: int, device: torch.device | str
) -> torch.Tensor:
    """``[H, Tq, max(max_k, 1)]`` bool: the keep mask of the kernels' counter-based hash
    (``attention_common._keep``) for ``seed``, in torch on any device. Row key
    ``r = fmix(lo32(h * Tq + t) ^ fmix(hi32(h * Tq + t) + lo32(seed)))`` for query token ``t``
    (packed index) of head ``h``; key ``j`` (index within the sequence) is kept when the top 24
    bits of ``fmix(r + j * 0x9E3779B1)`` are at least ``float32(dropout_p) * 2**24``. Drawn in
    chunks of rows, so its int64 temporaries stay small."""
    max_k = max(max_k, 1)
    out = torch.empty((heads, total_q, max_k), dtype=torch.bool, device=device)
    threshold = float(torch.tensor(dropout_p, dtype=torch.float32)) * 16777216.0
    seed_lo = int(seed) & _M32
    keys = _mul32(torch.arange(max_k, dtype=torch.int64, device=device), _KEY_STEP)
    flat = out.view(heads * total_q, max_k)
    step = max(1, _HASH_ELEMENTS // max_k)
    for start in range(0, heads * total_q, step):
        rows = torch.arange(start, min(start + step, heads * total_q), dtype=torch.int64, device=device)
        hi = _fmix32(((rows >> 32) + seed_lo) & _M32)
        r = _fmix32((rows & _M32) ^ hi)
        x = _fmix32((r[:, None] + keys[None, :]) & _M32)
        flat[start : start + rows.shape[0]] = (x >> 8) >= threshold
    return out


def reference_dropout_mask(
    seed: int, dropout_p: float, cu_seqlens_q: torch.Tensor, heads: int, total_q: int, max_k: int, device: torch.device
) -> torch.Tensor:
    """``[H, Tq, max_k]`` keep mask for ``seed``: the mask every backend's kernels draw, so the
    reference drops the same entries. On a CUDA device with Triton the kernels' own mask kernel
    draws it; elsewhere (the CPU, where Triton would only run interpreted) :func:`hashed_keep_mask`
    computes the same hash in torch. A seed drawn on the device (see :func:`dropout_seed`) is
    read back first: outside a graph capture only (the reference cannot be captured)."""
    if isinstance(seed, torch.Tensor):
        seed = int(seed.reshape(-1)[0].item())
    device = torch.device(device)
    if device.type == "cuda" and backends.triton_reason(device) is None:
        from ..kernels.triton.attention import dropout_keep_mask

        return dropout_keep_mask(seed, dropout_p, cu_seqlens_q, heads, total_q, max_k, device)
    return hashed_keep_mask(seed, dropout_p, heads, total_q, max_k, device)
