"""What ``python -m bench`` prints: the compact tables of a CPU run and the summary of any run.

A CPU run's table (:func:`compact_lines`) fits a terminal of ``width`` columns (at most
:data:`WIDTH`): the case as a heading line, then one line per measured or failed row (median,
GB/s and % copy or FLOP/s, the speedup over the fastest baseline the row is compared with, and
a status that says ``faster`` / ``slower`` for ragged rows), then the skipped rows grouped by
their reason, and one summary line. Names too long for their column end in ``…``; numbers are
never cut. Every column, skipped row and extra measurement is in the suite's JSON and Markdown
files; a GPU run prints those wide tables (:mod:`bench.tables`) with the same statuses.

:func:`tally` counts a run's rows and :func:`summary_text` says them in one line (wrapped at
``width``): ragged rows faster / slower than their fastest baseline, their geometric-mean
speedup, failures, skipped rows by kind of reason, and where the results were written.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Iterable
from typing import Any

from .harness import Row, Suite
from .report import (
    FASTER,
    NO_BASELINE,
    SLOWER,
    _cases_in_order,
    _fmt_ms,
    description,
    short_device,
    verdict,
)

WIDTH = 120  # the widest line of a CPU run's output
INDENT = "  "
GAP = "  "
ELLIPSIS = "…"
MIN_NAME, MIN_VERSUS = 14, 12  # narrowest name / speedup columns before other columns go


@dataclasses.dataclass
class Tally:
    """Counts of a run's rows: ragged rows by :func:`bench.report.verdict`, failures, skips by
    kind (:func:`skip_kind`) and the speedups over the fastest baseline (for the geomean)."""

    faster: int = 0
    slower: int = 0
    no_baseline: int = 0
    failed: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    ratios: list[float] = dataclasses.field(default_factory=list)

    def add(self, rows: Iterable[Row]) -> Tally:
        for r in rows:
            if r.status == "failed":
                self.failed += 1
            elif r.status == "skipped":
                kind = skip_kind(r.reason or "")
                self.skipped[kind] = self.skipped.get(kind, 0) + 1
            elif (v := verdict(r)) is not None:
                if v == NO_BASELINE:
                    self.no_baseline += 1
                    continue
                self.faster += v == FASTER
                self.slower += v == SLOWER
                self.ratios.append(min(r.speedup.values()))
        return self

    @property
    def geomean(self) -> float | None:
        return math.exp(sum(map(math.log, self.ratios)) / len(self.ratios)) if self.ratios else None


def tally(rows: Iterable[Row]) -> Tally:
    return Tally().add(rows)


_SKIP_KINDS = (  # (words of a reason, lower case; its kind), first match wins
    (("--rows",), "not among --rows"),
    (("interpreter",), "too slow interpreted"),
    (("torch.compile", "compiled"), "torch.compile (CUDA only here)"),
    (("not installed", "needs transformers", "could not load"), "a package missing"),
    (("out of memory",), "out of memory"),
    (("cuda", "gpu"), "need CUDA"),
)


def skip_kind(reason: str) -> str:
    """The kind of a skip reason, for the summary: ``need CUDA``, ``torch.compile (CUDA only here)``,
    ``a package missing``, ... or ``other``."""
    text = reason.lower()
    return next((kind for words, kind in _SKIP_KINDS if any(w in text for w in words)), "other")


def summary_text(t: Tally, out: Any | None = None, label: str = "summary") -> str:
    """One line: ``summary: 23 ragged rows timed: 9 faster, 14 slower than their fastest baseline
    (geomean speedup 0.91x); ...``."""
    timed = t.faster + t.slower
    parts = [
        f"{timed} ragged row{'s' if timed != 1 else ''} timed against a baseline: {t.faster} faster, "
        f"{t.slower} slower than their fastest baseline"
        + (f" (geomean speedup {t.geomean:.2f}x)" if t.geomean is not None else "")
    ]
    if t.no_baseline:
        parts.append(f"{t.no_baseline} timed without a baseline of the same work")
    parts.append(f"{t.failed} failed")
    skipped = sum(t.skipped.values())
    if skipped:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(t.skipped.items(), key=lambda kv: -kv[1]))
        parts.append(f"{skipped} rows skipped ({kinds})")
    else:
        parts.append("none skipped")
    text = f"{label}: " + "; ".join(parts)
    return text + (f"; results in {out}" if out is not None else "")


def wrap(text: str, width: int, indent: str = "", hanging: str = "    ") -> list[str]:
    """``text`` wrapped at ``width`` between words (a word longer than the line is left whole)."""
    return textwrap.wrap(
        text, width, initial_indent=indent, subsequent_indent=hanging, break_long_words=False, break_on_hyphens=False
    ) or [indent]


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + ELLIPSIS


def _metric(suite: Suite, rows: list[Row]) -> list[tuple[str, Any]]:
    """The numeric columns: median ms, then GB/s and % copy (memory-bound suites) or FLOP/s."""
    cols: list[tuple[str, Any]] = [("median ms", lambda r: _fmt_ms(r.median_ms) if r.median_ms is not None else "")]
    if any(r.gbps is not None for r in rows):
        cols.append(("GB/s", lambda r: f"{r.gbps:.1f}" if r.gbps is not None else ""))
    if suite.memory_bound and any(r.pct_of_copy is not None for r in rows):
        cols.append(("% copy", lambda r: f"{r.pct_of_copy:.0f}%" if r.pct_of_copy is not None else ""))
    if not suite.memory_bound and any(r.tflops is not None for r in rows):
        if max(r.tflops for r in rows if r.tflops is not None) < 1:
            cols.append(("GFLOP/s", lambda r: f"{1e3 * r.tflops:.3g}" if r.tflops is not None else ""))
        else:
            cols.append(("TFLOP/s", lambda r: f"{r.tflops:.1f}" if r.tflops is not None else ""))
    return cols


def _versus(r: Row) -> tuple[str, str]:
    """``("0.95x", "index_select")``: the speedup over the fastest baseline compared with."""
    if not r.speedup:
        return "", ""
    name, ratio = min(r.speedup.items(), key=lambda kv: kv[1])
    return f"{ratio:.2f}x", name


def compact_lines(suite: Suite, rows: list[Row], env: dict[str, Any] | None = None, width: int = WIDTH) -> list[str]:
    """The suite's rows as lines of at most ``width`` characters (see the module docstring)."""
    width = min(width, WIDTH)
    where = f" ({short_device(env)})" if env else ""
    lines = wrap(f"{suite.name}{where}: {description(suite, rows)}", width)
    shown = [r for r in rows if r.status != "skipped"]
    failures = list(dict.fromkeys(r.reason or "" for r in shown if r.status == "failed"))
    note = {reason: i for i, reason in enumerate(failures, 1)}

    def status(r: Row) -> str:
        if r.status == "failed":
            return f"FAILED [{note[r.reason or '']}]"
        return verdict(r) or ("baseline" if r.kind == "baseline" else r.kind)

    numeric = _metric(suite, shown)
    cells = [[c(r) for _, c in numeric] for r in shown]
    ratios = [_versus(r) for r in shown]
    widths = [max([len(h), *(len(row[j]) for row in cells)]) for j, (h, _) in enumerate(numeric)]
    ratio_w = max([len(x) for x, _ in ratios] + [0])
    status_w = max([len("status"), *(len(status(r)) for r in shown)])
    name_need = max([len("implementation"), *(len(r.impl) for r in shown)])
    versus_need = max([len("vs fastest baseline")] + [ratio_w + 1 + len(n) for x, n in ratios if x])
    fixed = len(INDENT) + sum(w + len(GAP) for w in widths) + len(GAP) + len(GAP) + status_w
    while widths and fixed + MIN_NAME + MIN_VERSUS > width:  # a very narrow terminal: drop rate columns
        fixed -= widths.pop() + len(GAP)
        numeric.pop()
    room = max(width - fixed, MIN_NAME + MIN_VERSUS)
    name_w = min(name_need, max(MIN_NAME, room - min(versus_need, room // 2)))
    versus_w = max(MIN_VERSUS, min(versus_need, room - name_w))

    def line(name: str, nums: list[str], versus: str, state: str) -> str:
        parts = [INDENT + _fit(name, name_w).ljust(name_w)]
        parts += [n.rjust(w) for n, w in zip(nums, widths)]
        parts += [_fit(versus, versus_w).ljust(versus_w), state]
        return GAP.join(parts).rstrip()

    if shown:
        lines.append(line("implementation", [h for h, _ in numeric], "vs fastest baseline", "status"))
    index = {id(r): i for i, r in enumerate(shown)}
    for case, case_rows in _cases_in_order(shown):
        lines += wrap(case, width)
        for r in case_rows:
            i = index[id(r)]
            ratio, name = ratios[i]
            # the ratio is never cut: only the baseline's name after it
            versus = f"{ratio} {_fit(name, versus_w - len(ratio) - 1)}" if ratio else ""
            lines.append(line(r.impl, cells[i][: len(widths)], versus, status(r)))
    for i, reason in enumerate(failures, 1):
        lines += wrap(f"[{i}] {reason}", width, hanging="    ")
    lines += _skipped_lines(rows, width)
    if any(r.pct_of_copy is not None for r in shown) and suite.memory_bound:
        lines += wrap(
            "% copy: GB/s over that of the case's own `copy (same bytes)` row (on CPU a copy's rate "
            "depends on its size: the caches)"
            if not env or env.get("device") == "cpu"
            else "% copy: GB/s over the device's copy ceiling",
            width,
        )
    for text in suite.console_notes(rows):
        lines += wrap(text, width)
    lines += wrap(summary_text(tally(rows), label=suite.name), width)
    return lines


def _skipped_lines(rows: list[Row], width: int) -> list[str]:
    """``skipped `ragged cuda`, `ragged triton` (every case): <reason>``, one entry per reason."""
    cases = list(dict.fromkeys(r.case for r in rows))
    by_reason: dict[str, dict[str, set[str]]] = {}
    for r in rows:
        if r.status == "skipped":
            by_reason.setdefault(r.reason or "no reason given", {}).setdefault(r.impl, set()).add(r.case)
    lines = []
    for reason, impls in by_reason.items():
        seen = set().union(*impls.values())
        where = "every case" if len(seen) == len(cases) else f"{len(seen)} of {len(cases)} cases"
        lines += wrap(f"skipped {', '.join(f'`{name}`' for name in impls)} ({where}): {reason}", width)
    return lines
