"""pool: each sequence of ``values [T, F]`` to one row of ``[B, F]`` (``ragged.pool``).

Sentence embeddings take the mean over each sequence's tokens, classifiers the first or
last token, some models the max. A pooling reads ``T*F*es`` bytes and writes ``B*F*es``
(``es``: element size), so it is memory bound; ``% copy`` is over the copy of those bytes.

Baselines run on what a padded model has: the padded ``[B, M, F]`` batch and its mask
(masked mean / max over the padded rows, which read the padding too), and on the packed
values: ``torch.segment_reduce`` (the packed op torch offers) and ``index_add_`` of each
token into its sequence's row. Outputs are compared with a float64 per-sequence reference
(:func:`ragged.ops.pool.reference_pool` in float64).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

import ragged
from ragged.ops.pool import reference_pool

from ..harness import (
    Case,
    Config,
    Impl,
    Suite,
    Workload,
    copy_impl,
    dtype_name,
    interpreter_skip,
    max_error_compare,
    register,
    workload_shapes,
)

RAGGED_BACKENDS = ("triton", "torch")
MODES = ("mean", "max")
SEED = 3


@dataclasses.dataclass(frozen=True)
class Shape:
    """``batch`` sequences of ``features`` elements per token, lengths in ``[min_len, max_len]``
    (``lognormal``: long-tailed, median about a quarter of the longest)."""

    dtype: torch.dtype
    batch: int
    min_len: int
    max_len: int
    features: int
    lengths: str = "uniform"
    note: str = ""

    def name(self) -> str:
        return (
            f"{dtype_name(self.dtype)} B={self.batch} L~{self.lengths}({self.min_len}..{self.max_len}) "
            f"F={self.features}"
        )


GPU_SHAPES = (
    Shape(torch.bfloat16, 256, 1, 512, 768, "lognormal", "sentence embeddings: long-tailed lengths"),
    Shape(torch.float16, 1000, 8, 32, 768, "uniform", "many short sequences"),
    Shape(torch.float32, 64, 1, 2048, 768, "uniform", "long sequences"),
)
CPU_SHAPES = (Shape(torch.float32, 64, 1, 256, 256, "lognormal", "CPU: past the per-call overhead"),)
CPU_QUICK_SHAPES = (Shape(torch.float32, 8, 1, 16, 32, "uniform", "tiny (smoke case: per-call overhead only)"),)


def draw_lengths(shape: Shape, seed: int = SEED) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    if shape.lengths == "lognormal":
        raw = torch.empty(shape.batch).log_normal_(0.0, 1.0, generator=gen) * (shape.max_len / 4)
        lengths = raw.round().clamp(shape.min_len, shape.max_len).to(torch.int64).tolist()
    else:
        lengths = torch.randint(shape.min_len, shape.max_len + 1, (shape.batch,), generator=gen).tolist()
    lengths[0] = shape.max_len
    return lengths


def pool_workload(shape: Shape, mode: str, device: torch.device, triton_skip: str | None) -> Workload:
    lengths = draw_lengths(shape)
    gen = torch.Generator(device=device).manual_seed(SEED)
    values = torch.randn((sum(lengths), shape.features), generator=gen, device=device).to(shape.dtype)
    rt = ragged.RaggedTensor.from_lengths(values, lengths)
    padded = rt.to_padded()
    keep = ~rt.padding_mask()  # [B, M], True at tokens
    counts = torch.tensor(lengths, device=device).clamp_min(1).to(values.dtype)[:, None]
    seq = rt.seq_ids()
    offsets64 = rt.offsets.to(torch.int64)

    def masked():
        if mode == "mean":
            return (padded * keep[..., None]).sum(1) / counts
        return padded.masked_fill(~keep[..., None], float("-inf")).amax(1)

    def segment():
        return torch.segment_reduce(values, "mean" if mode == "mean" else "max", offsets=offsets64, axis=0)

    def index_add():
        out = torch.zeros((rt.batch_size, shape.features), dtype=torch.float32, device=device)
        return (out.index_add_(0, seq, values.float()) / counts.float()).to(values.dtype)

    reasons = ragged.explain("pool", values, rt.offsets, mode)
    impls = []
    for backend in RAGGED_BACKENDS:
        why = reasons.get(backend) or ([triton_skip] if backend == "triton" and triton_skip else [])
        impls.append(
            Impl(
                f"ragged {backend}",
                "ragged",
                fn=lambda b=backend: ragged.pool(rt, mode, backend=b),
                skip="; ".join(why) if why else None,
            )
        )
    impls += [Impl("padded masked", "baseline", masked), Impl("segment_reduce", "baseline", segment)]
    if mode == "mean":
        impls.append(Impl("index_add_", "baseline", index_add))
    es = values.element_size()
    nbytes = (values.numel() + rt.batch_size * shape.features) * es
    impls.append(copy_impl(nbytes, device))
    reference = reference_pool(values.double(), rt.offsets, mode)[0]
    tol = 1e-5 if shape.dtype == torch.float32 else 2e-2
    return Workload(
        impls,
        reference=(reference,),
        bytes_moved=nbytes,
        compare=max_error_compare(("out",), lambda t: t.double(), tol),
    )


@register
class PoolSuite(Suite):
    name = "pool"
    description = "values [T, F] -> one row per sequence [B, F] (ragged.pool: mean, max)"
    memory_bound = True
    notes = """\
Implementations: `ragged <backend>`: `ragged.pool(rt, mode, backend=...)`; `padded masked`:
the padded batch `[B, M, F]` (zeros at padding) times its mask, summed over `M` and divided
by the lengths (mean), or the max over `M` with `-inf` at padding (max); `segment_reduce`:
`torch.segment_reduce(values, mode, offsets=offsets)`; `index_add_`: every token added into
its sequence's float32 row, divided by the lengths (mean only). `copy (same bytes)`: a copy
of (bytes read + bytes written) / 2 bytes.
"""

    def cases(self, config: Config) -> list[Case]:
        cases = []
        shapes = workload_shapes(config, GPU_SHAPES, CPU_SHAPES, 0, CPU_QUICK_SHAPES)
        for mode, shape in itertools.product(MODES, shapes):
            lengths = draw_lengths(shape)
            params = {
                "mode": mode,
                "dtype": dtype_name(shape.dtype),
                "B": shape.batch,
                "F": shape.features,
                "lengths": shape.lengths,
                "min_len": shape.min_len,
                "max_len": shape.max_len,
                "T": sum(lengths),
                "note": shape.note,
            }
            cases.append(Case(f"{mode} {shape.name()}", params, group=mode, spec=(mode, shape)))
        return cases

    def build(self, case: Case, config: Config) -> Workload:
        mode, shape = case.spec
        return pool_workload(shape, mode, config.device, interpreter_skip(config))
