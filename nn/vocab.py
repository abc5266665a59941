"""VocabProjection: an output layer that scores each sequence against its own candidate ids."""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn

from ragged import RaggedLogits, RaggedTensor, vocab_cross_entropy, vocab_projection


class VocabProjection(nn.Module):
    """``weight [num_embeddings, in_features]`` and ``bias [num_embeddings]`` (``nn.Linear``'s
    layout, names and initialisation, so a Linear's ``state_dict`` loads as is).

    ``forward(hidden, vocab)`` returns :func:`ragged.vocab_projection`'s
    :class:`ragged.RaggedLogits`; ``loss(hidden, vocab, target, **kwargs)`` is
    :func:`ragged.vocab_cross_entropy`. :meth:`from_linear` / :meth:`from_embedding` share
    (tie) an existing module's parameters instead of owning new ones.
    """

    def __init__(self, in_features: int, num_embeddings: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        for name, value in (("in_features", in_features), ("num_embeddings", num_embeddings)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"ragged.nn.VocabProjection(): expected {name} to be a non-negative int, got {value!r}"
                )
        self.in_features = in_features
        self.num_embeddings = num_embeddings
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty((num_embeddings, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(num_embeddings, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> VocabProjection:
        """A projection sharing ``linear``'s weight and bias (the same Parameter objects):
        training either trains both."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(
                f"ragged.nn.VocabProjection.from_linear(): expected an nn.Linear, got {type(linear).__name__}"
            )
        # a Linear's weight and bias are Parameters (torch's stubs type them as tensors)
        return cls._tied(cast(nn.Parameter, linear.weight), cast("nn.Parameter | None", linear.bias))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, bias: nn.Parameter | None = None) -> VocabProjection:
        """A projection tied to an input embedding table (``weight [V, d]``), with an
        optional ``bias [V]`` Parameter."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(
                f"ragged.nn.VocabProjection.from_embedding(): expected an nn.Embedding, got {type(embedding).__name__}"
            )
        return cls._tied(cast(nn.Parameter, embedding.weight), bias)

    @classmethod
    def _tied(cls, weight: nn.Parameter, bias: nn.Parameter | None) -> VocabProjection:
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.num_embeddings, module.in_features = weight.shape
        module.weight = weight
        if bias is None:
            module.register_parameter("bias", None)
        else:
            module.bias = bias
        return module

    def forward(
        self, hidden: RaggedTensor, vocab, *, validate: bool = False, backend: str | None = None
    ) -> RaggedLogits:
        return vocab_projection(hidden, self.weight, vocab, self.bias, validate=validate, backend=backend)

    def loss(self, hidden: RaggedTensor, vocab, target, **kwargs) -> torch.Tensor:
        """:func:`ragged.vocab_cross_entropy` with this layer's parameters (``kwargs``:
        ``ignore_index``, ``reduction``, ``label_smoothing``, ``out_of_vocab``, ``validate``,
        ``backend``)."""
        return vocab_cross_entropy(hidden, self.weight, vocab, target, self.bias, **kwargs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_embeddings={self.num_embeddings}, bias={self.bias is not None}"
