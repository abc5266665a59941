"""What the vocab tests share (tests/test_vocab.py, tests/test_vocab_cross_entropy.py): the
batch cases, the seeded draws, the per-sequence loop oracle without ragged, gradients through
autograd and the comparison with tolerance."""

from __future__ import annotations

import zlib

import pytest
import torch
from conftest import cpu_backends

import ragged
from ragged import RaggedTensor

BACKENDS = cpu_backends()
NEG_INF = float("-inf")

# name: (tokens per sequence, candidates per sequence, V, d)
CASES = {
    "mixed": ([3, 0, 5, 2, 4], [4, 3, 0, 1, 6], 40, 16),  # 0 tokens, 0 candidates, 1 candidate
    "overlap": ([4, 6, 3], [10, 10, 10], 12, 16),  # ids from 12: most rows listed thrice
    "single": ([7], [5], 30, 16),
    "odd_dim": ([5, 9, 1], [7, 3, 17], 25, 19),
    "no_tokens": ([0, 0], [3, 2], 10, 16),
    "batch0": ([], [], 10, 16),
}
FP32_TOL = {"atol": 2e-5, "rtol": 2e-5}
FN = "ragged.vocab_projection()"
CE = "ragged.vocab_cross_entropy()"


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=_gen(seed), dtype=torch.float64).to(dtype)


def _candidates(counts, vocab_size, seed):
    g = _gen(seed)
    return [torch.randperm(vocab_size, generator=g)[:n].sort().values for n in counts]


def _make(case, seed, dtype=torch.float64, bias=True, shared=False, id_dtype=torch.int64):
    """(hidden RaggedTensor, weight, bias, vocab, per-sequence candidate lists, token lengths)."""
    lens, counts, vocab_size, dim = CASES[case] if isinstance(case, str) else case
    hidden = RaggedTensor.from_lengths(_randn((sum(lens), dim), seed, dtype), lens)
    weight = _randn((vocab_size, dim), seed + 1, dtype)
    b = _randn((vocab_size,), seed + 2, dtype) if bias else None
    if shared:
        ids = _candidates([max(counts, default=3)], vocab_size, seed + 3)[0]
        cands = [ids] * len(lens)
        vocab = ids.to(id_dtype)
    else:
        cands = _candidates(counts, vocab_size, seed + 3)
        flat = torch.cat(cands) if cands else torch.zeros(0, dtype=torch.int64)
        vocab = RaggedTensor.from_lengths(flat.to(id_dtype), counts)
    return hidden, weight, b, vocab, cands, lens


def _loop_blocks(values, lens, weight, bias, cands):
    """float64 ``[T_b, V_b]`` blocks, one per sequence (differentiable)."""
    blocks, t = [], 0
    for n, c in zip(lens, cands):
        block = values[t : t + n].double() @ weight[c].double().T
        if bias is not None:
            block = block + bias[c].double()
        blocks.append(block)
        t += n
    return blocks


def _flat(blocks):
    return torch.cat([b.reshape(-1) for b in blocks]) if blocks else torch.zeros(0, dtype=torch.float64)


def _ids_and_offsets(vocab):
    if isinstance(vocab, RaggedTensor):
        return vocab.values, vocab.offsets
    return vocab, None


def _triton_reasons(hidden, weight, bias, vocab):
    ids, v_off = _ids_and_offsets(vocab)
    return ragged.explain("vocab_projection", hidden.values, hidden.offsets, weight, bias, ids, v_off)["triton"]


def _skip_if_backend_cannot(backend, hidden, weight, bias, vocab):
    if backend == "triton":
        reasons = _triton_reasons(hidden, weight, bias, vocab)
        if reasons:
            pytest.skip("triton cannot take this input: " + "; ".join(reasons))


def _grads(fn, leaves, upstream):
    """Gradients of ``<fn(*leaves), upstream>`` with respect to fresh copies of ``leaves`` (None stays None)."""
    fresh = [None if t is None else t.detach().clone().requires_grad_(True) for t in leaves]
    out = fn(*fresh)
    live = [t for t in fresh if t is not None]
    if not out.requires_grad:  # nothing to differentiate (an empty batch): zero gradients
        return [None if t is None else torch.zeros_like(t) for t in fresh]
    grads = iter(torch.autograd.grad(out, live, upstream.to(out.dtype), allow_unused=True))
    result = []
    for t in fresh:
        if t is None:
            result.append(None)
        else:
            g = next(grads)
            result.append(torch.zeros_like(t) if g is None else g)
    return result


def _close(got, expected, tol, what=""):
    for name, g, e in zip(("hidden", "weight", "bias"), got, expected):
        if e is None:
            assert g is None
            continue
        torch.testing.assert_close(g.double(), e.double(), **tol, msg=lambda m, n=name: f"{what} d{n}: {m}")


# --------------------------------------------------------------------------------------
# The reference against the hand-written loop (float64)


def _targets(lens, cands, vocab_size, seed, ignore_index=-100, ignored=0.2, outside=0.0):
    """Global target ids: a random candidate of the token's sequence, some ``ignore_index``,
    some (``outside``) an id that is not among the sequence's candidates."""
    g = _gen(seed)
    out = []
    for n, c in zip(lens, cands):
        others = sorted(set(range(vocab_size)) - set(c.tolist()))
        for _ in range(n):
            r = torch.rand((), generator=g).item()
            if not len(c) or r < ignored:
                out.append(ignore_index)
            elif r < ignored + outside and others:
                out.append(others[int(torch.randint(len(others), (), generator=g))])
            else:
                out.append(int(c[torch.randint(len(c), (), generator=g)]))
    return torch.tensor(out, dtype=torch.int64)
