"""Loads the CUDA C++ kernels of ``csrc/`` and launches them on torch tensors.

The kernels are compiled at first use through CuPy's NVRTC, so installing ragged needs no
build step; and only the kernel a launch asks for is compiled, not the whole file. A source
defines its ``extern "C"`` entry points by top-level instantiation lines (macro invocations
such as ``RAGGED_ATTENTION_SHORT_TYPES(64, 32, 2, 10)``); :func:`programs` reads them from the
source text itself (the file's ``#define`` s, expanded down to the innermost macro that writes
an ``extern "C"`` definition) and gives each kernel its own program: the whole file with the
instantiation lines blanked (shared code and line numbers kept), then the one macro invocation
that defines it. There is no table of kernels beside the sources, and each ``.cu`` file still
compiles as a whole with every kernel (the nvcc check; an ahead-of-time build).

A program is compiled once per (kernel, device) in this process (CuPy's disk cache, keyed by
the program text and options, keeps it across processes); :func:`precompile` compiles a list
of kernels concurrently (NVRTC runs without the GIL). Kernels are launched on torch's current
stream of the tensor's device, with raw ``data_ptr()`` arguments: no copies, no sync.

Ahead of time: where ``ragged._C`` is installed (``RAGGED_BUILD_CUDA=1``; ``setup.py``) and holds
the device's architecture, a kernel's CUfunction comes from that binary instead of NVRTC (no
compile, no CuPy); the launch itself is the same driver call. ``RAGGED_CUDA_LAUNCH=aot|jit``
forces one (:func:`launch_path`); :func:`build_info` says which is in use.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import difflib
import functools
import importlib
import importlib.resources
import os
import pathlib
import struct
import threading
import types
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from .instances import Program
from .instances import parse as _parse


@functools.cache
def source(name: str) -> str:
    """Text of ``csrc/<name>`` (installed as the ``ragged._csrc`` package data)."""
    try:
        return importlib.resources.files("ragged._csrc").joinpath(name).read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        return (pathlib.Path(__file__).resolve().parents[3] / "csrc" / name).read_text()


# --------------------------------------------------------------------------------------
# One program per kernel, read from the source text (the parser: :mod:`.instances`)


@functools.cache
def programs(src_name: str) -> Mapping[str, Program]:
    """Kernel name -> its :class:`Program`, for every ``extern "C"`` kernel ``csrc/<src_name>``
    instantiates, read from the source text (see the module docstring); read-only."""
    return types.MappingProxyType(_parse(src_name, source(src_name)))


def program(src_name: str, kernel: str) -> Program:
    """The :class:`Program` that defines ``kernel`` in ``csrc/<src_name>``."""
    table = programs(src_name)
    prog = table.get(kernel)
    if prog is None:
        close = difflib.get_close_matches(kernel, list(table), n=3)
        hint = f"; closest: {', '.join(close)}" if close else ""
        raise ValueError(
            f"ragged.kernels.cuda.launch.program(): csrc/{src_name} defines no kernel {kernel!r} "
            f"(it instantiates {len(table)} kernels{hint})"
        )
    return prog


_OPTIONS = ("-std=c++17",)
# (source, the program's first kernel, device index) -> the compiled cupy.RawModule
_modules: dict[tuple[str, str, int], object] = {}
_compile_locks: dict[tuple[str, str, int], threading.Lock] = {}
_functions: dict[tuple[str, int], object] = {}
_streams: dict[int, object] = {}


def _module(prog: Program, index: int):
    key = (prog.source, prog.kernels[0], index)
    mod = _modules.get(key)
    if mod is None:
        with _compile_locks.setdefault(key, threading.Lock()):  # one compile per program, whichever thread asks
            mod = _modules.get(key)
            if mod is None:
                import cupy

                with cupy.cuda.Device(index):
                    mod = cupy.RawModule(code=prog.text, options=_OPTIONS)
                    mod.compile()
                _modules[key] = mod
    return mod


def precompile(items, device=None, max_workers: int | None = None) -> None:
    """Compile the kernels ``items`` names, ``(src_name, kernel)`` pairs, for ``device`` (a
    ``torch.device``, an index, or None: the current device), each program once, concurrently
    in a pool of threads (NVRTC's compile runs without the GIL); returns when all are loaded.
    Unknown names raise before anything compiles; a failed compile raises once all are done."""
    if device is None:
        index = _current_device()
    elif isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        index = device.index if device.index is not None else _current_device()
    wanted = [(src_name, kernel, program(src_name, kernel)) for src_name, kernel in items]
    if launch_path(index) == "aot":  # nothing to compile: the binary's functions are looked up
        for src_name, kernel, _ in wanted:
            _function(src_name, kernel, index)
        return
    todo: dict[tuple[str, str], Any] = {}
    for _, kernel, prog in wanted:
        if (kernel, index) not in _functions:
            todo.setdefault((prog.source, prog.kernels[0]), prog)
    if len(todo) > 1:
        workers = max(1, min(len(todo), max_workers or os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ragged-nvrtc") as pool:
            futures = [pool.submit(_module, prog, index) for prog in todo.values()]
        for f in futures:  # every compile has ended: the first failure, if any
            f.result()
    for src_name, kernel, _ in wanted:
        _function(src_name, kernel, index)


def _raw_stream(index: int) -> int:
    try:  # the handle alone, without building a torch.cuda.Stream object on every launch
        return torch._C._cuda_getCurrentRawStream(index)
    except AttributeError:  # pragma: no cover - older torch
        return torch.cuda.current_stream(index).cuda_stream


def _current_device() -> int:
    try:
        return torch._C._cuda_getDevice()
    except AttributeError:  # pragma: no cover - older torch
        return torch.cuda.current_device()


# --------------------------------------------------------------------------------------
# Parameter lists and the driver's launch


_NUMPY_TYPES = {"P": np.uint64, "q": np.int64, "i": np.int32, "I": np.uint32, "f": np.float32}


class Params:
    """A kernel's parameter list, one code per parameter: ``P`` pointer (an int address),
    ``q`` int64, ``i`` int32, ``I`` uint32, ``f`` float32.

    :meth:`pack` lays the values out as the kernel's ABI does (each parameter at its natural
    alignment, the C layout of a struct of them), the buffer ``cuLaunchKernel`` takes through
    ``CU_LAUNCH_PARAM_BUFFER_POINTER``; :meth:`scalars` gives the typed NumPy scalars of the
    CuPy launch (the fallback path)."""

    def __init__(self, codes: str) -> None:
        unknown = set(codes) - set(_NUMPY_TYPES)
        if unknown:
            raise ValueError(f"ragged.kernels.cuda.Params(): unknown parameter codes {sorted(unknown)}")
        self.codes = codes
        self._struct = struct.Struct("@" + codes.replace("P", "Q"))
        self._types = tuple(_NUMPY_TYPES[c] for c in codes)
        self.size = ctypes.c_size_t(self._struct.size)
        self.size_pointer = ctypes.pointer(self.size)

    def pack(self, values) -> bytes:
        return self._struct.pack(*values)

    def scalars(self, values) -> tuple:
        return tuple(t(v) for t, v in zip(self._types, values))


class _LaunchExtra(ctypes.Structure):
    # cuLaunchKernel's `extra` array: BUFFER_POINTER, buffer, BUFFER_SIZE, &size, END.
    _fields_ = [
        ("buffer_key", ctypes.c_void_p),
        ("buffer", ctypes.c_char_p),
        ("size_key", ctypes.c_void_p),
        ("size", ctypes.POINTER(ctypes.c_size_t)),
        ("end", ctypes.c_void_p),
    ]


_CU_LAUNCH_PARAM_BUFFER_POINTER = 1
_CU_LAUNCH_PARAM_BUFFER_SIZE = 2
_driver_launch: list = []  # [cuLaunchKernel through ctypes, or None where the driver library is not found]


def _load_driver_launch():
    """``cuLaunchKernel`` of the CUDA driver library (the one CuPy and torch use), or None."""
    import ctypes.util

    names = ["libcuda.so.1", "libcuda.so", "nvcuda.dll"]
    found = ctypes.util.find_library("cuda")
    if found:
        names.append(found)
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        fn = lib.cuLaunchKernel
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        fn.restype = ctypes.c_int
        return fn
    return None


def _driver():
    if not _driver_launch:
        _driver_launch.append(_load_driver_launch() if DRIVER_LAUNCH else None)
    return _driver_launch[0]


# Launch through the driver directly, without CuPy's per-argument handling on the host
# (bench/results/launch_paths_h200_b205004.md); False: always through CuPy.
DRIVER_LAUNCH = True


# --------------------------------------------------------------------------------------
# Ahead of time (ragged._C) or just in time (NVRTC)

LAUNCH_VARIABLE = "RAGGED_CUDA_LAUNCH"  # "aot", "jit" or "auto" (default: aot where _C holds the arch)
_aot_state: list = []  # [(ragged._C or None, why not)] once looked up
_paths: dict[int, str] = {}  # device index -> "aot" or "jit", chosen at its first launch


def aot_module():
    """``(ragged._C, None)`` when the ahead-of-time build is installed, else ``(None, why)``."""
    if not _aot_state:
        try:
            _C = importlib.import_module("ragged._C")  # the compiled extension beside the package
        except ImportError as exc:
            _aot_state.append((None, f"ragged._C is not built ({exc}); RAGGED_BUILD_CUDA=1 pip install . builds it"))
        else:
            _aot_state.append((_C, None))
    return _aot_state[0]


def aot_reason(index: int) -> str | None:
    """Why ``ragged._C`` cannot launch on device ``index`` (None when it can): not built, or no
    machine code for the device's architecture (nor PTX the driver can compile for it)."""
    module, why = aot_module()
    if module is None:
        return why
    major, minor = torch.cuda.get_device_capability(index)
    arch, archs, ptx = 10 * major + minor, list(module.archs()), module.ptx_arch
    if arch in archs or (ptx and arch >= ptx):
        return None
    return f"ragged._C holds machine code for sm {archs} (PTX of sm_{ptx}), not for this device's sm_{arch}"


def launch_path(index: int) -> str:
    """``"aot"`` or ``"jit"``: how kernels are loaded on device ``index`` (``RAGGED_CUDA_LAUNCH``
    read at the device's first launch: ``aot`` and ``jit`` force one, a forced ``aot`` that cannot
    run raises with the reason; unset or ``auto``: ``_C`` where it holds the device's code)."""
    path = _paths.get(index)
    if path is None:
        mode = os.environ.get(LAUNCH_VARIABLE, "").strip().lower() or "auto"
        if mode not in ("auto", "aot", "jit"):
            raise ValueError(f"ragged: expected {LAUNCH_VARIABLE} to be aot, jit or auto, got {mode!r}")
        why = None if mode == "jit" else aot_reason(index)
        if mode == "aot" and why is not None:
            raise RuntimeError(f"ragged: {LAUNCH_VARIABLE}=aot, but {why}")
        path = _paths[index] = "aot" if why is None and mode != "jit" else "jit"
    return path


class _AotFunction:
    """A kernel of ``ragged._C``: its CUfunction in the device's primary context."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def _function(src_name: str, kernel: str, index: int):
    fn = _functions.get((kernel, index))
    if fn is None:
        if launch_path(index) == "aot":
            fn = _AotFunction(aot_module()[0].function(kernel, index))
        else:
            fn = _module(program(src_name, kernel), index).get_function(kernel).kernel
        _functions[(kernel, index)] = fn
    return fn


def build_info() -> dict:
    """How the CUDA C++ kernels are built and loaded here (see :func:`ragged.build_info`)."""
    module, why = aot_module()
    launch = None
    if torch.cuda.is_available() and torch.version.hip is None:
        index = _current_device()
        try:
            launch = launch_path(index)
        except (RuntimeError, ValueError) as exc:
            launch = f"error: {exc}"
        why = why if module is None else aot_reason(index)
    try:
        import cupy

        cupy_version = cupy.__version__
    except ImportError:
        cupy_version = None
    return {
        "launch": launch,
        "aot_present": module is not None,
        "aot_archs": list(module.archs()) if module is not None else [],
        "aot_ptx": module.ptx_arch if module is not None else None,
        "aot_nvcc": module.nvcc_version if module is not None else None,
        "aot_cuda_runtime": module.cuda_runtime_version if module is not None else None,
        "aot_reason": why,
        "cupy": cupy_version,
        LAUNCH_VARIABLE: os.environ.get(LAUNCH_VARIABLE),
    }


class _Ahead(threading.local):
    """This thread's :func:`compile_only` block: its pool, the compiles submitted, the programs asked."""

    pool: concurrent.futures.ThreadPoolExecutor | None = None
    futures: list | None = None
    asked: set | None = None


_AHEAD = _Ahead()


@contextlib.contextmanager
def compile_only(workers: int | None = None) -> Iterator[None]:
    """Within, on this thread: a launch of a CUDA kernel runs nothing (the outputs it would write
    stay as they were) and its program, where not loaded yet, compiles through NVRTC on a pool
    of ``workers`` threads (default: the CPU count, at most 16; NVRTC's compile runs without the
    GIL), each program once; the compiles are all finished, or the first failure raises, when the
    block ends. On the ahead-of-time path nothing compiles. Not reentrant; the code inside must
    not depend on the skipped kernels' outputs (:func:`ragged.warmup.compile_only`)."""
    if _AHEAD.pool is not None:
        raise RuntimeError("compile_only(): already inside a compile_only() block")
    n = workers or min(16, os.cpu_count() or 1)
    futures: list = []
    with concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="ragged-nvrtc") as pool:
        _AHEAD.pool, _AHEAD.futures, _AHEAD.asked = pool, futures, set()
        try:
            yield
        finally:
            _AHEAD.pool = _AHEAD.futures = _AHEAD.asked = None
    for f in futures:  # every compile has ended: the first failure, if any
        f.result()


def _compile_ahead(src_name: str, kernel: str, device: torch.device) -> None:
    index = device.index if device.index is not None else _current_device()
    if launch_path(index) == "aot" or (kernel, index) in _functions:
        return
    prog = program(src_name, kernel)
    key = (prog.source, prog.kernels[0], index)
    asked = _AHEAD.asked
    assert asked is not None and _AHEAD.pool is not None and _AHEAD.futures is not None
    if key in asked or key in _modules:
        return
    asked.add(key)
    _AHEAD.futures.append(_AHEAD.pool.submit(_module, prog, index))


def launch(
    src_name: str, kernel: str, device: torch.device, grid: int, block: tuple[int, int], params: Params, values: tuple
) -> None:
    """Launch ``kernel`` from ``csrc/<src_name>`` on torch's current stream of ``device``, with
    ``values`` laid out by ``params``.

    On the current device the parameters go to the driver's ``cuLaunchKernel`` as one packed
    buffer; anywhere else (another device, no driver library found, or a launch the driver
    refuses, e.g. a thread without a current context) CuPy launches it, with the device
    made current. Inside :func:`compile_only` it compiles instead, and runs nothing."""
    if _AHEAD.pool is not None:
        _compile_ahead(src_name, kernel, device)
        return
    index = device.index if device.index is not None else _current_device()
    fn = _function(src_name, kernel, index)
    handle = _raw_stream(index)
    driver = _driver_launch[0] if _driver_launch else _driver()
    if driver is not None and index == _current_device():
        extra = _LaunchExtra(
            _CU_LAUNCH_PARAM_BUFFER_POINTER,
            params.pack(values),
            _CU_LAUNCH_PARAM_BUFFER_SIZE,
            params.size_pointer,
            None,
        )
        rc = driver(fn.ptr, grid, 1, 1, block[0], block[1], 1, 0, handle, None, ctypes.byref(extra))
        if rc == 0:
            return
    else:
        rc = None
    if type(fn) is _AotFunction:  # no CuPy on this path: the driver, with the device made current
        if driver is None:
            raise RuntimeError("ragged._C: the CUDA driver library (libcuda) was not found")
        if rc is None:
            with torch.cuda.device(index):
                extra = _LaunchExtra(
                    _CU_LAUNCH_PARAM_BUFFER_POINTER,
                    params.pack(values),
                    _CU_LAUNCH_PARAM_BUFFER_SIZE,
                    params.size_pointer,
                    None,
                )
                rc = driver(fn.ptr, grid, 1, 1, block[0], block[1], 1, 0, handle, None, ctypes.byref(extra))
        if rc != 0:
            raise RuntimeError(f"ragged._C: cuLaunchKernel({kernel}) failed with CUresult {rc}")
        return
    _cupy_launch(fn, index, handle, grid, block, params.scalars(values))


def _cupy_launch(fn, index: int, handle: int, grid: int, block: tuple[int, int], args: tuple) -> None:
    import cupy

    stream = _streams.get(handle)
    if stream is None:
        stream = _streams[handle] = _wrap_stream(cupy, handle, index)
    with cupy.cuda.Device(index):
        fn((grid,), block, args, stream=stream)


class _StreamHandle:
    """A raw ``cudaStream_t`` exposed through the CUDA stream protocol."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def _wrap_stream(cupy, handle: int, index: int):
    """A CuPy view of torch's stream (``Stream.from_external`` in CuPy >= 14)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        with cupy.cuda.Device(index):
            return from_external(_StreamHandle(handle))
    return cupy.cuda.ExternalStream(handle, index)
