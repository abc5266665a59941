"""Loads the CUDA C++ kernels of ``csrc/`` and launches them on torch tensors.

The sources are compiled at first use through CuPy's NVRTC (once per GPU architecture
in this process; CuPy also keeps a disk cache across processes), so installing ragged
needs no build step. Kernels are launched on torch's current stream of the tensor's
device, with raw ``data_ptr()`` arguments: no copies, no sync.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.resources
import pathlib
import struct

import numpy as np
import torch


@functools.lru_cache(maxsize=None)
def source(name: str) -> str:
    """Text of ``csrc/<name>`` (installed as the ``ragged._csrc`` package data)."""
    try:
        return importlib.resources.files("ragged._csrc").joinpath(name).read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        return (pathlib.Path(__file__).resolve().parents[3] / "csrc" / name).read_text()


_modules: dict[tuple[str, int], object] = {}
_functions: dict[tuple[str, int], object] = {}
_streams: dict[int, object] = {}


def _module(name: str, index: int):
    import cupy

    key = (name, index)
    mod = _modules.get(key)
    if mod is None:
        with cupy.cuda.Device(index):
            mod = cupy.RawModule(code=source(name), options=("-std=c++17",))
            mod.compile()
        _modules[key] = mod
    return mod


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
        fn = _functions[(kernel, index)] = _module(src_name, index).get_function(kernel).kernel
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
