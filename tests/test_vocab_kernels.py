"""Triton vocabulary-projection kernels (ragged.kernels.triton.vocab, .vocab_cross_entropy)
against float64 loops.

The projection forward/backward and the fused subset cross-entropy are checked at the
kernel level here (small sizes: the interpreter runs them on CPU); the public API is
tested in test_vocab.py.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, TRITON_ON_CPU

from ragged.records.vocab import (
    VocabCrossEntropyArgs,
    VocabCrossEntropyBackwardInputs,
    VocabProjectionArgs,
    VocabProjectionBackwardInputs,
)

pytestmark = pytest.mark.skipif(not (TRITON_ON_CPU or HAS_CUDA), reason="needs the Triton interpreter or a GPU")

kv = pytest.importorskip("ragged.kernels.triton.vocab")
kce = pytest.importorskip("ragged.kernels.triton.vocab_cross_entropy")
DEVICE = "cuda" if HAS_CUDA and not TRITON_ON_CPU else "cpu"
V, D = 60, 24
CASES = {
    "mixed": ([3, 0, 5, 1], [4, 7, 1, 0]),  # a sequence with no tokens, one with no candidates, one with 1
    "two": ([9, 2], [6, 33]),
}


def _case(name, shared, seed):
    gen = torch.Generator().manual_seed(seed)
    t_lens, v_lens = CASES[name]
    batch = len(t_lens)
    if shared:
        lists = [torch.randperm(V, generator=gen)[:7].sort().values] * batch
        ids, v_off, v_lens = lists[0], None, [7] * batch
    else:  # overlapping candidate lists across sequences
        lists = [torch.randperm(V, generator=gen)[:n].sort().values for n in v_lens]
        ids, v_off = torch.cat(lists), [0, *itertools.accumulate(v_lens)]
    h_off = [0, *itertools.accumulate(t_lens)]
    l_off = [0, *itertools.accumulate(t * v for t, v in zip(t_lens, v_lens))]
    hidden = torch.randn(h_off[-1], D, generator=gen)
    weight = torch.randn(V, D, generator=gen)
    bias = torch.randn(V, generator=gen)
    return dict(
        t_lens=t_lens,
        v_lens=v_lens,
        lists=lists,
        ids=ids,
        v_off=v_off,
        h_off=h_off,
        l_off=l_off,
        hidden=hidden,
        weight=weight,
        bias=bias,
        gen=gen,
    )


def _i32(x):
    return None if x is None else torch.tensor(x, dtype=torch.int32, device=DEVICE)


def _dev(c):
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in c.items()}


def _loop_logits(h, w, b, c):
    blocks = []
    for i, ids in enumerate(c["lists"]):
        hb = h[c["h_off"][i] : c["h_off"][i + 1]]
        blocks.append((hb @ w[ids].T + b[ids]).reshape(-1))
    return torch.cat(blocks)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("deterministic", [False, True])
def test_projection_forward_backward(shared, name, deterministic):
    c = _case(name, shared, seed=hash((shared, name)) % 1000)
    d = _dev(c)
    l_off = torch.tensor(c["l_off"], device=DEVICE)
    args = VocabProjectionArgs(
        d["hidden"],
        _i32(c["h_off"]),
        d["weight"],
        d["bias"],
        d["ids"],
        _i32(c["v_off"]),
        l_off,
        c["l_off"][-1],
        max(c["t_lens"]),
        max(c["v_lens"]),
    )
    out = kv.forward(args).logits
    h64, w64, b64 = (t.double().requires_grad_(True) for t in (c["hidden"], c["weight"], c["bias"]))
    ref = _loop_logits(h64, w64, b64, c)
    torch.testing.assert_close(out.cpu().double(), ref.detach(), rtol=1e-5, atol=1e-5)
    grad = torch.randn(ref.shape, generator=c["gen"])
    ref.backward(grad.double())
    dh, dw, db = kv.backward(args, VocabProjectionBackwardInputs(grad.to(DEVICE), deterministic=deterministic))
    for got, want in ((dh, h64.grad), (dw, w64.grad), (db, b64.grad)):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk,use_host", [(kce.CE_CHUNK, True), (20, True), (kce.CE_CHUNK, False)])
def test_fused_cross_entropy(shared, smoothing, chunk, use_host):
    c = _case("mixed", shared, seed=7 + int(shared))
    d = _dev(c)
    ignore = -100
    targets, local_t = [], []
    for b, (t_len, v_len) in enumerate(zip(c["t_lens"], c["v_lens"])):
        for _ in range(t_len):  # some tokens without a target (ignore_index)
            keep = v_len and torch.rand((), generator=c["gen"]) > 0.2
            k = int(torch.randint(0, v_len, (), generator=c["gen"])) if keep else -1
            local_t.append(k)
            targets.append(int(c["lists"][b][k]) if keep else ignore)
    target = torch.tensor(targets)
    l_off = torch.tensor(c["l_off"], device=DEVICE)
    total, max_t, max_v = c["l_off"][-1], max(c["t_lens"]), max(c["v_lens"])
    args = VocabCrossEntropyArgs(
        d["hidden"],
        _i32(c["h_off"]),
        d["weight"],
        d["bias"],
        d["ids"],
        _i32(c["v_off"]),
        l_off,
        total,
        max_t,
        max_v,
        target.to(DEVICE),
        ignore,
        smoothing,
    )
    loss, lse, local, missing = kce.forward(args)
    assert missing.item() == 0 and local.cpu().tolist() == local_t
    h64, w64, b64 = (t.double().requires_grad_(True) for t in (c["hidden"], c["weight"], c["bias"]))
    losses = []
    for b, ids in enumerate(c["lists"]):
        z = h64[c["h_off"][b] : c["h_off"][b + 1]] @ w64[ids].T + b64[ids]
        for t in range(z.shape[0]):
            y = local_t[c["h_off"][b] + t]
            losses.append(
                F.cross_entropy(z[t : t + 1], torch.tensor([y]), label_smoothing=smoothing) if y >= 0 else h64.sum() * 0
            )
    ref = torch.stack(losses)
    torch.testing.assert_close(loss.cpu().double(), ref.detach(), rtol=1e-5, atol=1e-5)
    grad_loss = torch.randn(len(targets), generator=c["gen"])
    (ref * grad_loss.double()).sum().backward()
    host = (c["h_off"], c["v_off"]) if use_host else (None, None)
    inputs = VocabCrossEntropyBackwardInputs(grad_loss.to(DEVICE), local, lse, host_h_off=host[0], host_v_off=host[1])
    dh, dw, db = kce.backward(args, inputs, chunk_elems=chunk)
    for got_g, want in ((dh, h64.grad), (dw, w64.grad), (db, b64.grad)):
        torch.testing.assert_close(got_g.cpu().double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shared", [False, True])
def test_fused_cross_entropy_locates_global_targets(shared):
    """Global target ids are found by the kernel's binary search: local index, -1 for
    ignore_index and for ids outside the candidates, and the count of the latter; the losses
    equal those of the same call with the latter ignored."""
    c = _case("mixed", shared, seed=11 + int(shared))
    d = _dev(c)
    ignore = -7
    global_t, local_t = [], []
    for b, (t_len, ids) in enumerate(zip(c["t_lens"], c["lists"])):
        ids = torch.as_tensor(ids, dtype=torch.int64)
        members = set(ids.tolist())
        for _ in range(t_len):
            r = float(torch.rand((), generator=c["gen"]))
            if len(ids) and r < 0.6:
                k = int(torch.randint(0, len(ids), (), generator=c["gen"]))
                global_t.append(int(ids[k]))
                local_t.append(k)
            elif r < 0.8:
                global_t.append(ignore)
                local_t.append(-1)
            else:  # an id that is not a candidate (or out of range)
                cand = int(torch.randint(-3, c["weight"].shape[0] + 3, (), generator=c["gen"]))
                while cand in members or cand == ignore:
                    cand += 1
                global_t.append(cand)
                local_t.append(-2)
    want_local = torch.tensor([max(x, -1) for x in local_t], dtype=torch.int32)
    bad_tokens = [i for i, x in enumerate(local_t) if x == -2]
    l_off = torch.tensor(c["l_off"], device=DEVICE)
    args = VocabCrossEntropyArgs(
        d["hidden"],
        _i32(c["h_off"]),
        d["weight"],
        d["bias"],
        d["ids"],
        _i32(c["v_off"]),
        l_off,
        c["l_off"][-1],
        max(c["t_lens"]),
        max(c["v_lens"]),
        torch.tensor(global_t, device=DEVICE),
        ignore,
        0.1,
    )
    loss, lse, local, missing = kce.forward(args)
    assert torch.equal(local.cpu(), want_local)
    assert missing.item() == len(bad_tokens)
    # the same losses with the local targets given as candidates' ids and the rest ignored
    lists = c["lists"]
    again = [
        int(lists[b][k]) if k >= 0 else ignore
        for b, (t0, t1) in enumerate(zip(c["h_off"][:-1], c["h_off"][1:]))
        for k in want_local[t0:t1].tolist()
    ]
    loss2, lse2, local2, missing2 = kce.forward(args._replace(target=torch.tensor(again, device=DEVICE)))
    assert torch.equal(local2.cpu(), want_local) and missing2.item() == 0
    torch.testing.assert_close(loss.cpu(), loss2.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(lse.cpu(), lse2.cpu(), rtol=0, atol=0)
