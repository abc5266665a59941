"""The vocab suite of the benchmark harness (``bench/suites/vocab.py``) on CPU, and the
harness pieces it added: per-row ``extra`` measurements, ``Suite.annotate``, peak memory."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import TRITON_ON_CPU

from bench import report
from bench.__main__ import main
from bench.harness import (
    SUITES,
    Case,
    Config,
    CopyCeiling,
    Impl,
    Row,
    Skip,
    Suite,
    Timing,
    Workload,
    peak_memory_bytes,
    run_suite,
)
from bench.suites import vocab as V

CPU = torch.device("cpu")
FAST = Config(CPU, quick=True, timing=Timing(warmup_ms=0, rep_ms=0, min_reps=1))
CEILING = CopyCeiling(bytes=2 << 20, median_ms=0.1)
SMALL, CLAIM = V.CPU_QUICK_SHAPES  # the cases of FAST (--quick)
TINY = V.Shape("tiny", torch.float32, 3, 2, 5, 32, 300, 10, 40, bias=True)
ENV = {
    "device_name": "cpu",
    "device": "cpu",
    "date": "d",
    "torch": "t",
    "triton": "t",
    "cuda": None,
    "cupy": None,
    "git_commit": None,
}

BASELINES = {
    V.FWD: {V.FULL_GATHER, V.FULL_ONLY, V.UNION, V.LOOP},
    V.FWD_BWD: {V.FULL_GATHER, V.UNION, V.LOOP},
    V.CE: {V.CE_FULL, V.CE_GATHER, V.CE_LOOP},
}


@pytest.fixture(scope="module")
def cpu_rows():
    """One run of the suite's CPU cases (the slow part of this file, shared), on one
    thread as ``python -m bench`` runs them on CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_suite(SUITES["vocab"], FAST, CEILING)
    finally:
        torch.set_num_threads(threads)


def test_registered_last():
    names = list(SUITES)
    assert names.index("pack") < names.index("attention") < names.index("vocab")
    suite = SUITES["vocab"]
    assert not suite.memory_bound and suite.speedup_table


def test_cpu_cases():
    cases = SUITES["vocab"].cases(FAST)
    assert [c.group for c in cases] == [V.FWD, V.FWD, V.FWD_BWD, V.CE]
    claim = cases[1]
    assert claim.params["claim"] == 8.0 and claim.params["dtype"] == "fp32"
    assert (claim.params["B"], claim.params["d"], claim.params["V"]) == (16, 512, 50000)
    assert claim.params["min_cands"] == claim.params["max_cands"] == 2000
    for c in cases:
        assert "|" not in c.name  # the case column of the Markdown table is not a place for pipes
        assert c.params["full_logits_bytes"] == c.params["T"] * c.params["V"] * 4


def test_gpu_cases_and_dtype_filter():
    gpu = Config(torch.device("cuda"))  # listing cases allocates nothing on the device
    cases = SUITES["vocab"].cases(gpu)
    assert [c.group for c in cases] == list(V.GROUPS)
    p = cases[0].params
    assert (p["dtype"], p["B"], p["min_len"], p["max_len"], p["d"], p["V"], p["min_cands"], p["max_cands"]) == (
        "bf16",
        64,
        16,
        64,
        1024,
        32000,
        500,
        2000,
    )
    assert p["full_logits_bytes"] == p["T"] * 32000 * 2
    assert {
        c.params["dtype"] for c in SUITES["vocab"].cases(Config(torch.device("cuda"), dtypes=(torch.float16,)))
    } == {"fp16"}
    only_bf16 = SUITES["vocab"].cases(Config(CPU, dtypes=(torch.bfloat16,)))
    assert only_bf16 and all(c.params["dtype"] == "bf16" and c.params["claim"] is None for c in only_bf16)
    assert len(SUITES["vocab"].cases(Config(CPU, quick=True, dtypes=(torch.float32,)))) == 4
    assert len(SUITES["vocab"].cases(Config(CPU, dtypes=(torch.float32,)))) == 3
    assert SUITES["vocab"].cases(Config(CPU, dtypes=(torch.int64,))) == []


def test_draw_is_seeded_and_in_range():
    for shape in (*V.GPU_SHAPES, *V.CPU_SHAPES, *V.CPU_QUICK_SHAPES):
        lengths, cands = V.draw(shape)
        again = V.draw.__wrapped__(shape)
        assert lengths == again[0] and all(torch.equal(a, b) for a, b in zip(cands, again[1]))
        assert len(lengths) == len(cands) == shape.batch
        assert all(shape.min_len <= n <= shape.max_len for n in lengths)
        for c in cands:
            assert shape.min_cands <= c.numel() <= shape.max_cands and c.dtype == torch.int64
            assert bool((c[1:] > c[:-1]).all()) and 0 <= int(c.min()) and int(c.max()) < shape.vocab


def test_flops_and_sizes():
    assert V.selected_logits([2, 3], [10, 20]) == 80
    assert V.vocab_flops([2, 3], [10, 20], dim=8, backward=False) == 2 * 80 * 8
    assert V.vocab_flops([2, 3], [10, 20], dim=8, backward=True) == 3 * 2 * 80 * 8
    assert V.full_logits_bytes(10, 100, torch.bfloat16) == 2000
    assert V.full_logits_bytes(10, 100, torch.float32) == 4000


def test_problem_index_tensors():
    p = V.Problem.make(TINY, CPU)
    blocks = [x.reshape(-1) for x in V.loop_logits(p, p.hidden, p.weight, p.bias)]
    selected = torch.cat(blocks)
    full = F.linear(p.hidden, p.weight, p.bias)
    torch.testing.assert_close(full.reshape(-1)[p.full_index], selected)
    union = F.linear(p.hidden, p.weight[p.union], p.bias[p.union])
    torch.testing.assert_close(union.reshape(-1)[p.union_index], selected)
    assert torch.equal(p.union, torch.unique(p.vocab_values))
    ug = p.union_grad()
    assert ug.shape == (p.total, p.union.numel()) and torch.equal(ug.reshape(-1)[p.union_index], p.grad)
    assert float(ug.abs().sum()) == pytest.approx(float(p.grad.abs().sum()), rel=1e-5)
    index, pad = p.padded_candidates()
    assert index.shape == pad.shape == (p.total, max(p.counts))
    for s, e, c in p.spans:
        for t in range(s, e):
            assert torch.equal(index[t][~pad[t]], c)
            assert int(c[p.local_target[t]]) == int(p.target[t])


def test_reference_matches_the_ragged_torch_backend():
    api, missing = V.ragged_api()
    if api is None:
        pytest.skip(missing)
    projection, cross_entropy = api
    p = V.Problem.make(TINY, CPU)
    hidden = V.ragged.RaggedTensor.from_lengths(p.hidden, p.lengths)
    vocab = V.ragged.RaggedTensor.from_lengths(p.vocab_values, p.counts)
    (logits,) = V.reference_outputs(p, V.FWD)
    torch.testing.assert_close(projection(hidden, p.weight, vocab, bias=p.bias, backend="torch").values, logits)
    loss, _, _ = V.reference_outputs(p, V.CE)
    torch.testing.assert_close(cross_entropy(hidden, p.weight, vocab, p.target, bias=p.bias, backend="torch"), loss)
    # The loss of the gate is F.cross_entropy over the gathered candidates.
    index, pad = p.padded_candidates()
    gathered = F.linear(p.hidden, p.weight, p.bias).gather(1, index).masked_fill(pad, float("-inf"))
    torch.testing.assert_close(F.cross_entropy(gathered, p.local_target), loss)


@pytest.mark.parametrize("group", V.GROUPS)
def test_every_checked_baseline_passes_the_gate(group):
    wl = V.build_workload(TINY, group, CPU)
    for impl in wl.impls:
        if impl.kind == "baseline" and impl.check:
            assert wl.compare(impl.fn(), wl.reference) is None, impl.name
    assert {i.name for i in wl.impls if i.kind == "baseline"} == BASELINES[group]
    lengths, cands = V.draw(TINY)
    assert wl.flops == V.vocab_flops(lengths, [c.numel() for c in cands], TINY.dim, backward=group != V.FWD)


def test_gate_rejects_wrong_outputs():
    wl = V.build_workload(TINY, V.FWD_BWD, CPU)
    impls = {i.name: i for i in wl.impls}
    logits, dh, dw = impls[V.LOOP].fn()
    assert wl.compare((logits, dh, dw), wl.reference) is None
    problem = wl.compare((logits, dh, dw * 1.5), wl.reference)
    assert problem is not None and problem.startswith("dW max abs error")
    wrong = logits.detach().clone()
    wrong[3] += 1.0
    assert wl.compare((wrong, dh, dw), wl.reference).startswith("logits max abs error")
    assert "expected 3 outputs" in wl.compare(logits, wl.reference)
    assert "shape" in wl.compare((logits[:-1], dh, dw), wl.reference)
    nan = dh.detach().clone()
    nan[0, 0] = float("nan")
    assert "dh max abs error" in wl.compare((logits, nan, dw), wl.reference)

    ce = V.build_workload(TINY, V.CE, CPU)
    impls = {i.name: i for i in ce.impls}
    # The full-vocabulary loss is another loss: unchecked, and the gate would reject it.
    assert not impls[V.CE_FULL].check
    assert ce.compare(impls[V.CE_FULL].fn(), ce.reference).startswith("loss max abs error")


@pytest.mark.skipif(not TRITON_ON_CPU, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("group", V.GROUPS)
def test_triton_rows_pass_the_gate_on_a_tiny_case(group):
    """The suite interprets the triton rows in the small fwd case only; each group on a tiny one."""
    default = next(i for i in V.build_workload(TINY, group, CPU).impls if i.name == "ragged triton")
    assert (default.skip is None) == (group in TINY.interpreted_triton)
    wl = V.build_workload(V.dataclasses.replace(TINY, interpreted_triton=V.GROUPS), group, CPU)
    triton = next(i for i in wl.impls if i.name == "ragged triton")
    assert triton.skip is None, triton.skip
    assert wl.compare(triton.fn(), wl.reference) is None


def test_vocab_suite_on_cpu(cpu_rows):
    rows = cpu_rows
    assert rows and not [(r.case, r.impl, r.reason) for r in rows if r.status == "failed"]
    by = {(r.case, r.impl): r for r in rows}
    for case in SUITES["vocab"].cases(FAST):
        shape, group = case.spec
        lengths, cands = V.draw(shape)
        torch_row = by[(case.name, "ragged torch")]
        assert torch_row.status == "ok" and torch_row.median_ms > 0 and torch_row.tflops > 0
        assert torch_row.flops == V.vocab_flops(lengths, [c.numel() for c in cands], shape.dim, group != V.FWD)
        measured = {r.impl for r in rows if r.case == case.name and r.kind == "baseline" and r.status == "ok"}
        assert measured == BASELINES[group]
        assert set(torch_row.speedup) == measured
        triton_row = by[(case.name, "ragged triton")]
        interpreted = TRITON_ON_CPU and group in shape.interpreted_triton
        assert triton_row.status == ("ok" if interpreted else "skipped"), triton_row.reason
        for r in rows:
            if r.case == case.name and r.status == "ok":
                assert r.extra[V.PEAK_MB] > 0
                assert r.extra[V.PEAK_PCT] == pytest.approx(
                    100 * r.extra[V.PEAK_MB] * 1e6 / case.params["full_logits_bytes"]
                )
        if group == V.FWD:  # the full projection's output alone is the full logits
            assert by[(case.name, V.FULL_ONLY)].extra[V.PEAK_PCT] >= 99.9


def test_claim_annotation(cpu_rows):
    """The claim is ragged's: its row says whether it holds; the loop baseline's row gives
    its ratio alone (a "FAILS" on a baseline row whose status is ok read as a failure)."""
    case = next(c for c in SUITES["vocab"].cases(FAST) if c.params["claim"])
    rows = {r.impl: r for r in cpu_rows if r.case == case.name}
    key = V.claim_key(case.params["claim"])
    full = rows[V.FULL_ONLY].median_ms
    ratio = full / rows["ragged torch"].median_ms
    verdict = "holds" if ratio >= 8 else "FAILS"
    assert rows["ragged torch"].extra[key] == f"{ratio:.1f}x, {verdict}"
    assert rows[V.LOOP].extra[key] == f"{full / rows[V.LOOP].median_ms:.1f}x"
    assert key not in rows[V.FULL_GATHER].extra
    others = [r for r in cpu_rows if r.case != case.name]
    assert all(key not in r.extra for r in others)


def test_no_verdict_on_a_baseline_row():
    """Whatever the times, a baseline row carries no holds / FAILS."""
    case = next(c for c in SUITES["vocab"].cases(FAST) if c.params["claim"])
    base = dict(suite="vocab", case=case.name, group=case.group, params=case.params, status="ok")
    rows = [
        Row(**base, impl=V.FULL_ONLY, kind="baseline", median_ms=10.0),
        Row(**base, impl="ragged torch", kind="ragged", median_ms=5.0),
        Row(**base, impl=V.LOOP, kind="baseline", median_ms=5.0),
    ]
    SUITES["vocab"].annotate(case, rows)
    key = V.claim_key(case.params["claim"])
    assert rows[1].extra[key] == "2.0x, FAILS" and rows[2].extra[key] == "2.0x"


def test_default_cpu_cases_claim_and_size():
    """The CPU run without --quick: one shortlist workload in every group, sized so that
    the full-vocabulary rows are not all overhead, the claim on its fwd case."""
    cases = SUITES["vocab"].cases(Config(CPU))
    assert [c.group for c in cases] == list(V.GROUPS)
    assert all(c.params["selected_fraction"] < 0.1 and c.params["T"] >= 100 for c in cases)
    assert cases[0].params["claim"] == 8.0
    assert all(
        c.params["dtype"] == "bf16" and c.params["claim"] is None
        for c in SUITES["vocab"].cases(Config(CPU, dtypes=(torch.bfloat16,)))
    )


def test_markdown_and_json_carry_the_extra_columns(cpu_rows, tmp_path):
    suite = SUITES["vocab"]
    md = report.markdown(suite, cpu_rows, ENV, CEILING)
    header = next(line for line in md.splitlines() if line.startswith("| case |"))
    assert f"| {V.PEAK_MB} |" in header and f"| {V.PEAK_PCT} |" in header and "claim: >= 8x" in header
    assert "## Speedup over each baseline" in md and f"`{V.UNION}`" in md
    lines = md.splitlines()
    start = lines.index(header)
    table = lines[start : lines.index("", start)]
    cells = {len(re.split(r"(?<!\\)\|", line)) for line in table}
    assert len(cells) == 1  # every row has as many cells as its header
    _, body = report.speedup_table(cpu_rows)
    assert body and all(math.isfinite(float(c.rstrip("x"))) for _, _, cells in body for c in cells if c)
    doc = report.suite_document(suite, cpu_rows, FAST, ENV, CEILING)
    report.write_json(tmp_path / "vocab.json", doc)
    loaded = json.loads((tmp_path / "vocab.json").read_text())
    assert all(isinstance(r["extra"], dict) for r in loaded["rows"])
    assert any(V.PEAK_MB in r["extra"] for r in loaded["rows"])


def test_missing_api_skips_the_ragged_rows(monkeypatch):
    monkeypatch.setattr(V, "ragged_api", lambda: (None, "ragged.ops.vocab cannot be imported (test)"))
    wl = V.build_workload(TINY, V.FWD, CPU)
    ragged_rows = [i for i in wl.impls if i.kind == "ragged"]
    assert [i.name for i in ragged_rows] == ["ragged triton", "ragged torch"]
    assert all(i.skip == "ragged.ops.vocab cannot be imported (test)" for i in ragged_rows)


def test_declined_backend_is_a_skip():
    def declines():
        raise ValueError("ragged.vocab_projection(): backend 'triton' cannot take this input: float64")

    def broken():
        raise ValueError("something else")

    with pytest.raises(Skip, match="cannot take this input"):
        V._forced(declines)
    with pytest.raises(ValueError, match="something else"):
        V._forced(broken)


def test_gpu_only_rows_skip_on_the_gpu_shape():
    assert V._backend_skip(V.GPU_SHAPES[0], V.FWD, "torch", CPU) is not None
    assert V._backend_skip(SMALL, V.FWD, "torch", CPU) is None


# --------------------------------------------------------------------------------------
# Harness: extra measurements, annotate, peak memory


class _Extra(Suite):
    """Not registered: extra measurements that work, fail, and an annotation."""

    name = "extra"
    description = "extra columns self-test"

    def cases(self, config):
        return [Case("extra n=4", {"n": 4}, group="extra")]

    def build(self, case, config):
        x = torch.arange(4.0)

        def extra(impl):
            if impl.name == "bad":
                raise RuntimeError("no gauge")
            return {"size": 4, "ratio": 0.25, "label": impl.name}

        return Workload(
            impls=[
                Impl("good", "ragged", lambda: x.clone()),
                Impl("bad", "ragged", lambda: x.clone()),
                Impl("base", "baseline", lambda: x * 1),
                Impl("never", "ragged", skip="not here"),
            ],
            reference=x,
            flops=8,
            extra=extra,
        )

    def annotate(self, case, rows):
        for r in rows:
            if r.status == "ok":
                r.extra["annotated"] = r.impl.upper()


def test_extra_measurements_and_annotate():
    rows = {r.impl: r for r in run_suite(_Extra(), FAST, CEILING)}
    assert rows["good"].extra == {"size": 4, "ratio": 0.25, "label": "good", "annotated": "GOOD"}
    assert rows["bad"].status == "ok" and "no gauge" in rows["bad"].extra["extra error"]
    assert rows["never"].extra == {}
    cols = report.columns(_Extra(), list(rows.values()))
    headers = [c.header for c in cols]
    assert headers[-1] == "status" and {"size", "ratio", "label", "annotated", "extra error"} <= set(headers)
    by = {c.header: c for c in cols}
    assert by["ratio"].cell(rows["good"]) == "0.25" and by["size"].cell(rows["good"]) == "4"
    assert by["ratio"].numeric and not by["label"].numeric
    assert by["ratio"].cell(rows["never"]) == ""


def test_peak_memory_on_cpu():
    n = 1 << 20
    peak = peak_memory_bytes(lambda: torch.ones(n, dtype=torch.float32), CPU)
    if peak is None:
        pytest.skip("this torch's profiler records no CPU allocation events")
    assert n * 4 <= peak < n * 4 + (1 << 16)

    def temporaries():
        a = torch.ones(n)  # 4 MiB, freed before the 1 MiB result is returned
        return a[: n // 4].clone()

    assert 5 * n <= peak_memory_bytes(temporaries, CPU) < 5 * n + (1 << 16)


def test_cli_lists_vocab(capsys):
    pytest.importorskip("rich")
    assert main(["--suite", "vocab", "--list"]) == 0
    out = capsys.readouterr().out
    assert "vocab" in out and "cands=250..1000" in out  # the CPU run's shortlist case
    assert main(["--suite", "vocab", "--list", "--quick"]) == 0
    assert "cands=2000" in capsys.readouterr().out  # --quick: the small and claim cases
