"""ragged: variable-length batches at the cost of their real tokens.

Public API (see README.md for the table):

* :class:`RaggedTensor` (``values [T, *F]`` + ``offsets [B+1]`` + host ``max_len``)
* :func:`pack` / :func:`unpack` and their tensor forms :func:`pack_values` / :func:`unpack_values`
* interop: :func:`from_nested`, :func:`from_packed_sequence`, :func:`from_attention_mask`
* attention: :func:`attention` (RaggedTensors), :func:`varlen_attention` (cu_seqlens form)
* backend choice: :func:`set_backend`, :func:`get_backend`, :func:`use_backend`, :func:`explain`
"""

from .backends import BACKENDS, explain, get_backend, set_backend, use_backend
from .ops.attention import attention, reference_attention, reference_attention_backward, varlen_attention
from .interop import from_attention_mask, from_cu_seqlens, from_nested, from_packed_sequence
from .ops.pack import pack, pack_values, reference_pack, reference_unpack, unpack, unpack_values
from .tensor import RaggedTensor

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "RaggedTensor",
    "attention",
    "explain",
    "from_attention_mask",
    "from_cu_seqlens",
    "from_nested",
    "from_packed_sequence",
    "get_backend",
    "pack",
    "pack_values",
    "reference_attention",
    "reference_attention_backward",
    "reference_pack",
    "reference_unpack",
    "set_backend",
    "unpack",
    "unpack_values",
    "use_backend",
    "varlen_attention",
]
