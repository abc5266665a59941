"""What every attention kernel of :mod:`.attention_kernels` shares besides its dots: where a
program's work is (the work list of query or key blocks, the sequence bounds), which keys a row
sees under a sliding window (the spans of blocks, the element mask), and the dropout hash.

Coordinates: ``rows`` / ``cols`` are positions within a sequence (query and key), ``t_global``
packed token indices; ``shift = Lk - Lq`` aligns them as causal masking does.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find(cum, batch, n_steps, item):
    """Largest b in [0, batch) with cum[b] <= item (scalar binary search)."""
    lo = item * 0
    hi = lo + batch - 1
    for _ in range(n_steps):
        mid = (lo + hi + 1) // 2
        up = tl.load(cum + mid) <= item
        lo = tl.where(up, mid, lo)
        hi = tl.where(up, hi, mid - 1)
    return lo


@triton.jit
def _locate(cu, block_cum, batch, n_steps, item, BLOCK: tl.constexpr, INLINE: tl.constexpr, CHUNK: tl.constexpr):
    """Work item -> (sequence b, block index within b, blocks of b, total items).

    INLINE (moderate B): each program sums ceil(L / BLOCK) over the offsets itself (vector
    prefix sums, a few loads per sequence from L2), which saves the host a kernel launch
    per call. Otherwise ``block_cum`` (built by _block_cum_kernel) is binary-searched.
    """
    if INLINE:
        carry = item * 0
        count = item * 0
        before = item * 0
        after = item * 0 + 2147483647
        for start in range(0, batch, CHUNK):
            idx = start + tl.arange(0, CHUNK)
            ok = idx < batch
            length = tl.load(cu + idx + 1, mask=ok, other=0) - tl.load(cu + idx, mask=ok, other=0)
            incl = tl.cumsum(((length + (BLOCK - 1)) // BLOCK).to(tl.int32), 0) + carry
            done = ok & (incl <= item)
            count += tl.sum(done.to(tl.int32), 0)
            before = tl.maximum(before, tl.max(tl.where(done, incl, 0), 0))
            after = tl.minimum(after, tl.min(tl.where(ok & (incl > item), incl, 2147483647), 0))
            carry = tl.max(tl.where(ok, incl, carry), 0)
        return count, item - before, after - before, carry
    else:
        total = tl.load(block_cum + batch)
        b = _find(block_cum, batch, n_steps, item)
        first = tl.load(block_cum + b)
        return b, item - first, tl.load(block_cum + b + 1) - first, total


@triton.jit
def _bounds(cu_q, cu_k, b):
    """First packed token (int64) and length of sequence b on the query and key sides."""
    q_start = tl.load(cu_q + b).to(tl.int64)
    k_start = tl.load(cu_k + b).to(tl.int64)
    q_len = (tl.load(cu_q + b + 1) - q_start).to(tl.int32)
    k_len = (tl.load(cu_k + b + 1) - k_start).to(tl.int32)
    return q_start, q_len, k_start, k_len


@triton.jit
def _fmix32(x):
    """A bijective 32-bit mixer (every input bit flips each output bit with probability ~1/2)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _keep_rows(seed, h, t_global, total_q):
    """Per-row dropout keys of head ``h`` and query tokens ``t_global``: mixed with the seed."""
    rows = (h * total_q + t_global).to(tl.int64)
    hi = _fmix32((rows >> 32).to(tl.uint32) + seed.to(tl.uint32))
    return _fmix32((rows & 0xFFFFFFFF).to(tl.uint32) ^ hi)


@triton.jit
def _keep(seed, dropout_p, h, t_global, j_local, total_q):
    """``[M, N]`` dropout keep mask for query tokens ``t_global [M]`` x keys ``j_local [N]``
    (indices within the sequence) of head ``h``.

    A counter-based hash, one per element (no state, no ordering between programs): row key
    ``r = fmix(lo32(h * Tq + t) ^ fmix(hi32(h * Tq + t) + seed))``, element draw
    ``fmix(r + j * 0x9E3779B1)`` (mod 2**32); kept when its top 24 bits, as a fraction of
    2**24, are >= dropout_p. About ten integer operations per element: half the cost of
    Philox-10 at eight keys per call in the forward kernel, and no shuffles to spread one
    call's draws over neighbouring keys."""
    r = _keep_rows(seed, h, t_global, total_q)
    x = _fmix32(r[:, None] + j_local.to(tl.uint32)[None, :] * 0x9E3779B1)
    return (x >> 8).to(tl.float32) >= dropout_p * 16777216.0


@triton.jit
def _keep_t(seed, dropout_p, h, t_global, j_local, total_q):
    """The transpose of :func:`_keep`, ``[N, M]``, drawn in that layout."""
    r = _keep_rows(seed, h, t_global, total_q)
    x = _fmix32(r[None, :] + j_local.to(tl.uint32)[:, None] * 0x9E3779B1)
    return (x >> 8).to(tl.float32) >= dropout_p * 16777216.0


@triton.jit
def _in_window(rows, cols, shift, win_left, win_right):
    """``[M, N]``: whether query rows ``rows [M]`` see keys ``cols [N]`` (positions within the
    sequence) under the window."""
    rel = cols[None, :] - (rows[:, None] + shift)
    return (rel >= -win_left) & (rel <= win_right)


@triton.jit
def _key_span(first_row, last_row, shift, k_len, win_left, win_right, BLOCK_N: tl.constexpr):
    """The key blocks of query rows ``first_row..last_row`` (the block's rows in the sequence)
    under the window: ``(lo, full_lo, full_hi, hi)``, masked blocks in ``[lo, full_lo)``,
    blocks that every row sees whole in ``[full_lo, full_hi)``, masked ones in ``[full_hi, hi)``.
    ``lo``, ``full_lo``, ``full_hi`` are multiples of BLOCK_N (divisions of non-negative ints
    only), ``full_hi <= k_len``; empty when no row sees a key."""
    lo = (tl.maximum(first_row + shift - win_left, 0) // BLOCK_N) * BLOCK_N
    hi = tl.maximum(tl.minimum(k_len, last_row + shift + win_right + 1), 0)
    # a block [c, c + BLOCK_N) is whole for every row when c >= last_row + shift - win_left and
    # c + BLOCK_N <= first_row + shift + win_right + 1 and c + BLOCK_N <= k_len
    full_lo = tl.maximum(lo, ((tl.maximum(last_row + shift - win_left, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N)
    full_hi = tl.minimum(
        (k_len // BLOCK_N) * BLOCK_N, (tl.maximum(first_row + shift + win_right + 1, 0) // BLOCK_N) * BLOCK_N
    )
    return lo, full_lo, tl.maximum(full_lo, full_hi), hi


@triton.jit
def _query_span(first_col, last_col, shift, q_len, win_left, win_right, BLOCK_M: tl.constexpr):
    """The query blocks that see keys ``first_col..last_col`` (the block's keys in the sequence)
    under the window: ``(lo, full_lo, full_hi, hi)`` as in :func:`_key_span`, the rows of
    ``[full_lo, full_hi)`` seeing every key of the block; ``full_hi <= q_len`` (rows past the
    sequence add 0 in the dK/dV kernel)."""
    lo = (tl.maximum(first_col - shift - win_right, 0) // BLOCK_M) * BLOCK_M
    hi = tl.maximum(tl.minimum(q_len, last_col - shift + win_left + 1), 0)
    # a row block [r, r + BLOCK_M) sees the whole key block when r >= last_col - shift - win_right
    # and r + BLOCK_M <= first_col - shift + win_left + 1
    full_lo = tl.maximum(lo, ((tl.maximum(last_col - shift - win_right, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M)
    full_hi = tl.minimum(q_len, (tl.maximum(first_col - shift + win_left + 1, 0) // BLOCK_M) * BLOCK_M)
    return lo, full_lo, tl.maximum(full_lo, full_hi), hi
