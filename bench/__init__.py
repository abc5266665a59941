"""Benchmarks of ragged against the usual padded-tensor code: ``python -m bench``.

* :mod:`bench.harness`: suite registry, timing, correctness checks, copy ceiling;
* :mod:`bench.report`: terminal table, JSON, Markdown and plot of a suite's rows;
* :mod:`bench.suites`: the suites (imported here, so :data:`SUITES` is complete);
* :mod:`bench.__main__`: the command line.
"""

from . import suites  # noqa: E402,F401  (registers the suites)
from .harness import (
    SUITES,
    Case,
    Config,
    CopyCeiling,
    Impl,
    Row,
    Skip,
    Suite,
    Timing,
    Workload,
    copy_impl,
    exact_match,
    register,
)

__all__ = [
    "SUITES",
    "Case",
    "Config",
    "CopyCeiling",
    "Impl",
    "Row",
    "Skip",
    "Suite",
    "Timing",
    "Workload",
    "copy_impl",
    "exact_match",
    "register",
]
