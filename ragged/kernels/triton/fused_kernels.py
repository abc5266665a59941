"""The Triton kernels of the per-token ops of a transformer layer (launched by
:mod:`ragged.kernels.triton.fused`, which picks their tiles and buffers).

* ``bias_act``: ``y = act(x + bias)`` over ``x [N, F]``, and its backward
  ``dx = g * act'(x + bias)``, ``dbias = sum_rows dx`` (per row group, see below).
* ``add_layer_norm``: ``s = x + residual`` then ``y = (s - mean) * rstd * weight + bias``
  over the ``F`` features of each row, and its backward.

Layout: every 2-D input is read with unit stride along the features and any row stride
(``stride(0)``), every 1-D input (parameters, row statistics) as ``ptr + i``; every output is
written contiguous. Row offsets are int64 (``N * F`` passes 2**31 at realistic sizes);
column offsets stay int32 (``F < 2**31``). The feature size is a compile-time constant
(one compilation per size; models have few), so that Triton knows the row alignment of
every output.

Numerics: fp32 arithmetic whatever the storage dtypes. The sum ``s`` is rounded to its
storage dtype (``SUM_DTYPE``, that of ``x + residual`` under torch's type promotion) before
it is normalised, so ``y`` is exactly the layer norm of the returned sum; the backward
recomputes ``s`` the same way. Parameter gradients are reduced in fp32: each program of a
backward owns a group of rows and writes its partial sums to one row of an fp32 buffer that
the launcher reduces. No atomics: results are deterministic.

Layer norm rows that fit a block sit in registers (``N_CHUNKS == 1``, several rows per
program for small ``F``); longer rows are streamed in ``BLOCK_F`` chunks, with the parameter
gradients from a separate column kernel (:func:`_ln_bwd_dwdb_kernel`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import cached_launch

# --------------------------------------------------------------------------------------
# Activations (fp32 in, fp32 out)


@triton.jit
def _tanh(u):
    # tanh(|u|) = (1 - e) / (1 + e) with e = exp(-2|u|) in (0, 1]: no overflow at any u.
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u < 0, -t, t)


@triton.jit
def _act(z, ACT: tl.constexpr):
    if ACT == 1:
        y = tl.maximum(z, 0.0)
    elif ACT == 2:  # exact GELU: z * Phi(z)
        y = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    elif ACT == 3:  # tanh approximation
        y = 0.5 * z * (1.0 + _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z)))
    elif ACT == 4:  # SiLU: z * sigmoid(z)
        y = z * tl.sigmoid(z)
    else:
        y = z
    return y


@triton.jit
def _act_grad(z, ACT: tl.constexpr):
    """d act / dz at z."""
    if ACT == 1:
        d = tl.where(z > 0, 1.0, 0.0)  # 0 at z = 0, as torch's relu
    elif ACT == 2:  # Phi(z) + z * phi(z)
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
        d = cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    elif ACT == 3:
        z2 = z * z
        t = _tanh(0.7978845608028654 * (z + 0.044715 * z2 * z))
        d = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * z2)
    elif ACT == 4:
        s = tl.sigmoid(z)
        d = s * (1.0 + z * (1.0 - s))
    else:
        d = z * 0.0 + 1.0
    return d


# --------------------------------------------------------------------------------------
# bias + activation


@cached_launch
@triton.jit(do_not_specialize=["n_rows"])
def _bias_act_fwd_kernel(
    X,
    BIAS,
    Y,
    n_rows,
    stride_x,
    N_COLS: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    col_ok = cols < N_COLS
    m = (rows < n_rows)[:, None] & col_ok[None, :]
    z = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = _act(z, ACT)
    tl.store(Y + rows[:, None] * N_COLS + cols[None, :], y.to(Y.dtype.element_ty), mask=m)


@cached_launch
@triton.jit(do_not_specialize=["n_rows", "rows_per_group", "part_off"])
def _bias_act_bwd_kernel(
    G,
    X,
    BIAS,
    DX,
    DBIAS_PART,
    MASK,
    n_rows,
    rows_per_group,
    stride_g,
    stride_x,
    stride_mask,
    stride_part,
    part_off,
    drop_scale,
    N_COLS: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NEED_DBIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
    MASK_VEC: tl.constexpr = 8,
):
    """Program (group, column block): rows [group * rows_per_group, +rows_per_group); its
    partial bias sum goes to row ``group`` of ``DBIAS_PART`` (row stride ``stride_part``), from
    column ``part_off`` on.

    ``HAS_MASK``: ``G`` is the gradient of a dropout's output, taken back through it first
    (``g * keep * drop_scale``, rounded to G's dtype: what ``native_dropout_backward`` gives)."""
    group = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    col_ok = cols < N_COLS
    if HAS_BIAS:
        b = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)
    first = group.to(tl.int64) * rows_per_group
    end = tl.minimum(first + rows_per_group, n_rows)
    acc = tl.zeros([BLOCK_F], dtype=tl.float32)
    for start in range(first, end, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        m = (rows < end)[:, None] & col_ok[None, :]
        z = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += b[None, :]
        g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_MASK:
            mcols = tl.max_contiguous(cols, MASK_VEC)  # see _ln_bwd_kernel
            keep = tl.load(MASK + rows[:, None] * stride_mask + mcols[None, :], mask=m, other=0).to(tl.float32)
            g = (g * keep * drop_scale).to(G.dtype.element_ty).to(tl.float32)
        dz = g * _act_grad(z, ACT)  # 0 where masked (g = 0 there)
        tl.store(DX + rows[:, None] * N_COLS + cols[None, :], dz.to(DX.dtype.element_ty), mask=m)
        if NEED_DBIAS:
            acc += tl.sum(dz, 0)
    if NEED_DBIAS:
        tl.store(DBIAS_PART + part_off + group.to(tl.int64) * stride_part + cols, acc, mask=col_ok)


# --------------------------------------------------------------------------------------
# residual add + layer norm


@triton.jit
def _load_sum(A, B, rows, cols, m, stride_a, stride_b, HAS_B: tl.constexpr, SUM_DTYPE: tl.constexpr):
    """``a + b`` rounded to the storage dtype of the sum, as fp32 (0 where masked)."""
    s = tl.load(A + rows[:, None] * stride_a + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_B:
        s += tl.load(B + rows[:, None] * stride_b + cols[None, :], mask=m, other=0.0).to(tl.float32)
        s = s.to(SUM_DTYPE).to(tl.float32)
    return s


@cached_launch
@triton.jit(do_not_specialize=["n_rows"])
def _ln_fwd_kernel(
    X,
    R,
    W,
    B,
    Y,
    S,
    MEAN,
    RSTD,
    n_rows,
    stride_x,
    stride_r,
    eps,
    N_COLS: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    STORE_SUM: tl.constexpr,
    SUM_DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
    N_CHUNKS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    if N_CHUNKS == 1:  # the rows sit in registers
        cols = tl.arange(0, BLOCK_F)
        col_ok = cols < N_COLS
        m = row_ok[:, None] & col_ok[None, :]
        s = _load_sum(X, R, rows, cols, m, stride_x, stride_r, HAS_RES, SUM_DTYPE)
        if STORE_SUM:
            tl.store(S + rows[:, None] * N_COLS + cols[None, :], s.to(S.dtype.element_ty), mask=m)
        mean = tl.sum(s, 1) / N_COLS
        d = tl.where(m, s - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, 1) / N_COLS + eps)
        y = d * rstd[:, None]
        if HAS_W:
            y = y * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rows[:, None] * N_COLS + cols[None, :], y.to(Y.dtype.element_ty), mask=m)
    else:  # long rows: three passes over chunks (sum, centred squares, output)
        acc = tl.zeros([BLOCK_R, BLOCK_F], dtype=tl.float32)
        for c in range(N_CHUNKS):
            cols = c * BLOCK_F + tl.arange(0, BLOCK_F)
            m = row_ok[:, None] & (cols < N_COLS)[None, :]
            s = _load_sum(X, R, rows, cols, m, stride_x, stride_r, HAS_RES, SUM_DTYPE)
            if STORE_SUM:
                tl.store(S + rows[:, None] * N_COLS + cols[None, :], s.to(S.dtype.element_ty), mask=m)
            acc += s
        mean = tl.sum(acc, 1) / N_COLS
        acc = tl.zeros([BLOCK_R, BLOCK_F], dtype=tl.float32)
        for c in range(N_CHUNKS):
            cols = c * BLOCK_F + tl.arange(0, BLOCK_F)
            m = row_ok[:, None] & (cols < N_COLS)[None, :]
            s = _load_sum(X, R, rows, cols, m, stride_x, stride_r, HAS_RES, SUM_DTYPE)
            d = tl.where(m, s - mean[:, None], 0.0)
            acc += d * d
        rstd = 1.0 / tl.sqrt(tl.sum(acc, 1) / N_COLS + eps)
        for c in range(N_CHUNKS):
            cols = c * BLOCK_F + tl.arange(0, BLOCK_F)
            col_ok = cols < N_COLS
            m = row_ok[:, None] & col_ok[None, :]
            s = _load_sum(X, R, rows, cols, m, stride_x, stride_r, HAS_RES, SUM_DTYPE)
            y = (s - mean[:, None]) * rstd[:, None]
            if HAS_W:
                y = y * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if HAS_B:
                y = y + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(Y + rows[:, None] * N_COLS + cols[None, :], y.to(Y.dtype.element_ty), mask=m)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@cached_launch
@triton.jit(do_not_specialize=["n_rows", "rows_per_group", "part_off"])
def _ln_bwd_kernel(
    DY,
    DS,
    A,
    BSRC,
    W,
    MEAN,
    RSTD,
    DSUM,
    PART,
    MASK,
    DROP,
    n_rows,
    rows_per_group,
    stride_dy,
    stride_ds,
    stride_a,
    stride_b,
    stride_mask,
    stride_part,
    part_off,
    drop_scale,
    N_COLS: tl.constexpr,
    HAS_DS: tl.constexpr,
    HAS_BSRC: tl.constexpr,
    HAS_W: tl.constexpr,
    NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr,
    HAS_MASK: tl.constexpr,
    NEED_DC: tl.constexpr,
    SUM_DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
    N_CHUNKS: tl.constexpr,
    MASK_VEC: tl.constexpr = 8,
):
    """``ds_total = rstd * (g - mean(g) - xhat * mean(g * xhat)) + ds`` with ``g = dy * w``,
    ``xhat = (s - mean) * rstd`` and ``s = a + b`` (b optional) recomputed as in the forward.

    Program ``group`` takes rows [group * rows_per_group, +rows_per_group). With one chunk
    it also sums ``dy * xhat`` (``NEED_DW``) and ``dy`` (``NEED_DB``) over its rows into row
    ``group`` of ``PART`` (row stride ``stride_part``), from column ``part_off`` on, F
    columns each in that order; with several the launcher runs ``_ln_bwd_dwdb_kernel``
    instead.

    One chunk only: ``HAS_MASK`` also writes ``DROP = ds_total * keep * drop_scale`` (the
    gradient through the dropout whose output fed ``a``, from ``ds_total`` rounded to its
    dtype, as ``native_dropout_backward`` computes it), ``NEED_DC`` sums that gradient
    (``ds_total`` without a mask) over the rows into the next F columns of ``PART`` (a
    Linear's bias gradient)."""
    group = tl.program_id(0)
    first = group.to(tl.int64) * rows_per_group
    end = tl.minimum(first + rows_per_group, n_rows)
    if N_CHUNKS == 1:
        cols = tl.arange(0, BLOCK_F)
        col_ok = cols < N_COLS
        if HAS_W:
            w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_F], dtype=tl.float32)
        db = tl.zeros([BLOCK_F], dtype=tl.float32)
        dc = tl.zeros([BLOCK_F], dtype=tl.float32)
        for start in range(first, end, BLOCK_R):
            rows = start + tl.arange(0, BLOCK_R)
            row_ok = rows < end
            m = row_ok[:, None] & col_ok[None, :]
            s = _load_sum(A, BSRC, rows, cols, m, stride_a, stride_b, HAS_BSRC, SUM_DTYPE)
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            xhat = tl.where(m, (s - mean[:, None]) * rstd[:, None], 0.0)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=m, other=0.0).to(tl.float32)
            g = dy
            if HAS_W:
                g = dy * w[None, :]
            c1 = tl.sum(g * xhat, 1) / N_COLS
            c2 = tl.sum(g, 1) / N_COLS
            ds = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
            if HAS_DS:
                ds += tl.load(DS + rows[:, None] * stride_ds + cols[None, :], mask=m, other=0.0).to(tl.float32)
            ds = ds.to(DSUM.dtype.element_ty)
            tl.store(DSUM + rows[:, None] * N_COLS + cols[None, :], ds, mask=m)
            if NEED_DW:
                dw += tl.sum(dy * xhat, 0)
            if NEED_DB:
                db += tl.sum(dy, 0)
            if HAS_MASK or NEED_DC:
                d = ds.to(tl.float32)
                if HAS_MASK:
                    # the mask's columns announced contiguous in runs of the data's vector width only,
                    # so that its bytes load in the data's layout (no shuffle through shared memory)
                    mcols = tl.max_contiguous(cols, MASK_VEC)
                    keep = tl.load(MASK + rows[:, None] * stride_mask + mcols[None, :], mask=m, other=0)
                    d = (d * keep.to(tl.float32) * drop_scale).to(DROP.dtype.element_ty)
                    tl.store(DROP + rows[:, None] * N_COLS + cols[None, :], d, mask=m)
                    d = d.to(tl.float32)
                if NEED_DC:
                    dc += tl.sum(tl.where(m, d, 0.0), 0)
        out = PART + part_off + group.to(tl.int64) * stride_part + cols
        if NEED_DW:
            tl.store(out, dw, mask=col_ok)
            out += N_COLS
        if NEED_DB:
            tl.store(out, db, mask=col_ok)
            out += N_COLS
        if NEED_DC:
            tl.store(out, dc, mask=col_ok)
    else:
        for start in range(first, end, BLOCK_R):
            rows = start + tl.arange(0, BLOCK_R)
            row_ok = rows < end
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            acc1 = tl.zeros([BLOCK_R, BLOCK_F], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_R, BLOCK_F], dtype=tl.float32)
            for c in range(N_CHUNKS):
                cols = c * BLOCK_F + tl.arange(0, BLOCK_F)
                col_ok = cols < N_COLS
                m = row_ok[:, None] & col_ok[None, :]
                s = _load_sum(A, BSRC, rows, cols, m, stride_a, stride_b, HAS_BSRC, SUM_DTYPE)
                xhat = tl.where(m, (s - mean[:, None]) * rstd[:, None], 0.0)
                g = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=m, other=0.0).to(tl.float32)
                if HAS_W:
                    g = g * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                acc1 += g * xhat
                acc2 += g
            c1 = tl.sum(acc1, 1) / N_COLS
            c2 = tl.sum(acc2, 1) / N_COLS
            for c in range(N_CHUNKS):
                cols = c * BLOCK_F + tl.arange(0, BLOCK_F)
                col_ok = cols < N_COLS
                m = row_ok[:, None] & col_ok[None, :]
                s = _load_sum(A, BSRC, rows, cols, m, stride_a, stride_b, HAS_BSRC, SUM_DTYPE)
                xhat = (s - mean[:, None]) * rstd[:, None]
                g = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=m, other=0.0).to(tl.float32)
                if HAS_W:
                    g = g * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                ds = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
                if HAS_DS:
                    ds += tl.load(DS + rows[:, None] * stride_ds + cols[None, :], mask=m, other=0.0).to(tl.float32)
                tl.store(DSUM + rows[:, None] * N_COLS + cols[None, :], ds.to(DSUM.dtype.element_ty), mask=m)


@cached_launch
@triton.jit(do_not_specialize=["n_rows", "rows_per_group"])
def _ln_bwd_dwdb_kernel(
    DY,
    A,
    BSRC,
    MEAN,
    RSTD,
    DW_PART,
    DB_PART,
    n_rows,
    rows_per_group,
    stride_dy,
    stride_a,
    stride_b,
    N_COLS: tl.constexpr,
    HAS_BSRC: tl.constexpr,
    NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr,
    SUM_DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """Partial ``sum dy * xhat`` and ``sum dy`` of a row group over one column block (long rows)."""
    group = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    col_ok = cols < N_COLS
    first = group.to(tl.int64) * rows_per_group
    end = tl.minimum(first + rows_per_group, n_rows)
    dw = tl.zeros([BLOCK_F], dtype=tl.float32)
    db = tl.zeros([BLOCK_F], dtype=tl.float32)
    for start in range(first, end, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        row_ok = rows < end
        m = row_ok[:, None] & col_ok[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if NEED_DW:
            s = _load_sum(A, BSRC, rows, cols, m, stride_a, stride_b, HAS_BSRC, SUM_DTYPE)
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            dw += tl.sum(tl.where(m, (s - mean[:, None]) * rstd[:, None], 0.0) * dy, 0)
        if NEED_DB:
            db += tl.sum(dy, 0)
    if NEED_DW:
        tl.store(DW_PART + group.to(tl.int64) * N_COLS + cols, dw, mask=col_ok)
    if NEED_DB:
        tl.store(DB_PART + group.to(tl.int64) * N_COLS + cols, db, mask=col_ok)
