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
and sums: the same gradients, in more launches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ragged.ops.attention import AttentionArgs, AttentionBackwardInputs, AttentionGrads

from .layer_spec import LayerKernels, LayerSpec, LayerWeights


class LayerGrads(NamedTuple):
    """The gradients of one layer: of its input ``x``, of each weight (None where not wanted or
    absent) and of the position bias's table (``spec.position_bias``; None without one)."""

    x: torch.Tensor | None
    weights: LayerWeights
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
        self.sums = None
        fuses = ln.extra("backward_fuses")
        if (
            widths
            and self.ln_dropout is not None
            and self.ba_dropout is not None
            and fuses is not None
            and fuses(x.shape[1], x.dtype)
        ):
            self.sums = Sums(widths, ln.extra("partial_groups")(x.device), x.device)

    def ln_dropout_backward(
        self, dy, ds, a, b, weight, bias, mean, rstd, need_weight, need_bias, mask, p, linear_bias, need_linear_bias
    ):
        """Backward of ``LN(dropout(z) + ...)``: ``(ds_total, dz, dweight, dbias, dlinear_bias)`` with
        ``dlinear_bias`` the sum of ``dz`` over the tokens (the bias of the Linear that made ``z``);
        with :class:`Sums`, the three column sums stay in its buffer and come back as None."""
        colsum = linear_bias.dtype if need_linear_bias and linear_bias is not None else None
        if self.sums is not None:
            col = self.sums.take(need_weight and weight is not None, need_bias and bias is not None, colsum is not None)
            return self.ln_dropout(
                dy, ds, a, b, weight, bias, mean, rstd, need_weight, need_bias, mask, p, colsum, self.sums.part, col
            )
        if self.ln_dropout is not None:
            return self.ln_dropout(dy, ds, a, b, weight, bias, mean, rstd, need_weight, need_bias, mask, p, colsum)
        dsum, dweight, dbias = self.ln(dy, ds, a, b, weight, bias, mean, rstd, need_weight, need_bias)
        dz = _dropout_backward(dsum, mask, p)
        return dsum, dz, dweight, dbias, _bias_grad(dz, linear_bias, colsum is not None)

    def act_dropout_backward(self, g, mask, p, hid, b1, act, need_b1):
        """Backward of ``dropout(act(hid + b1))`` for the gradient ``g`` of its output: ``(dhid, db1)``."""
        if self.sums is not None:
            if need_b1 and b1 is not None:
                return self.ba_dropout(
                    g, hid, b1, act, True, mask=mask, p=p, part=self.sums.part, part_col=self.sums.take(True)
                )
            return self.ba_dropout(g, hid, b1, act, False, mask=mask, p=p)
        if self.ba_dropout is not None and mask is not None:
            return self.ba_dropout(g, hid, b1, act, need_b1, mask=mask, p=p)
        return self.ba(_dropout_backward(g, mask, p), hid, b1, act, need_b1)


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
    need: LayerWeights,
) -> LayerGrads:
    """The layer's gradients for the gradient ``dy`` of its output; ``s``: the tensors the
    forward saved by name (:data:`ragged.nn.layer.SAVED`); ``need``: per weight, whether its
    gradient is wanted."""
    norm_first = spec.norm_first
    p_attn, p1, p_ff, p2 = spec.dropout
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
        d_res, df, dn2w, dn2b, db2 = steps.ln_dropout_backward(
            dy,
            None,
            f,
            x1,
            w.norm2_w,
            w.norm2_b,
            s["mean3"],
            s["rstd3"],
            need.norm2_w,
            need.norm2_b,
            s["m3"],
            p2,
            w.ff2_b,
            need.ff2_b,
        )
    dw2 = torch.mm(df.t(), g) if need.ff2_w else None
    dhid, db1 = steps.act_dropout_backward(
        torch.mm(df, w.ff2_w), s["m2"], p_ff, hid, w.ff1_b, spec.activation, need.ff1_b
    )
    dw1 = torch.mm(dhid.t(), h2) if need.ff1_w else None
    # attention block; ds: the gradient of both summands of s = drop1(sa) + x, dsa: of the
    # output projection (through drop1)
    if norm_first:
        # h2 = LN2(s), x1 = s: the LayerNorm backward adds the returned sum's gradient
        ds, dsa, dn2w, dn2b, db_out = steps.ln_dropout_backward(
            torch.mm(dhid, w.ff1_w),
            d_res,
            x1,
            None,
            w.norm2_w,
            w.norm2_b,
            s["mean2"],
            s["rstd2"],
            need.norm2_w,
            need.norm2_b,
            s["m1"],
            p1,
            w.out_b,
            need.out_b,
        )
    else:
        dx1 = torch.addmm(d_res, dhid, w.ff1_w)
        ds, dsa, dn1w, dn1b, db_out = steps.ln_dropout_backward(
            dx1,
            None,
            s["sa"],
            x,
            w.norm1_w,
            w.norm1_b,
            s["mean2"],
            s["rstd2"],
            need.norm1_w,
            need.norm1_b,
            s["m1"],
            p1,
            w.out_b,
            need.out_b,
        )
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
            dh1 = torch.mm(dqkv, w.in_w)
            if steps.sums is not None:
                dx_ln = steps.ln_dropout_backward(
                    dh1,
                    None,
                    x,
                    None,
                    w.norm1_w,
                    w.norm1_b,
                    s["mean1"],
                    s["rstd1"],
                    need.norm1_w,
                    need.norm1_b,
                    None,
                    0.0,
                    None,
                    False,
                )[0]
            else:
                dx_ln, dn1w, dn1b = steps.ln(
                    dh1, None, x, None, w.norm1_w, w.norm1_b, s["mean1"], s["rstd1"], need.norm1_w, need.norm1_b
                )
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
    weights = LayerWeights(
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
