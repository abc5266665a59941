"""pack / unpack: padded ``[B, M, F]`` <-> packed ``values [T, F]``.

* ``pack``: gather the ``T`` real rows of ``padded [B, M, F]`` into ``values [T, F]``;
  moves ``T*F*es`` bytes read + ``T*F*es`` written (``es``: element size).
* ``unpack``: scatter ``values [T, F]`` into a new zero-filled ``[B, M, F]``;
  moves ``T*F*es`` read + ``B*M*F*es`` written.

Both are pure data movement and every correct implementation is bit-exact, so each
output is compared with :func:`ragged.reference_pack` / :func:`ragged.reference_unpack`
by ``torch.equal``. Sequences are right-padded; the longest one is exactly ``M`` long
(``M`` is the batch's pad-to-longest width), the others are drawn uniformly in
``[min_len, M]`` with a fixed seed.

On CPU the cases are sized past the per-call overhead (17 MB padded; the tiny ones are
the --quick smoke cases), and each case's % copy is over its own ``copy (same
bytes)`` row: a CPU copy's rate depends on its size through the caches.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

import ragged

from ..harness import Case, Config, Impl, Suite, Workload, copy_impl, dtype_name, interpreter_skip, register

RAGGED_BACKENDS = ("cuda", "triton", "torch")
SEED = 0


@dataclasses.dataclass(frozen=True)
class Shape:
    """A batch of ``batch`` sequences of ``features`` elements per token, padded to ``width``."""

    dtype: torch.dtype
    batch: int  # B
    width: int  # M: padded length = longest sequence
    features: int  # F: elements per token
    min_len: int  # lengths are uniform in [min_len, width]
    note: str = ""

    def name(self) -> str:
        return f"{dtype_name(self.dtype)} B={self.batch} M={self.width} F={self.features}"


GPU_SHAPES = (
    Shape(torch.bfloat16, 256, 512, 1024, 1, "target: about half the tokens real"),
    Shape(torch.float32, 64, 2048, 768, 1, "long sequences"),
    Shape(torch.float16, 1000, 32, 768, 8, "many short sequences"),
    Shape(torch.bfloat16, 256, 512, 1000, 1, "odd F (rows 16-byte aligned)"),
    Shape(torch.bfloat16, 256, 512, 129, 1, "odd F (rows 2-byte aligned)"),
    Shape(torch.int64, 1024, 1024, 1, 1, "token ids"),
)
CPU_SHAPES = (
    # 17 MB padded, about 8 MB real: past the per-call overhead (a B=16 M=64 F=64 case
    # took 2-40 us per call, all of it overhead) and the L2 cache.
    Shape(torch.float32, 64, 256, 256, 1, "CPU: about half the tokens real, 17 MB padded"),
    Shape(torch.int64, 256, 512, 1, 1, "CPU: token ids"),
)
CPU_QUICK_SHAPES = (
    Shape(torch.float32, 16, 64, 64, 1, "tiny (smoke case: per-call overhead only)"),
    Shape(torch.int64, 16, 64, 1, 1, "tiny token ids (smoke case)"),
)
OPS = ("pack", "unpack")


def draw_lengths(shape: Shape, seed: int = SEED) -> list[int]:
    """``B`` host lengths uniform in ``[min_len, M]``; the longest is set to ``M``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shape.min_len, shape.width + 1, (shape.batch,), generator=gen).tolist()
    lengths[max(range(len(lengths)), key=lengths.__getitem__)] = shape.width
    return lengths


def pack_bytes(total: int, shape: Shape) -> int:
    """Bytes moved by pack: ``T*F*es`` read + ``T*F*es`` written."""
    es = torch.empty((), dtype=shape.dtype).element_size()
    return 2 * total * shape.features * es


def unpack_bytes(total: int, shape: Shape) -> int:
    """Bytes moved by unpack: ``T*F*es`` read + ``B*M*F*es`` written (padding included)."""
    es = torch.empty((), dtype=shape.dtype).element_size()
    return (total + shape.batch * shape.width) * shape.features * es


def random_tensor(size: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Normal floats, or integers in [0, 50000) (token-id-like), seeded."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(size, dtype=dtype, device=device, generator=gen)
    high = 2 if dtype == torch.bool else min(50_000, torch.iinfo(dtype).max)
    return torch.randint(0, high, size, dtype=dtype, device=device, generator=gen)


@dataclasses.dataclass
class Batch:
    """Metadata of a case on the device: lengths, offsets, padding mask, flat index."""

    lengths: list[int]  # host, B
    total: int  # T
    offsets: torch.Tensor  # [B+1] int32
    mask: torch.Tensor  # [B, M] bool, True at padding (torch key_padding_mask)
    flat_index: torch.Tensor  # [T] int64: row of each token in padded.view(B*M, F)

    @classmethod
    def make(cls, shape: Shape, device: torch.device) -> Batch:
        lengths = draw_lengths(shape)
        offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
        lens = torch.tensor(lengths, device=device)
        mask = torch.arange(shape.width, device=device)[None, :] >= lens[:, None]
        flat_index = torch.nonzero(~mask.reshape(-1)).squeeze(1)
        return cls(lengths, sum(lengths), offsets, mask, flat_index)


def _ragged_impls(op: str, call, *explain_args, triton_skip: str | None = None) -> list[Impl]:
    """``ragged <backend>`` rows, skipped with ``ragged.explain``'s reasons where they cannot
    run (and the triton row with ``triton_skip`` when given)."""
    reasons = ragged.explain(op, *explain_args)
    impls = []
    for backend in RAGGED_BACKENDS:
        why = reasons.get(backend, [f"no {backend!r} implementation is registered for {op}"])
        if backend == "triton" and triton_skip and not why:
            why = [triton_skip]
        impls.append(
            Impl(f"ragged {backend}", "ragged", fn=lambda b=backend: call(b), skip="; ".join(why) if why else None)
        )
    return impls


def pack_workload(shape: Shape, batch: Batch, device: torch.device, triton_skip: str | None = None) -> Workload:
    """pack: ragged backends, boolean gather, index_select, torch.nested narrow, copy."""
    B, M, F, T = shape.batch, shape.width, shape.features, batch.total
    padded = random_tensor((B, M, F), shape.dtype, device, SEED + 1)
    offsets, mask, idx = batch.offsets, batch.mask, batch.flat_index
    starts = torch.zeros(B, dtype=torch.int64, device=device)
    lens64 = (offsets[1:] - offsets[:-1]).to(torch.int64)

    def nested_narrow():
        nt = torch.nested.narrow(padded, 1, starts, lens64, layout=torch.jagged)
        return nt.contiguous().values()

    nbytes = pack_bytes(T, shape)
    impls = _ragged_impls(
        "pack", lambda b: ragged.pack_values(padded, offsets, T, backend=b), padded, offsets, triton_skip=triton_skip
    )
    impls += [
        Impl("x[~mask]", "baseline", lambda: padded[~mask]),
        Impl("index_select", "baseline", lambda: padded.view(B * M, F).index_select(0, idx)),
        Impl("nested.narrow", "baseline", nested_narrow),
        copy_impl(nbytes, device),
    ]
    return Workload(impls, reference=ragged.reference_pack(padded, offsets, T), bytes_moved=nbytes)


def unpack_workload(shape: Shape, batch: Batch, device: torch.device, triton_skip: str | None = None) -> Workload:
    """unpack: ragged backends, index_put, index_copy_, torch.nested to_padded_tensor, pad_sequence, copy."""
    B, M, F, T = shape.batch, shape.width, shape.features, batch.total
    values = random_tensor((T, F), shape.dtype, device, SEED + 2)
    offsets, mask, idx, lengths = batch.offsets, batch.mask, batch.flat_index, batch.lengths
    offsets64 = offsets.to(torch.int64)

    def index_put():
        out = values.new_zeros(B, M, F)
        out[~mask] = values
        return out

    def index_copy():
        out = values.new_zeros(B * M, F)
        out.index_copy_(0, idx, values)
        return out.view(B, M, F)

    def nested_to_padded():
        nt = torch.nested.nested_tensor_from_jagged(values, offsets64, max_seqlen=M)
        return nt.to_padded_tensor(0.0, output_size=(B, M, F))

    def pad_sequence():
        return torch.nn.utils.rnn.pad_sequence(values.split(lengths), batch_first=True)

    nbytes = unpack_bytes(T, shape)
    impls = _ragged_impls(
        "unpack",
        lambda b: ragged.unpack_values(values, offsets, M, backend=b),
        values,
        offsets,
        triton_skip=triton_skip,
    )
    impls += [
        Impl("out[~mask] = values", "baseline", index_put),
        Impl("index_copy_", "baseline", index_copy),
        Impl("nested.to_padded", "baseline", nested_to_padded),
        Impl("pad_sequence", "baseline", pad_sequence),
        copy_impl(nbytes, device),
    ]
    return Workload(impls, reference=ragged.reference_unpack(values, offsets, M), bytes_moved=nbytes)


@register
class PackSuite(Suite):
    name = "pack"
    description = "padded [B, M, F] <-> packed values [T, F] (pack_values / unpack_values)"
    memory_bound = True
    notes = """\
Implementations (`mask`: `[B, M]` bool, True at padding; `idx`: the `[T]` flat row
index of the real tokens, precomputed outside the timed region):

- pack: `ragged <backend>`: `ragged.pack_values(x, offsets, T, backend=...)`;
  `x[~mask]`: boolean gather; `index_select`: `x.view(B*M, F).index_select(0, idx)`;
  `nested.narrow`: `torch.nested.narrow(x, 1, 0, lengths, layout=torch.jagged).contiguous().values()`.
- unpack: `ragged <backend>`: `ragged.unpack_values(values, offsets, M, backend=...)`;
  `out[~mask] = values`: index_put into `new_zeros(B, M, F)`; `index_copy_`: into
  `new_zeros(B*M, F)` at `idx`; `nested.to_padded`:
  `nested_tensor_from_jagged(values, offsets, max_seqlen=M).to_padded_tensor(0.0, output_size=(B, M, F))`;
  `pad_sequence`: `pad_sequence(values.split(lengths), batch_first=True)`.
- `copy (same bytes)`: `dst.copy_(src)` of (bytes read + bytes written) / 2 bytes: the
  time of an ideal kernel moving the case's bytes at copy speed. On CPU it is also what
  `% copy` divides by (a CPU copy's rate depends on its size), timed before and after the
  case's other rows for the faster median; on a GPU `% copy` is over the device's copy
  ceiling, one 1 GiB copy.
"""

    def shapes(self, config: Config) -> list[Shape]:
        """GPU: the fixed list (only the target case with --quick), filtered by --dtype.
        CPU: ``CPU_SHAPES`` (``CPU_QUICK_SHAPES``, tiny, with --quick); with --dtype, the
        first of them in each requested dtype."""
        if config.on_gpu:
            shapes = [s for s in GPU_SHAPES if config.wants(s.dtype)]
            return shapes[:1] if config.quick else shapes
        cpu = CPU_QUICK_SHAPES if config.quick else CPU_SHAPES
        if config.dtypes is None:
            return list(cpu)
        return [dataclasses.replace(cpu[0], dtype=d) for d in config.dtypes]

    def cases(self, config: Config) -> list[Case]:
        cases = []
        for op in OPS:
            for shape in self.shapes(config):
                total = sum(draw_lengths(shape))
                params = {
                    "op": op,
                    "dtype": dtype_name(shape.dtype),
                    "B": shape.batch,
                    "M": shape.width,
                    "F": shape.features,
                    "T": total,
                    "min_len": shape.min_len,
                    "real_fraction": round(total / (shape.batch * shape.width), 4),
                    "note": shape.note,
                }
                cases.append(Case(f"{op} {shape.name()}", params, group=op, spec=(op, shape)))
        return cases

    def build(self, case: Case, config: Config) -> Workload:
        op, shape = case.spec
        batch = Batch.make(shape, config.device)
        make = pack_workload if op == "pack" else unpack_workload
        return make(shape, batch, config.device, interpreter_skip(config))
