"""Regressions of the vocabulary ops (ragged.vocab_projection, ragged.vocab_cross_entropy
and their implementations on every backend), apart from strided inputs
(tests/test_vocab_strided.py):

1. double backward (an unrelated ``out=`` error, or a silent missing term);
2. candidate ids outside ``[0, V)`` (a raw IndexError, or reads outside ``weight``);
3. unsorted candidate ids in the cross-entropy (a misleading "outside" error, a silent NaN);
4. the fused cross-entropy kernel's ``0 * inf`` (a RuntimeWarning under the interpreter).

The oracle is a float64 per-sequence loop (``vocab_regression_cases``). Sizes are small: the
Triton kernels run through the interpreter on CPU. The GPU variants are in
tests/test_gpu_vocab.py.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from vocab_cases import _flat, _loop_blocks
from vocab_regression_cases import (
    BACKENDS,
    CE,
    COUNTS,
    FN,
    LENS,
    TOL,
    D,
    V,
    _candidates,
    _close,
    _gen,
    _grad,
    _loop_cross_entropy,
    _offsets,
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
# 1. Double backward: a clear error naming the function, on both the eager path and the
# torch.library op path (taken under a dispatch mode, as under tensor subclasses)


class _RecordOps(TorchDispatchMode):
    """Runs every op unchanged and records its name: an active mode sends the public
    functions through their torch.library ops."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def _double_backward_case(seed):
    g = _gen("double", seed)
    cands = _candidates(COUNTS, seed)
    hidden = RaggedTensor.from_lengths(torch.randn(sum(LENS), D, generator=g), LENS)
    weight, bias = torch.randn(V, D, generator=g), torch.randn(V, generator=g)
    vocab = RaggedTensor.from_lengths(torch.cat(cands), COUNTS)
    return hidden, weight, bias, vocab, cands, _targets(LENS, cands, seed)


@pytest.mark.parametrize("what", ["projection", "cross_entropy"])
@pytest.mark.parametrize("path", ["eager", "op"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_double_backward_raises_naming_the_function(backend, path, what):
    hidden, weight, bias, vocab, cands, target = _double_backward_case(6)

    def f(h, w, b):
        if what == "projection":
            return ragged.vocab_projection(hidden.with_values(h), w, vocab, b, backend=backend).values.square().sum()
        return ragged.vocab_cross_entropy(
            hidden.with_values(h), w, vocab, target, b, label_smoothing=0.1, backend=backend
        )

    def oracle(h, w, b):
        if what == "projection":
            return _flat(_loop_blocks(h, LENS, w, b, cands)).square().sum()
        return _loop_cross_entropy(h, LENS, w, b, cands, target, 0.1)

    mode = _RecordOps() if path == "op" else contextlib.nullcontext()
    leaves = [t.clone().requires_grad_(True) for t in (hidden.values, weight, bias)]
    with mode:
        grads = torch.autograd.grad(f(*leaves), leaves, create_graph=True)
    if path == "op":
        op = f"ragged.vocab_{what}.default"
        assert op in mode.names, sorted(mode.names)
    # the first-order gradients under create_graph=True are still right
    _close(grads, _grad(oracle, (hidden.values, weight, bias))[1], f"{backend} {path}")
    assert all(gr.requires_grad for gr in grads)
    name = CE if what == "cross_entropy" else FN
    with mode, pytest.raises(NotImplementedError, match="double backward") as info:
        sum(gr.square().sum() for gr in grads).backward()
    assert name in str(info.value)


@pytest.mark.parametrize("path", ["eager", "op"])
def test_gradgradcheck_raises_naming_the_function(path):
    hidden, weight, bias, vocab, cands, target = _double_backward_case(7)
    leaves = [t.double().requires_grad_(True) for t in (hidden.values, weight, bias)]
    mode = _RecordOps() if path == "op" else contextlib.nullcontext()

    def proj(h, w, b):
        return ragged.vocab_projection(hidden.with_values(h), w, vocab, b, backend="torch").values

    def loss(h, w, b):
        return ragged.vocab_cross_entropy(hidden.with_values(h), w, vocab, target, b, backend="torch")

    for f, name in ((proj, FN), (loss, CE)):
        with mode, pytest.raises(NotImplementedError, match="double backward") as info:
            torch.autograd.gradgradcheck(f, leaves)
        assert name in str(info.value)


# --------------------------------------------------------------------------------------
# 2. Candidate ids outside [0, V)


def _bad_id_case(shared, bad_id, seed):
    g = _gen("bad", seed)
    hidden = RaggedTensor.from_lengths(torch.randn(sum(LENS), D, generator=g), LENS)
    weight, bias = torch.randn(V, D, generator=g), torch.randn(V, generator=g)
    cands = _candidates(COUNTS, seed, shared)
    if shared:
        vocab = torch.cat([cands[0][:-1], torch.tensor([bad_id])]).sort().values
        name = "vocab"
    else:
        lists = [c.clone() for c in cands]
        lists[3] = torch.cat([lists[3][:-1], torch.tensor([bad_id])]).sort().values  # sequence 3
        vocab = RaggedTensor.from_lengths(torch.cat(lists), COUNTS)
        name = "vocab.values"
    return hidden, weight, bias, vocab, name


@pytest.mark.parametrize("bad_id", [V, V + 7, -1], ids=["V", "past_V", "negative"])
@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_ids_raise_value_error(backend, shared, bad_id):
    hidden, weight, bias, vocab, name = _bad_id_case(shared, bad_id, 8)
    target = torch.full((sum(LENS),), -100)
    words = (f"expected {name} in [0, {V})", f"got {bad_id}")
    for fn, call in (
        (FN, lambda: ragged.vocab_projection(hidden, weight, vocab, bias, backend=backend)),
        (CE, lambda: ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, backend=backend)),
        (
            CE,
            lambda: ragged.vocab_cross_entropy(
                hidden, weight, vocab, target, bias, backend=backend, out_of_vocab="ignore"
            ),
        ),
    ):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert message.startswith(fn[:-2] + "(): ") and all(w in message for w in words), message
        if not shared:
            assert "of sequence 3" in message


def _contract_oracle(weight, bias, ids_lists):
    """The kernels' contract for an id outside [0, V): its weight row and bias read as 0 and
    its gradient goes nowhere. Oracle: a zero row V appended, outside ids mapped to it."""
    w = torch.cat([weight, weight.new_zeros(1, weight.shape[1])])
    b = torch.cat([bias, bias.new_zeros(1)])
    mapped = [torch.where((c >= 0) & (c < weight.shape[0]), c, weight.shape[0]) for c in ids_lists]
    return w, b, mapped


@pytest.mark.skipif("triton" not in BACKENDS, reason="the Triton kernels need TRITON_INTERPRET=1 on CPU")
@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
def test_triton_kernels_never_follow_an_id_outside_the_vocabulary(shared):
    """Launchers called with ids past both ends of ``weight``: ``weight`` / ``bias`` are views
    into larger buffers whose other rows hold data (an unmasked read shows up in the
    numbers, not as a crash) and the gradients are summed into views of larger zeroed
    buffers (an unmasked write shows up in their spare rows)."""
    kv = pytest.importorskip("ragged.kernels.triton.vocab")
    kce = pytest.importorskip("ragged.kernels.triton.vocab_cross_entropy")
    g = _gen("oob", shared)
    w_buf, b_buf = torch.randn(V + 6, D, generator=g), torch.randn(V + 6, generator=g)
    weight, bias = w_buf[3 : 3 + V], b_buf[3 : 3 + V]
    hidden = torch.randn(sum(LENS), D, generator=g)
    cands = _candidates(COUNTS, 9, shared)
    # sorted lists with an id below 0 first and one past V last (sequences without candidates stay empty)
    lists = [torch.cat([torch.tensor([-2]), c, torch.tensor([V + 1])]) if len(c) else c for c in cands]
    sizes = [len(c) for c in lists]
    ids = lists[0] if shared else torch.cat(lists)
    h_off, v_off = _offsets(LENS), None if shared else _offsets(sizes)
    l_off = _offsets([t * v for t, v in zip(LENS, sizes)], torch.int64)
    total, max_t, max_v = int(l_off[-1]), max(LENS), max(sizes)
    w_ext, b_ext, mapped = _contract_oracle(weight, bias, lists)
    args = VocabProjectionArgs(hidden, h_off, weight, bias, ids, v_off, l_off, total, max_t, max_v)
    out = kv.forward(args).logits
    torch.testing.assert_close(out.double(), _flat(_loop_blocks(hidden, LENS, w_ext, b_ext, mapped)), **TOL)
    grad = torch.randn(total, generator=g)
    leaves = [t.double().requires_grad_(True) for t in (hidden, w_ext, b_ext)]
    _flat(_loop_blocks(leaves[0], LENS, leaves[1], leaves[2], mapped)).backward(grad.double())
    for deterministic in (False, True):
        dw_buf, db_buf = torch.zeros(V + 6, D), torch.zeros(V + 6)
        dh, _, _ = kv.backward(
            args,
            VocabProjectionBackwardInputs(grad, deterministic=deterministic),
            dw_out=dw_buf[3 : 3 + V],
            db_out=db_buf[3 : 3 + V],
        )
        _close(
            (dh, dw_buf[3 : 3 + V], db_buf[3 : 3 + V]),
            (leaves[0].grad, leaves[1].grad[:V], leaves[2].grad[:V]),
            f"deterministic={deterministic}",
        )
        assert torch.all(dw_buf[:3] == 0) and torch.all(dw_buf[3 + V :] == 0)
        assert torch.all(db_buf[:3] == 0) and torch.all(db_buf[3 + V :] == 0)
    # the fused cross-entropy: the outside ids score 0 as in the projection, and the targets
    # are found by the binary search past them
    target, want_local = [], []
    for n, c in zip(LENS, lists):
        for k in range(n):
            j = 1 + k % (len(c) - 2) if len(c) else -1
            target.append(int(c[j]) if j >= 0 else -100)
            want_local.append(j)
    target, want_local = torch.tensor(target), torch.tensor(want_local, dtype=torch.int32)
    ce_args = VocabCrossEntropyArgs(*args, target=target, ignore_index=-100, label_smoothing=0.0)
    loss, lse, local, missing = kce.forward(ce_args)
    assert torch.equal(local, want_local) and missing.item() == 0
    leaves = [t.double().requires_grad_(True) for t in (hidden, w_ext, b_ext)]
    per_token, t = [], 0
    for block, n, c in zip(_loop_blocks(leaves[0], LENS, leaves[1], leaves[2], mapped), LENS, lists):
        y = want_local[t : t + n].to(torch.int64)
        t += n
        if n:
            per_token.append(
                F.cross_entropy(block, y, ignore_index=-1, reduction="none") if len(c) else block.new_zeros(n)
            )
    want = torch.cat(per_token)
    torch.testing.assert_close(loss.double(), want.detach(), **TOL)
    grad_loss = torch.randn(sum(LENS), generator=g)
    (want * grad_loss.double()).sum().backward()
    got = kce.backward(ce_args, VocabCrossEntropyBackwardInputs(grad_loss, local, lse))
    _close(got, (leaves[0].grad, leaves[1].grad[:V], leaves[2].grad[:V]), "cross_entropy_backward")


# --------------------------------------------------------------------------------------
# 3. Unsorted candidate ids in the cross-entropy


def _unsorted_case(shared, seed):
    g = _gen("unsorted", seed)
    hidden = RaggedTensor.from_lengths(torch.randn(sum(LENS), D, generator=g), LENS)
    weight, bias = torch.randn(V, D, generator=g), torch.randn(V, generator=g)
    cands = _candidates(COUNTS, seed, shared)
    target = _targets(LENS, cands, seed)
    if shared:
        vocab, name = cands[0].flip(0), "vocab"
    else:
        vocab, name = RaggedTensor.from_lengths(torch.cat([c.flip(0) for c in cands]), COUNTS), "vocab.values"
    return hidden, weight, bias, vocab, target, name


@pytest.mark.parametrize("out_of_vocab", ["error", "ignore"])
@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_unsorted_ids_in_cross_entropy_say_so(backend, shared, out_of_vocab):
    """Host ids: the order is checked with the range (no wait on the host), so unsorted ids
    raise a ValueError saying so instead of reporting targets "outside" their candidates
    (error) or a silent NaN (ignore)."""
    hidden, weight, bias, vocab, target, name = _unsorted_case(shared, 10)
    with pytest.raises(ValueError) as info:
        ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, out_of_vocab=out_of_vocab, backend=backend)
    message = str(info.value)
    assert message.startswith(CE[:-2]) and f"expected {name} sorted" in message, message
    # the projection itself does not need sorted ids
    logits = ragged.vocab_projection(hidden, weight, vocab, bias, backend=backend)
    assert torch.isfinite(logits.values).all()


@pytest.mark.parametrize("problem", ["unsorted", "out_of_range"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_unchecked_ids_are_checked_in_the_out_of_vocab_read(monkeypatch, backend, problem):
    """Ids left unchecked by the argument checks (CUDA ids on the hot path, simulated here)
    are checked in the one read out_of_vocab="error" makes anyway: no extra read."""
    import ragged.ops.vocab_checks as checks

    # as for CUDA ids with host offsets: checking them in the argument checks would wait
    monkeypatch.setattr(checks, "id_check_is_free", lambda ids, read_offsets: read_offsets)
    if problem == "unsorted":
        hidden, weight, bias, vocab, target, name = _unsorted_case(False, 11)
        words = [f"expected {name} sorted"]
    else:
        hidden, weight, bias, vocab, name = _bad_id_case(False, V + 2, 11)
        target = torch.full((sum(LENS),), -100)
        words = [f"expected {name} in [0, {V})", "of sequence 3"]
    with pytest.raises(ValueError) as info:
        ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, backend=backend)
    assert all(w in str(info.value) for w in words), str(info.value)
    # one read when the ids are fine (the flag of out_of_vocab="error"), with the checks in it
    hidden, weight, bias, vocab, cands, target = _double_backward_case(12)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.numel()) or tolist(t))
    loss = ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, backend=backend)
    monkeypatch.undo()
    torch.testing.assert_close(
        loss.double(), _loop_cross_entropy(hidden.values, LENS, weight, bias, cands, target), **TOL
    )
    if backend == "triton":  # the torch backend also reads the offsets for its per-sequence loop
        assert len(reads) == 1, reads


# --------------------------------------------------------------------------------------
# 4. The fused cross-entropy kernel computes no 0 * inf


@pytest.mark.skipif("triton" not in BACKENDS, reason="the Triton kernels need TRITON_INTERPRET=1 on CPU")
@pytest.mark.parametrize("label_smoothing", [0.0, 1.0])
def test_fused_cross_entropy_has_no_invalid_value_warning(label_smoothing):
    """A sequence with tokens but no candidates has lse = -inf; with eps = 0 (or 1) the old
    kernel multiplied it by 0 (a RuntimeWarning, then masked)."""
    g = _gen("warn", label_smoothing)
    lens, counts = [2, 3, 1, 0], [4, 0, 2, 3]
    cands = [torch.randperm(V, generator=g)[:n].sort().values for n in counts]
    hidden = RaggedTensor.from_lengths(torch.randn(sum(lens), D, generator=g), lens)
    weight, bias = torch.randn(V, D, generator=g), torch.randn(V, generator=g)
    vocab = RaggedTensor.from_lengths(torch.cat(cands), counts)
    target = _targets(lens, cands, 13)

    def ours(h, w, b):
        return ragged.vocab_cross_entropy(
            hidden.with_values(h), w, vocab, target, b, label_smoothing=label_smoothing, backend="triton"
        )

    def oracle(h, w, b):
        total, kept, t = h.sum() * 0, 0, 0
        for block, n, c in zip(_loop_blocks(h, lens, w, b, cands), lens, cands):
            y = target[t : t + n]
            t += n
            if n and len(c):
                local = torch.searchsorted(c, y)
                total = total + F.cross_entropy(block, local, reduction="sum", label_smoothing=label_smoothing)
                kept += n
        return total / kept

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out, grads = _grad(ours, (hidden.values, weight, bias))
    want, want_grads = _grad(oracle, (hidden.values, weight, bias))
    torch.testing.assert_close(out.double(), want, **TOL)
    _close(grads, want_grads, f"eps={label_smoothing}")
