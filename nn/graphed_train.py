"""Training through :func:`ragged.nn.graphed`: the forward and the backward of a bucket are
captured once as two CUDA graphs and replayed for every batch that fits it.

How a batch fills its bucket ``(T_b, B_b, L_b)`` in training. The ``T_b - T`` spare rows are
given to *filler sequences* of at most ``L_b`` tokens each, appended after the batch's ``B``
sequences; the other spare sequences are empty and start at row ``T`` (a filler's first
row). Every row then belongs to a sequence, so every kernel writes every row it returns: a
spare row holds finite values, and its gradient is exactly zero, as the loss never reads it
(a row with no sequence would hold whatever the memory held, and ``0 * NaN`` in a weight
gradient is NaN). What is read from the spare rows and sequences is cut or ignored:

* the outputs are cut back to the caller's ``T`` tokens and ``B`` sequences (the gradients
  flowing back are zero past them);
* losses never see them (:func:`fill_value`, the same in evaluation): a cross-entropy computed
  inside the model skips them through its ignored entries (the spare entries of an argument
  named ``labels`` are ``-100``, ``ignore_index`` of every cross-entropy in HuggingFace's heads:
  means over real tokens and real sequences only; those of ``start_positions`` /
  ``end_positions`` lie past every sequence). A loss with no ignored entries cannot skip them,
  whatever the spare entries hold (MSE and BCE average over every row): a model family's hooks
  take such a loss out of the call, to be computed after the graph from the outputs cut to the
  caller's sequences (:meth:`ragged.nn.graphed.GraphHooks.outside_loss`); labels of floating
  dtype for any other module are refused (compute that loss from the cut outputs).

The two graphs of a bucket. The forward graph runs the module on the static inputs; the
backward graph computes the gradients of its differentiable outputs with respect to the
parameters (and to RaggedTensor inputs that require a gradient) from static gradient
buffers, and adds them into one persistent gradient tensor per parameter (shared by the
buckets). A ``torch.autograd.Function`` joins them to the caller's autograd graph: its forward
replays the forward graph and returns copies of the outputs; its backward copies the incoming
gradients in, replays the backward graph, and hands the parameters their gradients:

* a parameter whose ``.grad`` is None (``zero_grad(set_to_none=True)``) gets the persistent
  tensor, zeroed before the replay (one fused launch for all of them);
* one whose ``.grad`` is already that tensor accumulates (gradient accumulation, or
  ``zero_grad(set_to_none=False)`` which zeroed it in place);
* one whose ``.grad`` is another tensor gets the new gradient added to it.

The parameters' gradients are therefore written by the graphs, not by autograd's
accumulation, and ``torch.autograd.grad(loss, params)`` raises instead of returning them;
``loss.backward()`` is the way.

**Gradients through autograd** (*delivered*): where something waits for the parameters'
gradients in autograd's accumulation, the bucket's graphs are captured the other way (the
choice is part of the bucket's key). That is inside the forward of a
``DistributedDataParallel`` (its reducer all-reduces each gradient bucket from hooks there) and
for parameters with gradient hooks of their own (``register_hook``,
``register_post_accumulate_grad_hook``). The backward graph then writes the gradients into one
flat buffer per dtype, and the ``Function``'s backward returns a copy of it, cut into one view
per parameter, as every parameter's gradient: autograd accumulates them into ``.grad`` (or
hands them to ``torch.autograd.grad``) and runs the hooks, so DDP reduces them as for the
eager module, ``no_sync()``, gradient accumulation and unused parameters
(``find_unused_parameters``) included. DDP's all-reduces start when the backward graph has
finished (one replay for the whole backward): they do not overlap it. Under FSDP2 (parameters
that are ``DTensor`` s, gathered and freed around each use) no graph can hold their
addresses: :func:`ragged.nn.graphed` runs such a module eagerly, with a warning.

A bucket's saved activations live in the graphs' memory pool until its backward replays:
call ``backward`` on one forward's outputs before the next training forward of the same
graphed module (the usual loop, gradient accumulation included). A backward of an older
forward raises instead of using overwritten activations; so does a second backward of one
forward.

Dropout draws new masks on every replay: torch's own dropout through its graph-safe
generator, the attention kernels from a seed they read on the device (see
:func:`ragged.ops.attention.dropout_seed`); ``torch.manual_seed`` makes runs reproducible.
Under ``torch.autocast`` the graphs are captured with the autocast weight cache off (cast
weights cannot outlive a capture), and the autocast state is part of the bucket's key. The
dropout rates are part of the captured graphs: after changing one, call ``reset()``. Graphs
in eval mode record no backward: evaluation replays the inference graphs under ``no_grad``.
"""

from __future__ import annotations

import contextlib
import gc
import threading

import torch

from ragged import RaggedTensor

from .graph_switch import aliased, off

__all__ = [
    "IGNORE",
    "SPAN_POSITIONS",
    "TrainGraphs",
    "delivers",
    "fill_value",
    "is_float",
    "sharded",
    "smallest",
    "spare_offsets",
    "train_bucket",
]

IGNORE = -100
_PAST_EVERY_SEQUENCE = 2**30  # a span position beyond every sequence: ignored by the QA loss
SPAN_POSITIONS = ("start_positions", "end_positions")  # a span's targets, one per sequence


def is_float(t: torch.Tensor) -> bool:
    """Whether ``t`` holds floating (or complex) values: targets that no ignored entry can mark."""
    return t.dtype.is_floating_point or t.dtype.is_complex


def fill_value(fn: str, name, t: torch.Tensor) -> int:
    """What the spare entries (rows or sequences) of argument ``name`` hold (see the module
    docstring); 0 for inputs (valid ids, finite values). Labels and span positions must be
    integers: only a cross-entropy's ignored entries keep the spare ones out of a loss
    computed inside the graph (the losses that have none are taken out first: a family's
    :meth:`ragged.nn.graphed.GraphHooks.outside_loss`)."""
    if name == "labels" or name in SPAN_POSITIONS:
        if is_float(t):
            what = "labels (a cross-entropy loss" if name == "labels" else f"{name} (a span loss"
            raise ValueError(
                f"{fn}(): expected integer {what}, whose ignored entries keep the spare sequences of a "
                f"bucket out of the loss), got {name} of dtype {t.dtype}; call the graphed module "
                f"without {name} and compute this loss from its outputs"
            )
        return IGNORE if name == "labels" else _PAST_EVERY_SEQUENCE
    return 0


def smallest(buckets: tuple[int, ...], n: int) -> int | None:
    """The smallest of the sorted ``buckets`` that is at least ``n`` (None: over the largest)."""
    for b in buckets:
        if b >= n:
            return b
    return None


def train_bucket(graphed, num_tokens: int, batch_size: int, max_len: int) -> tuple[int, int, int, int] | None:
    """``(T_b, B_b, L_b, fillers)`` of a training batch, or None over the largest bucket: the
    spare rows go to ``fillers`` sequences of at most ``L_b`` tokens, so ``B_b`` leaves room for
    them (past ``max_batch_size`` if need be, in steps of 8: the number of sequences sizes
    grids, not work), and a bucket with spare sequences has at least one spare row (the empty
    ones start there)."""
    need = max(num_tokens, 1)
    while True:
        t = smallest(graphed.token_buckets, need)
        if t is None:
            return None
        lb = smallest(graphed.length_buckets, max(max_len, 1))
        if lb is None:
            return None
        lb = min(lb, t)
        spare = t - num_tokens
        fillers = -(-spare // lb)
        if batch_size > graphed.max_batch_size:
            return None
        b = smallest(graphed.batch_buckets, batch_size + fillers)
        if b is None:  # a full batch and its fillers: sequences size grids only, go past the top
            b = -(-(batch_size + fillers) // 8) * 8
        if b > batch_size and spare == 0:
            need = num_tokens + 1  # the empty spare sequences need a row to start at
            continue
        return t, b, lb, fillers


def spare_offsets(offsets: torch.Tensor, ramp: torch.Tensor, batch: int, num_tokens: int, size, fillers: int) -> None:
    """Write the spare sequences' offsets ``offsets[batch + 1:]`` of a bucket (``ramp``: ``1, 2,
    ...`` on the device): the empty ones at ``num_tokens``, then the fillers' ends, ``L_b`` apart,
    the last at ``T_b``. Three small launches, no host read."""
    t_b, b_b, l_b = size
    empty = b_b - batch - fillers
    if empty:
        offsets[batch + 1 : batch + 1 + empty].fill_(num_tokens)
    if fillers:
        tail = offsets[batch + 1 + empty :]
        torch.mul(ramp[:fillers], l_b, out=tail)
        tail.add_(num_tokens).clamp_(max=t_b)


# --------------------------------------------------------------------------------------
# Outputs as a flat list of tensors and a rebuild


def flatten(x, leaves: list, ragged: list):
    """``x`` with every tensor (a RaggedTensor's values) replaced by its index in ``leaves``;
    ``ragged[i]``: whether leaf ``i`` is a RaggedTensor's values."""
    if isinstance(x, (RaggedTensor, torch.Tensor)):
        rt = isinstance(x, RaggedTensor)
        leaves.append(x.values if rt else x)
        ragged.append(rt)
        return ("rt" if rt else "t", len(leaves) - 1)
    if isinstance(x, dict):  # HuggingFace ModelOutput is an OrderedDict subclass
        return ("dict", type(x), [(k, flatten(v, leaves, ragged)) for k, v in x.items()])
    if isinstance(x, tuple):
        return ("tuple", type(x), [flatten(v, leaves, ragged) for v in x])
    if isinstance(x, list):
        return ("list", None, [flatten(v, leaves, ragged) for v in x])
    return ("const", x)


def rebuild(spec, leaves: list, first: RaggedTensor):
    kind = spec[0]
    if kind == "rt":
        return first.with_values(leaves[spec[1]])
    if kind == "t":
        return leaves[spec[1]]
    if kind == "const":
        return spec[1]
    _, cls, items = spec
    if kind == "dict":
        named = {k: rebuild(v, leaves, first) for k, v in items}
        try:
            return cls(**named)
        except TypeError:
            return cls(named)
    values = [rebuild(v, leaves, first) for v in items]
    if kind == "list":
        return values
    return cls(*values) if hasattr(cls, "_fields") else cls(values)


def _rows(entry, b_b: int, n_tok: int, batch: int) -> tuple[int | None, ...]:
    """Per output, the rows the caller gets: ``T`` for a RaggedTensor's values, ``B`` for a
    tensor whose first dim is ``B_b`` (per-sequence), None (whole) otherwise."""
    return tuple(
        n_tok if rt else batch if t.dim() >= 1 and t.shape[0] == b_b else None
        for t, rt in zip(entry.outputs, entry.ragged)
    )


# --------------------------------------------------------------------------------------
# The graphs of one bucket


_CAPTURE_LOCKS: dict[int, threading.RLock] = {}
_CAPTURE_LOCKS_GUARD = threading.Lock()


def capture_lock(device) -> threading.RLock:
    """The lock that the captures on ``device`` take, one at a time in the process: two threads
    capturing on one GPU at once share its random generator's capture state and the
    allocator's, which fails (threads on other GPUs, and eager work, go on meanwhile)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    with _CAPTURE_LOCKS_GUARD:
        return _CAPTURE_LOCKS.setdefault(index, threading.RLock())


_GC_PAUSES = [0, False]  # [captures under way in the process, whether the collector was on before]


@contextlib.contextmanager
def capturing(device):
    """A capture's turn on ``device``: :func:`capture_lock`, and Python's cyclic garbage collector
    paused in the process until every capture under way has ended. A collection inside a capture
    (any thread's allocation can start one) may free the graphs of modules that are garbage, and
    destroying a graph there invalidates the capture ("operation failed due to a previous error
    during capture"); torch.cuda.graph collects once before it begins, as nothing does after."""
    with capture_lock(device):
        with _CAPTURE_LOCKS_GUARD:
            if _GC_PAUSES[0] == 0:
                _GC_PAUSES[1] = gc.isenabled()
                gc.disable()
            _GC_PAUSES[0] += 1
        try:
            yield
        finally:
            with _CAPTURE_LOCKS_GUARD:
                _GC_PAUSES[0] -= 1
                if _GC_PAUSES[0] == 0 and _GC_PAUSES[1]:
                    gc.enable()


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device) -> torch.cuda.Stream:
    """The stream the captures on ``device`` run on, under :func:`capture_lock`: one per GPU, apart
    from the warm-up's (torch.cuda.graph's default is one stream for the whole process, made on
    whichever GPU was current first, which threads on two GPUs would share)."""
    device = torch.device(device)
    index = torch.cuda.current_device() if device.index is None else device.index
    with _CAPTURE_LOCKS_GUARD:
        stream = _CAPTURE_STREAMS.get(index)
        if stream is None:
            stream = _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
        return stream


class _Entry:
    __slots__ = (
        "bwd",
        "deliver",
        "diff",
        "fwd",
        "generation",
        "grad_inputs",
        "grad_outs",
        "memory",
        "outputs",
        "ragged",
        "spec",
        "used",
    )
    bwd: torch.cuda.CUDAGraph
    deliver: list | None  # delivered gradients (module docstring): the parameters, in the order returned
    diff: list[int]  # the leaves (of ``outputs``) that take a gradient
    fwd: torch.cuda.CUDAGraph
    generation: int
    grad_inputs: list[torch.Tensor | None]
    grad_outs: list[torch.Tensor]
    memory: int
    outputs: list[torch.Tensor]
    ragged: list[bool]
    spec: tuple  # :func:`flatten`'s description of the outputs
    used: list[tuple[torch.Tensor, torch.Tensor]]  # (parameter, its persistent gradient)

    def __init__(self) -> None:
        self.generation = 0
        self.deliver = None


def _ddp_forward() -> bool:
    """Whether this call runs inside the forward of a DistributedDataParallel."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return False
    from torch.nn.parallel import DistributedDataParallel

    return getattr(DistributedDataParallel, "_active_ddp_module", None) is not None


def delivers(params: list) -> bool:
    """Whether the gradients of ``params`` must come through autograd (module docstring)."""
    if _ddp_forward():
        return True
    return any(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None) for p in params)


def sharded(params: list) -> bool:
    """Whether any of ``params`` is a DTensor (FSDP2's sharded parameters)."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


class _Replay(torch.autograd.Function):
    """Replays a bucket's forward graph; its backward replays the backward graph."""

    @staticmethod
    def forward(ctx, owner, entry, cut, *inputs):
        rows, n_tok = cut
        entry.fwd.replay()
        owner._generation += 1
        entry.generation = owner._generation
        ctx.owner, ctx.entry, ctx.rows, ctx.n_tok, ctx.generation = owner, entry, rows, n_tok, entry.generation
        ctx.n_inputs = len(inputs)
        outs = [t.clone() if n is None else t[:n].clone() for t, n in zip(entry.outputs, rows)]
        diff = set(entry.diff)
        constants = [o for i, o in enumerate(outs) if i not in diff]
        if constants:
            ctx.mark_non_differentiable(*constants)
        return tuple(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        entry, owner = ctx.entry, ctx.owner
        if ctx.generation != entry.generation or entry.generation != owner._generation:
            raise RuntimeError(
                "ragged.nn.Graphed: backward of a training forward whose saved activations a later forward of the "
                "same graphed module replaced (or a second backward of one forward): call backward on each "
                "forward's outputs before the next forward"
            )
        entry.generation = -1  # one backward per forward
        deliver = entry.deliver is not None
        for i, buf in zip(entry.diff, entry.grad_outs):
            g, n = grads[i], ctx.rows[i]
            if g is None:
                buf.zero_()
            elif n is None:
                buf.copy_(g)
            else:
                buf[:n].copy_(g)
                buf[n:].zero_()
        if not deliver:
            owner._attach_grads(entry)
        entry.bwd.replay()
        out = [None, None, None]
        for buf in entry.grad_inputs:
            out.append(None if buf is None else buf[: ctx.n_tok].clone())
        if deliver:
            out += owner._delivered(entry)
        else:
            owner._finish_grads(entry)
        out += [None] * (3 + ctx.n_inputs - len(out))  # the anchor
        return tuple(out)


class TrainGraphs:
    """The training graphs of one :class:`ragged.nn.Graphed` (see the module docstring)."""

    def __init__(self, graphed) -> None:
        self.graphed = graphed
        self._generation = 0
        self._grads: dict[int, torch.Tensor] = {}  # id(parameter) -> its persistent gradient
        self._foreign: list = []  # (parameter, its own .grad) during one backward
        self._zeroed: list = []
        self._anchor: torch.Tensor | None = None
        self._ramps: dict = {}
        # delivered gradients: (dtype, device) -> (flat buffer, its parameters in order); id -> (group, offset)
        self._flats: dict[tuple, tuple[torch.Tensor, list]] = {}
        self._slots: dict[int, tuple[tuple, int]] = {}

    def reset(self) -> None:
        self._grads.clear()
        self._ramps.clear()
        self._anchor = None
        self._flats.clear()
        self._slots.clear()

    def ramp(self, device, dtype, n: int) -> torch.Tensor:
        key = (device, dtype)
        r = self._ramps.get(key)
        if r is None or r.shape[0] < n:
            r = self._ramps[key] = torch.arange(1, max(n, 64) + 1, device=device, dtype=dtype)
        return r

    # gradients ---------------------------------------------------------------------------

    def _attach_grads(self, entry: _Entry) -> None:
        """Before the backward replay: every parameter's gradient target (see the module docstring)."""
        fresh, foreign = [], []
        for p, g in entry.used:
            cur = p.grad
            if cur is g:
                continue
            if cur is None:
                fresh.append(g)
                p.grad = g
            else:
                fresh.append(g)
                foreign.append((cur, g))
        if fresh:
            torch._foreach_zero_(fresh)
        self._foreign = foreign

    def _finish_grads(self, entry: _Entry) -> None:
        foreign, self._foreign = self._foreign, []
        if foreign:
            mine = [g for _, g in foreign]
            torch._foreach_add_([c for c, _ in foreign], mine)

    def _layout(self, params: list) -> None:
        """The flat buffers of delivered gradients: one per (dtype, device), every parameter of
        ``params`` at its own offset (laid out again when the parameters change)."""
        known = self._slots
        if len(known) == len(params) and all(id(p) in known for p in params):
            return
        groups: dict[tuple, list] = {}
        for p in params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        self._flats, self._slots = {}, {}
        for key, ps in groups.items():
            offset = 0
            for p in ps:
                self._slots[id(p)] = (key, offset)
                offset += p.numel()
            self._flats[key] = (torch.zeros(offset, dtype=key[0], device=key[1]), ps)

    def delivery_view(self, p: torch.Tensor) -> torch.Tensor:
        key, offset = self._slots[id(p)]
        return self._flats[key][0].narrow(0, offset, p.numel()).view(p.shape)

    def _delivered(self, entry: _Entry) -> list[torch.Tensor]:
        """The delivered gradients of ``entry`` 's parameters: a copy of each flat buffer (one
        launch per dtype), cut into views (module docstring)."""
        views: dict[int, torch.Tensor] = {}
        for flat, ps in self._flats.values():
            for p, v in zip(ps, torch._C._nn.unflatten_dense_tensors(flat.clone(), ps)):
                views[id(p)] = v
        assert entry.deliver is not None
        return [views[id(p)] for p in entry.deliver]

    def persistent_grad(self, p: torch.Tensor) -> torch.Tensor:
        g = self._grads.get(id(p))
        if g is None or g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
            g = self._grads[id(p)] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return g

    # capture -----------------------------------------------------------------------------

    def capture(
        self,
        call,
        inputs: list[torch.Tensor],
        grad_inputs: list[int],
        params: list,
        device,
        autocast,
        deliver: bool = False,
    ) -> _Entry:
        """Warm up, then capture the forward graph of ``call()`` and the backward graph of its
        differentiable outputs; ``inputs``: the static input buffers, ``grad_inputs``: the
        positions among them whose gradient the caller needs; ``deliver``: the gradients go
        through autograd (module docstring)."""
        g = self.graphed
        if g._pool is None:
            g._pool = torch.cuda.graph_pool_handle()
        for i in grad_inputs:
            inputs[i].requires_grad_(True)
        leaves_in = [inputs[i] for i in grad_inputs]
        modules = list(g.module.modules())

        def run():
            # the whole module is captured here: its layers run as they are, not from their own graphs
            with off():
                if autocast is None:
                    return call()
                with torch.autocast("cuda", dtype=autocast, cache_enabled=False):
                    return call()

        def differentiable(out):
            leaves: list = []
            ragged: list = []
            spec = flatten(out, leaves, ragged)
            diff = [i for i, t in enumerate(leaves) if t.requires_grad and t.is_floating_point()]
            return spec, leaves, ragged, diff

        with capturing(device):
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles the kernels, lets cuBLAS pick its algorithms
                    # the parameters as fresh leaves (graph_switch.aliased): no capture meets their own
                    # accumulation nodes, which DDP keeps from the default stream
                    with aliased(modules, params) as ps:
                        spec, leaves, _, diff = differentiable(run())
                    wrt = leaves_in + ps
                    if not diff:
                        raise ValueError(
                            "ragged.nn.Graphed: the module's outputs need no gradient in training mode "
                            "(no parameter requires grad?)"
                        )
                    outs = [leaves[i] for i in diff]
                    torch.autograd.grad(outs, wrt, grad_outputs=[torch.zeros_like(o) for o in outs], allow_unused=True)
                    del spec, leaves, outs, wrt, ps
            torch.cuda.current_stream(device).wait_stream(stream)

            entry = _Entry()
            entry.fwd, entry.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            # the pool's growth, read inside each capture: entering one empties the allocator's cache,
            # so a reading taken before it could even come out negative. The captures run on this GPU's
            # capture stream (torch.cuda.graph's default stream is one for the process, shared by threads)
            with torch.cuda.graph(entry.fwd, pool=g._pool, stream=capture_stream(device)):
                before = torch.cuda.memory_reserved(device)
                with aliased(modules, params) as ps:
                    spec, leaves, ragged, diff = differentiable(run())
                wrt = leaves_in + ps
                entry.memory = torch.cuda.memory_reserved(device) - before
            entry.spec, entry.outputs, entry.ragged, entry.diff = spec, [t.detach() for t in leaves], ragged, diff
            entry.grad_outs = [torch.zeros_like(leaves[i]) for i in diff]
            if deliver:
                self._layout(params)
                persistent = [self.delivery_view(p) for p in params]
            else:
                persistent = [self.persistent_grad(p) for p in params]
            with torch.cuda.graph(entry.bwd, pool=g._pool, stream=capture_stream(device)):
                before = torch.cuda.memory_reserved(device)
                grads = torch.autograd.grad(
                    [leaves[i] for i in diff], wrt, grad_outputs=entry.grad_outs, allow_unused=True
                )
                n_in = len(grad_inputs)
                pairs = [(acc, d) for acc, d in zip(persistent, grads[n_in:]) if d is not None]
                if pairs and deliver:
                    torch._foreach_copy_([a for a, _ in pairs], [d for _, d in pairs])
                elif pairs:
                    torch._foreach_add_([a for a, _ in pairs], [d for _, d in pairs])
                entry.grad_inputs = [None if d is None else d.detach() for d in grads[:n_in]]
                entry.memory += torch.cuda.memory_reserved(device) - before
        entry.used = [(p, acc) for p, acc, d in zip(params, persistent, grads[n_in:]) if d is not None]
        if deliver:
            entry.deliver = [p for p, _ in entry.used]
        for i in grad_inputs:
            inputs[i].requires_grad_(False)
        del grads, leaves, wrt, ps
        return entry

    def anchor(self, device) -> torch.Tensor:
        """A leaf that requires grad, so that the replay joins autograd when no input does."""
        if self._anchor is None or self._anchor.device != device:
            self._anchor = torch.zeros((), device=device, requires_grad=True)
        return self._anchor

    def replay(self, entry: _Entry, first: RaggedTensor, size, user_inputs: list[torch.Tensor]):
        rows = _rows(entry, size[1], first.num_tokens, first.batch_size)
        if entry.deliver is not None:  # the parameters are the Function's inputs: autograd gets their gradients
            extra = list(entry.deliver) if entry.deliver else [self.anchor(first.values.device)]
        else:
            extra = [] if user_inputs else [self.anchor(first.values.device)]
        outs = _Replay.apply(self, entry, (rows, first.num_tokens), *user_inputs, *extra)
        return rebuild(entry.spec, list(outs), first)
