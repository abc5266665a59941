"""The attention suite of the benchmark harness (``bench/suites/attention.py``) on CPU."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TRITON_ON_CPU

from bench import report
from bench.harness import SUITES, Config, CopyCeiling, Timing, run_suite
from bench.suites import attention as A

CPU = torch.device("cpu")
FAST = Config(CPU, quick=True, timing=Timing(warmup_ms=0, rep_ms=0, min_reps=1))
CEILING = CopyCeiling(bytes=2 << 20, median_ms=0.1)
TINY = A.CPU_QUICK_SHAPES[0]  # the cases of FAST (--quick): tiny


def test_registered_after_pack():
    names = list(SUITES)
    assert "attention" in names and names.index("pack") < names.index("attention")
    assert not SUITES["attention"].memory_bound


def test_attention_suite_on_cpu():
    suite = SUITES["attention"]
    cases = suite.cases(FAST)
    assert {c.group for c in cases} == {"fwd", "fwd causal", "fwd+bwd", "fwd+bwd causal"}
    rows = run_suite(suite, FAST, CEILING)
    assert rows and not [(r.case, r.impl, r.reason) for r in rows if r.status == "failed"]
    by = {(r.case, r.impl): r for r in rows}
    for case in cases:
        torch_row = by[(case.name, "ragged torch")]
        assert torch_row.status == "ok" and torch_row.median_ms > 0 and torch_row.tflops > 0
        assert torch_row.flops == A.attention_flops(
            A.draw_lengths(TINY), TINY.heads, TINY.head_dim, case.params["causal"], case.params["pass"] == "fwd+bwd"
        )
        measured = {r.impl for r in rows if r.case == case.name and r.kind == "baseline" and r.status == "ok"}
        assert measured == set(A.CPU_BASELINES)
        assert set(torch_row.speedup) == measured
        for name in set(A.BASELINES) - set(A.CPU_BASELINES):
            assert by[(case.name, name)].status == "skipped" and "CPU run" in by[(case.name, name)].reason
        assert by[(case.name, "ragged cuda")].status == "skipped"
        assert by[(case.name, "ragged triton")].status == ("ok" if TRITON_ON_CPU else "skipped")


def test_flops():
    # forward: 4 * sum(L^2) * D * H; causal halves it; forward+backward is 3.5x.
    assert A.attention_flops([2, 3], heads=2, head_dim=4, causal=False, backward=False) == 4 * 13 * 4 * 2
    assert A.attention_flops([2, 3], 2, 4, causal=True, backward=False) == 4 * 13 * 4 * 2 // 2
    assert A.attention_flops([2, 3], 2, 4, causal=False, backward=True) == 4 * 13 * 4 * 2 * 7 // 2


def test_lengths():
    for shape in (*A.GPU_SHAPES, *A.CPU_SHAPES, *A.CPU_QUICK_SHAPES):
        lengths = A.draw_lengths(shape)
        assert lengths == A.draw_lengths(shape)  # seeded
        assert len(lengths) == shape.batch and max(lengths) == shape.max_len and min(lengths) >= shape.min_len
    tailed = A.draw_lengths(A.GPU_SHAPES[1])
    assert 110 <= sum(tailed) / len(tailed) <= 150  # "mean about 130"


def test_pack_padded_round_trip():
    p = A.Problem.make(TINY, CPU)
    padded = p.padded(p.q)
    assert padded.shape == (TINY.batch, TINY.heads, max(p.lengths), TINY.head_dim)
    assert torch.equal(p.as_packed(padded), p.q)
    assert float(padded.transpose(1, 2)[~p.key_valid].abs().sum()) == 0.0


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_whole_batch(causal, backward):
    """The chunked reference equals one call of ragged.reference_attention over the batch."""
    p = A.Problem.make(TINY, CPU)
    ref = A.reference_outputs(p, causal, backward)
    q, k, v = (t.detach().clone().requires_grad_(backward) for t in (p.q, p.k, p.v))
    with torch.set_grad_enabled(backward):
        out, _ = A.ragged.reference_attention(q, k, v, p.offsets, p.offsets, causal=causal)
    expected = (out, *torch.autograd.grad(out, (q, k, v), p.do)) if backward else (out,)
    assert len(ref) == len(expected)
    for r, e in zip(ref, expected):
        torch.testing.assert_close(r, e.detach(), rtol=1e-5, atol=1e-5)


def test_gate_rejects_attention_to_padding():
    """The unmasked padded SDPA attends to the padding: the gate must see it (it is unchecked by design)."""
    wl = A.build_workload(TINY, causal=False, backward=False, device=CPU, measured=A.CPU_BASELINES)
    impls = {i.name: i for i in wl.impls}
    assert not impls[A.SDPA_NO_MASK].check
    assert wl.compare(impls[A.SDPA_MASKED].fn(), wl.reference) is None
    problem = wl.compare(impls[A.SDPA_NO_MASK].fn(), wl.reference)
    assert problem is not None and "out max abs error" in problem
    assert "expected 1 outputs" in wl.compare((wl.reference[0],) * 2, wl.reference)


def test_gate_checks_gradients():
    wl = A.build_workload(TINY, causal=True, backward=True, device=CPU, measured=A.CPU_BASELINES)
    impls = {i.name: i for i in wl.impls}
    out, dq, dk, dv = impls[A.SDPA_MASKED].fn()
    assert wl.compare((out, dq, dk, dv), wl.reference) is None
    problem = wl.compare((out, dq, dk * 1.5, dv), wl.reference)
    assert problem is not None and problem.startswith("dk max abs error")


def test_nested_baseline_on_cpu():
    """The NJT path (pack/unpack through torch.nested) runs on CPU where SDPA has a backend for it."""
    p = A.Problem.make(TINY, CPU)
    impl = A.baseline_impls(p, causal=False, backward=False, device=CPU, measured=(A.SDPA_NESTED,))
    nested = next(i for i in impl if i.name == A.SDPA_NESTED)
    assert nested.skip is None
    try:
        out = nested.fn()
    except RuntimeError as exc:  # no CPU backend in this torch
        pytest.skip(str(exc))
    ref = A.reference_outputs(p, causal=False, backward=False)
    assert A.make_compare(p, 1e-4)(out, ref) is None


def test_speedup_table_in_markdown():
    suite = SUITES["attention"]
    rows = run_suite(suite, FAST, CEILING, cases=suite.cases(FAST)[:1])
    env = {
        "device_name": "cpu",
        "device": "cpu",
        "date": "d",
        "torch": "t",
        "triton": "t",
        "cuda": None,
        "cupy": None,
        "git_commit": None,
    }
    md = report.markdown(suite, rows, env, CEILING)
    assert "## Speedup over each baseline" in md and f"`{A.SDPA_MASKED}`" in md
    baselines, body = report.speedup_table(rows)
    assert baselines[:2] == [A.SDPA_MASKED, A.SDPA_NO_MASK]
    assert body and all(len(cells) == len(baselines) for _, _, cells in body)
    assert all(math.isfinite(float(c.rstrip("x"))) for _, _, cells in body for c in cells if c)
