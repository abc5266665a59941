"""ragged.attention / ragged.varlen_attention on CPU.

The oracle is a per-sequence loop over ``torch.nn.functional.scaled_dot_product_attention``
in float64 (GQA through ``repeat_interleave``, bottom-right causal masking through an
explicit bool mask, zeros for queries that see no key), written here without ragged.
``ragged.reference_attention`` is checked against it, and every backend that can take
CPU tensors (the Triton kernels run through the interpreter, see ``conftest.py``) is
checked against both. Sizes stay small for the interpreter.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch
import torch.nn.functional as F
from conftest import TRITON_ON_CPU, cpu_backends
from hypothesis import given, settings
from hypothesis import strategies as st

import ragged
from ragged import RaggedTensor

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
        qb = q[tq:tq + nq].double().transpose(0, 1)                                  # [H, nq, D]
        kb = k[tk:tk + nk].double().transpose(0, 1).repeat_interleave(group, 0)      # [H, nk, D]
        vb = v[tk:tk + nk].double().transpose(0, 1).repeat_interleave(group, 0)
        allowed = _allowed(nq, nk, causal)
        sees = allowed.any(1)
        blind = nq - int(sees.sum())               # bottom-right causal: the first rows see nothing
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
            kb_keep = keep[:, tq + blind:tq + nq, :nk]
            probs = torch.where(kb_keep, probs / (1.0 - dropout_p), torch.zeros((), dtype=torch.float64))
            seen = torch.matmul(probs, vb)
        out = torch.cat([qb.new_zeros(heads, blind, dim), seen], dim=1)
        outs.append(out.transpose(0, 1))
        lses.append(lse.transpose(0, 1))
        tq += nq
        tk += nk
    if not outs:   # B = 0: an empty output that is still connected to q
        return q.double() * 0, torch.zeros(q.shape[:2], dtype=torch.float64)
    return torch.cat(outs), torch.cat(lses)


def _blind_rows(lq, lk, causal):
    """[Tq] bool: queries that see no key."""
    rows = []
    for nq, nk in zip(lq, lk):
        rows.append(~_allowed(nq, nk, causal).any(1))
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.bool)


def _run(q, k, v, lq, lk, backend, causal=False, scale=None, dropout_p=0.0):
    return ragged.varlen_attention(q, k, v, _cu(lq), _cu(lk), max(lq, default=0), max(lk, default=0),
                                   causal=causal, scale=scale, dropout_p=dropout_p, return_lse=True,
                                   backend=backend)


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


# --------------------------------------------------------------------------------------
# The oracle agrees with ragged.reference_attention


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_sdpa_loop(case, causal):
    lq, lk, heads, kv_heads, dim = CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed(case, "ref"), torch.float64)
    exp, exp_lse = _loop_attention(q, k, v, lq, lk, causal)
    blind = _blind_rows(lq, lk, causal)
    out, lse = ragged.reference_attention(q, k, v, _cu(lq), _cu(lk), causal)
    assert out.dtype == torch.float64 and out.shape == q.shape
    torch.testing.assert_close(out, exp, atol=1e-12, rtol=1e-12)
    assert torch.all(out[blind] == 0)
    _check_lse(lse, exp_lse, blind)
    # float32 inputs: computed in float32, returned in float32
    out32, _ = ragged.reference_attention(q.float(), k.float(), v.float(), _cu(lq), _cu(lk), causal)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), exp, **FWD_TOL)
    # gradients through torch autograd (B = 0: see test_reference_empty_batch_is_differentiable)
    if not lq:
        return
    up = _randn(q.shape, _seed(case, "up"), torch.float64)
    got = _grads(lambda a, b, c: ragged.reference_attention(a, b, c, _cu(lq), _cu(lk), causal)[0], q, k, v, up)
    ref = _grads(lambda a, b, c: _loop_attention(a, b, c, lq, lk, causal)[0], q, k, v, up)
    for name, g, r in zip("qkv", got, ref):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")


def test_reference_empty_batch_is_differentiable():
    """B = 0 with inputs that require grad: the output is part of the graph (empty gradients)."""
    q, k, v = (torch.zeros(0, 2, 16, requires_grad=True) for _ in range(3))
    cu = torch.zeros(1, dtype=torch.int32)
    out, lse = ragged.reference_attention(q, k, v, cu, cu)
    assert out.shape == (0, 2, 16) and lse.shape == (0, 2)
    assert out.requires_grad
    grads = torch.autograd.grad(out, (q, k, v), torch.zeros_like(out), allow_unused=True)
    assert all(g is None or g.shape == t.shape for g, t in zip(grads, (q, k, v)))


def test_loop_oracle_on_a_hand_case():
    """The oracle itself: Lq = 5, Lk = 2 causal (the docstring's picture), one head, D = 1."""
    q = torch.zeros(5, 1, 1, dtype=torch.float64)
    k = torch.zeros(2, 1, 1, dtype=torch.float64)
    v = torch.tensor([1.0, 3.0], dtype=torch.float64).view(2, 1, 1)
    out, lse = _loop_attention(q, k, v, [5], [2], causal=True)
    assert out.flatten().tolist() == [0.0, 0.0, 0.0, 1.0, 2.0]
    assert lse.flatten().tolist()[:3] == [float("-inf")] * 3
    assert lse.flatten().tolist()[3:] == pytest.approx([0.0, math.log(2.0)])


# --------------------------------------------------------------------------------------
# Kernels against the float64 oracle


@needs_triton
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_forward(case, causal):
    lq, lk, heads, kv_heads, dim = CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed(case, "fwd"))
    out, lse = _run(q, k, v, lq, lk, "triton", causal)
    exp, exp_lse = _loop_attention(q, k, v, lq, lk, causal)
    blind = _blind_rows(lq, lk, causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), exp, **FWD_TOL)
    assert torch.all(out[blind] == 0), "a query that sees no key must get zeros"
    _check_lse(lse, exp_lse, blind)


@needs_triton
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_backward(case, causal):
    lq, lk, heads, kv_heads, dim = CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed(case, "bwd"))
    up = _randn(q.shape, _seed(case, "bwd-up"))

    def kernel(a, b, c):
        return ragged.varlen_attention(a, b, c, _cu(lq), _cu(lk), max(lq, default=0), max(lk, default=0),
                                       causal=causal, backend="triton")

    got = _grads(kernel, q, k, v, up)
    ref = _grads(lambda a, b, c: _loop_attention(a, b, c, lq, lk, causal)[0], q, k, v, up)
    for name, g, r, t in zip("qkv", got, ref, (q, k, v)):
        assert g.shape == t.shape and g.dtype == t.dtype, name
        assert not torch.isnan(g).any(), f"d{name} has NaN"
        torch.testing.assert_close(g.double(), r.double(), **BWD_TOL, msg=lambda m, n=name: f"d{n}: {m}")
    blind = _blind_rows(lq, lk, causal)
    assert torch.all(got[0][blind] == 0), "queries that see no key get no gradient"


@needs_triton
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dim", [16, 32, 64, 80])
def test_triton_float16_error_rule(dim, causal):
    """flash-attn's rule: |kernel - f64| <= 2 |reference in float16 - f64| + 1e-3 (bfloat16 is left to the
    GPU tests: the Triton interpreter's bfloat16 dots are not exact)."""
    lq, lk = [9, 0, 23, 4], [9, 3, 23, 4]
    q, k, v = _qkv(lq, lk, 4, 2, dim, _seed("f16", dim, causal), torch.float16)
    exp, _ = _loop_attention(q, k, v, lq, lk, causal)
    low, _ = ragged.reference_attention(q, k, v, _cu(lq), _cu(lk), causal, compute_dtype=torch.float16)
    out, _ = _run(q, k, v, lq, lk, "triton", causal)
    assert out.dtype == torch.float16
    err_low = (low.double() - exp).abs().max().item()
    err = (out.double() - exp).abs().max().item()
    assert err <= 2 * err_low + 1e-3, (err, err_low)

    up = _randn(q.shape, _seed("f16-up", dim), torch.float16)

    def kernel(a, b, c):
        return ragged.varlen_attention(a, b, c, _cu(lq), _cu(lk), 23, 23, causal=causal, backend="triton")

    def low_ref(a, b, c):
        return ragged.reference_attention(a, b, c, _cu(lq), _cu(lk), causal, compute_dtype=torch.float16)[0]

    got = _grads(kernel, q, k, v, up)
    lows = _grads(low_ref, q, k, v, up)
    ref = _grads(lambda a, b, c: _loop_attention(a, b, c, lq, lk, causal)[0], q.double(), k.double(),
                 v.double(), up.double())
    for name, g, lo, r in zip("qkv", got, lows, ref):
        err_low = (lo.double() - r).abs().max().item()
        err = (g.double() - r).abs().max().item()
        assert err <= 2 * err_low + 1e-3, (name, err, err_low)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_odd_lengths_each_backend(backend, causal):
    lq = lk = [1, 7, 1, 15, 17, 3]
    q, k, v = _qkv(lq, lk, 2, 1, 32, _seed("odd", backend, causal))
    out, lse = _run(q, k, v, lq, lk, backend, causal)
    exp, exp_lse = _loop_attention(q, k, v, lq, lk, causal)
    torch.testing.assert_close(out.double(), exp, **FWD_TOL)
    _check_lse(lse, exp_lse, _blind_rows(lq, lk, causal))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [0.37, 2, 0.0])
def test_scale_argument(backend, scale):
    lq, lk = [6, 11, 0], [4, 13, 2]
    q, k, v = _qkv(lq, lk, 2, 2, 32, _seed("scale", backend))
    out, lse = _run(q, k, v, lq, lk, backend, scale=scale)
    exp, exp_lse = _loop_attention(q, k, v, lq, lk, scale=float(scale))
    torch.testing.assert_close(out.double(), exp, **FWD_TOL)
    _check_lse(lse, exp_lse, _blind_rows(lq, lk, False))
    if scale == 0.0:   # uniform weights: each query gets the mean of its sequence's values
        torch.testing.assert_close(out[:6], v[:4].mean(0, keepdim=True).expand(6, 2, 32), **FWD_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_scale_is_inverse_sqrt_head_dim(backend):
    lq = [5, 9]
    q, k, v = _qkv(lq, lq, 2, 2, 64, _seed("default-scale", backend))
    out, lse = _run(q, k, v, lq, lq, backend)
    out2, lse2 = _run(q, k, v, lq, lq, backend, scale=1.0 / math.sqrt(64))
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@needs_triton
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64], ids=str)
def test_int64_cu_seqlens(offsets_dtype):
    lq, lk = [3, 0, 18], [7, 2, 18]
    q, k, v = _qkv(lq, lk, 2, 2, 16, _seed("cu64"))
    out = ragged.varlen_attention(q, k, v, _cu(lq, offsets_dtype), _cu(lk, offsets_dtype), 18, 18,
                                  causal=True, backend="triton")
    exp, _ = _loop_attention(q, k, v, lq, lk, True)
    torch.testing.assert_close(out.double(), exp, **FWD_TOL)


# --------------------------------------------------------------------------------------
# Values outside a sequence never leak in


def _poisoned_storage(values, pad_heads=1, pad_dim=8, pad_rows=5):
    """``values`` as a view into a larger NaN-filled buffer: NaN rows before and after the
    tokens, NaN extra heads and NaN columns past the head dim (strided, not contiguous)."""
    t, h, d = values.shape
    buf = torch.full((t + 2 * pad_rows, h + pad_heads, d + pad_dim), float("nan"), dtype=values.dtype)
    view = buf[pad_rows:pad_rows + t, :h, :d]
    view.copy_(values)
    return view


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dim", [16, 80])
def test_nan_outside_the_views_never_leaks(backend, causal, dim):
    lq, lk = [5, 0, 20, 3], [9, 4, 20, 0]
    q, k, v = _qkv(lq, lk, 4, 2, dim, _seed("poison-view", dim))
    qp, kp, vp = (_poisoned_storage(t) for t in (q, k, v))
    assert not qp.is_contiguous()
    up = _randn(q.shape, _seed("poison-up"))

    def kernel(a, b, c):
        return ragged.varlen_attention(a, b, c, _cu(lq), _cu(lk), 20, 20, causal=causal, backend=backend)

    out = kernel(qp, kp, vp)
    assert not torch.isnan(out).any()
    exp, _ = _loop_attention(q, k, v, lq, lk, causal)
    torch.testing.assert_close(out.double(), exp, **FWD_TOL)
    leaves = [t.detach().requires_grad_(True) for t in (qp, kp, vp)]
    grads = torch.autograd.grad(kernel(*leaves), leaves, up)
    ref = _grads(lambda a, b, c: _loop_attention(a, b, c, lq, lk, causal)[0], q, k, v, up)
    for name, g, r in zip("qkv", grads, ref):
        assert not torch.isnan(g).any(), f"d{name} has NaN"
        torch.testing.assert_close(g.double(), r.double(), **BWD_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nan_padding_packed_away(backend, causal):
    """q, k, v packed from padded batches whose padding is NaN."""
    lq, lk = [4, 0, 13, 7], [6, 2, 13, 0]
    width, heads, dim = 16, 2, 32
    padded = [_randn((4, width, heads, dim), _seed("pad", i)) for i in range(3)]
    for x, lengths in zip(padded, (lq, lk, lk)):
        for b, n in enumerate(lengths):
            x[b, n:] = float("nan")
    q, k, v = (ragged.pack(x, lengths=n) for x, n in zip(padded, (lq, lk, lk)))
    out = ragged.attention(q, k, v, causal=causal, backend=backend)
    assert not torch.isnan(out.values).any()
    exp, _ = _loop_attention(q.values, k.values, v.values, lq, lk, causal)
    torch.testing.assert_close(out.values.double(), exp, **FWD_TOL)


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("poisoned", [0, 1, 3])
def test_nan_sequence_stays_in_its_sequence(backend, causal, poisoned):
    """A sequence whose q, k and v are all NaN poisons its own rows only (and its own gradients)."""
    lq, lk = [7, 17, 5, 18], [9, 17, 1, 20]
    q, k, v = _qkv(lq, lk, 2, 1, 32, _seed("poison-seq", poisoned))
    oq, ok = _offsets(lq), _offsets(lk)
    for t, o in ((q, oq), (k, ok), (v, ok)):
        t[o[poisoned]:o[poisoned + 1]] = float("nan")
    rows_q = torch.zeros(q.shape[0], dtype=torch.bool)
    rows_q[oq[poisoned]:oq[poisoned + 1]] = True
    rows_k = torch.zeros(k.shape[0], dtype=torch.bool)
    rows_k[ok[poisoned]:ok[poisoned + 1]] = True
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = ragged.varlen_attention(*leaves, _cu(lq), _cu(lk), 18, 20, causal=causal, backend=backend)
    clean_q = [n for b, n in enumerate(lq) if b != poisoned]
    clean_k = [n for b, n in enumerate(lk) if b != poisoned]
    exp, _ = _loop_attention(q[~rows_q], k[~rows_k], v[~rows_k], clean_q, clean_k, causal)
    torch.testing.assert_close(out[~rows_q].double(), exp, **FWD_TOL)
    up = _randn(q.shape, _seed("poison-seq-up"))
    up[rows_q] = 0
    dq, dk, dv = torch.autograd.grad(out, leaves, up)
    assert not torch.isnan(dq[~rows_q]).any()
    assert not torch.isnan(dk[~rows_k]).any() and not torch.isnan(dv[~rows_k]).any()


# --------------------------------------------------------------------------------------
# Batch invariance


@needs_triton
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_triton_batch_invariance(causal, kv_heads):
    """A sequence alone gives bit for bit what it gets as a slice of the batch."""
    lq, lk = [5, 0, 31, 12, 1, 17], [5, 3, 31, 19, 0, 9]
    q, k, v = _qkv(lq, lk, 4, kv_heads, 32, _seed("invariance", kv_heads))
    up = _randn(q.shape, _seed("invariance-up"))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = ragged.varlen_attention(*leaves, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal,
                                       return_lse=True, backend="triton")
    dq, dk, dv = torch.autograd.grad(out, leaves, up)
    oq, ok = _offsets(lq), _offsets(lk)
    for b in range(len(lq)):
        sq, sk = slice(oq[b], oq[b + 1]), slice(ok[b], ok[b + 1])
        one = [t[s].clone().requires_grad_(True) for t, s in ((q, sq), (k, sk), (v, sk))]
        o1, l1 = ragged.varlen_attention(*one, _cu([lq[b]]), _cu([lk[b]]), lq[b], lk[b], causal=causal,
                                         return_lse=True, backend="triton")
        assert torch.equal(o1, out[sq]), f"sequence {b}: output differs from its slice of the batch"
        assert torch.equal(l1, lse[sq]), f"sequence {b}: lse differs from its slice of the batch"
        if lq[b] or lk[b]:
            g1 = torch.autograd.grad(o1, one, up[sq])
            assert torch.equal(g1[0], dq[sq]), f"sequence {b}: dq"
            assert torch.equal(g1[1], dk[sk]), f"sequence {b}: dk"
            assert torch.equal(g1[2], dv[sk]), f"sequence {b}: dv"


# --------------------------------------------------------------------------------------
# RaggedTensor API


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_returns_ragged_with_q_offsets(backend, causal):
    lq, lk = [3, 0, 12, 6], [8, 5, 2, 6]
    qv, kv, vv = _qkv(lq, lk, 4, 2, 32, _seed("api", backend))
    q = RaggedTensor.from_lengths(qv, lq)
    k = RaggedTensor.from_lengths(kv, lk)
    v = k.with_values(vv)
    out = ragged.attention(q, k, v, causal=causal, backend=backend)
    assert isinstance(out, RaggedTensor)
    assert torch.equal(out.offsets, q.offsets) and out.offsets.dtype == q.offsets.dtype
    assert out.max_len == q.max_len and out.host_lengths() == lq
    assert out.values.shape == qv.shape and out.values.dtype == qv.dtype
    exp, exp_lse = _loop_attention(qv, kv, vv, lq, lk, causal)
    torch.testing.assert_close(out.values.double(), exp, **FWD_TOL)
    same = ragged.varlen_attention(qv, kv, vv, q.offsets, k.offsets, q.max_len, k.max_len, causal=causal,
                                   backend=backend)
    assert torch.equal(out.values, same)
    out2, lse = ragged.attention(q, k, v, causal=causal, return_lse=True, backend=backend)
    assert isinstance(out2, RaggedTensor) and isinstance(lse, torch.Tensor)
    assert torch.equal(out2.values, out.values)
    _check_lse(lse, exp_lse, _blind_rows(lq, lk, causal))
    # k and v as separate RaggedTensors with the same lengths
    v_separate = RaggedTensor.from_lengths(vv, lk)
    assert torch.equal(ragged.attention(q, k, v_separate, causal=causal, backend=backend).values, out.values)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_gradients_flow_to_values(backend):
    lq = [4, 9, 0, 2]
    qv, kv, vv = _qkv(lq, lq, 2, 2, 16, _seed("api-grad", backend))
    q, k, v = (RaggedTensor.from_lengths(t.clone(), lq).requires_grad_() for t in (qv, kv, vv))
    out = ragged.attention(q, k, v, causal=True, backend=backend)
    assert out.requires_grad
    up = _randn(qv.shape, _seed("api-grad-up"))
    (out.values * up).sum().backward()
    ref = _grads(lambda a, b, c: _loop_attention(a, b, c, lq, lq, True)[0], qv, kv, vv, up)
    for t, r in zip((q, k, v), ref):
        torch.testing.assert_close(t.values.grad.double(), r.double(), **BWD_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_and_global_backend(backend):
    lq = [3, 5]
    qv, kv, vv = _qkv(lq, lq, 2, 2, 16, _seed("global", backend))
    exp = ragged.varlen_attention(qv, kv, vv, _cu(lq), _cu(lq), 5, 5, backend=backend)
    with ragged.use_backend(backend):
        assert torch.equal(ragged.varlen_attention(qv, kv, vv, _cu(lq), _cu(lq), 5, 5), exp)
    # on CPU, "auto" takes the reference
    auto = ragged.varlen_attention(qv, kv, vv, _cu(lq), _cu(lq), 5, 5, backend="auto")
    torch.testing.assert_close(auto, exp, **FWD_TOL)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_auto_takes_head_dims_no_kernel_takes(causal):
    """D = 48 (no Triton kernel): "auto" and "torch" still answer."""
    lq = [3, 0, 6]
    q, k, v = _qkv(lq, lq, 2, 1, 48, _seed("d48"))
    exp, _ = _loop_attention(q, k, v, lq, lq, causal)
    for backend in ("auto", "torch"):
        out = ragged.varlen_attention(q, k, v, _cu(lq), _cu(lq), 6, 6, causal=causal, backend=backend)
        torch.testing.assert_close(out.double(), exp, **FWD_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    for heads, kv_heads in ((2, 2), (4, 1)):
        q = torch.zeros(0, heads, 16, requires_grad=True)
        k = torch.zeros(0, kv_heads, 16, requires_grad=True)
        v = torch.zeros(0, kv_heads, 16, requires_grad=True)
        cu = torch.zeros(1, dtype=torch.int32)
        out, lse = ragged.varlen_attention(q, k, v, cu, cu, 0, 0, return_lse=True, backend=backend)
        assert out.shape == (0, heads, 16) and lse.shape == (0, heads) and lse.dtype == torch.float32
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
        for g, t in zip((dq, dk, dv), (q, k, v)):
            assert g is None or g.shape == t.shape
        rt = RaggedTensor.from_lengths(torch.zeros(0, heads, 16), [])
        kv = RaggedTensor.from_lengths(torch.zeros(0, kv_heads, 16), [])
        assert ragged.attention(rt, kv, kv, backend=backend).values.shape == (0, heads, 16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_k_without_tokens_gives_zero_grads_for_q(backend):
    lq, lk = [3, 4], [0, 0]
    q, k, v = _qkv(lq, lk, 2, 2, 16, _seed("nokeys", backend))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = ragged.varlen_attention(*leaves, _cu(lq), _cu(lk), 4, 0, backend=backend)
    assert torch.equal(out, torch.zeros_like(q))
    dq, dk, dv = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == (0, 2, 16) and dv.shape == (0, 2, 16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_q_without_tokens_gives_zero_grads_for_kv(backend):
    lq, lk = [0, 0], [3, 4]
    q, k, v = _qkv(lq, lk, 2, 2, 16, _seed("noqueries", backend))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = ragged.varlen_attention(*leaves, _cu(lq), _cu(lk), 0, 4, backend=backend)
    assert out.shape == (0, 2, 16)
    dq, dk, dv = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert dq.shape == (0, 2, 16)
    assert torch.equal(dk, torch.zeros_like(k)) and torch.equal(dv, torch.zeros_like(v))


# --------------------------------------------------------------------------------------
# Dropout


def _drawn_seed(manual_seed: int) -> int:
    """The dropout seed a call draws after ``torch.manual_seed(manual_seed)``: one int from
    torch's CPU generator (so that nothing is read from the GPU)."""
    torch.manual_seed(manual_seed)
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())


DROP_CASES = {
    "mixed_gqa": ([5, 0, 31, 12], [5, 0, 31, 12], 4, 2, 32),
    "cross": ([2, 20, 3], [7, 4, 3], 2, 1, 16),
}


@needs_triton
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(DROP_CASES))
def test_dropout_forward(case, causal):
    lq, lk, heads, kv_heads, dim = DROP_CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed("drop", case))
    p = 0.3
    torch.manual_seed(1234)
    out, lse = _run(q, k, v, lq, lk, "triton", causal, dropout_p=p)
    torch.manual_seed(1234)
    again, lse_again = _run(q, k, v, lq, lk, "triton", causal, dropout_p=p)
    assert torch.equal(out, again), "dropout is not reproducible under torch.manual_seed"
    assert torch.equal(lse, lse_again)
    torch.manual_seed(99)
    other, _ = _run(q, k, v, lq, lk, "triton", causal, dropout_p=p)
    assert not torch.equal(out, other), "another seed draws the same dropout"
    plain, plain_lse = _run(q, k, v, lq, lk, "triton", causal)
    assert not torch.allclose(out, plain), "dropout_p = 0.3 changed nothing"
    # lse is the normaliser before dropout
    torch.testing.assert_close(lse, plain_lse, **FWD_TOL)
    assert not torch.isnan(out).any()
    assert torch.all(out[_blind_rows(lq, lk, causal)] == 0)

    from ragged.kernels.triton.attention import dropout_keep_mask

    max_k = max(lk)
    mask = dropout_keep_mask(_drawn_seed(1234), p, _cu(lq), heads, q.shape[0], max_k, q.device)
    assert mask.shape == (heads, q.shape[0], max_k) and mask.dtype == torch.bool
    # the kept fraction is 1 - p within 4 standard deviations of a Bernoulli mean
    assert abs(mask.float().mean().item() - (1 - p)) < 4 * (p * (1 - p) / mask.numel()) ** 0.5
    ref, _ = ragged.reference_attention(q.double(), k.double(), v.double(), _cu(lq), _cu(lk), causal, None,
                                        mask, p)
    torch.testing.assert_close(out.double(), ref, **FWD_TOL)
    exp, _ = _loop_attention(q, k, v, lq, lk, causal, keep=mask, dropout_p=p)
    torch.testing.assert_close(out.double(), exp, **FWD_TOL)
    # the reference backend draws the same mask under the same seed
    torch.manual_seed(1234)
    via_torch, _ = _run(q, k, v, lq, lk, "torch", causal, dropout_p=p)
    torch.testing.assert_close(via_torch.double(), exp, **FWD_TOL)


@needs_triton
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(DROP_CASES))
def test_dropout_backward(case, causal):
    lq, lk, heads, kv_heads, dim = DROP_CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed("drop-bwd", case))
    p = 0.3
    up = _randn(q.shape, _seed("drop-bwd-up", case))

    def kernel(a, b, c):
        torch.manual_seed(77)
        return ragged.varlen_attention(a, b, c, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal, dropout_p=p,
                                       backend="triton")

    from ragged.kernels.triton.attention import dropout_keep_mask

    mask = dropout_keep_mask(_drawn_seed(77), p, _cu(lq), heads, q.shape[0], max(lk), q.device)

    def reference(a, b, c):
        return ragged.reference_attention(a, b, c, _cu(lq), _cu(lk), causal, None, mask, p)[0]

    got = _grads(kernel, q, k, v, up)
    ref = _grads(reference, q.double(), k.double(), v.double(), up.double())
    loop = _grads(lambda a, b, c: _loop_attention(a, b, c, lq, lk, causal, keep=mask, dropout_p=p)[0],
                  q.double(), k.double(), v.double(), up.double())
    again = _grads(kernel, q, k, v, up)
    for name, g, r, lo, a in zip("qkv", got, ref, loop, again):
        assert torch.equal(g, a), f"d{name} is not reproducible"
        torch.testing.assert_close(r, lo, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(g.double(), r.double(), **BWD_TOL, msg=lambda m, n=name: f"d{n}: {m}")


@needs_triton
def test_dropout_mask_statistics():
    """The kernels' keep mask looks independent: at p = 0.5 the kept fraction, and the agreement
    between neighbouring keys, neighbouring queries, two heads and two seeds, are all 1/2
    within 4 standard deviations of a fair coin (a hash with a weak mix fails these)."""
    from ragged.kernels.triton.attention import dropout_keep_mask

    lengths, heads, p = [96, 1, 37, 128], 2, 0.5
    cu, total, max_k = _cu(lengths), sum(lengths), max(lengths)
    a = dropout_keep_mask(_drawn_seed(5), p, cu, heads, total, max_k, torch.device("cpu"))
    b = dropout_keep_mask(_drawn_seed(6), p, cu, heads, total, max_k, torch.device("cpu"))
    valid = torch.cat([torch.arange(max_k) < n for n in lengths for _ in range(n)]).view(total, max_k)

    def fair(x: torch.Tensor, what: str) -> None:
        x = x.float()
        assert abs(x.mean().item() - 0.5) < 4 * (0.25 / x.numel()) ** 0.5, f"{what}: {x.mean().item():.4f}"

    fair(a[:, valid], "kept fraction")
    both = valid[:, 1:] & valid[:, :-1]
    fair((a[:, :, 1:] == a[:, :, :-1])[:, both], "neighbouring keys agree")
    rows = valid[1:] & valid[:-1]
    fair((a[:, 1:] == a[:, :-1])[:, rows], "neighbouring queries agree")
    fair((a[0] == a[1])[valid], "two heads agree")
    fair((a == b)[:, valid], "two seeds agree")


@needs_triton
def test_dropout_reference_backend_without_a_gpu_or_interpreter():
    """The CPU path takes dropout on a machine with neither a GPU nor TRITON_INTERPRET."""
    code = textwrap.dedent("""
        import torch, ragged
        q = torch.randn(7, 2, 16)
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        torch.manual_seed(0)
        a = ragged.varlen_attention(q, q, q, cu, cu, 4, 4, dropout_p=0.25)
        torch.manual_seed(0)
        b = ragged.varlen_attention(q, q, q, cu, cu, 4, 4, dropout_p=0.25)
        assert torch.equal(a, b) and not torch.isnan(a).any()
        print("ok")
    """)
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


# --------------------------------------------------------------------------------------
# torch.compile and the torch.library ops


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph_forward_backward(backend):
    torch._dynamo.reset()
    lq, lk = [3, 0, 9, 5], [6, 2, 9, 0]
    q, k, v = _qkv(lq, lk, 4, 2, 16, _seed("compile", backend))
    cu_q, cu_k = _cu(lq), _cu(lk)

    def f(a, b, c, cq, ck):
        out, lse = ragged.varlen_attention(a, b, c, cq, ck, 9, 9, causal=True, return_lse=True, backend=backend)
        return out * 2, lse

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves, cu_q, cu_k)
    exp, exp_lse = _loop_attention(q, k, v, lq, lk, True)
    torch.testing.assert_close(out.double(), 2 * exp, **FWD_TOL)
    _check_lse(lse, exp_lse, _blind_rows(lq, lk, True))
    up = _randn(q.shape, _seed("compile-up"))
    got = torch.autograd.grad(out, leaves, up)
    ref = _grads(lambda a, b, c: 2 * _loop_attention(a, b, c, lq, lk, True)[0], q, k, v, up)
    for name, g, r in zip("qkv", got, ref):
        torch.testing.assert_close(g.double(), r.double(), **BWD_TOL, msg=lambda m, n=name: f"d{n}: {m}")


@needs_triton
def test_compile_new_lengths_each_call():
    """Training-style use: the lengths and max_seqlen change from call to call."""
    torch._dynamo.reset()

    def f(a, b, c, cq, ck, max_q: int, max_k: int):
        return ragged.varlen_attention(a, b, c, cq, ck, max_q, max_k, causal=True, backend="triton") * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for lq, lk in (([3, 0, 9], [3, 0, 9]), ([5, 2, 20, 1], [4, 2, 21, 0]), ([7, 7], [1, 30])):
        q, k, v = _qkv(lq, lk, 2, 1, 16, _seed("dynamic", lq))
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = compiled(*leaves, _cu(lq), _cu(lk), max(lq), max(lk))
        exp, _ = _loop_attention(q, k, v, lq, lk, True)
        torch.testing.assert_close(out.double(), 2 * exp, **FWD_TOL)
        up = _randn(q.shape, _seed("dynamic-up", lq))
        got = torch.autograd.grad(out, leaves, up)
        ref = _grads(lambda a, b, c, lq=lq, lk=lk: 2 * _loop_attention(a, b, c, lq, lk, True)[0], q, k, v, up)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g.double(), r.double(), **BWD_TOL)


@needs_triton
def test_compile_dropout_draws_a_new_mask_per_call():
    torch._dynamo.reset()
    lq = [3, 0, 9]
    q, k, v = _qkv(lq, lq, 2, 1, 16, _seed("compile-drop"))

    def f(a, b, c, cu):
        return ragged.varlen_attention(a, b, c, cu, cu, 9, 9, dropout_p=0.3, backend="triton")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    first = compiled(q, k, v, _cu(lq))
    second = compiled(q, k, v, _cu(lq))
    assert not torch.equal(first, second), "a compiled call reuses the previous call's dropout mask"
    torch.manual_seed(3)
    assert torch.equal(first, f(q, k, v, _cu(lq))), "compiled and eager draw different masks for one seed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    lq, lk = [3, 0, 9], [4, 2, 9]
    q, k, v = (t.requires_grad_(True) for t in _qkv(lq, lk, 2, 1, 16, _seed("opcheck")))
    torch.library.opcheck(torch.ops.ragged.attention.default,
                          (q, k, v, _cu(lq), _cu(lk), 9, 9, True, 0.25, 0.0, 0, -1, -1, backend))


# --------------------------------------------------------------------------------------
# Property test


@needs_triton
@settings(max_examples=12, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 19), st.integers(0, 19)), min_size=1, max_size=5),
       kv_heads=st.sampled_from([1, 2]), causal=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_triton_random_batches(pairs, kv_heads, causal, seed):
    lq = [a for a, _ in pairs]
    lk = [b for _, b in pairs]
    q, k, v = _qkv(lq, lk, 2, kv_heads, 16, seed)
    out, lse = _run(q, k, v, lq, lk, "triton", causal)
    exp, exp_lse = _loop_attention(q, k, v, lq, lk, causal)
    torch.testing.assert_close(out.double(), exp, **FWD_TOL)
    _check_lse(lse, exp_lse, _blind_rows(lq, lk, causal))


# --------------------------------------------------------------------------------------
# Bad input: a ValueError or TypeError whose message names the function and the argument


VARLEN = "ragged.varlen_attention()"
ATTN = "ragged.attention()"


def _varlen_args(**overrides):
    lq = [3, 5]
    q, k, v = _qkv(lq, lq, 4, 2, 32, 0)
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": _cu(lq), "cu_seqlens_k": _cu(lq), "max_seqlen_q": 5,
            "max_seqlen_k": 5}
    args.update(overrides)
    return args


def _ragged_args(**overrides):
    """q, k, v RaggedTensors (lengths [3, 5]); an override is a tensor of values or any object."""
    lengths = [3, 5]
    q, k, v = _qkv(lengths, lengths, 4, 2, 32, 0)
    values = {"q": q, "k": k, "v": v}
    values.update(overrides)
    return {name: RaggedTensor.from_lengths(t, lengths) if isinstance(t, torch.Tensor) else t
            for name, t in values.items()}


def _raises(exc, fn, *words):
    with pytest.raises(exc) as info:
        fn()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_varlen_batch_sizes_differ():
    for cu_q, cu_k in ((_cu([3, 5]), _cu([8])), (_cu([3, 5, 0]), _cu([3, 5]))):
        args = _varlen_args(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        _raises(ValueError, lambda args=args: ragged.varlen_attention(**args), VARLEN, "cu_seqlens_q",
                "cu_seqlens_k", "batch size")


@pytest.mark.parametrize("kv_heads", [3, 0])
def test_varlen_bad_head_counts(kv_heads):
    k = torch.randn(8, kv_heads, 32)
    _raises(ValueError, lambda: ragged.varlen_attention(**_varlen_args(k=k, v=k.clone())), VARLEN, "heads",
            f"({kv_heads})")


@needs_triton
def test_varlen_head_dim_a_forced_backend_cannot_take():
    q, k, v = (torch.randn(8, 2, 48) for _ in range(3))
    args = _varlen_args(q=q, k=k, v=v)
    _raises(ValueError, lambda: ragged.varlen_attention(**args, backend="triton"), VARLEN, "triton", "head dim",
            "48")
    reasons = ragged.explain("attention", q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], 5, 5, False, 0.0,
                             False)
    assert reasons["torch"] == [] and any("48" in r for r in reasons["triton"])


@needs_triton
def test_varlen_float64_with_triton():
    args = _varlen_args()
    args.update({name: args[name].double() for name in "qkv"})
    _raises(ValueError, lambda: ragged.varlen_attention(**args, backend="triton"), VARLEN, "triton", "float64")


def test_varlen_cuda_backend_on_cpu_tensors():
    _raises(ValueError, lambda: ragged.varlen_attention(**_varlen_args(), backend="cuda"), VARLEN, "cuda")


def test_varlen_head_dims_of_q_and_k_differ():
    k = torch.randn(8, 2, 16)
    _raises(ValueError, lambda: ragged.varlen_attention(**_varlen_args(k=k, v=k.clone())), VARLEN, "head dim")


def test_varlen_k_and_v_differ():
    _raises(ValueError, lambda: ragged.varlen_attention(**_varlen_args(v=torch.randn(8, 2, 16))), VARLEN, "k", "v")


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_varlen_bad_dtypes(which):
    args = _varlen_args()
    args[which] = args[which].half()
    _raises(TypeError, lambda: ragged.varlen_attention(**args), VARLEN, "dtype", "torch.float16")


def test_varlen_integer_inputs():
    ints = _varlen_args(q=torch.ones(8, 4, 32, dtype=torch.int64), k=torch.ones(8, 2, 32, dtype=torch.int64),
                        v=torch.ones(8, 2, 32, dtype=torch.int64))
    _raises(TypeError, lambda: ragged.varlen_attention(**ints), VARLEN, "floating", "torch.int64")


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_varlen_device_mismatch(which):
    args = _varlen_args()
    args[which] = args[which].to("meta")
    _raises(ValueError, lambda: ragged.varlen_attention(**args), VARLEN, "device", "meta")


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
@pytest.mark.parametrize("bad", ["float", "int16", "empty", "2d", "meta"])
def test_varlen_bad_cu_seqlens(which, bad):
    cu = _cu([3, 5])
    value = {"float": cu.float(), "int16": cu.to(torch.int16), "empty": cu[:0], "2d": cu.view(1, 3),
             "meta": cu.to("meta")}[bad]
    exc = TypeError if bad in ("float", "int16") else ValueError
    _raises(exc, lambda: ragged.varlen_attention(**_varlen_args(**{which: value})), VARLEN, which)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_varlen_takes_tensors_only(which):
    args = _varlen_args()
    args[which] = args[which].tolist()
    _raises(TypeError, lambda: ragged.varlen_attention(**args), VARLEN, which)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_varlen_bad_ranks(which):
    args = _varlen_args()
    args[which] = args[which].flatten(1)
    _raises(ValueError, lambda: ragged.varlen_attention(**args), VARLEN, which)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan"), float("inf")])
def test_varlen_bad_dropout_p(p):
    _raises(ValueError, lambda: ragged.varlen_attention(**_varlen_args(), dropout_p=p), VARLEN, "dropout_p")


def test_varlen_dropout_p_not_a_number():
    with pytest.raises((TypeError, ValueError)) as info:
        ragged.varlen_attention(**_varlen_args(), dropout_p="0.1")
    assert VARLEN in str(info.value) and "dropout_p" in str(info.value)


@pytest.mark.parametrize("which", ["max_seqlen_q", "max_seqlen_k"])
@pytest.mark.parametrize("bad", [-1, 2.5, None])
def test_varlen_bad_max_seqlen(which, bad):
    with pytest.raises((TypeError, ValueError)) as info:
        ragged.varlen_attention(**_varlen_args(**{which: bad}))
    assert VARLEN in str(info.value) and which in str(info.value)


def test_varlen_bad_scale():
    _raises(TypeError, lambda: ragged.varlen_attention(**_varlen_args(), scale="0.5"), VARLEN, "scale")


def test_varlen_bad_backend_name():
    _raises(ValueError, lambda: ragged.varlen_attention(**_varlen_args(), backend="flash"), "backend", "flash")


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("bad", ["tensor", "list", "none"])
def test_attention_takes_ragged_tensors_only(which, bad):
    args = _ragged_args()
    args[which] = {"tensor": args[which].values, "list": [1.0], "none": None}[bad]
    _raises(TypeError, lambda: ragged.attention(**args), ATTN, which, "RaggedTensor")


def test_attention_batch_sizes_differ():
    q = RaggedTensor.from_lengths(torch.randn(8, 2, 16), [3, 5])
    k = RaggedTensor.from_lengths(torch.randn(8, 2, 16), [8])
    _raises(ValueError, lambda: ragged.attention(q, k, k), ATTN, "batch size", "2", "1")


def test_attention_k_and_v_sequences_differ():
    q = RaggedTensor.from_lengths(torch.randn(8, 2, 16), [3, 5])
    k = RaggedTensor.from_lengths(torch.randn(8, 2, 16), [3, 5])
    v = RaggedTensor.from_lengths(torch.randn(8, 2, 16), [5, 3])
    _raises(ValueError, lambda: ragged.attention(q, k, v), ATTN, "k and v")


def _attention_bad_input(kind):
    """(exception, call, words the message must hold) for bad input to ragged.attention."""
    if kind == "heads":
        return ValueError, _ragged_args(k=torch.randn(8, 3, 32), v=torch.randn(8, 3, 32)), {}, ("heads",)
    if kind == "head_dim_triton":
        return (ValueError, _ragged_args(**{n: torch.randn(8, 2, 48) for n in "qkv"}), {"backend": "triton"},
                ("head dim", "48", "triton"))
    if kind == "dtype":
        return TypeError, _ragged_args(v=torch.randn(8, 2, 32, dtype=torch.float16)), {}, ("dtype",)
    if kind == "device":
        return ValueError, _ragged_args(k=torch.randn(8, 2, 32, device="meta")), {}, ("device", "meta")
    if kind == "dropout_p":
        return ValueError, _ragged_args(), {"dropout_p": 1.0}, ("dropout_p",)
    if kind == "scale":
        return TypeError, _ragged_args(), {"scale": "0.5"}, ("scale",)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["heads", "head_dim_triton", "dtype", "device", "dropout_p", "scale"])
def test_attention_bad_input_names_attention(kind):
    """Errors raised for ragged.attention name ragged.attention, not a function it calls."""
    if kind == "head_dim_triton" and not TRITON_ON_CPU:
        pytest.skip("the Triton kernels need TRITON_INTERPRET=1 on CPU")
    exc, args, kwargs, words = _attention_bad_input(kind)
    _raises(exc, lambda: ragged.attention(**args, **kwargs), ATTN, *words)


@needs_triton
def test_global_backend_that_cannot_take_the_input():
    args = _ragged_args(**{n: torch.randn(8, 2, 48) for n in "qkv"})
    with ragged.use_backend("triton"):
        _raises(ValueError, lambda: ragged.attention(**args), "head dim", "48", "triton")


def test_reference_under_autocast_computes_in_float32():
    """Autocast must not push the reference's float32 math into bf16 (it raised before)."""
    gen = torch.Generator().manual_seed(11)
    q = ragged.pack([torch.randn(n, 2, 8, generator=gen) for n in (3, 0, 5)])
    k = ragged.pack([torch.randn(n, 2, 8, generator=gen) for n in (4, 2, 5)])
    expected = ragged.attention(q, k, k, causal=True, backend="torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ragged.attention(q, k, k, causal=True, backend="torch")
    assert got.values.dtype == torch.float32
    torch.testing.assert_close(got.values, expected.values)
