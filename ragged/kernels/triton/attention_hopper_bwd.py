"""The varlen attention backward for Hopper (sm_90): the dQ and the dK/dV kernels of
:mod:`.attention_kernels` with their tiles moved by TMA through per-sequence tensor
descriptors (see :mod:`.attention_hopper`) and the products accumulated in place.

Same split, same order, same numbers as the portable backward: the dQ kernel runs first, one
program per (query block, head), and also stores ``delta = rowsum(O * dO)``; the dK/dV kernel
then runs one program per (key block, key head), summing over the group's query heads. Each
gradient element is written by exactly one program, so the results are deterministic (no
atomics). Rows past a sequence come in as zeros from the TMA; their ``lse`` loads as ``+inf``,
so they add exactly 0; keys past a sequence are masked out of P in the dQ kernel's last block
(a zero key scores 0, and ``exp(-lse)`` would overflow the cast of dS) and left in the dK/dV
kernel, where they reach only rows that are never stored (the TMA store clips at the
sequence's end).

Takes what the sm_90 forward takes (causal masks, windows and dropout with the portable
kernels' masks and hash), and gradient buffers the TMA can store into (:func:`runs`). It is
the backward of the ``"triton_sm90_full"`` implementation only, taken where preferred
(``RAGGED_ATTENTION_HOPPER=1``, ``ragged.backends.prefer``): ``"auto"``'s sm_90 forward is
followed by the portable backward, which the sweep measured as fast. The position bias stays
with the portable kernels.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from . import attention_hopper
from .attention_common import _bounds, _keep, _keep_t, _key_span, _locate, _query_span
from .attention_hopper import _key_rows, _query_block, _rows, _seen
from .launch import cached_launch

__all__ = ["CONFIGS", "backward", "config", "runs"]


@triton.jit
def _dq_tma_inner(
    dq,
    q,
    do,
    lse2,
    delta,
    k_desc,
    v_desc,
    lo,
    hi,
    k_len,
    shift,
    win_left,
    win_right,
    offs_m,
    offs_n,
    qk_scale,
    seed,
    dropout_p,
    h,
    tq,
    total_q,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    DROPOUT: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = k_desc.load([start_n, 0])
        v = v_desc.load([start_n, 0])
        p = tl.math.exp2(tl.dot(q, k.T) * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(_seen(offs_m, cols, k_len, shift, win_left, win_right, CAUSAL, WINDOW), p, 0.0)
        dp = tl.dot(do, v.T)
        if DROPOUT:
            keep = _keep(seed, dropout_p, h, tq, cols, total_q)
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@cached_launch
@triton.jit(do_not_specialize=["batch", "n_steps", "win_left", "win_right", "seed", "total_q"])
def _bwd_dq_tma_kernel(
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
    heads,
    win_left,
    win_right,
    seed,
    seed_ptr,
    dropout_p,
    total_q,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    DROPOUT: tl.constexpr,
    SEED_PTR: tl.constexpr,
    INLINE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """dQ of one query block of one head, and the block's ``delta`` (fp32 ``[Tq, H]``)."""
    item = tl.program_id(0)
    h = tl.program_id(1)
    b, m_blk, n_blocks, n_items = _locate(cu_q, block_cum, batch, n_steps, item, BLOCK_M, INLINE, CHUNK)
    if item >= n_items:
        return
    if SEED_PTR:  # the seed drawn on the device (a CUDA graph replays a new one each time)
        seed = tl.load(seed_ptr).to(tl.int32)
    q_start, q_len, k_start, k_len, hk, row0 = _query_block(cu_q, cu_k, b, m_blk, n_blocks, h, GROUP, BLOCK_M, CAUSAL)
    q_desc = _rows(Q, q_start, stride_qt, h, stride_qh, q_len, HEAD_DIM, BLOCK_M)
    do_desc = _rows(DO, q_start, stride_dot, h, stride_doh, q_len, HEAD_DIM, BLOCK_M)
    o_desc = _rows(O, q_start, stride_ot, h, stride_oh, q_len, HEAD_DIM, BLOCK_M)
    k_desc, v_desc = _key_rows(K, V, k_start, k_len, hk, stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM, BLOCK_N)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    r_ok = offs_m < q_len
    tq = q_start + offs_m
    q = q_desc.load([row0, 0])
    do = do_desc.load([row0, 0])
    o = o_desc.load([row0, 0])
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + tq * heads + h, delta, mask=r_ok)
    lse = tl.load(LSE + tq * heads + h, mask=r_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634  # no key seen: p = 0
    qk_scale = sm_scale * 1.4426950408889634
    shift = k_len - q_len
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if WINDOW:
        lo, full_lo, full_hi, hi = _key_span(
            row0, tl.minimum(row0 + BLOCK_M, q_len) - 1, shift, k_len, win_left, win_right, BLOCK_N
        )
        dq = _dq_tma_inner(
            dq,
            q,
            do,
            lse2,
            delta,
            k_desc,
            v_desc,
            lo,
            full_lo,
            k_len,
            shift,
            win_left,
            win_right,
            offs_m,
            offs_n,
            qk_scale,
            seed,
            dropout_p,
            h,
            tq,
            total_q,
            BLOCK_N,
            True,
            False,
            True,
            DROPOUT,
        )
        dq = _dq_tma_inner(
            dq,
            q,
            do,
            lse2,
            delta,
            k_desc,
            v_desc,
            full_lo,
            full_hi,
            k_len,
            shift,
            win_left,
            win_right,
            offs_m,
            offs_n,
            qk_scale,
            seed,
            dropout_p,
            h,
            tq,
            total_q,
            BLOCK_N,
            False,
            False,
            True,
            DROPOUT,
        )
        dq = _dq_tma_inner(
            dq,
            q,
            do,
            lse2,
            delta,
            k_desc,
            v_desc,
            full_hi,
            hi,
            k_len,
            shift,
            win_left,
            win_right,
            offs_m,
            offs_n,
            qk_scale,
            seed,
            dropout_p,
            h,
            tq,
            total_q,
            BLOCK_N,
            True,
            False,
            True,
            DROPOUT,
        )
    else:
        end = k_len
        full = (k_len // BLOCK_N) * BLOCK_N
        if CAUSAL:
            end = tl.maximum(tl.minimum(k_len, row0 + BLOCK_M + shift), 0)
            full = tl.maximum(tl.minimum(full, ((row0 + shift + 1) // BLOCK_N) * BLOCK_N), 0)
        dq = _dq_tma_inner(
            dq,
            q,
            do,
            lse2,
            delta,
            k_desc,
            v_desc,
            0,
            full,
            k_len,
            shift,
            win_left,
            win_right,
            offs_m,
            offs_n,
            qk_scale,
            seed,
            dropout_p,
            h,
            tq,
            total_q,
            BLOCK_N,
            False,
            CAUSAL,
            False,
            DROPOUT,
        )
        dq = _dq_tma_inner(
            dq,
            q,
            do,
            lse2,
            delta,
            k_desc,
            v_desc,
            full,
            end,
            k_len,
            shift,
            win_left,
            win_right,
            offs_m,
            offs_n,
            qk_scale,
            seed,
            dropout_p,
            h,
            tq,
            total_q,
            BLOCK_N,
            True,
            CAUSAL,
            False,
            DROPOUT,
        )
    dq_desc = _rows(DQ, q_start, stride_dqt, h, stride_dqh, q_len, HEAD_DIM, BLOCK_M)
    dq_desc.store([row0, 0], (dq * sm_scale).to(DQ.dtype.element_ty))


@triton.jit
def _dkdv_tma_inner(
    dk,
    dv,
    k,
    v,
    q_desc,
    do_desc,
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
    qk_scale,
    seed,
    dropout_p,
    total_q,
    BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr,
    WINDOW: tl.constexpr,
    DROPOUT: tl.constexpr,
):
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        r_ok = rows < q_len
        tq = q_start + rows
        q = q_desc.load([start_m, 0])
        do = do_desc.load([start_m, 0])
        lse = tl.load(LSE + tq * heads + h, mask=r_ok, other=float("inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
        delta = tl.load(DELTA + tq * heads + h, mask=r_ok, other=0.0)
        p_t = tl.math.exp2(tl.dot(k, q.T) * qk_scale - lse2[None, :])  # [BLOCK_N, BLOCK_M]
        if MASKED:  # the causal diagonal, or the window's edges
            rel = offs_n[:, None] - (rows[None, :] + shift)
            if WINDOW:
                p_t = tl.where((rel >= -win_left) & (rel <= win_right), p_t, 0.0)
            else:
                p_t = tl.where(rel <= 0, p_t, 0.0)
        dp_t = tl.dot(v, do.T)
        if DROPOUT:
            keep = _keep_t(seed, dropout_p, h, tq, offs_n, total_q)
            scale_keep = 1.0 / (1.0 - dropout_p)
            dv = tl.dot(tl.where(keep, p_t * scale_keep, 0.0).to(do.dtype), do, dv)
            dp_t = tl.where(keep, dp_t * scale_keep, 0.0)
        else:
            dv = tl.dot(p_t.to(do.dtype), do, dv)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@cached_launch
@triton.jit(do_not_specialize=["batch", "n_steps", "win_left", "win_right", "seed", "total_q"])
def _bwd_dkdv_tma_kernel(
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
    heads,
    win_left,
    win_right,
    seed,
    seed_ptr,
    dropout_p,
    total_q,
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
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    DROPOUT: tl.constexpr,
    SEED_PTR: tl.constexpr,
    INLINE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """dK and dV of one key block of one key head, over the group's query heads."""
    item = tl.program_id(0)
    hk = tl.program_id(1)
    b, n_blk, n_blocks, n_items = _locate(cu_k, block_cum, batch, n_steps, item, BLOCK_N, INLINE, CHUNK)
    if item >= n_items:
        return
    if SEED_PTR:
        seed = tl.load(seed_ptr).to(tl.int32)
    q_start, q_len, k_start, k_len = _bounds(cu_q, cu_k, b)
    col0 = n_blk * BLOCK_N
    k_desc = _rows(K, k_start, stride_kt, hk, stride_kh, k_len, HEAD_DIM, BLOCK_N)
    v_desc = _rows(V, k_start, stride_vt, hk, stride_vh, k_len, HEAD_DIM, BLOCK_N)
    k = k_desc.load([col0, 0])
    v = v_desc.load([col0, 0])
    offs_n = col0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    qk_scale = sm_scale * 1.4426950408889634
    shift = k_len - q_len
    q_rows = tl.maximum(q_len, 1)  # a descriptor has no empty dim; no query block is read then
    # query blocks: masked in [begin, full) (and [full_hi, end) under a window), whole in [full, full_hi)
    begin = 0
    full = 0
    full_hi = q_len
    end = q_len
    if WINDOW:
        begin, full, full_hi, end = _query_span(
            col0, tl.minimum(col0 + BLOCK_N, k_len) - 1, shift, q_len, win_left, win_right, BLOCK_M
        )
    elif CAUSAL:
        # rows [begin, full) cross the diagonal of this key block; rows from full on see all of it
        begin = (tl.maximum(col0 - shift, 0) // BLOCK_M) * BLOCK_M
        full = tl.minimum(
            ((tl.maximum(col0 + BLOCK_N - 1 - shift, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M,
            ((q_len + BLOCK_M - 1) // BLOCK_M) * BLOCK_M,
        )
        full = tl.maximum(full, begin)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        q_desc = _rows(Q, q_start, stride_qt, h, stride_qh, q_rows, HEAD_DIM, BLOCK_M)
        do_desc = _rows(DO, q_start, stride_dot, h, stride_doh, q_rows, HEAD_DIM, BLOCK_M)
        if CAUSAL or WINDOW:
            dk, dv = _dkdv_tma_inner(
                dk,
                dv,
                k,
                v,
                q_desc,
                do_desc,
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
                qk_scale,
                seed,
                dropout_p,
                total_q,
                BLOCK_M,
                True,
                WINDOW,
                DROPOUT,
            )
        dk, dv = _dkdv_tma_inner(
            dk,
            dv,
            k,
            v,
            q_desc,
            do_desc,
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
            qk_scale,
            seed,
            dropout_p,
            total_q,
            BLOCK_M,
            False,
            WINDOW,
            DROPOUT,
        )
        if WINDOW:
            dk, dv = _dkdv_tma_inner(
                dk,
                dv,
                k,
                v,
                q_desc,
                do_desc,
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
                qk_scale,
                seed,
                dropout_p,
                total_q,
                BLOCK_M,
                True,
                WINDOW,
                DROPOUT,
            )
    dk_desc = _rows(DK, k_start, stride_dkt, hk, stride_dkh, k_len, HEAD_DIM, BLOCK_N)
    dv_desc = _rows(DV, k_start, stride_dvt, hk, stride_dvh, k_len, HEAD_DIM, BLOCK_N)
    dk_desc.store([col0, 0], (dk * sm_scale).to(DK.dtype.element_ty))
    dv_desc.store([col0, 0], dv.to(DV.dtype.element_ty))


# --------------------------------------------------------------------------------------
# Launcher

# ((BLOCK_M, BLOCK_N, warps, stages) of dK/dV, the same of dQ) the tuning sweep tries: 16 to 64
# query rows a step over 64 or 128 keys (at 64 rows and 8 warps the two fp32 accumulators and the
# transposed scores spill at D=128 once a window or dropout is on: sm_90 compile of Triton 3.9,
# ``python -m bench.kernel_resources``)
CONFIGS = {
    128: tuple(
        (kv, dq)
        for kv in ((32, 128, 8, 2), (32, 64, 8, 2), (16, 128, 8, 2), (64, 128, 8, 2), (64, 64, 4, 2))
        for dq in ((128, 64, 8, 2), (64, 64, 4, 2), (128, 128, 8, 2))
    ),
    64: tuple(
        (kv, dq)
        for kv in ((32, 128, 8, 2), (32, 64, 8, 2), (64, 128, 8, 2))
        for dq in ((128, 64, 8, 2), (64, 64, 4, 2), (128, 128, 8, 2))
    ),
}


@functools.cache
def config(head_dim: int, causal: bool, interpreted: bool, window: bool = False, dropout: bool = False):
    """``((BLOCK_M, BLOCK_N, warps, stages) of dK/dV, the same of dQ)``: the fastest pair of
    :data:`CONFIGS` that does not spill (Triton 3.6's sm_90 compile), after the chosen forward
    on workload (c) of ``bench/tune_attention.py --hopper-backward`` on an H200
    (``bench/results/tune_attention_hopper_bwd_h200_*.txt``; pairs within about 5% of each
    other swap places between runs). With a window or dropout
    (not swept) at D=128, shapes that compile for sm_90 without spilling in Triton 3.6 and 3.9
    (``python -m bench.kernel_resources --chosen``, ``tests/test_kernel_resources.py``): the
    masks and the hash cost the dK/dV kernel registers, so it steps 16 query rows at a time
    with a window (32 spill 48 bytes a thread in Triton 3.6) and 64 keys with dropout."""
    if interpreted:
        return (16, 16, 4, 1), (16, 16, 4, 1)
    if head_dim == 128 and window:
        return (16, 128, 8, 2), (128, 64, 8, 2)
    if head_dim == 128 and dropout:
        return (32, 64, 8, 2), (128, 64, 8, 2)
    if head_dim == 128:  # (64, 128, 8, 2) / (64, 64, 4, 2) of dK/dV measured a little faster, but spill
        return (32, 128, 8, 2), (64, 64, 4, 2)
    return ((64, 128, 8, 2), (64, 64, 4, 2)) if causal else ((64, 128, 8, 2), (128, 64, 8, 2))


def runs(q, k, v, do, out, grads, scale: float) -> bool:
    """Whether this backward takes a call its implementation's reasons let through: the forward's
    run-time conditions (:func:`.attention_hopper.runs`), and ``do``, ``out`` and the gradient
    buffers (``grads``: the dq, dk, dv the kernels write) TMA-aligned too."""
    return attention_hopper.runs(q, k, v, scale) and all(attention_hopper._aligned(t) for t in (do, out, *grads))


def backward(
    q,
    k,
    v,
    out,
    do,
    lse,
    delta,
    dq,
    dk,
    dv,
    cu_q,
    cu_k,
    worklist,
    causal: bool,
    scale: float,
    interpreted: bool,
    window=None,
    dropout_p: float = 0.0,
    seed: int = 0,
    seed_ptr=None,
    shape=None,
) -> None:
    """Fill ``dq``, ``dk``, ``dv`` (and ``delta``); ``worklist(cu, block)``: the launcher's work
    list builder; ``window``, ``dropout_p``, ``seed``, ``seed_ptr``: as for
    :func:`.attention_hopper.forward`; ``shape``: a tuning sweep's pair instead of :func:`config`'s."""
    (kv_m, kv_n, kv_w, kv_s), (q_m, q_n, q_w, q_s) = shape or config(
        q.shape[-1], causal, interpreted, window is not None, dropout_p > 0
    )
    if not interpreted:
        attention_hopper._ensure_allocator()
    batch, heads = cu_q.shape[0] - 1, q.shape[1]
    win_left, win_right = window or (0, 0)
    common = dict(
        GROUP=heads // k.shape[1],
        HEAD_DIM=q.shape[-1],
        CAUSAL=causal and window is None,
        WINDOW=window is not None,
        DROPOUT=dropout_p > 0,
        SEED_PTR=seed_ptr is not None,
    )
    runtime = (win_left, win_right, seed, cu_q if seed_ptr is None else seed_ptr, dropout_p, q.shape[0])
    cum, inline, chunk, n_steps = worklist(cu_q, q_m)
    _bwd_dq_tma_kernel[(triton.cdiv(q.shape[0], q_m) + batch, heads)](
        q,
        k,
        v,
        out,
        do,
        lse,
        delta,
        dq,
        cu_q,
        cu_k,
        cum,
        batch,
        n_steps,
        scale,
        heads,
        *runtime,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        do.stride(0),
        do.stride(1),
        dq.stride(0),
        dq.stride(1),
        BLOCK_M=q_m,
        BLOCK_N=q_n,
        INLINE=inline,
        CHUNK=chunk,
        num_warps=q_w,
        num_stages=q_s,
        **common,
    )
    if k.shape[0]:
        cum, inline, chunk, n_steps = worklist(cu_k, kv_n)
        _bwd_dkdv_tma_kernel[(triton.cdiv(k.shape[0], kv_n) + batch, k.shape[1])](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dk,
            dv,
            cu_q,
            cu_k,
            cum,
            batch,
            n_steps,
            scale,
            heads,
            *runtime,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            do.stride(0),
            do.stride(1),
            dk.stride(0),
            dk.stride(1),
            dv.stride(0),
            dv.stride(1),
            BLOCK_M=kv_m,
            BLOCK_N=kv_n,
            INLINE=inline,
            CHUNK=chunk,
            num_warps=kv_w,
            num_stages=kv_s,
            **common,
        )
