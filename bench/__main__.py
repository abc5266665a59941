"""``python -m bench``: run the benchmark suites and write their results.

    python -m bench [--suite NAME ...] [--list] [--quick] [--out DIR] [--no-plots]
                    [--dtype DTYPE ...] [--device {auto,cpu,cuda}] [--wide] [--rows TEXT ...]

On a CUDA GPU every suite runs its full set of cases; without one, each runs a few CPU
cases sized past the per-call overhead, on one thread (well under a minute in all;
--quick: tiny smoke cases, seconds). Each suite prints a table and writes ``<suite>.json``,
``<suite>.md`` and ``<suite>.png`` to ``--out`` (default ``results/<timestamp>/``). On CPU the
tables are compact (at most ``bench.console.WIDTH`` columns: the measured rows, the skipped ones
grouped by reason; ``--wide``: the full tables); every ragged row's status says whether it was
faster or slower than its fastest baseline, and a summary line ends the run.
The exit status is 1 when any implementation failed its correctness check.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
import time
from pathlib import Path

import torch


def parse_args(argv: list[str] | None, suite_names: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description="Run the benchmark suites and write their results."
    )
    parser.add_argument(
        "--suite",
        nargs="+",
        metavar="NAME",
        choices=suite_names,
        help=f"suites to run (default: all of {', '.join(suite_names)})",
    )
    parser.add_argument("--list", action="store_true", help="list the suites and their cases, run nothing")
    parser.add_argument("--quick", action="store_true", help="fewer cases and shorter timing")
    parser.add_argument("--out", type=Path, metavar="DIR", help="results folder (default: results/<timestamp>)")
    parser.add_argument("--no-plots", action="store_true", help="do not write the PNG plots")
    parser.add_argument(
        "--dtype",
        nargs="+",
        metavar="DTYPE",
        help="only cases of these dtypes (e.g. bf16 fp32); on CPU, the tiny cases in these dtypes",
    )
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="where to run (default: cuda when available)"
    )
    parser.add_argument(
        "--wide",
        action="store_true",
        help="on CPU too, the full tables (every column, skipped rows, the speedup tables) as on a GPU",
    )
    parser.add_argument(
        "--rows",
        nargs="+",
        metavar="TEXT",
        help='only the rows whose names contain one of these texts (e.g. "ST encode" cuDNN); '
        "the others are listed as skipped",
    )
    return parser.parse_args(argv)


def _device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise SystemExit("python -m bench: --device cuda given but torch.cuda.is_available() is False")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _list(console, suites, config) -> None:
    from rich.table import Table

    table = Table(title=f"benchmark suites (cases for {config.device}{', quick' if config.quick else ''})")
    table.add_column("suite")
    table.add_column("description")
    table.add_column("cases")
    for suite in suites:
        cases = suite.cases(config)
        table.add_row(suite.name, suite.describe([c.params for c in cases]), "\n".join(c.name for c in cases))
    console.print(table)


def _run_with_progress(console, suite, config, ceiling, log_rows=True):
    """``run_suite`` under a progress bar over the suite's cases; where the output is not a
    terminal, one line per row when ``log_rows``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .harness import Hooks, run_suite

    cases = suite.cases(config)
    if not log_rows and not console.is_terminal:  # a log: the suite's table follows, failures in it
        return run_suite(suite, config, ceiling, cases)
    columns = (
        TextColumn("[bold]{task.fields[suite]}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    # Refreshed by hand, between measurements: a refresh thread would compete with the
    # timed calls for the interpreter.
    with Progress(*columns, console=console, transient=True, auto_refresh=False) as progress:
        task = progress.add_task("", total=len(cases), suite=suite.name)
        started = time.perf_counter()

        def on_impl(case, impl):
            progress.update(task, description=f"{case.name} · {impl.name}", refresh=True)
            if log_rows and not console.is_terminal:  # a log: one line per row: a run cut short says where
                console.print(
                    f"[{time.perf_counter() - started:7.1f} s] {suite.name} · {case.name} · {impl.name}",
                    highlight=False,
                )

        hooks = Hooks(
            on_impl=on_impl,
            on_case_done=lambda case: progress.update(task, advance=1, refresh=True),
            on_problem=lambda row: progress.console.print(
                f"[bold red]FAILED[/] {row.suite} / {row.case} / {row.impl}: {row.reason}"
            ),
        )
        return run_suite(suite, config, ceiling, cases, hooks)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from . import console as compact
    from . import env as envmod
    from . import report, tables
    from .harness import SUITES, Config, measure_copy_ceiling, parse_dtype

    args = parse_args(argv, list(SUITES))
    try:
        dtypes = None if args.dtype is None else tuple(dict.fromkeys(parse_dtype(d) for d in args.dtype))
    except ValueError as exc:
        raise SystemExit(f"python -m bench: {exc}") from None
    config = Config(
        device=_device(args.device), quick=args.quick, dtypes=dtypes, rows=tuple(args.rows) if args.rows else None
    )
    chosen = [SUITES[name] for name in (args.suite or SUITES)]
    # Piped to a file or a log, rich would wrap the text at 80 columns; the result tables are
    # then printed as wide as their content (bench.tables), in a terminal fitted to its width.
    free = tables.free_width(sys.stdout)
    console = Console(width=160 if free else None)
    if args.list:
        _list(console, chosen, config)
        return 0
    # A CPU run prints compact tables fitted to the terminal (at most compact.WIDTH columns);
    # the full ones, as on a GPU, go to the files (and to the terminal with --wide).
    brief = not config.on_gpu and not args.wide
    width = compact.WIDTH if free else min(console.width, compact.WIDTH)

    def say(text: str, style: str | None = None) -> None:
        for line in compact.wrap(text, width) if brief else [text]:
            console.print(line, style=style, highlight=False, markup=False, soft_wrap=brief)

    # torch.nested logs a one-time notice about fx tracing that would cut through the progress bar.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

    if not config.on_gpu:
        # Tiny CPU cases: one thread. On a small shared machine, parallel regions make
        # medians jump by whole scheduler time slices whenever a core is busy elsewhere.
        torch.set_num_threads(1)
    env = envmod.collect(config.device)
    source = " (BENCH_GIT_COMMIT)" if env["git_commit_source"] == envmod.COMMIT_VARIABLE else ""
    say(
        f"device: {envmod.device_label(env)} ({config.device})  torch {env['torch']}  triton {env['triton']}  "
        f"commit {(env['git_commit'] or 'unknown')[:12]}{source}",
        "bold",
    )
    if not config.on_gpu:
        say(report.cpu_run_note(env) + (f" --quick: {report.QUICK_CPU}" if config.quick else ""), "yellow")
        if env["triton_interpret"] and not config.quick:
            say(
                "TRITON_INTERPRET=1: the Triton rows are skipped outside --quick, but ragged.nn "
                "(encoder suite) may still pick interpreted kernels: slow",
                "yellow",
            )
    ceiling = measure_copy_ceiling(config)
    if not brief:  # a CPU run's tables say what their % copy is over
        say(report.ceiling_text(ceiling))

    out = args.out or Path("results") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    failed, total = 0, compact.Tally()
    for suite in chosen:
        rows = _run_with_progress(console, suite, config, ceiling, log_rows=not brief)
        if brief:
            console.print()
            for line in compact.compact_lines(suite, rows, env, width):
                console.print(line, highlight=False, markup=False, soft_wrap=True)
        else:
            tables.show(console, report.sheet(suite, rows, ceiling, env), free)
            if suite.speedup_table and (speedups := report.speedup_sheet(suite, rows, env)) is not None:
                tables.show(console, speedups, free)
            say(compact.summary_text(compact.tally(rows), label=suite.name))
        failed += sum(r.status == "failed" for r in rows)
        total.add(rows)

        report.write_json(out / f"{suite.name}.json", report.suite_document(suite, rows, config, env, ceiling))
        (out / f"{suite.name}.md").write_text(report.markdown(suite, rows, env, ceiling, config))
        if not args.no_plots:
            report.plot(out / f"{suite.name}.png", suite, rows, env, ceiling)
    console.print()
    say(
        compact.summary_text(
            total, out=f"{out}/ (JSON and Markdown: every column and row)" + ("" if args.no_plots else ", PNG plots")
        ),
        "bold",
    )
    if failed:
        console.print(f"[bold red]{failed} implementation(s) failed their correctness check or raised[/]")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
