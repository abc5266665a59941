"""What the vocab regression tests share (tests/test_vocab_strided.py,
tests/test_vocab_ids_and_gradients.py): one small batch (a sequence of 0 tokens, one of 0
candidates, one of 1 token), the seeded draws, strided views, and the float64 per-sequence
loop oracle: ``hidden_b @ W[ids_b].T + b[ids_b]`` (``vocab_cases._loop_blocks``) and
``F.cross_entropy`` on each sequence's block."""

from __future__ import annotations

import itertools
import zlib

import torch
import torch.nn.functional as F
from conftest import cpu_backends
from vocab_cases import _loop_blocks

BACKENDS = cpu_backends()
FN, CE = "ragged.vocab_projection()", "ragged.vocab_cross_entropy()"
TOL = {"atol": 5e-5, "rtol": 5e-5}
LENS, COUNTS, V, D = [3, 0, 5, 1, 2], [4, 2, 0, 3, 5], 13, 8  # 0 tokens, 0 candidates, 1 token


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


def _loop_cross_entropy(values, lens, weight, bias, cands, target, label_smoothing=0.0, ignore_index=-100):
    """Mean of F.cross_entropy over each sequence's gathered logits (targets mapped to local indices)."""
    total, kept, t = values.sum() * 0, 0, 0
    for block, n, c in zip(_loop_blocks(values, lens, weight, bias, cands), lens, cands):
        position = {int(i): j for j, i in enumerate(c.tolist())}
        local = torch.tensor([position.get(int(x), ignore_index) for x in target[t : t + n]], dtype=torch.int64)
        t += n
        if n and len(c) and (local != ignore_index).any():
            total = total + F.cross_entropy(
                block, local, ignore_index=ignore_index, reduction="sum", label_smoothing=label_smoothing
            )
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
