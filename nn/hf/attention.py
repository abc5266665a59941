"""ragged as a transformers attention implementation: ``attn_implementation="ragged"``.

:func:`register` registers :func:`attention_forward` with transformers' ``AttentionInterface``
and :func:`padding_mask` with its ``AttentionMaskInterface`` under the name ``"ragged"``. Importing
:mod:`ragged.integrations.transformers` does it, the way in for any transformers model, and so
does converting a sentence-transformers model over a decoder (:mod:`ragged.nn.hf.decoder` runs it
under this implementation). This module imports transformers; ``import ragged`` and ``import
ragged.nn`` do not import it::

    import ragged.integrations.transformers
    lm = AutoModelForCausalLM.from_pretrained(path, attn_implementation="ragged")
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(examples)
    lm(**batch).loss.backward()        # padding-free, on ragged.varlen_attention

Any model whose attention layers call ``ALL_ATTENTION_FUNCTIONS.get_interface(...)`` (Llama,
Qwen2, Mistral, BERT, ...) runs its attention on :func:`ragged.varlen_attention`: GQA with the
key/value heads as they are (never repeated), the module's ``is_causal`` (or the ``is_causal``
keyword a model passes), ``scaling``, attention-probability ``dropout`` (a model passes 0 outside
training) and ``sliding_window``.

Shapes (transformers' convention for attention functions): ``query [B, H, Lq, D]``, ``key`` and
``value [B, H_kv, Lk, D]``; the result is ``(out [B, Lq, H, D], None)``. Four kinds of batch:

* **flattened** (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``): keywords
  ``cu_seq_lens_q``, ``cu_seq_lens_k`` (``[N+1]`` int32/int64 offsets into the ``B * L`` tokens)
  and ``max_length_q``, ``max_length_k`` (host ints). No host read: the offsets are trusted on the
  GPU, under :func:`ragged.varlen_attention`'s contract. Offsets on the CPU beside GPU tensors
  are copied over through pinned memory (no blocking copy).
* **flattened by position ids** (one row, no ``cu_seq_lens_*``, ``position_ids`` that restart):
  a sequence starts wherever ``position_ids`` equals its minimum, as transformers' flash path
  reads them. One host read per forward (the starts of the ``[1, T]`` position ids), made by the
  first layer (``layer_idx == 0``; by every layer of a model whose attention modules carry no
  ``layer_idx``) and reused by the later layers of that forward: no key of a tensor changes with
  every write to it (``.data``, NumPy views and storage writes leave its version counter as it
  was), so nothing read is trusted past the forward that read it. ``cu_seq_lens_*`` cost no read
  at all.
* **padded with a padding mask**: the mask function hands the layers the 2-D mask ``[B, Lk]``
  (True at tokens; no ``[B, 1, Lq, Lk]`` mask is ever built) or None when no position is padding.
  Building it reads the mask's lengths and padding side on the host once (one sync per mask
  built, that is per forward) into a mask of its own (a copy: no other code holds it, so no
  write can make the layout stale), and every layer reuses that layout: it packs k and v (and q),
  runs the varlen kernels on the real tokens and unpacks the output. A mask whose tokens are
  not one run at either end of each row costs a second read (their indices) and a gather.
  Which queries are real: in self-attention (``Lq == Lk``) those of the mask, the output zero
  at padded positions; in a causal decoding step with a cache every query when ``Lq == 1``, else
  the last ``Lq`` columns of the mask (left padding, as in transformers' flash path); in
  non-causal attention to another sequence (``Lq != Lk``, or a cross-attention module: an
  ``is_cross_attention`` attribute, a class named ``*CrossAttention*`` or a decoder's non-causal
  attention) every query, the mask describing the keys only. A 2-D mask that reaches the
  attention function some other way (a direct call) is read by each call.
* **dense** (no mask, no flattening): ``B`` sequences of ``Lq`` queries and ``Lk`` keys,
  causal masking aligned to the end of the keys (a decoding step sees the whole cache). No host
  read.

Sliding windows: a layer with ``sliding_window=w`` sees ``w`` keys back, its own included
(``window_size=(w - 1, 0)`` when causal, ``(w - 1, w - 1)`` otherwise, flash-attn's convention as
transformers passes it). A window cuts nothing when no sequence is longer than ``w``; when one
is and ``ragged.varlen_attention`` takes no ``window_size``, the call raises
``NotImplementedError`` naming the model.

Refused with an error naming the feature: ``output_attentions=True`` (no attention weights are
formed), a ``head_mask``, a 4-D or block mask (custom mask patterns; only padding masks are
taken), mask functions a model overlays on the causal pattern (``or_mask_function`` /
``and_mask_function``), logit soft-capping (``softcap``), attention sinks (``s_aux`` /
``sinks``), a ``position_bias``, and a padding mask together with ``cu_seq_lens_*``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface, AttentionMaskInterface

import ragged
from ragged.padding import read_mask_layout
from ragged.utils import describe, offsets_dtype_for, to_device, warn_once

NAME = "ragged"

_FN = "ragged.nn.hf.attention.attention_forward"
_MASK_FN = "ragged.nn.hf.attention.padding_mask"
_FLAT_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# Keywords whose feature ragged's attention does not compute: refused when a model sets them.
_REFUSED = {
    "softcap": "attention logit soft-capping (softcap)",
    "s_aux": "attention sinks (s_aux)",
    "sinks": "attention sinks (sinks)",
    "head_mask": "a head_mask",
    "position_bias": "an additive position bias (position_bias)",
}
# The layout of a mask made by padding_mask (a copy only this module writes), kept on it for the
# layers of the forward; never set on a caller's tensor (a write through .data, a NumPy view or
# the storage changes no key of it).
_LAYOUT_ATTR = "_ragged_hf_layout"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the real tokens of a padded ``[B, W, ...]`` batch sit.

    ``host``: the offsets ``[B+1]`` as host ints, ``offsets`` the same on the device, ``max_len``
    the longest sequence; ``side``: ``"right"`` (tokens at the start of each row), ``"left"``
    (at the end) or None (anywhere: then ``index [T]`` holds their rows in the flattened
    ``[B * W]``)."""

    width: int
    host: tuple[int, ...]
    offsets: torch.Tensor
    max_len: int
    side: str | None
    index: torch.Tensor | None = None
    dense: bool = False  # known full rows: gather and scatter are views

    @classmethod
    def full_rows(cls, batch: int, width: int, device: torch.device) -> Layout:
        """``batch`` rows of ``width`` tokens each (no host read)."""
        return cls(
            width,
            tuple(b * width for b in range(batch + 1)),
            _dense_offsets(batch, width, device),
            width,
            "right",
            dense=True,
        )

    @property
    def batch(self) -> int:
        return len(self.host) - 1

    @property
    def total(self) -> int:
        return self.host[-1]

    @property
    def full(self) -> bool:
        """Every row is all tokens."""
        return all(b - a == self.width for a, b in zip(self.host[:-1], self.host[1:]))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, W, *F]`` -> its real rows ``[T, *F]`` (differentiable)."""
        if self.dense:
            return x.reshape(self.batch * self.width, *x.shape[2:])
        if self.side is not None:
            return ragged.pack_values(x, self.offsets, self.total, padding_side=self.side)
        assert self.index is not None  # set where side is None
        return x.reshape(self.batch * self.width, *x.shape[2:]).index_select(0, self.index)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """``values [T, *F]`` -> ``[B, W, *F]`` with zeros at padding (differentiable)."""
        if self.dense:
            return values.view(self.batch, self.width, *values.shape[1:])
        if self.side is not None:
            return ragged.unpack_values(values, self.offsets, self.width, padding_side=self.side)
        assert self.index is not None  # set where side is None
        rows = values.new_zeros(self.batch * self.width, *values.shape[1:]).index_copy(0, self.index, values)
        return rows.view(self.batch, self.width, *values.shape[1:])


def _cached(t: torch.Tensor):
    """The layout :func:`padding_mask` kept on its own mask ``t`` (the version check guards
    against a model writing that mask in place between layers)."""
    kept = getattr(t, _LAYOUT_ATTR, None)
    if kept is not None and kept[0] == t._version:
        return kept[1]
    return None


def _keep(t: torch.Tensor, layout: Layout) -> None:
    try:
        setattr(t, _LAYOUT_ATTR, (t._version, layout))
    except (AttributeError, RuntimeError):  # tensors that take no attribute: the layout is read per layer
        pass


def mask_layout(mask: torch.Tensor) -> Layout:
    """The :class:`Layout` of a 2-D padding mask ``[B, W]`` (bool, or 0/1 numbers; nonzero =
    token). One host read (lengths and padding side; a mask whose tokens are not one run at
    either end of a row is gathered by an index of known size, no second read) on every call,
    except for a mask :func:`padding_mask` returned, which carries its layout."""
    layout = _cached(mask)
    if layout is not None:
        return layout
    return _read_mask_layout(mask)


def _read_mask_layout(mask: torch.Tensor) -> Layout:
    keep = mask if mask.dtype == torch.bool else mask != 0
    lengths, is_right, is_left, _ = read_mask_layout(keep)
    host = [0]
    for n in lengths:
        host.append(host[-1] + n)
    offsets = to_device(host, offsets_dtype_for(host[-1]), mask.device)
    side = "right" if is_right else "left" if is_left else None
    index = None
    if side is None:
        warn_once(
            "hf-scattered-mask",
            f"{_MASK_FN}(): the attention mask has tokens that are not one contiguous run "
            "at the start or end of each row; gathering them by index",
        )
        index = torch.nonzero_static(keep.reshape(-1), size=host[-1]).reshape(-1)  # size known: no second read
    return Layout(keep.shape[1], tuple(host), offsets, max(lengths, default=0), side, index)


def _read_starts(row: torch.Tensor) -> list[int]:
    """The host read of :func:`positions_layout`: where ``row [T]`` (T > 0) equals its minimum, and 0."""
    starts = (row == row.min()).to("cpu").numpy()
    starts[0] = True
    return np.flatnonzero(starts).tolist()


# The layout read from a position-ids tensor by the first layer of a forward, for the later layers
# of the same forward: id(tensor) -> (weak reference, layout, version, data pointer). Nothing is
# set on the caller's tensor; an entry goes when its tensor does.
_FORWARD_LAYOUTS: dict[int, tuple] = {}


def _drop(key: int, ref) -> None:
    entry = _FORWARD_LAYOUTS.get(key)
    if entry is not None and entry[0] is ref:
        del _FORWARD_LAYOUTS[key]


def forward_positions_layout(position_ids: torch.Tensor, layer_idx) -> Layout:
    """:func:`positions_layout`, read once per forward: by the first layer (``layer_idx`` 0) and by
    any layer whose index is unknown, and reused by the later layers of the forward that pass the
    same tensor. No write can come between the layers of one forward, and every forward starts
    at layer 0, so a write between forwards (even one no version counter sees: ``.data``, a NumPy
    view) is read by the next forward. Later layers also check the version and the address."""
    key = (position_ids._version, position_ids.data_ptr())
    if isinstance(layer_idx, int) and layer_idx > 0:
        kept = _FORWARD_LAYOUTS.get(id(position_ids))
        if kept is not None and kept[0]() is position_ids and kept[2:] == key:
            return kept[1]
    layout = positions_layout(position_ids)
    if not torch.compiler.is_compiling():
        tid = id(position_ids)
        ref = weakref.ref(position_ids, functools.partial(_drop, tid))
        _FORWARD_LAYOUTS[tid] = (ref, layout, *key)
    return layout


def positions_layout(position_ids: torch.Tensor) -> Layout:
    """The sequences of one flattened row of ``position_ids [1, T]``: a sequence starts at every
    position equal to the row's minimum (and at 0). One host read of the ``T`` start flags."""
    row = position_ids.reshape(-1)
    total = row.shape[0]
    host = [*_read_starts(row), total] if total else [0]
    offsets = to_device(host, offsets_dtype_for(total), position_ids.device)
    longest = max((b - a for a, b in zip(host[:-1], host[1:])), default=0)
    return Layout(total, tuple(host), offsets, longest, "right")


# --------------------------------------------------------------------------------------
# The mask function


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
):
    """transformers' mask function for ``"ragged"``: the 2-D padding mask ``[B, kv_length]`` (bool,
        True at tokens) or None when nothing is padding; never a dense ``[B, 1, Lq, Lk]`` mask.

        Reads the mask's layout on the host (one sync, see :func:`mask_layout`) and keeps it on the
        returned mask, a copy of the caller's that only the attention layers see. The causal, sliding-window and
    packed-sequence
        patterns come from the attention call (``is_causal``, ``sliding_window``, ``cu_seq_lens_*``
        or ``position_ids``); a model that overlays its own mask function (``or_mask_function`` /
        ``and_mask_function``) is refused."""
    if kwargs.get("use_vmap"):
        config = kwargs.get("config")
        model = type(config).__name__ if config is not None else "the model"
        raise NotImplementedError(
            f"{_MASK_FN}(): {model} overlays a custom mask function (or_mask_function / and_mask_function) on "
            f"the attention pattern; attn_implementation={NAME!r} takes padding masks only (use 'sdpa' or 'eager')"
        )
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise NotImplementedError(f"{_MASK_FN}(): expected a 2-D padding mask [B, L], got {describe(attention_mask)}")
    # a copy: the layout kept on it stays true whatever the caller writes into their mask
    mask = (attention_mask[:, -kv_length:] if kv_length else attention_mask[:, :0]).clone()
    layout = _read_mask_layout(mask)
    if mask.shape[1] == kv_length and layout.full:
        return None
    _keep(mask, layout)
    return mask


# --------------------------------------------------------------------------------------
# The attention function


_TAKES_WINDOW: dict = {}


def _window_param(fn) -> bool:
    """Whether ``fn`` (``ragged.varlen_attention``) takes ``window_size`` (read once per function)."""
    takes = _TAKES_WINDOW.get(fn)
    if takes is None:
        try:
            takes = "window_size" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            takes = False
        _TAKES_WINDOW[fn] = takes
    return takes


def _refuse(module, kwargs) -> None:
    model = type(module).__name__
    if kwargs.get("output_attentions"):
        raise NotImplementedError(
            f"{_FN}(): {model} asks for output_attentions=True; attn_implementation={NAME!r} "
            "forms no attention weights (use 'eager' for them)"
        )
    for key, feature in _REFUSED.items():
        if kwargs.get(key) is not None:
            raise NotImplementedError(
                f"{_FN}(): {model} passes {feature}, which attn_implementation={NAME!r} does "
                "not compute (use 'eager' or 'sdpa')"
            )


def _to_device(fn: str, name: str, t: object, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}(): expected {name} to be a tensor of offsets, got {describe(t)}")
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _host_int(fn: str, name: str, value: object) -> int:
    if isinstance(value, torch.Tensor):
        value = int(value)  # a device read: the collator gives host ints
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{fn}(): expected {name} to be an int, got {describe(value)}")
    return int(value)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, D]`` -> ``[B, L, H, D]``, contiguous: a view of projections laid out as
    transformers' models make them (``view(B, L, H, D).transpose(1, 2)``; rotary embeddings keep
    that order), a copy otherwise (keys and values read back from a cache)."""
    return x.transpose(1, 2).contiguous()


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, D]`` -> ``[B * L, H, D]``."""
    return _rows(x).view(x.shape[0] * x.shape[2], x.shape[1], x.shape[3])


def _cross_attention(module: torch.nn.Module) -> bool:
    """Whether a non-causal module attends to another sequence (its mask then describes the keys
    only): an ``is_cross_attention`` attribute, a class named ``*CrossAttention*`` (BERT family),
    or a decoder's non-causal attention (BART, Whisper: ``is_decoder`` and not ``is_causal``)."""
    return bool(
        getattr(module, "is_cross_attention", False)
        or "CrossAttention" in type(module).__name__
        or getattr(module, "is_decoder", False)
    )


def _dense_offsets(batch: int, length: int, device: torch.device) -> torch.Tensor:
    return torch.arange(batch + 1, dtype=offsets_dtype_for(batch * length), device=device) * length


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function for ``"ragged"`` (see the module docstring).

    ``query [B, H, Lq, D]``, ``key``/``value [B, H_kv, Lk, D]`` (``H % H_kv == 0``),
    ``attention_mask``: None or the 2-D padding mask :func:`padding_mask` returns.
    Returns ``(out [B, Lq, H, D], None)``, zeros at the padded positions of a self-attention's
    queries.
    Host reads: none for flattened (``cu_seq_lens_*``) and dense batches; a padded batch's
    layout is read once per forward by :func:`padding_mask` (a 2-D mask that did not come from
    it is read by each call); position-ids flattening reads the position ids once per forward
    (by its first layer, or by each layer of modules without a ``layer_idx``).
    """
    _refuse(module, kwargs)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    batch, heads, len_q, dim = query.shape
    len_k, dim_v = key.shape[2], value.shape[3]
    # ragged's kernels take one head dim: the narrower of q/k and v is zero-padded (scores and
    # outputs unchanged), the output cropped back to v's.
    scale = float(scaling) if scaling is not None else dim**-0.5
    width = max(dim, dim_v)
    if dim < width:
        query, key = (torch.nn.functional.pad(t, (0, width - dim)) for t in (query, key))
    if dim_v < width:
        value = torch.nn.functional.pad(value, (0, width - dim_v))
    device = query.device
    if torch.is_autocast_enabled(device.type):
        # as torch's SDPA under autocast: q, k and v in autocast's dtype (rotary embeddings
        # leave q and k in float32 beside a bfloat16 v)
        low = torch.get_autocast_dtype(device.type)
        query, key, value = (t if t.dtype == low else t.to(low) for t in (query, key, value))
    flat = [kwargs.get(k) for k in _FLAT_KEYS]
    position_ids = kwargs.get("position_ids")
    out_q = None  # Layout of the output rows, or None for [B * Lq] rows
    window_ok = causal or len_q == len_k

    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            raise NotImplementedError(
                f"{_FN}(): {type(module).__name__} got an attention mask {describe(attention_mask)}; "
                f"attn_implementation={NAME!r} takes 2-D padding masks [B, L] only (custom 4-D or block masks: use "
                "'sdpa', 'eager' or 'flex_attention')"
            )
        if any(f is not None for f in flat):
            raise ValueError(
                f"{_FN}(): expected either a padding mask or cu_seq_lens_q/k (a flattened batch), got both"
            )
        mask_width = attention_mask.shape[1]
        if attention_mask.shape[0] != batch or mask_width > len_k:
            raise ValueError(
                f"{_FN}(): expected a padding mask of shape [{batch}, {len_k}] (batch, key length), got "
                f"{tuple(attention_mask.shape)}"
            )
        if mask_width < len_k:  # a static cache longer than the mask: its tail is unused
            key, value = key[:, :, :mask_width], value[:, :, :mask_width]
        lay_k = mask_layout(attention_mask)
        k = lay_k.gather(_rows(key))
        v = lay_k.gather(_rows(value))
        if len_q == 1 or not causal and (len_q != mask_width or _cross_attention(module)):
            lay_q = Layout.full_rows(batch, len_q, device)
        elif len_q == mask_width:
            lay_q = lay_k
        elif len_q < mask_width:
            lay_q = mask_layout(attention_mask[:, -len_q:])
        else:
            raise ValueError(
                f"{_FN}(): expected causal queries ({len_q}) no more than the padding mask's keys ({mask_width})"
            )
        q = lay_q.gather(_rows(query))
        cu_q, cu_k, max_q, max_k = lay_q.offsets, lay_k.offsets, lay_q.max_len, lay_k.max_len
        out_q = lay_q
        # transformers' window counts padded positions: the packed one matches it where the
        # tokens of each row are one run and queries and keys are the same positions (or causal)
        window_ok = lay_k.side is not None and lay_q.side is not None and (causal or lay_q is lay_k)
    elif any(f is not None for f in flat):
        missing = [name for name, f in zip(_FLAT_KEYS, flat) if f is None]
        if missing:
            raise ValueError(
                f"{_FN}(): a flattened batch needs all of {', '.join(_FLAT_KEYS)}; missing {', '.join(missing)}"
            )
        cu_q = _to_device(_FN, "cu_seq_lens_q", flat[0], device)
        cu_k = cu_q if flat[1] is flat[0] else _to_device(_FN, "cu_seq_lens_k", flat[1], device)
        max_q = _host_int(_FN, "max_length_q", flat[2])
        max_k = max_q if flat[3] is flat[2] else _host_int(_FN, "max_length_k", flat[3])
        q, k, v = _tokens(query), _tokens(key), _tokens(value)
    elif (
        batch == 1
        and len_q == len_k
        and len_q > 1
        and isinstance(position_ids, torch.Tensor)
        and position_ids.numel() == len_q
    ):
        lay = forward_positions_layout(position_ids, getattr(module, "layer_idx", None))
        cu_q = cu_k = lay.offsets
        max_q = max_k = lay.max_len
        q, k, v = _tokens(query), _tokens(key), _tokens(value)
    else:
        cu_q, cu_k = _dense_offsets(batch, len_q, device), _dense_offsets(batch, len_k, device)
        max_q, max_k = len_q, len_k
        q, k, v = _tokens(query), _tokens(key), _tokens(value)

    extra: dict[str, Any] = {}
    if sliding_window is not None and max(max_q, max_k) > sliding_window:
        if not window_ok:
            raise NotImplementedError(
                f"{_FN}(): {type(module).__name__} attends within a sliding window of {sliding_window} tokens with a "
                "padding mask whose tokens are not one run per row, or non-causally to keys of another length; "
                f"attn_implementation={NAME!r} does not place such windows"
            )
        if not _window_param(ragged.varlen_attention):
            raise NotImplementedError(
                f"{_FN}(): {type(module).__name__} attends within a sliding window of {sliding_window} tokens over "
                f"sequences of up to {max(max_q, max_k)}; this ragged.varlen_attention takes no window_size"
            )
        extra["window_size"] = (sliding_window - 1, 0 if causal else sliding_window - 1)
    out = ragged.varlen_attention(
        q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale, dropout_p=float(dropout), **extra
    )
    out = out.view(batch, len_q, heads, width) if out_q is None else out_q.scatter(out)
    if dim_v < width:
        out = out[..., :dim_v]
    return out, None


def register() -> None:
    """Register ``"ragged"`` with transformers' attention and mask interfaces (calling it again is
    harmless)."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, padding_mask)


__all__ = ["NAME", "Layout", "attention_forward", "padding_mask", "mask_layout", "positions_layout", "register"]
