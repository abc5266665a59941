"""The ``"cuda"`` backend: CUDA C++ kernels of ``csrc/`` compiled at first use through CuPy's
NVRTC (:mod:`.launch`), their implementations declared here as data (nothing here imports
CuPy). The backend's device reason is :func:`ragged.backends.cuda_reason`.
"""

from __future__ import annotations

import torch

from ...backends import Implementation, register, triton_reason
from ...utils import real_dtype_reasons

_HERE = __name__


# "auto"'s ranks on CUDA inputs (lower first), measured: bench/results/pack_*.md, attention_*.md,
# fused_*.md. The CUDA pack and fused kernels beat Triton's at every measured size.
register(
    Implementation("pack", "cuda", f"{_HERE}.pack:pack", check=real_dtype_reasons, rank=0),
    Implementation("unpack", "cuda", f"{_HERE}.pack:unpack", check=real_dtype_reasons, rank=0),
)


# ---- attention ---------------------------------------------------------------
# What the fused short-sequence kernel (csrc/attention_short.cu) is compiled for: head dims, and
# the most tokens of one sequence, queries and keys alike (one tile of shared memory).
ATTENTION_SHORT_HEAD_DIMS = (32, 64, 128)
ATTENTION_SHORT_MAX_LEN = 128

_attention_capabilities: dict[int, tuple[int, int]] = {}  # device index -> compute capability, read once


def _attention_check(spec) -> list[str]:
    """The reasons of the short-sequence kernel that its declared data cannot express."""
    out = []
    if spec.window_size != (-1, -1):  # the spec's window bounds some key: the kernel masks none
        out.append(
            f"the CUDA short-sequence attention kernel has no sliding window, got window_size={spec.window_size}"
        )
    index = spec.device.index if spec.device.index is not None else torch.cuda.current_device()
    cap = _attention_capabilities.get(index)
    if cap is None:
        cap = _attention_capabilities[index] = torch.cuda.get_device_capability(index)
    if cap < (8, 0):
        out.append(f"the CUDA short-sequence attention kernel needs compute capability >= 8.0, got {cap[0]}.{cap[1]}")
    if spec.dropout_p > 0:
        out.append(f"the CUDA short-sequence attention kernel has no dropout, got dropout_p={spec.dropout_p}")
    if spec.needs_grad:
        out.append("the CUDA short-sequence attention kernel is forward only (inputs require grad)")
    if spec.batch * spec.heads > 2**31 - 1:
        out.append(
            f"the CUDA short-sequence attention kernel launches one block per (sequence, head): "
            f"more than 2**31 - 1 of them ({spec.batch} x {spec.heads})"
        )
    return out


def _attention_rank(spec) -> int:
    """Before Triton (rank 1) where the fused short-sequence kernel was measured faster: up to 64
    tokens at every head dim and up to 128 at D <= 64 (``python -m bench --suite attention``,
    the B=256 short-sequence cases); after it beyond."""
    longest = max(spec.max_q, spec.max_k)
    return 0 if longest <= 64 or (spec.head_dim <= 64 and longest <= 128) else 2


register(
    Implementation(
        "attention",
        "cuda",
        f"{_HERE}.attention:forward",
        dtypes=(torch.float16, torch.bfloat16),
        rank=_attention_rank,
        limits={"head_dim": ATTENTION_SHORT_HEAD_DIMS},
        maxima={"max_q": ATTENTION_SHORT_MAX_LEN, "max_k": ATTENTION_SHORT_MAX_LEN},
        check=_attention_check,
        backward_backend="triton",  # forward only; its inputs are Triton's too
        extras={"packed_self_attention": f"{_HERE}.attention:packed_self_attention"},
        # the optional operands of the attention record it reads (its check declines a window and
        # dropout with its own reasons; an operand added to the record is declined until read)
        operands=frozenset({"dropout_p", "seed", "window_left", "window_right", "bias_table", "bias_buckets"}),
    )
)


# ---- fused -------------------------------------------------------------------
# What the per-token kernels of csrc/fused.cu are compiled for. They read every row in 16-byte
# vectors (elements per vector by dtype; every tensor of x's dtype). The layer norm keeps a row
# in the registers of one warp, ITERS vectors per lane (the RAGGED_ADD_LAYER_NORM_ITERS lines of
# the source), one warp per row and FUSED_LN_ROWS_PER_BLOCK rows per block (RAGGED_LN_WARPS).
FUSED_VECTOR = {torch.float16: 8, torch.bfloat16: 8, torch.float32: 4}
FUSED_LN_ITERS = (1, 2, 3, 4, 6, 8, 12, 16)
FUSED_LN_ROWS_PER_BLOCK = 4
FUSED_ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "none")

# the spec's layout faults (ragged.ops.fused.LayoutFault) as what the kernels need
_FUSED_NEEDS = {
    "stride": "{} with unit stride along the features, got stride {}",
    "row stride": "{}'s row strides to be multiples of 16 bytes, got {} bytes",
    "address": "{} 16-byte aligned, got an address {} bytes past a multiple of 16",
}


def fused_max_features(dtype: torch.dtype) -> int:
    """The widest row the layer norm kernel keeps in registers (elements)."""
    return 32 * FUSED_VECTOR[dtype] * FUSED_LN_ITERS[-1]


def _fused_check(what: str, spec, out: list[str]) -> list[str]:
    """``out`` and the reasons both fused kernels share: the feature count, the layout, and what
    the Triton backward that runs after the CUDA forward needs (the dtypes the kernels take
    are Triton's too: only its import is left to ask about)."""
    vec = FUSED_VECTOR[spec.dtype]  # a dtype of FUSED_VECTOR: declared as data, checked first
    if spec.features % vec:
        out.append(f"{what} takes a feature count that is a multiple of {vec} for {spec.dtype}, got {spec.features}")
    out += [f"{what} needs " + _FUSED_NEEDS[kind].format(name, value) for name, kind, value in spec.layout]
    reason = triton_reason(spec.device)
    if reason:
        out.append(reason)
    return out


def _bias_act_check(spec) -> list[str]:
    what = "the CUDA bias_act kernel"
    out = []
    if spec.bias_dtype is not None and spec.bias_dtype != spec.dtype:
        out.append(f"{what} takes bias of x's dtype {spec.dtype}, got {spec.bias_dtype}")
    if spec.activation not in FUSED_ACTIVATIONS:
        out.append(f"{what} takes activations {FUSED_ACTIVATIONS}, got {spec.activation!r}")
    if not spec.contiguous:
        out.append(f"{what} needs a contiguous x (it reads x as one run of vectors)")
    return _fused_check(what, spec, out)


def _add_layer_norm_check(spec) -> list[str]:
    what = "the CUDA add_layer_norm kernel"
    out = [
        f"{what} takes {name} of x's dtype {spec.dtype}, got {dtype}"
        for name, dtype in (("residual", spec.residual_dtype), ("weight", spec.weight_dtype), ("bias", spec.bias_dtype))
        if dtype is not None and dtype != spec.dtype
    ]
    top = fused_max_features(spec.dtype)
    if spec.features > top:
        out.append(f"{what} takes at most {top} features for {spec.dtype}, got {spec.features}")
    if -(-spec.rows // FUSED_LN_ROWS_PER_BLOCK) > 2**31 - 1:  # one block per FUSED_LN_ROWS_PER_BLOCK rows
        out.append(f"{what} takes at most {(2**31 - 1) * FUSED_LN_ROWS_PER_BLOCK} rows, got {spec.rows}")
    return _fused_check(what, spec, out)


# Forward kernels: the backward is Triton's, which reads the same saved tensors.
register(
    Implementation(
        "bias_act",
        "cuda",
        f"{_HERE}.fused:bias_act_forward",
        dtypes=tuple(FUSED_VECTOR),
        check=_bias_act_check,
        backward_backend="triton",
        rank=0,
    ),
    Implementation(
        "add_layer_norm",
        "cuda",
        f"{_HERE}.fused:add_layer_norm_forward",
        dtypes=tuple(FUSED_VECTOR),
        check=_add_layer_norm_check,
        backward_backend="triton",
        rank=0,
        # the forward without statistics, for inputs the caller has checked
        extras={"inference": f"{_HERE}.fused:add_layer_norm_inference"},
    ),
)
