"""``import ragged`` stays light: no torch._dynamo, no triton until a kernel needs them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ragged.utils import assume_constant_result

_PROBE = """
import json, sys, time
import pytest
import torch
start = time.perf_counter()
import ragged
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "heavy": [m for m in ("torch._dynamo", "triton", "sympy")
                                                 if m in sys.modules]}))
"""


def _probe() -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "", "PYTHONPATH": ":".join(p for p in sys.path if p)},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_ragged_pulls_in_no_compiler_or_kernel_toolchain():
    result = _probe()
    assert result["heavy"] == [], f"import ragged imported {result['heavy']}"
    # Measured 0.2 s beyond torch on a loaded 2-core machine (2.6 s before dynamo was deferred);
    # the bound leaves room for slow CI machines while still catching a dynamo import.
    assert result["seconds"] < 1.0, f"import ragged took {result['seconds']:.2f} s beyond torch"


def test_constant_mark_is_the_one_torch_sets():
    def ours():
        return 0

    def torchs():
        return 0

    assume_constant_result(ours)
    before = set(vars(torchs))
    torch.compiler.assume_constant_result(torchs)
    marks = set(vars(torchs)) - before
    assert marks and marks <= set(vars(ours)), f"torch marks {marks}, ragged sets {set(vars(ours))}"
    for name in marks:
        assert getattr(ours, name) == getattr(torchs, name)


_WITHOUT_TRITON = """
import importlib.abc, json, sys
class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, _NoTriton())
import torch, ragged
q = ragged.pack([torch.randn(n, 2, 8) for n in (3, 0, 5)])
out = ragged.attention(q, q, q, causal=True)
pooled = ragged.pool(out, "mean")
reasons = ragged.explain(ragged.pool, out, "mean")
print(json.dumps({"shape": list(pooled.shape), "triton": str(reasons.get("triton"))}))
"""


def test_cpu_install_runs_without_triton():
    """Triton is not a dependency on CPU: every op runs its reference, and the triton backend says why."""
    env = {"PATH": "", "PYTHONPATH": ":".join(p for p in sys.path if p), "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["shape"] == [3, 2, 8]
    assert "triton cannot be imported" in result["triton"], result


def test_installed_package_wins_over_a_folder_named_ragged(tmp_path):
    """A script beside the clone (the clone's parent folder first on sys.path) imports the installed
    package, not the clone folder as an empty namespace package."""
    import importlib.metadata

    # The distribution is ragged-kernels (the import name is ragged). A build can leave an egg-info
    # in the checkout, which a run from the checkout also finds: it has no direct_url.json.
    urls = [
        d.read_text("direct_url.json")
        for d in importlib.metadata.distributions()
        if d.metadata["Name"] == "ragged-kernels"
    ]
    if not any(json.loads(u).get("dir_info", {}).get("editable") for u in urls if u):
        pytest.skip("ragged is not installed in editable mode")
    (tmp_path / "ragged" / "nn").mkdir(parents=True)  # a clone: folders without __init__.py
    script = tmp_path / "script.py"
    script.write_text("import ragged, ragged.nn\nprint(ragged.pack.__module__, ragged.nn.convert.__module__)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env={"PATH": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ragged.interop", "ragged.nn.convert"], out.stdout


def test_triton_is_installed_only_where_it_runs_kernels():
    """A CPU install does not pull Triton (CUDA torch brings its own); the test extra does, for the
    interpreter."""
    import pathlib
    import re

    import tomllib

    project = tomllib.loads((pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    name = lambda req: re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip().lower()  # noqa: E731
    assert "triton" not in {name(r) for r in project["dependencies"]}
    assert "triton" in {name(r) for r in project["optional-dependencies"]["test"]}
