"""The attention-bias suite of the benchmark harness (``bench/suites/attention_bias.py``) on CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import TRITON_ON_CPU

from bench.harness import SUITES, Config, Timing, run_suite
from bench.suites import attention_bias as AB

CPU = torch.device("cpu")
FAST = Config(CPU, quick=True, timing=Timing(warmup_ms=0, rep_ms=0, min_reps=1))
SHAPE = AB.CPU_SHAPES[0]


def test_suite_on_cpu():
    suite = SUITES["attention-bias"]
    cases = suite.cases(FAST)
    assert [c.group for c in cases] == ["fwd", "fwd+bwd"]
    rows = run_suite(suite, FAST, None)
    assert rows and not [(r.case, r.impl, r.reason) for r in rows if r.status == "failed"]
    for r in rows:
        if r.impl == AB.FLEX_BIAS:
            assert r.status == "skipped" and "CUDA only" in r.reason
        elif r.impl in (AB.CUDA, AB.TRITON_GRAPHED, AB.NO_BIAS_GRAPHED) or (r.impl == AB.TRITON and not TRITON_ON_CPU):
            assert r.status == "skipped", (r.impl, r.status)
        else:  # checked against the float32 reference (outputs and every gradient, the table's too)
            assert r.status == "ok" and r.median_ms > 0, (r.impl, r.reason)
        if r.kind == "ragged" and r.status == "ok":  # over the padded baselines, not the bias-free ceiling
            assert set(r.speedup) == {AB.EAGER, AB.SDPA_BIAS}, (r.impl, r.speedup)


def test_cpu_run_reasons_match_the_rows():
    """A CPU run outside --quick (Triton skipped under the interpreter, or not runnable): the
    ragged row "auto" picks is measured, and no reason says that rows were measured which were not."""
    rows = run_suite(SUITES["attention-bias"], Config(CPU, timing=FAST.timing), None)
    by_impl = {}
    for r in rows:
        by_impl.setdefault(r.impl, []).append(r)
    assert all(r.status == "ok" for r in by_impl[AB.AUTO]), [(r.status, r.reason) for r in by_impl[AB.AUTO]]
    triton_ran = any(r.status == "ok" for r in by_impl[AB.TRITON])
    for r in rows:
        if r.status == "skipped" and "measures the triton" in (r.reason or "").lower():
            assert triton_ran, (r.impl, r.reason)


@pytest.mark.parametrize("backward", [False, True])
def test_baselines_match_reference_and_a_wrong_bias_fails(backward):
    bp = AB.BiasProblem.make(SHAPE, CPU)
    ref = AB.reference(bp, backward)
    names = ("out", "dq", "dk", "dv", "dtable") if backward else ("out",)
    compare = AB.max_error_compare(names, bp.flatten, 1e-4, absolute=("out",))
    for impl in (AB._eager(bp, backward, names), AB._sdpa(bp, backward)):
        out = impl.fn()
        assert compare(out, ref) is None
        if impl.compare is not None:  # the eager row's own, looser check passes too
            assert impl.compare(out, ref) is None
    # a bias off by one distance: the gate sees it, the eager row's own check too
    wrong = AB._eager(AB.BiasProblem(bp.p, bp.table, torch.roll(bp.buckets, 1)), backward, names)
    out = wrong.fn()
    assert compare(out, ref) is not None and wrong.compare(out, ref) is not None


def test_buckets_are_mpnets():
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    width = 200
    got = AB._buckets(width, CPU)
    distance = torch.arange(-(width - 1), width)
    want = MPNetEncoder.relative_position_bucket(distance, num_buckets=AB.NUM_BUCKETS, max_distance=AB.MAX_DISTANCE)
    assert torch.equal(got.long(), want.long())
