"""Triton kernels of the varying-vocabulary projection (segmented GEMM through id lists).

Sequence b has T_b tokens (``h_off``) and V_b candidate ids (``ids[v_off[b]:v_off[b+1]]``,
or the whole of ``ids`` for a shared vocabulary). Its logits are the ``[T_b, V_b]`` block
``hidden_b @ weight[ids_b].T (+ bias[ids_b])`` stored row-major at ``l_off[b]`` of a flat
output. Weight rows are read through the id list: no gathered copy of W is made.

Work lists. A forward program computes one (sequence, row tile, column tile) item. Items
are numbered by the prefix sums of ``ceil(T_b / BLOCK_M) * ceil(V_b / BLOCK_N)``, which
every program computes from the offsets itself (B <= 4096; no extra launch), or reads from
a work list built on the device. The grid is an upper bound known on the host
(``total / (BM*BN) + T / BM + S / BN + B``); programs past the last item exit at once.

Backward: ``d_hidden`` is the segmented GEMM of the logits' gradient with the same weight
rows (one program per (sequence, row tile) x d tile); ``d_weight`` sums each sequence's
``g_b.T @ hidden_b`` into the rows ``ids_b`` (one program per (sequence, column tile) x d
tile), with atomic adds into a ``[V, d]`` tensor of the weight's dtype, or, with
``deterministic=True``, into one fp32 row per (sequence, candidate) that are then summed by
id in a fixed order. Accumulation is fp32; float32 inputs use IEEE dots. The fused
cross-entropy on these kernels is :mod:`ragged.kernels.triton.vocab_cross_entropy`.

Trusted ids. The ids are not checked here (the ops check them where that costs no wait,
see :mod:`ragged.ops.vocab`), so every read and write through an id is masked to
``0 <= id < V``: a candidate outside the vocabulary scores 0 (no weight row, no bias), its
logit's gradient reaches no row of ``d_weight`` / ``d_bias`` and contributes nothing to
``d_hidden``. Offsets, ids, targets and the bias are read with unit stride: the launchers
make them contiguous (a copy only for a strided view).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import overload

import torch
import triton
import triton.language as tl

from ...backends import triton_interpreted as interpreted
from ...records.vocab import VocabGrads, VocabProjectionArgs, VocabProjectionBackwardInputs, VocabProjectionOutput
from .launch import cached_launch

_INLINE_MAX_BATCH = 4096


@triton.jit
def _items(
    h_off,
    v_off,
    batch,
    shared_v,
    b,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SHARED: tl.constexpr,
    USE_ROWS: tl.constexpr,
    USE_COLS: tl.constexpr,
):
    """Work items of sequences ``b`` (a vector): row tiles x column tiles (either may be off)."""
    ok = b < batch
    n = tl.full(b.shape, 1, tl.int32)
    if USE_ROWS:
        t_len = tl.load(h_off + b + 1, mask=ok, other=0) - tl.load(h_off + b, mask=ok, other=0)
        n = n * ((t_len + (BLOCK_R - 1)) // BLOCK_R).to(tl.int32)
    if USE_COLS:
        if SHARED:
            v_len = tl.zeros(b.shape, tl.int32) + shared_v
        else:
            v_len = tl.load(v_off + b + 1, mask=ok, other=0) - tl.load(v_off + b, mask=ok, other=0)
        n = n * ((v_len + (BLOCK_C - 1)) // BLOCK_C).to(tl.int32)
    return tl.where(ok, n, 0)


@triton.jit
def locate(
    h_off,
    v_off,
    work,
    batch,
    shared_v,
    n_steps,
    item,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SHARED: tl.constexpr,
    USE_ROWS: tl.constexpr,
    USE_COLS: tl.constexpr,
    INLINE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Work item -> (sequence b, item index within b, total items)."""
    if INLINE:
        carry = item * 0
        count = item * 0
        before = item * 0
        for start in range(0, batch, CHUNK):
            idx = start + tl.arange(0, CHUNK)
            incl = (
                tl.cumsum(_items(h_off, v_off, batch, shared_v, idx, BLOCK_R, BLOCK_C, SHARED, USE_ROWS, USE_COLS), 0)
                + carry
            )
            done = (idx < batch) & (incl <= item)
            count += tl.sum(done.to(tl.int32), 0)
            before = tl.maximum(before, tl.max(tl.where(done, incl, 0), 0))
            carry = tl.max(tl.where(idx < batch, incl, carry), 0)
        return count, item - before, carry
    else:
        lo = item * 0
        hi = lo + batch - 1
        for _ in range(n_steps):
            mid = (lo + hi + 1) // 2
            up = tl.load(work + mid) <= item
            lo = tl.where(up, mid, lo)
            hi = tl.where(up, hi, mid - 1)
        return lo, item - tl.load(work + lo), tl.load(work + batch)


@triton.jit
def segment(h_off, v_off, l_off, shared_v, b, SHARED: tl.constexpr):
    """(first token, T_b, first candidate, V_b, first logit) of sequence b."""
    t0 = tl.load(h_off + b).to(tl.int64)
    t_len = (tl.load(h_off + b + 1) - t0).to(tl.int32)
    if SHARED:
        v0 = t0 * 0
        v_len = t_len * 0 + shared_v
    else:
        v0 = tl.load(v_off + b).to(tl.int64)
        v_len = (tl.load(v_off + b + 1) - v0).to(tl.int32)
    return t0, t_len, v0, v_len, tl.load(l_off + b).to(tl.int64)


@triton.jit
def tile_of(IDS, local, t_len, v0, v_len, vocab_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Item ``local`` of a sequence -> its rows, columns, their masks, the columns' ids and
    the mask of the columns whose id lies in ``[0, vocab_size)`` (items run over column
    tiles first, then row tiles)."""
    n_col = (v_len + BLOCK_N - 1) // BLOCK_N
    r_tile = local // n_col
    c_tile = local - r_tile * n_col
    rows = r_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = c_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < t_len
    col_ok = cols < v_len
    ids = tl.load(IDS + v0 + cols, mask=col_ok, other=0).to(tl.int64)
    return rows, cols, row_ok, col_ok, ids, in_vocab(ids, col_ok, vocab_size)


@triton.jit
def in_vocab(ids, ok, vocab_size):
    """``ok`` where the id can be read: trusted ids are never followed outside ``[0, V)``."""
    return ok & (ids >= 0) & (ids < vocab_size)


@triton.jit
def logit_tile(
    H,
    W,
    BIAS,
    t0,
    rows,
    row_ok,
    ids,
    id_ok,
    dim,
    stride_ht,
    stride_wv,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = H + (t0 + rows)[:, None] * stride_ht + offs_k[None, :]
    w_ptr = W + ids[None, :] * stride_wv + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, dim, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptr, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptr, mask=id_ok[None, :], other=0.0)
        else:
            k_ok = (k + offs_k) < dim
            a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr, mask=id_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(a, w, input_precision=PRECISION)
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(BIAS + ids, mask=id_ok, other=0.0).to(tl.float32)[None, :]
    return acc


@cached_launch
@triton.jit
def _fwd_kernel(
    H,
    W,
    BIAS,
    IDS,
    OUT,
    h_off,
    v_off,
    l_off,
    work,
    batch,
    shared_v,
    n_steps,
    dim,
    vocab_size,
    stride_ht,
    stride_wv,
    HAS_BIAS: tl.constexpr,
    SHARED: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INLINE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    item = tl.program_id(0)
    b, local, n_items = locate(
        h_off, v_off, work, batch, shared_v, n_steps, item, BLOCK_M, BLOCK_N, SHARED, True, True, INLINE, CHUNK
    )
    if item >= n_items:
        return
    t0, t_len, v0, v_len, lb = segment(h_off, v_off, l_off, shared_v, b, SHARED)
    rows, cols, row_ok, col_ok, ids, id_ok = tile_of(IDS, local, t_len, v0, v_len, vocab_size, BLOCK_M, BLOCK_N)
    acc = logit_tile(
        H,
        W,
        BIAS,
        t0,
        rows,
        row_ok,
        ids,
        id_ok,
        dim,
        stride_ht,
        stride_wv,
        HAS_BIAS,
        EVEN_K,
        PRECISION,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    out = OUT + lb + rows.to(tl.int64)[:, None] * v_len + cols[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@cached_launch
@triton.jit
def _dhidden_kernel(
    G,
    W,
    IDS,
    DH,
    h_off,
    v_off,
    l_off,
    work,
    batch,
    shared_v,
    n_steps,
    dim,
    vocab_size,
    stride_wv,
    stride_dht,
    SHARED: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INLINE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """d_hidden[rows, dd] = sum over candidates c of g[rows, c] * W[ids_c, dd]."""
    item = tl.program_id(0)
    b, r_tile, n_items = locate(
        h_off, v_off, work, batch, shared_v, n_steps, item, BLOCK_M, 1, SHARED, True, False, INLINE, CHUNK
    )
    if item >= n_items:
        return
    t0, t_len, v0, v_len, lb = segment(h_off, v_off, l_off, shared_v, b, SHARED)
    rows = r_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < t_len
    d_ok = dd < dim
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    g_rows = G + lb + rows.to(tl.int64)[:, None] * v_len
    for c in range(0, v_len, BLOCK_K):
        cc = c + offs_k
        c_ok = cc < v_len
        g = tl.load(g_rows + cc[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0)
        ids = tl.load(IDS + v0 + cc, mask=c_ok, other=0).to(tl.int64)
        w = tl.load(
            W + ids[:, None] * stride_wv + dd[None, :],
            mask=in_vocab(ids, c_ok, vocab_size)[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc += tl.dot(g.to(w.dtype), w, input_precision=PRECISION)
    tl.store(
        DH + (t0 + rows)[:, None] * stride_dht + dd[None, :],
        acc.to(DH.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@cached_launch
@triton.jit
def _dweight_kernel(
    G,
    H,
    IDS,
    DW,
    DB,
    h_off,
    v_off,
    l_off,
    work,
    batch,
    shared_v,
    n_steps,
    dim,
    vocab_size,
    stride_ht,
    stride_dwv,
    SHARED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ATOMIC: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INLINE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Rows ids_b[cols] of d_weight gain g_b[:, cols].T @ hidden_b[:, dd] (and d_bias the column sums).

    ATOMIC: fp32 atomic adds into DW [V, d] / DB [V]. Otherwise DW / DB have one row per
    (sequence, candidate) (index v0 + col) and are reduced by id afterwards."""
    item = tl.program_id(0)
    b, c_tile, n_items = locate(
        h_off, v_off, work, batch, shared_v, n_steps, item, 1, BLOCK_N, SHARED, False, True, INLINE, CHUNK
    )
    if item >= n_items:
        return
    t0, t_len, v0, v_len, lb = segment(h_off, v_off, l_off, shared_v, b, SHARED)
    cols = c_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    dd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < v_len
    d_ok = dd < dim
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    gsum = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r in range(0, t_len, BLOCK_K):
        rr = r + offs_k
        r_ok = rr < t_len
        g_t = tl.load(
            G + lb + rr.to(tl.int64)[None, :] * v_len + cols[:, None], mask=col_ok[:, None] & r_ok[None, :], other=0.0
        )  # [BLOCK_N, BLOCK_K]
        h = tl.load(
            H + (t0 + rr)[:, None] * stride_ht + dd[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_D]
        acc += tl.dot(g_t.to(h.dtype), h, input_precision=PRECISION)
        if HAS_BIAS:
            gsum += tl.sum(g_t.to(tl.float32), 1)
    if ATOMIC:
        target = tl.load(IDS + v0 + cols, mask=col_ok, other=0).to(tl.int64)
        col_ok = in_vocab(target, col_ok, vocab_size)  # no row outside d_weight is written
    else:
        if SHARED:
            target = b.to(tl.int64) * shared_v + cols
        else:
            target = v0 + cols
    mask = col_ok[:, None] & d_ok[None, :]
    ptr = DW + target[:, None] * stride_dwv + dd[None, :]
    if ATOMIC:
        tl.atomic_add(ptr, acc.to(DW.dtype.element_ty), mask=mask, sem="relaxed")
    else:
        tl.store(ptr, acc, mask=mask)
    if HAS_BIAS:
        if tl.program_id(1) == 0:
            if ATOMIC:
                tl.atomic_add(DB + target, gsum.to(DB.dtype.element_ty), mask=col_ok, sem="relaxed")
            else:
                tl.store(DB + target, gsum, mask=col_ok)


# --------------------------------------------------------------------------------------
# Launchers


def _pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (>= 1). Plain Python: ``triton.next_power_of_2`` is
    a constexpr function whose host call costs microseconds."""
    return 1 << max(n - 1, 0).bit_length()


def precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def config(dim: int, max_t: int, max_v: int, dtype: torch.dtype, interp: bool):
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the forward and of the cross-entropy
    gradient tile: rows of 16..64 tokens and hundreds of candidates per sequence, K = d."""
    if interp:
        return 16, 16, 16, 4, 1
    block_m = max(16, min(64, triton.next_power_of_2(max(max_t, 1))))
    block_n = 128 if max_v >= 128 else max(16, triton.next_power_of_2(max(max_v, 1)))
    if dtype == torch.float32:
        return min(block_m, 32), min(block_n, 64), 32, 4, 2
    # the fastest forward tile of bench/results/tune_vocab_h200.txt (bench/tune_vocab.py, bf16
    # d=1024, T_i 16..64, |V_i| 500..2000): (64, 128, 64, 8 warps, 4 stages), ahead of 4 warps, 3 stages
    return block_m, block_n, 64, (8 if block_m * block_n >= 64 * 128 else 4), 4


@functools.cache
def _dhidden_config(dim: int, max_t: int, dtype: torch.dtype, interp: bool):
    """(BLOCK_M, BLOCK_D, BLOCK_K, warps, stages) of d_hidden (K runs over candidates)."""
    if interp:
        return 16, 16, 16, 4, 1
    block_m = max(16, min(64, triton.next_power_of_2(max(max_t, 1))))
    if dtype == torch.float32:
        return min(block_m, 32), 64, 32, 4, 2
    # the fastest d_hidden tile of bench/results/tune_vocab_h200.txt, ahead of (.., 64, 32, 4, 2)
    return block_m, 128, 64, 8, 3


@functools.cache
def _dweight_config(dim: int, max_t: int, dtype: torch.dtype, interp: bool):
    """(BLOCK_N, BLOCK_D, BLOCK_K, warps, stages) of d_weight (K runs over tokens)."""
    if interp:
        return 16, 16, 16, 4, 1
    if dtype == torch.float32:
        return 64, 64, 32, 4, 2
    return 64, 128, 32, 4, 2  # the fastest d_weight tile of bench/results/tune_vocab_h200.txt, ahead of (64, 64, ..)


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its last dim (the kernels step through rows by one stride)."""
    return t if t.stride(-1) == 1 else t.contiguous()


@overload
def unit_stride(t: torch.Tensor) -> torch.Tensor: ...
@overload
def unit_stride(t: None) -> None: ...
@overload
def unit_stride(t: torch.Tensor | None) -> torch.Tensor | None: ...
def unit_stride(t):
    """A 1-D tensor the kernels index as ``ptr + i`` (offsets, ids, targets, bias), with unit
    stride: a strided or expanded view becomes a copy (None stays None)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


@dataclasses.dataclass(frozen=True, eq=False)
class Segments:
    """A batch (or a chunk of one) as the kernels index it; every tensor of unit stride."""

    h_off: torch.Tensor  # [B+1] token offsets
    v_off: torch.Tensor | None  # [B+1] candidate offsets; None: ``ids`` shared by every sequence
    l_off: torch.Tensor  # int64 [B+1], first logit of each sequence
    ids: torch.Tensor  # the candidate ids
    batch: int  # B
    shared_v: int  # S = len(ids) for a shared vocabulary, 0 otherwise

    @property
    def v_arg(self) -> torch.Tensor:
        """The candidate offsets' pointer of the kernels (a placeholder they never read when shared)."""
        return self.h_off if self.v_off is None else self.v_off

    @property
    def n_cand(self) -> int:
        """Number of (sequence, candidate) pairs."""
        return self.ids.shape[0] * (self.batch if self.v_off is None else 1)


def segments(h_off: torch.Tensor, v_off: torch.Tensor | None, l_off: torch.Tensor, ids: torch.Tensor) -> Segments:
    """The :class:`Segments` of the ops' operands (a strided view becomes a copy)."""
    v_off, ids = unit_stride(v_off), unit_stride(ids)
    return Segments(
        unit_stride(h_off), v_off, unit_stride(l_off), ids, h_off.shape[0] - 1, ids.shape[0] if v_off is None else 0
    )


def worklist(seg: Segments, block_r: int, block_c: int, use_rows: bool, use_cols: bool):
    """(work tensor or a placeholder, INLINE, CHUNK, n_steps) for the kernels' locate."""
    batch, h_off = seg.batch, seg.h_off
    if batch <= _INLINE_MAX_BATCH:
        return h_off, True, min(1024, max(16, _pow2(batch))), 0
    n = torch.ones(batch, dtype=torch.int64, device=h_off.device)
    if use_rows:
        n = n * torch.div(h_off[1:] - h_off[:-1] + (block_r - 1), block_r, rounding_mode="floor")
    if use_cols:
        v_off = seg.v_off
        v_len = (v_off[1:] - v_off[:-1]) if v_off is not None else torch.full_like(n, seg.shared_v)
        n = n * torch.div(v_len + (block_c - 1), block_c, rounding_mode="floor")
    work = torch.zeros(batch + 1, dtype=torch.int32, device=h_off.device)
    torch.cumsum(n, 0, out=work[1:])
    return work, False, 16, max(batch - 1, 0).bit_length()


def forward(args: VocabProjectionArgs) -> VocabProjectionOutput:
    """Logits ``[total]`` in hidden's dtype: the ``vocab_projection`` op's forward."""
    hidden, weight, bias = row_major(args.hidden), row_major(args.weight), unit_stride(args.bias)
    total, max_t, max_v = args.total, args.max_t, args.max_v
    seg = segments(args.h_off, args.v_off, args.l_off, args.ids)
    out = torch.empty(total, dtype=hidden.dtype, device=hidden.device)
    batch = seg.batch
    if total == 0 or batch == 0:
        return VocabProjectionOutput(out)
    dim = hidden.shape[1]
    bm, bn, bk, warps, stages = config(dim, max_t, max_v, hidden.dtype, interpreted())
    work, inline, chunk, n_steps = worklist(seg, bm, bn, True, True)
    grid = (total // (bm * bn) + hidden.shape[0] // bm + seg.n_cand // bn + 2 * batch + 1,)
    _fwd_kernel[grid](
        hidden,
        weight,
        bias if bias is not None else hidden,
        seg.ids,
        out,
        seg.h_off,
        seg.v_arg,
        seg.l_off,
        work,
        batch,
        seg.shared_v,
        n_steps,
        dim,
        weight.shape[0],
        hidden.stride(0),
        weight.stride(0),
        HAS_BIAS=bias is not None,
        SHARED=seg.v_off is None,
        EVEN_K=dim % bk == 0,
        PRECISION=precision(hidden.dtype),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        INLINE=inline,
        CHUNK=chunk,
        num_warps=warps,
        num_stages=stages,
    )
    return VocabProjectionOutput(out)


def backward(
    args: VocabProjectionArgs, inputs: VocabProjectionBackwardInputs, *, dw_out=None, db_out=None, dh_out=None
) -> VocabGrads:
    """The gradients of hidden, weight and bias for the flat logits' gradient: the
    ``vocab_projection`` op's backward (see :func:`project_backward`; ``dw_out``, ``db_out``,
    ``dh_out``: its buffers)."""
    seg = segments(args.h_off, args.v_off, args.l_off, args.ids)
    return VocabGrads._make(
        project_backward(
            inputs.grad_logits.contiguous(),
            row_major(args.hidden),
            row_major(args.weight),
            seg,
            args.max_t,
            inputs.need_hidden,
            inputs.need_weight,
            inputs.need_bias,
            inputs.deterministic,
            dw_out,
            db_out,
            dh_out,
        )
    )


def project_backward(
    grad,
    hidden,
    weight,
    seg: Segments,
    max_t,
    need_hidden,
    need_weight,
    need_bias,
    deterministic,
    dw_out=None,
    db_out=None,
    dh_out=None,
):
    """(d_hidden, d_weight, d_bias), None for each one not asked for.

    d_weight is summed straight into a ``[V, d]`` tensor of the weight's dtype with atomic
    adds (each row receives one add per sequence whose candidates contain it: a few adds in
    fp16/bf16 precision, no fp32 copy of the weight-sized gradient). ``deterministic=True``
    writes one fp32 row per (sequence, candidate) and sums them by id in a fixed order.
    ``dw_out`` / ``db_out``: tensors to accumulate into (returned as d_weight / d_bias);
    ``dh_out``: rows to write d_hidden into (unit feature stride)."""
    d_hidden = d_weight = d_bias = None
    if need_hidden:
        d_hidden = _dhidden(grad, hidden, weight, seg, max_t, dh_out)
    if need_weight or need_bias:
        dw, db = _dweight(grad, hidden, weight, seg, max_t, need_bias, deterministic, dw_out, db_out)
        d_weight = dw if need_weight else None
        d_bias = db if need_bias else None
    return d_hidden, d_weight, d_bias


def _dhidden(grad, hidden, weight, seg: Segments, max_t, dh_out):
    batch, dim = seg.batch, hidden.shape[1]
    if dh_out is not None:
        d_hidden = dh_out.zero_() if batch == 0 else dh_out
    else:
        d_hidden = torch.zeros_like(hidden) if batch == 0 else torch.empty_like(hidden)
    if batch and hidden.shape[0]:
        bm, block_d, block_k, warps, stages = _dhidden_config(dim, max_t, hidden.dtype, interpreted())
        work, inline, chunk, n_steps = worklist(seg, bm, 1, True, False)
        _dhidden_kernel[(hidden.shape[0] // bm + batch, -(-dim // block_d))](
            grad,
            weight,
            seg.ids,
            d_hidden,
            seg.h_off,
            seg.v_arg,
            seg.l_off,
            work,
            batch,
            seg.shared_v,
            n_steps,
            dim,
            weight.shape[0],
            weight.stride(0),
            d_hidden.stride(0),
            SHARED=seg.v_off is None,
            PRECISION=precision(hidden.dtype),
            BLOCK_M=bm,
            BLOCK_D=block_d,
            BLOCK_K=block_k,
            INLINE=inline,
            CHUNK=chunk,
            num_warps=warps,
            num_stages=stages,
        )
    return d_hidden


def _dweight(grad, hidden, weight, seg: Segments, max_t, need_bias, deterministic, dw_out, db_out):
    batch, dim, vocab_size, device = seg.batch, hidden.shape[1], weight.shape[0], hidden.device
    atomic = not deterministic
    n_cand = seg.n_cand
    if atomic:
        dw = dw_out if dw_out is not None else torch.zeros((vocab_size, dim), dtype=weight.dtype, device=device)
        db = db_out if db_out is not None else torch.zeros(vocab_size, dtype=weight.dtype, device=device)
    else:
        dw = torch.zeros((n_cand, dim), dtype=torch.float32, device=device)
        db = torch.zeros(n_cand, dtype=torch.float32, device=device)
    if batch and n_cand and hidden.shape[0]:
        bn, block_d, block_k, warps, stages = _dweight_config(dim, max_t, hidden.dtype, interpreted())
        work, inline, chunk, n_steps = worklist(seg, 1, bn, False, True)
        _dweight_kernel[(n_cand // bn + batch, -(-dim // block_d))](
            grad,
            hidden,
            seg.ids,
            dw,
            db,
            seg.h_off,
            seg.v_arg,
            seg.l_off,
            work,
            batch,
            seg.shared_v,
            n_steps,
            dim,
            vocab_size,
            hidden.stride(0),
            dw.stride(0),
            SHARED=seg.v_off is None,
            HAS_BIAS=need_bias,
            ATOMIC=atomic,
            PRECISION=precision(hidden.dtype),
            BLOCK_N=bn,
            BLOCK_D=block_d,
            BLOCK_K=block_k,
            INLINE=inline,
            CHUNK=chunk,
            num_warps=warps,
            num_stages=stages,
        )
    if atomic:
        return dw, db
    dw, db = _reduce_by_id(dw, db, seg.ids, batch if seg.v_off is None else 1, vocab_size)
    dw, db = dw.to(weight.dtype), db.to(weight.dtype)
    return (dw if dw_out is None else dw_out.add_(dw)), (db if db_out is None else db_out.add_(db))


def _reduce_by_id(rows: torch.Tensor, bias_rows: torch.Tensor, ids: torch.Tensor, repeat: int, vocab_size: int):
    """Sum per-(sequence, candidate) rows into ``[V, d]`` in a fixed order (deterministic).

    Rows are stably sorted by id and each run of equal ids is summed by
    ``torch.segment_reduce``, so the result does not depend on scheduling. Costs one device
    read (the number of distinct ids). Rows of ids outside ``[0, V)`` land in a spare row
    ``V`` that is dropped (no write outside the result)."""
    flat_ids = ids.to(torch.int64).repeat(repeat)
    flat_ids = torch.where((flat_ids >= 0) & (flat_ids < vocab_size), flat_ids, vocab_size)
    order = torch.argsort(flat_ids, stable=True)
    uniq, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)
    dw = rows.new_zeros((vocab_size + 1, rows.shape[1]))
    db = bias_rows.new_zeros(vocab_size + 1)
    if uniq.numel():
        dw[uniq] = torch.segment_reduce(rows[order], "sum", lengths=counts)
        db[uniq] = torch.segment_reduce(bias_rows[order], "sum", lengths=counts)
    return dw[:vocab_size], db[:vocab_size]
