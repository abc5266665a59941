"""Shared test setup.

Without a GPU, Triton kernels run on CPU tensors through the interpreter: the
environment variable must be set before triton is first imported, hence here.
GPU tests carry ``@pytest.mark.gpu`` and are skipped when CUDA is not available.
"""

import os
import pathlib
import sys

import pytest
import torch

# bench/ is not installed (it runs from the repository root): make it importable here.
_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ragged  # noqa: E402  (after TRITON_INTERPRET is set)

TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET", "0") == "1"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_backend():
    """Every test starts from the default backend selection."""
    ragged.set_backend(None)
    yield
    ragged.set_backend(None)


def cpu_backends():
    """Backends that can run on CPU tensors in this process."""
    return ["torch", "triton"] if TRITON_ON_CPU else ["torch"]
