"""ragged: variable-length batches at the cost of their real tokens.

Public API (see README.md for the table):

* :class:`RaggedTensor` (``values [T, *F]`` + ``offsets [B+1]`` + host ``max_len``)
* :func:`pack` / :func:`unpack` and their tensor forms :func:`pack_values` / :func:`unpack_values`
* interop: :func:`from_nested`, :func:`from_packed_sequence`, :func:`from_attention_mask`
* attention: :func:`attention` (RaggedTensors), :func:`varlen_attention` (cu_seqlens form)
* fused per-token ops: :func:`bias_act` (bias + activation), :func:`add_layer_norm` (residual add + LayerNorm)
* :func:`rotary_embedding` (rotary position embedding of packed heads)
* :func:`add_rms_norm` (residual add + RMSNorm, Llama's and Gemma's)
* gated activation (GeGLU and the GLU family): :func:`gated_act`
* an LM head and its loss without the logits: :func:`linear_cross_entropy`, with
  :func:`shift_labels` (next-token targets of a packed batch)
* per-sequence vocabularies: :func:`vocab_projection` -> :class:`RaggedLogits`, :func:`vocab_cross_entropy`,
  :func:`union_vocab`; the layer ``ragged.nn.VocabProjection``
* backend choice: :func:`set_backend`, :func:`get_backend`, :func:`use_backend`, :func:`explain`
"""

from . import backends as _backends
from .backends import get_backend, set_backend, use_backend
from .explain import explain
from .interop import from_attention_mask, from_cu_seqlens, from_nested, from_packed_sequence, pack, unpack
from .kernels import cuda as _cuda_backend  # noqa: F401  (they register)
from .kernels import triton as _triton_backend  # noqa: F401
from .logits import RaggedLogits
from .ops.attention import attention, reference_attention, reference_attention_backward, varlen_attention
from .ops.fused import add_layer_norm, bias_act, reference_add_layer_norm, reference_bias_act
from .ops.gated import gated_act, reference_gated_act
from .ops.linear_ce import linear_cross_entropy, reference_linear_cross_entropy, shift_labels
from .ops.pool import pool
from .ops.rms_norm import add_rms_norm, reference_add_rms_norm
from .ops.rotary import rotary_embedding
from .ops.vocab import (
    reference_vocab_projection,
    reference_vocab_projection_backward,
    union_vocab,
    vocab_cross_entropy,
    vocab_projection,
)
from .packing import pack_values, reference_pack, reference_unpack, unpack_values
from .tensor import RaggedTensor
from .warmup import warmup

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "RaggedLogits",
    "RaggedTensor",
    "add_layer_norm",
    "add_rms_norm",
    "attention",
    "bias_act",
    "build_info",
    "explain",
    "from_attention_mask",
    "from_cu_seqlens",
    "from_nested",
    "from_packed_sequence",
    "gated_act",
    "get_backend",
    "linear_cross_entropy",
    "pack",
    "pack_values",
    "pool",
    "reference_add_layer_norm",
    "reference_add_rms_norm",
    "reference_attention",
    "reference_attention_backward",
    "reference_bias_act",
    "reference_gated_act",
    "reference_linear_cross_entropy",
    "reference_pack",
    "reference_unpack",
    "reference_vocab_projection",
    "reference_vocab_projection_backward",
    "rotary_embedding",
    "set_backend",
    "shift_labels",
    "union_vocab",
    "unpack",
    "unpack_values",
    "use_backend",
    "varlen_attention",
    "vocab_cross_entropy",
    "vocab_projection",
    "warmup",
]


def build_info() -> dict:
    """How the CUDA C++ kernels of ``csrc/`` are built and loaded in this process: ``launch``
    (``"aot"``: the ``ragged._C`` binary; ``"jit"``: NVRTC through CuPy; None without a CUDA
    device), ``aot_present``, ``aot_archs`` (SM architectures built), ``aot_ptx``, ``aot_nvcc``,
    ``aot_cuda_runtime``, ``aot_reason`` (why ``_C`` is not used, when it is not), ``cupy`` (its
    version or None) and the ``RAGGED_CUDA_LAUNCH`` setting."""
    from .kernels.cuda.launch import build_info as info

    return info()


def __getattr__(name: str):
    # BACKENDS read live (ragged.backends.register_backend adds names after import);
    # ``ragged.nn`` (installed from nn/) on first use, without importing it with ragged.
    if name == "BACKENDS":
        return _backends.BACKENDS
    if name == "nn":
        import importlib

        return importlib.import_module("ragged.nn")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
