"""Shared test setup.

Without a GPU, Triton kernels run on CPU tensors through the interpreter: the
environment variable must be set before triton is first imported, hence here.
GPU tests carry ``@pytest.mark.gpu`` and are skipped when CUDA is not available.

Hypothesis runs under a settings profile: ``"ci"`` (derandomized: the same examples on
every run, so a CI failure reproduces; failing examples printed with their blob) when the
environment variable ``CI`` is set or ``HYPOTHESIS_PROFILE=ci``, else the profile named by
``HYPOTHESIS_PROFILE``, else ``"dev"`` (random examples, the example database on; also
when ``CI`` is ``0``/``false``/``no``, where hypothesis alone would pick its own "ci"). Tests
set only ``max_examples`` (and what their examples need), never ``derandomize``: that
is the profile's to decide.
"""

import os
import pathlib
import sys

import pytest
import torch
from hypothesis import settings
from hypothesis.errors import InvalidArgument

# bench/ is not installed (it runs from the repository root): make it importable here.
_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ragged  # noqa: E402  (after TRITON_INTERPRET is set)

TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET", "0") == "1"

# deadline=None in both: the Triton interpreter makes one example take seconds. "ci" builds
# on hypothesis' own "ci" profile where it has one (it also quiets the too_slow check).
try:
    _HYPOTHESIS_CI = settings.get_profile("ci")
except InvalidArgument:
    _HYPOTHESIS_CI = None
settings.register_profile("ci", _HYPOTHESIS_CI, derandomize=True, database=None, print_blob=True, deadline=None)
settings.register_profile("dev", settings.get_profile("default"), deadline=None)


def hypothesis_profile(environ=os.environ) -> str:
    """The profile for this environment (see the module docstring)."""
    if environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return "ci"
    return environ.get("HYPOTHESIS_PROFILE") or "dev"


# Here, before any test module builds its settings objects, which inherit the loaded profile.
settings.load_profile(hypothesis_profile())


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_backend():
    """Every test starts from the default backend selection, with no use_backend block open,
    and leaves nothing open behind it."""
    from ragged import backends

    ragged.set_backend(None)
    tokens = backends._active.set(None), backends._stack.set(())
    yield
    backends._stack.reset(tokens[1])
    backends._active.reset(tokens[0])
    ragged.set_backend(None)


def cpu_backends():
    """Backends that can run on CPU tensors in this process."""
    return ["torch", "triton"] if TRITON_ON_CPU else ["torch"]
