"""Padding-free attention: each query attends only to the keys of its own sequence.

Shapes (packed token index ``t``, see :mod:`ragged.tensor`):

* ``q``: ``[Tq, H, D]``, ``k``: ``[Tk, H_kv, D]``, ``v``: ``[Tk, H_kv, D]`` with
  ``H % H_kv == 0`` (GQA/MQA: query head ``h`` reads key/value head ``h // (H / H_kv)``);
* ``cu_seqlens_q [B+1]``, ``cu_seqlens_k [B+1]`` (the offsets; q and k may differ, as in
  cross-attention, but the batch size is shared);
* output ``[Tq, H, D]`` in q's dtype and ``lse [Tq, H]`` float32, the natural-log
  normaliser of each query row (``-inf`` for a query that sees no key).

Causal masking with ``Lq != Lk`` is aligned to the bottom right (flash-attn >= 2.1):
query ``i`` sees keys ``j <= i + Lk - Lq``. For Lq = 2, Lk = 5 (``x`` = attends)::

        k0 k1 k2 k3 k4
    q0   x  x  x  x  .
    q1   x  x  x  x  x

and for Lq = 5, Lk = 2 the first three queries see no key and get zeros::

        k0 k1
    q0   .  .
    q1   .  .
    q2   .  .
    q3   x  .
    q4   x  x

Implementations (:mod:`ragged.backends`): ``"torch"`` (:func:`reference_attention`, a
loop of per-sequence attention in float32; the CPU path and the tests' oracle),
``"triton"`` (varlen flash attention, forward and backward) and ``"cuda"`` (a fused
kernel for short sequences, forward only; ``"auto"`` takes it only where it is measured
faster).
"""

from __future__ import annotations

import math

import torch

from .. import backends
from .._utils import check_int, check_offsets_tensor, check_tensor, describe, eager
from ..tensor import RaggedTensor

# --------------------------------------------------------------------------------------
# Reference


def _no_autocast(fn):
    """Run ``fn`` with autocast off on its tensors' device: a reference computes in the
    precision it names (float32/float64), never in autocast's lower one."""
    import functools

    @functools.wraps(fn)
    def wrapper(q, *args, **kwargs):
        with torch.autocast(device_type=q.device.type, enabled=False):
            return fn(q, *args, **kwargs)

    return wrapper


@_no_autocast
def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, causal: bool = False, scale: float | None = None,
                        dropout_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                        compute_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence attention in ``compute_dtype`` (float32 by default; float64 for float64 inputs).

    Differentiable through torch autograd. Reads the offsets on the host (one sync on
    CUDA): this is an oracle and the CPU path, not the GPU hot path. ``dropout_mask``
    (optional, ``[H, Tq, max_k]`` bool, True = keep) applies attention dropout with
    probability ``dropout_p`` exactly as the kernels draw it.
    Returns ``(out [Tq, H, D] in q.dtype, lse [Tq, H] float32)``.
    """
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    dtype = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(cq) - 1):
        qb = q[cq[b]:cq[b + 1]].to(dtype).transpose(0, 1)                       # [H, Lq, D]
        kb = k[ck[b]:ck[b + 1]].to(dtype).transpose(0, 1).repeat_interleave(group, 0)
        vb = v[ck[b]:ck[b + 1]].to(dtype).transpose(0, 1).repeat_interleave(group, 0)
        lq, lk = qb.shape[1], kb.shape[1]
        s = torch.matmul(qb, kb.transpose(1, 2)) * scale                         # [H, Lq, Lk]
        if causal:
            i = torch.arange(lq, device=q.device).unsqueeze(1)
            j = torch.arange(lk, device=q.device).unsqueeze(0)
            s = s.masked_fill(j > i + (lk - lq), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)                                         # [H, Lq]; -inf if no key
        p = torch.exp(s - lse.unsqueeze(-1).clamp_min(torch.finfo(dtype).min))
        p = torch.nan_to_num(p, nan=0.0)
        if dropout_mask is not None and dropout_p > 0:
            keep = dropout_mask[:, cq[b]:cq[b + 1], :lk]
            p = torch.where(keep, p / (1.0 - dropout_p), torch.zeros((), dtype=dtype, device=p.device))
        outs.append(torch.matmul(p, vb).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    if not outs:  # B = 0 (so T = 0): empty results that stay in the autograd graph
        return q * 0, torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
    out = torch.cat(outs).to(q.dtype)
    return out, torch.cat(lses).to(torch.float32)


@_no_autocast
def reference_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, causal: bool = False,
                                 scale: float | None = None, dropout_mask: torch.Tensor | None = None,
                                 dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`reference_attention` (float32; float64 for float64 inputs), written out.

    With ``P = softmax(S)``, ``Z`` the dropout keep mask scaled by ``1 / (1 - p)`` and
    ``O = (P * Z) V``: ``dV = (P * Z)^T dO``, ``dP = (dO V^T) * Z``,
    ``dS = P * (dP - rowsum(dO * O))``, ``dQ = scale * dS K``, ``dK = scale * dS^T Q``; for
    GQA the key/value gradients are summed over each group's query heads. Explicit
    formulas rather than autograd: this also runs inside the ``ragged::attention_backward``
    op, where autograd is off.
    """
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
        lq, lk = qe - qs, ke - ks
        if lq == 0 or lk == 0:
            continue
        qb = q[qs:qe].to(dtype).transpose(0, 1)                                  # [H, Lq, D]
        kb = k[ks:ke].to(dtype).transpose(0, 1).repeat_interleave(group, 0)     # [H, Lk, D]
        vb = v[ks:ke].to(dtype).transpose(0, 1).repeat_interleave(group, 0)
        dob = do[qs:qe].to(dtype).transpose(0, 1)
        s = torch.matmul(qb, kb.transpose(1, 2)) * scale
        if causal:
            i = torch.arange(lq, device=q.device).unsqueeze(1)
            j = torch.arange(lk, device=q.device).unsqueeze(0)
            s = s.masked_fill(j > i + (lk - lq), float("-inf"))
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.nan_to_num(torch.exp(s - lse.clamp_min(torch.finfo(dtype).min)), nan=0.0)
        zp = p
        if dropout_mask is not None and dropout_p > 0:
            keep = dropout_mask[:, qs:qe, :lk].to(dtype) / (1.0 - dropout_p)
            zp = p * keep
        out = torch.matmul(zp, vb)
        dvb = torch.matmul(zp.transpose(1, 2), dob)                              # [H, Lk, D]
        dp = torch.matmul(dob, vb.transpose(1, 2))
        if zp is not p:
            dp = dp * keep
        ds = p * (dp - (dob * out).sum(-1, keepdim=True))
        dq[qs:qe] = (torch.matmul(ds, kb) * scale).transpose(0, 1)
        dkb = torch.matmul(ds.transpose(1, 2), qb) * scale
        dk[ks:ke] = dkb.view(kv_heads, group, lk, head_dim).sum(1).transpose(0, 1)
        dv[ks:ke] = dvb.view(kv_heads, group, lk, head_dim).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def reference_dropout_mask(seed: int, dropout_p: float, cu_seqlens_q: torch.Tensor, heads: int, total_q: int,
                           max_k: int, device: torch.device) -> torch.Tensor:
    """``[H, Tq, max_k]`` keep mask for ``seed``: the Triton kernels' own mask wherever Triton
    can run on ``device`` (so the reference and the kernels drop the same entries), else
    one drawn by torch's generator (reproducible for the seed, but not the kernels' pattern)."""
    if backends.triton_reason(device) is None:
        from ..kernels.triton.attention import dropout_keep_mask

        return dropout_keep_mask(seed, dropout_p, cu_seqlens_q, heads, total_q, max_k, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.rand((heads, total_q, max(max_k, 1)), generator=gen, device=device) >= dropout_p


# --------------------------------------------------------------------------------------
# Backends


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _triton_reasons(q, k, v, cu_q, cu_k, max_q, max_k, causal, dropout_p, needs_grad) -> list[str]:
    reasons = []
    r = backends.triton_reason(q.device)
    if r:
        reasons.append(r)
    if q.dtype not in _KERNEL_DTYPES:
        reasons.append(f"triton attention takes float16, bfloat16 and float32, got {q.dtype}")
    from ..kernels.triton.attention import HEAD_DIMS

    if q.shape[-1] not in HEAD_DIMS:
        reasons.append(f"triton attention takes head dims {HEAD_DIMS}, got {q.shape[-1]}")
    return reasons


def _cuda_reasons(q, k, v, cu_q, cu_k, max_q, max_k, causal, dropout_p, needs_grad) -> list[str]:
    try:
        from ..kernels.cuda.attention import reasons
    except ImportError as exc:  # the short-sequence kernel is optional
        return [f"the CUDA short-sequence attention kernel is unavailable ({exc})"]
    return reasons(q, k, v, cu_q, cu_k, max_q, max_k, causal, dropout_p, needs_grad)


def _no_reasons(*_) -> list[str]:
    return []


def _reference_mask(q, cu_q, max_k, dropout_p, seed):
    if dropout_p == 0:
        return None
    return reference_dropout_mask(seed, dropout_p, cu_q, q.shape[1], q.shape[0], max_k, q.device)


def _reference_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed):
    mask = _reference_mask(q, cu_q, max_k, dropout_p, seed)
    with torch.no_grad():
        return reference_attention(q, k, v, cu_q, cu_k, causal, scale, mask, dropout_p)


def _reference_backward(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed):
    mask = _reference_mask(q, cu_q, max_k, dropout_p, seed)
    return reference_attention_backward(do, q, k, v, cu_q, cu_k, causal, scale, mask, dropout_p)


def _triton_forward(*args):
    from ..kernels.triton.attention import forward

    return forward(*args)


def _triton_backward(*args):
    from ..kernels.triton.attention import backward

    return backward(*args)


def _cuda_forward(*args):
    from ..kernels.cuda.attention import forward

    return forward(*args)


backends.register("attention", "torch", (_reference_forward, _reference_backward), _no_reasons)
backends.register("attention", "triton", (_triton_forward, _triton_backward), _triton_reasons)
backends.register("attention", "cuda", (_cuda_forward, None), _cuda_reasons)
def _auto_order(q, k, v, cu_q, cu_k, max_q, max_k, causal, dropout_p, needs_grad) -> tuple[str, ...]:
    # The fused CUDA kernel wins up to 64 tokens at every head dim and up to 128 at D <= 64
    # (H200: B=256 L=8..32 D=64 18 us vs Triton's 31 us; L=64..128 D=64 30 vs 31 us; L=128
    # D=128 48 vs 41 us), so "auto" takes it only there.
    longest = max(max_q, max_k)
    if longest <= 64 or (q.shape[-1] <= 64 and longest <= 128):
        return ("cuda", "triton", "torch")
    return ("triton", "cuda", "torch")


backends.set_auto_order("attention", _auto_order)


def _impl(name: str):
    return backends._OPS["attention"].impls[name].fn


# --------------------------------------------------------------------------------------
# torch.library ops


@torch.library.custom_op("ragged::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                  max_q: int, max_k: int, causal: bool, scale: float, dropout_p: float, seed: int,
                  backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(backend)[0](q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed)


@_attention_op.register_fake
def _attention_fake(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed, backend):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("ragged::attention_backward", mutates_args=())
def _attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
                           causal: bool, scale: float, dropout_p: float, seed: int,
                           backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _impl(backend)[1](do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed)
    return dq, dk, dv


@_attention_backward_op.register_fake
def _attention_backward_fake(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed,
                             backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = (max_q, max_k, causal, scale, dropout_p, seed, _backward_backend(backend))


def _backward(ctx, do, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _call_backward(do.contiguous(), q, k, v, out, lse, cu_q, cu_k, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _backward_backend(forward_backend: str) -> str:
    # The CUDA short-sequence kernel is forward only; its inputs are Triton's too.
    return "triton" if forward_backend == "cuda" else forward_backend


_attention_op.register_autograd(_backward, setup_context=_setup)


class _AttentionFunction(torch.autograd.Function):
    """Eager path: the same forward/backward without the torch.library dispatcher."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed, backend):
        out, lse = _impl(backend)[0](q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, causal, scale, dropout_p, seed, _backward_backend(backend))
        ctx.mark_non_differentiable(lse)
        return out, lse

    backward = staticmethod(_backward)


def _call_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed, backend):
    if eager(q, k, v, cu_q, cu_k):
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _AttentionFunction.apply(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed,
                                            backend)
        return _impl(backend)[0](q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed)
    return _attention_op(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed, backend)


def _call_backward(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed, backend):
    if eager(do, q, k, v):
        return _impl(backend)[1](do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, seed)
    return _attention_backward_op(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p,
                                  seed, backend)


# --------------------------------------------------------------------------------------
# Public API


_VARLEN_NAMES = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "q.shape[0]", "k.shape[0]")
_RAGGED_NAMES = ("q.offsets", "k.offsets", "q.max_len", "k.max_len", "q.num_tokens", "k.num_tokens")


def _validate(fn, q, k, v, cu_q, cu_k, max_q, max_k, scale, dropout_p, names=_VARLEN_NAMES):
    """Checks every argument every backend takes; returns ``(cu_q, cu_k, max_q, max_k)`` as the
    backends must get them: offsets contiguous (every kernel reads them with unit stride, and a
    RaggedTensor from the plain constructor may hold a strided view), maxima as Python ints.
    Reads no tensor's values (see :func:`_check_offset_values` for those)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(fn, name, t)
        if t.dim() != 3:
            raise ValueError(f"{fn}(): expected {name} of shape [T, H, D], got {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}(): expected q, k and v of one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"{fn}(): expected floating-point q, k, v, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}(): expected q, k and v on one device, got {q.device}, {k.device} and {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"{fn}(): expected k and v of the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{fn}(): expected q and k of the same head dim, got {q.shape[2]} and {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"{fn}(): expected the query heads ({q.shape[1]}) to be a multiple of the key/value "
                         f"heads ({k.shape[1]})")
    cu_q = check_offsets_tensor(fn, cu_q, q, name=names[0])
    cu_k = check_offsets_tensor(fn, cu_k, k, name=names[1])
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"{fn}(): expected {names[0]} and {names[1]} of the same batch size, got "
                         f"{cu_q.shape[0] - 1} and {cu_k.shape[0] - 1} sequences")
    max_q = check_int(fn, names[2], max_q, minimum=0)
    max_k = check_int(fn, names[3], max_k, minimum=0)
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"{fn}(): expected scale to be a float or None, got {describe(scale)}")
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{fn}(): expected dropout_p in [0, 1), got {describe(dropout_p)}")
    return cu_q, cu_k, max_q, max_k


def _check_host_ends(fn, host, total, name, total_name):
    """O(1) checks of offsets already on the host (a RaggedTensor's): first 0, last T. The rest
    (non-decreasing, max_len) the RaggedTensor constructors have checked, and a per-call loop over
    B would cost the host 13 us at B = 256."""
    if host[0] != 0:
        raise ValueError(f"{fn}(): expected {name}[0] == 0, got {host[0]}")
    if host[-1] != total:
        raise ValueError(f"{fn}(): expected {name}[-1] == {total_name} ({total}), got {host[-1]}")


def _summary(cu: torch.Tensor) -> torch.Tensor:
    """``[4]`` int64 on cu's device: first offset, last offset, shortest and longest length (0 for
    B = 0), so that checking a batch reads four numbers, whatever B."""
    cu = cu.to(torch.int64)
    lengths = torch.cat([cu[1:] - cu[:-1], cu.new_zeros(1)])
    return torch.stack([cu[0], cu[-1], lengths.min(), lengths.max()])


def _check_offset_values(fn, cu_q, cu_k, total_q, total_k, max_q, max_k, names=_VARLEN_NAMES):
    """The offsets against the data contract: ``[0] == 0``, non-decreasing, ``[-1] == T`` and no
    sequence longer than its max. One device-to-host read of 8 numbers (a sync on CUDA)."""
    first_q, last_q, low_q, high_q, first_k, last_k, low_k, high_k = torch.cat(
        [_summary(cu_q), _summary(cu_k)]).tolist()
    for cu, (first, last, low, high), total, longest, (name, max_name, total_name) in (
            (cu_q, (first_q, last_q, low_q, high_q), total_q, max_q, names[0::2]),
            (cu_k, (first_k, last_k, low_k, high_k), total_k, max_k, names[1::2])):
        if first != 0:
            raise ValueError(f"{fn}(): expected {name}[0] == 0, got {first}")
        if low < 0:  # the error path: reading all of them to name the first decrease is fine here
            host = cu.tolist()
            i = next(i for i in range(len(host) - 1) if host[i + 1] < host[i])
            raise ValueError(f"{fn}(): expected non-decreasing {name}, got {name}[{i}] = {host[i]} > "
                             f"{name}[{i + 1}] = {host[i + 1]}")
        if last != total:
            raise ValueError(f"{fn}(): expected {name}[-1] == {total_name} ({total}), got {last}")
        if high > longest:
            raise ValueError(f"{fn}(): expected {max_name} >= the longest sequence ({high}), got {longest}")


def _seed(dropout_p: float) -> int:
    # Drawn from torch's CPU generator (torch.manual_seed makes runs reproducible) so
    # that no GPU value is read.
    if dropout_p == 0.0:
        return 0
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                     scale: float | None = None, dropout_p: float = 0.0, return_lse: bool = False,
                     backend: str | None = None, *, validate: bool = False):
    """Attention in flash-attn's varlen convention (see the module docstring for shapes).

    ``max_seqlen_q`` / ``max_seqlen_k`` are host ints (Python or numpy; no sync). ``dropout_p > 0``
    drops attention probabilities (reproducible under ``torch.manual_seed``).
    Returns ``out [Tq, H, D]``, or ``(out, lse [Tq, H] float32)`` with ``return_lse``.

    Contract on the offsets: ``cu_seqlens_*[0] == 0``, non-decreasing, ``cu_seqlens_q[-1] ==
    q.shape[0]``, ``cu_seqlens_k[-1] == k.shape[0]``, and no sequence longer than its
    ``max_seqlen_*``. It is checked (``ValueError``, the same on every backend) wherever that reads
    no GPU memory: offsets on the CPU, and the ``"torch"`` backend (which reads them anyway).
    CUDA offsets are not read by default, since that would cost a host sync per call;
    ``validate=True`` checks them with one device-to-host read (a sync; a graph break under
    ``torch.compile``). Unchecked CUDA offsets that break the contract are the caller's error:
    the CUDA short-sequence kernel clips each sequence to the rows of q and k, but the Triton
    kernels trust the offsets (clipping there cost 45% of the causal forward) and may then read
    or write out of bounds. Pass ``validate=True`` (or host offsets through :func:`attention`)
    where they may be wrong.
    """
    return _varlen("ragged.varlen_attention", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   causal, scale, dropout_p, return_lse, backend, validate)


def _varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, dropout_p,
            return_lse, backend, validate, names=_VARLEN_NAMES, host_q=None, host_k=None):
    """``host_q`` / ``host_k``: the offsets as host ints when known (a RaggedTensor's), else None."""
    cu_q, cu_k, max_q, max_k = _validate(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         scale, dropout_p, names)
    # Offsets on the CPU cost nothing to read (and cannot be read while tracing: eager() is False).
    checked = bool(validate) or (cu_q.device.type == "cpu" and eager(cu_q, cu_k))
    if checked:
        _check_offset_values(fn, cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k, names)
    else:
        if host_q is not None:
            _check_host_ends(fn, host_q, q.shape[0], names[0], names[4])
        if host_k is not None:
            _check_host_ends(fn, host_k, k.shape[0], names[1], names[5])
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    impl = backends.select("attention", backend, q.device, q, k, v, cu_q, cu_k, max_q, max_k, causal, dropout_p,
                           needs_grad, fn=fn)
    if not checked and impl.name == "torch" and eager(cu_q, cu_k):
        # The reference reads the offsets on the host anyway: check them rather than return
        # a wrong number of rows.
        _check_offset_values(fn, cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k, names)
    out, lse = _call_forward(q, k, v, cu_q, cu_k, max_q, max_k, bool(causal), scale, float(dropout_p),
                             _seed(dropout_p), impl.name)
    return (out, lse) if return_lse else out


def attention(q: RaggedTensor, k: RaggedTensor, v: RaggedTensor, causal: bool = False, scale: float | None = None,
              dropout_p: float = 0.0, return_lse: bool = False, backend: str | None = None, *,
              validate: bool = False):
    """Padding-free attention over RaggedTensors (``values [T, H, D]``).

    ``k`` and ``v`` share their sequences; ``q`` may have other lengths (cross-attention)
    with the same batch size. Returns a RaggedTensor with q's sequences, or
    ``(out, lse)`` with ``return_lse`` (``lse``: ``[Tq, H]`` float32 tensor).

    The offsets are checked as in :func:`varlen_attention`; in addition, offsets the
    RaggedTensors hold on the host (from :func:`ragged.pack`, ``from_lengths``, ...) are checked
    against ``values.shape[0]`` at no cost. ``validate=True`` checks all of the data contract
    with one device-to-host read.
    """
    fn = "ragged.attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, RaggedTensor):
            raise TypeError(f"{fn}(): expected {name} to be a RaggedTensor, got {describe(t)}; "
                            "for packed tensors with cu_seqlens use ragged.varlen_attention")
    if k.offsets is not v.offsets:
        if k.offsets.shape != v.offsets.shape or k.num_tokens != v.num_tokens or (
                k._host_offsets is not None and v._host_offsets is not None and k._host_offsets != v._host_offsets):
            raise ValueError(f"{fn}(): expected k and v with the same sequences, got lengths "
                             f"{k.batch_size}/{k.num_tokens} and {v.batch_size}/{v.num_tokens} (batch/tokens)")
    if q.batch_size != k.batch_size:
        raise ValueError(f"{fn}(): expected q and k with the same batch size, got {q.batch_size} and {k.batch_size}")
    result = _varlen(fn, q.values, k.values, v.values, q.offsets, k.offsets, q.max_len, k.max_len, causal, scale,
                     dropout_p, return_lse, backend, validate, names=_RAGGED_NAMES, host_q=q._host_offsets,
                     host_k=k._host_offsets)
    if return_lse:
        out, lse = result
        return q.with_values(out), lse
    return q.with_values(result)
