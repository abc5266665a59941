"""Masked positions stay masked on the GPU: sequences of one key (or none) with large scores,
for the Triton kernels (forward and backward), the CUDA short-sequence kernel (forward only)
and ``backend="auto"``, against the float64 reference.

The failure this guards against: a key column past a sequence's end loads as K = V = 0 and,
left in P, gets ``p = exp(-lse)``; with a very negative ``lse`` the backward's ``dS`` overflows
when cast to float16 (or ``p`` itself passes float32's range) and ``inf * 0`` gives NaN in dQ.
The shape is flash-attn's varlen overflow case: queries 76, 34 and 146 over one key each,
``max_seqlen_q = 256``, ``max_seqlen_k = 3``, q / k / v ~ 3 * randn. ``test_attention_masking.py``
runs the same cases at interpreter sizes on the CPU.

Error rule (flash-attn's): the largest error against float64 at most twice that of the
reference run in the input dtype, plus one unit in the last place of the largest value. Every
output and gradient is also checked for NaN and inf. Run with ``pytest -m gpu``.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_attention_masking import _AMPLITUDE, _FEW_KEYS, MASKS, _check, _check_lse, _leaves, _seed

import ragged
from ragged import backends
from ragged.kernels.cuda import ATTENTION_SHORT_HEAD_DIMS, ATTENTION_SHORT_MAX_LEN
from ragged.kernels.triton import ATTENTION_HEAD_DIMS

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
DTYPES = [torch.float16, torch.bfloat16]
ONE_KEY_Q, ONE_KEY_K, ONE_KEY_MAX = [76, 34, 146], [1, 1, 1], (256, 3)
# The one-key sequences with a query-only one (no key), a key-only one, a longer pair and a
# 2-key one; the hints above every length.
MIXED_Q = [76, 34, 146, 9, 0, 70, 3]
MIXED_K = [1, 1, 1, 0, 4, 67, 2]
MIXED_MAX = (256, 80)
# The same within the CUDA short-sequence kernel's reach (at most 128 tokens a sequence).
SHORT_Q = [76, 34, 127, 9, 0, 70, 3]
SHORT_K = [1, 1, 1, 0, 4, 67, 2]
SHORT_MAX = (128, 80)
# Many short sequences of 0..2 keys: the CUDA kernel's pipelined path (one block per sequence
# and four heads) takes batches of at least 16 (sequence, head) pairs per multiprocessor.
_rng = random.Random(0)
MANY_Q = [_rng.randint(1, 32) for _ in range(1200)]
MANY_K = [_rng.choice([0, 1, 1, 2, 5, 32]) for _ in MANY_Q]
MANY_MAX = (32, 32)
# the masks, amplitudes and checks are the CPU tests' (tests/test_attention_masking.py)


def _cu(lengths) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEVICE)


def _inputs(lq, lk, heads, kv_heads, dim, dtype, seed, amplitude=None, values=1.0):
    """q, k, v and an upstream gradient (float64 draws cast to ``dtype``); the query rows of the
    sequences with at most _FEW_KEYS keys and their keys scaled by ``amplitude`` (default
    _AMPLITUDE[dtype]), their values by ``values``."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(sum(lq), heads, dim, generator=g, dtype=torch.float64, device=DEVICE)
    k = torch.randn(sum(lk), kv_heads, dim, generator=g, dtype=torch.float64, device=DEVICE)
    v = torch.randn(sum(lk), kv_heads, dim, generator=g, dtype=torch.float64, device=DEVICE)
    do = torch.randn(sum(lq), heads, dim, generator=g, dtype=torch.float64, device=DEVICE)
    amp = _AMPLITUDE[dtype] if amplitude is None else amplitude
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for b, n in enumerate(lk):
        if n <= _FEW_KEYS:
            q[cq[b] : cq[b + 1]] *= amp
            k[ck[b] : ck[b + 1]] *= amp
            v[ck[b] : ck[b + 1]] *= values
    return q.to(dtype), k.to(dtype), v.to(dtype), do.to(dtype)


def _run(backend, q, k, v, do, cu_q, cu_k, max_q, max_k, causal, window, grad=True):
    """``(out, lse, dq, dk, dv)`` through the public API (gradients None without ``grad``)."""
    if not grad:
        with torch.no_grad():
            out, lse = ragged.varlen_attention(
                q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True, backend=backend, window_size=window
            )
        return out, lse, None, None, None
    a, b, c = _leaves(q, k, v)
    out, lse = ragged.varlen_attention(
        a, b, c, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True, backend=backend, window_size=window
    )
    out.backward(do)
    return out.detach(), lse, a.grad, b.grad, c.grad


def _low(q, k, v, do, lq, lk, causal, window):
    a, b, c = _leaves(q, k, v)
    out, _ = ragged.reference_attention(a, b, c, _cu(lq), _cu(lk), causal, compute_dtype=q.dtype, window_size=window)
    out.backward(do)
    return out.detach(), a.grad, b.grad, c.grad


def _exact(q, k, v, do, lq, lk, causal, window, grad=True):
    """``(out, lse, dq, dk, dv)`` in float64 (``(out, lse)`` without ``grad``)."""
    args = [t.double() for t in (q, k, v)]
    out, lse = ragged.reference_attention(*args, _cu(lq), _cu(lk), causal, window_size=window)
    if not grad:
        return out, lse
    grads = ragged.reference_attention_backward(do.double(), *args, _cu(lq), _cu(lk), causal, window_size=window)
    return (out, lse, *grads)


def _zero_where_unseen(lq, lk, got, what):
    out, dq, dk, dv = got
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for b, (nq, nk) in enumerate(zip(lq, lk)):
        if nk == 0:
            assert torch.all(out[cq[b] : cq[b + 1]] == 0), (what, "out", b)
            if dq is not None:
                assert torch.all(dq[cq[b] : cq[b + 1]] == 0), (what, "dq", b)
        if nq == 0 and dk is not None:
            assert torch.all(dk[ck[b] : ck[b + 1]] == 0) and torch.all(dv[ck[b] : ck[b + 1]] == 0), (what, "dk/dv", b)


def _auto_choice(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, grad):
    return backends.select(
        "attention", "auto", q.device, q, k, v, cu_q, cu_k, max_q, max_k, causal, 0.0, grad, window
    ).backend


def _skip_unless_taken(backend, q, k, v, cu_q, cu_k, max_q, max_k, causal, window, grad):
    """Skip where a forced backend cannot take the input (the CUDA kernel's head dims, windows,
    gradients; a GPU older than it needs)."""
    if backend == "auto":
        return
    reasons = ragged.explain("attention", q, k, v, cu_q, cu_k, max_q, max_k, causal, 0.0, grad, window)[backend]
    if reasons:
        pytest.skip("; ".join(reasons))


@pytest.mark.parametrize("backend", ["triton", "auto"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dim", [16, 32, 64])
def test_one_key_per_sequence_float16(dim, causal, backend):
    """Queries of 76, 34 and 146 tokens over one key each, float16, q / k / v ~ 3 * randn: a very
    negative lse makes exp(s - lse) of an unmasked column past the keys overflow dS."""
    dtype = torch.float16
    q, k, v, do = _inputs(ONE_KEY_Q, ONE_KEY_K, 4, 4, dim, dtype, _seed("one-key", dim, causal), 3.0, 3.0)
    cu_q, cu_k = _cu(ONE_KEY_Q), _cu(ONE_KEY_K)
    what = f"one key D={dim} causal={causal} {backend}"
    if backend == "auto":  # gradients are needed: the backend that has a backward
        assert _auto_choice(q, k, v, cu_q, cu_k, *ONE_KEY_MAX, causal, (-1, -1), True) == "triton"
    out, lse, dq, dk, dv = _run(backend, q, k, v, do, cu_q, cu_k, *ONE_KEY_MAX, causal, (-1, -1))
    exact = _exact(q, k, v, do, ONE_KEY_Q, ONE_KEY_K, causal, (-1, -1))
    _check((out, dq, dk, dv), _low(q, k, v, do, ONE_KEY_Q, ONE_KEY_K, causal, (-1, -1)), exact[:1] + exact[2:], what)
    _check_lse(lse, exact[1], what)


# Every head dim in float16; bfloat16 at two (each (dtype, head dim, mask) compiles its own kernels,
# which is most of this file's time on a GPU). "auto" picks the Triton kernels when gradients are
# needed, which test_one_key_per_sequence_float16 checks.
MASK_CASES = [(torch.float16, d) for d in ATTENTION_HEAD_DIMS] + [
    (torch.bfloat16, d) for d in (32, 128) if d in ATTENTION_HEAD_DIMS
]


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype, dim", MASK_CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_masks_with_gradients(dtype, dim, mask, backend="triton"):
    """Every head dim of the Triton kernels, float16 and bfloat16, full, causal and window masks,
    GQA (4 query heads over 2), over 0-, 1-, 2-key and longer sequences; forward and backward."""
    causal, window = MASKS[mask]
    q, k, v, do = _inputs(MIXED_Q, MIXED_K, 4, 2, dim, dtype, _seed("masks", dtype, dim, mask))
    cu_q, cu_k = _cu(MIXED_Q), _cu(MIXED_K)
    what = f"{mask} D={dim} {dtype} {backend}"
    if backend == "auto":
        assert _auto_choice(q, k, v, cu_q, cu_k, *MIXED_MAX, causal, window, True) == "triton"
    out, lse, dq, dk, dv = _run(backend, q, k, v, do, cu_q, cu_k, *MIXED_MAX, causal, window)
    exact = _exact(q, k, v, do, MIXED_Q, MIXED_K, causal, window)
    _check((out, dq, dk, dv), _low(q, k, v, do, MIXED_Q, MIXED_K, causal, window), exact[:1] + exact[2:], what)
    _check_lse(lse, exact[1], what)
    _zero_where_unseen(MIXED_Q, MIXED_K, (out, dq, dk, dv), what)


@pytest.mark.parametrize("lengths", ["short", "many"])
@pytest.mark.parametrize("backend", ["cuda", "auto"])  # the Triton forward: test_masks_with_gradients
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dim", sorted(set(ATTENTION_SHORT_HEAD_DIMS) | {16}))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_without_gradients(dtype, dim, causal, backend, lengths):
    """Inference: "auto" takes the CUDA short-sequence kernel where it was measured faster (up to 64
    tokens, or 128 at head dims up to 64), Triton elsewhere; both keep the few-key sequences finite."""
    lq, lk, (max_q, max_k) = {"short": (SHORT_Q, SHORT_K, SHORT_MAX), "many": (MANY_Q, MANY_K, MANY_MAX)}[lengths]
    assert max(lq) <= max_q <= ATTENTION_SHORT_MAX_LEN and max(lk) <= max_k <= ATTENTION_SHORT_MAX_LEN
    q, k, v, do = _inputs(lq, lk, 4, 2, dim, dtype, _seed("fwd", dtype, dim, causal, lengths))
    cu_q, cu_k = _cu(lq), _cu(lk)
    _skip_unless_taken(backend, q, k, v, cu_q, cu_k, max_q, max_k, causal, (-1, -1), False)
    what = f"{lengths} D={dim} causal={causal} {dtype} {backend}"
    longest = max(max_q, max_k)
    if backend == "auto" and dim in ATTENTION_SHORT_HEAD_DIMS and (longest <= 64 or (dim <= 64 and longest <= 128)):
        # where "auto" ranks the CUDA kernel first (ragged/ops/attention.py, measured)
        assert _auto_choice(q, k, v, cu_q, cu_k, max_q, max_k, causal, (-1, -1), False) == "cuda"
    out, lse, *_ = _run(backend, q, k, v, do, cu_q, cu_k, max_q, max_k, causal, (-1, -1), grad=False)
    exact = _exact(q, k, v, do, lq, lk, causal, (-1, -1), grad=False)
    low = ragged.reference_attention(q, k, v, cu_q, cu_k, causal, compute_dtype=dtype)[0]
    _check((out,), (low,), exact[:1], what)
    _check_lse(lse, exact[1], what)
    _zero_where_unseen(lq, lk, (out, None, None, None), what)


@pytest.mark.parametrize("mask", ["full", "right", "both", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_spare_rows_past_the_last_offset(dtype, mask):
    """A graphed bucket's layout through the public API (CUDA offsets are not read, so
    ``offsets[-1] < T`` is taken): NaN rows past the last offset in q, k, v and the upstream
    gradient never reach a real row's output or gradient."""
    causal, window = MASKS[mask]
    q, k, v, do = _inputs(MIXED_Q, MIXED_K, 4, 2, 64, dtype, _seed("spare", dtype, mask))
    nq, nk, spare = q.shape[0], k.shape[0], 11

    def padded(x):
        return torch.cat([x, torch.full((spare, *x.shape[1:]), float("nan"), dtype=x.dtype, device=DEVICE)])

    cu_q, cu_k = _cu(MIXED_Q), _cu(MIXED_K)
    out, lse, dq, dk, dv = _run(
        "triton", padded(q), padded(k), padded(v), padded(do), cu_q, cu_k, *MIXED_MAX, causal, window
    )
    what = f"{mask} {dtype} spare rows"
    exact = _exact(q, k, v, do, MIXED_Q, MIXED_K, causal, window)
    _check(
        (out[:nq], dq[:nq], dk[:nk], dv[:nk]),
        _low(q, k, v, do, MIXED_Q, MIXED_K, causal, window),
        exact[:1] + exact[2:],
        what,
    )
    _check_lse(lse[:nq], exact[1], what)
