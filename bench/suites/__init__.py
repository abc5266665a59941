"""Benchmark suites. Importing this package registers every suite with the harness.

To add a suite, write ``bench/suites/<name>.py`` with a :class:`bench.harness.Suite`
subclass decorated with :func:`bench.harness.register`, and import it below.
"""

from . import (
    attention,  # noqa: F401
    attention_bias,  # noqa: F401
    encoder,  # noqa: F401
    hf,  # noqa: F401
    pack,  # noqa: F401  (first: registration order is the run order)
    pool,  # noqa: F401
    vocab,  # noqa: F401
)
