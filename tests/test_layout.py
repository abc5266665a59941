"""The shape of the code (ARCHITECTURE.md), checked from the sources.

* The layers: the table of ARCHITECTURE.md's "Layers" section (top layer first, each row naming its
  paths) is read here, every module of ragged/ and nn/ belongs to one row, and no import, at module
  level or inside a function, runs from a layer to one above it. Imports under ``if TYPE_CHECKING:``
  run nothing and are not read; imports of packages outside the tree are not this file's business.
  What is loaded by name at run time (an implementation's ``"module:function"``, the package's lazy
  ``ragged.nn`` attribute) is no import statement and is not read either.
* No module-level statement rebinds another module's global (an assignment to an attribute of an
  imported module, ``setattr`` on one, a call of a function that rebinds its own module's globals,
  or a module's ``globals()`` handed to another): the lower module never needs the upper one to
  fill it in. Registries filled through their functions (``backends.register_backend``) rebind
  nothing.
* No import cycle among the modules of ragged/ and nn/ (imports inside functions included).
* nn/ uses of ragged only what ARCHITECTURE.md's paragraph "What ``nn/`` may use of ``ragged``"
  names, and no name that starts with an underscore.
* No module of ragged/, nn/ or bench/ grows past the line limit.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARCHITECTURE = (ROOT / "ARCHITECTURE.md").read_text()
MAX_LINES = 1500
FOLDERS = (("ragged", "ragged"), ("nn", "ragged.nn"))  # folder -> the package it is installed as


def _modules() -> dict[str, pathlib.Path]:
    """Module name -> file, with nn/ under its installed name ragged.nn."""
    out = {}
    for folder, prefix in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


def _type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST):
    """Every import statement under ``node``, in functions too, but not under ``if TYPE_CHECKING:``."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    elif _type_checking(node):
        for other in node.orelse:
            yield from _import_nodes(other)
    else:
        for child in ast.iter_child_nodes(node):
            yield from _import_nodes(child)


def _resolve(name: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    return base


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]):
    """``(module imported, names taken, line)`` for every import statement of a module."""
    for node in _import_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, (), node.lineno
        else:
            base = _resolve(name, path, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub, (), node.lineno) if sub in modules else (base, (alias.name,), node.lineno)


def _graph():
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        found = {target for target, _, _ in _imports(name, path, modules)}
        graph[name] = {target for target in found if target in modules and target != name}
    return graph


# --------------------------------------------------------------------------------------
# The layers, as ARCHITECTURE.md's table gives them


def _section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", ARCHITECTURE, re.DOTALL | re.MULTILINE)
    assert match, f"ARCHITECTURE.md has no section {title!r}"
    return match.group(1)


def _layers() -> list[tuple[str, list[str]]]:
    """``(layer, [path, ...])`` from the top layer down: the table of the Layers section, whose
    columns are ``layer``, ``paths`` (each a backticked file, or a folder ending in ``/``) and what
    the layer holds."""
    rows = [line for line in _section("Layers").splitlines() if line.startswith("|")]
    assert rows, "ARCHITECTURE.md's Layers section has no table"
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert header[:2] == ["layer", "paths"], f"the layer table's first columns are layer and paths, got {header}"
    layers = []
    for row in rows[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        paths = re.findall(r"`([^`]+)`", cells[1])
        assert paths and all(re.fullmatch(r"[\w/.]+", p) for p in paths), f"row {cells[0]!r}: paths {cells[1]!r}"
        layers.append((cells[0], paths))
    return layers


def _layer_of(layers, path: pathlib.Path) -> int | None:
    """The index of the row whose longest path holds ``path`` (0: the top layer), or None."""
    rel = path.relative_to(ROOT).as_posix()
    best, found = -1, None
    for i, (_, paths) in enumerate(layers):
        for p in paths:
            holds = rel == p or (p.endswith("/") and rel.startswith(p))
            if holds and len(p) > best:
                best, found = len(p), i
    return found


def test_the_layer_table_names_existing_paths():
    missing = [p for _, paths in _layers() for p in paths if not (ROOT / p).exists()]
    assert missing == [], f"ARCHITECTURE.md's layer table names paths that do not exist: {missing}"


def test_every_module_has_a_layer():
    layers = _layers()
    loose = sorted(str(p.relative_to(ROOT)) for p in _modules().values() if _layer_of(layers, p) is None)
    assert loose == [], f"modules in no row of ARCHITECTURE.md's layer table: {loose}"


def test_no_import_climbs_a_layer():
    layers = _layers()
    modules = _modules()
    climbs = []
    for name, path in sorted(modules.items()):
        mine = _layer_of(layers, path)
        for target, _, line in _imports(name, path, modules):
            if target not in modules or mine is None:
                continue
            theirs = _layer_of(layers, modules[target])
            if theirs is not None and theirs < mine:
                climbs.append(
                    f"{path.relative_to(ROOT)}:{line} ({layers[mine][0]}) imports {target} ({layers[theirs][0]})"
                )
    assert climbs == [], "imports from a layer to one above it:\n" + "\n".join(climbs)


# --------------------------------------------------------------------------------------
# No module-level writes into other modules


def _module_level(body):
    """The statements that run when the module is imported (not those of functions and classes)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield node
        for field in ("body", "orelse", "finalbody"):
            yield from _module_level(getattr(node, field, []) or [])
        for handler in getattr(node, "handlers", []) or []:
            yield from _module_level(handler.body)


def _global_writers(tree: ast.Module) -> set[str]:
    """The module's top-level functions that rebind its globals (a ``global`` statement)."""
    return {
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and any(isinstance(n, ast.Global) for n in ast.walk(node))
    }


def _bound_names(name: str, path: pathlib.Path, tree: ast.Module, modules):
    """Names the module binds at its top level to modules of the tree, and to functions of them:
    ``({local: module}, {local: (module, function)})``."""
    bound, functions = {}, {}
    for node in _module_level(tree.body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, path, node)
            for alias in node.names:
                local = alias.asname or alias.name
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    bound[local] = sub
                elif base in modules:
                    functions[local] = (base, alias.name)
    return {k: v for k, v in bound.items() if v in modules}, functions


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_no_module_level_statement_writes_another_modules_global():
    modules = _modules()
    trees = {name: ast.parse(path.read_text()) for name, path in modules.items()}
    writers = {name: _global_writers(tree) for name, tree in trees.items()}
    found = []
    for name, path in sorted(modules.items()):
        tree = trees[name]
        bound, functions = _bound_names(name, path, tree, modules)
        for node in _module_level(tree.body):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and _root(t) in bound:
                        found.append(f"{where}: assigns {ast.unparse(t)} of {bound[_root(t)]}")
            statement = isinstance(node, (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign))
            for call in [n for n in ast.walk(node) if isinstance(n, ast.Call)] if statement else []:
                fn = call.func
                if isinstance(fn, ast.Name) and fn.id == "setattr" and call.args and _root(call.args[0]) in bound:
                    found.append(f"{where}: setattr on {bound[_root(call.args[0])]}")
                elif isinstance(fn, ast.Name) and fn.id in functions:
                    module, function = functions[fn.id]
                    if function in writers.get(module, ()):
                        found.append(f"{where}: calls {module}.{function}, which rebinds its module's globals")
                elif isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id in bound:
                    if fn.attr in writers.get(bound[fn.value.id], ()):
                        found.append(f"{where}: calls {bound[fn.value.id]}.{fn.attr}, which rebinds its globals")
                if any(isinstance(a, ast.Call) and ast.unparse(a.func) == "globals" for a in call.args):
                    found.append(f"{where}: hands its globals() to {ast.unparse(fn)}")
    assert found == [], "module-level writes into other modules:\n" + "\n".join(found)


# --------------------------------------------------------------------------------------
# Cycles, nn/'s use of ragged, sizes


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


def _nn_may_use() -> tuple[set[str], set[tuple[str, str]]]:
    """What the paragraph "What ``nn/`` may use of ``ragged``" names: whole modules (a module's
    name, or ``import ragged``) and single names of a module (``ragged.interop.read_mask_layout``)."""
    match = re.search(r"^\*\*What `nn/` may use of `ragged`\*\*(.*?)\n\n", ARCHITECTURE, re.DOTALL | re.MULTILINE)
    assert match, "ARCHITECTURE.md has no paragraph 'What `nn/` may use of `ragged`'"
    modules = _modules()
    whole, names = set(), set()
    for token in re.findall(r"`(?:import )?(ragged(?:\.\w+)*)`", match.group(1)):
        if token in modules:
            whole.add(token)
        elif token.rpartition(".")[0] in modules:
            names.add(tuple(token.rsplit(".", 1)))
    return whole, names


def _allowed(target: str, names: tuple, whole: set[str], single: set[tuple[str, str]]) -> bool:
    if target in whole or any(target.startswith(w + ".") for w in whole if w != "ragged"):
        return True
    return bool(names) and all((target, n) in single for n in names)


def test_nn_uses_only_public_names_of_ragged():
    modules = _modules()
    bad = []
    for name, path in modules.items():
        if not name.startswith("ragged.nn"):
            continue
        for target, names, _ in _imports(name, path, modules):
            if target.startswith("ragged.nn") or not target.startswith("ragged"):
                continue
            private = [part for part in target.split(".") if part.startswith("_")]
            private += [n for n in names if n.startswith("_")]
            if private:
                bad.append(f"{path.relative_to(ROOT)}: {target} {names}")
    assert bad == []


def test_nn_uses_only_what_architecture_md_allows():
    whole, single = _nn_may_use()
    assert "ragged" in whole and "ragged.backends" in whole
    modules = _modules()
    bad = []
    for name, path in sorted(modules.items()):
        if not name.startswith("ragged.nn"):
            continue
        for target, names, line in _imports(name, path, modules):
            if target.startswith("ragged.nn") or not (target == "ragged" or target.startswith("ragged.")):
                continue
            if not _allowed(target, names, whole, single):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {target} {list(names)}")
    assert bad == [], "nn/ uses what ARCHITECTURE.md does not let it use:\n" + "\n".join(bad)


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


# --------------------------------------------------------------------------------------
# The checks themselves catch what they are for


def test_the_checks_catch_a_climb_and_a_write(tmp_path):
    """On a toy tree: an import from a lower layer to a higher one, function-local or not, and a
    module-level write into another module are found; a TYPE_CHECKING import is not."""
    src = {
        "low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from high import X\n"
        "def f():\n    import high\n",
        "high.py": "import low\nlow.VALUE = 1\n",
    }
    for file, text in src.items():
        (tmp_path / file).write_text(text)
    modules = {p.stem: p for p in tmp_path.glob("*.py")}
    low = list(_imports("low", modules["low"], modules))
    assert [t for t, _, _ in low if t in modules] == ["high"]  # the function-local one only
    tree = ast.parse(src["high.py"])
    bound, _ = _bound_names("high", modules["high"], tree, modules)
    assigned = [n for n in _module_level(tree.body) if isinstance(n, ast.Assign)]
    assert bound == {"low": "low"} and _root(assigned[0].targets[0]) == "low"


@pytest.mark.parametrize("token", ["ragged.backends", "ragged.interop.read_mask_layout"])
def test_the_nn_paragraph_is_read(token):
    whole, single = _nn_may_use()
    assert token in whole or tuple(token.rsplit(".", 1)) in single
