"""The Hopper forward (TMA descriptors, ``ragged.kernels.triton.attention_hopper``) on CPU,
through the Triton interpreter, against the float64 per-sequence oracle.

``RAGGED_ATTENTION_HOPPER=1`` routes the calls it takes to it; each test counts that it ran.
float16 only here: the interpreter (Triton 3.9) computes the transposed dot of a bfloat16 tile
loaded through a descriptor wrongly (a bf16 copy through descriptors is exact; ``dot(x, x.T)``
is not), so bfloat16 is checked on the GPU (``test_gpu_attention_hopper.py``).
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import _blind_rows, _cu, _grads, _loop_attention, _qkv, _randn, _seed, needs_triton, spy_hopper

import ragged
from ragged.kernels.triton import attention_hopper

pytestmark = needs_triton

# name: (query lengths, key lengths, H, H_kv, D)
CASES = {
    "mixed": ([5, 0, 31, 12, 1], [5, 0, 31, 12, 1], 2, 2, 64),
    "gqa": ([5, 0, 31, 12], [5, 0, 31, 12], 4, 2, 64),
    "mqa_d128": ([3, 17, 1], [3, 17, 1], 2, 1, 128),
    "cross": ([2, 7, 1, 16], [5, 19, 3, 33], 2, 2, 64),
    "cross_q_longer": ([5, 20, 3], [2, 7, 3], 2, 1, 128),
    "empty_keys": ([4, 3, 6], [3, 0, 5], 2, 2, 64),
    "one_long": ([70], [70], 1, 1, 64),
}


@pytest.fixture
def hopper(monkeypatch):
    """The sm_90 kernels switched on; the list counts their launches."""
    return spy_hopper(monkeypatch)


def _error_bound(q, k, v, lq, lk, causal, exp):
    """The flash-attention rule: twice the error of the computation in float16 (the reference
    op in float16), plus a floor for float16's rounding of the output."""
    ref16, _ = ragged.reference_attention(q, k, v, _cu(lq), _cu(lk), causal, compute_dtype=torch.float16)
    return 2 * (ref16.double() - exp).abs().max().item() + 2e-3


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_hopper_forward_matches_the_oracle(case, causal, hopper):
    lq, lk, heads, kv_heads, dim = CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed(case, "hopper"), torch.float16)
    out, lse = ragged.varlen_attention(
        q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal, return_lse=True, backend="triton"
    )
    assert hopper, "the Hopper forward did not run"
    exp, exp_lse = _loop_attention(q, k, v, lq, lk, causal)
    blind = _blind_rows(lq, lk, causal)
    assert out.dtype == torch.float16 and out.shape == q.shape
    err = (out.double() - exp).abs().max().item()
    assert err <= _error_bound(q, k, v, lq, lk, causal, exp), err
    assert torch.all(out[blind] == 0)
    assert torch.all(torch.isneginf(lse[blind])) and torch.all(torch.isfinite(lse[~blind]))
    torch.testing.assert_close(lse[~blind].double(), exp_lse[~blind], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_hopper_backward_matches_the_oracle(case, causal, hopper):
    """dq, dk, dv through the sm_90 backward kernels against float64, under flash-attn's rule
    (twice the error of the float16 reference's own gradients, plus a floor)."""
    lq, lk, heads, kv_heads, dim = CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed(case, "hopper-bwd"), torch.float16)
    up = _randn(q.shape, _seed(case, "hopper-up"), torch.float16)
    got = _grads(
        lambda a, b, c: ragged.varlen_attention(
            a, b, c, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal, backend="triton"
        ),
        q,
        k,
        v,
        up,
    )
    assert ("backward", q.shape) in hopper, "the Hopper backward did not run"
    ref = _grads(
        lambda a, b, c: _loop_attention(a, b, c, lq, lk, causal)[0], q.double(), k.double(), v.double(), up.double()
    )
    low = _grads(
        lambda a, b, c: ragged.reference_attention(a, b, c, _cu(lq), _cu(lk), causal, compute_dtype=torch.float16)[0],
        q,
        k,
        v,
        up,
    )
    for name, g, r, lo in zip("qkv", got, ref, low):
        assert g.dtype == torch.float16 and torch.isfinite(g).all(), name
        err = (g.double() - r).abs().max().item() if g.numel() else 0.0
        bound = 2 * ((lo.double() - r).abs().max().item() if g.numel() else 0.0) + 5e-3
        assert err <= bound, f"d{name}: {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", ["mixed", "gqa", "cross_q_longer", "empty_keys"])
def test_hopper_forward_then_fused_backward(case, causal, monkeypatch):
    """``triton_sm90_fused_bwd``: the sm_90 forward's log-sum-exp read by the fused backward
    (dQ added atomically); gradients against float64 under the same rule."""
    from ragged import backends
    from ragged.kernels.triton import attention as launcher

    hopper = spy_hopper(monkeypatch)
    monkeypatch.delenv("RAGGED_ATTENTION_HOPPER")
    fused: list = []
    real = launcher._backward_fused
    monkeypatch.setattr(launcher, "_backward_fused", lambda *a: fused.append(1) or real(*a))
    lq, lk, heads, kv_heads, dim = CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed(case, "hopper-fused"), torch.float16)
    up = _randn(q.shape, _seed(case, "hopper-fused-up"), torch.float16)
    with backends.prefer("attention", "triton_sm90_fused_bwd"):
        got = _grads(
            lambda a, b, c: ragged.varlen_attention(
                a, b, c, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal, backend="triton"
            ),
            q,
            k,
            v,
            up,
        )
    assert q.shape in hopper and fused, "the sm_90 forward or the fused backward did not run"
    assert ("backward", q.shape) not in hopper, "the sm_90 backward ran instead of the fused one"

    def reference(dtype):
        if dtype == torch.float64:
            return lambda a, b, c: _loop_attention(a, b, c, lq, lk, causal)[0]
        return lambda a, b, c: ragged.reference_attention(a, b, c, _cu(lq), _cu(lk), causal, compute_dtype=dtype)[0]

    _check_grads(got, reference, q, k, v, up)


def _drawn_seed(manual_seed: int) -> int:
    """The dropout seed a call draws after ``torch.manual_seed(manual_seed)`` (one CPU int)."""
    torch.manual_seed(manual_seed)
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())


def _check_against(got, ref, low, what):
    err = (got.double() - ref).abs().max().item() if got.numel() else 0.0
    bound = 2 * ((low.double() - ref).abs().max().item() if got.numel() else 0.0) + 5e-3
    assert torch.isfinite(got).all() and err <= bound, f"{what}: {err:.3g} > {bound:.3g}"


def _check_grads(got, reference, q, k, v, up):
    """dq, dk, dv (``got``) against ``reference(dtype)``'s in float64, under the rule of
    :func:`_check_against` with its float16 gradients."""
    ref = _grads(reference(torch.float64), q.double(), k.double(), v.double(), up.double())
    low = _grads(reference(torch.float16), q, k, v, up)
    for name, g, r, lo in zip("qkv", got, ref, low):
        _check_against(g, r, lo, f"d{name}")


@pytest.mark.parametrize("window", [(3, 0), (2, 5), (0, 0), (40, 1)], ids=str)
@pytest.mark.parametrize("case", ["mixed", "cross", "one_long", "gqa"])
def test_hopper_window_matches_the_reference(case, window, hopper):
    """Sliding windows (causal folded in where the right side is 0): the output and every
    gradient against the float64 reference with the same window."""
    lq, lk, heads, kv_heads, dim = CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed(case, "hopper-window", window), torch.float16)
    up = _randn(q.shape, _seed(case, "hopper-window-up"), torch.float16)
    cq, ck = _cu(lq), _cu(lk)

    def ours(a, b, c):
        return ragged.varlen_attention(a, b, c, cq, ck, max(lq), max(lk), window_size=window, backend="triton")

    def reference(dtype):
        return lambda a, b, c: ragged.reference_attention(
            a, b, c, cq, ck, False, window_size=window, compute_dtype=dtype
        )[0]

    _check_against(
        ours(q, k, v),
        reference(torch.float64)(q.double(), k.double(), v.double()),
        reference(torch.float16)(q, k, v),
        "out",
    )
    got = _grads(ours, q, k, v, up)
    assert ("backward", q.shape) in hopper and q.shape in hopper
    _check_grads(got, reference, q, k, v, up)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", ["mixed", "cross", "gqa"])
def test_hopper_dropout_draws_the_portable_kernels_mask(case, causal, hopper):
    """Dropout through the TMA kernels keeps what the portable kernels' hash keeps: the output
    and every gradient against the float64 reference given that keep mask."""
    from ragged.ops.attention_reference import reference_dropout_mask

    lq, lk, heads, kv_heads, dim = CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed(case, "hopper-drop"), torch.float16)
    up = _randn(q.shape, _seed(case, "hopper-drop-up"), torch.float16)
    cq, ck, p = _cu(lq), _cu(lk), 0.3
    mask = reference_dropout_mask(_drawn_seed(77), p, cq, heads, q.shape[0], max(lk), q.device)

    def ours(a, b, c):
        torch.manual_seed(77)
        return ragged.varlen_attention(a, b, c, cq, ck, max(lq), max(lk), causal=causal, dropout_p=p, backend="triton")

    def reference(dtype):
        return lambda a, b, c: ragged.reference_attention(a, b, c, cq, ck, causal, None, mask, p, compute_dtype=dtype)[
            0
        ]

    out = ours(q, k, v)
    _check_against(
        out, reference(torch.float64)(q.double(), k.double(), v.double()), reference(torch.float16)(q, k, v), "out"
    )
    assert not torch.allclose(
        out, ragged.varlen_attention(q, k, v, cq, ck, max(lq), max(lk), causal=causal, backend="triton")
    ), "dropout changed nothing"
    got = _grads(ours, q, k, v, up)
    assert ("backward", q.shape) in hopper
    _check_grads(got, reference, q, k, v, up)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", ["mixed", "cross", "one_long"])
def test_persistent_grid_matches_the_oracle(case, causal, hopper, monkeypatch):
    """The persistent grid (a few programs, each looping over (block, head) pairs) gives the
    same rows as one program per pair."""
    monkeypatch.setattr(attention_hopper, "config", lambda *a: (16, 16, 4, 1, True, False))
    lq, lk, heads, kv_heads, dim = CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed(case, "persistent"), torch.float16)
    got = ragged.varlen_attention(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal, backend="triton")
    monkeypatch.setattr(attention_hopper, "config", lambda *a: (16, 16, 4, 1, False, False))
    want = ragged.varlen_attention(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal, backend="triton")
    assert len(hopper) == 2
    assert torch.equal(got, want)
    exp, _ = _loop_attention(q, k, v, lq, lk, causal)
    assert (got.double() - exp).abs().max().item() <= _error_bound(q, k, v, lq, lk, causal, exp)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", ["mixed", "cross", "one_long"])
def test_the_pipelined_key_loop_matches_the_oracle(case, causal, hopper, monkeypatch):
    """The key loop with the products issued one block apart (scores of block j beside P @ V of
    block j - 1; the first softmax and the last product peeled) gives the oracle's rows and the
    plain loop's, to rounding."""
    monkeypatch.setattr(attention_hopper, "config", lambda *a: (16, 16, 4, 1, False, True))
    lq, lk, heads, kv_heads, dim = CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed(case, "pipelined"), torch.float16)
    got = ragged.varlen_attention(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal, backend="triton")
    assert len(hopper) == 1
    exp, _ = _loop_attention(q, k, v, lq, lk, causal)
    bound = _error_bound(q, k, v, lq, lk, causal, exp)
    assert (got.double() - exp).abs().max().item() <= bound
    monkeypatch.setattr(attention_hopper, "config", lambda *a: (16, 16, 4, 1, False, False))
    plain = ragged.varlen_attention(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal, backend="triton")
    assert (got.double() - plain.double()).abs().max().item() <= bound


def test_a_preference_holds_for_every_thread_of_the_process(monkeypatch):
    """``ragged.backends.prefer`` is seen by other threads too (autograd runs a CUDA backward on a
    thread of its own), and the block's end restores what the environment says."""
    import threading

    from ragged import backends

    monkeypatch.setenv("RAGGED_ATTENTION_HOPPER", "0")
    seen = []

    def look():
        seen.append(backends.preferences().get("attention"))

    with backends.prefer("attention", "triton_sm90_full"):
        worker = threading.Thread(target=look)
        worker.start()
        worker.join()
        with backends.prefer("attention", "triton"):
            look()
        look()
    look()
    assert seen == ["triton_sm90_full", "triton", "triton_sm90_full", "triton"]


def test_a_seed_on_the_device_draws_the_host_seeds_mask(hopper):
    """The seed read from a device tensor (what a CUDA graph replays) gives the mask of the same
    seed passed from the host, forward and backward."""
    from ragged.kernels.triton import attention as launcher

    lq = [7, 20, 1]
    q, k, v = _qkv(lq, lq, 2, 2, 64, _seed("seed-ptr"), torch.float16)
    cu, do = _cu(lq), _randn(q.shape, _seed("seed-ptr-do"), torch.float16)
    from ragged.ops.attention import AttentionArgs, AttentionBackwardInputs

    args = AttentionArgs(
        q=q, k=k, v=v, cu_q=cu, cu_k=cu, max_q=20, max_k=20, causal=True, scale=0.125, dropout_p=0.25, seed=12345
    )
    on_device = args._replace(seed=torch.tensor([12345]))
    host = launcher.forward_sm90(args)
    device = launcher.forward_sm90(on_device)
    assert torch.equal(host.out, device.out) and torch.equal(host.lse, device.lse)
    inputs = AttentionBackwardInputs(grad_out=do, out=host.out, lse=host.lse)
    g_host = launcher.backward_sm90(args, inputs)
    g_device = launcher.backward_sm90(on_device, inputs)
    assert all(torch.equal(a, b) for a, b in zip(g_host[:3], g_device[:3]))
    other = launcher.forward_sm90(args._replace(seed=54321))
    assert not torch.equal(host.out, other.out)
    assert len([c for c in hopper if c == q.shape]) == 3 and hopper.count(("backward", q.shape)) == 2


def test_hopper_forward_reads_nothing_of_other_sequences(hopper):
    """Key and value rows past the last sequence hold NaN, and one sequence is NaN throughout: the
    other sequences' rows equal those computed without the poison (each program's descriptors
    end at its own sequence, and the TMA fills what lies past with zeros)."""
    lq = lk = [9, 20, 7]
    q, k, v = _qkv(lq, lk, 2, 2, 64, _seed("poison"), torch.float16)
    want = ragged.varlen_attention(q, k, v, _cu(lq), _cu(lk), 20, 20, backend="triton")
    buf = torch.full((2, k.shape[0] + 5, 2, 64), float("nan"), dtype=torch.float16)
    buf[0, : k.shape[0]], buf[1, : k.shape[0]] = k, v
    buf[:, 9:29] = float("nan")  # the second sequence's keys and values
    got = ragged.varlen_attention(
        q, buf[0, : k.shape[0]], buf[1, : k.shape[0]], _cu(lq), _cu(lk), 20, 20, backend="triton"
    )
    assert len(hopper) == 2
    ok = torch.ones(q.shape[0], dtype=torch.bool)
    ok[9:29] = False
    assert torch.equal(got[ok], want[ok])
    assert torch.isnan(got[~ok]).all()


def test_hopper_forward_takes_strided_views_of_a_packed_projection(hopper):
    """q, k, v as views of one ``[T, 3, H, D]`` projection (token stride 3 H D)."""
    lq = [6, 1, 23]
    qkv = _qkv([sum(lq)], [sum(lq)], 3 * 2, 3 * 2, 64, _seed("packed"), torch.float16)[0].view(-1, 3, 2, 64)
    q, k, v = qkv.unbind(1)
    got = ragged.varlen_attention(q, k, v, _cu(lq), _cu(lq), 23, 23, backend="triton")
    assert hopper
    exp, _ = _loop_attention(q, k, v, lq, lq)
    assert (got.double() - exp).abs().max().item() <= _error_bound(q, k, v, lq, lq, False, exp)


def _reasons(q, k=None, v=None, dropout_p=0.0, window=(-1, -1), bias=None, name="triton_sm90_full"):
    k = q if k is None else k
    v = q if v is None else v
    cu = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    n = q.shape[0]
    return ragged.explain("attention", q, k, v, cu, cu, n, n, False, dropout_p, False, window, bias)[name]


def test_the_sm90_implementations_take_only_what_the_kernels_do():
    """Their declared reasons, which ``ragged.explain`` shows: fp16 / bf16, head dims 64 and
    128, no position bias, TMA-aligned q, k and v (here under the interpreter, no GPU)."""
    q = torch.zeros(8, 2, 64, dtype=torch.float16)
    assert _reasons(q) == [] and _reasons(q.bfloat16()) == [] and _reasons(q, name="triton_sm90") == []
    assert _reasons(torch.zeros(8, 2, 128, dtype=torch.float16)) == []
    assert _reasons(q.float())  # fp16 / bf16 only
    assert _reasons(torch.zeros(8, 2, 32, dtype=torch.float16))  # head dims 64, 128
    assert _reasons(q, dropout_p=0.1) == [] and _reasons(q, window=(4, 0)) == []
    bias = (torch.zeros(3, 2), torch.zeros(15, dtype=torch.int32))
    assert any("position bias" in r for r in _reasons(q, bias=bias))
    flat = torch.zeros(8 * 2 * 64 + 1, dtype=torch.float16)
    assert any("16-byte" in r for r in _reasons(flat[1:].view(8, 2, 64)))  # 2 bytes off 16-byte alignment
    odd = torch.zeros(8, 2, 65, dtype=torch.float16)[..., :64]  # token stride 130 elements
    assert _reasons(odd)
    assert _reasons(q, k=torch.zeros(8, 2, 128, dtype=torch.float16)[..., ::2])  # strided features


def test_runs_declines_what_only_the_call_knows():
    """The launcher's last check, with the tensors in hand: a scale that is not positive, and
    addresses a traced choice could not see, run the portable kernels."""
    q = torch.zeros(8, 2, 64, dtype=torch.float16)
    assert attention_hopper.runs(q, q, q, 0.125)
    assert not attention_hopper.runs(q, q, q, -0.125) and not attention_hopper.runs(q, q, q, 0.0)
    flat = torch.zeros(8 * 2 * 64 + 1, dtype=torch.float16)
    assert not attention_hopper.runs(flat[1:].view(8, 2, 64), q, q, 0.125)


def test_auto_ranks_the_sm90_forward_first_for_long_queries_only(monkeypatch):
    """``auto`` on CUDA inputs takes the warp-specialised forward at head dim 128 from a longest
    query of ``ws_min_len`` tokens, else the sm_90 forward from ``sm90_min_len`` tokens (by head
    dim and mask), the portable kernels below both, and the sm_90 backward only where preferred
    (the GPU half is tests/test_gpu_attention_hopper.py and tests/test_gpu_attention_ws.py); CPU
    inputs take the reference."""
    import dataclasses

    from ragged import backends
    from ragged.kernels import triton as triton_backend
    from ragged.ops.attention import attention_spec

    monkeypatch.delenv("RAGGED_ATTENTION_HOPPER", raising=False)
    monkeypatch.delenv("RAGGED_PREFER", raising=False)
    q = torch.zeros(8, 2, 64, dtype=torch.float16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    entry = backends.op_entry("attention")
    cpu = attention_spec(q, q, q, cu, cu, 8, 8, False, 0.0, False)
    assert backends.auto_choice(entry, cpu).name == "torch"
    rules = [(d, causal, triton_backend.sm90_min_len(d, causal)) for d in (64, 128) for causal in (False, True)]
    # the measured rule: from 1024 tokens, except head dim 128 without a mask (a longer threshold)
    assert [n for *_, n in rules] == [1024, 1024, triton_backend.AUTO_MIN_LEN_D128_FULL, 1024]
    assert triton_backend.AUTO_MIN_LEN_D128_FULL > 2048
    # the warp-specialised forward at head dim 128 only, from its own (shorter) thresholds
    ws_rules = {(d, causal): triton_backend.ws_min_len(d, causal) for d in (64, 128) for causal in (False, True)}
    assert ws_rules[(64, False)] is None and ws_rules[(64, True)] is None
    assert ws_rules[(128, False)] < triton_backend.AUTO_MIN_LEN_D128_FULL
    assert 0 < ws_rules[(128, True)] <= 2048
    cases = [(d, causal, longest) for d, causal, n in rules for longest in (n, n - 1)]
    cases += [(128, causal, ws_rules[(128, causal)] + step) for causal in (False, True) for step in (0, -1)]
    for d, causal, longest in cases:
        spec = dataclasses.replace(cpu, max_q=longest, max_k=longest, head_dim=d, causal=causal)
        order = [n for n in entry.gpu_preference_by_rank(spec) if n.startswith("triton")]
        ws_from = ws_rules[(d, causal)]
        if ws_from is not None and longest >= ws_from:
            first = "triton_sm90_ws"
        elif longest >= triton_backend.sm90_min_len(d, causal):
            first = "triton_sm90"
        else:
            first = "triton"
        # taken only where preferred: the sm_90 backward, the fused backward (dQ by element atomics
        # or by TMA), the sm_90 forwards with the fused backward, and the warp-specialised forward
        # where "auto" does not take it
        preferred_only = {
            "triton_sm90_full", "triton_fused_bwd", "triton_sm90_fused_bwd", "triton_sm90_ws_fused_bwd",
            "triton_fused_bwd_tma", "triton_sm90_fused_bwd_tma",
        }  # fmt: skip
        if first != "triton_sm90_ws":
            preferred_only.add("triton_sm90_ws")
        assert order[0] == first, (d, causal, longest, order)
        assert set(order[-len(preferred_only) :]) == preferred_only, (d, causal, longest, order)
    assert backends.implementation("attention", "triton_sm90").backward_backend == "triton"
    with backends.prefer("attention", "triton_sm90_full"):
        assert entry.gpu_preference(cpu)[0] == "triton_sm90_full"


@pytest.mark.parametrize("value", ["yes", "2", "", "on"])
def test_a_bad_switch_value_says_what_it_takes(value, monkeypatch):
    monkeypatch.setenv("RAGGED_ATTENTION_HOPPER", value)
    q = torch.zeros(8, 2, 64, dtype=torch.float16)
    with pytest.raises(
        ValueError, match=r"RAGGED_ATTENTION_HOPPER \(environment variable\): expected 1, 0 or auto, got"
    ):
        ragged.varlen_attention(
            q,
            q,
            q,
            torch.tensor([0, 8], dtype=torch.int32),
            torch.tensor([0, 8], dtype=torch.int32),
            8,
            8,
            backend="triton",
        )


def test_calls_it_does_not_take_run_the_portable_kernel(hopper):
    """float32, head dim 32 and a position bias stay with the portable kernels."""
    lq = [5, 9]
    q, k, v = _qkv(lq, lq, 2, 2, 64, _seed("fallback"), torch.float16)
    ragged.varlen_attention(q.float(), k.float(), v.float(), _cu(lq), _cu(lq), 9, 9, backend="triton")
    q32, k32, v32 = _qkv(lq, lq, 2, 2, 32, _seed("fallback32"), torch.float16)
    ragged.varlen_attention(q32, k32, v32, _cu(lq), _cu(lq), 9, 9, backend="triton")
    table = torch.randn(8, 2)
    buckets = torch.randint(0, 8, (2 * 9 - 1,), dtype=torch.int32)
    ragged.varlen_attention(q, k, v, _cu(lq), _cu(lq), 9, 9, position_bias=(table, buckets), backend="triton")
    assert not hopper


def test_explain_names_the_variant_a_forced_backend_runs_and_the_preference(monkeypatch):
    """A forced ``"triton"`` runs the best-ranked of its implementations that takes the call;
    ``ragged.explain`` reports that implementation and the preference in force."""
    from ragged import backends

    monkeypatch.delenv("RAGGED_ATTENTION_HOPPER", raising=False)
    monkeypatch.delenv("RAGGED_PREFER", raising=False)
    q = torch.zeros(8, 2, 64, dtype=torch.float16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    operands = (q, q, q, cu, cu, 8, 8, False, 0.0, False)
    with backends.use_backend("triton"):
        plain = ragged.explain("attention", *operands)
        assert plain.chosen == "triton" and plain.preferred is None
        assert {"triton", "triton_sm90", "triton_sm90_full", "torch"} <= set(plain)
        with backends.prefer("attention", "triton_sm90_full"):
            why = ragged.explain("attention", *operands)
            assert why.chosen == "triton_sm90_full" and why.preferred == "triton_sm90_full"
            # a call the preferred implementation cannot take runs the backend's own kernels
            assert ragged.explain("attention", q.float(), q.float(), q.float(), *operands[3:]).chosen == "triton"
        monkeypatch.setenv("RAGGED_PREFER", "attention=triton_sm90")
        assert ragged.explain("attention", *operands).chosen == "triton_sm90"
        monkeypatch.setenv("RAGGED_ATTENTION_HOPPER", "0")
        monkeypatch.delenv("RAGGED_PREFER")
        assert ragged.explain("attention", *operands).preferred == "triton"


def test_a_preference_that_names_nothing_is_refused(monkeypatch):
    from ragged import backends

    with pytest.raises(ValueError, match=r"prefer\(\): attention has no implementation 'triton_sm80'"):
        with backends.prefer("attention", "triton_sm80"):
            pass
    with pytest.raises(ValueError, match=r"prefer\(\): unknown op 'attn'"):
        with backends.prefer("attn", "triton"):
            pass
    monkeypatch.setenv("RAGGED_PREFER", "attention")
    with pytest.raises(ValueError, match=r"RAGGED_PREFER \(environment variable\): expected op=implementation"):
        backends.preferences()


def test_the_warp_specialised_forward_says_what_it_does_not_take():
    """Its declared reasons: a window, dropout, position bias, a CPU tensor; none for a plain
    causal bf16 call on an sm_90 GPU (the GPU half: tests/test_gpu_attention_ws.py)."""
    import dataclasses

    from ragged import backends
    from ragged.kernels import triton as triton_backend
    from ragged.ops.attention import attention_spec

    q = torch.zeros(8, 2, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    impl = backends.implementation("attention", "triton_sm90_ws")
    cpu = attention_spec(q, q, q, cu, cu, 8, 8, True, 0.0, False)
    assert impl.backward_backend == "triton" and impl.rank_for(cpu) > 20
    assert any("CUDA tensors" in r for r in impl.reasons(cpu))
    triton_backend._MAJOR[0] = 9  # as an sm_90 GPU reads: no device here
    try:
        gpu = dataclasses.replace(cpu, device=torch.device("cuda", 0))
        base = impl.reasons(gpu)
        window = impl.reasons(dataclasses.replace(gpu, window_size=(16, 0)))
        dropout = impl.reasons(dataclasses.replace(gpu, dropout_p=0.1))
        wide = impl.reasons(dataclasses.replace(gpu, head_dim=96))
    finally:
        triton_backend._MAJOR.pop(0, None)
    extra = [r for r in base if "Triton" not in r and "triton" not in r]  # Triton's own device reason aside
    assert not extra, extra
    assert any("sliding window" in r for r in window) and any("dropout" in r for r in dropout)
    assert any("96" in r for r in wide)
