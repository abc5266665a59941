"""The batch of a converted HuggingFace model's call, read once: the input packed with the
caller's layout, and every per-token argument packed the same way.

Coordinates: a *packed token* is row ``t`` of ``values [T, ...]``; its *position* is its
index ``j`` within its sequence; its *column* is where it sat in the caller's padded
``[B, M]`` batch (the position for right padding and for RaggedTensor inputs).
"""

from __future__ import annotations

import dataclasses

import torch

import ragged
from ragged import RaggedTensor
from ragged.padding import PaddedLayout, mask_keep, pack_by_layout, read_mask_layout
from ragged.utils import describe

__all__ = ["Batch", "read_batch"]


@dataclasses.dataclass
class Batch:
    """The sequences of one call: ``rt`` (the packed input ids or embeddings, with the
    offsets and host ``max_len`` every step uses), ``layout`` (where the tokens sat in the
    caller's padded batch; None for a RaggedTensor input) and ``keep`` (``[B, M]`` bool,
    True at tokens; None without an attention mask or for a RaggedTensor input)."""

    rt: RaggedTensor
    layout: PaddedLayout | None
    keep: torch.Tensor | None = None

    @property
    def ragged(self) -> bool:
        return self.layout is None

    def pack(self, fn: str, name: str, t, features: int, broadcast: bool = False) -> torch.Tensor | None:
        """``t`` as packed ``[T, *F]`` values (``features`` = ``len(F)``): a RaggedTensor (its
        values), packed values ``[T, *F]`` with a RaggedTensor input, or a padded
        ``[B, M, *F]`` tensor (``[1, M, *F]`` too with ``broadcast``) with a padded input."""
        if t is None:
            return None
        total = self.rt.num_tokens
        if isinstance(t, RaggedTensor) or self.layout is None:  # self.ragged, narrowing layout
            v = t.values if isinstance(t, RaggedTensor) else t
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"{fn}(): expected {name} to be a RaggedTensor or a tensor, got {describe(t)}")
            if v.dim() != 1 + features or v.shape[0] != total:
                raise ValueError(
                    f"{fn}(): expected {name} with values of {1 + features} dims and {total} tokens "
                    f"(those of the input), got shape {tuple(v.shape)}"
                )
            return v
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}(): expected {name} to be a tensor or a RaggedTensor, got {describe(t)}")
        batch, width = self.rt.batch_size, self.layout.width
        if broadcast and t.dim() == 2 + features and t.shape[0] == 1 and batch != 1:
            t = t.expand(batch, *t.shape[1:])
        if t.dim() != 2 + features or tuple(t.shape[:2]) != (batch, width):
            raise ValueError(
                f"{fn}(): expected {name} of shape ({batch}, {width}{', ...' if features else ''}) "
                f"like the input, got {tuple(t.shape)}"
            )
        if self.layout.side == "scattered":
            return t[self.layout.index]
        return ragged.pack_values(t, self.rt.offsets, total, padding_side=self.layout.side)

    def out(self, values: torch.Tensor, fill: float = 0.0):
        """Packed ``values [T, ...]`` in the caller's form: a RaggedTensor, or padded like the
        input with ``fill`` at padding."""
        rt = self.rt.with_values(values)
        if self.layout is None:
            return rt
        if fill == 0.0:
            return self.layout.unpack(rt)
        if self.layout.side == "scattered":
            full = values.new_full((rt.batch_size, self.layout.width, *values.shape[1:]), fill)
            return full.index_put(self.layout.index, values)
        return ragged.unpack(rt, padding_value=fill, total_length=self.layout.width, padding_side=self.layout.side)

    def columns(self) -> torch.Tensor:
        """``[T]`` int64: each token's column in the padded input (its position when ragged)."""
        return self.rt.position_ids() if self.layout is None else self.layout.positions(self.rt)


def read_batch(fn: str, name: str, src, attention_mask, features: int) -> Batch:
    """The batch of ``src`` (``input_ids``: ``features=0``; ``inputs_embeds``: 1): a
    RaggedTensor is taken as it is (no device read); a padded ``[B, M, *F]`` tensor is
    packed with its 2-D HuggingFace ``attention_mask`` (1 at tokens, 0 at padding; right,
    left or scattered), which costs one device-to-host read (:func:`ragged.padding.read_mask_layout`;
    a scattered mask one more, for its token coordinates), or as full rows without one."""
    if isinstance(src, RaggedTensor):
        if attention_mask is not None:
            raise ValueError(
                f"{fn}(): attention_mask applies to padded inputs; the RaggedTensor {name} carries its own lengths"
            )
        if src.values.dim() != 1 + features:
            shape = "[T, E]" if features else "[T]"
            raise ValueError(f"{fn}(): expected {name} with values of shape {shape}, got {tuple(src.values.shape)}")
        return Batch(src, None)
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"{fn}(): expected {name} to be a tensor or a RaggedTensor, got {describe(src)}")
    if src.dim() != 2 + features:
        shape = "[B, M, E]" if features else "[B, M]"
        raise ValueError(f"{fn}(): expected {name} of shape {shape} (or a RaggedTensor), got {tuple(src.shape)}")
    batch, width = src.shape[0], src.shape[1]
    if attention_mask is None:
        return Batch(ragged.pack(src), PaddedLayout(width))
    mask = attention_mask
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{fn}(): expected attention_mask to be a tensor, got {describe(mask)}")
    if mask.dim() != 2:
        raise NotImplementedError(
            f"{fn}(): attention_mask of shape {tuple(mask.shape)} is not supported: ragged takes "
            "the 2-D [B, M] padding mask (1 at tokens, 0 at padding), not 4-D attention masks"
        )
    if tuple(mask.shape) != (batch, width):
        raise ValueError(
            f"{fn}(): expected attention_mask of shape ({batch}, {width}) like {name}, got {tuple(mask.shape)}"
        )
    if mask.device != src.device:
        raise ValueError(f"{fn}(): expected attention_mask on {src.device} (the device of {name}), got {mask.device}")
    keep, bad = mask_keep(fn, "attention_mask", mask, "hf")
    # The one read of a padded call: lengths and layout flags together.
    host, is_right, is_left, is_bad = read_mask_layout(keep, bad)
    if is_bad:
        raise ValueError(f"{fn}(): expected attention_mask to hold 1 (token) and 0 (padding) only, got other values")
    rt, layout = pack_by_layout(src, keep, host, is_right, is_left)
    return Batch(rt, layout, keep)
