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

import pytest
import torch
from attention_cases import (
    BACKENDS,
    BWD_TOL,
    CASES,
    FWD_TOL,
    _blind_rows,
    _check_lse,
    _cu,
    _grads,
    _loop_attention,
    _offsets,
    _qkv,
    _randn,
    _run,
    _seed,
    needs_triton,
)

import ragged
from ragged import RaggedTensor

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
@pytest.mark.parametrize("variant", ["triton", "triton_fused_bwd"], ids=["split", "fused"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_backward(case, causal, variant, monkeypatch):
    """Both backwards: the split kernels (dK/dV, then dQ recomputing S and dP) and the fused one
    (dQ added atomically from the key-block kernel)."""
    from ragged import backends
    from ragged.kernels.triton import attention as launcher

    lq, lk, heads, kv_heads, dim = CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed(case, "bwd"))
    up = _randn(q.shape, _seed(case, "bwd-up"))
    fused = []
    real = launcher._backward_fused
    monkeypatch.setattr(launcher, "_backward_fused", lambda *a: fused.append(1) or real(*a))

    def kernel(a, b, c):
        return ragged.varlen_attention(
            a, b, c, _cu(lq), _cu(lk), max(lq, default=0), max(lk, default=0), causal=causal, backend="triton"
        )

    with backends.prefer("attention", variant):
        got = _grads(kernel, q, k, v, up)
    assert bool(fused) == (variant == "triton_fused_bwd" and sum(lq) > 0), "the chosen backward did not run"
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
    ref = _grads(
        lambda a, b, c: _loop_attention(a, b, c, lq, lk, causal)[0], q.double(), k.double(), v.double(), up.double()
    )
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
    if scale == 0.0:  # uniform weights: each query gets the mean of its sequence's values
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
    out = ragged.varlen_attention(
        q, k, v, _cu(lq, offsets_dtype), _cu(lk, offsets_dtype), 18, 18, causal=True, backend="triton"
    )
    exp, _ = _loop_attention(q, k, v, lq, lk, True)
    torch.testing.assert_close(out.double(), exp, **FWD_TOL)


# --------------------------------------------------------------------------------------
# Values outside a sequence never leak in


def _poisoned_storage(values, pad_heads=1, pad_dim=8, pad_rows=5):
    """``values`` as a view into a larger NaN-filled buffer: NaN rows before and after the
    tokens, NaN extra heads and NaN columns past the head dim (strided, not contiguous)."""
    t, h, d = values.shape
    buf = torch.full((t + 2 * pad_rows, h + pad_heads, d + pad_dim), float("nan"), dtype=values.dtype)
    view = buf[pad_rows : pad_rows + t, :h, :d]
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
        t[o[poisoned] : o[poisoned + 1]] = float("nan")
    rows_q = torch.zeros(q.shape[0], dtype=torch.bool)
    rows_q[oq[poisoned] : oq[poisoned + 1]] = True
    rows_k = torch.zeros(k.shape[0], dtype=torch.bool)
    rows_k[ok[poisoned] : ok[poisoned + 1]] = True
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
    out, lse = ragged.varlen_attention(
        *leaves, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal, return_lse=True, backend="triton"
    )
    dq, dk, dv = torch.autograd.grad(out, leaves, up)
    oq, ok = _offsets(lq), _offsets(lk)
    for b in range(len(lq)):
        sq, sk = slice(oq[b], oq[b + 1]), slice(ok[b], ok[b + 1])
        one = [t[s].clone().requires_grad_(True) for t, s in ((q, sq), (k, sk), (v, sk))]
        o1, l1 = ragged.varlen_attention(
            *one, _cu([lq[b]]), _cu([lk[b]]), lq[b], lk[b], causal=causal, return_lse=True, backend="triton"
        )
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
    same = ragged.varlen_attention(
        qv, kv, vv, q.offsets, k.offsets, q.max_len, k.max_len, causal=causal, backend=backend
    )
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


def test_fused_backward_declines_bias_and_deterministic_mode():
    """The fused backward's reasons: a position bias, and torch's deterministic mode (its dQ is
    summed atomically); the split kernels take both."""
    from ragged import backends
    from ragged.ops.attention import attention_spec

    q = torch.zeros(8, 2, 32)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    impl = backends.implementation("attention", "triton_fused_bwd")
    spec = attention_spec(q, q, q, cu, cu, 8, 8, False, 0.0, True)
    plain = [r for r in impl.reasons(spec) if "determin" in r or "bias" in r]
    assert not plain
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert any("deterministic" in r for r in impl.reasons(spec))
    finally:
        torch.use_deterministic_algorithms(was)
    import dataclasses

    assert any("position bias" in r for r in impl.reasons(dataclasses.replace(spec, bias_buckets=16)))


def test_tma_fused_backwards_say_what_they_need(monkeypatch):
    """The fused backward with dQ by TMA bulk reduce-adds, after the portable forward
    (``triton_fused_bwd_tma``) and after the sm_90 one (``triton_sm90_fused_bwd_tma``):
    ``ragged.explain`` gives their reasons for a CPU tensor, under the interpreter and under
    torch's deterministic mode; a GPU other than sm_90 and another head dim are refused too, and
    a plain bf16 call on an sm_90 GPU is not."""
    import dataclasses

    pytest.importorskip("triton")
    from ragged import backends
    from ragged.kernels import triton as triton_backend
    from ragged.ops.attention import attention_spec

    names = ("triton_fused_bwd_tma", "triton_sm90_fused_bwd_tma")
    q = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    operands = (q, q, q, cu, cu, 8, 8, False, 0.0, True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    why = ragged.explain("attention", *operands)
    assert all(any("CUDA tensors" in r for r in why[n]) for n in names), why
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    why = ragged.explain("attention", *operands)
    for n in names:
        assert any("TRITON_INTERPRET=1" in r and "bulk reduce" in r for r in why[n]), why[n]
        assert not any("determin" in r for r in why[n]), why[n]
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        why = ragged.explain("attention", *operands)
    finally:
        torch.use_deterministic_algorithms(was)
    assert all(any("use_deterministic_algorithms" in r for r in why[n]) for n in names), why
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gpu = dataclasses.replace(attention_spec(*operands), device=torch.device("cuda", 0))
    impls = [backends.implementation("attention", n) for n in names]
    monkeypatch.setitem(triton_backend._MAJOR, 0, 8)  # as an sm_80 GPU reads: no device here
    assert all(any("sm_90 GPUs, got compute capability 8.x" in r for r in i.reasons(gpu)) for i in impls)
    monkeypatch.setitem(triton_backend._MAJOR, 0, 9)
    assert [i.reasons(gpu) for i in impls] == [[], []]
    wide = [i.reasons(dataclasses.replace(gpu, head_dim=96)) for i in impls]
    assert all(any("head dims (64, 128), got 96" in r for r in w) for w in wide), wide
    assert all(i.rank_for(gpu) > backends.implementation("attention", "triton_fused_bwd").rank_for(gpu) for i in impls)
