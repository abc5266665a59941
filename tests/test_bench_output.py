"""What the benchmark tools print and write on CPU: result tables whose cells are never cut
(in a file, and in a terminal of 80 columns), no verdict on the GPU targets, the exit status."""

from __future__ import annotations

import contextlib
import json
import re

import pytest
import torch

pytest.importorskip("rich")
pytest.importorskip("transformers")

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
            code, text = _run(tmp, mp, ["--suite", "hf", "--quick", "--no-plots", "--out", str(tmp / "out")],
                              request.param)
        finally:
            torch.set_num_threads(threads)
    doc = json.loads((tmp / "out" / "hf.json").read_text())
    rows = [Row(**r) for r in doc["rows"]]
    return request.param, code, text, rows, (tmp / "out" / "hf.md").read_text()


def _numbers(suite, rows) -> set[str]:
    """Every word with a digit in the cells of the result and speedup tables."""
    cells = [r.case for r in rows] + [c.cell(r) for c in report.columns(suite, rows) for r in rows]
    cells += [cell for _, _, line in report.speedup_table(rows)[1] for cell in line]
    return {word for cell in cells for word in cell.split() if any(ch.isdigit() for ch in word)}


def test_hf_tables_keep_every_number_whole(hf_run):
    columns, code, text, rows, _ = hf_run
    suite = SUITES["hf"]
    assert code == 0, [(r.impl, r.reason) for r in rows if r.status == "failed"]
    cut = sorted(word for word in _numbers(suite, rows) if word not in text)
    assert cut == [], f"cut across lines: {cut}"
    if columns is not None:
        assert max(len(line) for line in text.splitlines()) <= columns
    else:  # as wide as the content: a row's name and its time on one line
        for r in rows:
            if r.status == "ok" and len(r.impl) <= 40:
                assert any(r.impl in line and report._fmt_ms(r.median_ms) in line for line in text.splitlines()), r.impl


def test_hf_gives_no_gpu_verdict_on_cpu(hf_run):
    _, _, text, rows, md = hf_run
    assert "MISSED" not in text and "MISSED" not in md
    assert "GPU targets, not evaluated on CPU" in text
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
        return Workload([Impl("baseline", "baseline", lambda: x * 1), Impl("wrong", "ragged", lambda: x + 1)],
                        reference=x, flops=4)


def test_a_failed_check_gives_exit_status_1(tmp_path, monkeypatch):
    monkeypatch.setitem(SUITES, "broken", _Broken())
    code, text = _run(tmp_path, monkeypatch, ["--suite", "broken", "--no-plots", "--out", str(tmp_path / "o")], 80)
    assert code == 1 and "failed their correctness check" in text


def test_ddp_targets_are_not_judged_on_cpu():
    def row(world, impl, tokens, spread):
        return {"workload": "lm", "world": world, "impl": impl, "status": "ok", "tokens_per_s_per_rank": tokens,
                "spread_ms": spread, "first_loss": 1.0}

    rows = [row(1, D.PADDED, 100.0, 0.0), row(1, D.BALANCED, 100.0, 0.0), row(2, D.PADDED, 100.0, 3.0),
            row(2, D.BALANCED, 10.0, 3.0)]
    D.derive(rows, on_gpu=False)
    assert rows[3]["targets"] == "GPU targets, not evaluated on CPU"
    D.derive(rows, on_gpu=True)
    assert rows[3]["targets"] == "scaling>=90%: MISSED; spread<=1/3 padded: MISSED"


def test_overhead_on_cpu_gives_no_verdict(tmp_path, capsys, monkeypatch):
    every = overhead.rows  # the budgeted rows and the torch ones, not Triton's (interpreted on CPU: slow)
    monkeypatch.setattr(overhead, "rows", lambda dev: ((n, fn) for n, fn in every(dev) if "triton" not in n
                                                       and (n in overhead.BUDGETS or n.startswith("torch"))))
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
        H.RAG_DATA: [f">=4x {H.HF_DATA}: 2.00x MISSED"]}
    assert speedup_notes(targets, medians, on_gpu=False) == {H.RAG_SORTED: [NOT_EVALUATED],
                                                             H.RAG_DATA: [NOT_EVALUATED]}
