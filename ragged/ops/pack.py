"""pack / unpack: padded ``[B, M, *F]`` <-> packed ``values [T, *F]``.

Two torch.library ops carry the work (``ragged::pack``, ``ragged::unpack``), each with
a fake implementation for torch.compile and an autograd rule (the gradient of pack is
unpack with zeros at padding, and the gradient of unpack is pack). Each has three
implementations, picked by :mod:`ragged.backends`:

* ``"torch"``: :func:`reference_pack` / :func:`reference_unpack`, plain indexing;
  the CPU path and the oracle of the tests;
* ``"triton"``: :mod:`ragged.kernels.triton.pack`;
* ``"cuda"``: ``csrc/pack.cu`` through :mod:`ragged.kernels.cuda`.

All three move the same bytes and are bit-exact against each other.

Padding side: with ``padding_side="right"`` sequence ``b`` occupies positions
``[0, L_b)`` of its padded row; with ``"left"`` it occupies ``[M - L_b, M)``.

Padding value: every backend writes :func:`fill_element` of it, torch's own cast of the
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

import numbers
from typing import Sequence

import numpy as np
import torch
import torch.types

from .. import backends
from .._utils import (
    check_int,
    check_offsets_tensor,
    check_tensor,
    describe,
    eager,
    host_lengths_of,
    host_offsets_from_lengths,
    max_length,
    offsets_dtype_for,
    to_device,
    warn_once,
)
from ..tensor import RaggedTensor, _side, exact_ragged

# --------------------------------------------------------------------------------------
# Reference (pure torch; CPU product path and test oracle)


def _token_coords(offsets: torch.Tensor, total: int, width: int, left: bool):
    """For each packed token t: its sequence b and its position in the padded row."""
    offsets = offsets.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    b = torch.repeat_interleave(torch.arange(lengths.shape[0], device=offsets.device), lengths,
                                output_size=total)
    j = torch.arange(total, device=offsets.device) - offsets[b]
    if left:
        j = j + (width - lengths[b])
    return b, j


def reference_pack(padded: torch.Tensor, offsets: torch.Tensor, total: int, left: bool = False) -> torch.Tensor:
    """``values[offsets[b] + j] = padded[b, j]`` (``j`` shifted by ``M - L_b`` when ``left``)."""
    batch, width = padded.shape[0], padded.shape[1]
    b, j = _token_coords(offsets, total, width, left)
    try:
        rows = padded.view(batch * width, *padded.shape[2:])
    except RuntimeError:  # batch and position dims not viewable as one: index them apart
        return padded[_checked_positions(b, j, width), j]
    # One index_select over [B*M] rows: about 2x faster on CPU than padded[b, j].
    return rows.index_select(0, _flat_rows(b, j, width, batch))


def fill_element(fn: str, padding_value: object, dtype: torch.dtype) -> torch.Tensor:
    """``padding_value`` as one element of ``dtype``: a 0-d CPU tensor.

    The one definition of the padding every backend writes: torch's cast of the number,
    what ``torch.full((), padding_value, dtype=dtype)`` (and ``Tensor.new_full``) holds.
    So bool is True for any nonzero number (``0.5``, ``-1.0``, ``nan``), integer dtypes
    truncate toward zero (``0.5`` -> 0), a Python int wraps where torch wraps it
    (``-1`` -> 255 in uint8) while a float out of range does not (``-1.0`` in uint8), and
    float16 rounds ``1e10`` to inf. What torch refuses to cast raises ``ValueError``;
    anything but a number (bool, int, float, complex, numpy scalar, one-element tensor)
    raises ``TypeError``.
    """
    value = _padding_number(fn, padding_value)
    try:
        return torch.full((), value, dtype=dtype)
    except (RuntimeError, OverflowError):
        raise ValueError(f"{fn}(): expected padding_value representable in {dtype} (torch cannot cast it "
                         f"without overflow), got {describe(padding_value)}") from None


def padding_scalar(fn: str, padding_value: object, dtype: torch.dtype) -> bool | int | float | complex:
    """:func:`fill_element` as a Python scalar: passing it to ``torch.full`` again gives the
    same element, bit for bit (a Python float holds every float16/bfloat16/float32 value)."""
    return fill_element(fn, padding_value, dtype).item()


def _padding_number(fn: str, padding_value: object) -> bool | int | float | complex:
    """``padding_value`` as a Python number (numpy scalars and one-element tensors taken)."""
    value = padding_value
    if isinstance(value, np.generic):
        value = value.item()
    elif isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"{fn}(): expected padding_value to be a number, got {describe(padding_value)}")
        value = value.item()
    if not isinstance(value, numbers.Number):
        raise TypeError(f"{fn}(): expected padding_value to be a number, got {describe(padding_value)}")
    return value


def _fill_argument(fn: str, padding_value: object, values: torch.Tensor, offsets: torch.Tensor):
    """The padding value handed to the unpack op: cast here in eager calls, so that a value
    the dtype cannot hold raises before any work; while tracing (torch.compile, fake
    tensors) the number as given, cast by the backend when the op runs (a cast here would
    be a traced tensor op whose value cannot be read)."""
    if eager(values, offsets):
        return padding_scalar(fn, padding_value, values.dtype)
    return _padding_number(fn, padding_value)


def reference_unpack(values: torch.Tensor, offsets: torch.Tensor, width: int, padding_value: float = 0.0,
                     left: bool = False) -> torch.Tensor:
    """Inverse of :func:`reference_pack`; ``padding_value`` (see :func:`fill_element`) everywhere else."""
    batch = offsets.shape[0] - 1
    fill = padding_scalar("ragged.reference_unpack", padding_value, values.dtype)
    out = values.new_full((batch, width, *values.shape[1:]), fill)
    b, j = _token_coords(offsets, values.shape[0], width, left)
    rows = out.view(batch * width, *values.shape[1:])
    rows.index_copy_(0, _flat_rows(b, j, width, batch), values)  # about 2x faster on CPU than out[b, j] = v
    return out


def _flat_rows(b: torch.Tensor, j: torch.Tensor, width: int, batch: int) -> torch.Tensor:
    """Row ``b * width + j`` of the flattened ``[B*M]`` padded rows; a position outside
    ``[0, width)`` (a length longer than the padded width, which callers that could not check
    it let through) maps to row ``B*M``, so the index op raises instead of touching another row."""
    return torch.where((j >= 0) & (j < width), b * width + j, batch * width)


def _checked_positions(b: torch.Tensor, j: torch.Tensor, width: int) -> torch.Tensor:
    """``b``, with the sequence index made out of range where ``j`` is (see :func:`_flat_rows`)."""
    return torch.where((j >= 0) & (j < width), b, torch.iinfo(b.dtype).max)


# --------------------------------------------------------------------------------------
# Backends: what each implementation can take


def _kernel_dtype_reason(dtype: torch.dtype) -> str | None:
    if dtype.is_complex:
        return f"complex dtypes are not supported by the kernels (got {dtype})"
    return None


def _triton_reasons(x: torch.Tensor, offsets: torch.Tensor, *_) -> list[str]:
    reasons = [r for r in (backends.triton_reason(x.device), _kernel_dtype_reason(x.dtype)) if r]
    return reasons


def _cuda_reasons(x: torch.Tensor, offsets: torch.Tensor, *_) -> list[str]:
    return [r for r in (backends.cuda_reason(x.device), _kernel_dtype_reason(x.dtype)) if r]


def _no_reasons(*_) -> list[str]:
    return []


def _triton_pack(padded, offsets, total, left):
    from ..kernels.triton.pack import pack as kernel

    return kernel(padded, offsets, total, left)


def _triton_unpack(values, offsets, width, padding_value, left):
    from ..kernels.triton.pack import unpack as kernel

    return kernel(values, offsets, width, padding_value, left)


def _cuda_pack(padded, offsets, total, left):
    from ..kernels.cuda import pack as kernel

    return kernel(padded, offsets, total, left)


def _cuda_unpack(values, offsets, width, padding_value, left):
    from ..kernels.cuda import unpack as kernel

    return kernel(values, offsets, width, padding_value, left)


backends.register("pack", "torch", reference_pack, _no_reasons)
backends.register("pack", "triton", _triton_pack, _triton_reasons)
backends.register("pack", "cuda", _cuda_pack, _cuda_reasons)
backends.register("unpack", "torch", reference_unpack, _no_reasons)
backends.register("unpack", "triton", _triton_unpack, _triton_reasons)
backends.register("unpack", "cuda", _cuda_unpack, _cuda_reasons)
# "auto" on CUDA tensors: fastest measured first (bench/results/pack_*.md).
backends.set_auto_order("pack", ("cuda", "triton", "torch"))
backends.set_auto_order("unpack", ("cuda", "triton", "torch"))


# --------------------------------------------------------------------------------------
# torch.library ops


@torch.library.custom_op("ragged::pack", mutates_args=())
def _pack_op(padded: torch.Tensor, offsets: torch.Tensor, total: int, left: bool, backend: str) -> torch.Tensor:
    return backends._OPS["pack"].impls[backend].fn(padded, offsets, total, left)


@_pack_op.register_fake
def _pack_fake(padded, offsets, total, left, backend):
    return padded.new_empty((total, *padded.shape[2:]))


# padding_value is a Scalar, not a float: an int64 fill such as 2**62 + 1 stays exact.
@torch.library.custom_op("ragged::unpack", mutates_args=())
def _unpack_op(values: torch.Tensor, offsets: torch.Tensor, width: int, padding_value: torch.types.Number,
               left: bool, backend: str) -> torch.Tensor:
    return backends._OPS["unpack"].impls[backend].fn(values, offsets, width, padding_value, left)


@_unpack_op.register_fake
def _unpack_fake(values, offsets, width, padding_value, left, backend):
    return values.new_empty((offsets.shape[0] - 1, width, *values.shape[1:]))


def _pack_setup(ctx, inputs, output):
    padded, offsets, total, left, backend = inputs
    ctx.save_for_backward(offsets)
    ctx.width, ctx.left, ctx.backend = padded.shape[1], left, backend


def _pack_backward(ctx, grad):
    (offsets,) = ctx.saved_tensors
    backend = _backward_backend("unpack", ctx.backend, grad)
    return _call_unpack(grad.contiguous(), offsets, ctx.width, 0.0, ctx.left, backend), None, None, None, None


def _unpack_setup(ctx, inputs, output):
    values, offsets, width, padding_value, left, backend = inputs
    ctx.save_for_backward(offsets)
    ctx.total, ctx.left, ctx.backend = values.shape[0], left, backend


def _unpack_backward(ctx, grad):
    (offsets,) = ctx.saved_tensors
    backend = _backward_backend("pack", ctx.backend, grad)
    return _call_pack(grad.contiguous(), offsets, ctx.total, ctx.left, backend), None, None, None, None, None


def _backward_backend(op: str, forward_backend: str, grad: torch.Tensor) -> str:
    # The forward's backend took this device and dtype; keep it unless the gradient differs.
    impl = backends._OPS[op].impls[forward_backend]
    if impl.reasons(grad, None):
        return backends.select(op, "auto", grad.device, grad, None).name
    return forward_backend


_pack_op.register_autograd(_pack_backward, setup_context=_pack_setup)
_unpack_op.register_autograd(_unpack_backward, setup_context=_unpack_setup)


# Eager calls skip the torch.library dispatcher: it costs about 25 us of host time per
# call on an H200 machine (bench/overhead.py), more than a small pack kernel runs.
# The same autograd rules then come from these Functions. Under torch.compile, fake
# tensors, tensor subclasses or dispatch modes, calls go through the ops above.


class _PackFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, padded, offsets, total, left, backend):
        ctx.save_for_backward(offsets)
        ctx.width, ctx.left, ctx.backend = padded.shape[1], left, backend
        return backends._OPS["pack"].impls[backend].fn(padded, offsets, total, left)

    backward = staticmethod(_pack_backward)


class _UnpackFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, offsets, width, padding_value, left, backend):
        ctx.save_for_backward(offsets)
        ctx.total, ctx.left, ctx.backend = values.shape[0], left, backend
        return backends._OPS["unpack"].impls[backend].fn(values, offsets, width, padding_value, left)

    backward = staticmethod(_unpack_backward)


def _call_pack(padded: torch.Tensor, offsets: torch.Tensor, total: int, left: bool, backend: str) -> torch.Tensor:
    if eager(padded, offsets):
        if padded.requires_grad and torch.is_grad_enabled():
            return _PackFunction.apply(padded, offsets, total, left, backend)
        return backends._OPS["pack"].impls[backend].fn(padded, offsets, total, left)
    return _pack_op(padded, offsets, total, left, backend)


def _call_unpack(values: torch.Tensor, offsets: torch.Tensor, width: int, padding_value: torch.types.Number,
                 left: bool, backend: str) -> torch.Tensor:
    if eager(values, offsets):
        if values.requires_grad and torch.is_grad_enabled():
            return _UnpackFunction.apply(values, offsets, width, padding_value, left, backend)
        return backends._OPS["unpack"].impls[backend].fn(values, offsets, width, padding_value, left)
    return _unpack_op(values, offsets, width, padding_value, left, backend)


# --------------------------------------------------------------------------------------
# Functional forms on plain tensors


def pack_values(padded: torch.Tensor, offsets: torch.Tensor, total: int, *, padding_side: str = "right",
                backend: str | None = None, validate: bool = False) -> torch.Tensor:
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
    left = _side(fn, padding_side) == "left"
    impl = backends.select("pack", backend, padded.device, padded, offsets)
    if _reads_offsets(validate, padded, offsets):
        _check_offsets(fn, offsets, total, "total", padded.shape[1], "the padded width padded.shape[1]")
    return _call_pack(padded, offsets, total, left, impl.name)


def unpack_values(values: torch.Tensor, offsets: torch.Tensor, width: int, *, padding_value: float = 0.0,
                  padding_side: str = "right", backend: str | None = None, validate: bool = False) -> torch.Tensor:
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
    left = _side(fn, padding_side) == "left"
    fill = _fill_argument(fn, padding_value, values, offsets)
    impl = backends.select("unpack", backend, values.device, values, offsets)
    if _reads_offsets(validate, values, offsets):
        _check_offsets(fn, offsets, values.shape[0], "values.shape[0]", width, "width")
    return _call_unpack(values, offsets, width, fill, left, impl.name)


def _reads_offsets(validate: bool, x: torch.Tensor, offsets: torch.Tensor) -> bool:
    """Whether to read the offsets to check them: CPU offsets always (no sync to pay), CUDA
    ones when asked; never while tracing (fake tensors, torch.compile: no data to read)."""
    if not (validate or offsets.device.type == "cpu"):
        return False
    return offsets.device.type != "meta" and eager(x, offsets)


def _check_offsets(fn: str, offsets: torch.Tensor, total: int, total_name: str, width: int, width_name: str) -> None:
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
        raise ValueError(f"{fn}(): expected every length <= {width_name} ({width}), "
                         f"got a length of {longest} (sequence {where})")


# --------------------------------------------------------------------------------------
# User-facing pack / unpack


def pack(data, lengths=None, *, mask: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
         padding_side: str | None = None, backend: str | None = None) -> RaggedTensor:
    """Build a :class:`RaggedTensor`.

    * ``pack([t_0, t_1, ...])``: a list of ``[L_i, *F]`` tensors (same ``F``, dtype and
      device); no sync.
    * ``pack(x, lengths=[...])``: ``x`` padded ``[B, M, *F]`` and host lengths (list,
      tuple, numpy array, CPU tensor): no sync. A CUDA lengths tensor is read back once.
      ``padding_side="left"`` when the tokens sit at the end of each row.
    * ``pack(x, mask=key_padding_mask)``: torch convention, ``[B, M]`` bool with True at
      padding (or float with ``-inf`` at padding). One sync reads the lengths and the
      padding side.
    * ``pack(x, attention_mask=hf_mask)``: HuggingFace convention, ``[B, M]`` of any dtype
      holding only 0 (padding) and 1 (token); right or left padding is detected. One sync,
      as for ``mask``. An integer mask given as ``mask=`` raises ``TypeError``.
    * ``pack(x)``: every row is full (``L_b = M``).

    Masks whose tokens are not one contiguous run at either end of each row are
    compressed with a boolean gather (slower; warns once).
    """
    fn = "ragged.pack"
    if backend is not None:
        backends._check_name(fn, backend)
    if isinstance(data, (list, tuple)):
        if lengths is not None or mask is not None or attention_mask is not None:
            raise ValueError(f"{fn}(): lengths, mask and attention_mask apply to a padded tensor, "
                             "not to a list of sequences")
        return _pack_list(fn, data)
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{fn}(): expected a list of tensors or a padded tensor [B, M, ...], got {describe(data)}")
    x = data
    if x.dim() < 2:
        raise ValueError(f"{fn}(): expected a padded tensor of shape [B, M, ...], got {tuple(x.shape)}")
    given = [name for name, v in (("lengths", lengths), ("mask", mask), ("attention_mask", attention_mask))
             if v is not None]
    if len(given) > 1:
        raise ValueError(f"{fn}(): expected at most one of lengths, mask, attention_mask, got {', '.join(given)}")
    batch, width = x.shape[0], x.shape[1]
    if mask is not None or attention_mask is not None:
        name = "mask" if mask is not None else "attention_mask"
        return _pack_masked(fn, x, mask if mask is not None else attention_mask, name, padding_side, backend)
    side = _side(fn, "right" if padding_side is None else padding_side)
    if lengths is None:
        host_lengths = [width] * batch
    else:
        host_lengths = host_lengths_of(fn, lengths)
        if len(host_lengths) != batch:
            raise ValueError(f"{fn}(): expected {batch} lengths (x.shape[0]), got {len(host_lengths)}")
    host = host_offsets_from_lengths(fn, host_lengths)
    longest = max_length(host)
    if longest > width:
        i = max(range(batch), key=lambda k: host[k + 1] - host[k])
        raise ValueError(f"{fn}(): expected every length <= the padded width x.shape[1] ({width}), "
                         f"got lengths[{i}] = {longest}")
    return _pack_host(x, host, longest, side, backend)


def _pack_host(x: torch.Tensor, host: Sequence[int], longest: int, side: str, backend) -> RaggedTensor:
    total = host[-1]
    offsets = to_device(host, offsets_dtype_for(total), x.device)
    impl = backends.select("pack", backend, x.device, x, offsets)
    values = _call_pack(x, offsets, total, side == "left", impl.name)
    return exact_ragged(values, offsets, host, longest)


def _pack_list(fn: str, seqs: Sequence[torch.Tensor]) -> RaggedTensor:
    if len(seqs) == 0:
        return RaggedTensor(torch.empty(0), torch.zeros(1, dtype=torch.int32), 0, (0,))
    first = seqs[0]
    for i, s in enumerate(seqs):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{fn}(): expected every sequence to be a torch.Tensor, got {describe(s)} at index {i}")
        if s.dim() < 1:
            raise ValueError(f"{fn}(): expected sequences of shape [L, ...], got a 0-d tensor at index {i}")
        if s.shape[1:] != first.shape[1:]:
            raise ValueError(f"{fn}(): expected every sequence to have feature shape {tuple(first.shape[1:])} "
                             f"(that of sequence 0), got {tuple(s.shape[1:])} at index {i}")
        if s.dtype != first.dtype:
            raise TypeError(f"{fn}(): expected every sequence to have dtype {first.dtype} (that of sequence 0), "
                            f"got {s.dtype} at index {i}")
        if s.device != first.device:
            raise ValueError(f"{fn}(): expected every sequence on {first.device} (that of sequence 0), "
                             f"got {s.device} at index {i}")
    host = host_offsets_from_lengths(fn, [s.shape[0] for s in seqs])
    values = torch.cat(list(seqs), dim=0)
    offsets = to_device(host, offsets_dtype_for(host[-1]), first.device)
    return exact_ragged(values, offsets, host, max_length(host))


def _pack_masked(fn: str, x: torch.Tensor, m: torch.Tensor, name: str, padding_side, backend) -> RaggedTensor:
    check_tensor(fn, name, m)
    if tuple(m.shape) != tuple(x.shape[:2]):
        raise ValueError(f"{fn}(): expected {name} of shape {tuple(x.shape[:2])} (x.shape[:2]), got {tuple(m.shape)}")
    if m.device != x.device:
        raise ValueError(f"{fn}(): expected {name} on {x.device} (the device of x), got {m.device}")
    if padding_side is not None:
        _side(fn, padding_side)
    if name == "mask":  # torch convention: True (or -inf) = padding
        if m.dtype == torch.bool:
            keep, bad = ~m, None
        elif m.dtype.is_floating_point:
            keep = m == 0
            bad = ~(keep | torch.isneginf(m))
        else:
            # An integer mask is almost always a HuggingFace 0/1 mask (1 = token): read with
            # the torch convention its lengths would come out inverted.
            raise TypeError(f"{fn}(): expected mask of dtype bool (True = padding) or float (-inf = padding), "
                            f"got {m.dtype}; for a 0/1 mask with 1 at tokens (HuggingFace convention) "
                            "use attention_mask= instead")
    else:  # HuggingFace convention: 1 = token, 0 = padding, nothing else (bool is 0/1 already)
        keep = m != 0
        bad = None if m.dtype == torch.bool else ~(keep == (m == 1))
    host_lengths, is_right, is_left, is_bad = read_mask_layout(keep, bad)
    if is_bad:
        what = "0 (token) or -inf (padding)" if name == "mask" else "0 (padding) or 1 (token)"
        raise ValueError(f"{fn}(): expected {name} values to be {what}, got other values")
    host = host_offsets_from_lengths(fn, host_lengths)
    longest = max_length(host)
    if is_right and padding_side != "left":
        return _pack_host(x, host, longest, "right", backend)
    if is_left and padding_side != "right":
        return _pack_host(x, host, longest, "left", backend)
    if is_right or is_left:
        found = "right" if is_right else "left"
        raise ValueError(f"{fn}(): padding_side={padding_side!r} expects a {padding_side}-padded {name}, "
                         f"got a {found}-padded one")
    warn_once("pack-scattered-mask",
              f"{fn}(): {name} has tokens that are not one contiguous run at the start or end of each row; "
              "compressing them with a boolean gather, which is slower than the pack kernels")
    values = x[keep]
    offsets = to_device(host, offsets_dtype_for(host[-1]), x.device)
    return exact_ragged(values, offsets, host, longest)


def read_mask_layout(keep: torch.Tensor, bad: torch.Tensor | None = None) -> tuple[list[int], bool, bool, bool]:
    """The one device read of a mask-driven pack.

    ``keep``: ``[B, M]`` bool, True at tokens. Returns the host lengths, whether every row's
    tokens are one run at the start (right padding) or at the end (left padding) of the
    row (full and empty rows are both), and whether ``bad`` (bool, any shape) holds a True.
    """
    batch, width = keep.shape
    lengths = keep.sum(1)
    j = torch.arange(width, device=keep.device)
    right = (keep == (j < lengths.unsqueeze(1))).all()
    left = (keep == (j >= width - lengths.unsqueeze(1))).all()
    flags = torch.stack([right, left, bad.any() if bad is not None else torch.zeros((), dtype=torch.bool,
                                                                                    device=keep.device)])
    stats = torch.cat([lengths.to(torch.int64), flags.to(torch.int64)]).tolist()
    host_lengths, (is_right, is_left, is_bad) = stats[:batch], stats[batch:]
    return host_lengths, bool(is_right), bool(is_left), bool(is_bad)


def unpack(rt: RaggedTensor, padding_value: float = 0.0, total_length: int | None = None,
           padding_side: str = "right", backend: str | None = None) -> torch.Tensor:
    """``[B, M, *F]`` from a RaggedTensor, ``padding_value`` at padding; ``M = total_length or max_len``.

    ``M`` is checked against the longest sequence on the host when the host offsets are
    known (no sync), and otherwise from CPU offsets; CUDA offsets without host offsets are
    trusted to fit ``max_len``.
    """
    fn = "ragged.unpack"
    if not isinstance(rt, RaggedTensor):
        raise TypeError(f"{fn}(): expected a RaggedTensor for rt, got {describe(rt)}")
    width = rt._width(fn, total_length)
    left = _side(fn, padding_side) == "left"
    values, offsets = rt.values, rt.offsets
    fill = _fill_argument(fn, padding_value, values, offsets)
    impl = backends.select("unpack", backend, values.device, values, offsets)
    if rt._host_offsets is None and _reads_offsets(False, values, offsets):
        _check_offsets(fn, offsets, values.shape[0], "values.shape[0]", width,
                       "max_len" if total_length is None else "total_length")
    return _call_unpack(values, offsets, width, fill, left, impl.name)
