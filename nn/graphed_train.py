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
``register_post_accumulate_grad_hook``). The backward graphs then write the gradients into one
flat buffer per dtype, and the autograd nodes return copies of them, one view per parameter:
autograd accumulates them into ``.grad`` (or hands them to ``torch.autograd.grad``) and runs
the hooks, so DDP reduces them as for the eager module, ``no_sync()``, gradient accumulation
and unused parameters (``find_unused_parameters``) included.

The backward of a delivered bucket is cut into up to :data:`SEGMENTS` graphs at the hidden
states between encoder layers (:func:`ragged.nn.graph_switch.tap`), each its own autograd
node in a chain below the forward's: the top segment's node replays its graph and returns its
parameters' gradients; autograd accumulates them (DDP launches their all-reduce) before the
node of the segment below replays its graph, so the communication of the upper layers runs
while the lower layers' backward computes. A cut is taken only where it separates the
autograd graph (checked at capture, :func:`segments`): a parameter read both above and below
(tied embeddings) keeps the backward in one graph. Under FSDP2 (parameters that are
``DTensor`` s, gathered and freed around each use) no graph can hold their addresses:
:func:`ragged.nn.graphed` runs such a module eagerly, with a warning.

Every capture runs the module on the parameters swapped for fresh leaves on the same memory
(:func:`ragged.nn.graph_switch.aliased`) and differentiates with respect to those: autograd
never routes a captured gradient into the parameters' own accumulation nodes, which DDP keeps
alive from the default stream (a capture must not wait on it).

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
import functools
import gc
import threading
from collections.abc import Callable

import torch

from ragged import RaggedTensor

from .graph_switch import aliased, off, tapping

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
        "graphs",
        "groups",
        "memory",
        "outputs",
        "ragged",
        "spec",
        "top_done",
        "used",
    )
    bwd: list  # one replay per segment of the backward, the top one first
    deliver: list | None  # delivered gradients (module docstring): per segment, the parameters returned
    diff: list[int]  # the leaves (of ``outputs``) that take a gradient
    fwd: Callable[[], None]
    generation: int
    grad_inputs: list[torch.Tensor | None]
    grad_outs: list[torch.Tensor]
    graphs: list  # the CUDA graphs (kept alive with their entry)
    groups: list  # per segment: (positions, flat views, parameters) per dtype of its delivered gradients
    memory: int
    outputs: list[torch.Tensor]
    ragged: list[bool]
    spec: tuple  # :func:`flatten`'s description of the outputs
    top_done: int  # the forward whose top segment's backward ran (the lower segments' check)
    used: list[tuple[torch.Tensor, torch.Tensor]]  # (parameter, its persistent gradient)

    def __init__(self) -> None:
        self.generation = 0
        self.top_done = -1
        self.deliver = None
        self.graphs = []
        self.groups = []
        self.memory = 0


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


_STALE = (
    "ragged.nn.Graphed: backward of a training forward whose saved activations a later forward of the "
    "same graphed module replaced (or a second backward of one forward): call backward on each "
    "forward's outputs before the next forward"
)


class _Replay(torch.autograd.Function):
    """Replays a bucket's forward graph; its backward replays the (top segment's) backward graph."""

    @staticmethod
    def forward(ctx, owner, entry, cut, *inputs):
        rows, n_tok = cut
        entry.fwd()
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
            raise RuntimeError(_STALE)
        entry.generation = -1  # one backward per forward
        entry.top_done = ctx.generation
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
        entry.bwd[0]()
        out: list = [None, None, None]
        if len(entry.bwd) == 1:
            out += _input_grads(entry, ctx.n_tok)
        else:  # the token from the segment below: its backward runs next
            out.append(owner.zero(entry.grad_outs[0].device))
        if deliver:
            out += owner._delivered(entry, 0)
        else:
            owner._finish_grads(entry)
        out += [None] * (3 + ctx.n_inputs - len(out))  # the anchor
        return tuple(out)


class _Segment(torch.autograd.Function):
    """A lower segment of a bucket's backward (module docstring): its forward passes a token on
    (the forward graph replays at the top); its backward replays the segment's backward graph and
    returns its parameters' gradients, which autograd accumulates (DDP's hooks fire) before the
    segment below replays."""

    @staticmethod
    def forward(ctx, owner, entry, j, n_tok, token, *inputs):
        ctx.owner, ctx.entry, ctx.j, ctx.n_tok = owner, entry, j, n_tok
        ctx.forward_id = owner._generation + 1  # the id the top's forward takes next
        ctx.n_inputs = len(inputs)
        return token.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _token):
        entry, owner, j = ctx.entry, ctx.owner, ctx.j
        if entry.top_done != ctx.forward_id:
            raise RuntimeError(_STALE)
        entry.bwd[j]()
        out: list = [None, None, None, None]
        if j == len(entry.bwd) - 1:  # the bottom: the anchor, the inputs
            entry.top_done = -1
            out.append(None)
            out += _input_grads(entry, ctx.n_tok)
        else:
            out.append(owner.zero(entry.grad_outs[0].device))
        out += owner._delivered(entry, j)
        out += [None] * (5 + ctx.n_inputs - len(out))
        return tuple(out)


def _input_grads(entry: _Entry, n_tok: int) -> list:
    return [None if buf is None else buf[:n_tok].clone() for buf in entry.grad_inputs]


SEGMENTS = 4  # backward segments of a graph whose gradients are delivered (DDP reduces one while the next runs)


def _reach(starts: list, stop) -> tuple[set[int], bool]:
    """The ids of the leaves whose accumulation nodes the autograd graph reaches from ``starts``
    without passing ``stop``, and whether it met ``stop``."""
    found: set[int] = set()
    # the nodes visited, kept alive: a node's Python object lives only while referenced, and a
    # dropped one's id can come back as another node's
    seen: dict[int, object] = {}
    met = False
    stack = [fn for fn in starts if fn is not None]
    while stack:
        fn = stack.pop()
        if fn is stop:
            met = True
            continue
        if id(fn) in seen:
            continue
        seen[id(fn)] = fn
        var = getattr(fn, "variable", None)  # an AccumulateGrad node: a leaf
        if var is not None:
            found.add(id(var))
            continue
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return found, met


def segments(outs: list, taps: list, params: list, leaves_in: list, count: int = SEGMENTS):
    """``(bounds, segs)``: the hidden states at which the backward is cut (top first) and the
    positions in ``params`` of each segment's parameters (top first); None where it cannot be cut
    soundly: fewer than two layers tapped, or a path from the outputs to a parameter (or from a
    segment to an input) that bypasses a cut (a tied weight read above and below, say)."""
    n = len(taps)
    cut = sorted({round(n * j / count) - 1 for j in range(1, count)})
    cut = [i for i in cut if 0 <= i < n - 1]
    if not cut:
        return None
    bounds = [taps[i] for i in reversed(cut)]
    where = {id(q): k for k, q in enumerate(params)}
    inputs = {id(t) for t in leaves_in}
    owner: dict[int, int] = {}
    segs: list[list[int]] = []
    for j in range(len(bounds) + 1):
        if j == 0:
            starts = [o.grad_fn for o in outs]
        else:
            starts = [nxt for nxt, _ in bounds[j - 1].grad_fn.next_functions]
        stop = bounds[j].grad_fn if j < len(bounds) else None
        found, met = _reach(starts, stop)
        if stop is not None and not met:
            return None
        if j < len(bounds) and found & inputs:
            return None
        mine = []
        for v in found:
            k = where.get(v)
            if k is None:
                continue
            if k in owner:
                return None
            owner[k] = j
            mine.append(k)
        segs.append(sorted(mine))
    return bounds, segs


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
        self._zeros: dict = {}

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

    def _delivered(self, entry: _Entry, j: int) -> list[torch.Tensor]:
        """The delivered gradients of segment ``j`` of ``entry``: one copy per dtype (a
        concatenation of the flat buffer's views), cut into views (module docstring)."""
        assert entry.deliver is not None
        out: list = [None] * len(entry.deliver[j])
        for positions, views, ps in entry.groups[j]:
            got = torch._C._nn.unflatten_dense_tensors(torch.cat(views), ps)
            for k, g in zip(positions, got):
                out[k] = g
        return out

    def zero(self, device) -> torch.Tensor:
        """A zero scalar: the gradient of the token a segment hands to the one below."""
        z = self._zeros.get(device)
        if z is None:
            z = self._zeros[device] = torch.zeros((), device=device)
        return z

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
        differentiable outputs (delivered: one per segment); ``inputs``: the static input
        buffers, ``grad_inputs``: the positions among them whose gradient the caller needs;
        ``deliver``: the gradients go through autograd (module docstring). Off the GPU each
        "graph" is the Python it would capture, run at every replay (what the CPU tests check)."""
        g = self.graphed
        emulate = device.type != "cuda"
        if not emulate and g._pool is None:
            g._pool = torch.cuda.graph_pool_handle()
        leaves_in = [inputs[i] for i in grad_inputs]
        for t in leaves_in:
            t.requires_grad_(True)
        modules = list(g.module.modules())
        try:
            return self._capture(call, leaves_in, params, modules, device, autocast, deliver, emulate)
        finally:
            for t in leaves_in:
                t.requires_grad_(False)

    def _capture(self, call, leaves_in, params, modules, device, autocast, deliver: bool, emulate: bool) -> _Entry:
        g = self.graphed

        def forward_pass(taps_on: bool):
            """The module's forward on the parameters as fresh leaves (graph_switch.aliased: no
            capture meets their own accumulation nodes, which DDP keeps from the default stream)."""
            with aliased(modules, params) as ps, tapping(taps_on) as taps, off(), torch.enable_grad():
                # the whole module is captured here: its layers run as they are, not from their own graphs
                if autocast is None:
                    out = call()
                else:
                    with torch.autocast("cuda", dtype=autocast, cache_enabled=False):
                        out = call()
            leaves: list = []
            ragged: list = []
            spec = flatten(out, leaves, ragged)
            diff = [i for i, t in enumerate(leaves) if t.requires_grad and t.is_floating_point()]
            if not diff:
                raise ValueError(
                    "ragged.nn.Graphed: the module's outputs need no gradient in training mode "
                    "(no parameter requires grad?)"
                )
            return spec, leaves, ragged, diff, ps, list(taps)

        def graph(fill: Callable[[], object]):
            """``fill()`` captured into a new graph of the pool (emulated: run once); its replay."""
            if emulate:
                return fill(), None
            cuda_graph = torch.cuda.CUDAGraph()
            # the pool's growth is read inside the capture: entering one empties the allocator's cache.
            # The captures run on this GPU's capture stream (torch.cuda.graph's default stream is
            # one for the process, shared by threads)
            with torch.cuda.graph(cuda_graph, pool=g._pool, stream=capture_stream(device)):
                before = torch.cuda.memory_reserved(device)
                got = fill()
                entry.memory += torch.cuda.memory_reserved(device) - before
            entry.graphs.append(cuda_graph)
            return got, cuda_graph.replay

        with capturing(device) if not emulate else contextlib.nullcontext():
            if not emulate:  # compiles the kernels, lets cuBLAS pick its algorithms
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        _, leaves, _, diff, ps, _ = forward_pass(False)
                        outs = [leaves[i] for i in diff]
                        zeros = [torch.zeros_like(o) for o in outs]
                        torch.autograd.grad(outs, leaves_in + ps, grad_outputs=zeros, allow_unused=True)
                        del leaves, outs, ps, zeros
                torch.cuda.current_stream(device).wait_stream(stream)

            entry = _Entry()
            (spec, leaves, ragged, diff, ps, taps), fwd = graph(lambda: forward_pass(deliver))
            entry.spec, entry.ragged, entry.diff = spec, ragged, diff
            outs = [leaves[i] for i in diff]
            plan = segments(outs, taps, ps, leaves_in) if deliver else None
            bounds, segs = plan if plan is not None else ([], [list(range(len(params)))])
            entry.outputs = [t.detach().clone() if emulate else t.detach() for t in leaves]
            entry.grad_outs = [torch.zeros_like(o) for o in outs]
            cut_grads = [torch.zeros_like(b) for b in bounds]  # each cut's gradient, from the segment above
            entry.grad_inputs = [torch.zeros_like(t) for t in leaves_in]
            if deliver:
                self._layout(params)
                targets = [self.delivery_view(p) for p in params]
            else:
                targets = [self.persistent_grad(p) for p in params]
            state = [outs, bounds, ps]  # what the backward graphs read (emulated: the latest forward's)

            def backward(j: int) -> list:
                """Segment ``j``'s gradients into their buffers; the parameters' gradients (None: unused)."""
                outs, bounds, ps = state
                if j == 0:
                    starts, grad_outs = outs, entry.grad_outs
                else:
                    starts, grad_outs = [bounds[j - 1]], [cut_grads[j - 1]]
                mine = [ps[k] for k in segs[j]]
                below = [bounds[j]] if j < len(bounds) else leaves_in
                got = torch.autograd.grad(starts, mine + below, grad_outputs=grad_outs, allow_unused=True)
                if emulate and j == len(bounds):
                    for t in leaves_in:
                        t.requires_grad_(False)
                for buf, d in zip(cut_grads[j : j + 1] if j < len(bounds) else entry.grad_inputs, got[len(mine) :]):
                    if buf is not None:
                        buf.copy_(d) if d is not None else buf.zero_()
                pairs = [(targets[k], d) for k, d in zip(segs[j], got[: len(mine)]) if d is not None]
                if pairs and deliver:
                    torch._foreach_copy_([a for a, _ in pairs], [d for _, d in pairs])
                elif pairs:
                    torch._foreach_add_([a for a, _ in pairs], [d for _, d in pairs])
                return [got[i] for i in range(len(mine))] + [got[len(mine) + i] for i in range(len(below))]

            entry.bwd = []
            used: dict[int, bool] = {}
            for j in range(len(segs)):
                got, replay = graph(functools.partial(backward, j))
                for k, d in zip(segs[j], got):
                    used[k] = d is not None
                if j == len(segs) - 1:  # an input whose gradient is None gets None
                    rest = got[len(segs[j]) :]
                    entry.grad_inputs = [None if d is None else buf for buf, d in zip(entry.grad_inputs, rest)]
                entry.bwd.append(replay if replay is not None else functools.partial(backward, j))
                del got
            if emulate:

                def fwd_emulated() -> None:
                    for t in leaves_in:  # until the bottom segment's backward
                        t.requires_grad_(True)
                    _, leaves, _, diff, ps, taps = forward_pass(deliver)
                    for buf, t in zip(entry.outputs, leaves):
                        buf.copy_(t.detach())
                    again = segments([leaves[i] for i in diff], taps, ps, leaves_in) if deliver else None
                    state[:] = [[leaves[i] for i in diff], [] if again is None else again[0], ps]

                entry.fwd = fwd_emulated
            else:
                assert fwd is not None
                entry.fwd = fwd
                del state[:]  # the backward graphs hold what they read
        order = [k for seg in segs for k in seg]
        entry.used = [(params[k], targets[k]) for k in order if used.get(k)]
        if deliver:
            entry.deliver = [[params[k] for k in seg if used.get(k)] for seg in segs]
            entry.groups = []
            for ps_j in entry.deliver:
                by: dict[tuple, tuple[list, list, list]] = {}
                for pos, p in enumerate(ps_j):
                    positions, views, group = by.setdefault((p.dtype, p.device), ([], [], []))
                    positions.append(pos)
                    views.append(self.delivery_view(p).view(-1))
                    group.append(p)
                entry.groups.append(list(by.values()))
        return entry

    def anchor(self, device) -> torch.Tensor:
        """A leaf that requires grad, so that the replay joins autograd when no input does."""
        if self._anchor is None or self._anchor.device != device:
            self._anchor = torch.zeros((), device=device, requires_grad=True)
        return self._anchor

    def replay(self, entry: _Entry, first: RaggedTensor, size, user_inputs: list[torch.Tensor]):
        rows = _rows(entry, size[1], first.num_tokens, first.batch_size)
        device = first.values.device
        cut = (rows, first.num_tokens)
        if entry.deliver is None:
            extra = [] if user_inputs else [self.anchor(device)]
            outs = _Replay.apply(self, entry, cut, *user_inputs, *extra)
        elif len(entry.bwd) == 1:  # the parameters are the Function's inputs: autograd gets their gradients
            extra = entry.deliver[0] if entry.deliver[0] or user_inputs else [self.anchor(device)]
            outs = _Replay.apply(self, entry, cut, *user_inputs, *extra)
        else:  # a chain of segments, the bottom first: their backwards run top down
            last = len(entry.bwd) - 1
            token = _Segment.apply(
                self, entry, last, first.num_tokens, self.anchor(device), *user_inputs, *entry.deliver[last]
            )
            for j in range(last - 1, 0, -1):
                token = _Segment.apply(self, entry, j, first.num_tokens, token, *entry.deliver[j])
            outs = _Replay.apply(self, entry, cut, token, *entry.deliver[0])
        return rebuild(entry.spec, list(outs), first)
