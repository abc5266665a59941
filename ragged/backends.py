"""Which implementation of an op runs: ``"torch"`` | ``"triton"`` | ``"cuda"`` | ``"auto"``.

The choice is made, in this order, from

1. the ``backend=`` argument of the op,
2. :func:`set_backend` (or the :func:`use_backend` context manager),
3. the ``RAGGED_BACKEND`` environment variable,
4. ``"auto"``.

Every implementation of an op registers a ``reasons(*args)`` function that returns
the reasons it cannot take a given input (an empty list when it can). ``"auto"``
walks the op's preference order (measured; see ``bench/results/``) and takes the
first implementation with no reasons; the pure-torch reference takes everything, so
auto never fails. A forced backend that cannot take an input raises ``ValueError``
with its reasons. :func:`explain` reports every implementation's reasons for an input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
from typing import Callable, Iterator

import torch

BACKENDS = ("auto", "torch", "triton", "cuda")

_selected: str | None = None


def _check_name(fn: str, name: object) -> str:
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"{fn}(): expected backend to be one of {BACKENDS}, got {name!r}")
    return name


def set_backend(name: str | None) -> None:
    """Select the backend for every op (``None`` returns to the environment / ``"auto"``)."""
    global _selected
    _selected = None if name is None else _check_name("ragged.set_backend", name)


def get_backend() -> str:
    """The backend ops use when no ``backend=`` argument is given."""
    if _selected is not None:
        return _selected
    env = os.environ.get("RAGGED_BACKEND")
    if env:
        return _check_name("RAGGED_BACKEND (environment variable)", env.strip().lower())
    return "auto"


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Context manager form of :func:`set_backend`."""
    global _selected
    previous = _selected
    set_backend(name)
    try:
        yield
    finally:
        _selected = previous


# --------------------------------------------------------------------------------------
# Availability of the kernel toolchains (each answers with a reason or None).


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_import_errors: dict[str, str | None] = {}  # module -> why it cannot be imported (None: it can)


@torch.compiler.assume_constant_result
def _import_error(module: str) -> str | None:
    # Under torch.compile this runs eagerly and its answer is a constant of the graph.
    if module not in _import_errors:
        try:
            importlib.import_module(module)
            _import_errors[module] = None
        except Exception as exc:
            hint = "; install ragged[cuda]" if module == "cupy" else ""
            _import_errors[module] = f"{module} cannot be imported ({type(exc).__name__}: {exc}){hint}"
    return _import_errors[module]


def triton_reason(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on ``device`` (None when they can)."""
    err = _import_error("triton")
    if err:
        return err
    if device.type == "cuda":
        return None
    if device.type == "cpu" and triton_interpreted():
        return None
    return f"triton runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got a {device.type} tensor"


def cuda_reason(device: torch.device) -> str | None:
    """Why the CUDA C++ kernels of ``csrc/`` cannot run on ``device`` (None when they can)."""
    if device.type != "cuda":
        return f"the CUDA kernels need a CUDA tensor, got a {device.type} tensor"
    if torch.version.hip is not None:
        return "the CUDA kernels are not built for ROCm"
    return _import_error("cupy")


# --------------------------------------------------------------------------------------
# Per-op registry.


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    fn: Callable
    reasons: Callable[..., list[str]]


@dataclasses.dataclass
class _Op:
    impls: dict[str, Implementation] = dataclasses.field(default_factory=dict)
    # Preference of "auto" for CUDA inputs, fastest measured first: a tuple, or a function
    # of the op's arguments returning one (when the fastest kernel depends on the shapes).
    gpu_order: tuple[str, ...] | Callable[..., tuple[str, ...]] = ("cuda", "triton", "torch")


_OPS: dict[str, _Op] = {}


def register(op: str, name: str, fn: Callable, reasons: Callable[..., list[str]]) -> None:
    if name not in BACKENDS or name == "auto":
        raise ValueError(f"register(): backend name must be one of {BACKENDS[1:]}, got {name!r}")
    _OPS.setdefault(op, _Op()).impls[name] = Implementation(name, fn, reasons)


def set_auto_order(op: str, order: tuple[str, ...] | Callable[..., tuple[str, ...]]) -> None:
    _OPS.setdefault(op, _Op()).gpu_order = order if callable(order) else tuple(order)


def explain(op: str, *args, **kwargs) -> dict[str, list[str]]:
    """For each implementation of ``op``, the reasons it cannot take these arguments."""
    return {name: impl.reasons(*args, **kwargs) for name, impl in _OPS[op].impls.items()}


def select(op: str, backend: str | None, device: torch.device, *args, fn: str | None = None,
           **kwargs) -> Implementation:
    """Pick the implementation of ``op`` for these arguments (see the module docstring).

    ``fn`` names the public function in error messages (default ``ragged.<op>``)."""
    fn = fn or f"ragged.{op}"
    name = get_backend() if backend is None else _check_name(fn, backend)
    entry = _OPS[op]
    if name != "auto":
        impl = entry.impls.get(name)
        if impl is None:
            raise ValueError(f"{fn}(): backend {name!r} has no implementation of this op "
                             f"(available: {sorted(entry.impls)})")
        reasons = impl.reasons(*args, **kwargs)
        if reasons:
            raise ValueError(f"{fn}(): backend {name!r} cannot take this input: " + "; ".join(reasons))
        return impl
    if device.type != "cuda":
        order = ("torch",)
    else:
        order = entry.gpu_order(*args, **kwargs) if callable(entry.gpu_order) else entry.gpu_order
    for candidate in order:
        impl = entry.impls.get(candidate)
        if impl is not None and not impl.reasons(*args, **kwargs):
            return impl
    return entry.impls["torch"]
