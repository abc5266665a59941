"""What the benchmark tools print and write on CPU: compact result tables whose numbers are never
cut and whose lines fit 120 columns (80 in a terminal of 80), a status that says when a ragged row
is slower than its baseline, skipped rows with their reasons, a summary line whose counts match
the rows, no verdict on the GPU targets, the exit status."""

from __future__ import annotations

import contextlib
import json
import re

import pytest
import torch

pytest.importorskip("rich")
pytest.importorskip("transformers")

from bench import console as C  # noqa: E402
from bench import ddp as D  # noqa: E402
from bench import harness, overhead, report  # noqa: E402
from bench.__main__ import main  # noqa: E402
from bench.harness import SUITES, Case, Impl, Row, Suite, Timing, Workload  # noqa: E402
from bench.suites import hf as H  # noqa: E402

FAST = Timing(warmup_ms=0, rep_ms=0, min_reps=1)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _quick_timing(monkeypatch):
    monkeypatch.setattr(harness.Timing, "default", classmethod(lambda cls, device, quick: FAST))


def _run(tmp_path, monkeypatch, argv, columns):
    """``python -m bench`` with its output captured to a file (not a terminal)."""
    _quick_timing(monkeypatch)
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", str(columns))
    path = tmp_path / "stdout.txt"
    with open(path, "w") as f, contextlib.redirect_stdout(f):
        code = main(argv)
    return code, ANSI.sub("", path.read_text())


@pytest.fixture(scope="module", params=[None, 80], ids=["file", "columns80"])
def hf_run(request, tmp_path_factory):
    """The hf suite's quick CPU cases, as ``python -m bench`` prints them (no dropout: under
    TRITON_INTERPRET=1 its masks come from an interpreted kernel)."""
    tmp = tmp_path_factory.mktemp("hf")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("BENCH_HF_MODEL", raising=False)
        mp.delenv("BENCH_HF_WORKLOADS", raising=False)
        mp.setattr(SUITES["hf"], "dropout", 0.0)
        threads = torch.get_num_threads()
        try:
            code, text = _run(
                tmp, mp, ["--suite", "hf", "--quick", "--no-plots", "--out", str(tmp / "out")], request.param
            )
        finally:
            torch.set_num_threads(threads)
    doc = json.loads((tmp / "out" / "hf.json").read_text())
    rows = [Row(**r) for r in doc["rows"]]
    return request.param, code, text, rows, (tmp / "out" / "hf.md").read_text()


def _numbers(rows) -> set[str]:
    """Every word with a digit of the compact table: case names, medians, speedups."""
    cells = [r.case for r in rows] + [report._fmt_ms(r.median_ms) for r in rows if r.median_ms is not None]
    cells += [f"{min(r.speedup.values()):.2f}x" for r in rows if r.speedup]
    return {word for cell in cells for word in cell.split() if any(ch.isdigit() for ch in word)}


def test_hf_tables_keep_every_number_whole(hf_run):
    columns, code, text, rows, _ = hf_run
    assert code == 0, [(r.impl, r.reason) for r in rows if r.status == "failed"]
    cut = sorted(word for word in _numbers(rows) if word not in text)
    assert cut == [], f"cut across lines: {cut}"
    assert max(len(line) for line in text.splitlines()) <= (columns or C.WIDTH)
    for r in rows:  # a row's name and its time on one line
        if r.status == "ok" and len(r.impl) <= C.MIN_NAME:
            assert any(r.impl in line and report._fmt_ms(r.median_ms) in line for line in text.splitlines()), r.impl


def test_hf_output_is_short_and_true(hf_run):
    """Skipped rows are not table lines (one line per reason names them), the graphed fine-tune row
    is skipped rather than timed, every ragged row's status is its verdict, and the summary line
    counts what the rows hold."""
    columns, _, text, rows, _ = hf_run
    lines = text.splitlines()
    assert len(lines) <= 40 + 2 * len(rows), len(lines)
    graphed = [r for r in rows if r.impl == H.RAG_GRAPHED_TRAIN]
    assert graphed and all(r.status == "skipped" and r.reason == H.GRAPHS_ON_CUDA for r in graphed)
    flat = " ".join(text.split())
    assert re.search(rf"skipped [^:]*`{H.RAG_GRAPHED_TRAIN}`[^:]*: {H.GRAPHS_ON_CUDA}", flat), flat
    for r in rows:
        if r.kind == "ragged" and r.status == "ok" and len(r.impl) <= C.MIN_NAME:
            found = [x for x in lines if x.startswith(f"  {r.impl} ") and report._fmt_ms(r.median_ms) in x]
            assert found and all(x.endswith(report.verdict(r)) for x in found), (r.impl, found)
    summary = " ".join(text[text.index("\nsummary: ") + 1 :].split())
    t = C.tally(rows)
    assert (
        f"{t.faster + t.slower} ragged rows timed against a baseline: {t.faster} faster, {t.slower} slower" in summary
    ), summary
    assert f"{t.failed} failed" in summary and f"{sum(t.skipped.values())} rows skipped" in summary, summary


def test_hf_gives_no_gpu_verdict_on_cpu(hf_run):
    _, _, text, rows, md = hf_run
    assert "MISSED" not in text and "MISSED" not in md
    assert "GPU targets, not evaluated on CPU" in " ".join(text.split())
    speed = {(workload, rag) for workload, targets in H.TARGETS_BY_WORKLOAD.items() for rag, _, _ in targets}
    for r in rows:
        if r.kind == "ragged" and r.status == "ok" and (r.group, r.impl) in speed:
            assert "GPU targets, not evaluated on CPU" in r.extra["targets"], r.extra
            assert " met" not in re.sub(r"cos>=[^;]*: met", "", r.extra["targets"]), r.extra
    assert "issue" not in md.lower() and "GPU targets" in md


class _Broken(Suite):
    """Not registered: a case with a wrong ragged row."""

    name = "broken"
    description = "a ragged row with the wrong output"

    def cases(self, config):
        return [Case("n=4", {"n": 4}, group="n")]

    def build(self, case, config):
        x = torch.arange(4.0)
        return Workload(
            [Impl("baseline", "baseline", lambda: x * 1), Impl("wrong", "ragged", lambda: x + 1)], reference=x, flops=4
        )


def test_a_failed_check_gives_exit_status_1(tmp_path, monkeypatch):
    monkeypatch.setitem(SUITES, "broken", _Broken())
    code, text = _run(tmp_path, monkeypatch, ["--suite", "broken", "--no-plots", "--out", str(tmp_path / "o")], 80)
    assert code == 1 and "failed their correctness check" in text


def test_ddp_targets_are_not_judged_on_cpu():
    def row(world, impl, tokens, spread):
        return {
            "workload": "lm",
            "world": world,
            "impl": impl,
            "status": "ok",
            "tokens_per_s_per_rank": tokens,
            "spread_ms": spread,
            "first_loss": 1.0,
        }

    rows = [
        row(1, D.PADDED, 100.0, 0.0),
        row(1, D.BALANCED, 100.0, 0.0),
        row(2, D.PADDED, 100.0, 3.0),
        row(2, D.BALANCED, 10.0, 3.0),
    ]
    D.derive(rows, on_gpu=False)
    assert rows[3]["targets"] == "GPU targets, not evaluated on CPU"
    D.derive(rows, on_gpu=True)
    assert rows[3]["targets"] == "scaling>=90%: MISSED; spread<=1/3 padded: MISSED"


def test_overhead_on_cpu_gives_no_verdict(tmp_path, capsys, monkeypatch):
    every = overhead.rows  # the budgeted rows and the torch ones, not Triton's (interpreted on CPU: slow)
    monkeypatch.setattr(
        overhead,
        "rows",
        lambda dev: (
            (n, fn) for n, fn in every(dev) if "triton" not in n and (n in overhead.BUDGETS or n.startswith("torch"))
        ),
    )
    out = tmp_path / "overhead.md"
    assert overhead.main(["--device", "cpu", "--calls", "2", "--out", str(out)]) == 0
    md = out.read_text()
    budgeted = [line for line in md.splitlines() if line.startswith("| ") and "GPU target" in line]
    assert budgeted and "MISSED" not in md and "| met |" not in md
    assert md.startswith("# Host time per eager call") and "CPU" in md.splitlines()[2]


def test_speedup_targets_are_judged_on_a_gpu_only():
    from bench.targets import NOT_EVALUATED, speedup_notes

    targets = ((H.RAG_SORTED, H.HF_SORTED, 2.5), (H.RAG_SORTED, H.HF_COMPILED, 1.25), (H.RAG_DATA, H.HF_DATA, 4.0))
    medians = {H.RAG_SORTED: 1.0, H.HF_SORTED: 3.0, H.RAG_DATA: 1.0, H.HF_DATA: 2.0}
    assert speedup_notes(targets, medians, on_gpu=True) == {
        H.RAG_SORTED: [f">=2.5x {H.HF_SORTED}: 3.00x met", f">=1.25x {H.HF_COMPILED}: baseline did not run"],
        H.RAG_DATA: [f">=4x {H.HF_DATA}: 2.00x MISSED"],
    }
    assert speedup_notes(targets, medians, on_gpu=False) == {H.RAG_SORTED: [NOT_EVALUATED], H.RAG_DATA: [NOT_EVALUATED]}


# --------------------------------------------------------------------------------------
# The compact CPU table and the summary, on rows made here (their numbers chosen)

CPU_ENV = {
    "device_name": "Test CPU",
    "device": "cpu",
    "cpu_name": "Test CPU",
    "date": "d",
    "torch": "t",
    "triton": "t",
    "cuda": None,
    "cupy": None,
    "git_commit": None,
}
LONG = "a baseline with a very long name that no terminal column of the compact table can hold whole"


class _Made(Suite):
    """Not registered: a suite whose rows are made by :func:`_made_rows`."""

    name = "made"
    description = "rows with chosen times"
    memory_bound = False


def _row(case, impl, kind, ms=None, status="ok", reason=None, versus=None):
    return Row(
        "made",
        case,
        "g",
        {},
        impl,
        kind,
        status,
        reason=reason,
        median_ms=ms,
        flops=None if ms is None else 10**9,
        tflops=None if ms is None else 1e-3 / ms,
        versus=versus,
    )


def _made_rows():
    """Case 1: a faster and a slower ragged row, a graphed row skipped off CUDA, a failed row and a
    baseline whose name is too long for any column. Case 2 (batch 8 beside batch 256): the ragged
    batch-8 row is compared with the batch-8 baseline only."""
    one = [
        _row("case one B=4", "padded", "baseline", 2.0),
        _row("case one B=4", LONG, "baseline", 1.0),
        _row("case one B=4", "ragged fast", "ragged", 0.5),
        _row("case one B=4", "ragged slow", "ragged", 4.0),
        _row("case one B=4", "ragged graphed", "ragged", status="skipped", reason="CUDA graphs: runs on CUDA"),
        _row("case one B=4", "ragged broken", "ragged", status="failed", reason="wrong output: 3 of 8 differ"),
    ]
    two = [
        _row("case two", "HF, batch 8", "baseline", 1.0),
        _row("case two", "HF, batch 256", "baseline", 0.1),
        _row("case two", "ragged, batch 8", "ragged", 0.8, versus=["HF, batch 8"]),
    ]
    for rows in (one, two):
        harness._add_derived(rows, None, False)
    return one + two


@pytest.mark.parametrize("width", [C.WIDTH, 100, 80])
def test_compact_table_says_slower_and_sums_up(width):
    rows = _made_rows()
    lines = C.compact_lines(_Made(), rows, CPU_ENV, width)
    assert max(map(len, lines)) <= width, max(lines, key=len)

    def line_of(impl):
        (found,) = [x for x in lines if x.startswith(f"  {impl} ")]
        return found

    assert line_of("ragged fast").endswith("faster") and "2.00x" in line_of("ragged fast")
    assert line_of("ragged slow").endswith("slower") and "0.25x" in line_of("ragged slow")
    assert line_of("ragged, batch 8").endswith("faster") and "1.25x HF, batch 8" in line_of("ragged, batch 8")
    assert line_of("padded").endswith("baseline") and not any(x.endswith(" ok") for x in lines)
    assert any(x.startswith("  a baseline with") and C.ELLIPSIS in x for x in lines)  # too long: cut, marked
    assert "ragged graphed" not in " ".join(x for x in lines if x.startswith("  "))  # skipped: not a table line
    skipped = [x for x in lines if x.startswith("skipped ")]
    assert skipped == ["skipped `ragged graphed` (1 of 2 cases): CUDA graphs: runs on CUDA"]
    # footnotes: each [n] of a row has its note, and each note its row
    marks = {m for x in lines if x.startswith("  ") for m in re.findall(r"FAILED \[(\d+)\]", x)}
    notes = {m for x in lines for m in re.findall(r"^\[(\d+)\] ", x)}
    assert marks == notes == {"1"} and any(x.startswith("[1] wrong output: 3 of 8 differ") for x in lines)
    summary = " ".join(" ".join(lines[next(i for i, x in enumerate(lines) if x.startswith("made: ")) :]).split())
    assert summary.startswith(
        "made: 3 ragged rows timed against a baseline: 2 faster, 1 slower than their fastest baseline"
    ), summary
    geomean = (2.0 * 0.25 * 1.25) ** (1 / 3)
    assert f"(geomean speedup {geomean:.2f}x)" in summary and "1 failed" in summary, summary
    assert "1 rows skipped (1 need CUDA)" in summary, summary


def test_wide_table_says_slower_too():
    """The GPU table (and the Markdown file) carry the same status as the compact one."""
    rows = _made_rows()
    cols = report.columns(_Made(), rows)
    status = next(c for c in cols if c.header == "status")
    by_impl = {r.impl: status.cell(r) for r in rows}
    assert by_impl["ragged slow"] == "slower" and by_impl["ragged fast"] == "faster" and by_impl["padded"] == "ok"
    assert by_impl["ragged, batch 8"] == "faster"  # 1.25x its batch-8 baseline, not 0.12x the batch-256 one
    md = report.markdown(_Made(), rows, CPU_ENV, None)
    assert "| slower |" in md and "| faster |" in md


def test_cli_output_on_cpu_fits_and_ends_with_a_summary(tmp_path, monkeypatch):
    """``python -m bench`` on CPU, its output to a file: every line within 120 columns, the skipped
    rows on one line per reason, the last lines a summary naming the results folder."""
    out = tmp_path / "o"
    code, text = _run(
        tmp_path, monkeypatch, ["--suite", "pack", "pool", "--quick", "--no-plots", "--out", str(out)], None
    )
    lines = text.splitlines()
    assert code == 0 and max(map(len, lines)) <= C.WIDTH, max(lines, key=len)
    rows = [Row(**r) for name in ("pack", "pool") for r in json.loads((out / f"{name}.json").read_text())["rows"]]
    summary = " ".join(text[text.index("\nsummary: ") + 1 :].split())
    t = C.tally(rows)
    assert summary.startswith(
        f"summary: {t.faster + t.slower} ragged rows timed against a baseline: {t.faster} faster, {t.slower} slower"
    ), summary
    assert str(out) in summary and f"{sum(t.skipped.values())} rows skipped" in summary
    assert not any(line.rstrip().endswith(" ok") for line in lines)
    assert len(lines) < 30 + len([r for r in rows if r.status != "skipped"]) + len({r.case for r in rows})
