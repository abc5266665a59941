"""ragged attention on the GPU (``pytest -m gpu``): more than 2**31 elements, and offsets
(strided views, the data contract, kernels on offsets nobody checked), on every backend."""

from __future__ import annotations

import pytest
import torch

import ragged
from ragged import RaggedTensor, backends

pytestmark = pytest.mark.gpu
from gpu_attention_cases import (
    ATOL,
    KERNELS,
    LENGTHS,
    _assert_rule,
    _check_backward,
    _cu,
    _gen,
    _needs,
    _qkv,
    _reasons,
)

# --------------------------------------------------------------------------------------
# More than 2**31 elements


def test_int64_indexing_many_short_sequences():
    """B = 2**16 sequences of 17 tokens, H = 16, D = 128, bf16: T * H * D = 2.28e9 > 2**31 elements
    per tensor. Memory: q, k, v and out take 4.25 GiB each (about 17 GiB together)."""
    free, _ = torch.cuda.mem_get_info()
    if free < 20 * 2**30:
        pytest.skip("needs 20 GiB of free GPU memory")
    batch, length, heads, dim = 2**16, 17, 16, 128
    total = batch * length
    assert total * heads * dim > 2**31
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(total, heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, total + 1, length, dtype=torch.int32, device="cuda")
    samples = [0, 1, 12345, batch // 2, 61_681, batch - 2, batch - 1]  # 61_681 * 17 * 2048 > 2**31
    ran = []
    for backend in KERNELS:
        reasons = _reasons(backend, q, k, v, cu, cu, length, length, True)
        if reasons:
            assert backend != "triton", reasons
            continue
        out, lse = ragged.varlen_attention(
            q, k, v, cu, cu, length, length, causal=True, return_lse=True, backend=backend
        )
        for b in samples:
            s = slice(b * length, (b + 1) * length)
            one = torch.tensor([0, length], dtype=torch.int32, device="cuda")
            ref, ref_lse = ragged.reference_attention(q[s].double(), k[s].double(), v[s].double(), one, one, True)
            low, low_lse = ragged.reference_attention(q[s], k[s], v[s], one, one, True, compute_dtype=q.dtype)
            _assert_rule(f"{backend} sequence {b}", out[s], ref, low, 1e-3)
            _assert_rule(f"{backend} lse {b}", lse[s], ref_lse, low_lse, 1e-3)
        assert torch.isfinite(out[-4096:]).all() and torch.isfinite(out[:4096]).all()
        del out, lse
        ran.append(backend)
    assert "triton" in ran


# --------------------------------------------------------------------------------------
# Offsets: strided views, the data contract, kernels on offsets nobody checked

ALL_BACKENDS = ["torch", "triton", "cuda", "auto"]


def _strided_cu(lengths, dtype=torch.int32, junk=10**6):
    """The offsets of ``lengths`` as a non-contiguous view (``buf[::2]``), junk in between."""
    cu = _cu(lengths, dtype)
    buf = torch.full((2 * cu.shape[0],), junk, dtype=dtype, device="cuda")
    buf[::2] = cu
    view = buf[::2]
    assert not view.is_contiguous()
    return view


def _skip_unless_takes(backend, q, k, v, cu_q, cu_k, max_q, max_k, causal, needs_grad=False):
    if backend in KERNELS:
        _needs(backend)
    if backend != "auto" and _reasons(backend, q, k, v, cu_q, cu_k, max_q, max_k, causal, 0.0, needs_grad):
        pytest.skip(f"{backend} cannot take this input")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_strided_offsets_every_backend(backend, causal, offsets_dtype):
    """cu_seqlens / RaggedTensor offsets as strided views, forward (varlen_attention and
    attention over plain-constructor RaggedTensors) and backward (not the forward-only CUDA
    kernel), against the reference with contiguous offsets."""
    lq, lk = LENGTHS["short_cross"]
    q, k, v = _qkv(lq, lk, 4, 2, 64, torch.bfloat16, _gen("strided-cu", backend, causal, offsets_dtype))
    cu_q, cu_k = _strided_cu(lq, offsets_dtype), _strided_cu(lk, offsets_dtype)
    _skip_unless_takes(backend, q, k, v, cu_q, cu_k, max(lq), max(lk), causal)
    ref, _ = ragged.reference_attention(q.double(), k.double(), v.double(), _cu(lq), _cu(lk), causal)
    low, _ = ragged.reference_attention(q, k, v, _cu(lq), _cu(lk), causal, compute_dtype=q.dtype)
    out = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, backend=backend)
    _assert_rule(f"{backend} varlen", out, ref, low, ATOL[q.dtype])
    rq, rk, rv = RaggedTensor(q, cu_q, max(lq)), RaggedTensor(k, cu_k, max(lk)), RaggedTensor(v, cu_k, max(lk))
    out = ragged.attention(rq, rk, rv, causal=causal, backend=backend)
    _assert_rule(f"{backend} ragged", out.values, ref, low, ATOL[q.dtype])
    if backend != "cuda":
        _check_backward(lq, lk, q, k, v, causal, f"strided/{backend}/{causal}", backend=backend, cu_q=cu_q, cu_k=cu_k)


def _break(kind, lengths):
    """Offsets (host list) of ``lengths`` breaking the data contract as ``kind`` says."""
    good = [0]
    for n in lengths:
        good.append(good[-1] + n)
    if kind == "last_past_T":
        return good[:-1] + [good[-1] + 5]
    if kind == "last_short_of_T":
        return good[:-1] + [good[-1] - 2]
    if kind == "first_not_0":
        return [2] + good[1:]
    if kind == "decreasing":
        return [good[0], good[2] + 1] + good[2:]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["last_past_T", "last_short_of_T", "first_not_0", "decreasing", "max_seqlen"])
@pytest.mark.parametrize("side", ["q", "k"])
def test_validate_gives_one_error_on_every_backend(kind, side):
    """validate=True reads CUDA offsets once and raises the same ValueError whatever the backend;
    the "torch" backend (which reads the offsets anyway) raises it without being asked."""
    lq, lk = [3, 0, 17, 9], [5, 2, 0, 20]
    q, k, v = _qkv(lq, lk, 4, 2, 64, torch.bfloat16, _gen("validate", kind, side))
    off = {"q": [0] + [sum(lq[: i + 1]) for i in range(len(lq))], "k": [0] + [sum(lk[: i + 1]) for i in range(len(lk))]}
    maxima = {"q": max(lq), "k": max(lk)}
    if kind == "max_seqlen":
        maxima[side] -= 1
    else:
        off[side] = _break(kind, lq if side == "q" else lk)
    cu_q = torch.tensor(off["q"], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(off["k"], dtype=torch.int32, device="cuda")
    messages = set()
    for backend in ALL_BACKENDS:
        if backend in KERNELS and (
            backends.triton_reason(q.device) if backend == "triton" else backends.cuda_reason(q.device)
        ):
            continue
        for validate in (False, True) if backend == "torch" else (True,):
            with pytest.raises(ValueError) as info:
                ragged.varlen_attention(
                    q, k, v, cu_q, cu_k, maxima["q"], maxima["k"], backend=backend, validate=validate
                )
            messages.add(str(info.value))
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("ragged.varlen_attention()"), message
    assert (f"max_seqlen_{side}" if kind == "max_seqlen" else f"cu_seqlens_{side}") in message, message


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_validate_on_good_offsets_and_no_sync_without_it(backend):
    lq, lk = LENGTHS["short_cross"]
    q, k, v = _qkv(lq, lk, 4, 2, 64, torch.bfloat16, _gen("validate-good", backend))
    cu_q, cu_k = _cu(lq), _cu(lk)
    _skip_unless_takes(backend, q, k, v, cu_q, cu_k, max(lq), max(lk), True)
    checked = ragged.varlen_attention(
        q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, backend=backend, validate=True
    )
    out = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, backend=backend)
    assert torch.equal(out, checked)
    if backend == "torch":
        return  # the reference reads the offsets on the host
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(again, out)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_ragged_host_offsets_against_values_without_sync(backend):
    """A RaggedTensor whose host offsets end past its values: ValueError, read from the host copy
    (no sync), before any backend runs."""
    lengths = [3, 0, 5]
    q = torch.randn(8, 4, 64, device="cuda", dtype=torch.bfloat16)
    good = RaggedTensor.from_lengths(q, lengths)
    bad = RaggedTensor(q[:7], good.offsets, good.max_len, good.host_offsets())
    if backend in KERNELS:
        _needs(backend)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(
            ValueError,
            match=r"ragged\.attention\(\): expected q\.offsets\[-1\] == q\.num_tokens "
            r"\(7\), got 8",
        ):
            ragged.attention(bad, good, good, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _nan_guarded(x, lead=3, trail=64):
    """``x`` copied into the middle of a NaN buffer (NaN rows before and after, a NaN head beside)."""
    buf = torch.full(
        (lead + x.shape[0] + trail, x.shape[1] + 1, x.shape[2]), float("nan"), dtype=x.dtype, device=x.device
    )
    view = buf[lead : lead + x.shape[0], 1:]
    view.copy_(x)
    return view


# Backends whose kernels read their offsets as given (the contract: validate=True checks them).
_TRUSTS_OFFSETS = {
    "triton": "the Triton attention kernels trust their offsets (clipping cost 45% of the causal "
    "forward); validate=True checks them"
}


@pytest.mark.parametrize("backend", [*KERNELS, "auto"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("side", ["q", "k", "both"])
def test_kernels_clip_offsets_past_T(backend, side, causal):
    """CUDA offsets past T, unchecked (validate=False): each sequence is clipped to the rows the
    tensors have. Inputs sit in NaN buffers (a read past T gives NaN); the Triton backward writes
    into sentinel buffers (a write past T changes a sentinel)."""
    if backend in _TRUSTS_OFFSETS:
        pytest.skip(_TRUSTS_OFFSETS[backend])
    if backend in KERNELS:
        _needs(backend)
    lq, lk = [3, 0, 17, 9], [5, 2, 0, 20]
    gen = _gen("clip", backend, side, causal)
    q0, k0, v0 = _qkv(lq, lk, 4, 2, 64, torch.bfloat16, gen)
    tq = q0.shape[0]
    off_q = [0] + [sum(lq[: i + 1]) for i in range(len(lq))]
    off_k = [0] + [sum(lk[: i + 1]) for i in range(len(lk))]
    ref_cq, ref_ck = _cu(lq), _cu(lk)  # the clipped offsets are the valid ones
    if side in ("q", "both"):
        off_q[-1] += 11
    if side in ("k", "both"):
        off_k[-1] += 13
    cu_q = torch.tensor(off_q, dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(off_k, dtype=torch.int32, device="cuda")
    q, k, v = _nan_guarded(q0), _nan_guarded(k0), _nan_guarded(v0)
    if backend != "auto" and _reasons(backend, q, k, v, cu_q, cu_k, max(lq), max(lk), causal):
        pytest.skip(f"{backend} cannot take this input")
    out, lse = ragged.varlen_attention(
        q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, return_lse=True, backend=backend
    )
    ref, ref_lse = ragged.reference_attention(q0.double(), k0.double(), v0.double(), ref_cq, ref_ck, causal)
    low, _ = ragged.reference_attention(q0, k0, v0, ref_cq, ref_ck, causal, compute_dtype=q0.dtype)
    _assert_rule(f"{backend} out", out, ref, low, ATOL[q0.dtype])
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    if backend != "triton":
        return
    # gradients through the public path (the leaves are the guarded views themselves) ...
    _check_backward(lq, lk, q, k, v, causal, f"clip/{side}/{causal}", backend="triton", cu_q=cu_q, cu_k=cu_k)
    # ... and through the launcher, into sentinel buffers, with do, out and lse guarded too
    from ragged.kernels.triton import attention as ka

    do = _nan_guarded(torch.randn(q0.shape, generator=gen, device="cuda").to(q0.dtype))
    lse_g = torch.full((tq + 64, 4), float("nan"), device="cuda")[:tq]
    lse_g.copy_(lse)
    buffers = [torch.full((t.shape[0] + 64, *t.shape[1:]), 1234.5, dtype=t.dtype, device="cuda") for t in (q0, k0, v0)]
    views = tuple(b[: t.shape[0]] for b, t in zip(buffers, (q0, k0, v0)))
    from ragged.ops.attention import AttentionArgs, AttentionBackwardInputs, AttentionGrads

    args = AttentionArgs(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=max(lq), max_k=max(lk), causal=causal, scale=0.125)
    inputs = AttentionBackwardInputs(grad_out=do, out=_nan_guarded(out), lse=lse_g)
    grads = ka.backward(args, inputs, grads=AttentionGrads(*views))
    for name, g, view, buf in zip("qkv", grads, views, buffers):
        assert g is view
        assert torch.all(buf[view.shape[0] :] == 1234.5), f"d{name}: written past T"
        assert not torch.isnan(g).any(), f"d{name}: read past T"


@pytest.mark.parametrize("layout", ["feature_strided", "packed_qkv"])
def test_triton_backward_grads_buffers_of_any_strides(layout):
    _needs("triton")
    from ragged.kernels.triton import attention as ka

    lengths = [5, 0, 1, 70, 33]
    gen = _gen("grads", layout)
    q, k, v = _qkv(lengths, lengths, 4, 4, 64, torch.bfloat16, gen)
    do = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
    cu = _cu(lengths)
    from ragged.ops.attention import AttentionArgs, AttentionBackwardInputs, AttentionGrads

    args = AttentionArgs(q=q, k=k, v=v, cu_q=cu, cu_k=cu, max_q=70, max_k=70, causal=True, scale=0.125)
    out, lse = ka.forward(args)
    if layout == "feature_strided":
        grads = AttentionGrads(
            *(
                torch.full((t.shape[2], t.shape[1], t.shape[0]), 7.0, dtype=t.dtype, device="cuda").permute(2, 1, 0)
                for t in (q, k, v)
            )
        )
    else:
        grads = AttentionGrads(*torch.full((q.shape[0], 3, 4, 64), 7.0, dtype=q.dtype, device="cuda").unbind(1))
    inputs = AttentionBackwardInputs(grad_out=do, out=out, lse=lse)
    got = ka.backward(args, inputs, grads=grads)
    expected = ka.backward(args, inputs)
    for name, g, buf, e in zip("qkv", got[:3], grads[:3], expected[:3]):
        assert g is buf
        torch.testing.assert_close(g, e, atol=0, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")
