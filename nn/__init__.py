"""ragged.nn: drop-in padding-free modules (thin: they own parameters and call ragged ops)."""

from .activation import MultiheadAttention
from .convert import convert
from .transformer import TransformerEncoder, TransformerEncoderLayer
from .vocab import VocabProjection

__all__: list[str] = []
__all__ += ["VocabProjection"]
__all__ += ["MultiheadAttention", "TransformerEncoder", "TransformerEncoderLayer", "convert"]
