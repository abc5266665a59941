"""Which implementation of an op runs: ``"torch"`` | ``"triton"`` | ``"cuda"`` | ``"auto"``.

The choice is made, in this order, from

1. the ``backend=`` argument of the op,
2. the innermost active :func:`use_backend` context of the calling thread or asyncio task,
3. :func:`set_backend`, the process-wide default,
4. the ``RAGGED_BACKEND`` environment variable,
5. ``"auto"``.

:func:`use_backend` lives in a :class:`contextvars.ContextVar`: each thread and each
asyncio task sees its own, so one thread's ``with ragged.use_backend("triton"):`` never
changes what another thread runs, and contexts entered and left in any order restore
their own previous value. :func:`set_backend` changes the default of every thread.

Every implementation of an op is an :class:`Implementation`, declared beside its kernels
with what it takes as data (dtypes, allowed values and maxima of the op's spec fields) and a
``check(spec)`` for the rest; :meth:`Implementation.reasons` returns the reasons it cannot
take an input of a given spec (an empty list when it can). On CUDA inputs ``"auto"`` walks
the op's implementations by the ``rank`` each declares beside its kernels (measured; see
``bench/results/``; :meth:`OpEntry.gpu_preference`) and takes the first with no reasons (on
other devices the reference); the pure-torch reference takes everything, so auto never fails. A forced backend
that cannot take an input raises ``ValueError`` with its reasons. :func:`ragged.explain` (:mod:`ragged.explain`)
reports every implementation's reasons for an input. :func:`select_spec` is the one place a backend
is chosen. A new backend is :func:`register_backend` plus its implementations
(:func:`register`); see ``ARCHITECTURE.md``.

Under ``torch.compile`` the selection is read when a function is traced, and a
``use_backend`` block inside the compiled function works as in eager mode. A change of
:func:`set_backend` makes a compiled function retrace; the :func:`use_backend` block
around the call does not (torch.compile cannot guard on a ContextVar), so a compiled
function keeps the backend of the block it was first traced in: pass ``backend=`` to the
op, or call ``torch._dynamo.reset()``, to choose again.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import importlib.util
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .utils import assume_constant_result

BACKENDS: tuple[str, ...] = ("auto", "torch", "triton", "cuda")

_selected: str | None = None  # set_backend(): the process-wide default

# use_backend(): the choice of the calling thread / asyncio task, None where no block is open
# (read on every op, so kept apart from the stack below).
_active: contextvars.ContextVar[str | None] = contextvars.ContextVar("ragged_backend", default=None)

# The use_backend() blocks open in this context, innermost last, each a fresh 1-tuple
# (name,) found by identity on exit. A ContextVar token would restore the value from before
# its own block, which is wrong when blocks close out of order (two async generators each
# inside a block, an ExitStack closed by hand); removing the block from an immutable stack
# is right in any order, and the stack a child task inherits never changes with its
# parent's exits.
_stack: contextvars.ContextVar[tuple[tuple[str | None], ...]] = contextvars.ContextVar(
    "ragged_backend_stack", default=()
)

# The innermost use_backend() block of a function that torch.compile is tracing, as (name,).
_traced: tuple[str | None] | None = None


def check_name(fn: str, name: object) -> str:
    """``name`` if it is a backend (or ``"auto"``), else ``ValueError`` naming the function ``fn``."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"{fn}(): expected backend to be one of {BACKENDS}, got {name!r}")
    return name


@assume_constant_result
def _active_backend() -> str | None:
    # torch.compile cannot trace ContextVar.get: marked constant, the value is read when a
    # function is traced and becomes a constant of its graph (unguarded).
    return _active.get()


def set_backend(name: str | None) -> None:
    """Select the backend for every op in every thread (``None`` returns to the environment /
    ``"auto"``). Where a :func:`use_backend` block is open, the block still decides."""
    global _selected
    _selected = None if name is None else check_name("ragged.set_backend", name)


def get_backend() -> str:
    """The backend ops use when no ``backend=`` argument is given (see the module docstring)."""
    traced = _traced
    name = _active_backend() if traced is None else traced[0]
    if name is not None:
        return name
    if _selected is not None:
        return _selected
    env = os.environ.get("RAGGED_BACKEND")
    if env:
        return check_name("RAGGED_BACKEND (environment variable)", env.strip().lower())
    return "auto"


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Select the backend for the calling thread / asyncio task inside the ``with`` block.

    ``None`` steps out of any enclosing block: the process default applies inside
    (:func:`set_backend`, then ``RAGGED_BACKEND``, then ``"auto"``). Asyncio tasks created
    inside the block inherit the selection (a task copies its creator's context); a new
    thread starts without it, unless run through ``contextvars.copy_context().run``.
    On exit the selection of this thread / task is what it would be had the block never
    been entered, also when blocks are left in another order than they were entered.
    Usable as a decorator.
    """
    global _traced
    name = None if name is None else check_name("ragged.use_backend", name)
    entry = (name,)
    if torch.compiler.is_compiling():
        # Traced code cannot set a ContextVar. A global set and restored inside the traced
        # frame is seen by the ops traced in the block and leaves nothing behind.
        previous, _traced = _traced, entry
        try:
            yield
        finally:
            _traced = previous
        return
    _stack.set(_stack.get() + (entry,))
    _active.set(name)
    try:
        yield
    finally:
        _leave(entry)


def _leave(entry: tuple[str | None]) -> None:
    stack = _stack.get()
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is entry:
            stack = stack[:i] + stack[i + 1 :]
            _stack.set(stack)
            _active.set(stack[-1][0] if stack else None)
            return
    # Not in this context's stack: the block is left in another context than the one it was
    # entered in (a generator finalized elsewhere); this context has nothing of it to undo.


# --------------------------------------------------------------------------------------
# Availability of the kernel toolchains (each answers with a reason or None).


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_import_errors: dict[str, str | None] = {}  # module -> why it cannot be imported (None: it can)


@assume_constant_result
def import_error(module: str) -> str | None:
    # Under torch.compile this runs eagerly and its answer is a constant of the graph.
    if module not in _import_errors:
        try:
            importlib.import_module(module)
            _import_errors[module] = None
        except Exception as exc:
            hint = '; install ragged-kernels[cuda] (pip install -e ".[cuda]" from a clone)' if module == "cupy" else ""
            _import_errors[module] = f"{module} cannot be imported ({type(exc).__name__}: {exc}){hint}"
    return _import_errors[module]


def triton_reason(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on ``device`` (None when they can)."""
    err = import_error("triton")
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
    if _AOT_BUILT:  # ragged._C: no CuPy needed (the launcher says if it lacks the device's arch)
        return None
    why = import_error("cupy")
    return None if why is None else f"{why} (or build ragged._C: RAGGED_BUILD_CUDA=1 pip install .)"


# Whether the ahead-of-time binary is installed, looked up once at import (not in a traced call)
_AOT_BUILT = importlib.util.find_spec("ragged._C") is not None


# --------------------------------------------------------------------------------------
# Backends and their implementations.
#
# A backend is a name and the reason it cannot run on a device (its toolchain); an
# implementation is one backend's kernels for one op, declared beside them as data: the
# dtypes, values and maxima of the op's spec fields it takes, plus a ``check`` for the rest.
# Each op declares (ragged.opdef.define) the function that turns its operands into its
# frozen spec; every reason reads that spec, so the choice is made here and nowhere else.

_BACKEND_REASONS: dict[str, Callable[[torch.device], str | None]] = {}


def register_backend(name: str, device_reason: Callable[[torch.device], str | None]) -> None:
    """Make ``name`` a backend: ``device_reason(device)`` says why it cannot run on a device
    (None when it can). Its implementations are then registered with :func:`register`."""
    global BACKENDS
    if not isinstance(name, str) or not name.isidentifier() or name == "auto":
        raise ValueError(
            f"ragged.backends.register_backend(): expected a backend name (an identifier other than "
            f"'auto'), got {name!r}"
        )
    _BACKEND_REASONS[name] = device_reason
    if name not in BACKENDS:
        BACKENDS = (*BACKENDS, name)


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One backend's implementation of one op.

    ``forward`` / ``backward``: the functions (or ``"module:function"``, imported on first use,
    so that declaring a backend imports none of its toolchain). What the implementation takes
    is data read from the op's spec: ``dtypes`` (of ``spec.dtype``), ``limits`` (spec field ->
    the values taken), ``maxima`` (spec field -> the largest value taken); ``check(spec)``
    returns the reasons the data cannot express. ``backward_backend``: the backend whose
    backward runs after this forward (a forward-only kernel). ``extras``: further entry points
    by name (e.g. a fused dropout backward) that callers such as the layer core look up rather
    than test a backend's name. ``variant``: a second implementation of the same backend (the
    sm_90 attention kernels beside Triton's portable ones), registered as
    ``<backend>_<variant>``; a forced backend runs the best-ranked of its implementations that
    takes the input, ``"auto"`` the best-ranked of all."""

    op: str
    backend: str
    forward: Callable | str
    backward: Callable | str | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    limits: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    maxima: Mapping[str, int] = dataclasses.field(default_factory=dict)
    check: Callable[[Any], list[str]] | None = None
    backward_backend: str | None = None
    extras: Mapping[str, Callable | str] = dataclasses.field(default_factory=dict)
    # The preference of "auto" on CUDA inputs, lower first, from measurements (bench/results):
    # a number, or a function of the spec where the faster kernel depends on the shapes; None
    # (the torch reference): after every ranked implementation.
    rank: float | Callable[[Any], float] | None = None
    variant: str = ""
    # The optional operands it reads (fields of the op's record with a default), None: every one.
    # A call that gives another one a value (the spec's ``operands_used``) is declined with a
    # reason: an operand added to an op is refused by every implementation that does not read it.
    operands: frozenset[str] | None = None

    @property
    def name(self) -> str:
        """The implementation's name in the registry (and the last operand of its op)."""
        return f"{self.backend}_{self.variant}" if self.variant else self.backend

    def rank_for(self, spec) -> float:
        """This implementation's place in ``"auto"``'s order for a CUDA input of ``spec`` (an
        implementation :func:`prefer` names comes before every rank)."""
        rank = self.rank
        if rank is None:
            return math.inf
        return rank(spec) if callable(rank) else rank

    @functools.cached_property
    def forward_fn(self) -> Callable:
        return _resolve(self.forward)

    @functools.cached_property
    def backward_fn(self) -> Callable:
        if self.backward_backend is not None:
            return implementation(self.op, self.backward_backend).backward_fn
        if self.backward is None:
            raise NotImplementedError(f"the {self.backend} implementation of {self.op} has no backward")
        return _resolve(self.backward)

    def extra(self, key: str) -> Callable | None:
        """The entry point ``key`` of :attr:`extras` (imported on first use), None if not declared."""
        fn = self.extras.get(key)
        return None if fn is None else _resolve(fn)

    def reasons(self, spec) -> list[str]:
        """Why this implementation cannot take an input of this spec (empty when it can)."""
        reason = _BACKEND_REASONS[self.backend](spec.device)
        out = [reason] if reason else []
        if self.dtypes is not None and spec.dtype not in self.dtypes:
            out.append(f"{self.backend} {self.op} takes {_dtype_names(self.dtypes)}, got {spec.dtype}")
        if self.limits:
            for field, allowed in self.limits.items():
                value = getattr(spec, field)
                if value not in allowed:
                    out.append(f"{self.backend} {self.op} takes {field.replace('_', ' ')}s {allowed}, got {value!r}")
        if self.maxima:
            for field, top in self.maxima.items():
                value = getattr(spec, field)
                if value > top:
                    out.append(f"{self.backend} {self.op} takes {field.replace('_', ' ')} <= {top}, got {value}")
        if self.operands is not None:
            unread: frozenset[str] = getattr(spec, "operands_used", frozenset()) - self.operands
            out.extend(f"{self.backend} {self.op} does not take {name}" for name in sorted(unread))
        if self.check is not None and not out:
            out.extend(self.check(spec))
        return out


_RESOLVED: dict[str, Callable] = {}


def _resolve(fn: Callable | str) -> Callable:
    if callable(fn):
        return fn
    found = _RESOLVED.get(fn)
    if found is None:
        module, _, attr = fn.partition(":")
        found = _RESOLVED[fn] = getattr(importlib.import_module(module), attr)
    return found


@dataclasses.dataclass
class OpEntry:
    """An op in the registry: its spec function, its implementations by backend name and the
    preference order of ``"auto"`` on CUDA inputs."""

    spec: Callable[..., Any]  # operands -> the op's frozen spec
    impls: dict[str, Implementation] = dataclasses.field(default_factory=dict)
    variants: bool = False  # whether a backend has more than one implementation
    op: str = ""
    # (implementation names, their order) while no rank depends on the spec
    _static: tuple[tuple[str, ...], tuple[str, ...]] | None = dataclasses.field(default=None, repr=False)

    def gpu_preference(self, spec) -> tuple[str, ...]:
        """The backends of ``"auto"`` for a CUDA input of ``spec``, by their implementations'
        measured ranks (lowest first; equal ranks in registration order)."""
        impls = self.impls
        preferred = _preferred_name(self.op)
        if preferred is not None and preferred in impls:
            rest = tuple(n for n in self.gpu_preference_by_rank(spec) if n != preferred)
            return (preferred, *rest)
        return self.gpu_preference_by_rank(spec)

    def gpu_preference_by_rank(self, spec) -> tuple[str, ...]:
        """:meth:`gpu_preference` without preferences: the measured ranks alone."""
        impls = self.impls
        names = tuple(impls)
        static = self._static
        if static is not None and static[0] == names:
            return static[1]
        order = tuple(sorted(names, key=lambda n: impls[n].rank_for(spec)))
        if not any(callable(impls[n].rank) for n in names):
            self._static = (names, order)
        return order


_OPS: dict[str, OpEntry] = {}
_PENDING: dict[str, list[Implementation]] = {}  # implementations declared before their op


def declare_op(op: str, spec: Callable[..., Any]) -> None:
    """Called by :func:`ragged.opdef.define`: the op and its spec function."""
    entry = _OPS[op] = OpEntry(spec, op=op)
    for impl in _PENDING.pop(op, ()):
        entry.impls[impl.name] = impl
        entry.variants = entry.variants or bool(impl.variant)


def register(*impls: Implementation) -> None:
    """Register implementations (of ops defined now or later)."""
    for impl in impls:
        if impl.backend not in _BACKEND_REASONS:
            raise ValueError(
                f"ragged.backends.register(): unknown backend {impl.backend!r} (register_backend() "
                f"first; known: {sorted(_BACKEND_REASONS)})"
            )
        entry = _OPS.get(impl.op)
        if entry is None:
            _PENDING.setdefault(impl.op, []).append(impl)
        else:
            entry.impls[impl.name] = impl
            entry.variants = entry.variants or bool(impl.variant)


def implementations(op: str) -> dict[str, Implementation]:
    """The registry's own dict of ``op``'s implementations by backend name (filled as they register)."""
    return _OPS[op].impls


def implementation(op: str, name: str) -> Implementation:
    """The registered implementation ``name`` of ``op`` (a backend's name, or
    ``<backend>_<variant>``; KeyError when there is none)."""
    return _OPS[op].impls[name]


def op_entry(op: str) -> OpEntry | None:
    """The registry's entry of ``op`` (None when there is no such op). An op registers when its
    module is imported, and ``import ragged`` imports every op module (``ragged/__init__.py``)."""
    return _OPS.get(op)


def op_names() -> list[str]:
    """The names of the registered ops, sorted."""
    return sorted(_OPS)


class ChoiceCaptured(BaseException):
    """Raised by :func:`select_spec` inside :func:`capturing_choice`, at the point where a call
    would pick a backend: the op and the spec it would pick for. A BaseException: no ``except
    Exception`` on the way up may swallow it."""

    def __init__(self, op: str, spec):
        super().__init__(op)
        self.op, self.spec = op, spec


_EXPLAIN = "<explain>"  # the value of _active inside capturing_choice()


@contextlib.contextmanager
def capturing_choice() -> Iterator[None]:
    """A block in which the first choice of a backend raises :class:`ChoiceCaptured` instead
    of choosing (what :func:`ragged.explain` runs a public function under); ``use_backend``
    blocks outside it do not apply inside."""
    stack_token = _stack.set(())
    token = _active.set(_EXPLAIN)
    try:
        yield
    finally:
        _active.reset(token)
        _stack.reset(stack_token)


def select(
    op: str, backend: str | None, device: torch.device, *args, fn: str | None = None, **kwargs
) -> Implementation:
    """Pick the implementation of ``op`` for these operands (see the module docstring): the
    op's spec function makes them its spec, and :func:`select_spec` chooses."""
    return select_spec(op, backend, _OPS[op].spec(*args, **kwargs), fn=fn)


def select_spec(op: str, backend: str | None, spec, *, fn: str | None = None) -> Implementation:
    """Pick the implementation of ``op`` for an input of this spec: the one place a backend is
    chosen. ``fn`` names the public function in error messages (default ``ragged.<op>``)."""
    name = get_backend() if backend is None else check_name(fn or f"ragged.{op}", backend)
    entry = _OPS[op]
    if name != "auto":
        if name is _EXPLAIN:
            raise ChoiceCaptured(op, spec)
        return forced_choice(entry, name, spec, fn or f"ragged.{op}")
    return auto_choice(entry, spec)


def forced_choice(entry: OpEntry, backend: str, spec, fn: str) -> Implementation:
    """A forced backend: the best-ranked of its implementations that takes ``spec`` (its one
    implementation, for most ops); ``ValueError`` with the reasons when none does."""
    impl = entry.impls.get(backend)
    if impl is not None and not entry.variants:  # one implementation per backend: the common case
        reasons = impl.reasons(spec)
        if reasons:
            raise ValueError(f"{fn}(): backend {backend!r} cannot take this input: " + "; ".join(reasons))
        return impl
    own = [i for i in entry.impls.values() if i.backend == backend]
    if not own:
        raise ValueError(
            f"{fn}(): backend {backend!r} has no implementation of this op (available: "
            f"{sorted({i.backend for i in entry.impls.values()})})"
        )
    preferred = _preferred_name(entry.op)
    if spec.device.type == "cuda":
        own.sort(key=lambda i: -math.inf if i.name == preferred else i.rank_for(spec))
    else:  # the backend's own implementation first, unless another is preferred
        own.sort(key=lambda i: 0 if i.name == preferred else 1 if not i.variant else 2)
    for candidate in own:
        if not candidate.reasons(spec):
            return candidate
    primary = impl if impl is not None else own[0]
    raise ValueError(f"{fn}(): backend {backend!r} cannot take this input: " + "; ".join(primary.reasons(spec)))


# --------------------------------------------------------------------------------------
# Preferences: an implementation named to come first where it can take the input (the sm_90
# attention kernels switched on or off, in a benchmark or by the environment), read here and
# shown by ragged.explain, never inside an implementation.

_PREFERRED: dict[str, str] = {}  # prefer(): op -> implementation name ("": none), process-wide


def _env_preferences() -> dict[str, str]:
    """``RAGGED_PREFER="op=implementation,..."``, and ``RAGGED_ATTENTION_HOPPER`` (``1``: the sm_90
    attention kernels, forward and backward, wherever they take the call; ``0``: the portable
    Triton kernels; ``auto``, the default: ``"auto"``'s measured ranks)."""
    out: dict[str, str] = {}
    hopper = os.environ.get("RAGGED_ATTENTION_HOPPER", "auto")
    if hopper not in ("auto", "0", "1"):
        raise ValueError(f"RAGGED_ATTENTION_HOPPER (environment variable): expected 1, 0 or auto, got {hopper!r}")
    if hopper != "auto":
        out["attention"] = "triton_sm90_full" if hopper == "1" else "triton"
    for item in filter(None, (p.strip() for p in os.environ.get("RAGGED_PREFER", "").split(","))):
        op, sep, name = item.partition("=")
        if not sep or not op.strip() or not name.strip():
            raise ValueError(f"RAGGED_PREFER (environment variable): expected op=implementation[,...], got {item!r}")
        out[op.strip()] = name.strip()
    return out


def _preferred_name(op: str) -> str | None:
    """The implementation of ``op`` preferred now (a :func:`prefer` block, else the environment)."""
    if op in _PREFERRED:
        return _PREFERRED[op] or None
    if "RAGGED_PREFER" not in os.environ and "RAGGED_ATTENTION_HOPPER" not in os.environ:
        return None
    return _env_preferences().get(op)


def preferences() -> dict[str, str]:
    """The implementations preferred now, by op (a :func:`prefer` block over the environment)."""
    out = {**_env_preferences(), **_PREFERRED}
    return {op: name for op, name in out.items() if name}


@contextlib.contextmanager
def prefer(op: str, name: str | None) -> Iterator[None]:
    """In this block, implementation ``name`` of ``op`` comes first wherever it can take the input
    (``"auto"`` and a forced backend of its own alike); None: no preference, the environment's
    neither. Process-wide, not per thread: the backward of a call made inside the block runs on
    autograd's own thread and must see the same choice."""
    if op not in _OPS:
        raise ValueError(f"ragged.backends.prefer(): unknown op {op!r} (known: {op_names()})")
    if name is not None and name not in _OPS[op].impls:
        raise ValueError(
            f"ragged.backends.prefer(): {op} has no implementation {name!r} (known: {sorted(_OPS[op].impls)})"
        )
    had, before = op in _PREFERRED, _PREFERRED.get(op, "")
    _PREFERRED[op] = name or ""
    try:
        yield
    finally:
        if had:
            _PREFERRED[op] = before
        else:
            _PREFERRED.pop(op, None)


def auto_choice(entry: OpEntry, spec) -> Implementation:
    """``"auto"``: the first implementation, by measured rank on CUDA inputs, that takes ``spec``."""
    order = entry.gpu_preference(spec) if spec.device.type == "cuda" else ("torch",)
    for candidate in order:
        impl = entry.impls.get(candidate)
        if impl is not None and not impl.reasons(spec):
            return impl
    return entry.impls["torch"]


register_backend("torch", lambda device: None)
register_backend("triton", triton_reason)
register_backend("cuda", cuda_reason)
