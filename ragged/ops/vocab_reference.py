"""The ``"torch"`` implementations of the vocab ops: the CPU path and the tests' oracle.

Plain torch, one gather of the candidate rows of ``weight`` and one GEMM per sequence,
accumulated in float32 (float64 for float64). They read the offsets on the host (one sync
on CUDA, none for a shared vocabulary), so they are not the GPU hot path. The op
implementations (:func:`projection_forward`, :func:`projection_backward`,
:func:`cross_entropy_forward`, :func:`cross_entropy_backward`) take the records of the ops of
:mod:`ragged.ops.vocab` (:mod:`ragged.records.vocab`), as every backend's do.
"""

from __future__ import annotations

import torch

from ..logits import compute_dtype, layout_coords, segmented_cross_entropy
from ..records.vocab import (
    VocabCrossEntropyArgs,
    VocabCrossEntropyBackwardInputs,
    VocabCrossEntropyOutput,
    VocabGrads,
    VocabProjectionArgs,
    VocabProjectionBackwardInputs,
    VocabProjectionOutput,
)
from .vocab_checks import host_ints


def _segments(
    tokens: int, h_off: torch.Tensor, ids: torch.Tensor, v_off: torch.Tensor | None, host_h=None, host_v=None
) -> list[tuple[int, int, int, int, int]]:
    """(first token, end token, first candidate, end candidate, first logit) per block, from
    the host offsets when given (else read from the device ones: one sync on CUDA)."""
    if v_off is None:  # one [T, S] block: l_off[b] = h_off[b] * S, so the rows follow each other
        return [(0, tokens, 0, ids.shape[0], 0)]
    if host_h is None or host_v is None:
        if h_off.device.type == "cpu":
            host_h, host_v = host_ints(h_off), host_ints(v_off)
        else:  # one read: one wait for the device
            both = host_ints(torch.cat([h_off.to(torch.int64), v_off.to(torch.int64)]))
            host_h, host_v = both[: h_off.shape[0]], both[h_off.shape[0] :]
    out, start = [], 0
    for b in range(len(host_h) - 1):
        out.append((host_h[b], host_h[b + 1], host_v[b], host_v[b + 1], start))
        start += (host_h[b + 1] - host_h[b]) * (host_v[b + 1] - host_v[b])
    return out


def _rows(src: torch.Tensor, index: torch.Tensor, dtype: torch.dtype, buf: torch.Tensor | None) -> torch.Tensor:
    """``src[index]`` in ``dtype``; gathered into ``buf`` (no allocation) when the dtypes allow."""
    if buf is not None and src.dtype == dtype:
        return torch.index_select(src, 0, index, out=buf[: index.shape[0]])
    return src.index_select(0, index).to(dtype)


def reference_vocab_projection(
    hidden: torch.Tensor,
    h_off: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    v_off: torch.Tensor | None,
) -> torch.Tensor:
    """Flat logits (see :mod:`ragged.ops.vocab`) in float32 accumulation, returned in hidden's dtype.

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
    grads = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if not grads:
        return _project(hidden, weight, bias, ids64, segments, dtype)
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


def _project(hidden, weight, bias, ids64, segments, dtype) -> torch.Tensor:
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
        block = out[l0 : l0 + rows * cols].view(rows, cols)
        h = hidden[t0:t1].to(dtype)
        if bias is None:
            torch.mm(h, w.t(), out=block)
        else:
            torch.addmm(_rows(bias, cand, dtype, b_buf), h, w.t(), out=block)
    return out.to(hidden.dtype)


def reference_vocab_projection_backward(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    h_off: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    v_off: torch.Tensor | None,
    need_hidden: bool = True,
    need_weight: bool = True,
    need_bias: bool = True,
):
    """Gradients of :func:`reference_vocab_projection` for the flat ``grad``, written out.

    With ``g_b`` sequence b's ``[T_b, V_b]`` block of ``grad``: ``d_hidden_b = g_b @ W[ids_b]``,
    ``d_weight[ids_b] += g_b.T @ hidden_b``, ``d_bias[ids_b] += g_b.sum(0)`` (rows of ids no
    sequence lists stay 0; an id listed by several sequences sums their contributions).
    Accumulated in float32 (float64 for float64), returned in the inputs' dtypes;
    ``(d_hidden, d_weight, d_bias)`` with None for each one not asked for. Explicit
    formulas rather than autograd: this also runs inside the
    ``ragged::vocab_projection_backward`` op, where autograd is off.
    """
    segments = _segments(hidden.shape[0], h_off, ids, v_off)
    return _project_backward(grad, hidden, weight, ids.to(torch.int64), segments, need_hidden, need_weight, need_bias)


def _project_backward(grad, hidden, weight, ids64, segments, need_hidden, need_weight, need_bias):
    dtype = compute_dtype(hidden.dtype)
    g = grad.to(dtype)
    d_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if need_hidden else None
    d_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
    d_bias = torch.zeros(weight.shape[0], dtype=dtype, device=weight.device) if need_bias else None
    width = max((v1 - v0 for _, _, v0, v1, _ in segments), default=0) if need_hidden else 0
    w_buf = torch.empty((width, weight.shape[1]), dtype=dtype, device=weight.device)
    for t0, t1, v0, v1, l0 in segments:
        rows, cols = t1 - t0, v1 - v0
        if rows == 0 or cols == 0:
            continue
        gb = g[l0 : l0 + rows * cols].view(rows, cols)
        cand = ids64[v0:v1]
        if need_hidden:
            torch.mm(gb, _rows(weight, cand, dtype, w_buf), out=d_hidden[t0:t1])
        if need_weight:
            d_weight.index_add_(0, cand, gb.t() @ hidden[t0:t1].to(dtype))
        if need_bias:
            d_bias.index_add_(0, cand, gb.sum(0))
    return (
        None if d_hidden is None else d_hidden.to(hidden.dtype),
        None if d_weight is None else d_weight.to(weight.dtype),
        None if d_bias is None else d_bias.to(weight.dtype),
    )


# --------------------------------------------------------------------------------------
# The implementations of the ops (over the records of ragged.records.vocab)


def projection_forward(args: VocabProjectionArgs) -> VocabProjectionOutput:
    with torch.no_grad():
        return VocabProjectionOutput(
            reference_vocab_projection(args.hidden, args.h_off, args.weight, args.bias, args.ids, args.v_off)
        )


def projection_backward(args: VocabProjectionArgs, inputs: VocabProjectionBackwardInputs) -> VocabGrads:
    return VocabGrads._make(
        reference_vocab_projection_backward(
            inputs.grad_logits,
            args.hidden,
            args.h_off,
            args.weight,
            args.ids,
            args.v_off,
            inputs.need_hidden,
            inputs.need_weight,
            inputs.need_bias,
        )
    )


def locate_targets(
    target: torch.Tensor,
    h_off: torch.Tensor,
    ids: torch.Tensor,
    v_off: torch.Tensor | None,
    vocab_size: int,
    ignore_index: int,
    seq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local, missing)`` of global target ids, with device ops only (no sync).

    ``local``: ``[T]`` int64, each token's target as an index into its sequence's sorted
    candidates, -1 for a token without one (``ignore_index``, or not a candidate).
    ``missing``: int64 ``[]``, the number of tokens whose target is neither a candidate nor
    ``ignore_index``.
    ``seq``: the ``[T]`` sequence of each token, when the caller has it."""
    tokens = target.shape[0]
    tgt = target.to(torch.int64)
    ids64 = ids.to(torch.int64)
    n = ids64.shape[0]
    in_range = (tgt >= 0) & (tgt < vocab_size)
    if n == 0:
        local = torch.zeros_like(tgt)
        found = torch.zeros_like(in_range)
    elif v_off is None:  # searchsorted copies a strided view of either (with a warning)
        local = torch.searchsorted(ids64.contiguous(), tgt.contiguous())
        found = in_range & (ids64[local.clamp(max=n - 1)] == tgt)
    else:
        # Keys b * V + id are sorted when each sequence's ids are: one search for the batch.
        v = v_off.to(torch.int64)
        steps = torch.arange(v.shape[0] - 1, device=target.device)
        if seq is None:  # B for a row past h_off[-1] (a spare row of a graphed bucket): no key matches
            seq = torch.searchsorted(h_off.to(torch.int64)[1:], torch.arange(tokens, device=target.device), right=True)
        keys = torch.repeat_interleave(steps, torch.diff(v), output_size=n) * vocab_size + ids64
        query = seq * vocab_size + tgt
        pos = torch.searchsorted(keys, query)
        found = in_range & (keys[pos.clamp(max=n - 1)] == query)
        local = pos - v[seq]
    wanted = tgt != ignore_index
    keep = found & wanted
    return torch.where(keep, local, -1), (keep ^ wanted).sum()  # wanted, not found


class _Outputs(VocabCrossEntropyOutput):
    """The cross-entropy forward's output record, carrying its flat logits as ``.logits`` (an
    attribute, not an output: the op's outputs are the same on every backend): an eager call
    hands them to its backward instead of having them recomputed."""

    logits: torch.Tensor


def cross_entropy_forward(args: VocabCrossEntropyArgs) -> VocabCrossEntropyOutput:
    """``(loss, lse, local, missing)``: the logits of :func:`reference_vocab_projection` and a
    segmented log-softmax over them (see :func:`ragged.logits.segmented_cross_entropy`)."""
    hidden, h_off, weight, ids, v_off = args.hidden, args.h_off, args.weight, args.ids, args.v_off
    tokens = hidden.shape[0]
    shared = v_off is None
    coords = None if v_off is None else layout_coords(h_off, v_off, args.l_off, ids.shape[0], tokens, args.total)
    local, missing = locate_targets(
        args.target, h_off, ids, v_off, weight.shape[0], args.ignore_index, None if coords is None else coords.seq
    )
    with torch.no_grad():
        values = reference_vocab_projection(hidden, h_off, weight, args.bias, ids, v_off)
        loss, lse = segmented_cross_entropy(
            values, tokens, coords, ids.shape[0] if shared else None, local, args.label_smoothing
        )
    out = _Outputs(loss, lse, local.to(torch.int32), missing)
    out.logits = values
    return out


def cross_entropy_backward(args: VocabCrossEntropyArgs, inputs: VocabCrossEntropyBackwardInputs) -> VocabGrads:
    """Gradients of ``sum_t grad[t] * loss_t``: the logits' gradient
    ``grad_t * (softmax - (1 - eps) * onehot - eps / V_b)`` (the logits recomputed where the
    forward's ``logits`` are not given), then the projection's backward. Reads no ``target``."""
    hidden, h_off, weight, ids, v_off, l_off = args.hidden, args.h_off, args.weight, args.ids, args.v_off, args.l_off
    grad, lse, logits = inputs.grad_loss, inputs.lse, inputs.logits
    tokens = hidden.shape[0]
    dtype = compute_dtype(hidden.dtype)
    ids64 = ids.to(torch.int64)
    shared = v_off is None
    segments = _segments(tokens, h_off, ids, v_off, inputs.host_h_off, inputs.host_v_off)
    with torch.no_grad():
        if logits is None:
            logits = _project(hidden, weight, args.bias, ids64, segments, dtype)
        x = logits.to(dtype)
        local = inputs.local.to(torch.int64)
        keep = local >= 0
        eps = float(args.label_smoothing)
        grad_t = torch.where(keep, grad.expand(tokens).to(dtype), 0.0)  # 0 for a token without target
        target_t = grad_t * (eps - 1.0)  # the one-hot term, per token
        if x.shape[0] == 0:
            g = x
        elif shared:
            size = ids.shape[0]
            g = torch.exp(x.view(tokens, size) - lse.unsqueeze(1)) * grad_t.unsqueeze(1)
            if eps:
                g -= (grad_t * (eps / size)).unsqueeze(1)
            g = g.scatter_add_(1, local.clamp_min(0).unsqueeze(1), target_t.unsqueeze(1)).reshape(-1)
        else:
            row_len, row_start = _token_rows(h_off, v_off, l_off, tokens)
            # per token (lse, grad, smoothing term), spread over its row of logits in one op
            per_token = [lse, grad_t] + ([grad_t * eps / row_len.clamp_min(1).to(dtype)] if eps else [])
            spread = torch.repeat_interleave(torch.stack(per_token, 1), row_len, dim=0, output_size=x.shape[0])
            g = torch.exp(x - spread[:, 0]) * spread[:, 1]
            if eps:
                g -= spread[:, 2]
            g.index_put_((torch.where(keep, row_start + local, 0),), target_t, accumulate=True)
    return VocabGrads._make(
        _project_backward(g, hidden, weight, ids64, segments, inputs.need_hidden, inputs.need_weight, inputs.need_bias)
    )


def _token_rows(h_off, v_off, l_off, tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_len, row_start)``: each token's number of candidates and first logit (``[T]``
    int64; the part of :func:`ragged.logits.layout_coords` the backward needs: a row past
    ``h_off[-1]`` has no candidates)."""
    h, v = h_off.to(torch.int64), v_off.to(torch.int64)
    position = torch.arange(tokens, device=h.device)
    seq = torch.searchsorted(h[1:], position, right=True)
    v_len = torch.cat([torch.diff(v), v.new_zeros(1)])
    row_len = v_len[seq]
    row_start = (l_off.to(torch.int64) - h * v_len)[seq] + position * row_len
    return row_len, row_start
