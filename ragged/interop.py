"""Conversions between RaggedTensor and the other variable-length formats: padded batches
(:func:`pack` / :func:`unpack`, with lengths or masks), torch.nested, PackedSequence,
flash-attn's cu_seqlens and HuggingFace attention masks.

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

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence

from . import backends
from .padding import mask_keep, pack_rows, read_mask_layout  # noqa: F401  (read_mask_layout: re-exported)
from .tensor import RaggedTensor, exact_ragged
from .utils import (
    check_offsets_tensor,
    check_side,
    check_tensor,
    describe,
    host_lengths_of,
    host_offsets_from_lengths,
    max_length,
    offsets_dtype_for,
    to_device,
    warn_once,
)


def to_nested(rt: RaggedTensor) -> torch.Tensor:
    """The function form of :meth:`RaggedTensor.to_nested`."""
    return rt.to_nested()


def to_packed_sequence(rt: RaggedTensor, enforce_sorted: bool = False) -> PackedSequence:
    """The function form of :meth:`RaggedTensor.to_packed_sequence`."""
    return rt.to_packed_sequence(enforce_sorted)


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
        return pack(list(nt.unbind()))
    jagged: Any = nt  # a NestedTensor of the jagged layout: its attributes are not on torch.Tensor
    if getattr(jagged, "_ragged_idx", 1) != 1:
        raise ValueError(f"{fn}(): expected the ragged dimension to be dim 1, got dim {jagged._ragged_idx}")
    if jagged._lengths is not None:
        nt = jagged = nt.contiguous()
    values, offsets = jagged.values(), jagged.offsets()
    total = values.shape[0]
    offsets = check_offsets_tensor(fn, offsets.to(offsets_dtype_for(total)), values)
    max_len = getattr(nt, "_maybe_max_seqlen", None)
    if max_len is None:
        return RaggedTensor.from_offsets_named(fn, values, offsets, None, True, "nt.offsets()", "max_seqlen")
    return RaggedTensor(values, offsets, int(max_len))


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
        rank = ps.unsorted_indices.to("cpu", torch.int64).numpy()  # original i -> sorted position
    else:
        rank = np.arange(batch)
    lengths = sorted_lengths[rank]
    step_start = np.concatenate([[0], np.cumsum(batch_sizes)[:-1]]).astype(np.int64)
    # Token t of original sequence i sits at data row step_start[t] + rank[i].
    index = (
        np.concatenate([step_start[: lengths[i]] + rank[i] for i in range(batch)])
        if batch
        else np.zeros(0, dtype=np.int64)
    )
    host = [0, *np.cumsum(lengths).tolist()]
    values = ps.data.index_select(0, to_device(index.tolist(), torch.int64, ps.data.device))
    offsets = to_device(host, offsets_dtype_for(host[-1]), ps.data.device)
    return exact_ragged(values, offsets, host, max_length(host))


def from_cu_seqlens(
    values: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int | None = None, *, validate: bool = True
) -> RaggedTensor:
    """RaggedTensor from flash-attn's varlen form (``values [T, ...]``, ``cu_seqlens [B+1]``).

    As :meth:`RaggedTensor.from_offsets`: ``cu_seqlens`` of any stride is stored contiguous,
    and ``validate=False`` with ``max_seqlen`` given reads nothing from the GPU.
    """
    return RaggedTensor.from_offsets_named(
        "ragged.from_cu_seqlens", values, cu_seqlens, max_seqlen, validate, "cu_seqlens", "max_seqlen"
    )


def from_attention_mask(x: torch.Tensor, attention_mask: torch.Tensor, backend: str | None = None) -> RaggedTensor:
    """RaggedTensor from a padded batch and a HuggingFace mask (right or left padded).

    ``attention_mask [B, M]`` of any dtype holds 1 at tokens and 0 at padding, nothing else
    (checked within the one read of the mask: ``ValueError`` otherwise)."""
    fn = "ragged.from_attention_mask"
    if backend is not None:
        backends.check_name(fn, backend)
    check_tensor(fn, "x", x)
    if x.dim() < 2:
        raise ValueError(f"{fn}(): expected x of shape [B, M, ...], got {tuple(x.shape)}")
    return _pack_masked(fn, x, attention_mask, "attention_mask", None, backend)


# --------------------------------------------------------------------------------------
# Padded batches


def pack(
    data,
    lengths=None,
    *,
    mask: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    padding_side: str | None = None,
    backend: str | None = None,
) -> RaggedTensor:
    """Build a :class:`RaggedTensor`.

    * ``pack([t_0, t_1, ...])``: a list of ``[L_i, *F]`` tensors (same ``F``, dtype and
      device); no sync.
    * ``pack(x, lengths=[...])``: ``x`` padded ``[B, M, *F]`` and host lengths (list,
      tuple, numpy array, CPU tensor): no sync. A CUDA lengths tensor is read back once.
      ``padding_side="left"`` when the tokens sit at the end of each row.
    * ``pack(x, mask=key_padding_mask)``: torch convention, ``[B, M]`` bool with True at
      padding (or float with ``-inf`` at padding). One sync reads the lengths and the
      padding side.
    * ``pack(x, attention_mask=hf_mask)``: HuggingFace convention, ``[B, M]`` of any dtype
      holding only 0 (padding) and 1 (token); right or left padding is detected. One sync,
      as for ``mask``. An integer mask given as ``mask=`` raises ``TypeError``.
    * ``pack(x)``: every row is full (``L_b = M``).

    Masks whose tokens are not one contiguous run at either end of each row are
    compressed with a boolean gather (slower; warns once).
    """
    fn = "ragged.pack"
    if backend is not None:
        backends.check_name(fn, backend)
    if isinstance(data, (list, tuple)):
        if lengths is not None or mask is not None or attention_mask is not None:
            raise ValueError(
                f"{fn}(): lengths, mask and attention_mask apply to a padded tensor, not to a list of sequences"
            )
        return _pack_list(fn, data)
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{fn}(): expected a list of tensors or a padded tensor [B, M, ...], got {describe(data)}")
    x = data
    if x.dim() < 2:
        raise ValueError(f"{fn}(): expected a padded tensor of shape [B, M, ...], got {tuple(x.shape)}")
    given = [
        name for name, v in (("lengths", lengths), ("mask", mask), ("attention_mask", attention_mask)) if v is not None
    ]
    if len(given) > 1:
        raise ValueError(f"{fn}(): expected at most one of lengths, mask, attention_mask, got {', '.join(given)}")
    batch, width = x.shape[0], x.shape[1]
    if mask is not None or attention_mask is not None:
        name, given_mask = ("mask", mask) if mask is not None else ("attention_mask", attention_mask)
        assert given_mask is not None
        return _pack_masked(fn, x, given_mask, name, padding_side, backend)
    side = check_side(fn, "right" if padding_side is None else padding_side)
    if lengths is None:
        host_lengths = [width] * batch
    else:
        host_lengths = host_lengths_of(fn, lengths)
        if len(host_lengths) != batch:
            raise ValueError(f"{fn}(): expected {batch} lengths (x.shape[0]), got {len(host_lengths)}")
    host = host_offsets_from_lengths(fn, host_lengths)
    longest = max_length(host)
    if longest > width:
        i = max(range(batch), key=lambda k: host[k + 1] - host[k])
        raise ValueError(
            f"{fn}(): expected every length <= the padded width x.shape[1] ({width}), got lengths[{i}] = {longest}"
        )
    return pack_rows(x, host, side, backend)


def _pack_list(fn: str, seqs: Sequence[torch.Tensor]) -> RaggedTensor:
    if len(seqs) == 0:
        return RaggedTensor(torch.empty(0), torch.zeros(1, dtype=torch.int32), 0, (0,))
    first = seqs[0]
    for i, s in enumerate(seqs):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{fn}(): expected every sequence to be a torch.Tensor, got {describe(s)} at index {i}")
        if s.dim() < 1:
            raise ValueError(f"{fn}(): expected sequences of shape [L, ...], got a 0-d tensor at index {i}")
        if s.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"{fn}(): expected every sequence to have feature shape {tuple(first.shape[1:])} "
                f"(that of sequence 0), got {tuple(s.shape[1:])} at index {i}"
            )
        if s.dtype != first.dtype:
            raise TypeError(
                f"{fn}(): expected every sequence to have dtype {first.dtype} (that of sequence 0), "
                f"got {s.dtype} at index {i}"
            )
        if s.device != first.device:
            raise ValueError(
                f"{fn}(): expected every sequence on {first.device} (that of sequence 0), got {s.device} at index {i}"
            )
    host = host_offsets_from_lengths(fn, [s.shape[0] for s in seqs])
    values = torch.cat(list(seqs), dim=0)
    offsets = to_device(host, offsets_dtype_for(host[-1]), first.device)
    return exact_ragged(values, offsets, host, max_length(host))


def _pack_masked(fn: str, x: torch.Tensor, m: torch.Tensor, name: str, padding_side, backend) -> RaggedTensor:
    check_tensor(fn, name, m)
    if tuple(m.shape) != tuple(x.shape[:2]):
        raise ValueError(f"{fn}(): expected {name} of shape {tuple(x.shape[:2])} (x.shape[:2]), got {tuple(m.shape)}")
    if m.device != x.device:
        raise ValueError(f"{fn}(): expected {name} on {x.device} (the device of x), got {m.device}")
    if padding_side is not None:
        check_side(fn, padding_side)
    # mask=: torch's convention (True or -inf = padding); attention_mask=: HuggingFace's (1 = token)
    keep, bad = mask_keep(fn, name, m, "torch" if name == "mask" else "hf")
    host_lengths, is_right, is_left, is_bad = read_mask_layout(keep, bad)
    if is_bad:
        what = "0 (token) or -inf (padding)" if name == "mask" else "0 (padding) or 1 (token)"
        raise ValueError(f"{fn}(): expected {name} values to be {what}, got other values")
    host = host_offsets_from_lengths(fn, host_lengths)
    longest = max_length(host)
    if is_right and padding_side != "left":
        return pack_rows(x, host, "right", backend)
    if is_left and padding_side != "right":
        return pack_rows(x, host, "left", backend)
    if is_right or is_left:
        found = "right" if is_right else "left"
        raise ValueError(
            f"{fn}(): padding_side={padding_side!r} expects a {padding_side}-padded {name}, got a {found}-padded one"
        )
    warn_once(
        "pack-scattered-mask",
        f"{fn}(): {name} has tokens that are not one contiguous run at the start or end of each row; "
        "compressing them with a boolean gather, which is slower than the pack kernels",
    )
    values = x[keep]
    offsets = to_device(host, offsets_dtype_for(host[-1]), x.device)
    return exact_ragged(values, offsets, host, longest)


def unpack(
    rt: RaggedTensor,
    padding_value: float = 0.0,
    total_length: int | None = None,
    padding_side: str = "right",
    backend: str | None = None,
) -> torch.Tensor:
    """``[B, M, *F]`` from a RaggedTensor, ``padding_value`` at padding; ``M = total_length or max_len``
    (the function form of :meth:`RaggedTensor.to_padded`).

    ``M`` is checked against the longest sequence on the host when the host offsets are
    known (no sync), and otherwise from CPU offsets; CUDA offsets without host offsets are
    trusted to fit ``max_len``.
    """
    fn = "ragged.unpack"
    if not isinstance(rt, RaggedTensor):
        raise TypeError(f"{fn}(): expected a RaggedTensor for rt, got {describe(rt)}")
    return rt._to_padded(fn, padding_value, total_length, padding_side, backend)
