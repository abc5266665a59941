"""The Gluon kernels of :mod:`bench.racecheck_probe`: ``gl.warp_specialize``'s hand-over of the
partitions' arguments, alone and followed by a device-made TMA descriptor, with nothing of
attention in them. Imported only where Gluon for Hopper is (the probe says so when it is not).

Both kernels are shaped like ``ragged.kernels.triton.attention_ws._ws_fwd_kernel``: 4 warps in
the default partition (the loader), two worker partitions of 4 warps with 240 registers a
thread, launched with ``maxnreg`` :data:`MAX_REGISTERS`. One program per row of ``IN``.

* ``IN [programs, 4] int32``: the program's ``a, b, c`` and the row count of its tile (``rows``);
  loaded on the device, so the workers receive them through the hand-over (values a compiler
  could rebuild from the kernel's parameters might not go through shared memory).
* ``OUT [programs, 3, 2] int32``: partition ``p`` (0 the default, 1 and 2 the workers) writes
  ``(p, a + b + c)`` into its row, through the pointer ``OUT + 6 * program`` it was handed.
* ``X, Y [programs * TILE_ROWS, TILE_COLS] fp16`` (the descriptor kernel): the loader TMA-loads
  the program's tile of ``X`` in two halves of 64 rows into shared memory on one mbarrier;
  worker ``p`` waits for it and copies half ``p - 1`` to ``Y``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

__all__ = ["MAX_REGISTERS", "TILE_COLS", "TILE_ROWS", "descriptor_kernel", "handover_kernel"]

# the TMA load's name: async_copy_global_to_shared up to Triton 3.6, async_load after
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

MAX_REGISTERS = 168  # attention_ws's: 2 x 128 worker threads at 240, 128 default ones at 24
TILE_ROWS = 128  # two halves of 64, one per worker, as attention_ws's query tile
TILE_COLS = 64
_WORKER_REGS = gl.constexpr(240)
_HALF = gl.constexpr(64)
_ROWS = gl.constexpr(TILE_ROWS)
_COLS = gl.constexpr(TILE_COLS)


@gluon.jit
def _report(out_row, PART: gl.constexpr, a, b, c):
    """Partition ``PART``'s entry of ``OUT``: its id and the sum of the scalars it was handed."""
    gl.store(out_row + 2 * PART, PART)
    gl.store(out_row + 2 * PART + 1, a + b + c)


@gluon.jit
def _handover_part(args, PART: gl.constexpr):
    out_row, a, b, c = args
    _report(out_row, PART, a, b, c)


@gluon.jit
def handover_kernel(IN, OUT):
    pid = gl.program_id(0)
    row = IN + 4 * pid
    args = (OUT + 6 * pid, gl.load(row), gl.load(row + 1), gl.load(row + 2))
    gl.warp_specialize(
        [(_handover_part, (args, 0)), (_handover_part, (args, 1)), (_handover_part, (args, 2))],
        [4, 4],
        [_WORKER_REGS, _WORKER_REGS],
    )


@gluon.jit
def _descriptor_loader(args, tile, bar, PART: gl.constexpr):
    """The default partition, as attention_ws's loader: a descriptor of the program's rows made
    on the device (attention_ws's ``_rows_desc``), both halves loaded on one barrier."""
    out_row, a, b, c, x, y, rows = args
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HALF, _COLS], x.dtype.element_ty)
    desc = tma.make_tensor_descriptor(
        x, shape=[rows, _COLS], strides=[_COLS, 1], block_shape=[_HALF, _COLS], layout=layout
    )
    mbarrier.expect(bar, 2 * desc.block_type.nbytes)
    _tma_load(desc, [0, 0], bar, tile.index(0))
    _tma_load(desc, [_HALF, 0], bar, tile.index(1))
    _report(out_row, PART, a, b, c)


@gluon.jit
def _descriptor_reader(args, tile, bar, PART: gl.constexpr):
    """A worker: its report, then, once the loads are in, its half of the tile to ``Y``."""
    out_row, a, b, c, x, y, rows = args
    _report(out_row, PART, a, b, c)
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    mbarrier.wait(bar, 0)
    values = tile.index(PART - 1).load(blocked)
    r = gl.arange(0, _HALF, layout=gl.SliceLayout(1, blocked)) + (PART - 1) * _HALF
    d = gl.arange(0, _COLS, layout=gl.SliceLayout(0, blocked))
    gl.store(y + gl.expand_dims(r * _COLS, 1) + gl.expand_dims(d, 0), values)


@gluon.jit
def descriptor_kernel(IN, OUT, X, Y):
    pid = gl.program_id(0)
    row = IN + 4 * pid
    start = pid.to(gl.int64) * (_ROWS * _COLS)
    args = (OUT + 6 * pid, gl.load(row), gl.load(row + 1), gl.load(row + 2), X + start, Y + start, gl.load(row + 3))
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HALF, _COLS], X.dtype.element_ty)
    tile = gl.allocate_shared_memory(X.dtype.element_ty, [2, _HALF, _COLS], layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    fence_async_shared()
    gl.warp_specialize(
        [
            (_descriptor_loader, (args, tile, bar, 0)),
            (_descriptor_reader, (args, tile, bar, 1)),
            (_descriptor_reader, (args, tile, bar, 2)),
        ],
        [4, 4],
        [_WORKER_REGS, _WORKER_REGS],
    )
