"""``python -m ragged.serve MODEL [options]``: an HTTP embedding server (OpenAI's
``/v1/embeddings``, text-embeddings-inference's ``/embed``, ``/health``, ``/metrics``) over a
sentence-transformers model converted by :func:`ragged.nn.convert`, batching the texts of
concurrent requests by tokens.

The command's entry and nothing more: what it does and its options are
:mod:`ragged.integrations.serve` (``python -m ragged.serve --help`` lists the options).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from ragged.integrations.serve import main

    sys.exit(main())
