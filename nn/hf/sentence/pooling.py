"""sentence-transformers' Pooling on packed tokens, for :mod:`ragged.nn.hf.sentence`.

The converted Transformer writes ``features["ragged_token_embeddings"]`` (a
:class:`TokenEmbeddings`); a converted Pooling (:class:`RaggedPooling`) reduces it with
:func:`ragged.pool` to the values sentence-transformers' padded pooling gives.

**weightedmean** weighs token ``j`` of a sequence by ``j + 1`` counted from where the installed
sentence-transformers counts: from the first column of the padded batch before 6.2 (a
left-padded sequence's weights start past 1), from the sequence's first token from 6.2 on.
Which one is read from the installed Pooling itself, once per process
(:func:`weightedmean_origin`), so the converted model follows whatever version is installed.

**Replicas** (``torch.nn.DataParallel``): :class:`Replicate` remakes a patched module's patches for
each replica, and a replica of the SentenceTransformer gets a :class:`ReplicaForward`.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
from torch import nn

import ragged
from ragged import RaggedTensor
from ragged.padding import PaddedLayout

__all__ = [
    "TOKENS_KEY",
    "RaggedPooling",
    "Replicate",
    "ReplicaForward",
    "TokenEmbeddings",
    "pool_tokens",
    "set_patches",
    "weightedmean_origin",
]

TOKENS_KEY = "ragged_token_embeddings"


class TokenEmbeddings:
    """``features["ragged_token_embeddings"]``: ``rt``, the Transformer's token embeddings as a
    RaggedTensor ``[T, d]``; ``layout``, where they sat in the padded batch; ``padded``, the
    padded ``features["token_embeddings"]`` written with them (None when none was).
    ``tokens[b]`` is sequence ``b``'s ``[L_b, d]``."""

    __slots__ = ("rt", "layout", "padded")

    def __init__(self, rt: RaggedTensor, layout: PaddedLayout, padded: torch.Tensor | None) -> None:
        self.rt, self.layout, self.padded = rt, layout, padded

    def __getitem__(self, index):
        return self.rt[index]

    def columns(self) -> torch.Tensor:
        """``[T]`` int64: each token's column in the padded batch."""
        return self.layout.positions(self.rt)

    def from_first(self) -> torch.Tensor:
        """``[T]`` int64: each token's column counted from its sequence's first token's column
        (its position in the sequence, unless the padding mask had holes inside the sequence)."""
        if self.layout.side != "scattered":
            return self.rt.position_ids()
        columns = self.columns()
        # offsets, not offsets[:-1]: the spare rows of a graphed bucket have sequence id B
        first = self.rt.offsets.to(torch.int64).index_select(0, self.rt.seq_ids())
        return columns - columns.index_select(0, first)

    def __repr__(self) -> str:
        return f"TokenEmbeddings({self.rt!r}, side={self.layout.side!r})"


_ORIGIN: list[str] = []  # the installed Pooling's answer, once known


def weightedmean_origin() -> str:
    """Where the installed sentence-transformers' ``weightedmean`` counts a token's weight from:
    ``"column"`` (the padded batch's first column: before 6.2) or ``"sequence"`` (the sequence's
    first token: 6.2 on). Read from its Pooling on one left-padded row of 0, 0, 1 (float64, on
    the host, once per process): weights 2, 3 give 3/5; weights 1, 2 give 2/3."""
    if _ORIGIN:
        return _ORIGIN[0]
    from sentence_transformers.sentence_transformer.modules import Pooling

    x = torch.tensor([[[0.0], [0.0], [1.0]]], dtype=torch.float64)
    features = {"token_embeddings": x, "attention_mask": torch.tensor([[0, 1, 1]])}
    with torch.no_grad():
        value = float(Pooling(1, "weightedmean")(features)["sentence_embedding"].reshape(-1)[0])
    for origin, expected in (("column", 3 / 5), ("sequence", 2 / 3)):
        if abs(value - expected) < 1e-9:
            _ORIGIN.append(origin)
            return origin
    raise NotImplementedError(
        "Pooling.forward(): the installed sentence-transformers' weightedmean weighs tokens in a way the ragged "
        f"pooling does not know (a left-padded row of 0, 0, 1 pools to {value!r}, neither 3/5 nor 2/3)"
    )


class Replicate:
    """The instance ``_replicate_for_data_parallel`` of a module that conversion patched.
    ``torch.nn.parallel.replicate`` (DataParallel) calls it on every module and gives each
    replica its own parameters, but the replica's ``__dict__`` is a shallow copy: its patches
    would hold this module and run its parameters. Each patch (an instance attribute with a
    ``for_replica`` method, which gives the replica's patches by name) is remade for the replica."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self) -> nn.Module:
        module = self.module
        replica = type(module)._replicate_for_data_parallel(module)
        patches = {}
        for value in list(module.__dict__.values()):
            if callable(getattr(type(value), "for_replica", None)):  # the type's: no instance __getattr__
                patches.update(value.for_replica(replica))
        set_patches(replica, patches)
        return replica

    def __repr__(self) -> str:
        return "Replicate()"


class ReplicaForward:
    """The ``forward`` of a DataParallel replica of a converted SentenceTransformer: the model's
    own, its output less ``"ragged_token_embeddings"``. DataParallel gathers the replicas'
    outputs key by key (tensors concatenated on one device); packed tokens of a part of the
    batch have no such concatenation (padded ``token_embeddings``, where written, do)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, *args, **kwargs):
        out = type(self.model).forward(self.model, *args, **kwargs)
        if isinstance(out, MutableMapping):
            out.pop(TOKENS_KEY, None)
        return out

    def for_replica(self, replica: nn.Module) -> dict:
        return {"forward": ReplicaForward(replica)}

    def __repr__(self) -> str:
        return "ReplicaForward()"


def set_patches(module: nn.Module, patches: dict) -> list[str]:
    """Set ``patches`` (name -> patch of ``module``) as instance attributes of ``module``, with a
    :class:`Replicate` of its own; the names set, for undoing."""
    for name, patch in patches.items():
        module.__dict__[name] = patch
    names = list(patches)
    current = module.__dict__.get("_replicate_for_data_parallel")
    if names and not (isinstance(current, Replicate) and current.module is module):
        module.__dict__["_replicate_for_data_parallel"] = Replicate(module)
        names.append("_replicate_for_data_parallel")
    return names


class RaggedPooling:
    """The ``forward`` of a converted Pooling module: see :mod:`ragged.nn.hf.sentence`."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def for_replica(self, replica: nn.Module) -> dict:
        return {"forward": RaggedPooling(replica)}

    def __call__(self, features: dict, **kwargs) -> dict:
        tokens = features.get(TOKENS_KEY) if isinstance(features, MutableMapping) else None
        if not isinstance(tokens, TokenEmbeddings) or features.get("token_embeddings") is not tokens.padded:
            return type(self.module).forward(self.module, features, **kwargs)
        features["sentence_embedding"] = pool_tokens(self.module, tokens, features)
        return features

    def __repr__(self) -> str:
        return "RaggedPooling()"


def pool_tokens(pooling: nn.Module, tokens: TokenEmbeddings, features: dict) -> torch.Tensor:
    """``[B, modes * d]``: ``pooling``'s modes over the packed tokens, concatenated in its order
    (the installed sentence-transformers' values; ``cls_token_embeddings`` and
    ``token_weights_sum`` in the features are used as sentence-transformers uses them)."""
    rt = tokens.rt
    x = rt.values
    modes = (pooling.pooling_mode,) if isinstance(pooling.pooling_mode, str) else tuple(pooling.pooling_mode)
    prompt = None  # the prompt is left out with include_prompt=False and its length given (an int, or a
    if not pooling.include_prompt and "prompt_length" in features:  # tensor read once, as sentence-transformers does)
        pl = features["prompt_length"]
        prompt = int(pl[0].item()) if isinstance(pl, torch.Tensor) else int(pl)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # sums and divisions
    lengths = rt.lengths.to(torch.int64)
    keep = None if prompt is None else rt.position_ids() >= prompt  # [T] tokens pooled
    weights_sum = features.get("token_weights_sum")
    count = None  # [B, 1] in acc: tokens pooled
    out = []
    for mode in modes:
        if mode == "cls":
            if "cls_token_embeddings" in features:
                out.append(features["cls_token_embeddings"])
            elif keep is None:
                out.append(ragged.pool(rt, "first"))
            else:
                out.append(_first_kept(x, rt, lengths, prompt))
        elif mode == "lasttoken":
            last = ragged.pool(rt, "last")
            out.append(last if keep is None else last * (lengths > prompt).unsqueeze(1).to(last.dtype))
        elif mode == "max":
            v = x if keep is None else x.masked_fill(~keep.unsqueeze(1), float("-inf"))
            out.append(ragged.pool(rt.with_values(v), "max"))
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            if keep is None and weights_sum is None and mode == "mean":
                out.append(ragged.pool(rt, "mean"))
                continue
            v = x if keep is None else x * keep.unsqueeze(1).to(x.dtype)
            total = ragged.pool(rt.with_values(v), "sum").to(acc)
            if count is None:
                if weights_sum is not None:
                    count = weights_sum.to(acc).unsqueeze(1)
                elif keep is None:
                    count = lengths.to(acc).unsqueeze(1)
                else:
                    count = ragged.pool(rt.with_values(keep.to(acc).unsqueeze(1)), "sum")
                count = count.clamp(min=1e-9)
            out.append((total / (count if mode == "mean" else count.sqrt())).to(x.dtype))
        elif mode == "weightedmean":
            # a left-out prompt keeps the other tokens' weights, in every version
            where = tokens.columns() if weightedmean_origin() == "column" else tokens.from_first()
            w = ((where + 1).to(acc) * (1 if keep is None else keep)).unsqueeze(1)
            total = ragged.pool(rt.with_values(x.to(acc) * w), "sum")
            norm = (
                weights_sum.to(acc).unsqueeze(1) if weights_sum is not None else ragged.pool(rt.with_values(w), "sum")
            )
            out.append((total / norm.clamp(min=1e-9)).to(x.dtype))
        else:
            raise NotImplementedError(
                f"Pooling.forward(): pooling mode {mode!r} is not supported by the ragged "
                f"pooling (supported: {', '.join(type(pooling).POOLING_MODES)})"
            )
    return out[0] if len(out) == 1 else torch.cat(out, dim=-1)


def _first_kept(x: torch.Tensor, rt: RaggedTensor, lengths: torch.Tensor, prompt: int) -> torch.Tensor:
    """``[B, d]``: each sequence's first token past the prompt, as sentence-transformers picks it;
    its first token when the prompt covers it all (sentence-transformers: column 0, padding when
    left-padded); zeros for an empty sequence."""
    if x.shape[0] == 0:
        return x.new_zeros((rt.batch_size, *x.shape[1:]))
    start = rt.offsets[:-1].to(torch.int64)
    index = start + torch.where(lengths > prompt, prompt, 0)
    row = x.index_select(0, index.clamp(max=x.shape[0] - 1))
    return row * (lengths > 0).unsqueeze(1).to(x.dtype)
