"""What a new user meets first: the distribution's name and metadata, the README's install lines,
and a CI that installs what the README's line installs (no more) before it runs the README's tests.

The distribution is ``ragged-kernels``; the import name stays ``ragged``. The PyPI project named
``ragged`` is an unrelated ragged-array library, so no install line may name ``ragged`` itself.
"""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import shlex
import sys

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DIST = "ragged-kernels"
# The repository's own top-level folders (importable from its root, where the tests run) and the
# tests' helper modules.
LOCAL = {"ragged", "nn", "bench", "examples", "tests", "conftest"} | {p.stem for p in (ROOT / "tests").glob("*.py")}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _readme_test_line() -> tuple[str, str]:
    """(install, run) of the README's test command: the bash line that runs pytest."""
    bash = [
        body for tag, body in re.findall(r"^```(\w*)\n(.*?)^```", README, re.DOTALL | re.MULTILINE) if tag == "bash"
    ]
    lines = [line.strip() for body in bash for line in body.splitlines() if "pytest" in line and " && " in line]
    assert len(lines) == 1, f"README.md should give one install-and-test line, found {lines}"
    install, _, run = lines[0].partition(" && ")
    return install, run


def _shell_statements(script: str) -> list[str]:
    """The script's statements: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", script)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def _pip_install_args(statement: str) -> list[str] | None:
    """The arguments of a ``pip install`` statement (options dropped), or None for other statements."""
    words = shlex.split(statement.replace(";", " ; "))
    for i, word in enumerate(words[:-1]):
        if word in ("pip", "pip3") and words[i + 1] == "install":
            args = []
            for arg in words[i + 2 :]:
                if arg in (";", "&&", "||", ">", ">>"):
                    break
                if arg in ("-q", "-U", "--upgrade", "--quiet"):
                    continue
                args.append(arg)
            return args
    return None


def _installs_before_readme_tests(script: str) -> list[list[str]]:
    statements = _shell_statements(script)
    run = _readme_test_line()[1].replace("python ", "python3 ")
    at = [i for i, s in enumerate(statements) if run in s]
    assert at, f".ci/run does not run the README's test command {run!r}"
    return [args for s in statements[: at[0]] if (args := _pip_install_args(s)) is not None]


def _is_torch_only(args: list[str]) -> bool:
    try:
        return bool(args) and all(_norm(Requirement(a).name) == "torch" for a in args if not a.startswith("-"))
    except ValueError:  # a path or URL, not a requirement
        return False


def _extra_installs(script: str) -> list[list[str]]:
    """Installs before the README's tests other than torch's CPU build and the README's own line."""
    readme = shlex.split(_readme_test_line()[0])[2:]
    return [args for args in _installs_before_readme_tests(script) if args != readme and not _is_torch_only(args)]


# --------------------------------------------------------------------------------------
# CI installs what the README's line installs, in an environment of its own


def test_ci_installs_nothing_before_the_readme_tests_that_the_readme_line_does_not():
    """A CI that installed more than the README's line passed while the README's command failed."""
    assert _extra_installs(CI) == []
    installs = _installs_before_readme_tests(CI)
    assert shlex.split(_readme_test_line()[0])[2:] in installs, ".ci/run does not run the README's install line"


def test_the_ci_check_catches_an_extra_install():
    """The check above flags a package installed before the README's tests, and only that one."""
    install, run = _readme_test_line()
    script = (
        f"python3 -m pip install -q torch==2.13.0\npython3 -m {install}\n"
        f"python3 -m pip install -q -U trl \\\n    rich\n{run.replace('python ', 'python3 ')}\n"
        "python3 -m pip install -q datasets\n"
    )
    assert _extra_installs(script) == [["trl", "rich"]]


def test_ci_runs_in_a_fresh_virtual_environment():
    """Packages already on the machine stay out of the README's tests: CI makes a new environment
    (without the system's site-packages) and enters it before its first install."""
    statements = _shell_statements(CI)
    first_install = next(i for i, s in enumerate(statements) if _pip_install_args(s) is not None)
    venv = [i for i, s in enumerate(statements) if re.search(r"-m venv\b", s)]
    assert venv and venv[0] < first_install, ".ci/run installs before making a virtual environment"
    assert "--system-site-packages" not in statements[venv[0]]
    activate = [i for i, s in enumerate(statements) if re.search(r"(^|\s)(\.|source) \S*bin/activate", s)]
    assert activate and venv[0] < activate[0] < first_install, ".ci/run does not enter its environment"


# --------------------------------------------------------------------------------------
# The tests import only what the README's extras install


def _requirement_closure(dist: str, extras: set[str]) -> set[str]:
    """Normalized names of ``dist`` and everything its requirements (with ``extras``) pull in, as far
    as the installed metadata tells."""
    seen: set[str] = set()
    todo = [(dist, frozenset(extras))]
    done = set()
    while todo:
        name, ex = todo.pop()
        if (_norm(name), ex) in done:
            continue
        done.add((_norm(name), ex))
        seen.add(_norm(name))
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (ex or {""})):
                todo.append((req.name, frozenset(req.extras)))
    return seen


def _skipped_modules(node: ast.AST) -> set[str]:
    """Top-level modules that ``pytest.importorskip`` asks for in ``node``'s own body (not in the
    functions or classes defined there)."""
    out = set()
    todo = list(ast.iter_child_nodes(node))
    while todo:
        call = todo.pop()
        if isinstance(call, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        todo.extend(ast.iter_child_nodes(call))
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "importorskip"
            and call.args
            and isinstance(call.args[0], ast.Constant)
            and isinstance(call.args[0].value, str)
        ):
            out.add(call.args[0].value.split(".")[0])
    return out


def _unguarded_imports(source: str, allowed) -> list[tuple[int, str]]:
    """(line, module) of each import that neither ``allowed(top-level name)`` accepts nor a guard
    covers: a ``try`` that catches ImportError (or Exception), or a ``pytest.importorskip`` of the same
    top-level module earlier in the module or in the enclosing function."""
    tree = ast.parse(source)
    out = []

    def visit(node, skipped, guarded):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            skipped = skipped | _skipped_modules(node)
        if isinstance(node, ast.Try) and any(
            h.type is None or re.search(r"\b(ImportError|ModuleNotFoundError|Exception)\b", ast.unparse(h.type))
            for h in node.handlers
        ):
            for child in node.body:
                visit(child, skipped, True)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, skipped, guarded)
            return
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if not guarded and top not in skipped and not allowed(top):
                out.append((node.lineno, name))
        for child in ast.iter_child_nodes(node):
            visit(child, skipped, guarded)

    module_skips = _skipped_modules(tree)
    for child in tree.body:
        visit(child, module_skips, False)
    return out


def _provided_by_readme_extras():
    install = _readme_test_line()[0]
    extras = set(re.search(r'-e "\.\[([^\]]*)\]"', install).group(1).split(","))
    closure = _requirement_closure(PROJECT["name"], extras)
    by_module = importlib.metadata.packages_distributions()

    def allowed(top: str) -> bool:
        if top in sys.stdlib_module_names or top in LOCAL or top == "__future__":
            return True
        return any(_norm(d) in closure for d in by_module.get(top, ()))

    return allowed


def test_tests_import_only_what_the_readme_extras_install():
    """A test module that imports a package outside the README's extras (pyarrow, datasets, trl,
    pandas, ...) without ``pytest.importorskip`` fails the README's command for a new user."""
    allowed = _provided_by_readme_extras()
    found = {
        f"{path.name}:{line}: {name}"
        for path in sorted((ROOT / "tests").glob("*.py"))
        for line, name in _unguarded_imports(path.read_text(), allowed)
    }
    assert not found, sorted(found)


def test_the_import_check_catches_an_unguarded_import():
    allowed = _provided_by_readme_extras()
    source = (
        "import os\nimport torch\nimport pyarrow.parquet\n"
        "try:\n    import peft\nexcept ImportError:\n    peft = None\n"
        "def test_a():\n    pytest.importorskip('datasets')\n    import datasets\n"
        "def test_b():\n    import datasets\n    from trl import SFTTrainer\n"
    )
    assert _unguarded_imports(source, allowed) == [(3, "pyarrow.parquet"), (12, "datasets"), (13, "trl")]


def test_readme_extras_leave_out_what_the_tests_must_skip_without():
    """The README's extras do not bring pyarrow, datasets or trl (else the check above could not
    tell): each test that needs one skips without it."""
    closure = _requirement_closure(
        PROJECT["name"], set(re.search(r'-e "\.\[([^\]]*)\]"', _readme_test_line()[0]).group(1).split(","))
    )
    assert not closure & {"pyarrow", "datasets", "trl"}, closure & {"pyarrow", "datasets", "trl"}


# --------------------------------------------------------------------------------------
# Name and metadata


def test_distribution_name_is_not_the_unrelated_pypi_project():
    assert _norm(PROJECT["name"]) == DIST
    assert PROJECT["name"] != "ragged"
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert "ragged" in packages and "ragged.nn" in packages  # the import name is kept


def _pip_install_mentions(text: str) -> list[str]:
    """Each ``pip install ...`` in ``text`` up to the end of its code span, line or command."""
    return [m.group(0) for m in re.finditer(r"pip install[^`\n&|;)]*", text)]


def _names_installed(mention: str) -> list[str]:
    """Project names a ``pip install`` mention installs from an index (local paths and options left out)."""
    names = []
    skip_next = False
    for word in shlex.split(mention)[2:]:
        if skip_next:
            skip_next = False
            continue
        if word in ("-e", "--editable"):
            skip_next = True  # the project in a folder: this one
            continue
        if word.startswith(("-", ".", "/", "git+", "http")):
            skip_next = word in ("--index-url", "--extra-index-url", "-r", "-c", "-i")
            continue
        names.append(_norm(Requirement(word).name))
    return names


def test_every_readme_install_line_installs_this_project():
    """``pip install ragged[...]`` installs the unrelated PyPI project ``ragged``: every README line
    names this distribution or installs the checkout."""
    mentions = _pip_install_mentions(README)
    assert mentions
    wrong = [m for m in mentions if "ragged" in _names_installed(m)]
    assert not wrong, wrong
    assert not re.search(r"(?<![\w-])ragged\[", README), "README.md names an extra of the PyPI project `ragged`"
    assert re.search(r"unrelated", README) and "import name" in README, "README.md does not warn of the name clash"


def test_the_install_line_check_catches_the_wrong_project():
    assert _names_installed('pip install "ragged[trl]"') == ["ragged"]
    assert _names_installed("pip install ragged") == ["ragged"]
    assert _names_installed('pip install -e ".[trl]"') == []
    assert _names_installed('pip install "ragged-kernels[cuda]"') == ["ragged-kernels"]


def test_license_file_is_the_apache_license():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]


def test_installed_metadata_names_authors_urls_and_license():
    """The metadata pip shows (``pip show -v``) and an index page reads: read from the installed
    distribution, so a stale install (reinstall with ``pip install -e .``) fails here too."""
    try:
        meta = importlib.metadata.metadata(DIST)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"the distribution {DIST} is not installed (pip install -e . from the checkout)")
    assert meta["Name"] == DIST
    assert meta["Version"] == PROJECT["version"]
    assert meta.get("License-Expression") == "Apache-2.0", meta.get("License-Expression")
    assert "LICENSE" in (meta.get_all("License-File") or [])
    assert meta.get("Author") or meta.get("Author-email")
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert {"Homepage", "Repository", "Issues", "Documentation"} <= set(urls), urls
    assert all(u.startswith("https://") for u in urls.values()), urls
    classifiers = meta.get_all("Classifier") or []
    assert any(c.startswith("Programming Language :: Python :: 3") for c in classifiers), classifiers
