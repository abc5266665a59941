"""Relative-position bias (``position_bias=(table, buckets)``) on the GPU against the float64
reference.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise). Errors follow
flash-attn's rule (``gpu_attention_cases._assert_rule``): a kernel's max abs error against the
float64 reference may be at most twice that of the reference computed in the input dtype, plus
``atol``; float32 is also held near the float64 reference directly. The gradients of q, k, v
and the table follow the same rule. The reference itself is checked against an independent
oracle in ``test_attention_bias.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

import ragged
from ragged import RaggedTensor, backends

pytestmark = pytest.mark.gpu
from gpu_attention_cases import (
    ATOL,
    DTYPES,
    _assert_rule,
    _cu,
    _gen,
    _needs,
    _qkv,
)

# name: (query lengths, key lengths); "mpnet" is MPNet's shapes in small (8..128 tokens)
LENGTHS = {
    "self": ([1, 17, 0, 130, 64, 257, 33, 7], [1, 17, 0, 130, 64, 257, 33, 7]),
    "cross": ([3, 100, 0, 200, 1, 77], [50, 7, 9, 0, 300, 77]),
    "mpnet": ([8, 128, 37, 64, 100, 9, 71, 128, 15, 90], [8, 128, 37, 64, 100, 9, 71, 128, 15, 90]),
}


def _mpnet_buckets(max_q: int, max_k: int, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """MPNet's (T5's bidirectional) bucket of each distance ``j - i`` from ``-(max_q - 1)`` to
    ``max_k - 1``, int32 on the GPU."""
    n = -torch.arange(-(max_q - 1), max_k)
    half = num_buckets // 2
    out = (n < 0).long() * half
    n = n.abs()
    exact = half // 2
    large = exact + (torch.log(n.float().clamp_min(1) / exact) / math.log(max_distance / exact) * (half - exact)).long()
    return (out + torch.where(n < exact, n, large.clamp_max(half - 1))).to(torch.int32).cuda()


def _inputs(name, heads, kv_heads, dim, dtype, tag):
    lq, lk = LENGTHS[name]
    gen = _gen("bias", tag)
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, dtype, gen)
    table = torch.randn(32, heads, generator=gen, device="cuda")
    return lq, lk, q, k, v, table, _mpnet_buckets(max(lq), max(lk))


def _reference(q, k, v, lq, lk, causal, table, buckets, dtype):
    """The reference in ``dtype`` (inputs and table cast to it; float64: the oracle)."""
    cast = [t.to(dtype) for t in (q, k, v)]
    return ragged.reference_attention(
        *cast, _cu(lq), _cu(lk), causal, compute_dtype=dtype, position_bias=(table.to(dtype), buckets)
    )


def _grads(fn, tensors, up):
    leaves = [t.detach().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves, up.to(out.dtype))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("name", list(LENGTHS))
def test_accuracy(name, dim, dtype, causal):
    """Triton forward and gradients (q, k, v, table) by the flash-attn rule; GQA (H = 4, H_kv = 2)."""
    _needs("triton")
    lq, lk, q, k, v, table, buckets = _inputs(name, 4, 2, dim, dtype, (name, dim, dtype, causal))
    up = torch.randn(q.shape, generator=_gen("bias-up", name), device="cuda").to(dtype)
    tensors = (q, k, v, table)

    def kernel(a, b, c, t):
        return ragged.varlen_attention(
            a, b, c, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal, position_bias=(t, buckets), backend="triton"
        )

    def reference(dt):
        return lambda a, b, c, t: _reference(a, b, c, lq, lk, causal, t, buckets, dt)[0]

    out, got = _grads(kernel, tensors, up)
    ref, ref_grads = _grads(reference(torch.float64), tensors, up)
    low, low_grads = _grads(reference(dtype), tensors, up)
    tag = f"{name}/D={dim}/{dtype}/causal={causal}"
    assert out.dtype == dtype and got[3].dtype == table.dtype and got[3].shape == table.shape
    _assert_rule(f"{tag} out", out, ref, low, ATOL[dtype])
    for grad_name, g, r, lo in zip(("dq", "dk", "dv", "dtable"), got, ref_grads, low_grads):
        _assert_rule(f"{tag} {grad_name}", g, r, lo, ATOL[dtype] * (10 if grad_name == "dtable" else 1))
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
        for g, r in zip(got, ref_grads):
            torch.testing.assert_close(g.double(), r.double(), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("window", [(16, 16), (40, 0)], ids=str)
def test_windows_and_dropout(window):
    _needs("triton")
    lq, lk, q, k, v, table, buckets = _inputs("self", 4, 1, 64, torch.bfloat16, ("window", window))
    up = torch.randn(q.shape, generator=_gen("window-up"), device="cuda").to(q.dtype)
    args = (_cu(lq), _cu(lk), max(lq), max(lk))
    out, got = _grads(
        lambda a, b, c, t: ragged.varlen_attention(
            a, b, c, *args, window_size=window, position_bias=(t, buckets), backend="triton"
        ),
        (q, k, v, table),
        up,
    )
    ref, ref_grads = _grads(
        lambda a, b, c, t: ragged.reference_attention(
            a.double(),
            b.double(),
            c.double(),
            _cu(lq),
            _cu(lk),
            window_size=window,
            position_bias=(t.double(), buckets),
        )[0],
        (q, k, v, table),
        up,
    )
    low, low_grads = _grads(
        lambda a, b, c, t: ragged.reference_attention(
            a, b, c, _cu(lq), _cu(lk), window_size=window, compute_dtype=q.dtype, position_bias=(t.to(q.dtype), buckets)
        )[0],
        (q, k, v, table),
        up,
    )
    _assert_rule(f"window {window} out", out, ref, low, ATOL[q.dtype])
    for grad_name, g, r, lo in zip(("dq", "dk", "dv", "dtable"), got, ref_grads, low_grads):
        _assert_rule(f"window {window} {grad_name}", g, r, lo, ATOL[q.dtype] * (10 if grad_name == "dtable" else 1))
    # dropout: the torch backend draws the kernels' mask for the same seed
    torch.manual_seed(5)
    drop = ragged.varlen_attention(
        q, k, v, *args, dropout_p=0.2, window_size=window, position_bias=(table, buckets), backend="triton"
    )
    torch.manual_seed(5)
    drop_ref = ragged.varlen_attention(
        q.double(),
        k.double(),
        v.double(),
        *args,
        dropout_p=0.2,
        window_size=window,
        position_bias=(table.double(), buckets),
        backend="torch",
    )
    torch.testing.assert_close(drop.double(), drop_ref, atol=2e-2, rtol=2e-2)


def test_table_gradient_is_deterministic():
    _needs("triton")
    lq, lk, q, k, v, table, buckets = _inputs("self", 12, 12, 64, torch.bfloat16, "determinism")
    table = table.requires_grad_(True)
    up = torch.randn(q.shape, generator=_gen("determinism-up"), device="cuda").to(q.dtype)
    runs = []
    for _ in range(3):
        out = ragged.varlen_attention(
            q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=True, position_bias=(table, buckets), backend="triton"
        )
        runs.append(torch.autograd.grad(out, table, up)[0])
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


def test_no_host_sync():
    _needs("triton")
    lq, lk, q, k, v, table, buckets = _inputs("mpnet", 12, 12, 64, torch.bfloat16, "sync")
    q, k, v = (RaggedTensor.from_lengths(t, n) for t, n in zip((q, k, v), (lq, lk, lk)))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    table = table.requires_grad_(True)
    up = torch.randn(q.values.shape, generator=_gen("sync-up"), device="cuda").to(torch.bfloat16)

    def step():
        out = ragged.attention(q, k, v, dropout_p=0.1, position_bias=(table, buckets), backend="triton")
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
    assert not torch.isnan(out.values).any() and torch.isfinite(table.grad).all()


def test_cuda_graph_capture():
    """Forward and backward captured once and replayed on new values: the grids come from host
    ints, the bias is read on the device."""
    _needs("triton")
    lq, lk, q, k, v, table, buckets = _inputs("mpnet", 12, 12, 64, torch.bfloat16, "graph")
    cu_q, cu_k = _cu(lq), _cu(lk)
    table = table.requires_grad_(True)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    up = torch.randn(q.shape, generator=_gen("graph-up"), device="cuda").to(q.dtype)

    def step():
        out = ragged.varlen_attention(
            q, k, v, cu_q, cu_k, max(lq), max(lk), position_bias=(table, buckets), backend="triton"
        )
        return (out,) + torch.autograd.grad(out, (q, k, v, table), up)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up on the side stream: compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for t in (q, k, v, table):
            t.copy_(torch.randn(t.shape, generator=_gen("graph-new"), device="cuda").to(t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for name, a, b in zip(("out", "dq", "dk", "dv", "dtable"), captured, eager):
        assert torch.equal(a, b), f"{name}: the replay differs from an eager call on the same values"


# The CUDA short-sequence kernel's cases (<= 128 tokens): "many" reaches its pipelined kernel
# (enough (sequence, head) pairs, every sequence <= 32 tokens), the others the per-head one.
_MANY = torch.randint(0, 33, (240,), generator=torch.Generator().manual_seed(5)).tolist()
CUDA_LENGTHS = {
    "mpnet": LENGTHS["mpnet"],
    "cross": ([3, 100, 0, 128, 1, 77], [50, 7, 9, 0, 128, 77]),
    "many": (_MANY, _MANY),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("name", list(CUDA_LENGTHS))
def test_cuda_forward_accuracy(name, dim, dtype, causal):
    """The short-sequence kernel's forward with the bias (its ``_bias`` kernels) by the flash-attn
    rule, out and lse; GQA (H = 12, H_kv = 4); the same kernel without the bias unchanged."""
    _needs("cuda")
    lq, lk = CUDA_LENGTHS[name]
    gen = _gen("bias-cuda", name, dim, dtype, causal)
    q, k, v = _qkv(lq, lk, 12, 4, dim, dtype, gen)
    table = torch.randn(32, 12, generator=gen, device="cuda")
    buckets = _mpnet_buckets(max(lq), max(lk))
    args = (q, k, v, _cu(lq), _cu(lk), max(lq), max(lk))
    with torch.no_grad():
        out, lse = ragged.varlen_attention(
            *args, causal=causal, position_bias=(table, buckets), return_lse=True, backend="cuda"
        )
        plain = ragged.varlen_attention(*args, causal=causal, backend="cuda")
    ref, ref_lse = _reference(q, k, v, lq, lk, causal, table, buckets, torch.float64)
    low, low_lse = _reference(q, k, v, lq, lk, causal, table, buckets, dtype)
    tag = f"{name}/D={dim}/{dtype}/causal={causal}"
    _assert_rule(f"{tag} out", out, ref, low, ATOL[dtype])
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), f"{tag}: rows without keys differ"
    _assert_rule(f"{tag} lse", lse[seen], ref_lse[seen], low_lse[seen].float(), ATOL[dtype])
    unbiased = ragged.reference_attention(
        *(t.double() for t in (q, k, v)), _cu(lq), _cu(lk), causal, compute_dtype=torch.float64
    )[0]
    assert (plain.double() - unbiased).abs().max() < (out.double() - unbiased).abs().max(), (
        f"{tag}: the bias changed nothing"
    )


def test_auto_takes_the_cuda_kernel_for_inference_only():
    """With a bias, "auto" keeps the choice it makes without one for inference (the CUDA kernel at
    MPNet's sizes) and takes Triton when a gradient is needed (the CUDA kernel is forward only)."""
    _needs("triton")
    lq, lk, q, k, v, table, buckets = _inputs("mpnet", 12, 12, 64, torch.bfloat16, "auto")
    args = (q, k, v, _cu(lq), _cu(lk), max(lq), max(lk))
    plain = backends.select("attention", "auto", q.device, *args, False, 0.0, False)
    inference = backends.select("attention", "auto", q.device, *args, False, 0.0, False, (-1, -1), (table, buckets))
    training = backends.select("attention", "auto", q.device, *args, False, 0.0, True, (-1, -1), (table, buckets))
    assert inference.backend == plain.backend and training.backend == "triton"
    if backends.cuda_reason(q.device) is None:
        assert inference.backend == "cuda"
        reasons = ragged.explain("attention", *args, False, 0.0, True, (-1, -1), (table, buckets))
        assert any("forward only" in r for r in reasons["cuda"]), reasons["cuda"]


def test_validate_reads_the_buckets():
    """CUDA buckets are not read by default (a sync per call); ``validate=True`` checks them."""
    lq, lk, q, k, v, table, buckets = _inputs("mpnet", 2, 2, 64, torch.bfloat16, "validate")
    bad = buckets.clone()
    bad[3] = 32
    with pytest.raises(ValueError, match=r"position_bias buckets in \[0, 32\)"):
        ragged.varlen_attention(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), position_bias=(table, bad), validate=True)
