"""ragged.nn: drop-in padding-free modules (they own parameters; the encoder layer is computed once, in
:mod:`ragged.nn.layer`, from the LayerSpec an adapter builds)."""

from .convert import convert
from .graphed import CaptureError, Graphed, graphed
from .hf import graphs as _hf_graphs  # noqa: F401  (the HuggingFace families register their graph hooks)
from .hf.lm_loss import fuse_lm_loss, unfuse_lm_loss
from .multihead_attention import MultiheadAttention
from .transformer import TransformerEncoder, TransformerEncoderLayer
from .vocab import VocabProjection

__all__: list[str] = []
__all__ += ["VocabProjection", "CaptureError", "Graphed", "graphed", "fuse_lm_loss", "unfuse_lm_loss"]
__all__ += ["MultiheadAttention", "TransformerEncoder", "TransformerEncoderLayer", "convert"]
