"""Regressions of the vocabulary ops (ragged.vocab_projection, ragged.vocab_cross_entropy,
ragged.union_vocab, RaggedLogits and the implementations of the two ops on every backend):
strided offsets, ids, targets and bias, which the Triton kernels read as if contiguous.

The oracle is a float64 per-sequence loop (``vocab_regression_cases``). Sizes are small: the
Triton kernels run through the interpreter on CPU. The GPU variants are in
tests/test_gpu_vocab.py; the other regressions of these ops in
tests/test_vocab_ids_and_gradients.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from vocab_cases import _flat, _loop_blocks
from vocab_regression_cases import (
    BACKENDS,
    COUNTS,
    LENS,
    TOL,
    D,
    V,
    _candidates,
    _close,
    _gen,
    _grad,
    _interleave,
    _loop_cross_entropy,
    _offsets,
    _targets,
)

import ragged
from ragged import RaggedLogits, RaggedTensor
from ragged.records.vocab import (
    VocabCrossEntropyArgs,
    VocabCrossEntropyBackwardInputs,
    VocabProjectionArgs,
    VocabProjectionBackwardInputs,
)


def _strided_inputs(seed, shared, host):
    """A batch whose offsets, ids, bias and weight are all strided views, and its plain values.

    ``host``: the RaggedTensors carry host offsets (the hot path: the device offsets go to
    the kernels unread) or not (they are read once)."""
    g = _gen("strided", seed)
    cands = _candidates(COUNTS, seed, shared)
    h_full = torch.randn(sum(LENS), 2 * D, generator=g)
    w_full = torch.randn(V, 2 * D, generator=g)
    b_full = torch.randn(2 * V, generator=g)
    h_off = _offsets(LENS)
    host_h = tuple(h_off.tolist()) if host else None

    def build(hf, wf, bf):
        hidden = RaggedTensor(hf[:, ::2], _interleave(h_off, 0), max(LENS), host_h)
        if shared:
            vocab = _interleave(cands[0], 0)
        else:
            v_off = _offsets(COUNTS)
            vocab = RaggedTensor(
                _interleave(torch.cat(cands).to(torch.int32), 0),
                _interleave(v_off, 0),
                max(COUNTS),
                tuple(v_off.tolist()) if host else None,
            )
        return hidden, wf[:, ::2], vocab, bf[::2]

    return (h_full, w_full, b_full), build, cands


@pytest.mark.parametrize("host", [True, False], ids=["host_offsets", "device_offsets"])
@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_projection_takes_strided_offsets_ids_bias(backend, shared, host):
    leaves, build, cands = _strided_inputs(1, shared, host)

    def ours(hf, wf, bf):
        return ragged.vocab_projection(*build(hf, wf, bf), backend=backend).values

    def oracle(hf, wf, bf):
        return _flat(_loop_blocks(hf[:, ::2], LENS, wf[:, ::2], bf[::2], cands))

    up = torch.randn(sum(n * len(c) for n, c in zip(LENS, cands)), generator=_gen("up", shared))
    out, grads = _grad(ours, leaves, up)
    want, want_grads = _grad(oracle, leaves, up)
    torch.testing.assert_close(out.double(), want, **TOL)
    # the gradients reach the leaves the strided views were taken of (bias.grad of b_full[::2])
    _close(grads, want_grads, backend)
    assert torch.all(grads[2][1::2] == 0) and torch.all(grads[1][:, 1::2] == 0)


@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_logits_of_strided_inputs(backend, shared):
    """Every RaggedLogits method on the logits of strided inputs equals the same method on
    the logits of their contiguous copies."""
    (h_full, w_full, b_full), build, _ = _strided_inputs(2, shared, True)
    hidden, weight, vocab, bias = build(h_full, w_full, b_full)
    strided = ragged.vocab_projection(hidden, weight, vocab, bias, backend=backend)
    if isinstance(vocab, RaggedTensor):
        plain_vocab = RaggedTensor.from_lengths(vocab.values.contiguous(), COUNTS)
    else:
        plain_vocab = vocab.contiguous()
    plain = ragged.vocab_projection(
        RaggedTensor.from_lengths(hidden.values.contiguous(), LENS),
        weight.contiguous(),
        plain_vocab,
        bias.contiguous(),
        backend=backend,
    )
    torch.testing.assert_close(strided.values, plain.values, **TOL)
    assert torch.equal(strided.argmax(), plain.argmax())
    for a, b in zip(strided.topk(3), plain.topk(3)):
        torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(strided.to_full(), plain.to_full(), **TOL)
    torch.testing.assert_close(strided.to_padded(), plain.to_padded(), **TOL)
    torch.testing.assert_close(strided.log_softmax().values, plain.log_softmax().values, **TOL)
    torch.testing.assert_close(strided.logsumexp(), plain.logsumexp(), **TOL)
    assert [t.shape for t in strided.unbind()] == [t.shape for t in plain.unbind()]
    # a RaggedLogits built by hand on strided metadata (its methods are torch ops on the layout)
    by_hand = RaggedLogits(
        _interleave(plain.values, 0.0),
        _interleave(plain.offsets, 0),
        plain.num_tokens,
        plain.max_len,
        _interleave(plain.ids, 0),
        None if plain.shared else _interleave(plain.vocab_offsets, 0),
        plain.max_candidates,
        _interleave(plain.logit_offsets, 0),
        plain.num_embeddings,
    )
    assert torch.equal(by_hand.argmax(), plain.argmax())
    for a, b in zip(by_hand.topk(3), plain.topk(3)):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(by_hand.to_full(), plain.to_full())
    torch.testing.assert_close(by_hand.to_padded(), plain.to_padded())
    torch.testing.assert_close(by_hand.log_softmax().values, plain.log_softmax().values)


@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_takes_strided_offsets_ids_bias_target(backend, shared):
    leaves, build, cands = _strided_inputs(3, shared, True)
    target = _targets(LENS, cands, 3)

    def ours(hf, wf, bf):
        hidden, weight, vocab, bias = build(hf, wf, bf)
        return ragged.vocab_cross_entropy(
            hidden, weight, vocab, _interleave(target, 0), bias, label_smoothing=0.1, backend=backend
        )

    def oracle(hf, wf, bf):
        return _loop_cross_entropy(hf[:, ::2], LENS, wf[:, ::2], bf[::2], cands, target, 0.1)

    out, grads = _grad(ours, leaves)
    want, want_grads = _grad(oracle, leaves)
    torch.testing.assert_close(out.double(), want, **TOL)
    _close(grads, want_grads, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_union_vocab_of_strided_ids_projects_like_the_loop(backend):
    cands = _candidates(COUNTS, 4)
    expected = sorted(set(torch.cat(cands).tolist()))
    flat = torch.cat(cands)
    strided = RaggedTensor(_interleave(flat, 0), _interleave(_offsets(COUNTS), 0), max(COUNTS))
    assert ragged.union_vocab(strided).tolist() == expected
    assert ragged.union_vocab(_interleave(flat, 0)).tolist() == expected
    assert ragged.union_vocab([_interleave(c, 0) for c in cands]).tolist() == expected
    union = ragged.union_vocab(strided)
    g = _gen("union")
    hidden = RaggedTensor(torch.randn(sum(LENS), D, generator=g), _interleave(_offsets(LENS), 0), max(LENS))
    weight, b_full = torch.randn(V, D, generator=g), torch.randn(2 * V, generator=g)
    logits = ragged.vocab_projection(hidden, weight, _interleave(union, 0), b_full[::2], backend=backend)
    want = _flat(_loop_blocks(hidden.values, LENS, weight, b_full[::2], [union] * len(LENS)))
    torch.testing.assert_close(logits.values.double(), want, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
def test_implementations_take_strided_metadata(shared, backend):
    """Every backend's implementations of the two ops (called without the ops' checks, with
    the ops' operands) take strided offsets, ids, bias, targets, lse and loss gradient."""
    projection = ragged.backends.implementation("vocab_projection", backend)
    cross_entropy = ragged.backends.implementation("vocab_cross_entropy", backend)
    g = _gen("launch", shared)
    cands = _candidates(COUNTS, 5, shared)
    hidden, weight, bias = (
        torch.randn(sum(LENS), D, generator=g),
        torch.randn(V, D, generator=g),
        torch.randn(V, generator=g),
    )
    sizes = [len(c) for c in cands]
    l_off = _offsets([t * v for t, v in zip(LENS, sizes)], torch.int64)
    total, max_t, max_v = int(l_off[-1]), max(LENS), max(sizes)
    ids = cands[0] if shared else torch.cat(cands)
    v_off = None if shared else _interleave(_offsets(COUNTS), 0)
    args = VocabProjectionArgs(
        hidden=hidden,
        h_off=_interleave(_offsets(LENS), 0),
        weight=weight,
        bias=_interleave(bias, 0.0),
        ids=_interleave(ids, 0),
        v_off=v_off,
        l_off=_interleave(l_off, 0),
        total=total,
        max_t=max_t,
        max_v=max_v,
    )
    out = projection.forward_fn(args).logits
    want = _flat(_loop_blocks(hidden, LENS, weight, bias, cands))
    torch.testing.assert_close(out.double(), want, **TOL)
    grad = torch.randn(total, generator=g)
    leaves = [t.double().requires_grad_(True) for t in (hidden, weight, bias)]
    _flat(_loop_blocks(*leaves[:1], LENS, *leaves[1:], cands)).backward(grad.double())
    for deterministic in (False, True):
        got = projection.backward_fn(args, VocabProjectionBackwardInputs(grad, deterministic=deterministic))
        _close(got, [t.grad for t in leaves], f"{backend} backward deterministic={deterministic}")
    target = _targets(LENS, cands, 5)
    ce_args = VocabCrossEntropyArgs(*args, target=_interleave(target, 0), ignore_index=-100, label_smoothing=0.1)
    forward = cross_entropy.forward_fn(ce_args)
    loss, lse, local, missing = forward
    assert missing.item() == 0 and local.dtype == torch.int32
    per_token = []
    t = 0
    for block, n, c in zip(_loop_blocks(hidden, LENS, weight, bias, cands), LENS, cands):
        y = target[t : t + n]
        t += n
        if n:
            local_y = torch.where(y >= 0, torch.searchsorted(c, y.clamp_min(0)), -100)
            per_token.append(
                F.cross_entropy(block, local_y, reduction="none", label_smoothing=0.1) if len(c) else block.new_zeros(n)
            )
    torch.testing.assert_close(loss.double(), torch.cat(per_token), **TOL)
    grad_loss = _interleave(torch.randn(sum(LENS), generator=g), 0.0)
    host = (list(_offsets(LENS).tolist()), None if shared else list(_offsets(COUNTS).tolist()))
    leaves = [t.double().requires_grad_(True) for t in (hidden, weight, bias)]
    per_token, t = [], 0
    for block, n, c in zip(_loop_blocks(leaves[0], LENS, leaves[1], leaves[2], cands), LENS, cands):
        y = target[t : t + n]
        t += n
        if n and len(c):
            local_y = torch.where(y >= 0, torch.searchsorted(c, y.clamp_min(0)), -100)
            per_token.append(F.cross_entropy(block, local_y, reduction="none", label_smoothing=0.1))
        elif n:
            per_token.append(block.new_zeros(n))
    (torch.cat(per_token) * grad_loss.double()).sum().backward()
    kept = getattr(forward, "logits", None)  # the logits an implementation's forward keeps for its backward
    for host_h, host_v in ((None, None), host):
        for logits in (None,) if kept is None else (None, kept):
            inputs = VocabCrossEntropyBackwardInputs(
                grad_loss, local, _interleave(lse, 0.0), logits, host_h_off=host_h, host_v_off=host_v
            )
            got = cross_entropy.backward_fn(ce_args, inputs)
            _close(
                got,
                [t.grad for t in leaves],
                f"{backend} cross_entropy backward, host offsets {host_h is not None}, logits {logits is not None}",
            )
