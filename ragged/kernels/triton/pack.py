"""Triton pack / unpack kernels.

Both kernels see a tensor as rows of ``row`` contiguous elements: a padded row
``(b, j)`` of ``[B, M, *F]`` or a packed row ``t`` of ``values [T, *F]``.

* pack: one program per tile of ``BLOCK_R`` packed rows x ``BLOCK_F`` elements. The grid
  covers the T real rows only; the tile's first and last rows find their sequences with
  a binary search over ``offsets``, and every row then searches only between those two.
* unpack: one program per tile of padded rows; rows past a sequence's end get the fill.

The row size is a compile-time constant (one compilation per feature size: models have
few), so that Triton can prove 16-byte alignment and vectorise. Index arithmetic is
int64: ``B * M * row`` passes 2**31 at realistic sizes.
Dtypes are moved as they are (bool as uint8); the kernels never convert values, so
every backend is bit-exact against the reference. The fill of unpack is
:func:`ragged.utils.fill_element` of the padding value in the tensor's own dtype (bool
included), the rule every backend shares.

``offsets`` are read as ``offsets + b``: the launchers make them contiguous (no copy
when they already are), whoever calls them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...records.pack import PackArgs, PackOutput, UnpackArgs, UnpackOutput
from ...utils import feature_rows_contiguous, fill_element
from .launch import cached_launch


@triton.jit
def _search(offsets, t, lo, hi, steps):
    """Largest b in [lo, hi] with offsets[b] <= t, elementwise; ``steps`` >= ceil(log2(hi - lo + 1))."""
    for _ in range(steps):
        mid = (lo + hi + 1) // 2
        go_up = tl.load(offsets + mid).to(tl.int64) <= t
        lo = tl.where(go_up, mid, lo)
        hi = tl.where(go_up, hi, mid - 1)
    return lo


@cached_launch
@triton.jit(do_not_specialize=["batch", "total", "n_steps"])
def _pack_kernel(
    src,
    dst,
    offsets,
    batch,
    total,
    width,
    stride_b,
    stride_m,
    n_steps,
    ROW: tl.constexpr,
    SRC_ALIGN: tl.constexpr,
    LEFT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64) * BLOCK_R
    last = tl.minimum(first + BLOCK_R, total) - 1
    # Sequences of the tile's first and last rows over all B, then each row searches only
    # between them (0 to 2 steps for typical lengths): the search is the cost of short rows.
    ends = tl.where(tl.arange(0, 2) == 0, first, last)
    zero2 = tl.zeros([2], dtype=tl.int64)
    found = _search(offsets, ends, zero2, zero2 + (batch - 1), n_steps)
    b_first = tl.min(found, axis=0)
    b_last = tl.max(found, axis=0)
    t = first + tl.arange(0, BLOCK_R)
    row_ok = t <= last
    zero = tl.zeros([BLOCK_R], dtype=tl.int64)
    lo = zero + b_first
    hi = zero + b_last
    span = b_last - b_first
    while span > 0:
        mid = (lo + hi + 1) // 2
        go_up = tl.load(offsets + mid).to(tl.int64) <= t
        lo = tl.where(go_up, mid, lo)
        hi = tl.where(go_up, hi, mid - 1)
        span = span // 2
    start = tl.load(offsets + lo).to(tl.int64)
    j = t - start
    if LEFT:
        end = tl.load(offsets + lo + 1).to(tl.int64)
        j += width - (end - start)
    # Every padded row starts at a multiple of SRC_ALIGN elements (the launcher's gcd of
    # the strides, capped at 16 bytes): with ROW a constexpr, loads and stores vectorise.
    src_row = tl.multiple_of(lo * stride_b + j * stride_m, SRC_ALIGN)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    col_ok = (cols < ROW)[None, :]
    # A length past the width (offsets unchecked on CUDA) would read outside padded: such
    # rows are written as zeros instead. One compare per row; valid offsets never hit it.
    in_row = (j >= 0) & (j < width)
    x = tl.load(src + src_row[:, None] + cols[None, :], mask=(row_ok & in_row)[:, None] & col_ok, other=0)
    tl.store(dst + t[:, None] * ROW + cols[None, :], x, mask=row_ok[:, None] & col_ok)


@cached_launch
@triton.jit(do_not_specialize=["n_rows"])
def _unpack_kernel(
    src,
    dst,
    offsets,
    n_rows,
    width,
    fill_bits,
    ROW: tl.constexpr,
    LEFT: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64) * BLOCK_R
    # One 64-bit division per program; rows step from there with 32-bit arithmetic
    # (the launcher keeps width + BLOCK_R below 2**31).
    b0 = first // width
    local = (first - b0 * width).to(tl.int32) + tl.arange(0, BLOCK_R)
    width32 = width.to(tl.int32)
    hop = local // width32
    b = b0 + hop.to(tl.int64)
    j = (local - hop * width32).to(tl.int64)
    r = first + tl.arange(0, BLOCK_R)
    row_ok = r < n_rows
    start = tl.load(offsets + b, mask=row_ok, other=0).to(tl.int64)
    length = tl.load(offsets + b + 1, mask=row_ok, other=0).to(tl.int64) - start
    if LEFT:
        j -= width - length
    real = row_ok & (j >= 0) & (j < length)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    col_ok = cols < ROW
    x = tl.load(src + (start + j)[:, None] * ROW + cols[None, :], mask=real[:, None] & col_ok[None, :])
    # The fill arrives as the element's bit pattern: exact for every dtype (a float
    # scalar argument would be rounded through fp32).
    fill = tl.full([BLOCK_R, BLOCK_F], fill_bits, BITS).to(dst.dtype.element_ty, bitcast=True)
    x = tl.where(real[:, None], x, fill)
    tl.store(dst + r[:, None] * ROW + cols[None, :], x, mask=row_ok[:, None] & col_ok[None, :])


# Tile shape: about 8 KiB per program, rows of up to 4 KiB in one column block.
# Sweep on an H200 (bench/tune_pack.py, bf16 B=256 M=512 F=1024): 8 KiB tiles with 4 warps
# gave pack 86.7% / unpack 90.8% of the copy ceiling; 16 KiB 85.6% / 89.2%; 32 KiB 85.4% /
# 88.6%; 8 warps within noise of 4.
_TILE_BYTES = 8192
_ROW_BYTES = 4096


@functools.cache
def _tile(row: int, elem: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_F, num_warps) for rows of ``row`` elements of ``elem`` bytes.

    BLOCK_F is the widest power of two (up to 4 KiB) whose column blocks cover the row
    with at most a quarter of the lanes masked off: 768 -> 256 (three blocks, no waste)
    rather than 1024 (a quarter of the lanes idle, slower than ``index_select`` on the many
    short sequences case of ``bench/tune_pack.py``).
    """
    cap = max(1, _ROW_BYTES // elem)
    block_f = min(triton.next_power_of_2(max(row, 1)), cap)
    while block_f > 16 and 4 * (-(-row // block_f) * block_f - row) > row:
        block_f //= 2
    block_r = max(1, min(1024, (_TILE_BYTES // elem) // block_f))
    return block_r, block_f, 4


@functools.cache
def _align(*strides: int, elem: int) -> int:
    """Largest power of two (in elements, at most 16 bytes) dividing every stride."""
    a = max(1, 16 // elem)
    while a > 1 and any(s % a for s in strides):
        a //= 2
    return a


def _as_kernel_dtype(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == torch.bool else x


def pack(args: PackArgs) -> PackOutput:
    padded, offsets, total, left = args.padded, args.offsets, args.total, args.left
    batch, width = padded.shape[0], padded.shape[1]
    row = 1
    for s in padded.shape[2:]:
        row *= s
    out = torch.empty((total, *padded.shape[2:]), dtype=padded.dtype, device=padded.device)
    if total == 0 or row == 0:
        return PackOutput(out)
    padded = feature_rows_contiguous(padded, 2, "pack")
    offsets = offsets.contiguous()
    src, dst = _as_kernel_dtype(padded), _as_kernel_dtype(out)
    block_r, block_f, warps = _tile(row, padded.element_size())
    grid = (triton.cdiv(total, block_r), triton.cdiv(row, block_f))
    n_steps = max(batch - 1, 0).bit_length()
    align = _align(padded.stride(0), padded.stride(1), elem=padded.element_size())
    _pack_kernel[grid](
        src,
        dst,
        offsets,
        batch,
        total,
        width,
        padded.stride(0),
        padded.stride(1),
        n_steps,
        ROW=row,
        SRC_ALIGN=align,
        LEFT=left,
        BLOCK_R=block_r,
        BLOCK_F=block_f,
        num_warps=warps,
    )
    return PackOutput(out)


def unpack(args: UnpackArgs) -> UnpackOutput:
    values, offsets, width, left = args.values, args.offsets, args.width, args.left
    batch = offsets.shape[0] - 1
    row = 1
    for s in values.shape[1:]:
        row *= s
    out = torch.empty((batch, width, *values.shape[1:]), dtype=values.dtype, device=values.device)
    n_rows = batch * width
    if n_rows == 0 or row == 0:
        return UnpackOutput(out)
    if width > 2**31 - 1 - 2 * _TILE_BYTES:
        raise ValueError(
            f"ragged.unpack (triton backend): padded width {width} is too large for its 32-bit row "
            "stepping; use backend='torch'"
        )
    values = feature_rows_contiguous(values, 1, "unpack").contiguous()
    offsets = offsets.contiguous()
    src, dst = _as_kernel_dtype(values), _as_kernel_dtype(out)
    block_r, block_f, warps = _tile(row, values.element_size())
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(row, block_f))
    # From the tensor's own dtype, not the uint8 view of a bool tensor: 0.5 is True in bool
    # but 0 in uint8, and -1.0 is True in bool but no uint8 at all.
    bits, bits_type = _fill_bits(args.padding_value, values.dtype)
    _unpack_kernel[grid](
        src,
        dst,
        offsets,
        n_rows,
        width,
        bits,
        ROW=row,
        LEFT=left,
        BITS=bits_type,
        BLOCK_R=block_r,
        BLOCK_F=block_f,
        num_warps=warps,
    )
    return UnpackOutput(out)


_INT_OF_SIZE = {
    1: (torch.int8, tl.int8),
    2: (torch.int16, tl.int16),
    4: (torch.int32, tl.int32),
    8: (torch.int64, tl.int64),
}


def _fill_bits(value, dtype: torch.dtype):
    """``value`` as ``dtype`` holds it (:func:`ragged.utils.fill_element`), as a signed int bit pattern."""
    element = fill_element("ragged.unpack", value, dtype)
    int_dtype, bits_type = _INT_OF_SIZE[element.element_size()]
    return element.view(int_dtype).item(), bits_type
