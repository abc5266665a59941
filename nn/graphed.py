"""CUDA graphs for ragged batches: :func:`graphed` captures a module's forward (in train mode its
forward and backward: :mod:`.graphed_train`) once per bucket of (tokens, sequences, longest
sequence) and replays it for every batch that fits.

In eval mode, a batch of ``T`` tokens in ``B`` sequences, the longest ``L``, runs the graph of the smallest
buckets ``T_b >= T``, ``B_b >= B``, ``L_b >= L``: its values are copied into the first ``T``
rows of a static ``[T_b, *F]`` buffer and its offsets into a static ``[B_b + 1]`` buffer whose
entries past ``B`` repeat ``T``. The extra sequences have no tokens and the rows past ``T``
belong to no sequence: every ragged kernel sizes its work from the host ints (``T_b``, ``B_b``,
``L_b``) and reads the offsets on the device, so a program of a sequence with no tokens exits and
the spare rows are computed by the per-token steps (GEMMs, LayerNorm) but read by nothing that
writes a real token's result. The outputs are cut back to ``T`` tokens and ``B`` sequences.

Rules of the wrapped call, checked on every call (host ints only, no device read):

* arguments are RaggedTensors of one batch (offsets trusted equal to the first one's),
  per-sequence tensors ``[B, ...]`` (``labels``, say) and constants (None, bool, int, float,
  str), which are part of the graph's key; the first RaggedTensor sets the batch;
* no loss sees a spare sequence or row, in training and in evaluation (see :mod:`.graphed_train`):
  a cross-entropy in the graph ignores them (integer labels, -100 at the spare entries); a loss
  that has no ignored entries is computed after the graph, on the outputs cut to the caller's
  batch, where a model family's hooks take it out of the call (:meth:`GraphHooks.outside_loss`);
  labels of floating dtype for anything else are refused;
* in eval mode the call runs under ``torch.no_grad()``; in train mode (with gradients enabled)
  it replays the training graphs, and ``backward`` their backward;
* outputs: a RaggedTensor comes back with the caller's offsets and ``T`` rows; a tensor whose
  first dim is the bucket's ``B_b`` is cut to ``B`` rows (per-sequence results: pooled
  embeddings, sequence logits); other tensors come back whole; tuples, lists, dicts and
  HuggingFace ``ModelOutput`` s are walked;
* a batch over the largest bucket, or off the GPU, runs the module eagerly (a one-time
  warning says why);
* no bucket is longer than the longest sequence the module takes (``max_len``, or what its
  family's hooks read from it: :meth:`GraphHooks.max_len`): a spare row's position is below the
  bucket's length, so every position the graph looks up exists; a batch longer than that is
  refused.

This module knows no model family: what only a family knows comes from the :class:`GraphHooks`
that the family registers (:func:`register_hooks`; the HuggingFace families' are
:mod:`ragged.nn.hf.graphs`).

The graphs share one memory pool and are captured lazily, the first time a bucket is met, after
two warm-up runs on a side stream (they compile the kernels and let cuBLAS pick its algorithms).
Graphs hold the addresses of the module's parameters: after moving the module (``.to()``) or
replacing parameters call :meth:`Graphed.reset`; in-place updates (``load_state_dict``,
optimizer steps) are seen by the next replay.

**Threads.** The graphs read and write static buffers that every call shares (the buckets share
the input buffers and one memory pool), so a call holds :attr:`Graphed.lock` (re-entrant) from
copying its inputs in, through the capture or replay, to copying the outputs out: calls from
several threads take turns, and calls that run eagerly (off the GPU, over the largest bucket)
do not wait. With ``copy_outputs=False`` the outputs are the graphs' buffers themselves, which
the next call from any thread may overwrite: hold ``g.lock`` around the call and the reads of
its outputs.

Captures on one GPU take turns with the work of every graphed module's calls on that GPU (one
lock per GPU, held by a call inside its own ``lock``; threads that drive different GPUs do not
wait on each other), and Python's cyclic garbage collector is paused while a capture runs: a
collection inside a capture (any thread's allocation can start one) that frees the graphs of
modules that are garbage invalidates the capture ("operation failed due to a previous error
during capture": one two-thread run in a few dozen to a few hundred without the pause, none
in 2,200 with it). Eager CUDA work of your own in another thread on the same GPU is not held
back: keep it apart from a bucket's first call, when its graph is captured.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ragged import RaggedTensor
from ragged.utils import describe

from . import graphed_train
from .graph_switch import emulating
from .graphed_train import smallest as _smallest

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

__all__ = ["CaptureError", "GraphHooks", "Graphed", "graphed", "powers_of_two", "register_hooks"]

_CONSTANTS = (type(None), bool, int, float, str)


def powers_of_two(top: int, start: int = 1, steps: int = 1) -> tuple[int, ...]:
    """``start, 2 * start, ...`` up to ``top``, with ``top`` itself last; ``steps`` > 1 adds
    ``steps - 1`` evenly spaced sizes inside each octave (4: ``64, 80, 96, 112, 128, 160, ...``,
    at most 25% over a batch's size), each a multiple of 8 where the octave allows."""
    out: list[int] = []
    b = max(1, start)
    while b < top:
        for i in range(steps):
            size = b + (b * i) // steps
            if steps > 1 and b >= 8 * steps:
                size -= size % 8
            if size < top and (not out or size > out[-1]):
                out.append(size)
        b *= 2
    out.append(top)
    return tuple(out)


def _buckets(fn: str, name: str, given, top: int, start: int, steps: int = 1, why: str = "") -> tuple[int, ...]:
    if given is None:
        return powers_of_two(top, start, steps)
    try:
        values = sorted({int(v) for v in given})
    except (TypeError, ValueError):
        raise TypeError(f"{fn}(): expected {name} to be a list of ints, got {describe(given)}") from None
    if not values or values[0] < 1 or values[-1] > top:
        raise ValueError(f"{fn}(): expected {name} of ints in 1..{top}{why}, got {list(given)}")
    if values[-1] != top:
        values.append(top)
    return tuple(values)


class GraphHooks:
    """What a family of models tells the graph wrapper, which knows none. A family registers an
    instance with :func:`register_hooks` when its package is imported; each method answers for
    the modules of its family and returns None for any other (the defaults here)."""

    def max_len(self, module: nn.Module) -> tuple[int, str] | None:
        """``(L, why)``: the longest sequence ``module`` takes (its position table: a bucket longer
        than ``L`` would give the spare rows positions past it), and where that comes from."""
        return None

    def outside_loss(self, fn: str, module: nn.Module, args: tuple, kwargs: dict):
        """A loss of this call that no ignored entry keeps a bucket's spare sequences out of (a
        mean over every row), to compute after the graph: an object with ``args`` and ``kwargs``
        (the call without the loss's targets) and ``finish(module, out)`` (``out``, the outputs
        cut to the caller's batch, with the loss). Refuses targets the loss cannot take, before
        anything runs; host ints only. None: no such loss."""
        return None

    def graphed(self, module: nn.Module, make: Callable[[nn.Module], Graphed]) -> nn.Module | None:
        """What :func:`graphed` returns for a ``module`` whose graphs belong to a model inside it
        (``make(inner)`` builds the :class:`Graphed` of ``inner`` with the call's buckets), or
        None: ``module`` itself is graphed."""
        return None


_HOOKS: list[GraphHooks] = []


def register_hooks(hooks: GraphHooks) -> None:
    """Consult ``hooks`` for every module graphed from now on (registering it again does nothing)."""
    if not any(h is hooks for h in _HOOKS):
        _HOOKS.append(hooks)


def _ask(method: str, *args):
    """The first registered family's answer that is not None."""
    for hooks in _HOOKS:
        found = getattr(hooks, method)(*args)
        if found is not None:
            return found
    return None


def _check_int(fn: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}(): expected {name} to be an int, got {describe(value)}")
    if value < 1:
        raise ValueError(f"{fn}(): expected {name} >= 1, got {value}")
    return value


class CaptureError(RuntimeError):
    """A module's call could not be captured in a CUDA graph (its cause: ``__cause__``), e.g. a
    forward that reads the GPU on the host. Nothing is kept of the failed capture: the same call
    runs eagerly."""


class _Graph:
    """A bucket's static buffers and its graph (inference: a ``CUDAGraph``; training: the
    forward and backward graphs of :mod:`.graphed_train`)."""

    __slots__ = ("graph", "offsets", "output", "seqs", "values")

    def __init__(self, graph, values, offsets, output, seqs=()) -> None:
        self.graph, self.values, self.offsets, self.output, self.seqs = graph, values, offsets, output, seqs


class Graphed(nn.Module):
    """A module whose inference forward replays CUDA graphs per bucket: see :func:`graphed`."""

    def __init__(
        self,
        module: nn.Module,
        max_tokens: int,
        max_batch_size: int,
        token_buckets=None,
        batch_buckets=None,
        length_buckets=None,
        copy_outputs: bool = True,
        capture: bool = True,
        max_len: int | None = None,
    ) -> None:
        fn = "ragged.nn.graphed"
        if not isinstance(module, nn.Module):
            raise TypeError(f"{fn}(): expected module to be a torch.nn.Module, got {describe(module)}")
        max_tokens = _check_int(fn, "max_tokens", max_tokens)
        max_batch_size = _check_int(fn, "max_batch_size", max_batch_size)
        # the longest sequence the module takes: a bucket's length never exceeds it (the spare
        # rows' positions run up to the bucket's length minus one)
        limit = _ask("max_len", module)
        if limit is not None and limit[0] < 1:
            raise ValueError(
                f"{fn}(): expected a model that takes sequences of at least one token, got "
                f"{type(module).__name__} ({limit[1]})"
            )
        if max_len is not None:
            max_len = _check_int(fn, "max_len", max_len)
            if limit is not None and max_len > limit[0]:
                raise ValueError(
                    f"{fn}(): expected max_len <= {limit[0]}, the longest sequence "
                    f"{type(module).__name__} takes ({limit[1]}), got {max_len}"
                )
            limit = (max_len, f"max_len={max_len}")
        super().__init__()
        self.module = module
        self.max_tokens, self.max_batch_size = max_tokens, max_batch_size
        # tokens: eight buckets an octave (the GEMMs run on the bucket's rows: at most 12.5% more;
        # four an octave measured 0.86x of dense-equal-tokens at B=256 where the exact count would
        # give about 0.77x); sequences and lengths: powers of two (they size grids, not work)
        self.token_buckets = _buckets(fn, "token_buckets", token_buckets, max_tokens, 64, 8)
        self.batch_buckets = _buckets(fn, "batch_buckets", batch_buckets, max_batch_size, 1)
        self.max_len: int | None
        self._max_len_why: str
        self.max_len, self._max_len_why = (None, "") if limit is None else limit
        top = max_tokens if self.max_len is None else min(max_tokens, self.max_len)
        why = (
            ""
            if self.max_len is None or top == max_tokens
            else f" (the longest sequence {type(module).__name__} takes: {self._max_len_why})"
        )
        self.length_buckets = _buckets(fn, "length_buckets", length_buckets, top, 16, why=why)
        self.copy_outputs = bool(copy_outputs)
        # False: run the bucketed (padded) batch eagerly instead of capturing: the same inputs the
        # graphs see, on any device (what the CPU tests check)
        self.capture = bool(capture)
        self._graphs: dict[tuple, _Graph] = {}
        # not ``_buffers``: that is Module's own table of registered buffers
        self._static_buffers: dict[tuple, torch.Tensor] = {}
        self._pool: _POOL_HANDLE | None = None
        self._train = graphed_train.TrainGraphs(self)
        self._params: list | None = None  # the parameters the training graphs were captured for
        self._memory: dict[tuple, int] = {}
        self._warned: set[str] = set()
        self.lock = threading.RLock()  # see the module docstring: held from the inputs in to the outputs out

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["lock"]  # a lock is of this process
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.lock = threading.RLock()

    # ------------------------------------------------------------------------------------
    # Public

    @property
    def num_graphs(self) -> int:
        """How many buckets have been captured."""
        return len(self._graphs)

    def reset(self) -> None:
        """Drop every graph and static buffer (after moving the module or replacing parameters)."""
        with self.lock:  # not under a call of another thread
            self._graphs.clear()
            self._static_buffers.clear()
            self._pool = None
            self._train.reset()
            self._params = None
            self._memory.clear()

    def bucket(self, num_tokens: int, batch_size: int, max_len: int) -> tuple[int, int, int] | None:
        """``(T_b, B_b, L_b)`` a batch of this size runs in, or None when it is over the largest."""
        b = _smallest(self.batch_buckets, batch_size)
        t = _smallest(self.token_buckets, num_tokens)
        if b is not None and t is not None and b > batch_size and t == num_tokens:
            # the sequences added to the batch start at row T: keep one row past it so that a
            # per-sequence gather at the start of an empty sequence stays in bounds
            t = _smallest(self.token_buckets, num_tokens + 1)
        lb = _smallest(self.length_buckets, max(max_len, 1))
        if b is None or t is None or lb is None:
            return None
        return t, b, min(lb, t)

    def memory(self) -> dict:
        """Device memory held for the graphs, in bytes: ``"graphs"`` (the shared pool, as the
        captures grew it), ``"buffers"`` (static inputs), ``"gradients"`` (the training graphs'
        persistent parameter gradients), ``"buckets"`` (per captured bucket, what its capture
        added to the pool: later captures reuse the pool, so these do not add up to more)."""
        grads = sum(g.numel() * g.element_size() for g in self._train._grads.values())
        bufs = sum(b.numel() * b.element_size() for b in self._static_buffers.values())
        return {
            "graphs": sum(self._memory.values()),
            "buffers": bufs,
            "gradients": grads,
            "buckets": {k[0]: v for k, v in self._memory.items()},
        }

    def forward(self, *args, **kwargs):
        fn = "ragged.nn.Graphed.forward"
        outside = _ask("outside_loss", fn, self.module, args, kwargs)
        if outside is not None:  # a loss that would average a bucket's spare sequences in: the graph gives the logits
            out = self.forward(*outside.args, **outside.kwargs)
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.module.training):
                return outside.finish(self.module, out)
        rts, seqs, key_args = self._read_args(fn, args, kwargs)
        first = rts[0][1]
        training = self.module.training
        if training and not torch.is_grad_enabled():
            return self._eager(
                "no_grad",
                "the module is in training mode under torch.no_grad(): the graphs of "
                "training capture the backward too (call .eval() to replay the inference graphs)",
                args,
                kwargs,
            )
        n_tok, batch, max_len = first.num_tokens, first.batch_size, first.max_len
        if self.max_len is not None and max_len > self.max_len:
            raise ValueError(
                f"{fn}(): expected sequences of at most {self.max_len} tokens, the longest "
                f"{type(self.module).__name__} takes ({self._max_len_why}), got a batch whose max_len "
                f"is {max_len}"
            )
        fills = [
            graphed_train.fill_value(fn, slot, t.values if isinstance(t, RaggedTensor) else t)
            for slot, t in [*rts, *seqs]
        ]
        device = first.values.device
        if self.capture and device.type != "cuda" and not (training and emulating()):
            return self._eager("device", f"inputs on {device}: CUDA graphs need CUDA tensors", args, kwargs)
        if training:
            found = graphed_train.train_bucket(self, n_tok, batch, max_len)
            size, fillers = (None, 0) if found is None else (found[:3], found[3])
        else:
            size, fillers = self.bucket(n_tok, batch, max_len), 0
        if size is None:
            return self._eager(
                "size",
                f"a batch of {n_tok} tokens in {batch} sequences is over the largest bucket "
                f"({self.max_tokens} tokens, {self.max_batch_size} sequences)",
                args,
                kwargs,
            )
        t_b, b_b, l_b = size
        off = first.offsets
        autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        grad_inputs = tuple(i for i, (_, rt) in enumerate(rts) if training and rt.values.requires_grad)
        deliver = False
        if training:
            params = self._train_params()
            if graphed_train.sharded(params):
                return self._eager(
                    "sharded",
                    "parameters sharded by FSDP2 (DTensors): a graph cannot hold the addresses of "
                    "parameters gathered and freed around each use",
                    args,
                    kwargs,
                )
            # DDP's reducer (or a parameter's hook) waits for the gradients in autograd's accumulation
            deliver = self.capture and graphed_train.delivers(params)
        key = (
            size,
            training,
            off.dtype,
            device,
            autocast,
            tuple((slot, rt.values.dtype, tuple(rt.values.shape[1:])) for slot, rt in rts),
            tuple((slot, t.dtype, tuple(t.shape[1:])) for slot, t in seqs),
            grad_inputs,
            key_args,
            deliver,
        )
        # the bucket's buffers are shared by every thread's calls, and the calls on one GPU take
        # turns with its captures (module docstring)
        turn = graphed_train.capture_lock(device) if device.type == "cuda" else contextlib.nullcontext()
        with self.lock, turn:
            entry = self._graphs.get(key)
            with torch.no_grad():
                if entry is None:
                    entry = self._static(key, rts, seqs, size)
                values, offsets, per_seq = entry.values, entry.offsets, entry.seqs
                self._fill(rts, seqs, fills, values, per_seq, n_tok, batch, training)
                offsets[: batch + 1].copy_(off)
                if b_b > batch:
                    if training:
                        ramp = self._train.ramp(device, offsets.dtype, b_b)
                        graphed_train.spare_offsets(offsets, ramp, batch, n_tok, size, fillers)
                    else:
                        offsets[batch + 1 :].fill_(n_tok)
            if training:
                return self._train_step(
                    key, entry, rts, seqs, args, kwargs, size, params, grad_inputs, autocast, deliver
                )
            with torch.no_grad():
                if self.capture and entry.graph is None:
                    self._capture(entry, args, kwargs, rts, seqs, l_b, device, key)
                if entry.graph is None:
                    out = self._call(args, kwargs, rts, values, offsets, l_b, seqs, per_seq)
                else:
                    entry.graph.replay()
                    out = entry.output
                return _cut(out, first, t_b, b_b, self.copy_outputs or entry.graph is None)

    # ------------------------------------------------------------------------------------
    # Internals

    def _read_args(self, fn: str, args: tuple, kwargs: dict):
        rts: list[tuple[object, RaggedTensor]] = []
        seqs: list[tuple[object, torch.Tensor]] = []
        key = []
        for slot, value in [*enumerate(args), *kwargs.items()]:
            if isinstance(value, RaggedTensor):
                rts.append((slot, value))
            elif isinstance(value, torch.Tensor):
                seqs.append((slot, value))
            elif isinstance(value, _CONSTANTS):
                key.append((slot, value))
            else:
                raise TypeError(
                    f"{fn}(): expected RaggedTensor arguments, per-sequence tensors and constants (None, "
                    f"bool, int, float, str), got {describe(value)} for argument {slot!r}"
                )
        if not rts:
            raise TypeError(f"{fn}(): expected at least one RaggedTensor argument (the batch), got none")
        first = rts[0][1]
        for slot, rt in rts[1:]:
            # the same batch: the offsets are trusted to be equal (comparing them would read the GPU)
            if rt.batch_size != first.batch_size or rt.num_tokens != first.num_tokens:
                raise ValueError(
                    f"{fn}(): expected every RaggedTensor argument to be of the first one's batch "
                    f"({first.batch_size} sequences, {first.num_tokens} tokens), got argument {slot!r} "
                    f"with {rt.batch_size} sequences and {rt.num_tokens} tokens"
                )
        for slot, t in seqs:
            if t.dim() < 1 or t.shape[0] != first.batch_size or t.device != first.values.device:
                raise ValueError(
                    f"{fn}(): expected tensor argument {slot!r} to hold one entry per sequence "
                    f"(shape [{first.batch_size}, ...] on {first.values.device}), got shape "
                    f"{tuple(t.shape)} on {t.device}"
                )
        return rts, seqs, tuple(key)

    def _warn_once(self, kind: str, why: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(
                f"ragged.nn.graphed: running eagerly ({why}); further such calls run eagerly without a warning",
                stacklevel=3,
            )

    def _eager(self, kind: str, why: str, args, kwargs):
        self._warn_once(kind, why)
        if self.module.training:
            return self.module(*args, **kwargs)
        with torch.no_grad():
            return self.module(*args, **kwargs)

    def _buffer(self, name: tuple, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A zeroed static buffer of ``rows`` rows like ``like`` (shared by the buckets that fit
        it: a bucket uses its first rows). Zeros: the spare rows of ids stay valid ids."""
        key = (name, like.dtype, like.device, tuple(like.shape[1:]))
        buf = self._static_buffers.get(key)
        if buf is None or buf.shape[0] < rows:
            top = max(rows, self.max_tokens if name[0] == "values" else self.max_batch_size + 1)
            with torch.inference_mode(False):  # a normal tensor: written in place in and out of inference mode
                buf = torch.zeros((top, *like.shape[1:]), dtype=like.dtype, device=like.device)
            self._static_buffers[key] = buf
        return buf[:rows]

    def _static(self, key, rts, seqs, size) -> _Graph:
        t_b, b_b, _ = size
        values = [self._buffer(("values", slot), t_b, rt.values) for slot, rt in rts]
        per_seq = [self._buffer(("seq", slot), b_b, t) for slot, t in seqs]
        offsets = self._buffer(("offsets",), b_b + 1, rts[0][1].offsets)
        entry = self._graphs[key] = _Graph(None, values, offsets, None, per_seq)
        return entry

    @staticmethod
    def _fill(rts, seqs, fills, values, per_seq, n_tok: int, batch: int, training: bool) -> None:
        """The batch into the static buffers; the spare entries of labels set to be ignored. In
        training every spare row is set (the fillers' rows enter the weight gradients with a
        zero factor: they must be finite); in inference the spare rows of other inputs keep
        earlier batches' values (no real token reads them)."""
        it = iter(fills)
        for (_, rt), static in zip(rts, values):
            static[:n_tok].copy_(rt.values)
            fill = next(it)
            if (fill or training) and static.shape[0] > n_tok:
                static[n_tok:].fill_(fill)
        for (_, t), static in zip(seqs, per_seq):
            static[:batch].copy_(t)
            fill = next(it)
            if fill or static.shape[0] > batch:
                static[batch:].fill_(fill)

    def _call(self, args, kwargs, rts, values, offsets, max_len: int, seqs=(), per_seq=()):
        static = {slot: RaggedTensor(v, offsets, max_len) for (slot, _), v in zip(rts, values)}
        static.update({slot: t for (slot, _), t in zip(seqs, per_seq)})
        a = tuple(static.get(i, x) for i, x in enumerate(args))
        k = {name: static.get(name, x) for name, x in kwargs.items()}
        return self.module(*a, **k)

    def _capture(self, entry: _Graph, args, kwargs, rts, seqs, l_b: int, device, key) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with graphed_train.capturing(device):  # one capture at a time per GPU, no collection meanwhile
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._call(args, kwargs, rts, entry.values, entry.offsets, l_b, seqs, entry.seqs)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: threads driving other GPUs (python -m ragged.embed --devices) may go on
            # meanwhile; this thread's own calls are checked as in the default mode
            # the pool's growth is read inside the capture: entering it empties the allocator's cache.
            # The capture runs on this GPU's capture stream: torch.cuda.graph's default is one stream
            # for the whole process, which threads capturing on two GPUs at once would share
            capture = graphed_train.capture_stream(device)
            try:
                with torch.cuda.graph(graph, pool=self._pool, stream=capture, capture_error_mode="thread_local"):
                    before = torch.cuda.memory_reserved(device)
                    output = self._call(args, kwargs, rts, entry.values, entry.offsets, l_b, seqs, entry.seqs)
                    self._memory[key] = torch.cuda.memory_reserved(device) - before
            except Exception as e:
                self._memory.pop(key, None)
                raise CaptureError(
                    f"ragged.nn.graphed: the forward of {type(self.module).__name__} cannot be captured in a "
                    f"CUDA graph ({type(e).__name__}: {e}); call the module itself to run it eagerly"
                ) from e
            entry.output, entry.graph = output, graph

    def _train_params(self) -> list:
        """The parameters that require grad (listed once; a change of which ones do, or of the
        parameters themselves, drops the training graphs: they hold the old set's addresses)."""
        params = self._params
        if params is None or any(p.requires_grad != flag for p, flag in params):
            listed = [(p, p.requires_grad) for p in self.module.parameters()]
            if params is not None:
                for k in [k for k in self._graphs if k[1]]:
                    del self._graphs[k]
            params = self._params = listed
        return [p for p, flag in params if flag]

    def _train_step(
        self, key, entry: _Graph, rts, seqs, args, kwargs, size, params, grad_inputs, autocast, deliver: bool
    ):
        first = rts[0][1]
        n_tok = first.num_tokens
        t_b, b_b, l_b = size
        if not self.capture:
            # the bucketed batch, eagerly (autograd through it): what the graphs compute, on any device
            values = [
                torch.cat([rt.values, static[n_tok:]]) if i in grad_inputs else static
                for i, ((_, rt), static) in enumerate(zip(rts, entry.values))
            ]
            out = self._call(args, kwargs, rts, values, entry.offsets, l_b, seqs, entry.seqs)
            return _cut(out, first, t_b, b_b, False)
        device = first.values.device
        if entry.graph is None:
            inputs = list(entry.values)

            def call():
                return self._call(args, kwargs, rts, inputs, entry.offsets, l_b, seqs, entry.seqs)

            try:
                entry.graph = self._train.capture(call, inputs, list(grad_inputs), params, device, autocast, deliver)
            except Exception as e:
                self._graphs.pop(key, None)
                raise CaptureError(
                    f"ragged.nn.graphed: capturing the training step of the bucket {size} of "
                    f"{type(self.module).__name__} failed ({type(e).__name__}: {e}); call the module "
                    "itself to train it eagerly"
                ) from e
            self._memory[key] = entry.graph.memory
        user_inputs = [rts[i][1].values for i in grad_inputs]
        return self._train.replay(entry.graph, first, size, user_inputs)


def _cut(out, first: RaggedTensor, t_b: int, b_b: int, copy: bool):
    """The graph's outputs cut to the caller's batch (see the module docstring)."""
    n_tok, batch = first.num_tokens, first.batch_size

    def walk(x):
        if isinstance(x, RaggedTensor):
            v = x.values[:n_tok]
            return first.with_values(v.clone() if copy else v)
        if isinstance(x, torch.Tensor):
            if x.dim() >= 1 and x.shape[0] == b_b:
                x = x[:batch]
            return x.clone() if copy else x
        if isinstance(x, dict):  # HuggingFace ModelOutput is an OrderedDict subclass
            items = {k: walk(v) for k, v in x.items()}
            try:
                return type(x)(**items)
            except TypeError:
                return type(x)(items)
        if isinstance(x, tuple):
            items = [walk(v) for v in x]
            return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(out)


def graphed(
    module: nn.Module,
    *,
    max_tokens: int,
    max_batch_size: int,
    token_buckets=None,
    batch_buckets=None,
    length_buckets=None,
    copy_outputs: bool = True,
    max_len: int | None = None,
) -> Graphed:
    """``module``'s inference forward on RaggedTensor batches through CUDA graphs, one per bucket.

    ``max_tokens`` / ``max_batch_size``: the largest batch graphed (larger ones run eagerly, with
    a one-time warning). Buckets: ``token_buckets`` (default 64, 72, 80, ..., 128, 144, ...: eight an octave),
    ``batch_buckets`` (from 1) and ``length_buckets`` (longest sequence, from 16), each ending at
    its maximum (for lengths the smaller of ``max_tokens`` and the longest sequence the module
    takes). ``copy_outputs=False`` returns views of the graph's static outputs (no copy; the next
    call, from any thread, may overwrite them: hold the module's ``lock`` around
    the call and the reads of its outputs to keep other threads' calls out meanwhile). Calls from
    several threads take turns on the graphs (see the module docstring).

    ``max_len``: the longest sequence the module takes. Where the module's family knows it
    (:meth:`GraphHooks.max_len`: a converted HuggingFace model's position table),
    ``max_len`` may only lower it. The spare rows of a bucket get positions up to
    the bucket's length minus one, so no length bucket exceeds it: ``length_buckets`` above it
    are refused, and a batch whose ``max_len`` exceeds it raises ``ValueError`` (the model
    cannot take it; on the GPU its position lookup would fail inside the graph).

    Works for ``ragged.nn`` encoders and HuggingFace models converted by
    :func:`ragged.nn.convert` (embeddings, layers and head inside the graph): ``g(rt)`` with ``rt``
    a RaggedTensor of token ids, or of ``[T, d]`` hidden states. See the module docstring for the
    rules of a call.

    A module whose graphs belong to a model inside it is returned as its family's hooks make it
    (:meth:`GraphHooks.graphed`): a SentenceTransformer converted by :func:`ragged.nn.convert` is
    returned itself, its ``encode()`` (and forward) now replaying graphs of its HuggingFace model
    (see :mod:`ragged.nn.hf.graphs`).
    """

    def make(inner: nn.Module) -> Graphed:
        return Graphed(
            inner,
            max_tokens,
            max_batch_size,
            token_buckets,
            batch_buckets,
            length_buckets,
            copy_outputs,
            max_len=max_len,
        )

    wrapped = _ask("graphed", module, make)
    return make(module) if wrapped is None else wrapped
