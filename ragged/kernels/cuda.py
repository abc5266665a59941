"""Loads the CUDA C++ kernels of ``csrc/`` and launches them on torch tensors.

The sources are compiled at first use through CuPy's NVRTC (once per GPU architecture
in this process; CuPy also keeps a disk cache across processes), so installing ragged
needs no build step. Kernels are launched on torch's current stream of the tensor's
device, with raw ``data_ptr()`` arguments: no copies, no sync.
"""

from __future__ import annotations

import functools
import importlib.resources
import pathlib

import numpy as np
import torch

from .._utils import feature_rows_contiguous

_UNROLL = 4            # vectors per thread per trip (RAGGED_UNROLL in csrc/pack.cu)
_THREADS = 256         # threads per block (__launch_bounds__ in csrc/pack.cu)
_VEC_NAMES = {16: "v16", 8: "v8", 4: "v4", 2: "v2", 1: "v1"}


@functools.lru_cache(maxsize=None)
def source(name: str) -> str:
    """Text of ``csrc/<name>`` (installed as the ``ragged._csrc`` package data)."""
    try:
        return importlib.resources.files("ragged._csrc").joinpath(name).read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        return (pathlib.Path(__file__).resolve().parents[2] / "csrc" / name).read_text()


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


def launch(src_name: str, kernel: str, device: torch.device, grid: int, block: tuple[int, int], args: tuple) -> None:
    """Launch ``kernel`` from ``csrc/<src_name>`` on torch's current stream of ``device``."""
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    fn = _functions.get((kernel, index))
    if fn is None:
        fn = _functions[(kernel, index)] = _module(src_name, index).get_function(kernel).kernel
    handle = _raw_stream(index)
    stream = _streams.get(handle)
    if stream is None:
        stream = _streams[handle] = _wrap_stream(cupy, handle, index)
    if index == torch.cuda.current_device():
        fn((grid,), block, args, stream=stream)
    else:
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


# --------------------------------------------------------------------------------------
# pack / unpack launchers


def _vec_bytes(*quantities: int) -> int:
    """Widest vector (16, 8, 4, 2, 1 bytes) dividing every byte count/address given."""
    v = 16
    while v > 1 and any(q % v for q in quantities):
        v //= 2
    return v


def _layout(row_vecs: int) -> tuple[int, int]:
    """(lanes per row, rows per block): lanes cover a row in about one unrolled trip."""
    lanes = 1
    while lanes < 32 and lanes * _UNROLL < row_vecs:
        lanes *= 2
    return lanes, _THREADS // lanes


def _grid(n_rows: int, rows_per_block: int) -> int:
    blocks = -(-n_rows // rows_per_block)
    if blocks > 2**31 - 1:
        raise ValueError(f"ragged (cuda backend): {n_rows} rows exceed one launch's grid; use backend='triton'")
    return blocks


def _offsets_suffix(offsets: torch.Tensor) -> str:
    return "i32" if offsets.dtype == torch.int32 else "i64"


def pack(padded: torch.Tensor, offsets: torch.Tensor, total: int, left: bool) -> torch.Tensor:
    batch, width = padded.shape[0], padded.shape[1]
    out = torch.empty((total, *padded.shape[2:]), dtype=padded.dtype, device=padded.device)
    es = padded.element_size()
    row_bytes = out[0].numel() * es if total else 0
    if total == 0 or row_bytes == 0:
        return out
    padded = feature_rows_contiguous(padded, 2, "pack")
    offsets = offsets.contiguous()
    stride_b, stride_m = padded.stride(0) * es, padded.stride(1) * es
    vec = _vec_bytes(row_bytes, stride_b, stride_m, padded.data_ptr(), out.data_ptr())
    row_vecs = row_bytes // vec
    lanes, rows = _layout(row_vecs)
    kernel = f"ragged_pack_{_VEC_NAMES[vec]}_{_offsets_suffix(offsets)}"
    args = (np.uint64(padded.data_ptr()), np.uint64(out.data_ptr()), np.uint64(offsets.data_ptr()),
            np.int64(batch), np.int64(total), np.int64(width), np.int64(stride_b), np.int64(stride_m),
            np.int64(row_vecs), np.int32(int(left)))
    launch("pack.cu", kernel, padded.device, _grid(total, rows), (lanes, rows), args)
    return out


def _fill_words(value: float, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """The fill value's bit pattern repeated over 16 bytes, as four 32-bit words."""
    pattern = torch.full((16 // torch.empty(0, dtype=dtype).element_size(),), value, dtype=dtype)
    words = pattern.view(torch.int32).tolist()
    return tuple(w & 0xFFFFFFFF for w in words)


def unpack(values: torch.Tensor, offsets: torch.Tensor, width: int, padding_value: float, left: bool) -> torch.Tensor:
    batch = offsets.shape[0] - 1
    out = torch.empty((batch, width, *values.shape[1:]), dtype=values.dtype, device=values.device)
    es = values.element_size()
    row_bytes = es
    for s in values.shape[1:]:
        row_bytes *= s
    n_rows = batch * width
    if n_rows == 0 or row_bytes == 0:
        return out
    values = feature_rows_contiguous(values, 1, "unpack").contiguous()
    offsets = offsets.contiguous()
    vec = _vec_bytes(row_bytes, values.data_ptr(), out.data_ptr())
    row_vecs = row_bytes // vec
    lanes, rows = _layout(row_vecs)
    kernel = f"ragged_unpack_{_VEC_NAMES[vec]}_{_offsets_suffix(offsets)}"
    w0, w1, w2, w3 = _fill_words(padding_value, values.dtype)
    args = (np.uint64(values.data_ptr()), np.uint64(out.data_ptr()), np.uint64(offsets.data_ptr()),
            np.int64(n_rows), np.int64(width), np.int64(row_vecs), np.int32(int(left)),
            np.uint32(w0), np.uint32(w1), np.uint32(w2), np.uint32(w3))
    launch("pack.cu", kernel, values.device, _grid(n_rows, rows), (lanes, rows), args)
    return out
