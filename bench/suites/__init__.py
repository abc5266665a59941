# ruff: noqa: I001  (registration order is the run order: the imports stay in it)
"""Benchmark suites. Importing this package registers every suite with the harness.

To add a suite, write ``bench/suites/<name>.py`` with a :class:`bench.harness.Suite`
subclass decorated with :func:`bench.harness.register`, and import it below.
"""

from . import pack  # noqa: F401  (first: registration order is the run order)
from . import attention  # noqa: F401
from . import attention_bias  # noqa: F401
from . import vocab  # noqa: F401
from . import lm_head  # noqa: F401
from . import encoder  # noqa: F401
from . import pool  # noqa: F401
from . import hf  # noqa: F401
