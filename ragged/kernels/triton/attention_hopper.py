"""The varlen attention forward for Hopper (sm_90): tiles moved by TMA through tensor
descriptors, the P @ V product accumulated in place.

What it changes against :func:`.attention_kernels._fwd_kernel` (same work list, same masks,
same outputs):

* **Descriptors per sequence, made on the device.** Each program describes its sequence's
  rows of Q, K, V and O to the TMA unit (``tl.make_tensor_descriptor``: base at the sequence's
  first token and head, ``[L, D]`` rows of the token stride). A tile that reaches past the
  sequence's end comes in zero-filled and the store of O is clipped at it, by the hardware: no
  element masks on the loads, and nothing of a neighbouring sequence is read (a NaN or an
  infinity in it cannot leak in through ``0 * inf``).
* **In-place accumulation.** ``acc = dot(p, v, acc * alpha)``: the wgmma accumulates into the
  rescaled registers instead of adding a second product.
* **The scale applied after the row maximum** (positive scales only): the maximum is taken
  over the raw scores and ``exp2(s * scale - m)`` is one fused multiply-add per score.
* **The pipelined key loop** (``PIPE``, the chosen shape at D=128 without a mask): the scores
  of block j and ``P @ V`` of block j - 1 are issued back to back, the softmax after both.
* **One-warpgroup tiles** (64 rows, 4 warps, two programs a multiprocessor): one program's
  softmax runs beside the other's products (the chosen shape for causal masks and D=64).

What it does not reach (``bench/results/ncu_attention_sm90_*.txt``): the tensor pipe is busy
44-49% of the forward's cycles. Triton 3.6 and 3.9 wait for every wgmma right after issuing
it (``warp_group_dot_wait {pendings = 0}`` in the TTGIR, also in the pipelined loop), so a
warpgroup's softmax never overlaps its own products, and ``tl.range(...,
warp_specialize=True)`` gives the same code as without at sm_90 (at one shape, D=64, 64 x 64
tiles, 4 warps, 2 stages, Triton 3.9's compiler aborted). The overlap FlashAttention-3 gets
from producer and consumer warpgroups needs explicit asynchronous wgmma and barriers (Gluon or
CUDA C++).

It takes fp16/bf16 at head dims 64 and 128, with causal masks, sliding windows and dropout
(the portable kernels' masks and dropout hash) but no position bias, on sm_90 (or under
``TRITON_INTERPRET=1``), with 16-byte aligned operands whose token and head strides are
multiples of 16 bytes (the TMA's rules). Two implementations of the attention op run it,
declared with their reasons and ranks in :mod:`ragged.kernels.triton`: ``"triton_sm90"``
(this forward, the portable backward; ``"auto"`` takes it for long batches, where the sweep of
``bench/tune_attention.py --hopper`` measured it faster) and ``"triton_sm90_full"`` (its
backward too, :mod:`.attention_hopper_bwd`; taken only where preferred:
``ragged.backends.prefer`` or ``RAGGED_ATTENTION_HOPPER=1``). :func:`runs` is the last check,
made by the launcher with the tensors in hand.

Device descriptors need a global scratch buffer per launch: Triton asks its allocator
(``triton.set_allocator``, one per thread); where a thread has none, the launcher sets one
that takes the buffer from torch's caching allocator on the current stream (stream-ordered,
captured into CUDA graphs like any other allocation).
"""

from __future__ import annotations

import functools
import threading

import torch
import triton
import triton.language as tl

from .attention_common import _bounds, _in_window, _keep, _key_span, _locate
from .launch import cached_launch

__all__ = ["CONFIGS", "config", "forward", "runs"]

HEAD_DIMS = (64, 128)
_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _rows(base, start, stride_t, head, stride_h, rows, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """A TMA descriptor of one sequence's ``rows`` tokens of one head (from token ``start``):
    ``[rows, HEAD_DIM]`` with the token stride, moved ``BLOCK`` rows at a time; rows past the
    end load as zeros and are not stored. ``rows`` must be at least 1."""
    return tl.make_tensor_descriptor(
        base + start * stride_t + head * stride_h,
        shape=[rows, HEAD_DIM],
        strides=[stride_t, 1],
        block_shape=[BLOCK, HEAD_DIM],
    )


@triton.jit
def _query_block(cu_q, cu_k, b, m_blk, n_blocks, h, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Where a query block of the work list reads: ``(q_start, q_len, k_start, k_len, key head,
    first row)``; under CAUSAL the heaviest (last) blocks of a sequence come first."""
    q_start, q_len, k_start, k_len = _bounds(cu_q, cu_k, b)
    if CAUSAL:
        m_blk = n_blocks - 1 - m_blk
    return q_start, q_len, k_start, k_len, h // GROUP, m_blk * BLOCK_M


@triton.jit
def _key_rows(
    K, V, k_start, k_len, hk, stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr
):
    """The K and V descriptors of one sequence's keys of key head ``hk`` (one row when it has
    none: a descriptor has no empty dim; no key block is read then)."""
    kv_rows = tl.maximum(k_len, 1)
    return (
        _rows(K, k_start, stride_kt, hk, stride_kh, kv_rows, HEAD_DIM, BLOCK_N),
        _rows(V, k_start, stride_vt, hk, stride_vh, kv_rows, HEAD_DIM, BLOCK_N),
    )


@triton.jit
def _seen(rows, cols, k_len, shift, win_left, win_right, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """``[M, N]``: whether query ``rows`` see keys ``cols`` (positions in the sequence): keys within
    the sequence, left of the causal diagonal (CAUSAL) or inside the window (WINDOW)."""
    ok = cols[None, :] < k_len
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None] + shift)
    if WINDOW:
        ok = ok & _in_window(rows, cols, shift, win_left, win_right)
    return ok


@triton.jit
def _softmax(
    l_i,
    m_i,
    s,
    cols,
    k_len,
    shift,
    win_left,
    win_right,
    offs_m,
    qk_scale,
    seed,
    dropout_p,
    h,
    q_start,
    total_q,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    DROPOUT: tl.constexpr,
):
    """One key block of the online softmax: the scores ``s`` of keys ``cols`` into the running
    maximum and sum; returns ``(p, alpha, l_i, m_i)``: the block's probabilities (fp32) and the
    factor the accumulator is rescaled by. MASKED: keys past the sequence (zeros from the TMA),
    right of the causal diagonal or outside the window score -inf. ``DROPOUT``: ``p`` dropped
    after the row sums, with the portable kernels' hash (same mask)."""
    if MASKED:
        s = tl.where(_seen(offs_m, cols, k_len, shift, win_left, win_right, CAUSAL, WINDOW), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        keep = _keep(seed, dropout_p, h, q_start + offs_m, cols, total_q)
        p = tl.where(keep, p * (1.0 / (1.0 - dropout_p)), 0.0)
    return p, alpha, l_i, m_new


@triton.jit
def _tma_inner(
    acc,
    l_i,
    m_i,
    q,
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
    q_start,
    total_q,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    DROPOUT: tl.constexpr,
    PIPE: tl.constexpr = False,
):
    """The online softmax over the key blocks [lo, hi) (:func:`_softmax`), ``acc += P @ V``.
    ``PIPE``: the products are issued one block apart, the scores of block j and ``P @ V`` of
    block j - 1 back to back, so that the softmax of block j runs while the tensor cores do the
    second (the wgmma is asynchronous); the first softmax and the last product are peeled off."""
    if PIPE:
        if lo < hi:
            s = tl.dot(q, k_desc.load([lo, 0]).T)
            p, alpha, l_i, m_i = _softmax(
                l_i,
                m_i,
                s,
                lo + offs_n,
                k_len,
                shift,
                win_left,
                win_right,
                offs_m,
                qk_scale,
                seed,
                dropout_p,
                h,
                q_start,
                total_q,
                MASKED,
                CAUSAL,
                WINDOW,
                DROPOUT,
            )
            acc = acc * alpha[:, None]
            for start_n in range(lo + BLOCK_N, hi, BLOCK_N):
                s = tl.dot(q, k_desc.load([start_n, 0]).T)
                v = v_desc.load([start_n - BLOCK_N, 0])
                acc = tl.dot(p.to(v.dtype), v, acc)
                p, alpha, l_i, m_i = _softmax(
                    l_i,
                    m_i,
                    s,
                    start_n + offs_n,
                    k_len,
                    shift,
                    win_left,
                    win_right,
                    offs_m,
                    qk_scale,
                    seed,
                    dropout_p,
                    h,
                    q_start,
                    total_q,
                    MASKED,
                    CAUSAL,
                    WINDOW,
                    DROPOUT,
                )
                acc = acc * alpha[:, None]
            last = lo + ((hi - lo - 1) // BLOCK_N) * BLOCK_N
            v = v_desc.load([last, 0])
            acc = tl.dot(p.to(v.dtype), v, acc)
    else:
        for start_n in range(lo, hi, BLOCK_N):
            s = tl.dot(q, k_desc.load([start_n, 0]).T)
            p, alpha, l_i, m_i = _softmax(
                l_i,
                m_i,
                s,
                start_n + offs_n,
                k_len,
                shift,
                win_left,
                win_right,
                offs_m,
                qk_scale,
                seed,
                dropout_p,
                h,
                q_start,
                total_q,
                MASKED,
                CAUSAL,
                WINDOW,
                DROPOUT,
            )
            v = v_desc.load([start_n, 0])
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_i


@triton.jit
def _tma_block(
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
    item,
    h,
    heads,
    win_left,
    win_right,
    seed,
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
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    DROPOUT: tl.constexpr,
    INLINE: tl.constexpr,
    CHUNK: tl.constexpr,
    PIPE: tl.constexpr,
):
    """Work item ``item`` (one query block of the work list of ``_fwd_kernel``) of head ``h``;
    nothing past the list's end."""
    b, m_blk, n_blocks, n_items = _locate(cu_q, block_cum, batch, n_steps, item, BLOCK_M, INLINE, CHUNK)
    if item < n_items:
        q_start, q_len, k_start, k_len, hk, row0 = _query_block(
            cu_q, cu_k, b, m_blk, n_blocks, h, GROUP, BLOCK_M, CAUSAL
        )
        q_desc = _rows(Q, q_start, stride_qt, h, stride_qh, q_len, HEAD_DIM, BLOCK_M)
        k_desc, v_desc = _key_rows(
            K, V, k_start, k_len, hk, stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM, BLOCK_N
        )
        q = q_desc.load([row0, 0])
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        qk_scale = sm_scale * 1.4426950408889634

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

        shift = k_len - q_len  # causal: row i sees keys j <= i + shift
        if WINDOW:  # masked blocks at both ends of the window's span, whole ones between
            lo, full_lo, full_hi, hi = _key_span(
                row0, tl.minimum(row0 + BLOCK_M, q_len) - 1, shift, k_len, win_left, win_right, BLOCK_N
            )
            acc, l_i, m_i = _tma_inner(
                acc,
                l_i,
                m_i,
                q,
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
                q_start,
                total_q,
                BLOCK_N,
                True,
                False,
                True,
                DROPOUT,
            )
            acc, l_i, m_i = _tma_inner(
                acc,
                l_i,
                m_i,
                q,
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
                q_start,
                total_q,
                BLOCK_N,
                False,
                False,
                True,
                DROPOUT,
                PIPE,
            )
            acc, l_i, m_i = _tma_inner(
                acc,
                l_i,
                m_i,
                q,
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
                q_start,
                total_q,
                BLOCK_N,
                True,
                False,
                True,
                DROPOUT,
            )
        else:
            end = k_len
            full = (k_len // BLOCK_N) * BLOCK_N  # key blocks every row sees without a mask
            if CAUSAL:
                end = tl.maximum(tl.minimum(k_len, row0 + BLOCK_M + shift), 0)
                full = tl.maximum(tl.minimum(full, ((row0 + shift + 1) // BLOCK_N) * BLOCK_N), 0)
            acc, l_i, m_i = _tma_inner(
                acc,
                l_i,
                m_i,
                q,
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
                q_start,
                total_q,
                BLOCK_N,
                False,
                CAUSAL,
                False,
                DROPOUT,
                PIPE,
            )
            acc, l_i, m_i = _tma_inner(
                acc,
                l_i,
                m_i,
                q,
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
                q_start,
                total_q,
                BLOCK_N,
                True,
                CAUSAL,
                False,
                DROPOUT,
            )

        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        o_desc = _rows(O, q_start, stride_ot, h, stride_oh, q_len, HEAD_DIM, BLOCK_M)
        o_desc.store([row0, 0], out.to(O.dtype.element_ty))
        tl.store(LSE + (q_start + offs_m) * heads + h, lse, mask=offs_m < q_len)


@cached_launch
@triton.jit(do_not_specialize=["batch", "n_steps", "n_work", "win_left", "win_right", "seed", "total_q"])
def _fwd_tma_kernel(
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
    heads,
    n_work,
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
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    DROPOUT: tl.constexpr,
    SEED_PTR: tl.constexpr,
    PERSISTENT: tl.constexpr,
    INLINE: tl.constexpr,
    CHUNK: tl.constexpr,
    PIPE: tl.constexpr,
):
    """Grid ``(items, heads)``: one query block of one head per program. ``PERSISTENT``: a grid of
    a few programs per multiprocessor, each taking the (item, head) pairs ``pid, pid + grid, ...``
    of the ``n_work = items x heads`` (the heads of one query block next to each other: under
    GQA they read the same keys, which the L2 then holds). The window, dropout and seed
    arguments are those of ``_fwd_kernel``."""
    if SEED_PTR:  # the seed drawn on the device (a CUDA graph replays a new one each time)
        seed = tl.load(seed_ptr).to(tl.int32)
    if PERSISTENT:
        for w in range(tl.program_id(0), n_work, tl.num_programs(0)):
            _tma_block(
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
                w // heads,
                w % heads,
                heads,
                win_left,
                win_right,
                seed,
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
                GROUP,
                HEAD_DIM,
                BLOCK_M,
                BLOCK_N,
                CAUSAL,
                WINDOW,
                DROPOUT,
                INLINE,
                CHUNK,
                PIPE,
            )
    else:
        _tma_block(
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
            tl.program_id(0),
            tl.program_id(1),
            heads,
            win_left,
            win_right,
            seed,
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
            GROUP,
            HEAD_DIM,
            BLOCK_M,
            BLOCK_N,
            CAUSAL,
            WINDOW,
            DROPOUT,
            INLINE,
            CHUNK,
            PIPE,
        )


# --------------------------------------------------------------------------------------
# Launcher

# (BLOCK_M, BLOCK_N, num_warps, num_stages, persistent, pipelined) the tuning sweep tries, per
# head dim: 128-row tiles over two warpgroups, and 64-row tiles over one (two programs share a
# multiprocessor, one's softmax beside the other's products). At 64 x 64 tiles 8 warps leave each
# too little work; stages past 3 do not fit a 128-row D=128 tile's pipeline in shared memory.
_FLAGS = tuple((pe, pi) for pe in (False, True) for pi in (False, True))
CONFIGS = {
    128: tuple((128, n, 8, s, pe, pi) for n in (64, 128) for s in (2, 3) for pe, pi in _FLAGS)
    + tuple((64, n, 4, s, False, pi) for n in (64, 128) for s in (2, 3) for pi in (False, True)),
    64: tuple(
        (m, n, 8 if m == 128 else 4, s, pe, pi)
        for m, n in ((64, 64), (128, 64), (128, 128))
        for s in (2, 3)
        for pe, pi in _FLAGS
    ),
}
PROGRAMS_PER_SM = 2  # a persistent grid's programs per multiprocessor


@functools.cache
def config(
    head_dim: int, max_q: int, causal: bool, interpreted: bool, window: bool = False
) -> tuple[int, int, int, int, bool, bool]:
    """The shape a call runs with: the fastest of :data:`CONFIGS` on workload (c) of
    ``bench/tune_attention.py --hopper`` (16 sequences of 256..4096 tokens, 16 heads, bf16) on
    an H200 (``bench/results/tune_attention_hopper_h200_*.txt``, which also holds the portable
    kernel's rows). D=128: 128-row tiles over two warpgroups with the pipelined key loop;
    causal, and D=64: 64-row tiles, one warpgroup, two programs a multiprocessor. ``window``
    without ``causal`` at D=128: the 128 x 64 tiles without the pipelined loop, which spills with
    the window's masks (Triton 3.6's sm_90 compile, ``python -m bench.kernel_resources --chosen``)."""
    if interpreted:
        return 16, 16, 4, 1, False, False
    if head_dim == 128 and window and not causal:  # the pipelined loop spills with the window's masks
        return 128, 64, 8, 3, False, False
    if head_dim == 128:
        return (64, 64, 4, 3, False, False) if causal else (128, 128, 8, 3, False, True)
    return 64, 64, 4, 2, False, False


_threads = threading.local()


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return (
        t.data_ptr() % 16 == 0
        and t.stride(-1) == 1
        and (t.stride(0) * size) % 16 == 0
        and (t.stride(1) * size) % 16 == 0
    )


def runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> bool:
    """Whether a call its implementation's reasons let through runs here: what only the call
    knows (the addresses, unknown while torch.compile traced the choice; the scale, outside the
    spec). Otherwise the launcher runs the portable kernels."""
    return scale > 0 and _aligned(q) and _aligned(k) and _aligned(v)


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")  # 512-byte aligned blocks, current device


def _ensure_allocator() -> None:
    """A scratch allocator for the device descriptors in this thread, unless one is set."""
    if getattr(_threads, "ready", False):
        return
    try:
        from triton.runtime import _allocation

        unset = isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    except (ImportError, AttributeError):  # pragma: no cover - another Triton layout: set ours
        unset = True
    if unset:
        triton.set_allocator(_scratch)
    _threads.ready = True


_SMS: dict = {}


def multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of CUDA ``device`` (asked once per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def _programs(device: torch.device, interpreted: bool) -> int:
    """A persistent grid's size on ``device``."""
    if interpreted:
        return 3  # a few programs, each looping over several items (the loop is what is tested)
    return PROGRAMS_PER_SM * multiprocessors(device)


def forward(
    q,
    k,
    v,
    out,
    lse,
    cu_q,
    cu_k,
    cum,
    inline: bool,
    chunk: int,
    n_steps: int,
    max_q: int,
    causal: bool,
    scale: float,
    interpreted: bool,
    window=None,
    dropout_p: float = 0.0,
    seed: int = 0,
    seed_ptr=None,
    shape=None,
) -> None:
    """Fill ``out [Tq, H, D]`` and ``lse [Tq, H]`` (the launcher of :mod:`.attention` has made
    them, the work list ``cum`` too). ``window``: the launcher's ``(win_left, win_right)`` (causal
    folded in) or None; ``seed`` / ``seed_ptr``: a host seed, or a one-element device tensor read
    by the kernel (None: the host seed); ``shape``: a tuning sweep's ``(BLOCK_M, BLOCK_N, warps,
    stages, persistent, pipelined)`` instead of :func:`config`'s."""
    block_m, block_n, warps, stages, persistent, pipe = shape or config(q.shape[-1], max_q, causal, interpreted)
    if not interpreted:
        _ensure_allocator()
    batch, heads = cu_q.shape[0] - 1, q.shape[1]
    items = triton.cdiv(q.shape[0], block_m) + batch  # an upper bound of the work list (no sync)
    grid = (min(items * heads, _programs(q.device, interpreted)),) if persistent else (items, heads)
    win_left, win_right = window or (0, 0)
    _fwd_tma_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        cum,
        batch,
        n_steps,
        scale,
        heads,
        items * heads,
        win_left,
        win_right,
        seed,
        cu_q if seed_ptr is None else seed_ptr,
        dropout_p,
        q.shape[0],
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
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CAUSAL=causal and window is None,
        WINDOW=window is not None,
        DROPOUT=dropout_p > 0,
        SEED_PTR=seed_ptr is not None,
        PERSISTENT=persistent,
        INLINE=inline,
        CHUNK=chunk,
        PIPE=pipe,
        num_warps=warps,
        num_stages=stages,
    )
