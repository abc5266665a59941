"""ragged.vocab_projection / RaggedLogits / ragged.vocab_cross_entropy / ragged.nn.VocabProjection on CPU.

The oracle is a per-sequence loop written here without ragged: ``hidden_b @ W[ids_b].T +
bias[ids_b]`` in float64, and ``F.cross_entropy`` on each sequence's gathered logits with
the target mapped to its position in the sequence's candidates. The reference
(``ragged.reference_vocab_projection`` and its written-out backward) is checked against
the oracle, and every backend that can take CPU tensors (the Triton kernels run
through the interpreter, see ``conftest.py``; their tests skip while
``ragged.explain`` says Triton cannot take the input) against both.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vocab_cases import (
    BACKENDS,
    CASES,
    FP32_TOL,
    NEG_INF,
    _close,
    _flat,
    _grads,
    _ids_and_offsets,
    _loop_blocks,
    _make,
    _randn,
    _seed,
    _skip_if_backend_cannot,
    _targets,
)

import ragged
from ragged import RaggedLogits, RaggedTensor


@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_loop(case, with_bias, shared):
    hidden, weight, bias, vocab, cands, lens = _make(case, _seed(case, "ref"), bias=with_bias, shared=shared)
    ids, v_off = _ids_and_offsets(vocab)
    expected = _flat(_loop_blocks(hidden.values, lens, weight, bias, cands))
    out = ragged.reference_vocab_projection(hidden.values, hidden.offsets, weight, bias, ids, v_off)
    assert out.dtype == torch.float64 and out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    # float32 in, float32 out
    out32 = ragged.reference_vocab_projection(
        hidden.values.float(),
        hidden.offsets,
        weight.float(),
        None if bias is None else bias.float(),
        ids.to(torch.int32),
        v_off,
    )
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), expected, **FP32_TOL)
    # the written-out backward and autograd through the reference, against the loop
    up = _randn(expected.shape, _seed(case, "ref-up"))
    leaves = (hidden.values, weight, bias)
    ref = _grads(lambda h, w, b: _flat(_loop_blocks(h, lens, w, b, cands)), leaves, up)
    auto = _grads(lambda h, w, b: ragged.reference_vocab_projection(h, hidden.offsets, w, b, ids, v_off), leaves, up)
    _close(auto, ref, {"atol": 1e-10, "rtol": 1e-10}, "autograd")
    written = ragged.reference_vocab_projection_backward(
        up, hidden.values, hidden.offsets, weight, ids, v_off, True, True, with_bias
    )
    _close(written, ref, {"atol": 1e-10, "rtol": 1e-10}, "written-out")


def test_reference_backward_returns_only_what_is_asked():
    hidden, weight, _, vocab, _, _ = _make("mixed", 1)
    grad = torch.ones(sum(t * v for t, v in zip(*CASES["mixed"][:2])), dtype=torch.float64)
    for flags in ((True, False, False), (False, True, False), (False, False, True)):
        out = ragged.reference_vocab_projection_backward(
            grad, hidden.values, hidden.offsets, weight, vocab.values, vocab.offsets, *flags
        )
        assert [g is not None for g in out] == list(flags)
    dh, dw, db = ragged.reference_vocab_projection_backward(
        grad, hidden.values, hidden.offsets, weight, vocab.values, vocab.offsets
    )
    assert dh.shape == hidden.values.shape and dw.shape == weight.shape and db.shape == (weight.shape[0],)


# --------------------------------------------------------------------------------------
# Public API on each backend: forward and backward against the loop


@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
@pytest.mark.parametrize("case", ["mixed", "overlap", "odd_dim", "no_tokens", "batch0"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_projection_forward_backward(backend, case, shared):
    dtype = torch.float64 if backend == "torch" else torch.float32
    tol = {"atol": 1e-10, "rtol": 1e-10} if dtype == torch.float64 else {"atol": 5e-5, "rtol": 5e-5}
    hidden, weight, bias, vocab, cands, lens = _make(case, _seed(case, backend, shared), dtype, shared=shared)
    _skip_if_backend_cannot(backend, hidden, weight, bias, vocab)
    logits = ragged.vocab_projection(hidden, weight, vocab, bias, backend=backend)
    expected = _flat(_loop_blocks(hidden.values, lens, weight, bias, cands))
    assert isinstance(logits, RaggedLogits)
    assert logits.values.dtype == dtype and logits.values.shape == expected.shape
    torch.testing.assert_close(logits.values.double(), expected, **tol)
    assert logits.shared == shared and logits.num_embeddings == weight.shape[0]
    expected_l_off = [0]
    for n, c in zip(lens, cands):
        expected_l_off.append(expected_l_off[-1] + n * len(c))
    assert logits.logit_offsets.dtype == torch.int64 and logits.logit_offsets.tolist() == expected_l_off
    up = _randn(expected.shape, _seed(case, backend, "up"))
    leaves = (hidden.values, weight, bias)
    got = _grads(
        lambda h, w, b: ragged.vocab_projection(hidden.with_values(h), w, vocab, b, backend=backend).values, leaves, up
    )
    ref = _grads(lambda h, w, b: _flat(_loop_blocks(h, lens, w, b, cands)), leaves, up)
    _close(got, ref, tol, backend)
    # rows of ids that no sequence lists get no gradient
    listed = torch.zeros(weight.shape[0], dtype=torch.bool)
    for c in cands:
        listed[c] = True
    assert torch.all(got[1][~listed] == 0) and torch.all(got[2][~listed] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlapping_candidates_sum_weight_gradients(backend):
    """Three sequences listing the same ids: d_weight[id] is the sum of their contributions."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    lens, dim = [3, 4, 2], 16
    cands = [torch.tensor([1, 4, 6]), torch.tensor([0, 1, 4, 6, 7]), torch.tensor([4])]
    hidden = RaggedTensor.from_lengths(_randn((sum(lens), dim), 5, dtype), lens)
    weight, bias = _randn((8, dim), 6, dtype), _randn((8,), 7, dtype)
    vocab = RaggedTensor.from_lengths(torch.cat(cands), [3, 5, 1])
    _skip_if_backend_cannot(backend, hidden, weight, bias, vocab)
    w = weight.clone().requires_grad_(True)
    b = bias.clone().requires_grad_(True)
    ragged.vocab_projection(hidden, w, vocab, b, backend=backend).values.sum().backward()
    per_seq = []
    for h, c in zip(hidden.unbind(), cands):
        dw = torch.zeros_like(weight)
        dw[c] = h.sum(0).expand(len(c), dim)  # d(sum of logits)/dW[id] = sum of the sequence's tokens
        per_seq.append(dw)
    torch.testing.assert_close(w.grad, sum(per_seq), **FP32_TOL)
    counts = torch.zeros(8, dtype=dtype)
    for n, c in zip(lens, cands):
        counts[c] += n
    torch.testing.assert_close(b.grad, counts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_low_precision_dtypes(backend):
    # bfloat16 Triton is left to the GPU: the interpreter's bfloat16 dots are not exact
    dtypes = (torch.float16,) if backend == "triton" else (torch.bfloat16, torch.float16)
    for dtype in dtypes:
        hidden, weight, bias, vocab, cands, lens = _make("mixed", _seed("lowp", dtype), dtype)
        _skip_if_backend_cannot(backend, hidden, weight, bias, vocab)
        logits = ragged.vocab_projection(hidden, weight, vocab, bias, backend=backend)
        assert logits.values.dtype == dtype
        expected = _flat(_loop_blocks(hidden.values, lens, weight, bias, cands))
        torch.testing.assert_close(logits.values.double(), expected, atol=0.1, rtol=0.02)


@pytest.mark.skipif("triton" not in BACKENDS, reason="the Triton kernels need TRITON_INTERPRET=1 on CPU")
def test_triton_deterministic_backward():
    hidden, weight, bias, vocab, cands, lens = _make("overlap", 11, torch.float32)
    _skip_if_backend_cannot("triton", hidden, weight, bias, vocab)
    up = _randn((sum(t * len(c) for t, c in zip(lens, cands)),), 12, torch.float32)
    leaves = (hidden.values, weight, bias)
    ref = _grads(lambda h, w, b: _flat(_loop_blocks(h, lens, w, b, cands)), leaves, up)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        got = _grads(
            lambda h, w, b: ragged.vocab_projection(hidden.with_values(h), w, vocab, b, backend="triton").values,
            leaves,
            up,
        )
    finally:
        torch.use_deterministic_algorithms(previous)
    _close(got, ref, {"atol": 5e-5, "rtol": 5e-5}, "deterministic")


def test_auto_takes_the_reference_on_cpu_and_int32_everything():
    hidden, weight, bias, vocab, cands, lens = _make("mixed", 3, id_dtype=torch.int32)
    hidden = RaggedTensor.from_offsets(hidden.values, hidden.offsets.to(torch.int64))
    vocab = RaggedTensor(vocab.values, vocab.offsets.to(torch.int32), vocab.max_len, vocab._host_offsets)
    logits = ragged.vocab_projection(hidden, weight, vocab, bias)
    torch.testing.assert_close(logits.values, _flat(_loop_blocks(hidden.values, lens, weight, bias, cands)))


def test_host_offsets_are_read_only_when_missing():
    """Host offsets size the output: read once (and cached) when a RaggedTensor lacks them;
    a shared vocabulary needs none."""
    hidden, weight, bias, vocab, cands, lens = _make("mixed", 4)
    bare_h = RaggedTensor(hidden.values, hidden.offsets, hidden.max_len)
    bare_v = RaggedTensor(vocab.values, vocab.offsets, vocab.max_len)
    shared = ragged.vocab_projection(bare_h, weight, cands[0], bias)
    assert bare_h._host_offsets is None and shared.values.shape == (sum(lens) * len(cands[0]),)
    logits = ragged.vocab_projection(bare_h, weight, bare_v, bias)
    assert bare_h._host_offsets == hidden.host_offsets() and bare_v._host_offsets == vocab.host_offsets()
    torch.testing.assert_close(logits.values, _flat(_loop_blocks(hidden.values, lens, weight, bias, cands)))


@settings(max_examples=15, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 9)), min_size=0, max_size=5),
    vocab_size=st.integers(1, 20),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_batches_reference(seqs, vocab_size, with_bias, seed):
    lens = [t for t, _ in seqs]
    counts = [min(v, vocab_size) for _, v in seqs]
    hidden, weight, bias, vocab, cands, _ = _make((lens, counts, vocab_size, 8), seed, bias=with_bias)
    logits = ragged.vocab_projection(hidden, weight, vocab, bias, validate=True)
    blocks = _loop_blocks(hidden.values, lens, weight, bias, cands)
    torch.testing.assert_close(logits.values, _flat(blocks))
    for got, block in zip(logits.unbind(), blocks):
        torch.testing.assert_close(got, block)
    full = hidden.values @ weight.T + (0 if bias is None else bias)
    _check_decoding(logits, full, lens, cands)


# --------------------------------------------------------------------------------------
# RaggedLogits


def _restricted_full(full, lens, cands):
    """The full projection with -inf outside each token's candidates."""
    out = torch.full_like(full, NEG_INF)
    t = 0
    for n, c in zip(lens, cands):
        out[t : t + n, c] = full[t : t + n, c]
        t += n
    return out


def _check_decoding(logits, full, lens, cands):
    masked = _restricted_full(full, lens, cands)
    has = torch.tensor([len(c) > 0 for n, c in zip(lens, cands) for _ in range(n)], dtype=torch.bool)
    expected = torch.where(has, masked.argmax(1), -1) if full.shape[0] else torch.zeros(0, dtype=torch.int64)
    assert torch.equal(logits.argmax(), expected)
    for k in (1, 3, 12):
        scores, ids = logits.topk(k)
        assert scores.shape == (full.shape[0], k) and ids.shape == (full.shape[0], k)
        ref_scores, ref_ids = torch.topk(masked, min(k, full.shape[1]), dim=1)
        real = ref_scores > NEG_INF
        width = ref_scores.shape[1]
        torch.testing.assert_close(scores[:, :width], ref_scores)
        assert torch.equal(ids[:, :width], torch.where(real, ref_ids, -1))
        assert torch.all(scores[:, width:] == NEG_INF) and torch.all(ids[:, width:] == -1)


@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
@pytest.mark.parametrize("case", ["mixed", "overlap", "no_tokens", "batch0"])
def test_argmax_topk_are_the_full_projection_restricted(case, shared):
    hidden, weight, bias, vocab, cands, lens = _make(case, _seed(case, "dec"), shared=shared)
    logits = ragged.vocab_projection(hidden, weight, vocab, bias)
    full = hidden.values @ weight.T + bias
    _check_decoding(logits, full, lens, cands)


def test_argmax_ties_and_nan():
    hidden = RaggedTensor.from_lengths(torch.zeros(3, 2), [2, 1])
    weight = torch.zeros(6, 2)
    vocab = RaggedTensor.from_lengths(torch.tensor([1, 3, 4, 0, 5]), [3, 2])
    logits = ragged.vocab_projection(hidden, weight, vocab)
    assert logits.argmax().tolist() == [1, 1, 0]  # ties: the smallest id, as torch.argmax
    values = logits.values.clone()
    values[4] = float("nan")  # token 1, candidate 1 (id 3)
    assert logits.with_values(values).argmax().tolist() == [1, 3, 0]


@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
@pytest.mark.parametrize("case", ["mixed", "overlap", "batch0"])
def test_log_softmax_softmax_logsumexp(case, shared):
    hidden, weight, bias, vocab, cands, lens = _make(case, _seed(case, "lsm"), shared=shared)
    values = hidden.values.clone().requires_grad_(True)
    logits = ragged.vocab_projection(hidden.with_values(values), weight, vocab, bias)
    logp = logits.log_softmax()
    assert isinstance(logp, RaggedLogits) and logp.values.shape == logits.values.shape
    blocks = _loop_blocks(hidden.values, lens, weight, bias, cands)
    torch.testing.assert_close(logp.values, _flat([torch.log_softmax(b, dim=1) for b in blocks]))
    torch.testing.assert_close(logits.softmax().values, _flat([torch.softmax(b, dim=1) for b in blocks]))
    # rows sum to one (tokens with candidates); their exp through the padded form
    probs = logp.to_padded().exp().sum(-1)  # [B, max T, ]
    for b, (n, c) in enumerate(zip(lens, cands)):
        if len(c):
            torch.testing.assert_close(probs[b, :n], torch.ones(n, dtype=torch.float64))
    lse = logits.logsumexp()
    expected = (
        torch.cat(
            [
                torch.logsumexp(b, 1) if b.shape[1] else torch.full((b.shape[0],), NEG_INF, dtype=torch.float64)
                for b in blocks
            ]
        )
        if blocks
        else torch.zeros(0, dtype=torch.float64)
    )
    torch.testing.assert_close(lse, expected)
    if logits.numel():  # gradients flow through the normalisation
        up = _randn(logp.values.shape, 9)
        (g,) = torch.autograd.grad(logp.values, values, up)
        ref = _grads(
            lambda h: _flat([torch.log_softmax(b, 1) for b in _loop_blocks(h, lens, weight, bias, cands)]),
            [hidden.values],
            up,
        )[0]
        torch.testing.assert_close(g, ref)


def test_log_softmax_keeps_low_precision_dtype():
    hidden, weight, bias, vocab, _, _ = _make("mixed", 8, torch.bfloat16)
    logp = ragged.vocab_projection(hidden, weight, vocab, bias).log_softmax()
    assert logp.values.dtype == torch.bfloat16


@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
@pytest.mark.parametrize("case", ["mixed", "single", "no_tokens", "batch0"])
def test_to_padded_and_to_full(case, shared):
    hidden, weight, bias, vocab, cands, lens = _make(case, _seed(case, "dense"), shared=shared)
    values = hidden.values.clone().requires_grad_(True)
    logits = ragged.vocab_projection(hidden.with_values(values), weight, vocab, bias)
    blocks = _loop_blocks(hidden.values, lens, weight, bias, cands)
    max_t = max(lens, default=0)
    max_v = vocab.shape[0] if shared else max((len(c) for c in cands), default=0)
    padded = logits.to_padded()
    assert padded.shape == (len(lens), max_t, max_v)
    expected = torch.full((len(lens), max_t, max_v), NEG_INF, dtype=torch.float64)
    for b, block in enumerate(blocks):
        expected[b, : block.shape[0], : block.shape[1]] = block
    # float64 logits from the kernel and from the per-sequence loop may differ in the last bit
    # (another summation order); the padding must be exactly -inf / exactly the fill value
    torch.testing.assert_close(padded, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(padded == NEG_INF, expected == NEG_INF)
    torch.testing.assert_close(
        logits.to_padded(0.0), torch.where(expected == NEG_INF, 0.0, expected), rtol=1e-12, atol=1e-12
    )
    assert torch.equal(logits.to_padded(0.0) == 0, torch.where(expected == NEG_INF, 0.0, expected) == 0)
    full = logits.to_full()
    assert full.shape == (sum(lens), weight.shape[0])
    expected_full = _restricted_full(hidden.values @ weight.T + bias, lens, cands)
    torch.testing.assert_close(full, expected_full)
    assert torch.equal(full == NEG_INF, expected_full == NEG_INF)
    if logits.numel():
        (g,) = torch.autograd.grad(full.masked_fill(full == NEG_INF, 0).sum() + padded.clamp_min(0).sum(), values)
        assert g.shape == values.shape


def test_with_values_repr_unbind_detach():
    hidden, weight, bias, vocab, cands, lens = _make("mixed", 10)
    logits = ragged.vocab_projection(hidden, weight, vocab, bias)
    other = logits.with_values(logits.values * 2)
    assert other.logit_offsets is logits.logit_offsets and torch.equal(other.values, logits.values * 2)
    with pytest.raises(ValueError, match=r"with_values\(\): expected values of shape \[38\]"):
        logits.with_values(logits.values[:-1])
    text = repr(logits)
    assert "RaggedLogits(batch_size=5" in text and "candidates=[4, 3, 0, 1, 6]" in text and "numel=38" in text
    assert "shared_candidates=6" in repr(ragged.vocab_projection(hidden, weight, cands[-1], bias))
    views = logits.unbind()
    assert [tuple(v.shape) for v in views] == [(n, len(c)) for n, c in zip(lens, cands)]
    assert not logits.detach().requires_grad
    assert logits.candidate_lengths.tolist() == [len(c) for c in cands]
    with pytest.raises(ValueError, match="topk"):
        logits.topk(-1)


@pytest.fixture
def no_host_reads(monkeypatch):
    """Within ``with no_host_reads():`` any Python-level read of a tensor value raises."""
    import contextlib

    def boom(*_, **__):
        raise AssertionError("a tensor value was read on the host")

    @contextlib.contextmanager
    def guard():
        with monkeypatch.context() as m:
            for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
                m.setattr(torch.Tensor, name, boom)
            yield

    return guard


@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
def test_logits_methods_read_nothing_back(no_host_reads, shared):
    hidden, weight, bias, vocab, cands, lens = _make("mixed", 14, torch.float32, shared=shared)
    logits = ragged.vocab_projection(hidden, weight, vocab, bias)
    target = _targets(lens, cands, weight.shape[0], 15, outside=0.2)
    # host ids are range-checked on the host on purpose (no wait there); CUDA ids are not
    # read on the hot path (tests/test_gpu_vocab.py::test_no_host_sync)
    layout = ragged.ops.vocab_checks.prepare("f", hidden, weight, vocab, bias, False)
    with no_host_reads():
        logits.argmax(), logits.topk(3), logits.topk(9), logits.to_padded(), logits.to_full()
        logits.log_softmax().softmax(), logits.logsumexp(), repr(logits)
        local, missing = ragged.ops.vocab_reference.locate_targets(
            target, layout.h_off, layout.ids, layout.v_off, weight.shape[0], -100
        )
    assert local.shape == target.shape and missing.shape == ()


def test_ragged_logits_cross_the_compile_boundary():
    torch._dynamo.reset()
    hidden, weight, bias, vocab, _, _ = _make("mixed", 13, torch.float32)
    logits = ragged.vocab_projection(hidden, weight, vocab, bias)
    out = torch.compile(lambda lg: lg.with_values(lg.values * 3), fullgraph=True, backend="aot_eager")(logits)
    assert isinstance(out, RaggedLogits) and torch.equal(out.values, logits.values * 3)
    assert torch.equal(out.argmax(), logits.argmax())
