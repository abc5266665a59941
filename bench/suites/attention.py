"""attention: padding-free varlen attention against padded and nested baselines.

Self-attention over a batch of ``B`` sequences of lengths ``L_i`` (``T = sum L_i``
tokens), ``H`` heads of dim ``D``; q/k/v packed ``[T, H, D]`` with ``cu_seqlens``
(the offsets, int32). Each workload runs forward and forward+backward, without and
with a causal mask: four cases, one per group (``fwd``, ``fwd causal``, ``fwd+bwd``,
``fwd+bwd causal``).

Useful FLOPs (what the TFLOP/s of every row divide by its time): forward
``4 * sum_i(L_i^2) * D * H`` (QK^T and PV, 2 flops per multiply-add), halved for
causal; forward+backward 3.5x the forward (backward: 2.5x). Work spent on padding
counts for nothing.

Correctness gate: before timing, each implementation's outputs at the real tokens
(padded outputs are packed back first, outside the timed region) are compared with a
float32 reference: :func:`ragged.reference_attention` in float32, run on the device a
few sequences at a time (so its ``[H, L, L]`` score matrices stay small). The
forward+backward rows return ``(out, dq, dk, dv)`` and all four are compared (the
gradient of the output is one fixed random ``do``, zero at the padding of the padded
baselines so that padded query rows add nothing to the key/value gradients).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import ragged

from ..harness import (
    Case,
    Config,
    Impl,
    Skip,
    Suite,
    Workload,
    _error_text,
    dtype_name,
    interpreter_skip,
    max_error_compare,
    register,
    workload_shapes,
)

RAGGED_BACKENDS = ("triton", "cuda", "torch")
GRAPHED = "ragged graphed"
HOPPER = "ragged triton hopper"
WARP_SPECIALISED = "ragged triton sm90 ws"
FUSED_BACKWARD = "ragged triton fused bwd"
PORTABLE = "ragged triton portable"
SEED = 0

# Baseline names (the rows' ``impl``).
SDPA_MASKED = "SDPA padded + mask"
SDPA_NO_MASK = "SDPA padded, no mask"
CUDNN = "SDPA padded, no mask (cuDNN)"
SDPA_NESTED = "SDPA nested (NJT)"
VARLEN_ATTN = "varlen_attn"
FLEX = "flex_attention (compiled)"
BASELINES = (SDPA_MASKED, SDPA_NO_MASK, CUDNN, SDPA_NESTED, VARLEN_ATTN, FLEX)
CPU_BASELINES = (SDPA_MASKED, SDPA_NO_MASK)
"""Measured on CPU (tiny cases); the others are GPU baselines and show as skipped there."""

# Max abs error allowed against the float32 reference, per input dtype (inputs ~N(0, 1)).
# Gradients: the same bound times max(1, max |reference gradient|).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 5e-3, torch.float64: 1e-6}

# Bytes of float32 scores the reference may hold at once (one [H, L, L] per sequence,
# a few temporaries each, twice that with gradients).
REFERENCE_CHUNK_BYTES = 1 << 30


# --------------------------------------------------------------------------------------
# Workloads


def lengths_text(dist: str, min_len: int, max_len: int) -> str:
    """How a shape's lengths read in a case name (the attention and encoder suites)."""
    if dist == "lognormal":
        return f"L~lognormal({min_len}..{max_len})"
    return f"L={min_len}..{max_len}"


@dataclasses.dataclass(frozen=True)
class Shape:
    """A batch of ``batch`` sequences with ``heads`` heads of dim ``head_dim``.

    Lengths: ``dist="uniform"``: uniform in ``[min_len, max_len]``; ``dist="lognormal"``:
    ``round(exp(N(log(median), sigma^2)))`` clipped to ``[min_len, max_len]``. In both the
    longest is then set to ``max_len`` (so the padded width ``M`` is ``max_len``).
    """

    label: str
    dtype: torch.dtype
    batch: int  # B
    heads: int  # H
    head_dim: int  # D
    min_len: int
    max_len: int
    dist: str = "uniform"
    median: float = 0.0  # lognormal only
    sigma: float = 0.0  # lognormal only
    note: str = ""

    def lengths_text(self) -> str:
        return lengths_text(self.dist, self.min_len, self.max_len)

    def name(self) -> str:
        return f"{dtype_name(self.dtype)} B={self.batch} {self.lengths_text()} H={self.heads} D={self.head_dim}"


GPU_SHAPES = (
    Shape("short", torch.bfloat16, 256, 12, 64, 8, 32, note="many short sequences"),
    Shape(
        "long-tailed",
        torch.bfloat16,
        64,
        12,
        64,
        1,
        512,
        dist="lognormal",
        median=150 * math.exp(-0.5),
        sigma=1.0,
        note="long-tailed lengths (lognormal, sigma=1, clipped), mean about 130",
    ),
    Shape("long", torch.bfloat16, 16, 16, 128, 256, 4096, note="long sequences"),
)
QUICK_SHAPE = 1  # --quick on a GPU: the long-tailed workload only
# CPU: long-tailed lengths, where skipping the padding pays (ragged's torch backend loops
# over the sequences: sum(L^2) work against SDPA's B * M^2 on the padded batch); a few
# seconds for the four groups on one thread.
CPU_SHAPES = (
    Shape(
        "long-tailed",
        torch.float32,
        16,
        4,
        32,
        1,
        256,
        dist="lognormal",
        median=75 * math.exp(-0.5),
        sigma=1.0,
        note="CPU: long-tailed lengths (lognormal, sigma=1, clipped to 256), mean about 58",
    ),
)
CPU_QUICK_SHAPES = (Shape("tiny", torch.float32, 4, 2, 32, 3, 17, note="tiny CPU smoke case: per-call overhead only"),)
PASSES = ((False, False), (True, False), (False, True), (True, True))  # (causal, backward)


def group_name(causal: bool, backward: bool) -> str:
    return ("fwd+bwd" if backward else "fwd") + (" causal" if causal else "")


def draw_lengths(shape: Shape, seed: int = SEED) -> list[int]:
    """``B`` host lengths (see :class:`Shape`), seeded; the longest is set to ``max_len``."""
    gen = torch.Generator().manual_seed(seed)
    if shape.dist == "uniform":
        lengths = torch.randint(shape.min_len, shape.max_len + 1, (shape.batch,), generator=gen)
    elif shape.dist == "lognormal":
        draws = torch.empty(shape.batch, dtype=torch.float64).log_normal_(
            math.log(shape.median), shape.sigma, generator=gen
        )
        lengths = draws.round().clamp(shape.min_len, shape.max_len).to(torch.int64)
    else:
        raise ValueError(f"unknown length distribution {shape.dist!r}")
    lengths = lengths.tolist()
    lengths[max(range(len(lengths)), key=lengths.__getitem__)] = shape.max_len
    return lengths


def attention_flops(lengths: list[int], heads: int, head_dim: int, causal: bool, backward: bool) -> int:
    """Useful flops: ``4 * sum(L^2) * D * H``, halved for causal, x3.5 with the backward."""
    flops = 4 * sum(n * n for n in lengths) * head_dim * heads
    if causal:
        flops //= 2
    if backward:
        flops = flops * 7 // 2
    return flops


# --------------------------------------------------------------------------------------
# Inputs and reference


def _randn(size: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(size, dtype=dtype, device=device, generator=gen)


@dataclasses.dataclass
class Problem:
    """One workload on the device: lengths, offsets, packed q/k/v/do and the padding maps."""

    lengths: list[int]  # host, B
    heads: int
    head_dim: int
    width: int  # M: padded length (the longest sequence)
    offsets: torch.Tensor  # [B+1] int32 (cu_seqlens)
    offsets64: torch.Tensor  # [B+1] int64 (torch.nested)
    flat_index: torch.Tensor  # [T] int64: row of each real token in a [B*M] padded layout
    key_valid: torch.Tensor  # [B, M] bool, True at real tokens
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor  # [T, H, D]: the fixed gradient of the output

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def total(self) -> int:
        return int(self.flat_index.numel())

    @classmethod
    def make(cls, shape: Shape, device: torch.device) -> Problem:
        lengths = draw_lengths(shape)
        width = max(lengths)
        offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
        lens = torch.tensor(lengths, device=device)
        key_valid = torch.arange(width, device=device)[None, :] < lens[:, None]
        flat_index = torch.nonzero(key_valid.reshape(-1)).squeeze(1)
        size = (sum(lengths), shape.heads, shape.head_dim)
        q, k, v, do = (_randn(size, shape.dtype, device, SEED + 1 + i) for i in range(4))
        return cls(
            lengths,
            shape.heads,
            shape.head_dim,
            width,
            offsets,
            offsets.to(torch.int64),
            flat_index,
            key_valid,
            q,
            k,
            v,
            do,
        )

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """Packed ``[T, H, D]`` -> contiguous padded ``[B, H, M, D]`` (zeros at the padding)."""
        B, M = self.batch, self.width
        out = x.new_zeros(B * M, *x.shape[1:])
        out.index_copy_(0, self.flat_index, x)
        return out.view(B, M, *x.shape[1:]).transpose(1, 2).contiguous()

    def packed(self, x: torch.Tensor) -> torch.Tensor:
        """Padded ``[B, H, M, D]`` -> packed ``[T, H, D]`` (real positions only)."""
        B, H, M, D = x.shape
        return x.transpose(1, 2).reshape(B * M, H, D).index_select(0, self.flat_index)

    def as_packed(self, x: Any) -> torch.Tensor:
        """An implementation's output (or gradient) in the packed ``[T, H, D]`` layout."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"expected a tensor, got {type(x).__name__}")
        if x.is_nested:
            return x.values()
        if x.dim() == 4:
            if x.shape[0] != self.batch or x.shape[2] != self.width:
                raise ValueError(
                    f"padded output of shape {tuple(x.shape)}, expected [{self.batch}, H, {self.width}, D]"
                )
            return self.packed(x)
        return x


def reference_outputs(p: Problem, causal: bool, backward: bool) -> tuple[torch.Tensor, ...]:
    """Float32 ``(out,)`` or ``(out, dq, dk, dv)`` of the packed problem (float64 for float64 inputs).

    :func:`ragged.reference_attention` in float32 on chunks of whole sequences, each chunk
    holding at most about ``REFERENCE_CHUNK_BYTES`` of scores, so that the long cases
    (``[H, 4096, 4096]`` per sequence) and their gradients fit in memory.
    """
    dtype = torch.float64 if p.q.dtype == torch.float64 else torch.float32
    per_seq = [p.heads * n * n * 4 * (6 if backward else 3) for n in p.lengths]
    results: list[list[torch.Tensor]] = [[] for _ in range(4 if backward else 1)]
    starts = [0, *itertools.accumulate(p.lengths)]
    b = 0
    while b < p.batch:
        e, used = b + 1, per_seq[b]
        while e < p.batch and used + per_seq[e] <= REFERENCE_CHUNK_BYTES:
            used += per_seq[e]
            e += 1
        lo, hi = starts[b], starts[e]
        cu = torch.tensor([s - lo for s in starts[b : e + 1]], dtype=torch.int32, device=p.q.device)
        q, k, v = (t[lo:hi].to(dtype, copy=True).requires_grad_(backward) for t in (p.q, p.k, p.v))
        with torch.set_grad_enabled(backward):
            out, _ = ragged.reference_attention(q, k, v, cu, cu, causal=causal, compute_dtype=dtype)
        results[0].append(out.detach())
        if backward:
            for i, g in enumerate(torch.autograd.grad(out, (q, k, v), p.do[lo:hi].to(dtype)), 1):
                results[i].append(g)
        del q, k, v, out
        b = e
    return tuple(torch.cat(parts) for parts in results)


def make_compare(p: Problem, tol: float) -> Callable[[Any, Any], str | None]:
    """Max abs error at the real tokens against the float32 reference (gradients scaled by their size)."""
    return max_error_compare(("out", "dq", "dk", "dv"), p.as_packed, tol, absolute=("out",))


# --------------------------------------------------------------------------------------
# Implementations


def forward_or_backward(
    forward: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], grad_out: torch.Tensor | None
) -> Callable[[], Any]:
    """The timed callable: ``forward(*inputs)``, or forward then ``autograd.grad`` with
    ``grad_out`` (``inputs`` are then leaves requiring grad); returns ``out`` or
    ``(out, dq, dk, dv)`` in the layout of the implementation."""
    if grad_out is None:
        return lambda: forward(*inputs)

    def fwd_bwd():
        out = forward(*inputs)
        return (out, *torch.autograd.grad(out, inputs, grad_out))

    return fwd_bwd


def _leaves(tensors: tuple[torch.Tensor, ...], backward: bool) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach().requires_grad_(True) for t in tensors) if backward else tensors


def ragged_impls(
    p: Problem, causal: bool, backward: bool, device: torch.device, triton_skip: str | None = None
) -> list[Impl]:
    """``ragged <backend>``: ``ragged.varlen_attention(..., backend=b)``; the triton row
    skipped with ``triton_skip`` when given."""
    M = p.width
    inputs = _leaves((p.q, p.k, p.v), backward)
    reasons = ragged.explain("attention", *inputs, p.offsets, p.offsets, M, M, causal, 0.0, backward)
    impls = []
    for backend in RAGGED_BACKENDS:
        why = reasons.get(backend, [f"no {backend!r} attention is registered"])
        if not why and backend == "torch" and device.type == "cuda":
            why = ["the torch reference loops over the sequences on the host; measured on the CPU cases only"]
        if not why and backend == "triton" and triton_skip:
            why = [triton_skip]

        def forward(q, k, v, b=backend):
            return ragged.varlen_attention(q, k, v, p.offsets, p.offsets, M, M, causal=causal, backend=b)

        name = f"ragged {backend}"
        if why:
            impls.append(Impl(name, "ragged", skip="; ".join(why)))
        else:
            impls.append(Impl(name, "ragged", forward_or_backward(forward, inputs, p.do if backward else None)))
    if device.type == "cuda":
        impls.append(_hopper_impl(p, causal, backward, inputs, reasons.get("triton") or triton_skip))
        impls.append(_hopper_impl(p, causal, backward, inputs, reasons.get("triton") or triton_skip, on=False))
        ws_skip = reasons.get("triton") or triton_skip
        impls.append(_hopper_impl(p, causal, backward, inputs, ws_skip, variant="triton_sm90_ws"))
        if backward:
            impls.append(_hopper_impl(p, causal, backward, inputs, ws_skip, variant="triton_fused_bwd"))
        impls.append(_graphed_impl(p, causal, backward, inputs))
    return impls


def _hopper_impl(
    p: Problem,
    causal: bool,
    backward: bool,
    inputs: tuple[torch.Tensor, ...],
    why,
    on: bool = True,
    variant: str | None = None,
) -> Impl:
    """``ragged triton hopper``: the triton row with the sm_90 kernels (TMA descriptors, forward and
    backward) switched on, skipped where they do not take the call; ``on=False``: ``ragged triton
    portable``, the same with them off (the portable kernels, what other GPUs run);
    ``variant="triton_sm90_ws"``: ``ragged triton sm90 ws``, the warp-specialised forward
    (Gluon) with the portable backward; ``variant="triton_fused_bwd"``: ``ragged triton fused
    bwd``, the portable forward and the fused backward (dQ added atomically)."""
    M = p.width
    name = {"triton_sm90_ws": WARP_SPECIALISED, "triton_fused_bwd": FUSED_BACKWARD}.get(
        variant or "", HOPPER if on else PORTABLE
    )
    variant = variant or ("triton_sm90_full" if on else "triton")
    if on and not why:
        q, k, v = inputs[:3]
        why = ragged.explain("attention", q, k, v, p.offsets, p.offsets, M, M, causal, 0.0, backward)[variant]
    if why:
        return Impl(name, "ragged", skip=why if isinstance(why, str) else "; ".join(why))

    def forward(q, k, v):
        with ragged.backends.prefer("attention", variant):
            return ragged.varlen_attention(q, k, v, p.offsets, p.offsets, M, M, causal=causal, backend="triton")

    return Impl(name, "ragged", forward_or_backward(forward, inputs, p.do if backward else None))


def _graphed_impl(p: Problem, causal: bool, backward: bool, inputs: tuple[torch.Tensor, ...]) -> Impl:
    """``ragged graphed``: the auto-chosen ragged forward (and backward) replayed from CUDA graphs
    captured here: ``torch.cuda.make_graphed_callables`` with a backward, one graph without."""
    M = p.width

    def forward(q, k, v):
        return ragged.varlen_attention(q, k, v, p.offsets, p.offsets, M, M, causal=causal)

    try:
        if backward:
            run = torch.cuda.make_graphed_callables(forward, inputs)
        else:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.no_grad():
                for _ in range(2):
                    forward(*inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), torch.no_grad():
                static = forward(*inputs)

            def run(*_):
                graph.replay()
                return static
    except Exception as exc:  # noqa: BLE001 - a row that cannot be captured says why
        return Impl(GRAPHED, "ragged", skip=f"capture failed: {_error_text(exc)}")
    return Impl(GRAPHED, "ragged", forward_or_backward(run, inputs, p.do if backward else None))


def _sdpa_masked(p: Problem, causal: bool, backward: bool, device: torch.device) -> Impl:
    inputs = _leaves(tuple(p.padded(t) for t in (p.q, p.k, p.v)), backward)
    mask = p.key_valid[:, None, None, :]  # [B, 1, 1, M], True = attend
    if causal:
        M = p.width
        mask = mask & torch.ones(M, M, dtype=torch.bool, device=device).tril()  # [B, 1, M, M]

    def forward(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    grad_out = p.padded(p.do) if backward else None
    return Impl(SDPA_MASKED, "baseline", forward_or_backward(forward, inputs, grad_out))


def _sdpa_no_mask(p: Problem, causal: bool, backward: bool, device: torch.device) -> Impl:
    inputs = _leaves(tuple(p.padded(t) for t in (p.q, p.k, p.v)), backward)

    def forward(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    grad_out = p.padded(p.do) if backward else None
    # Attends to the padding: its output is wrong by design, so it is not checked.
    return Impl(SDPA_NO_MASK, "baseline", forward_or_backward(forward, inputs, grad_out), check=False)


def _cudnn(p: Problem, causal: bool, backward: bool, device: torch.device) -> Impl:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    inputs = _leaves(tuple(p.padded(t) for t in (p.q, p.k, p.v)), backward)

    def forward(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    grad_out = p.padded(p.do) if backward else None
    # The dense ceiling: padded, no mask (attends to the padding, not checked, as SDPA_NO_MASK).
    return Impl(CUDNN, "baseline", forward_or_backward(forward, inputs, grad_out), check=False)


def _sdpa_nested(p: Problem, causal: bool, backward: bool, device: torch.device) -> Impl:
    inputs = _leaves((p.q, p.k, p.v), backward)

    shortest = min(p.lengths)

    def nested(x):  # [T, H, D] -> NJT [B, H, j, D]; both bounds given, else SDPA reads them from the device
        return torch.nested.nested_tensor_from_jagged(
            x, p.offsets64, min_seqlen=shortest, max_seqlen=p.width
        ).transpose(1, 2)

    def forward(q, k, v):
        out = F.scaled_dot_product_attention(nested(q), nested(k), nested(v), is_causal=causal)
        return out.transpose(1, 2).values()  # [T, H, D]

    return Impl(SDPA_NESTED, "baseline", forward_or_backward(forward, inputs, p.do if backward else None))


def _varlen_attn(p: Problem, causal: bool, backward: bool, device: torch.device) -> Impl:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        raise Skip(f"torch.nn.attention.varlen.varlen_attn is not in torch {torch.__version__} ({exc})") from None
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, Any] = {}
    if causal:
        if "is_causal" in params:  # torch 2.10
            kwargs["is_causal"] = True
        elif "window_size" in params:  # later: (-1, 0) is causal
            kwargs["window_size"] = (-1, 0)
        else:
            raise Skip(f"varlen_attn{inspect.signature(varlen_attn)} takes no causal option")
    inputs = _leaves((p.q, p.k, p.v), backward)
    M = p.width

    def forward(q, k, v):
        out = varlen_attn(q, k, v, p.offsets, p.offsets, M, M, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    return Impl(VARLEN_ATTN, "baseline", forward_or_backward(forward, inputs, p.do if backward else None))


def _flex(p: Problem, causal: bool, backward: bool, device: torch.device) -> Impl:
    from torch import _dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    T = p.total
    doc = torch.repeat_interleave(
        torch.arange(p.batch, device=device, dtype=torch.int32), torch.tensor(p.lengths, device=device)
    )  # [T]: sequence id of each token

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    def causal_document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    # Built once, outside the timed region.
    block_mask = create_block_mask(causal_document if causal else document, None, None, T, T, device=device)
    # Each case compiles anew (new shapes and mask): start from a clean cache so that
    # the recompile limit is never reached across cases.
    _dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    inputs = _leaves((p.q, p.k, p.v), backward)

    def forward(q, k, v):  # packed [T, H, D] as a batch of one: [1, H, T, D] views
        out = compiled(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            block_mask=block_mask,
        )
        return out.squeeze(0).transpose(0, 1)  # [T, H, D] view

    return Impl(FLEX, "baseline", forward_or_backward(forward, inputs, p.do if backward else None))


BASELINE_BUILDERS = {
    SDPA_MASKED: _sdpa_masked,
    SDPA_NO_MASK: _sdpa_no_mask,
    CUDNN: _cudnn,
    SDPA_NESTED: _sdpa_nested,
    VARLEN_ATTN: _varlen_attn,
    FLEX: _flex,
}


def baseline_impls(
    p: Problem, causal: bool, backward: bool, device: torch.device, measured: tuple[str, ...]
) -> list[Impl]:
    """Every baseline; those not in ``measured``, or whose setup raises, are skipped with the reason."""
    impls = []
    for name, build in BASELINE_BUILDERS.items():
        if name not in measured:
            impls.append(
                Impl(
                    name, "baseline", skip="GPU baseline; the CPU run measures the torch reference and padded SDPA only"
                )
            )
            continue
        try:
            impls.append(build(p, causal, backward, device))
        except Skip as exc:
            impls.append(Impl(name, "baseline", skip=str(exc)))
        except torch.OutOfMemoryError:
            impls.append(Impl(name, "baseline", skip="out of memory while setting up"))
        except Exception as exc:
            impls.append(Impl(name, "baseline", skip=f"setup failed: {_error_text(exc)}"))
    return impls


def build_workload(
    shape: Shape,
    causal: bool,
    backward: bool,
    device: torch.device,
    measured: tuple[str, ...] = BASELINES,
    triton_skip: str | None = None,
) -> Workload:
    p = Problem.make(shape, device)
    reference = reference_outputs(p, causal, backward)
    impls = ragged_impls(p, causal, backward, device, triton_skip) + baseline_impls(
        p, causal, backward, device, measured
    )
    tol = TOLERANCE.get(shape.dtype, 2e-2)
    flops = attention_flops(p.lengths, shape.heads, shape.head_dim, causal, backward)
    return Workload(impls, reference=reference, flops=flops, compare=make_compare(p, tol))


# --------------------------------------------------------------------------------------
# The suite


@register
class AttentionSuite(Suite):
    name = "attention"
    description = "varlen self-attention, packed [T, H, D] vs padded / nested / varlen / flex baselines"
    memory_bound = False
    speedup_table = True
    notes = """\
Self-attention over `B` sequences, q/k/v packed `[T, H, D]` with `cu` = `cu_seqlens`
(int32 offsets, `[B+1]`) and `M` = the longest length. TFLOP/s count useful flops only:
forward `4 * sum(L_i^2) * D * H`, halved for causal; forward+backward 3.5x that. The
`fwd+bwd` rows time one callable: the forward, then
`torch.autograd.grad(out, (q, k, v), do)` with a fixed random `do`.

- `ragged <backend>`: `ragged.varlen_attention(q, k, v, cu, cu, M, M, causal=..., backend=...)`;
  `cuda` is the short-sequence kernel (forward only), `torch` the float32 reference
  (a loop over the sequences; timed on the CPU cases only, where it is ragged's CPU path:
  `sum(L_i^2)` work against `B * M^2` for padded SDPA).
- `ragged graphed` (CUDA): the same call with the auto-chosen backend, captured once in a CUDA
  graph (forward) or through `torch.cuda.make_graphed_callables` (forward and backward) and
  replayed: what a graphed model pays for the attention, without the per-call host time.
- `SDPA padded + mask`: `F.scaled_dot_product_attention(q, k, v, attn_mask=mask)` on
  contiguous padded `[B, H, M, D]`; `mask` is bool, True = attend: the key-padding mask
  `[B, 1, 1, M]`, and for causal `key_padding & tril(M, M)` as `[B, 1, M, M]` (built
  outside the timed region). For the backward, `do` is zero at the padding.
- `SDPA padded, no mask`: the same without a mask (`is_causal=True` for causal): a lower
  bound for padded compute. It attends to the padding, so its output is not checked.
- `SDPA padded, no mask (cuDNN)`: the same under `sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`:
  cuDNN's dense kernel, the ceiling a padded batch reaches (not checked either).
- `ragged triton` takes the default (`RAGGED_ATTENTION_HOPPER=auto`): on sm_90 the TMA
  forward of `ragged.kernels.triton.attention_hopper` for batches whose longest sequence has
  1024 tokens or more (3072 at head dim 128 without a mask: `sm90_min_len`), the portable
  kernels otherwise and for every backward.
- `ragged triton hopper` (sm_90): the triton row with the TMA kernels of
  `attention_hopper` (forward) and `attention_hopper_bwd` switched on for every call they take
  (`RAGGED_ATTENTION_HOPPER=1`); `ragged triton portable`: switched off (`=0`), the kernels
  other GPUs run; `ragged triton sm90 ws`: the warp-specialised forward of
  `attention_ws` (Gluon: a loading warpgroup, two consumer warpgroups) preferred, the portable
  backward; `ragged triton fused bwd` (fwd+bwd only): the portable forward and the fused
  backward, dK, dV and dQ from one key-block kernel (dQ added atomically, 5 matrix products per
  block pair where the split kernels make 7).
- `SDPA nested (NJT)`: `torch.nested.nested_tensor_from_jagged(x, offsets, min_seqlen=min(L),
  max_seqlen=M)` (jagged layout, `[B, j, H, D]`; given on the host, the bounds spare
  SDPA a device sync) for q, k, v, `.transpose(1, 2)`, SDPA
  (`is_causal=True` for causal), `.transpose(1, 2).values()`.
- `varlen_attn`: `torch.nn.attention.varlen.varlen_attn(q, k, v, cu, cu, M, M)`; causal
  through `is_causal=True` or `window_size=(-1, 0)`, whichever this torch takes.
- `flex_attention (compiled)`: `torch.compile(flex_attention, dynamic=False)` on the packed
  tokens as a batch of one (`[1, H, T, D]` views of q, k, v) with a document mask
  `doc[q] == doc[kv]` (`& (q >= kv)` for causal) from `create_block_mask`, built once
  outside the timed region; compiled during the untimed correctness call.

Correctness: every checked row's outputs at the real tokens (and, for `fwd+bwd`, its
`dq`, `dk`, `dv`) are compared with `ragged.reference_attention` in float32 (run a few
sequences at a time); max abs error <= 2e-2 for bf16 (gradients: 2e-2 x max(1, max |ref|)).
"""

    def shapes(self, config: Config) -> list[Shape]:
        """GPU: the three workloads (the long-tailed one with --quick); --dtype swaps their
        dtype. CPU: the long-tailed CPU case (the tiny one with --quick), in each requested
        floating dtype."""
        return workload_shapes(config, GPU_SHAPES, CPU_SHAPES, QUICK_SHAPE, CPU_QUICK_SHAPES)

    def cases(self, config: Config) -> list[Case]:
        cases = []
        for causal, backward in PASSES:
            group = group_name(causal, backward)
            for shape in self.shapes(config):
                lengths = draw_lengths(shape)
                total = sum(lengths)
                params = {
                    "workload": shape.label,
                    "pass": "fwd+bwd" if backward else "fwd",
                    "causal": causal,
                    "dtype": dtype_name(shape.dtype),
                    "B": shape.batch,
                    "H": shape.heads,
                    "D": shape.head_dim,
                    "lengths": shape.dist,
                    "min_len": shape.min_len,
                    "max_len": shape.max_len,
                    "mean_len": round(total / shape.batch, 2),
                    "T": total,
                    "M": max(lengths),
                    "real_fraction": round(total / (shape.batch * max(lengths)), 4),
                    "note": shape.note,
                }
                name = f"{group} {shape.name()} mean={total / shape.batch:.0f}"
                cases.append(Case(name, params, group=group, spec=(shape, causal, backward)))
        return cases

    def build(self, case: Case, config: Config) -> Workload:
        shape, causal, backward = case.spec
        measured = BASELINES if config.on_gpu else CPU_BASELINES
        return build_workload(shape, causal, backward, config.device, measured, interpreter_skip(config))
