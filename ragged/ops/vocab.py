"""Projection onto per-sequence candidate vocabularies (varying-vocabulary output layer).

Each sequence ``b`` of a batch scores its tokens only against its own candidate ids
(vocabulary selection, per-request allowed tokens, short-lists): with ``hidden [T, d]``,
``weight [V, d]`` (``nn.Linear`` / tied-embedding layout) and ``bias [V]``, sequence ``b``
gets the ``[T_b, V_b]`` block ``hidden_b @ weight[ids_b].T + bias[ids_b]`` and nothing
else is computed. The blocks are stored flat, row-major per sequence (the layout of
:mod:`ragged.logits`)::

    l_off[b] = sum_{j<b} T_j * V_j        (int64 [B+1] on the device)
    logits[l_off[b] + t * V_b + c]      = token t of sequence b against candidate c

``vocab`` is a :class:`RaggedTensor` of int32/int64 ids (sequence ``b``'s sorted, unique
candidates, offsets ``v_off``) or a 1-D id tensor shared by the whole batch (then every
``V_b = S`` and ``v_off`` is None).

Implementations (:mod:`ragged.backends`): ``"torch"``
(:func:`reference_vocab_projection`: one gather of the candidate rows of ``weight`` and
one GEMM per sequence, float32 accumulation; the CPU path and the tests' oracle) and
``"triton"`` (:mod:`ragged.kernels.triton.vocab`: a segmented GEMM reading the weight
rows through the id lists). ``"auto"`` takes Triton on CUDA tensors.

Host syncs: none on the hot path when the RaggedTensors carry host offsets (built from
host lengths or lists) or the vocabulary is shared; otherwise the offsets are read once
(and cached on the RaggedTensors) to size the output. ``vocab_cross_entropy`` with
``out_of_vocab="error"`` (the default) reads one flag to raise on a target that is not
among its sequence's candidates.

Candidate ids. ``validate=True`` checks them (sorted, unique per sequence, in ``[0, V)``)
with one read. Without it they are checked only where that costs no wait for the device:
ids on the host (range; for the cross-entropy also order), ids of a call that reads the
device anyway (the offsets' read above, the ``out_of_vocab="error"`` flag, the ``"torch"``
backend, which reads the offsets itself) get the same checks folded into that read. An id
outside ``[0, V)`` then raises ``ValueError`` naming the function and the argument.
Elsewhere (CUDA ids on the hot path) the ids are trusted, and the kernels still never
read outside ``weight`` / ``bias``: a candidate id outside ``[0, V)`` scores 0 (no weight
row, no bias) and passes no gradient on; unsorted ids make the cross-entropy miss targets
that are among them (``out_of_vocab="ignore"`` then ignores those tokens).

Gradients are first order: a backward through the gradient (``create_graph=True`` then
a second backward, ``gradgradcheck``) raises ``NotImplementedError`` naming the function.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import backends
from .._utils import check_offsets_tensor, check_tensor, check_vector, describe, eager, to_device
from ..logits import RaggedLogits, compute_dtype, layout_coords, segmented_cross_entropy
from ..tensor import RaggedTensor

ID_DTYPES = (torch.int32, torch.int64)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_KERNEL_MODULE = "ragged.kernels.triton.vocab"
REDUCTIONS = ("mean", "sum", "none")
OUT_OF_VOCAB = ("error", "ignore")

# --------------------------------------------------------------------------------------
# Reference


def _host(offsets: torch.Tensor) -> list[int]:
    return offsets.detach().to("cpu", torch.int64).tolist()


def _segments(tokens: int, h_off: torch.Tensor, ids: torch.Tensor, v_off: torch.Tensor | None):
    """(first token, end token, first candidate, end candidate, first logit) per block."""
    if v_off is None:  # one [T, S] block: l_off[b] = h_off[b] * S, so the rows follow each other
        return [(0, tokens, 0, ids.shape[0], 0)]
    ho, vo = _host(h_off), _host(v_off)
    out, start = [], 0
    for b in range(len(ho) - 1):
        out.append((ho[b], ho[b + 1], vo[b], vo[b + 1], start))
        start += (ho[b + 1] - ho[b]) * (vo[b + 1] - vo[b])
    return out


def _rows(src: torch.Tensor, index: torch.Tensor, dtype: torch.dtype, buf: torch.Tensor | None) -> torch.Tensor:
    """``src[index]`` in ``dtype``; gathered into ``buf`` (no allocation) when the dtypes allow."""
    if buf is not None and src.dtype == dtype:
        return torch.index_select(src, 0, index, out=buf[:index.shape[0]])
    return src.index_select(0, index).to(dtype)


def reference_vocab_projection(hidden: torch.Tensor, h_off: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None, ids: torch.Tensor,
                               v_off: torch.Tensor | None) -> torch.Tensor:
    """Flat logits (see the module docstring) in float32 accumulation, returned in hidden's dtype.

    ``hidden [T, d]``, ``h_off [B+1]``, ``weight [V, d]``, ``bias [V]`` or None, ``ids``
    int32/int64 and ``v_off [B+1]`` (None: ``ids`` is shared by every sequence). Per
    sequence one gather of ``weight[ids_b]`` (only the candidates' rows are touched)
    and one GEMM; a shared vocabulary is one gather and one GEMM for the batch.
    Differentiable through torch autograd. Reads the offsets on the host (one sync on
    CUDA, none for a shared vocabulary): this is the oracle and the CPU path, not the
    GPU hot path.
    """
    dtype = compute_dtype(hidden.dtype)
    ids64 = ids.to(torch.int64)
    segments = _segments(hidden.shape[0], h_off, ids, v_off)
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                         or (bias is not None and bias.requires_grad))
    if not grads:
        return _reference_into_buffers(hidden, weight, bias, ids64, segments, dtype)
    blocks = []
    for t0, t1, v0, v1, _ in segments:
        cand = ids64[v0:v1]
        h = hidden[t0:t1].to(dtype)
        w = weight.index_select(0, cand).to(dtype)
        if bias is None:
            block = torch.mm(h, w.t())
        else:
            block = torch.addmm(bias.index_select(0, cand).to(dtype), h, w.t())
        blocks.append(block.reshape(-1))
    if not blocks:  # B = 0: an empty result that is still part of the autograd graph
        return (hidden.reshape(-1)[:0] * 0).to(hidden.dtype)
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return out.to(hidden.dtype)


def _reference_into_buffers(hidden, weight, bias, ids64, segments, dtype):
    """The forward without autograd: one output allocation, the GEMMs write their blocks in
    place and the candidate rows of every sequence are gathered into one reused buffer
    (fresh multi-megabyte allocations per sequence cost page faults on CPU)."""
    total = sum((t1 - t0) * (v1 - v0) for t0, t1, v0, v1, _ in segments)
    out = torch.empty(total, dtype=dtype, device=hidden.device)
    width = max((v1 - v0 for _, _, v0, v1, _ in segments), default=0)
    w_buf = torch.empty((width, weight.shape[1]), dtype=dtype, device=weight.device)
    b_buf = torch.empty(width, dtype=dtype, device=weight.device) if bias is not None else None
    for t0, t1, v0, v1, l0 in segments:
        rows, cols = t1 - t0, v1 - v0
        if rows == 0 or cols == 0:
            continue
        cand = ids64[v0:v1]
        w = _rows(weight, cand, dtype, w_buf)
        block = out[l0:l0 + rows * cols].view(rows, cols)
        h = hidden[t0:t1].to(dtype)
        if bias is None:
            torch.mm(h, w.t(), out=block)
        else:
            torch.addmm(_rows(bias, cand, dtype, b_buf), h, w.t(), out=block)
    return out.to(hidden.dtype)


def reference_vocab_projection_backward(grad: torch.Tensor, hidden: torch.Tensor, h_off: torch.Tensor,
                                        weight: torch.Tensor, ids: torch.Tensor, v_off: torch.Tensor | None,
                                        need_hidden: bool = True, need_weight: bool = True,
                                        need_bias: bool = True):
    """Gradients of :func:`reference_vocab_projection` for the flat ``grad``, written out.

    With ``g_b`` sequence b's ``[T_b, V_b]`` block of ``grad``: ``d_hidden_b = g_b @ W[ids_b]``,
    ``d_weight[ids_b] += g_b.T @ hidden_b``, ``d_bias[ids_b] += g_b.sum(0)`` (rows of ids no
    sequence lists stay 0; an id listed by several sequences sums their contributions).
    Accumulated in float32 (float64 for float64), returned in the inputs' dtypes;
    ``(d_hidden, d_weight, d_bias)`` with None for each one not asked for. Explicit
    formulas rather than autograd: this also runs inside the
    ``ragged::vocab_projection_backward`` op, where autograd is off.
    """
    dtype = compute_dtype(hidden.dtype)
    ids64 = ids.to(torch.int64)
    g = grad.to(dtype)
    d_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if need_hidden else None
    d_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
    d_bias = torch.zeros(weight.shape[0], dtype=dtype, device=weight.device) if need_bias else None
    segments = _segments(hidden.shape[0], h_off, ids, v_off)
    width = max((v1 - v0 for _, _, v0, v1, _ in segments), default=0) if need_hidden else 0
    w_buf = torch.empty((width, weight.shape[1]), dtype=dtype, device=weight.device)
    for t0, t1, v0, v1, l0 in segments:
        rows, cols = t1 - t0, v1 - v0
        if rows == 0 or cols == 0:
            continue
        gb = g[l0:l0 + rows * cols].view(rows, cols)
        cand = ids64[v0:v1]
        if need_hidden:
            torch.mm(gb, _rows(weight, cand, dtype, w_buf), out=d_hidden[t0:t1])
        if need_weight:
            d_weight.index_add_(0, cand, gb.t() @ hidden[t0:t1].to(dtype))
        if need_bias:
            d_bias.index_add_(0, cand, gb.sum(0))
    return (None if d_hidden is None else d_hidden.to(hidden.dtype),
            None if d_weight is None else d_weight.to(weight.dtype),
            None if d_bias is None else d_bias.to(weight.dtype))


# --------------------------------------------------------------------------------------
# Backends


def _triton_reasons(hidden, h_off, weight, bias, ids, v_off, *_) -> list[str]:
    reasons = []
    r = backends.triton_reason(hidden.device)
    if r:
        reasons.append(r)
    if hidden.dtype not in _KERNEL_DTYPES:
        reasons.append(f"triton vocab_projection takes float16, bfloat16 and float32, got {hidden.dtype}")
    if backends._import_error("triton") is None:
        err = backends._import_error(_KERNEL_MODULE)
        if err:
            reasons.append(f"the Triton vocab kernels are unavailable ({err})")
    return reasons


def _no_reasons(*_) -> list[str]:
    return []


def _reference_forward(hidden, h_off, weight, bias, ids, v_off, l_off, total, max_t, max_v):
    with torch.no_grad():
        return reference_vocab_projection(hidden, h_off, weight, bias, ids, v_off)


def _reference_backward(grad, hidden, h_off, weight, ids, v_off, l_off, max_t, max_v, need_hidden, need_weight,
                        need_bias, deterministic):
    return reference_vocab_projection_backward(grad, hidden, h_off, weight, ids, v_off, need_hidden, need_weight,
                                               need_bias)


def _triton_forward(*args):
    from ..kernels.triton.vocab import forward

    return forward(*args)


def _triton_backward(*args):
    from ..kernels.triton.vocab import backward

    return backward(*args)


backends.register("vocab_projection", "torch", (_reference_forward, _reference_backward), _no_reasons)
backends.register("vocab_projection", "triton", (_triton_forward, _triton_backward), _triton_reasons)
backends.set_auto_order("vocab_projection", ("triton", "torch"))


def _impl(name: str):
    return backends._OPS["vocab_projection"].impls[name].fn


# --------------------------------------------------------------------------------------
# torch.library ops


@torch.library.custom_op("ragged::vocab_projection", mutates_args=())
def _projection_op(hidden: torch.Tensor, h_off: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   ids: torch.Tensor, v_off: torch.Tensor | None, l_off: torch.Tensor, shared: bool, total: int,
                   max_t: int, max_v: int, backend: str) -> torch.Tensor:
    return _impl(backend)[0](hidden, h_off, weight, bias, ids, None if shared else v_off, l_off, total, max_t,
                             max_v)


@_projection_op.register_fake
def _projection_fake(hidden, h_off, weight, bias, ids, v_off, l_off, shared, total, max_t, max_v, backend):
    return hidden.new_empty((total,))


@torch.library.custom_op("ragged::vocab_projection_backward", mutates_args=())
def _projection_backward_op(grad: torch.Tensor, hidden: torch.Tensor, h_off: torch.Tensor, weight: torch.Tensor,
                            ids: torch.Tensor, v_off: torch.Tensor | None, l_off: torch.Tensor, shared: bool,
                            max_t: int, max_v: int, need_hidden: bool, need_weight: bool, need_bias: bool,
                            deterministic: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dh, dw, db = _impl(backend)[1](grad, hidden, h_off, weight, ids, None if shared else v_off, l_off, max_t, max_v,
                                   need_hidden, need_weight, need_bias, deterministic)
    # An op returns tensors only: a gradient not asked for is an empty tensor.
    return (hidden.new_empty(0) if dh is None else dh, weight.new_empty(0) if dw is None else dw,
            weight.new_empty(0) if db is None else db)


@_projection_backward_op.register_fake
def _projection_backward_fake(grad, hidden, h_off, weight, ids, v_off, l_off, shared, max_t, max_v, need_hidden,
                              need_weight, need_bias, deterministic, backend):
    return (hidden.new_empty(hidden.shape) if need_hidden else hidden.new_empty(0),
            weight.new_empty(weight.shape) if need_weight else weight.new_empty(0),
            weight.new_empty(weight.shape[0]) if need_bias else weight.new_empty(0))


def _save(ctx, hidden, h_off, weight, ids, v_off, l_off, shared, max_t, max_v, backend):
    ctx.save_for_backward(hidden, h_off, weight, ids, v_off, l_off)
    ctx.args = (shared, max_t, max_v, backend)


def _setup(ctx, inputs, output):
    hidden, h_off, weight, bias, ids, v_off, l_off, shared, total, max_t, max_v, backend = inputs
    _save(ctx, hidden, h_off, weight, ids, v_off, l_off, shared, max_t, max_v, backend)


# --------------------------------------------------------------------------------------
# First-order gradients only. The backward kernels (and the reference backward, which
# writes into preallocated buffers) are not differentiable: under create_graph=True their
# results pass through _FirstOrderOnly, whose own backward raises with the function's name,
# instead of an unrelated error from deep inside (or a silently missing second-order term).

_PROJECTION_FNS = "ragged.vocab_projection() (and ragged.vocab_cross_entropy() through its logits)"
_CROSS_ENTROPY_FN = "ragged.vocab_cross_entropy()"


class _FirstOrderOnly(torch.autograd.Function):
    """Identity on gradients; differentiating them raises (``anchor``: an input that requires
    grad, so that the outputs belong to the graph being recorded)."""

    @staticmethod
    def forward(ctx, fn, anchor, *grads):
        ctx.fn = fn
        return grads

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(
            f"{ctx.fn}: double backward is not supported (expected one backward through the op, got a backward "
            f"through its gradient: create_graph=True followed by a backward, or gradgradcheck); its gradient is "
            f"computed by kernels that are not differentiable")


def _first_order(fn: str, grads: tuple, *inputs) -> tuple:
    """``grads`` as they are, or, while the backward is recorded (``create_graph=True``) and an
    input requires grad, through :class:`_FirstOrderOnly`."""
    if not torch.is_grad_enabled():
        return grads
    anchor = next((t for t in inputs if t is not None and t.requires_grad), None)
    present = [g for g in grads if g is not None]
    if anchor is None or not present:
        return grads
    wrapped = iter(_FirstOrderOnly.apply(fn, anchor, *present))
    return tuple(None if g is None else next(wrapped) for g in grads)


def _backward(ctx, grad):
    hidden, h_off, weight, ids, v_off, l_off = ctx.saved_tensors
    shared, max_t, max_v, backend = ctx.args
    need = ctx.needs_input_grad
    with torch.no_grad():
        dh, dw, db = _call_backward(grad.contiguous(), hidden, h_off, weight, ids, v_off, l_off, shared, max_t,
                                    max_v, bool(need[0]), bool(need[2]), bool(need[3]),
                                    torch.are_deterministic_algorithms_enabled(), backend)
    dh, dw, db = _first_order(_PROJECTION_FNS, (dh, dw, db), grad, hidden, weight)
    return dh, None, dw, db, None, None, None, None, None, None, None, None


_projection_op.register_autograd(_backward, setup_context=_setup)


class _ProjectionFunction(torch.autograd.Function):
    """Eager path: the same forward/backward without the torch.library dispatcher."""

    @staticmethod
    def forward(ctx, hidden, h_off, weight, bias, ids, v_off, l_off, shared, total, max_t, max_v, backend):
        out = _impl(backend)[0](hidden, h_off, weight, bias, ids, v_off, l_off, total, max_t, max_v)
        _save(ctx, hidden, h_off, weight, ids, v_off, l_off, shared, max_t, max_v, backend)
        return out

    backward = staticmethod(_backward)


def _present(*tensors):
    return [t for t in tensors if t is not None]


def _call_forward(hidden, h_off, weight, bias, ids, v_off, l_off, shared, total, max_t, max_v, backend):
    if eager(*_present(hidden, h_off, weight, bias, ids, v_off, l_off)):
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            return _ProjectionFunction.apply(hidden, h_off, weight, bias, ids, v_off, l_off, shared, total, max_t,
                                             max_v, backend)
        return _impl(backend)[0](hidden, h_off, weight, bias, ids, v_off, l_off, total, max_t, max_v)
    return _projection_op(hidden, h_off, weight, bias, ids, v_off, l_off, shared, total, max_t, max_v, backend)


def _call_backward(grad, hidden, h_off, weight, ids, v_off, l_off, shared, max_t, max_v, need_hidden, need_weight,
                   need_bias, deterministic, backend):
    if eager(*_present(grad, hidden, h_off, weight, ids, v_off, l_off)):
        return _impl(backend)[1](grad, hidden, h_off, weight, ids, v_off, l_off, max_t, max_v, need_hidden,
                                 need_weight, need_bias, deterministic)
    dh, dw, db = _projection_backward_op(grad, hidden, h_off, weight, ids, v_off, l_off, shared, max_t, max_v,
                                         need_hidden, need_weight, need_bias, deterministic, backend)
    return dh if need_hidden else None, dw if need_weight else None, db if need_bias else None


# --------------------------------------------------------------------------------------
# Cross-entropy over each token's candidates: an op of its own, so that a fused kernel
# (logits never stored) can take the place of an implementation. Each implementation is
# ``fn(hidden, h_off, weight, bias, ids, v_off, l_off, total, max_t, max_v, target,
# label_smoothing) -> [T]`` per-token losses (float32; float64 for float64 inputs; 0 where
# ``target < 0``), differentiable in hidden, weight and bias; ``target`` holds each
# token's *local* candidate index. For now both compute the logits with the projection
# of the same backend, then a segmented log-softmax in torch.


def _cross_entropy_via(projection_backend: str):
    def run(hidden, h_off, weight, bias, ids, v_off, l_off, total, max_t, max_v, target, label_smoothing):
        shared = v_off is None
        values = _call_forward(hidden, h_off, weight, bias, ids, v_off, l_off, shared, total, max_t, max_v,
                               projection_backend)
        coords = None if shared else layout_coords(h_off, v_off, l_off, ids.shape[0], hidden.shape[0], total)
        return segmented_cross_entropy(values, hidden.shape[0], coords, ids.shape[0] if shared else None, target,
                                       label_smoothing)

    run.__name__ = f"vocab_cross_entropy_{projection_backend}"
    return run


# The Triton implementation is fused (ragged.kernels.triton.vocab): the forward streams over
# each token's candidates with an online logsumexp and stores no logits; the backward
# recomputes the logits' gradient in chunks of at most CE_CHUNK elements.


@torch.library.custom_op("ragged::vocab_cross_entropy_fused", mutates_args=())
def _ce_fused_op(hidden: torch.Tensor, h_off: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 ids: torch.Tensor, v_off: torch.Tensor | None, l_off: torch.Tensor, target: torch.Tensor,
                 ignore_index: int, smoothing: float, total: int, max_t: int,
                 max_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse, local targets, bad-target record) for global target ids."""
    from ..kernels.triton.vocab import cross_entropy_forward

    return cross_entropy_forward(hidden, h_off, weight, bias, ids, v_off, l_off, target, smoothing, max_t, max_v,
                                 ignore_index)


@_ce_fused_op.register_fake
def _ce_fused_fake(hidden, h_off, weight, bias, ids, v_off, l_off, target, ignore_index, smoothing, total, max_t,
                   max_v):
    tokens = hidden.shape[0]
    return (hidden.new_empty((tokens,), dtype=torch.float32), hidden.new_empty((tokens,), dtype=torch.float32),
            hidden.new_empty((tokens,), dtype=torch.int32), hidden.new_empty((2,), dtype=torch.int32))


@torch.library.custom_op("ragged::vocab_cross_entropy_fused_backward", mutates_args=())
def _ce_fused_backward_op(grad: torch.Tensor, hidden: torch.Tensor, h_off: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None, ids: torch.Tensor, v_off: torch.Tensor | None,
                          l_off: torch.Tensor, total: int, target: torch.Tensor, lse: torch.Tensor, smoothing: float,
                          max_t: int, max_v: int, need_hidden: bool, need_weight: bool, need_bias: bool,
                          deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from ..kernels.triton.vocab import cross_entropy_backward

    dh, dw, db = cross_entropy_backward(grad, hidden, h_off, weight, bias, ids, v_off, l_off, total, target, lse,
                                        smoothing, max_t, max_v, need_hidden, need_weight, need_bias, deterministic)
    return (hidden.new_empty(0) if dh is None else dh, weight.new_empty(0) if dw is None else dw,
            weight.new_empty(0) if db is None else db)


@_ce_fused_backward_op.register_fake
def _ce_fused_backward_fake(grad, hidden, h_off, weight, bias, ids, v_off, l_off, total, target, lse, smoothing,
                            max_t, max_v, need_hidden, need_weight, need_bias, deterministic):
    return (hidden.new_empty(hidden.shape) if need_hidden else hidden.new_empty(0),
            weight.new_empty(weight.shape) if need_weight else weight.new_empty(0),
            weight.new_empty(weight.shape[0]) if need_bias else weight.new_empty(0))


def _ce_setup(ctx, inputs, output):
    hidden, h_off, weight, bias, ids, v_off, l_off, target, ignore_index, smoothing, total, max_t, max_v = inputs
    ctx.save_for_backward(hidden, h_off, weight, bias, ids, v_off, l_off, output[2], output[1])
    ctx.args = (smoothing, max_t, max_v, None, None, total)


def _ce_backward(ctx, grad, *_unused):
    hidden, h_off, weight, bias, ids, v_off, l_off, local, lse = ctx.saved_tensors
    smoothing, max_t, max_v, host_h, host_v, total = ctx.args
    need = ctx.needs_input_grad
    need_h, need_w, need_b = bool(need[0]), bool(need[2]), bool(bias is not None and need[3])
    deterministic = torch.are_deterministic_algorithms_enabled()
    # the loss gradient may be a broadcast scalar (mean, sum): the kernel reads it with its stride
    with torch.no_grad():
        if eager(*_present(grad, hidden, h_off, weight, bias, ids, v_off, l_off, local, lse)):
            from ..kernels.triton.vocab import cross_entropy_backward

            dh, dw, db = cross_entropy_backward(grad, hidden, h_off, weight, bias, ids, v_off, l_off, total, local,
                                                lse, smoothing, max_t, max_v, need_h, need_w, need_b, deterministic,
                                                host_h_off=host_h, host_v_off=host_v)
        else:
            dh, dw, db = _ce_fused_backward_op(grad, hidden, h_off, weight, bias, ids, v_off, l_off, total, local,
                                               lse, smoothing, max_t, max_v, need_h, need_w, need_b, deterministic)
    dh, dw, db = _first_order(_CROSS_ENTROPY_FN, (dh if need_h else None, dw if need_w else None,
                                                  db if need_b else None), grad, hidden, weight, bias)
    return (dh, None, dw, db,
            None, None, None, None, None, None, None, None, None)


_ce_fused_op.register_autograd(_ce_backward, setup_context=_ce_setup)


class _FusedCrossEntropy(torch.autograd.Function):
    """Eager path of the fused cross-entropy (keeps the host offsets for chunking)."""

    @staticmethod
    def forward(ctx, hidden, h_off, weight, bias, ids, v_off, l_off, target, ignore_index, smoothing, max_t, max_v,
                host):
        from ..kernels.triton.vocab import cross_entropy_forward

        loss, lse, local, bad = cross_entropy_forward(hidden, h_off, weight, bias, ids, v_off, l_off, target,
                                                      smoothing, max_t, max_v, ignore_index)
        ctx.save_for_backward(hidden, h_off, weight, bias, ids, v_off, l_off, local, lse)
        host_h, host_v, total = host
        ctx.args = (smoothing, max_t, max_v, host_h, host_v, total)
        ctx.mark_non_differentiable(lse, local, bad)
        return loss, lse, local, bad

    @staticmethod
    def backward(ctx, grad, *_unused):
        return _ce_backward(ctx, grad)


def _fused_cross_entropy(hidden, h_off, weight, bias, ids, v_off, l_off, total, max_t, max_v, target, ignore_index,
                         label_smoothing, host_h=None, host_v=None):
    """(per-token losses, local targets, bad-target record) for *global* target ids."""
    if eager(*_present(hidden, h_off, weight, bias, ids, v_off, l_off, target)):
        loss, _, local, bad = _FusedCrossEntropy.apply(hidden, h_off, weight, bias, ids, v_off, l_off, target,
                                                       int(ignore_index), float(label_smoothing), max_t, max_v,
                                                       (host_h, host_v, total))
    else:
        loss, _, local, bad = _ce_fused_op(hidden, h_off, weight, bias, ids, v_off, l_off, target, int(ignore_index),
                                           float(label_smoothing), total, max_t, max_v)
    return loss, local, bad


backends.register("vocab_cross_entropy", "torch", _cross_entropy_via("torch"), _no_reasons)
backends.register("vocab_cross_entropy", "triton", _fused_cross_entropy, _triton_reasons)
backends.set_auto_order("vocab_cross_entropy", ("triton", "torch"))


# --------------------------------------------------------------------------------------
# Argument checks and the layout


class _Layout(NamedTuple):
    hidden: torch.Tensor             # [T, d]
    h_off: torch.Tensor              # [B+1]
    weight: torch.Tensor             # [V, d]
    bias: torch.Tensor | None        # [V]
    ids: torch.Tensor                # [S]
    v_off: torch.Tensor | None       # [B+1]; None: shared
    l_off: torch.Tensor              # int64 [B+1]
    total: int
    max_t: int
    max_v: int
    host_h: tuple[int, ...] | None
    host_v: tuple[int, ...] | None
    name: str                        # the ids' argument name, for messages
    ids_checked: bool                # the ids' range (and order, when asked) already read and checked

    def args(self) -> tuple:
        """Arguments of the implementations' forward (and of their reasons functions)."""
        return (self.hidden, self.h_off, self.weight, self.bias, self.ids, self.v_off, self.l_off, self.total,
                self.max_t, self.max_v)


def _check_ids_dtype(fn: str, name: str, ids: torch.Tensor) -> None:
    if ids.dtype not in ID_DTYPES:
        raise TypeError(f"{fn}(): expected {name} of dtype torch.int32 or torch.int64, got {ids.dtype}")


def _prepare(fn: str, hidden, weight, vocab, bias, validate, sorted_ids: bool = False) -> _Layout:
    if not isinstance(hidden, RaggedTensor):
        raise TypeError(f"{fn}(): expected hidden to be a RaggedTensor with values [T, d], got {describe(hidden)}")
    h = hidden.values
    if h.dim() != 2:
        raise ValueError(f"{fn}(): expected hidden.values of shape [T, d], got {tuple(h.shape)}")
    if not h.dtype.is_floating_point:
        raise TypeError(f"{fn}(): expected floating-point hidden.values, got {h.dtype}")
    check_tensor(fn, "weight", weight)
    if weight.dim() != 2 or weight.shape[1] != h.shape[1]:
        raise ValueError(f"{fn}(): expected weight of shape [V, {h.shape[1]}] (d = hidden.values.shape[1]), "
                         f"got {tuple(weight.shape)}")
    if weight.dtype != h.dtype:
        raise TypeError(f"{fn}(): expected weight of dtype {h.dtype} (that of hidden), got {weight.dtype}")
    if weight.device != h.device:
        raise ValueError(f"{fn}(): expected weight on {h.device} (the device of hidden), got {weight.device}")
    vocab_size = weight.shape[0]
    if bias is not None:
        check_tensor(fn, "bias", bias)
        if tuple(bias.shape) != (vocab_size,):
            raise ValueError(f"{fn}(): expected bias of shape [{vocab_size}] (weight.shape[0]) or None, "
                             f"got {tuple(bias.shape)}")
        if bias.dtype != h.dtype:
            raise TypeError(f"{fn}(): expected bias of dtype {h.dtype} (that of hidden), got {bias.dtype}")
        if bias.device != h.device:
            raise ValueError(f"{fn}(): expected bias on {h.device} (the device of hidden), got {bias.device}")
        # kernels index the bias as ptr + id: a strided view becomes a (differentiable) copy
        bias = check_vector(fn, "bias", bias, vocab_size, h.device)
    h_off = check_offsets_tensor(fn, hidden.offsets, h, name="hidden.offsets")
    if isinstance(vocab, RaggedTensor):
        ids, v_off, name = vocab.values, vocab.offsets, "vocab.values"
        if ids.dim() != 1:
            raise ValueError(f"{fn}(): expected vocab.values to be 1-D ids [sum V_b], got {tuple(ids.shape)}")
        if vocab.batch_size != hidden.batch_size:
            raise ValueError(f"{fn}(): expected vocab with the batch size of hidden ({hidden.batch_size}), "
                             f"got {vocab.batch_size} sequences")
    elif isinstance(vocab, torch.Tensor):
        ids, v_off, name = vocab, None, "vocab"
        if ids.dim() != 1:
            raise ValueError(f"{fn}(): expected vocab to be a RaggedTensor of ids or a 1-D id tensor shared by the "
                             f"batch, got a tensor of shape {tuple(ids.shape)}")
    else:
        raise TypeError(f"{fn}(): expected vocab to be a RaggedTensor of ids or a 1-D id tensor, "
                        f"got {describe(vocab)}")
    _check_ids_dtype(fn, name, ids)
    if ids.device != h.device:
        raise ValueError(f"{fn}(): expected {name} on {h.device} (the device of hidden), got {ids.device}")
    ids = check_vector(fn, name, ids, ids.shape[0], h.device)
    if v_off is not None:
        v_off = check_offsets_tensor(fn, v_off, ids, name="vocab.offsets")
    if not isinstance(validate, bool):
        raise TypeError(f"{fn}(): expected validate to be a bool, got {describe(validate)}")

    # The ids are checked where that costs no wait: on the host, or folded into a read of the
    # device that happens anyway (the offsets' read below); validate=True always reads.
    read_offsets = v_off is not None and (hidden._host_offsets is None or vocab._host_offsets is None)
    checks = _ID_CHECKS if validate else (("range", "sorted") if sorted_ids else ("range",))
    check_now = validate or _id_check_is_free(ids, read_offsets)
    flags = _id_flags(ids, v_off, vocab_size, checks) if check_now else None
    tokens = h.shape[0]
    if v_off is None:
        if flags is not None:
            _raise_id_errors(fn, name, _host(flags), ids, None, vocab_size, checks)
        size = ids.shape[0]
        l_off = h_off.to(torch.int64) * size
        return _Layout(h, h_off, weight, bias, ids, None, l_off, tokens * size, hidden.max_len, size,
                       hidden._host_offsets, None, name, check_now)
    host_h, host_v, host_flags = _host_offsets(hidden, vocab, flags)
    if flags is not None:
        _raise_id_errors(fn, name, host_flags, ids, v_off, vocab_size, checks)
    # l_off from the host offsets: one queued copy instead of half a dozen small kernels.
    host_l = [0] * len(host_h)
    for b in range(len(host_h) - 1):
        host_l[b + 1] = host_l[b] + (host_h[b + 1] - host_h[b]) * (host_v[b + 1] - host_v[b])
    total = host_l[-1]
    l_off = to_device(host_l, torch.int64, h.device)
    return _Layout(h, h_off, weight, bias, ids, v_off, l_off, total, hidden.max_len, vocab.max_len, host_h, host_v,
                   name, check_now)


def _id_check_is_free(ids: torch.Tensor, read_offsets: bool) -> bool:
    """True when checking the ids costs no wait for the device: host ids, or a read of the
    offsets that happens anyway (never while traced or on fake tensors)."""
    return eager(ids) and (ids.device.type == "cpu" or read_offsets)


def _host_offsets(hidden: RaggedTensor, vocab: RaggedTensor, extra: torch.Tensor | None = None):
    """Both host offsets (and ``extra``'s values, an int64 device tensor, or None): the ones
    the RaggedTensors lack and ``extra`` come back in one read (the offsets are cached)."""
    missing = [rt for rt in (hidden, vocab) if rt._host_offsets is None]
    host_extra = None
    if missing or extra is not None:
        parts = [rt.offsets.to(torch.int64) for rt in missing] + ([] if extra is None else [extra])
        host = _host(torch.cat(parts))
        start = 0
        for rt in missing:
            rt._host_offsets = tuple(host[start:start + rt.offsets.shape[0]])
            start += rt.offsets.shape[0]
        host_extra = None if extra is None else host[start:]
    return hidden.host_offsets(), vocab.host_offsets(), host_extra


_ID_CHECKS = ("range", "sorted", "unique")


def _id_failures(ids: torch.Tensor, v_off: torch.Tensor | None, vocab_size: int,
                 checks: tuple[str, ...]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Per check in ``checks`` the ``[n]`` bool mask of the ids that fail it ("range": outside
    ``[0, vocab_size)``; "sorted": followed by a smaller id of the same sequence; "unique":
    followed by the same id in the same sequence), and the ``[n]`` sequence of each id (None
    when no check needed it). Device ops only: no sync."""
    n = ids.shape[0]
    device = ids.device
    x = ids.to(torch.int64)
    seq = None
    if any(c != "range" for c in checks):
        if v_off is None:
            seq = torch.zeros(n, dtype=torch.int64, device=device)
        else:
            v = v_off.to(torch.int64)
            seq = torch.repeat_interleave(torch.arange(v.shape[0] - 1, device=device), v[1:] - v[:-1],
                                          output_size=n)
    masks = []
    for check in checks:
        if check == "range":
            masks.append((x < 0) | (x >= vocab_size))
            continue
        step = x[1:] - x[:-1]
        same = seq[1:] == seq[:-1]
        last = torch.zeros(1, dtype=torch.bool, device=device)
        masks.append(torch.cat([same & ((step < 0) if check == "sorted" else (step == 0)), last]))
    return masks, seq


def _id_flags(ids: torch.Tensor, v_off: torch.Tensor | None, vocab_size: int,
              checks: tuple[str, ...]) -> torch.Tensor:
    """int64 ``[len(checks)]`` on the ids' device, 1 where a check fails: the few values a
    read of the hot path carries (no sync here; :func:`_raise_id_errors` reads the details
    only once a flag is set)."""
    if ids.shape[0] == 0:
        return torch.zeros(len(checks), dtype=torch.int64, device=ids.device)
    masks, _ = _id_failures(ids, v_off, vocab_size, checks)
    return torch.stack([m.any() for m in masks]).to(torch.int64)


def _raise_id_errors(fn: str, name: str, flags: list[int], ids: torch.Tensor, v_off: torch.Tensor | None,
                     vocab_size: int, checks: tuple[str, ...]) -> None:
    """ValueError for the first failed check among the host ``flags`` of :func:`_id_flags`;
    the position and values it names cost one more read (on the error path only)."""
    failed = [c for c, f in zip(checks, flags) if f]
    if not failed:
        return
    check = failed[0]
    masks, seq = _id_failures(ids, v_off, vocab_size, (check,))
    n = ids.shape[0]
    i = masks[0].to(torch.int32).argmax().to(torch.int64)
    j = (i + 1).clamp(max=n - 1)
    x = ids.to(torch.int64)
    if v_off is None:
        owner = torch.zeros_like(i)
    elif seq is None:
        owner = torch.searchsorted(v_off.to(torch.int64), i.reshape(1), right=True)[0] - 1
    else:
        owner = seq[i]
    i, xi, xj, b = torch.stack([i, x[i], x[j], owner]).tolist()
    where = "" if v_off is None else f" of sequence {b}"
    if check == "range":
        raise ValueError(f"{fn}(): expected {name} in [0, {vocab_size}) (weight.shape[0]), got {xi} at "
                         f"position {i}{where}")
    if check == "sorted":
        raise ValueError(f"{fn}(): expected {name} sorted in increasing order within each sequence, got {xi} "
                         f"before {xj} at positions {i}, {i + 1}{where}")
    raise ValueError(f"{fn}(): expected {name} unique within each sequence, got {xi} twice at positions {i}, "
                     f"{i + 1}{where}")


def _check_ids_late(layout: _Layout, checks: tuple[str, ...]) -> torch.Tensor | None:
    """Device flags of the ids' checks when ``_prepare`` left them unread (None otherwise, or
    when the ids cannot be read: traced, fake)."""
    if layout.ids_checked or not eager(layout.ids):
        return None
    return _id_flags(layout.ids, layout.v_off, layout.weight.shape[0], checks)


def _raise_layout_id_errors(fn: str, layout: _Layout, flags: list[int], checks: tuple[str, ...]) -> None:
    _raise_id_errors(fn, layout.name, flags, layout.ids, layout.v_off, layout.weight.shape[0], checks)


def _check_backend_name(fn: str, backend) -> None:
    if backend is not None:
        backends._check_name(fn, backend)


# --------------------------------------------------------------------------------------
# Public API


def vocab_projection(hidden: RaggedTensor, weight: torch.Tensor, vocab, bias: torch.Tensor | None = None, *,
                     validate: bool = False, backend: str | None = None) -> RaggedLogits:
    """Logits of every token against its own sequence's candidate ids only.

    * ``hidden``: RaggedTensor, ``values [T, d]`` (float16, bfloat16, float32, float64);
    * ``weight``: ``[V, d]`` (``nn.Linear`` / tied-embedding layout), hidden's dtype;
    * ``vocab``: RaggedTensor of int32/int64 ids, sequence ``b``'s sorted unique candidates
      (batch size of hidden), or a 1-D id tensor shared by the whole batch;
    * ``bias``: ``[V]`` or None.

    Returns a :class:`ragged.RaggedLogits` (flat ``values [sum_b T_b * V_b]`` in hidden's
    dtype, accumulated in float32; ``to_padded``, ``to_full``, ``argmax``, ``topk``,
    ``log_softmax``). Differentiable in hidden, weight and bias; rows of ``weight`` that
    no sequence lists get a zero gradient.

    ``validate=True`` checks the ids (sorted and unique within each sequence, in
    ``[0, V)``) at the cost of one device read. Without it an id outside ``[0, V)`` still
    raises ``ValueError`` where the ids are read at no cost (host ids, a call that reads the
    offsets or runs the ``"torch"`` backend); CUDA ids on the hot path are trusted, and
    an id outside ``[0, V)`` scores 0 there (no weight row or bias is read for it; see
    the module docstring). Any tensor argument may be a strided view.
    """
    fn = "ragged.vocab_projection"
    _check_backend_name(fn, backend)
    layout = _prepare(fn, hidden, weight, vocab, bias, validate)
    impl = backends.select("vocab_projection", backend, layout.hidden.device, *layout.args(), fn=fn)
    if impl.name == "torch":  # the reference reads the offsets itself: the range check costs no wait
        flags = _check_ids_late(layout, ("range",))
        if flags is not None:
            _raise_layout_id_errors(fn, layout, _host(flags), ("range",))
    values = _call_forward(layout.hidden, layout.h_off, layout.weight, layout.bias, layout.ids, layout.v_off,
                           layout.l_off, layout.v_off is None, layout.total, layout.max_t, layout.max_v, impl.name)
    return RaggedLogits(values, layout.h_off, layout.hidden.shape[0], layout.max_t, layout.ids, layout.v_off,
                        layout.max_v, layout.l_off, weight.shape[0], layout.host_h, layout.host_v)


def _local_targets(fn: str, layout: _Layout, target: torch.Tensor, ignore_index: int,
                   out_of_vocab: str, id_flags: torch.Tensor | None = None) -> torch.Tensor:
    """``[T]`` int64: each token's target as an index into its sequence's candidates, -1 for
    a token that is ignored (``ignore_index``, or outside the candidates with ``"ignore"``)."""
    tokens = target.shape[0]
    device = target.device
    vocab_size = layout.weight.shape[0]
    tgt = target.to(torch.int64)
    ids = layout.ids.to(torch.int64)
    n = ids.shape[0]
    h_off = layout.h_off.to(torch.int64)
    batch = h_off.shape[0] - 1
    seq = torch.repeat_interleave(torch.arange(batch, device=device), h_off[1:] - h_off[:-1], output_size=tokens)
    in_range = (tgt >= 0) & (tgt < vocab_size)
    if n == 0:
        local = torch.zeros_like(tgt)
        found = torch.zeros_like(in_range)
    elif layout.v_off is None:
        local = torch.searchsorted(ids, tgt)
        found = in_range & (ids[local.clamp(max=n - 1)] == tgt)
    else:
        # Keys b * V + id are sorted when each sequence's ids are: one search for the batch.
        v = layout.v_off.to(torch.int64)
        owner = torch.repeat_interleave(torch.arange(batch, device=device), v[1:] - v[:-1], output_size=n)
        keys = owner * vocab_size + ids
        query = seq * vocab_size + tgt
        pos = torch.searchsorted(keys, query)
        found = in_range & (keys[pos.clamp(max=n - 1)] == query)
        local = pos - v[:-1][seq]
    ignored = tgt == ignore_index
    if out_of_vocab == "error" and tokens > 0:
        bad = ~(found | ignored)
        first = bad.to(torch.int32).argmax()
        _raise_out_of_vocab(fn, torch.stack([bad.sum().to(torch.int32), (2 ** 31 - 1) - first.to(torch.int32)]),
                            target, h_off, ignore_index, layout, id_flags)
    keep = found & ~ignored
    return torch.where(keep, local, torch.full_like(local, -1))


_CE_ID_CHECKS = ("range", "sorted")


def _raise_out_of_vocab(fn: str, bad: torch.Tensor, target: torch.Tensor, h_off: torch.Tensor,
                        ignore_index: int, layout: _Layout, id_flags: torch.Tensor | None = None) -> None:
    """ValueError naming the first token whose target is outside its candidates. ``bad``:
    device ``[count, 2**31 - 1 - first token]``; reading it is the one sync of ``out_of_vocab="error"``
    (under torch.compile, a device-side assert instead). ``id_flags``: the ids' checks
    (:func:`_id_flags` of ``_CE_ID_CHECKS``) not yet read, read in the same copy and raised first:
    an id outside ``[0, V)`` or unsorted ids (the targets' binary search misses) explain
    "missing" targets better than the targets do."""
    hint = "pass out_of_vocab='ignore' to skip such tokens"
    if torch.compiler.is_compiling():
        torch._assert_async(bad[0] == 0, f"{fn}(): a target is not among its sequence's candidate ids; {hint}")
        return
    if id_flags is None:
        count, first = bad.tolist()
    else:
        host = torch.cat([bad.to(torch.int64), id_flags]).tolist()
        count, first = host[:2]
        _raise_layout_id_errors(fn, layout, host[2:], _CE_ID_CHECKS)
    first = 2 ** 31 - 1 - first
    if count:
        tid = int(target[first])
        b = int(torch.searchsorted(h_off.to(torch.int64), torch.tensor([first], device=h_off.device),
                                   right=True)[0]) - 1
        raise ValueError(f"{fn}(): expected every target to be one of its sequence's candidate ids (or "
                         f"ignore_index = {ignore_index}), got {count} token(s) outside them, the first "
                         f"token {first} (sequence {b}) with target {tid}; {hint}")


def vocab_cross_entropy(hidden: RaggedTensor, weight: torch.Tensor, vocab, target, bias: torch.Tensor | None = None,
                        *, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                        out_of_vocab: str = "error", validate: bool = False,
                        backend: str | None = None) -> torch.Tensor:
    """Cross-entropy of each token's target over its own sequence's candidates.

    Arguments as :func:`vocab_projection`, plus ``target``: ``[T]`` int64/int32 *global*
    vocabulary ids (a tensor, or a RaggedTensor with hidden's tokens). It equals
    ``F.cross_entropy`` on each sequence's ``[T_b, V_b]`` logits with the target mapped to
    its position in the sequence's candidates, with the same ``ignore_index``,
    ``reduction`` (``"mean"`` over the tokens not ignored, ``"sum"``, ``"none"`` ->
    ``[T]`` with 0 at ignored tokens) and ``label_smoothing`` (spread over the token's
    candidates). Returned in hidden's dtype (computed in float32).

    ``out_of_vocab``: what a target outside its sequence's candidates means.
    ``"error"`` (default) raises ``ValueError`` naming the first such token, which costs one
    device read (under ``torch.compile`` a device-side assert instead, raising
    ``RuntimeError``); ``"ignore"`` treats such tokens like ``ignore_index`` (no read).

    Targets are located with a binary search, so each sequence's ids must be sorted.
    ``validate=True`` checks them; so does every call on host ids, and the read of
    ``out_of_vocab="error"`` (the same copy, no extra sync): unsorted ids raise
    ``ValueError`` there rather than a report of targets outside their candidates. With
    ``out_of_vocab="ignore"`` on CUDA ids and no read (the hot path), unsorted ids are
    trusted: targets the search misses count as ignored, and if that is every token the
    ``"mean"`` is NaN (as ``F.cross_entropy`` with every target ignored) -- pass
    ``validate=True`` once to check the ids.
    """
    fn = "ragged.vocab_cross_entropy"
    _check_backend_name(fn, backend)
    layout = _prepare(fn, hidden, weight, vocab, bias, validate, sorted_ids=True)
    tokens = layout.hidden.shape[0]
    if isinstance(target, RaggedTensor):
        if target.values.dim() != 1 or target.num_tokens != tokens:
            raise ValueError(f"{fn}(): expected target with values of shape [{tokens}] (the tokens of hidden), "
                             f"got {tuple(target.values.shape)}")
        target = target.values
    check_tensor(fn, "target", target)
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{fn}(): expected target of dtype torch.int64 or torch.int32, got {target.dtype}")
    if tuple(target.shape) != (tokens,):
        raise ValueError(f"{fn}(): expected target of shape [{tokens}] (the tokens of hidden), "
                         f"got {tuple(target.shape)}")
    if target.device != layout.hidden.device:
        raise ValueError(f"{fn}(): expected target on {layout.hidden.device} (the device of hidden), "
                         f"got {target.device}")
    target = check_vector(fn, "target", target, tokens, layout.hidden.device)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{fn}(): expected ignore_index to be an int, got {describe(ignore_index)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{fn}(): expected reduction to be one of {REDUCTIONS}, got {reduction!r}")
    if (isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float))
            or not 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"{fn}(): expected label_smoothing in [0, 1], got {describe(label_smoothing)}")
    if out_of_vocab not in OUT_OF_VOCAB:
        raise ValueError(f"{fn}(): expected out_of_vocab to be one of {OUT_OF_VOCAB}, got {out_of_vocab!r}")
    impl = backends.select("vocab_cross_entropy", backend, layout.hidden.device, *layout.args(), fn=fn)
    # ids not checked yet (CUDA ids): folded into the read of out_of_vocab="error"; the
    # "torch" backend reads the offsets itself, so it checks them before it runs
    fold = out_of_vocab == "error" and tokens > 0
    id_flags = _check_ids_late(layout, _CE_ID_CHECKS) if fold or impl.name == "torch" else None
    if id_flags is not None and not fold:
        _raise_layout_id_errors(fn, layout, _host(id_flags), _CE_ID_CHECKS)
        id_flags = None
    if impl.name == "triton":  # targets located inside the kernel
        losses, local, bad = impl.fn(*layout.args(), target, ignore_index, float(label_smoothing), layout.host_h,
                                     layout.host_v)
        if out_of_vocab == "error" and tokens > 0:
            _raise_out_of_vocab(fn, bad, target, layout.h_off, ignore_index, layout, id_flags)
    else:
        local = _local_targets(fn, layout, target, ignore_index, out_of_vocab, id_flags)
        losses = impl.fn(*layout.args(), local, float(label_smoothing))
    dtype = layout.hidden.dtype
    if reduction == "none":
        return losses.to(dtype)
    if reduction == "sum":
        return losses.sum().to(dtype)
    return (losses.sum() / (local >= 0).sum()).to(dtype)


def union_vocab(vocab) -> torch.Tensor:
    """One sorted 1-D tensor of every id any sequence lists (their union).

    ``vocab``: a RaggedTensor of ids, a 1-D id tensor, or a list of 1-D id tensors.
    Projecting onto the union as a shared vocabulary (every token scored against the
    batch's candidates, as Marian's vocabulary short-lists do) trades some extra logits
    for one dense GEMM. ``torch.unique`` sizes its output on the host: one sync on CUDA.
    """
    fn = "ragged.union_vocab"
    if isinstance(vocab, RaggedTensor):
        ids, name = vocab.values, "vocab.values"
    elif isinstance(vocab, torch.Tensor):
        ids, name = vocab, "vocab"
    elif isinstance(vocab, (list, tuple)) and vocab and all(isinstance(t, torch.Tensor) for t in vocab):
        for i, t in enumerate(vocab):
            if t.dim() != 1:
                raise ValueError(f"{fn}(): expected 1-D id tensors, got shape {tuple(t.shape)} at index {i}")
            _check_ids_dtype(fn, f"vocab[{i}]", t)
        ids, name = torch.cat([t.to(torch.int64) for t in vocab]), "vocab"
    else:
        raise TypeError(f"{fn}(): expected vocab to be a RaggedTensor of ids, a 1-D id tensor or a list of them, "
                        f"got {describe(vocab)}")
    if ids.dim() != 1:
        raise ValueError(f"{fn}(): expected {name} to be 1-D, got shape {tuple(ids.shape)}")
    _check_ids_dtype(fn, name, ids)
    return torch.unique(ids, sorted=True)
