"""The boundary between padded and packed batches, once: mask conventions, the one read of a
mask, packing a padded batch by its layout, and putting results back where they came from.

* **Mask conventions** (:func:`mask_keep`): ``"torch"`` (a key padding mask: bool True, or
  float ``-inf``, at padding; 0 at tokens) and ``"hf"`` (HuggingFace's ``attention_mask``: 1 at
  tokens, 0 at padding) both become ``keep`` (bool, True at tokens) and ``bad`` (True where a
  value is neither).
* **The one read** (:func:`read_mask_layout`): the host lengths and whether every row is right
  padded (tokens first), left padded (tokens last) or neither, with the ``bad`` flag, in one
  device-to-host copy.
* **Packing by layout** (:func:`pack_rows`, :func:`pack_by_layout`): right and left padding go
  through the pack kernels with host lengths; any other mask gathers its tokens by index (the
  token count is known on the host, so no second read).
* **Back to the caller's layout** (:class:`PaddedLayout`): where each packed token sat.

Used by :mod:`ragged.interop` (``pack(mask=)`` / ``pack(attention_mask=)``), the torch.nn
drop-ins (key padding masks), the HuggingFace adapters (``attention_mask``) and
``attn_implementation="ragged"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from . import backends
from .packing import PACK, PackSpec
from .records.pack import PackArgs
from .tensor import RaggedTensor, exact_ragged
from .utils import max_length, offsets_dtype_for, to_device

__all__ = ["CONVENTIONS", "PaddedLayout", "mask_keep", "pack_by_layout", "pack_rows", "read_mask_layout"]

CONVENTIONS = ("torch", "hf")


def mask_keep(fn: str, name: str, mask: torch.Tensor, convention: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(keep, bad)`` of a padding mask: ``keep`` bool, True at tokens; ``bad`` bool (or None
    when no value can be wrong), True where a value is neither a token's nor padding's.

    ``"torch"``: bool (True = padding) or float (0 = token, -inf = padding); an integer mask
    raises ``TypeError`` (almost always a HuggingFace 0/1 mask, whose lengths would come out
    inverted). ``"hf"``: 1 = token, 0 = padding, any dtype."""
    if convention == "torch":
        if mask.dtype == torch.bool:
            return ~mask, None
        if mask.dtype.is_floating_point:
            keep = mask == 0
            return keep, ~(keep | torch.isneginf(mask))
        raise TypeError(
            f"{fn}(): expected {name} of dtype bool (True = padding) or float (-inf = padding), "
            f"got {mask.dtype}; for a 0/1 mask with 1 at tokens (HuggingFace convention) "
            "use attention_mask= instead"
        )
    if convention == "hf":
        if mask.dtype == torch.bool:
            return mask, None
        keep = mask != 0
        return keep, keep != (mask == 1)
    raise ValueError(f"ragged.padding.mask_keep(): expected convention to be one of {CONVENTIONS}, got {convention!r}")


def read_mask_layout(keep: torch.Tensor, bad: torch.Tensor | None = None) -> tuple[list[int], bool, bool, bool]:
    """The one device read of a mask-driven pack.

    ``keep``: ``[B, M]`` bool, True at tokens. Returns the host lengths, whether every row's
    tokens are one run at the start (right padding) or at the end (left padding) of the
    row (full and empty rows are both), and whether ``bad`` (bool, any shape) holds a True.
    """
    batch, width = keep.shape
    lengths = keep.sum(1)
    j = torch.arange(width, device=keep.device)
    right = (keep == (j < lengths.unsqueeze(1))).all()
    left = (keep == (j >= width - lengths.unsqueeze(1))).all()
    flags = torch.stack(
        [right, left, bad.any() if bad is not None else torch.zeros((), dtype=torch.bool, device=keep.device)]
    )
    stats = torch.cat([lengths.to(torch.int64), flags.to(torch.int64)]).tolist()
    host_lengths, (is_right, is_left, is_bad) = stats[:batch], stats[batch:]
    return host_lengths, bool(is_right), bool(is_left), bool(is_bad)


def pack_rows(x: torch.Tensor, host: Sequence[int], side: str, backend: str | None = None) -> RaggedTensor:
    """Pack the rows of batch-first ``x [B, M, *F]`` whose tokens are the first (``side="right"``)
    or the last (``"left"``) of each row, given the host offsets ``host [B+1]``."""
    total = host[-1]
    offsets = to_device(host, offsets_dtype_for(total), x.device)
    impl = backends.select_spec("pack", backend, PackSpec(x.device, x.dtype))
    values = PACK(PackArgs(x, offsets, total, side == "left"), impl.name).values
    return exact_ragged(values, offsets, host, max_length(host))


def pack_by_layout(
    x: torch.Tensor, keep: torch.Tensor, lengths: Sequence[int], is_right: bool, is_left: bool
) -> tuple[RaggedTensor, PaddedLayout]:
    """Pack ``x [B, M, *F]`` by what :func:`read_mask_layout` found: the pack kernels for right
    or left padding, a gather of ``keep``'s tokens otherwise (row-major: each row's tokens in
    order). Returns the RaggedTensor and where its tokens sat."""
    host = [0]
    for n in lengths:
        host.append(host[-1] + n)
    width = x.shape[1]
    if is_right:
        return pack_rows(x, host, "right"), PaddedLayout(width)
    if is_left:
        return pack_rows(x, host, "left"), PaddedLayout(width, "left")
    # the token count is known on the host: no second read for the gather's size
    rows, cols = torch.nonzero_static(keep, size=host[-1]).unbind(1)
    return RaggedTensor.from_lengths(x[rows, cols], list(lengths)), PaddedLayout(width, "scattered", (rows, cols))


@dataclasses.dataclass
class PaddedLayout:
    """Where the tokens of a packed batch sat in the caller's padded ``[B, M, ...]`` tensor.

    ``side``: ``"right"`` (tokens first in each row; also every row full), ``"left"`` (tokens
    last) or ``"scattered"`` (any other padding mask: ``index`` holds the token coordinates,
    in row-major order).
    """

    width: int
    side: str = "right"
    index: tuple[torch.Tensor, torch.Tensor] | None = None

    def unpack(self, rt: RaggedTensor) -> torch.Tensor:
        """``[B, width, ...]`` with ``rt``'s tokens back at their places and zeros elsewhere."""
        if self.side == "scattered":
            out = rt.values.new_zeros((rt.batch_size, self.width, *rt.feature_shape))
            return out.index_put(self.index, rt.values)
        return rt.to_padded(total_length=self.width, padding_side=self.side)

    def positions(self, rt: RaggedTensor) -> torch.Tensor:
        """``[T]`` column of every packed token in the padded tensor."""
        if self.side == "scattered":
            assert self.index is not None  # a scattered layout carries its coordinates
            return self.index[1]
        j = rt.position_ids()
        if self.side == "left":
            j = j + (self.width - rt.lengths.to(torch.int64)).repeat_interleave(rt.lengths, output_size=rt.num_tokens)
        return j
