"""The Hopper kernels (``ragged.kernels.triton.attention_hopper`` and ``attention_hopper_bwd``,
``RAGGED_ATTENTION_HOPPER=1``) on an sm_90 GPU: flash-attn's error rule against the float64
reference (see ``test_gpu_attention.py``) for the output and every gradient, no host sync, CUDA
graphs, and the calls they do not take. Skipped on other GPUs."""

from __future__ import annotations

import pytest
import torch

import ragged

pytestmark = pytest.mark.gpu

from attention_cases import spy_hopper
from gpu_attention_cases import (
    ATOL,
    _assert_rule,
    _check_backward,
    _check_forward,
    _cu,
    _gen,
    _needs,
    _qkv,
)
from gpu_attention_cases import (
    LENGTHS as CASES,
)

# zero-length sequences, length 1, lengths off the tiles, cross lengths, one long sequence
LENGTHS = {
    "self": CASES["self"],
    "cross": CASES["cross"],
    "long_tail": ([4000, 3, 1, 129, 0, 700], [4000, 3, 1, 129, 0, 700]),
}


@pytest.fixture
def hopper(monkeypatch):
    _needs("triton")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper kernels run on sm_90 only")
    return spy_hopper(monkeypatch)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_hopper_forward_accuracy(dim, dtype, causal, heads, hopper):
    for name, (lq, lk) in LENGTHS.items():
        q, k, v = _qkv(lq, lk, *heads, dim, dtype, _gen("hopper", dim, dtype, causal, name, heads))
        before = len(hopper)
        _check_forward("triton", lq, lk, q, k, v, causal, f"hopper/{name}/D={dim}/{dtype}/causal={causal}")
        assert len(hopper) == before + 1, f"{name}: the Hopper forward did not run"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim", [64, 128])
def test_hopper_backward_accuracy(dim, dtype, causal, hopper):
    """dq, dk, dv under flash-attn's rule, GQA, self, cross and long-tailed lengths."""
    for name, (lq, lk) in LENGTHS.items():
        q, k, v = _qkv(lq, lk, 4, 2, dim, dtype, _gen("hopper-bwd", dim, dtype, causal, name))
        _check_backward(lq, lk, q, k, v, causal, f"hopper-bwd/{name}/D={dim}/{dtype}/causal={causal}")
        assert ("backward", q.shape) in hopper, f"{name}: the Hopper backward did not run"


def test_hopper_backward_is_deterministic(hopper):
    """Two backward passes give the same bits (one program writes each gradient element)."""
    lq, lk = LENGTHS["long_tail"]
    q, k, v = (t.requires_grad_(True) for t in _qkv(lq, lk, 4, 2, 128, torch.bfloat16, _gen("hopper-det")))
    do = torch.randn(q.shape, generator=_gen("hopper-det-do"), device="cuda").to(q.dtype)
    runs = [
        torch.autograd.grad(
            ragged.varlen_attention(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=True, backend="triton"),
            (q, k, v),
            do,
        )
        for _ in range(2)
    ]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_hopper_forward_is_graph_safe_and_sync_free(hopper):
    """No host sync in a call; captured in a CUDA graph, a replay with new offsets and values in
    the same buffers gives the eager result (the descriptors are made on the device, per call)."""
    lq = [300, 1, 77, 0, 512]
    q, k, v = _qkv(lq, lq, 4, 4, 128, torch.bfloat16, _gen("hopper-graph"))
    cu = _cu(lq)
    torch.cuda.set_sync_debug_mode("error")
    try:
        ragged.varlen_attention(q, k, v, cu, cu, 512, 512, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ragged.varlen_attention(q, k, v, cu, cu, 512, 512, backend="triton")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ragged.varlen_attention(q, k, v, cu, cu, 512, 512, backend="triton")
    lq2 = [512, 0, 1, 300, 77]
    cu.copy_(_cu(lq2))
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, generator=_gen("hopper-graph-2", t.shape), device="cuda").to(t.dtype))
    graph.replay()
    want = ragged.varlen_attention(q, k, v, _cu(lq2), _cu(lq2), 512, 512, backend="triton")
    torch.testing.assert_close(out, want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [(64, 0), (100, 37), (0, 0)], ids=str)
def test_hopper_window_accuracy(window, dtype, hopper):
    """Sliding windows: output and gradients against the float64 reference with the window."""
    lq, lk = LENGTHS["long_tail"]
    q, k, v = _qkv(lq, lk, 4, 2, 128, dtype, _gen("hopper-window", window, dtype))
    cu = _cu(lq)
    up = torch.randn(q.shape, generator=_gen("hopper-window-up"), device="cuda").to(dtype)

    def grads(fn, cast):
        leaves = [t.detach().to(cast).requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, up.to(cast)))

    got = grads(
        lambda a, b, c: ragged.varlen_attention(
            a, b, c, cu, cu, max(lq), max(lq), window_size=window, backend="triton"
        ),
        dtype,
    )
    ref = grads(
        lambda a, b, c: ragged.reference_attention(a, b, c, cu, cu, False, window_size=window)[0], torch.float64
    )
    low = grads(
        lambda a, b, c: ragged.reference_attention(a, b, c, cu, cu, False, window_size=window, compute_dtype=dtype)[0],
        dtype,
    )
    assert q.shape in hopper and ("backward", q.shape) in hopper
    for name, g, r, lo in zip(("out", "dq", "dk", "dv"), got, ref, low):
        _assert_rule(f"window {window} {name}", g, r, lo, ATOL[dtype])


def test_hopper_dropout_accuracy(hopper):
    """Dropout: output and gradients against the float64 reference given the kernels' keep mask."""
    from ragged.kernels.triton.attention import dropout_keep_mask

    lq, lk = LENGTHS["cross"]
    dtype, p = torch.bfloat16, 0.2
    q, k, v = _qkv(lq, lk, 4, 2, 128, dtype, _gen("hopper-dropout"))
    cq, ck = _cu(lq), _cu(lk)
    torch.manual_seed(31)
    seed = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())
    mask = dropout_keep_mask(seed, p, cq, 4, q.shape[0], max(lk), q.device)
    up = torch.randn(q.shape, generator=_gen("hopper-dropout-up"), device="cuda").to(dtype)

    def grads(fn, cast):
        leaves = [t.detach().to(cast).requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, up.to(cast)))

    def ours(a, b, c):
        torch.manual_seed(31)
        return ragged.varlen_attention(a, b, c, cq, ck, max(lq), max(lk), causal=True, dropout_p=p, backend="triton")

    got = grads(ours, dtype)
    ref = grads(lambda a, b, c: ragged.reference_attention(a, b, c, cq, ck, True, None, mask, p)[0], torch.float64)
    low = grads(
        lambda a, b, c: ragged.reference_attention(a, b, c, cq, ck, True, None, mask, p, compute_dtype=dtype)[0], dtype
    )
    assert q.shape in hopper and ("backward", q.shape) in hopper
    for name, g, r, lo in zip(("out", "dq", "dk", "dv"), got, ref, low):
        _assert_rule(f"dropout {name}", g, r, lo, ATOL[dtype])


def test_hopper_kernels_not_taken_where_they_do_not_go(hopper):
    """float32, a position bias and operands off the TMA's 16-byte alignment stay portable."""
    lq = [40, 9]
    q, k, v = _qkv(lq, lq, 2, 2, 64, torch.bfloat16, _gen("hopper-not"))
    cu = _cu(lq)
    ragged.varlen_attention(q.float(), k.float(), v.float(), cu, cu, 40, 40, backend="triton")
    table = torch.randn(8, 2, device="cuda")
    buckets = torch.randint(0, 8, (2 * 40 - 1,), dtype=torch.int32, device="cuda")
    ragged.varlen_attention(q, k, v, cu, cu, 40, 40, position_bias=(table, buckets), backend="triton")
    flat = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape)
    flat.copy_(q)
    ragged.varlen_attention(flat, k, v, cu, cu, 40, 40, backend="triton")
    assert not hopper


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_auto_takes_the_forward_of_long_batches_and_leaves_the_backward(causal, hopper, monkeypatch):
    """``auto`` (the default): the sm_90 forward for a batch whose longest query reaches
    ``sm90_min_len``, the portable backward after it (gradients under the rule), and neither
    for a short batch. At head dim 64, where the warp-specialised forward is not ranked first
    (its rule: tests/test_gpu_attention_ws.py)."""
    from ragged.kernels import triton as triton_backend

    monkeypatch.delenv("RAGGED_ATTENTION_HOPPER")
    lq, lk = LENGTHS["long_tail"]
    assert max(lq) >= triton_backend.sm90_min_len(64, causal) and triton_backend.ws_min_len(64, causal) is None
    q, k, v = _qkv(lq, lk, 4, 2, 64, torch.bfloat16, _gen("hopper-auto", causal))
    _check_forward("triton", lq, lk, q, k, v, causal, f"auto/long/causal={causal}")
    assert hopper == [q.shape]
    _check_backward(lq, lk, q, k, v, causal, f"auto/long-bwd/causal={causal}")
    assert q.shape in hopper and not any(isinstance(c, tuple) and c[0] == "backward" for c in hopper)
    hopper.clear()
    short = [triton_backend.sm90_min_len(64, causal) - 1, 5, 300]
    q, k, v = _qkv(short, short, 4, 2, 64, torch.bfloat16, _gen("hopper-auto-short", causal))
    _check_forward("triton", short, short, q, k, v, causal, f"auto/short/causal={causal}")
    assert hopper == []
