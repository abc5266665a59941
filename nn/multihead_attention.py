"""MultiheadAttention with torch.nn.MultiheadAttention's signature, parameters and state_dict keys,
computed padding-free through :func:`ragged.attention`.

Also home of the small helpers the transformer modules share for padded inputs: checking and
reading a key padding mask once (:func:`pack_padded`, over :mod:`ragged.padding`, which also
holds :class:`PaddedLayout`) and recognising a causal attention mask (:func:`causal_flag`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from ragged import RaggedTensor, attention, pack
from ragged.padding import PaddedLayout, mask_keep, pack_by_layout, read_mask_layout
from ragged.utils import describe

from .accept import adopt, attention_features, module_attention_features
from .layer import attention_dtype

# --------------------------------------------------------------------------------------
# Padded inputs: one read of the key padding mask, then packed with host lengths


def check_padding_mask(fn: str, name: str, mask: object, batch: int, width: int) -> torch.Tensor:
    """Host-only checks of a torch-convention key padding mask ``[B, M]``."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{fn}(): expected {name} to be a torch.Tensor, got {describe(mask)}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(
            f"{fn}(): expected {name} of dtype bool (True = padding) or floating point "
            f"(-inf = padding, 0 = token), got {mask.dtype}"
        )
    if tuple(mask.shape) != (batch, width):
        raise ValueError(
            f"{fn}(): expected {name} of shape ({batch}, {width}) (batch, sequence length), got {tuple(mask.shape)}"
        )
    return mask


def pack_padded(fn: str, name: str, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[RaggedTensor, PaddedLayout]:
    """Pack batch-first ``x [B, M, ...]`` given a checked key padding mask (or none: every row full).

    A mask costs one device-to-host read (its lengths, whether it is right or left
    padded, and whether a float mask holds anything but 0 and -inf); the pack itself then
    runs from host lengths. Masks whose tokens are not one run at either end of each row
    are gathered with a boolean index (slower, still exact).
    """
    width = x.shape[1]
    if mask is None:
        return pack(x), PaddedLayout(width)
    if mask.device != x.device:
        raise ValueError(f"{fn}(): expected {name} on {x.device} (the device of the input), got {mask.device}")
    keep, bad = mask_keep(fn, name, mask, "torch")
    # The one read of a padded call: lengths and layout flags together.
    host, is_right, is_left, is_bad = read_mask_layout(keep, bad)
    if is_bad:
        raise NotImplementedError(
            f"{fn}(): a float {name} must hold 0 (token) or -inf (padding); additive "
            "biases of other values are not supported (use a bool mask, True = padding)"
        )
    return pack_by_layout(x, keep, host, is_right, is_left)


# --------------------------------------------------------------------------------------
# Attention masks: none, or causal


def check_attn_mask(fn: str, name: str, mask: object) -> torch.Tensor:
    """Host-only checks of a dense attention mask: a tensor, bool or float, 2-D."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{fn}(): expected {name} to be a torch.Tensor, got {describe(mask)}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(
            f"{fn}(): expected {name} of dtype bool (True = masked) or floating point (-inf = masked), got {mask.dtype}"
        )
    if mask.dim() != 2:
        raise NotImplementedError(
            f"{fn}(): {name} of shape {tuple(mask.shape)} is not supported: ragged takes "
            f"no {name}, a square 2-D causal mask, or is_causal=True"
        )
    return mask


def causal_flag(
    fn: str, name: str, mask: torch.Tensor | None, is_causal, rows: int, cols: int, at_least: bool = False
) -> bool:
    """Whether attention is causal, from torch.nn's ``mask`` / ``is_causal`` pair.

    * ``is_causal=True``: causal, trusted as in torch.nn (``mask``'s shape is still checked,
      its values are not read).
    * otherwise, with a ``mask``: it must be a square causal mask (bool with True exactly
      above the diagonal, or float with -inf above the diagonal and 0 elsewhere); checking
      its values costs one device-to-host read. Any other mask raises NotImplementedError.
    * no mask: not causal.

    ``rows``/``cols``: the expected ``[L, S]`` (with ``at_least``, lower bounds of a square
    mask: RaggedTensor inputs have no padded length).
    """
    if mask is None:
        return bool(is_causal)
    check_attn_mask(fn, name, mask)
    size = tuple(mask.shape)
    if at_least:
        if size[0] != size[1] or size[0] < max(rows, cols):
            raise ValueError(
                f"{fn}(): expected a square {name} of size at least the longest sequence "
                f"({max(rows, cols)}), got {size}"
            )
    elif size != (rows, cols):
        raise ValueError(f"{fn}(): expected {name} of shape ({rows}, {cols}), got {size}")
    if is_causal is True:
        return True
    if size[0] != size[1]:
        raise NotImplementedError(
            f"{fn}(): {name} of shape {size} is not a square causal mask; ragged takes "
            f"no {name}, a square causal mask, or is_causal=True"
        )
    above = torch.ones(size, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        ok = (mask == above).all()
    else:
        ok = ((mask == 0) | above).all() & (torch.isneginf(mask) | ~above).all()
    if not bool(ok):  # one device-to-host read; pass is_causal=True to skip it
        raise NotImplementedError(
            f"{fn}(): {name} is not a causal mask. ragged supports no {name}, a causal {name} (bool: True "
            "exactly above the diagonal; float: -inf above the diagonal and 0 elsewhere) or is_causal=True; "
            "other dense attention masks are not supported (express padding through the key padding mask "
            "or a RaggedTensor)"
        )
    return True


def to_batch_first(x: torch.Tensor, batch_first: bool) -> torch.Tensor:
    return x if batch_first else x.transpose(0, 1)


def from_batch_first(x: torch.Tensor, batch_first: bool) -> torch.Tensor:
    return x if batch_first else x.transpose(0, 1).contiguous()


# --------------------------------------------------------------------------------------
# The module


class MultiheadAttention(nn.Module):
    """``torch.nn.MultiheadAttention`` computed padding-free.

    Same constructor, parameters (``in_proj_weight``/``in_proj_bias``/``out_proj``, or
    ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` when ``kdim``/``vdim`` differ from
    ``embed_dim``), initialisation and ``state_dict`` keys; ``add_bias_kv`` and
    ``add_zero_attn`` are not supported.

    ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False)`` takes

    * RaggedTensors (``values [T, E]``; ``key`` and ``value`` with the same sequences,
      ``query`` with the same batch size, for self or cross attention) and returns a
      RaggedTensor with ``query``'s sequences; or
    * padded tensors as torch.nn does (``[B, L, E]`` with ``batch_first``, else ``[L, B, E]``;
      unbatched ``[L, E]``) with an optional ``key_padding_mask [B, S]`` (bool, True =
      padding, or float, -inf = padding). When ``query``, ``key`` and ``value`` are one
      tensor the mask applies to the queries too and their padded rows come out as zeros;
      otherwise every query row is computed.

    Masks: ``attn_mask`` may only be a causal mask (see :func:`causal_flag`; reading it costs
    one device-to-host read, ``is_causal=True`` skips it); ``is_causal=True`` alone is enough
    (torch.nn requires the mask as well). Causal masking is aligned to the bottom right of each
    sequence pair (``ragged.attention``), which is torch's mask whenever query and key
    sequences have the same lengths; causal cross-attention on padded inputs is therefore
    refused (pass RaggedTensors). A query whose keys are all padding gets zeros (torch.nn
    gives NaN).

    ``need_weights=True`` (torch's default) also returns the attention probabilities,
    computed explicitly in the padded layout (``[B, L, S]``, or ``[B, H, L, S]`` without
    ``average_attn_weights``; zeros at padding): a dense, memory-hungry extra, taken before
    attention dropout. Pass ``need_weights=False`` for ``(output, None)``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        fn = "ragged.nn.MultiheadAttention"
        unsupported = attention_features(add_bias_kv, add_zero_attn)
        if unsupported:
            raise NotImplementedError(f"{fn}(): {unsupported} is not supported")
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"{fn}(): expected embed_dim and num_heads > 0, got embed_dim={embed_dim} and num_heads={num_heads}"
            )
        if embed_dim % num_heads:
            raise ValueError(f"{fn}(): expected embed_dim ({embed_dim}) divisible by num_heads ({num_heads})")
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty((3 * embed_dim, embed_dim), **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory))
            self.k_proj_weight = nn.Parameter(torch.empty((embed_dim, self.kdim), **factory))
            self.v_proj_weight = nn.Parameter(torch.empty((embed_dim, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory)
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch.nn.MultiheadAttention's initialisation."""
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    @classmethod
    def from_torch(
        cls, module: nn.MultiheadAttention, *, copy: bool = False, memo: dict | None = None
    ) -> MultiheadAttention:
        """The ragged module for ``module``: same configuration, same training mode.

        ``copy=False`` shares ``module``'s Parameter objects (``out_proj``'s included): training
        either trains both. ``copy=True`` gives the new module its own copies (on the same
        device and dtype). ``memo``: a ``copy.deepcopy`` memo shared across one conversion.
        """
        fn = "ragged.nn.MultiheadAttention.from_torch"
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"{fn}(): expected a torch.nn.MultiheadAttention, got {type(module).__name__}")
        unsupported = module_attention_features(module)
        if unsupported:
            raise NotImplementedError(f"{fn}(): modules built with {unsupported} are not supported")
        shell = cls(
            module.embed_dim,
            module.num_heads,
            dropout=module.dropout,
            bias=module.in_proj_bias is not None,
            kdim=module.kdim,
            vdim=module.vdim,
            batch_first=module.batch_first,
            device="meta",
        )
        return adopt(fn, shell, module, copy, memo)

    # ----------------------------------------------------------------------------------
    # Packed computation

    def _project(self, query: RaggedTensor, key: RaggedTensor, value: RaggedTensor):
        """q, k, v ``values [T, H, D]`` (one GEMM for self-attention, two for shared key/value)."""
        e, h, d = self.embed_dim, self.num_heads, self.head_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:e], b[e : 2 * e], b[2 * e :])
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            if query is key and key is value:
                qkv = F.linear(query.values, w, b).view(-1, 3, h, d)
                return qkv.unbind(1)
            q = F.linear(query.values, w[:e], bq)
            if key is value:
                k, v = F.linear(key.values, w[e:], None if b is None else b[e:]).view(-1, 2, h, d).unbind(1)
            else:
                k = F.linear(key.values, w[e : 2 * e], bk).view(-1, h, d)
                v = F.linear(value.values, w[2 * e :], bv).view(-1, h, d)
            return q.view(-1, h, d), k, v
        q = F.linear(query.values, self.q_proj_weight, bq)
        k = F.linear(key.values, self.k_proj_weight, bk)
        v = F.linear(value.values, self.v_proj_weight, bv)
        return q.view(-1, h, d), k.view(-1, h, d), v.view(-1, h, d)

    def _attend(self, query: RaggedTensor, key: RaggedTensor, value: RaggedTensor, causal: bool):
        """``(output RaggedTensor, q, k)``: projections, ragged.attention, output projection."""
        q, k, v = self._project(query, key, value)
        kr = key.with_values(k)
        vr = kr.with_values(v) if value is key else value.with_values(v)
        p = self.dropout if self.training else 0.0
        with attention_dtype(q):  # the layer core's rule under autocast
            out = attention(query.with_values(q), kr, vr, causal=causal, dropout_p=p)
        y = F.linear(out.values.reshape(-1, self.embed_dim), self.out_proj.weight, self.out_proj.bias)
        return query.with_values(y), q, k

    def _weights(
        self,
        q,
        k,
        query: RaggedTensor,
        key: RaggedTensor,
        q_layout: PaddedLayout,
        k_layout: PaddedLayout,
        causal: bool,
        average: bool,
    ) -> torch.Tensor:
        """Attention probabilities ``[B, H, L, S]`` in the padded layout (zeros at padding)."""
        batch, h = query.batch_size, self.num_heads
        lq, lk = q_layout.width, k_layout.width
        sq, sk = query.seq_ids(), key.seq_ids()
        pq, pk = q_layout.positions(query), k_layout.positions(key)
        # one row more than the batch, dropped after the scatter: the spare rows of a graphed
        # bucket (past offsets[-1]) have sequence id B and land there, never out of range
        qp = q.new_zeros((batch + 1, lq, h, self.head_dim)).index_put((sq, pq), q)[:batch]
        kp = k.new_zeros((batch + 1, lk, h, self.head_dim)).index_put((sk, pk), k)[:batch]
        scores = torch.einsum("bihd,bjhd->bhij", qp, kp) * (1.0 / math.sqrt(self.head_dim))
        # rank of each token within its sequence, -1 at padding
        rq = torch.full((batch + 1, lq), -1, dtype=torch.int64, device=q.device).index_put(
            (sq, pq), query.position_ids()
        )[:batch]
        rk = torch.full((batch + 1, lk), -1, dtype=torch.int64, device=k.device).index_put(
            (sk, pk), key.position_ids()
        )[:batch]
        allowed = (rq >= 0)[:, None, :, None] & (rk >= 0)[:, None, None, :]
        if causal:
            shift = (key.lengths - query.lengths).to(torch.int64)[:, None, None, None]
            allowed = allowed & (rk[:, None, None, :] <= rq[:, None, :, None] + shift)
        probs = torch.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1)
        probs = torch.where(allowed, probs, torch.zeros((), dtype=probs.dtype, device=probs.device))
        return probs.mean(1) if average else probs

    # ----------------------------------------------------------------------------------

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ):
        fn = "ragged.nn.MultiheadAttention.forward"
        is_ragged = [isinstance(t, RaggedTensor) for t in (query, key, value)]
        if any(is_ragged):
            if not all(is_ragged):
                raise TypeError(
                    f"{fn}(): expected query, key and value all RaggedTensors or all padded tensors, "
                    f"got {', '.join(type(t).__name__ for t in (query, key, value))}"
                )
            return self._forward_ragged(
                fn, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
        return self._forward_padded(
            fn, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
        )

    def _forward_ragged(self, fn, query, key, value, key_padding_mask, need_weights, attn_mask, average, is_causal):
        if key_padding_mask is not None:
            raise ValueError(
                f"{fn}(): key_padding_mask applies to padded inputs; a RaggedTensor carries its own lengths"
            )
        for name, t, dim in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if t.values.dim() != 2 or t.values.shape[1] != dim:
                raise ValueError(
                    f"{fn}(): expected {name} with values of shape [T, {dim}], got {tuple(t.values.shape)}"
                )
        if query.batch_size != key.batch_size or key.batch_size != value.batch_size:
            raise ValueError(
                f"{fn}(): expected query, key and value with the same batch size, got "
                f"{query.batch_size}, {key.batch_size} and {value.batch_size}"
            )
        if key.num_tokens != value.num_tokens:
            raise ValueError(
                f"{fn}(): expected key and value with the same sequences, got {key.num_tokens} and "
                f"{value.num_tokens} tokens"
            )
        causal = causal_flag(fn, "attn_mask", attn_mask, is_causal, query.max_len, key.max_len, at_least=True)
        out, q, k = self._attend(query, key, value, causal)
        if not need_weights:
            return out, None
        weights = self._weights(
            q, k, query, key, PaddedLayout(query.max_len), PaddedLayout(key.max_len), causal, average
        )
        return out, weights

    def _forward_padded(self, fn, query, key, value, key_padding_mask, need_weights, attn_mask, average, is_causal):
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{fn}(): expected {name} to be a torch.Tensor or a RaggedTensor, got {describe(t)}")
        batched = query.dim() == 3
        for name, t, dim in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if t.dim() != query.dim() or t.dim() not in (2, 3) or t.shape[-1] != dim:
                shape = "[B, L, " if self.batch_first else "[L, B, "
                raise ValueError(
                    f"{fn}(): expected {name} of shape {shape}{dim}] (or unbatched [L, {dim}]) like "
                    f"query, got {tuple(t.shape)}"
                )
        self_attention = query is key and key is value
        if batched:
            q = to_batch_first(query, self.batch_first)
            k = to_batch_first(key, self.batch_first)
            v = k if value is key else to_batch_first(value, self.batch_first)
        else:
            q, k = query.unsqueeze(0), key.unsqueeze(0)
            v = k if value is key else value.unsqueeze(0)
            if (
                key_padding_mask is not None
                and isinstance(key_padding_mask, torch.Tensor)
                and key_padding_mask.dim() == 1
            ):
                key_padding_mask = key_padding_mask.unsqueeze(0)
        batch, lq, lk = q.shape[0], q.shape[1], k.shape[1]
        if k.shape[0] != batch or v.shape[:2] != k.shape[:2]:
            raise ValueError(
                f"{fn}(): expected query, key and value with one batch size and key and value with "
                f"one sequence length, got {tuple(query.shape)}, {tuple(key.shape)} and "
                f"{tuple(value.shape)}"
            )
        if key_padding_mask is not None:
            check_padding_mask(fn, "key_padding_mask", key_padding_mask, batch, lk)
        causal = causal_flag(fn, "attn_mask", attn_mask, is_causal, lq, lk)
        if causal and not self_attention:
            raise NotImplementedError(
                f"{fn}(): causal cross-attention on padded inputs is not supported (torch aligns the mask to the "
                "top left of the padded grid, ragged to the bottom right of each sequence); pass RaggedTensors"
            )
        k_rt, k_layout = pack_padded(fn, "key_padding_mask", k, key_padding_mask)
        if self_attention:
            q_rt, q_layout, v_rt = k_rt, k_layout, k_rt
        else:
            q_rt, q_layout = pack(q), PaddedLayout(lq)
            v_rt = (
                k_rt
                if value is key
                else RaggedTensor(_repack(v, k_rt, k_layout), k_rt.offsets, k_rt.max_len, k_rt.known_host_offsets)
            )
        out_rt, qv, kv = self._attend(q_rt, k_rt, v_rt, causal)
        out = q_layout.unpack(out_rt)
        weights = None
        if need_weights:
            weights = self._weights(qv, kv, q_rt, k_rt, q_layout, k_layout, causal, average)
        if not batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        return from_batch_first(out, self.batch_first), weights

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
            f"batch_first={self.batch_first}"
        )


def _repack(x: torch.Tensor, like: RaggedTensor, layout: PaddedLayout) -> torch.Tensor:
    """``values`` of batch-first ``x`` packed exactly as ``like`` was (no further read)."""
    if layout.side == "scattered":
        return x[layout.index]
    host = like.host_lengths()  # known on the host after pack_padded: no read
    return pack(x, lengths=host, padding_side=layout.side).values
