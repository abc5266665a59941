"""The benchmark harness (``bench/``) on CPU: checks before timing, skips, reports, CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import TRITON_ON_CPU

from bench import measure, report
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


def test_rows_filter_runs_only_the_named_rows():
    """``--rows``: rows whose names contain none of the texts are skipped, never called (the
    row that raises is not reached), and say why; the named ones run as usual."""
    rows = {r.impl: r for r in run_suite(_Toy(), dataclasses.replace(FAST, rows=("righ", "copy")), CEILING)}
    assert rows["right"].status == "ok" and rows["right"].median_ms is not None
    assert rows["copy (same bytes)"].status == "ok"
    for name in ("wrong", "raises", "missing baseline"):
        assert rows[name].status == "skipped" and rows[name].reason == "not among --rows righ copy", name
    assert rows["not here"].reason == "needs a GPU"  # its own reason first


def test_reports(tmp_path):
    suite = _Toy()
    rows = run_suite(suite, FAST, CEILING)
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
    assert main(["--rows", "ragged", "ST encode", "--list"]) == 0


def test_more_rounds_report_the_median_and_spread_round_robin(monkeypatch):
    import bench.harness as H

    order = []
    times = {"a": iter([4.0, 2.0]), "b": iter([1.0, 9.0])}

    def fake_median(fn, device, timing):
        name = fn()
        order.append(name)
        return next(times[name])

    monkeypatch.setattr(H, "median_ms", fake_median)
    impls = [
        H.Impl("a", "baseline", lambda: "a"),
        H.Impl("b", "ragged", lambda: "b"),
        H.Impl("c", "ragged", lambda: "c"),
    ]
    rows = [
        H.Row("s", "case", "g", {}, i.name, i.kind, "ok", median_ms=m, flops=10**9)
        for i, m in zip(impls, (3.0, 2.0, 1.0))
    ]
    rows[2].status = "failed"  # not timed again
    H._more_rounds(impls, rows, 3, H.Config(torch.device("cpu")))
    assert order == ["a", "b", "a", "b"]  # round-robin
    assert rows[0].median_ms == 3.0 and rows[0].extra[H.ROUND_SPREAD] == pytest.approx(100 * 2 / 3)
    assert rows[1].median_ms == 2.0 and rows[1].extra[H.ROUND_SPREAD] == pytest.approx(100 * 8 / 2)
    assert rows[1].tflops == pytest.approx(1e9 / 2e-3 / 1e12)
    assert rows[2].median_ms == 1.0 and H.ROUND_SPREAD not in rows[2].extra


# --------------------------------------------------------------------------------------
# Git metadata: BENCH_GIT_COMMIT wins; git is asked about the project's root only


def _git_repo(path):
    """A fresh repository at ``path`` with one empty commit; its HEAD."""
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    run = lambda *args: subprocess.run(
        ["git", "-C", str(path), *args],
        check=True,
        capture_output=True,  # noqa: E731
        text=True,
    ).stdout.strip()
    run("init", "-q")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "outer")
    return run("rev-parse", "HEAD")


def _project_head():
    import subprocess

    from bench import env

    done = subprocess.run(["git", "-C", str(env.REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def test_commit_variable_wins(monkeypatch, tmp_path):
    from bench import env

    monkeypatch.setenv("BENCH_GIT_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    info = env.collect(CPU)
    assert info["git_commit"] == "0123456789abcdef0123456789abcdef01234567"
    assert info["git_commit_source"] == "BENCH_GIT_COMMIT"
    if info["git_dirty"] is not None:  # known only for a checkout at that very commit
        assert _project_head() == info["git_commit"]
    md = report.markdown(_Toy(), [], info, CEILING)
    assert "commit: 0123456789abcdef0123456789abcdef01234567 (from BENCH_GIT_COMMIT)" in md


def test_commit_is_the_project_roots_not_the_working_directorys(monkeypatch, tmp_path):
    """Run from inside another repository: the commit is still the project's (or none)."""
    pytest.importorskip("shutil").which("git") or pytest.skip("no git")
    from bench import env

    monkeypatch.delenv("BENCH_GIT_COMMIT", raising=False)
    outer = _git_repo(tmp_path / "outer")
    monkeypatch.chdir(tmp_path / "outer")
    info = env.collect(CPU)
    assert info["git_commit"] != outer
    assert info["git_commit"] == _project_head()


def test_project_copy_inside_another_repository_has_no_commit(monkeypatch, tmp_path):
    """A copy of the project (no .git of its own) unpacked inside another repository:
    "unknown", never the enclosing repository's commit."""
    pytest.importorskip("shutil").which("git") or pytest.skip("no git")
    from bench import env

    monkeypatch.delenv("BENCH_GIT_COMMIT", raising=False)
    outer = _git_repo(tmp_path / "outer")
    copy = tmp_path / "outer" / "project"
    (copy / "bench").mkdir(parents=True)
    monkeypatch.setattr(env, "REPO_ROOT", copy)
    monkeypatch.chdir(copy)
    info = env.collect(CPU)
    assert info["git_commit"] is None and info["git_dirty"] is None and info["git_commit_source"] is None
    assert env.git_state(copy)["git_commit"] is None and env.git_state(tmp_path / "outer")["git_commit"] == outer
    assert "- commit: unknown" in report.markdown(_Toy(), [], info, CEILING)
    monkeypatch.setenv("BENCH_GIT_COMMIT", "feedc0de")
    assert env.collect(CPU)["git_commit"] == "feedc0de"


# --------------------------------------------------------------------------------------
# Warm-up until times settle


def test_settle_repeats_short_timings_until_two_agree(monkeypatch):
    import bench.harness as H

    times = iter([9.0, 6.0, 5.0, 5.1, 1.0])
    calls = []
    monkeypatch.setattr(measure, "short_median_ms", lambda fn, device, rep_ms: calls.append(rep_ms) or next(times))
    timing = H.Timing(0, 0, settle_rep_ms=7, settle_tol=0.03, settle_max_s=60)
    assert H.settle(lambda: None, CPU, timing) == [9.0, 6.0, 5.0, 5.1]  # 5.0 -> 5.1: within 3%
    assert calls == [7, 7, 7, 7]
    assert H.settle(lambda: None, CPU, H.Timing(0, 0)) == []  # settle_max_s=0: no warm-up


def test_settle_stops_at_its_time_cap(monkeypatch):
    import itertools
    import time

    import bench.harness as H

    drifting = itertools.count(10.0, 1.0)  # never two within 3%... of each other at this pace? 10, 11: 10%

    def slow(fn, device, rep_ms):
        time.sleep(0.01)
        return next(drifting)

    monkeypatch.setattr(measure, "short_median_ms", slow)
    start = time.perf_counter()
    rounds = H.settle(lambda: None, CPU, H.Timing(0, 0, settle_rep_ms=1, settle_max_s=0.1))
    assert time.perf_counter() - start < 1.0 and 2 <= len(rounds) <= 15


def test_settle_absolute_floor(monkeypatch):
    """Medians a timer tick apart (0.5 us on CUDA events: 5% of a 10 us kernel) agree."""
    import bench.harness as H

    times = iter([0.0100, 0.0105, 0.0099])
    monkeypatch.setattr(measure, "short_median_ms", lambda fn, device, rep_ms: next(times))
    assert H.settle(lambda: None, CPU, H.Timing(0, 0, settle_rep_ms=1, settle_abs_ms=0.001, settle_max_s=60)) == [
        0.0100,
        0.0105,
    ]


def test_rows_are_timed_after_the_check_and_the_warm_up(monkeypatch):
    import bench.harness as H

    order = []
    monkeypatch.setattr(H, "settle", lambda fn, device, timing: order.append("settle") or [1.0, 1.0])
    monkeypatch.setattr(H, "median_ms", lambda fn, device, timing: order.append("time") or 2.0)
    impl = Impl("r", "ragged", lambda: order.append("call") or torch.ones(2))
    wl = Workload([impl], reference=torch.ones(2), bytes_moved=8)
    row = H.Row("s", "c", "g", {}, "r", "ragged", "skipped", bytes=8)
    H.run_impl(impl, wl, row, FAST)
    assert order == ["call", "settle", "time"] and row.status == "ok" and row.median_ms == 2.0


def test_default_timing_settles_on_the_gpu_and_briefly_on_cpu():
    gpu, cpu = Timing.default(torch.device("cuda"), False), Timing.default(CPU, False)
    assert gpu.settle_max_s >= 2 and 0 < gpu.settle_tol <= 0.05 and gpu.settle_rep_ms > 0
    assert 0 < cpu.settle_max_s <= 0.2
    assert Timing.default(torch.device("cuda"), True).settle_max_s > 0


@pytest.mark.gpu
def test_settle_and_copy_ceiling_on_cuda():
    """On a GPU: settle returns agreeing rounds (or stops at its cap), and the measurement
    after it reads like its last round; the copy ceiling is one large copy."""
    import time

    import bench.harness as H

    dev = torch.device("cuda")
    a = torch.randn(2048, 2048, device=dev)
    timing = Timing.default(dev, quick=True)
    start = time.perf_counter()
    rounds = H.settle(lambda: a @ a, dev, timing)
    assert rounds and all(r > 0 for r in rounds)
    assert time.perf_counter() - start < timing.settle_max_s + 5
    if len(rounds) >= 2 and time.perf_counter() - start < timing.settle_max_s:
        assert abs(rounds[-1] - rounds[-2]) <= timing.settle_tol * min(rounds[-2:]) + timing.settle_abs_ms
    ms = H.median_ms(lambda: a @ a, dev, timing)
    assert 0.5 * rounds[-1] <= ms <= 2.0 * rounds[-1]
    ceiling = H.measure_copy_ceiling(H.Config(dev, quick=True))
    assert ceiling is not None and ceiling.bytes == 2 * (256 << 20) and ceiling.gbps > 100


# --------------------------------------------------------------------------------------
# CPU runs: % copy against the case's own copy, labels, cases past the overhead


def test_cpu_copy_ceiling_is_per_case():
    """On CPU % copy divides by the case's own copy of the same bytes (a large copy measured
    once read 473% for rows of a cache-sized case)."""
    from bench.harness import measure_copy_ceiling

    assert measure_copy_ceiling(Config(CPU)) is None
    rows = {r.impl: r for r in run_suite(_Toy(), FAST, None)}
    copy = rows["copy (same bytes)"]
    assert copy.status == "ok" and copy.pct_of_copy == pytest.approx(100.0) and copy.copy_gbps == copy.gbps
    for r in rows.values():
        if r.status == "ok":
            assert r.copy_gbps == copy.gbps and r.pct_of_copy == pytest.approx(100 * r.gbps / copy.gbps)
    rows = {r.impl: r for r in run_suite(_Toy(), FAST, CEILING)}  # a device ceiling given: that one
    assert rows["right"].pct_of_copy == pytest.approx(100 * rows["right"].gbps / CEILING.gbps)


def test_cpu_copy_row_is_the_faster_of_two_timings(monkeypatch):
    """A busy moment of a shared CPU during the copy row's timing would lift every row's
    % copy: it is timed again after the other rows, and the faster median stands."""
    import bench.harness as H

    copy_times = iter([2.0, 1.0])

    def fake_median(fn, device, timing):
        return next(copy_times) if fn().dtype == torch.uint8 else 1.5  # the copy row copies bytes

    monkeypatch.setattr(H, "median_ms", fake_median)
    suite = _Toy()
    rows = {r.impl: r for r in run_suite(suite, FAST, None)}
    copy = rows["copy (same bytes)"]
    assert copy.median_ms == 1.0 and copy.gbps == pytest.approx(64 / 1e-3 / 1e9)
    assert rows["right"].pct_of_copy == pytest.approx(100 * 1.0 / 1.5)
    copy_times = iter([1.0, 3.0])  # the first timing was the faster: it stands
    assert {r.impl: r for r in run_suite(suite, FAST, None)}["copy (same bytes)"].median_ms == 1.0


CPU_ENV = {
    "device_name": "Test CPU 9000",
    "device": "cpu",
    "cpu_name": "Test CPU 9000",
    "cpu_count": 2,
    "torch_threads": 1,
    "date": "d",
    "torch": "t",
    "triton": "t",
    "cuda": None,
    "cupy": None,
    "git_commit": "abc",
    "git_dirty": False,
    "git_commit_source": "git",
}
GPU_ENV = {**CPU_ENV, "device": "cuda", "device_name": "NVIDIA H200"}


def test_cpu_runs_are_labelled_and_name_the_cpu(tmp_path):
    from bench import env

    info = env.collect(CPU)
    assert info["cpu_name"] and info["cpu_name"] == env.cpu_name() and info["cpu_count"] >= 1
    rows = run_suite(SUITES["pack"], FAST, None, cases=SUITES["pack"].cases(FAST)[:1])
    md = report.markdown(SUITES["pack"], rows, CPU_ENV, None)
    head = md.split("\n| case |")[0]
    assert head.startswith("# pack (CPU, Test CPU 9000):")
    assert "- host CPU: Test CPU 9000; 1 torch thread of 2 logical cores" in head
    assert "CPU run:" in head and "own `copy (same bytes)` row" in head
    gpu_md = report.markdown(SUITES["pack"], rows, GPU_ENV, CEILING)
    assert gpu_md.startswith("# pack (NVIDIA H200):") and "- host CPU: Test CPU 9000" in gpu_md
    assert "CPU run:" not in gpu_md
    assert env.device_label(CPU_ENV) == "CPU: Test CPU 9000"
    assert env.device_label(GPU_ENV) == "NVIDIA H200 (host CPU: Test CPU 9000)"
    assert env.device_label({"device": "cuda", "device_name": "NVIDIA H200"}) == "NVIDIA H200"  # older results
    pytest.importorskip("rich")
    assert "CPU, Test CPU 9000" in report.rich_table(SUITES["pack"], rows, None, CPU_ENV).title


def test_cpu_name_from_proc_cpuinfo(monkeypatch, tmp_path):
    from bench import env

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel\t\t: 17\nmodel name\t: Some CPU 7000\n")
    real = env.Path

    monkeypatch.setattr(env, "Path", lambda p: real(info) if p == "/proc/cpuinfo" else real(p))
    assert env.cpu_name() == "Some CPU 7000"
    info.write_text("processor\t: 0\nmodel\t\t: 17\n")  # x86 "model" is a number, not a name
    assert env.cpu_name() != "17"


def test_default_cpu_cases_are_past_the_overhead():
    """Without --quick the CPU cases are sized to measure something (the tiny ones, all
    per-call overhead, are --quick's); every suite has some."""
    from bench.suites import attention as A
    from bench.suites import encoder as E
    from bench.suites import pack as P

    cpu = Config(CPU)
    for name in ("pack", "attention", "vocab", "encoder", "pool"):
        assert SUITES[name].cases(cpu) and SUITES[name].cases(cpu) != SUITES[name].cases(FAST)
    assert all(c.params["B"] * c.params["M"] * c.params["F"] >= 100_000 for c in SUITES["pack"].cases(cpu))
    assert {c.params["lengths"] for c in SUITES["attention"].cases(cpu)} == {"lognormal"}
    encoder = SUITES["encoder"].cases(cpu)
    assert {c.params["lengths"] for c in encoder} == {"lognormal"} and encoder[0].params["d_model"] >= 64
    assert P.CPU_QUICK_SHAPES and A.CPU_QUICK_SHAPES and E.CPU_QUICK_SHAPES


def test_interpreted_triton_rows_only_in_quick_cpu_cases(monkeypatch):
    from bench.harness import interpreter_skip

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreter_skip(FAST) is None and interpreter_skip(Config(torch.device("cuda"))) is None
    reason = interpreter_skip(Config(CPU))
    assert reason and "interpreter" in reason
    case = SUITES["pack"].cases(Config(CPU))[0]
    impls = {i.name: i for i in SUITES["pack"].build(case, Config(CPU)).impls}
    if TRITON_ON_CPU:
        assert impls["ragged triton"].skip == reason
    monkeypatch.delenv("TRITON_INTERPRET")
    assert interpreter_skip(Config(CPU)) is None


def test_encoder_title_names_the_model_it_ran():
    suite = SUITES["encoder"]
    cpu = suite.describe(c.params for c in suite.cases(Config(CPU)))
    assert "BERT-base" not in cpu and "d=128 h=4 ff=512 x2, fp32" in cpu
    assert "BERT-base" not in suite.describe(c.params for c in suite.cases(FAST))
    assert suite.describe(c.params for c in suite.cases(Config(torch.device("cuda")))).startswith("BERT-base")
    assert SUITES["pack"].describe([]) == SUITES["pack"].description


# --------------------------------------------------------------------------------------
# Plots


def _render(monkeypatch, tmp_path, suite, rows, env, ceiling):
    """``report.plot``'s figure, drawn, before it is closed."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    assert report.plot(tmp_path / "p.png", suite, rows, env, ceiling)
    fig = figures[-1]
    fig.canvas.draw()
    return fig


def _texts(fig):
    from matplotlib.text import Text

    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def _overlap(a, b):
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def _encoder_like_rows():
    """Rows of two cases with a ceiling row of other (10x more) work, as the encoder's GEMM."""
    rows = []
    for case in (
        "inference long case name B=64 L~lognormal(1..512) mean=131 d=768 h=12 ff=3072 x12",
        "inference another case B=1000 L=8..32 mean=20 d=768 h=12 ff=3072 x12",
    ):
        for impl, kind, tflops, flops in (
            ("padded", "baseline", 0.004, 10),
            ("ragged", "ragged", 0.012, 10),
            ("dense equal tokens", "ceiling", 0.02, 10),
            ("GEMM ceiling (torch.mm 256^3 fp32)", "ceiling", 0.1, 99),
        ):
            params = {"d_model": 32, "nhead": 2, "dim_feedforward": 64, "layers": 2, "dtype": "fp32"}
            rows.append(
                report.Row(
                    "encoder", case, "inference", params, impl, kind, "ok", median_ms=1.0, flops=flops, tflops=tflops
                )
            )
    return rows


def test_plot_names_the_device_and_nothing_overlaps_or_is_cut(monkeypatch, tmp_path):
    fig = _render(monkeypatch, tmp_path, SUITES["encoder"], _encoder_like_rows(), CPU_ENV, None)
    title = fig._suptitle.get_text()
    assert "CPU: Test CPU 9000" in title and "BERT-base" not in title
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    texts = _texts(fig)
    for t in texts:  # nothing cut at the figure's edges
        ext = t.get_window_extent(renderer)
        assert ext.x0 >= box.x0 - 1 and ext.x1 <= box.x1 + 1 and ext.y0 >= box.y0 - 1 and ext.y1 <= box.y1 + 1, (
            t.get_text()
        )
    suptitle = fig._suptitle.get_window_extent(renderer)
    for ax in fig.axes:
        if ax.get_visible():
            assert not _overlap(suptitle, ax.title.get_window_extent(renderer))
            assert not _overlap(suptitle, ax.get_window_extent(renderer))
    legend = fig.legends[0].get_window_extent(renderer)
    assert not any(_overlap(legend, ax.get_window_extent(renderer)) for ax in fig.axes if ax.get_visible())


def test_plot_does_not_flatten_bars_under_a_ceiling_of_other_work(monkeypatch, tmp_path):
    """The GEMM ceiling (10x the bars) is written at the top, not drawn as a bar."""
    fig = _render(monkeypatch, tmp_path, SUITES["encoder"], _encoder_like_rows(), CPU_ENV, None)
    for ax in (a for a in fig.axes if a.get_visible()):
        heights = [p.get_height() for p in ax.patches]
        assert len(heights) == 3 and max(heights) >= 0.5 * ax.get_ylim()[1]
        assert any("GEMM ceiling" in t.get_text() and "off scale" in t.get_text() for t in ax.texts)


def test_plot_copy_bars_and_ceiling_line(monkeypatch, tmp_path):
    """GPU: the device's copy ceiling is a line above the copy bars; CPU: no such line (each
    case's copy bar is its ceiling)."""
    rows = run_suite(_Toy(), FAST, None)
    fig = _render(monkeypatch, tmp_path, _Toy(), rows, CPU_ENV, None)
    assert not [line for ax in fig.axes for line in ax.get_lines()]
    copy = next(r for r in rows if r.impl == "copy (same bytes)")
    fast = CopyCeiling(bytes=2 << 30, median_ms=1e-9)  # far above every bar
    fig = _render(monkeypatch, tmp_path, _Toy(), rows, GPU_ENV, fast)
    ax = next(a for a in fig.axes if a.get_visible())
    assert copy.gbps in [p.get_height() for p in ax.patches]  # the copy row: a bar
    assert "copy ceiling" in " ".join(t.get_text() for t in ax.texts)  # off scale: written
    tallest = max(r.gbps for r in rows if r.status == "ok")
    level = CopyCeiling(bytes=2 << 20, median_ms=(2 << 20) / (1.5 * tallest * 1e9) * 1e3)
    fig = _render(monkeypatch, tmp_path, _Toy(), rows, GPU_ENV, level)
    ax = next(a for a in fig.axes if a.get_visible())
    (line,) = ax.get_lines()
    assert line.get_ydata()[0] == pytest.approx(level.gbps)
    assert level.gbps > max(p.get_height() for p in ax.patches) and ax.get_ylim()[1] > level.gbps


def test_plot_committed_gpu_results(monkeypatch, tmp_path):
    """Every committed result file renders, its panels readable (each case on its own
    scale), nothing cut at the edges."""
    import pathlib

    from bench.harness import Row

    files = sorted((pathlib.Path(report.__file__).parent / "results").glob("*.json"))
    if not files:
        pytest.skip("no committed results")
    for f in files[:3]:
        doc = json.loads(f.read_text())
        rows = [Row(**r) for r in doc["rows"]]
        c = doc["copy_ceiling"]
        fig = _render(
            monkeypatch,
            tmp_path,
            SUITES[doc["suite"]],
            rows,
            doc["env"],
            None if c is None else CopyCeiling(c["bytes"], c["median_ms"]),
        )
        assert doc["env"]["device_name"] in fig._suptitle.get_text()
        renderer, box = fig.canvas.get_renderer(), fig.bbox
        for t in _texts(fig):
            ext = t.get_window_extent(renderer)
            assert ext.x0 >= box.x0 - 1 and ext.x1 <= box.x1 + 1, (f.name, t.get_text())


def test_ab_compares_the_ragged_rows_of_two_trees(tmp_path):
    """bench.ab: the medians over the rounds of each tree per ragged row, head / base, rows of one
    tree only listed as such; suites split one per run; the package copy has the installed layout."""
    import json

    from bench import ab

    def write(tree, r, rows):
        folder = tmp_path / tree / f"r{r}"
        folder.mkdir(parents=True)
        doc = {
            "rows": [
                {"suite": "s", "case": c, "impl": "ragged x", "kind": k, "status": "ok", "median_ms": ms}
                for c, k, ms in rows
            ]
        }
        (folder / "s.json").write_text(json.dumps(doc))

    write("base", 1, [("a", "ragged", 1.0), ("b", "ragged", 2.0), ("c", "baseline", 9.0)])
    write("base", 2, [("a", "ragged", 3.0), ("b", "ragged", 2.0)])
    write("head", 1, [("a", "ragged", 1.0), ("b", "ragged", 1.0), ("new", "ragged", 5.0)])
    write("head", 2, [("a", "ragged", 1.0), ("b", "ragged", 1.0)])
    text = ab.compare(tmp_path, 2, {"base": "aaa", "head": "bbb"})
    assert "| s | a | ragged x | 2.0000 | 1.0000 | 0.500 |" in text
    assert "| s | b | ragged x | 2.0000 | 1.0000 | 0.500 |" in text
    assert "| s | new | ragged x |  | 5.0000 | only in one |" in text
    assert "| c |" not in text  # baselines are not compared
    assert "2 rows; 0 slower than base by more than 3%" in text
    assert (tmp_path / "ab.md").read_text() == text
    assert ab._split_suites(["--suite", "pack", "pool", "--quick"]) == (["pack", "pool"], ["--quick"])
    assert ab._split_suites(["--quick"]) == ([None], ["--quick"])
    pkg = ab.package(ab.ROOT, tmp_path / "pkg")
    for part in ("ragged/__init__.py", "ragged/nn/__init__.py", "ragged/_csrc/pack.cu", "bench/__main__.py"):
        assert (pkg / part).exists(), part


def test_ab_runs_each_tree_from_its_copy_even_under_an_editable_install(tmp_path):
    """The child of bench.ab imports the copy's ragged and ragged.nn, not the tree pip installed
    (an editable install's finder comes first on sys.meta_path): a marker in the copy's
    modules shows in the child's output."""
    from bench import ab

    pkg = ab.package(ab.ROOT, tmp_path / "pkg")
    for part in ("ragged/__init__.py", "ragged/nn/__init__.py"):
        path = pkg / part
        path.write_text(path.read_text() + f"\nprint('loaded from the copy: {part}')\n")
    log = tmp_path / "log.txt"
    assert ab.run_tree(pkg, "abc", ["--list"], log) == 0, log.read_text()
    text = log.read_text()
    assert "loaded from the copy: ragged/__init__.py" in text
    assert "loaded from the copy: ragged/nn/__init__.py" in text


def test_overhead_rows_run_on_the_cpu():
    """bench.overhead's rows (on CPU tensors here): every row that names no GPU backend runs."""
    from bench import overhead

    ran = 0
    for name, fn in overhead.rows("cpu"):
        if "cuda" in name or "triton" in name:
            continue  # forced GPU backends: their errors on CPU tensors are tested with the ops
        fn()
        ran += 1
    assert ran >= 10
