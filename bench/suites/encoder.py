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

import contextlib
import copy
import dataclasses
import itertools
import math
import os
import warnings
from typing import Any, Callable, Iterator

import torch
from torch import nn

import ragged
import ragged.nn as rnn

from ..env import gpu_clocks
from ..harness import (Case, Config, Impl, Row, Suite, Workload, dtype_name, gpu_busy_ms, register,
                       workload_shapes)
from . import attention

SEED = 0
DROPOUT = 0.1  # BERT's; the default of EncoderSuite.dropout

INFERENCE, TRAINING = "inference", "training"
GROUPS = (INFERENCE, TRAINING)

# Row names (the rows' ``impl``).
PADDED = "padded"
PADDED_FAST = "padded fast path"
NESTED = "torch nested"
DENSE = "dense equal tokens"
RAGGED = "ragged"
RAGGED_PADDED = "ragged (padded in/out)"
RAGGED_GRAPHED = "ragged graphed"

# Extra columns (``Row.extra`` keys).
VS_PADDED = "speedup vs padded"
VS_DENSE = "speedup vs dense"
PCT_GEMM = "% of GEMM ceiling"
GPU_BUSY = "GPU busy ms"

# Gate: a row's max abs error against the float32 reference may be SLACK times that of
# torch.nn's padded plain-ops row in the same dtype, and never less than
# TOLERANCE[dtype] * max(1, max |reference|). Measured on CPU, bf16 BERT-base, 16
# sequences of 8..32 tokens: the ragged / torch.nn error ratio was 0.6..1.65 over the
# output and the 196 parameter gradients (nested fast path 1.15 on the output), and the
# output error itself 0.018 x max |reference|: a fixed bf16 bound of 2e-2 would sit at
# the noise.
SLACK = 3.0
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4, torch.float64: 1e-9}

# Padded tokens (sequences x their chunk's longest) per call of the float32 reference.
REFERENCE_TOKENS = 8192


# --------------------------------------------------------------------------------------
# Workloads


@dataclasses.dataclass(frozen=True)
class Model:
    """``torch.nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout,
    activation="gelu", batch_first=True, norm_first=False)`` stacked ``layers`` times."""

    d_model: int
    nhead: int
    dim_feedforward: int
    layers: int

    def name(self) -> str:
        return f"d={self.d_model} h={self.nhead} ff={self.dim_feedforward} x{self.layers}"


BERT_BASE = Model(768, 12, 3072, 12)
SMALL = Model(128, 4, 512, 2)
TINY = Model(32, 2, 64, 2)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A batch of ``batch`` sequences through ``model``; lengths as in
    :class:`bench.suites.attention.Shape` (uniform or clipped lognormal, the longest set
    to ``max_len``) and drawn by the same function. ``groups``: the groups it runs in."""

    label: str
    dtype: torch.dtype
    model: Model
    batch: int  # B
    min_len: int
    max_len: int
    dist: str = "uniform"
    median: float = 0.0  # lognormal only
    sigma: float = 0.0  # lognormal only
    groups: tuple[str, ...] = GROUPS
    note: str = ""

    def lengths_text(self) -> str:
        if self.dist == "lognormal":
            return f"L~lognormal({self.min_len}..{self.max_len})"
        return f"L={self.min_len}..{self.max_len}"

    def name(self) -> str:
        return f"{dtype_name(self.dtype)} B={self.batch} {self.lengths_text()}"


_TAILED = attention.GPU_SHAPES[1]  # the attention suite's long-tailed lengths (expected mean about 137)
GPU_SHAPES = (
    Shape("short", torch.bfloat16, BERT_BASE, 256, 8, 32, groups=(INFERENCE,), note="many short sequences"),
    Shape("short, large batch", torch.bfloat16, BERT_BASE, 1000, 8, 32, note="many short sequences, large batch"),
    Shape("long-tailed", torch.bfloat16, BERT_BASE, 64, _TAILED.min_len, _TAILED.max_len, dist=_TAILED.dist,
          median=_TAILED.median, sigma=_TAILED.sigma,
          note="long-tailed lengths up to 512 (the attention suite's: lognormal, sigma=1, clipped)"),
)
QUICK_SHAPE = 2  # --quick on a GPU: the long-tailed workload only
# CPU: long-tailed lengths (the attention suite's distribution, scaled to a longest of 128)
# through a small model, where skipping the padding pays; about 5 s on one thread.
CPU_SHAPES = (Shape("long-tailed", torch.float32, SMALL, 16, 1, 128, dist="lognormal", median=40 * math.exp(-0.5),
                    sigma=1.0, note="CPU: long-tailed lengths (lognormal, sigma=1, clipped to 128), mean about 30"),)
CPU_QUICK_SHAPES = (Shape("tiny", torch.float32, TINY, 6, 3, 17, note="tiny CPU smoke case: per-call overhead only"),)
CEILING_N = {"cuda": 8192, "cpu": 256}  # square GEMM of the ceiling row, per device type


def draw_lengths(shape: Shape, seed: int = SEED) -> list[int]:
    """``B`` host lengths, seeded: :func:`bench.suites.attention.draw_lengths`."""
    spec = attention.Shape(shape.label, shape.dtype, shape.batch, 1, 1, shape.min_len, shape.max_len,
                           dist=shape.dist, median=shape.median, sigma=shape.sigma)
    return attention.draw_lengths(spec, seed)


def encoder_flops(lengths: list[int], model: Model, backward: bool) -> int:
    """Useful flops of one call, per layer ``2*T*(4*d^2 + 2*d*ff) + 4*sum(L^2)*d``, times the
    layers; x3 with the backward."""
    d, ff = model.d_model, model.dim_feedforward
    per_layer = 2 * sum(lengths) * (4 * d * d + 2 * d * ff) + 4 * sum(n * n for n in lengths) * d
    flops = model.layers * per_layer
    return 3 * flops if backward else flops


def dense_length(lengths: list[int]) -> int:
    """Length of every sequence of the dense batch: ``round(T / B)``, at least 1."""
    return max(1, round(sum(lengths) / len(lengths)))


# --------------------------------------------------------------------------------------
# Inputs and models


def _randn(size: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)  # on the host: the same inputs on every device
    return torch.randn(size, generator=gen).to(device=device, dtype=dtype)


@dataclasses.dataclass
class Problem:
    """One batch on the device, in every layout the rows take."""

    lengths: list[int]  # host, B
    starts: list[int]  # host token offsets, B+1
    width: int  # M
    values: torch.Tensor  # [T, d]: the token features, packed
    rt: ragged.RaggedTensor  # ragged.pack of the B sequences (values [T, d])
    padded: torch.Tensor  # [B, M, d], zeros at the padding
    mask: torch.Tensor  # [B, M] bool, True at padding (torch.nn's src_key_padding_mask)
    flat_index: torch.Tensor  # [T] int64: row of each real token in the [B*M] padded layout
    dense: torch.Tensor  # [B, dense_length, d]: same token count, no padding
    grad: torch.Tensor  # [T, d]: fixed gradient of the output (training)
    grad_padded: torch.Tensor  # [B, M, d]: grad, zero at the padding
    grad_dense: torch.Tensor  # [B, dense_length, d]

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @classmethod
    def make(cls, shape: Shape, device: torch.device) -> "Problem":
        lengths = draw_lengths(shape)
        B, M, d, T = len(lengths), max(lengths), shape.model.d_model, sum(lengths)
        n = dense_length(lengths)
        values = _randn((T, d), shape.dtype, device, SEED + 1)
        grad = _randn((T, d), shape.dtype, device, SEED + 2)
        lens = torch.tensor(lengths, device=device)
        valid = torch.arange(M, device=device)[None, :] < lens[:, None]
        flat_index = torch.nonzero(valid.reshape(-1)).squeeze(1)

        def padded(x: torch.Tensor) -> torch.Tensor:
            out = x.new_zeros(B * M, d)
            out.index_copy_(0, flat_index, x)
            return out.view(B, M, d)

        return cls(lengths, [0, *itertools.accumulate(lengths)], M, values,
                   ragged.pack(list(values.split(lengths))), padded(values), ~valid, flat_index,
                   _randn((B, n, d), shape.dtype, device, SEED + 3), grad, padded(grad),
                   _randn((B, n, d), shape.dtype, device, SEED + 4))

    def as_packed(self, x: Any) -> torch.Tensor:
        """An output in the packed ``[T, d]`` layout: a RaggedTensor's values, or the real
        rows of a padded ``[B, M, d]``."""
        if isinstance(x, ragged.RaggedTensor):
            return x.values
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"expected a tensor or a RaggedTensor, got {type(x).__name__}")
        if x.dim() == 3:
            if tuple(x.shape[:2]) != (self.batch, self.width):
                raise ValueError(f"padded output of shape {tuple(x.shape)}, expected "
                                 f"[{self.batch}, {self.width}, d]")
            return x.reshape(-1, x.shape[-1]).index_select(0, self.flat_index)
        return x


@dataclasses.dataclass
class Models:
    """The encoders of a case, all on one set of Parameter objects."""

    nested: nn.TransformerEncoder  # enable_nested_tensor=True
    padded: nn.TransformerEncoder  # enable_nested_tensor=False, the same layers
    ragged: rnn.TransformerEncoder  # from_torch(nested): shares the parameters
    names: list[str]  # parameter names, in the order of ``params``
    params: list[nn.Parameter]

    def train(self, mode: bool) -> None:
        self.nested.train(mode)
        self.padded.train(mode)
        self.ragged.train(mode)

    @classmethod
    def make(cls, model: Model, dtype: torch.dtype, device: torch.device, dropout: float) -> "Models":
        layer = nn.TransformerEncoderLayer(model.d_model, model.nhead, model.dim_feedforward, dropout,
                                           activation="gelu", batch_first=True, norm_first=False, device=device,
                                           dtype=dtype)
        nested = nn.TransformerEncoder(layer, model.layers, enable_nested_tensor=True)
        padded = nn.TransformerEncoder(layer, model.layers, enable_nested_tensor=False)
        padded.layers = nested.layers
        # The layers are deep copies of one: give each its own weights, drawn on the host.
        # Unit-scale init (std fan_in^-1/2, LayerNorm scales 1 +- 0.1, biases ~0.1) keeps
        # every sublayer's contribution O(1), so that the gate sees each of them.
        gen = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            for name, p in nested.named_parameters():
                draw = torch.randn(p.shape, generator=gen)
                if name.endswith("bias"):
                    draw = 0.1 * draw
                elif ".norm" in name:
                    draw = 1.0 + 0.1 * draw
                else:
                    draw = draw * p.shape[1] ** -0.5
                p.copy_(draw)
        names, params = zip(*nested.named_parameters())
        return cls(nested, padded, rnn.TransformerEncoder.from_torch(nested), list(names), list(params))


@contextlib.contextmanager
def fastpath(enabled: bool) -> Iterator[None]:
    """``torch.backends.mha.set_fastpath_enabled(enabled)`` for the block (a host flag)."""
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


@contextlib.contextmanager
def training_mode(module: nn.Module, mode: bool) -> Iterator[None]:
    previous = module.training
    module.train(mode)
    try:
        yield
    finally:
        module.train(previous)


def reference_outputs(models: Models, p: Problem, backward: bool) -> tuple[torch.Tensor, ...]:
    """Float32 (float64 for float64 inputs) ``(out,)`` or ``(out, *parameter gradients)``
    at the real tokens: a copy of the torch.nn model in eval mode (no dropout), plain ops,
    on chunks of at most ``REFERENCE_TOKENS`` padded tokens (gradients summed over them)."""
    dtype = torch.float64 if p.values.dtype == torch.float64 else torch.float32
    model = copy.deepcopy(models.padded).to(dtype).eval()
    params = list(model.parameters())
    outs: list[torch.Tensor] = []
    grads: list[torch.Tensor] | None = None
    lo = 0
    while lo < p.batch:
        hi, width = lo + 1, p.lengths[lo]
        while hi < p.batch and (hi + 1 - lo) * max(width, p.lengths[hi]) <= REFERENCE_TOKENS:
            width = max(width, p.lengths[hi])
            hi += 1
        lengths, s, e = p.lengths[lo:hi], p.starts[lo], p.starts[hi]
        x = nn.utils.rnn.pad_sequence(p.values[s:e].to(dtype).split(lengths), batch_first=True)
        valid = torch.arange(width, device=x.device)[None, :] < torch.tensor(lengths, device=x.device)[:, None]
        with torch.set_grad_enabled(backward), fastpath(False):
            out = model(x, src_key_padding_mask=~valid)[valid]  # [e - s, d]
            outs.append(out.detach())
            if backward:
                chunk = torch.autograd.grad(out, params, p.grad[s:e].to(dtype))
                grads = list(chunk) if grads is None else [a + b for a, b in zip(grads, chunk)]
        del x, out
        lo = hi
    return (torch.cat(outs), *(grads or ()))


def output_names(models: Models, backward: bool) -> tuple[str, ...]:
    return ("out", *(f"d {n}" for n in models.names)) if backward else ("out",)


def errors(names: tuple[str, ...], outs: Any, ref: tuple[torch.Tensor, ...],
           flatten: Callable[[Any], torch.Tensor]) -> dict[str, float]:
    """Max abs error of each output (the first one through ``flatten``) against ``ref``."""
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    if len(outs) != len(ref):
        raise ValueError(f"expected {len(ref)} outputs, got {len(outs)}")
    result = {}
    for i, (name, o, r) in enumerate(zip(names, outs, ref)):
        o = flatten(o) if i == 0 else o
        if tuple(o.shape) != tuple(r.shape):
            raise ValueError(f"{name}: shape {tuple(o.shape)} != reference {tuple(r.shape)}")
        result[name] = float((o.detach().to(r.dtype) - r).abs().max()) if r.numel() else 0.0
    return result


def make_compare(names: tuple[str, ...], p: Problem, tol: float,
                 torch_error: dict[str, float]) -> Callable[[Any, Any], str | None]:
    """A ``Workload.compare``: the max abs error of each output (at the real tokens) must be
    <= ``max(tol * max(1, max |ref|), SLACK * torch_error[name])``, where ``torch_error`` is
    that of torch.nn's padded plain-ops row in the same dtype. NaN always fails."""

    @torch.no_grad()
    def compare(out: Any, ref: tuple[torch.Tensor, ...]) -> str | None:
        try:
            errs = errors(names, out, ref, p.as_packed)
        except (TypeError, ValueError) as exc:
            return str(exc)
        problems = []
        for name, r in zip(names, ref):
            floor = tol * max(1.0, float(r.abs().max())) if r.numel() else tol
            bound = max(floor, SLACK * torch_error.get(name, 0.0))
            if not errs[name] <= bound:  # also catches NaN
                problems.append(f"{name} max abs error {errs[name]:.3g} > {bound:.3g}")
        if len(problems) > 3:
            problems = problems[:3] + [f"and {len(problems) - 3} more"]
        return "; ".join(problems) or None

    return compare


# --------------------------------------------------------------------------------------
# Implementations


class TrainStep:
    """The callable of a checked training row.

    The harness calls an implementation once to check its output, then times it: the
    first call is the check (eval mode, so no dropout: ``(out, *parameter gradients)``,
    comparable with the reference), every later call one training step (train mode,
    dropout on), returning the gradients.
    """

    def __init__(self, module: nn.Module, step: Callable[[], tuple[torch.Tensor, ...]],
                 check: Callable[[], tuple[torch.Tensor, ...]]):
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
        graphed = rnn.graphed(m.ragged, max_tokens=1 << p.rt.num_tokens.bit_length(),
                                    max_batch_size=p.rt.batch_size)
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
    a = _randn((n, n), dtype, device, SEED + 5)
    b = _randn((n, n), dtype, device, SEED + 6)
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
    return Workload(impls, reference=reference, flops=encoder_flops(p.lengths, shape.model, backward),
                    compare=make_compare(names, p, TOLERANCE.get(shape.dtype, 2e-2), torch_error),
                    extra=lambda impl: row_diagnostics(impl, device))


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
        models = list(dict.fromkeys(
            (Model(p["d_model"], p["nhead"], p["dim_feedforward"], p["layers"]), p.get("dtype", "")) for p in params
            if "d_model" in p))
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
                    "workload": shape.label, "pass": "fwd+bwd" if group == TRAINING else "fwd",
                    "dtype": dtype_name(shape.dtype), "B": shape.batch, "d_model": model.d_model,
                    "nhead": model.nhead, "dim_feedforward": model.dim_feedforward, "layers": model.layers,
                    "dropout": self.dropout if group == TRAINING else 0.0, "lengths": shape.dist,
                    "min_len": shape.min_len, "max_len": shape.max_len, "mean_len": round(total / shape.batch, 2),
                    "T": total, "M": width, "real_fraction": round(total / (shape.batch * width), 4),
                    "dense_len": dense_length(lengths), "gemm_n": gemm_n, "note": shape.note,
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
