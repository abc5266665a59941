"""The vocab suite's workloads: shapes, the seeded draw of lengths and candidate lists, and the
:class:`Problem` every row of a case runs on (inputs built once, on the device)."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from ..harness import dtype_name

RAGGED_BACKENDS = ("triton", "torch")
SEED = 0

FWD, FWD_BWD, CE = "fwd", "fwd+bwd", "ce fwd+bwd"
GROUPS = (FWD, FWD_BWD, CE)

# Baseline names (the rows' ``impl``).
FULL_GATHER = "full h@W.T + gather"
FULL_ONLY = "full h@W.T only"
UNION = "union h@W[u].T"
LOOP = "loop index_select + matmul"
CE_FULL = "full + CE over all V"
CE_GATHER = "full + gather + CE"
CE_LOOP = "loop + CE"

# Max abs error allowed against the float32 reference, times max(1, max |reference|),
# per input dtype (fp32 leaves room for TF32 products in the kernels).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 5e-3, torch.float64: 1e-8}

# Extra columns (``Row.extra`` keys).
PEAK_MB = "peak MB"
PEAK_PCT = "% of full logits"
EXTRA_PCT = "% of full logits, grads excluded"  # backward groups: peak less the dh and dW every row returns


# --------------------------------------------------------------------------------------
# Workloads


@dataclasses.dataclass(frozen=True)
class Shape:
    """``batch`` sequences of ``min_len..max_len`` tokens (uniform), hidden size ``dim``,
    a vocabulary of ``vocab`` ids and ``min_cands..max_cands`` (uniform) candidates per
    sequence.

    ``groups``: the groups this workload runs in. ``torch_backend``: measure the ragged
    torch reference (kept to small cases). ``interpreted_triton``: the groups whose
    triton rows also run under ``TRITON_INTERPRET=1`` (CPU tensors; the interpreter takes
    seconds per call even on the small case). ``claim``: the ragged torch row should be at
    least this many times faster than the full projection (``full h@W.T only``) in the fwd
    group; its row says whether that holds (the loop baseline's row gives its ratio alone).
    """

    label: str
    dtype: torch.dtype
    batch: int  # B
    min_len: int
    max_len: int
    dim: int  # d
    vocab: int  # V
    min_cands: int
    max_cands: int
    bias: bool = False
    groups: tuple[str, ...] = GROUPS
    torch_backend: bool = True
    interpreted_triton: tuple[str, ...] = (FWD,)
    claim: float | None = None
    note: str = ""

    def name(self) -> str:
        cands = f"{self.min_cands}" if self.min_cands == self.max_cands else f"{self.min_cands}..{self.max_cands}"
        return (
            f"{dtype_name(self.dtype)} B={self.batch} T_i={self.min_len}..{self.max_len} d={self.dim} "
            f"V={self.vocab} cands={cands}" + (" +bias" if self.bias else "")
        )


GPU_SHAPES = (
    Shape(
        "target",
        torch.bfloat16,
        64,
        16,
        64,
        1024,
        32000,
        500,
        2000,
        torch_backend=False,
        note="translation batch with per-sentence shortlists",
    ),
)
# CPU: one shortlist workload in every group, candidates about 4% of the vocabulary, sized
# so that the full-vocabulary rows (the slow ones) take tens of ms: a few seconds in all.
CPU_SHAPES = (
    Shape(
        "shortlist",
        torch.float32,
        8,
        8,
        32,
        128,
        16000,
        250,
        1000,
        bias=True,
        interpreted_triton=(),
        claim=8.0,
        note="CPU: per-sentence shortlists, about 4% of the vocabulary",
    ),
)
# --quick on CPU (and the tests): a small case whose fwd triton row runs interpreted, and the
# claim case of the selected projection.
CPU_QUICK_SHAPES = (
    Shape("small", torch.float32, 8, 4, 16, 256, 5000, 50, 200, bias=True, note="small CPU case"),
    Shape(
        "claim",
        torch.float32,
        16,
        16,
        64,
        512,
        50000,
        2000,
        2000,
        groups=(FWD,),
        interpreted_triton=(),
        claim=8.0,
        note="selected projection >= 8x faster than the full one",
    ),
)


@functools.lru_cache(maxsize=16)
def draw(shape: Shape, seed: int = SEED) -> tuple[tuple[int, ...], tuple[torch.Tensor, ...]]:
    """Host lengths ``T_i`` and per-sequence candidates (sorted unique int64 ids, CPU), seeded:
    ``|V_i|`` uniform in ``[min_cands, max_cands]``, ids ``randperm(V)[:|V_i|].sort()``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shape.min_len, shape.max_len + 1, (shape.batch,), generator=gen).tolist()
    counts = torch.randint(shape.min_cands, shape.max_cands + 1, (shape.batch,), generator=gen).tolist()
    cands = tuple(torch.randperm(shape.vocab, generator=gen)[:n].sort().values for n in counts)
    return tuple(lengths), cands


def selected_logits(lengths: list[int] | tuple[int, ...], counts: list[int] | tuple[int, ...]) -> int:
    """``sum_i T_i * |V_i|``: the number of useful logits."""
    return sum(t * n for t, n in zip(lengths, counts, strict=True))


def vocab_flops(lengths, counts, dim: int, backward: bool) -> int:
    """Useful flops: ``2 * sum_i T_i*|V_i| * d``, 3x with the backward."""
    flops = 2 * selected_logits(lengths, counts) * dim
    return 3 * flops if backward else flops


def full_logits_bytes(total: int, vocab: int, dtype: torch.dtype) -> int:
    """Size of the full logits ``[T, V]`` in ``dtype``: what the memory columns compare with."""
    return total * vocab * torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------------------
# Inputs and reference


@dataclasses.dataclass
class Problem:
    """One workload on the device."""

    shape: Shape
    lengths: list[int]  # host T_i
    counts: list[int]  # host |V_i|
    starts: list[int]  # host token offsets, B+1
    hidden: torch.Tensor  # [T, d]
    weight: torch.Tensor  # [V, d]
    bias: torch.Tensor | None  # [V]
    candidates: list[torch.Tensor]  # per sequence: sorted unique int64 ids on the device
    vocab_values: torch.Tensor  # [sum |V_i|] int64: the candidates, concatenated
    target: torch.Tensor  # [T] int64: global ids, each among its sequence's candidates
    local_target: torch.Tensor  # [T] int64: position of the target among its candidates
    grad: torch.Tensor  # [sum T_i*|V_i|]: fixed gradient of the selected logits
    full_index: torch.Tensor  # [sum T_i*|V_i|] int64: t*V + id, into the flat full logits
    union: torch.Tensor  # [U] int64: sorted union of the candidates
    union_index: torch.Tensor  # [sum T_i*|V_i|] int64: t*U + position of id in the union

    @property
    def total(self) -> int:
        return self.starts[-1]

    @property
    def spans(self) -> list[tuple[int, int, torch.Tensor]]:
        """``(start, end, candidates)`` of each sequence."""
        return [(self.starts[i], self.starts[i + 1], c) for i, c in enumerate(self.candidates)]

    @classmethod
    def make(cls, shape: Shape, device: torch.device) -> Problem:
        lengths, cands = (list(x) for x in draw(shape))
        counts = [int(c.numel()) for c in cands]
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        T, V, d = starts[-1], shape.vocab, shape.dim
        gen = torch.Generator().manual_seed(SEED + 1)  # on the host: the same inputs on every device
        hidden = torch.randn(T, d, generator=gen)
        weight = torch.randn(V, d, generator=gen) / d**0.5  # logits about N(0, 1)
        bias = 0.1 * torch.randn(V, generator=gen) if shape.bias else None
        picks = [torch.randint(0, n, (t,), generator=gen) for t, n in zip(lengths, counts)]
        target = torch.cat([c[k] for c, k in zip(cands, picks)])
        grad = torch.randn(selected_logits(lengths, counts), generator=gen)

        full_index, union_index = [], []
        union = torch.unique(torch.cat(cands))
        for (s, e), c in zip(itertools.pairwise(starts), cands):
            rows = torch.arange(s, e)[:, None]
            full_index.append((rows * V + c[None, :]).reshape(-1))
            union_index.append((rows * union.numel() + torch.searchsorted(union, c)[None, :]).reshape(-1))

        def put(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
            return x.to(device=device, dtype=dtype or x.dtype)

        dev_cands = [put(c) for c in cands]
        return cls(
            shape,
            lengths,
            counts,
            starts,
            put(hidden, shape.dtype),
            put(weight, shape.dtype),
            None if bias is None else put(bias, shape.dtype),
            dev_cands,
            torch.cat(dev_cands),
            put(target),
            put(torch.cat(picks)),
            put(grad, shape.dtype),
            put(torch.cat(full_index)),
            put(union),
            put(torch.cat(union_index)),
        )

    # Inputs of the individual implementations (built outside the timed region).

    def union_grad(self) -> torch.Tensor:
        """``grad`` scattered into the ``[T, U]`` union logits (zero off the candidates)."""
        out = self.grad.new_zeros(self.total * self.union.numel())
        out[self.union_index] = self.grad
        return out.view(self.total, self.union.numel())

    def padded_candidates(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, max |V_i|]`` ids of each token's candidates (0 past the end) and the mask
        that is True there."""
        width = max(self.counts)
        rows = self.vocab_values.new_zeros(len(self.counts), width)
        for i, c in enumerate(self.candidates):
            rows[i, : c.numel()] = c
        lengths = torch.tensor(self.counts, device=rows.device)
        pad = torch.arange(width, device=rows.device)[None, :] >= lengths[:, None]
        seq = torch.repeat_interleave(
            torch.arange(len(self.counts), device=rows.device), torch.tensor(self.lengths, device=rows.device)
        )
        return rows[seq], pad[seq]

    def leaves(self, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and weight, as fresh leaves requiring grad when ``backward``."""
        if not backward:
            return self.hidden, self.weight
        return self.hidden.detach().requires_grad_(True), self.weight.detach().requires_grad_(True)
