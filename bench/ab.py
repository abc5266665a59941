"""``python -m bench.ab``: the benchmark suites of two trees of ragged, run alternately in one call.

A change that must not slow anything down is measured against the tree before it on the same
machine, in the same call, rounds interleaved (base, this, base, this, ...), each run in a
process of its own from an importable copy of its tree (its ``ragged/``, ``nn/`` as
``ragged.nn``, ``csrc/`` and ``bench/``), so each tree runs its own code and its own suites:

    python -m bench.ab prepare REV DIR      # DIR: a copy of the tree at git revision REV (needs git)
    python -m bench.ab run --base DIR --out OUT [--rounds 2] [--suite pack attention ...] [--quick]

``run`` writes each round's suite results under ``OUT/base/rN`` and ``OUT/head/rN``,
the head's ``bench/overhead.py`` run against each tree to ``OUT/overhead_{base,head}_rN.txt`` and
``OUT/overhead.md`` (GPU only), and ``OUT/ab.md``: per ragged row, the median time over the
rounds of each tree and head / base.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("base", "head")
REV_FILE = ".ab_rev"  # the revision a prepared copy holds


def prepare(rev: str, dest: Path) -> None:
    """A copy of the tree at ``rev`` (``git archive``) in ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    short = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    (dest / REV_FILE).write_text(short + "\n")


def package(tree: Path, dest: Path) -> Path:
    """An importable copy of ``tree`` in ``dest``: ``ragged/`` with ``nn/`` as ``ragged/nn`` and
    ``csrc/`` as ``ragged/_csrc`` (the installed layout), and ``bench/`` beside it."""
    if dest.exists():
        shutil.rmtree(dest)
    ignore = shutil.ignore_patterns("__pycache__", "results")
    shutil.copytree(tree / "ragged", dest / "ragged", ignore=ignore)
    shutil.copytree(tree / "nn", dest / "ragged" / "nn", ignore=ignore)
    shutil.copytree(tree / "csrc", dest / "ragged" / "_csrc", ignore=ignore)
    shutil.copytree(tree / "bench", dest / "bench", ignore=ignore)
    return dest


def commit_of(tree: Path) -> str:
    if (tree / REV_FILE).exists():
        return (tree / REV_FILE).read_text().strip()
    found = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if found.returncode == 0 and Path(tree, ".git").exists():
        return found.stdout.strip()
    return os.environ.get("BENCH_GIT_COMMIT", tree.name)


# The child's entry point: ``python -m bench`` with the package copy's ragged. An editable install
# of any tree puts its import finder first on ``sys.meta_path``, ahead of ``PYTHONPATH``: left
# there, it would hand both trees the installed tree's ``ragged`` and only ``bench/`` would differ.
# The bootstrap drops such finders and refuses to run when ragged still comes from elsewhere.
_BOOT = """\
import importlib, os, runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if not str(getattr(f, "__module__", "")).startswith("__editable__")]
sys.path_hooks[:] = [h for h in sys.path_hooks if not str(getattr(h, "__module__", "")).startswith("__editable__")]
sys.path_importer_cache.clear()
pkg = os.path.realpath(sys.argv[1])
for name in ("ragged", "ragged.nn", "bench"):
    where = os.path.realpath(importlib.import_module(name).__file__)
    if not where.startswith(pkg + os.sep):
        raise SystemExit(f"bench.ab: {name} was imported from {where}, not from the copy {pkg}")
sys.argv = ["bench", *sys.argv[2:]]
runpy.run_module("bench", run_name="__main__", alter_sys=True)
"""


def run_tree(pkg: Path, commit: str, args: list[str], log: Path) -> int:
    """``python -m bench ARGS`` from the package copy ``pkg``: its own ragged, ``ragged.nn`` and
    bench, whatever tree is installed (see ``_BOOT``)."""
    env = dict(os.environ, BENCH_GIT_COMMIT=commit, PYTHONPATH=str(pkg))
    with log.open("w") as out:
        return subprocess.run(
            [sys.executable, "-c", _BOOT, str(pkg), *args], cwd=pkg, env=env, stdout=out, stderr=subprocess.STDOUT
        ).returncode


def ragged_rows(folder: Path) -> dict[tuple[str, str, str], float]:
    import json

    rows = {}
    for path in folder.glob("*.json"):
        for row in json.loads(path.read_text()).get("rows", []):
            if row.get("kind") == "ragged" and row.get("status") == "ok" and row.get("median_ms") is not None:
                rows[(row["suite"], row["case"], row["impl"])] = row["median_ms"]
    return rows


def compare(out: Path, rounds: int, commits: dict[str, str]) -> str:
    """``ab.md``: the median over the rounds of each tree, per ragged row, and head / base."""
    times: dict[tuple, dict[str, list[float]]] = {}
    for tree in TREES:
        for r in range(1, rounds + 1):
            for key, ms in ragged_rows(out / tree / f"r{r}").items():
                times.setdefault(key, {}).setdefault(tree, []).append(ms)
    lines = [
        f"# A/B: base {commits['base']} against head {commits['head']}, {rounds} interleaved round(s)",
        "",
        "| suite | case | implementation | base ms | head ms | head / base |",
        "|---|---|---|---|---|---|",
    ]
    ratios = []
    for key in sorted(times):
        got = times[key]
        if set(got) != set(TREES):
            lines.append(f"| {' | '.join(key)} | {_fmt(got.get('base'))} | {_fmt(got.get('head'))} | only in one |")
            continue
        base, head = statistics.median(got["base"]), statistics.median(got["head"])
        ratios.append(head / base)
        lines.append(f"| {' | '.join(key)} | {base:.4f} | {head:.4f} | {head / base:.3f} |")
    if ratios:
        slower = sum(r > 1.03 for r in ratios)
        lines += [
            "",
            f"{len(ratios)} rows; {slower} slower than base by more than 3%; median head / base "
            f"{statistics.median(ratios):.3f}",
        ]
    text = "\n".join(lines) + "\n"
    (out / "ab.md").write_text(text)
    return text


def compare_overhead(out: Path, rounds: int, commits: dict[str, str]) -> str:
    """``overhead.md``: per row of ``bench/overhead.py``, the median over the rounds of each tree."""
    times: dict[str, dict[str, list[float]]] = {}
    order: list[str] = []
    for tree in TREES:
        for r in range(1, rounds + 1):
            path = out / f"overhead_{tree}_r{r}.txt"
            for line in path.read_text().splitlines() if path.exists() else ():
                name, _, rest = line.partition("  ")
                name, rest = name.strip(), rest.strip()
                if rest.endswith("us/call"):
                    if name not in order:
                        order.append(name)
                    times.setdefault(name, {}).setdefault(tree, []).append(float(rest.split()[0]))
    lines = [
        f"# Host time per call (us): base {commits['base']} against head {commits['head']}, {rounds} "
        "interleaved round(s) of bench/overhead.py",
        "",
        "| row | base us | head us | head / base |",
        "|---|---|---|---|",
    ]
    for name in order:
        got = times[name]
        if set(got) != set(TREES):
            lines.append(f"| {name} | {_fmt(got.get('base'))} | {_fmt(got.get('head'))} | only in one |")
            continue
        base, head = statistics.median(got["base"]), statistics.median(got["head"])
        lines.append(f"| {name} | {base:.1f} | {head:.1f} | {head / base:.3f} |")
    return "\n".join(lines) + "\n"


def _fmt(values: list[float] | None) -> str:
    return "" if not values else f"{statistics.median(values):.4f}"


def run(base: Path, out: Path, rounds: int, suite_args: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="ragged_ab_"))
    trees = {"base": base.resolve(), "head": ROOT}
    pkgs = {tree: package(path, scratch / tree) for tree, path in trees.items()}
    commits = {tree: commit_of(path) for tree, path in trees.items()}
    suites, other = _split_suites(suite_args)
    failed = 0
    for r in range(1, rounds + 1):
        for tree in TREES:
            for suite in suites:
                # one process per suite: a suite the other tree lacks is left out of it only
                args = [
                    *(["--suite", suite] if suite else []),
                    *other,
                    "--no-plots",
                    "--out",
                    str(out / tree / f"r{r}"),
                ]
                log = out / f"{tree}_r{r}{'_' + suite if suite else ''}.log"
                code = run_tree(pkgs[tree], commits[tree], args, log)
                failed += code not in (0, 2)  # 2: the tree has no such suite (argparse)
                print(f"round {r} {tree} {suite or 'all suites'}: exit {code}", flush=True)
    import torch

    if torch.cuda.is_available():
        # the head's overhead script against both trees (public API only; rows a tree lacks
        # print n/a), rounds interleaved
        script = ROOT / "bench" / "overhead.py"
        for r in range(1, rounds + 1):
            for tree in TREES:
                env = dict(os.environ, PYTHONPATH=str(pkgs[tree]))
                with (out / f"overhead_{tree}_r{r}.txt").open("w") as log:
                    subprocess.run(
                        [sys.executable, str(script)], cwd=scratch, env=env, stdout=log, stderr=subprocess.STDOUT
                    )
        (out / "overhead.md").write_text(compare_overhead(out, rounds, commits))
    print(compare(out, rounds, commits))
    shutil.rmtree(scratch, ignore_errors=True)
    return 1 if failed else 0


def _split_suites(args: list[str]) -> tuple[list[str | None], list[str]]:
    """``(suites named after --suite, or [None] for all; the other arguments)``."""
    suites, other, taking = [], [], False
    for arg in args:
        if arg == "--suite":
            taking = True
        elif taking and not arg.startswith("-"):
            suites.append(arg)
        else:
            taking = False
            other.append(arg)
    return suites or [None], other


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="copy the tree at a git revision into a folder")
    p.add_argument("rev")
    p.add_argument("dest", type=Path)
    r = sub.add_parser("run", help="run the suites of the base folder and of this tree, interleaved")
    r.add_argument("--base", type=Path, required=True, help="a copy of the base tree (from prepare)")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--rounds", type=int, default=2)
    args, rest = parser.parse_known_args(argv)
    if args.command == "prepare":
        prepare(args.rev, args.dest)
        return 0
    if args.rounds < 1:
        raise SystemExit("python -m bench.ab: expected --rounds >= 1")
    return run(args.base, args.out, args.rounds, rest)


if __name__ == "__main__":
    sys.exit(main())
