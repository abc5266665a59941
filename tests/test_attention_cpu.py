"""Attention's "torch" implementation on the CPU (ragged.ops.attention_cpu): sequences grouped by
length into padded calls of torch's fused CPU kernel. Checked against the float64 per-sequence
reference on fresh random inputs, with lengths spread wide enough that a batch splits into
several groups (asserted), and the grouping itself against its contract."""

from __future__ import annotations

import pytest
import torch

import ragged
from ragged.ops import attention_cpu

# name: (query lengths, key lengths, H, H_kv); lengths from 1 to 150 tokens: several groups
CASES = {
    "self": ([150, 3, 40, 0, 90, 7, 128, 1, 33], None, 4, 4),
    "self_gqa": ([5, 140, 0, 60, 2, 100, 17], None, 4, 2),
    "self_mqa": ([120, 9, 64, 1, 31], None, 2, 1),
    "cross_q_shorter": ([3, 100, 1, 40, 8], [20, 130, 5, 70, 8], 2, 2),
    "cross_q_longer": ([60, 130, 9, 2, 40], [7, 100, 0, 1, 90], 2, 1),
}
WINDOWS = [(-1, -1), (4, -1), (3, 2), (-1, 0)]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float64: 1e-10}


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_torch_backend_equals_the_float64_reference(case, causal, window, dtype):
    lq, lk, heads, kv_heads = CASES[case]
    lk = lq if lk is None else lk
    cu_q, cu_k = _cu(lq), _cu(lk)
    assert len(attention_cpu.plan(cu_q.tolist(), cu_k.tolist())) > 1  # the case covers several groups
    q = torch.randn(sum(lq), heads, 16).to(dtype)
    k = torch.randn(sum(lk), kv_heads, 16).to(dtype)
    v = torch.randn(sum(lk), kv_heads, 16).to(dtype)
    out, lse = ragged.varlen_attention(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(lq),
        max(lk),
        causal=causal,
        scale=0.3,
        return_lse=True,
        backend="torch",
        window_size=window,
    )
    ref, ref_lse = ragged.reference_attention(
        q.double(), k.double(), v.double(), cu_q, cu_k, causal, 0.3, window_size=window
    )
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    blind = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), blind)  # queries that see no key, and only those
    assert (out[blind.all(1)] == 0).all()
    torch.testing.assert_close(lse[~blind].double(), ref_lse[~blind].double(), atol=1e-4, rtol=1e-5)


def test_spare_rows_past_the_last_offset_are_zeros():
    lengths = [70, 4, 0, 33]
    cu = _cu(lengths)
    q, k, v = (torch.randn(sum(lengths) + 5, 2, 16) for _ in range(3))
    q[sum(lengths) :] = float("nan")
    impl = ragged.backends.implementation("attention", "torch")
    from ragged.ops.attention import AttentionArgs

    out, lse = impl.forward_fn(
        AttentionArgs(q=q, k=k, v=v, cu_q=cu, cu_k=cu, max_q=70, max_k=70, causal=False, scale=0.25)
    )
    ref, ref_lse = ragged.reference_attention(
        q[: sum(lengths)].double(), k[: sum(lengths)].double(), v[: sum(lengths)].double(), cu, cu, False, 0.25
    )
    torch.testing.assert_close(out[: sum(lengths)].double(), ref, atol=2e-5, rtol=2e-5)
    assert (out[sum(lengths) :] == 0).all() and (lse[sum(lengths) :] == 0).all()


@pytest.mark.parametrize("seed", range(20))
def test_plan_covers_every_sequence_once_within_its_waste_bound(seed):
    gen = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(0, 40, (), generator=gen))
    lq = torch.randint(0, 300, (batch,), generator=gen)
    lk = lq if seed % 2 else torch.randint(0, 300, (batch,), generator=gen)
    lq[torch.rand(batch, generator=gen) < 0.1] = 0
    cq, ck = _cu(lq.tolist()).tolist(), _cu(lk.tolist()).tolist()
    groups = attention_cpu.plan(cq, ck)
    placed = [b for g in groups for b in g]
    assert sorted(placed) == [b for b in range(batch) if lq[b] > 0 and lk[b] > 0]
    short = attention_cpu._SHORT
    for g in groups:
        assert g == sorted(g)
        area = len(g) * max(lq[b] for b in g) * max(lk[b] for b in g)
        own = sum(max(int(lq[b]), short) * max(int(lk[b]), short) for b in g)
        assert len(g) == 1 or area <= attention_cpu._WASTE * own


def test_one_group_for_lengths_alike():
    cu = _cu([40, 37, 41, 39, 2])
    assert attention_cpu.plan(cu.tolist(), cu.tolist()) == [[0, 1, 2, 3, 4]]
