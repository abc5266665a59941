"""The Triton kernels of varlen flash attention: forward, backward (dK/dV and dQ), dropout mask.

Launched by :mod:`ragged.kernels.triton.attention` (tile shapes, work lists, buffers).

Work lists. A forward program handles one (sequence b, query block m) item and one
query head. The items are numbered by the prefix sums of ``ceil(L_b / BLOCK_M)``; each
program computes them from the offsets itself (B <= 4096: vector prefix sums, no extra
launch) or binary-searches ``block_cum [B+1]`` built on the device by one small kernel
(:func:`_block_cum_kernel`). The grid is ``ceil(Tq / BLOCK_M) + B`` programs per head, an
upper bound known on the host (no sync); programs past the last item exit at once. So only
real query blocks are scheduled, never B x ceil(max_len / BLOCK_M). The backward's dK/dV
kernel works the same way over key blocks.

Offsets. The kernels trust them (``offsets[-1] == T``, non-decreasing, no length above
``max_seqlen``) and do not clip them to ``[0, T]``: clipping made the causal forward markedly
slower (its time without the clip: bench/results/attention_h200_quick_2c0093c.md).
:mod:`ragged.ops.attention` checks them where that reads no GPU memory, and on request
(``validate=True``).

Masks. Within a sequence, key blocks that every query row of the block may see run
without masks; only the last (ragged or causal-diagonal) blocks are masked, so a mask costs
nothing in the blocks between. A masked block masks every position a row may not see: keys
past the sequence as well as those outside the causal or window band, in the forward and in
the dQ loop alike (a key past the end loads as zeros and scores 0, and an unmasked 0 is not
harmless in the backward: see :func:`_dq_inner`). Causal masking is aligned to the bottom
right: query i sees keys j <= i + Lk - Lq.

Sliding windows (``WINDOW``). Query i sees keys ``i + shift - win_left <= j <= i + shift +
win_right`` (``shift = Lk - Lq``; the launcher folds causal masking in as ``win_right = 0`` and
gives an unbounded side a bound no sequence reaches). A query block loops over the key
blocks that meet the window of one of its rows, no others: masked blocks at both ends of
that span, unmasked ones between (:func:`_key_span`); a key block of the dK/dV kernel
loops over the query blocks in the same way (:func:`_query_span`). Without ``WINDOW`` the
kernels are those of full and causal attention, untouched by the window code.

Numerics: fp32 accumulation, exp2 with the scale folded in; ``lse`` (natural log) is
kept for the backward; rows that see no key give 0 (never NaN) and ``lse = -inf``.
float32 inputs use IEEE fp32 dots (no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_bias import _bias_row, _bias_tile, _bias_tile_t, _bucket_add, _diagonal_sums
from .attention_common import (
    _bounds,
    _in_window,
    _keep,
    _keep_t,
    _key_span,
    _locate,
    _query_span,
)
from .launch import cached_launch


@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    lo,
    hi,
    k_len,
    shift,
    win_left,
    win_right,
    offs_m,
    offs_n,
    offs_d,
    d_ok,
    qk_scale,
    seed,
    dropout_p,
    h,
    q_start,
    total_q,
    bias_row,
    bias_rows,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    DROPOUT: tl.constexpr,
    BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Online softmax over key blocks [lo, hi), masked (keys past the sequence, the causal
    diagonal, the window's edges) or not; ``BIAS``: the position bias of rows ``bias_rows`` added
    (head ``h``'s distance table row at ``bias_row``)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            col_ok = cols < k_len
            k = tl.load(
                k_base + cols[None, :] * stride_kt + offs_d[:, None], mask=col_ok[None, :] & d_ok[:, None], other=0.0
            )
            v = tl.load(
                v_base + cols[:, None] * stride_vt + offs_d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0
            )
        else:
            k = tl.load(k_base + cols[None, :] * stride_kt + offs_d[:, None], mask=d_ok[:, None], other=0.0)
            v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        if BIAS:
            s += _bias_tile(bias_row, bias_rows, cols, k_len, MASKED)
        if MASKED:
            ok = col_ok[None, :]
            if CAUSAL:
                ok = ok & (cols[None, :] <= offs_m[:, None] + shift)
            if WINDOW:
                ok = ok & _in_window(offs_m, cols, shift, win_left, win_right)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            keep = _keep(seed, dropout_p, h, q_start + offs_m, cols, total_q)
            p = tl.where(keep, p * (1.0 / (1.0 - dropout_p)), 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@cached_launch
@triton.jit(
    do_not_specialize=["batch", "n_steps", "seed", "total_q", "max_k", "win_left", "win_right", "max_q", "bias_span"]
)
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    cu_q,
    cu_k,
    block_cum,
    batch,
    n_steps,
    sm_scale,
    seed,
    seed_ptr,
    dropout_p,
    total_q,
    max_k,
    win_left,
    win_right,
    DIST,
    max_q,
    bias_span,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    DROPOUT: tl.constexpr,
    SEED_PTR: tl.constexpr,
    BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    INLINE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One query block of one head. ``BIAS``: the relative-position bias of the distance table
    ``DIST [H, bias_span]`` (see :mod:`.attention_bias`) added to every score."""
    item = tl.program_id(0)
    h = tl.program_id(1)
    b, m_blk, n_blocks, n_items = _locate(cu_q, block_cum, batch, n_steps, item, BLOCK_M, INLINE, CHUNK)
    if item >= n_items:
        return
    if SEED_PTR:  # the seed drawn on the device (a CUDA graph replays a new one each time)
        seed = tl.load(seed_ptr).to(tl.int32)
    q_start, q_len, k_start, k_len = _bounds(cu_q, cu_k, b)
    if CAUSAL:  # the heaviest (last) blocks of a sequence first
        m_blk = n_blocks - 1 - m_blk
    hk = h // GROUP
    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < q_len
    q = tl.load(
        Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    k_base = K + k_start * stride_kt + hk * stride_kh
    v_base = V + k_start * stride_vt + hk * stride_vh
    qk_scale = sm_scale * 1.4426950408889634
    bias_row = _bias_row(DIST, bias_span, h, max_q)
    bias_rows = tl.minimum(offs_m, q_len - 1)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    shift = k_len - q_len  # causal: row i sees keys j <= i + shift
    if WINDOW:
        lo, full_lo, full_hi, hi = _key_span(
            m_blk * BLOCK_M,
            tl.minimum(m_blk * BLOCK_M + BLOCK_M, q_len) - 1,
            shift,
            k_len,
            win_left,
            win_right,
            BLOCK_N,
        )
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            lo,
            full_lo,
            k_len,
            shift,
            win_left,
            win_right,
            offs_m,
            offs_n,
            offs_d,
            d_ok,
            qk_scale,
            seed,
            dropout_p,
            h,
            q_start,
            total_q,
            bias_row,
            bias_rows,
            BLOCK_N,
            True,
            False,
            True,
            DROPOUT,
            BIAS,
            PRECISION,
        )
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            full_lo,
            full_hi,
            k_len,
            shift,
            win_left,
            win_right,
            offs_m,
            offs_n,
            offs_d,
            d_ok,
            qk_scale,
            seed,
            dropout_p,
            h,
            q_start,
            total_q,
            bias_row,
            bias_rows,
            BLOCK_N,
            False,
            False,
            True,
            DROPOUT,
            BIAS,
            PRECISION,
        )
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            full_hi,
            hi,
            k_len,
            shift,
            win_left,
            win_right,
            offs_m,
            offs_n,
            offs_d,
            d_ok,
            qk_scale,
            seed,
            dropout_p,
            h,
            q_start,
            total_q,
            bias_row,
            bias_rows,
            BLOCK_N,
            True,
            False,
            True,
            DROPOUT,
            BIAS,
            PRECISION,
        )
    else:
        end = k_len
        full = (k_len // BLOCK_N) * BLOCK_N  # key blocks every row sees without a mask
        if CAUSAL:
            end = tl.minimum(k_len, m_blk * BLOCK_M + BLOCK_M + shift)
            full = tl.minimum(full, ((m_blk * BLOCK_M + shift + 1) // BLOCK_N) * BLOCK_N)
            end = tl.maximum(end, 0)
            full = tl.maximum(full, 0)

        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            0,
            full,
            k_len,
            shift,
            win_left,
            win_right,
            offs_m,
            offs_n,
            offs_d,
            d_ok,
            qk_scale,
            seed,
            dropout_p,
            h,
            q_start,
            total_q,
            bias_row,
            bias_rows,
            BLOCK_N,
            False,
            CAUSAL,
            False,
            DROPOUT,
            BIAS,
            PRECISION,
        )
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            full,
            end,
            k_len,
            shift,
            win_left,
            win_right,
            offs_m,
            offs_n,
            offs_d,
            d_ok,
            qk_scale,
            seed,
            dropout_p,
            h,
            q_start,
            total_q,
            bias_row,
            bias_rows,
            BLOCK_N,
            True,
            CAUSAL,
            False,
            DROPOUT,
            BIAS,
            PRECISION,
        )

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(
        O + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(LSE + (q_start + offs_m) * tl.num_programs(1) + h, lse, mask=row_ok)


@triton.jit
def _dq_target(
    DQ,
    q_start,
    q_len,
    heads,
    stride_dqt,
    stride_dqh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    FUSED_DQ: tl.constexpr,
):
    """Where :func:`_dkdv_inner` adds its dQ tiles: the float32 buffer ``DQ`` itself
    (``FUSED_DQ`` 0 or 1), or (2) the TMA descriptor of the sequence's dQ rows,
    ``[q_len, heads, HEAD_DIM]``, moved a ``[BLOCK_M, 1, HEAD_DIM]`` tile (one head) at a time,
    rows past ``q_len`` clipped by the TMA unit. One descriptor for every head of the program's
    group: rewriting a descriptor per head could change it under a reduce still in flight."""
    if FUSED_DQ == 2:
        tl.static_assert(HEAD_DIM == BLOCK_D, "the TMA dQ moves whole rows: the head dim a power of two")
        return tl.make_tensor_descriptor(
            DQ + q_start * stride_dqt,
            shape=[tl.maximum(q_len, 1), heads, HEAD_DIM],
            strides=[stride_dqt, stride_dqh, 1],
            block_shape=[BLOCK_M, 1, HEAD_DIM],
        )
    else:
        return DQ


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    Q,
    DO,
    LSE,
    DELTA,
    lo,
    hi,
    q_start,
    q_len,
    shift,
    win_left,
    win_right,
    h,
    heads,
    offs_n,
    offs_m,
    offs_d,
    d_ok,
    stride_qt,
    stride_qh,
    stride_dot,
    stride_doh,
    qk_scale,
    seed,
    dropout_p,
    total_q,
    bias_row,
    bias_cols,
    DQ,
    stride_dqt,
    stride_dqh,
    n_ok,
    BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr,
    WINDOW: tl.constexpr,
    DROPOUT: tl.constexpr,
    BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    FUSED_DQ: tl.constexpr,
):
    """dK/dV of one key block over query blocks [lo, hi) of head h (``BIAS``: the position bias of
    keys ``bias_cols`` from head ``h``'s distance table row at ``bias_row``).

    Query rows past the sequence load as q = dO = 0 and lse = +inf, so they add exactly 0.
    Key rows past the sequence go unmasked: each key row of dK / dV sums its own row of P and
    dS only, and those rows are never stored, so what they hold (inf or NaN from p = exp(-lse)
    at a zero key included) reaches no result. Only the causal diagonal or the window's edges
    (MASKED) need an element mask.

    ``FUSED_DQ``: each query block's share of dQ, ``dS^T K`` (unscaled), added into the float32
    dQ (the fused backward: no dQ kernel recomputing S and dP); there the key rows past the
    sequence (``n_ok`` false) are zeroed first, their dS being anything. 0: no dQ; 1: element
    atomics into the pointer ``DQ``; 2: one TMA bulk reduce-add of the tile (``DQ`` is then the
    descriptor of the sequence's dQ rows, :func:`_dq_target`, which clips the rows past the
    sequence)."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        r_ok = rows < q_len
        tq = q_start + rows
        q = tl.load(
            Q + tq[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0
        )
        do = tl.load(
            DO + tq[:, None] * stride_dot + h * stride_doh + offs_d[None, :],
            mask=r_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        lse = tl.load(LSE + tq * heads + h, mask=r_ok, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)  # rows that see no key: p = 0
        delta = tl.load(DELTA + tq * heads + h, mask=r_ok, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
        if BIAS:
            s_t += _bias_tile_t(bias_row, bias_cols, rows, q_len)
        p_t = tl.math.exp2(s_t - lse[None, :] * 1.4426950408889634)
        if MASKED:
            if WINDOW:
                rel = offs_n[:, None] - (rows[None, :] + shift)
                p_t = tl.where((rel >= -win_left) & (rel <= win_right), p_t, 0.0)
            else:
                p_t = tl.where(offs_n[:, None] <= rows[None, :] + shift, p_t, 0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        if DROPOUT:
            keep = _keep_t(seed, dropout_p, h, tq, offs_n, total_q)
            scale_keep = 1.0 / (1.0 - dropout_p)
            dv += tl.dot(tl.where(keep, p_t * scale_keep, 0.0).to(do.dtype), do, input_precision=PRECISION)
            dp_t = tl.where(keep, dp_t * scale_keep, 0.0)
        else:
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
        if FUSED_DQ != 0:
            ds_k = tl.where(n_ok[:, None], ds_t, 0.0).to(k.dtype)
            dq = tl.dot(tl.trans(ds_k), k, input_precision=PRECISION)  # [BLOCK_M, BLOCK_D]
            if FUSED_DQ == 2:
                DQ.atomic_add([start_m, h, 0], dq[:, None, :])
            else:
                tl.atomic_add(
                    DQ + tq[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :],
                    dq,
                    mask=r_ok[:, None] & d_ok[None, :],
                    sem="relaxed",
                )
    return dk, dv


@cached_launch
@triton.jit(
    do_not_specialize=["batch", "n_steps", "seed", "total_q", "max_k", "win_left", "win_right", "max_q", "bias_span"]
)
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    cu_q,
    cu_k,
    block_cum,
    batch,
    n_steps,
    sm_scale,
    seed,
    seed_ptr,
    dropout_p,
    total_q,
    max_k,
    win_left,
    win_right,
    heads,
    DIST,
    max_q,
    bias_span,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    DQ,
    stride_dqt,
    stride_dqh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    DROPOUT: tl.constexpr,
    SEED_PTR: tl.constexpr,
    BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    INLINE: tl.constexpr,
    CHUNK: tl.constexpr,
    FUSED_DQ: tl.constexpr = 0,
):
    item = tl.program_id(0)
    hk = tl.program_id(1)
    b, n_blk, n_blocks, n_items = _locate(cu_k, block_cum, batch, n_steps, item, BLOCK_N, INLINE, CHUNK)
    if item >= n_items:
        return
    if SEED_PTR:  # the seed drawn on the device (a CUDA graph replays a new one each time)
        seed = tl.load(seed_ptr).to(tl.int32)
    q_start, q_len, k_start, k_len = _bounds(cu_q, cu_k, b)
    offs_n = n_blk * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    n_ok = offs_n < k_len
    kv_mask = n_ok[:, None] & d_ok[None, :]
    dq_out = _dq_target(DQ, q_start, q_len, heads, stride_dqt, stride_dqh, HEAD_DIM, BLOCK_D, BLOCK_M, FUSED_DQ)
    k = tl.load(K + (k_start + offs_n)[:, None] * stride_kt + hk * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + (k_start + offs_n)[:, None] * stride_vt + hk * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    shift = k_len - q_len
    bias_cols = tl.minimum(offs_n, k_len - 1)
    begin = 0
    full = 0
    if WINDOW:
        begin, full, full_hi, end = _query_span(
            n_blk * BLOCK_N,
            tl.minimum(n_blk * BLOCK_N + BLOCK_N, k_len) - 1,
            shift,
            q_len,
            win_left,
            win_right,
            BLOCK_M,
        )
        for g in range(GROUP):
            h = hk * GROUP + g
            bias_row = _bias_row(DIST, bias_span, h, max_q)
            dk, dv = _dkdv_inner(
                dk,
                dv,
                k,
                v,
                Q,
                DO,
                LSE,
                DELTA,
                begin,
                full,
                q_start,
                q_len,
                shift,
                win_left,
                win_right,
                h,
                heads,
                offs_n,
                offs_m,
                offs_d,
                d_ok,
                stride_qt,
                stride_qh,
                stride_dot,
                stride_doh,
                qk_scale,
                seed,
                dropout_p,
                total_q,
                bias_row,
                bias_cols,
                dq_out,
                stride_dqt,
                stride_dqh,
                n_ok,
                BLOCK_M,
                True,
                True,
                DROPOUT,
                BIAS,
                PRECISION,
                FUSED_DQ,
            )
            dk, dv = _dkdv_inner(
                dk,
                dv,
                k,
                v,
                Q,
                DO,
                LSE,
                DELTA,
                full,
                full_hi,
                q_start,
                q_len,
                shift,
                win_left,
                win_right,
                h,
                heads,
                offs_n,
                offs_m,
                offs_d,
                d_ok,
                stride_qt,
                stride_qh,
                stride_dot,
                stride_doh,
                qk_scale,
                seed,
                dropout_p,
                total_q,
                bias_row,
                bias_cols,
                dq_out,
                stride_dqt,
                stride_dqh,
                n_ok,
                BLOCK_M,
                False,
                True,
                DROPOUT,
                BIAS,
                PRECISION,
                FUSED_DQ,
            )
            dk, dv = _dkdv_inner(
                dk,
                dv,
                k,
                v,
                Q,
                DO,
                LSE,
                DELTA,
                full_hi,
                end,
                q_start,
                q_len,
                shift,
                win_left,
                win_right,
                h,
                heads,
                offs_n,
                offs_m,
                offs_d,
                d_ok,
                stride_qt,
                stride_qh,
                stride_dot,
                stride_doh,
                qk_scale,
                seed,
                dropout_p,
                total_q,
                bias_row,
                bias_cols,
                dq_out,
                stride_dqt,
                stride_dqh,
                n_ok,
                BLOCK_M,
                True,
                True,
                DROPOUT,
                BIAS,
                PRECISION,
                FUSED_DQ,
            )
    else:
        if CAUSAL:
            # rows [begin, full) cross the diagonal of this key block; rows from full on see all of it
            begin = (tl.maximum(n_blk * BLOCK_N - shift, 0) // BLOCK_M) * BLOCK_M
            full = tl.minimum(
                ((tl.maximum(n_blk * BLOCK_N + BLOCK_N - 1 - shift, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M,
                ((q_len + BLOCK_M - 1) // BLOCK_M) * BLOCK_M,
            )
            full = tl.maximum(full, begin)
        for g in range(GROUP):
            h = hk * GROUP + g
            bias_row = _bias_row(DIST, bias_span, h, max_q)
            if CAUSAL:
                dk, dv = _dkdv_inner(
                    dk,
                    dv,
                    k,
                    v,
                    Q,
                    DO,
                    LSE,
                    DELTA,
                    begin,
                    full,
                    q_start,
                    q_len,
                    shift,
                    win_left,
                    win_right,
                    h,
                    heads,
                    offs_n,
                    offs_m,
                    offs_d,
                    d_ok,
                    stride_qt,
                    stride_qh,
                    stride_dot,
                    stride_doh,
                    qk_scale,
                    seed,
                    dropout_p,
                    total_q,
                    bias_row,
                    bias_cols,
                    dq_out,
                    stride_dqt,
                    stride_dqh,
                    n_ok,
                    BLOCK_M,
                    True,
                    False,
                    DROPOUT,
                    BIAS,
                    PRECISION,
                    FUSED_DQ,
                )
            dk, dv = _dkdv_inner(
                dk,
                dv,
                k,
                v,
                Q,
                DO,
                LSE,
                DELTA,
                full,
                q_len,
                q_start,
                q_len,
                shift,
                win_left,
                win_right,
                h,
                heads,
                offs_n,
                offs_m,
                offs_d,
                d_ok,
                stride_qt,
                stride_qh,
                stride_dot,
                stride_doh,
                qk_scale,
                seed,
                dropout_p,
                total_q,
                bias_row,
                bias_cols,
                dq_out,
                stride_dqt,
                stride_dqh,
                n_ok,
                BLOCK_M,
                False,
                False,
                DROPOUT,
                BIAS,
                PRECISION,
                FUSED_DQ,
            )
    dk = dk * sm_scale
    tl.store(
        DK + (k_start + offs_n)[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :],
        dk.to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV + (k_start + offs_n)[:, None] * stride_dvt + hk * stride_dvh + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=kv_mask,
    )


@triton.jit
def _dq_inner(
    dq,
    buckets_acc,
    carry,
    carry_pos,
    q,
    do,
    lse,
    delta,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    lo,
    hi,
    k_len,
    shift,
    win_left,
    win_right,
    offs_m,
    offs_n,
    offs_d,
    d_ok,
    h,
    tq,
    qk_scale,
    seed,
    dropout_p,
    total_q,
    bias_row,
    bias_rows,
    BUCKETS,
    bias_span,
    bias_pos,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    DROPOUT: tl.constexpr,
    BIAS: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dQ of one query block over key blocks [lo, hi). The masked blocks (MASKED: the sequence's
    last, ragged key block, the causal diagonal, the window's edges) zero P at every key past
    the sequence as well as outside the causal or window band. A key past the end loads as
    K = V = 0 and so scores 0: left in P it would give p = exp(-lse), which overflows dS in the
    cast for dS @ K when lse is very negative (float16 past 65504, any dtype once p is inf),
    and inf * 0 is NaN. The unmasked blocks lie within the sequence and the band.

    ``BIAS``: the position bias of rows ``bias_rows`` added to the scores (head ``h``'s distance
    table row at ``bias_row``), and ``dS`` summed per bucket into ``buckets_acc``: pairs at
    ``c - r = 0`` of the key block at ``start_n`` lie at distance index ``start_n + bias_pos`` of
    ``BUCKETS``; ``carry`` holds the diagonal sums from distance index ``carry_pos`` on that still
    miss the next key block's share (see :mod:`.attention_bias`)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            kv_mask = (cols < k_len)[:, None] & d_ok[None, :]
        else:
            kv_mask = d_ok[None, :]
        k = tl.load(k_base + cols[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if BIAS:
            s += _bias_tile(bias_row, bias_rows, cols, k_len, MASKED)
        p = tl.math.exp2(s - lse[:, None] * 1.4426950408889634)
        if MASKED:
            ok = (cols < k_len)[None, :]
            if CAUSAL:
                ok = ok & (cols[None, :] <= offs_m[:, None] + shift)
            if WINDOW:
                ok = ok & _in_window(offs_m, cols, shift, win_left, win_right)
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if DROPOUT:
            keep = _keep(seed, dropout_p, h, tq, cols, total_q)
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if BIAS:
            lo_sums, hi_sums = _diagonal_sums(ds, BLOCK_M, BLOCK_N)
            buckets_acc = _bucket_add(
                buckets_acc, carry + hi_sums, BUCKETS, bias_span, start_n + bias_pos - BLOCK_N, BLOCK_N, NUM_BUCKETS
            )
            carry = lo_sums
            carry_pos = start_n + bias_pos
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq, buckets_acc, carry, carry_pos


@cached_launch
@triton.jit(
    do_not_specialize=["batch", "n_steps", "seed", "total_q", "max_k", "win_left", "win_right", "max_q", "bias_span"]
)
def _bwd_dq_kernel(
    Q,
    K,
    V,
    O,
    DO,
    LSE,
    DELTA,
    DQ,
    cu_q,
    cu_k,
    block_cum,
    batch,
    n_steps,
    sm_scale,
    seed,
    seed_ptr,
    dropout_p,
    total_q,
    max_k,
    win_left,
    win_right,
    heads,
    DIST,
    BUCKETS,
    PARTIAL,
    max_q,
    bias_span,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    DROPOUT: tl.constexpr,
    SEED_PTR: tl.constexpr,
    BIAS: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    PRECISION: tl.constexpr,
    INLINE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """dQ of one query block of one head; it also computes the block's ``delta = rowsum(O * dO)``
    (fp32, ``[Tq, H]``) and stores it for the dK / dV kernel, launched after this one. ``BIAS``:
    the position bias added (see :mod:`.attention_bias`), and this program's sums of dS per
    bucket written to its row ``PARTIAL[item, :, h]`` (``[programs, NUM_BUCKETS, H]``)."""
    item = tl.program_id(0)
    h = tl.program_id(1)
    b, m_blk, n_blocks, n_items = _locate(cu_q, block_cum, batch, n_steps, item, BLOCK_M, INLINE, CHUNK)
    if item >= n_items:
        return
    if SEED_PTR:  # the seed drawn on the device (a CUDA graph replays a new one each time)
        seed = tl.load(seed_ptr).to(tl.int32)
    q_start, q_len, k_start, k_len = _bounds(cu_q, cu_k, b)
    if CAUSAL:  # the heaviest (last) blocks of a sequence first
        m_blk = n_blocks - 1 - m_blk
    hk = h // GROUP
    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    r_ok = offs_m < q_len
    tq = q_start + offs_m
    qd_mask = r_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + tq[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(DO + tq[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=qd_mask, other=0.0)
    lse = tl.load(LSE + tq * heads + h, mask=r_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    o = tl.load(O + tq[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=qd_mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + tq * heads + h, delta, mask=r_ok)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    shift = k_len - q_len
    k_base = K + k_start * stride_kt + hk * stride_kh
    v_base = V + k_start * stride_vt + hk * stride_vh
    bias_row = _bias_row(DIST, bias_span, h, max_q)
    bias_rows = tl.minimum(offs_m, q_len - 1)
    bias_pos = max_q - 1 - m_blk * BLOCK_M  # distance index of a key block's pairs at c - r = 0, less its first key
    acc = tl.zeros([NUM_BUCKETS], dtype=tl.float32)
    carry = tl.zeros([BLOCK_N], dtype=tl.float32)
    carry_pos = bias_pos
    if WINDOW:
        lo, full_lo, full_hi, hi = _key_span(
            m_blk * BLOCK_M,
            tl.minimum(m_blk * BLOCK_M + BLOCK_M, q_len) - 1,
            shift,
            k_len,
            win_left,
            win_right,
            BLOCK_N,
        )
        dq, acc, carry, carry_pos = _dq_inner(
            dq,
            acc,
            carry,
            carry_pos,
            q,
            do,
            lse,
            delta,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            lo,
            full_lo,
            k_len,
            shift,
            win_left,
            win_right,
            offs_m,
            offs_n,
            offs_d,
            d_ok,
            h,
            tq,
            qk_scale,
            seed,
            dropout_p,
            total_q,
            bias_row,
            bias_rows,
            BUCKETS,
            bias_span,
            bias_pos,
            BLOCK_M,
            BLOCK_N,
            True,
            False,
            True,
            DROPOUT,
            BIAS,
            NUM_BUCKETS,
            PRECISION,
        )
        dq, acc, carry, carry_pos = _dq_inner(
            dq,
            acc,
            carry,
            carry_pos,
            q,
            do,
            lse,
            delta,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            full_lo,
            full_hi,
            k_len,
            shift,
            win_left,
            win_right,
            offs_m,
            offs_n,
            offs_d,
            d_ok,
            h,
            tq,
            qk_scale,
            seed,
            dropout_p,
            total_q,
            bias_row,
            bias_rows,
            BUCKETS,
            bias_span,
            bias_pos,
            BLOCK_M,
            BLOCK_N,
            False,
            False,
            True,
            DROPOUT,
            BIAS,
            NUM_BUCKETS,
            PRECISION,
        )
        dq, acc, carry, carry_pos = _dq_inner(
            dq,
            acc,
            carry,
            carry_pos,
            q,
            do,
            lse,
            delta,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            full_hi,
            hi,
            k_len,
            shift,
            win_left,
            win_right,
            offs_m,
            offs_n,
            offs_d,
            d_ok,
            h,
            tq,
            qk_scale,
            seed,
            dropout_p,
            total_q,
            bias_row,
            bias_rows,
            BUCKETS,
            bias_span,
            bias_pos,
            BLOCK_M,
            BLOCK_N,
            True,
            False,
            True,
            DROPOUT,
            BIAS,
            NUM_BUCKETS,
            PRECISION,
        )
    else:
        end = k_len
        full = (k_len // BLOCK_N) * BLOCK_N
        if CAUSAL:
            end = tl.maximum(tl.minimum(k_len, m_blk * BLOCK_M + BLOCK_M + shift), 0)
            full = tl.maximum(tl.minimum(full, ((m_blk * BLOCK_M + shift + 1) // BLOCK_N) * BLOCK_N), 0)
        dq, acc, carry, carry_pos = _dq_inner(
            dq,
            acc,
            carry,
            carry_pos,
            q,
            do,
            lse,
            delta,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            0,
            full,
            k_len,
            shift,
            win_left,
            win_right,
            offs_m,
            offs_n,
            offs_d,
            d_ok,
            h,
            tq,
            qk_scale,
            seed,
            dropout_p,
            total_q,
            bias_row,
            bias_rows,
            BUCKETS,
            bias_span,
            bias_pos,
            BLOCK_M,
            BLOCK_N,
            False,
            CAUSAL,
            False,
            DROPOUT,
            BIAS,
            NUM_BUCKETS,
            PRECISION,
        )
        dq, acc, carry, carry_pos = _dq_inner(
            dq,
            acc,
            carry,
            carry_pos,
            q,
            do,
            lse,
            delta,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            full,
            end,
            k_len,
            shift,
            win_left,
            win_right,
            offs_m,
            offs_n,
            offs_d,
            d_ok,
            h,
            tq,
            qk_scale,
            seed,
            dropout_p,
            total_q,
            bias_row,
            bias_rows,
            BUCKETS,
            bias_span,
            bias_pos,
            BLOCK_M,
            BLOCK_N,
            True,
            CAUSAL,
            False,
            DROPOUT,
            BIAS,
            NUM_BUCKETS,
            PRECISION,
        )
    dq = dq * sm_scale
    tl.store(DQ + tq[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=qd_mask)
    if BIAS:
        acc = _bucket_add(acc, carry, BUCKETS, bias_span, carry_pos, BLOCK_N, NUM_BUCKETS)
        n = tl.arange(0, NUM_BUCKETS)
        tl.store(PARTIAL + (item.to(tl.int64) * NUM_BUCKETS + n) * heads + h, acc)


@cached_launch
@triton.jit(do_not_specialize=["seed", "total_q", "max_k"])
def _keep_mask_kernel(OUT, seed, dropout_p, total_q, max_k, BLOCK: tl.constexpr):
    h = tl.program_id(1)
    t = tl.program_id(0)
    for start in range(0, max_k, BLOCK):
        j = start + tl.arange(0, BLOCK)
        keep = _keep(seed, dropout_p, h, t + tl.zeros([1], dtype=tl.int64), j, total_q)
        tl.store(OUT + (h * total_q + t).to(tl.int64) * max_k + j[None, :], keep.to(tl.int8), mask=(j < max_k)[None, :])


@cached_launch
@triton.jit(do_not_specialize=["total_q"])
def _bwd_delta_kernel(
    O,
    DO,
    DELTA,
    total_q,
    heads,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """``DELTA[t, h] = sum_d dO[t, h, d] * O[t, h, d]`` in float32 (the fused backward's rows; the
    split backward's dQ kernel computes them itself)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (rows < total_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    t = rows.to(tl.int64)[:, None]
    o = tl.load(O + t * stride_ot + h * stride_oh + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + t * stride_dot + h * stride_doh + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(DELTA + rows.to(tl.int64) * heads + h, tl.sum(o * do, 1), mask=rows < total_q)


@cached_launch(dry=False)  # writes the block counts other kernels index by
@triton.jit(do_not_specialize=["batch"])
def _block_cum_kernel(CU, OUT, batch, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """OUT[b+1] = sum over b' <= b of ceil(L_b' / BLOCK_M); OUT[0] = 0 (one program)."""
    carry = tl.load(CU) * 0
    tl.store(OUT, carry)
    for start in range(0, batch, CHUNK):
        b = start + tl.arange(0, CHUNK)
        ok = b < batch
        length = tl.load(CU + b + 1, mask=ok, other=0) - tl.load(CU + b, mask=ok, other=0)
        blocks = (length + (BLOCK_M - 1)) // BLOCK_M
        cum = tl.cumsum(blocks, 0) + carry
        tl.store(OUT + b + 1, cum.to(tl.int32), mask=ok)
        carry = tl.max(tl.where(ok, cum, 0), 0)


def _block_cum(cu: torch.Tensor, block: int) -> torch.Tensor:
    """``[B+1]`` int32 on cu's device: the work list of query (or key) blocks, one launch."""
    batch = cu.shape[0] - 1
    out = torch.empty(batch + 1, dtype=torch.int32, device=cu.device)
    _block_cum_kernel[(1,)](cu, out, batch, BLOCK_M=block, CHUNK=min(1024, max(16, triton.next_power_of_2(batch))))
    return out
