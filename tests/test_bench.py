"""The benchmark harness (``bench/``) on CPU: checks before timing, skips, reports, CLI."""

from __future__ import annotations

import json

import pytest
import torch


from bench import report
from bench.__main__ import main
from bench.harness import (
    SUITES,
    Case,
    Config,
    CopyCeiling,
    Impl,
    Suite,
    Timing,
    Workload,
    copy_impl,
    run_suite,
)
from conftest import TRITON_ON_CPU

CPU = torch.device("cpu")
FAST = Config(CPU, quick=True, timing=Timing(warmup_ms=0, rep_ms=0, min_reps=1))
CEILING = CopyCeiling(bytes=2 << 20, median_ms=0.1)


def test_pack_suite_on_cpu():
    rows = run_suite(SUITES["pack"], FAST, CEILING)
    assert rows and not [r for r in rows if r.status == "failed"]
    by_impl = {(r.case, r.impl): r for r in rows}
    for case in SUITES["pack"].cases(FAST):
        torch_row = by_impl[(case.name, "ragged torch")]
        assert torch_row.status == "ok" and torch_row.median_ms > 0 and torch_row.gbps > 0
        assert set(torch_row.speedup) == {r.impl for r in rows if r.case == case.name and r.kind == "baseline"}
        assert by_impl[(case.name, "ragged cuda")].status == "skipped"
        assert by_impl[(case.name, "ragged triton")].status == ("ok" if TRITON_ON_CPU else "skipped")


class _Toy(Suite):
    """Not registered: one case whose implementations misbehave on purpose."""

    name = "toy"
    description = "harness self-test"

    def cases(self, config):
        return [Case("toy n=8", {"n": 8}, group="toy")]

    def build(self, case, config):
        x = torch.arange(8)

        def boom():
            raise RuntimeError("kernel exploded")

        return Workload(
            impls=[
                Impl("right", "ragged", lambda: x.clone()),
                Impl("wrong", "ragged", lambda: x + 1),
                Impl("raises", "ragged", boom),
                Impl("missing baseline", "baseline", boom),
                Impl("not here", "ragged", skip="needs a GPU"),
                Impl("baseline", "baseline", lambda: x * 1),
                copy_impl(64, config.device),
            ],
            reference=x,
            bytes_moved=64,
        )


def test_wrong_output_fails_and_is_not_timed():
    rows = {r.impl: r for r in run_suite(_Toy(), FAST, CEILING)}
    assert rows["right"].status == "ok" and rows["right"].median_ms is not None
    assert "baseline" in rows["right"].speedup
    assert rows["wrong"].status == "failed" and rows["wrong"].median_ms is None
    assert "8 of 8 elements differ" in rows["wrong"].reason
    assert rows["raises"].status == "failed" and "kernel exploded" in rows["raises"].reason
    assert rows["missing baseline"].status == "skipped" and "kernel exploded" in rows["missing baseline"].reason
    assert rows["not here"].status == "skipped" and rows["not here"].reason == "needs a GPU"
    assert rows["copy (same bytes)"].status == "ok" and rows["copy (same bytes)"].pct_of_copy is not None


def test_reports(tmp_path):
    suite = _Toy()
    rows = run_suite(suite, FAST, CEILING)
    env = {"device_name": "cpu", "device": "cpu", "date": "d", "torch": "t", "triton": "t", "cuda": None,
           "cupy": None, "git_commit": None}
    doc = report.suite_document(suite, rows, FAST, env, CEILING)
    report.write_json(tmp_path / "toy.json", doc)
    loaded = json.loads((tmp_path / "toy.json").read_text())
    assert loaded["suite"] == "toy" and len(loaded["rows"]) == len(rows)
    assert loaded["copy_ceiling"]["gbps"] == pytest.approx(CEILING.gbps)
    md = report.markdown(suite, rows, env, CEILING)
    assert "FAILED [" in md and "kernel exploded" in md and "`right`" in md
    pytest.importorskip("matplotlib")
    assert report.plot(tmp_path / "toy.png", suite, rows, env, CEILING)
    assert (tmp_path / "toy.png").stat().st_size > 0


def test_cli(capsys):
    pytest.importorskip("rich")
    assert main(["--list"]) == 0
    assert "pack" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--dtype", "nonsense", "--list"])


def test_more_rounds_report_the_median_and_spread_round_robin(monkeypatch):
    import bench.harness as H

    order = []
    times = {"a": iter([4.0, 2.0]), "b": iter([1.0, 9.0])}

    def fake_median(fn, device, timing):
        name = fn()
        order.append(name)
        return next(times[name])

    monkeypatch.setattr(H, "median_ms", fake_median)
    impls = [H.Impl("a", "baseline", lambda: "a"), H.Impl("b", "ragged", lambda: "b"),
             H.Impl("c", "ragged", lambda: "c")]
    rows = [H.Row("s", "case", "g", {}, i.name, i.kind, "ok", median_ms=m, flops=10**9)
            for i, m in zip(impls, (3.0, 2.0, 1.0))]
    rows[2].status = "failed"  # not timed again
    H._more_rounds(impls, rows, 3, H.Config(torch.device("cpu")))
    assert order == ["a", "b", "a", "b"]  # round-robin
    assert rows[0].median_ms == 3.0 and rows[0].extra[H.ROUND_SPREAD] == pytest.approx(100 * 2 / 3)
    assert rows[1].median_ms == 2.0 and rows[1].extra[H.ROUND_SPREAD] == pytest.approx(100 * 8 / 2)
    assert rows[1].tflops == pytest.approx(1e9 / 2e-3 / 1e12)
    assert rows[2].median_ms == 1.0 and H.ROUND_SPREAD not in rows[2].extra
