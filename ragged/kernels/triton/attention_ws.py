"""The varlen attention forward for Hopper (sm_90) with warp specialisation, written in Gluon.

The structure of FlashAttention-3's forward, which Triton's own pipeliner does not reach
(:mod:`.attention_hopper` says why: every wgmma waited for right after its issue, one
program's softmax never beside its products):

* **Three (or four) partitions per program** (``gl.warp_specialize``): a loading warpgroup (the default
  partition; one thread issues) that TMA-loads the query tile and each key block's K and V into
  a ring of ``STAGES`` shared-memory stages, and two (or, at head dim 64, three:
  :data:`CONSUMERS_D64`) consumer warpgroups, each owning 64 of the program's query rows. The
  consumers are scheduled by the hardware independently: one's softmax runs while
  the other's matrix products occupy the tensor cores.
* **Barriers, not waits for everything**: ``k_ready[s]`` and ``v_ready[s]`` (the TMA
  transaction counts of stage ``s``'s K and V: a consumer starts ``Q K^T`` before V is in) and
  ``kv_empty[s]`` (arrived by every consumer when its ``P @ V`` of the stage has completed)
  hand each stage back and forth; the loader runs up to ``STAGES`` blocks ahead.
* **Ping-pong** (:data:`PINGPONG`, off by default): two more barriers, ``turns``, make the
  consumers issue their products strictly in turn, consumer 0 first, so that one's softmax
  always runs under the other's products rather than when the scheduler happens to place it.
* **Registers moved to the consumers** (``setmaxnreg`` through the partitions' register
  budgets): 240 per consumer thread, the 24 left of the kernel's 168 for the loading warpgroup
  (three consumers: 160 each, 32 left of 128).
* **P from registers**: the probabilities are the A operand of the second product, never
  written to shared memory.
* **A persistent grid** (:data:`PERSISTENT`, on by default): a program per multiprocessor
  looping over the tiles, the sequences with the most keys first, in snake-ordered rounds. The
  ring's blocks and the query tiles are counted across tiles (their barriers' phases run on);
  the consumers hand the query tiles back (``q_empty``) once their last ``Q K^T`` is done, so the
  next tile's queries and first key blocks load under this tile's last products and its stores.

Descriptors are made per sequence on the device (as in :mod:`.attention_hopper`): tiles that
reach past a sequence's end are zero-filled by the TMA unit, and nothing of a neighbouring
sequence is read. The program's query block comes from the work list ``block_cum`` (blocks of
:func:`block_m` query rows per sequence, cumulated), searched by each program.

What it takes: fp16/bf16, head dims 64 and 128, causal or not, GQA, positive scales; no
window, dropout or position bias (the reasons of its implementation, ``"triton_sm90_ws"``, in
:mod:`ragged.kernels.triton`). Gluon is imported here only: the launcher imports the module
on first use. Compiled for sm_90 with Triton 3.6 and 3.9 (``bench.kernel_resources``: 168
registers by ``setmaxnreg`` for the kernel, 240 for each of two consumers); tested on an H200 by
``tests/test_gpu_attention_ws.py``.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

__all__ = ["block_m", "config", "forward", "longest_first", "max_registers"]

# the TMA load's name: async_copy_global_to_shared up to Triton 3.6, async_load after
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

HEAD_DIMS = (64, 128)
# Registers per thread (setmaxnreg), by the number of consumer warpgroups: the kernel's (its
# launch limit), each consumer's, the loading warpgroup's; 65,536 a block in all.
#   2 consumers: 3 x 128 threads at 168 = 2 x 128 at 240 + 128 at 24
#   3 consumers: 4 x 128 threads at 128 = 3 x 128 at 160 + 128 at 32
_REGISTERS = {2: (168, 240, 24), 3: (128, 160, 32)}


# The consumers in ping-pong (FlashAttention-3's turn-taking: one issues its products while the
# other runs its softmax). Off until measured faster; read at each launch, so a process may turn
# it on (bench.attention_variants --ws-pingpong, the GPU tests in a child process). Programs of
# three consumers (CONSUMERS_D64) run without it: its turns are two consumers'.
PINGPONG = False
# Consumer warpgroups (64 query rows each) at head dim 64: 2, or 3 (192-row programs: more
# softmax beside the products, which at D=64 take half the time per score). Read at each launch.
CONSUMERS_D64 = 2
# The K/V ring's depth at head dim 128: 3 (229,680 bytes of shared memory with the query halves
# and the barriers, under the 232,448 of an H100/H200 SM), measured faster than 2 on an H200
# (bench/results/attention_variants_ws_h200_f48f284.md). Read at each launch, as PINGPONG.
STAGES_D128 = 3
# A program per multiprocessor looping over the tiles, the sequences with the most keys first
# (forward's ``persistent``), instead of a program per tile: each tile's prologue (the work-list
# search, the descriptors, the query load) and epilogue (the stores) under another tile's
# products. On an H200, five interleaved rounds each (bench/results/ws_persistent_ab_h200_5d41d90.md)
# it was as fast or faster on every batch measured: case (c) and about 32k tokens of lengths in
# [L/2, L] for L = 512 to 4096, both head dims, full and causal (0.65-1.005 of the time; level at
# D=128 on case (c) and on [2048, 4096], 26% faster on [256, 512] causal). Read at each launch,
# as PINGPONG (which it excludes: ping-pong runs one tile per program).
PERSISTENT = True


def config(head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_N, STAGES, CONSUMERS)``: key rows per block, the depth of the K/V ring (shared
    memory: the query tiles plus ``STAGES`` blocks of K and of V, within the 227 KB of an SM) and
    the consumer warpgroups."""
    if head_dim > 64:
        return (128, STAGES_D128, 2)
    # three consumers at 160 registers spill with 128-key blocks (56 bytes a thread): 64-key ones
    return (128, 3, 2) if CONSUMERS_D64 == 2 else (64, 4, 3)


def block_m(head_dim: int) -> int:
    """Query rows per program: 64 per consumer warpgroup."""
    return 64 * config(head_dim)[2]


def max_registers(consumers: int) -> int:
    """The kernel's register limit per thread (its launch option) for ``consumers``."""
    return _REGISTERS[consumers][0]


@gluon.jit
def _find(block_cum, batch, n_steps, item):
    """The sequence ``b`` whose query blocks hold work item ``item``: the last ``b`` with
    ``block_cum[b] <= item`` (``block_cum[0] = 0``; sequences without rows have no block)."""
    lo = item * 0
    hi = lo + batch
    for _ in range(n_steps):
        mid = (lo + hi) // 2
        go = (gl.load(block_cum + mid) <= item).to(gl.int32)
        lo = lo + (mid - lo) * go
        hi = mid + (hi - mid) * go
    return lo


@gluon.jit
def _rows_desc(base, start, stride_t, head, stride_h, rows, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr):
    """A TMA descriptor of ``rows`` tokens of one head from token ``start`` (rows >= 1)."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, HEAD_DIM], base.dtype.element_ty)
    return tma.make_tensor_descriptor(
        base + start * stride_t + head * stride_h,
        shape=[rows, HEAD_DIM],
        strides=[stride_t, 1],
        block_shape=[BLOCK, HEAD_DIM],
        layout=layout,
    )


@gluon.jit
def _tile(
    t,
    work,
    GROUP: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    CAUSAL: gl.constexpr,
    SORTED: gl.constexpr,
):
    """Work tile ``t`` (``item * heads + head``): its sequence's token ranges, its head and key
    head, its first query row and the key blocks it reads. ``SORTED``: the work list is in the
    order of ``order`` (sequence ``order[b]`` is the work list's ``b``-th)."""
    cu_q, cu_k, block_cum, order, batch, n_steps, heads = work
    item = t // heads
    h = t - item * heads
    b = _find(block_cum, batch, n_steps, item)
    m_blk = item - gl.load(block_cum + b)
    if SORTED:
        b = gl.load(order + b)
    q_start = gl.load(cu_q + b).to(gl.int64)
    k_start = gl.load(cu_k + b).to(gl.int64)
    q_len = gl.load(cu_q + b + 1) - gl.load(cu_q + b)
    k_len = gl.load(cu_k + b + 1) - gl.load(cu_k + b)
    if CAUSAL:  # the heaviest (last) blocks of a sequence first
        m_blk = (q_len + BLOCK_M - 1) // BLOCK_M - 1 - m_blk
    row0 = m_blk * BLOCK_M
    n_blocks = (k_len + BLOCK_N - 1) // BLOCK_N
    if CAUSAL:  # keys up to the diagonal of the program's last row
        last = gl.minimum(k_len, gl.maximum(row0 + BLOCK_M + k_len - q_len, 0))
        n_blocks = (last + BLOCK_N - 1) // BLOCK_N
    return q_start, q_len, k_start, k_len, h, h // GROUP, row0, n_blocks


@gluon.jit
def _schedule(work, PERSISTENT: gl.constexpr):
    """``(first, rounds, step, n_work)``: this program's tiles, and the tiles in all. One program
    per tile (grid ``(items, heads)``), or, ``PERSISTENT``, a program per multiprocessor taking one
    tile of each round of ``step`` tiles in snake order (program ``p`` the ``p``-th in even rounds,
    the ``p``-th from the end in odd ones): with the work list longest first, each program's sum
    is close to the others'."""
    heads = work[6]
    n_work = gl.load(work[2] + work[4]) * heads  # block_cum[batch] query blocks, each head
    if PERSISTENT:
        step = gl.num_programs(0)
        first = gl.program_id(0)
        rounds = (n_work + step - 1) // step
    else:
        step = 1
        first = gl.program_id(0) * heads + gl.program_id(1)
        rounds = 1
    return first, rounds, step, n_work


@gluon.jit
def _tile_of(first, r, step, PERSISTENT: gl.constexpr):
    """Round ``r``'s tile of the program whose first tile is ``first``."""
    t = first
    if PERSISTENT:
        t = r * step + first + (r & 1) * (step - 1 - 2 * first)
    return t


@gluon.jit
def _loader(
    work,
    tensors,
    smem,
    bars,
    out_args,
    HALF: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    OVERLAP: gl.constexpr,
    PINGPONG: gl.constexpr,
    CONSUMERS: gl.constexpr,
    GROUP: gl.constexpr,
    SORTED: gl.constexpr,
    PERSISTENT: gl.constexpr,
):
    """The loading warp: for each of the program's tiles, each consumer's query tile, then each key
    block's K and V into the ring (the consumers' signature: worker partitions share one). The
    ring's blocks and the query tiles are counted across tiles, so their barriers' phases run on."""
    Q, K, V, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh = tensors
    q_smem, k_smem, v_smem = smem
    q_bar, q_empty, k_ready, v_ready, kv_empty, turns = bars
    first, rounds, step, n_work = _schedule(work, PERSISTENT)
    it = first * 0  # key blocks loaded by this program before the tile
    done = first * 0  # tiles before this one
    for r in range(rounds):
        t = _tile_of(first, r, step, PERSISTENT)
        if t < n_work:
            q_start, q_len, k_start, k_len, h, hk, row0, n_blocks = _tile(
                t, work, GROUP, 64 * CONSUMERS, BLOCK_N, CAUSAL, SORTED
            )
            # the descriptors live in one global scratch slot per program: the previous tile's
            # loads have all landed before they are rewritten (the end of this loop)
            q_desc = _rows_desc(Q, q_start, stride_qt, h, stride_qh, gl.maximum(q_len, 1), HEAD_DIM, 64)
            k_desc = _rows_desc(K, k_start, stride_kt, hk, stride_kh, gl.maximum(k_len, 1), HEAD_DIM, BLOCK_N)
            v_desc = _rows_desc(V, k_start, stride_vt, hk, stride_vh, gl.maximum(k_len, 1), HEAD_DIM, BLOCK_N)
            # every consumer is done with the previous tile's queries (a fresh barrier counts as a
            # completed phase 1)
            mbarrier.wait(q_empty, (done & 1) ^ 1)
            mbarrier.expect(q_bar, CONSUMERS * q_desc.block_type.nbytes)
            for i in gl.static_range(CONSUMERS):
                _tma_load(q_desc, [row0 + 64 * i, 0], q_bar, q_smem.index(i))
            for j in range(n_blocks):
                s = (it + j) % STAGES
                phase = ((it + j) // STAGES) & 1
                mbarrier.wait(kv_empty.index(s), phase ^ 1)
                # K and V on barriers of their own: S_j = Q K_j^T starts once K_j is in, V_j still coming
                mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                _tma_load(k_desc, [j * BLOCK_N, 0], k_ready.index(s), k_smem.index(s))
                mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                _tma_load(v_desc, [j * BLOCK_N, 0], v_ready.index(s), v_smem.index(s))
            if PERSISTENT:
                # the loads still in flight: the query tile and the last STAGES blocks (each earlier
                # block's stage came back through kv_empty, after its consumers waited for it)
                mbarrier.wait(q_bar, done & 1)
                for j in range(gl.maximum(n_blocks - STAGES, 0), n_blocks):
                    s = (it + j) % STAGES
                    phase = ((it + j) // STAGES) & 1
                    mbarrier.wait(k_ready.index(s), phase)
                    mbarrier.wait(v_ready.index(s), phase)
            it += n_blocks
            done += 1


@gluon.jit
def _masked(scores, j, full, k_len, rows, shift, s_cols: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Key block ``j``'s scores, -inf where a key is past the sequence's end (the TMA's zeros)
    or right of a row's causal diagonal; blocks before ``full`` are seen whole."""
    if j >= full:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=s_cols)
        ok = gl.expand_dims(cols, 0) < k_len
        if CAUSAL:
            ok = ok & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + shift)
        scores = gl.where(ok, scores, float("-inf"))
    return scores


@gluon.jit
def _online_softmax(scores, m_i, l_i, qk_scale):
    """One key block into the running row maximum and sum: ``(p, alpha, l_i, m_i)``, the block's
    probabilities (fp32) and the factor the accumulator is rescaled by (rows that see no key
    yet: p = 0, alpha = 0)."""
    m_new = gl.maximum(m_i, gl.max(scores, 1) * qk_scale)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(scores * qk_scale - gl.expand_dims(m_safe, 1))
    alpha = gl.exp2(m_i - m_safe)
    return p, alpha, l_i * alpha + gl.sum(p, 1), m_new


@gluon.jit
def _my_turn(turns, k, HALF: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: wait until consumer ``HALF`` may issue its ``k``-th group of products. The two
    consumers take turns strictly, consumer 0 first: consumer 0's ``k``-th turn is consumer 1's
    ``(k-1)``-th hand-over (phase ``k-1`` of ``turns[0]``; a fresh barrier counts as a completed
    phase 1, so its first turn is free), consumer 1's is consumer 0's ``k``-th hand-over."""
    if PINGPONG:
        mbarrier.wait(turns.index(HALF), (k & 1) ^ (1 - HALF))


@gluon.jit
def _pass_turn(turns, HALF: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: this consumer's products are issued; the other may issue its own (the tensor
    cores run them after these, while this consumer's softmax runs)."""
    if PINGPONG:
        mbarrier.arrive(turns.index(1 - HALF), count=1)


@gluon.jit
def _consume(
    work,
    tensors,
    smem,
    bars,
    out_args,
    HALF: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    OVERLAP: gl.constexpr,
    PINGPONG: gl.constexpr,
    CONSUMERS: gl.constexpr,
    GROUP: gl.constexpr,
    SORTED: gl.constexpr,
    PERSISTENT: gl.constexpr,
):
    """One consumer warpgroup: for each of the program's tiles, query rows ``row0 + 64 * HALF ..``
    against every key block of the tile, the online softmax in registers, O and the log-sum-exp
    stored at the end."""
    first, rounds, step, n_work = _schedule(work, PERSISTENT)
    it = first * 0  # the ring's blocks and the tiles before this one, as the loader counts them
    done = first * 0
    for r in range(rounds):
        t = _tile_of(first, r, step, PERSISTENT)
        if t < n_work:
            tile = _tile(t, work, GROUP, 64 * CONSUMERS, BLOCK_N, CAUSAL, SORTED)
            _consume_tile(
                tile, it, done, tensors, smem, bars, out_args, HALF, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, OVERLAP,
                PINGPONG,
            )  # fmt: skip
            it += tile[7]
            done += 1


@gluon.jit
def _consume_tile(
    tile,
    it,
    done,
    tensors,
    smem,
    bars,
    out_args,
    HALF: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    OVERLAP: gl.constexpr,
    PINGPONG: gl.constexpr,
):
    """One tile of one consumer: ``it`` key blocks and ``done`` tiles went through the ring and the
    query tiles before it."""
    q_start, q_len, k_start, k_len, h, hk, row0, n_blocks = tile
    Q = tensors[0]
    O, LSE, stride_ot, stride_oh, heads, qk_scale = out_args
    q_smem, k_smem, v_smem = smem
    q_bar, q_empty, k_ready, v_ready, kv_empty, turns = bars
    dtype: gl.constexpr = Q.dtype.element_ty
    # the wgmma accumulators of one warpgroup: S [64, BLOCK_N] and O [64, HEAD_DIM]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], [16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], [16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)

    first = row0 + 64 * HALF  # this warpgroup's first query row within the sequence
    rows = first + gl.arange(0, 64, layout=s_rows)
    shift = k_len - q_len  # causal masks align the last query with the last key
    # key blocks every row of this half sees whole (no mask): before the sequence's end and,
    # causally, left of the half's first row's diagonal
    full = k_len // BLOCK_N
    if CAUSAL:
        full = gl.minimum(full, gl.maximum(first + shift + 1, 0) // BLOCK_N)

    m_i = gl.full([64], float("-inf"), gl.float32, layout=s_rows)
    l_i = gl.zeros([64], gl.float32, layout=s_rows)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)
    q = q_smem.index(HALF)
    mbarrier.wait(q_bar, done & 1)
    if OVERLAP:
        # S_j = Q K_j^T and P_{j-1} V_{j-1} issued back to back; the softmax of block j runs while
        # the second product is in flight (wgmma groups complete in order: waiting for all but
        # one leaves S_j done). acc is rescaled to block j's maximum once P_{j-1} V_{j-1} is in.
        # Under PINGPONG every issue (S_0; each S_j with P_{j-1} V_{j-1}; the last P V) is one
        # turn: n_blocks + 1 of them in each consumer, the same count in both (n_blocks is the
        # tile's), so the alternation never waits for a turn that does not come (one tile per
        # program: ping-pong is not persistent).
        if n_blocks > 0:
            mbarrier.wait(k_ready.index(it % STAGES), (it // STAGES) & 1)
            zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
            _my_turn(turns, 0, HALF, PINGPONG)
            scores = warpgroup_mma(q, k_smem.index(it % STAGES).permute((1, 0)), zero, use_acc=False, is_async=True)
            _pass_turn(turns, HALF, PINGPONG)
            scores = warpgroup_mma_wait(0, deps=[scores])
            if n_blocks == 1:  # the last product that reads the queries is done
                mbarrier.arrive(q_empty, count=1)
            scores = _masked(scores, 0, full, k_len, rows, shift, s_cols, BLOCK_N, CAUSAL)
            p, alpha, l_i, m_i = _online_softmax(scores, m_i, l_i, qk_scale)
            p_prev = gl.convert_layout(p.to(dtype), p_layout)
            for j in range(1, n_blocks):
                s = (it + j) % STAGES
                before = (it + j - 1) % STAGES
                mbarrier.wait(k_ready.index(s), ((it + j) // STAGES) & 1)
                mbarrier.wait(v_ready.index(before), ((it + j - 1) // STAGES) & 1)
                zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
                _my_turn(turns, j, HALF, PINGPONG)
                scores = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
                acc = warpgroup_mma(p_prev, v_smem.index(before), acc, is_async=True)
                _pass_turn(turns, HALF, PINGPONG)
                scores = warpgroup_mma_wait(1, deps=[scores])
                if j == n_blocks - 1:
                    mbarrier.arrive(q_empty, count=1)
                scores = _masked(scores, j, full, k_len, rows, shift, s_cols, BLOCK_N, CAUSAL)
                p, alpha, l_i, m_i = _online_softmax(scores, m_i, l_i, qk_scale)
                acc, p_prev = warpgroup_mma_wait(0, deps=[acc, p_prev])
                mbarrier.arrive(kv_empty.index(before), count=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
                p_prev = gl.convert_layout(p.to(dtype), p_layout)
            last = (it + n_blocks - 1) % STAGES
            mbarrier.wait(v_ready.index(last), ((it + n_blocks - 1) // STAGES) & 1)
            _my_turn(turns, n_blocks, HALF, PINGPONG)
            acc = warpgroup_mma(p_prev, v_smem.index(last), acc, is_async=True)
            _pass_turn(turns, HALF, PINGPONG)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(kv_empty.index(last), count=1)
        else:
            mbarrier.arrive(q_empty, count=1)
    else:
        for j in range(n_blocks):
            s = (it + j) % STAGES
            mbarrier.wait(k_ready.index(s), ((it + j) // STAGES) & 1)
            zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
            scores = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
            scores = warpgroup_mma_wait(0, deps=[scores])
            scores = _masked(scores, j, full, k_len, rows, shift, s_cols, BLOCK_N, CAUSAL)
            p, alpha, l_i, m_i = _online_softmax(scores, m_i, l_i, qk_scale)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
            mbarrier.wait(v_ready.index(s), ((it + j) // STAGES) & 1)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(kv_empty.index(s), count=1)
        mbarrier.arrive(q_empty, count=1)

    seen = l_i > 0
    denominator = gl.convert_layout(gl.where(seen, l_i, 1.0), o_rows)
    out = acc / gl.expand_dims(denominator, 1)
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_row = first + gl.arange(0, 64, layout=o_rows)
    d = gl.arange(0, HEAD_DIM, layout=o_cols)
    tokens = (q_start + o_row).to(gl.int64)
    ptrs = O + gl.expand_dims(tokens * stride_ot + h * stride_oh, 1) + gl.expand_dims(d, 0)
    gl.store(ptrs, out.to(dtype), mask=gl.expand_dims(o_row < q_len, 1))
    lse_rows = gl.convert_layout(o_row, s_rows)
    gl.store(LSE + (q_start + lse_rows).to(gl.int64) * heads + h, lse, mask=lse_rows < q_len)


@gluon.jit
def _ws_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    cu_q,
    cu_k,
    block_cum,
    order,
    batch,
    n_steps,
    qk_scale,
    heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    OVERLAP: gl.constexpr,
    PINGPONG: gl.constexpr,
    CONSUMERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    SORTED: gl.constexpr = False,
    PERSISTENT: gl.constexpr = False,
):
    """Grid ``(items, heads)``, a tile (one query block of one head) per program, or, ``PERSISTENT``,
    one program per multiprocessor looping over the tiles (:func:`_schedule`): the next tile's
    query and first key blocks load under the current tile's last products and its stores."""
    dtype: gl.constexpr = Q.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 64, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=CONSUMERS)  # every consumer releases the query tiles
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=CONSUMERS)  # every consumer releases a stage
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    fence_async_shared()

    work = (cu_q, cu_k, block_cum, order, batch, n_steps, heads)
    tensors = (Q, K, V, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh)
    smem = (q_smem, k_smem, v_smem)
    bars = (q_bar, q_empty, k_ready, v_ready, kv_empty, turns)
    outs = (O, LSE, stride_ot, stride_oh, heads, qk_scale)
    # the partitions' functions written in the call: Gluon takes no function held in a variable
    if CONSUMERS == 3:  # no ping-pong: its turns are two consumers'
        gl.warp_specialize(
            [
                (_loader, (work, tensors, smem, bars, outs, 0, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, OVERLAP, False, 3,
                           GROUP, SORTED, PERSISTENT)),
                (_consume, (work, tensors, smem, bars, outs, 0, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, OVERLAP, False, 3,
                            GROUP, SORTED, PERSISTENT)),
                (_consume, (work, tensors, smem, bars, outs, 1, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, OVERLAP, False, 3,
                            GROUP, SORTED, PERSISTENT)),
                (_consume, (work, tensors, smem, bars, outs, 2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, OVERLAP, False, 3,
                            GROUP, SORTED, PERSISTENT)),
            ],
            [4, 4, 4],
            [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_loader, (work, tensors, smem, bars, outs, 0, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, OVERLAP, PINGPONG,
                           2, GROUP, SORTED, PERSISTENT)),
                (_consume, (work, tensors, smem, bars, outs, 0, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, OVERLAP,
                            PINGPONG, 2, GROUP, SORTED, PERSISTENT)),
                (_consume, (work, tensors, smem, bars, outs, 1, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, OVERLAP,
                            PINGPONG, 2, GROUP, SORTED, PERSISTENT)),
            ],
            [4, 4],
            [CONSUMER_REGS, CONSUMER_REGS],
        )  # fmt: skip


def forward(
    q,
    k,
    v,
    out,
    lse,
    cu_q,
    cu_k,
    block_cum,
    n_steps: int,
    causal: bool,
    scale: float,
    overlap: bool = True,
    pingpong: bool | None = None,
    persistent: bool | None = None,
) -> None:
    """Fill ``out [Tq, H, D]`` and ``lse [Tq, H]`` (made by the launcher, with the search depth
    ``n_steps`` of the work list of :func:`block_m`-row query blocks; ``block_cum``: that list, or
    None for one made here).
    ``overlap``: each consumer's softmax beside its own ``P @ V`` (else one product at a time);
    ``pingpong``: the two consumers take turns at the tensor cores (default :data:`PINGPONG`;
    only with ``overlap`` and two consumers, one tile per program); ``persistent``: a program per
    multiprocessor looping over the tiles (default: :data:`PERSISTENT`, without ping-pong), on a
    work list of the sequences with the most keys first, made here from ``cu_q`` and ``cu_k``
    (``block_cum`` unused)."""
    from .attention_hopper import _ensure_allocator, multiprocessors
    from .attention_kernels import _block_cum

    block_n, stages, consumers = config(q.shape[-1])
    batch, heads = cu_q.shape[0] - 1, q.shape[1]
    if pingpong is None:
        pingpong = PINGPONG and consumers == 2 and not persistent
    if persistent is None:
        persistent = PERSISTENT and not pingpong
    if pingpong and not overlap:
        raise ValueError("attention_ws.forward: pingpong=True needs overlap=True, got overlap=False")
    if pingpong and consumers != 2:
        raise ValueError(f"attention_ws.forward: pingpong=True takes two consumers, got {consumers}")
    if pingpong and persistent:
        raise ValueError("attention_ws.forward: pingpong=True runs one tile per program, got persistent=True")
    _ensure_allocator()
    items = triton.cdiv(q.shape[0], 64 * consumers) + batch  # an upper bound of the work list (no sync)
    order = cu_q
    if persistent:
        order, block_cum = longest_first(cu_q, cu_k, 64 * consumers)
        grid: tuple[int, ...] = (min(items * heads, multiprocessors(q.device)),)
    else:
        if block_cum is None:
            block_cum = _block_cum(cu_q, 64 * consumers)
        grid = (items, heads)
    _ws_fwd_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        block_cum,
        order,
        batch,
        n_steps,
        scale * 1.4426950408889634,
        heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=heads // k.shape[1],
        HEAD_DIM=q.shape[-1],
        BLOCK_N=block_n,
        STAGES=stages,
        CAUSAL=causal,
        OVERLAP=overlap,
        PINGPONG=pingpong,
        CONSUMERS=consumers,
        CONSUMER_REGS=_REGISTERS[consumers][1],
        SORTED=persistent,
        PERSISTENT=persistent,
        num_warps=4,
        maxnreg=_REGISTERS[consumers][0],
    )


def longest_first(cu_q, cu_k, block: int):
    """``(order, block_cum)``: the sequences by their key counts, most first (int32 ``[B]``), and
    the work list of ``block``-row query blocks in that order (``[B+1]``), on the device, without
    a sync. A persistent grid hands its tiles out in rounds in this order, so that each round's
    tiles cost about the same."""
    order = torch.argsort(cu_k[1:] - cu_k[:-1], descending=True, stable=True)
    blocks = ((cu_q[1:] - cu_q[:-1])[order] + (block - 1)) // block
    cum = torch.zeros(cu_q.shape[0], dtype=torch.int32, device=cu_q.device)
    torch.cumsum(blocks, 0, out=cum[1:])
    return order.to(torch.int32), cum
