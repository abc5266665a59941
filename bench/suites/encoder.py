"""encoder: a Transformer encoder on ragged batches, torch.nn padded / nested vs ragged.nn.

The model is ``torch.nn.TransformerEncoder`` (post-norm, GELU, ``batch_first``): on a
GPU BERT-base (``d = 768``, 12 heads, ``ff = 3072``, 12 layers) in bfloat16, on CPU a
small one in float32 (``d = 128``, 4 heads, ``ff = 512``, 2 layers) on a long-tailed
batch (a tiny one with --quick). ``ragged.nn.TransformerEncoder.from_torch`` of it
shares its Parameter objects, so every row runs the same weights. A batch is ``B`` sequences of lengths
``L_i`` (``T = sum L_i`` real tokens, padded width ``M = max L_i``); its token
features are one fixed random ``[T, d]``. Two groups:

* ``inference``: eval mode, under ``torch.no_grad()``: torch.nn on the padded batch
  (plain ops, its fused fast path, its nested-tensor fast path), torch.nn on a batch of
  the same token count without padding (the ideal), and ragged.nn on a RaggedTensor
  (and on the padded batch, packing and unpacking inside the call);
* ``training``: train mode with dropout (``EncoderSuite.dropout``, 0.1 as BERT), one
  forward and ``torch.autograd.grad`` of every parameter with a fixed random gradient of
  the output (zero at the padding of padded outputs).

Useful FLOPs (what the TFLOP/s of every row divide by its time), per layer: the GEMMs
of the real tokens ``2 * T * (4 * d^2 + 2 * d * ff)`` (q/k/v/out projections and the
two feed-forward layers) plus attention ``4 * sum_i(L_i^2) * d`` (QK^T and PV); times
the layers; forward+backward 3x the forward. Work spent on padding counts for nothing.
Each case also times one large ``torch.mm`` in the case's dtype (the GEMM ceiling row)
and reports every row's TFLOP/s as a percentage of it.

Correctness gate: before timing, the outputs of every checked row at the real tokens
(and, for training rows, the gradients of every parameter) are compared with a float32
copy of the torch.nn model (plain ops, eval mode, so no dropout), run a few sequences
at a time. The bound is relative to torch.nn's own error in the same dtype (see
:func:`make_compare`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import ragged.nn as rnn

from ..env import gpu_clocks
from ..harness import Case, Config, Impl, Row, Suite, Workload, dtype_name, gpu_busy_ms, register, workload_shapes
from .encoder_problem import (
    BERT_BASE,
    CEILING_N,
    CPU_QUICK_SHAPES,
    CPU_SHAPES,
    DENSE,
    DROPOUT,
    GPU_BUSY,
    GPU_SHAPES,
    GROUPS,
    INFERENCE,  # noqa: F401  (the tests read it here)
    NESTED,
    PADDED,
    PADDED_FAST,
    PCT_GEMM,
    QUICK_SHAPE,
    RAGGED,
    RAGGED_GRAPHED,
    RAGGED_PADDED,
    SEED,
    TOLERANCE,
    TRAINING,
    VS_DENSE,
    VS_PADDED,
    Model,
    Models,
    Problem,
    Shape,
    dense_length,
    draw_lengths,
    encoder_flops,
    errors,
    fastpath,
    make_compare,
    output_names,
    reference_outputs,
    seeded_randn,
    training_mode,
)

# --------------------------------------------------------------------------------------
# Implementations


class TrainStep:
    """The callable of a checked training row.

    The harness calls an implementation once to check its output, then times it: the
    first call is the check (eval mode, so no dropout: ``(out, *parameter gradients)``,
    comparable with the reference), every later call one training step (train mode,
    dropout on), returning the gradients.
    """

    def __init__(
        self,
        module: nn.Module,
        step: Callable[[], tuple[torch.Tensor, ...]],
        check: Callable[[], tuple[torch.Tensor, ...]],
    ):
        self.module, self.step, self.check = module, step, check
        self.checked = False

    def __call__(self) -> tuple[torch.Tensor, ...]:
        if self.checked:
            return self.step()
        self.checked = True
        with training_mode(self.module, False), fastpath(False):
            return self.check()


def inference_impls(m: Models, p: Problem) -> list[Impl]:
    x, mask = p.padded, p.mask

    @torch.no_grad()
    def padded():
        # torch.nn's plain ops (what it runs in training). torch/nn/modules/transformer.py
        # takes its fast paths (fused layer, nested tensor) only in eval mode, with the
        # torch.backends.mha fast-path flag on, without autocast or hooks, and unless grad
        # is enabled while the input or a weight requires grad. Here: eval mode and
        # no_grad, with that flag off for the call (a host flag). Enabling grad instead
        # would also turn them off, but would record the autograd graph as well.
        with fastpath(False):
            return m.padded(x, src_key_padding_mask=mask)

    @torch.no_grad()
    def padded_fast():  # each layer's fused torch._transformer_encoder_layer_fwd on the padded tensor
        return m.padded(x, src_key_padding_mask=mask)

    @torch.no_grad()
    def nested():  # the mask turned into a nested tensor (mask_check reads the device), padded back at the end
        return m.nested(x, src_key_padding_mask=mask)

    @torch.no_grad()
    def dense():  # no mask: no nested tensor, each layer's fused fast path
        return m.padded(p.dense)

    @torch.no_grad()
    def ragged_rt():
        return m.ragged(p.rt)

    @torch.no_grad()
    def ragged_padded():  # packs from the mask (one read of its lengths), unpacks at the end
        return m.ragged(x, src_key_padding_mask=mask)

    impls = [
        Impl(PADDED, "baseline", padded),
        Impl(PADDED_FAST, "baseline", padded_fast),
        Impl(NESTED, "baseline", nested),
        # Another input (the same token count, no padding): not comparable, so not checked.
        Impl(DENSE, "ceiling", dense, check=False),
        Impl(RAGGED, "ragged", ragged_rt),
        Impl(RAGGED_PADDED, "ragged", ragged_padded),
    ]
    if p.rt.values.is_cuda:
        # CUDA graphs per bucket: the batch's bucket is captured by the untimed check call
        graphed = rnn.graphed(m.ragged, max_tokens=1 << p.rt.num_tokens.bit_length(), max_batch_size=p.rt.batch_size)
        impls.append(Impl(RAGGED_GRAPHED, "ragged", lambda: graphed(p.rt)))
    return impls


def padded_check(m: Models, p: Problem, backward: bool) -> Callable[[], Any]:
    """torch.nn's padded plain-ops row as the gate sees it (what ``torch_error`` measures)."""
    if not backward:

        def forward():
            with torch.no_grad(), fastpath(False):
                return m.padded(p.padded, src_key_padding_mask=p.mask)

        return forward

    def forward_backward():
        with fastpath(False):  # already off: grad is on and the parameters require it
            out = m.padded(p.padded, src_key_padding_mask=p.mask)
        return (out, *torch.autograd.grad(out, m.params, p.grad_padded))

    return forward_backward


def training_impls(m: Models, p: Problem) -> list[Impl]:
    x, mask = p.padded, p.mask

    def padded():
        out = m.padded(x, src_key_padding_mask=mask)
        return torch.autograd.grad(out, m.params, p.grad_padded)

    def dense():
        out = m.padded(p.dense)
        return torch.autograd.grad(out, m.params, p.grad_dense)

    def ragged_rt():
        out = m.ragged(p.rt).values
        return torch.autograd.grad(out, m.params, p.grad)

    def ragged_check():
        out = m.ragged(p.rt).values
        return (out, *torch.autograd.grad(out, m.params, p.grad))

    return [
        Impl(PADDED, "baseline", TrainStep(m.padded, padded, padded_check(m, p, backward=True))),
        Impl(DENSE, "ceiling", dense, check=False),
        Impl(RAGGED, "ragged", TrainStep(m.ragged, ragged_rt, ragged_check)),
    ]


def ceiling_size(device: torch.device) -> int:
    """``n`` of the ceiling row's ``[n, n] @ [n, n]``."""
    return CEILING_N.get(device.type, CEILING_N["cpu"])


def gemm_ceiling_name(n: int, dtype: torch.dtype) -> str:
    return f"GEMM ceiling (torch.mm {n}^3 {dtype_name(dtype)})"


def gemm_ceiling_impl(n: int, dtype: torch.dtype, device: torch.device) -> Impl:
    """A ``ceiling`` row: ``torch.mm`` of two ``[n, n]`` matrices into a preallocated output."""
    a = seeded_randn((n, n), dtype, device, SEED + 5)
    b = seeded_randn((n, n), dtype, device, SEED + 6)
    out = torch.empty(n, n, dtype=dtype, device=device)
    return Impl(gemm_ceiling_name(n, dtype), "ceiling", lambda: torch.mm(a, b, out=out), check=False)


def _spend_nested_prototype_warning() -> None:
    """torch warns once per process, from C++, when the first strided nested tensor is
    made; made here, silenced, it does not cut through the progress display later."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.nested.nested_tensor([torch.zeros(1)])


def build_workload(shape: Shape, group: str, device: torch.device, dropout: float = DROPOUT) -> Workload:
    backward = group == TRAINING
    p = Problem.make(shape, device)
    m = Models.make(shape.model, shape.dtype, device, dropout)
    m.train(False)
    reference = reference_outputs(m, p, backward)
    names = output_names(m, backward)
    torch_error = errors(names, padded_check(m, p, backward)(), reference, p.as_packed)
    if not backward:
        _spend_nested_prototype_warning()
    impls = training_impls(m, p) if backward else inference_impls(m, p)
    m.train(backward)
    impls.append(gemm_ceiling_impl(ceiling_size(device), shape.dtype, device))
    return Workload(
        impls,
        reference=reference,
        flops=encoder_flops(p.lengths, shape.model, backward),
        compare=make_compare(names, p, TOLERANCE.get(shape.dtype, 2e-2), torch_error),
        extra=lambda impl: row_diagnostics(impl, device),
    )


def row_diagnostics(impl: Impl, device: torch.device) -> dict[str, Any]:
    """Untimed columns after a row's timing: the SM clock and power (a throttled row), and, with
    ``BENCH_GPU_BUSY=1``, the GPU busy time of one call (a row whose median is well above it
    waited on the host: the long-tailed training rows moved by up to 50% between runs on one
    host, with the GPU work of each call unchanged). Opt-in: torch.profiler can leave its
    tracing attached to the process and add host time to every later launch (in the one H200
    run with it on, the host-bound rows of later cases ran up to 2x slower than in runs
    without it; that host's speed also varies between runs), so it stays out of timed tables."""
    out: dict[str, Any] = dict(gpu_clocks(device))
    if os.environ.get("BENCH_GPU_BUSY") == "1" and not impl.name.startswith("GEMM ceiling"):
        busy = gpu_busy_ms(impl.fn, device)
        if busy is not None:
            out[GPU_BUSY] = busy
    return out


# --------------------------------------------------------------------------------------
# The suite


@register
class EncoderSuite(Suite):
    name = "encoder"
    description = "Transformer encoder: torch.nn padded / fast path / nested vs ragged.nn, inference and training"
    memory_bound = False
    speedup_table = True
    rounds = 3
    notes = """\
`torch.nn.TransformerEncoder` of `TransformerEncoderLayer(d, h, ff, dropout,
activation="gelu", batch_first=True, norm_first=False)`: on a GPU BERT-base (`d=768, h=12,
ff=3072`, 12 layers) in bf16; on CPU a small model in fp32 (`d=128, h=4, ff=512`, 2
layers; with --quick a tiny one) on one long-tailed batch, run by ragged.nn's pure-torch
paths. `ragged.nn.TransformerEncoder.from_torch` of it shares its parameters. `B`
sequences of lengths `L_i`, `T = sum L_i`, padded to `M = max L_i` (right padding, `mask`
= `src_key_padding_mask`, True at padding). TFLOP/s count useful flops only: per layer
`2*T*(4*d^2 + 2*d*ff) + 4*sum(L_i^2)*d`, times the layers; training 3x that. `% of GEMM
ceiling`: TFLOP/s over those of the ceiling row, one `torch.mm` of two `[n, n]` matrices
in the case's dtype (`n` = 8192 on a GPU, 256 on CPU), timed in the same case. `speedup vs
padded` / `speedup vs dense`: the `padded` / `dense equal tokens` row's ms over this
row's. `SM MHz` / `W` (GPU runs with `nvidia-smi`): the SM clock and power draw read right
after the row's timing, to tell a throttled row. Timing (GPU, without --quick): each row
is first warmed up until two short timings agree within 3% (a few seconds at most), then
each case's rows are timed three times round-robin (every row, then every row again,
twice), each round a `do_bench` median; a row reports the median of its three, and `rounds
spread %` = (max - min) / median. The host of the GPU machine changes speed from minute to
minute, and the rows that wait on it (ragged and dense equal tokens in training, the
short-batch rows) move with it: round-robin rounds spread such a drift over every row of
the case.
`GPU busy ms` (only with `BENCH_GPU_BUSY=1`: the profiler slows every later launch of the
process, so a table with it is for diagnosis, not for timings): the GPU time of one call
with the host taken out (the union of the kernel intervals `torch.profiler` records over
three calls, divided by three); a median well above it means the GPU waited for the host.

Inference rows (eval mode, `torch.no_grad()`):

- `padded`: `enc(x, src_key_padding_mask=mask)` on `x [B, M, d]` with torch.nn's fast
  paths off (`torch.backends.mha.set_fastpath_enabled(False)` around the call): the plain
  ops torch.nn runs in training (masked SDPA inside `MultiheadAttention`).
- `padded fast path`: the same with `enable_nested_tensor=False`: each layer's fused
  `torch._transformer_encoder_layer_fwd` on the padded tensor.
- `torch nested`: `enable_nested_tensor=True`: torch.nn checks that the mask is left
  aligned (a read of the device), converts `x` and the mask to a nested tensor, runs the
  fused layers on it and pads the output back (zeros at padding).
- `dense equal tokens` (the ideal): the fast path on `[B, round(T/B), d]` without mask,
  the same token count and no padding; another input, so not checked (its TFLOP/s still
  divide the ragged batch's useful flops).
- `ragged`: `ragged_enc(rt)` on the RaggedTensor `rt = ragged.pack(sequences)` (packed
  once, outside the timed region); returns a RaggedTensor, reads nothing from the device.
- `ragged (padded in/out)`: `ragged_enc(x, src_key_padding_mask=mask)`: reads the mask's
  lengths (one device-to-host read), packs, runs, unpacks with zeros at padding.
- `ragged graphed` (CUDA): `ragged.nn.graphed(ragged_enc, max_tokens=2^ceil(log2(T+1)),
  max_batch_size=B)(rt)`: the inference forward replayed from the CUDA graph of the batch's
  bucket (captured by the untimed check call), the output copied out of the graph's buffer.

Training rows (train mode, dropout 0.1 as BERT): the forward, then
`torch.autograd.grad(out, params, g)` for every parameter with one fixed random `g` (zero
at the padding of the padded output); no `.grad` is accumulated, nothing is zeroed.
`padded`: torch.nn (train mode: plain ops) on `x` with `mask`; `dense equal tokens`: on
`[B, round(T/B), d]` without mask; `ragged`: `ragged_enc(rt).values`.

Correctness: before timing, each checked row's output at the real tokens (training rows:
and every parameter gradient, computed in eval mode, so without dropout: the harness's
first, untimed call of a training row is this check) is compared with a float32 copy of
the torch.nn model (eval, plain ops, a few sequences at a time). Max abs error <=
max(tol x max(1, max |ref|), 3 x the error of torch.nn's `padded` row in the same dtype),
tol = 2e-2 for bf16, 1e-4 for fp32.
"""

    dropout: float = DROPOUT
    """Dropout rate of the models (used by the training rows; eval mode turns it off)."""

    def shapes(self, config: Config) -> list[Shape]:
        """GPU: the three workloads (the long-tailed one with --quick); --dtype swaps their
        dtype. CPU: the long-tailed CPU case (the tiny one with --quick), in each requested
        floating dtype."""
        return workload_shapes(config, GPU_SHAPES, CPU_SHAPES, QUICK_SHAPE, CPU_QUICK_SHAPES)

    def describe(self, params) -> str:
        """``BERT-base encoder: ...`` when every case ran BERT-base, else the models the cases
        ran (``Transformer encoder (d=128 h=4 ff=512 x2, fp32): ...``); ``description``
        when the params name no model."""
        models = list(
            dict.fromkeys(
                (Model(p["d_model"], p["nhead"], p["dim_feedforward"], p["layers"]), p.get("dtype", ""))
                for p in params
                if "d_model" in p
            )
        )
        what = self.description.split(": ", 1)[1]
        if not models:
            return self.description
        if all(m == BERT_BASE for m, _ in models):
            return f"BERT-base encoder: {what}"
        return "Transformer encoder (" + "; ".join(f"{m.name()}, {dtype}" for m, dtype in models) + "): " + what

    def cases(self, config: Config) -> list[Case]:
        cases = []
        gemm_n = ceiling_size(config.device)
        for group in GROUPS:
            for shape in self.shapes(config):
                if group not in shape.groups:
                    continue
                lengths = draw_lengths(shape)
                total, width, model = sum(lengths), max(lengths), shape.model
                params = {
                    "workload": shape.label,
                    "pass": "fwd+bwd" if group == TRAINING else "fwd",
                    "dtype": dtype_name(shape.dtype),
                    "B": shape.batch,
                    "d_model": model.d_model,
                    "nhead": model.nhead,
                    "dim_feedforward": model.dim_feedforward,
                    "layers": model.layers,
                    "dropout": self.dropout if group == TRAINING else 0.0,
                    "lengths": shape.dist,
                    "min_len": shape.min_len,
                    "max_len": shape.max_len,
                    "mean_len": round(total / shape.batch, 2),
                    "T": total,
                    "M": width,
                    "real_fraction": round(total / (shape.batch * width), 4),
                    "dense_len": dense_length(lengths),
                    "gemm_n": gemm_n,
                    "note": shape.note,
                }
                name = f"{group} {shape.name()} mean={total / shape.batch:.0f} {model.name()}"
                cases.append(Case(name, params, group=group, spec=(shape, group)))
        return cases

    def build(self, case: Case, config: Config) -> Workload:
        shape, group = case.spec
        return build_workload(shape, group, config.device, self.dropout)

    def annotate(self, case: Case, rows: list[Row]) -> None:
        """The ceiling row's own TFLOP/s; every other row's speedups and % of it."""
        ok = {r.impl: r for r in rows if r.status == "ok"}
        ceiling = next((r for r in ok.values() if r.impl.startswith("GEMM ceiling")), None)
        if ceiling is not None:
            ceiling.flops = 2 * case.params["gemm_n"] ** 3
            ceiling.tflops = ceiling.flops / (ceiling.median_ms * 1e-3) / 1e12
        padded, dense = ok.get(PADDED), ok.get(DENSE)
        for r in ok.values():
            if r is ceiling:
                continue
            if padded is not None:
                r.extra[VS_PADDED] = padded.median_ms / r.median_ms
            if dense is not None:
                r.extra[VS_DENSE] = dense.median_ms / r.median_ms
            if ceiling is not None and r.tflops is not None:
                r.extra[PCT_GEMM] = 100.0 * r.tflops / ceiling.tflops
