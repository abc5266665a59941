"""RaggedLogits: the logits of a projection onto per-sequence candidate vocabularies.

Layout (shared with :mod:`ragged.ops.vocab` and its kernels). Sequence ``b`` has ``T_b``
tokens (``offsets``, the hidden states' offsets) and ``V_b`` candidate ids
(``ids[vocab_offsets[b]:vocab_offsets[b+1]]``, sorted and unique; with a vocabulary
shared by the whole batch ``vocab_offsets`` is None and every ``V_b = S = ids.numel()``).
Its logits form a ``[T_b, V_b]`` block stored row-major from ``logit_offsets[b]`` of the
flat ``values``::

    logit_offsets[b] = sum_{j<b} T_j * V_j          (int64, [B+1], on the device)
    values[logit_offsets[b] + t * V_b + c] = logit of token t of sequence b, candidate c

so the row of every packed token is contiguous, and the rows follow the packed token
order. Every method is vectorised over the batch (index tensors built from the offsets: each
token's sequence by ``searchsorted``, each logit's token by ``repeat_interleave(...,
output_size=...)`` of the row lengths) and reads nothing from the device: sizes come from host
ints kept alongside (``num_tokens``, ``values.numel()``).

Rows past ``offsets[-1]`` (the spare rows of a graphed bucket) belong to no sequence: with
per-sequence vocabularies they have no candidates and no logits; with a shared vocabulary they
have their ``S`` logits like any row (a per-token GEMM), which :meth:`RaggedLogits.to_padded`
leaves out.
"""

from __future__ import annotations

import dataclasses

import torch

from .utils import check_tensor, describe

_NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True, eq=False)
class Coords:
    """Index tensors of a logits layout (all int64, on the device).

    Per packed token (``[T]``): ``seq`` its sequence (``B`` for a row past ``offsets[-1]``),
    ``row_start`` the flat index of its first logit, ``row_len`` its number of candidates
    ``V_b``, ``first_id`` the index in ``ids`` of its sequence's first candidate. Per flat
    logit (``[total]``): ``token`` and ``cand`` (its candidate's position within the
    sequence's list)."""

    seq: torch.Tensor
    row_start: torch.Tensor
    row_len: torch.Tensor
    first_id: torch.Tensor
    token: torch.Tensor
    cand: torch.Tensor


def layout_coords(
    h_off: torch.Tensor, v_off: torch.Tensor | None, l_off: torch.Tensor, num_ids: int, num_tokens: int, total: int
) -> Coords:
    """:class:`Coords` of a layout, from the device offsets and host sizes (no sync).

    A row past ``offsets[-1]`` gets the sequence ``B``, found by a search of the offsets: per
    entry ``B`` of the tables below it has no candidates (per-sequence vocabularies; its row
    starts at ``l_off[B]``, the end of the logits) or the ``S`` shared ones (at ``t * S``)."""
    device = h_off.device
    h = h_off.to(torch.int64)
    batch = h.shape[0] - 1
    position = torch.arange(num_tokens, device=device)
    seq = torch.searchsorted(h[1:], position, right=True)
    # per sequence b in [0, B]: V_b, and the first logit of its row 0 (l_off[b] - h_off[b] * V_b)
    if v_off is None:
        v_len = torch.full((batch + 1,), num_ids, dtype=torch.int64, device=device)
        first_id = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    else:
        v = v_off.to(torch.int64)
        v_len = torch.cat([torch.diff(v), v.new_zeros(1)])
        first_id = v[seq]
    row_len = v_len[seq]
    # token t of sequence b starts at l_off[b] + (t - h_off[b]) * V_b
    row_start = (l_off.to(torch.int64) - h * v_len)[seq] + position * row_len
    token = torch.repeat_interleave(position, row_len, output_size=total)
    cand = torch.arange(total, device=device) - row_start[token]
    return Coords(seq, row_start, row_len, first_id, token, cand)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other dtype is reduced in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def segment_logsumexp(x: torch.Tensor, token: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[T]`` log-sum-exp of each token's row of the flat ``x`` (``-inf`` for an empty row).

    Differentiable in ``x``; the row maximum is only a shift (detached)."""
    xd = x.detach()
    m = xd.new_full((num_tokens,), _NEG_INF).scatter_reduce(0, token, xd, "amax", include_self=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=m.dtype, device=m.device))
    s = x.new_zeros(num_tokens).index_add(0, token, torch.exp(x - m[token]))
    return m + torch.log(s)


def segmented_cross_entropy(
    values: torch.Tensor,
    num_tokens: int,
    coords: Coords | None,
    shared_size: int | None,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy over each token's candidates and the log-normaliser of each
    token's row: ``(loss [T], lse [T])`` in the compute dtype (``lse`` is ``-inf`` for a token
    without candidates).

    ``target``: ``[T]`` int64 *local* candidate index of each token's target, ``-1`` for a
    token without one (its loss is 0). With label smoothing ``eps`` the loss of a token is
    ``(1 - eps) * nll + eps * mean over its candidates of -log p`` (``F.cross_entropy``'s
    rule with the token's candidates as the classes). A shared vocabulary of ``S`` ids
    (``shared_size``; ``coords`` may be None) takes a dense ``[T, S]`` path; otherwise
    ``coords`` are the layout's :class:`Coords`. Differentiable in ``values``."""
    total = values.shape[0]
    x = values.to(compute_dtype(values.dtype))
    valid = target >= 0
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if total == 0:  # no token has a candidate: every loss is 0 (still part of the graph)
        return x.new_zeros(num_tokens) + x.sum(), x.new_full((num_tokens,), _NEG_INF)
    safe = torch.where(valid, target, torch.zeros_like(target))
    mean = None
    if shared_size is not None:
        rows = x.view(num_tokens, shared_size)
        lse = torch.logsumexp(rows, dim=1)
        picked = rows.gather(1, safe.unsqueeze(1)).squeeze(1)
        if label_smoothing:
            mean = rows.mean(dim=1)
    else:
        lse = segment_logsumexp(x, coords.token, num_tokens)
        picked = x[torch.where(valid, coords.row_start + safe, torch.zeros_like(safe))]
        if label_smoothing:
            sums = x.new_zeros(num_tokens).index_add(0, coords.token, x)
            mean = sums / coords.row_len.clamp_min(1).to(x.dtype)
    loss = lse - picked
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - mean)
    return torch.where(valid, loss, zero), lse


class RaggedLogits:
    """Flat logits of a varying-vocabulary projection (see the module docstring).

    Built by :func:`ragged.vocab_projection`; the plain constructor trusts its arguments.

    * ``values``: ``[total]``, ``total = sum_b T_b * V_b``;
    * ``offsets``: the hidden states' offsets ``[B+1]``; ``num_tokens``: ``T`` (host int);
      ``max_len``: the longest sequence (host int);
    * ``ids``: the candidate ids (``[sum_b V_b]``, or ``[S]`` when shared);
      ``vocab_offsets``: ``[B+1]`` or None (shared); ``max_candidates``: ``max_b V_b``;
    * ``logit_offsets``: int64 ``[B+1]``; ``num_embeddings``: ``V``, the full vocabulary.
    """

    __slots__ = (
        "values",
        "offsets",
        "num_tokens",
        "max_len",
        "ids",
        "vocab_offsets",
        "max_candidates",
        "logit_offsets",
        "num_embeddings",
        "_host_offsets",
        "_host_vocab_offsets",
        "_cache",
    )

    def __init__(
        self,
        values: torch.Tensor,
        offsets: torch.Tensor,
        num_tokens: int,
        max_len: int,
        ids: torch.Tensor,
        vocab_offsets: torch.Tensor | None,
        max_candidates: int,
        logit_offsets: torch.Tensor,
        num_embeddings: int,
        host_offsets: tuple[int, ...] | None = None,
        host_vocab_offsets: tuple[int, ...] | None = None,
    ):
        self.values = values
        self.offsets = offsets
        self.num_tokens = int(num_tokens)
        self.max_len = int(max_len)
        self.ids = ids
        self.vocab_offsets = vocab_offsets
        self.max_candidates = int(max_candidates)
        self.logit_offsets = logit_offsets
        self.num_embeddings = int(num_embeddings)
        self._host_offsets = host_offsets
        self._host_vocab_offsets = host_vocab_offsets
        self._cache: dict = {}

    # ----------------------------------------------------------------------------------
    # Metadata

    @property
    def shared(self) -> bool:
        """True when the whole batch shares one candidate list."""
        return self.vocab_offsets is None

    @property
    def batch_size(self) -> int:
        return self.offsets.shape[0] - 1

    def __len__(self) -> int:
        return self.batch_size

    def numel(self) -> int:
        """Number of logits, ``sum_b T_b * V_b``."""
        return self.values.shape[0]

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def requires_grad(self) -> bool:
        return self.values.requires_grad

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` tokens per sequence (device; no sync)."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def candidate_lengths(self) -> torch.Tensor:
        """``[B]`` candidates per sequence, ``V_b`` (device; no sync)."""
        if self.vocab_offsets is None:
            return torch.full((self.batch_size,), self.ids.shape[0], dtype=torch.int64, device=self.offsets.device)
        return self.vocab_offsets[1:] - self.vocab_offsets[:-1]

    def host_offsets(self) -> tuple[int, ...]:
        """The token offsets as Python ints (cached; one sync the first time on CUDA)."""
        if self._host_offsets is None:
            self._host_offsets = tuple(self.offsets.detach().to("cpu", torch.int64).tolist())
        return self._host_offsets

    def host_vocab_offsets(self) -> tuple[int, ...]:
        """The candidate offsets as Python ints (``b * S`` when shared; cached like :meth:`host_offsets`)."""
        if self._host_vocab_offsets is None:
            if self.vocab_offsets is None:
                size = self.ids.shape[0]
                self._host_vocab_offsets = tuple(b * size for b in range(self.batch_size + 1))
            else:
                self._host_vocab_offsets = tuple(self.vocab_offsets.detach().to("cpu", torch.int64).tolist())
        return self._host_vocab_offsets

    def _coords(self) -> Coords:
        coords = self._cache.get("coords")
        if coords is None:
            coords = layout_coords(
                self.offsets,
                self.vocab_offsets,
                self.logit_offsets,
                self.ids.shape[0],
                self.num_tokens,
                self.values.shape[0],
            )
            self._cache["coords"] = coords
        return coords

    def _element_ids(self) -> torch.Tensor:
        """``[total]`` global vocabulary id of every logit."""
        c = self._coords()
        if self.values.shape[0] == 0:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        return self.ids.to(torch.int64)[c.first_id[c.token] + c.cand]

    def __repr__(self) -> str:
        if self.shared:
            cands = f"shared_candidates={self.ids.shape[0]}"
        elif self._host_vocab_offsets is not None:
            o = self._host_vocab_offsets
            lens = [o[i + 1] - o[i] for i in range(len(o) - 1)]
            cands = (
                f"candidates={lens}"
                if len(lens) <= 8
                else f"candidates=[min {min(lens)}, mean {sum(lens) / len(lens):.1f}, max {max(lens)}]"
            )
        else:
            cands = f"max_candidates={self.max_candidates}"
        if self._host_offsets is not None and self.batch_size <= 8:
            o = self._host_offsets
            toks = f"lengths={[o[i + 1] - o[i] for i in range(len(o) - 1)]}"
        else:
            toks = f"max_len={self.max_len}"
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (
            f"RaggedLogits(batch_size={self.batch_size}, num_tokens={self.num_tokens}, {toks}, {cands}, "
            f"num_embeddings={self.num_embeddings}, numel={self.numel()}, dtype={self.dtype}, "
            f"device={self.device}{grad})"
        )

    # ----------------------------------------------------------------------------------
    # Same layout, other values

    def with_values(self, values: torch.Tensor) -> RaggedLogits:
        """Same layout, new flat ``values`` (``[total]`` on the same device)."""
        fn = "ragged.RaggedLogits.with_values"
        check_tensor(fn, "values", values)
        if values.dim() != 1 or values.shape[0] != self.numel():
            raise ValueError(f"{fn}(): expected values of shape [{self.numel()}], got {tuple(values.shape)}")
        if values.device != self.device:
            raise ValueError(f"{fn}(): expected values on {self.device}, got {values.device}")
        out = RaggedLogits(
            values,
            self.offsets,
            self.num_tokens,
            self.max_len,
            self.ids,
            self.vocab_offsets,
            self.max_candidates,
            self.logit_offsets,
            self.num_embeddings,
            self._host_offsets,
            self._host_vocab_offsets,
        )
        out._cache = self._cache  # the index tensors depend on the layout only
        return out

    def detach(self) -> RaggedLogits:
        return self.with_values(self.values.detach())

    # ----------------------------------------------------------------------------------
    # Views and dense forms

    def unbind(self) -> tuple[torch.Tensor, ...]:
        """``[T_b, V_b]`` views, one per sequence (host offsets needed: a sync when unknown)."""
        h = self.host_offsets()
        v = self.host_vocab_offsets()
        out, start = [], 0
        for b in range(self.batch_size):
            rows, cols = h[b + 1] - h[b], v[b + 1] - v[b]
            out.append(self.values[start : start + rows * cols].view(rows, cols))
            start += rows * cols
        return tuple(out)

    def to_padded(self, padding_value: float = _NEG_INF) -> torch.Tensor:
        """``[B, max_len, max_candidates]``: sequence ``b``'s ``[T_b, V_b]`` block at the top left,
        ``padding_value`` (default ``-inf``) elsewhere. Differentiable."""
        batch, width = self.batch_size, self.max_len
        if self.numel() == 0:
            return self.values.new_full((batch, width, self.max_candidates), padding_value) + self.values.sum()
        c = self._coords()
        b = c.seq[c.token]
        j = c.token - self.offsets.to(torch.int64)[b]
        if not self.shared:  # a row past offsets[-1] has no logits here
            out = self.values.new_full((batch, width, self.max_candidates), padding_value)
            return out.index_put((b, j, c.cand), self.values)
        # shared: the logits of rows past offsets[-1] (sequence B) land in a discarded block
        spare = b >= batch
        b, j = torch.where(spare, batch, b), torch.where(spare, 0, j)
        out = self.values.new_full((batch + 1, max(width, 1), self.max_candidates), padding_value)
        return out.index_put((b, j, c.cand), self.values)[:batch, :width]

    def to_full(self, fill_value: float = _NEG_INF) -> torch.Tensor:
        """``[T, num_embeddings]``: each token's logits at their global ids, ``fill_value``
        (default ``-inf``) outside its sequence's candidates; a drop-in for samplers over
        the full vocabulary. Differentiable."""
        out = self.values.new_full((self.num_tokens, self.num_embeddings), fill_value)
        if self.numel() == 0:
            return out + self.values.sum()
        if self.shared:
            rows = torch.arange(self.num_tokens, device=self.device).unsqueeze(1)
            return out.index_put(
                (rows, self.ids.to(torch.int64).unsqueeze(0)), self.values.view(self.num_tokens, self.ids.shape[0])
            )
        return out.index_put((self._coords().token, self._element_ids()), self.values)

    # ----------------------------------------------------------------------------------
    # Decoding

    def argmax(self) -> torch.Tensor:
        """``[T]`` int64 global id of each token's best candidate (the smallest id among ties;
        ``-1`` for a token whose sequence has no candidate)."""
        device = self.device
        if self.numel() == 0:
            return torch.full((self.num_tokens,), -1, dtype=torch.int64, device=device)
        ids = self.ids.to(torch.int64)
        x = self.values.detach()
        if self.shared:
            return ids[x.view(self.num_tokens, self.ids.shape[0]).argmax(dim=1)]
        c = self._coords()
        best = x.new_full((self.num_tokens,), _NEG_INF).scatter_reduce(0, c.token, x, "amax", include_self=True)
        hit = (x == best[c.token]) | torch.isnan(x)  # NaN wins, as in torch.argmax
        never = self.max_candidates
        first = torch.full((self.num_tokens,), never, dtype=torch.int64, device=device)
        first = first.scatter_reduce(0, c.token, torch.where(hit, c.cand, never), "amin", include_self=True)
        found = first < never
        pos = torch.where(found, c.first_id + first, torch.zeros_like(first))
        return torch.where(found, ids[pos], torch.full_like(first, -1))

    def topk(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores [T, k], ids [T, k])``: each token's ``k`` best candidates, best first, as
        global ids. Tokens with fewer than ``k`` candidates are padded with ``-inf`` / ``-1``.
        Differentiable in the scores."""
        fn = "ragged.RaggedLogits.topk"
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"{fn}(): expected k to be a non-negative int, got {describe(k)}")
        device, tokens = self.device, self.num_tokens
        scores = self.values.new_full((tokens, k), _NEG_INF)
        out_ids = torch.full((tokens, k), -1, dtype=torch.int64, device=device)
        if self.numel() == 0 or k == 0:
            return scores + self.values.sum(), out_ids
        ids = self.ids.to(torch.int64)
        if self.shared:
            size = self.ids.shape[0]
            top, local = torch.topk(self.values.view(tokens, size), min(k, size), dim=1)
            if k <= size:
                return top, ids[local]
            return torch.cat([top, scores[:, size:]], 1), torch.cat([ids[local], out_ids[:, size:]], 1)
        c = self._coords()
        # Best first within each token: a stable sort by value, then a stable sort by token.
        by_value = torch.argsort(self.values.detach(), descending=True, stable=True)
        order = by_value[torch.argsort(c.token[by_value], stable=True)]
        # Sorted by token, the rows keep their places: position e is rank e - row_start of its token.
        rank = torch.arange(self.numel(), device=device) - c.row_start[c.token]
        slot = rank.clamp(max=k)  # rank >= k lands in a discarded column
        padded_scores = self.values.new_full((tokens, k + 1), _NEG_INF)
        padded_ids = torch.full((tokens, k + 1), -1, dtype=torch.int64, device=device)
        padded_scores = padded_scores.index_put((c.token, slot), self.values[order])
        chosen = c.first_id[c.token] + c.cand[order]
        padded_ids = padded_ids.index_put((c.token, slot), ids[chosen])
        return padded_scores[:, :k], padded_ids[:, :k]

    # ----------------------------------------------------------------------------------
    # Normalisation

    def logsumexp(self) -> torch.Tensor:
        """``[T]`` log-normaliser over each token's candidates (compute dtype: float32, or
        float64 for float64 logits; ``-inf`` for a token without candidates)."""
        x = self.values.to(compute_dtype(self.dtype))
        if self.shared:
            if self.ids.shape[0] == 0:
                return x.new_full((self.num_tokens,), _NEG_INF)
            return torch.logsumexp(x.view(self.num_tokens, self.ids.shape[0]), dim=1)
        return segment_logsumexp(x, self._coords().token, self.num_tokens)

    def log_softmax(self) -> RaggedLogits:
        """Log-probabilities normalised over each token's candidates (same layout and dtype;
        computed in float32). Differentiable."""
        x = self.values.to(compute_dtype(self.dtype))
        if self.numel() == 0:
            return self.with_values(self.values * 1)
        if self.shared:
            out = torch.log_softmax(x.view(self.num_tokens, self.ids.shape[0]), dim=1).reshape(-1)
        else:
            out = x - segment_logsumexp(x, self._coords().token, self.num_tokens)[self._coords().token]
        return self.with_values(out.to(self.dtype))

    def softmax(self) -> RaggedLogits:
        """Probabilities over each token's candidates (``exp`` of :meth:`log_softmax`)."""
        x = self.values.to(compute_dtype(self.dtype))
        if self.numel() == 0:
            return self.with_values(self.values * 1)
        if self.shared:
            out = torch.softmax(x.view(self.num_tokens, self.ids.shape[0]), dim=1).reshape(-1)
        else:
            out = torch.exp(x - segment_logsumexp(x, self._coords().token, self.num_tokens)[self._coords().token])
        return self.with_values(out.to(self.dtype))


# --------------------------------------------------------------------------------------
# pytree: RaggedLogits crosses torch.compile boundaries like RaggedTensor.


def _flatten(lg: RaggedLogits):
    children = [lg.values, lg.offsets, lg.ids, lg.vocab_offsets, lg.logit_offsets]
    context = (
        lg.num_tokens,
        lg.max_len,
        lg.max_candidates,
        lg.num_embeddings,
        lg._host_offsets,
        lg._host_vocab_offsets,
    )
    return children, context


def _unflatten(children, context):
    values, offsets, ids, v_off, l_off = children
    num_tokens, max_len, max_candidates, num_embeddings, host, host_v = context
    return RaggedLogits(
        values, offsets, num_tokens, max_len, ids, v_off, max_candidates, l_off, num_embeddings, host, host_v
    )


def _flatten_with_keys(lg: RaggedLogits):
    from torch.utils._pytree import GetAttrKey

    children, context = _flatten(lg)
    names = ("values", "offsets", "ids", "vocab_offsets", "logit_offsets")
    return [(GetAttrKey(n), c) for n, c in zip(names, children)], context


def _register() -> None:
    import torch.utils._pytree as pytree

    try:
        pytree.register_pytree_node(
            RaggedLogits,
            _flatten,
            _unflatten,
            serialized_type_name="ragged.RaggedLogits",
            flatten_with_keys_fn=_flatten_with_keys,
        )
    except TypeError:  # older torch without flatten_with_keys_fn
        pytree.register_pytree_node(RaggedLogits, _flatten, _unflatten)


_register()
