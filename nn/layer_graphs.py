"""Eager training with each encoder layer replayed from CUDA graphs, one pair per token bucket.

An eager training step of a converted encoder launches a few dozen kernels per layer, and on a
GPU the host time of those launches (and of the Python around them) is several times the GPU
time of the kernels at the batch sizes people train with. This module takes a layer's forward
and backward out of the host's hands: the first time a layer meets a bucket of batch sizes it
runs eagerly; the second time its forward and backward are captured as two CUDA graphs, and
from then on every batch of that bucket replays them. The layer stays an ordinary autograd node
of the caller's graph: its backward returns the gradient of its input and of each of its
Parameters, which autograd accumulates into ``.grad`` as it does for any node, so gradient
hooks run, DistributedDataParallel reduces each layer's gradients while the layers below it
are still in their backward, and gradient accumulation, ``torch.autograd.grad`` and frozen
Parameters behave as in eager mode. Only the layer runs from graphs: the embeddings, the heads,
the loss, the optimizer and the caller's control flow stay eager.

Buckets. A batch of ``T`` tokens in ``B`` sequences (the longest ``L``) runs as a bucket
``(T_b, B_b, L_b)`` (:func:`bucket_of`): ``T_b`` rounds ``T`` up on a geometric scale of 32
steps per power of two (at most about 3% spare rows), ``L_b`` is the power of two at or above
``L``, ``B_b`` leaves room for filler sequences and rounds up to a multiple of 8. The spare
rows go to filler sequences of at most ``L_b`` tokens, as in :mod:`ragged.nn.graphed_train`:
every row belongs to a sequence, so every kernel writes finite values there, and as the
gradient arriving at the spare rows is zero, their share of each weight gradient is exactly
zero. The bucket's input, output and gradient buffers are shared by every layer (each replay's
results are copied out at once).

Memory. The activations a layer's forward graph keeps for its backward graph live in a memory
pool of that layer's graphs only, and the buckets of one layer share it: the pool holds one
forward's activations of the largest bucket a layer has met, about what an eager step holds.
Sharing is sound because a layer's forward graph is replayed again only after the backward of
the previous replay ran (or its outputs were dropped): a second training forward of a layer
whose previous forward still waits for its backward (two forwards before one backward) runs
that layer eagerly instead.

What is captured is fixed per graph: the Parameters' addresses and ``requires_grad`` flags, the
dropout rates and the layer's kernels. They are part of each graph's key, so moving a model,
freezing a Parameter or changing a dropout module's ``p`` captures anew. The layers of
``ragged.nn.convert`` run here in eager training on CUDA (``RAGGED_LAYER_GRAPHS=0`` or
:func:`off` turns it off): not under ``torch.compile``, autocast, gradient checkpointing,
hooks on the layer, inside another capture (:func:`ragged.nn.graphed` turns it off around its
own), or above ``MAX_TOKENS`` tokens.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from .graph_switch import aliased, emulated, emulating, off, switched_off
from .graphed_train import capture_stream, capturing, spare_offsets

__all__ = ["MAX_TOKENS", "Plan", "active", "bucket_of", "emulated", "off", "own", "plan", "reset", "run"]

MAX_TOKENS = 1 << 17  # batches above this many tokens run eagerly
_STEPS = 32  # bucket steps per power of two of tokens
_ENV_ON = os.environ.get("RAGGED_LAYER_GRAPHS", "1") != "0"


def active(x: torch.Tensor) -> bool:
    """Whether a layer on values ``x`` may run from graphs now (see the module docstring)."""
    if not _ENV_ON or torch.compiler.is_compiling() or not torch.is_grad_enabled() or switched_off():
        return False
    if emulating():
        return True
    if x.device.type != "cuda" or torch.is_autocast_enabled("cuda"):
        return False
    return not torch.cuda.is_current_stream_capturing()


def token_bucket(n: int) -> int:
    """``n`` rounded up on a scale of :data:`_STEPS` steps per power of two, in steps of at least
    16 rows (at least 64)."""
    if n <= 64:
        return 64
    step = max(16, 1 << max(0, (n - 1).bit_length() - _STEPS.bit_length()))
    return -(-n // step) * step


def bucket_of(num_tokens: int, batch_size: int, max_len: int) -> tuple[int, int, int, int]:
    """``(T_b, B_b, L_b, fillers)`` of a batch (see the module docstring): a bucket with empty
    spare sequences has a spare row for them to start at."""
    need = max(num_tokens, 1)
    while True:
        t_b = token_bucket(need)
        l_b = min(max(64, 1 << max(0, max_len - 1).bit_length()), t_b)
        spare = t_b - num_tokens
        fillers = -(-spare // l_b)
        b_b = -(-(batch_size + fillers) // 8) * 8
        if b_b > batch_size + fillers and spare == 0:
            need = t_b + 1
            continue
        return t_b, b_b, l_b, fillers


class _Bucket:
    """The buffers of one bucket, shared by every layer: the values ``[T_b, d]`` a forward graph
    reads and then overwrites with its output, the gradient ``[T_b, d]`` a backward graph reads and
    then overwrites with its input's gradient (so consecutive replayed layers hand them on in
    place), and the offsets with the fillers ``[B_b + 1]``."""

    def __init__(self, size, d: int, dtype, cu_dtype, device) -> None:
        t_b, b_b, l_b = size
        self.size = size
        self.x = torch.zeros((t_b, d), dtype=dtype, device=device)
        self.dy = torch.zeros_like(self.x)
        self.cu = torch.zeros(b_b + 1, dtype=cu_dtype, device=device)
        self.ramp = torch.arange(1, b_b + 1, dtype=cu_dtype, device=device)
        self._source: torch.Tensor | None = None
        self._version = -1
        self._tokens = -1
        # the tokens of the replays of this bucket whose backward is due: their graphs read these
        # offsets, so another batch may not write them until those backwards ran
        self.due: weakref.WeakSet[_Token] = weakref.WeakSet()

    def fill(self, cu: torch.Tensor, num_tokens: int, fillers: int) -> bool:
        """Write the offsets of a batch (``cu``, then the spare sequences), once per batch; False
        (nothing written) while a replay of another batch still needs the current ones."""
        if cu is self._source and cu._version == self._version and num_tokens == self._tokens:
            return True
        if len(self.due):
            return False
        batch = cu.shape[0] - 1
        self.cu[: batch + 1].copy_(cu)
        spare_offsets(self.cu, self.ramp, batch, num_tokens, self.size, fillers)
        self._source, self._version, self._tokens = cu, cu._version, num_tokens
        return True


_BUCKETS: dict[tuple, _Bucket] = {}


class Plan(NamedTuple):
    """One batch in its bucket: what every layer of one forward shares."""

    bucket: _Bucket
    num_tokens: int
    key: tuple


def plan(x: torch.Tensor, cu: torch.Tensor, max_len: int) -> Plan | None:
    """The bucket of a batch of values ``x [T, d]`` and offsets ``cu``, its offsets written;
    None where the layers run eagerly (no tokens, over :data:`MAX_TOKENS`, not 2-D, or the
    bucket's offsets still needed by the backward of another batch's replays)."""
    n = x.shape[0]
    if x.dim() != 2 or n == 0 or n > MAX_TOKENS or not x.is_floating_point():
        return None
    t_b, b_b, l_b, fillers = bucket_of(n, cu.shape[0] - 1, max_len)
    key = (x.device, x.dtype, x.shape[1], cu.dtype, t_b, b_b, l_b)
    bucket = _BUCKETS.get(key)
    if bucket is None:
        bucket = _BUCKETS[key] = _Bucket((t_b, b_b, l_b), x.shape[1], x.dtype, cu.dtype, x.device)
    if not bucket.fill(cu, n, fillers):
        return None
    return Plan(bucket, n, key)


def own(x: torch.Tensor, p: Plan) -> torch.Tensor:
    """``x`` as a tensor of its own: a copy where it is the bucket's values buffer (a replayed
    layer's output handed on in place), before a layer that runs eagerly reads (and saves) it."""
    return x.clone() if x.data_ptr() == p.bucket.x.data_ptr() else x


class _Token:
    """Held by a replay's autograd node while its backward is due (see :class:`_LayerState`)."""


class _Entry:
    """A layer's two graphs for one key, and where its Parameters' gradients land."""

    __slots__ = ("bwd", "flat", "fwd", "need_x", "params", "used", "used_params")

    def __init__(self) -> None:
        self.fwd: Callable[[], None]
        self.bwd: Callable[[], None]
        self.flat: torch.Tensor | None = None  # the gradients of params, one after another
        self.need_x = False
        self.params: list[nn.Parameter] = []  # those that take a gradient (the node's inputs)
        self.used: list[bool] = []  # per entry of params: whether the layer reads it
        self.used_params: list[nn.Parameter] = []


class _LayerState:
    """One layer's graphs, the buckets it has met once, its memory pool, and the replay whose
    backward is due (a weak reference to its :class:`_Token`)."""

    def __init__(self) -> None:
        self.entries: dict[tuple, _Entry] = {}
        self.seen: set[tuple] = set()
        self.pool: Any = None  # the graphs' memory pool handle
        self.pending: weakref.ref | None = None
        self.dropouts: list = []  # the layer's dropout modules (their rates are captured)
        self.tuners: list = []  # its adapter layers (peft's): their state is captured too
        self.walk: tuple | None = None  # (modules, their dicts' copies, the Parameters): _parameters


_STATES: weakref.WeakKeyDictionary[nn.Module, _LayerState] = weakref.WeakKeyDictionary()
_FLATS: dict[tuple, torch.Tensor] = {}


def reset() -> None:
    """Drop every layer's graphs and the shared buffers (they are captured again as needed)."""
    _STATES.clear()
    _BUCKETS.clear()
    _FLATS.clear()


def _walk(layer: nn.Module) -> tuple:
    """``(modules, copies of their module and Parameter dicts, Parameters)`` of the layer's tree:
    ``layer.parameters()``, each once, in a fixed order, and what tells whether it changed."""
    mods: list = []
    params: list = []
    seen: set = set()
    stack = [layer]
    while stack:
        m = stack.pop()
        mods.append(m)
        for q in m._parameters.values():
            if q is not None and id(q) not in seen:
                seen.add(id(q))
                params.append(q)
        stack.extend(c for c in reversed(m._modules.values()) if c is not None)
    return mods, [(dict(m._modules), dict(m._parameters)) for m in mods], params


def _parameters(state: _LayerState, layer: nn.Module) -> list:
    """The layer's Parameters, read again whenever a module or Parameter was swapped in."""
    walk = state.walk
    if walk is not None:
        mods, copies, params = walk
        try:  # dict equality compares identical entries by identity
            if all(m._modules == c[0] and m._parameters == c[1] for m, c in zip(mods, copies)):
                return params
        except RuntimeError:  # a different tensor compared by value
            pass
    walk = state.walk = _walk(layer)
    state.dropouts = [m for m in walk[0] if isinstance(m, nn.modules.dropout._DropoutNd)]
    state.tuners = [m for m in walk[0] if hasattr(m, "merged_adapters") and hasattr(m, "active_adapters")]
    return walk[2]


def _tuner_state(m) -> tuple:
    """What a peft adapter layer's forward depends on besides its Parameters."""
    scaling = getattr(m, "scaling", {})
    return (
        tuple(m.active_adapters),
        tuple(m.merged_adapters),
        bool(getattr(m, "disable_adapters", False)),
        tuple(sorted(scaling.items())) if isinstance(scaling, dict) else scaling,
    )


def _flat(device, dtype, numel: int) -> torch.Tensor:
    key = (device, dtype, numel)
    t = _FLATS.get(key)
    if t is None:
        t = _FLATS[key] = torch.empty(numel, dtype=dtype, device=device)
    return t


def run(
    layer: nn.Module, body: Callable, x: torch.Tensor, p: Plan, hand_on: bool = False, first: bool = True
) -> torch.Tensor | None:
    """Layer ``layer`` on ``x [T, d]`` from its graphs for the bucket of ``p``: ``body(x, cu,
    max_len) -> y`` is what they capture (the layer on the bucket's values, offsets and longest
    length). None where the layer runs eagerly this time (the caller then calls it on
    :func:`own` of ``x``): the first time it meets this key, a previous forward's backward still
    due, no gradient wanted. ``hand_on``: the output is read by the next layer only, so it may
    stay in the bucket's buffer (the next replay overwrites it); ``first``: the input's gradient
    leaves the layers (else it may stay in the bucket's gradient buffer for the layer before)."""
    state = _STATES.get(layer)
    if state is None:
        state = _STATES[layer] = _LayerState()
    if state.pending is not None and state.pending() is not None:
        return None
    params = _parameters(state, layer)
    dtype = x.dtype
    for q in params:
        if q.dtype != dtype:
            return None
    need_x = x.requires_grad
    grads = tuple([q.requires_grad for q in params])
    if not need_x and True not in grads:
        return None
    key = (
        p.key,
        need_x,
        grads,
        tuple([q.data_ptr() for q in params]),
        layer.training,
        tuple([m.p for m in state.dropouts]),
        tuple([_tuner_state(m) for m in state.tuners]) if state.tuners else (),
    )
    entry = state.entries.get(key)
    if entry is None:
        if key not in state.seen:
            state.seen.add(key)
            return None
        x = own(x, p)  # the warm-up and the capture write the bucket's buffers
        entry = state.entries[key] = _capture(state, body, p, params, grads, need_x, x.device)
    token = _Token()
    return _Replay.apply(entry, state, token, p, (hand_on, not first), x, *entry.params)


def _capture(state: _LayerState, body: Callable, p: Plan, params, grads, need_x: bool, device) -> _Entry:
    """Warm up, then capture the layer's forward graph (the bucket's input to its output) and
    backward graph (the output's gradient to the input's and the Parameters' gradients)."""
    b = p.bucket
    t_b, b_b, l_b = b.size
    entry = _Entry()
    entry.need_x = need_x
    entry.params = [q for q, g in zip(params, grads) if g]
    x_leaf = b.x.detach().requires_grad_(need_x)
    wrt = ([x_leaf] if need_x else []) + entry.params
    n_x = 1 if need_x else 0
    mods = state.walk[0] if state.walk is not None else []

    def forward() -> torch.Tensor:
        return body(x_leaf.clone(), b.cu, l_b)

    def gradients(y: torch.Tensor, wrt: list = wrt) -> list:
        if not y.requires_grad:  # the layer reads none of them (adapters merged, say)
            return [None] * len(wrt)
        return list(torch.autograd.grad(y, wrt, b.dy, allow_unused=True))

    def on_aliases():
        """The layer's Parameters swapped for fresh leaves (graph_switch.aliased), and what to
        differentiate with respect to: a capture never meets their own accumulation nodes."""
        return aliased(mods, entry.params)

    def backward(y: torch.Tensor, wrt: list = wrt) -> None:
        got = gradients(y, wrt)
        if need_x:  # after every read of b.dy
            d = got[0]
            b.dy.copy_(d) if d is not None else b.dy.zero_()
        if entry.flat is not None:
            torch.cat([g.reshape(-1) for g in got[n_x:] if g is not None], out=entry.flat)

    emulate = emulating() or device.type != "cuda"
    # which Parameters the layer reads (those it does not get None, as from autograd): one pass
    # (on a GPU, the first warm-up run, on a side stream)
    stream = None if emulate else torch.cuda.Stream(device)
    with capturing(device) if not emulate else contextlib.nullcontext(), off():
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(), torch.enable_grad():
            with on_aliases() as ps:
                probe = gradients(forward(), wrt[:n_x] + ps)
            entry.used = [g is not None for g in probe[n_x:]]
            entry.used_params = [q for q, u in zip(entry.params, entry.used) if u]
            del probe
            numel = sum(q.numel() for q, u in zip(entry.params, entry.used) if u)
            if numel:
                entry.flat = _flat(b.x.device, b.x.dtype, numel)
            if stream is not None:  # compiles the kernels, lets cuBLAS pick its algorithms
                with on_aliases() as ps:
                    y = forward()
                backward(y, wrt[:n_x] + ps)
                del y, ps
        if stream is None:
            kept: list[torch.Tensor] = []

            def fwd() -> None:
                with torch.enable_grad():
                    y = forward()
                b.x.copy_(y.detach())
                kept[:] = [y]

            def bwd() -> None:
                y = kept.pop()
                with torch.enable_grad():
                    backward(y)

            entry.fwd, entry.bwd = fwd, bwd
            return entry

        torch.cuda.current_stream(device).wait_stream(stream)
        if state.pool is None:
            state.pool = torch.cuda.graph_pool_handle()
        graph_f, graph_b = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        capture = capture_stream(device)
        with torch.enable_grad():
            with torch.cuda.graph(graph_f, pool=state.pool, stream=capture, capture_error_mode="thread_local"):
                with on_aliases() as ps:
                    y = forward()
                b.x.copy_(y.detach())  # after every read of b.x
            with torch.cuda.graph(graph_b, pool=state.pool, stream=capture, capture_error_mode="thread_local"):
                backward(y, wrt[:n_x] + ps)
        # the activations between the two graphs go back to the layer's pool, for its other buckets
        del y, ps
    entry.fwd, entry.bwd = graph_f.replay, graph_b.replay
    return entry


class _Replay(torch.autograd.Function):
    """The layer's forward graph; its backward replays the backward graph."""

    @staticmethod
    def forward(ctx, entry, state, token, p, hand_on, x, *params):
        b, n = p.bucket, p.num_tokens
        if x.data_ptr() != b.x.data_ptr():  # else the previous layer's output, handed on in place
            b.x[:n].copy_(x)
        entry.fwd()
        state.pending = weakref.ref(token)
        b.due.add(token)
        ctx.entry, ctx.state, ctx.token, ctx.plan, ctx.dx_in_place = entry, state, token, p, hand_on[1]
        return b.x[:n] if hand_on[0] else b.x[:n].clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        entry, state, p = ctx.entry, ctx.state, ctx.plan
        if state.pending is None or state.pending() is not ctx.token:
            raise RuntimeError(
                "ragged.nn: a second backward through a layer replayed from CUDA graphs; its saved "
                "activations are gone (run the step without retain_graph, or with RAGGED_LAYER_GRAPHS=0)"
            )
        b, n = p.bucket, p.num_tokens
        if dy.data_ptr() != b.dy.data_ptr():
            b.dy[:n].copy_(dy)
            b.dy[n:].zero_()
        # else the next layer's input gradient, handed on in place: zero at the spare rows, as the
        # gradient it came from was
        entry.bwd()
        state.pending = None
        b.due.discard(ctx.token)
        ctx.token = None
        dx = None
        if entry.need_x:
            dx = b.dy[:n] if ctx.dx_in_place else b.dy[:n].clone()
        grads: list[torch.Tensor | None] = [None] * len(entry.params)
        if entry.flat is not None:  # one copy of every gradient, handed out as views of it
            got = iter(torch._C._nn.unflatten_dense_tensors(entry.flat.clone(), entry.used_params))
            grads = [next(got) if u else None for u in entry.used]
        return (None, None, None, None, None, dx, *grads)
