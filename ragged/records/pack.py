"""The records of ``ragged::pack`` and ``ragged::unpack`` (see :mod:`ragged.packing`): each is the
other's gradient, so neither has a backward op of its own."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor
from torch.types import Number


class PackArgs(NamedTuple):
    """The operands of one pack: ``padded [B, M, *F]``, ``offsets [B+1]``, ``total`` (the host
    int ``offsets[-1]``) and ``left`` (sequences sit at the end of their padded rows)."""

    padded: Tensor
    offsets: Tensor
    total: int
    left: bool


class PackOutput(NamedTuple):
    """``values [total, *F]``."""

    values: Tensor


class PackGrads(NamedTuple):
    """The gradient of ``padded`` (zeros at the padding)."""

    padded: Tensor


class UnpackArgs(NamedTuple):
    """The operands of one unpack: ``values [T, *F]``, ``offsets [B+1]``, the padded ``width``,
    the ``padding_value`` (a Scalar of the schema: an int64 fill such as 2**62 + 1 stays exact)
    and ``left``."""

    values: Tensor
    offsets: Tensor
    width: int
    padding_value: Number
    left: bool


class UnpackOutput(NamedTuple):
    """``padded [B, width, *F]``."""

    padded: Tensor


class UnpackGrads(NamedTuple):
    """The gradient of ``values``."""

    values: Tensor
