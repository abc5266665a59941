"""Conversions between RaggedTensor and the other variable-length formats.

=============================  ================================  ===============================
format                         to                                from
=============================  ================================  ===============================
torch.nested (jagged layout)   ``rt.to_nested()``                ``from_nested(nt)``
PackedSequence                 ``rt.to_packed_sequence()``       ``from_packed_sequence(ps)``
flash-attn varlen              ``rt.cu_seqlens()``,              ``from_cu_seqlens(values,
                               ``rt.flash_kwargs()``             cu_seqlens, max_seqlen)``
HuggingFace attention mask     ``rt.attention_mask()``,          ``from_attention_mask(x, mask)``
                               ``rt.to_padded()``                (= ``pack(x, attention_mask=)``)
=============================  ================================  ===============================
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence

from ._utils import check_offsets_tensor, check_tensor, describe, max_length, offsets_dtype_for, to_device
from .tensor import RaggedTensor, exact_ragged

# nested_tensor_from_jagged asks torch.fx whether it is tracing, and that query reports a
# deprecation notice addressed to fx users (through logging in torch 2.13, as a
# UserWarning in some other releases), once per process: to a ragged user it is noise.
_FX_TRACING_NOTICE = "is_fx_tracing will return true"
_FX_LOGGER = "torch.fx._symbolic_trace"


class _DropFxTracingNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _FX_TRACING_NOTICE not in record.getMessage()


_DROP_FX_TRACING_NOTICE = _DropFxTracingNotice()


def to_nested(rt: RaggedTensor) -> torch.Tensor:
    """A jagged-layout nested tensor ``[B, j, *F]`` that shares ``rt.values`` (no copy).

    torch.nested keeps int64 offsets; int32 offsets are widened (a small device op).
    The host ``max_len`` is passed along so that NJT ops need not read it back.
    """
    min_len = None
    if rt._host_offsets is not None:
        o = rt._host_offsets
        min_len = min((o[i + 1] - o[i] for i in range(len(o) - 1)), default=0)
    offsets = rt.offsets.to(torch.int64)
    if torch.compiler.is_compiling():  # filters are host state; a traced call builds the tensor only
        return torch.nested.nested_tensor_from_jagged(rt.values, offsets, max_seqlen=rt.max_len, min_seqlen=min_len)
    # The notice is filtered for this one call only, by its text, on the logger that emits it.
    logger = logging.getLogger(_FX_LOGGER)
    logger.addFilter(_DROP_FX_TRACING_NOTICE)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_FX_TRACING_NOTICE)
            return torch.nested.nested_tensor_from_jagged(rt.values, offsets, max_seqlen=rt.max_len,
                                                          min_seqlen=min_len)
    finally:
        logger.removeFilter(_DROP_FX_TRACING_NOTICE)


def from_nested(nt: torch.Tensor) -> RaggedTensor:
    """RaggedTensor from a nested tensor (jagged layout shares values; strided layout is packed).

    A jagged tensor with holes (from ``torch.nested.narrow``) is compacted first. When the
    nested tensor does not carry its max sequence length, it is read back (one sync).
    """
    fn = "ragged.from_nested"
    check_tensor(fn, "nt", nt)
    if not nt.is_nested:
        raise TypeError(f"{fn}(): expected a nested tensor, got {describe(nt)}")
    if nt.layout == torch.strided:
        from .ops.pack import pack

        return pack(list(nt.unbind()))
    if getattr(nt, "_ragged_idx", 1) != 1:
        raise ValueError(f"{fn}(): expected the ragged dimension to be dim 1, got dim {nt._ragged_idx}")
    if nt._lengths is not None:
        nt = nt.contiguous()
    values, offsets = nt.values(), nt.offsets()
    total = values.shape[0]
    offsets = check_offsets_tensor(fn, offsets.to(offsets_dtype_for(total)), values)
    max_len = getattr(nt, "_maybe_max_seqlen", None)
    if max_len is None:
        return RaggedTensor._from_offsets(fn, values, offsets, None, True, "nt.offsets()", "max_seqlen")
    return RaggedTensor(values, offsets, int(max_len))


def to_packed_sequence(rt: RaggedTensor, enforce_sorted: bool = False) -> PackedSequence:
    """A ``PackedSequence`` (time-major, sequences sorted by decreasing length).

    Needs the host lengths (one sync the first time when they are not known). Sequences
    of length 0 cannot be represented in a PackedSequence and raise ValueError.
    """
    fn = "ragged.RaggedTensor.to_packed_sequence"
    lengths = np.asarray(rt.host_lengths(), dtype=np.int64)
    if lengths.size and lengths.min() == 0:
        raise ValueError(f"{fn}(): PackedSequence cannot hold sequences of length 0, got length 0 at index "
                         f"{int(np.argmin(lengths))}")
    if lengths.size == 0:
        raise ValueError(f"{fn}(): PackedSequence cannot hold an empty batch (B = 0)")
    if enforce_sorted:
        if np.any(np.diff(lengths) > 0):
            raise ValueError(f"{fn}(): enforce_sorted=True needs lengths sorted in decreasing order, got {lengths.tolist()}")
        order = np.arange(lengths.size)
    else:
        order = np.argsort(-lengths, kind="stable")
    starts = np.asarray(rt.host_offsets()[:-1], dtype=np.int64)[order]
    sorted_lengths = lengths[order]
    steps = np.arange(int(sorted_lengths[0]))
    present = steps[:, None] < sorted_lengths[None, :]          # [max_len, B], time-major
    index = (starts[None, :] + steps[:, None])[present]
    batch_sizes = torch.from_numpy(present.sum(1).astype(np.int64))
    data = rt.values.index_select(0, to_device(index.tolist(), torch.int64, rt.device))
    if enforce_sorted:
        return PackedSequence(data, batch_sizes, None, None)
    sorted_indices = to_device(order.tolist(), torch.int64, rt.device)
    unsorted_indices = to_device(np.argsort(order).tolist(), torch.int64, rt.device)
    return PackedSequence(data, batch_sizes, sorted_indices, unsorted_indices)


def from_packed_sequence(ps: PackedSequence) -> RaggedTensor:
    """RaggedTensor from a ``PackedSequence``, sequences in their original (unsorted) order.

    Reads ``unsorted_indices`` on the host (one sync when they live on the GPU).
    """
    fn = "ragged.from_packed_sequence"
    if not isinstance(ps, PackedSequence):
        raise TypeError(f"{fn}(): expected a torch.nn.utils.rnn.PackedSequence, got {describe(ps)}")
    batch_sizes = ps.batch_sizes.to("cpu", torch.int64).numpy()
    batch = int(batch_sizes[0]) if batch_sizes.size else 0
    # Sequence k in sorted order has length #{t : batch_sizes[t] > k}.
    sorted_lengths = (batch_sizes[:, None] > np.arange(batch)[None, :]).sum(0)
    if ps.unsorted_indices is not None:
        rank = ps.unsorted_indices.to("cpu", torch.int64).numpy()   # original i -> sorted position
    else:
        rank = np.arange(batch)
    lengths = sorted_lengths[rank]
    step_start = np.concatenate([[0], np.cumsum(batch_sizes)[:-1]]).astype(np.int64)
    # Token t of original sequence i sits at data row step_start[t] + rank[i].
    index = np.concatenate([step_start[: lengths[i]] + rank[i] for i in range(batch)]) if batch else \
        np.zeros(0, dtype=np.int64)
    host = [0, *np.cumsum(lengths).tolist()]
    values = ps.data.index_select(0, to_device(index.tolist(), torch.int64, ps.data.device))
    offsets = to_device(host, offsets_dtype_for(host[-1]), ps.data.device)
    return exact_ragged(values, offsets, host, max_length(host))


def from_cu_seqlens(values: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int | None = None, *,
                    validate: bool = True) -> RaggedTensor:
    """RaggedTensor from flash-attn's varlen form (``values [T, ...]``, ``cu_seqlens [B+1]``).

    As :meth:`RaggedTensor.from_offsets`: ``cu_seqlens`` of any stride is stored contiguous,
    and ``validate=False`` with ``max_seqlen`` given reads nothing from the GPU.
    """
    return RaggedTensor._from_offsets("ragged.from_cu_seqlens", values, cu_seqlens, max_seqlen, validate,
                                      "cu_seqlens", "max_seqlen")


def from_attention_mask(x: torch.Tensor, attention_mask: torch.Tensor, backend: str | None = None) -> RaggedTensor:
    """RaggedTensor from a padded batch and a HuggingFace mask (right or left padded).

    ``attention_mask [B, M]`` of any dtype holds 1 at tokens and 0 at padding, nothing else
    (checked within the one read of the mask: ``ValueError`` otherwise)."""
    from . import backends
    from .ops.pack import _pack_masked

    fn = "ragged.from_attention_mask"
    if backend is not None:
        backends._check_name(fn, backend)
    check_tensor(fn, "x", x)
    if x.dim() < 2:
        raise ValueError(f"{fn}(): expected x of shape [B, M, ...], got {tuple(x.shape)}")
    return _pack_masked(fn, x, attention_mask, "attention_mask", None, backend)
