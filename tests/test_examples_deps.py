"""Examples run for real in a subprocess: what ``examples/sft_with_trl.py`` does when a module it
needs is missing (a non-zero exit naming the module and the install line), and that
``examples/train_with_trainer.py`` prints a training loss comparable to its eval loss under
gradient accumulation."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example(script: str, args: list[str], missing: str | None = None, timeout: int = 240):
    """``python examples/<script> args`` from the project root, with ``import <missing>`` failing
    (``sys.modules[missing] = None`` makes every import of it raise ImportError)."""
    code = (
        "import runpy, sys\n"
        + (f"sys.modules[{missing!r}] = None\n" if missing else "")
        + f"sys.argv = [{script!r}, *{args!r}]\n"
        + f"runpy.run_path({str(ROOT / 'examples' / script)!r}, run_name='__main__')\n"
    )
    # As a user runs it on a CPU: without the Triton interpreter the test session sets.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.parametrize("missing", ["datasets", "trl"])
def test_sft_example_names_the_missing_module_and_fails(missing):
    # the other module must import, or the example rightly names that one (CI's first stage has
    # neither; its trl stage runs this again)
    if missing == "datasets":
        pytest.importorskip("trl")
    else:
        pytest.importorskip("datasets")
    done = _example("sft_with_trl.py", ["--cpu", "--steps", "1"], missing=missing, timeout=120)
    text = done.stdout + done.stderr
    assert done.returncode != 0, text
    assert f"'{missing}'" in text, text
    assert 'pip install -e ".[trl]"' in text, text
    assert "Traceback" not in text, text
    other = {"datasets": "trl", "trl": "datasets"}[missing]
    assert f"'{other}'" not in text, text  # the module that did import is not blamed


def test_trainer_example_logs_a_training_loss_comparable_to_eval():
    """At --grad-accum 2, transformers' default logs the sum of the two accumulated batches' mean
    losses for this model (twice the eval loss at the start); the example's printed training loss
    must be on the eval loss's scale: near it at the start, where both are near ln 2."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    done = _example(
        "train_with_trainer.py",
        ["--cpu", "--epochs", "1", "--examples", "160", "--max-tokens", "128", "--grad-accum", "2"],
    )
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-4000:]
    losses = [float(x) for x in re.findall(r"^step +\d+ .*training loss (\d+\.\d+)", done.stdout, re.MULTILINE)]
    before = re.search(r"^eval loss (\d+\.\d+) ->", done.stdout, re.MULTILINE)
    assert losses and before, done.stdout
    first, eval_before = losses[0], float(before.group(1))
    assert 0.75 < first / eval_before < 1.33, (first, eval_before, done.stdout)
    final = re.search(r"final training loss (\d+\.\d+)", done.stdout)
    assert final and 0.5 < float(final.group(1)) / eval_before < 1.33, done.stdout
    assert "accumulat" in done.stdout  # the printed reason
