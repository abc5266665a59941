"""Results of a suite: terminal table (rich), JSON, Markdown and PNG plot.

The table and the Markdown file share their columns (:func:`columns`), so both read
the same. File layout of a run folder::

    <out>/<suite>.json   rows + environment + copy ceiling (see ``suite_document``)
    <out>/<suite>.md     the table, with a header naming device, host CPU, versions and commit
    <out>/<suite>.png    one panel of bars per case (GB/s, or TFLOP/s; GFLOP/s on CPU), the
                         device in the title

Every title says where the run was: the GPU's name, or ``CPU`` and the CPU's model
(:func:`bench.env.device_label`); a CPU run's header says what its rows measure.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .env import device_label
from .harness import Config, CopyCeiling, Row, Suite, dtype_name
from .tables import Sheet, tables

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


FASTER, SLOWER, NO_BASELINE = "faster", "slower", "no baseline"


def verdict(row: Row) -> str | None:
    """A measured ragged row against the fastest baseline it is compared with (``Row.speedup``):
    ``faster`` (or as fast), ``slower``, or ``no baseline`` where none of them ran; ``None`` for
    every other row."""
    if row.kind != "ragged" or row.status != "ok":
        return None
    if not row.speedup:
        return NO_BASELINE
    return FASTER if min(row.speedup.values()) >= 1.0 else SLOWER


def extra_keys(rows: list[Row]) -> list[str]:
    """The keys of the rows' ``extra`` dicts, in order of first appearance: one column each."""
    return list(dict.fromkeys(key for r in rows for key in r.extra))


def reasons(rows: list[Row]) -> list[str]:
    """The distinct skip / failure reasons of ``rows``, in order: the table's footnotes."""
    return list(dict.fromkeys(r.reason for r in rows if r.status != "ok" and r.reason))


def columns(suite: Suite, rows: list[Row]) -> list[Column]:
    """Columns of the result table; GB/s, % copy and TFLOP/s only where they apply, then
    one column per key of the rows' ``extra`` measurements (:func:`extra_keys`).

    The status cell of a skipped or failed row points to its footnote in :func:`reasons`; that
    of a measured ragged row is its :func:`verdict` against its fastest baseline.
    """
    has = lambda attr: any(getattr(r, attr) is not None for r in rows)  # noqa: E731
    note = {reason: i + 1 for i, reason in enumerate(reasons(rows))}

    def status(r: Row) -> str:
        if r.status == "ok":
            return verdict(r) or "ok"
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
    """The speedup of each measured ragged row over each baseline of its case that it is
    compared with (``Row.versus``).

    Returns the baseline names (the columns, in order of appearance) and one
    ``(case, impl, cells)`` per ragged row that ran; a cell is ``"1.23x"`` or ``""`` where
    that baseline did not run or does other work than the row.
    """
    baselines = list(dict.fromkeys(r.impl for r in rows if r.kind == "baseline"))
    table = []
    for case, case_rows in _cases_in_order(rows):
        for r in case_rows:
            if r.kind == "ragged" and r.status == "ok":
                cells = [f"{r.speedup[b]:.2f}x" if b in r.speedup else "" for b in baselines]
                table.append((case, r.impl, cells))
    return baselines, table


def speedup_sheet(suite: Suite, rows: list[Row], env: dict[str, Any] | None = None) -> Sheet | None:
    """:func:`speedup_table` as a :class:`bench.tables.Sheet` (``None`` when no ragged row ran);
    the title names the device when ``env`` is given."""
    baselines, body = speedup_table(rows)
    if not body or not baselines:
        return None
    where = f" ({short_device(env)})" if env else ""
    out = Sheet(
        f"{suite.name}{where}: speedup of the ragged rows over each baseline (baseline ms / ragged ms)",
        ["case", "implementation", *baselines],
        [False, False, *(True for _ in baselines)],
        [],
    )
    previous = None
    for case, impl, cells in body:
        if previous is not None and case != previous:
            out.ends.add(len(out.cells) - 1)
        out.cells.append([case if case != previous else "", impl, *cells])
        previous = case
    return out


def rich_speedup_table(suite: Suite, rows: list[Row], env: dict[str, Any] | None = None):
    """:func:`speedup_sheet` as one ``rich.table.Table`` (``None`` when no ragged row ran)."""
    speedups = speedup_sheet(suite, rows, env)
    return None if speedups is None else tables(speedups, None)[0][0]


def _cases_in_order(rows: list[Row]) -> list[tuple[str, list[Row]]]:
    order: dict[str, list[Row]] = {}
    for r in rows:
        order.setdefault(r.case, []).append(r)
    return list(order.items())


def ceiling_text(ceiling: CopyCeiling | None) -> str:
    if ceiling is None:
        return (
            "copy ceiling: per case, the case's own `copy (same bytes)` row (on CPU a copy's rate "
            "depends on its size: the caches)"
        )
    return (
        f"copy ceiling: {ceiling.gbps:.1f} GB/s "
        f"({ceiling.bytes / 2**30:.2f} GiB read + written in {_fmt_ms(ceiling.median_ms)} ms)"
    )


def description(suite: Suite, rows: list[Row]) -> str:
    """The suite's description for what these rows ran (:meth:`Suite.describe`)."""
    return suite.describe([r.params for r in rows])


def short_device(env: dict[str, Any]) -> str:
    """``NVIDIA H200`` or ``CPU, AMD EPYC 9654``: the device in a title."""
    if env.get("device") == "cpu":
        return f"CPU, {env.get('cpu_name') or env.get('device_name') or 'unknown model'}"
    return env.get("device_name") or str(env.get("device"))


def threads_text(env: dict[str, Any]) -> str:
    """``1 torch thread of 2 logical cores`` (empty where the result does not say)."""
    threads, cores = env.get("torch_threads"), env.get("cpu_count")
    if threads is None:
        return ""
    text = f"{threads} torch thread{'s' if threads != 1 else ''}"
    return text + (f" of {cores} logical cores" if cores else "")


QUICK_CPU = "the test suite's small smoke cases; their times are mostly per-call overhead, not throughput."


def cpu_run_note(env: dict[str, Any]) -> str | None:
    """What a CPU run measures (``None`` for a GPU run)."""
    if env.get("device") != "cpu":
        return None
    threads = threads_text(env)
    return (
        "CPU run: ragged's rows run its pure-torch backends (its CUDA kernels and the GPU-only "
        "baselines need a GPU; its Triton kernels run on CPU only interpreted, "
        "`TRITON_INTERPRET=1`, in the --quick cases). Times are CPU times"
        + (f" ({threads})" if threads else "")
        + ", not those of the GPU kernels."
    )


# --------------------------------------------------------------------------------------
# Terminal


def sheet(suite: Suite, rows: list[Row], ceiling: CopyCeiling | None, env: dict[str, Any] | None = None) -> Sheet:
    """The result table as a :class:`bench.tables.Sheet`: one section per case, failures in
    red, skips dimmed; the title names the device when ``env`` is given."""
    cols = columns(suite, rows)
    lines = [ceiling_text(ceiling)] if suite.memory_bound or ceiling is not None else []
    caption = "\n".join([*lines, *(f"[{i}] {text}" for i, text in enumerate(reasons(rows), 1))])
    where = f" ({short_device(env)})" if env else ""
    out = Sheet(
        f"{suite.name}{where}: {description(suite, rows)}",
        ["case", *(c.header for c in cols)],
        [False, *(c.numeric for c in cols)],
        [],
        caption=caption,
    )
    for case, case_rows in _cases_in_order(rows):
        for i, r in enumerate(case_rows):
            out.cells.append([case if i == 0 else "", *(c.cell(r) for c in cols)])
            out.styles.append(
                {"failed": "bold red", "skipped": "dim"}.get(r.status, "bold" if r.kind == "ragged" else None)
            )
        out.ends.add(len(out.cells) - 1)
    return out


def rich_table(suite: Suite, rows: list[Row], ceiling: CopyCeiling | None, env: dict[str, Any] | None = None):
    """:func:`sheet` as one ``rich.table.Table``, as wide as its content."""
    return tables(sheet(suite, rows, ceiling, env), None)[0][0]


# --------------------------------------------------------------------------------------
# Files


def suite_document(
    suite: Suite, rows: list[Row], config: Config, env: dict[str, Any], ceiling: CopyCeiling | None
) -> dict[str, Any]:
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


def markdown(
    suite: Suite, rows: list[Row], env: dict[str, Any], ceiling: CopyCeiling | None, config: Config | None = None
) -> str:
    """The results as a Markdown document (header + one table); ``config``, when given,
    says in the header whether the run was --quick."""
    cols = columns(suite, rows)
    commit = env.get("git_commit") or "unknown"
    if env.get("git_commit_source") == "BENCH_GIT_COMMIT":
        commit += " (from BENCH_GIT_COMMIT)"
    if env.get("git_dirty"):
        commit += " (with uncommitted changes)"
    host = env.get("cpu_name") or "not recorded"
    threads = threads_text(env)
    if suite.memory_bound:
        metric = "- GB/s: the ideal bytes of the case (read + written) over the median time; % copy: that " + (
            "over the copy ceiling."
            if ceiling is not None
            else "over the GB/s of the case's own `copy (same bytes)` row."
        )
    else:
        metric = "- TFLOP/s: the useful flops of the case (see the notes below) over the median time."
    note = cpu_run_note(env)
    lines = [
        f"# {suite.name} ({short_device(env)}): {description(suite, rows)}",
        "",
        f"- device: {short_device(env)} ({env['device']})",
        f"- host CPU: {host}" + (f"; {threads}" if threads else ""),
        f"- date: {env['date']}",
        f"- torch {env['torch']}, triton {env['triton']}, cuda {env['cuda']}, cupy {env['cupy']}",
        f"- commit: {commit}",
        *([f"- {ceiling_text(ceiling)}"] if suite.memory_bound or ceiling is not None else []),
        metric,
        *([f"- {note}"] if note else []),
        *(
            ["- --quick: " + (QUICK_CPU if env.get("device") == "cpu" else "fewer cases and shorter timing.")]
            if config is not None and config.quick
            else []
        ),
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
            lines += [
                "",
                "## Speedup over each baseline",
                "",
                "Baseline median ms / ragged median ms, per case (empty: that baseline did not run, "
                "or does other work than the row: other batches or inputs).",
                "",
                "| case | implementation | " + " | ".join(f"`{_md_escape(b)}`" for b in baselines) + " |",
                "| --- | --- | " + " | ".join("---:" for _ in baselines) + " |",
            ]
            previous = None
            for case, impl, cells in body:
                lines.append(
                    f"| {_md_escape(case) if case != previous else ''} | `{_md_escape(impl)}` | "
                    + " | ".join(cells)
                    + " |"
                )
                previous = case
    if suite.notes:
        lines += ["", suite.notes.strip()]
    return "\n".join(lines) + "\n"


_PALETTE = {
    "ragged": ["#1b4f9c", "#3a7fd5", "#8ab6ef", "#c5dbf7"],
    "baseline": [
        "#d95f02",
        "#e6ab02",
        "#a6761d",
        "#e7298a",
        "#66a61e",
        "#7570b3",
        "#1b9e77",
        "#e31a1c",
        "#b15928",
        "#6a3d9a",
    ],
    "ceiling": ["#8c8c8c", "#bdbdbd", "#5a5a5a"],
}

PANEL_HEIGHT = 2.9  # inches per row of panels (bars, value labels, a two-line title)
OFF_SCALE = 2.0  # a reference level more than this times the tallest bar is written, not drawn


def _fmt_value(value: float) -> str:
    """A bar's label: three significant digits, never in exponent form above 1."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _reference_levels(case_rows: list[Row]) -> set[int]:
    """Indices of the ``ceiling`` rows of a case that did other work than the case (e.g. the
    encoder's GEMM ceiling, whose flops are its own): levels to compare with, drawn as lines,
    not as bars of the case's work (a plain copy of the case's bytes, or the dense batch of
    the same tokens, stay bars)."""
    work = [(r.flops, r.bytes) for r in case_rows if r.kind != "ceiling"]
    usual = max(set(work), key=work.count) if work else None
    return {
        i for i, r in enumerate(case_rows) if r.kind == "ceiling" and usual is not None and (r.flops, r.bytes) != usual
    }


MAX_COLUMNS = 4  # panels side by side, at most


def _panels(ok: list[Row]) -> list[list[tuple[str, str] | None]]:
    """The grid of (group, case) panels, ``None`` in empty cells: each group's cases in rows
    of at most :data:`MAX_COLUMNS` panels (balanced: 6 cases make two rows of 3); when every
    group has a single case, all panels flow in balanced rows of up to three instead."""
    groups = list(dict.fromkeys(r.group for r in ok))
    cases = {g: list(dict.fromkeys(r.case for r in ok if r.group == g)) for g in groups}
    if max(len(c) for c in cases.values()) == 1:
        chunks = [[(g, cases[g][0]) for g in groups]]
        width = math.ceil(len(groups) / math.ceil(len(groups) / 3))  # 4 panels: 2 x 2
    else:
        width = max(math.ceil(len(c) / math.ceil(len(c) / MAX_COLUMNS)) for c in cases.values())
        chunks = [[(g, c) for c in cases[g]] for g in groups]
    grid = []
    for chunk in chunks:
        for i in range(0, len(chunk), width):
            line = chunk[i : i + width]
            grid.append(line + [None] * (width - len(line)))
    return grid


def plot(path: Path, suite: Suite, rows: list[Row], env: dict[str, Any], ceiling: CopyCeiling | None) -> bool:
    """One panel of bars per case (each on its own scale: the cases of a suite differ by
    orders of magnitude), a row of panels per group; returns False when nothing was measured.

    Each bar is labelled with its value. The device's copy ceiling (memory-bound suites)
    and ceiling rows of other work than the case (e.g. a GEMM) are dashed levels, written
    at the top of the panel instead when they would flatten its bars. The title names the
    suite, the device (GPU, or CPU and its model), versions, commit and date.
    """
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    metric, unit = ("gbps", "GB/s") if suite.memory_bound else ("tflops", "TFLOP/s")
    ok = [r for r in rows if r.status == "ok" and getattr(r, metric) is not None]
    if not ok:
        return False
    scale = 1.0
    if metric == "tflops" and max(r.tflops for r in ok) < 1:  # CPU runs: GFLOP/s reads better
        scale, unit = 1e3, "GFLOP/s"

    def value_of(r: Row) -> float:
        return scale * getattr(r, metric)

    grid = _panels(ok)
    nrows, ncols = len(grid), len(grid[0])

    # One colour per implementation across the whole figure (one legend for every panel).
    by_case = {case: [r for r in ok if r.case == case] for case in dict.fromkeys(r.case for r in ok)}
    levels = {case: _reference_levels(case_rows) for case, case_rows in by_case.items()}
    bar_rows = {
        case: [r for i, r in enumerate(case_rows) if i not in levels[case]] for case, case_rows in by_case.items()
    }
    impls = list(dict.fromkeys((r.impl, r.kind) for case_rows in bar_rows.values() for r in case_rows))
    used: dict[str, int] = {}
    style = {}
    for impl, kind in impls:
        colors = _PALETTE.get(kind, _PALETTE["ceiling"])
        style[impl] = (colors[used.get(kind, 0) % len(colors)], "//" if kind == "ceiling" else None)
        used[kind] = used.get(kind, 0) + 1
    level_names = list(
        dict.fromkeys(
            r.impl for case, case_rows in by_case.items() for i, r in enumerate(case_rows) if i in levels[case]
        )
    )
    level_colors = {name: c for name, c in zip(level_names, ["#4d4d4d", "#7f7f7f", "#a0a0a0"] * 4)}

    widest = max(len(case_rows) for case_rows in bar_rows.values())
    panel_width = max(2.9, 0.36 * widest + 1.1)
    fig_width = max(7.5, ncols * panel_width)
    chars = int(fig_width * 10.5)
    facts = [
        x
        for x in (
            device_label(env),
            f"torch {env.get('torch')}",
            threads_text(env) if env.get("device") == "cpu" else "",
            f"commit {(env.get('git_commit') or 'unknown')[:10]}",
            str(env.get("date", "")),
        )
        if x
    ]
    lines = [textwrap.fill(f"{suite.name}: {description(suite, rows)}", chars), facts[0]]
    for fact in facts[1:]:  # whole facts per line, joined by " · "
        if len(lines[-1]) + 3 + len(fact) <= chars:
            lines[-1] += " · " + fact
        else:
            lines.append(fact)
    title = "\n".join(lines)
    legend_entries = len(impls) + len(level_names) + (1 if suite.memory_bound and ceiling is not None else 0)
    legend_cols = max(1, min(legend_entries, int(fig_width // 2.3)))
    legend_height = 0.22 * math.ceil(legend_entries / legend_cols)
    fig, axes = plt.subplots(
        nrows,
        ncols,
        squeeze=False,
        layout="constrained",
        figsize=(fig_width, nrows * PANEL_HEIGHT + 0.5 + 0.2 * title.count("\n") + legend_height),
    )
    fig.get_layout_engine().set(h_pad=0.08, w_pad=0.06, hspace=0.04, wspace=0.03)
    copy_line = suite.memory_bound and ceiling is not None

    for r_i, panel_row in enumerate(grid):
        for c_i, cell in enumerate(panel_row):
            ax = axes[r_i, c_i]
            if cell is None:
                ax.set_visible(False)
                continue
            group, case = cell
            bars = bar_rows[case]
            values = [value_of(r) for r in bars]
            xs = range(len(bars))
            top = max(values) if values else 0.0
            marks = [(ceiling.gbps, "copy ceiling", "black")] if copy_line else []
            marks += [
                (value_of(r), r.impl, level_colors[r.impl]) for i, r in enumerate(by_case[case]) if i in levels[case]
            ]
            drawn = [m for m in marks if m[0] <= OFF_SCALE * top or top == 0]
            high = max([top, *(m[0] for m in drawn)])
            # Headroom for the vertical value labels above the short bars.
            ylim = max(top * 1.3, high * 1.06) or 1.0
            ax.set_ylim(0, ylim)
            for x, r, v in zip(xs, bars, values):
                color, hatch = style[r.impl]
                ax.bar(x, v, 0.8, color=color, hatch=hatch, edgecolor="white", linewidth=0.5)
                # Tall bars carry their label inside: above them it would cross the levels.
                inside = v > 0.45 * ylim
                ax.annotate(
                    _fmt_value(v),
                    (x, v),
                    xytext=(0, -3 if inside else 2),
                    textcoords="offset points",
                    rotation=90,
                    ha="center",
                    va="top" if inside else "bottom",
                    fontsize=6.5,
                    color="white" if inside else "black",
                    bbox=dict(boxstyle="square,pad=0.1", facecolor=color, edgecolor="none") if inside else None,
                )
            for value, name, color in drawn:
                ax.axhline(value, color=color, linestyle="--", linewidth=1)
            written = [m for m in marks if m not in drawn]
            if written:
                text = "\n".join(f"{name}: {_fmt_value(value)} {unit} (off scale)" for value, name, _ in written)
                ax.text(
                    0.98,
                    0.98,
                    textwrap.fill(text, 38),
                    transform=ax.transAxes,
                    ha="right",
                    va="top",
                    fontsize=6,
                    color="#333333",
                    bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="#bbbbbb", alpha=0.9),
                )
            ax.set_xticks([])
            ax.set_xlim(-0.6, len(bars) - 0.4)
            label = case.removeprefix(group).strip() or case
            heading = textwrap.fill(
                f"{group}: {label}" if group and label != case else label, max(24, int(fig_width / ncols * 11))
            )
            ax.set_title(heading, fontsize=7.5)
            ax.tick_params(axis="y", labelsize=7)
            ax.grid(axis="y", alpha=0.3)
            ax.set_ylabel(unit, fontsize=8)

    handles = [
        Patch(facecolor=style[impl][0], hatch=style[impl][1], edgecolor="white", label=impl) for impl, _ in impls
    ]
    if copy_line:
        handles.append(
            Line2D(
                [],
                [],
                color="black",
                linestyle="--",
                label=f"copy ceiling ({ceiling.gbps:.0f} GB/s, {ceiling.bytes / 2**30:.0f} GiB moved)",
            )
        )
    handles += [Line2D([], [], color=level_colors[name], linestyle="--", label=name) for name in level_names]
    fig.legend(handles=handles, loc="outside lower center", ncol=legend_cols, fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
