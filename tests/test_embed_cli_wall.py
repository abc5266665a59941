"""The whole run of ``python -m ragged.embed`` (a fresh process, CPU): its report gives the run
from the process's start (the imports before the command's first line included), phases that add
up to it, and a wall time close to what the parent measures; ``bench/embed_wall.py`` runs end to
end at a tiny size and writes its JSON and Markdown."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")

from test_embed_cli import TEXTS, _write, make_model

ROOT = Path(__file__).resolve().parents[1]
TIME = re.compile(
    r"time: imports ([\d.]+) s, input ([\d.]+) s, model ([\d.]+) s, embedding ([\d.]+) s "
    r"\((\d+) CUDA graphs? captured\), output ([\d.]+) s, other (-?[\d.]+) s"
)
LAST = re.compile(
    r"embedded (\d+) texts \((\d+) tokens\) in ([\d.]+) s: [\d.]+ texts/s, [\d.]+ tokens/s; "
    r"whole run ([\d.]+) s: ([\d.]+) texts/s"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model(tmp_path_factory)


def test_whole_run_reported(model_dir, tmp_path):
    corpus = _write(tmp_path / "corpus.txt", TEXTS)
    cmd = [
        sys.executable,
        "-m",
        "ragged.embed",
        model_dir,
        str(corpus),
        str(tmp_path / "e.npy"),
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--no-progress",
    ]
    begin = time.perf_counter()
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"), check=False
    )
    wall = time.perf_counter() - begin
    assert done.returncode == 0, done.stderr
    assert "Loading weights" not in done.stderr
    lines = done.stdout.strip().splitlines()
    phases, last = TIME.fullmatch(lines[-2]), LAST.fullmatch(lines[-1])
    assert phases and last, lines
    values = [float(v) for i, v in enumerate(phases.groups()) if i != 4]
    whole = float(last.group(4))
    assert int(phases.group(5)) == 0 and int(last.group(1)) == len(TEXTS)
    assert abs(sum(values) - whole) <= 0.01 * len(values)  # the phases are the whole run
    assert float(last.group(3)) <= whole <= wall
    # from the process's start: python's start and `import ragged` (torch) are in it; what the
    # parent sees past it is the process's start and exit alone
    assert values[0] > 0.2 * whole and wall - whole < max(1.5, 0.25 * wall), (wall, whole, lines)
    assert abs(float(last.group(5)) - len(TEXTS) / whole) <= 0.06 + 1e-3 * len(TEXTS) / whole


def test_bench_embed_wall_tiny(tmp_path):
    prefix = tmp_path / "wall"
    cmd = [
        sys.executable,
        "-m",
        "bench.embed_wall",
        "--device",
        "cpu",
        "--tiny",
        "--texts",
        "12,30",
        "--repeats",
        "1",
        "--out",
        str(prefix),
    ]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=False,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(Path(f"{prefix}.json").read_text())
    assert result["env"]["cpu_name"] and result["env"]["device"] == "cpu"
    assert [(r["n"], r["run"]) for r in result["runs"]] == [(12, "cold"), (30, "cold")]
    for row in result["runs"]:
        assert row["texts"] == row["n"] and 0 < row["whole_run_s"] <= row["wall_s"]
        assert row["embedding_s"] <= row["whole_run_s"]
    assert result["encode"]["encode_texts_per_s"] > 0 and result["encode"]["embed_texts_per_s"] > 0
    assert [t["met"] for t in result["targets"]] == [
        t["value"] <= 8.0 if i == 0 else t["value"] >= 0.5 for i, t in enumerate(result["targets"])
    ]
    md = Path(f"{prefix}.md").read_text()
    assert result["env"]["cpu_name"] in md and "| 30 | cold |" in md
