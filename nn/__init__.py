"""ragged.nn: drop-in padding-free modules (thin: they own parameters and call ragged ops)."""

__all__: list[str] = []
