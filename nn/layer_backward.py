"""The hand-written backward of one encoder layer (:class:`ragged.nn.layer.LayerFunction`).

Every gradient of the layer in one pass over what the forward saved:

* the residual gradients enter the GEMMs as their accumulators (``addmm``);
* the LayerNorm backward returns the gradient of both summands of its sum; where the
  implementation that runs it declares ``extras["dropout_backward"]``, it also takes the
  dropout in front of it back, and sums the result into the bias gradient of the Linear
  before that dropout, in the same pass (the bias + activation backward takes the
  feed-forward dropout back the same way);
* with those fused backwards, the per-group partial column sums of the launches (LayerNorm
  weights and biases, the Linear biases) go to one fp32 buffer reduced by one ``sum`` at the
  end (:class:`Sums`), when the implementation declares ``extras["backward_fuses"]`` true
  for the layer's width;
* the attention backward writes dq, dk, dv into one ``[T, 3, H, D]`` buffer (every
  implementation takes ``grads=``), so the input projection's gradient needs no stacking copy.

Implementations without those extras run their plain backward and torch's dropout backward
and sums: the same gradients, in more launches. Every backward is called with its op's
records (:mod:`ragged.records`: the operands, the backward's inputs), and an extra's own
arguments (the dropout mask and rate, the shared buffer's columns) by keyword.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch

from ragged.ops.attention import AttentionArgs, AttentionBackwardInputs, AttentionGrads
from ragged.records.fused import (
    AddLayerNormArgs,
    AddLayerNormBackwardInputs,
    AddLayerNormDropoutGrads,
    BiasActArgs,
    BiasActBackwardInputs,
    BiasActGrads,
)

from .layer_spec import LayerKernels, LayerNeeds, LayerSpec, LayerWeightGrads, LayerWeights


class LayerGrads(NamedTuple):
    """The gradients of one layer: of its input ``x``, of each weight (None where not wanted or
    absent) and of the position bias's table (``spec.position_bias``; None without one)."""

    x: torch.Tensor | None
    weights: LayerWeightGrads
    table: torch.Tensor | None


def _dropout_backward(g: torch.Tensor, mask: torch.Tensor | None, p: float) -> torch.Tensor:
    return g if mask is None else torch.ops.aten.native_dropout_backward(g, mask, 1.0 / (1.0 - p))


def _bias_grad(g: torch.Tensor, b: torch.Tensor | None, need: bool) -> torch.Tensor | None:
    return g.sum(0).to(b.dtype) if need and b is not None else None


class Sums:
    """One fp32 buffer ``[groups, W]`` for the per-group partial column sums of a layer's
    backward launches, reduced by one ``sum`` at the end: three reductions, their casts and
    buffers become one of each. ``take(*wanted)`` hands out the next columns, one width per
    wanted sum (in launch order)."""

    def __init__(self, widths: list[int], groups: int, device: torch.device) -> None:
        self.widths = widths
        self.part = torch.empty((groups, sum(widths)), dtype=torch.float32, device=device)
        self._col = 0
        self._next = 0

    def take(self, *wanted: bool) -> int:
        col = self._col
        for flag in wanted:
            if flag:
                self._col += self.widths[self._next]
                self._next += 1
        return col

    def reduce(self, dtype: torch.dtype) -> list[torch.Tensor]:
        return list(self.part.sum(0).to(dtype).split(self.widths))


class _Steps:
    """The backward implementations of a layer's fused steps and their declared extras."""

    def __init__(self, kernels: LayerKernels, x: torch.Tensor, widths: list[int]) -> None:
        ln = kernels.backward_of(kernels.add_layer_norm)
        ba = kernels.backward_of(kernels.bias_act)
        self.attention = kernels.backward_of(kernels.attention).backward_fn
        self.ln = ln.backward_fn
        self.ba = ba.backward_fn
        self.ln_dropout = ln.extra("dropout_backward")
        self.ba_dropout = ba.extra("dropout_backward")
        self.sums: Sums | None = None
        fuses = ln.extra("backward_fuses")
        if (
            widths
            and self.ln_dropout is not None
            and self.ba_dropout is not None
            and fuses is not None
            and fuses(x.shape[1], x.dtype)
        ):
            partial_groups = ln.extra("partial_groups")
            assert partial_groups is not None  # declared beside backward_fuses
            self.sums = Sums(widths, partial_groups(x.device), x.device)

    def ln_dropout_backward(
        self,
        args: AddLayerNormArgs,
        inputs: AddLayerNormBackwardInputs,
        *,
        mask: torch.Tensor | None,
        p: float,
        linear_bias: torch.Tensor | None,
        need_linear_bias: bool,
    ) -> AddLayerNormDropoutGrads:
        """Backward of ``LN(dropout(z) + residual)`` (``args.x = dropout(z)``): the gradients of
        the sum's summands, of ``z`` and of the parameters, and ``z_sum``, ``z``'s gradient
        summed over the tokens (the bias of the Linear that made ``z``); with :class:`Sums`,
        the three column sums stay in its buffer and come back as None."""
        colsum = linear_bias.dtype if need_linear_bias and linear_bias is not None else None
        fused, sums = self.ln_dropout, self.sums
        if fused is not None and sums is not None:
            col = sums.take(
                inputs.need_weight and args.weight is not None,
                inputs.need_bias and args.bias is not None,
                colsum is not None,
            )
            return fused(args, inputs, mask=mask, p=p, colsum_dtype=colsum, part=sums.part, part_col=col)
        if fused is not None:
            return fused(args, inputs, mask=mask, p=p, colsum_dtype=colsum)
        grads = self.ln(args, inputs)
        dz = _dropout_backward(grads.x, mask, p)
        return AddLayerNormDropoutGrads(
            grads.x, dz, grads.weight, grads.bias, _bias_grad(dz, linear_bias, colsum is not None)
        )

    def act_dropout_backward(
        self, args: BiasActArgs, g: torch.Tensor, *, mask: torch.Tensor | None, p: float, need_bias: bool
    ) -> BiasActGrads:
        """Backward of ``dropout(act(x + bias))`` for the gradient ``g`` of its output."""
        fused, sums = self.ba_dropout, self.sums
        if fused is not None and sums is not None:
            if need_bias and args.bias is not None:
                inputs = BiasActBackwardInputs(g, need_bias=True)
                return fused(args, inputs, mask=mask, p=p, part=sums.part, part_col=sums.take(True))
            return fused(args, BiasActBackwardInputs(g, need_bias=False), mask=mask, p=p)
        if fused is not None and mask is not None:
            return fused(args, BiasActBackwardInputs(g, need_bias), mask=mask, p=p)
        return self.ba(args, BiasActBackwardInputs(_dropout_backward(g, mask, p), need_bias))


def layer_backward(
    spec: LayerSpec,
    w: LayerWeights,
    kernels: LayerKernels,
    s: dict,
    max_len: int,
    causal: bool,
    seed: int,
    dy: torch.Tensor,
    need_x: bool,
    need: LayerNeeds,
) -> LayerGrads:
    """The layer's gradients for the gradient ``dy`` of its output; ``s``: the tensors the
    forward saved by name (:data:`ragged.nn.layer.SAVED`); ``need``: per weight, whether its
    gradient is wanted."""
    norm_first = spec.norm_first
    p_attn, p1, p_ff, p2 = spec.dropout
    eps1, eps2 = spec.eps
    heads, head_dim = spec.heads, spec.head_dim
    x, cu = s["x"], s["cu"]
    dy = dy.contiguous()
    n_tok, d = x.shape
    dn1w = dn1b = dn2w = dn2b = None
    # the column sums (LayerNorm weights and biases, Linear biases) of the fused launches go to
    # one buffer, reduced once at the end (Sums); wanted: in launch order
    want_n1 = (need.norm1_w and w.norm1_w is not None, need.norm1_b and w.norm1_b is not None)
    want_n2 = (need.norm2_w and w.norm2_w is not None, need.norm2_b and w.norm2_b is not None)
    want_b1, want_b2 = need.ff1_b and w.ff1_b is not None, need.ff2_b and w.ff2_b is not None
    want_out_b = need.out_b and w.out_b is not None
    if norm_first:
        wanted = [want_b1, *want_n2, want_out_b, *want_n1]
        names = ["b1", "n2w", "n2b", "out_b", "n1w", "n1b"]
    else:
        wanted = [*want_n2, want_b2, want_b1, *want_n1, want_out_b]
        names = ["n2w", "n2b", "b2", "b1", "n1w", "n1b", "out_b"]
    ff = w.ff1_w.shape[0]
    widths = [ff if name == "b1" else d for name, flag in zip(names, wanted) if flag]
    steps = _Steps(kernels, x, widths)
    x1, h2, hid, g, f = s["x1"], s["h2"], s["hid"], s["g"], s["f"]
    # feed-forward block; d_res: the gradient of the block's residual input (x1)
    if norm_first:
        d_res = dy
        df = _dropout_backward(dy, s["m3"], p2)
        db2 = _bias_grad(df, w.ff2_b, need.ff2_b)
    else:
        n2 = steps.ln_dropout_backward(
            AddLayerNormArgs(f, x1, w.norm2_w, w.norm2_b, eps2),
            AddLayerNormBackwardInputs(dy, None, s["mean3"], s["rstd3"], bool(need.norm2_w), bool(need.norm2_b)),
            mask=s["m3"],
            p=p2,
            linear_bias=w.ff2_b,
            need_linear_bias=bool(need.ff2_b),
        )
        d_res, df, dn2w, dn2b, db2 = n2.x, n2.z, n2.weight, n2.bias, n2.z_sum
    dw2 = torch.mm(df.t(), g) if need.ff2_w else None
    act = steps.act_dropout_backward(
        BiasActArgs(hid, w.ff1_b, cast(str, spec.activation)),  # a fused step: a named activation
        torch.mm(df, w.ff2_w),
        mask=s["m2"],
        p=p_ff,
        need_bias=bool(need.ff1_b),
    )
    dhid, db1 = act.x, act.bias
    dw1 = torch.mm(dhid.t(), h2) if need.ff1_w else None
    # attention block; ds: the gradient of both summands of s = drop1(sa) + x, dsa: of the
    # output projection (through drop1)
    if norm_first:
        # h2 = LN2(s), x1 = s: the LayerNorm backward adds the returned sum's gradient (the sum
        # kept, it stands as x with no residual)
        n2 = steps.ln_dropout_backward(
            AddLayerNormArgs(x1, None, w.norm2_w, w.norm2_b, eps2),
            AddLayerNormBackwardInputs(
                torch.mm(dhid, w.ff1_w), d_res, s["mean2"], s["rstd2"], bool(need.norm2_w), bool(need.norm2_b)
            ),
            mask=s["m1"],
            p=p1,
            linear_bias=w.out_b,
            need_linear_bias=bool(need.out_b),
        )
        ds, dsa, dn2w, dn2b, db_out = n2.x, n2.z, n2.weight, n2.bias, n2.z_sum
    else:
        dx1 = torch.addmm(d_res, dhid, w.ff1_w)
        n1 = steps.ln_dropout_backward(
            AddLayerNormArgs(s["sa"], x, w.norm1_w, w.norm1_b, eps1),
            AddLayerNormBackwardInputs(dx1, None, s["mean2"], s["rstd2"], bool(need.norm1_w), bool(need.norm1_b)),
            mask=s["m1"],
            p=p1,
            linear_bias=w.out_b,
            need_linear_bias=bool(need.out_b),
        )
        ds, dsa, dn1w, dn1b, db_out = n1.x, n1.z, n1.weight, n1.bias, n1.z_sum
    dw_out = torch.mm(dsa.t(), s["a"]) if need.out_w else None
    q, k, v = s["q"], s["k"], s["v"]
    da = torch.mm(dsa, w.out_w).view(n_tok, heads, head_dim)
    dqkv = torch.empty((n_tok, 3, heads, head_dim), dtype=q.dtype, device=q.device)
    table, buckets = spec.position_bias or (None, None)
    args = AttentionArgs(
        q=q,
        k=k,
        v=v,
        cu_q=cu,
        cu_k=cu,
        max_q=max_len,
        max_k=max_len,
        causal=causal,
        scale=spec.scale,
        dropout_p=p_attn,
        seed=seed,
        bias_table=table,
        bias_buckets=buckets,
    )
    dq, dk, dv = dqkv.unbind(1)
    got = steps.attention(
        args, AttentionBackwardInputs(grad_out=da, out=s["o"], lse=s["lse"]), grads=AttentionGrads(q=dq, k=dk, v=dv)
    )
    dtable = got.bias_table
    dqkv = dqkv.view(n_tok, 3 * d)
    dw_in = torch.mm(dqkv.t(), s["h1"]) if need.in_w else None
    db_in = _bias_grad(dqkv, w.in_b, need.in_b)
    dx = None
    if need_x or (norm_first and any(want_n1)):
        if norm_first:
            n1_args = AddLayerNormArgs(x, None, w.norm1_w, w.norm1_b, eps1)
            n1_inputs = AddLayerNormBackwardInputs(
                torch.mm(dqkv, w.in_w), None, s["mean1"], s["rstd1"], bool(need.norm1_w), bool(need.norm1_b)
            )
            if steps.sums is not None:
                dx_ln = steps.ln_dropout_backward(
                    n1_args, n1_inputs, mask=None, p=0.0, linear_bias=None, need_linear_bias=False
                ).x
            else:
                n1 = steps.ln(n1_args, n1_inputs)
                dx_ln, dn1w, dn1b = n1.x, n1.weight, n1.bias
            dx = ds + dx_ln if need_x else None
        else:
            dx = torch.addmm(ds, dqkv, w.in_w)
    if steps.sums is not None:  # one reduction for every column sum above
        reduced = iter(steps.sums.reduce(x.dtype))
        got = {name: next(reduced) for name, flag in zip(names, wanted) if flag}
        db1, db_out = got.get("b1"), got.get("out_b")
        dn1w, dn1b, dn2w, dn2b = got.get("n1w"), got.get("n1b"), got.get("n2w"), got.get("n2b")
        if not norm_first:
            db2 = got.get("b2")
    weights = LayerWeightGrads(
        in_w=dw_in,
        in_b=db_in,
        out_w=dw_out,
        out_b=db_out,
        norm1_w=dn1w,
        norm1_b=dn1b,
        ff1_w=dw1,
        ff1_b=db1,
        ff2_w=dw2,
        ff2_b=db2,
        norm2_w=dn2w,
        norm2_b=dn2b,
    )
    return LayerGrads(x=dx, weights=weights, table=dtable)
