"""Cached launches of Triton kernels: a launch's host cost cut to one table lookup and the launch
(``python -m bench.overhead`` measures it).

``kernel[grid](*args, **meta)`` on a ``@triton.jit`` function binds the arguments to the
signature, computes Triton's specialisation of each one, hashes the lot into a cache key
and looks the compiled kernel up, every call. :class:`CachedLaunch` wraps such a kernel
and keeps its own table: the key is the current device, the launch options (``meta``:
constexprs, ``num_warps``, ...) and, per positional argument, exactly what Triton
specialises on (a tensor's dtype and 16-byte alignment; an integer's equality to 1,
divisibility by 16 and width; a float; ``None``). On a hit it calls the compiled kernel's
launcher directly. On a miss, and whenever the fast path does not apply (the interpreter,
a callable grid, an argument of another type, launch hooks installed by a profiler, a
Triton whose launcher has another signature), it runs the normal ``kernel[grid]`` path,
which also compiles.

The wrapped kernel stays reachable as ``.jit`` (ahead-of-time compilation takes it).

:func:`compile_only` turns launches into compiles: inside it a launch compiles the kernel's
variant (on a thread pool, several at once, where Triton has asynchronous compilation) and
runs nothing, so one pass over a piece of code compiles every kernel it will launch in the
time of the slowest compile instead of their sum. Kernels whose outputs other code may use as
indices or lengths (declared ``cached_launch(dry=False)``) compile and run as usual there.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
import triton

try:  # Triton >= 3.0
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton
    _knobs = None

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_I64_MAX = 2**63 - 1
_FAST = True  # cleared for good if a direct launch is refused (another launcher signature)


class _Dry(threading.local):
    """Whether this thread is inside compile_only() (per thread: DataParallel's replicas run
    in threads at once, and one's pass must not stop another's launches)."""

    active = False


_DRY = _Dry()


def _dry_here() -> bool:
    return _DRY.active


def _spec(a):
    """What Triton specialises a positional argument on, as one hashable value (raises
    :class:`_Unsupported` for another type of argument): a tensor's dtype (a 1-tuple of it
    when its data is not 16-byte aligned); an integer's code ``8 | (== 1) | (% 16 == 0) << 1
    | (fits int32) << 2 | (past int64) << 4``; ``float``; ``(bool, value)``; None.
    :func:`_key_function` computes the same values inline."""
    if isinstance(a, torch.Tensor):
        return a.dtype if not a.data_ptr() & 15 else (a.dtype,)
    t = type(a)
    if t is int:
        return 8 | (a == 1) | ((a & 15 == 0) << 1) | ((_I32_MIN <= a <= _I32_MAX) << 2) | ((a > _I64_MAX) << 4)
    if t is float:
        return float
    if t is bool:
        return (bool, a)
    if a is None:
        return None
    raise _Unsupported


class _Unsupported(Exception):
    """An argument the cached path does not key (the normal launch path takes it)."""


_KEY_FUNCTIONS: dict[int, object] = {}


def _key_function(n: int):
    """``f(*args) -> tuple`` of :func:`_spec` over ``n`` positional arguments, with the two
    common cases (a plain tensor, an int) inlined: a launch's key costs about half as much
    as calling ``_spec`` per argument."""
    fn = _KEY_FUNCTIONS.get(n)
    if fn is None:
        names = [f"a{i}" for i in range(n)]
        items = "".join(
            f"\n        ({a}.dtype if not {a}.data_ptr() & 15 else ({a}.dtype,)) if type({a}) is _Tensor else "
            f"(8 | ({a} == 1) | (({a} & 15 == 0) << 1) | ((-2147483648 <= {a} <= 2147483647) << 2) | "
            f"(({a} > {_I64_MAX}) << 4)) if type({a}) is int else _spec({a}),"
            for a in names
        )
        namespace = {"_Tensor": torch.Tensor, "_spec": _spec}
        exec(f"def key({', '.join(names)}):\n    return ({items}\n    )\n", namespace)
        fn = _KEY_FUNCTIONS[n] = namespace["key"]
    return fn


def _hook_set(hook) -> bool:
    # None, or (newer Triton) a chain of hooks that may be empty
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


def _hooks_installed() -> bool:
    """True when a profiler or a user installed Triton launch hooks (they expect the normal path)."""
    if _knobs is None:
        return True
    runtime = _knobs.runtime
    return _hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook)


class CachedLaunch:
    """A ``@triton.jit`` kernel with a cached launch path; ``kernel[grid](*args, **meta)``
    as for the kernel itself (constexprs by keyword, runtime arguments by position)."""

    def __init__(self, jit, dry: bool = True) -> None:
        self.jit = jit
        self.dry = dry  # whether compile_only() may skip its launches (no output used as an index)
        self._direct = isinstance(jit, triton.runtime.JITFunction)
        if self._direct:
            params = list(inspect.signature(jit.fn).parameters.values())
            self._names = [p.name for p in params]
            self._defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self._table: dict = {}
        self._keys: dict = {}  # number of positional arguments -> its key function

    def __getattr__(self, name):
        return getattr(self.jit, name)

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launch(grid, args, meta)

    def launch(self, grid, args: tuple, meta: dict):
        if _DRY.active and self.dry and self._direct:
            return self.jit.run(*args, grid=grid, warmup=True, **meta)
        if not (self._direct and _FAST) or callable(grid):
            return self.jit[grid](*args, **meta)
        key_fn = self._keys.get(len(args))
        if key_fn is None:
            key_fn = self._keys[len(args)] = _key_function(len(args))
        try:
            spec = key_fn(*args)
        except _Unsupported:
            return self.jit[grid](*args, **meta)
        if _hooks_installed():
            return self.jit[grid](*args, **meta)
        device = torch._C._cuda_getDevice()
        key = (device, spec, tuple(meta.items()))
        try:
            entry = self._table.get(key)
        except TypeError:  # an unhashable launch option
            return self.jit[grid](*args, **meta)
        if entry is None:
            compiled = self.jit[grid](*args, **meta)
            tail = []
            for name in self._names[len(args) :]:
                if name in meta:
                    tail.append(meta[name])
                elif name in self._defaults:
                    tail.append(self._defaults[name])
                else:  # a runtime argument given by keyword: not for the fast path
                    return compiled
            self._table[key] = (compiled, tuple(tail))
            return compiled
        compiled, tail = entry
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        try:
            compiled.run(
                grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *tail
            )
        except TypeError:  # another launcher signature: the normal path from now on
            _disable()
            return self.jit[grid](*args, **meta)
        return compiled


def _disable() -> None:
    global _FAST
    _FAST = False


def cached_launch(jit=None, *, dry: bool = True):
    """Decorator: ``@cached_launch`` above ``@triton.jit`` on a kernel launched with a grid;
    ``@cached_launch(dry=False)`` on one whose outputs other code may read as indices or
    lengths (:func:`compile_only` then runs it as usual)."""
    if jit is None:
        return lambda fn: CachedLaunch(fn, dry)
    return CachedLaunch(jit, dry)


def _async_mode():
    """Triton's asynchronous compilation (Triton >= 3.4), or None."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # pragma: no cover - older Triton: the compiles run one after another
        return None
    return AsyncCompileMode


class _CompilePool(ThreadPoolExecutor):
    """A thread pool whose compile jobs also build the compiled kernel's host launcher (a C
    module Triton builds with the system compiler, on disk in Triton's cache), which Triton
    would otherwise build on the main thread at the kernel's first launch."""

    def submit(self, fn, /, *args, **kwargs):
        def job():
            kernel = fn(*args, **kwargs)
            _build_launcher(kernel)
            return kernel

        return super().submit(job)


def _build_launcher(kernel) -> None:
    try:
        from triton.runtime.driver import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # another Triton: the launcher is built at the first launch, as usual
        pass


@contextlib.contextmanager
def compile_only(workers: int | None = None) -> Iterator[None]:
    """Within, on this thread: a launch of a cached kernel (one not declared ``dry=False``) compiles the
    variant its arguments ask for and runs nothing; the outputs it would write stay as they
    were. The compiles run on ``workers`` threads (default: the CPU count, at most 16; Triton
    compiles mostly outside the GIL) and are all finished, and in Triton's in-memory cache, when
    the block ends; a compile error is raised there. Not reentrant; the code inside must not
    read the skipped kernels' outputs as indices or lengths, nor depend on their values."""
    if _DRY.active:
        raise RuntimeError("compile_only(): already inside a compile_only() block")
    mode = _async_mode()
    n = workers or min(16, os.cpu_count() or 1)
    with contextlib.ExitStack() as stack:
        if mode is not None and n > 1:  # (interpreted kernels are no JITFunction: they just run)
            pool = stack.enter_context(_CompilePool(n, thread_name_prefix="ragged-compile"))
            stack.enter_context(mode(pool))
        _DRY.active = True
        try:
            yield
        finally:
            _DRY.active = False
