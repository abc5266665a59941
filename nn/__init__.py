"""ragged.nn: drop-in padding-free modules (thin: they own parameters and call ragged ops)."""

from .vocab import VocabProjection

__all__: list[str] = []
__all__ += ["VocabProjection"]
