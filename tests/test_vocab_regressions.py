"""Regressions of the vocabulary ops (ragged.vocab_projection, ragged.vocab_cross_entropy,
ragged.union_vocab, RaggedLogits and the implementations of the two ops on every backend).

1. strided offsets, ids, targets and bias (Triton read them as if contiguous);
2. double backward (an unrelated ``out=`` error, or a silent missing term);
3. candidate ids outside ``[0, V)`` (a raw IndexError, or reads outside ``weight``);
4. unsorted candidate ids in the cross-entropy (a misleading "outside" error, a silent NaN);
5. the fused cross-entropy kernel's ``0 * inf`` (a RuntimeWarning under the interpreter).

The oracle is a float64 per-sequence loop written here (``hidden_b @ W[ids_b].T + b[ids_b]``
and ``F.cross_entropy`` on each sequence's block). Sizes are small: the Triton kernels run
through the interpreter on CPU. The GPU variants are in tests/test_gpu_vocab.py.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
import zlib

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_backends
from torch.utils._python_dispatch import TorchDispatchMode

import ragged
from ragged import RaggedLogits, RaggedTensor

BACKENDS = cpu_backends()
FN, CE = "ragged.vocab_projection()", "ragged.vocab_cross_entropy()"
TOL = {"atol": 5e-5, "rtol": 5e-5}
LENS, COUNTS, V, D = [3, 0, 5, 1, 2], [4, 2, 0, 3, 5], 13, 8   # 0 tokens, 0 candidates, 1 token


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def _gen(*parts):
    return torch.Generator().manual_seed(_seed(*parts))


def _offsets(lengths, dtype=torch.int32):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=dtype)


def _interleave(t: torch.Tensor, pad) -> torch.Tensor:
    """``t`` as a view of stride 2 into a buffer whose other entries are ``pad`` (a value that
    stays in bounds when read as if contiguous, so the old code gave wrong numbers, not a crash)."""
    buf = torch.full((2 * t.shape[0], *t.shape[1:]), pad, dtype=t.dtype)
    buf[::2] = t
    out = buf[::2]
    assert not out.is_contiguous() or t.shape[0] <= 1
    return out


def _candidates(counts, seed, shared=False):
    g = _gen("cands", seed)
    if shared:
        ids = torch.randperm(V, generator=g)[:5].sort().values
        return [ids] * len(counts)
    return [torch.randperm(V, generator=g)[:n].sort().values for n in counts]


def _loop_blocks(values, lens, weight, bias, cands):
    """float64 ``[T_b, V_b]`` blocks (differentiable)."""
    blocks, t = [], 0
    for n, c in zip(lens, cands):
        block = values[t:t + n].double() @ weight[c].double().T
        if bias is not None:
            block = block + bias[c].double()
        blocks.append(block)
        t += n
    return blocks


def _flat(blocks):
    return torch.cat([b.reshape(-1) for b in blocks])


def _loop_cross_entropy(values, lens, weight, bias, cands, target, label_smoothing=0.0, ignore_index=-100):
    """Mean of F.cross_entropy over each sequence's gathered logits (targets mapped to local indices)."""
    total, kept, t = values.sum() * 0, 0, 0
    for block, n, c in zip(_loop_blocks(values, lens, weight, bias, cands), lens, cands):
        position = {int(i): j for j, i in enumerate(c.tolist())}
        local = torch.tensor([position.get(int(x), ignore_index) for x in target[t:t + n]], dtype=torch.int64)
        t += n
        if n and len(c) and (local != ignore_index).any():
            total = total + F.cross_entropy(block, local, ignore_index=ignore_index, reduction="sum",
                                            label_smoothing=label_smoothing)
            kept += int((local != ignore_index).sum())
    return total / kept


def _targets(lens, cands, seed):
    g = _gen("targets", seed)
    out = []
    for n, c in zip(lens, cands):
        for _ in range(n):
            out.append(int(c[torch.randint(len(c), (), generator=g)]) if len(c) else -100)
    return torch.tensor(out, dtype=torch.int64)


def _grad(fn, leaves, up=None):
    """Gradients of ``<fn(*leaves), up>`` with respect to fresh copies of ``leaves``."""
    fresh = [t.detach().clone().requires_grad_(True) for t in leaves]
    out = fn(*fresh)
    return out.detach(), torch.autograd.grad(out, fresh, None if up is None else up.to(out.dtype))


def _close(got, want, what):
    for k, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a.double(), b.double(), **TOL, msg=lambda m, k=k: f"{what} [{k}]: {m}")


# --------------------------------------------------------------------------------------
# 1. Strided inputs


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
            vocab = RaggedTensor(_interleave(torch.cat(cands).to(torch.int32), 0), _interleave(v_off, 0),
                                 max(COUNTS), tuple(v_off.tolist()) if host else None)
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
    plain = ragged.vocab_projection(RaggedTensor.from_lengths(hidden.values.contiguous(), LENS),
                                    weight.contiguous(), plain_vocab, bias.contiguous(), backend=backend)
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
    by_hand = RaggedLogits(_interleave(plain.values, 0.0), _interleave(plain.offsets, 0), plain.num_tokens,
                           plain.max_len, _interleave(plain.ids, 0),
                           None if plain.shared else _interleave(plain.vocab_offsets, 0), plain.max_candidates,
                           _interleave(plain.logit_offsets, 0), plain.num_embeddings)
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
        return ragged.vocab_cross_entropy(hidden, weight, vocab, _interleave(target, 0), bias, label_smoothing=0.1,
                                          backend=backend)

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
    hidden, weight, bias = (torch.randn(sum(LENS), D, generator=g), torch.randn(V, D, generator=g),
                            torch.randn(V, generator=g))
    sizes = [len(c) for c in cands]
    l_off = _offsets([t * v for t, v in zip(LENS, sizes)], torch.int64)
    total, max_t, max_v = int(l_off[-1]), max(LENS), max(sizes)
    ids = cands[0] if shared else torch.cat(cands)
    v_off = None if shared else _interleave(_offsets(COUNTS), 0)
    args = (_interleave(_offsets(LENS), 0), weight, _interleave(bias, 0.0), _interleave(ids, 0), v_off,
            _interleave(l_off, 0))
    h_off, _, b_s, ids_s, v_s, l_s = args
    out = projection.forward_fn(hidden, *args, total, max_t, max_v)
    want = _flat(_loop_blocks(hidden, LENS, weight, bias, cands))
    torch.testing.assert_close(out.double(), want, **TOL)
    grad = torch.randn(total, generator=g)
    leaves = [t.double().requires_grad_(True) for t in (hidden, weight, bias)]
    _flat(_loop_blocks(*leaves[:1], LENS, *leaves[1:], cands)).backward(grad.double())
    for deterministic in (False, True):
        got = projection.backward_fn(grad, hidden, h_off, weight, ids_s, v_s, l_s, max_t, max_v, True, True, True,
                                     deterministic)
        _close(got, [t.grad for t in leaves], f"{backend} backward deterministic={deterministic}")
    target = _targets(LENS, cands, 5)
    forward = cross_entropy.forward_fn(hidden, h_off, weight, b_s, ids_s, v_s, l_s, total, max_t, max_v,
                                       _interleave(target, 0), -100, 0.1)
    loss, lse, local, missing = forward
    assert missing.item() == 0 and local.dtype == torch.int32
    per_token = []
    t = 0
    for block, n, c in zip(_loop_blocks(hidden, LENS, weight, bias, cands), LENS, cands):
        y = target[t:t + n]
        t += n
        if n:
            local_y = torch.where(y >= 0, torch.searchsorted(c, y.clamp_min(0)), -100)
            per_token.append(F.cross_entropy(block, local_y, reduction="none", label_smoothing=0.1)
                             if len(c) else block.new_zeros(n))
    torch.testing.assert_close(loss.double(), torch.cat(per_token), **TOL)
    grad_loss = _interleave(torch.randn(sum(LENS), generator=g), 0.0)
    host = (list(_offsets(LENS).tolist()), None if shared else list(_offsets(COUNTS).tolist()))
    leaves = [t.double().requires_grad_(True) for t in (hidden, weight, bias)]
    per_token, t = [], 0
    for block, n, c in zip(_loop_blocks(leaves[0], LENS, leaves[1], leaves[2], cands), LENS, cands):
        y = target[t:t + n]
        t += n
        if n and len(c):
            local_y = torch.where(y >= 0, torch.searchsorted(c, y.clamp_min(0)), -100)
            per_token.append(F.cross_entropy(block, local_y, reduction="none", label_smoothing=0.1))
        elif n:
            per_token.append(block.new_zeros(n))
    (torch.cat(per_token) * grad_loss.double()).sum().backward()
    kept = getattr(forward, "logits", None)   # the logits an implementation's forward keeps for its backward
    for host_h, host_v in ((None, None), host):
        for logits in (None,) if kept is None else (None, kept):
            got = cross_entropy.backward_fn(grad_loss, hidden, h_off, weight, b_s, ids_s, v_s, l_s, total, local,
                                            _interleave(lse, 0.0), logits, 0.1, max_t, max_v, True, True, True, False,
                                            host_h, host_v)
            _close(got, [t.grad for t in leaves], f"{backend} cross_entropy backward, host offsets "
                                                   f"{host_h is not None}, logits {logits is not None}")


# --------------------------------------------------------------------------------------
# 2. Double backward: a clear error naming the function, on both the eager path and the
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
        return ragged.vocab_cross_entropy(hidden.with_values(h), w, vocab, target, b, label_smoothing=0.1,
                                          backend=backend)

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
# 3. Candidate ids outside [0, V)


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
        lists[3] = torch.cat([lists[3][:-1], torch.tensor([bad_id])]).sort().values   # sequence 3
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
    for fn, call in ((FN, lambda: ragged.vocab_projection(hidden, weight, vocab, bias, backend=backend)),
                     (CE, lambda: ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, backend=backend)),
                     (CE, lambda: ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, backend=backend,
                                                             out_of_vocab="ignore"))):
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
    weight, bias = w_buf[3:3 + V], b_buf[3:3 + V]
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
    out = kv.forward(hidden, h_off, weight, bias, ids, v_off, l_off, total, max_t, max_v)
    torch.testing.assert_close(out.double(), _flat(_loop_blocks(hidden, LENS, w_ext, b_ext, mapped)), **TOL)
    grad = torch.randn(total, generator=g)
    leaves = [t.double().requires_grad_(True) for t in (hidden, w_ext, b_ext)]
    _flat(_loop_blocks(leaves[0], LENS, leaves[1], leaves[2], mapped)).backward(grad.double())
    for deterministic in (False, True):
        dw_buf, db_buf = torch.zeros(V + 6, D), torch.zeros(V + 6)
        dh, _, _ = kv.backward(grad, hidden, h_off, weight, ids, v_off, l_off, max_t, max_v, True, True, True,
                               deterministic, dw_out=dw_buf[3:3 + V], db_out=db_buf[3:3 + V])
        _close((dh, dw_buf[3:3 + V], db_buf[3:3 + V]), (leaves[0].grad, leaves[1].grad[:V], leaves[2].grad[:V]),
               f"deterministic={deterministic}")
        assert torch.all(dw_buf[:3] == 0) and torch.all(dw_buf[3 + V:] == 0)
        assert torch.all(db_buf[:3] == 0) and torch.all(db_buf[3 + V:] == 0)
    # the fused cross-entropy: the outside ids score 0 as in the projection, and the targets
    # are found by the binary search past them
    target, want_local = [], []
    for n, c in zip(LENS, lists):
        for k in range(n):
            j = 1 + k % (len(c) - 2) if len(c) else -1
            target.append(int(c[j]) if j >= 0 else -100)
            want_local.append(j)
    target, want_local = torch.tensor(target), torch.tensor(want_local, dtype=torch.int32)
    loss, lse, local, missing = kce.forward(hidden, h_off, weight, bias, ids, v_off, l_off, total, max_t, max_v, target,
                                        -100, 0.0)
    assert torch.equal(local, want_local) and missing.item() == 0
    leaves = [t.double().requires_grad_(True) for t in (hidden, w_ext, b_ext)]
    per_token, t = [], 0
    for block, n, c in zip(_loop_blocks(leaves[0], LENS, leaves[1], leaves[2], mapped), LENS, lists):
        y = want_local[t:t + n].to(torch.int64)
        t += n
        if n:
            per_token.append(F.cross_entropy(block, y, ignore_index=-1, reduction="none") if len(c)
                             else block.new_zeros(n))
    want = torch.cat(per_token)
    torch.testing.assert_close(loss.double(), want.detach(), **TOL)
    grad_loss = torch.randn(sum(LENS), generator=g)
    (want * grad_loss.double()).sum().backward()
    got = kce.backward(grad_loss, hidden, h_off, weight, bias, ids, v_off, l_off, total, local, lse, None, 0.0,
                       max_t, max_v, True, True, True, False, None, None)
    _close(got, (leaves[0].grad, leaves[1].grad[:V], leaves[2].grad[:V]), "cross_entropy_backward")


# --------------------------------------------------------------------------------------
# 4. Unsorted candidate ids in the cross-entropy


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
    torch.testing.assert_close(loss.double(), _loop_cross_entropy(hidden.values, LENS, weight, bias, cands, target),
                               **TOL)
    if backend == "triton":   # the torch backend also reads the offsets for its per-sequence loop
        assert len(reads) == 1, reads


# --------------------------------------------------------------------------------------
# 5. The fused cross-entropy kernel computes no 0 * inf


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
        return ragged.vocab_cross_entropy(hidden.with_values(h), w, vocab, target, b, label_smoothing=label_smoothing,
                                          backend="triton")

    def oracle(h, w, b):
        total, kept, t = h.sum() * 0, 0, 0
        for block, n, c in zip(_loop_blocks(h, lens, w, b, cands), lens, cands):
            y = target[t:t + n]
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
