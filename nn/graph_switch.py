"""Whether a layer may run from its own CUDA graphs in this thread (:mod:`ragged.nn.layer_graphs`):
the switch both that module and the whole-module graph wrapper (:mod:`ragged.nn.graphed_train`,
whose captures run the layers as they are) read, below both of them."""

from __future__ import annotations

import contextlib
import threading

__all__ = ["emulated", "emulating", "off", "switched_off"]

_local = threading.local()


@contextlib.contextmanager
def off():
    """No layer graphs in this thread inside the block (the graph wrapper's own captures, say)."""
    depth: int = getattr(_local, "off_depth", 0)
    _local.off_depth = depth + 1
    try:
        yield
    finally:
        _local.off_depth = depth


def switched_off() -> bool:
    depth: int = getattr(_local, "off_depth", 0)
    return depth > 0


@contextlib.contextmanager
def emulated():
    """Layer graphs on every device, with each "graph" run as the Python it would capture: the
    buckets, the fillers and the autograd node are those of the real path. For tests off the GPU."""
    before: bool = getattr(_local, "emulate", False)
    _local.emulate = True
    try:
        yield
    finally:
        _local.emulate = before


def emulating() -> bool:
    flag: bool = getattr(_local, "emulate", False)
    return flag
