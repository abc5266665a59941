"""Results of a suite: terminal table (rich), JSON, Markdown and PNG plot.

The table and the Markdown file share their columns (:func:`columns`), so both read
the same. File layout of a run folder::

    <out>/<suite>.json   rows + environment + copy ceiling (see ``suite_document``)
    <out>/<suite>.md     the table, with a header naming device, versions and commit
    <out>/<suite>.png    grouped bars of GB/s (or TFLOP/s) per implementation per case
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable

from .harness import Config, CopyCeiling, Row, Suite, dtype_name

SCHEMA_VERSION = 1


# --------------------------------------------------------------------------------------
# Columns shared by the terminal table and the Markdown table


@dataclasses.dataclass(frozen=True)
class Column:
    header: str
    cell: Callable[[Row], str]
    numeric: bool = True


def _fmt_ms(ms: float) -> str:
    return f"{ms:.4f}" if ms < 10 else f"{ms:.2f}"


def _fmt_tflops(tflops: float) -> str:
    """One decimal; three significant digits below 1 (CPU runs)."""
    return f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.3g}"


def _vs_fastest_baseline(row: Row) -> str:
    """Speedup over the fastest baseline of the case (the smallest ratio baseline_ms / ms)."""
    if not row.speedup:
        return ""
    name, ratio = min(row.speedup.items(), key=lambda kv: kv[1])
    return f"{ratio:.2f}x vs {name}"


def _fmt_extra(value: Any) -> str:
    """A cell of an ``extra`` column: numbers to a few digits, anything else as text."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "nan"
    magnitude = abs(value)
    return f"{value:.0f}" if magnitude >= 100 else f"{value:.1f}" if magnitude >= 10 else f"{value:.2f}"


def extra_keys(rows: list[Row]) -> list[str]:
    """The keys of the rows' ``extra`` dicts, in order of first appearance: one column each."""
    return list(dict.fromkeys(key for r in rows for key in r.extra))


def reasons(rows: list[Row]) -> list[str]:
    """The distinct skip / failure reasons of ``rows``, in order: the table's footnotes."""
    return list(dict.fromkeys(r.reason for r in rows if r.status != "ok" and r.reason))


def columns(suite: Suite, rows: list[Row]) -> list[Column]:
    """Columns of the result table; GB/s, % copy and TFLOP/s only where they apply, then
    one column per key of the rows' ``extra`` measurements (:func:`extra_keys`).

    The status cell of a skipped or failed row points to its footnote in :func:`reasons`.
    """
    has = lambda attr: any(getattr(r, attr) is not None for r in rows)  # noqa: E731
    note = {reason: i + 1 for i, reason in enumerate(reasons(rows))}

    def status(r: Row) -> str:
        if r.status == "ok":
            return "ok"
        word = "FAILED" if r.status == "failed" else r.status
        return f"{word} [{note[r.reason]}]" if r.reason in note else word

    cols = [
        Column("implementation", lambda r: r.impl, numeric=False),
        Column("kind", lambda r: r.kind, numeric=False),
        Column("median ms", lambda r: _fmt_ms(r.median_ms) if r.median_ms is not None else ""),
    ]
    if has("gbps"):
        cols.append(Column("GB/s", lambda r: f"{r.gbps:.1f}" if r.gbps is not None else ""))
    if suite.memory_bound and has("pct_of_copy"):
        cols.append(Column("% copy", lambda r: f"{r.pct_of_copy:.0f}%" if r.pct_of_copy is not None else ""))
    if has("tflops"):
        cols.append(Column("TFLOP/s", lambda r: _fmt_tflops(r.tflops) if r.tflops is not None else ""))
    cols.append(Column("vs fastest baseline", _vs_fastest_baseline))
    for key in extra_keys(rows):
        numeric = all(isinstance(r.extra.get(key), (int, float, type(None))) for r in rows)
        cols.append(Column(key, lambda r, k=key: _fmt_extra(r.extra.get(k)), numeric=numeric))
    cols.append(Column("status", status, numeric=False))
    return cols


def speedup_table(rows: list[Row]) -> tuple[list[str], list[tuple[str, str, list[str]]]]:
    """The speedup of each measured ragged row over each baseline of its case.

    Returns the baseline names (the columns, in order of appearance) and one
    ``(case, impl, cells)`` per ragged row that ran; a cell is ``"1.23x"`` or ``""`` where
    that baseline did not run.
    """
    baselines = list(dict.fromkeys(r.impl for r in rows if r.kind == "baseline"))
    table = []
    for case, case_rows in _cases_in_order(rows):
        for r in case_rows:
            if r.kind == "ragged" and r.status == "ok":
                cells = [f"{r.speedup[b]:.2f}x" if b in r.speedup else "" for b in baselines]
                table.append((case, r.impl, cells))
    return baselines, table


def rich_speedup_table(suite: Suite, rows: list[Row]):
    """:func:`speedup_table` as a ``rich.table.Table`` (``None`` when no ragged row ran)."""
    from rich.table import Table

    baselines, body = speedup_table(rows)
    if not body or not baselines:
        return None
    table = Table(title=f"{suite.name}: speedup of the ragged rows over each baseline (baseline ms / ragged ms)")
    table.add_column("case", overflow="fold")
    table.add_column("implementation")
    for b in baselines:
        table.add_column(b, justify="right", overflow="fold")
    previous = None
    for case, impl, cells in body:
        table.add_row(case if case != previous else "", impl, *cells)
        previous = case
    return table


def _cases_in_order(rows: list[Row]) -> list[tuple[str, list[Row]]]:
    order: dict[str, list[Row]] = {}
    for r in rows:
        order.setdefault(r.case, []).append(r)
    return list(order.items())


def ceiling_text(ceiling: CopyCeiling | None) -> str:
    if ceiling is None:
        return "copy ceiling: not measured"
    return (f"copy ceiling: {ceiling.gbps:.1f} GB/s "
            f"({ceiling.bytes / 2**30:.2f} GiB read + written in {_fmt_ms(ceiling.median_ms)} ms)")


# --------------------------------------------------------------------------------------
# Terminal


def rich_table(suite: Suite, rows: list[Row], ceiling: CopyCeiling | None):
    """A ``rich.table.Table``: one section per case, failures in red, skips dimmed."""
    from rich.table import Table

    cols = columns(suite, rows)
    caption = "\n".join([ceiling_text(ceiling), *(f"[{i}] {text}" for i, text in enumerate(reasons(rows), 1))])
    table = Table(title=f"{suite.name}: {suite.description}", caption=caption, caption_justify="left")
    table.add_column("case", overflow="fold")
    for c in cols:
        table.add_column(c.header, justify="right" if c.numeric else "left", overflow="fold")
    for case, case_rows in _cases_in_order(rows):
        for i, r in enumerate(case_rows):
            style = {"failed": "bold red", "skipped": "dim"}.get(r.status, "bold" if r.kind == "ragged" else "")
            table.add_row(case if i == 0 else "", *(c.cell(r) for c in cols), style=style or None)
        table.add_section()
    return table


# --------------------------------------------------------------------------------------
# Files


def suite_document(suite: Suite, rows: list[Row], config: Config, env: dict[str, Any],
                   ceiling: CopyCeiling | None) -> dict[str, Any]:
    """The JSON document of one suite."""
    return {
        "schema": SCHEMA_VERSION,
        "suite": suite.name,
        "description": suite.description,
        "memory_bound": suite.memory_bound,
        "env": env,
        "config": {
            "device": str(config.device),
            "quick": config.quick,
            "dtypes": None if config.dtypes is None else [dtype_name(d) for d in config.dtypes],
            "timing": dataclasses.asdict(config.timer),
        },
        "copy_ceiling": None if ceiling is None else ceiling.to_dict(),
        "rows": [r.to_dict() for r in rows],
    }


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=2) + "\n")


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(suite: Suite, rows: list[Row], env: dict[str, Any], ceiling: CopyCeiling | None) -> str:
    """The results as a Markdown document (header + one table)."""
    cols = columns(suite, rows)
    commit = env.get("git_commit") or "unknown"
    if env.get("git_dirty"):
        commit += " (with uncommitted changes)"
    lines = [
        f"# {suite.name}: {suite.description}",
        "",
        f"- device: {env['device_name']} ({env['device']})",
        f"- date: {env['date']}",
        f"- torch {env['torch']}, triton {env['triton']}, cuda {env['cuda']}, cupy {env['cupy']}",
        f"- commit: {commit}",
        f"- {ceiling_text(ceiling)}",
        "- GB/s: the ideal bytes of the case (read + written) over the median time; "
        "% copy: that over the copy ceiling." if suite.memory_bound else
        "- TFLOP/s: the useful flops of the case (see the notes below) over the median time.",
        "",
        "| case | " + " | ".join(c.header for c in cols) + " |",
        "| --- | " + " | ".join("---:" if c.numeric else "---" for c in cols) + " |",
    ]
    for case, case_rows in _cases_in_order(rows):
        for i, r in enumerate(case_rows):
            cells = [_md_escape(case) if i == 0 else ""]
            for c in cols:
                text = _md_escape(c.cell(r))
                if c.header == "implementation":
                    text = f"`{text}`"
                    if r.kind == "ragged" and r.status == "ok":
                        text = f"**{text}**"
                cells.append(text)
            lines.append("| " + " | ".join(cells) + " |")
    notes = reasons(rows)
    if notes:
        lines += ["", *(f"- [{i}] {_md_escape(text)}" for i, text in enumerate(notes, 1))]
    if suite.speedup_table:
        baselines, body = speedup_table(rows)
        if body and baselines:
            lines += ["", "## Speedup over each baseline", "",
                      "Baseline median ms / ragged median ms, per case (empty: that baseline did not run).", "",
                      "| case | implementation | " + " | ".join(f"`{_md_escape(b)}`" for b in baselines) + " |",
                      "| --- | --- | " + " | ".join("---:" for _ in baselines) + " |"]
            previous = None
            for case, impl, cells in body:
                lines.append(f"| {_md_escape(case) if case != previous else ''} | `{_md_escape(impl)}` | "
                             + " | ".join(cells) + " |")
                previous = case
    if suite.notes:
        lines += ["", suite.notes.strip()]
    return "\n".join(lines) + "\n"


_PALETTE = {
    "ragged": ["#1b4f9c", "#3a7fd5", "#8ab6ef", "#c5dbf7"],
    "baseline": ["#d95f02", "#e6ab02", "#a6761d", "#e7298a", "#66a61e", "#7570b3"],
    "ceiling": ["#8c8c8c", "#bdbdbd"],
}


def plot(path: Path, suite: Suite, rows: list[Row], env: dict[str, Any], ceiling: CopyCeiling | None) -> bool:
    """Grouped bars per case, one panel per group; returns False when nothing was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric, unit = ("gbps", "GB/s") if suite.memory_bound else ("tflops", "TFLOP/s")
    ok = [r for r in rows if r.status == "ok" and getattr(r, metric) is not None]
    if not ok:
        return False
    groups = list(dict.fromkeys(r.group for r in ok))
    widest = max(len({r.case for r in ok if r.group == g}) for g in groups)
    fig, axes = plt.subplots(len(groups), 1, figsize=(max(8.0, 2.2 * widest + 3), 4.2 * len(groups)),
                             squeeze=False)
    labels = {r.case: r.case.removeprefix(r.group).strip() or r.case for r in rows}
    for ax, group in zip(axes[:, 0], groups, strict=True):
        g_rows = [r for r in ok if r.group == group]
        cases = list(dict.fromkeys(r.case for r in g_rows))
        impls = list(dict.fromkeys((r.impl, r.kind) for r in g_rows))
        width = 0.85 / len(impls)
        used = {k: 0 for k in _PALETTE}
        for i, (impl, kind) in enumerate(impls):
            value = {r.case: getattr(r, metric) for r in g_rows if r.impl == impl}
            colors = _PALETTE[kind] if kind in _PALETTE else _PALETTE["ceiling"]
            color = colors[used.get(kind, 0) % len(colors)]
            used[kind] = used.get(kind, 0) + 1
            xs = [c + (i - (len(impls) - 1) / 2) * width for c in range(len(cases))]
            ax.bar(xs, [value.get(c, float("nan")) for c in cases], width, label=impl, color=color,
                   hatch="//" if kind == "ceiling" else None, edgecolor="white", linewidth=0.5)
        if suite.memory_bound and ceiling is not None:
            ax.axhline(ceiling.gbps, color="black", linestyle="--", linewidth=1,
                       label=f"copy ceiling ({ceiling.gbps:.0f} GB/s)")
        ax.set_xticks(range(len(cases)), [labels[c] for c in cases], rotation=12, ha="right", fontsize="small")
        ax.set_ylabel(unit)
        ax.set_title(f"{suite.name}: {group}" if group else suite.name)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="x-small", ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"{env['device_name']}  ·  torch {env['torch']}  ·  {env['date']}", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
