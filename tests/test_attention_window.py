"""Sliding-window attention (``window_size=(left, right)``) on CPU.

The oracle is written here from the definition alone: query ``i`` of a sequence, at aligned
position ``a = i + Lk - Lq``, sees key ``j`` iff ``a - left <= j <= a + right`` (a side of ``-1``
bounds nothing) and, with ``causal``, ``j <= a``; the mask is built one entry at a time and
attention computed from it in float64 (zeros and ``lse = -inf`` for a query that sees no key).
``ragged.reference_attention`` (and its written-out backward) is checked against it, then every
backend that takes CPU tensors (Triton through the interpreter, see ``conftest.py``) against
both. Sizes stay small for the interpreter; the interpreter's tiles are 16 x 16, so a
97-token sequence spans seven blocks and the windows below have masked and unmasked blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib

import pytest
import torch
from conftest import TRITON_ON_CPU, cpu_backends
from hypothesis import given, settings
from hypothesis import strategies as st

import ragged
from ragged import backends

BACKENDS = cpu_backends()
needs_triton = pytest.mark.skipif(not TRITON_ON_CPU, reason="the Triton kernels need TRITON_INTERPRET=1 on CPU")

FWD_TOL = {"atol": 2e-5, "rtol": 2e-5}
BWD_TOL = {"atol": 1e-4, "rtol": 1e-4}

# name: (query lengths, key lengths, H, H_kv, D, windows)
CASES = {
    "gqa": ([5, 0, 35, 1, 12], [5, 0, 35, 1, 12], 2, 1, 16, [(0, 0), (3, -1), (-1, 2), (2, 5), (100, 100)]),
    "long": ([97], [97], 1, 1, 16, [(20, 17), (40, -1), (-1, 33)]),
    "q_shorter": ([2, 7, 1, 16], [5, 19, 3, 33], 2, 2, 32, [(0, 0), (2, 5), (-1, 2)]),
    "q_longer": ([5, 20, 3, 33], [2, 7, 3, 17], 2, 1, 16, [(0, 0), (3, -1), (2, 5)]),
    "lengths_0_1": ([0, 1, 3, 0, 1], [4, 1, 0, 0, 2], 2, 2, 16, [(0, 0), (1, 1)]),
}
PARAMS = [(case, window) for case, spec in CASES.items() for window in spec[5]]


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def _cu(lengths, dtype=torch.int32):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype)


def _randn(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _qkv(lq, lk, heads, kv_heads, dim, seed, dtype=torch.float32):
    return (
        _randn((sum(lq), heads, dim), seed, dtype),
        _randn((sum(lk), kv_heads, dim), seed + 1, dtype),
        _randn((sum(lk), kv_heads, dim), seed + 2, dtype),
    )


@functools.cache
def _sees(nq: int, nk: int, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """[nq, nk] bool from the definition, one entry at a time (not to be written to)."""
    left, right = window
    out = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        a = i + nk - nq
        for j in range(nk):
            out[i, j] = (not causal or j <= a) and (left < 0 or j >= a - left) and (right < 0 or j <= a + right)
    return out


def _oracle(q, k, v, lq, lk, causal, window, scale=None, keep=None, dropout_p=0.0):
    """float64 ``(out [Tq, H, D], lse [Tq, H])`` from the mask of :func:`_sees`; differentiable in
    q, k, v (rows that see no key give zeros and no gradient). ``keep``: ``[H, Tq, >= max Lk]``
    dropout keep mask."""
    heads, dim = q.shape[1], q.shape[2]
    group = heads // k.shape[1]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    outs, lses = [], []
    tq = tk = 0
    for nq, nk in zip(lq, lk):
        qb = q[tq : tq + nq].double().transpose(0, 1)
        kb = k[tk : tk + nk].double().transpose(0, 1).repeat_interleave(group, 0)
        vb = v[tk : tk + nk].double().transpose(0, 1).repeat_interleave(group, 0)
        seen = _sees(nq, nk, causal, window)
        blind = ~seen.any(1)
        scores = torch.matmul(qb, kb.transpose(1, 2)) * scale
        lse = (
            torch.logsumexp(scores.masked_fill(~seen, float("-inf")), dim=-1)
            if nk
            else torch.full((heads, nq), float("-inf"), dtype=torch.float64)
        )
        # blind rows take a finite softmax of their raw scores, then a zero weight
        probs = torch.softmax(scores.masked_fill(~seen & ~blind[:, None], float("-inf")), dim=-1)
        probs = probs * (~blind)[:, None].double()
        if keep is not None:
            probs = probs * keep[:, tq : tq + nq, :nk].double() / (1.0 - dropout_p)
        outs.append(torch.matmul(probs, vb).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
        tq += nq
        tk += nk
    if not outs:
        return q.double() * 0, torch.zeros(q.shape[:2], dtype=torch.float64)
    return torch.cat(outs), torch.cat(lses)


def _blind(lq, lk, causal, window) -> torch.Tensor:
    rows = [~_sees(nq, nk, causal, window).any(1) for nq, nk in zip(lq, lk)]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.bool)


def _grads(fn, q, k, v, upstream):
    """Gradients of ``<fn(q, k, v), upstream>`` with respect to fresh leaves."""
    return _forward_and_grads(lambda a, b, c: (fn(a, b, c), None), q, k, v, upstream)[2]


def _forward_and_grads(fn, q, k, v, upstream):
    """``(out, lse, grads)`` of ``fn(q, k, v) -> (out, lse)`` with gradients of ``<out, upstream>``
    (one forward for both)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, upstream.to(out.dtype), allow_unused=True)
    return out.detach(), lse, tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))


def _run(q, k, v, lq, lk, backend, causal, window, **kwargs):
    return ragged.varlen_attention(
        q,
        k,
        v,
        _cu(lq),
        _cu(lk),
        max(lq, default=0),
        max(lk, default=0),
        causal=causal,
        return_lse=True,
        backend=backend,
        window_size=window,
        **kwargs,
    )


def _check(out, lse, exp, exp_lse, blind, tol=FWD_TOL):
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), exp, **tol)
    assert torch.all(out[blind] == 0), "a query that sees no key must get zeros"
    assert lse.dtype == torch.float32 and lse.shape == exp_lse.shape
    assert torch.all(torch.isneginf(lse[blind])), "a query that sees no key must get lse = -inf"
    assert torch.all(torch.isfinite(lse[~blind]))
    torch.testing.assert_close(lse[~blind].double(), exp_lse[~blind], **tol)


def _check_grads(got, ref, tol=BWD_TOL):
    for name, g, r in zip("qkv", got, ref):
        assert not torch.isnan(g).any(), f"d{name} has NaN"
        torch.testing.assert_close(g.double(), r.double(), **tol, msg=lambda m, n=name: f"d{n}: {m}")


# --------------------------------------------------------------------------------------
# The oracle and the reference


def test_oracle_on_a_hand_case():
    """The module docstring's picture (Lq = Lk = 5, window (1, 2)) and a causal window with Lq > Lk."""
    rows = ["xxx..", "xxxx.", ".xxxx", "..xxx", "...xx"]
    assert _sees(5, 5, False, (1, 2)).tolist() == [[c == "x" for c in r] for r in rows]
    # Lq = 4, Lk = 2, causal, left 0: aligned positions -2, -1, 0, 1 -> q2 sees k0, q3 sees k1
    assert _sees(4, 2, True, (0, -1)).tolist() == [[False, False], [False, False], [True, False], [False, True]]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("case", "window"), PARAMS)
def test_reference_matches_the_definition(case, window, causal):
    lq, lk, heads, kv_heads, dim, _ = CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed(case, "ref"), torch.float64)
    cu_q, cu_k = _cu(lq), _cu(lk)
    exp, exp_lse = _oracle(q, k, v, lq, lk, causal, window)
    out, lse = ragged.reference_attention(q, k, v, cu_q, cu_k, causal, window_size=window)
    blind = _blind(lq, lk, causal, window)
    torch.testing.assert_close(out, exp, atol=1e-12, rtol=1e-12)
    assert torch.all(out[blind] == 0) and torch.all(torch.isneginf(lse[blind]))
    torch.testing.assert_close(lse[~blind].double(), exp_lse[~blind], atol=1e-6, rtol=1e-6)
    up = _randn(q.shape, _seed(case, "ref-up"), torch.float64)
    ref = _grads(lambda a, b, c: _oracle(a, b, c, lq, lk, causal, window)[0], q, k, v, up)
    auto = _grads(
        lambda a, b, c: ragged.reference_attention(a, b, c, cu_q, cu_k, causal, window_size=window)[0], q, k, v, up
    )
    written = ragged.reference_attention_backward(up, q, k, v, cu_q, cu_k, causal, window_size=window)
    for name, a, w, r in zip("qkv", auto, written, ref):
        torch.testing.assert_close(a, r, atol=1e-10, rtol=1e-10, msg=lambda m, n=name: f"autograd d{n}: {m}")
        torch.testing.assert_close(w, r, atol=1e-10, rtol=1e-10, msg=lambda m, n=name: f"written d{n}: {m}")


@settings(max_examples=40, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=1, max_size=4),
    left=st.integers(-1, 14),
    right=st.integers(-1, 14),
    causal=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_effective_window_masks_the_same_keys(pairs, left, right, causal, seed):
    """effective_window drops exactly the sides that bound nothing: the mask is unchanged, and a
    side it keeps bounds some key of a sequence of the longest lengths."""
    from ragged.ops.attention import effective_window

    lq = [a for a, _ in pairs]
    lk = [b for _, b in pairs]
    max_q, max_k = max(lq), max(lk)
    eff = effective_window((left, right), causal, max_q, max_k)
    for nq, nk in zip(lq, lk):
        assert torch.equal(_sees(nq, nk, causal, (left, right)), _sees(nq, nk, causal, eff))
    if eff[0] >= 0:
        assert not _sees(max_k, max_k, False, (eff[0], -1)).all()
    if eff[1] >= 0:
        assert not causal and not _sees(max_q, max_q, False, (-1, eff[1])).all()
    q, k, v = _qkv(lq, lk, 2, 1, 8, seed % 10_000, torch.float64)
    out, lse = ragged.reference_attention(q, k, v, _cu(lq), _cu(lk), causal, window_size=(left, right))
    exp, _ = _oracle(q, k, v, lq, lk, causal, (left, right))
    torch.testing.assert_close(out, exp, atol=1e-12, rtol=1e-12)


# --------------------------------------------------------------------------------------
# Every backend against the definition


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("case", "window"), PARAMS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_forward_and_backward(backend, case, window, causal):
    lq, lk, heads, kv_heads, dim, _ = CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed(case, window, "run"))
    up = _randn(q.shape, _seed(case, window, "up"))
    out, lse, got = _forward_and_grads(lambda a, b, c: _run(a, b, c, lq, lk, backend, causal, window), q, k, v, up)
    exp, exp_lse = _oracle(q, k, v, lq, lk, causal, window)
    blind = _blind(lq, lk, causal, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    _check(out, lse, exp, exp_lse, blind)
    ref = _grads(lambda a, b, c: _oracle(a, b, c, lq, lk, causal, window)[0], q, k, v, up)
    _check_grads(got, ref)
    assert torch.all(got[0][blind] == 0), "queries that see no key get no gradient"


@needs_triton
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("case", "window"), PARAMS)
def test_fused_backward_with_windows(case, window, causal):
    """The fused backward (dQ from the key-block kernel) under every window of the cases."""
    from ragged import backends

    lq, lk, heads, kv_heads, dim, _ = CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed(case, window, "fused"))
    up = _randn(q.shape, _seed(case, window, "fused-up"))
    with backends.prefer("attention", "triton_fused_bwd"):
        _, _, got = _forward_and_grads(lambda a, b, c: _run(a, b, c, lq, lk, "triton", causal, window), q, k, v, up)
    ref = _grads(lambda a, b, c: _oracle(a, b, c, lq, lk, causal, window)[0], q, k, v, up)
    _check_grads(got, ref)
    assert torch.all(got[0][_blind(lq, lk, causal, window)] == 0), "queries that see no key get no gradient"


@pytest.mark.parametrize("backend", BACKENDS)
def test_windows_at_the_edges_of_the_sequences(backend):
    """Windows one short of, and exactly at, the widths that bound nothing (Lk - 1 on the left,
    Lq - 1 on the right, per sequence and for the longest), with queries longer and shorter
    than their keys."""
    lq, lk = [9, 4, 6], [6, 11, 6]
    q, k, v = _qkv(lq, lk, 2, 1, 16, _seed("edges", backend))
    lefts = [((left, -1), causal) for left in (4, 5, 9, 10) for causal in (False, True)]
    rights = [((-1, right), False) for right in (3, 4, 7, 8)]  # causal: the right side is 0 whatever it says
    for window, causal in lefts + rights:
        out, lse = _run(q, k, v, lq, lk, backend, causal, window)
        exp, exp_lse = _oracle(q, k, v, lq, lk, causal, window)
        _check(out, lse, exp, exp_lse, _blind(lq, lk, causal, window))


@needs_triton
@settings(max_examples=6, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 33), st.integers(0, 33)), min_size=1, max_size=3),
    left=st.integers(-1, 34),
    right=st.integers(-1, 34),
    causal=st.booleans(),
    kv_heads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_triton_random_windows(pairs, left, right, causal, kv_heads, seed):
    lq = [a for a, _ in pairs]
    lk = [b for _, b in pairs]
    window = (left, right)
    q, k, v = _qkv(lq, lk, 2, kv_heads, 16, seed % 100_000)
    up = _randn(q.shape, seed % 100_000 + 7)
    out, lse, got = _forward_and_grads(lambda a, b, c: _run(a, b, c, lq, lk, "triton", causal, window), q, k, v, up)
    exp, exp_lse = _oracle(q, k, v, lq, lk, causal, window)
    _check(out, lse, exp, exp_lse, _blind(lq, lk, causal, window))
    ref = _grads(lambda a, b, c: _oracle(a, b, c, lq, lk, causal, window)[0], q, k, v, up)
    _check_grads(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_and_the_ragged_form(backend):
    lengths = [7, 0, 30, 1]
    q, k, v = _qkv(lengths, lengths, 2, 1, 32, _seed("scale", backend))
    out, lse = _run(q, k, v, lengths, lengths, backend, False, (4, 1), scale=0.37)
    exp, exp_lse = _oracle(q, k, v, lengths, lengths, False, (4, 1), scale=0.37)
    _check(out, lse, exp, exp_lse, _blind(lengths, lengths, False, (4, 1)))
    rq, rk, rv = (ragged.RaggedTensor.from_lengths(t, lengths) for t in (q, k, v))
    rout, rlse = ragged.attention(rq, rk, rv, causal=True, return_lse=True, backend=backend, window_size=[6, 3])
    exp, exp_lse = _oracle(q, k, v, lengths, lengths, True, (6, 3))
    assert torch.equal(rout.offsets, rq.offsets)
    _check(rout.values, rlse, exp, exp_lse, _blind(lengths, lengths, True, (6, 3)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_padding_packed_away(backend):
    """q, k, v packed from padded batches whose padding is NaN."""
    lq, lk = [4, 0, 13, 7], [6, 2, 13, 0]
    padded = [_randn((4, 16, 2, 16), _seed("pad", i)) for i in range(3)]
    for x, lengths in zip(padded, (lq, lk, lk)):
        for b, n in enumerate(lengths):
            x[b, n:] = float("nan")
    q, k, v = (ragged.pack(x, lengths=n) for x, n in zip(padded, (lq, lk, lk)))
    for causal, window in ((False, (2, 1)), (True, (3, -1))):
        out = ragged.attention(q, k, v, causal=causal, backend=backend, window_size=window)
        exp, _ = _oracle(q.values, k.values, v.values, lq, lk, causal, window)
        assert not torch.isnan(out.values).any()
        torch.testing.assert_close(out.values.double(), exp, **FWD_TOL)


# --------------------------------------------------------------------------------------
# Dropout with a window


def _drawn_seed(manual_seed: int) -> int:
    """The dropout seed a call draws after ``torch.manual_seed(manual_seed)``."""
    torch.manual_seed(manual_seed)
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())


@needs_triton
@pytest.mark.parametrize(("causal", "window"), [(False, (3, 2)), (True, (4, -1))], ids=["window", "causal_window"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout(backend, causal, window):
    """The Triton kernels and the torch backend drop the entries of the kernels' keep mask (the
    reference draws it with the kernels' hash under the interpreter)."""
    from ragged.ops.attention_reference import reference_dropout_mask

    lq, lk = [5, 0, 19, 2], [9, 3, 19, 0]
    q, k, v = _qkv(lq, lk, 2, 1, 16, _seed("drop", window))
    p = 0.3
    mask = reference_dropout_mask(_drawn_seed(55), p, _cu(lq), 2, q.shape[0], max(lk), q.device)

    def kernel(a, b, c):
        torch.manual_seed(55)
        return _run(a, b, c, lq, lk, backend, causal, window, dropout_p=p)

    up = _randn(q.shape, _seed("drop-up", window))
    out, lse, got = _forward_and_grads(kernel, q, k, v, up)
    exp, exp_lse = _oracle(q, k, v, lq, lk, causal, window, keep=mask, dropout_p=p)
    _check(out, lse, exp, exp_lse, _blind(lq, lk, causal, window))
    ref = _grads(lambda a, b, c: _oracle(a, b, c, lq, lk, causal, window, keep=mask, dropout_p=p)[0], q, k, v, up)
    _check_grads(got, ref)


# --------------------------------------------------------------------------------------
# The op and its implementations


@pytest.mark.parametrize("backend", BACKENDS)
def test_implementations_take_any_window_and_default_to_none(backend):
    """Called straight (as the layer core calls them), the implementations take windows that
    the public functions would have simplified (a right side under causal, sides wider than
    every sequence) and mask the same keys; leaving the window out is no window."""
    from ragged.ops.attention import ATTENTION, AttentionArgs, AttentionBackwardInputs

    impl = backends.implementation("attention", backend)
    lengths = [7, 20, 0, 3]
    q, k, v = _qkv(lengths, lengths, 2, 2, 16, _seed("impl", backend))
    cu = _cu(lengths)
    do = _randn(q.shape, _seed("impl-do", backend))
    args = AttentionArgs(q=q, k=k, v=v, cu_q=cu, cu_k=cu, max_q=20, max_k=20, causal=True, scale=0.25)
    plain = impl.forward_fn(args)
    none = impl.forward_fn(args._replace(window_left=-1, window_right=-1))
    wide = impl.forward_fn(args._replace(window_left=19, window_right=7))  # bounds nothing: 19 >= max_k - 1
    for a, b, c in zip(plain, none, wide):
        assert torch.equal(a, b) and torch.equal(a, c)
    exp, _ = _oracle(q, k, v, lengths, lengths, True, (-1, -1), scale=0.25)
    torch.testing.assert_close(plain.out.double(), exp, **FWD_TOL)
    windowed = args._replace(window_left=2, window_right=5)  # causal: the right side is 0
    out, lse = impl.forward_fn(windowed)
    exp, exp_lse = _oracle(q, k, v, lengths, lengths, True, (2, 0), scale=0.25)
    _check(out, lse, exp, exp_lse, _blind(lengths, lengths, True, (2, 0)))
    got = ATTENTION.call_backward(windowed, AttentionBackwardInputs(grad_out=do, out=out, lse=lse), backend)
    ref = ragged.reference_attention_backward(
        do.double(), q.double(), k.double(), v.double(), cu, cu, True, 0.25, window_size=(2, 0)
    )
    _check_grads(got[:3], ref)
    no_window = impl.backward_fn(args, AttentionBackwardInputs(grad_out=do, out=plain.out, lse=plain.lse))
    ref = ragged.reference_attention_backward(do.double(), q.double(), k.double(), v.double(), cu, cu, True, 0.25)
    _check_grads(no_window[:3], ref)


@pytest.mark.parametrize("backend", BACKENDS[-1:])  # one backend: the fake and the schema are the op's
def test_opcheck(backend):
    lq, lk = [3, 0, 9], [4, 2, 9]
    q, k, v = (t.requires_grad_(True) for t in _qkv(lq, lk, 2, 1, 16, _seed("opcheck")))
    torch.library.opcheck(
        torch.ops.ragged.attention.default,
        (q, k, v, _cu(lq), _cu(lk), 9, 9, False, 0.25, 0.0, 0, 2, 1, None, None, backend),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph_forward_backward(backend):
    torch._dynamo.reset()
    lq, lk = [3, 0, 19, 5], [6, 2, 19, 0]
    q, k, v = _qkv(lq, lk, 4, 2, 16, _seed("compile", backend))
    window = (3, 2)

    def f(a, b, c, cq, ck):
        out, lse = ragged.varlen_attention(
            a, b, c, cq, ck, 19, 19, return_lse=True, backend=backend, window_size=window
        )
        return out * 2, lse

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves, _cu(lq), _cu(lk))
    exp, exp_lse = _oracle(q, k, v, lq, lk, False, window)
    _check(out / 2, lse, exp, exp_lse, _blind(lq, lk, False, window))
    up = _randn(q.shape, _seed("compile-up"))
    got = torch.autograd.grad(out, leaves, up)
    ref = _grads(lambda a, b, c: 2 * _oracle(a, b, c, lq, lk, False, window)[0], q, k, v, up)
    _check_grads(got, ref)


@needs_triton
def test_triton_skips_key_blocks_outside_every_window():
    """Blocks outside the window are never read, not read and masked: a NaN in the values of
    the last key poisons (through 0 * NaN in P V) only the query blocks whose span of key
    blocks reaches it; a NaN in the last query (and its upstream gradient) only the key blocks
    whose span of query blocks reaches it."""
    from ragged.kernels.triton import attention as ka

    n, window = 97, (2, 1)
    block_m, block_n = ka._fwd_config(16, n, n, False, torch.float32, True)[:2]
    (kv_m, kv_n, *_), (dq_m, dq_n, *_) = ka._bwd_config(16, n, n, False, torch.float32, True)
    q, k, v = _qkv([n], [n], 1, 1, 16, _seed("skip"))
    up = _randn(q.shape, _seed("skip-up"))
    exp, _ = _oracle(q, k, v, [n], [n], False, window)
    ref = _grads(lambda a, b, c: _oracle(a, b, c, [n], [n], False, window)[0], q, k, v, up)

    def call(a, b, c):
        return ragged.varlen_attention(a, b, c, _cu([n]), _cu([n]), n, n, backend="triton", window_size=window)

    # the query rows whose blocks end before the window of their last row reaches the last key block
    last_key_block = ((n - 1) // block_n) * block_n
    clean_rows = ((last_key_block - window[1]) // block_m) * block_m
    clean_dq = ((last_key_block - window[1]) // dq_m) * dq_m
    assert clean_rows >= 48 and clean_dq >= 48
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[-1], v_bad[-1] = float("nan"), float("nan")
    out = call(q, k_bad, v_bad)
    assert torch.isnan(out[-1]).all(), "the poisoned key is in the last query's window"
    torch.testing.assert_close(out[:clean_rows].double(), exp[:clean_rows], **FWD_TOL)
    dq = _grads(call, q, k_bad, v_bad, up)[0]
    torch.testing.assert_close(dq[:clean_dq].double(), ref[0][:clean_dq].double(), **BWD_TOL)
    # the key rows whose blocks end before the window of the last query reaches them
    last_query_block = ((n - 1) // kv_m) * kv_m
    clean_keys = ((last_query_block - window[0]) // kv_n) * kv_n
    assert clean_keys >= 48
    q_bad, up_bad = q.clone(), up.clone()
    q_bad[-1], up_bad[-1] = float("nan"), float("nan")
    _, dk, dv = _grads(call, q_bad, k, v, up_bad)
    torch.testing.assert_close(dk[:clean_keys].double(), ref[1][:clean_keys].double(), **BWD_TOL)
    torch.testing.assert_close(dv[:clean_keys].double(), ref[2][:clean_keys].double(), **BWD_TOL)
    # the premise: a block that reads the poisoned key block (masked) gets NaN in rows whose
    # windows miss that key, so the clean rows above are clean because their blocks skip it
    assert clean_rows + 1 + window[1] < n - 1 and torch.isnan(out[clean_rows]).all()


# --------------------------------------------------------------------------------------
# Choosing a backend


def test_spec_carries_the_effective_window():
    from ragged.ops.attention import attention_spec

    q = torch.zeros(10, 2, 32)
    cu = _cu([4, 6])
    spec = attention_spec(q, q, q, cu, cu, 6, 6, False, 0.0, False)
    assert spec.window_size == (-1, -1)
    assert attention_spec(q, q, q, cu, cu, 6, 6, False, 0.0, False, (2, 3)).window_size == (2, 3)
    assert attention_spec(q, q, q, cu, cu, 6, 6, True, 0.0, False, (2, 3)).window_size == (2, -1)
    assert attention_spec(q, q, q, cu, cu, 6, 6, False, 0.0, False, (5, 5)).window_size == (-1, -1)
    assert attention_spec(q, q, q, cu, cu, 6, 6, True, 0.0, False, (5, 0)).window_size == (-1, -1)
    assert attention_spec(q, q, q, cu, cu, 6, 6, False, 0.0, False, (4, 4)).window_size == (4, 4)


def test_cuda_declaration_refuses_windows(monkeypatch):
    """The short-sequence kernel masks no window: its check says so for a window that bounds a
    key, and only then (the device's compute capability is stood in for: no GPU here)."""
    import ragged.kernels.cuda as cuda_backend
    from ragged.ops.attention import attention_spec

    monkeypatch.setitem(cuda_backend._attention_capabilities, 0, (9, 0))
    impl = backends.implementation("attention", "cuda")
    q = torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    cu = _cu([4, 6])

    def reasons(causal, window):
        spec = attention_spec(q, q, q, cu, cu, 6, 6, causal, 0.0, False, window)
        return impl.check(dataclasses.replace(spec, device=torch.device("cuda", 0)))

    assert reasons(False, (-1, -1)) == [] and reasons(True, (-1, 3)) == [] and reasons(False, (7, 9)) == []
    for causal, window in ((False, (2, -1)), (False, (-1, 0)), (True, (1, -1))):
        got = reasons(causal, window)
        assert len(got) == 1 and "no sliding window" in got[0] and "window_size=" in got[0], got


def test_explain_takes_the_window():
    lengths = [3, 8]
    q, k, v = _qkv(lengths, lengths, 2, 2, 64, 0)
    reasons = ragged.explain(ragged.varlen_attention, q, k, v, _cu(lengths), _cu(lengths), 8, 8, window_size=(2, 2))
    assert reasons["torch"] == [] and reasons["cuda"]
    reasons = ragged.explain(
        "attention", q, k, v, _cu(lengths), _cu(lengths), 8, 8, False, 0.0, False, window_size=(2, 2)
    )
    assert reasons["torch"] == []


# --------------------------------------------------------------------------------------
# Bad windows: a TypeError or ValueError naming the function and the argument


@pytest.mark.parametrize(
    ("bad", "exc", "words"),
    [
        (3, TypeError, ("window_size", "tuple")),
        ((1, 2, 3), TypeError, ("window_size", "tuple")),
        ("ab", TypeError, ("window_size", "tuple")),
        ((1.5, 2), TypeError, ("window_size[0]", "int")),
        ((1, True), TypeError, ("window_size[1]", "int")),
        ((-2, 0), ValueError, ("window_size[0]", ">= -1", "-2")),
        ((0, -5), ValueError, ("window_size[1]", ">= -1", "-5")),
    ],
)
def test_bad_window_size(bad, exc, words):
    lengths = [3, 5]
    q, k, v = _qkv(lengths, lengths, 2, 2, 16, 0)
    with pytest.raises(exc) as info:
        ragged.varlen_attention(q, k, v, _cu(lengths), _cu(lengths), 5, 5, window_size=bad)
    for word in ("ragged.varlen_attention()", *words):
        assert word in str(info.value), (word, str(info.value))
    rq, rk, rv = (ragged.RaggedTensor.from_lengths(t, lengths) for t in (q, k, v))
    with pytest.raises(exc) as info:
        ragged.attention(rq, rk, rv, window_size=bad)
    for word in ("ragged.attention()", *words):
        assert word in str(info.value), (word, str(info.value))
    with pytest.raises(exc, match=r"ragged.reference_attention\(\)"):
        ragged.reference_attention(q, k, v, _cu(lengths), _cu(lengths), window_size=bad)


def test_window_size_takes_lists_and_numpy_ints():
    np = pytest.importorskip("numpy")
    lengths = [3, 5]
    q, k, v = _qkv(lengths, lengths, 2, 2, 16, 0)
    a = ragged.varlen_attention(
        q, k, v, _cu(lengths), _cu(lengths), 5, 5, window_size=[np.int64(1), 0], backend="torch"
    )
    b = ragged.varlen_attention(q, k, v, _cu(lengths), _cu(lengths), 5, 5, window_size=(1, 0), backend="torch")
    assert torch.equal(a, b)
