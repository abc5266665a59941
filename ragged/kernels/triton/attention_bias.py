"""The relative-position bias of the attention kernels (``position_bias=(table, buckets)``, see
:mod:`ragged.ops.attention`): read per tile in the forward and backward, its table gradient
summed per bucket in the dQ kernel.

Coordinates: ``rows`` / ``cols`` are query and key positions within a sequence; the bias of
``(i, j)`` sits at distance index ``j - i + max_q - 1`` of ``buckets``.

Forward. The launcher composes the table with the buckets once per call,
``dist[h, d] = table[buckets[d], h] * log2(e)`` (``[H, max_q + max_k - 1]`` float32, one gather
of a few thousand numbers, :func:`distance_table`; the scale puts it in the kernels' exp2
domain once per call instead of once per score), so that a tile's bias is one load per score from a
row of ``dist`` that stays in L1: ``dist[h, cols - rows + max_q - 1]``, contiguous along the
keys of each row (coalesced), no dependent second load and no mask (rows and columns are
clamped into the sequence first, which keeps every index in ``[0, max_q + max_k - 1)``; a row
or column past the sequence gets a finite bias that no result reads). It is added to the
scaled scores (exp2 domain), before masking. Nothing of size
``B x H x L x L`` exists.

Table gradient. ``dtable[n, h]`` sums ``dS`` of head ``h`` over the pairs of bucket ``n``. A
tile's ``dS [BLOCK_M, BLOCK_N]`` is first summed along its diagonals (all its pairs at one
distance): a ``tl.gather`` rotates row ``r`` left by ``r`` within the tile, so that each column
of the rotated tile holds two diagonals, ``c - r = y`` and ``c - r = y - BLOCK_N``, split at the
wrap point into two column sums (:func:`_diagonal_sums`; needs ``BLOCK_M <= BLOCK_N``). The
second lies in the distance range of the previous key block's first, so the dQ program walks
its key blocks in order carrying one ``[BLOCK_N]`` vector: each distance's sum is complete once
the next block has added its share, and is then sent to its bucket by a ``[BLOCK_N,
NUM_BUCKETS]`` compare-and-sum against the buckets of that range (one vector load,
:func:`_bucket_add`). That is about three passes over a tile's worth of elements whatever the
bucket count, where a masked sum per bucket would be ``num_buckets`` passes. Each program (one
query block of one head) keeps its ``[NUM_BUCKETS]`` sums in registers and writes them once to
its own row of a partial buffer; :func:`table_gradient` sums the rows in a fixed order. No
atomics: the gradient is the same bits every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bias_row(dist, span, h, max_q):
    """Head ``h``'s row of the distance table at distance 0: the bias of ``(i, j)`` is at
    ``pointer + j - i``."""
    return dist + h.to(tl.int64) * span + (max_q - 1)


@triton.jit
def _bias_tile(bias_row, rows, cols, k_len, MASKED: tl.constexpr):
    """``[M, N]`` float32 bias, in the exp2 domain, of query rows ``rows [M]`` (clamped into the
    sequence by the caller) and keys ``cols [N]`` (clamped here where ``MASKED``: only a masked
    block reaches past the sequence)."""
    if MASKED:
        cols = tl.minimum(cols, k_len - 1)
    return tl.load(bias_row + (cols[None, :] - rows[:, None]))


@triton.jit
def _bias_tile_t(bias_row, cols, rows, q_len):
    """``[N, M]`` float32 bias, in the exp2 domain, of keys ``cols [N]`` (clamped into the
    sequence by the caller) and query rows ``rows [M]`` (clamped here), for the transposed tiles
    of the dK/dV kernel."""
    rows = tl.minimum(rows, q_len - 1)
    return tl.load(bias_row + (cols[:, None] - rows[None, :]))


@triton.jit
def _diagonal_sums(ds, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(lo, hi)``, each ``[BLOCK_N]``: the sums of ``ds [BLOCK_M, BLOCK_N]`` (``BLOCK_M <=
    BLOCK_N``) along its diagonals, ``lo[y]`` over the pairs with ``c - r = y`` and ``hi[y]`` over
    those with ``c - r = y - BLOCK_N``. Row ``r`` is rotated left by ``r`` (one ``tl.gather`` of
    the tile's own size), so that column ``y`` of the rotated tile holds both diagonals; the
    wrap point splits them."""
    tl.static_assert(BLOCK_M <= BLOCK_N)
    r = tl.arange(0, BLOCK_M)[:, None]
    y = tl.arange(0, BLOCK_N)[None, :]
    rotated = tl.gather(ds, (y + r) & (BLOCK_N - 1), 1)  # rotated[r, y] = ds[r, (y + r) % N]
    wrapped = y + r >= BLOCK_N
    return tl.sum(tl.where(wrapped, 0.0, rotated), 0), tl.sum(tl.where(wrapped, rotated, 0.0), 0)


@triton.jit
def _bucket_add(acc, sums, buckets, span, pos0, BLOCK_N: tl.constexpr, NUM_BUCKETS: tl.constexpr):
    """``acc [NUM_BUCKETS]`` plus ``sums [BLOCK_N]`` (the sums at distance indices ``pos0 ..
    pos0 + BLOCK_N - 1``) sent to their buckets. An index outside ``buckets`` holds only zeros of
    ``dS`` (pairs past the sequence) and counts for no bucket."""
    pos = pos0 + tl.arange(0, BLOCK_N)
    bucket = tl.load(buckets + pos, mask=(pos >= 0) & (pos < span), other=-1)
    n = tl.arange(0, NUM_BUCKETS)
    return acc + tl.sum(tl.where(bucket[:, None] == n[None, :], sums[:, None], 0.0), 0)


LOG2E = 1.4426950408889634


def distance_table(table: torch.Tensor, buckets: torch.Tensor) -> torch.Tensor:
    """``[H, len(buckets)]`` float32, contiguous: ``table[buckets[d], h] * log2(e)`` at ``[h, d]``
    (the forward's and backward's bias rows, already in the kernels' exp2 domain; one gather
    and one scale on the device, no sync)."""
    return (table.detach().t().to(torch.float32)[:, buckets] * LOG2E).contiguous()


def partial_buffer(programs: int, heads: int, num_buckets: int, device: torch.device) -> torch.Tensor:
    """``[programs, NUM_BUCKETS, H]`` float32 zeros: a row of bucket sums per dQ program (the
    programs past the last query block write none); ``NUM_BUCKETS``, the kernel's vector of
    sums, is the table's row count rounded up to a power of two, at least 16."""
    return torch.zeros(
        (programs, max(16, triton.next_power_of_2(num_buckets)), heads), dtype=torch.float32, device=device
    )


def table_gradient(partial: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``dtable`` in the table's shape and dtype: the programs' rows summed in a fixed order."""
    return partial.sum(0)[: table.shape[0]].to(table.dtype)


def gather_reason() -> str | None:
    """Why this Triton cannot sum the table gradient (None when it can)."""
    if hasattr(tl, "gather"):
        return None
    return f"the Triton attention kernels need tl.gather (Triton >= 3.2) for position_bias, got {triton.__version__}"
