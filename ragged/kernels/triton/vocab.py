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
tile), with fp32 atomics into a ``[V, d]`` fp32 buffer, or, with ``deterministic=True``,
into one row per (sequence, candidate) that are then summed by id in a fixed order.
Accumulation is fp32; float32 inputs use IEEE dots.

Trusted ids. The ids are not checked here (the ops check them where that costs no wait,
see :mod:`ragged.ops.vocab`), so every read and write through an id is masked to
``0 <= id < V``: a candidate outside the vocabulary scores 0 (no weight row, no bias), its
logit's gradient reaches no row of ``d_weight`` / ``d_bias`` and contributes nothing to
``d_hidden``. Offsets, ids, targets and the bias are read with unit stride: the launchers
make them contiguous (a copy only for a strided view).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..._utils import to_device
from .launch import cached_launch

_INLINE_MAX_BATCH = 4096


@triton.jit
def _items(h_off, v_off, batch, shared_v, b, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, SHARED: tl.constexpr,
           USE_ROWS: tl.constexpr, USE_COLS: tl.constexpr):
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
def _locate(h_off, v_off, work, batch, shared_v, n_steps, item, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
            SHARED: tl.constexpr, USE_ROWS: tl.constexpr, USE_COLS: tl.constexpr, INLINE: tl.constexpr,
            CHUNK: tl.constexpr):
    """Work item -> (sequence b, item index within b, total items)."""
    if INLINE:
        carry = item * 0
        count = item * 0
        before = item * 0
        for start in range(0, batch, CHUNK):
            idx = start + tl.arange(0, CHUNK)
            incl = tl.cumsum(_items(h_off, v_off, batch, shared_v, idx, BLOCK_R, BLOCK_C, SHARED, USE_ROWS,
                                    USE_COLS), 0) + carry
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
def _segment(h_off, v_off, l_off, shared_v, b, SHARED: tl.constexpr):
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
def _tile_of(IDS, local, t_len, v0, v_len, vocab_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
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
    return rows, cols, row_ok, col_ok, ids, _id_ok(ids, col_ok, vocab_size)


@triton.jit
def _id_ok(ids, ok, vocab_size):
    """``ok`` where the id can be read: trusted ids are never followed outside ``[0, V)``."""
    return ok & (ids >= 0) & (ids < vocab_size)


@triton.jit
def _logit_tile(H, W, BIAS, t0, rows, row_ok, ids, id_ok, dim, stride_ht, stride_wv,
                HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
def _fwd_kernel(H, W, BIAS, IDS, OUT, h_off, v_off, l_off, work, batch, shared_v, n_steps, dim, vocab_size,
                stride_ht, stride_wv,
                HAS_BIAS: tl.constexpr, SHARED: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                INLINE: tl.constexpr, CHUNK: tl.constexpr):
    item = tl.program_id(0)
    b, local, n_items = _locate(h_off, v_off, work, batch, shared_v, n_steps, item, BLOCK_M, BLOCK_N, SHARED,
                                True, True, INLINE, CHUNK)
    if item >= n_items:
        return
    t0, t_len, v0, v_len, lb = _segment(h_off, v_off, l_off, shared_v, b, SHARED)
    rows, cols, row_ok, col_ok, ids, id_ok = _tile_of(IDS, local, t_len, v0, v_len, vocab_size, BLOCK_M, BLOCK_N)
    acc = _logit_tile(H, W, BIAS, t0, rows, row_ok, ids, id_ok, dim, stride_ht, stride_wv,
                      HAS_BIAS, EVEN_K, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    out = OUT + lb + rows.to(tl.int64)[:, None] * v_len + cols[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@cached_launch
@triton.jit
def _dhidden_kernel(G, W, IDS, DH, h_off, v_off, l_off, work, batch, shared_v, n_steps, dim, vocab_size,
                    stride_wv, stride_dht,
                    SHARED: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                    INLINE: tl.constexpr, CHUNK: tl.constexpr):
    """d_hidden[rows, dd] = sum over candidates c of g[rows, c] * W[ids_c, dd]."""
    item = tl.program_id(0)
    b, r_tile, n_items = _locate(h_off, v_off, work, batch, shared_v, n_steps, item, BLOCK_M, 1, SHARED,
                                 True, False, INLINE, CHUNK)
    if item >= n_items:
        return
    t0, t_len, v0, v_len, lb = _segment(h_off, v_off, l_off, shared_v, b, SHARED)
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
        w = tl.load(W + ids[:, None] * stride_wv + dd[None, :],
                    mask=_id_ok(ids, c_ok, vocab_size)[:, None] & d_ok[None, :], other=0.0)
        acc += tl.dot(g.to(w.dtype), w, input_precision=PRECISION)
    tl.store(DH + (t0 + rows)[:, None] * stride_dht + dd[None, :], acc.to(DH.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


@cached_launch
@triton.jit
def _dweight_kernel(G, H, IDS, DW, DB, h_off, v_off, l_off, work, batch, shared_v, n_steps, dim, vocab_size,
                    stride_ht, stride_dwv,
                    SHARED: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                    INLINE: tl.constexpr, CHUNK: tl.constexpr):
    """Rows ids_b[cols] of d_weight gain g_b[:, cols].T @ hidden_b[:, dd] (and d_bias the column sums).

    ATOMIC: fp32 atomic adds into DW [V, d] / DB [V]. Otherwise DW / DB have one row per
    (sequence, candidate) (index v0 + col) and are reduced by id afterwards."""
    item = tl.program_id(0)
    b, c_tile, n_items = _locate(h_off, v_off, work, batch, shared_v, n_steps, item, 1, BLOCK_N, SHARED,
                                 False, True, INLINE, CHUNK)
    if item >= n_items:
        return
    t0, t_len, v0, v_len, lb = _segment(h_off, v_off, l_off, shared_v, b, SHARED)
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
        g_t = tl.load(G + lb + rr.to(tl.int64)[None, :] * v_len + cols[:, None],
                      mask=col_ok[:, None] & r_ok[None, :], other=0.0)                  # [BLOCK_N, BLOCK_K]
        h = tl.load(H + (t0 + rr)[:, None] * stride_ht + dd[None, :], mask=r_ok[:, None] & d_ok[None, :],
                    other=0.0)                                                          # [BLOCK_K, BLOCK_D]
        acc += tl.dot(g_t.to(h.dtype), h, input_precision=PRECISION)
        if HAS_BIAS:
            gsum += tl.sum(g_t.to(tl.float32), 1)
    if ATOMIC:
        target = tl.load(IDS + v0 + cols, mask=col_ok, other=0).to(tl.int64)
        col_ok = _id_ok(target, col_ok, vocab_size)   # no row outside d_weight is written
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


def _interpreted() -> bool:
    from ...backends import triton_interpreted

    return triton_interpreted()


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)
def _config(dim: int, max_t: int, max_v: int, dtype: torch.dtype, interpreted: bool):
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the forward and of the cross-entropy
    gradient tile: rows of 16..64 tokens and hundreds of candidates per sequence, K = d."""
    if interpreted:
        return 16, 16, 16, 4, 1
    block_m = max(16, min(64, triton.next_power_of_2(max(max_t, 1))))
    block_n = 128 if max_v >= 128 else max(16, triton.next_power_of_2(max(max_v, 1)))
    if dtype == torch.float32:
        return min(block_m, 32), min(block_n, 64), 32, 4, 2
    # Swept on an H200 (bench/tune_vocab.py, bf16 d=1024, T_i 16..64, |V_i| 500..2000):
    # (64, 128, 64, 8 warps, 4 stages) 0.0517 ms, the former (.., 4 warps, 3 stages) 0.0555 ms.
    return block_m, block_n, 64, (8 if block_m * block_n >= 64 * 128 else 4), 4


@functools.lru_cache(maxsize=None)
def _ce_config(dim: int, max_t: int, max_v: int, dtype: torch.dtype, interpreted: bool):
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the fused cross-entropy forward (one
    program per row tile, looping over its candidates). Short row tiles and wide
    candidate tiles: (32, 256, 64, 8 warps, 3 stages) took 0.113 ms on the sweep's
    workload against 0.173 ms for the forward projection's tile."""
    if interpreted or dtype == torch.float32:
        return _config(dim, max_t, max_v, dtype, interpreted)
    block_m = max(16, min(32, triton.next_power_of_2(max(max_t, 1))))
    block_n = 256 if max_v >= 256 else max(16, triton.next_power_of_2(max(max_v, 1)))
    return block_m, block_n, 64, 8, 3


@functools.lru_cache(maxsize=None)
def _dhidden_config(dim: int, max_t: int, dtype: torch.dtype, interpreted: bool):
    """(BLOCK_M, BLOCK_D, BLOCK_K, warps, stages) of d_hidden (K runs over candidates)."""
    if interpreted:
        return 16, 16, 16, 4, 1
    block_m = max(16, min(64, triton.next_power_of_2(max(max_t, 1))))
    if dtype == torch.float32:
        return min(block_m, 32), 64, 32, 4, 2
    return block_m, 128, 64, 8, 3  # swept: 0.083 ms against 0.118 ms for (.., 64, 32, 4, 2)


@functools.lru_cache(maxsize=None)
def _dweight_config(dim: int, max_t: int, dtype: torch.dtype, interpreted: bool):
    """(BLOCK_N, BLOCK_D, BLOCK_K, warps, stages) of d_weight (K runs over tokens)."""
    if interpreted:
        return 16, 16, 16, 4, 1
    if dtype == torch.float32:
        return 64, 64, 32, 4, 2
    return 64, 128, 32, 4, 2  # swept: 0.121 ms against 0.137 ms for (64, 64, ..)


def _worklist(h_off, v_off, shared_v, batch, block_r, block_c, use_rows, use_cols):
    """(work tensor or a placeholder, INLINE, CHUNK, n_steps) for the kernels' _locate."""
    if batch <= _INLINE_MAX_BATCH:
        return h_off, True, min(1024, max(16, triton.next_power_of_2(batch))), 0
    n = torch.ones(batch, dtype=torch.int64, device=h_off.device)
    if use_rows:
        n = n * torch.div(h_off[1:] - h_off[:-1] + (block_r - 1), block_r, rounding_mode="floor")
    if use_cols:
        v_len = (v_off[1:] - v_off[:-1]) if v_off is not None else torch.full_like(n, shared_v)
        n = n * torch.div(v_len + (block_c - 1), block_c, rounding_mode="floor")
    work = torch.zeros(batch + 1, dtype=torch.int32, device=h_off.device)
    torch.cumsum(n, 0, out=work[1:])
    return work, False, 16, max(batch - 1, 0).bit_length()


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _unit(t: torch.Tensor | None) -> torch.Tensor | None:
    """A 1-D tensor the kernels index as ``ptr + i`` (offsets, ids, targets, bias), with unit
    stride: a strided or expanded view becomes a copy (None stays None)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def forward(hidden, h_off, weight, bias, ids, v_off, l_off, total, max_t, max_v):
    hidden, weight = _rows(hidden), _rows(weight)
    h_off, v_off, l_off, ids, bias = _unit(h_off), _unit(v_off), _unit(l_off), _unit(ids), _unit(bias)
    out = torch.empty(total, dtype=hidden.dtype, device=hidden.device)
    batch = h_off.shape[0] - 1
    if total == 0 or batch == 0:
        return out
    shared = v_off is None
    shared_v = ids.shape[0] if shared else 0
    dim = hidden.shape[1]
    bm, bn, bk, warps, stages = _config(dim, max_t, max_v, hidden.dtype, _interpreted())
    work, inline, chunk, n_steps = _worklist(h_off, v_off, shared_v, batch, bm, bn, True, True)
    n_cand = ids.shape[0] * (batch if shared else 1)
    grid = (total // (bm * bn) + hidden.shape[0] // bm + n_cand // bn + 2 * batch + 1,)
    _fwd_kernel[grid](hidden, weight, bias if bias is not None else hidden, ids, out, h_off,
                      v_off if v_off is not None else h_off, l_off, work, batch, shared_v, n_steps, dim,
                      weight.shape[0], hidden.stride(0), weight.stride(0),
                      HAS_BIAS=bias is not None, SHARED=shared, EVEN_K=dim % bk == 0,
                      PRECISION=_precision(hidden.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                      INLINE=inline, CHUNK=chunk, num_warps=warps, num_stages=stages)
    return out


def backward(grad, hidden, h_off, weight, ids, v_off, l_off, max_t, max_v, need_hidden, need_weight, need_bias,
             deterministic, dw_out=None, db_out=None, dh_out=None):
    """(d_hidden, d_weight, d_bias) of the projection for the flat logits' gradient ``grad``.

    d_weight is summed straight into a ``[V, d]`` tensor of the weight's dtype with atomic
    adds (each row receives one add per sequence whose candidates contain it: a few adds in
    fp16/bf16 precision, no fp32 copy of the weight-sized gradient). ``deterministic=True``
    writes one fp32 row per (sequence, candidate) and sums them by id in a fixed order.
    ``dw_out`` / ``db_out``: tensors to accumulate into (returned as d_weight / d_bias);
    ``dh_out``: rows to write d_hidden into (unit feature stride)."""
    hidden, weight, grad = _rows(hidden), _rows(weight), grad.contiguous()
    h_off, v_off, l_off, ids = _unit(h_off), _unit(v_off), _unit(l_off), _unit(ids)
    batch = h_off.shape[0] - 1
    shared = v_off is None
    shared_v = ids.shape[0] if shared else 0
    dim = hidden.shape[1]
    vocab_size = weight.shape[0]
    interp = _interpreted()
    precision = _precision(hidden.dtype)
    v_arg = v_off if v_off is not None else h_off
    d_hidden = d_weight = d_bias = None
    if need_hidden:
        if dh_out is not None:
            d_hidden = dh_out.zero_() if batch == 0 else dh_out
        else:
            d_hidden = torch.zeros_like(hidden) if batch == 0 else torch.empty_like(hidden)
        bm, block_d, block_k, warps, stages = _dhidden_config(dim, max_t, hidden.dtype, interp)
        if batch and hidden.shape[0]:
            work, inline, chunk, n_steps = _worklist(h_off, v_off, shared_v, batch, bm, 1, True, False)
            _dhidden_kernel[(hidden.shape[0] // bm + batch, triton.cdiv(dim, block_d))](
                grad, weight, ids, d_hidden, h_off, v_arg, l_off, work, batch, shared_v, n_steps, dim, vocab_size,
                weight.stride(0), d_hidden.stride(0), SHARED=shared, PRECISION=precision, BLOCK_M=bm,
                BLOCK_D=block_d, BLOCK_K=block_k, INLINE=inline, CHUNK=chunk, num_warps=warps,
                num_stages=stages)
    if need_weight or need_bias:
        atomic = not deterministic
        if atomic:
            dw = dw_out if dw_out is not None else torch.zeros((vocab_size, dim), dtype=weight.dtype,
                                                               device=hidden.device)
            db = db_out if db_out is not None else torch.zeros(vocab_size, dtype=weight.dtype, device=hidden.device)
        else:
            n_rows = ids.shape[0] * (batch if shared else 1)
            dw = torch.zeros((n_rows, dim), dtype=torch.float32, device=hidden.device)
            db = torch.zeros(n_rows, dtype=torch.float32, device=hidden.device)
        bn, block_d, block_k, warps, stages = _dweight_config(dim, max_t, hidden.dtype, interp)
        n_cand = ids.shape[0] * (batch if shared else 1)
        if batch and n_cand and hidden.shape[0]:
            work, inline, chunk, n_steps = _worklist(h_off, v_off, shared_v, batch, 1, bn, False, True)
            _dweight_kernel[(n_cand // bn + batch, triton.cdiv(dim, block_d))](
                grad, hidden, ids, dw, db, h_off, v_arg, l_off, work, batch, shared_v, n_steps, dim, vocab_size,
                hidden.stride(0), dw.stride(0), SHARED=shared, HAS_BIAS=need_bias, ATOMIC=atomic,
                PRECISION=precision, BLOCK_N=bn, BLOCK_D=block_d, BLOCK_K=block_k, INLINE=inline, CHUNK=chunk,
                num_warps=warps, num_stages=stages)
        if not atomic:
            dw, db = _reduce_by_id(dw, db, ids, batch if shared else 1, vocab_size)
            dw, db = dw.to(weight.dtype), db.to(weight.dtype)
            if dw_out is not None:
                dw = dw_out.add_(dw)
            if db_out is not None:
                db = db_out.add_(db)
        d_weight = dw if need_weight else None
        d_bias = db if need_bias else None
    return d_hidden, d_weight, d_bias


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


# --------------------------------------------------------------------------------------
# Fused subset cross-entropy
#
# Forward: one program per (sequence, row tile) streams over the sequence's candidate
# tiles, computing each logit tile (GEMM over d) and keeping only an online logsumexp,
# the target's logit and the sum of logits (for label smoothing) per token: the
# [sum T_i * V_i] logits are never stored.
# Backward: the logits' gradient g = w_t * (softmax - (1 - eps) * onehot - eps / V_b) is
# recomputed tile by tile into a buffer of at most CE_CHUNK elements (sequences are taken
# in chunks), and fed to the d_hidden / d_weight kernels above.

CE_CHUNK = 1 << 22


@cached_launch
@triton.jit
def _ce_fwd_kernel(H, W, BIAS, IDS, TGT, LOCAL, BAD, LOSS, LSE, h_off, v_off, l_off, work, batch, shared_v,
                   n_steps, dim, vocab_size, stride_ht, stride_wv, smoothing, ignore_index, n_search,
                   HAS_BIAS: tl.constexpr, SHARED: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                   GLOBAL: tl.constexpr, SMOOTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, INLINE: tl.constexpr, CHUNK: tl.constexpr):
    """Per token: the loss (1 - eps) * (lse - z_target) + eps * (lse - mean z) over its
    sequence's candidates (0 for a token without target) and the lse.

    GLOBAL=False: TGT holds each token's target as a local candidate index (-1: none).
    GLOBAL=True: TGT holds global ids; each is found by a binary search (``n_search``
    halvings) among its sequence's sorted candidates, its local index (-1: ignore_index
    or not found) is written to LOCAL, and BAD[0] / BAD[1] gain the count / the smallest
    index of the tokens whose target is neither found nor ignore_index.

    SMOOTH=False (``smoothing == 0``): the loss is lse - z_target, and the smoothing term
    is not computed at all (0 * (lse - mean z) would be NaN for a row without candidates)."""
    item = tl.program_id(0)
    b, r_tile, n_items = _locate(h_off, v_off, work, batch, shared_v, n_steps, item, BLOCK_M, 1, SHARED,
                                 True, False, INLINE, CHUNK)
    if item >= n_items:
        return
    t0, t_len, v0, v_len, lb = _segment(h_off, v_off, l_off, shared_v, b, SHARED)
    rows = r_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < t_len
    if GLOBAL:
        want = tl.load(TGT + t0 + rows, mask=row_ok, other=0).to(tl.int64)
        lo = tl.zeros([BLOCK_M], dtype=tl.int32)
        hi = tl.zeros([BLOCK_M], dtype=tl.int32) + v_len
        for _ in range(n_search):
            live = lo < hi
            mid = (lo + hi) // 2
            val = tl.load(IDS + v0 + mid, mask=row_ok & live, other=0).to(tl.int64)
            lo = tl.where(live & (val < want), mid + 1, lo)
            hi = tl.where(live & (val >= want), mid, hi)
        inside = row_ok & (lo < v_len)
        hit = tl.load(IDS + v0 + lo, mask=inside, other=0).to(tl.int64)
        found = inside & (hit == want)
        ignored = want == ignore_index
        tgt = tl.where(found & (~ignored), lo, -1)
        tl.store(LOCAL + t0 + rows, tgt, mask=row_ok)
        bad = row_ok & (~found) & (~ignored)
        n_bad = tl.sum(bad.to(tl.int32), 0)
        if n_bad > 0:
            tl.atomic_add(BAD, n_bad, sem="relaxed")
            # BAD[1] keeps 2**31 - 1 - (first bad token): a max over a zeroed tensor
            tl.atomic_max(BAD + 1, 2147483647 - tl.min(tl.where(bad, t0 + rows, 2147483647), 0), sem="relaxed")
    else:
        tgt = tl.load(TGT + t0 + rows, mask=row_ok, other=-1)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    zy = tl.zeros([BLOCK_M], dtype=tl.float32)
    zsum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c in range(0, v_len, BLOCK_N):
        cols = c + tl.arange(0, BLOCK_N)
        col_ok = cols < v_len
        ids = tl.load(IDS + v0 + cols, mask=col_ok, other=0).to(tl.int64)
        z = _logit_tile(H, W, BIAS, t0, rows, row_ok, ids, _id_ok(ids, col_ok, vocab_size), dim, stride_ht,
                        stride_wv, HAS_BIAS, EVEN_K, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        zy += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), 1)
        if SMOOTH:
            zsum += tl.sum(tl.where(col_ok[None, :], z, 0.0), 1)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(z - m_safe[:, None]), 1)
        m_i = m_new
    lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    loss = lse - zy
    if SMOOTH:
        # (1 - eps) * (lse - zy) + eps * (lse - mean z), written so that no factor multiplies
        # lse (-inf for a row without candidates): no 0 * inf at eps = 1 either
        loss += smoothing * (zy - zsum / tl.maximum(v_len, 1).to(tl.float32))
    tl.store(LOSS + t0 + rows, tl.where(tgt >= 0, loss, 0.0), mask=row_ok)
    tl.store(LSE + t0 + rows, lse, mask=row_ok)


@cached_launch
@triton.jit
def _ce_grad_kernel(H, W, BIAS, IDS, TGT, LSE, WT, G, h_off, v_off, l_off, work, batch, shared_v, n_steps, dim,
                    vocab_size, stride_ht, stride_wv, stride_wt, smoothing,
                    HAS_BIAS: tl.constexpr, SHARED: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                    SMOOTH: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    INLINE: tl.constexpr, CHUNK: tl.constexpr):
    """g[t, c] = WT[t] * (exp(z - lse) - (1 - eps) * [c == target] - eps / V_b), written flat at l_off
    (0 for a token without target). WT: the loss gradient, read with stride ``stride_wt``
    (0 for the broadcast gradient of a mean or a sum)."""
    item = tl.program_id(0)
    b, local, n_items = _locate(h_off, v_off, work, batch, shared_v, n_steps, item, BLOCK_M, BLOCK_N, SHARED,
                                True, True, INLINE, CHUNK)
    if item >= n_items:
        return
    t0, t_len, v0, v_len, lb = _segment(h_off, v_off, l_off, shared_v, b, SHARED)
    rows, cols, row_ok, col_ok, ids, id_ok = _tile_of(IDS, local, t_len, v0, v_len, vocab_size, BLOCK_M, BLOCK_N)
    z = _logit_tile(H, W, BIAS, t0, rows, row_ok, ids, id_ok, dim, stride_ht, stride_wv,
                    HAS_BIAS, EVEN_K, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    lse = tl.load(LSE + t0 + rows, mask=row_ok, other=0.0)
    tgt = tl.load(TGT + t0 + rows, mask=row_ok, other=-1)
    wt = tl.load(WT + (t0 + rows).to(tl.int64) * stride_wt, mask=row_ok & (tgt >= 0), other=0.0).to(tl.float32)
    p = tl.exp(z - lse[:, None])
    hit = (cols[None, :] == tgt[:, None]).to(tl.float32)
    if SMOOTH:
        g = p - (1.0 - smoothing) * hit - smoothing / v_len.to(tl.float32)
    else:
        g = p - hit
    g = g * wt[:, None]
    out = G + lb + rows.to(tl.int64)[:, None] * v_len + cols[None, :]
    tl.store(out, g.to(G.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def cross_entropy_forward(hidden, h_off, weight, bias, ids, v_off, l_off, target, smoothing, max_t, max_v,
                          ignore_index=None):
    """(loss, lse, local, bad) without storing logits; loss and lse ``[T]`` float32.

    ``ignore_index=None``: ``target`` holds each token's target as an index into its
    sequence's candidates (-1: no target; its loss is 0); ``local`` is that tensor (int32)
    and ``bad`` is None. Otherwise ``target`` holds global ids, located in the kernel:
    ``local`` ``[T]`` int32 gets each one's index among its candidates (-1 where it is
    ``ignore_index`` or not a candidate) and ``bad`` int32 ``[2]`` the number of tokens whose
    target is neither, and ``2**31 - 1`` minus the first such token (0 when none)."""
    hidden, weight = _rows(hidden), _rows(weight)
    h_off, v_off, l_off, ids, bias = _unit(h_off), _unit(v_off), _unit(l_off), _unit(ids), _unit(bias)
    target = _unit(target)
    globl = ignore_index is not None
    if not globl:
        target = target.to(torch.int32)
    total_t = hidden.shape[0]
    device = hidden.device
    # every token belongs to a row tile of its sequence: the kernel writes each row
    loss = torch.empty(total_t, dtype=torch.float32, device=device)
    lse = torch.empty(total_t, dtype=torch.float32, device=device)
    local = torch.empty(total_t, dtype=torch.int32, device=device) if globl else target
    bad = torch.zeros(2, dtype=torch.int32, device=device) if globl else None
    batch = h_off.shape[0] - 1
    if total_t == 0 or batch == 0:
        return loss, lse, local, bad
    shared = v_off is None
    shared_v = ids.shape[0] if shared else 0
    dim = hidden.shape[1]
    bm, bn, bk, warps, stages = _ce_config(dim, max_t, max_v, hidden.dtype, _interpreted())
    work, inline, chunk, n_steps = _worklist(h_off, v_off, shared_v, batch, bm, 1, True, False)
    _ce_fwd_kernel[(total_t // bm + batch,)](
        hidden, weight, bias if bias is not None else hidden, ids, target, local, bad if globl else local, loss, lse,
        h_off, v_off if v_off is not None else h_off, l_off, work, batch, shared_v, n_steps, dim, weight.shape[0],
        hidden.stride(0), weight.stride(0), float(smoothing), int(ignore_index) if globl else 0,
        max(int(max_v), 1).bit_length(), HAS_BIAS=bias is not None, SHARED=shared,
        EVEN_K=dim % bk == 0, PRECISION=_precision(hidden.dtype), GLOBAL=globl, SMOOTH=float(smoothing) != 0.0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, INLINE=inline, CHUNK=chunk, num_warps=warps, num_stages=stages)
    return loss, lse, local, bad


def cross_entropy_backward(grad_loss, hidden, h_off, weight, bias, ids, v_off, l_off, total, target_local, lse,
                           smoothing, max_t, max_v, need_hidden, need_weight, need_bias, deterministic,
                           host_h_off=None, host_v_off=None, chunk_elems=CE_CHUNK):
    """Gradients of ``sum_t grad_loss[t] * loss_t`` w.r.t. hidden, weight and bias.

    With the host offsets (``host_v_off`` ``None`` for a shared vocabulary) the batch is
    taken in chunks of at most ``chunk_elems`` logits (a sequence larger than that forms a
    chunk alone): the only logits-sized memory the loss holds. Without them, one chunk."""
    device = hidden.device
    hidden, weight = _rows(hidden), _rows(weight)
    h_off, v_off, l_off, ids, bias = _unit(h_off), _unit(v_off), _unit(l_off), _unit(ids), _unit(bias)
    lse = _unit(lse)
    target_local = target_local.to(torch.int32).contiguous()
    if grad_loss.dim() != 1 or grad_loss.shape[0] != hidden.shape[0]:
        grad_loss = grad_loss.expand(hidden.shape[0])
    batch = h_off.shape[0] - 1
    shared = v_off is None
    dim = hidden.shape[1]
    vocab_size = weight.shape[0]
    dw = torch.zeros((vocab_size, dim), dtype=weight.dtype, device=device) if need_weight or need_bias else None
    db = torch.zeros(vocab_size, dtype=weight.dtype, device=device) if need_bias else None
    single = host_h_off is None or (not shared and host_v_off is None) or total <= chunk_elems
    if batch == 0 or hidden.shape[0] == 0 or total == 0:
        return torch.zeros_like(hidden) if need_hidden else None, dw if need_weight else None, db
    # one chunk: d_hidden written by its kernel for every token; several: rows of sequences
    # without logits belong to no chunk and stay zero
    d_hidden = (torch.empty_like(hidden) if single else torch.zeros_like(hidden)) if need_hidden else None
    chunks = ([(h_off, v_off, l_off, ids, 0, hidden.shape[0], total, batch)] if single else
              _ce_chunks(h_off, v_off, l_off, ids, total, host_h_off, host_v_off, chunk_elems, device))
    bm, bn, bk, warps, stages = _config(dim, max_t, max_v, hidden.dtype, _interpreted())
    for c_h_off, c_v_off, c_l_off, c_ids, t_lo, t_hi, size, n in chunks:
        shared_v = c_ids.shape[0] if shared else 0
        hid_c = hidden[t_lo:t_hi]
        g = torch.empty(size, dtype=hidden.dtype, device=device)
        work, inline, chunk_w, n_steps = _worklist(c_h_off, c_v_off, shared_v, n, bm, bn, True, True)
        n_cand = c_ids.shape[0] * (n if shared else 1)
        grid = (size // (bm * bn) + (t_hi - t_lo) // bm + n_cand // bn + 2 * n + 1,)
        _ce_grad_kernel[grid](
            hid_c, weight, bias if bias is not None else hidden, c_ids, target_local[t_lo:t_hi], lse[t_lo:t_hi],
            grad_loss[t_lo:t_hi], g, c_h_off, c_v_off if c_v_off is not None else c_h_off, c_l_off, work, n,
            shared_v, n_steps, dim, vocab_size, hid_c.stride(0), weight.stride(0), grad_loss.stride(0),
            float(smoothing), HAS_BIAS=bias is not None, SHARED=shared, EVEN_K=dim % bk == 0,
            PRECISION=_precision(hidden.dtype), SMOOTH=float(smoothing) != 0.0,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, INLINE=inline, CHUNK=chunk_w, num_warps=warps, num_stages=stages)
        backward(g, hid_c, c_h_off, weight, c_ids, c_v_off, c_l_off, max_t, max_v, need_hidden, need_weight,
                 need_bias, deterministic, dw_out=dw, db_out=db,
                 dh_out=d_hidden[t_lo:t_hi] if need_hidden else None)
    return d_hidden, dw if need_weight else None, db


def _ce_chunks(h_off, v_off, l_off, ids, total, host_h_off, host_v_off, chunk_elems, device):
    """Yield (h_off, v_off, l_off, ids, first token, end token, logits, sequences) per chunk
    of at most ``chunk_elems`` logits; needs the host offsets (the caller takes the batch
    as one chunk without them)."""
    batch = h_off.shape[0] - 1
    shared = v_off is None

    def v_len(b):
        return ids.shape[0] if shared else host_v_off[b + 1] - host_v_off[b]

    start = 0
    while start < batch:
        stop, size = start, 0
        while stop < batch:
            extra = (host_h_off[stop + 1] - host_h_off[stop]) * v_len(stop)
            if stop > start and size + extra > chunk_elems:
                break
            size += extra
            stop += 1
        t_lo, t_hi = host_h_off[start], host_h_off[stop]
        if size and t_hi > t_lo:
            if start == 0 and stop == batch:
                yield h_off, v_off, l_off, ids, t_lo, t_hi, size, batch
            else:
                l_rel = [0]
                for b in range(start, stop):
                    l_rel.append(l_rel[-1] + (host_h_off[b + 1] - host_h_off[b]) * v_len(b))
                c_h_off = to_device([o - t_lo for o in host_h_off[start:stop + 1]], torch.int32, device)
                c_l_off = to_device(l_rel, torch.int64, device)
                if shared:
                    c_ids, c_v_off = ids, None
                else:
                    v_lo = host_v_off[start]
                    c_ids = ids[v_lo:host_v_off[stop]]
                    c_v_off = to_device([o - v_lo for o in host_v_off[start:stop + 1]], torch.int32, device)
                yield c_h_off, c_v_off, c_l_off, c_ids, t_lo, t_hi, size, stop - start
        start = stop
