"""bench.lm on CPU: the tiny model's rows run, and the rows that compute the same loss on the same
batches (padded, flattened, the fused loss) report the same mean loss."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bench import lm  # noqa: E402


def test_rows_run_and_agree(tmp_path, capsys):
    out = tmp_path / "lm.md"
    assert lm.main(["--steps", "1", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "path" not in line]
    losses = {line.split("|")[1].strip(): line.split("|")[5].strip() for line in rows if "skipped" not in line}
    assert len(losses) == 4, rows
    assert len(set(losses.values())) == 1, losses


def test_lengths_add_up_to_the_budget():
    for step in lm.lengths(4, 4096, 32, 2048):
        assert 4096 <= sum(step) < 4096 + 2048 and all(32 <= n <= 2048 for n in step)
