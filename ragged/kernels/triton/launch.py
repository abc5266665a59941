"""Cached launches of Triton kernels: the host cost of a launch cut from about 20 us to 5-8 us.

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
"""

from __future__ import annotations

import inspect

import torch
import triton

try:  # Triton >= 3.0
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton
    _knobs = None

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_I64_MAX = 2**63 - 1
_FAST = True  # cleared for good if a direct launch is refused (another launcher signature)


def _spec(a):
    """What Triton specialises a positional argument on, or ``NotImplemented``."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    t = type(a)
    if t is int:
        return (a == 1, a & 15 == 0, _I32_MIN <= a <= _I32_MAX, a <= _I64_MAX)
    if t is float:
        return float
    if t is bool:
        return (bool, a)
    if a is None:
        return None
    return NotImplemented


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

    def __init__(self, jit) -> None:
        self.jit = jit
        self._direct = isinstance(jit, triton.runtime.JITFunction)
        if self._direct:
            params = list(inspect.signature(jit.fn).parameters.values())
            self._names = [p.name for p in params]
            self._defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self._table: dict = {}

    def __getattr__(self, name):
        return getattr(self.jit, name)

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launch(grid, args, meta)

    def launch(self, grid, args: tuple, meta: dict):
        if not (self._direct and _FAST) or callable(grid):
            return self.jit[grid](*args, **meta)
        spec = tuple(_spec(a) for a in args)
        if NotImplemented in spec or _hooks_installed():
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
            for name in self._names[len(args):]:
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
            compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None,
                         *args, *tail)
        except TypeError:  # another launcher signature: the normal path from now on
            _disable()
            return self.jit[grid](*args, **meta)
        return compiled


def _disable() -> None:
    global _FAST
    _FAST = False


def cached_launch(jit) -> CachedLaunch:
    """Decorator: ``@cached_launch`` above ``@triton.jit`` on a kernel launched with a grid."""
    return CachedLaunch(jit)
