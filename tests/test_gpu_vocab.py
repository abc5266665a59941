"""Varying-vocabulary projection and cross-entropy on the GPU (``pytest -m gpu``).

Every backend against float64 loops, with flash-attn's error rule: the kernel's error is
at most twice the error of the same computation done by torch in the input's precision
(plus a small atol).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import ragged
from ragged import RaggedTensor

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-4}


def _batch(seed, dtype, shared=False, lens=(17, 0, 64, 1, 33), counts=(300, 7, 1, 0, 129), vocab_size=5000, dim=256):
    gen = torch.Generator().manual_seed(seed)
    hidden = RaggedTensor.from_lengths(torch.randn(sum(lens), dim, generator=gen).to("cuda", dtype), list(lens))
    weight = (torch.randn(vocab_size, dim, generator=gen) / dim**0.5).to("cuda", dtype)
    bias = torch.randn(vocab_size, generator=gen).to("cuda", dtype)
    if shared:
        ids = torch.randperm(vocab_size, generator=gen)[:200].sort().values
        cands, vocab = [ids] * len(lens), ids.cuda()
    else:  # overlapping lists: every sequence draws from the same small range
        cands = [torch.randperm(vocab_size // 4, generator=gen)[:n].sort().values for n in counts]
        vocab = RaggedTensor.from_lengths(torch.cat(cands).cuda(), list(counts))
    return hidden, weight, bias, vocab, cands, list(lens)


def _loop(values, lens, weight, bias, cands, dtype):
    out, t = [], 0
    for n, c in zip(lens, cands):
        c = c.cuda()
        block = values[t : t + n].to(dtype) @ weight[c].to(dtype).T + bias[c].to(dtype)
        out.append(block.reshape(-1))
        t += n
    return torch.cat(out)


def _backends(hidden, weight, bias, vocab):
    ids, v_off = (vocab.values, vocab.offsets) if isinstance(vocab, RaggedTensor) else (vocab, None)
    reasons = ragged.explain("vocab_projection", hidden.values, hidden.offsets, weight, bias, ids, v_off)
    return [name for name, why in reasons.items() if not why]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
def test_projection_every_backend(dtype, shared):
    hidden, weight, bias, vocab, cands, lens = _batch(1, dtype, shared)
    ref64 = _loop(hidden.values, lens, weight, bias, cands, torch.float64)
    low = _loop(hidden.values, lens, weight, bias, cands, dtype).double()
    bound = 2 * (low - ref64).abs().max().item() + ATOL[dtype]
    for backend in _backends(hidden, weight, bias, vocab):
        got = ragged.vocab_projection(hidden, weight, vocab, bias, backend=backend).values
        assert got.dtype == dtype
        err = (got.double() - ref64).abs().max().item()
        assert err <= bound, (backend, err, bound)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_projection_gradients(dtype, deterministic):
    hidden, weight, bias, vocab, cands, lens = _batch(2, dtype)
    g = torch.randn(sum(n * len(c) for n, c in zip(lens, cands)), device="cuda", dtype=dtype)

    def grads(fn, leaves):
        leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
        torch.autograd.backward(fn(*leaves), g.to(fn(*leaves).dtype))
        return [t.grad.double() for t in leaves]

    leaves = (hidden.values, weight, bias)
    ref = grads(lambda h, w, b: _loop(h, lens, w, b, cands, torch.float64), leaves)
    low = grads(lambda h, w, b: _loop(h, lens, w, b, cands, dtype), leaves)
    for backend in _backends(hidden, weight, bias, vocab):
        prior = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        try:
            got = grads(
                lambda h, w, b: ragged.vocab_projection(hidden.with_values(h), w, vocab, b, backend=backend).values,
                leaves,
            )
        finally:
            torch.use_deterministic_algorithms(prior)
        for name, a, r, lo in zip(("hidden", "weight", "bias"), got, ref, low):
            # twice the error of the same loop in the low precision, plus the rounding of each
            # element to the output dtype (a gradient summed over many tokens can be large)
            bound = 2 * (lo - r).abs().max().item() + 10 * ATOL[dtype] + torch.finfo(dtype).eps * r.abs()
            assert ((a - r).abs() <= bound).all(), (backend, name, (a - r).abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_every_backend(dtype, smoothing):
    hidden, weight, bias, vocab, cands, lens = _batch(3, dtype)
    gen = torch.Generator().manual_seed(4)
    target = []
    for n, c in zip(lens, cands):
        target += [int(c[torch.randint(0, len(c), (), generator=gen)]) if len(c) else -100 for _ in range(n)]
    target = torch.tensor(target, device="cuda")

    def oracle(h, w, b):
        losses, t = [], 0
        for n, c in zip(lens, cands):
            c = c.cuda()
            z = h[t : t + n].double() @ w[c].double().T + b[c].double()
            y = target[t : t + n]
            local = torch.where(y >= 0, torch.searchsorted(c, y.clamp_min(0)), -100)
            if n and len(c):
                losses.append(F.cross_entropy(z, local, reduction="sum", label_smoothing=smoothing))
            t += n
        return torch.stack(losses).sum() / (target >= 0).sum()

    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden.values, weight, bias)]
    ref = oracle(*leaves)
    ref.backward()
    for backend in _backends(hidden, weight, bias, vocab):
        mine = [t.detach().clone().requires_grad_(True) for t in (hidden.values, weight, bias)]
        loss = ragged.vocab_cross_entropy(
            hidden.with_values(mine[0]), mine[1], vocab, target, mine[2], label_smoothing=smoothing, backend=backend
        )
        loss.backward()
        tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype]
        assert abs(loss.double().item() - ref.item()) <= tol * max(1.0, abs(ref.item())), backend
        for a, r in zip(mine, leaves):
            assert (a.grad.double() - r.grad).abs().max().item() <= tol, backend


def test_fused_cross_entropy_memory_at_the_benchmark_size():
    """Peak extra memory of the fused loss (forward + backward, gradients excluded) <= 10% of the full logits."""
    gen = torch.Generator().manual_seed(5)
    batch, dim, vocab_size = 64, 1024, 32000
    lens = torch.randint(16, 65, (batch,), generator=gen).tolist()
    counts = torch.randint(500, 2001, (batch,), generator=gen).tolist()
    cands = [torch.randperm(vocab_size, generator=gen)[:n].sort().values for n in counts]
    hidden = RaggedTensor.from_lengths(torch.randn(sum(lens), dim, device="cuda", dtype=torch.bfloat16), lens)
    hidden.values.requires_grad_(True)
    weight = torch.randn(vocab_size, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    vocab = RaggedTensor.from_lengths(torch.cat(cands).cuda(), counts)
    target = torch.cat([c[torch.randint(0, len(c), (n,), generator=gen)] for n, c in zip(lens, cands)]).cuda()
    if "triton" not in _backends(hidden, weight, None, vocab):
        pytest.skip("triton cannot run here")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = ragged.vocab_cross_entropy(hidden, weight, vocab, target, out_of_vocab="ignore", backend="triton")
    loss.backward()
    torch.cuda.synchronize()
    # the gradients (which become .grad without a copy) are outputs, not extra memory
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (weight, hidden.values))
    extra = torch.cuda.max_memory_allocated() - before - grads
    full_logits = sum(lens) * vocab_size * 2
    assert extra <= 0.10 * full_logits, (extra, full_logits)


def test_no_host_sync():
    hidden, weight, bias, vocab, cands, lens = _batch(6, torch.bfloat16)
    hidden.values.requires_grad_(True)
    weight.requires_grad_(True)
    # each token's target among its candidates (0 for a sequence without candidates: ignored)
    target = torch.cat(
        [c[:n].repeat(n + 1)[:n] if len(c) else torch.zeros(n, dtype=torch.int64) for n, c in zip(lens, cands)]
    ).cuda()
    # the torch backend is the reference (a host loop over the sequences, which reads the
    # offsets); the kernels must not read the device
    for backend in [b for b in _backends(hidden, weight, bias, vocab) if b != "torch"]:
        ragged.vocab_projection(hidden, weight, vocab, bias, backend=backend)  # warm up
        ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, out_of_vocab="ignore", backend=backend)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = ragged.vocab_projection(hidden, weight, vocab, bias, backend=backend)
            logits.values.float().sum().backward()
            logits.argmax(), logits.topk(3), logits.log_softmax()
            loss = ragged.vocab_cross_entropy(
                hidden, weight, vocab, target, bias, out_of_vocab="ignore", backend=backend
            )
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "chunked"])
def test_cross_entropy_forward_backward_captured_in_a_cuda_graph(monkeypatch, chunked):
    """Captured once, replayed on new values written into the same tensors: the replay must
    give the eager call's loss and gradients on those values (host metadata copied while
    capturing, e.g. the chunks' offsets of the backward, must stay valid for every replay)."""
    from ragged.kernels.triton import vocab_cross_entropy as kce

    if chunked:  # several chunks of the backward, each with offsets copied from the host
        monkeypatch.setitem(kce.backward.__kwdefaults__, "chunk_elems", 3000)
    hidden, weight, bias, vocab, cands, lens = _batch(8, torch.float32)
    gen = torch.Generator().manual_seed(9)

    def targets():
        picks = [
            c[torch.randint(0, len(c), (n,), generator=gen)] if len(c) else torch.full((n,), -100)
            for n, c in zip(lens, cands)
        ]
        return torch.cat(picks).cuda()

    h = hidden.values.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    rt = hidden.with_values(h)
    target = targets()

    def run():
        loss = ragged.vocab_cross_entropy(rt, w, vocab, target, bias, out_of_vocab="ignore", backend="triton")
        return (loss, *torch.autograd.grad(loss, (h, w)))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    junk = []
    for _ in range(2):
        # take the freed pinned host blocks (the sizes of offsets) and fill them with other values
        junk += [
            torch.full((n,), 1 << 20, dtype=dt, pin_memory=True)
            for n in range(1, 40)
            for dt in (torch.int32, torch.int64)
        ]
        with torch.no_grad():
            h.copy_(torch.randn(h.shape, generator=gen).cuda())
            w.copy_(torch.randn(w.shape, generator=gen).cuda() / w.shape[1] ** 0.5)
            target.copy_(targets())
        graph.replay()
        expected = run()
        for a, b in zip(out, expected):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_compile_fullgraph():
    torch._dynamo.reset()
    hidden, weight, bias, vocab, cands, lens = _batch(7, torch.bfloat16)
    w = weight.clone().requires_grad_(True)

    def f(values, w):
        return ragged.vocab_projection(hidden.with_values(values), w, vocab, bias).values.float().square().sum()

    out = torch.compile(f, fullgraph=True)(hidden.values, w)
    out.backward()
    w_ref = weight.clone().requires_grad_(True)
    ref = f(hidden.values, w_ref)
    ref.backward()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=1e-1)
    torch.testing.assert_close(w.grad.float(), w_ref.grad.float(), rtol=5e-2, atol=1e-1)


# --------------------------------------------------------------------------------------
# Regressions (their CPU versions: tests/test_vocab_strided.py, tests/test_vocab_ids_and_gradients.py), on every
# backend and "auto"

REG_LENS, REG_COUNTS, REG_V, REG_D = [17, 0, 33, 1, 5], [40, 7, 0, 1, 129], 700, 64


def _every_backend(hidden, weight, bias, vocab):
    return _backends(hidden, weight, bias, vocab) + ["auto"]


def _every_other(t):
    """``t`` as a view of stride 2 into a zero-padded buffer of twice its length."""
    buf = t.new_zeros((2 * t.shape[0], *t.shape[1:]))
    buf[::2] = t
    return buf[::2]


def _cuda_offsets(lengths, dtype=torch.int32):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=dtype, device="cuda")


def _reg_cands(seed, shared):
    gen = torch.Generator().manual_seed(seed)
    if shared:
        return [torch.randperm(REG_V, generator=gen)[:90].sort().values.cuda()] * len(REG_LENS)
    return [torch.randperm(REG_V, generator=gen)[:n].sort().values.cuda() for n in REG_COUNTS]


def _reg_loop(h, w, b, cands, lens=REG_LENS):
    blocks, t = [], 0
    for n, c in zip(lens, cands):
        blocks.append(h[t : t + n].double() @ w[c].double().T + b[c].double())
        t += n
    return blocks


def _reg_ce(h, w, b, cands, target, smoothing=0.0, lens=REG_LENS):
    total, kept, t = h.sum().double() * 0, 0, 0
    for block, n, c in zip(_reg_loop(h, w, b, cands, lens), lens, cands):
        y = target[t : t + n]
        t += n
        if n and len(c):
            local = torch.searchsorted(c, y)
            total = total + F.cross_entropy(block, local, reduction="sum", label_smoothing=smoothing)
            kept += n
    return total / kept


def _reg_targets(cands, seed, lens=REG_LENS):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, c in zip(lens, cands):
        out += [int(c[torch.randint(0, len(c), (), generator=gen)]) if len(c) else -100 for _ in range(n)]
    return torch.tensor(out, device="cuda")


def _assert_grads_close(got, want, what):
    for k, (a, r) in enumerate(zip(got, want)):
        torch.testing.assert_close(
            a.double(), r.double(), atol=2e-3, rtol=2e-3, msg=lambda m, k=k: f"{what} [{k}]: {m}"
        )


@pytest.mark.parametrize("host", [True, False], ids=["host_offsets", "device_offsets"])
@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
def test_strided_offsets_ids_bias_target_every_backend(shared, host):
    """Strided views of the offsets, ids, bias, weight and targets: the values and the
    gradients of the leaves they are views of match the loop on every backend."""
    gen = torch.Generator().manual_seed(21)
    cands = _reg_cands(22, shared)
    h_full = torch.randn(sum(REG_LENS), 2 * REG_D, generator=gen).cuda()
    w_full = (torch.randn(REG_V, 2 * REG_D, generator=gen) / REG_D**0.5).cuda()
    b_full = torch.randn(2 * REG_V, generator=gen).cuda()
    h_off = _cuda_offsets(REG_LENS)
    target = _reg_targets(cands, 23)

    def build(hf, wf, bf):
        hidden = RaggedTensor(hf[:, ::2], _every_other(h_off), max(REG_LENS), tuple(h_off.tolist()) if host else None)
        if shared:
            vocab = _every_other(cands[0])
        else:
            v_off = _cuda_offsets(REG_COUNTS)
            vocab = RaggedTensor(
                _every_other(torch.cat(cands).to(torch.int32)),
                _every_other(v_off),
                max(REG_COUNTS),
                tuple(v_off.tolist()) if host else None,
            )
        return hidden, wf[:, ::2], vocab, bf[::2]

    def grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (h_full, w_full, b_full)]
        out = fn(*leaves)
        out_sum = out.double().square().sum() if out.dim() else out.double()
        return out.detach(), torch.autograd.grad(out_sum, leaves)

    def oracle_projection(hf, wf, bf):
        return torch.cat([b.reshape(-1) for b in _reg_loop(hf[:, ::2], wf[:, ::2], bf[::2], cands)])

    def oracle_ce(hf, wf, bf):
        return _reg_ce(hf[:, ::2], wf[:, ::2], bf[::2], cands, target, 0.1)

    ref_p, ref_pg = grads(oracle_projection)
    ref_c, ref_cg = grads(oracle_ce)
    for backend in _every_backend(*build(h_full, w_full, b_full)):
        got_p, got_pg = grads(lambda hf, wf, bf: ragged.vocab_projection(*build(hf, wf, bf), backend=backend).values)
        torch.testing.assert_close(got_p.double(), ref_p, atol=1e-3, rtol=1e-3, msg=lambda m: f"{backend}: {m}")
        _assert_grads_close(got_pg, ref_pg, f"{backend} projection")
        assert torch.all(got_pg[2][1::2] == 0)  # the bias buffer's other entries get no gradient

        def ce(hf, wf, bf):
            hidden, weight, vocab, bias = build(hf, wf, bf)
            return ragged.vocab_cross_entropy(
                hidden, weight, vocab, _every_other(target), bias, label_smoothing=0.1, backend=backend
            )

        got_c, got_cg = grads(ce)
        torch.testing.assert_close(got_c.double(), ref_c, atol=1e-4, rtol=1e-4, msg=lambda m: f"{backend}: {m}")
        _assert_grads_close(got_cg, ref_cg, f"{backend} cross-entropy")
        # union_vocab of strided ids, projected onto as a shared vocabulary
        hidden, weight, vocab, bias = build(h_full, w_full, b_full)
        union = ragged.union_vocab(vocab)
        assert union.tolist() == sorted(set(torch.cat(cands).tolist()))
        got_u = ragged.vocab_projection(hidden, weight, _every_other(union), bias, backend=backend).values
        want_u = torch.cat([b.reshape(-1) for b in _reg_loop(hidden.values, weight, bias, [union] * len(REG_LENS))])
        torch.testing.assert_close(got_u.double(), want_u, atol=1e-3, rtol=1e-3)


def _reg_bad_ids(shared, bad_id):
    """(cands with bad_id in sequence 3, or in the shared list; vocab with host offsets)."""
    cands = _reg_cands(31, shared)
    if shared:
        ids = torch.cat([cands[0][:-1], torch.tensor([bad_id], device="cuda")]).sort().values
        return [ids] * len(REG_LENS), ids, "vocab"
    cands = [c.clone() for c in cands]
    cands[3] = torch.tensor([bad_id], device="cuda")
    return cands, RaggedTensor.from_lengths(torch.cat(cands), REG_COUNTS), "vocab.values"


@pytest.mark.parametrize("bad_id", [REG_V, -1], ids=["V", "negative"])
@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
def test_out_of_range_ids_every_backend(shared, bad_id):
    """CUDA ids with an id outside [0, V), host offsets known (the hot path):
    ValueError under validate=True and in the read of out_of_vocab="error" on every backend,
    and from the "torch" backend (which reads anyway); the kernels' projection reads no
    device value and never follows the id (it scores 0: weight is a view into a larger
    buffer whose other rows hold data)."""
    gen = torch.Generator().manual_seed(32)
    cands, vocab, name = _reg_bad_ids(shared, bad_id)
    hidden = RaggedTensor.from_lengths(torch.randn(sum(REG_LENS), REG_D, generator=gen).cuda(), REG_LENS)
    w_buf = torch.randn(REG_V + 8, REG_D, generator=gen).cuda()
    b_buf = torch.randn(REG_V + 8, generator=gen).cuda()
    weight, bias = w_buf[4 : 4 + REG_V], b_buf[4 : 4 + REG_V]
    target = torch.full((sum(REG_LENS),), -100, device="cuda")
    pattern = rf"expected {name.replace('.', '[.]')} in \[0, {REG_V}\)"
    # the contract: an outside id reads as a zero row with no bias
    w_ext = torch.cat([weight, weight.new_zeros(1, REG_D)])
    b_ext = torch.cat([bias, bias.new_zeros(1)])
    mapped = [torch.where((c >= 0) & (c < REG_V), c, REG_V) for c in cands]
    want = torch.cat([b.reshape(-1) for b in _reg_loop(hidden.values, w_ext, b_ext, mapped)])
    for backend in _every_backend(hidden, weight, bias, vocab):
        with pytest.raises(ValueError, match=r"ragged\.vocab_projection\(\): " + pattern):
            ragged.vocab_projection(hidden, weight, vocab, bias, validate=True, backend=backend)
        with pytest.raises(ValueError, match=r"ragged\.vocab_cross_entropy\(\): " + pattern):
            ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, backend=backend)
        if backend == "torch":
            with pytest.raises(ValueError, match=r"ragged\.vocab_projection\(\): " + pattern):
                ragged.vocab_projection(hidden, weight, vocab, bias, backend=backend)
            continue
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = ragged.vocab_projection(hidden, weight, vocab, bias, backend=backend).values
            loss = ragged.vocab_cross_entropy(
                hidden, weight, vocab, target, bias, out_of_vocab="ignore", reduction="sum", backend=backend
            )
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.testing.assert_close(got.double(), want, atol=1e-3, rtol=1e-3)
        assert loss.item() == 0


@pytest.mark.parametrize("shared", [False, True], ids=["ragged", "shared"])
def test_unsorted_ids_cross_entropy_every_backend(shared):
    """Unsorted CUDA ids: the read of out_of_vocab="error" says they are unsorted (rather than
    reporting targets outside their candidates) on every backend; so does "ignore" on the
    "torch" backend, which reads anyway."""
    gen = torch.Generator().manual_seed(41)
    cands = _reg_cands(42, shared)
    target = _reg_targets(cands, 43)
    hidden = RaggedTensor.from_lengths(torch.randn(sum(REG_LENS), REG_D, generator=gen).cuda(), REG_LENS)
    weight, bias = torch.randn(REG_V, REG_D, generator=gen).cuda(), torch.randn(REG_V, generator=gen).cuda()
    if shared:
        vocab, name = cands[0].flip(0), "vocab"
    else:
        vocab, name = RaggedTensor.from_lengths(torch.cat([c.flip(0) for c in cands]), REG_COUNTS), "vocab.values"
    pattern = rf"ragged\.vocab_cross_entropy\(\): expected {name.replace('.', '[.]')} sorted"
    for backend in _every_backend(hidden, weight, bias, vocab):
        with pytest.raises(ValueError, match=pattern):
            ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, backend=backend)
        with pytest.raises(ValueError, match=pattern):
            ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, validate=True, backend=backend)
        if backend == "torch":
            with pytest.raises(ValueError, match=pattern):
                ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, out_of_vocab="ignore", backend=backend)


@pytest.mark.parametrize("what", ["projection", "cross_entropy"])
def test_double_backward_raises_every_backend(what):
    gen = torch.Generator().manual_seed(51)
    cands = _reg_cands(52, False)
    target = _reg_targets(cands, 53)
    hidden = RaggedTensor.from_lengths(torch.randn(sum(REG_LENS), REG_D, generator=gen).cuda(), REG_LENS)
    weight, bias = torch.randn(REG_V, REG_D, generator=gen).cuda(), torch.randn(REG_V, generator=gen).cuda()
    vocab = RaggedTensor.from_lengths(torch.cat(cands), REG_COUNTS)
    name = "ragged.vocab_cross_entropy()" if what == "cross_entropy" else "ragged.vocab_projection()"
    for backend in _every_backend(hidden, weight, bias, vocab):
        leaves = [t.clone().requires_grad_(True) for t in (hidden.values, weight, bias)]
        if what == "projection":
            out = (
                ragged.vocab_projection(hidden.with_values(leaves[0]), leaves[1], vocab, leaves[2], backend=backend)
                .values.square()
                .sum()
            )
        else:
            out = ragged.vocab_cross_entropy(
                hidden.with_values(leaves[0]), leaves[1], vocab, target, leaves[2], backend=backend
            )
        grads = torch.autograd.grad(out, leaves, create_graph=True)
        with pytest.raises(NotImplementedError, match="double backward") as info:
            sum(g.square().sum() for g in grads).backward()
        assert name in str(info.value), backend


@pytest.mark.parametrize("smoothing", [0.0, 1.0])
def test_label_smoothing_edges_with_an_empty_candidate_list_every_backend(smoothing):
    """eps = 0 and eps = 1 with a sequence that has tokens but no candidates (lse = -inf
    there): finite losses and gradients equal to the loop's."""
    gen = torch.Generator().manual_seed(61)
    lens, counts = [9, 4, 30], [50, 0, 7]
    cands = [torch.randperm(REG_V, generator=gen)[:n].sort().values.cuda() for n in counts]
    target = _reg_targets(cands, 62, lens)
    values = torch.randn(sum(lens), REG_D, generator=gen).cuda()
    weight = (torch.randn(REG_V, REG_D, generator=gen) / REG_D**0.5).cuda()
    bias = torch.randn(REG_V, generator=gen).cuda()
    hidden = RaggedTensor.from_lengths(values, lens)
    vocab = RaggedTensor.from_lengths(torch.cat(cands), counts)
    ref_leaves = [t.clone().requires_grad_(True) for t in (values, weight, bias)]
    ref = _reg_ce(*ref_leaves, cands, target, smoothing, lens)
    ref.backward()
    for backend in _every_backend(hidden, weight, bias, vocab):
        leaves = [t.clone().requires_grad_(True) for t in (values, weight, bias)]
        loss = ragged.vocab_cross_entropy(
            hidden.with_values(leaves[0]),
            leaves[1],
            vocab,
            target,
            leaves[2],
            label_smoothing=smoothing,
            backend=backend,
        )
        loss.backward()
        assert torch.isfinite(loss), backend
        torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-4, rtol=1e-4)
        _assert_grads_close([t.grad for t in leaves], [t.grad for t in ref_leaves], f"{backend} eps={smoothing}")
