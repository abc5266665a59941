"""``python -m bench.ddp`` on the CPU: 1 and 2 ranks over gloo, tiny models in float32."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("transformers")

from torch.utils.data import DistributedSampler  # noqa: E402

from bench import ddp as D  # noqa: E402
from bench.suites.hf import Lengths  # noqa: E402
from ragged.data import TokenBudgetSampler  # noqa: E402

WORKLOADS, WORLDS = ("fine-tune", "lm"), (1, 2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "ddp.md"
    code = D.main(["--device", "cpu", "--gpus", "1", "2", "--quick", "--out", str(out)])
    return code, out.read_text(), json.loads(out.with_suffix(".json").read_text())


def test_every_row_ran_and_reports_its_columns(run):
    code, md, doc = run
    rows = doc["rows"]
    assert code == 0, [r.get("error") for r in rows]
    assert [(r["workload"], r["world"], r["impl"]) for r in rows] == [
        (w, n, i) for w in WORKLOADS for n in WORLDS for i in D.ROWS if i != D.GRAPHED or w in D.GRAPHED_WORKLOADS
    ]
    for r in rows:
        assert r["status"] == "ok" and r["steps"] >= 1
        for key in ("tokens_per_s_per_rank", "sequences_per_s_per_rank", "step_ms", "local_ms"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert math.isfinite(r["spread_ms"]) and r["spread_ms"] >= 0 and r["spread_fraction"] >= 0
        assert len(r["ranks"]) == r["world"] and all(len(k["local_s"]) == r["steps"] for k in r["ranks"])
        if r["world"] == 1:
            assert r["spread_ms"] == 0 and r["load_ratio"] == 1 and r["scaling"] == pytest.approx(1)
        assert r["load_ratio"] >= 1 and r["speedup"] > 0 and math.isfinite(r["first_loss"])
        assert (r["targets"] != "") == (r["impl"] in (D.BALANCED, D.GRAPHED) and r["world"] == 2)
    by = {(r["workload"], r["world"], r["impl"]): r for r in rows}
    for w in WORKLOADS:
        # the balanced sampler evens the ranks' loads out; padding makes the baseline's uneven
        assert by[(w, 2, D.BALANCED)]["load_ratio"] < by[(w, 2, D.PADDED)]["load_ratio"]
        # the same batches, the same float32 weights: the same loss at initialisation
        assert by[(w, 1, D.UNBALANCED)]["loss_diff"] < 1e-4 and by[(w, 2, D.UNBALANCED)]["loss_diff"] < 1e-4
        assert by[(w, 2, D.PADDED)]["computed_tokens"] > by[(w, 2, D.PADDED)]["tokens"]
    for column in ("tokens/s per rank", "spread ms", "spread/step", "load max/mean", "scaling vs 1", "vs padded"):
        assert f" {column} |" in md
    table = [line for line in md.splitlines() if line.startswith(("| fine-tune", "| lm"))]
    assert len(table) == len(rows) and all(line.count("|") == 16 for line in table)
    assert "FAILED" not in md and doc["env"]["device"] == "cpu"


def _expected_tokens(doc, row) -> list[int]:
    """Real tokens of each rank's timed batches, from the samplers built here."""
    w = doc["workloads"][row["workload"]]
    lengths = np.asarray(Lengths(**w["lengths"]).draw(w["sequences"], 0))
    per_rank = w["per_rank"]
    assert w["budget"] == round(per_rank * lengths.mean())
    out = []
    for rank in range(row["world"]):
        if row["impl"] in (D.BALANCED, D.GRAPHED):
            batches = list(
                TokenBudgetSampler(
                    lengths.tolist(), w["budget"], shuffle=True, seed=0, num_replicas=row["world"], rank=rank
                )
            )
        else:
            order = list(
                DistributedSampler(range(len(lengths)), num_replicas=row["world"], rank=rank, shuffle=True, seed=0)
            )
            batches = [order[i : i + per_rank] for i in range(0, len(order) - per_rank + 1, per_rank)]
        timed = batches[w["warmup"] : w["warmup"] + row["steps"]]
        assert len(timed) == row["steps"]
        out.append(int(sum(lengths[b].sum() for b in timed)))
    return out


def test_rows_fed_exactly_the_samplers_tokens(run):
    _, _, doc = run
    for row in doc["rows"]:
        expected = _expected_tokens(doc, row)
        assert [k["tokens"] for k in row["ranks"]] == expected, row["impl"]
        assert row["tokens"] == sum(expected)
        if row["impl"] != D.PADDED:
            assert row["computed_tokens"] == row["tokens"]


def test_a_failing_row_is_reported_and_nothing_hangs():
    spec = D.workloads(False, True)["fine-tune"]
    too_long = D.Job(spec, D.BALANCED, 2, 32, 10**6)
    after = D.Job(spec, D.PADDED, 2, 32, 1)
    failed, skipped = D.run_group([too_long, after], 2, "cpu", timeout_s=120, grace_s=5)
    assert "RuntimeError" in failed["error"] and "needed" in failed["error"] and "rank 0" in failed["error"]
    assert "not run" in skipped["error"]
    row = D.summarize(too_long, failed)
    assert row["status"] == "failed" and "needed" in row["error"]
    with pytest.raises(SystemExit):
        D.main(["--device", "cpu", "--steps", "0"])
