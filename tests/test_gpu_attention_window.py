"""Sliding-window attention (``window_size=(left, right)``) on the GPU against the float64 reference.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise). Errors follow
flash-attn's rule, as in ``test_gpu_attention.py``: a kernel's max abs error against the
float64 reference may be at most twice that of the reference computed in the input dtype
(``compute_dtype=q.dtype``), plus ``atol`` (1e-4 for float32, 1e-3 for float16 and bfloat16),
for the output, lse and the gradients. ``ragged.reference_attention`` with a window is checked
against the definition in ``test_attention_window.py``.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from gpu_attention_cases import _assert_rule  # flash-attn's error rule, as the other GPU attention tests apply it

import ragged
from ragged import RaggedTensor, backends

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
ATOL = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-3}

# name: (query lengths, key lengths)
LENGTHS = {
    "self": ([1, 17, 0, 130, 64, 257, 33, 7], [1, 17, 0, 130, 64, 257, 33, 7]),
    "cross": ([3, 100, 0, 200, 1, 77], [50, 7, 9, 0, 300, 77]),
    "short": ([1, 17, 0, 64, 33, 7, 5], [1, 17, 0, 64, 33, 7, 5]),
}
WINDOWS = [(0, 0), (3, -1), (-1, 2), (64, 31), (300, 300)]


def _cu(lengths, dtype=torch.int32):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype, device="cuda")


def _gen(*parts):
    return torch.Generator(device="cuda").manual_seed(zlib.crc32("/".join(map(str, parts)).encode()))


def _qkv(lq, lk, heads, kv_heads, dim, dtype, gen):
    q = torch.randn(sum(lq), heads, dim, generator=gen, device="cuda").to(dtype)
    k = torch.randn(sum(lk), kv_heads, dim, generator=gen, device="cuda").to(dtype)
    v = torch.randn(sum(lk), kv_heads, dim, generator=gen, device="cuda").to(dtype)
    return q, k, v


def _needs_triton():
    reason = backends.triton_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)


def _check(lq, lk, q, k, v, causal, window, tag, backward=True, backend="triton"):
    """Forward (out, lse, rows that see no key) and, with ``backward``, dq, dk, dv of ``backend``
    against the float64 reference, by flash-attn's rule."""
    cu_q, cu_k = _cu(lq), _cu(lk)
    atol = ATOL[q.dtype]
    gen = _gen("up", tag)
    up = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)

    def run(dtype, fn):
        leaves = [t.detach().to(dtype).requires_grad_(backward) for t in (q, k, v)]
        out, lse = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, up.to(dtype)) if backward else None
        return out.detach(), lse, grads

    got, lse, got_grads = run(
        q.dtype,
        lambda a, b, c: ragged.varlen_attention(
            a, b, c, cu_q, cu_k, max(lq), max(lk), causal=causal, return_lse=True, backend=backend, window_size=window
        ),
    )
    ref, ref_lse, ref_grads = run(
        torch.float64, lambda a, b, c: ragged.reference_attention(a, b, c, cu_q, cu_k, causal, window_size=window)
    )
    low, low_lse, low_grads = run(
        q.dtype,
        lambda a, b, c: ragged.reference_attention(
            a, b, c, cu_q, cu_k, causal, compute_dtype=q.dtype, window_size=window
        ),
    )
    assert got.shape == q.shape and got.dtype == q.dtype and lse.dtype == torch.float32
    _assert_rule(f"{tag} out", got, ref, low, atol)
    blind = torch.isneginf(ref_lse)
    assert torch.all(got[blind] == 0), f"{tag}: a query that sees no key must get zeros"
    assert torch.equal(torch.isneginf(lse), blind), f"{tag}: lse = -inf exactly where no key is seen"
    _assert_rule(f"{tag} lse", lse[~blind], ref_lse[~blind], low_lse[~blind], atol)
    if backward:
        for name, g, r, lo, t in zip("qkv", got_grads, ref_grads, low_grads, (q, k, v)):
            assert g.shape == t.shape and g.dtype == t.dtype
            _assert_rule(f"{tag} d{name}", g, r, lo, atol)


# --------------------------------------------------------------------------------------
# Accuracy


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [64, 128])
def test_accuracy(dim, dtype, causal, window):
    """GQA (H = 4, H_kv = 2), self, cross and short lengths, forward and backward."""
    _needs_triton()
    for name, (lq, lk) in LENGTHS.items():
        q, k, v = _qkv(lq, lk, 4, 2, dim, dtype, _gen(dim, dtype, causal, window, name))
        _check(lq, lk, q, k, v, causal, window, f"{name}/D={dim}/{dtype}/causal={causal}/window={window}")


@pytest.mark.parametrize("dim", [32, 80, 96, 256])
def test_other_head_dims(dim):
    _needs_triton()
    lq, lk = LENGTHS["cross"]
    for causal, window in ((False, (5, 9)), (True, (17, -1))):
        q, k, v = _qkv(lq, lk, 4, 1, dim, torch.bfloat16, _gen("dims", dim, causal))
        _check(lq, lk, q, k, v, causal, window, f"D={dim}/causal={causal}/window={window}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_long_sequences(dtype, causal):
    """Sequences to 2048 tokens with a window of 256 (the key blocks skipped are most of them)."""
    _needs_triton()
    lq = lk = [2048, 1000, 17, 2048, 0, 300]
    window = (256, -1) if causal else (256, 256)
    q, k, v = _qkv(lq, lk, 8, 2, 128, dtype, _gen("long", dtype, causal))
    _check(lq, lk, q, k, v, causal, window, f"long/{dtype}/causal={causal}")


def test_dropout_against_reference():
    _needs_triton()
    from ragged.kernels.triton.attention import dropout_keep_mask

    lq, lk = LENGTHS["cross"]
    p, window = 0.3, (20, 3)
    q, k, v = _qkv(lq, lk, 4, 2, 64, torch.float16, _gen("dropout"))
    cu_q, cu_k = _cu(lq), _cu(lk)
    up = torch.randn(q.shape, generator=_gen("dropout-up"), device="cuda").to(q.dtype)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    torch.manual_seed(2024)
    out = ragged.varlen_attention(
        *leaves, cu_q, cu_k, max(lq), max(lk), dropout_p=p, backend="triton", window_size=window
    )
    got = torch.autograd.grad(out, leaves, up)
    torch.manual_seed(2024)
    seed = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())
    mask = dropout_keep_mask(seed, p, cu_q, 4, q.shape[0], max(lk), q.device)

    def grads(dtype, compute):
        ls = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        o, _ = ragged.reference_attention(
            *ls, cu_q, cu_k, False, None, mask, p, compute_dtype=compute, window_size=window
        )
        return o, torch.autograd.grad(o, ls, up.to(dtype))

    ref, ref_grads = grads(torch.float64, torch.float64)
    low, low_grads = grads(q.dtype, q.dtype)
    _assert_rule("dropout out", out, ref, low, ATOL[q.dtype])
    for name, g, r, lo in zip("qkv", got, ref_grads, low_grads):
        _assert_rule(f"dropout d{name}", g, r, lo, ATOL[q.dtype])


# --------------------------------------------------------------------------------------
# Choosing a backend, no host sync, torch.compile


def test_cuda_kernel_is_never_chosen_for_a_window():
    """Short sequences, where "auto" prefers the CUDA kernel: a window that bounds a key leaves
    it to Triton (explain says why; forcing it raises); one that bounds nothing does not."""
    _needs_triton()
    lq, lk = LENGTHS["short"]
    q, k, v = _qkv(lq, lk, 4, 2, 64, torch.bfloat16, _gen("choose"))
    cu_q, cu_k = _cu(lq), _cu(lk)
    args = (q, k, v, cu_q, cu_k, max(lq), max(lk))
    reasons = ragged.explain(ragged.varlen_attention, *args, window_size=(4, 4))
    assert reasons["triton"] == []
    assert backends.select("attention", "auto", q.device, *args, False, 0.0, False, (4, 4)).backend == "triton"
    if backends.cuda_reason(q.device) is not None:  # the check runs once the toolchain is there
        pytest.skip(backends.cuda_reason(q.device))
    assert any("no sliding window" in r for r in reasons["cuda"]), reasons["cuda"]
    with pytest.raises(ValueError, match="no sliding window"):
        ragged.varlen_attention(*args, backend="cuda", window_size=(4, 4))
    wide = ragged.explain(ragged.varlen_attention, *args, window_size=(500, 500))["cuda"]
    assert wide == [], wide
    assert backends.select("attention", "auto", q.device, *args, False, 0.0, False, (500, 500)).backend == "cuda"
    torch.testing.assert_close(
        ragged.varlen_attention(*args, window_size=(500, 500)),
        ragged.varlen_attention(*args, backend="triton"),
        atol=2e-2,
        rtol=2e-2,
    )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_no_host_sync(causal):
    _needs_triton()
    lq, lk = LENGTHS["cross"]
    gen = _gen("sync", causal)
    q, k, v = (
        RaggedTensor.from_lengths(t, n) for t, n in zip(_qkv(lq, lk, 4, 2, 64, torch.bfloat16, gen), (lq, lk, lk))
    )
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    up = torch.randn(q.values.shape, generator=gen, device="cuda").to(torch.bfloat16)

    def step():
        out = ragged.attention(q, k, v, causal=causal, dropout_p=0.1, window_size=(16, 8))
        out.values.backward(up)
        return out

    step()  # warm up: compile the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert not torch.isnan(out.values).any()


def test_compile_fullgraph_with_backward():
    _needs_triton()
    torch._dynamo.reset()

    def f(q, k, v, cu_q, cu_k, max_q: int, max_k: int):
        out = ragged.varlen_attention(
            q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend="triton", window_size=(32, -1)
        )
        return out.float() * 2

    compiled = torch.compile(f, fullgraph=True)
    for name in ("self", "cross"):
        lq, lk = LENGTHS[name]
        gen = _gen("compile", name)
        q, k, v = _qkv(lq, lk, 4, 2, 64, torch.bfloat16, gen)
        cu_q, cu_k = _cu(lq), _cu(lk)
        up = torch.randn(q.shape, generator=gen, device="cuda")
        a = [t.clone().requires_grad_(True) for t in (q, k, v)]
        b = [t.clone().requires_grad_(True) for t in (q, k, v)]
        got = compiled(*a, cu_q, cu_k, max(lq), max(lk))
        exp = f(*b, cu_q, cu_k, max(lq), max(lk))
        torch.testing.assert_close(got, exp, atol=1e-3, rtol=1e-3)
        for name_, x, y in zip("qkv", torch.autograd.grad(got, a, up), torch.autograd.grad(exp, b, up)):
            torch.testing.assert_close(x, y, atol=1e-2, rtol=1e-2, msg=lambda m, n=name_: f"d{n}: {m}")
