"""ragged.vocab_cross_entropy on CPU: against ``F.cross_entropy`` on each sequence's gathered
logits (the per-sequence loop oracle of ``vocab_cases``), every backend that can take CPU
tensors, its options and errors; the projection's own tests are tests/test_vocab.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from vocab_cases import (
    BACKENDS,
    CE,
    FN,
    FP32_TOL,
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
from ragged import RaggedTensor
from ragged.records.vocab import (
    VocabCrossEntropyArgs,
    VocabCrossEntropyBackwardInputs,
    VocabProjectionArgs,
    VocabProjectionBackwardInputs,
)

# --------------------------------------------------------------------------------------
# Cross-entropy against F.cross_entropy on each sequence's gathered logits


def _loop_cross_entropy(values, lens, weight, bias, cands, target, ignore_index, reduction, label_smoothing):
    """F.cross_entropy per sequence on gathered logits, targets mapped to local indices
    (targets outside the candidates count as ignored)."""
    blocks = _loop_blocks(values, lens, weight, bias, cands)
    losses, kept, t = [], 0, 0
    for block, n, c in zip(blocks, lens, cands):
        position = {int(i): j for j, i in enumerate(c.tolist())}
        local = torch.tensor(
            [position.get(int(x), ignore_index) if int(x) != ignore_index else ignore_index for x in target[t : t + n]],
            dtype=torch.int64,
        )
        t += n
        if n == 0:
            continue
        if block.shape[1] == 0:
            losses.append(block.new_zeros(n))
            continue
        losses.append(
            F.cross_entropy(block, local, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
        )
        kept += int((local != ignore_index).sum())
    per_token = torch.cat(losses) if losses else values.new_zeros(0, dtype=torch.float64)
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / kept


@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
@pytest.mark.parametrize("case", ["mixed", "overlap"])
def test_cross_entropy_matches_f_cross_entropy(case, shared, reduction, label_smoothing):
    hidden, weight, bias, vocab, cands, lens = _make(case, _seed(case, "ce"), shared=shared)
    target = _targets(lens, cands, weight.shape[0], _seed(case, "ce-target"))
    kwargs = {"reduction": reduction, "label_smoothing": label_smoothing}

    def ours(h, w, b):
        return ragged.vocab_cross_entropy(hidden.with_values(h), w, vocab, target, b, **kwargs)

    def oracle(h, w, b):
        return _loop_cross_entropy(h, lens, w, b, cands, target, -100, reduction, label_smoothing)

    loss = ours(hidden.values, weight, bias)
    expected = oracle(hidden.values, weight, bias)
    assert loss.dtype == torch.float64 and loss.shape == expected.shape
    torch.testing.assert_close(loss, expected, atol=1e-10, rtol=1e-10)
    if reduction == "none":
        assert torch.all(loss[target == -100] == 0)
    up = _randn(expected.shape, 3)
    leaves = (hidden.values, weight, bias)
    _close(_grads(ours, leaves, up), _grads(oracle, leaves, up), {"atol": 1e-10, "rtol": 1e-10}, "ce")


def test_cross_entropy_shared_vocabulary_is_f_cross_entropy_on_the_batch():
    hidden, weight, bias, vocab, cands, lens = _make("overlap", 21, shared=True)
    target = _targets(lens, cands, weight.shape[0], 22)
    logits = hidden.values @ weight[vocab].T + bias[vocab]
    local = torch.where(target >= 0, torch.searchsorted(vocab, target.clamp_min(0)), -100)
    for reduction in ("mean", "sum", "none"):
        torch.testing.assert_close(
            ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, reduction=reduction, label_smoothing=0.1),
            F.cross_entropy(logits, local, reduction=reduction, label_smoothing=0.1),
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_each_backend(backend):
    hidden, weight, bias, vocab, cands, lens = _make("mixed", 31, torch.float32)
    _skip_if_backend_cannot(backend, hidden, weight, bias, vocab)
    target = _targets(lens, cands, weight.shape[0], 32)

    def ours(h, w, b):
        return ragged.vocab_cross_entropy(
            hidden.with_values(h), w, vocab, target, b, label_smoothing=0.1, backend=backend
        )

    def oracle(h, w, b):
        return _loop_cross_entropy(h, lens, w, b, cands, target, -100, "mean", 0.1)

    leaves = (hidden.values, weight, bias)
    assert ours(*leaves).dtype == torch.float32
    torch.testing.assert_close(ours(*leaves).double(), oracle(*leaves), **FP32_TOL)
    up = torch.tensor(1.0)
    _close(_grads(ours, leaves, up), _grads(oracle, leaves, up), {"atol": 5e-5, "rtol": 5e-5}, backend)


def test_cross_entropy_options():
    hidden, weight, bias, vocab, cands, lens = _make("mixed", 41)
    vocab_size = weight.shape[0]
    # a custom ignore_index, int32 targets and a RaggedTensor target
    target = _targets(lens, cands, vocab_size, 42, ignore_index=-1)
    expected = _loop_cross_entropy(hidden.values, lens, weight, bias, cands, target, -1, "sum", 0.0)
    for tgt in (target, target.to(torch.int32), hidden.with_values(target)):
        got = ragged.vocab_cross_entropy(hidden, weight, vocab, tgt, bias, ignore_index=-1, reduction="sum")
        torch.testing.assert_close(got, expected)
    # out_of_vocab="ignore": targets outside their sequence's candidates count as ignored
    target = _targets(lens, cands, vocab_size, 43, ignored=0.1, outside=0.4)
    got = ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, out_of_vocab="ignore", reduction="none")
    expected = _loop_cross_entropy(hidden.values, lens, weight, bias, cands, target, -100, "none", 0.0)
    torch.testing.assert_close(got, expected)
    assert (got == 0).sum() > (target == -100).sum()
    with pytest.raises(ValueError, match=r"vocab_cross_entropy\(\): expected every target .* out_of_vocab='ignore'"):
        ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias)
    # every token ignored: mean is nan (as F.cross_entropy), sum is 0 and still differentiable
    ignored = torch.full_like(target, -100)
    assert torch.isnan(ragged.vocab_cross_entropy(hidden, weight, vocab, ignored, bias))
    w = weight.clone().requires_grad_(True)
    total = ragged.vocab_cross_entropy(hidden, w, vocab, ignored, bias, reduction="sum")
    total.backward()
    assert total.item() == 0 and torch.all(w.grad == 0)


def test_cross_entropy_batch_without_logits():
    for case in ("no_tokens", "batch0"):
        hidden, weight, bias, vocab, _, lens = _make(case, 51)
        target = torch.zeros(sum(lens), dtype=torch.int64)
        assert ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, reduction="sum").item() == 0
    # tokens whose sequences have no candidates must be ignored
    hidden, weight, bias, _, _, _ = _make("single", 52)
    empty = RaggedTensor.from_lengths(torch.zeros(0, dtype=torch.int64), [0])
    target = torch.full((7,), -100)
    loss = ragged.vocab_cross_entropy(hidden, weight, empty, target, bias, reduction="none")
    assert loss.shape == (7,) and torch.all(loss == 0)


# --------------------------------------------------------------------------------------
# union_vocab


def test_union_vocab():
    _, weight, bias, vocab, cands, _ = _make("overlap", 61)
    hidden, _, _, _, _, _lens = _make("overlap", 62)
    union = ragged.union_vocab(vocab)
    expected = sorted(set(torch.cat(cands).tolist()))
    assert union.tolist() == expected and union.dtype == torch.int64
    assert ragged.union_vocab(vocab.values.to(torch.int32)).dtype == torch.int32
    assert ragged.union_vocab(list(cands)).tolist() == expected
    assert ragged.union_vocab(torch.tensor([5, 1, 5])).tolist() == [1, 5]
    # Marian-style: score every token against the union (a shared vocabulary)
    logits = ragged.vocab_projection(hidden, weight, union, bias)
    full = hidden.values @ weight.T + bias
    torch.testing.assert_close(logits.to_full()[:, union], full[:, union])
    with pytest.raises(TypeError, match=r"union_vocab\(\): expected vocab"):
        ragged.union_vocab([1, 2])
    with pytest.raises(TypeError, match=r"union_vocab\(\): expected vocab of dtype torch.int32 or torch.int64"):
        ragged.union_vocab(torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"union_vocab\(\): expected vocab to be 1-D"):
        ragged.union_vocab(torch.zeros(2, 2, dtype=torch.int64))


# --------------------------------------------------------------------------------------
# ragged.nn.VocabProjection


def test_vocab_projection_module():
    torch.manual_seed(0)
    proj = ragged.nn.VocabProjection(16, 40, dtype=torch.float64)
    assert proj.weight.shape == (40, 16) and proj.bias.shape == (40,)
    assert "in_features=16, num_embeddings=40, bias=True" in repr(proj)
    hidden, _, _, vocab, cands, lens = _make("mixed", 71)
    logits = proj(hidden, vocab)
    torch.testing.assert_close(
        logits.values, _flat(_loop_blocks(hidden.values, lens, proj.weight.detach(), proj.bias.detach(), cands))
    )
    target = _targets(lens, cands, 40, 72)
    loss = proj.loss(hidden, vocab, target, label_smoothing=0.1)
    torch.testing.assert_close(
        loss, ragged.vocab_cross_entropy(hidden, proj.weight, vocab, target, proj.bias, label_smoothing=0.1)
    )
    loss.backward()
    assert proj.weight.grad is not None and proj.bias.grad is not None
    assert ragged.nn.VocabProjection(8, 5, bias=False).bias is None


def test_vocab_projection_ties_a_linear_and_loads_its_state_dict():
    lm_head = torch.nn.Linear(16, 40, dtype=torch.float64)
    proj = ragged.nn.VocabProjection.from_linear(lm_head)
    assert proj.weight is lm_head.weight and proj.bias is lm_head.bias
    assert (proj.in_features, proj.num_embeddings) == (16, 40)
    assert [p for p in proj.parameters()] == [lm_head.weight, lm_head.bias]
    hidden, _, _, vocab, cands, lens = _make("mixed", 81)
    target = _targets(lens, cands, 40, 82)
    proj.loss(hidden, vocab, target).backward()
    assert lm_head.weight.grad is not None and torch.any(lm_head.weight.grad != 0)
    # state_dict: the Linear's keys and shapes
    assert set(proj.state_dict()) == {"weight", "bias"}
    fresh = ragged.nn.VocabProjection(16, 40, dtype=torch.float64)
    fresh.load_state_dict(lm_head.state_dict())
    assert torch.equal(fresh.weight, lm_head.weight) and fresh.weight is not lm_head.weight
    torch.testing.assert_close(fresh(hidden, vocab).values, proj(hidden, vocab).values)
    no_bias = ragged.nn.VocabProjection.from_linear(torch.nn.Linear(16, 40, bias=False))
    assert no_bias.bias is None and set(no_bias.state_dict()) == {"weight"}
    emb = torch.nn.Embedding(40, 16)
    tied = ragged.nn.VocabProjection.from_embedding(emb)
    assert tied.weight is emb.weight and tied.bias is None
    with pytest.raises(TypeError, match="from_linear"):
        ragged.nn.VocabProjection.from_linear(emb)


# --------------------------------------------------------------------------------------
# torch.compile and the torch.library ops


@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph_forward_backward(backend, shared):
    torch._dynamo.reset()
    hidden, weight, bias, vocab, cands, lens = _make("mixed", _seed("compile", backend), torch.float32, shared=shared)
    _skip_if_backend_cannot(backend, hidden, weight, bias, vocab)

    def f(h, w, b, voc):
        logits = ragged.vocab_projection(h, w, voc, b, backend=backend)
        return logits.values * 2, logits.log_softmax().values

    leaves = [t.clone().requires_grad_(True) for t in (hidden.values, weight, bias)]
    out, logp = torch.compile(f, fullgraph=True, backend="aot_eager")(
        hidden.with_values(leaves[0]), leaves[1], leaves[2], vocab
    )
    blocks = _loop_blocks(hidden.values, lens, weight, bias, cands)
    torch.testing.assert_close(out.double(), 2 * _flat(blocks), **FP32_TOL)
    torch.testing.assert_close(logp.double(), _flat([torch.log_softmax(b, 1) for b in blocks]), **FP32_TOL)
    up = _randn(out.shape, 5, torch.float32)
    got = torch.autograd.grad(out, leaves, up)
    ref = _grads(lambda h, w, b: 2 * _flat(_loop_blocks(h, lens, w, b, cands)), [hidden.values, weight, bias], up)
    _close(got, ref, {"atol": 5e-5, "rtol": 5e-5}, "compiled")


@pytest.mark.parametrize("out_of_vocab", ["error", "ignore"])
def test_compile_cross_entropy(out_of_vocab):
    torch._dynamo.reset()
    hidden, weight, bias, vocab, cands, lens = _make("mixed", 91, torch.float32)
    target = _targets(lens, cands, weight.shape[0], 92)

    def f(h, w, b, tgt):
        return ragged.vocab_cross_entropy(h, w, vocab, tgt, b, label_smoothing=0.1, out_of_vocab=out_of_vocab)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    w = weight.clone().requires_grad_(True)
    loss = compiled(hidden, w, bias, target)
    torch.testing.assert_close(loss, f(hidden, weight, bias, target))
    loss.backward()
    w_ref = weight.clone().requires_grad_(True)
    f(hidden, w_ref, bias, target).backward()
    torch.testing.assert_close(w.grad, w_ref.grad)
    if out_of_vocab == "error":  # under compile a device-side assert, not a read
        outside = target.clone()
        outside[0] = int(torch.tensor([i for i in range(40) if i not in cands[0].tolist()])[0])
        with pytest.raises(RuntimeError, match="candidate"):
            compiled(hidden, weight, bias, outside)


def _op_args(case="mixed", shared=False, grad=True):
    hidden, weight, bias, vocab, cands, lens = _make(case, 101, torch.float32, shared=shared)
    ids, v_off = _ids_and_offsets(vocab)
    size = ids.shape[0]
    counts = [n * (size if shared else len(c)) for n, c in zip(lens, cands)]
    l_off = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int64)
    h, w, b = (t.requires_grad_(grad) for t in (hidden.values, weight, bias))
    max_v = size if shared else max(len(c) for c in cands)
    return (h, hidden.offsets, w, b, ids, None if shared else v_off, l_off, sum(counts), max(lens), max_v, "torch")


def _without_target(args: VocabCrossEntropyArgs) -> list:
    """The cross-entropy's operands its backward op takes: all but the target."""
    return [value for name, value in zip(args._fields, args) if name != "target"]


@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
def test_opcheck(shared):
    torch.library.opcheck(torch.ops.ragged.vocab_projection.default, _op_args(shared=shared))
    *operands, backend = _op_args(shared=shared, grad=False)
    args = VocabProjectionArgs(*operands)
    grad = torch.randn(args.total)
    for flags in ((True, True, True), (False, True, False)):
        # the backward op: the operands, then the backward's inputs
        torch.library.opcheck(
            torch.ops.ragged.vocab_projection_backward.default,
            (*args, *VocabProjectionBackwardInputs(grad, *flags, False), backend),
        )


@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
def test_opcheck_cross_entropy(shared):
    """The cross-entropy op and its backward op (global targets, some ignored, some outside
    their candidates), with and without the host offsets of an eager call."""
    hidden, weight, bias, vocab, cands, lens = _make("mixed", 101, torch.float32, shared=shared)  # _op_args' case
    *operands, backend = _op_args(shared=shared)
    target = _targets(lens, cands, weight.shape[0], 103, outside=0.2)
    args = VocabCrossEntropyArgs(*operands, target=target, ignore_index=-100, label_smoothing=0.1)
    torch.library.opcheck(torch.ops.ragged.vocab_cross_entropy.default, (*args, backend))
    loss, lse, local, missing = torch.ops.ragged.vocab_cross_entropy(*args, backend)
    host = (list(hidden.host_offsets()), None if shared else list(vocab.host_offsets()))
    grad = torch.randn(loss.shape[0])
    plain = args._replace(hidden=args.hidden.detach(), weight=args.weight.detach(), bias=args.bias.detach())
    for flags, (host_h, host_v) in (((True, True, True), host), ((False, True, False), (None, None))):
        inputs = VocabCrossEntropyBackwardInputs(grad, local, lse.detach(), None, *flags, False, host_h, host_v)
        # the backward op: the operands it reads (no target), then the backward's inputs
        torch.library.opcheck(
            torch.ops.ragged.vocab_cross_entropy_backward.default,
            (*_without_target(plain), *inputs, backend),
        )


def test_fake_implementations_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        h, w = torch.empty(9, 16), torch.empty(40, 16)
        h_off = torch.empty(4, dtype=torch.int32)
        ids = torch.empty(11, dtype=torch.int64)
        l_off = torch.empty(4, dtype=torch.int64)
        out = torch.ops.ragged.vocab_projection(h, h_off, w, None, ids, h_off, l_off, 37, 5, 6, "torch")
        # the backward ops: the operands they read, then the backward's inputs
        grads = torch.ops.ragged.vocab_projection_backward(
            *VocabProjectionArgs(h, h_off, w, None, ids, h_off, l_off, 37, 5, 6),
            *VocabProjectionBackwardInputs(out, True, False, True, False),
            "torch",
        )
        target = torch.empty(9, dtype=torch.int64)
        ce = torch.ops.ragged.vocab_cross_entropy(
            h.double(), h_off, w.double(), None, ids, None, l_off, 99, 5, 11, target, -100, 0.0, "torch"
        )
        ce_grads = torch.ops.ragged.vocab_cross_entropy_backward(
            *_without_target(VocabCrossEntropyArgs(h, h_off, w, None, ids, h_off, l_off, 37, 5, 6, target, -100, 0.0)),
            *VocabCrossEntropyBackwardInputs(ce[0], ce[2], ce[1], None, False, True, False, False),
            "torch",
        )
    assert out.shape == (37,)
    assert [tuple(g.shape) for g in grads] == [(9, 16), (0,), (40,)]
    assert [(tuple(t.shape), t.dtype) for t in ce] == [
        ((9,), torch.float64),
        ((9,), torch.float64),
        ((9,), torch.int32),
        ((), torch.int64),
    ]
    assert [tuple(g.shape) for g in ce_grads] == [(0,), (40, 16), (0,)]


def test_public_api_under_fake_tensors_uses_the_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode

    hidden, weight, _bias, vocab, _, _lens = _make("mixed", 111, torch.float32)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = RaggedTensor(
            mode.from_tensor(hidden.values), mode.from_tensor(hidden.offsets), hidden.max_len, hidden._host_offsets
        )
        logits = ragged.vocab_projection(
            fake,
            mode.from_tensor(weight),
            RaggedTensor(
                mode.from_tensor(vocab.values), mode.from_tensor(vocab.offsets), vocab.max_len, vocab._host_offsets
            ),
        )
    assert logits.values.shape == (38,)


# --------------------------------------------------------------------------------------
# Bad input: ValueError / TypeError naming the function and the argument


def _raises(exc, fn, *words):
    with pytest.raises(exc) as info:
        fn()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def _good():
    hidden, weight, bias, vocab, cands, lens = _make("mixed", 121, torch.float32)
    return hidden, weight, bias, vocab, _targets(lens, cands, weight.shape[0], 122)


def _vocab(ids, counts, dtype=torch.int64):
    return RaggedTensor.from_lengths(torch.tensor(ids, dtype=dtype), counts)


@pytest.mark.parametrize(
    "bad,words",
    [
        (([[3, 1, 5], [2]], [3, 1]), ("sorted", "3 before 1", "sequence 0")),
        (([[1, 5, 5], [2]], [3, 1]), ("unique", "5 twice", "sequence 0")),
        (([[1, 5], [2, 40]], [2, 2]), ("[0, 40)", "got 40", "sequence 1")),
        (
            ([[-1, 5], [2]], [2, 1]),
            (
                "[0, 40)",
                "got -1",
            ),
        ),
    ],
    ids=["unsorted", "duplicate", "too_large", "negative"],
)
def test_validate_catches_bad_ids(bad, words):
    hidden, weight, bias, _, _ = _good()
    lists, counts = bad
    hidden = RaggedTensor.from_lengths(hidden.values[:5], [3, 2])
    vocab = _vocab([i for ids in lists for i in ids], counts)
    _raises(
        ValueError,
        lambda: ragged.vocab_projection(hidden, weight, vocab, bias, validate=True),
        FN,
        "vocab.values",
        *words,
    )
    target = torch.full((5,), -100)
    _raises(
        ValueError, lambda: ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, validate=True), CE, *words
    )


def test_validate_shared_vocabulary_and_good_input():
    hidden, weight, bias, vocab, _ = _good()
    ragged.vocab_projection(hidden, weight, vocab, bias, validate=True)
    ragged.vocab_projection(hidden, weight, torch.tensor([0, 3, 39]), bias, validate=True)
    _raises(
        ValueError,
        lambda: ragged.vocab_projection(hidden, weight, torch.tensor([0, 3, 3]), validate=True),
        FN,
        "unique",
        "3 twice",
    )
    _raises(
        ValueError, lambda: ragged.vocab_projection(hidden, weight, torch.tensor([4, 3]), validate=True), FN, "sorted"
    )
    # sequences are checked separately: the same id in two sequences and a drop across a boundary are fine
    two = RaggedTensor.from_lengths(hidden.values[:5], [3, 2])
    ragged.vocab_projection(two, weight, _vocab([1, 5, 9, 1, 5], [3, 2]), validate=True)


def test_bad_hidden():
    _, weight, bias, vocab, _ = _good()
    _raises(
        TypeError,
        lambda: ragged.vocab_projection(torch.randn(14, 16), weight, vocab, bias),
        FN,
        "hidden",
        "RaggedTensor",
    )
    _raises(
        TypeError,
        lambda: ragged.vocab_cross_entropy(torch.randn(14, 16), weight, vocab, torch.zeros(14)),
        CE,
        "hidden",
        "RaggedTensor",
    )
    three_d = RaggedTensor.from_lengths(torch.randn(14, 2, 8), [3, 0, 5, 2, 4])
    _raises(ValueError, lambda: ragged.vocab_projection(three_d, weight, vocab), FN, "hidden.values", "[T, d]")
    ints = RaggedTensor.from_lengths(torch.ones(14, 16, dtype=torch.int64), [3, 0, 5, 2, 4])
    _raises(TypeError, lambda: ragged.vocab_projection(ints, weight, vocab), FN, "floating")


def test_bad_weight_and_bias():
    hidden, weight, bias, vocab, _ = _good()
    _raises(
        ValueError,
        lambda: ragged.vocab_projection(hidden, torch.randn(40, 8), vocab),
        FN,
        "weight",
        "[V, 16]",
        "(40, 8)",
    )
    _raises(ValueError, lambda: ragged.vocab_projection(hidden, torch.randn(40), vocab), FN, "weight")
    _raises(TypeError, lambda: ragged.vocab_projection(hidden, weight.numpy(), vocab), FN, "weight", "torch.Tensor")
    _raises(TypeError, lambda: ragged.vocab_projection(hidden, weight.double(), vocab), FN, "weight", "torch.float64")
    _raises(ValueError, lambda: ragged.vocab_projection(hidden, weight.to("meta"), vocab), FN, "weight", "meta")
    _raises(
        ValueError, lambda: ragged.vocab_projection(hidden, weight, vocab, torch.randn(39)), FN, "bias", "[40]", "(39,)"
    )
    _raises(ValueError, lambda: ragged.vocab_projection(hidden, weight, vocab, torch.randn(1, 40)), FN, "bias")
    _raises(TypeError, lambda: ragged.vocab_projection(hidden, weight, vocab, bias.half()), FN, "bias", "torch.float16")
    _raises(
        ValueError,
        lambda: ragged.vocab_cross_entropy(hidden, weight, vocab, torch.zeros(14, dtype=torch.int64), torch.randn(7)),
        CE,
        "bias",
    )


def test_bad_vocab():
    hidden, weight, _bias, vocab, _ = _good()
    short = RaggedTensor.from_lengths(vocab.values[:7], [4, 3])
    _raises(
        ValueError, lambda: ragged.vocab_projection(hidden, weight, short), FN, "vocab", "batch size", "(5)", "got 2"
    )
    for dtype in (torch.float32, torch.int16, torch.uint8):
        bad = RaggedTensor.from_lengths(vocab.values.to(dtype), [4, 3, 0, 1, 6])
        _raises(
            TypeError,
            lambda bad=bad: ragged.vocab_projection(hidden, weight, bad),
            FN,
            "vocab.values",
            "torch.int32 or torch.int64",
            str(dtype),
        )
        _raises(
            TypeError,
            lambda dtype=dtype: ragged.vocab_projection(hidden, weight, torch.arange(4).to(dtype)),
            FN,
            "vocab",
            str(dtype),
        )
    _raises(
        ValueError,
        lambda: ragged.vocab_projection(hidden, weight, torch.zeros(2, 3, dtype=torch.int64)),
        FN,
        "vocab",
        "1-D",
    )
    two_d = RaggedTensor.from_lengths(torch.zeros(14, 1, dtype=torch.int64), [4, 3, 0, 1, 6])
    _raises(ValueError, lambda: ragged.vocab_projection(hidden, weight, two_d), FN, "vocab.values", "1-D")
    _raises(TypeError, lambda: ragged.vocab_projection(hidden, weight, [1, 2, 3]), FN, "vocab")
    _raises(TypeError, lambda: ragged.vocab_projection(hidden, weight, vocab, validate=1), FN, "validate")


def test_bad_target():
    hidden, weight, bias, vocab, target = _good()
    _raises(
        TypeError,
        lambda: ragged.vocab_cross_entropy(hidden, weight, vocab, target.float(), bias),
        CE,
        "target",
        "torch.int64 or torch.int32",
        "torch.float32",
    )
    _raises(
        TypeError,
        lambda: ragged.vocab_cross_entropy(hidden, weight, vocab, target.to(torch.int16), bias),
        CE,
        "target",
        "torch.int16",
    )
    _raises(
        ValueError, lambda: ragged.vocab_cross_entropy(hidden, weight, vocab, target[:-1], bias), CE, "target", "[14]"
    )
    _raises(TypeError, lambda: ragged.vocab_cross_entropy(hidden, weight, vocab, target.tolist(), bias), CE, "target")
    outside = target.clone()
    outside[3] = 0 if 0 not in vocab[2].tolist() else 1  # token 3: sequence 2 (5 tokens, no candidates)
    _raises(
        ValueError,
        lambda: ragged.vocab_cross_entropy(hidden, weight, vocab, outside, bias),
        CE,
        "candidate",
        "token 3 (sequence 2)",
        "out_of_vocab='ignore'",
    )
    mid = target.clone()
    cand0 = set(vocab[0].tolist())
    mid[0] = next(i for i in range(40) if i not in cand0)  # in [0, V) but not a candidate of sequence 0
    _raises(ValueError, lambda: ragged.vocab_cross_entropy(hidden, weight, vocab, mid, bias), CE, "token 0")
    big = target.clone()
    big[0] = 40  # outside the vocabulary altogether
    _raises(ValueError, lambda: ragged.vocab_cross_entropy(hidden, weight, vocab, big, bias), CE, "target 40")


def test_bad_options():
    hidden, weight, bias, vocab, target = _good()

    def call(**kwargs):
        return lambda: ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, **kwargs)

    _raises(ValueError, call(reduction="avg"), CE, "reduction", "'avg'")
    _raises(ValueError, call(reduction=None), CE, "reduction")
    for eps in (-0.1, 1.5, "0.1", float("nan")):
        _raises(ValueError, call(label_smoothing=eps), CE, "label_smoothing")
    _raises(ValueError, call(out_of_vocab="skip"), CE, "out_of_vocab", "'skip'")
    _raises(TypeError, call(ignore_index=-100.0), CE, "ignore_index")
    _raises(ValueError, call(backend="flash"), "backend", "flash")
    _raises(ValueError, lambda: ragged.vocab_projection(hidden, weight, vocab, backend="cuda"), FN, "cuda")


def test_forced_triton_that_cannot_take_the_input():
    hidden, weight, _bias, vocab, _ = _good()
    h64 = hidden.double()
    reasons = ragged.explain(
        "vocab_projection", h64.values, h64.offsets, weight.double(), None, vocab.values, vocab.offsets
    )
    assert reasons["torch"] == [] and reasons["triton"]
    _raises(
        ValueError,
        lambda: ragged.vocab_projection(h64, weight.double(), vocab, backend="triton"),
        FN,
        "triton",
        "cannot take",
    )
    with ragged.use_backend("triton"):
        _raises(
            ValueError,
            lambda: ragged.vocab_cross_entropy(h64, weight.double(), vocab, torch.full((14,), -100)),
            CE,
            "triton",
        )


def test_missing_kernel_module_is_a_reason_not_an_import_error():
    """Without ragged.kernels.triton.vocab, ``import ragged`` works, explain gives the reason,
    auto takes the reference and a forced "triton" says why it cannot run."""
    code = textwrap.dedent("""
        import sys
        sys.modules["ragged.kernels.triton.vocab"] = None   # the import now raises ImportError
        import torch, ragged
        from ragged import RaggedTensor
        h = RaggedTensor.from_lengths(torch.randn(5, 8), [2, 3])
        w = torch.randn(10, 8)
        vocab = RaggedTensor.from_lengths(torch.tensor([1, 4, 0, 2, 9]), [2, 3])
        reasons = ragged.explain("vocab_projection", h.values, h.offsets, w, None, vocab.values, vocab.offsets)
        assert reasons["torch"] == [] and any("vocab kernels are unavailable" in r for r in reasons["triton"])
        assert ragged.vocab_projection(h, w, vocab).values.shape == (13,)
        try:
            ragged.vocab_projection(h, w, vocab, backend="triton")
        except ValueError as exc:
            assert "unavailable" in str(exc)
        else:
            raise AssertionError("a forced triton backend ran without its kernels")
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
def test_compile_cross_entropy_each_backend(backend, shared):
    """The traced path (custom ops) of every backend, forward and backward, against eager."""
    torch._dynamo.reset()
    hidden, weight, bias, vocab, cands, lens = _make("mixed", 95, torch.float32, shared=shared)
    _skip_if_backend_cannot(backend, hidden, weight, bias, vocab)
    target = _targets(lens, cands, weight.shape[0], 96)

    def f(h, w, b):
        return ragged.vocab_cross_entropy(
            hidden.with_values(h), w, vocab, target, b, label_smoothing=0.1, out_of_vocab="ignore", backend=backend
        )

    leaves = [t.clone().requires_grad_(True) for t in (hidden.values, weight, bias)]
    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves)
    loss.backward()
    ref_leaves = [t.clone().requires_grad_(True) for t in (hidden.values, weight, bias)]
    ref = f(*ref_leaves)
    ref.backward()
    torch.testing.assert_close(loss, ref, **FP32_TOL)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, **FP32_TOL)
