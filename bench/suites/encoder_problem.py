"""The encoder suite's workloads: model sizes and shapes, the seeded lengths, the
:class:`Problem` (inputs built once) and :class:`Models` (every path's module, same weights),
the float64 reference outputs and the comparison of a row's outputs with them."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import ragged
import ragged.nn as rnn

from ..harness import dtype_name
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
        return attention.lengths_text(self.dist, self.min_len, self.max_len)

    def name(self) -> str:
        return f"{dtype_name(self.dtype)} B={self.batch} {self.lengths_text()}"


_TAILED = attention.GPU_SHAPES[1]  # the attention suite's long-tailed lengths (expected mean about 137)
GPU_SHAPES = (
    Shape("short", torch.bfloat16, BERT_BASE, 256, 8, 32, groups=(INFERENCE,), note="many short sequences"),
    Shape("short, large batch", torch.bfloat16, BERT_BASE, 1000, 8, 32, note="many short sequences, large batch"),
    Shape(
        "long-tailed",
        torch.bfloat16,
        BERT_BASE,
        64,
        _TAILED.min_len,
        _TAILED.max_len,
        dist=_TAILED.dist,
        median=_TAILED.median,
        sigma=_TAILED.sigma,
        note="long-tailed lengths up to 512 (the attention suite's: lognormal, sigma=1, clipped)",
    ),
)
QUICK_SHAPE = 2  # --quick on a GPU: the long-tailed workload only
# CPU: long-tailed lengths (the attention suite's distribution, scaled to a longest of 128)
# through a small model, where skipping the padding pays; about 5 s on one thread.
CPU_SHAPES = (
    Shape(
        "long-tailed",
        torch.float32,
        SMALL,
        16,
        1,
        128,
        dist="lognormal",
        median=40 * math.exp(-0.5),
        sigma=1.0,
        note="CPU: long-tailed lengths (lognormal, sigma=1, clipped to 128), mean about 30",
    ),
)
CPU_QUICK_SHAPES = (Shape("tiny", torch.float32, TINY, 6, 3, 17, note="tiny CPU smoke case: per-call overhead only"),)
CEILING_N = {"cuda": 8192, "cpu": 256}  # square GEMM of the ceiling row, per device type


def draw_lengths(shape: Shape, seed: int = SEED) -> list[int]:
    """``B`` host lengths, seeded: :func:`bench.suites.attention.draw_lengths`."""
    spec = attention.Shape(
        shape.label,
        shape.dtype,
        shape.batch,
        1,
        1,
        shape.min_len,
        shape.max_len,
        dist=shape.dist,
        median=shape.median,
        sigma=shape.sigma,
    )
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


def seeded_randn(size: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
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
    def make(cls, shape: Shape, device: torch.device) -> Problem:
        lengths = draw_lengths(shape)
        B, M, d, T = len(lengths), max(lengths), shape.model.d_model, sum(lengths)
        n = dense_length(lengths)
        values = seeded_randn((T, d), shape.dtype, device, SEED + 1)
        grad = seeded_randn((T, d), shape.dtype, device, SEED + 2)
        lens = torch.tensor(lengths, device=device)
        valid = torch.arange(M, device=device)[None, :] < lens[:, None]
        flat_index = torch.nonzero(valid.reshape(-1)).squeeze(1)

        def padded(x: torch.Tensor) -> torch.Tensor:
            out = x.new_zeros(B * M, d)
            out.index_copy_(0, flat_index, x)
            return out.view(B, M, d)

        return cls(
            lengths,
            [0, *itertools.accumulate(lengths)],
            M,
            values,
            ragged.pack(list(values.split(lengths))),
            padded(values),
            ~valid,
            flat_index,
            seeded_randn((B, n, d), shape.dtype, device, SEED + 3),
            grad,
            padded(grad),
            seeded_randn((B, n, d), shape.dtype, device, SEED + 4),
        )

    def as_packed(self, x: Any) -> torch.Tensor:
        """An output in the packed ``[T, d]`` layout: a RaggedTensor's values, or the real
        rows of a padded ``[B, M, d]``."""
        if isinstance(x, ragged.RaggedTensor):
            return x.values
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"expected a tensor or a RaggedTensor, got {type(x).__name__}")
        if x.dim() == 3:
            if tuple(x.shape[:2]) != (self.batch, self.width):
                raise ValueError(f"padded output of shape {tuple(x.shape)}, expected [{self.batch}, {self.width}, d]")
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
    def make(cls, model: Model, dtype: torch.dtype, device: torch.device, dropout: float) -> Models:
        layer = nn.TransformerEncoderLayer(
            model.d_model,
            model.nhead,
            model.dim_feedforward,
            dropout,
            activation="gelu",
            batch_first=True,
            norm_first=False,
            device=device,
            dtype=dtype,
        )
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


def errors(
    names: tuple[str, ...], outs: Any, ref: tuple[torch.Tensor, ...], flatten: Callable[[Any], torch.Tensor]
) -> dict[str, float]:
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


def make_compare(
    names: tuple[str, ...], p: Problem, tol: float, torch_error: dict[str, float]
) -> Callable[[Any, Any], str | None]:
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
