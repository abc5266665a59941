"""The chunked driver of ``linear_cross_entropy`` (:mod:`ragged.ops.linear_ce`), shared by its
implementations: the logits ``hidden @ weight.T + bias`` are made one slice of ``chunk``
vocabulary rows at a time by the GEMM of torch (cuBLAS on a GPU) and never exist whole.

Forward, per slice ``[v0, v1)``: ``z = hidden @ weight[v0:v1].T (+ bias[v0:v1])`` in the operands'
dtype (the logits a model's LM head would return), then a *step* folds the slice into each
token's running maximum ``m`` and sum ``s`` of ``exp(logit - m)`` (an online log-sum-exp) and
picks the target's logit where the target falls in the slice. After the last slice
``lse = m + log(s)`` and ``loss = lse - logit[target]`` (0 at ignored tokens; NaN for a target
outside ``[0, V)``, which no slice holds).

Backward, per slice, the logits are made again and a second step turns them in place into their
gradient ``g * (softmax - onehot)`` (times ``1 - tanh^2`` under a soft cap) from the forward's
``lse``; then ``d weight[v0:v1] = dz.T @ hidden`` (one GEMM, each row written once),
``d bias[v0:v1] = dz.sum(0)`` and ``d hidden += dz @ weight[v0:v1]`` (summed over the slices in
the compute dtype). Memory: one ``[T, chunk]`` slice at a time, plus ``[T, d]`` in float32.

A step is a pair of functions; :data:`TORCH_STEPS` are written in torch ops (the ``"torch"``
implementation, any device and floating dtype); the Triton ones fuse each step into one kernel
(:mod:`ragged.kernels.triton.linear_ce`).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from ..records.linear_ce import (
    LinearCrossEntropyArgs,
    LinearCrossEntropyBackwardInputs,
    LinearCrossEntropyGrads,
    LinearCrossEntropyOutput,
)

__all__ = ["BUDGET", "TORCH_STEPS", "Steps", "backward", "chunk_rows", "compute_dtype", "forward"]

BUDGET = 1 << 25  # logits in one slice (T x chunk): 64 MiB in bfloat16


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_rows(tokens: int, vocab: int, chunk: int = 0) -> int:
    """The vocabulary rows of one slice: ``chunk`` when given, else as many as keep a slice
    under :data:`BUDGET` logits, a multiple of 128 (at least 128, at most ``vocab``)."""
    if chunk > 0:
        return min(chunk, max(vocab, 1))
    rows = max(128, (BUDGET // max(tokens, 1)) // 128 * 128)
    return min(rows, max(vocab, 1))


class LseStep(Protocol):
    def __call__(
        self, z: Tensor, target: Tensor, v0: int, m: Tensor, s: Tensor, zt: Tensor, softcap: float
    ) -> None: ...


class GradStep(Protocol):
    def __call__(self, z: Tensor, target: Tensor, v0: int, lse: Tensor, g: Tensor, softcap: float) -> Tensor: ...


class Steps(NamedTuple):
    """``lse(z, target, v0, m, s, zt, softcap)``: fold the slice ``z [T, n]`` of vocabulary rows
    ``[v0, v0 + n)`` into ``m``, ``s`` and the target logits ``zt`` (in place); ``grad(z,
    target, v0, lse, g, softcap) -> dz``: the slice's logit gradient in z's dtype (z may be
    overwritten), ``g [T]`` the loss gradient of each token (0 at ignored ones)."""

    lse: LseStep
    grad: GradStep


def _capped(z: Tensor, dtype: torch.dtype, softcap: float) -> Tensor:
    y = z.to(dtype)
    if softcap:
        y = torch.tanh(y / softcap) * softcap
    return y


def _local(target: Tensor, v0: int, n: int) -> tuple[Tensor, Tensor]:
    local = target - v0
    inside = (local >= 0) & (local < n)
    return local.clamp(0, max(n - 1, 0)), inside


def _torch_lse(z: Tensor, target: Tensor, v0: int, m: Tensor, s: Tensor, zt: Tensor, softcap: float) -> None:
    y = _capped(z, m.dtype, softcap)
    top = torch.maximum(m, y.amax(dim=1))
    s.mul_(torch.exp(m - top)).add_(torch.exp(y - top[:, None]).sum(dim=1))
    m.copy_(top)
    local, inside = _local(target, v0, y.shape[1])
    zt.copy_(torch.where(inside, y.gather(1, local[:, None])[:, 0], zt))


def _torch_grad(z: Tensor, target: Tensor, v0: int, lse: Tensor, g: Tensor, softcap: float) -> Tensor:
    y = _capped(z, lse.dtype, softcap)
    p = torch.exp(y - lse[:, None])
    local, inside = _local(target, v0, y.shape[1])
    p.scatter_add_(1, local[:, None], -inside.to(p.dtype)[:, None])
    d = p * g[:, None]
    if softcap:
        d = d * (1 - (y / softcap) ** 2)
    return d.to(z.dtype)


TORCH_STEPS = Steps(_torch_lse, _torch_grad)


def _slice_logits(h: Tensor, weight: Tensor, bias: Tensor | None, v0: int, v1: int) -> Tensor:
    w = weight[v0:v1]
    if bias is None:
        return h @ w.T
    return torch.addmm(bias[v0:v1], h, w.T)


def forward(args: LinearCrossEntropyArgs, steps: Steps) -> LinearCrossEntropyOutput:
    """The per-token losses and log-sum-exps (see the module docstring)."""
    h, weight, bias, target = args.hidden, args.weight, args.bias, args.target
    tokens, vocab = h.shape[0], weight.shape[0]
    dtype = compute_dtype(h.dtype)
    m = torch.full((tokens,), float("-inf"), dtype=dtype, device=h.device)
    s = torch.zeros((tokens,), dtype=dtype, device=h.device)
    zt = torch.full((tokens,), float("nan"), dtype=dtype, device=h.device)
    if tokens == 0:
        return LinearCrossEntropyOutput(s, s.clone())
    rows = chunk_rows(tokens, vocab, args.chunk)
    with torch.no_grad():
        for v0 in range(0, vocab, rows):
            v1 = min(v0 + rows, vocab)
            steps.lse(_slice_logits(h, weight, bias, v0, v1), target, v0, m, s, zt, args.softcap)
        lse = m + torch.log(s)
        loss = torch.where(target == args.ignore_index, torch.zeros_like(lse), lse - zt)
    return LinearCrossEntropyOutput(loss, lse)


def backward(
    args: LinearCrossEntropyArgs, inputs: LinearCrossEntropyBackwardInputs, steps: Steps
) -> LinearCrossEntropyGrads:
    """The gradients the inputs ask for (see the module docstring)."""
    h, weight, bias, target = args.hidden, args.weight, args.bias, args.target
    tokens, vocab = h.shape[0], weight.shape[0]
    dtype = compute_dtype(h.dtype)
    need_b = inputs.need_bias and bias is not None
    dh = torch.zeros(h.shape, dtype=dtype, device=h.device) if inputs.need_hidden else None
    dw = torch.zeros_like(weight) if inputs.need_weight else None
    db = torch.zeros((vocab,), dtype=dtype, device=h.device) if need_b else None
    if tokens and (dh is not None or dw is not None or db is not None):
        ignored = target == args.ignore_index
        g = torch.where(ignored, torch.zeros((), dtype=dtype, device=h.device), inputs.grad_loss.to(dtype))
        rows = chunk_rows(tokens, vocab, args.chunk)
        with torch.no_grad():
            for v0 in range(0, vocab, rows):
                v1 = min(v0 + rows, vocab)
                dz = steps.grad(_slice_logits(h, weight, bias, v0, v1), target, v0, inputs.lse, g, args.softcap)
                if dw is not None:
                    torch.mm(dz.T, h, out=dw[v0:v1])
                if db is not None:
                    db[v0:v1] = dz.sum(dim=0, dtype=dtype)
                if dh is not None:
                    part = dz @ weight[v0:v1]
                    dh.add_(part)
    return LinearCrossEntropyGrads(
        None if dh is None else dh.to(h.dtype),
        dw,
        None if db is None else db.to(bias.dtype),  # type: ignore[union-attr]
    )
