"""The ``"triton"`` backend: its implementations, declared as data (nothing here imports Triton).

Each :class:`ragged.backends.Implementation` names its kernels as ``"module:function"``
(imported on the first call) and says what it takes through the op's spec; the device
reason of the backend itself (Triton importable; a CUDA tensor, or a CPU tensor under
``TRITON_INTERPRET=1``) is :func:`ragged.backends.triton_reason`.
"""

from __future__ import annotations

import torch

from ...backends import Implementation, import_error, register, triton_interpreted
from ...utils import real_dtype_reasons

_HERE = __name__

# "auto"'s ranks on CUDA inputs (lower first; see ragged/kernels/cuda/__init__.py for the CUDA
# kernels'): rank 1 where a CUDA kernel was measured faster, 0 where Triton's is the only kernel.
register(
    Implementation("pack", "triton", f"{_HERE}.pack:pack", check=real_dtype_reasons, rank=1),
    Implementation("unpack", "triton", f"{_HERE}.pack:unpack", check=real_dtype_reasons, rank=1),
)


# ---- attention ---------------------------------------------------------------
# The head dims the attention kernels take (BLOCK_D is the next power of two; a dim outside
# this list is left to the other backends rather than compiled for).
ATTENTION_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)


# The most rows of a position-bias table: the dQ kernel keeps a sum per bucket in registers and
# compares each of a tile's distances with every bucket (MPNet and T5 use 32).
ATTENTION_MAX_BUCKETS = 128


# The optional operands of the attention record the Triton kernels read (an operand added to the
# record is declined until the kernels read it and it is listed here).
ATTENTION_OPERANDS = frozenset({"dropout_p", "seed", "window_left", "window_right", "bias_table", "bias_buckets"})


def _attention_check(spec) -> list[str]:
    if spec.bias_buckets and spec.needs_grad:
        from .attention_bias import gather_reason  # imports Triton: only for a bias with a backward

        reason = gather_reason()
        return [reason] if reason else []
    return []


# what the portable kernels take (the split backward's implementation and the fused one's)
_PORTABLE = {
    "dtypes": (torch.float16, torch.bfloat16, torch.float32),
    "limits": {"head_dim": ATTENTION_HEAD_DIMS},
    "maxima": {"bias_buckets": ATTENTION_MAX_BUCKETS},
    "operands": ATTENTION_OPERANDS,
}
register(
    Implementation(
        "attention",
        "triton",
        f"{_HERE}.attention:forward",
        f"{_HERE}.attention:backward",
        check=_attention_check,
        rank=1,
        **_PORTABLE,  # type: ignore[arg-type]
    )
)


# The sm_90 kernels (tiles moved by TMA; attention_hopper.py): fp16 / bf16 at head dims 64 and
# 128, no position bias, q, k and v TMA-aligned, on an sm_90 GPU (or the interpreter). Two
# implementations: the forward with the portable backward, which "auto" takes from a longest
# query of sm90_min_len() tokens on, and the forward with the sm_90 backward, measured no faster
# than the portable one, so taken only where preferred (RAGGED_ATTENTION_HOPPER=1 or
# ragged.backends.prefer). The length rule is the H200 sweep of bench.attention_variants --sweep
# (bench/results/attention_variants_h200_22a2478.md: about 32k tokens in lengths of [L/2, L]):
# the sm_90 forward is faster from L = 1024 at head dim 64 and under a causal mask, but at head
# dim 128 without a mask the portable forward stays faster through L = 2048 (399 against 376
# TF/s) and loses at 4096 (425 against 462); AUTO_MIN_LEN_D128_FULL sits between the two.
ATTENTION_SM90_HEAD_DIMS = (64, 128)
AUTO_MIN_LEN = 1024
AUTO_MIN_LEN_D128_FULL = 3072
_MAJOR: dict[int, int] = {}  # device index -> compute capability major (read once per device)


def cuda_major(device: torch.device) -> int:
    """The compute capability's major number of a CUDA device (read once per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MAJOR:
        _MAJOR[index] = torch.cuda.get_device_capability(index)[0]
    return _MAJOR[index]


def _sm90_device_reasons(spec, what: str) -> list[str]:
    """Why ``what`` (the subject of a sentence, plural) cannot run on ``spec``'s device: not an
    sm_90 GPU; a CPU tensor outside the interpreter."""
    if spec.device.type == "cuda":
        major = cuda_major(spec.device)
        return [] if major == 9 else [f"{what} run on sm_90 GPUs, got compute capability {major}.x"]
    if triton_interpreted():
        return []
    return [f"{what} run on CUDA tensors, got a {spec.device.type} tensor"]


def sm90_min_len(head_dim: int, causal: bool) -> int:
    """The longest query (tokens) from which ``"auto"`` takes the sm_90 forward."""
    return AUTO_MIN_LEN_D128_FULL if head_dim == 128 and not causal else AUTO_MIN_LEN


def _sm90_check(spec) -> list[str]:
    out = []
    if spec.bias_buckets:
        out.append("the sm_90 attention kernels take no position bias")
    if spec.tma_aligned is False:
        out.append("the sm_90 attention kernels need q, k and v with 16-byte aligned addresses and row strides")
    return out + _sm90_device_reasons(spec, "the sm_90 attention kernels")


def _sm90_rank(spec) -> float:
    return 0.5 if spec.max_q >= sm90_min_len(spec.head_dim, spec.causal) else 10.0


_SM90 = {
    "dtypes": (torch.float16, torch.bfloat16),
    "limits": {"head_dim": ATTENTION_SM90_HEAD_DIMS},
    "check": _sm90_check,
    "operands": ATTENTION_OPERANDS,
}
register(
    Implementation(
        "attention",
        "triton",
        f"{_HERE}.attention:forward_sm90",
        backward_backend="triton",
        variant="sm90",
        rank=_sm90_rank,
        **_SM90,  # type: ignore[arg-type]
    ),
    Implementation(
        "attention",
        "triton",
        f"{_HERE}.attention:forward_sm90",
        f"{_HERE}.attention:backward_sm90",
        variant="sm90_full",
        rank=20.0,
        **_SM90,  # type: ignore[arg-type]
    ),
)


# The fused backward (attention.py:backward_fused): one key-block kernel for dK, dV and dQ, dQ
# added atomically (non-deterministic), with the portable forward; no position bias, and not
# under torch.use_deterministic_algorithms. Measured slower than the split kernels on an H200
# (python -m bench.attention_variants; bench/results/attention_variants_h200_*.md), so taken only
# where preferred.
def _deterministic_reason() -> list[str]:
    if torch.are_deterministic_algorithms_enabled():
        return [
            "the fused attention backward adds dQ atomically (not deterministic) and "
            "torch.use_deterministic_algorithms is on"
        ]
    return []


def _fused_bwd_check(spec) -> list[str]:
    out = _attention_check(spec)
    if spec.bias_buckets:
        out.append("the fused attention backward takes no position bias (its table gradient is the split dQ kernel's)")
    return out + _deterministic_reason()


register(
    Implementation(
        "attention",
        "triton",
        f"{_HERE}.attention:forward",
        f"{_HERE}.attention:backward_fused",
        check=_fused_bwd_check,
        variant="fused_bwd",
        rank=25.0,
        **_PORTABLE,  # type: ignore[arg-type]
    )
)


# The warp-specialised sm_90 forward (attention_ws.py, Gluon: a loading warpgroup and two
# consumer warpgroups over a ring of three K/V stages at head dim 128, a persistent grid), with
# the portable backward: no window, dropout or position bias, not under the
# interpreter. "auto" takes it at head dim 128 from a longest query of ws_min_len() tokens: the
# H200 sweep with the persistent grid (bench/results/attention_sweep_ws_h200_a841e34.md, about
# 32k tokens in lengths of [L/2, L], kernel times) measured it the fastest forward at every L
# from 128, by a few percent at L = 128 and 256 (145 against 134 TF/s for the portable one at
# 256) and by 14-20% from L = 512 (265 against 233, 157 against 131 causal); the threshold sits
# between 256 and 512, where the launch's few more host operations (the sort of the work list)
# cost less than the kernel gains. At head dim 64 it was at best level with the TMA forward
# below L = 4096: taken there only where preferred.
WS_MIN_LEN_D128_FULL = 384
WS_MIN_LEN_D128_CAUSAL = 384


def ws_min_len(head_dim: int, causal: bool) -> int | None:
    """The longest query (tokens) from which ``"auto"`` takes the warp-specialised forward (None:
    only where preferred)."""
    if head_dim != 128:
        return None
    return WS_MIN_LEN_D128_CAUSAL if causal else WS_MIN_LEN_D128_FULL


def _sm90_ws_rank(spec) -> float:
    least = ws_min_len(spec.head_dim, spec.causal)
    return 0.4 if least is not None and spec.max_q >= least else 30.0


def _sm90_ws_check(spec) -> list[str]:
    out = _sm90_check(spec)
    if spec.window_size != (-1, -1):
        out.append(f"the warp-specialised sm_90 forward has no sliding window, got window_size={spec.window_size}")
    if spec.dropout_p > 0:
        out.append(f"the warp-specialised sm_90 forward has no dropout, got dropout_p={spec.dropout_p}")
    if spec.device.type != "cuda":
        out.append(f"the warp-specialised sm_90 forward (Gluon) runs on CUDA tensors only, got {spec.device.type}")
    elif not out:  # Gluon's Hopper language (Triton 3.5 on), imported once the rest lets the call through
        reason = import_error("triton.experimental.gluon.language.nvidia.hopper")
        if reason:
            out.append(f"the warp-specialised sm_90 forward needs Gluon: {reason}")
    return out


register(
    Implementation(
        "attention",
        "triton",
        f"{_HERE}.attention:forward_sm90_ws",
        backward_backend="triton",
        variant="sm90_ws",
        rank=_sm90_ws_rank,
        **{**_SM90, "check": _sm90_ws_check},  # type: ignore[arg-type]
    )
)


# The sm_90 forwards followed by the fused backward: the pairs a training step would take if
# each half were the fastest of its kind. Measured no faster than the fused backward after the
# portable forward (the backward dominates), so taken only where preferred.
register(
    Implementation(
        "attention",
        "triton",
        f"{_HERE}.attention:forward_sm90",
        f"{_HERE}.attention:backward_fused",
        variant="sm90_fused_bwd",
        rank=26.0,
        **{**_SM90, "check": lambda spec: _sm90_check(spec) + _deterministic_reason()},  # type: ignore[arg-type]
    ),
    Implementation(
        "attention",
        "triton",
        f"{_HERE}.attention:forward_sm90_ws",
        f"{_HERE}.attention:backward_fused",
        variant="sm90_ws_fused_bwd",
        rank=31.0,
        **{**_SM90, "check": lambda spec: _sm90_ws_check(spec) + _deterministic_reason()},  # type: ignore[arg-type]
    ),
)


# The fused backward with each dQ tile added by one TMA bulk reduce-add (attention.py:
# backward_fused_tma, FlashAttention-3's way) instead of element atomics, after the portable
# forward and after the sm_90 TMA forward: what the fused backward refuses, and what the bulk
# reduce needs (an sm_90 GPU; a tile's rows whole rows of the buffer, so head dims 64 and 128;
# not the interpreter, which has no bulk reduce). Not yet measured, so taken only where preferred.
FUSED_TMA_HEAD_DIMS = (64, 128)


def _tma_dq_reasons(spec, device: bool = True) -> list[str]:
    what = "the fused attention backward's TMA reduce-adds of dQ"
    out = []
    if spec.head_dim not in FUSED_TMA_HEAD_DIMS:
        out.append(
            f"{what} move whole rows of a power-of-two head dim: they take head dims {FUSED_TMA_HEAD_DIMS}, "
            f"got {spec.head_dim}"
        )
    if triton_interpreted():
        out.append(f"{what} do not run under TRITON_INTERPRET=1 (the interpreter has no bulk reduce)")
    elif device:
        out.extend(_sm90_device_reasons(spec, what))
    return out


def _fused_bwd_tma_check(spec) -> list[str]:
    return _fused_bwd_check(spec) + _tma_dq_reasons(spec)


def _sm90_fused_bwd_tma_check(spec) -> list[str]:
    return _sm90_check(spec) + _deterministic_reason() + _tma_dq_reasons(spec, device=False)


register(
    Implementation(
        "attention",
        "triton",
        f"{_HERE}.attention:forward",
        f"{_HERE}.attention:backward_fused_tma",
        check=_fused_bwd_tma_check,
        variant="fused_bwd_tma",
        rank=27.0,
        **_PORTABLE,  # type: ignore[arg-type]
    ),
    Implementation(
        "attention",
        "triton",
        f"{_HERE}.attention:forward_sm90",
        f"{_HERE}.attention:backward_fused_tma",
        variant="sm90_fused_bwd_tma",
        rank=28.0,
        **{**_SM90, "check": _sm90_fused_bwd_tma_check},  # type: ignore[arg-type]
    ),
)


# ---- fused -------------------------------------------------------------------
# bias_act and add_layer_norm: every tensor float16, bfloat16 or float32, in any mix (the
# kernels compute in float32); x's dtype is the spec's dtype, the others' are checked here.
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _fused_dtypes(op: str, **dtypes) -> list[str]:
    return [
        f"triton {op} takes float16, bfloat16 and float32, got {name} of dtype {dtype}"
        for name, dtype in dtypes.items()
        if dtype is not None and dtype not in FUSED_DTYPES
    ]


def _bias_act_check(spec) -> list[str]:
    return _fused_dtypes("bias_act", bias=spec.bias_dtype)


def _add_layer_norm_check(spec) -> list[str]:
    return _fused_dtypes("add_layer_norm", residual=spec.residual_dtype, weight=spec.weight_dtype, bias=spec.bias_dtype)


register(
    Implementation(
        "bias_act",
        "triton",
        f"{_HERE}.fused:bias_act_forward",
        f"{_HERE}.fused:bias_act_backward",
        dtypes=FUSED_DTYPES,
        check=_bias_act_check,
        rank=1,
        # the backward taking the gradient back through a dropout (mask=, p=) and writing
        # its bias gradient's partial sums into a shared buffer (part=, part_col=)
        extras={"dropout_backward": f"{_HERE}.fused:bias_act_backward"},
    ),
    Implementation(
        "add_layer_norm",
        "triton",
        f"{_HERE}.fused:add_layer_norm_forward",
        f"{_HERE}.fused:add_layer_norm_backward",
        dtypes=FUSED_DTYPES,
        check=_add_layer_norm_check,
        rank=1,
        extras={
            "dropout_backward": f"{_HERE}.fused:add_layer_norm_dropout_backward",
            "partial_groups": f"{_HERE}.fused:partial_groups",
            "backward_fuses": f"{_HERE}.fused:layer_norm_backward_fuses",
        },
    ),
)


# ---- vocab -------------------------------------------------------------------
# The segmented GEMM through the id lists, and the fused cross-entropy on it: the float
# dtypes of tensor-core dots; the kernel modules need a Triton that compiles them (a reason
# of their own, so that a Triton too old for them leaves the op to the reference).
_VOCAB_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _vocab_kernels(module: str):
    def check(spec) -> list[str]:
        err = import_error(module)
        return [f"the Triton vocab kernels are unavailable ({err})"] if err else []

    return check


register(
    Implementation(
        "vocab_projection",
        "triton",
        f"{_HERE}.vocab:forward",
        f"{_HERE}.vocab:backward",
        dtypes=_VOCAB_DTYPES,
        check=_vocab_kernels(f"{_HERE}.vocab"),
        rank=0,
    ),
    Implementation(
        "vocab_cross_entropy",
        "triton",
        f"{_HERE}.vocab_cross_entropy:forward",
        f"{_HERE}.vocab_cross_entropy:backward",
        dtypes=_VOCAB_DTYPES,
        check=_vocab_kernels(f"{_HERE}.vocab_cross_entropy"),
        rank=0,
    ),
)


# ---- pool --------------------------------------------------------------------
# Every mode; float16 / bfloat16 / float32 values (accumulated in float32). Integer, bool
# and float64 values take the torch reference.
register(
    Implementation(
        "pool",
        "triton",
        f"{_HERE}.pool:pool",
        backward=f"{_HERE}.pool:pool_backward",
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        rank=0,
    )
)


# ---- gated_act ---------------------------------------------------------------
# act(x[:, :F]) * x[:, F:] and its gradient, elementwise in float32; Triton's is the only
# kernel (rank 0). float64 takes the torch reference.
register(
    Implementation(
        "gated_act",
        "triton",
        f"{_HERE}.gated:gated_act_forward",
        f"{_HERE}.gated:gated_act_backward",
        dtypes=FUSED_DTYPES,
        rank=0,
    )
)


# ---- add_rms_norm --------------------------------------------------------------
# Residual add + RMSNorm, forward and backward one Triton kernel each, the row in registers;
# float64 takes the torch reference.
register(
    Implementation(
        "add_rms_norm",
        "triton",
        f"{_HERE}.rms_norm:add_rms_norm_forward",
        f"{_HERE}.rms_norm:add_rms_norm_backward",
        dtypes=FUSED_DTYPES,
        maxima={"features": 16384},
        rank=0,
    )
)


# ---- linear_cross_entropy ----------------------------------------------------
# The chunked LM head + loss: torch's GEMMs, each slice's log-sum-exp and gradient one Triton
# kernel; float64 takes the torch steps.
register(
    Implementation(
        "linear_cross_entropy",
        "triton",
        f"{_HERE}.linear_ce:linear_cross_entropy_forward",
        f"{_HERE}.linear_ce:linear_cross_entropy_backward",
        dtypes=FUSED_DTYPES,
        rank=0,
    )
)


# ---- rotary_embedding --------------------------------------------------------
# Forward and backward in one kernel (the backward rotates by the opposite angle); float16 /
# bfloat16 / float32 x, any strides, computed in float32. float64 takes the torch reference.
register(
    Implementation(
        "rotary_embedding",
        "triton",
        f"{_HERE}.rotary:rotary_embedding",
        backward=f"{_HERE}.rotary:rotary_embedding_backward",
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        rank=0,
    )
)
