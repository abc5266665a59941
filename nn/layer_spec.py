"""What a model adapter hands the layer core (:mod:`ragged.nn.layer`): one encoder layer's
configuration and weights (:class:`LayerSpec`), and the implementations its fused steps run
(:class:`LayerKernels`); and the fused projections' concatenated weights (:func:`concatenated`,
made once per weight set under :func:`frozen_weights`)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from ragged import backends
from ragged.backends import Implementation

# the cache of concatenated weights of the innermost frozen_weights(), or None outside one
_FROZEN: contextvars.ContextVar[dict | None] = contextvars.ContextVar("ragged_frozen_weights", default=None)


@contextlib.contextmanager
def frozen_weights(cache: dict | None = None):
    """Within it the caller promises that no weight changes (one ``encode`` call, a server that
    owns its model): the concatenations of the fused projections (Q/K/V, gate/up) are made once
    per set of CPU Parameters and kept in ``cache`` (a dict the caller may keep for later
    calls, or a fresh one), where no gradient is recorded and nothing is compiled. A Parameter
    moved or cast since (a new address, dtype or device) misses the cache; a write into its
    ``.data`` is not seen: that is the promise."""
    token = _FROZEN.set({} if cache is None else cache)
    try:
        yield
    finally:
        _FROZEN.reset(token)


def concatenated(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``torch.cat(parts)`` along the first dim; within :func:`frozen_weights`, where it applies,
    made once per tuple of CPU Parameters."""
    cache = _FROZEN.get()
    # on a GPU the copy costs microseconds and a kept one would hold the weights twice in device
    # memory: kept on the CPU only, where one short text's forward paid about 8% for it
    if (
        cache is None
        or parts[0].device.type != "cpu"
        or torch.is_grad_enabled()
        or torch.compiler.is_compiling()
        or not all(type(p) is torch.nn.Parameter for p in parts)
    ):
        return torch.cat(parts)
    key = tuple((id(p), p.data_ptr(), p.dtype, p.device) for p in parts)
    held = cache.get(key)
    # the Parameters are held with their concatenation: their ids and addresses stay theirs
    if held is None or any(a is not b for a, b in zip(held[0], parts)):
        held = cache[key] = (parts, torch.cat(parts))
    return held[1]


class LayerWeights(NamedTuple):
    """The parameters of one layer (None where the layer has no bias)."""

    in_w: torch.Tensor  # [3d, d] packed q, k, v projection
    in_b: torch.Tensor | None  # [3d]
    out_w: torch.Tensor  # [d, d]
    out_b: torch.Tensor | None  # [d]
    norm1_w: torch.Tensor | None
    norm1_b: torch.Tensor | None
    ff1_w: torch.Tensor  # [ff, d]
    ff1_b: torch.Tensor | None  # [ff]
    ff2_w: torch.Tensor  # [d, ff]
    ff2_b: torch.Tensor | None  # [d]
    norm2_w: torch.Tensor | None
    norm2_b: torch.Tensor | None


class LayerNeeds(NamedTuple):
    """Per weight of :class:`LayerWeights` (same fields), whether its gradient is wanted."""

    in_w: bool
    in_b: bool
    out_w: bool
    out_b: bool
    norm1_w: bool
    norm1_b: bool
    ff1_w: bool
    ff1_b: bool
    ff2_w: bool
    ff2_b: bool
    norm2_w: bool
    norm2_b: bool


class LayerWeightGrads(NamedTuple):
    """Per weight of :class:`LayerWeights` (same fields), its gradient: None where not wanted
    or where the layer has no such weight."""

    in_w: torch.Tensor | None
    in_b: torch.Tensor | None
    out_w: torch.Tensor | None
    out_b: torch.Tensor | None
    norm1_w: torch.Tensor | None
    norm1_b: torch.Tensor | None
    ff1_w: torch.Tensor | None
    ff1_b: torch.Tensor | None
    ff2_w: torch.Tensor | None
    ff2_b: torch.Tensor | None
    norm2_w: torch.Tensor | None
    norm2_b: torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One encoder layer: configuration and weights.

    ``activation``: a :func:`ragged.bias_act` name (``"relu"``, ``"gelu"``, ``"gelu_tanh"``),
    which the fused kernels take, or any callable on ``[T, ff]`` (then the layer runs
    :class:`Recorded`). ``dropout``: the rates of ``(attention probabilities, after the
    attention block, the feed-forward hidden layer, after the feed-forward block)``, zeros in
    eval mode. ``eps``: the two LayerNorms'. Bias flags are the weights that are None.
    Self-attention over the packed in-projection; causal masking is chosen per call.
    ``position_bias``: ``(table, buckets)`` of :func:`ragged.varlen_attention` (a relative-position
    bias added to the scores, MPNet's), or None; a layer with one trains as any other, its table
    an operand of the layer's one autograd node, whose backward returns the table's gradient
    (summed over the layers that share the table)."""

    heads: int
    head_dim: int
    norm_first: bool
    activation: str | Callable[[torch.Tensor], torch.Tensor]
    eps: tuple[float, float]
    dropout: tuple[float, float, float, float]
    weights: LayerWeights
    position_bias: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def d_model(self) -> int:
        return self.heads * self.head_dim

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def fused_activation(self) -> bool:
        return isinstance(self.activation, str)


@dataclasses.dataclass(frozen=True)
class LayerKernels:
    """The implementations a layer's fused steps run (see :func:`choose_kernels`)."""

    attention: Implementation
    add_layer_norm: Implementation
    bias_act: Implementation

    def backward_of(self, impl: Implementation) -> Implementation:
        """The implementation whose backward follows ``impl``'s forward."""
        return backends.implementation(impl.op, impl.backward_backend or impl.backend)
