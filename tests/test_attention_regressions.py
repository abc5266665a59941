"""Regressions of ragged.attention / ragged.varlen_attention on CPU: offsets and buffers that
break a unit-stride or a size assumption.

* strided offsets (``cu[::2]``): every backend reads them as the values they hold;
* offsets that break the data contract (``cu[-1] != T``, ``cu[0] != 0``, a decrease, a sequence
  longer than ``max_seqlen``): one ``ValueError``, the same on every backend, wherever the check
  reads no GPU memory (here: CPU offsets) or ``validate=True`` asks for it;
* the Triton kernels called with such offsets unchecked (as CUDA offsets reach them) never read
  or write outside their tensors: NaN guard rows around every input and sentinel rows around
  every gradient buffer show it;
* gradient buffers (``grads=``) whose feature dim is strided, taken by every backward;
* the op's declarations: the spec, auto's order by the declared ranks, no toolchain imported to declare.

The oracle is ``ragged.reference_attention`` in float64 (checked against an SDPA loop in
``test_attention.py``). Sizes stay small for the Triton interpreter.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from conftest import TRITON_ON_CPU, cpu_backends

import ragged
from ragged import RaggedTensor
from ragged.ops.attention import AttentionArgs, AttentionBackwardInputs, AttentionGrads

BACKENDS = cpu_backends()
needs_triton = pytest.mark.skipif(not TRITON_ON_CPU, reason="the Triton kernels need TRITON_INTERPRET=1 on CPU")
FWD_TOL = {"atol": 2e-5, "rtol": 2e-5}
BWD_TOL = {"atol": 1e-4, "rtol": 1e-4}
VARLEN = "ragged.varlen_attention()"
ATTN = "ragged.attention()"

# Cross-attention lengths with empty and one-token sequences on both sides (GQA: H = 2, H_kv = 1).
LQ, LK = [3, 0, 1, 6], [4, 2, 0, 5]
HEADS, KV_HEADS, DIM = 2, 1, 16


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32("/".join(map(str, parts)).encode()))


def _offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _cu(lengths, dtype=torch.int32):
    return torch.tensor(_offsets(lengths), dtype=dtype)


def _strided(values, dtype=torch.int32, junk=99):
    """A non-contiguous 1-D view holding ``values``, with ``junk`` between them (``x[::2]``)."""
    buf = torch.full((2 * len(values),), junk, dtype=dtype)
    buf[::2] = torch.tensor(values, dtype=dtype)
    view = buf[::2]
    assert not view.is_contiguous() and view.tolist() == list(values)
    return view


def _qkv(lq, lk, gen, heads=HEADS, kv_heads=KV_HEADS, dim=DIM):
    q = torch.randn(sum(lq), heads, dim, generator=gen)
    k = torch.randn(sum(lk), kv_heads, dim, generator=gen)
    v = torch.randn(sum(lk), kv_heads, dim, generator=gen)
    return q, k, v


def _guarded(x, gen, lead=3, trail=40):
    """``x`` copied into the middle of a NaN buffer (NaN rows before and after, a NaN head beside
    it): a kernel that reads outside ``x`` puts NaN into its results."""
    buf = torch.full((lead + x.shape[0] + trail, x.shape[1] + 1, x.shape[2]), float("nan"), dtype=x.dtype)
    view = buf[lead : lead + x.shape[0], 1:]
    view.copy_(x)
    return view


def _reference(q, k, v, cu_q, cu_k, causal, up):
    """float64 ``(out, (dq, dk, dv))`` of ``<out, up>`` with contiguous copies of the offsets."""
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out, _ = ragged.reference_attention(*leaves, cu_q.contiguous(), cu_k.contiguous(), causal)
    grads = torch.autograd.grad(out, leaves, up.double(), allow_unused=True)
    return out.detach(), tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))


def _run_and_grads(fn, q, k, v, up):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, up.to(out.dtype), allow_unused=True)
    return out.detach(), tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))


def _check(got, ref, tol, what):
    assert not torch.isnan(got).any(), f"{what}: NaN"
    torch.testing.assert_close(got.double(), ref, **tol, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------------------
# 1. Strided offsets


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_strided_cu_seqlens_every_backend(backend, causal, offsets_dtype):
    """varlen_attention with ``cu_seqlens[::2]`` views on both sides, forward and backward
    (the Triton kernels read cu + b, so a strided view read the junk between the offsets:
    out-of-bounds, a segfault on CPU)."""
    gen = _gen("strided-varlen", backend, causal, offsets_dtype)
    q, k, v = _qkv(LQ, LK, gen)
    up = torch.randn(q.shape, generator=gen)
    cu_q, cu_k = _strided(_offsets(LQ), offsets_dtype), _strided(_offsets(LK), offsets_dtype)
    out, grads = _run_and_grads(
        lambda a, b, c: ragged.varlen_attention(a, b, c, cu_q, cu_k, max(LQ), max(LK), causal=causal, backend=backend),
        q,
        k,
        v,
        up,
    )
    ref, ref_grads = _reference(q, k, v, cu_q, cu_k, causal, up)
    _check(out, ref, FWD_TOL, "out")
    for name, g, r in zip("qkv", grads, ref_grads):
        _check(g, r, BWD_TOL, f"d{name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided_ragged_offsets_every_backend(backend, causal):
    """ragged.attention on RaggedTensors built by the plain constructor (which checks nothing)
    around strided offsets, forward and backward, with the lse."""
    gen = _gen("strided-ragged", backend, causal)
    q, k, v = _qkv(LQ, LK, gen)
    up = torch.randn(q.shape, generator=gen)
    off_q, off_k = _strided(_offsets(LQ)), _strided(_offsets(LK))

    def fn(a, b, c):
        rq, rk, rv = RaggedTensor(a, off_q, max(LQ)), RaggedTensor(b, off_k, max(LK)), RaggedTensor(c, off_k, max(LK))
        out, lse = ragged.attention(rq, rk, rv, causal=causal, return_lse=True, backend=backend)
        assert out.offsets is off_q  # the result keeps the caller's sequences
        fn.lse = lse
        return out.values

    out, grads = _run_and_grads(fn, q, k, v, up)
    ref, ref_grads = _reference(q, k, v, off_q, off_k, causal, up)
    _check(out, ref, FWD_TOL, "out")
    _, ref_lse = ragged.reference_attention(q.double(), k.double(), v.double(), _cu(LQ), _cu(LK), causal)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(fn.lse), seen)
    torch.testing.assert_close(fn.lse[seen].double(), ref_lse[seen].double(), **FWD_TOL)
    for name, g, r in zip("qkv", grads, ref_grads):
        _check(g, r, BWD_TOL, f"d{name}")


@needs_triton
def test_triton_launchers_take_strided_offsets():
    """The Triton launchers themselves (called directly by ragged.nn's fused layer) make the
    offsets contiguous, forward and backward."""
    from ragged.kernels.triton import attention as ka

    gen = _gen("strided-launcher")
    q, k, v = _qkv(LQ, LK, gen)
    do = torch.randn(q.shape, generator=gen)
    cu_q, cu_k = _strided(_offsets(LQ)), _strided(_offsets(LK))
    args = AttentionArgs(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=max(LQ), max_k=max(LK), causal=True, scale=0.25)
    out, lse = ka.forward(args)
    dq, dk, dv, _ = ka.backward(args, AttentionBackwardInputs(grad_out=do, out=out, lse=lse))
    ref, _ = ragged.reference_attention(q.double(), k.double(), v.double(), _cu(LQ), _cu(LK), True, 0.25)
    ref_grads = ragged.reference_attention_backward(
        do.double(), q.double(), k.double(), v.double(), _cu(LQ), _cu(LK), True, 0.25
    )
    _check(out, ref, FWD_TOL, "out")
    for name, g, r in zip("qkv", (dq, dk, dv), ref_grads):
        _check(g, r, BWD_TOL, f"d{name}")


# --------------------------------------------------------------------------------------
# 2. Offsets that break the data contract


def _bad_offsets(kind, lengths):
    """(offsets breaking the contract for ``sum(lengths)`` rows, words the error names)."""
    good = _offsets(lengths)
    total = good[-1]
    if kind == "last_past_T":
        return good[:-1] + [total + 5], ("[-1] ==", f"({total})", str(total + 5))
    if kind == "last_short_of_T":
        return good[:-1] + [total - 2], ("[-1] ==", f"({total})", str(total - 2))
    if kind == "first_not_0":
        return [2] + good[1:], ("[0] == 0", "got 2")
    if kind == "decreasing":
        bad = list(good)
        bad[1] = good[2] + 1
        return bad, ("non-decreasing", f"= {good[2] + 1} >")
    raise AssertionError(kind)


KINDS = ["last_past_T", "last_short_of_T", "first_not_0", "decreasing"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("side", ["q", "k"])
@pytest.mark.parametrize("validate", [False, True], ids=["implicit", "validate"])
def test_varlen_offsets_against_T_same_error_every_backend(kind, side, validate):
    """CPU offsets are checked for free (and with validate=True): one ValueError, naming the
    offsets, the same whatever the backend; nothing runs (before: the torch backend returned
    cu[-1] rows, Triton wrote out of bounds: "double free or corruption")."""
    gen = _gen("contract", kind, side)
    q, k, v = _qkv(LQ, LK, gen)
    cu_q, cu_k = _cu(LQ), _cu(LK)
    bad, words = _bad_offsets(kind, LQ if side == "q" else LK)
    name = f"cu_seqlens_{side}"
    if side == "q":
        cu_q = torch.tensor(bad, dtype=torch.int32)
    else:
        cu_k = torch.tensor(bad, dtype=torch.int32)
    messages = set()
    for backend in [*BACKENDS, "auto"]:
        with pytest.raises(ValueError) as info:
            ragged.varlen_attention(q, k, v, cu_q, cu_k, 64, 64, backend=backend, validate=validate)
        message = str(info.value)
        assert message.startswith(VARLEN) and name in message, message
        for word in words:
            assert word in message, (word, message)
        messages.add(message)
    assert len(messages) == 1, messages


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("side", ["q", "k"])
def test_ragged_offsets_against_T_same_error_every_backend(kind, side):
    """The same for RaggedTensors from the plain constructor (their offsets are trusted)."""
    gen = _gen("contract-ragged", kind, side)
    q, k, v = _qkv(LQ, LK, gen)
    off_q, off_k = _cu(LQ), _cu(LK)
    bad, words = _bad_offsets(kind, LQ if side == "q" else LK)
    if side == "q":
        off_q = torch.tensor(bad, dtype=torch.int32)
    else:
        off_k = torch.tensor(bad, dtype=torch.int32)
    rq, rk, rv = RaggedTensor(q, off_q, 64), RaggedTensor(k, off_k, 64), RaggedTensor(v, off_k, 64)
    messages = set()
    for backend in [*BACKENDS, "auto"]:
        with pytest.raises(ValueError) as info:
            ragged.attention(rq, rk, rv, backend=backend)
        message = str(info.value)
        assert message.startswith(ATTN) and f"{side}.offsets" in message, message
        for word in words:
            assert word in message, (word, message)
        messages.add(message)
    assert len(messages) == 1, messages


@pytest.mark.parametrize("side", ["q", "k"])
def test_max_seqlen_below_the_longest_sequence(side):
    gen = _gen("max-seqlen", side)
    q, k, v = _qkv(LQ, LK, gen)
    max_q, max_k = (max(LQ) - 1, max(LK)) if side == "q" else (max(LQ), max(LK) - 1)
    name = f"max_seqlen_{side}"
    longest = max(LQ) if side == "q" else max(LK)
    messages = set()
    for backend in [*BACKENDS, "auto"]:
        with pytest.raises(ValueError) as info:
            ragged.varlen_attention(q, k, v, _cu(LQ), _cu(LK), max_q, max_k, backend=backend)
        message = str(info.value)
        assert message.startswith(VARLEN) and name in message and f"({longest})" in message, message
        messages.add(message)
    assert len(messages) == 1, messages


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_seqlen_takes_numpy_ints(backend):
    gen = _gen("numpy-max", backend)
    q, k, v = _qkv(LQ, LK, gen)
    out = ragged.varlen_attention(q, k, v, _cu(LQ), _cu(LK), np.int64(max(LQ)), np.int32(max(LK)), backend=backend)
    ref, _ = ragged.reference_attention(q.double(), k.double(), v.double(), _cu(LQ), _cu(LK))
    _check(out, ref, FWD_TOL, "out")


@pytest.mark.parametrize("which", ["max_seqlen_q", "max_seqlen_k"])
@pytest.mark.parametrize(
    "bad,exc",
    [(-1, ValueError), (np.int64(-3), ValueError), (True, TypeError), (2.0, TypeError), ("6", TypeError)],
    ids=["neg", "np_neg", "bool", "float", "str"],
)
def test_max_seqlen_bad_values(which, bad, exc):
    gen = _gen("bad-max", which)
    q, k, v = _qkv(LQ, LK, gen)
    kwargs = {"max_seqlen_q": max(LQ), "max_seqlen_k": max(LK), which: bad}
    messages = set()
    for backend in [*BACKENDS, "auto"]:
        with pytest.raises(exc) as info:
            ragged.varlen_attention(q, k, v, _cu(LQ), _cu(LK), backend=backend, **kwargs)
        assert str(info.value).startswith(VARLEN) and which in str(info.value)
        messages.add(str(info.value))
    assert len(messages) == 1, messages


@pytest.mark.parametrize("backend", BACKENDS)
def test_validate_true_on_good_offsets_changes_nothing(backend):
    gen = _gen("validate-good", backend)
    q, k, v = _qkv(LQ, LK, gen)
    a = ragged.varlen_attention(q, k, v, _cu(LQ), _cu(LK), max(LQ), max(LK), causal=True, backend=backend)
    b = ragged.varlen_attention(
        q,
        k,
        v,
        _strided(_offsets(LQ)),
        _cu(LK, torch.int64),
        max(LQ),
        max(LK),
        causal=True,
        backend=backend,
        validate=True,
    )
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    rq, rk = RaggedTensor.from_lengths(q, LQ), RaggedTensor.from_lengths(k, LK)
    c = ragged.attention(rq, rk, rk.with_values(v), causal=True, backend=backend, validate=True)
    torch.testing.assert_close(a, c.values, atol=0, rtol=0)


# --------------------------------------------------------------------------------------
# The Triton kernels: max_seqlen is a tile hint, not a bound on the work


@needs_triton
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_lengths_past_max_seqlen(causal):
    """max_seqlen only picks tile shapes: sequences longer than it are still computed whole."""
    from ragged.kernels.triton import attention as ka

    gen = _gen("past-max", causal)
    lq, lk = [21, 1, 0, 18], [19, 0, 3, 23]
    q0, k0, v0 = _qkv(lq, lk, gen)
    do = torch.randn(q0.shape, generator=gen)
    q, k, v = (_guarded(t, gen) for t in (q0, k0, v0))
    cu_q, cu_k = _cu(lq), _cu(lk)
    args = AttentionArgs(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=1, max_k=1, causal=causal, scale=0.25)
    out, lse = ka.forward(args)
    grads = ka.backward(args, AttentionBackwardInputs(grad_out=do, out=out, lse=lse))[:3]
    ref, _ = ragged.reference_attention(q0.double(), k0.double(), v0.double(), cu_q, cu_k, causal, 0.25)
    ref_grads = ragged.reference_attention_backward(
        do.double(), q0.double(), k0.double(), v0.double(), cu_q, cu_k, causal, 0.25
    )
    _check(out, ref, FWD_TOL, "out")
    for name, g, r in zip("qkv", grads, ref_grads):
        _check(g, r, BWD_TOL, f"d{name}")


# --------------------------------------------------------------------------------------
# 3. Gradient buffers with a strided feature dim


@needs_triton
@pytest.mark.parametrize("layout", ["feature_strided", "packed_qkv"])
def test_triton_backward_grads_buffers_of_any_strides(layout):
    """``grads=`` buffers are written (and returned) whatever their strides: views of one packed
    ``[T, 3, H, D]`` buffer in place, a feature-strided one through a copy (before: the kernels
    wrote it as if its feature stride were 1)."""
    from ragged.kernels.triton import attention as ka

    gen = _gen("grads", layout)
    lengths = [5, 0, 1, 9]
    q, k, v = _qkv(lengths, lengths, gen, heads=2, kv_heads=2)
    do = torch.randn(q.shape, generator=gen)
    cu = _cu(lengths)
    args = AttentionArgs(q=q, k=k, v=v, cu_q=cu, cu_k=cu, max_q=9, max_k=9, causal=True, scale=0.25)
    out, lse = ka.forward(args)
    if layout == "feature_strided":  # [T, H, D] views of [D, H, T] buffers: feature stride H * T
        grads = AttentionGrads(
            *(torch.full((t.shape[2], t.shape[1], t.shape[0]), 7.0).permute(2, 1, 0) for t in (q, k, v))
        )
        assert all(g.stride(-1) != 1 for g in grads[:3])
    else:
        grads = AttentionGrads(*torch.full((q.shape[0], 3, 2, DIM), 7.0).unbind(1))
    got = ka.backward(args, AttentionBackwardInputs(grad_out=do, out=out, lse=lse), grads=grads)
    ref = ragged.reference_attention_backward(do.double(), q.double(), k.double(), v.double(), cu, cu, True, 0.25)
    for name, g, buf, r in zip("qkv", got[:3], grads, ref):
        assert g is buf
        _check(g, r, BWD_TOL, f"d{name}")


@needs_triton
def test_triton_backward_grads_of_the_wrong_shape():
    from ragged.kernels.triton import attention as ka

    gen = _gen("grads-shape")
    q, k, v = _qkv([3, 4], [3, 4], gen)
    cu = _cu([3, 4])
    args = AttentionArgs(q=q, k=k, v=v, cu_q=cu, cu_k=cu, max_q=4, max_k=4, causal=False, scale=0.25)
    out, lse = ka.forward(args)
    bad = AttentionGrads(torch.zeros(6, HEADS, DIM), torch.zeros_like(k), torch.zeros_like(v))
    with pytest.raises(ValueError, match="gradient of q of shape"):
        ka.backward(args, AttentionBackwardInputs(grad_out=torch.ones_like(q), out=out, lse=lse), grads=bad)


# --------------------------------------------------------------------------------------
# 4. The op's definition: declared implementations, one backward contract, the spec


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["separate", "packed_qkv"])
def test_every_backward_implementation_fills_grads_buffers(backend, layout):
    """Each backend's backward takes ``grads=`` (what the layers pass: the unbound views of one
    ``[T, 3, H, D]`` buffer) and returns those very buffers, filled; callers never test a name."""
    from ragged import backends
    from ragged.ops.attention import ATTENTION, AttentionArgs, AttentionBackwardInputs, AttentionGrads

    gen = _gen("grads-uniform", backend, layout)
    lengths = [4, 0, 1, 6]
    q, k, v = _qkv(lengths, lengths, gen, heads=2, kv_heads=2)
    do = torch.randn(q.shape, generator=gen)
    cu = _cu(lengths)
    impl = backends.implementation("attention", backend)
    args = AttentionArgs(q=q, k=k, v=v, cu_q=cu, cu_k=cu, max_q=6, max_k=6, causal=True, scale=0.25)
    out, lse = impl.forward_fn(args)
    if layout == "separate":
        grads = AttentionGrads(*(torch.full_like(t, 7.0) for t in (q, k, v)))
    else:
        grads = AttentionGrads(*torch.full((q.shape[0], 3, 2, DIM), 7.0).unbind(1))
    inputs = AttentionBackwardInputs(grad_out=do, out=out, lse=lse)
    got = impl.backward_fn(args, inputs, grads=grads)
    plain = ATTENTION.call_backward(args, inputs, backend)
    ref = ragged.reference_attention_backward(do.double(), q.double(), k.double(), v.double(), cu, cu, True, 0.25)
    for name, g, buf, p, r in zip("qkv", got, grads, plain, ref):
        assert g is buf
        torch.testing.assert_close(g, p, atol=0, rtol=0)
        _check(g, r, BWD_TOL, f"d{name}")


def test_reference_backward_grads_of_the_wrong_shape():
    from ragged import backends
    from ragged.ops.attention import AttentionArgs, AttentionBackwardInputs, AttentionGrads

    q, k, v = _qkv([3, 4], [3, 4], _gen("ref-grads-shape"))
    cu = _cu([3, 4])
    impl = backends.implementation("attention", "torch")
    args = AttentionArgs(q=q, k=k, v=v, cu_q=cu, cu_k=cu, max_q=4, max_k=4, causal=False, scale=0.25)
    out, lse = impl.forward_fn(args)
    inputs = AttentionBackwardInputs(grad_out=torch.ones_like(q), out=out, lse=lse)
    bad = AttentionGrads(torch.zeros(6, HEADS, DIM), torch.zeros_like(k), torch.zeros_like(v))
    with pytest.raises(ValueError, match="gradient of q of shape"):
        impl.backward_fn(args, inputs, grads=bad)
    with pytest.raises(TypeError, match="grads as an AttentionGrads record"):
        impl.backward_fn(args, inputs, grads=(bad.q, bad.k, bad.v))


def test_dropout_seed():
    from ragged.ops.attention import dropout_seed

    assert dropout_seed(0.0) == 0
    torch.manual_seed(5)
    a = dropout_seed(0.1)
    torch.manual_seed(5)
    assert dropout_seed(0.3) == a and isinstance(a, int) and 0 <= a < 2**31 - 1
    assert dropout_seed(0.1) != a  # a fresh draw per call


def test_spec_and_the_auto_order_on_cuda():
    """The spec carries what the reasons read; "auto" on CUDA prefers the short-sequence kernel
    exactly where it was measured faster (both lengths <= 64, or <= 128 at D <= 64)."""
    from ragged import backends
    from ragged.ops.attention import AttentionSpec, attention_spec

    q, k, v = torch.zeros(9, 4, 32), torch.zeros(7, 2, 32), torch.zeros(7, 2, 32)
    spec = attention_spec(q, k, v, _cu([4, 5]), _cu([3, 4]), 5, 4, 1, 0, 0)
    assert spec == AttentionSpec(
        torch.device("cpu"), torch.float32, 32, 4, 2, 2, 5, 4, True, 0.0, False, tma_aligned=True
    )
    order = backends.op_entry("attention").gpu_preference
    cuda = torch.device("cuda")
    for head_dim, longest, first in ((128, 64, "cuda"), (128, 65, "triton"), (64, 128, "cuda"), (64, 129, "triton")):
        s = AttentionSpec(cuda, torch.bfloat16, head_dim, 4, 4, 8, longest, 1, False, 0.0, False)
        assert order(s)[0] == first and order(s)[-1] == "torch"
        assert set(order(s)) == {
            "cuda", "triton", "triton_sm90", "triton_sm90_full", "triton_fused_bwd", "triton_sm90_ws",
            "triton_sm90_fused_bwd", "triton_sm90_ws_fused_bwd", "triton_fused_bwd_tma",
            "triton_sm90_fused_bwd_tma", "torch",
        }  # fmt: skip


def test_declarations_import_no_toolchain():
    """Declaring the Triton and CUDA implementations imports neither Triton nor CuPy; the head
    dims of the kernels are data there."""
    import subprocess
    import sys

    code = (
        "import sys, ragged\n"
        "from ragged import backends\n"
        "from ragged.kernels.triton import ATTENTION_HEAD_DIMS\n"
        "from ragged.kernels.cuda import ATTENTION_SHORT_HEAD_DIMS, ATTENTION_SHORT_MAX_LEN\n"
        "t, c = backends.implementation('attention', 'triton'), backends.implementation('attention', 'cuda')\n"
        "assert t.limits == {'head_dim': ATTENTION_HEAD_DIMS}\n"
        "assert c.limits == {'head_dim': ATTENTION_SHORT_HEAD_DIMS} and c.backward_backend == 'triton'\n"
        "assert c.maxima == {'max_q': ATTENTION_SHORT_MAX_LEN, 'max_k': ATTENTION_SHORT_MAX_LEN}\n"
        "assert 'packed_self_attention' in c.extras\n"
        "assert 'triton' not in sys.modules and 'cupy' not in sys.modules, 'a toolchain was imported'\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


@needs_triton
def test_triton_head_dims_are_the_declared_ones():
    from ragged.kernels.triton import ATTENTION_HEAD_DIMS
    from ragged.kernels.triton import attention as ka

    assert ka.HEAD_DIMS == ATTENTION_HEAD_DIMS
    reasons = ragged.explain(
        "attention", *(torch.zeros(3, 2, 48) for _ in range(3)), _cu([3]), _cu([3]), 3, 3, False, 0.0, False
    )
    assert reasons["torch"] == [] and any("head dims" in r and "48" in r for r in reasons["triton"])
