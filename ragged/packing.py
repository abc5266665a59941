"""pack / unpack: padded ``[B, M, *F]`` <-> packed ``values [T, *F]``.

Two ops carry the work (``ragged::pack``, ``ragged::unpack``, defined through
:mod:`ragged.opdef` over the records of :mod:`ragged.records.pack`): the gradient of pack is
unpack with zeros at padding, and the gradient of unpack is pack. Each has three
implementations, picked by :mod:`ragged.backends`, each a function of the op's record:

* ``"torch"``: :func:`reference_pack` / :func:`reference_unpack`, plain indexing;
  the CPU path and the oracle of the tests (declared here);
* ``"triton"``: :mod:`ragged.kernels.triton.pack` (declared in :mod:`ragged.kernels.triton`);
* ``"cuda"``: ``csrc/pack.cu`` through :mod:`ragged.kernels.cuda.pack`.

This module works on plain tensors (:func:`pack_values`, :func:`unpack_values`); the
RaggedTensor forms (:func:`ragged.pack`, :func:`ragged.unpack`) live in :mod:`ragged.interop`.

All three move the same bytes and are bit-exact against each other.

Padding side: with ``padding_side="right"`` sequence ``b`` occupies positions
``[0, L_b)`` of its padded row; with ``"left"`` it occupies ``[M - L_b, M)``.

Padding value: every backend writes :func:`ragged.utils.fill_element` of it, torch's own cast of the
number to the dtype (``torch.full((), padding_value, dtype=dtype)``): for bool any
nonzero number (NaN included) is True, integer dtypes truncate floats toward zero, and a
number the dtype cannot hold (``-1.0`` or ``nan`` for uint8, ``1e10`` for int32) raises
``ValueError`` on every backend.

Lengths against the padded width: every length must be ``<= M`` (and the offsets valid).
Where the lengths are on the host (a RaggedTensor's host offsets, ``pack(lengths=)``) this
is checked there; otherwise the check reads the offsets, so it always runs when they are
on the CPU (no sync to pay) and on CUDA only with ``validate=True`` (one sync), because a
check on the hot path would stall the stream. Unchecked on CUDA, a length past ``M`` is a
broken contract that no kernel can report without a sync: the kernels still touch memory
only inside their tensors (unpack leaves the tokens past the width out, pack writes zero
rows for tokens it has no padded row for), and the torch backend raises a device-side
index error. So a caller that cannot vouch for CUDA offsets passes ``validate=True``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from . import backends, opdef
from .records.pack import PackArgs, PackGrads, PackOutput, UnpackArgs, UnpackGrads, UnpackOutput
from .utils import (
    check_int,
    check_offsets_tensor,
    check_side,
    check_tensor,
    eager,
    padding_number,
    padding_scalar,
)

# --------------------------------------------------------------------------------------
# Reference (pure torch; CPU product path and test oracle)


def _token_coords(offsets: torch.Tensor, total: int, width: int, left: bool):
    """For each packed token t: its sequence b and its position in the padded row.

    ``b`` is found by a search of the offsets (as :meth:`RaggedTensor.seq_ids` finds it), so that
    a row past ``offsets[-1]`` (a spare row of a graphed bucket) gets ``b = B``, one past the
    last sequence; the callers move nothing for it."""
    offsets = offsets.to(torch.int64)
    t = torch.arange(total, device=offsets.device)
    b = torch.searchsorted(offsets[1:], t, right=True)
    if left:  # j + M - L_b, with L_b = offsets[b + 1] - offsets[b]
        return b, t + (width - offsets[(b + 1).clamp(max=offsets.shape[0] - 1)])
    return b, t - offsets[b]


def reference_pack(padded: torch.Tensor, offsets: torch.Tensor, total: int, left: bool = False) -> torch.Tensor:
    """``values[offsets[b] + j] = padded[b, j]`` (``j`` shifted by ``M - L_b`` when ``left``);
    zeros at rows past ``offsets[-1]``."""
    batch, width = padded.shape[0], padded.shape[1]
    b, j = _token_coords(offsets, total, width, left)
    spare = b >= batch
    try:
        rows = padded.view(batch * width, *padded.shape[2:])
    except RuntimeError:  # batch and position dims not viewable as one: index them apart
        b, j = torch.where(spare, 0, b), torch.where(spare, 0, j)
        out = padded[_checked_positions(b, j, width), j]
    else:
        if rows.shape[0] == 0:  # no padded row: a spare row reads a row of zeros
            rows = padded.new_zeros((1, *padded.shape[2:]))
        # One index_select of whole rows of the [B*M] view, rather than padded[b, j], which indexes two
        # dims for every element.
        out = rows.index_select(0, _flat_rows(b, j, width, batch, 0))
    return out.masked_fill_(spare.view(-1, *(1,) * (out.dim() - 1)), 0)


def unpack_fill(fn: str, padding_value: object, values: torch.Tensor, offsets: torch.Tensor):
    """The padding value handed to the unpack op: cast here in eager calls, so that a value
    the dtype cannot hold raises before any work; while tracing (torch.compile, fake
    tensors) the number as given, cast by the backend when the op runs (a cast here would
    be a traced tensor op whose value cannot be read)."""
    if eager(values, offsets):
        return padding_scalar(fn, padding_value, values.dtype)
    return padding_number(fn, padding_value)


def reference_unpack(
    values: torch.Tensor, offsets: torch.Tensor, width: int, padding_value: float = 0.0, left: bool = False
) -> torch.Tensor:
    """Inverse of :func:`reference_pack`; ``padding_value`` (see :func:`fill_element`) everywhere else."""
    batch = offsets.shape[0] - 1
    fill = padding_scalar("ragged.reference_unpack", padding_value, values.dtype)
    # one row past the padded ones takes the rows past offsets[-1] (the spare rows of a graphed bucket)
    rows = values.new_full((batch * width + 1, *values.shape[1:]), fill)
    b, j = _token_coords(offsets, values.shape[0], width, left)
    rows.index_copy_(0, _flat_rows(b, j, width, batch, batch * width), values)  # whole rows: out[b, j] = v
    return rows[: batch * width].view(batch, width, *values.shape[1:])


def _flat_rows(b: torch.Tensor, j: torch.Tensor, width: int, batch: int, spare: int) -> torch.Tensor:
    """Row ``b * width + j`` of the flattened ``[B*M]`` padded rows; row ``spare`` for a token
    past ``offsets[-1]`` (``b == B``); a position outside ``[0, width)`` (a length longer than the
    padded width, which callers that could not check it let through) maps to row ``B*M + 1``,
    past the rows the callers index, so the index op raises instead of touching another row."""
    rows = torch.where((j >= 0) & (j < width), b * width + j, batch * width + 1)
    return torch.where(b >= batch, spare, rows)


def _checked_positions(b: torch.Tensor, j: torch.Tensor, width: int) -> torch.Tensor:
    """``b``, with the sequence index made out of range where ``j`` is (see :func:`_flat_rows`)."""
    return torch.where((j >= 0) & (j < width), b, torch.iinfo(b.dtype).max)


# --------------------------------------------------------------------------------------
# The ops


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """What an implementation of pack / unpack is asked to take: the moved rows' device and dtype."""

    device: torch.device
    dtype: torch.dtype


def pack_spec(x: torch.Tensor, offsets: torch.Tensor, *_) -> PackSpec:
    """The spec of ``pack(padded [B, M, *F], offsets [B+1], ...)`` / ``unpack(values [T, *F], offsets, ...)``
    (the operands after the offsets do not change what an implementation takes)."""
    return PackSpec(x.device, x.dtype)


def _backward_impl(op: str, forward_impl: str, grad: torch.Tensor) -> str:
    # The forward's implementation took this device and dtype; keep it unless the gradient differs.
    spec = PackSpec(grad.device, grad.dtype)
    if backends.implementation(op, forward_impl).reasons(spec):
        return backends.select_spec(op, "auto", spec).name
    return forward_impl


def _pack_setup(ctx, args: PackArgs, output: PackOutput) -> None:
    ctx.save_for_backward(args.offsets)
    ctx.width, ctx.left = args.padded.shape[1], args.left


def _pack_backward(ctx, grad: Tensor) -> PackGrads:
    (offsets,) = ctx.saved_tensors
    impl = _backward_impl("unpack", ctx.impl, grad)
    return PackGrads(UNPACK(UnpackArgs(grad.contiguous(), offsets, ctx.width, 0.0, ctx.left), impl).padded)


def _pack_fake(args: PackArgs) -> PackOutput:
    padded = args.padded
    return PackOutput(padded.new_empty((args.total, *padded.shape[2:])))


PACK = opdef.define(
    "pack",
    PackArgs,
    PackOutput,
    spec=pack_spec,
    setup=_pack_setup,
    backward=_pack_backward,
    fake=_pack_fake,
    grads=PackGrads,
)


def _unpack_setup(ctx, args: UnpackArgs, output: UnpackOutput) -> None:
    ctx.save_for_backward(args.offsets)
    ctx.total, ctx.left = args.values.shape[0], args.left


def _unpack_backward(ctx, grad: Tensor) -> UnpackGrads:
    (offsets,) = ctx.saved_tensors
    impl = _backward_impl("pack", ctx.impl, grad)
    return UnpackGrads(PACK(PackArgs(grad.contiguous(), offsets, ctx.total, ctx.left), impl).values)


def _unpack_fake(args: UnpackArgs) -> UnpackOutput:
    values = args.values
    return UnpackOutput(values.new_empty((args.offsets.shape[0] - 1, args.width, *values.shape[1:])))


UNPACK = opdef.define(
    "unpack",
    UnpackArgs,
    UnpackOutput,
    spec=pack_spec,
    setup=_unpack_setup,
    backward=_unpack_backward,
    fake=_unpack_fake,
    grads=UnpackGrads,
)


def _reference_pack(args: PackArgs) -> PackOutput:
    return PackOutput(reference_pack(args.padded, args.offsets, args.total, args.left))


def _reference_unpack(args: UnpackArgs) -> UnpackOutput:
    return UnpackOutput(reference_unpack(args.values, args.offsets, args.width, args.padding_value, args.left))


backends.register(
    backends.Implementation("pack", "torch", _reference_pack),
    backends.Implementation("unpack", "torch", _reference_unpack),
)


# --------------------------------------------------------------------------------------
# Functional forms on plain tensors


def pack_values(
    padded: torch.Tensor,
    offsets: torch.Tensor,
    total: int,
    *,
    padding_side: str = "right",
    backend: str | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """Gather the real rows of ``padded [B, M, *F]`` into ``values [total, *F]``.

    ``offsets [B+1]`` (int32/int64, on ``padded.device``, any stride) delimit the sequences
    and ``total == offsets[-1]`` is given by the caller so that nothing reads the GPU.
    The offsets must be valid (``offsets[0] == 0``, non-decreasing, ``offsets[-1] == total``)
    with every length ``<= M``: checked when the offsets are on the CPU (free) or with
    ``validate=True`` (one sync on CUDA); on CUDA otherwise they are the caller's contract.
    """
    fn = "ragged.pack_values"
    check_tensor(fn, "padded", padded)
    if padded.dim() < 2:
        raise ValueError(f"{fn}(): expected padded of shape [B, M, ...], got {tuple(padded.shape)}")
    offsets = check_offsets_tensor(fn, offsets, padded)
    if offsets.shape[0] != padded.shape[0] + 1:
        raise ValueError(f"{fn}(): expected offsets of shape [{padded.shape[0] + 1}] (B+1), got {tuple(offsets.shape)}")
    total = check_int(fn, "total", total, minimum=0)
    left = check_side(fn, padding_side) == "left"
    impl = backends.select_spec("pack", backend, PackSpec(padded.device, padded.dtype), fn=fn)
    if reads_offsets(validate, padded, offsets):
        check_offsets(fn, offsets, total, "total", padded.shape[1], "the padded width padded.shape[1]")
    return PACK(PackArgs(padded, offsets, total, left), impl.name).values


def unpack_values(
    values: torch.Tensor,
    offsets: torch.Tensor,
    width: int,
    *,
    padding_value: float = 0.0,
    padding_side: str = "right",
    backend: str | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """Scatter ``values [T, *F]`` into a new ``[B, width, *F]`` filled with ``padding_value``.

    ``offsets [B+1]`` (int32/int64, on ``values.device``, any stride) must be valid
    (``offsets[0] == 0``, non-decreasing, ``offsets[-1] == T``) with every length
    ``<= width``: checked when the offsets are on the CPU (free) or with ``validate=True``
    (one sync on CUDA). Unchecked on CUDA, a longer sequence is the caller's broken
    contract (see the module docstring). ``padding_value`` is cast as torch casts it
    (:func:`fill_element`), the same on every backend.
    """
    fn = "ragged.unpack_values"
    check_tensor(fn, "values", values)
    if values.dim() < 1:
        raise ValueError(f"{fn}(): expected values of shape [T, ...], got a 0-d tensor")
    offsets = check_offsets_tensor(fn, offsets, values)
    width = check_int(fn, "width", width, minimum=0)
    left = check_side(fn, padding_side) == "left"
    fill = unpack_fill(fn, padding_value, values, offsets)
    impl = backends.select_spec("unpack", backend, PackSpec(values.device, values.dtype), fn=fn)
    if reads_offsets(validate, values, offsets):
        check_offsets(fn, offsets, values.shape[0], "values.shape[0]", width, "width")
    return UNPACK(UnpackArgs(values, offsets, width, fill, left), impl.name).padded


def reads_offsets(validate: bool, x: torch.Tensor, offsets: torch.Tensor) -> bool:
    """Whether to read the offsets to check them: CPU offsets always (no sync to pay), CUDA
    ones when asked; never while tracing (fake tensors, torch.compile: no data to read)."""
    if not (validate or offsets.device.type == "cpu"):
        return False
    return offsets.device.type != "meta" and eager(x, offsets)


def check_offsets(fn: str, offsets: torch.Tensor, total: int, total_name: str, width: int, width_name: str) -> None:
    """Offsets valid for ``total`` rows with every length ``<= width``, in one read."""
    o = offsets.detach().to(torch.int64)
    lengths = o[1:] - o[:-1]
    if lengths.numel():
        stats = torch.stack([o[0], o[-1], lengths.min(), lengths.max(), lengths.argmax()])
    else:
        stats = torch.cat([o[:1], o[:1], o.new_zeros(3)])
    first, last, shortest, longest, where = stats.tolist()
    if first != 0:
        raise ValueError(f"{fn}(): expected offsets[0] == 0, got {first}")
    if shortest < 0:
        raise ValueError(f"{fn}(): expected non-decreasing offsets, got a decrease of {-shortest}")
    if last != total:
        raise ValueError(f"{fn}(): expected offsets[-1] == {total_name} ({total}), got {last}")
    if longest > width:
        raise ValueError(
            f"{fn}(): expected every length <= {width_name} ({width}), got a length of {longest} (sequence {where})"
        )
