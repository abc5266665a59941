"""The report of ``python -m bench.ddp``: the rows' names and targets, scaling and speedups
derived from the rows, and the Markdown table."""

from __future__ import annotations

from typing import Any

from bench.targets import NOT_EVALUATED, verdict

PADDED, UNBALANCED, BALANCED, GRAPHED = (
    "HF SDPA padded + DistributedSampler",
    "ragged + DistributedSampler (unbalanced)",
    "ragged + balanced TokenBudgetSampler",
    "ragged graphed + balanced TokenBudgetSampler",
)
ROWS = (PADDED, UNBALANCED, BALANCED, GRAPHED)
GRAPHED_WORKLOADS = ("fine-tune",)  # ragged.nn.graphed takes the converted encoder, not the Llama
SCALING_TARGET, SPREAD_TARGET = 0.9, 1 / 3


def derive(rows: list[dict], on_gpu: bool = True) -> None:
    """Scaling, speedup and spread against the baseline, and the GPU targets (judged on a GPU), in place."""
    ok = {(r["workload"], r["world"], r["impl"]): r for r in rows if r["status"] == "ok"}
    for (work, W, impl), r in ok.items():
        one, base = ok.get((work, 1, impl)), ok.get((work, W, PADDED))
        r["scaling"] = r["tokens_per_s_per_rank"] / one["tokens_per_s_per_rank"] if one else None
        r["speedup"] = r["tokens_per_s_per_rank"] / base["tokens_per_s_per_rank"] if base else None
        r["spread_vs_padded"] = r["spread_ms"] / base["spread_ms"] if base and base["spread_ms"] > 0 and W > 1 else None
        r["loss_diff"] = abs(r["first_loss"] - base["first_loss"]) if base and impl == UNBALANCED else None
        checks = (
            (f"scaling>={SCALING_TARGET:.0%}", r["scaling"], lambda x: x >= SCALING_TARGET),
            ("spread<=1/3 padded", r["spread_vs_padded"], lambda x: x <= SPREAD_TARGET),
        )
        judged = "; ".join(f"{name}: {verdict(test(x))}" for name, x, test in checks if x is not None)
        judge = impl in (BALANCED, GRAPHED) and W > 1 and judged
        r["targets"] = (judged if on_gpu else NOT_EVALUATED) if judge else ""


# --------------------------------------------------------------------------------------
# Report


def _f(x, fmt: str, suffix: str = "") -> str:
    return "" if x is None else format(x, fmt) + suffix


def markdown(rows: list[dict], env: dict, specs: dict[str, Any], args_text: str) -> str:
    from bench import env as envmod

    unit, ranks = ("GPU", "one GPU per rank (NCCL)") if env["device"] == "cuda" else ("rank", "ranks on the CPU (gloo)")
    commit = (env.get("git_commit") or "unknown")[:12] + (" (dirty)" if env.get("git_dirty") else "")
    lines = [
        "# Data-parallel training (DDP): ragged vs HF padded",
        "",
        f"{envmod.device_label(env)}, {ranks}; torch {env['torch']}, transformers {env.get('transformers')}, "
        f"commit {commit}, {env['date']}. `python -m bench.ddp {args_text}`.",
        "",
    ]
    for s in specs.values():
        lines.append(
            f"- {s.name}: {s.describe()}; baseline {s.per_rank} sequences per rank per step, ragged "
            f"budget {s.per_rank} x mean length; {s.warmup} warm-up steps."
        )
    lines += [
        "",
        f"| workload | ranks | implementation | steps | tokens/s per {unit} | seqs/s per {unit} | ms/step | "
        "spread ms | spread/step | load max/mean | scaling vs 1 | vs padded | spread vs padded | loss diff | "
        "targets |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['workload']} | {r['world']} | {r['impl']} | {r['steps']} |"
        if r["status"] != "ok":
            lines.append(f"{head} FAILED: {r['error'][:300].replace('|', '/')} |||||||||||")
            continue
        lines.append(
            f"{head} {r['tokens_per_s_per_rank']:,.0f} | {r['sequences_per_s_per_rank']:,.1f} | {r['step_ms']:.1f} | "
            f"{r['spread_ms']:.2f} | {r['spread_fraction']:.1%} | {r['load_ratio']:.3f} | {_f(r['scaling'], '.1%')} | "
            f"{_f(r['speedup'], '.2f', 'x')} | {_f(r['spread_vs_padded'], '.2f')} | {_f(r['loss_diff'], '.2g')} | "
            f"{r['targets']} |"
        )
    lines += [
        "",
        "tokens/s: real tokens, all ranks, over the slowest rank's wall time of the timed steps, / ranks. "
        "spread: per step, slowest minus fastest rank's own forward + backward (untimed pass under "
        "no_sync), mean over steps. load: per step max/mean over ranks of tokens computed (padded ones "
        "for the baseline), mean over the timed steps. See `bench/ddp.py` for the details.",
    ]
    return "\n".join(lines) + "\n"
