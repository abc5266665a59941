"""Attention's ``"torch"`` implementation on the CPU: the sequences of a batch grouped by length
into a few padded batches, each one call of torch's fused CPU attention kernel
(``aten::_scaled_dot_product_flash_attention_for_cpu``, which also returns the lse).

Why not the per-sequence loop of :func:`ragged.ops.attention.reference_attention`: it issues a
dozen small ops per sequence and layer, and with more than one intra-op thread each of them may
open a parallel region whose threads spin while they wait for each other: on a small host under
load a converted sentence encoder then spends most of its CPU time in the loop's small ops, more
at 2 threads than at 1. Grouped, a layer's attention is a handful of ops on whole batches, whose
parallel regions pay off (the converted encoder against the original on a 2-core host:
``bench/results/cpu_embed_epyc2_98997cd.txt``).

Same contract as the reference: ``q [Tq, H, D]``, ``k, v [Tk, H_kv, D]`` (GQA: query head ``h``
reads key/value head ``h // (H / H_kv)``), bottom-right aligned causal masking and sliding
window, the relative-position bias (one ``[H, max_q, max_k]`` block per group, the same for each
of its sequences: positions within a sequence start at 0), zeros and ``lse = -inf`` for a query
that sees no key, the math in float32 (float64 for float64 inputs). No dropout: the caller keeps
the reference for that.
"""

from __future__ import annotations

import torch

# A group's padded attention may cost up to twice its sequences' own, each counted as at least
# _SHORT tokens: below that a sequence's scores cost less than the few ops another group adds.
_WASTE = 2
_SHORT = 32

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def available(q: torch.Tensor, dropout_p: float) -> bool:
    """Whether :func:`grouped_attention` takes ``q``'s device and this dropout."""
    return _FLASH is not None and q.device.type == "cpu" and dropout_p == 0


def plan(cq: list[int], ck: list[int]) -> list[list[int]]:
    """The groups of sequence indices (each in batch order) that run as one padded batch:
    sequences sorted by length, a group closed where the next one would make its padded area
    (``n * max_q * max_k``) exceed ``_WASTE`` times its own. Sequences with no query or no key
    are in no group (their rows are zeros)."""
    lengths = [(ck[b + 1] - ck[b], cq[b + 1] - cq[b], b) for b in range(len(cq) - 1)]
    groups: list[list[int]] = []
    members: list[int] = []
    mq = mk = area = 0
    for lk, lq, b in sorted(lengths, reverse=True):
        if lq == 0 or lk == 0:
            continue
        nq, nk, own = max(mq, lq), max(mk, lk), area + max(lq, _SHORT) * max(lk, _SHORT)
        if members and (len(members) + 1) * nq * nk > _WASTE * own:
            groups.append(sorted(members))
            members, nq, nk, own = [], lq, lk, max(lq, _SHORT) * max(lk, _SHORT)
        members.append(b)
        mq, mk, area = nq, nk, own
    if members:
        groups.append(sorted(members))
    return groups


def _padded_rows(starts: list[int], lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [n, width] int64, valid [n, width] bool)``: the packed row of each slot of the
    padded batch; a padding slot reads its sequence's first row (masked or dropped later)."""
    start = torch.tensor(starts, dtype=torch.int64).unsqueeze(1)
    valid = torch.arange(width).unsqueeze(0) < torch.tensor(lengths, dtype=torch.int64).unsqueeze(1)
    return torch.where(valid, start + torch.arange(width), start), valid


def _gather(x: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype, group: int) -> torch.Tensor:
    """``x [T, h, D]`` at ``rows [n, M]`` as ``[n, h * group, M, D]`` in ``dtype`` (each head
    repeated ``group`` times, next to itself), a view of a ``[n, M, H, D]`` buffer."""
    n, width = rows.shape
    heads, dim = x.shape[1], x.shape[2]
    out = x.index_select(0, rows.reshape(-1)).view(n, width, heads, dim).to(dtype)
    if group > 1:
        out = out.unsqueeze(3).expand(n, width, heads, group, dim).reshape(n, width, heads * group, dim)
    return out.transpose(1, 2)


def _rows_of(x: torch.Tensor, start: int, length: int, dtype: torch.dtype, group: int) -> torch.Tensor:
    """:func:`_gather`'s layout, ``[1, h * group, length, D]``, for one sequence's rows: a view
    where no cast or repeat copies."""
    out = x[start : start + length].to(dtype).unsqueeze(0)
    if group > 1:
        n, width, heads, dim = out.shape
        out = out.unsqueeze(3).expand(n, width, heads, group, dim).reshape(n, width, heads * group, dim)
    return out.transpose(1, 2)


def band(i: torch.Tensor, j: torch.Tensor, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """Bool, True where a query at aligned position ``i`` sees the key at ``j`` under causal masking
    and the ``(left, right)`` window (broadcast shapes; every key where neither applies)."""
    left, right = window
    seen = torch.ones(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool, device=j.device)
    if causal:
        seen &= j <= i
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    return seen


def _mask(lq: list[int], lk: list[int], mq: int, mk: int, causal: bool, window: tuple[int, int]) -> torch.Tensor | None:
    """``[n, 1, mq or 1, mk]`` bool, True where a query sees a key (key padding, causal masking and
    the window, aligned as the reference aligns them), or None where every slot sees every key."""
    left, right = window
    tq = torch.tensor(lq, dtype=torch.int64).view(-1, 1, 1)
    tk = torch.tensor(lk, dtype=torch.int64).view(-1, 1, 1)
    j = torch.arange(mk).view(1, 1, -1)
    seen = j < tk if min(lk) < mk else None  # [n, 1, mk]
    if causal or left >= 0 or right >= 0:
        a = torch.arange(mq).view(1, -1, 1) + (tk - tq)  # aligned positions
        rule = band(a, j, causal, window)  # [n, mq, mk]
        seen = rule if seen is None else rule & seen
    return None if seen is None else seen.unsqueeze(1)


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cq: list[int],
    ck: list[int],
    causal: bool,
    scale: float,
    window: tuple[int, int],
    position_bias: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the packed sequences of offsets ``cq`` / ``ck`` (host ints), one kernel call
    per group of :func:`plan`. ``position_bias``: ``(table [num_buckets, H], buckets, max_q)``,
    see :mod:`ragged.ops.attention_reference`. Returns ``(out [cq[-1], H, D] in q.dtype,
    lse [cq[-1], H] float32)``, as :func:`ragged.ops.attention.reference_attention` does."""
    heads, dim = q.shape[1], q.shape[2]
    group = heads // k.shape[1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if position_bias is not None:
        table, buckets, max_q = position_bias
        table = table.to(dtype).t()  # [H, num_buckets]
    total = cq[-1]
    groups = plan(cq, ck)
    whole = len(groups) == 1 and len(groups[0]) == len(cq) - 1
    if not whole:
        out = torch.zeros((total, heads, dim), dtype=dtype)
        lse = torch.full((total, heads), float("-inf"), dtype=torch.float32)
    for members in groups:
        lq = [cq[b + 1] - cq[b] for b in members]
        lk = [ck[b + 1] - ck[b] for b in members]
        mq, mk = max(lq), max(lk)
        one = len(members) == 1  # one sequence: views of its rows, nothing to gather or drop
        if one:
            b = members[0]
            qg = _rows_of(q, cq[b], lq[0], dtype, 1)
            kg, vg = _rows_of(k, ck[b], lk[0], dtype, group), _rows_of(v, ck[b], lk[0], dtype, group)
        else:
            rows_q, valid_q = _padded_rows([cq[b] for b in members], lq, mq)
            rows_k, _ = _padded_rows([ck[b] for b in members], lk, mk)
            qg = _gather(q, rows_q, dtype, 1)
            kg, vg = _gather(k, rows_k, dtype, group), _gather(v, rows_k, dtype, group)
        # Where every sequence has as many queries as keys, causal masking needs no mask: a
        # query of a sequence of length L never reaches the padding keys past L.
        self_causal = causal and window == (-1, -1) and lq == lk and position_bias is None
        seen = None if self_causal else _mask(lq, lk, mq, mk, causal, window)
        if position_bias is None:
            bias = None if seen is None else torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, float("-inf"))
        else:
            rel = torch.arange(mk).unsqueeze(0) - torch.arange(mq).unsqueeze(1) + (max_q - 1)
            bias = table[:, buckets[rel]].unsqueeze(0)  # [1, H, mq, mk]
            if seen is not None:
                bias = bias.masked_fill(~seen, float("-inf"))
        assert _FLASH is not None  # available() said so
        o, s = _FLASH(qg, kg, vg, 0.0, self_causal, attn_mask=bias, scale=scale)  # [n,H,mq,D], [n,H,mq]
        if one:
            o, s = o[0].transpose(0, 1), s[0].transpose(0, 1).to(torch.float32)
        else:
            o, s = o.transpose(1, 2)[valid_q], s.transpose(1, 2)[valid_q].to(torch.float32)
        if seen is not None and seen.shape[2] > 1:
            blind = ~seen[:, 0].any(-1)  # queries that see no key
            blind = blind[0] if one else blind[valid_q]
            if bool(blind.any()):
                o[blind] = 0.0
                s[blind] = float("-inf")
        if whole:
            return o.to(q.dtype), s
        rows = torch.arange(cq[members[0]], cq[members[0]] + lq[0]) if one else rows_q[valid_q]
        out.index_copy_(0, rows, o)
        lse.index_copy_(0, rows, s)
    return out.to(q.dtype), lse
