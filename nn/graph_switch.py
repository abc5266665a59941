"""Whether a layer may run from its own CUDA graphs in this thread (:mod:`ragged.nn.layer_graphs`):
the switch both that module and the whole-module graph wrapper (:mod:`ragged.nn.graphed_train`,
whose captures run the layers as they are) read, below both of them; and :func:`aliased`, which
both use around a capture."""

from __future__ import annotations

import contextlib
import threading

__all__ = ["aliased", "emulated", "emulating", "off", "switched_off", "tap", "tapping"]

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


@contextlib.contextmanager
def aliased(modules, params):
    """Inside the block, each of ``params`` is replaced in the parameter tables of ``modules`` by
    a fresh leaf on the same memory (``detach()``, the same ``requires_grad``); yields those leaves
    in the order of ``params``. A capture differentiates with respect to them: autograd then
    routes no gradient into the Parameters' own accumulation nodes, which something else may keep
    alive (DistributedDataParallel's reducer holds them from its construction) with the stream
    they were made on, the legacy default stream, which a capture must never wait on. The tables
    are put back however the block ends."""
    alias = {}
    for q in params:
        if id(q) not in alias:
            alias[id(q)] = q.detach().requires_grad_(q.requires_grad)
    swapped = []
    for m in modules:
        table = m._parameters
        for name, q in table.items():
            if q is not None and id(q) in alias:
                swapped.append((table, name, q))
    for table, name, q in swapped:
        table[name] = alias[id(q)]
    try:
        yield [alias[id(q)] for q in params]
    finally:
        for table, name, q in swapped:
            table[name] = q


@contextlib.contextmanager
def tapping(on: bool = True):
    """Inside the block (when ``on``), :func:`tap` records the hidden states an encoder hands from
    one layer to the next in this thread: the whole-module graph wrapper cuts its backward at
    some of them (:mod:`ragged.nn.graphed_train`). Yields the list they are appended to, bottom
    layer first."""
    before = getattr(_local, "taps", None)
    taps: list = []
    _local.taps = taps if on else None
    try:
        yield taps
    finally:
        _local.taps = before


def tap(x):
    """``x``, the output of an encoder layer that the next layer reads; inside :func:`tapping`, a
    view of it (its own autograd node, which nothing else feeds), recorded."""
    taps = getattr(_local, "taps", None)
    if taps is None or not x.requires_grad:
        return x
    x = x.view_as(x)
    taps.append(x)
    return x
