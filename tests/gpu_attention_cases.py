"""What the GPU attention tests share (test_gpu_attention.py, test_gpu_attention_offsets.py): head
dims, dtypes and tolerances, the lengths cases, seeded q/k/v, the float64 oracle and the error
rule of the forward and backward checks."""

from __future__ import annotations

import zlib

import pytest
import torch

import ragged
from ragged import backends

DIMS = [32, 64, 80, 96, 128, 256]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
ATOL = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-3}
KERNELS = ["triton", "cuda"]

# name: (query lengths, key lengths). "short*" fit the CUDA short-sequence kernel
# (<= 128 tokens); "tiny" stays <= 64 tokens (the Triton launcher's short-sequence shapes).
LENGTHS = {
    "self": ([1, 17, 0, 130, 64, 257, 33, 7], [1, 17, 0, 130, 64, 257, 33, 7]),
    "cross": ([3, 100, 0, 200, 1, 77], [50, 7, 9, 0, 300, 77]),
    "short_self": ([1, 17, 0, 128, 64, 33, 7, 100], [1, 17, 0, 128, 64, 33, 7, 100]),
    "short_cross": ([3, 100, 0, 50, 1, 128], [50, 7, 9, 0, 128, 77]),
    "tiny": ([1, 17, 0, 64, 33, 7, 5], [1, 17, 0, 64, 33, 7, 5]),
}
BACKWARD_SETS = ("self", "cross", "tiny")


def _cu(lengths, dtype=torch.int32):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype, device="cuda")


def _qkv(lq, lk, heads, kv_heads, dim, dtype, gen):
    q = torch.randn(sum(lq), heads, dim, generator=gen, device="cuda").to(dtype)
    k = torch.randn(sum(lk), kv_heads, dim, generator=gen, device="cuda").to(dtype)
    v = torch.randn(sum(lk), kv_heads, dim, generator=gen, device="cuda").to(dtype)
    return q, k, v


def _gen(*parts):
    return torch.Generator(device="cuda").manual_seed(zlib.crc32("/".join(map(str, parts)).encode()))


def _blind_rows(lq, lk, causal):
    """[Tq] bool on the GPU: queries that see no key (bottom-right causal)."""
    rows = []
    for nq, nk in zip(lq, lk):
        i = torch.arange(nq)
        rows.append((nk == 0) | ((i + nk - nq < 0) if causal else torch.zeros(nq, dtype=torch.bool)))
    return torch.cat(rows).cuda() if rows else torch.zeros(0, dtype=torch.bool, device="cuda")


def _reasons(backend, q, k, v, cu_q, cu_k, max_q, max_k, causal, dropout_p=0.0, needs_grad=False):
    return ragged.explain("attention", q, k, v, cu_q, cu_k, max_q, max_k, causal, dropout_p, needs_grad)[backend]


def _needs(backend):
    reason = (
        backends.triton_reason(torch.device("cuda"))
        if backend == "triton"
        else backends.cuda_reason(torch.device("cuda"))
    )
    if reason:
        pytest.skip(reason)


def _max_err(a, b):
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def _assert_rule(name, got, ref64, low, atol):
    """flash-attn's rule: err(got) <= 2 * err(low) + atol, both against float64."""
    assert not torch.isnan(got).any(), f"{name}: NaN"
    err = _max_err(got, ref64)
    err_low = _max_err(low, ref64)
    assert err <= 2 * err_low + atol, f"{name}: error {err:.3g} > 2 * {err_low:.3g} + {atol}"


def _check_forward(backend, lq, lk, q, k, v, causal, tag):
    cu_q, cu_k = _cu(lq), _cu(lk)
    out, lse = ragged.varlen_attention(
        q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, return_lse=True, backend=backend
    )
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:2] and lse.dtype == torch.float32
    ref, ref_lse = ragged.reference_attention(q.double(), k.double(), v.double(), cu_q, cu_k, causal)
    low, low_lse = ragged.reference_attention(q, k, v, cu_q, cu_k, causal, compute_dtype=q.dtype)
    atol = ATOL[q.dtype]
    _assert_rule(f"{tag} out", out, ref, low, atol)
    blind = _blind_rows(lq, lk, causal)
    assert torch.all(out[blind] == 0), f"{tag}: a query that sees no key must get zeros"
    assert torch.all(torch.isneginf(lse[blind])), f"{tag}: a query that sees no key must get lse = -inf"
    assert torch.all(torch.isfinite(lse[~blind])), f"{tag}: lse"
    _assert_rule(f"{tag} lse", lse[~blind], ref_lse[~blind], low_lse[~blind], atol)


def _check_backward(lq, lk, q, k, v, causal, tag, backend="triton", cu_q=None, cu_k=None):
    """Gradients of ``backend`` against the reference; ``cu_q`` / ``cu_k``: the offsets the
    backend gets (default: contiguous ones from the lengths; the reference always gets those)."""
    ref_cq, ref_ck = _cu(lq), _cu(lk)
    cu_q = ref_cq if cu_q is None else cu_q
    cu_k = ref_ck if cu_k is None else cu_k
    gen = _gen("up", tag)
    up = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        return torch.autograd.grad(fn(*leaves), leaves, up.to(dtype))

    got = grads(
        lambda a, b, c: ragged.varlen_attention(a, b, c, cu_q, cu_k, max(lq), max(lk), causal=causal, backend=backend),
        q.dtype,
    )
    ref = grads(lambda a, b, c: ragged.reference_attention(a, b, c, ref_cq, ref_ck, causal)[0], torch.float64)
    low = grads(
        lambda a, b, c: ragged.reference_attention(a, b, c, ref_cq, ref_ck, causal, compute_dtype=q.dtype)[0], q.dtype
    )
    for name, g, r, lo, t in zip("qkv", got, ref, low, (q, k, v)):
        assert g.shape == t.shape and g.dtype == t.dtype
        _assert_rule(f"{tag} d{name}", g, r, lo, ATOL[q.dtype])
