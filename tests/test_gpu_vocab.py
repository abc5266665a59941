"""Varying-vocabulary projection and cross-entropy on the GPU (``pytest -m gpu``).

Every backend against float64 loops, with flash-attn's error rule: the kernel's error is
at most twice the error of the same computation done by torch in the input's precision
(plus a small atol).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ragged
from ragged import RaggedTensor

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-4}


def _batch(seed, dtype, shared=False, lens=(17, 0, 64, 1, 33), counts=(300, 7, 1, 0, 129), vocab_size=5000,
           dim=256):
    gen = torch.Generator().manual_seed(seed)
    hidden = RaggedTensor.from_lengths(torch.randn(sum(lens), dim, generator=gen).to("cuda", dtype), list(lens))
    weight = (torch.randn(vocab_size, dim, generator=gen) / dim ** 0.5).to("cuda", dtype)
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
        block = values[t:t + n].to(dtype) @ weight[c].to(dtype).T + bias[c].to(dtype)
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
            got = grads(lambda h, w, b: ragged.vocab_projection(hidden.with_values(h), w, vocab, b,
                                                                backend=backend).values, leaves)
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
            z = h[t:t + n].double() @ w[c].double().T + b[c].double()
            y = target[t:t + n]
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
        loss = ragged.vocab_cross_entropy(hidden.with_values(mine[0]), mine[1], vocab, target, mine[2],
                                          label_smoothing=smoothing, backend=backend)
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
    target = torch.cat([c[:n].repeat(n + 1)[:n] if len(c) else torch.zeros(n, dtype=torch.int64)
                        for n, c in zip(lens, cands)]).cuda()
    # the torch backend is the reference (a host loop over the sequences, which reads the
    # offsets); the kernels must not read the device
    for backend in [b for b in _backends(hidden, weight, bias, vocab) if b != "torch"]:
        ragged.vocab_projection(hidden, weight, vocab, bias, backend=backend)   # warm up
        ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, out_of_vocab="ignore", backend=backend)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = ragged.vocab_projection(hidden, weight, vocab, bias, backend=backend)
            logits.values.float().sum().backward()
            logits.argmax(), logits.topk(3), logits.log_softmax()
            loss = ragged.vocab_cross_entropy(hidden, weight, vocab, target, bias, out_of_vocab="ignore",
                                              backend=backend)
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)


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
