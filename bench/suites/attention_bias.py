"""The attention-bias suite: varlen self-attention with MPNet's relative-position bias
(``position_bias=(table, buckets)``), the padded ways HuggingFace and PyTorch users add such a
bias (a materialised ``[B, H, M, M]`` bias), FlexAttention's ``score_mod``, and ragged's own
attention without a bias (the ceiling a bias read inside the kernels aims for)."""

from __future__ import annotations

import dataclasses
import math
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
from ..measure import graphed_replay
from .attention import Problem, Shape, attention_flops, draw_lengths, forward_or_backward

NUM_BUCKETS, MAX_DISTANCE = 32, 128  # MPNet's (HuggingFace's compute_position_bias)
AUTO = "ragged"
TRITON = "ragged triton"
CUDA = "ragged cuda"
NO_BIAS = "ragged, no bias"
TRITON_GRAPHED = "ragged triton, graphed"
NO_BIAS_GRAPHED = "ragged, no bias, graphed"
EAGER = "eager, bias materialised (HF MPNet)"
SDPA_BIAS = "SDPA padded, bias as float mask"
FLEX_BIAS = "flex_attention score_mod (compiled)"
BASELINES = (EAGER, SDPA_BIAS, FLEX_BIAS)  # the rows a ragged row's speedups are over
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 5e-3}
GPU_SHAPES = (
    Shape(
        "MPNet sentences",
        torch.bfloat16,
        256,
        12,
        64,
        8,
        128,
        note="all-mpnet-base-v2's attention: 256 sentences of 8..128 tokens",
    ),
)
CPU_SHAPES = (Shape("tiny", torch.float32, 6, 2, 32, 1, 24, note="tiny CPU smoke case"),)
PASSES = (False, True)  # backward


def _buckets(width: int, device: torch.device) -> torch.Tensor:
    """MPNet's bucket of every distance ``j - i`` from ``-(width - 1)`` to ``width - 1``."""
    from ragged.nn.hf.mpnet import relative_buckets

    distance = torch.arange(-(width - 1), width, device=device)
    return relative_buckets(distance, NUM_BUCKETS, MAX_DISTANCE).to(torch.int32)


@dataclasses.dataclass
class BiasProblem:
    p: Problem
    table: torch.Tensor  # [NUM_BUCKETS, H] float32
    buckets: torch.Tensor  # [2M - 1] int32

    @classmethod
    def make(cls, shape: Shape, device: torch.device) -> BiasProblem:
        p = Problem.make(shape, device)
        gen = torch.Generator(device=device).manual_seed(7)
        table = torch.randn((NUM_BUCKETS, shape.heads), generator=gen, device=device)
        return cls(p, table, _buckets(p.width, device))

    def dense_bias(self, table: torch.Tensor) -> torch.Tensor:
        """``[H, M, M]``: ``table[bucket(j - i), h]`` at ``[h, i, j]`` (differentiable in ``table``)."""
        M = self.p.width
        i = torch.arange(M, device=table.device)
        return table[self.buckets[(i[None, :] - i[:, None]) + M - 1].long()].permute(2, 0, 1)

    def flatten(self, x: Any) -> torch.Tensor:
        return x if isinstance(x, torch.Tensor) and x.dim() == 2 else self.p.as_packed(x)


def reference(bp: BiasProblem, backward: bool) -> tuple[torch.Tensor, ...]:
    """Float32 ``(out,)`` or ``(out, dq, dk, dv, dtable)``: ragged's torch reference on float32 copies."""
    p = bp.p
    leaves = [t.float().requires_grad_(backward) for t in (p.q, p.k, p.v, bp.table)]
    with torch.set_grad_enabled(backward):
        out = ragged.varlen_attention(
            *leaves[:3], p.offsets, p.offsets, p.width, p.width, backend="torch", position_bias=(leaves[3], bp.buckets)
        )
    if not backward:
        return (out.detach(),)
    return (out.detach(), *torch.autograd.grad(out, leaves, p.do.float()))


def _inputs(bp: BiasProblem, backward: bool) -> tuple[torch.Tensor, ...]:
    p = bp.p
    return tuple(t.detach().requires_grad_(backward) for t in (p.q, p.k, p.v, bp.table))


def _ragged(bp: BiasProblem, backward: bool, name: str) -> Impl:
    """``ragged`` (the backend "auto" picks), ``ragged triton`` / ``ragged cuda`` (forced), or
    ``ragged, no bias`` (auto, the same call without the bias: q, k, v only; its outputs differ,
    so it is not checked)."""
    p = bp.p
    inputs = _inputs(bp, backward)
    backend = {TRITON: "triton", CUDA: "cuda"}.get(name)

    def forward(q, k, v, table):
        return ragged.varlen_attention(
            q,
            k,
            v,
            p.offsets,
            p.offsets,
            p.width,
            p.width,
            backend=backend,
            position_bias=None if table is None else (table, bp.buckets),
        )

    do = p.do if backward else None
    if name == NO_BIAS:
        return Impl(
            NO_BIAS,
            "baseline",
            forward_or_backward(lambda q, k, v: forward(q, k, v, None), inputs[:3], do),
            check=False,
        )
    return Impl(name, "ragged", forward_or_backward(forward, inputs, do))


def _ragged_graphed(bp: BiasProblem, backward: bool, name: str) -> Impl:
    """``ragged triton`` (Triton forced) or ``ragged, no bias`` replayed from a CUDA graph."""
    eager = _ragged(bp, backward, TRITON if name == TRITON_GRAPHED else NO_BIAS)
    return Impl(name, eager.kind, graphed_replay(eager.fn), check=eager.check)


def _padded_do(bp: BiasProblem) -> torch.Tensor:
    return bp.p.padded(bp.p.do)  # zeros at the padding


def _eager(bp: BiasProblem, backward: bool, names: tuple[str, ...]) -> Impl:
    """HuggingFace MPNet's attention: padded scores, the bias gathered to ``[1, H, M, M]`` and added,
    the key padding masked to the dtype's minimum, softmax in float32, times v. The scores are
    rounded to the input dtype before the softmax, as HF's are, which in bf16 puts its output
    up to about 0.035 from the float32 reference at these shapes: its check allows 2.5x the
    workload's tolerance (a missing bias or mask is still off by far more)."""
    p = bp.p
    inputs = _inputs(bp, backward)
    keep = p.key_valid[:, None, None, :]
    scale = 1.0 / math.sqrt(p.head_dim)

    def forward(q, k, v, table):
        q, k, v = p.padded(q), p.padded(k), p.padded(v)
        scores = (q @ k.transpose(-1, -2)) * scale + bp.dense_bias(table)[None].to(q.dtype)
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        return torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v

    tol = 2.5 * TOLERANCE.get(bp.p.q.dtype, 2e-2)
    return Impl(
        EAGER,
        "baseline",
        forward_or_backward(forward, inputs, _padded_do(bp) if backward else None),
        compare=max_error_compare(names, bp.flatten, tol, absolute=("out",)),
    )


def _sdpa(bp: BiasProblem, backward: bool) -> Impl:
    """``F.scaled_dot_product_attention`` with the bias and the key padding as one float mask
    ``[B, H, M, M]`` (the memory-efficient kernel takes a float mask and its gradient)."""
    p = bp.p
    inputs = _inputs(bp, backward)
    padding = torch.zeros(p.key_valid.shape, device=p.q.device).masked_fill(~p.key_valid, float("-inf"))

    def forward(q, k, v, table):
        mask = (bp.dense_bias(table)[None] + padding[:, None, None, :]).to(q.dtype)
        return F.scaled_dot_product_attention(p.padded(q), p.padded(k), p.padded(v), attn_mask=mask)

    return Impl(SDPA_BIAS, "baseline", forward_or_backward(forward, inputs, _padded_do(bp) if backward else None))


def _flex(bp: BiasProblem, backward: bool) -> Impl:
    """``flex_attention`` on the packed tokens as a batch of one, a document block mask and a
    ``score_mod`` adding ``table[bucket(pos[kv] - pos[q]), h]`` (``pos``: position in the sequence)."""
    from torch import _dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    p = bp.p
    device = p.q.device
    lengths = torch.tensor(p.lengths, device=device)
    doc = torch.repeat_interleave(torch.arange(p.batch, device=device, dtype=torch.int32), lengths)
    pos = torch.arange(p.total, device=device, dtype=torch.int32) - p.offsets[:-1].repeat_interleave(lengths)
    buckets, shift = bp.buckets, p.width - 1

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    block_mask = create_block_mask(document, None, None, p.total, p.total, device=device)
    _dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    inputs = _inputs(bp, backward)

    def forward(q, k, v, table):
        def bias(score, b, h, q_idx, kv_idx):
            return score + table[buckets[pos[kv_idx] - pos[q_idx] + shift], h]

        out = compiled(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            score_mod=bias,
            block_mask=block_mask,
        )
        return out.squeeze(0).transpose(0, 1)

    return Impl(FLEX_BIAS, "baseline", forward_or_backward(forward, inputs, p.do if backward else None))


def build_workload(shape: Shape, backward: bool, device: torch.device, triton_skip: str | None) -> Workload:
    bp = BiasProblem.make(shape, device)
    ref = reference(bp, backward)
    names = ("out", "dq", "dk", "dv", "dtable") if backward else ("out",)
    impls = []
    p = bp.p
    reasons = ragged.explain(
        "attention",
        p.q,
        p.k,
        p.v,
        p.offsets,
        p.offsets,
        p.width,
        p.width,
        False,
        0.0,
        backward,
        (-1, -1),
        (bp.table, bp.buckets),
    )
    unable = {
        TRITON: reasons.get("triton", ["no triton attention is registered"]),
        CUDA: reasons.get("cuda", ["no cuda attention is registered"]),
    }
    unable[TRITON_GRAPHED] = unable[TRITON]
    if device.type == "cpu":  # "auto" on CPU tensors is the torch backend: what a CPU user runs
        unable[TRITON_GRAPHED] = unable[NO_BIAS_GRAPHED] = ["CUDA graphs: CUDA only"]
    for name, build in (
        (AUTO, lambda: _ragged(bp, backward, AUTO)),
        (TRITON, lambda: _ragged(bp, backward, TRITON)),
        (CUDA, lambda: _ragged(bp, backward, CUDA)),
        (NO_BIAS, lambda: _ragged(bp, backward, NO_BIAS)),
        (TRITON_GRAPHED, lambda: _ragged_graphed(bp, backward, TRITON_GRAPHED)),
        (NO_BIAS_GRAPHED, lambda: _ragged_graphed(bp, backward, NO_BIAS_GRAPHED)),
        (EAGER, lambda: _eager(bp, backward, names)),
        (SDPA_BIAS, lambda: _sdpa(bp, backward)),
        (FLEX_BIAS, lambda: _flex(bp, backward)),
    ):
        kind = "ragged" if name in (AUTO, TRITON, CUDA, TRITON_GRAPHED) else "baseline"
        why = (
            "compiled FlexAttention: CUDA only"
            if name == FLEX_BIAS and device.type != "cuda"
            else "; ".join(unable.get(name, [])) or None
        )
        if name in (TRITON, TRITON_GRAPHED) and triton_skip:
            why = triton_skip
        if why:
            impls.append(Impl(name, kind, skip=why))
            continue
        try:
            impls.append(build())
        except (Skip, torch.OutOfMemoryError) as exc:
            impls.append(Impl(name, kind, skip=str(exc) or "out of memory while setting up"))
        except Exception as exc:  # noqa: BLE001  (the row says why; the suite goes on)
            impls.append(Impl(name, kind, skip=f"setup failed: {_error_text(exc)}"))
    for impl in impls:  # the bias-free ceiling does other work: no speedup over it
        if impl.kind == "ragged":
            impl.versus = BASELINES
    compare = max_error_compare(names, bp.flatten, TOLERANCE.get(shape.dtype, 2e-2), absolute=("out",))
    flops = attention_flops(bp.p.lengths, shape.heads, shape.head_dim, False, backward)
    return Workload(impls, reference=ref, flops=flops, compare=compare)


@register
class AttentionBiasSuite(Suite):
    name = "attention-bias"
    description = "varlen self-attention with MPNet's relative-position bias vs materialised-bias baselines"
    memory_bound = False
    speedup_table = True
    notes = """\
Self-attention (not causal) over `B` sequences packed `[T, H, D]`, each score plus MPNet's
relative-position bias: `table[bucket(j - i), h]`, `table [32, H]` float32, buckets as
HuggingFace's MPNet computes them (32 buckets, max distance 128, both directions). `fwd+bwd`
times the forward then `torch.autograd.grad` to q, k, v and the table with a fixed `do`.
TFLOP/s count the attention's useful flops (the bias adds none).

- `ragged`: `ragged.varlen_attention(..., position_bias=(table, buckets))` with the backend
  "auto" picks (on CPU tensors the torch backend); `ragged triton` / `ragged cuda` forced: Triton reads the bias
  per tile inside
  the kernels from `j - i` and sums the table's gradient per bucket; the CUDA short-sequence
  kernel (forward only, sequences up to 128 tokens) reads it per score.
- `ragged, no bias`: the same call without the bias, the ceiling (not checked: other outputs;
  the speedups of the ragged rows are over the three padded / flex baselines, not over it).
  Target: `ragged` within 15% of it.
- `ragged triton, graphed` / `ragged, no bias, graphed`: the same calls (Triton forced with the
  bias) captured once in a CUDA graph and replayed: the kernels' time without the host's
  per-call work, which at these sizes can be as long as the kernels'.
- `eager, bias materialised (HF MPNet)`: HuggingFace MPNet's attention on padded `[B, H, M, D]`:
  `q @ k^T * scale + bias[None]` with the bias gathered to `[H, M, M]`, key padding masked,
  float32 softmax, `@ v`. Target: `ragged` >= 3x.
- `SDPA padded, bias as float mask`: `F.scaled_dot_product_attention` with `attn_mask` =
  the gathered bias plus `-inf` at the padded keys, `[B, H, M, M]` in the inputs' dtype.
- `flex_attention score_mod (compiled)`: the packed tokens as a batch of one, a document
  block mask, and a `score_mod` adding the table entry of `pos[kv] - pos[q]`.

Correctness: outputs and gradients (the table's included) against ragged's torch reference in
float32; max abs error <= 2e-2 for bf16 (gradients: 2e-2 x max(1, max |ref|)).
"""

    def shapes(self, config: Config) -> list[Shape]:
        return workload_shapes(config, GPU_SHAPES, CPU_SHAPES, 0, CPU_SHAPES)

    def cases(self, config: Config) -> list[Case]:
        cases = []
        for backward in PASSES:
            group = "fwd+bwd" if backward else "fwd"
            for shape in self.shapes(config):
                lengths = draw_lengths(shape)
                total = sum(lengths)
                params = {
                    "workload": shape.label,
                    "pass": group,
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
                    "num_buckets": NUM_BUCKETS,
                    "max_distance": MAX_DISTANCE,
                    "note": shape.note,
                }
                name = f"{group} bias {shape.name()} mean={total / shape.batch:.0f}"
                cases.append(Case(name, params, group=group, spec=(shape, backward)))
        return cases

    def build(self, case: Case, config: Config) -> Workload:
        shape, backward = case.spec
        return build_workload(shape, backward, config.device, interpreter_skip(config))
