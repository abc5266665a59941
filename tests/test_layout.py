"""The shape of the code (ARCHITECTURE.md), checked from the sources: no import cycle among the
modules of ragged/ and nn/ (imports inside functions included), nn/ reaches into ragged only
through public names, and no module of ragged/, nn/ or bench/ grows past 600 lines."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 1500


def _modules() -> dict[str, pathlib.Path]:
    """Module name -> file, with nn/ under its installed name ragged.nn."""
    out = {}
    for folder, prefix in (("ragged", "ragged"), ("nn", "ragged.nn")):
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]):
    """``(module imported, names taken)`` for every import statement of a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub, ()) if sub in modules else (base, (alias.name,))


def _graph():
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        graph[name] = {target for target, _ in _imports(name, path, modules) if target in modules and target != name}
    return graph


def test_no_import_cycles():
    graph = _graph()
    # a package's __init__ that re-exports its modules is not part of a cycle through them
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert cycles == [], f"import cycles: {cycles}"


def test_the_data_type_does_not_import_the_layers_above_it():
    graph = _graph()
    assert not {"ragged.interop", "ragged.logits"} & graph["ragged.tensor"]
    assert "ragged.tensor" not in graph["ragged.packing"]  # the pack op works on plain tensors


def test_nn_uses_only_public_names_of_ragged():
    modules = _modules()
    bad = []
    for name, path in modules.items():
        if not name.startswith("ragged.nn"):
            continue
        for target, names in _imports(name, path, modules):
            if target.startswith("ragged.nn") or not target.startswith("ragged"):
                continue
            private = [part for part in target.split(".") if part.startswith("_")]
            private += [n for n in names if n.startswith("_")]
            if private:
                bad.append(f"{path.relative_to(ROOT)}: {target} {names}")
    assert bad == []


def test_no_module_over_600_lines():
    files = [*_modules().values(), *(ROOT / "bench").rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_tests_and_benchmarks_import_nn_by_its_installed_name():
    """``nn/`` is installed as ``ragged.nn``: importing the folder as ``nn`` (possible from the
    repository root) makes a second copy of every module, whose globals the library never sees."""
    found = []
    for folder in ("tests", "bench", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and not node.level
                    else []
                )
                found += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n == "nn" or n.startswith("nn.")]
    assert not found, f"import ragged.nn, not the folder nn: {found}"
