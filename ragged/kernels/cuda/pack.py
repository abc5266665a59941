"""CUDA C++ pack / unpack (``csrc/pack.cu``): one launch each, vectorised row copies."""

from __future__ import annotations

import torch

from ...records.pack import PackArgs, PackOutput, UnpackArgs, UnpackOutput
from ...utils import feature_rows_contiguous, fill_element
from .launch import Params, launch

_UNROLL = 4  # vectors per thread per trip (RAGGED_UNROLL in csrc/pack.cu)
_THREADS = 256  # threads per block (__launch_bounds__ in csrc/pack.cu)
_VEC_NAMES = {16: "v16", 8: "v8", 4: "v4", 2: "v2", 1: "v1"}

# --------------------------------------------------------------------------------------
# pack / unpack launchers


# (src, dst, offsets, batch, total, width, stride_b, stride_m, row_vecs, left)
_PACK_PARAMS = Params("PPPqqqqqqi")
# (src, dst, offsets, n_rows, width, row_vecs, left, w0, w1, w2, w3)
_UNPACK_PARAMS = Params("PPPqqqiIIII")


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


def pack(args: PackArgs) -> PackOutput:
    padded, offsets, total, left = args.padded, args.offsets, args.total, args.left
    batch, width = padded.shape[0], padded.shape[1]
    out = torch.empty((total, *padded.shape[2:]), dtype=padded.dtype, device=padded.device)
    es = padded.element_size()
    row_bytes = out[0].numel() * es if total else 0
    if total == 0 or row_bytes == 0:
        return PackOutput(out)
    padded = feature_rows_contiguous(padded, 2, "pack")
    offsets = offsets.contiguous()
    stride_b, stride_m = padded.stride(0) * es, padded.stride(1) * es
    vec = _vec_bytes(row_bytes, stride_b, stride_m, padded.data_ptr(), out.data_ptr())
    row_vecs = row_bytes // vec
    lanes, rows = _layout(row_vecs)
    kernel = f"ragged_pack_{_VEC_NAMES[vec]}_{_offsets_suffix(offsets)}"
    params = (
        padded.data_ptr(),
        out.data_ptr(),
        offsets.data_ptr(),
        batch,
        total,
        width,
        stride_b,
        stride_m,
        row_vecs,
        int(left),
    )
    launch("pack.cu", kernel, padded.device, _grid(total, rows), (lanes, rows), _PACK_PARAMS, params)
    return PackOutput(out)


def _fill_words(value, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """The fill value's bit pattern (:func:`ragged.utils.fill_element`, the rule every
    backend shares) repeated over 16 bytes, as four 32-bit words."""
    element = fill_element("ragged.unpack", value, dtype)
    pattern = element.reshape(1).expand(16 // element.element_size()).contiguous()
    words = pattern.view(torch.uint8).view(torch.int32).tolist()
    return tuple(w & 0xFFFFFFFF for w in words)


def unpack(args: UnpackArgs) -> UnpackOutput:
    values, offsets, width, left = args.values, args.offsets, args.width, args.left
    batch = offsets.shape[0] - 1
    out = torch.empty((batch, width, *values.shape[1:]), dtype=values.dtype, device=values.device)
    es = values.element_size()
    row_bytes = es
    for s in values.shape[1:]:
        row_bytes *= s
    n_rows = batch * width
    if n_rows == 0 or row_bytes == 0:
        return UnpackOutput(out)
    values = feature_rows_contiguous(values, 1, "unpack").contiguous()
    offsets = offsets.contiguous()
    vec = _vec_bytes(row_bytes, values.data_ptr(), out.data_ptr())
    row_vecs = row_bytes // vec
    lanes, rows = _layout(row_vecs)
    kernel = f"ragged_unpack_{_VEC_NAMES[vec]}_{_offsets_suffix(offsets)}"
    w0, w1, w2, w3 = _fill_words(args.padding_value, values.dtype)
    params = (values.data_ptr(), out.data_ptr(), offsets.data_ptr(), n_rows, width, row_vecs, int(left), w0, w1, w2, w3)
    launch("pack.cu", kernel, values.device, _grid(n_rows, rows), (lanes, rows), _UNPACK_PARAMS, params)
    return UnpackOutput(out)
