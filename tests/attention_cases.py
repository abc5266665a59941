"""What the attention tests share (tests/test_attention.py, test_attention_dropout.py,
test_attention_errors.py): the batch cases, seeded draws, the float64 per-sequence loop oracle
over scaled_dot_product_attention written without ragged, and the comparisons."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F
from conftest import TRITON_ON_CPU, cpu_backends

import ragged

BACKENDS = cpu_backends()
needs_triton = pytest.mark.skipif(not TRITON_ON_CPU, reason="the Triton kernels need TRITON_INTERPRET=1 on CPU")

# name: (query lengths, key lengths, H, H_kv, D)
CASES = {
    "mixed": ([5, 0, 31, 12], [5, 0, 31, 12], 4, 4, 32),
    "gqa2": ([5, 0, 31, 12], [5, 0, 31, 12], 4, 2, 32),
    "mqa": ([5, 0, 31, 12], [5, 0, 31, 12], 4, 1, 32),
    "cross_q_shorter": ([2, 7, 1, 16], [5, 19, 3, 33], 2, 2, 64),
    "cross_q_longer": ([5, 20, 3, 33], [2, 7, 3, 17], 2, 1, 16),
    "empty_in_k": ([4, 3, 6], [3, 0, 5], 2, 2, 32),
    "empty_in_q": ([0, 6, 0], [5, 4, 3], 2, 2, 32),
    "empty_in_both": ([3, 0, 5, 0], [2, 0, 6, 0], 2, 1, 32),
    "all_k_empty": ([3, 2], [0, 0], 2, 2, 16),
    "all_q_empty": ([0, 0], [3, 4], 2, 2, 16),
    "odd": ([1, 7, 1], [1, 7, 1], 2, 2, 16),
    "odd_97": ([97], [97], 1, 1, 16),
    "single_token": ([1], [1], 1, 1, 32),
    "d64": ([33, 1, 16], [33, 1, 16], 2, 2, 64),
    "d80": ([5, 17, 9], [5, 17, 9], 2, 1, 80),
    "batch0": ([], [], 2, 2, 16),
}

# float32 kernels use IEEE fp32 dots: errors against float64 stay near 1e-6.
FWD_TOL = {"atol": 2e-5, "rtol": 2e-5}
BWD_TOL = {"atol": 1e-4, "rtol": 1e-4}


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def _offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _cu(lengths, dtype=torch.int32):
    return torch.tensor(_offsets(lengths), dtype=dtype)


def _randn(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _qkv(lq, lk, heads, kv_heads, dim, seed, dtype=torch.float32):
    q = _randn((sum(lq), heads, dim), seed, dtype)
    k = _randn((sum(lk), kv_heads, dim), seed + 1, dtype)
    v = _randn((sum(lk), kv_heads, dim), seed + 2, dtype)
    return q, k, v


def _allowed(nq, nk, causal):
    """[nq, nk] bool, True where query i may attend key j (bottom-right causal)."""
    i = torch.arange(nq).unsqueeze(1)
    j = torch.arange(nk).unsqueeze(0)
    if causal:
        return j <= i + (nk - nq)
    return torch.ones(nq, nk, dtype=torch.bool)


def _loop_attention(q, k, v, lq, lk, causal=False, scale=None, keep=None, dropout_p=0.0):
    """float64 per-sequence attention: ``(out [Tq, H, D], lse [Tq, H])``.

    Queries that see no key get zeros and ``lse = -inf``. Without ``keep`` the rows that
    see keys go through SDPA; with ``keep`` (``[H, Tq, >= max Lk]`` bool, True = keep) the
    probabilities are dropped explicitly and scaled by ``1 / (1 - dropout_p)``.
    Differentiable in q, k, v.
    """
    heads, dim = q.shape[1], q.shape[2]
    group = heads // k.shape[1]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    outs, lses = [], []
    tq = tk = 0
    for nq, nk in zip(lq, lk):
        qb = q[tq : tq + nq].double().transpose(0, 1)  # [H, nq, D]
        kb = k[tk : tk + nk].double().transpose(0, 1).repeat_interleave(group, 0)  # [H, nk, D]
        vb = v[tk : tk + nk].double().transpose(0, 1).repeat_interleave(group, 0)
        allowed = _allowed(nq, nk, causal)
        sees = allowed.any(1)
        blind = nq - int(sees.sum())  # bottom-right causal: the first rows see nothing
        assert not sees[:blind].any() and sees[blind:].all()
        scores = torch.matmul(qb, kb.transpose(1, 2)) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        if nk:
            lse = torch.logsumexp(scores, dim=-1)
        else:
            lse = torch.full((heads, nq), float("-inf"), dtype=torch.float64)
        if keep is None:
            seen = F.scaled_dot_product_attention(qb[:, blind:], kb, vb, attn_mask=allowed[blind:], scale=scale)
        else:
            probs = torch.softmax(scores[:, blind:], dim=-1)
            kb_keep = keep[:, tq + blind : tq + nq, :nk]
            probs = torch.where(kb_keep, probs / (1.0 - dropout_p), torch.zeros((), dtype=torch.float64))
            seen = torch.matmul(probs, vb)
        out = torch.cat([qb.new_zeros(heads, blind, dim), seen], dim=1)
        outs.append(out.transpose(0, 1))
        lses.append(lse.transpose(0, 1))
        tq += nq
        tk += nk
    if not outs:  # B = 0: an empty output that is still connected to q
        return q.double() * 0, torch.zeros(q.shape[:2], dtype=torch.float64)
    return torch.cat(outs), torch.cat(lses)


def _blind_rows(lq, lk, causal):
    """[Tq] bool: queries that see no key."""
    rows = []
    for nq, nk in zip(lq, lk):
        rows.append(~_allowed(nq, nk, causal).any(1))
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.bool)


def _run(q, k, v, lq, lk, backend, causal=False, scale=None, dropout_p=0.0):
    return ragged.varlen_attention(
        q,
        k,
        v,
        _cu(lq),
        _cu(lk),
        max(lq, default=0),
        max(lk, default=0),
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        return_lse=True,
        backend=backend,
    )


def _grads(fn, q, k, v, upstream):
    """Gradients of ``<fn(q, k, v), upstream>`` with respect to fresh leaves."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, upstream.to(out.dtype), allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))


def _check_lse(lse, expected, blind):
    assert lse.dtype == torch.float32
    assert lse.shape == expected.shape
    assert torch.all(torch.isneginf(lse[blind])), "a query that sees no key must get lse = -inf"
    assert torch.all(torch.isfinite(lse[~blind]))
    torch.testing.assert_close(lse[~blind].double(), expected[~blind], **FWD_TOL)


def spy_hopper(monkeypatch) -> list:
    """Switch the sm_90 attention kernels on (``RAGGED_ATTENTION_HOPPER=1``) and count their
    launches: the list gets q's shape per forward, ``("backward", q's shape)`` per backward."""
    from ragged.kernels.triton import attention_hopper, attention_hopper_bwd

    monkeypatch.setenv("RAGGED_ATTENTION_HOPPER", "1")
    calls: list = []
    forward, backward = attention_hopper.forward, attention_hopper_bwd.backward

    def spy_forward(*args, **kwargs):
        calls.append(args[0].shape)
        return forward(*args, **kwargs)

    def spy_backward(*args, **kwargs):
        calls.append(("backward", args[0].shape))
        return backward(*args, **kwargs)

    monkeypatch.setattr(attention_hopper, "forward", spy_forward)
    monkeypatch.setattr(attention_hopper_bwd, "backward", spy_backward)
    return calls
