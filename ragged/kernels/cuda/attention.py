"""Launcher of the fused short-sequence attention kernel (``csrc/attention_short.cu``), forward only.

One thread block per (sequence, query head), or per (sequence, PIPELINED_HEADS heads) with
the copies of the next head overlapping the current one's compute when every sequence fits one
tile (at most 32 queries and 32 keys): Q, K, V of the sequence go to shared memory,
``S = Q K^T`` and ``O = P V`` run on the tensor cores (``mma.sync``), the softmax in fp32
registers, and O and lse are written in one pass. It takes fp16/bf16, head dims 32, 64 and
128, sequences of at most :data:`MAX_LEN` tokens (queries and keys), GQA, cross-attention
(different q and k offsets), bottom-right causal masking and a relative-position bias
(``position_bias``: the ``_bias`` kernels read one float per score from the head's row of a
distance table, ``table[buckets[d], h] * log2(e)``, composed once per call); no dropout, no
sliding window, no backward. What it takes is declared in :mod:`ragged.kernels.cuda` (the ``"cuda"``
implementation of the attention op, whose backward is Triton's).

The kernel is compiled at first use through NVRTC (CuPy) and launched on torch's current
stream by :func:`ragged.kernels.cuda.launch`: no sync, no host reads of the offsets.
"""

from __future__ import annotations

import math

import torch

from ...records.attention import AttentionArgs, AttentionOutput
from . import ATTENTION_SHORT_HEAD_DIMS as HEAD_DIMS
from . import ATTENTION_SHORT_MAX_LEN as MAX_LEN
from .launch import Params, launch

__all__ = ["HEAD_DIMS", "MAX_LEN", "PARAMS", "forward", "packed_self_attention"]

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}
_SOURCE = "attention_short.cu"
_LOG2E = 1.4426950408889634
# (q, k, v, out, lse, cu_q, cu_k, offsets64, heads, group, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, scale_log2,
#  causal, total_q, total_k, bias, bias_span, bias_origin): RAGGED_ATTENTION_PARAMS of the source
PARAMS = Params("PPPPPPPiiiqqqqqqfiqqPii")

# Head dim -> ((key rows per shared-memory chunk C, warps per block W), ...), smallest C first;
# the same (D, C, W) list as the RAGGED_ATTENTION_SHORT_TYPES lines of the source. The launcher
# takes the smallest C >= max_seqlen_k (the largest when none is: several chunks).
_CONFIGS = {
    32: ((32, 2), (64, 4), (128, 4)),
    64: ((32, 2), (64, 4), (128, 4)),
    128: ((32, 2), (64, 2)),
}
# Head dim -> (C, W) of the pipelined kernel (RAGGED_ATTENTION_SHORT_PIPELINED_TYPES lines): one
# block per (sequence, PIPELINED_HEADS heads), the copies of the next head overlapping the
# compute of the current one; taken when max_seqlen_q <= 16 W and max_seqlen_k <= C.
_PIPELINED = {
    32: (32, 2),
    64: (32, 2),
}
PIPELINED_HEADS = 4  # 0: always the one-block-per-head kernel
# ... and only for batches of at least this many (sequence, head) pairs per multiprocessor: a
# small batch is better off with its heads spread over more blocks (measured on an H200, see
# bench/results/attention_*.md: one block per head at a few short sequences, the pipelined
# kernel at hundreds).
PIPELINED_MIN_PAIRS_PER_SM = 16

_multiprocessors: dict[int, int] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _multiprocessor_count(device: torch.device) -> int:
    index = _index(device)
    n = _multiprocessors.get(index)
    if n is None:
        n = _multiprocessors[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


def _config(head_dim: int, max_k: int) -> tuple[int, int]:
    configs = _CONFIGS[head_dim]
    for chunk, warps in configs:
        if max_k <= chunk:
            return chunk, warps
    return configs[-1]


def _aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """x itself when its rows (last dim) are contiguous and every row starts on 16 bytes, else an
    aligned contiguous copy (``contiguous()`` would return a misaligned contiguous view as is)."""
    es = x.element_size()
    if x.stride(-1) != 1 or x.data_ptr() % 16 or (x.stride(0) * es) % 16 or (x.stride(1) * es) % 16:
        return x.clone(memory_format=torch.contiguous_format)
    return x


def _kernel(
    dtype: torch.dtype,
    head_dim: int,
    heads: int,
    batch: int,
    max_q: int,
    max_k: int,
    device: torch.device,
    bias: bool = False,
) -> tuple[str, int, int]:
    """(kernel name, heads per block, warps per block)."""
    tag = "_bias" if bias else ""
    pipe = _PIPELINED.get(head_dim) if PIPELINED_HEADS else None
    if (
        pipe is not None
        and max_q <= 16 * pipe[1]
        and max_k <= pipe[0]
        and batch * heads >= PIPELINED_MIN_PAIRS_PER_SM * _multiprocessor_count(device)
    ):
        (chunk, warps), per_block = pipe, PIPELINED_HEADS
        return (
            f"ragged_attention_short_pipe{tag}_{_DTYPES[dtype]}_d{head_dim}_c{chunk}_h{per_block}",
            per_block,
            warps,
        )
    chunk, warps = _config(head_dim, max_k)
    return f"ragged_attention_short{tag}_{_DTYPES[dtype]}_d{head_dim}_c{chunk}", 1, warps


def _distance_rows(table: torch.Tensor, buckets: torch.Tensor) -> torch.Tensor:
    """``[H, len(buckets)]`` float32, contiguous: ``table[buckets[d], h] * log2(e)`` at ``[h, d]``
    (the bias kernels' rows, in their log2 units; one gather on the device, no sync)."""
    return (table.detach().t().to(torch.float32)[:, buckets.long()] * _LOG2E).contiguous()


def packed_self_attention(
    qkv: torch.Tensor, cu: torch.Tensor, max_len: int, heads: int, causal: bool, scale: float
) -> torch.Tensor:
    """Inference self-attention on a packed input projection: ``qkv [T, 3 * heads * D]`` (per
    token q, k, v side by side, as ``x @ in_proj_weight.T`` gives them), contiguous and
    16-byte aligned, ``T > 0``, a dtype and head dim the kernel takes, ``max_len`` at most
    :data:`MAX_LEN` (the caller has checked: ``ragged.explain("attention", ...)["cuda"]`` is
    empty for it); returns ``out [T, heads * D]``
    and writes no lse. No views, copies or checks: one allocation and the launch."""
    total, width = qkv.shape
    d = width // 3
    head_dim = d // heads
    batch = cu.shape[0] - 1
    cu = cu.contiguous()  # the kernel reads cu[b] at cu + b (free when it already is)
    out = torch.empty((total, d), dtype=qkv.dtype, device=qkv.device)
    kernel, per_block, warps = _kernel(qkv.dtype, head_dim, heads, batch, max_len, max_len, qkv.device)
    p = qkv.data_ptr()
    step = d * qkv.element_size()
    wide = 3 if cu.dtype == torch.int64 else 0
    args = (
        p,
        p + step,
        p + 2 * step,
        out.data_ptr(),
        0,
        cu.data_ptr(),
        cu.data_ptr(),
        wide,
        heads,
        1,
        width,
        head_dim,
        width,
        head_dim,
        width,
        head_dim,
        scale * _LOG2E,
        int(causal),
        total,
        total,
        0,
        0,
        0,
    )
    launch(_SOURCE, kernel, qkv.device, batch * -(-heads // per_block), (warps * 32, 1), PARAMS, args)
    return out


def forward(args: AttentionArgs) -> AttentionOutput:
    """The output record of :mod:`ragged.ops.attention`'s op. No sliding window and no dropout
    (the implementation's reasons decline them; a direct call with either raises). A position
    bias (``bias_table [num_buckets, H]``, ``bias_buckets [max_q + max_k - 1]``) runs the
    ``_bias`` kernels."""
    q, k, v, cu_q, cu_k = args.q, args.k, args.v, args.cu_q, args.cu_k
    max_q, max_k, causal, scale = args.max_q, args.max_k, args.causal, args.scale
    bias_table, bias_buckets = args.bias_table, args.bias_buckets
    if args.dropout_p > 0:
        raise ValueError("the CUDA short-sequence attention kernel has no dropout")
    if (bias_table is None) != (bias_buckets is None):
        raise ValueError("the CUDA short-sequence attention kernel takes bias_table and bias_buckets together")
    if args.window_left != -1 or args.window_right != -1:
        raise ValueError(
            f"the CUDA short-sequence attention kernel has no sliding window, got window_size="
            f"({args.window_left}, {args.window_right})"
        )
    total_q, heads, head_dim = q.shape
    batch = cu_q.shape[0] - 1
    out = torch.empty((total_q, heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((total_q, heads), dtype=torch.float32, device=q.device)
    if total_q == 0 or batch == 0 or heads == 0:
        return AttentionOutput(out, lse)
    q, k, v = _aligned_rows(q), _aligned_rows(k), _aligned_rows(v)
    cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()  # the kernel reads cu[b] at cu + b
    bias = bias_table is not None
    kernel, per_block, warps = _kernel(q.dtype, head_dim, heads, batch, max_q, max_k, q.device, bias)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    rows = None if bias_table is None or bias_buckets is None else _distance_rows(bias_table, bias_buckets)
    bias_args = (rows.data_ptr(), rows.shape[1], max_q - 1) if rows is not None else (0, 0, 0)
    wide = int(cu_q.dtype == torch.int64) | (int(cu_k.dtype == torch.int64) << 1)
    launch_args = (
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
        cu_q.data_ptr(),
        cu_k.data_ptr(),
        wide,
        heads,
        heads // k.shape[1],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        scale * _LOG2E,
        int(causal),
        total_q,
        k.shape[0],
        *bias_args,
    )
    launch(_SOURCE, kernel, q.device, batch * -(-heads // per_block), (warps * 32, 1), PARAMS, launch_args)
    return AttentionOutput(out, lse)
