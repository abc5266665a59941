"""Small shared helpers: argument checks, host-to-device metadata, the padding value, warn-once.

An internal API, documented for ragged's own modules and its model adapters (``ragged.nn``):
not part of the public API of ``import ragged``."""

from __future__ import annotations

import math
import numbers
import sys
import warnings
from collections.abc import Sequence
from typing import cast

import numpy as np
import torch

INT32_MAX = 2**31 - 1
OFFSET_DTYPES = (torch.int32, torch.int64)


def offsets_dtype_for(total: int) -> torch.dtype:
    """int32 offsets unless a token count can pass 2**31 - 1 (then int64)."""
    return torch.int32 if total <= INT32_MAX else torch.int64


def numel_of(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def describe(x: object) -> str:
    """Short description of an argument for error messages."""
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def check_tensor(fn: str, name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}(): expected {name} to be a torch.Tensor, got {type(x).__name__}")
    return x


def check_int(fn: str, name: str, value: object, *, minimum: int | None = None) -> int:
    """``value`` as a Python int: ints, numpy integers and 0-d integer tensors are taken;
    bools, floats and everything else raise ``TypeError``; below ``minimum`` raises ``ValueError``."""
    if (
        isinstance(value, torch.Tensor)
        and value.dim() == 0
        and not value.dtype.is_floating_point
        and not value.dtype.is_complex
        and value.dtype != torch.bool
    ):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{fn}(): expected {name} to be an int, got {describe(value)}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{fn}(): expected {name} >= {minimum}, got {value}")
    return value


def check_offsets_tensor(
    fn: str, offsets: object, values: torch.Tensor | None = None, name: str = "offsets"
) -> torch.Tensor:
    """Checks ``offsets`` (``[B+1]`` int32/int64, on values' device) and returns it contiguous.

    Every kernel reads offsets (cu_seqlens, ids, lengths) with unit stride: this is the one
    place where a strided view (``offsets[::2]``) becomes a contiguous copy, so callers must
    use the returned tensor."""
    check_tensor(fn, name, offsets)
    offsets = cast(torch.Tensor, offsets)
    if offsets.dtype not in OFFSET_DTYPES:
        raise TypeError(f"{fn}(): expected {name} of dtype torch.int32 or torch.int64, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{fn}(): expected {name} to be 1-D with B+1 >= 1 entries, got shape {tuple(offsets.shape)}")
    if values is not None and offsets.device != values.device:
        raise ValueError(
            f"{fn}(): expected values and {name} on the same device, "
            f"got values on {values.device} and {name} on {offsets.device}"
        )
    return offsets if offsets.is_contiguous() else offsets.contiguous()


def check_vector(fn: str, name: str, t: object, size: int, device: torch.device, what: str = "") -> torch.Tensor:
    """A 1-D parameter of ``size`` entries on ``device`` (a bias, a LayerNorm weight),
    returned with unit stride: Triton kernels index such vectors as ``ptr + i``, so a
    strided or expanded view (``b[::2]``, ``b.expand(n)``) becomes a contiguous copy here."""
    check_tensor(fn, name, t)
    t = cast(torch.Tensor, t)
    if tuple(t.shape) != (size,):
        raise ValueError(f"{fn}(): expected {name} of shape ({size},){what}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{fn}(): expected {name} on {device}, got {t.device}")
    return t if t.stride(0) == 1 or size <= 1 else t.contiguous()


def host_offsets_from_lengths(fn: str, lengths: Sequence[int]) -> list[int]:
    """Validated host lengths -> host offsets (B+1 Python ints).

    Pure Python on purpose: under torch.compile, Python ints fold into constants,
    while numpy calls would be traced into tensor ops.
    """
    offsets = [0]
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            if isinstance(n, (float, np.floating)) and float(n).is_integer():
                n = int(n)
            else:
                raise TypeError(f"{fn}(): expected integer lengths, got lengths[{i}] = {describe(n)}")
        n = int(n)
        if n < 0:
            raise ValueError(f"{fn}(): expected lengths >= 0, got lengths[{i}] = {n}")
        offsets.append(offsets[-1] + n)
    return offsets


def host_lengths_of(fn: str, lengths: object) -> list[int]:
    """Lengths as Python ints. A CUDA tensor costs one device-to-host sync."""
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
            raise TypeError(f"{fn}(): expected integer lengths, got a {lengths.dtype} tensor")
        if lengths.dim() != 1:
            raise ValueError(f"{fn}(): expected 1-D lengths, got shape {tuple(lengths.shape)}")
        if lengths.device.type == "meta":
            # A meta tensor has a shape but no values to read back.
            raise ValueError(
                f"{fn}(): expected lengths with values (host ints, or a CPU or CUDA tensor), "
                f"got a tensor on the meta device"
            )
        return lengths.detach().to("cpu", torch.int64).tolist()
    if isinstance(lengths, np.ndarray):
        if lengths.ndim != 1:
            raise ValueError(f"{fn}(): expected 1-D lengths, got shape {lengths.shape}")
        return lengths.tolist()
    if isinstance(lengths, (list, tuple, range)):
        return list(lengths)
    raise TypeError(f"{fn}(): expected lengths as a list of ints, a numpy array or a tensor, got {describe(lengths)}")


def max_length(host_offsets: Sequence[int]) -> int:
    longest = 0  # a plain loop: torch.compile traces it (max(..., default=) it does not)
    for i in range(len(host_offsets) - 1):
        longest = max(longest, host_offsets[i + 1] - host_offsets[i])
    return longest


_CAPTURED_SOURCES: list[torch.Tensor] = []  # pinned sources of copies recorded in CUDA graphs


def to_device(host: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host metadata -> device tensor without a blocking copy (pinned + non_blocking on CUDA).

    While a CUDA graph is captured the copy is recorded with its pinned source, which every
    replay reads again: the source is then kept for the life of the process (a few bytes per
    captured copy) so that its memory never holds anything else."""
    if device.type == "cuda" and not torch.compiler.is_compiling():
        # A pageable host->device copy blocks the host (and trips sync-debug mode);
        # a pinned one is queued on the stream, and the caching host allocator keeps
        # the pinned block alive until the copy has run.
        source = torch.tensor(host, dtype=dtype, pin_memory=True)
        if torch.cuda.is_current_stream_capturing():
            _CAPTURED_SOURCES.append(source)
        return source.to(device, non_blocking=True)
    t = torch.tensor(host, dtype=dtype)
    return t if device.type == "cpu" else t.to(device)


def _dispatch_modes() -> int:
    try:
        return torch._C._len_torch_dispatch_stack()
    except AttributeError:  # pragma: no cover - older torch
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        return int(_get_current_dispatch_mode() is not None)


_Parameter = torch.nn.Parameter


def eager(*tensors: torch.Tensor) -> bool:
    """True when a call may skip the torch.library dispatcher: plain tensors in eager mode
    (not compiling, no tensor subclass such as FakeTensor, no dispatch mode active;
    ``nn.Parameter`` is a plain tensor here: it dispatches like one)."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if type(t) is not torch.Tensor and type(t) is not _Parameter:
            return False
    return _dispatch_modes() == 0


def feature_rows_contiguous(x: torch.Tensor, lead: int, fn: str) -> torch.Tensor:
    """``x`` with its feature dims (after the first ``lead``) one contiguous block per row;
    copies (and warns once) only when they are not, so kernels can move rows as bytes."""
    expected = 1
    for size, stride in reversed(list(zip(x.shape[lead:], x.stride()[lead:]))):
        if size != 1 and stride != expected:
            warn_once(f"{fn}-noncontig", f"ragged.{fn}: feature dims are not contiguous; copying them first")
            return x.contiguous()
        expected *= size
    return x


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` at import
    time (a large import, which would cost every ``import ragged`` far more than ragged's own
    modules): the decorator only marks the function, with the
    attribute below, and dynamo reads the mark when it traces a call (tests/test_imports.py
    checks that the mark is the one torch sets)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


_warned: set[str] = set()


def warn_once(key: str, message: str, category: type[Warning] = UserWarning) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, category, stacklevel=3)


def real_dtype_reasons(spec) -> list[str]:
    """The reason a kernel that moves bytes (pack, unpack) gives for a spec's dtype: complex is refused."""
    return [f"complex dtypes are not supported by the kernels (got {spec.dtype})"] if spec.dtype.is_complex else []


def check_side(fn: str, padding_side: object) -> str:
    """``padding_side``: ``"right"`` (tokens at the start of each padded row) or ``"left"``."""
    if padding_side not in ("right", "left"):
        raise ValueError(f"{fn}(): expected padding_side 'right' or 'left', got {padding_side!r}")
    return padding_side


# --------------------------------------------------------------------------------------
# The padding value: one rule for every backend of pack / unpack


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
    value = padding_number(fn, padding_value)
    try:
        return torch.full((), value, dtype=dtype)
    except (RuntimeError, OverflowError):
        raise ValueError(
            f"{fn}(): expected padding_value representable in {dtype} (torch cannot cast it "
            f"without overflow), got {describe(padding_value)}"
        ) from None


def padding_scalar(fn: str, padding_value: object, dtype: torch.dtype) -> bool | int | float | complex:
    """:func:`fill_element` as a Python scalar: passing it to ``torch.full`` again gives the
    same element, bit for bit (a Python float holds every float16/bfloat16/float32 value)."""
    return fill_element(fn, padding_value, dtype).item()


def padding_number(fn: str, padding_value: object) -> bool | int | float | complex:
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
    return cast("bool | int | float | complex", value)


def no_autocast(fn):
    """Run ``fn(x, ...)`` with autocast off on ``x``'s device type: a reference computes in the
    precision it names (float32/float64), never in autocast's lower one."""
    import functools

    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        if not torch.is_autocast_enabled(x.device.type):  # entering the block costs microseconds
            return fn(x, *args, **kwargs)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return fn(x, *args, **kwargs)

    return wrapper


class _FirstOrderOnly(torch.autograd.Function):
    """Identity on gradients; differentiating them raises (``anchor``: an input that requires
    grad, so that the outputs belong to the graph being recorded)."""

    @staticmethod
    def forward(ctx, fn, anchor, *grads):
        ctx.fn = fn
        return grads

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(
            f"{ctx.fn}: double backward is not supported (expected one backward through the op, got a backward "
            f"through its gradient: create_graph=True followed by a backward, or gradgradcheck); its gradient is "
            f"computed by kernels that are not differentiable"
        )


def first_order_only(fn: str, grads: tuple, *inputs) -> tuple:
    """``grads`` as they are, or, while the backward is recorded (``create_graph=True``) and an
    input requires grad, through :class:`_FirstOrderOnly`."""
    if not torch.is_grad_enabled():
        return grads
    anchor = next((t for t in inputs if t is not None and t.requires_grad), None)
    present = [g for g in grads if g is not None]
    if anchor is None or not present:
        return grads
    wrapped = iter(_FirstOrderOnly.apply(fn, anchor, *present))
    return tuple(None if g is None else next(wrapped) for g in grads)
