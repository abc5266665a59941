"""ragged.attention / ragged.varlen_attention on the GPU against the float64 reference.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise). Errors follow
flash-attn's rule: a kernel's max abs error against the float64 reference may be at most
twice that of the reference computed in the input dtype (``compute_dtype=q.dtype``), plus
``atol`` (1e-4 for float32, 1e-3 for float16 and bfloat16). The same rule holds for the
gradients. ``ragged.reference_attention`` itself is checked against an independent SDPA
loop in ``test_attention.py``.
"""

from __future__ import annotations

import pytest
import torch

import ragged
from ragged import RaggedTensor

pytestmark = pytest.mark.gpu
from gpu_attention_cases import (
    ATOL,
    BACKWARD_SETS,
    DIMS,
    DTYPES,
    KERNELS,
    LENGTHS,
    _assert_rule,
    _check_backward,
    _check_forward,
    _cu,
    _gen,
    _needs,
    _qkv,
    _reasons,
)

# --------------------------------------------------------------------------------------
# Accuracy


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", DIMS)
def test_accuracy(backend, dim, dtype, causal):
    """GQA (H = 4, H_kv = 2), self and cross lengths; forward for every backend that takes
    the input, backward for Triton."""
    _needs(backend)
    ran = []
    for name, (lq, lk) in LENGTHS.items():
        q, k, v = _qkv(lq, lk, 4, 2, dim, dtype, _gen(backend, dim, dtype, causal, name))
        reasons = _reasons(backend, q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal)
        if backend == "triton":
            assert reasons == [], f"triton refuses {name}: {reasons}"
        elif reasons:
            continue
        tag = f"{backend}/{name}/D={dim}/{dtype}/causal={causal}"
        _check_forward(backend, lq, lk, q, k, v, causal, tag)
        if backend == "triton" and name in BACKWARD_SETS:
            _check_backward(lq, lk, q, k, v, causal, tag)
        ran.append(name)
    if not ran:
        pytest.skip(f"{backend} takes none of these inputs")


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [8, 1])
def test_heads_mha_and_mqa(backend, kv_heads, causal):
    _needs(backend)
    ran = False
    for name in ("cross", "short_self"):
        lq, lk = LENGTHS[name]
        q, k, v = _qkv(lq, lk, 8, kv_heads, 64, torch.bfloat16, _gen("heads", backend, kv_heads, causal, name))
        if _reasons(backend, q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal):
            assert backend != "triton"
            continue
        tag = f"{backend}/{name}/H_kv={kv_heads}/causal={causal}"
        _check_forward(backend, lq, lk, q, k, v, causal, tag)
        if backend == "triton":
            _check_backward(lq, lk, q, k, v, causal, tag)
        ran = True
    if not ran:
        pytest.skip(f"{backend} takes none of these inputs")


@pytest.mark.parametrize("backend", KERNELS)
def test_int64_cu_seqlens_and_strided_inputs(backend):
    _needs(backend)
    lq, lk = LENGTHS["short_cross"]
    gen = _gen("strided", backend)
    # q as a head-major buffer seen token-major; k, v with a NaN head and NaN columns beside them
    q = torch.randn(4, sum(lq), 64, generator=gen, device="cuda").to(torch.float16).transpose(0, 1)
    kbuf = torch.full((sum(lk), 3, 72), float("nan"), dtype=torch.float16, device="cuda")
    vbuf = torch.full((sum(lk), 3, 72), float("nan"), dtype=torch.float16, device="cuda")
    k, v = kbuf[:, :2, :64], vbuf[:, :2, :64]
    k.copy_(torch.randn(k.shape, generator=gen, device="cuda"))
    v.copy_(torch.randn(v.shape, generator=gen, device="cuda"))
    cu_q, cu_k = _cu(lq, torch.int64), _cu(lk, torch.int64)
    if _reasons(backend, q, k, v, cu_q, cu_k, max(lq), max(lk), True):
        pytest.skip(f"{backend} cannot take int64 cu_seqlens here")
    out = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, backend=backend)
    ref, _ = ragged.reference_attention(q.double(), k.double(), v.double(), cu_q, cu_k, True)
    low, _ = ragged.reference_attention(q, k, v, cu_q, cu_k, True, compute_dtype=q.dtype)
    _assert_rule(backend, out, ref, low, ATOL[q.dtype])


# --------------------------------------------------------------------------------------
# Dropout


def _drawn_seed(manual_seed: int) -> int:
    """The dropout seed a call draws after ``torch.manual_seed(manual_seed)`` (torch's CPU generator)."""
    torch.manual_seed(manual_seed)
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())


def test_torch_hash_is_the_kernels_mask_on_the_gpu():
    """The torch form of the dropout hash (the reference's mask off CUDA) on CUDA tensors equals
    the Triton mask kernel's at a size with many chunks of rows and a fresh rate."""
    _needs("triton")
    from ragged.kernels.triton.attention import dropout_keep_mask
    from ragged.ops.attention_reference import hashed_keep_mask

    lengths = [1500, 0, 1, 3001, 777]
    heads, max_k, seed = 12, 3001, _drawn_seed(31)
    p = torch.rand((), generator=torch.Generator().manual_seed(31)).item()
    want = dropout_keep_mask(seed, p, _cu(lengths), heads, sum(lengths), max_k, torch.device("cuda"))
    got = hashed_keep_mask(seed, p, heads, sum(lengths), max_k, "cuda")
    assert torch.equal(got, want), f"{(got != want).sum().item()} entries differ"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_dropout_against_reference(dtype, causal):
    _needs("triton")
    from ragged.kernels.triton.attention import dropout_keep_mask

    lq, lk = LENGTHS["cross"]
    p = 0.3
    q, k, v = _qkv(lq, lk, 4, 2, 64, dtype, _gen("dropout", dtype, causal))
    cu_q, cu_k = _cu(lq), _cu(lk)
    up = torch.randn(q.shape, generator=_gen("dropout-up"), device="cuda").to(dtype)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    torch.manual_seed(2024)
    out = ragged.varlen_attention(*leaves, cu_q, cu_k, max(lq), max(lk), causal=causal, dropout_p=p, backend="triton")
    got = torch.autograd.grad(out, leaves, up)
    torch.manual_seed(2024)
    again = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, dropout_p=p, backend="triton")
    assert torch.equal(out.detach(), again)
    plain = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, backend="triton")
    assert not torch.allclose(out.detach(), plain)

    mask = dropout_keep_mask(_drawn_seed(2024), p, cu_q, 4, q.shape[0], max(lk), q.device)
    assert abs(mask.float().mean().item() - (1 - p)) < 4 * (p * (1 - p) / mask.numel()) ** 0.5

    def grads(dtype_, compute):
        ls = [t.detach().to(dtype_).requires_grad_(True) for t in (q, k, v)]
        o, _ = ragged.reference_attention(*ls, cu_q, cu_k, causal, None, mask, p, compute_dtype=compute)
        return o, torch.autograd.grad(o, ls, up.to(dtype_))

    ref, ref_grads = grads(torch.float64, torch.float64)
    low, low_grads = grads(dtype, dtype)
    _assert_rule("dropout out", out, ref, low, ATOL[dtype])
    for name, g, r, lo in zip("qkv", got, ref_grads, low_grads):
        _assert_rule(f"dropout d{name}", g, r, lo, ATOL[dtype])


# --------------------------------------------------------------------------------------
# No host sync, torch.compile, auto


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_no_host_sync(backend, dropout_p):
    _needs(backend)
    lq, lk = LENGTHS["short_cross"]
    gen = _gen("sync", backend)
    q, k, v = (
        RaggedTensor.from_lengths(t, n) for t, n in zip(_qkv(lq, lk, 4, 2, 64, torch.bfloat16, gen), (lq, lk, lk))
    )
    train = backend == "triton"
    if _reasons(
        backend, q.values, k.values, v.values, q.offsets, k.offsets, q.max_len, k.max_len, True, dropout_p, train
    ):
        pytest.skip(f"{backend} cannot take this input")
    if train:
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    up = torch.randn(q.values.shape, generator=gen, device="cuda").to(torch.bfloat16)

    def step():
        out, lse = ragged.attention(q, k, v, causal=True, dropout_p=dropout_p, return_lse=True, backend=backend)
        if train:
            out.values.backward(up)
        return out, lse

    step()  # warm up: compile the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert not torch.isnan(out.values).any()
    if train:
        assert q.values.grad is not None and k.values.grad is not None and v.values.grad is not None


def test_compile_fullgraph_with_backward():
    _needs("triton")
    torch._dynamo.reset()

    def f(q, k, v, cu_q, cu_k, max_q: int, max_k: int):
        out = ragged.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend="triton")
        return out.float() * 2

    compiled = torch.compile(f, fullgraph=True)
    for name in ("cross", "tiny"):
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
        ga = torch.autograd.grad(got, a, up)
        gb = torch.autograd.grad(exp, b, up)
        for name_, x, y in zip("qkv", ga, gb):
            torch.testing.assert_close(x, y, atol=1e-2, rtol=1e-2, msg=lambda m, n=name_: f"d{n}: {m}")
        low, _ = ragged.reference_attention(q, k, v, cu_q, cu_k, True, compute_dtype=q.dtype)
        ref, _ = ragged.reference_attention(q.double(), k.double(), v.double(), cu_q, cu_k, True)
        _assert_rule(f"compiled {name}", got / 2, ref, low, ATOL[q.dtype])


def test_compile_fullgraph_cuda_forward():
    _needs("cuda")
    torch._dynamo.reset()
    lq, lk = LENGTHS["short_cross"]
    q, k, v = _qkv(lq, lk, 4, 2, 64, torch.float16, _gen("compile-cuda"))
    cu_q, cu_k = _cu(lq), _cu(lk)
    if _reasons("cuda", q, k, v, cu_q, cu_k, max(lq), max(lk), True):
        pytest.skip("the CUDA kernel cannot take this input")

    def f(q, k, v):
        return ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, backend="cuda")

    got = torch.compile(f, fullgraph=True)(q, k, v)
    assert torch.equal(got, f(q, k, v))


def test_auto_backend_on_cuda():
    lq, lk = LENGTHS["short_cross"]
    q, k, v = _qkv(lq, lk, 4, 2, 64, torch.bfloat16, _gen("auto"))
    cu_q, cu_k = _cu(lq), _cu(lk)
    ref, _ = ragged.reference_attention(q.double(), k.double(), v.double(), cu_q, cu_k, True)
    low, _ = ragged.reference_attention(q, k, v, cu_q, cu_k, True, compute_dtype=q.dtype)
    out = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True)
    _assert_rule("auto", out, ref, low, 1e-3)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = ragged.varlen_attention(*leaves, cu_q, cu_k, max(lq), max(lk), causal=True)  # needs a backward
    _assert_rule("auto (grad)", out.detach(), ref, low, 1e-3)
    out.float().sum().backward()
    assert all(t.grad is not None and not torch.isnan(t.grad).any() for t in leaves)
