"""bench.racecheck_probe without a GPU: its command line, the check of its partitions' reports, the
probe kernels compiled for sm_90 (as ``tests/test_kernel_resources.py`` compiles attention_ws, in a
process without ``TRITON_INTERPRET``) and bench/racecheck.sh's summary over a stand-in sanitizer."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*args, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "bench.racecheck_probe", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_help_runs():
    run = _run("--help")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--variant" in run.stdout and "racecheck" in run.stdout


def test_reports_check_reads_every_partition():
    from bench import racecheck_probe as probe

    n = torch.arange(probe.PROGRAMS, dtype=torch.int32)
    scalars = torch.stack([n + 1, 10 * n + 2, 100 * n + 3, torch.full_like(n, 128)], 1)
    sums = (111 * n + 6)[:, None].expand(-1, 3)
    good = torch.stack([torch.arange(3, dtype=torch.int32).expand(probe.PROGRAMS, 3), sums], 2)
    assert probe._reports_ok(good.clone(), scalars)
    for part in range(3):  # one partition's sum off by one, in the last program
        bad = good.clone()
        bad[-1, part, 1] += 1
        assert not probe._reports_ok(bad, scalars), part


@pytest.mark.slow
def test_probe_kernels_compile_for_sm90():
    """The hand-over alone (no TMA) and with the descriptor: registers moved to the workers by
    setmaxnreg, no spills, the named barriers of the hand-over; the descriptor kernel's two TMA
    loads and its mbarrier."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = _run("--compile", "90", env=env, timeout=600)
    if run.returncode and "Gluon Hopper language cannot be imported" in run.stderr:
        pytest.skip("this Triton has no Gluon for Hopper")
    if (
        run.returncode
        and "No such file or directory" in run.stderr
        and ("ptxas" in run.stderr or "cuobjdump" in run.stderr)
    ):
        pytest.skip("this Triton build has no NVIDIA tools (ptxas, cuobjdump)")
    assert run.returncode == 0, run.stderr[-3000:]
    records = {r["kernel"]: r for r in (json.loads(line) for line in run.stdout.splitlines() if line.startswith("{"))}
    assert set(records) == {"handover", "descriptor"}
    for name, r in records.items():
        assert r["USETMAXREG"] > 0, f"{name}: no register reallocation between the partitions"
        assert r["stack"] == 0 and r["LDL"] == 0, f"{name}: spills"
        assert r["BAR_SYNC"] > 0, f"{name}: no named barrier (the hand-over)"
    assert records["handover"]["UTMALDG"] == 0 and records["handover"]["SYNCS"] == 0
    assert records["descriptor"]["UTMALDG"] == 2 and records["descriptor"]["SYNCS"] > 0


_FAKE_SANITIZER = """#!/usr/bin/env bash
if [ "$1" = --version ]; then echo "Stand-in Sanitizer"; echo "Version 0.0"; exit 0; fi
variant=${@: -1}
echo "========= COMPUTE-SANITIZER"
if [ "$variant" = descriptor ]; then
    echo "========= Error: Race reported between Read access at k+0x110 in probe.py:1"
    echo "=========     and Write access at k+0xe750 in probe.py:2 [3 hazards]"
    echo "========= RACECHECK SUMMARY: 1 hazard displayed (3 errors, 1 warning)"
    echo "$variant: tiles match"
elif [ "$variant" = attention ]; then
    echo "crashed" >&2
    exit 3
else
    echo "$variant: ids match"
    echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
fi
"""


def test_racecheck_script_summarises_each_variant(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    fake = tmp_path / "sanitizer"
    fake.write_text(_FAKE_SANITIZER)
    fake.chmod(0o755)
    summary = tmp_path / "out" / "racecheck.txt"
    env = dict(os.environ, COMPUTE_SANITIZER=str(fake))
    run = subprocess.run(
        ["bash", str(ROOT / "bench" / "racecheck.sh"), str(summary)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 1, run.stderr  # the attention variant's exit status 3
    lines = summary.read_text().splitlines()
    assert lines[0].startswith("# racecheck") and "Version 0.0" in lines[0]
    handover, descriptor, attention = lines[1:]
    assert handover.startswith("handover: errors 0, warnings 0") and handover.endswith("exit 0")
    assert "probe: handover: ids match" in handover and "sites: none" in handover
    assert descriptor.startswith("descriptor: errors 3, warnings 1")
    assert "Read@k+0x110 x1" in descriptor and "Write@k+0xe750 x1" in descriptor
    assert attention.startswith("attention: no racecheck summary") and attention.endswith("exit 3")
    for variant in ("handover", "descriptor", "attention"):
        assert (tmp_path / "out" / f"racecheck_{variant}.log").exists()
