"""The HuggingFace model families :func:`ragged.nn.convert` converts, one file each in this
package; a new family is a file declaring its :class:`ragged.nn.hf.family.Family` objects and one
line here."""

from __future__ import annotations

from . import bert, distilbert, electra, modernbert, mpnet, roberta

__all__ = ["FAMILIES"]

# modeling module in transformers -> its family
FAMILIES = {f.module: f for m in (bert, roberta, electra, distilbert, modernbert, mpnet) for f in m.FAMILIES}
