"""Triton kernels of the fused cross-entropy over per-sequence candidate vocabularies.

The layout and the kernels' work lists are those of :mod:`ragged.kernels.triton.vocab`.

Forward: one program per (sequence, row tile) streams over the sequence's candidate
tiles, computing each logit tile (GEMM over d) and keeping only an online logsumexp, the
target's logit and the sum of logits (for label smoothing) per token: the
``[sum T_i * V_i]`` logits are never stored. The targets are global ids, found among the
sequence's sorted candidates by a binary search in the kernel.

Backward: the logits' gradient ``g = w_t * (softmax - (1 - eps) * onehot - eps / V_b)`` is
recomputed tile by tile into a buffer of at most :data:`CE_CHUNK` elements (sequences are
taken in chunks when the host offsets are known), and fed to the d_hidden / d_weight
kernels of the projection.

:func:`forward` and :func:`backward` are the ``vocab_cross_entropy`` op's implementations
(their operands: :mod:`ragged.ops.vocab`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...records.vocab import VocabCrossEntropyArgs, VocabCrossEntropyBackwardInputs, VocabCrossEntropyOutput, VocabGrads
from ...utils import to_device
from .launch import cached_launch
from .vocab import (
    Segments,
    config,
    in_vocab,
    interpreted,
    locate,
    logit_tile,
    precision,
    project_backward,
    row_major,
    segment,
    segments,
    tile_of,
    unit_stride,
    worklist,
)

CE_CHUNK = 1 << 22


@cached_launch(dry=False)  # writes indices other code reads
@triton.jit
def _ce_fwd_kernel(
    H,
    W,
    BIAS,
    IDS,
    TGT,
    LOCAL,
    MISSING,
    LOSS,
    LSE,
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
    smoothing,
    ignore_index,
    n_search,
    HAS_BIAS: tl.constexpr,
    SHARED: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    SMOOTH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INLINE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Per token: the loss (1 - eps) * (lse - z_target) + eps * (lse - mean z) over its
    sequence's candidates (0 for a token without target) and the lse.

    TGT holds global ids; each is found by a binary search (``n_search`` halvings) among
    its sequence's sorted candidates, its local index (-1: ignore_index or not found) is
    written to LOCAL, and MISSING (int64) gains the number of tokens whose target is neither
    found nor ignore_index.

    SMOOTH=False (``smoothing == 0``): the loss is lse - z_target, and the smoothing term
    is not computed at all (0 * (lse - mean z) would be NaN for a row without candidates)."""
    item = tl.program_id(0)
    b, r_tile, n_items = locate(
        h_off, v_off, work, batch, shared_v, n_steps, item, BLOCK_M, 1, SHARED, True, False, INLINE, CHUNK
    )
    if item >= n_items:
        return
    t0, t_len, v0, v_len, lb = segment(h_off, v_off, l_off, shared_v, b, SHARED)
    rows = r_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < t_len
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
    n_missing = tl.sum((row_ok & (~found) & (~ignored)).to(tl.int32), 0)
    if n_missing > 0:
        tl.atomic_add(MISSING, n_missing.to(tl.int64), sem="relaxed")
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    zy = tl.zeros([BLOCK_M], dtype=tl.float32)
    zsum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c in range(0, v_len, BLOCK_N):
        cols = c + tl.arange(0, BLOCK_N)
        col_ok = cols < v_len
        ids = tl.load(IDS + v0 + cols, mask=col_ok, other=0).to(tl.int64)
        z = logit_tile(
            H,
            W,
            BIAS,
            t0,
            rows,
            row_ok,
            ids,
            in_vocab(ids, col_ok, vocab_size),
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
def _ce_grad_kernel(
    H,
    W,
    BIAS,
    IDS,
    TGT,
    LSE,
    WT,
    G,
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
    stride_wt,
    smoothing,
    HAS_BIAS: tl.constexpr,
    SHARED: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    SMOOTH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INLINE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """g[t, c] = WT[t] * (exp(z - lse) - (1 - eps) * [c == target] - eps / V_b), written flat at l_off
    (0 for a token without target). WT: the loss gradient, read with stride ``stride_wt``
    (0 for the broadcast gradient of a mean or a sum)."""
    item = tl.program_id(0)
    b, local, n_items = locate(
        h_off, v_off, work, batch, shared_v, n_steps, item, BLOCK_M, BLOCK_N, SHARED, True, True, INLINE, CHUNK
    )
    if item >= n_items:
        return
    t0, t_len, v0, v_len, lb = segment(h_off, v_off, l_off, shared_v, b, SHARED)
    rows, cols, row_ok, col_ok, ids, id_ok = tile_of(IDS, local, t_len, v0, v_len, vocab_size, BLOCK_M, BLOCK_N)
    z = logit_tile(
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


@functools.cache
def _ce_config(dim: int, max_t: int, max_v: int, dtype: torch.dtype, interp: bool):
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the forward (one program per row tile,
    looping over its candidates): short row tiles and wide candidate tiles."""
    if interp or dtype == torch.float32:
        return config(dim, max_t, max_v, dtype, interp)
    # bench/results/tune_vocab_h200.txt: (32, 256, 64, 8 warps, 3 stages) 0.113 ms against
    # 0.173 ms for the projection's tile
    block_m = max(16, min(32, triton.next_power_of_2(max(max_t, 1))))
    block_n = 256 if max_v >= 256 else max(16, triton.next_power_of_2(max(max_v, 1)))
    return block_m, block_n, 64, 8, 3


def forward(args: VocabCrossEntropyArgs) -> VocabCrossEntropyOutput:
    """``(loss, lse, local, missing)`` without storing logits: the ``vocab_cross_entropy`` op's forward.

    ``target``: ``[T]`` global ids. ``loss`` and ``lse``: ``[T]`` float32 (``lse`` is -inf for
    a token without candidates, ``loss`` 0 for a token without target). ``local``: ``[T]``
    int32, each target's index among its sequence's candidates (-1 where it is
    ``ignore_index`` or not a candidate). ``missing``: int64 ``[]``, the number of tokens
    whose target is neither."""
    hidden, weight = row_major(args.hidden), row_major(args.weight)
    bias, target = unit_stride(args.bias), unit_stride(args.target)
    max_t, max_v = args.max_t, args.max_v
    seg = segments(args.h_off, args.v_off, args.l_off, args.ids)
    tokens = hidden.shape[0]
    device = hidden.device
    # The kernel writes the row of every token of a sequence; a row past h_off[-1] (a spare row of
    # a graphed bucket) belongs to none, and keeps a loss of 0 and no target (local -1), so that the
    # sum and the mean of the losses, and the count of targets, cover the real rows only.
    loss = torch.zeros(tokens, dtype=torch.float32, device=device)
    lse = torch.empty(tokens, dtype=torch.float32, device=device)
    local = torch.full((tokens,), -1, dtype=torch.int32, device=device)
    missing = torch.zeros((), dtype=torch.int64, device=device)
    batch = seg.batch
    if tokens == 0 or batch == 0:
        return VocabCrossEntropyOutput(loss, lse, local, missing)
    dim = hidden.shape[1]
    smoothing = float(args.label_smoothing)
    bm, bn, bk, warps, stages = _ce_config(dim, max_t, max_v, hidden.dtype, interpreted())
    work, inline, chunk, n_steps = worklist(seg, bm, 1, True, False)
    _ce_fwd_kernel[(tokens // bm + batch,)](
        hidden,
        weight,
        bias if bias is not None else hidden,
        seg.ids,
        target,
        local,
        missing,
        loss,
        lse,
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
        smoothing,
        int(args.ignore_index),
        max(int(max_v), 1).bit_length(),
        HAS_BIAS=bias is not None,
        SHARED=seg.v_off is None,
        EVEN_K=dim % bk == 0,
        PRECISION=precision(hidden.dtype),
        SMOOTH=smoothing != 0.0,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        INLINE=inline,
        CHUNK=chunk,
        num_warps=warps,
        num_stages=stages,
    )
    return VocabCrossEntropyOutput(loss, lse, local, missing)


def backward(
    args: VocabCrossEntropyArgs, inputs: VocabCrossEntropyBackwardInputs, *, chunk_elems: int = CE_CHUNK
) -> VocabGrads:
    """Gradients of ``sum_t grad[t] * loss_t`` w.r.t. hidden, weight and bias: the
    ``vocab_cross_entropy`` op's backward (it reads no ``target``).

    With the host offsets (``host_v_off`` ``None`` for a shared vocabulary) the batch is
    taken in chunks of at most ``chunk_elems`` logits (a sequence larger than that forms a
    chunk alone): the only logits-sized memory the loss holds. Without them, one chunk.
    ``grad_loss`` may be a broadcast view (the gradient of a mean or a sum): it is read with
    its stride. ``logits``: None (the forward keeps none: they are recomputed tile by tile)."""
    device = args.hidden.device
    hidden, weight, bias, lse = (
        row_major(args.hidden),
        row_major(args.weight),
        unit_stride(args.bias),
        unit_stride(inputs.lse),
    )
    seg = segments(args.h_off, args.v_off, args.l_off, args.ids)
    local = inputs.local.to(torch.int32).contiguous()
    grad, total, max_t, max_v = inputs.grad_loss, args.total, args.max_t, args.max_v
    need_hidden, need_weight, need_bias = inputs.need_hidden, inputs.need_weight, inputs.need_bias
    host_h_off, host_v_off = inputs.host_h_off, inputs.host_v_off
    tokens = hidden.shape[0]
    if grad.dim() != 1 or grad.shape[0] != tokens:
        grad = grad.expand(tokens)
    shared = seg.v_off is None
    dim = hidden.shape[1]
    vocab_size = weight.shape[0]
    dw = torch.zeros((vocab_size, dim), dtype=weight.dtype, device=device) if need_weight or need_bias else None
    db = torch.zeros(vocab_size, dtype=weight.dtype, device=device) if need_bias else None
    if seg.batch == 0 or tokens == 0 or total == 0:
        return VocabGrads(torch.zeros_like(hidden) if need_hidden else None, dw if need_weight else None, db)
    single = host_h_off is None or (not shared and host_v_off is None) or total <= chunk_elems
    # one chunk: d_hidden written by its kernel for every token; several: rows of sequences
    # without logits belong to no chunk and stay zero
    d_hidden = (torch.empty_like(hidden) if single else torch.zeros_like(hidden)) if need_hidden else None
    chunks = [(seg, 0, tokens, total)] if single else _ce_chunks(seg, host_h_off, host_v_off, chunk_elems, device)
    smoothing = float(args.label_smoothing)
    bm, bn, bk, warps, stages = config(dim, max_t, max_v, hidden.dtype, interpreted())
    for c_seg, t_lo, t_hi, size in chunks:
        n = c_seg.batch
        hid_c = hidden[t_lo:t_hi]
        g = torch.empty(size, dtype=hidden.dtype, device=device)
        work, inline, chunk_w, n_steps = worklist(c_seg, bm, bn, True, True)
        grid = (size // (bm * bn) + (t_hi - t_lo) // bm + c_seg.n_cand // bn + 2 * n + 1,)
        _ce_grad_kernel[grid](
            hid_c,
            weight,
            bias if bias is not None else hidden,
            c_seg.ids,
            local[t_lo:t_hi],
            lse[t_lo:t_hi],
            grad[t_lo:t_hi],
            g,
            c_seg.h_off,
            c_seg.v_arg,
            c_seg.l_off,
            work,
            n,
            c_seg.shared_v,
            n_steps,
            dim,
            vocab_size,
            hid_c.stride(0),
            weight.stride(0),
            grad.stride(0),
            smoothing,
            HAS_BIAS=bias is not None,
            SHARED=shared,
            EVEN_K=dim % bk == 0,
            PRECISION=precision(hidden.dtype),
            SMOOTH=smoothing != 0.0,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            INLINE=inline,
            CHUNK=chunk_w,
            num_warps=warps,
            num_stages=stages,
        )
        project_backward(
            g,
            hid_c,
            weight,
            c_seg,
            max_t,
            need_hidden,
            need_weight,
            need_bias,
            inputs.deterministic,
            dw_out=dw,
            db_out=db,
            dh_out=None if d_hidden is None else d_hidden[t_lo:t_hi],
        )
    return VocabGrads(d_hidden, dw if need_weight else None, db)


def _ce_chunks(seg: Segments, host_h_off, host_v_off, chunk_elems, device):
    """Yield (segments, first token, end token, logits) per chunk of at most ``chunk_elems``
    logits; needs the host offsets (the caller takes the batch as one chunk without them)."""
    batch = seg.batch
    shared = seg.v_off is None
    size_v = seg.ids.shape[0]

    def v_len(b):
        return size_v if shared else host_v_off[b + 1] - host_v_off[b]

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
                yield seg, t_lo, t_hi, size
            else:
                l_rel = [0]
                for b in range(start, stop):
                    l_rel.append(l_rel[-1] + (host_h_off[b + 1] - host_h_off[b]) * v_len(b))
                c_h_off = to_device([o - t_lo for o in host_h_off[start : stop + 1]], torch.int32, device)
                c_l_off = to_device(l_rel, torch.int64, device)
                if shared:
                    c_ids, c_v_off = seg.ids, None
                else:
                    v_lo = host_v_off[start]
                    c_ids = seg.ids[v_lo : host_v_off[stop]]
                    c_v_off = to_device([o - v_lo for o in host_v_off[start : stop + 1]], torch.int32, device)
                yield (
                    Segments(c_h_off, c_v_off, c_l_off, c_ids, stop - start, c_ids.shape[0] if shared else 0),
                    t_lo,
                    t_hi,
                    size,
                )
        start = stop
