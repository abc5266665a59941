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
* ``WS``: the key loop asks Triton for warp specialisation (producer warps issue the TMA
  loads, consumers do the matrix products and the softmax), where the Triton build supports it.

It takes fp16/bf16 at head dims 64 and 128 without dropout, windows or a position bias, on
sm_90 (or under ``TRITON_INTERPRET=1``), with 16-byte aligned operands whose token and head
strides are multiples of 16 bytes (the TMA's rules); :func:`usable` says whether a call is one.
Everything else runs the portable kernels. ``RAGGED_ATTENTION_HOPPER``: ``0`` (the default
until the H200 sweep of ``bench/tune_attention.py --hopper`` picks it) or ``1``.

Device descriptors need a global scratch buffer per launch: Triton asks its allocator
(``triton.set_allocator``, one per thread); where a thread has none, the launcher sets one
that takes the buffer from torch's caching allocator on the current stream (stream-ordered,
captured into CUDA graphs like any other allocation).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch
import triton
import triton.language as tl

from .attention_common import _bounds, _locate
from .launch import cached_launch

__all__ = ["CONFIGS", "config", "forced", "forward", "usable"]

HEAD_DIMS = (64, 128)
_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _tma_inner(acc, l_i, m_i, q, k_desc, v_desc, lo, hi, k_len, shift, offs_m, offs_n, qk_scale,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WS: tl.constexpr):
    """Online softmax over the key blocks [lo, hi); MASKED: keys past the sequence (zeros from
    the TMA) and, CAUSAL, those right of the diagonal score -inf."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        k = k_desc.load([start_n, 0])
        s = tl.dot(q, k.T)
        if MASKED:
            cols = start_n + offs_n
            ok = cols[None, :] < k_len
            if CAUSAL:
                ok = ok & (cols[None, :] <= offs_m[:, None] + shift)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * qk_scale - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@cached_launch
@triton.jit(do_not_specialize=["batch", "n_steps"])
def _fwd_tma_kernel(Q, K, V, O, LSE, cu_q, cu_k, block_cum, batch, n_steps, sm_scale,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, WS: tl.constexpr, INLINE: tl.constexpr, CHUNK: tl.constexpr):
    """One query block of one head (the work list of ``_fwd_kernel``)."""
    item = tl.program_id(0)
    h = tl.program_id(1)
    b, m_blk, n_blocks, n_items = _locate(cu_q, block_cum, batch, n_steps, item, BLOCK_M, INLINE, CHUNK)
    if item >= n_items:
        return
    q_start, q_len, k_start, k_len = _bounds(cu_q, cu_k, b)
    if CAUSAL:  # the heaviest (last) blocks of a sequence first
        m_blk = n_blocks - 1 - m_blk
    hk = h // GROUP
    row0 = m_blk * BLOCK_M
    q_desc = tl.make_tensor_descriptor(Q + q_start * stride_qt + h * stride_qh, shape=[q_len, HEAD_DIM],
                                       strides=[stride_qt, 1], block_shape=[BLOCK_M, HEAD_DIM])
    kv_rows = tl.maximum(k_len, 1)  # a descriptor has no empty dim; no key block is read then
    k_desc = tl.make_tensor_descriptor(K + k_start * stride_kt + hk * stride_kh, shape=[kv_rows, HEAD_DIM],
                                       strides=[stride_kt, 1], block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + k_start * stride_vt + hk * stride_vh, shape=[kv_rows, HEAD_DIM],
                                       strides=[stride_vt, 1], block_shape=[BLOCK_N, HEAD_DIM])
    q = q_desc.load([row0, 0])
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    qk_scale = sm_scale * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    shift = k_len - q_len  # causal: row i sees keys j <= i + shift
    end = k_len
    full = (k_len // BLOCK_N) * BLOCK_N  # key blocks every row sees without a mask
    if CAUSAL:
        end = tl.maximum(tl.minimum(k_len, row0 + BLOCK_M + shift), 0)
        full = tl.maximum(tl.minimum(full, ((row0 + shift + 1) // BLOCK_N) * BLOCK_N), 0)
    acc, l_i, m_i = _tma_inner(acc, l_i, m_i, q, k_desc, v_desc, 0, full, k_len, shift, offs_m, offs_n, qk_scale,
                               BLOCK_N, False, CAUSAL, WS)
    acc, l_i, m_i = _tma_inner(acc, l_i, m_i, q, k_desc, v_desc, full, end, k_len, shift, offs_m, offs_n, qk_scale,
                               BLOCK_N, True, CAUSAL, WS)

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_desc = tl.make_tensor_descriptor(O + q_start * stride_ot + h * stride_oh, shape=[q_len, HEAD_DIM],
                                       strides=[stride_ot, 1], block_shape=[BLOCK_M, HEAD_DIM])
    o_desc.store([row0, 0], out.to(O.dtype.element_ty))
    tl.store(LSE + (q_start + offs_m) * tl.num_programs(1) + h, lse, mask=offs_m < q_len)


# --------------------------------------------------------------------------------------
# Launcher

# (BLOCK_M, BLOCK_N, num_warps, num_stages, warp-specialised) the tuning sweep tries
CONFIGS = tuple((m, n, w, s, ws) for m in (64, 128) for n in (64, 128) for w in (4, 8) for s in (2, 3, 4)
                for ws in (False, True) if not (m == 64 and w == 8))


@functools.lru_cache(maxsize=None)
def config(head_dim: int, max_q: int, causal: bool, interpreted: bool) -> tuple[int, int, int, int, bool]:
    """The shape a call runs with: a starting point (the portable kernel's best shapes at D=128
    on an H200, without warp specialisation) until the sweep of ``bench/tune_attention.py
    --hopper`` replaces it with measured ones."""
    if interpreted:
        return 16, 16, 4, 1, False
    if head_dim == 128:
        return (128, 128, 8, 3, False) if causal else (128, 64, 8, 3, False)
    return (64, 64, 4, 3, False) if max_q <= 512 else (128, 64, 8, 3, False)


_threads = threading.local()


@contextlib.contextmanager
def forced(on: bool):
    """In this block (this thread), the Hopper forward on or off whatever the environment says
    (the benchmarks' rows of both kernels in one process)."""
    before = getattr(_threads, "forced", None)
    _threads.forced = bool(on)
    try:
        yield
    finally:
        _threads.forced = before


def _enabled() -> bool:
    on = getattr(_threads, "forced", None)
    return os.environ.get("RAGGED_ATTENTION_HOPPER", "0") == "1" if on is None else on


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and (t.stride(0) * size) % 16 == 0
            and (t.stride(1) * size) % 16 == 0)


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout_p: float, window, bias,
           interpreted: bool, force: bool = False) -> bool:
    """Whether this forward takes the call (see the module docstring): host facts only;
    ``force``: as if it were switched on."""
    if not (force or _enabled()) or dropout_p > 0 or window is not None or bias is not None or not scale > 0:
        return False
    if q.dtype not in _DTYPES or q.shape[-1] not in HEAD_DIMS:
        return False
    if not interpreted and (q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9):
        return False
    return _aligned(q) and _aligned(k) and _aligned(v)


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


def forward(q, k, v, out, lse, cu_q, cu_k, cum, inline: bool, chunk: int, n_steps: int, max_q: int, causal: bool,
            scale: float, interpreted: bool, shape=None) -> None:
    """Fill ``out [Tq, H, D]`` and ``lse [Tq, H]`` (the launcher of :mod:`.attention` has made
    them, the work list ``cum`` too); ``shape``: a tuning sweep's ``(BLOCK_M, BLOCK_N, warps,
    stages, ws)`` instead of :func:`config`'s."""
    block_m, block_n, warps, stages, ws = shape or config(q.shape[-1], max_q, causal, interpreted)
    if not interpreted:
        _ensure_allocator()
    batch = cu_q.shape[0] - 1
    grid = (triton.cdiv(q.shape[0], block_m) + batch, q.shape[1])
    _fwd_tma_kernel[grid](q, k, v, out, lse, cu_q, cu_k, cum, batch, n_steps, scale,
                          q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                          out.stride(0), out.stride(1),
                          GROUP=q.shape[1] // k.shape[1], HEAD_DIM=q.shape[-1], BLOCK_M=block_m, BLOCK_N=block_n,
                          CAUSAL=causal, WS=ws, INLINE=inline, CHUNK=chunk, num_warps=warps, num_stages=stages)
