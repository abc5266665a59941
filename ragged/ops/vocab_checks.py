"""Argument checks of the vocab ops: the layout of a call and the checks of its candidate ids.

:func:`prepare` checks the public arguments of :func:`ragged.vocab_projection` /
:func:`ragged.vocab_cross_entropy` and returns their :class:`VocabLayout`, the operands of
the ops. The ids (sorted and unique per sequence, in ``[0, V)``) are checked where that
costs no wait for the device (see :mod:`ragged.ops.vocab`): :func:`id_flags` computes the
checks on the device (no sync), a read that happens anyway carries the flags, and
:func:`raise_id_errors` reads the details only once a flag is set.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import backends
from ..tensor import RaggedTensor
from ..utils import check_offsets_tensor, check_tensor, check_vector, describe, eager, to_device

ID_DTYPES = (torch.int32, torch.int64)
ID_CHECKS = ("range", "sorted", "unique")
CE_ID_CHECKS = ("range", "sorted")  # the cross-entropy's binary search needs sorted ids


@dataclasses.dataclass(frozen=True, eq=False)
class VocabLayout:
    """A checked call of the vocab ops: the operands of their kernels and the host facts
    known about them (see the layout in :mod:`ragged.logits`)."""

    hidden: torch.Tensor  # [T, d]
    h_off: torch.Tensor  # [B+1] int32/int64
    weight: torch.Tensor  # [V, d]
    bias: torch.Tensor | None  # [V], unit stride
    ids: torch.Tensor  # [sum_b V_b] or [S] (shared), unit stride
    v_off: torch.Tensor | None  # [B+1]; None: one vocabulary shared by the batch
    l_off: torch.Tensor  # int64 [B+1], first logit of each sequence
    total: int  # number of logits, sum_b T_b * V_b
    max_t: int  # longest sequence
    max_v: int  # most candidates of a sequence
    host_h: tuple[int, ...] | None  # h_off on the host, when known
    host_v: tuple[int, ...] | None  # v_off on the host, when known
    ids_checked: bool  # the ids' range (and order, when asked) already read and checked

    @property
    def name(self) -> str:
        """The ids' argument name, for messages."""
        return "vocab" if self.v_off is None else "vocab.values"


def check_backend_name(fn: str, backend) -> None:
    if backend is not None:
        backends.check_name(fn, backend)


def check_ids_dtype(fn: str, name: str, ids: torch.Tensor) -> None:
    if ids.dtype not in ID_DTYPES:
        raise TypeError(f"{fn}(): expected {name} of dtype torch.int32 or torch.int64, got {ids.dtype}")


def _check_weight_and_bias(fn: str, h: torch.Tensor, weight, bias):
    """``bias`` with unit stride (the kernels index it as ``ptr + id``), after the checks of
    ``weight [V, d]`` and ``bias [V]`` against ``h [T, d]``."""
    check_tensor(fn, "weight", weight)
    if weight.dim() != 2 or weight.shape[1] != h.shape[1]:
        raise ValueError(
            f"{fn}(): expected weight of shape [V, {h.shape[1]}] (d = hidden.values.shape[1]), "
            f"got {tuple(weight.shape)}"
        )
    _like_hidden(fn, "weight", weight, h)
    if bias is None:
        return None
    vocab_size = weight.shape[0]
    check_tensor(fn, "bias", bias)
    if tuple(bias.shape) != (vocab_size,):
        raise ValueError(
            f"{fn}(): expected bias of shape [{vocab_size}] (weight.shape[0]) or None, got {tuple(bias.shape)}"
        )
    _like_hidden(fn, "bias", bias, h)
    # a strided view becomes a (differentiable) copy
    return check_vector(fn, "bias", bias, vocab_size, h.device)


def _like_hidden(fn: str, name: str, t: torch.Tensor, h: torch.Tensor) -> None:
    if t.dtype != h.dtype:
        raise TypeError(f"{fn}(): expected {name} of dtype {h.dtype} (that of hidden), got {t.dtype}")
    if t.device != h.device:
        raise ValueError(f"{fn}(): expected {name} on {h.device} (the device of hidden), got {t.device}")


def _split_vocab(fn: str, hidden: RaggedTensor, vocab):
    """``(ids, v_off or None, the ids' argument name)`` of a RaggedTensor or a shared 1-D tensor."""
    if isinstance(vocab, RaggedTensor):
        ids = vocab.values
        if ids.dim() != 1:
            raise ValueError(f"{fn}(): expected vocab.values to be 1-D ids [sum V_b], got {tuple(ids.shape)}")
        if vocab.batch_size != hidden.batch_size:
            raise ValueError(
                f"{fn}(): expected vocab with the batch size of hidden ({hidden.batch_size}), "
                f"got {vocab.batch_size} sequences"
            )
        return ids, vocab.offsets, "vocab.values"
    if isinstance(vocab, torch.Tensor):
        if vocab.dim() != 1:
            raise ValueError(
                f"{fn}(): expected vocab to be a RaggedTensor of ids or a 1-D id tensor shared by the "
                f"batch, got a tensor of shape {tuple(vocab.shape)}"
            )
        return vocab, None, "vocab"
    raise TypeError(f"{fn}(): expected vocab to be a RaggedTensor of ids or a 1-D id tensor, got {describe(vocab)}")


def prepare(fn: str, hidden, weight, vocab, bias, validate, sorted_ids: bool = False) -> VocabLayout:
    """The checked :class:`VocabLayout` of a public call (``sorted_ids``: the order of the ids
    is checked with their range, where that is free)."""
    if not isinstance(hidden, RaggedTensor):
        raise TypeError(f"{fn}(): expected hidden to be a RaggedTensor with values [T, d], got {describe(hidden)}")
    h = hidden.values
    if h.dim() != 2:
        raise ValueError(f"{fn}(): expected hidden.values of shape [T, d], got {tuple(h.shape)}")
    if not h.dtype.is_floating_point:
        raise TypeError(f"{fn}(): expected floating-point hidden.values, got {h.dtype}")
    bias = _check_weight_and_bias(fn, h, weight, bias)
    vocab_size = weight.shape[0]
    h_off = check_offsets_tensor(fn, hidden.offsets, h, name="hidden.offsets")
    ids, v_off, name = _split_vocab(fn, hidden, vocab)
    check_ids_dtype(fn, name, ids)
    if ids.device != h.device:
        raise ValueError(f"{fn}(): expected {name} on {h.device} (the device of hidden), got {ids.device}")
    ids = check_vector(fn, name, ids, ids.shape[0], h.device)
    if v_off is not None:
        v_off = check_offsets_tensor(fn, v_off, ids, name="vocab.offsets")
    if not isinstance(validate, bool):
        raise TypeError(f"{fn}(): expected validate to be a bool, got {describe(validate)}")

    # The ids are checked where that costs no wait: on the host, or folded into a read of the
    # device that happens anyway (the offsets' read below); validate=True always reads.
    read_offsets = v_off is not None and (hidden.known_host_offsets is None or vocab.known_host_offsets is None)
    checks = ID_CHECKS if validate else (CE_ID_CHECKS if sorted_ids else ("range",))
    check_now = validate or id_check_is_free(ids, read_offsets)
    flags = id_flags(ids, v_off, vocab_size, checks) if check_now else None
    tokens = h.shape[0]
    if v_off is None:
        if flags is not None:
            raise_id_errors(fn, name, host_ints(flags), ids, None, vocab_size, checks)
        size = ids.shape[0]
        return VocabLayout(
            h,
            h_off,
            weight,
            bias,
            ids,
            None,
            h_off.to(torch.int64) * size,
            tokens * size,
            hidden.max_len,
            size,
            hidden.known_host_offsets,
            None,
            check_now,
        )
    host_h, host_v, host_flags = _host_offsets(hidden, vocab, flags)
    if flags is not None:
        raise_id_errors(fn, name, host_flags, ids, v_off, vocab_size, checks)
    # l_off from the host offsets: one queued copy instead of half a dozen small kernels.
    host_l = [0] * len(host_h)
    for b in range(len(host_h) - 1):
        host_l[b + 1] = host_l[b] + (host_h[b + 1] - host_h[b]) * (host_v[b + 1] - host_v[b])
    return VocabLayout(
        h,
        h_off,
        weight,
        bias,
        ids,
        v_off,
        to_device(host_l, torch.int64, h.device),
        host_l[-1],
        hidden.max_len,
        vocab.max_len,
        host_h,
        host_v,
        check_now,
    )


def check_target(fn: str, target, tokens: int, device: torch.device) -> torch.Tensor:
    """``target`` (a tensor, or a RaggedTensor with hidden's tokens) as an int ``[T]`` vector
    of unit stride on ``device``."""
    if isinstance(target, RaggedTensor):
        if target.values.dim() != 1 or target.num_tokens != tokens:
            raise ValueError(
                f"{fn}(): expected target with values of shape [{tokens}] (the tokens of hidden), "
                f"got {tuple(target.values.shape)}"
            )
        target = target.values
    check_tensor(fn, "target", target)
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{fn}(): expected target of dtype torch.int64 or torch.int32, got {target.dtype}")
    if tuple(target.shape) != (tokens,):
        raise ValueError(
            f"{fn}(): expected target of shape [{tokens}] (the tokens of hidden), got {tuple(target.shape)}"
        )
    if target.device != device:
        raise ValueError(f"{fn}(): expected target on {device} (the device of hidden), got {target.device}")
    return check_vector(fn, "target", target, tokens, device)


def host_ints(t: torch.Tensor) -> list[int]:
    return t.detach().to("cpu", torch.int64).tolist()


def id_check_is_free(ids: torch.Tensor, read_offsets: bool) -> bool:
    """True when checking the ids costs no wait for the device: host ids, or a read of the
    offsets that happens anyway (never while traced or on fake tensors)."""
    return eager(ids) and (ids.device.type == "cpu" or read_offsets)


def _host_offsets(hidden: RaggedTensor, vocab: RaggedTensor, extra: torch.Tensor | None = None):
    """Both host offsets (and ``extra``'s values, an int64 device tensor, or None): the ones
    the RaggedTensors lack and ``extra`` come back in one read (the offsets are cached)."""
    missing = [rt for rt in (hidden, vocab) if rt.known_host_offsets is None]
    host_extra = None
    if missing or extra is not None:
        parts = [rt.offsets.to(torch.int64) for rt in missing] + ([] if extra is None else [extra])
        host = host_ints(torch.cat(parts))
        start = 0
        for rt in missing:
            rt.remember_host_offsets(host[start : start + rt.offsets.shape[0]])
            start += rt.offsets.shape[0]
        host_extra = None if extra is None else host[start:]
    return hidden.host_offsets(), vocab.host_offsets(), host_extra


def _id_failures(
    ids: torch.Tensor, v_off: torch.Tensor | None, vocab_size: int, checks: tuple[str, ...]
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Per check in ``checks`` the ``[n]`` bool mask of the ids that fail it ("range": outside
    ``[0, vocab_size)``; "sorted": followed by a smaller id of the same sequence; "unique":
    followed by the same id in the same sequence), and the ``[n]`` sequence of each id (None
    when no check needed it). Device ops only: no sync."""
    n = ids.shape[0]
    device = ids.device
    x = ids.to(torch.int64)
    seq: torch.Tensor | None = None
    if any(c != "range" for c in checks):
        if v_off is None:
            seq = torch.zeros(n, dtype=torch.int64, device=device)
        else:
            v = v_off.to(torch.int64)
            seq = torch.repeat_interleave(torch.arange(v.shape[0] - 1, device=device), v[1:] - v[:-1], output_size=n)
    masks = []
    for check in checks:
        if check == "range":
            masks.append((x < 0) | (x >= vocab_size))
            continue
        assert seq is not None  # made above for every check but "range"
        step = x[1:] - x[:-1]
        same = seq[1:] == seq[:-1]
        last = torch.zeros(1, dtype=torch.bool, device=device)
        masks.append(torch.cat([same & ((step < 0) if check == "sorted" else (step == 0)), last]))
    return masks, seq


def id_flags(ids: torch.Tensor, v_off: torch.Tensor | None, vocab_size: int, checks: tuple[str, ...]) -> torch.Tensor:
    """int64 ``[len(checks)]`` on the ids' device, 1 where a check fails: the few values a
    read of the hot path carries (no sync here; :func:`raise_id_errors` reads the details
    only once a flag is set)."""
    if ids.shape[0] == 0:
        return torch.zeros(len(checks), dtype=torch.int64, device=ids.device)
    masks, _ = _id_failures(ids, v_off, vocab_size, checks)
    return torch.stack([m.any() for m in masks]).to(torch.int64)


def raise_id_errors(
    fn: str,
    name: str,
    flags: list[int],
    ids: torch.Tensor,
    v_off: torch.Tensor | None,
    vocab_size: int,
    checks: tuple[str, ...],
) -> None:
    """ValueError for the first failed check among the host ``flags`` of :func:`id_flags`;
    the position and values it names cost one more read (on the error path only)."""
    failed = [c for c, f in zip(checks, flags) if f]
    if not failed:
        return
    check = failed[0]
    masks, seq = _id_failures(ids, v_off, vocab_size, (check,))
    n = ids.shape[0]
    i = masks[0].to(torch.int32).argmax().to(torch.int64)
    j = (i + 1).clamp(max=n - 1)
    x = ids.to(torch.int64)
    if v_off is None:
        owner = torch.zeros_like(i)
    elif seq is None:
        owner = torch.searchsorted(v_off.to(torch.int64), i.reshape(1), right=True)[0] - 1
    else:
        owner = seq[i]
    i, xi, xj, b = torch.stack([i, x[i], x[j], owner]).tolist()
    where = "" if v_off is None else f" of sequence {b}"
    if check == "range":
        raise ValueError(
            f"{fn}(): expected {name} in [0, {vocab_size}) (weight.shape[0]), got {xi} at position {i}{where}"
        )
    if check == "sorted":
        raise ValueError(
            f"{fn}(): expected {name} sorted in increasing order within each sequence, got {xi} "
            f"before {xj} at positions {i}, {i + 1}{where}"
        )
    raise ValueError(
        f"{fn}(): expected {name} unique within each sequence, got {xi} twice at positions {i}, {i + 1}{where}"
    )


def late_id_flags(layout: VocabLayout, checks: tuple[str, ...]) -> torch.Tensor | None:
    """Device flags of the ids' checks when :func:`prepare` left them unread (None otherwise,
    or when the ids cannot be read: traced, fake)."""
    if layout.ids_checked or not eager(layout.ids):
        return None
    return id_flags(layout.ids, layout.v_off, layout.weight.shape[0], checks)


def raise_layout_id_errors(fn: str, layout: VocabLayout, flags: list[int], checks: tuple[str, ...]) -> None:
    raise_id_errors(fn, layout.name, flags, layout.ids, layout.v_off, layout.weight.shape[0], checks)


def check_ids_now(fn: str, layout: VocabLayout, checks: tuple[str, ...]) -> None:
    """Read and check the ids that :func:`prepare` left unread (one read; nothing when traced).

    The ``"check_ids"`` entry point of an implementation that indexes ``weight`` with the ids
    unmasked and reads the offsets on the host anyway (the torch reference): there the
    check costs no extra wait, and an id outside ``[0, V)`` is a ValueError rather than an
    index error of the device."""
    flags = late_id_flags(layout, checks)
    if flags is not None:
        raise_layout_id_errors(fn, layout, host_ints(flags), checks)


def raise_out_of_vocab(
    fn: str,
    missing: torch.Tensor,
    local: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    layout: VocabLayout,
    id_flags: torch.Tensor | None = None,
) -> None:
    """ValueError naming the first token whose target is outside its candidates. ``missing``:
    the cross-entropy op's device count of such tokens; reading it is the one sync of
    ``out_of_vocab="error"`` (under torch.compile, a device-side assert instead). ``id_flags``:
    the ids' checks (:func:`id_flags` of ``CE_ID_CHECKS``) not yet read, read in the same copy
    and raised first: an id outside ``[0, V)`` or unsorted ids (the targets' binary search
    misses) explain "missing" targets better than the targets do. The first such token is
    found from the op's ``local`` targets on the error path only."""
    hint = "pass out_of_vocab='ignore' to skip such tokens"
    if torch.compiler.is_compiling():
        torch._assert_async(missing == 0, f"{fn}(): a target is not among its sequence's candidate ids; {hint}")
        return
    if id_flags is None:
        count = missing.tolist()
    else:
        host = torch.cat([missing.reshape(1), id_flags]).tolist()
        count = host[0]
        raise_layout_id_errors(fn, layout, host[1:], CE_ID_CHECKS)
    if count:
        outside = (local < 0) & (target != ignore_index)
        first = int(outside.to(torch.int32).argmax())
        tid = int(target[first])
        h_off = layout.h_off
        b = (
            int(torch.searchsorted(h_off.to(torch.int64), torch.tensor([first], device=h_off.device), right=True)[0])
            - 1
        )
        raise ValueError(
            f"{fn}(): expected every target to be one of its sequence's candidate ids (or "
            f"ignore_index = {ignore_index}), got {count} token(s) outside them, the first "
            f"token {first} (sequence {b}) with target {tid}; {hint}"
        )
