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
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import difflib
import functools
import importlib.resources
import os
import pathlib
import struct
import threading
import types
from collections.abc import Mapping

import numpy as np
import torch

from .instances import Program, parse as _parse


@functools.lru_cache(maxsize=None)
def source(name: str) -> str:
    """Text of ``csrc/<name>`` (installed as the ``ragged._csrc`` package data)."""
    try:
        return importlib.resources.files("ragged._csrc").joinpath(name).read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        return (pathlib.Path(__file__).resolve().parents[3] / "csrc" / name).read_text()


# --------------------------------------------------------------------------------------
# One program per kernel, read from the source text (the parser: :mod:`.instances`)


@functools.lru_cache(maxsize=None)
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
        raise ValueError(f"ragged.kernels.cuda.launch.program(): csrc/{src_name} defines no kernel {kernel!r} "
                         f"(it instantiates {len(table)} kernels{hint})")
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
    todo = {}
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
    try:  # the handle alone, without building a torch.cuda.Stream (about 3 us less per launch)
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
    _fields_ = [("buffer_key", ctypes.c_void_p), ("buffer", ctypes.c_char_p), ("size_key", ctypes.c_void_p),
                ("size", ctypes.POINTER(ctypes.c_size_t)), ("end", ctypes.c_void_p)]


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
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                       ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return fn
    return None


def _driver():
    if not _driver_launch:
        _driver_launch.append(_load_driver_launch() if DRIVER_LAUNCH else None)
    return _driver_launch[0]


# Launch through the driver directly (about 4 us less host time per launch than CuPy's
# argument handling); False: always through CuPy.
DRIVER_LAUNCH = True


def _function(src_name: str, kernel: str, index: int):
    fn = _functions.get((kernel, index))
    if fn is None:
        fn = _functions[(kernel, index)] = _module(program(src_name, kernel), index).get_function(kernel).kernel
    return fn


def launch(src_name: str, kernel: str, device: torch.device, grid: int, block: tuple[int, int], params: Params,
           values: tuple) -> None:
    """Launch ``kernel`` from ``csrc/<src_name>`` on torch's current stream of ``device``, with
    ``values`` laid out by ``params``.

    On the current device the parameters go to the driver's ``cuLaunchKernel`` as one packed
    buffer; anywhere else (another device, no driver library found, or a launch the driver
    refuses, e.g. a thread without a current context) CuPy launches it, with the device
    made current."""
    index = device.index if device.index is not None else _current_device()
    fn = _function(src_name, kernel, index)
    handle = _raw_stream(index)
    driver = _driver_launch[0] if _driver_launch else _driver()
    if driver is not None and index == _current_device():
        extra = _LaunchExtra(_CU_LAUNCH_PARAM_BUFFER_POINTER, params.pack(values), _CU_LAUNCH_PARAM_BUFFER_SIZE,
                             params.size_pointer, None)
        if driver(fn.ptr, grid, 1, 1, block[0], block[1], 1, 0, handle, None, ctypes.byref(extra)) == 0:
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
