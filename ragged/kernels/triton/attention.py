"""Triton varlen flash attention: the launchers of the kernels in :mod:`.attention_kernels`.

:func:`forward` and :func:`backward` are the ``"triton"`` implementation of the attention op,
:func:`forward_sm90` / :func:`backward_sm90` its sm_90 variants (all declared in
:mod:`ragged.kernels.triton`); :func:`dropout_keep_mask` gives the reference
the kernels' own dropout pattern. Each launcher picks tile shapes from the head dim, the
longest sequences and the dtype (:func:`_fwd_config`, :func:`_bwd_config`), builds the work
list of query (or key) blocks without reading the offsets on the host, and launches on
torch's current stream: no sync. The offsets are trusted (see :mod:`.attention_kernels`).
"""

from __future__ import annotations

import functools

import torch
import triton

from ...records.attention import AttentionArgs, AttentionBackwardInputs, AttentionGrads, AttentionOutput
from . import ATTENTION_HEAD_DIMS as HEAD_DIMS
from . import attention_hopper, attention_hopper_bwd
from .attention_bias import distance_table, partial_buffer, table_gradient
from .attention_kernels import (
    _block_cum,
    _bwd_delta_kernel,
    _bwd_dkdv_kernel,
    _bwd_dq_kernel,
    _fwd_kernel,
    _keep_mask_kernel,
)

__all__ = [
    "HEAD_DIMS",
    "backward",
    "backward_fused",
    "backward_fused_tma",
    "backward_sm90",
    "dropout_keep_mask",
    "flops",
    "forward",
    "forward_sm90",
]


@functools.cache
def _fwd_config(
    head_dim: int,
    max_q: int,
    max_k: int,
    causal: bool,
    dtype: torch.dtype,
    interpreted: bool,
    dropout: bool = False,
    bias: bool = False,
):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the forward, from sweeps of
    ``bench/tune_attention.py`` on an H200 (bf16):

    * D=128, lengths 256..4096: (128, 64, 8, 3), causal (128, 128, 8, 3);
    * D=64, long-tailed lengths to 512: (64, 64, 4, 3) up to 512 queries; causal and with
      dropout (128, 64, 8, 2) (with dropout the smaller tile slowed a 12-layer training step);
    * D=64, lengths 8..32: (16, 32, 4, 2), causal (32, 32, 4, 2) (host-bound: the shapes
      differ little there).

    A position bias (``bias``) keeps D=128 causal at the 64-key tile: the bias tile's layout
    conversions need more shared memory at 128x128 over 3 stages than an H200 has. At MPNet's
    shapes (D=64, 256 sentences of 8..128 tokens) (64, 32, 4, 2) was the best of the shapes
    ``tune_attention --bias`` sweeps (``bench/results/tune_attention_bias_h200_4aa04c8.txt``).
    """
    if interpreted:
        return 16, 16, 4, 1
    if dtype == torch.float32:
        return min(64, max(16, triton.next_power_of_2(max_q))), 32, 4, 2
    if head_dim > 128:
        return 64, 32, 8, 2
    if max_q <= 64:
        block_m = 32 if causal else 16
        return block_m, max(16, min(64, triton.next_power_of_2(max(max_k, 1)))), 4, 2
    if head_dim > 64:
        return (128, 128, 8, 3) if causal and not bias else (128, 64, 8, 3)
    if max_q <= 512 and not causal and not dropout:
        return (64, 32, 4, 2) if bias else (64, 64, 4, 3)
    return 128, 64, 8, 2


@functools.cache
def _bwd_config(
    head_dim: int, max_q: int, max_k: int, causal: bool, dtype: torch.dtype, interpreted: bool, bias: bool = False
):
    """((BLOCK_M, BLOCK_N, warps, stages) of the dK/dV kernel, the same of the dQ kernel), from
    ``bench/tune_attention.py --bwd`` on an H200 (bf16, D=128, lengths 256..4096): dK/dV
    (64, 64, 4, 2), causal (32, 64, 4, 2); dQ (128, 64, 8, 3).

    With a position bias (``bias``) the dQ kernel also rotates each tile's dS (needs BLOCK_M <=
    BLOCK_N) and sends its diagonal sums to their buckets (:mod:`.attention_bias`). At MPNet's
    shapes (D=64, 256 sentences of 8..128 tokens) dK/dV (32, 64, 4, 2) with dQ (32, 32, 4, 2)
    was the fastest pair ``tune_attention --bias`` found
    (``bench/results/tune_attention_bias_h200_4aa04c8.txt``); above D=64 the dQ query blocks are
    kept to 32 rows so that the tile fits the registers (sm_90 register counts, not timed).
    """
    if interpreted:
        return (16, 16, 4, 1), (16, 16, 4, 1)
    if bias and dtype == torch.float32:
        return (32, 32, 4, 1), (16, 32, 4, 1)
    if head_dim > 128 or dtype == torch.float32:
        return (32, 32, 4, 1), (32, 32, 4, 1)
    kv = (32, 64, 4, 2) if causal else (64, 64, 4, 2)
    # dQ (128, 64, 8, 3) is the D=128 optimum; at D=64 (lengths to 512, non-causal) it measured
    # slower than (64, 64, 4, 2) (bench/results/attention_h200.md), so D <= 64 keeps the smaller shape.
    dq = (128, 64, 8, 3) if head_dim > 64 else (64, 64, 4, 2)
    if max(max_q, max_k) <= 64:  # short sequences: blocks no longer than the sequences
        kv = (min(kv[0], max(16, triton.next_power_of_2(max_q))), max(16, min(64, triton.next_power_of_2(max_k))), 4, 2)
        dq = (max(16, min(64, triton.next_power_of_2(max_q))), max(16, min(64, triton.next_power_of_2(max_k))), 4, 2)
    if bias and head_dim <= 64:
        cols = min(dq[1], 32)
        dq = (min(dq[0], cols), cols, 4, 2)
        if max(max_q, max_k) > 64 and not causal:
            kv = (32, 64, 4, 2)
    elif bias:
        cols = min(dq[1], 64)
        rows = min(dq[0], 32, cols)
        dq = (rows, cols, 8 if rows * cols >= 2048 else dq[2], min(dq[3], 2))
    return kv, dq


_INLINE_MAX_BATCH = 4096  # beyond this, programs binary-search a launched work list instead


def _worklist(cu: torch.Tensor, block: int):
    """(block_cum or a placeholder, INLINE, CHUNK, n_steps) for the kernels' _locate."""
    batch = cu.shape[0] - 1
    if batch <= _INLINE_MAX_BATCH:
        return cu, True, min(1024, max(16, triton.next_power_of_2(batch))), 0
    return _block_cum(cu, block), False, 16, max(batch - 1, 0).bit_length()


def _interpreted() -> bool:
    from ...backends import triton_interpreted

    return triton_interpreted()


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _window(causal: bool, window_left: int, window_right: int, max_q: int, max_k: int) -> tuple[int, int] | None:
    """The kernels' window ``(win_left, win_right)``: query ``i`` sees keys ``i + shift - win_left``
    to ``i + shift + win_right``, causal masking folded in as ``win_right = 0`` and an unbounded
    side (``-1``, or one that reaches past every sequence) bounded by the longest sequence, so
    that the kernels' int32 sums stay small. None where no side bounds anything: the kernels
    of full or causal attention run, as without a window."""
    left = window_left if 0 <= window_left < max_k - 1 else -1
    right = window_right if not causal and 0 <= window_right < max_q - 1 else -1
    if left < 0 and right < 0:
        return None
    return (max_k if left < 0 else left), (0 if causal else max_q if right < 0 else right)


def _span(bias_buckets) -> int:
    """The distance table's row length (0 without a bias)."""
    return 0 if bias_buckets is None else bias_buckets.shape[0]


def _seed(seed, cu_q):
    """``(seed int, seed pointer)`` for the kernels: a host int is passed as is (the pointer
    argument then is ``cu_q``, never read); a one-element int64 tensor on the device (what
    :func:`ragged.ops.attention.dropout_seed` draws while a CUDA graph is captured) is read by
    the kernels, so that every replay draws the mask of the seed the replay drew."""
    if isinstance(seed, torch.Tensor):
        return 0, seed
    return seed, cu_q


def forward(args: AttentionArgs) -> AttentionOutput:
    """The portable kernels' forward: ``q [Tq, H, D]``, ``k, v [Tk, H_kv, D]`` (float16, bfloat16
    or float32; ``D`` in :data:`HEAD_DIMS`), ``cu_q, cu_k [B+1]`` int32/int64 -> ``out [Tq, H, D]``
    in q's dtype and ``lse [Tq, H]`` float32 (the offsets are trusted: see
    :mod:`.attention_kernels`). A sliding window runs the kernels over the key blocks it reaches
    only; the relative-position bias is read per tile from one distance table
    (:mod:`.attention_bias`)."""
    return _forward(args, sm90=False)


def forward_sm90(args: AttentionArgs) -> AttentionOutput:
    """The sm_90 forward (:mod:`.attention_hopper`: tiles moved by TMA), for the calls its
    implementation's declared reasons let through; a call whose tensors turn out not to be
    TMA-aligned (known only at run time under torch.compile) or whose scale is not positive runs
    the portable kernels."""
    return _forward(args, sm90=True)


def forward_sm90_ws(args: AttentionArgs) -> AttentionOutput:
    """The warp-specialised sm_90 forward (:mod:`.attention_ws`, Gluon), for the calls its
    implementation's declared reasons let through; a call whose tensors turn out not to be
    TMA-aligned, or whose scale is not positive, runs the portable kernels."""
    q, k, v = _rows(args.q), _rows(args.k), _rows(args.v)
    if args.scale <= 0 or not attention_hopper.runs(q, k, v, args.scale):
        return _forward(args, sm90=False)
    from . import attention_ws

    cu_q, cu_k = args.cu_q.contiguous(), args.cu_k.contiguous()
    total_q, heads, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((total_q, heads), dtype=torch.float32, device=q.device)
    batch = cu_q.shape[0] - 1
    if total_q == 0 or batch == 0:
        return AttentionOutput(out, lse)
    # the work list made by forward: a persistent grid's is sorted, which this one would not be
    attention_ws.forward(
        q, k, v, out, lse, cu_q, cu_k, None, max(batch - 1, 0).bit_length(), args.causal, args.scale
    )  # fmt: skip
    return AttentionOutput(out, lse)


def _forward(args: AttentionArgs, sm90: bool) -> AttentionOutput:
    q, k, v = _rows(args.q), _rows(args.k), _rows(args.v)
    cu_q, cu_k = args.cu_q.contiguous(), args.cu_k.contiguous()  # the kernels read cu[b] at cu + b
    max_q, max_k, causal, scale, dropout_p = args.max_q, args.max_k, args.causal, args.scale, args.dropout_p
    bias_table, bias_buckets = args.bias_table, args.bias_buckets
    total_q, heads, head_dim = q.shape
    batch = cu_q.shape[0] - 1
    out = torch.empty_like(q)
    lse = torch.empty((total_q, heads), dtype=torch.float32, device=q.device)
    if total_q == 0 or batch == 0:
        return AttentionOutput(out, lse)
    window = _window(causal, args.window_left, args.window_right, max_q, max_k)
    interpreted = _interpreted()
    if sm90 and attention_hopper.runs(q, k, v, scale):
        shape = attention_hopper.config(head_dim, max_q, causal, interpreted, window is not None)
        cum, inline, chunk, n_steps = _worklist(cu_q, shape[0])
        host_seed, seed_ptr = _seed(args.seed, cu_q)
        attention_hopper.forward(
            q,
            k,
            v,
            out,
            lse,
            cu_q,
            cu_k,
            cum,
            inline,
            chunk,
            n_steps,
            max_q,
            causal,
            scale,
            interpreted,
            window,
            dropout_p,
            host_seed,
            None if seed_ptr is cu_q else seed_ptr,
            shape,
        )
        return AttentionOutput(out, lse)
    block_m, block_n, warps, stages = _fwd_config(
        head_dim, max_q, max_k, causal, q.dtype, interpreted, dropout_p > 0, bias_table is not None
    )
    win_left, win_right = window or (0, 0)
    cum, inline, chunk, n_steps = _worklist(cu_q, block_m)
    grid = (triton.cdiv(total_q, block_m) + batch, heads)
    seed, seed_ptr = _seed(args.seed, cu_q)
    no_bias = bias_table is None or bias_buckets is None
    dist = lse if no_bias else distance_table(bias_table, bias_buckets)  # type: ignore[arg-type]  # lse: never read
    _fwd_kernel[grid](
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
        seed,
        seed_ptr,
        dropout_p,
        total_q,
        max(max_k, 1),
        win_left,
        win_right,
        dist,
        max_q,
        _span(bias_buckets),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=heads // k.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CAUSAL=causal and window is None,
        WINDOW=window is not None,
        DROPOUT=dropout_p > 0,
        SEED_PTR=seed_ptr is not cu_q,
        BIAS=bias_table is not None,
        PRECISION=_precision(q.dtype),
        INLINE=inline,
        CHUNK=chunk,
        num_warps=warps,
        num_stages=stages,
    )
    return AttentionOutput(out, lse)


def _grad_buffers(grads: AttentionGrads | None, q, k, v):
    """``(buffers the kernels write, the caller's buffers)``. A caller's buffer is written in place
    when its feature dim has unit stride (the kernels take token and head strides only); any
    other is given a temporary, copied into it at the end."""
    if grads is None:
        mine = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        return mine, mine
    fn = "ragged.kernels.triton.attention.backward"
    if not isinstance(grads, AttentionGrads):
        raise TypeError(f"{fn}(): expected grads as an AttentionGrads record, got {type(grads).__name__}")
    kernels = []
    for name, g, like in zip(("q", "k", "v"), (grads.q, grads.k, grads.v), (q, k, v)):
        if not isinstance(g, torch.Tensor) or g.shape != like.shape or g.device != like.device:
            raise ValueError(
                f"{fn}(): expected the gradient of {name} of shape {tuple(like.shape)} on {like.device}, got "
                f"{tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__}"
            )
        kernels.append(g if g.stride(-1) == 1 or g.shape[-1] <= 1 else torch.empty_like(like))
    return tuple(kernels), (grads.q, grads.k, grads.v)


def backward(
    args: AttentionArgs, inputs: AttentionBackwardInputs, grads: AttentionGrads | None = None
) -> AttentionGrads:
    """The portable kernels' backward: the gradients of ``q, k, v`` in their shapes and dtypes from
    ``inputs`` (the gradient of ``out``, and the forward's ``out`` and ``lse``); with a bias
    table, its gradient too, summed per bucket in the dQ kernel and reduced in a fixed order
    (:mod:`.attention_bias`: the same bits every run).

    ``grads``: optional preallocated gradients of q, k and v the kernels write into and return;
    any strides (views of one packed ``[T, 3, H, D]`` buffer are written in place; a buffer whose
    feature dim is strided goes through a copy)."""
    return _backward(args, inputs, grads, sm90=False)


def backward_sm90(
    args: AttentionArgs, inputs: AttentionBackwardInputs, grads: AttentionGrads | None = None
) -> AttentionGrads:
    """The sm_90 backward (:mod:`.attention_hopper_bwd`), where ``do``, ``out`` and the gradient
    buffers are TMA-aligned too (else the portable kernels, as :func:`forward_sm90`)."""
    return _backward(args, inputs, grads, sm90=True)


def backward_fused(
    args: AttentionArgs, inputs: AttentionBackwardInputs, grads: AttentionGrads | None = None
) -> AttentionGrads:
    """The fused backward: one kernel per key block computes dK, dV and its share of dQ (added
    atomically into a float32 buffer: 5 matrix products per block pair where the split kernels
    need 7, in an order that varies run to run, as FlashAttention's default). No position bias
    (its table gradient is summed in the split dQ kernel); under
    ``torch.use_deterministic_algorithms`` the registry takes the split kernels instead."""
    return _backward(args, inputs, grads, sm90=False, fused=DQ_ATOMIC)


def backward_fused_tma(
    args: AttentionArgs, inputs: AttentionBackwardInputs, grads: AttentionGrads | None = None
) -> AttentionGrads:
    """:func:`backward_fused` with each dQ tile added by one TMA bulk reduce-add (sm_90,
    FlashAttention-3's way) instead of element atomics: the tile goes through shared memory to
    the TMA unit, which adds it into the float32 buffer (through a per-sequence descriptor made
    on the device, clipped at the sequence's last row). Head dims 64 and 128 (a tile's rows are
    whole rows of the buffer), on sm_90 and not under the interpreter: the reasons of its
    implementations in :mod:`ragged.kernels.triton`."""
    return _backward(args, inputs, grads, sm90=False, fused=DQ_TMA)


# How the fused backward adds dQ (the dK/dV kernel's FUSED_DQ): not at all (the split kernels),
# element atomics, or TMA bulk reduce-adds of whole tiles.
DQ_SPLIT, DQ_ATOMIC, DQ_TMA = 0, 1, 2


def _backward(
    args: AttentionArgs,
    inputs: AttentionBackwardInputs,
    grads: AttentionGrads | None,
    sm90: bool,
    fused: int = DQ_SPLIT,
) -> AttentionGrads:
    q, k, v, do = _rows(args.q), _rows(args.k), _rows(args.v), _rows(inputs.grad_out)
    cu_q, cu_k = args.cu_q.contiguous(), args.cu_k.contiguous()  # the kernels read cu[b] at cu + b
    max_q, max_k, causal, scale, dropout_p = args.max_q, args.max_k, args.causal, args.scale, args.dropout_p
    bias_table, bias_buckets = args.bias_table, args.bias_buckets
    total_q, heads, head_dim = q.shape
    total_k, kv_heads, _ = k.shape
    batch = cu_q.shape[0] - 1
    (dq, dk, dv), result = _grad_buffers(grads, q, k, v)
    bias = bias_table is not None
    if batch == 0 or total_q == 0:
        if batch and total_k:
            result[1].zero_(), result[2].zero_()
        return AttentionGrads(
            result[0], result[1], result[2], None if bias_table is None else torch.zeros_like(bias_table)
        )
    delta = torch.empty((total_q, heads), dtype=torch.float32, device=q.device)  # written by the dQ kernel
    out = _rows(inputs.out)
    lse = inputs.lse.contiguous()
    window = _window(causal, args.window_left, args.window_right, max_q, max_k)
    interpreted = _interpreted()
    if sm90 and attention_hopper_bwd.runs(q, k, v, do, out, (dq, dk, dv), scale):
        host_seed, seed_ptr = _seed(args.seed, cu_q)
        attention_hopper_bwd.backward(
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
            _worklist,
            causal,
            scale,
            interpreted,
            window,
            dropout_p,
            host_seed,
            None if seed_ptr is cu_q else seed_ptr,
        )
        for mine, theirs in zip((dq, dk, dv), result):
            if mine is not theirs:
                theirs.copy_(mine)
        return AttentionGrads(*result)
    (kv_m, kv_n, kv_w, kv_s), (q_m, q_n, q_w, q_s) = _bwd_config(
        head_dim, max_q, max_k, causal, q.dtype, interpreted, bias_table is not None
    )
    group = heads // kv_heads
    win_left, win_right = window or (0, 0)
    seed, seed_ptr = _seed(args.seed, cu_q)
    common = dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        CAUSAL=causal and window is None,
        WINDOW=window is not None,
        DROPOUT=dropout_p > 0,
        SEED_PTR=seed_ptr is not cu_q,
        BIAS=bias,
        PRECISION=_precision(q.dtype),
    )
    if fused and not bias:
        shape = (kv_m, kv_n, kv_w, kv_s) if interpreted or head_dim > 128 else _FUSED_BWD_SHAPE
        return _backward_fused(args, q, k, v, do, out, lse, delta, (dq, dk, dv), result, window, common, shape, fused)
    programs = triton.cdiv(total_q, q_m) + batch
    dist, buckets, partial = lse, cu_q, lse  # pointers never read without a bias
    if bias_table is not None and bias_buckets is not None:
        dist, buckets = distance_table(bias_table, bias_buckets), bias_buckets.contiguous()
        partial = partial_buffer(programs, heads, bias_table.shape[0], q.device)
    cum_q, inline, chunk, n_steps = _worklist(cu_q, q_m)
    _bwd_dq_kernel[(programs, heads)](
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
        cum_q,
        batch,
        n_steps,
        scale,
        seed,
        seed_ptr,
        dropout_p,
        total_q,
        max(max_k, 1),
        win_left,
        win_right,
        heads,
        dist,
        buckets,
        partial,
        max_q,
        _span(bias_buckets),
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
        num_warps=q_w,
        num_stages=q_s,
        INLINE=inline,
        CHUNK=chunk,
        NUM_BUCKETS=partial.shape[1] if bias else 16,
        **common,
    )
    if total_k:
        cum_k, inline, chunk, n_steps = _worklist(cu_k, kv_n)
        _bwd_dkdv_kernel[(triton.cdiv(total_k, kv_n) + batch, kv_heads)](
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
            cum_k,
            batch,
            n_steps,
            scale,
            seed,
            seed_ptr,
            dropout_p,
            total_q,
            max(max_k, 1),
            win_left,
            win_right,
            heads,
            dist,
            max_q,
            _span(bias_buckets),
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
            dq,  # read only by the fused backward
            dq.stride(0),
            dq.stride(1),
            BLOCK_M=kv_m,
            BLOCK_N=kv_n,
            num_warps=kv_w,
            num_stages=kv_s,
            INLINE=inline,
            CHUNK=chunk,
            **common,
        )
    for mine, theirs in zip((dq, dk, dv), result):
        if mine is not theirs:
            theirs.copy_(mine)
    return AttentionGrads(
        result[0], result[1], result[2], None if bias_table is None else table_gradient(partial, bias_table)
    )


# The fused key-block kernel's (BLOCK_M, BLOCK_N, warps, stages) at head dims up to 128: the
# least local memory among the shapes bench.kernel_resources compiled for sm_90 (Triton 3.6:
# none at D=64, 408 / 864 bytes a thread at D=128 full / causal, against 1928 / 2368 with the
# split dK/dV kernel's 4 warps). Not yet measured on a GPU.
_FUSED_BWD_SHAPE = (64, 64, 8, 2)


def _backward_fused(args, q, k, v, do, out, lse, delta, buffers, result, window, common, shape, dq_mode=DQ_ATOMIC):
    """:func:`backward_fused`'s launches: the rows' ``dO . O``, then the fused key-block kernel
    adding dQ as ``dq_mode`` says (``DQ_ATOMIC`` or ``DQ_TMA``)."""
    dq, dk, dv = buffers
    kv_m, kv_n, kv_w, kv_s = shape
    cu_q, cu_k = args.cu_q.contiguous(), args.cu_k.contiguous()
    total_q, heads, head_dim = q.shape
    total_k, kv_heads, _ = k.shape
    batch = cu_q.shape[0] - 1
    block_d = triton.next_power_of_2(head_dim)
    block_t = max(1, min(64, 4096 // block_d))
    _bwd_delta_kernel[(triton.cdiv(total_q, block_t), heads)](
        out, do, delta, total_q, heads, out.stride(0), out.stride(1), do.stride(0), do.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_T=block_t,
    )  # fmt: skip
    dq_sum = torch.zeros((total_q, heads, head_dim), dtype=torch.float32, device=q.device)
    win_left, win_right = window or (0, 0)
    seed, seed_ptr = _seed(args.seed, cu_q)
    if total_k:
        if dq_mode == DQ_TMA:
            attention_hopper._ensure_allocator()  # the scratch of the device descriptors
        cum_k, inline, chunk, n_steps = _worklist(cu_k, kv_n)
        _bwd_dkdv_kernel[(triton.cdiv(total_k, kv_n) + batch, kv_heads)](
            q, k, v, do, lse, delta, dk, dv, cu_q, cu_k, cum_k, batch, n_steps, args.scale, seed, seed_ptr,
            args.dropout_p, total_q, max(args.max_k, 1), win_left, win_right, heads, lse, args.max_q, 0,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0),
            do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            dq_sum, dq_sum.stride(0), dq_sum.stride(1),
            BLOCK_M=kv_m, BLOCK_N=kv_n, num_warps=kv_w, num_stages=kv_s, INLINE=inline, CHUNK=chunk,
            FUSED_DQ=dq_mode, **common,
        )  # fmt: skip
    torch.mul(dq_sum, args.scale, out=dq)  # scaled and cast in one pass
    for mine, theirs in zip((dq, dk, dv), result):
        if mine is not theirs:
            theirs.copy_(mine)
    return AttentionGrads(result[0], result[1], result[2], None)


def dropout_keep_mask(
    seed: int, dropout_p: float, cu_q: torch.Tensor, heads: int, total_q: int, max_k: int, device: torch.device
) -> torch.Tensor:
    """``[H, Tq, max_k]`` bool: the keep mask the kernels draw for ``seed`` (for the reference)."""
    max_k = max(max_k, 1)
    out = torch.empty((heads, total_q, max_k), dtype=torch.int8, device=device)
    if total_q and heads:
        _keep_mask_kernel[(total_q, heads)](
            out, seed, dropout_p, total_q, max_k, BLOCK=max(8, min(triton.next_power_of_2(max_k), 1024))
        )
    return out.bool()


def flops(lengths_q, lengths_k, heads: int, head_dim: int, causal: bool) -> float:
    """Useful forward FLOPs: 4 * sum(Lq * Lk) * D * H, halved for causal."""
    total = sum(a * b for a, b in zip(lengths_q, lengths_k))
    return 4.0 * total * head_dim * heads * (0.5 if causal else 1.0)
