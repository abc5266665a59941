"""``python -m ragged.embed MODEL INPUT OUTPUT [options]``: embed a text corpus with a
sentence-transformers model converted by :func:`ragged.nn.convert`, into one ``.npy`` or
``.parquet`` file, resumably.

The command's entry and nothing more: what it does, its options and its output are
:mod:`ragged.integrations.embed` (``python -m ragged.embed --help`` lists the options). The
process ends at once when the command returns (``os._exit``): every file is closed and on disk
and the lines are printed, and the interpreter's teardown (the model freed, the CUDA context
destroyed, every imported library's exit handlers) would cost whole seconds after the last line.
"""

from __future__ import annotations

import os
import sys
import time

from ragged.integrations.embed import main
from ragged.integrations.embed_report import process_start

_IMPORTED = time.perf_counter()  # where the process's start cannot be read, the whole run starts here

if __name__ == "__main__":
    status = main(started=process_start() or _IMPORTED)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
