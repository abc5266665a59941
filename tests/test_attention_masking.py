"""Every position a query may not see stays out of the Triton attention kernels' sums, in the
forward and in both backward kernels (dQ; dK / dV), on CPU through the Triton interpreter.

The hard case is a sequence with one key (or a few) and large scores. A kernel tile holds
BLOCK_N key columns; the ones past the sequence's end load as K = V = 0. Left in P, such a
column gets ``p = exp(0 - lse)``: with a very negative ``lse`` that is huge, ``dS`` overflows
the input dtype when it is cast for the ``dS @ K`` product (float16 past 65504; any dtype once
``p`` passes float32's range) and ``inf * 0`` puts NaN into dQ. So every test gives the
sequences with at most a few keys scores of a large scale (``_AMPLITUDE``: ``lse`` well below
``-11`` in float16, below ``-89`` in bfloat16 and float32), and the others scores of order one,
where a wrong mask shows in the values; the queries of the few-key sequences that see no key
(causal, windows) check that ``lse = -inf`` rows stay at zero.

Oracle: ``ragged.reference_attention`` and ``ragged.reference_attention_backward`` in float64
(the latter written out, not autograd). Error rule (flash-attn's): the kernel's largest error
against float64 may be at most twice that of the reference run in the input dtype, plus one
unit in the last place of the largest value. bfloat16 runs with the interpreter's dot fixed
(:func:`_bfloat16_as_on_a_gpu`). The interpreter's tiles are 16 x 16, so a 1-key sequence leaves 15 key
columns of its tile past the end, and the 17- and 20-token sequences span a full tile and a
ragged one.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from conftest import TRITON_ON_CPU

import ragged
from ragged.kernels.triton import ATTENTION_HEAD_DIMS

pytestmark = pytest.mark.skipif(not TRITON_ON_CPU, reason="the Triton kernels need TRITON_INTERPRET=1 on CPU")

DTYPES = [torch.float16, torch.bfloat16]
# Score scale of the few-key sequences (the scores' standard deviation is its square): float16
# overflows at lse < -11 or so, bfloat16 and float32 only when exp(-lse) passes float32's range.
_AMPLITUDE = {torch.float16: 3.0, torch.bfloat16: 12.0, torch.float32: 12.0}
_FEW_KEYS = 2  # sequences with at most this many keys get the large scores

# The one-key shape at interpreter size: several queries per sequence, one key each, a 0-key one.
ONE_KEY_Q, ONE_KEY_K = [7, 3, 12, 4], [1, 1, 1, 0]
# Masks at work: 1- and 2-key sequences (query rows past the diagonal of a few keys), a key-only
# sequence (dK = dV = 0), a query-only one (out = dQ = 0), sequences of a tile and a ragged one
# with fewer and more queries than keys.
MIXED_Q = [7, 3, 0, 20, 5, 2, 1, 3]
MIXED_K = [1, 1, 4, 17, 0, 1, 2, 19]

# (causal, window_size): full, causal, and windows bounded on the left, the right, both sides,
# the diagonal only, and combined with causal masking.
MASKS = {
    "full": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "left": (False, (1, -1)),
    "right": (False, (-1, 1)),
    "both": (False, (2, 3)),
    "diagonal": (False, (0, 0)),
    "causal_left": (True, (1, -1)),
}


@pytest.fixture(autouse=True)
def _bfloat16_as_on_a_gpu(monkeypatch):
    """The interpreter keeps bfloat16 tensors as their uint16 bit patterns: ``tl.dot`` multiplies
    those patterns as integers, and float32 -> bfloat16 casts truncate. Here a bfloat16 dot
    operand is widened to the float32 it stands for (exact: its bits in the high half) and the
    cast rounds to nearest even, as a GPU does, so that the kernels' bfloat16 paths can be held
    to the same error rule as the float16 ones."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    dot, cast = builder.create_dot, builder.cast_impl

    def widened(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        nearest = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nearest = np.where(np.isnan(src.data), np.uint16(0x7FC0), nearest)
        return interpreter.TensorHandle(nearest, tl.bfloat16)

    monkeypatch.setattr(builder, "create_dot", create_dot)
    monkeypatch.setattr(builder, "cast_impl", cast_impl)


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def _cu(lengths) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _inputs(lq, lk, heads, kv_heads, dim, dtype, seed):
    """q, k, v and an upstream gradient: float64 draws cast to ``dtype``; the query rows of the
    sequences with at most _FEW_KEYS keys and their keys scaled by _AMPLITUDE[dtype] (values
    not: the scores make the overflow, and values of order one keep the stored output's rounding,
    which reaches the gradients through ``delta = rowsum(O * dO)``, small)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), heads, dim, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lk), kv_heads, dim, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lk), kv_heads, dim, generator=g, dtype=torch.float64)
    do = torch.randn(sum(lq), heads, dim, generator=g, dtype=torch.float64)
    amp = _AMPLITUDE[dtype]
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for b, n in enumerate(lk):
        if n <= _FEW_KEYS:
            q[cq[b] : cq[b + 1]] *= amp
            k[ck[b] : ck[b + 1]] *= amp
    return q.to(dtype), k.to(dtype), v.to(dtype), do.to(dtype)


def _leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def _kernel(q, k, v, do, lq, lk, causal, window):
    """``(out, lse, dq, dk, dv)`` of the Triton backend through the public API."""
    a, b, c = _leaves(q, k, v)
    out, lse = ragged.varlen_attention(
        a,
        b,
        c,
        _cu(lq),
        _cu(lk),
        max(lq),
        max(lk),
        causal=causal,
        return_lse=True,
        backend="triton",
        window_size=window,
    )
    out.backward(do)
    return out.detach(), lse, a.grad, b.grad, c.grad


def _low(q, k, v, do, lq, lk, causal, window):
    """``(out, dq, dk, dv)`` of the reference computed in the inputs' dtype (autograd)."""
    a, b, c = _leaves(q, k, v)
    out, _ = ragged.reference_attention(a, b, c, _cu(lq), _cu(lk), causal, compute_dtype=q.dtype, window_size=window)
    out.backward(do)
    return out.detach(), a.grad, b.grad, c.grad


def _exact(q, k, v, do, lq, lk, causal, window, keep=None, dropout_p=0.0):
    """``(out, lse, dq, dk, dv)`` in float64."""
    args = [t.double() for t in (q, k, v)]
    out, lse = ragged.reference_attention(*args, _cu(lq), _cu(lk), causal, None, keep, dropout_p, window_size=window)
    grads = ragged.reference_attention_backward(
        do.double(), *args, _cu(lq), _cu(lk), causal, None, keep, dropout_p, window
    )
    return (out, lse, *grads)


def _check(got, low, exact, what):
    """Every result finite and within flash-attn's error rule against float64; ``got`` entries
    that are None (no gradient asked for) are skipped."""
    for name, g, lo, e in zip(("out", "dq", "dk", "dv"), got, low, exact):
        if g is None:
            continue
        assert g.shape == e.shape, (what, name)
        bad = ~torch.isfinite(g)
        assert not bad.any(), f"{what}: {name} has {int(bad.any(-1).any(-1).sum())} rows with NaN or inf"
        if e.numel() == 0:
            continue
        err = (g.double() - e).abs().max().item()
        err_low = (lo.double() - e).abs().max().item()
        tol = 2 * err_low + torch.finfo(g.dtype).eps * (1 + e.abs().max().item())
        assert err <= tol, f"{what}: {name} max error {err:.3g} > {tol:.3g} (dtype reference {err_low:.3g})"


def _check_lse(lse, exact_lse, what):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(exact_lse)), f"{what}: lse = -inf on other rows"
    seen = torch.isfinite(exact_lse)
    assert torch.isfinite(lse[seen]).all(), f"{what}: lse not finite where a key is seen"
    torch.testing.assert_close(lse[seen].double(), exact_lse[seen].double(), atol=1e-3, rtol=1e-4)


def _zero_where_unseen(lq, lk, got, exact, what):
    """Sequences without queries give their keys no gradient, sequences without keys give their
    queries zeros; the oracle agrees exactly."""
    out, dq, dk, dv = got
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for b, (nq, nk) in enumerate(zip(lq, lk)):
        if nk == 0:
            assert torch.all(out[cq[b] : cq[b + 1]] == 0) and torch.all(dq[cq[b] : cq[b + 1]] == 0), (what, b)
        if nq == 0:
            assert torch.all(dk[ck[b] : ck[b + 1]] == 0) and torch.all(dv[ck[b] : ck[b + 1]] == 0), (what, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", ATTENTION_HEAD_DIMS)
def test_one_key_per_sequence_every_head_dim(dim, dtype):
    """Non-causal attention over sequences of one key (and one of none): out = v, dQ = dK = 0,
    dV = the sum of dO over the sequence's queries."""
    q, k, v, do = _inputs(ONE_KEY_Q, ONE_KEY_K, 2, 2, dim, dtype, _seed("one-key", dim, dtype))
    what = f"D={dim} {dtype}"
    out, lse, dq, dk, dv = _kernel(q, k, v, do, ONE_KEY_Q, ONE_KEY_K, False, (-1, -1))
    exact = _exact(q, k, v, do, ONE_KEY_Q, ONE_KEY_K, False, (-1, -1))
    _check((out, dq, dk, dv), _low(q, k, v, do, ONE_KEY_Q, ONE_KEY_K, False, (-1, -1)), exact[:1] + exact[2:], what)
    _check_lse(lse, exact[1], what)
    _zero_where_unseen(ONE_KEY_Q, ONE_KEY_K, (out, dq, dk, dv), exact, what)
    reach = -11.0 if dtype == torch.float16 else -89.0
    assert exact[1][torch.isfinite(exact[1])].min() < reach, "the case no longer reaches the overflow"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", list(MASKS))
def test_masks_with_few_key_sequences(mask, dtype):
    """Full, causal and window masks, GQA (4 query heads over 2), at a head dim below the tile
    (D = 80 pads to 128 columns), over 0-, 1-, 2-key and longer sequences."""
    causal, window = MASKS[mask]
    dim = 80
    q, k, v, do = _inputs(MIXED_Q, MIXED_K, 4, 2, dim, dtype, _seed("masks", mask, dtype))
    what = f"{mask} {dtype}"
    out, lse, dq, dk, dv = _kernel(q, k, v, do, MIXED_Q, MIXED_K, causal, window)
    exact = _exact(q, k, v, do, MIXED_Q, MIXED_K, causal, window)
    _check((out, dq, dk, dv), _low(q, k, v, do, MIXED_Q, MIXED_K, causal, window), exact[:1] + exact[2:], what)
    _check_lse(lse, exact[1], what)
    _zero_where_unseen(MIXED_Q, MIXED_K, (out, dq, dk, dv), exact, what)


def _direct(q, k, v, do, lq, lk, causal, window, dropout_p=0.0, seed=0, spare=0):
    """The Triton launchers called directly (as the op calls them), with ``spare`` NaN rows past
    the last offset in every input, and NaN in the spare rows of out, lse and dO given to the
    backward; ``(out, lse, dq, dk, dv)`` of the real rows."""
    from ragged.kernels.triton import attention as triton_attention
    from ragged.ops.attention import AttentionArgs, AttentionBackwardInputs

    def padded(x):
        return torch.cat([x, torch.full((spare, *x.shape[1:]), float("nan"), dtype=x.dtype)])

    nq, nk = q.shape[0], k.shape[0]
    q, k, v, do = padded(q), padded(k), padded(v), padded(do)
    scale = q.shape[-1] ** -0.5
    args = AttentionArgs(
        q=q,
        k=k,
        v=v,
        cu_q=_cu(lq),
        cu_k=_cu(lk),
        max_q=max(lq),
        max_k=max(lk),
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        seed=seed,
        window_left=window[0] if window else -1,
        window_right=window[1] if window else -1,
    )
    out, lse = triton_attention.forward(args)
    out[nq:] = float("nan")
    lse[nq:] = float("nan")
    dq, dk, dv, _ = triton_attention.backward(args, AttentionBackwardInputs(grad_out=do, out=out, lse=lse))
    return out[:nq], lse[:nq], dq[:nq], dk[:nk], dv[:nk]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", ["full", "right", "both"])
def test_spare_rows_past_the_last_offset_stay_unread(mask, dtype):
    """A graphed bucket's layout: NaN rows past ``offsets[-1]`` in q, k, v, dO, out and lse (the
    public functions check ``offsets[-1] == T`` for CPU offsets, so the launchers are called as
    the op calls them). The real rows match the oracle and hold no NaN."""
    causal, window = MASKS[mask]
    q, k, v, do = _inputs(MIXED_Q, MIXED_K, 2, 1, 32, dtype, _seed("spare", mask, dtype))
    what = f"{mask} {dtype} spare rows"
    out, lse, dq, dk, dv = _direct(q, k, v, do, MIXED_Q, MIXED_K, causal, window, spare=9)
    exact = _exact(q, k, v, do, MIXED_Q, MIXED_K, causal, window)
    _check((out, dq, dk, dv), _low(q, k, v, do, MIXED_Q, MIXED_K, causal, window), exact[:1] + exact[2:], what)
    _check_lse(lse, exact[1], what)


@pytest.mark.parametrize("mask", ["full", "left"])
def test_dropout_with_few_key_sequences(mask):
    """Dropout does not hide a column past the end: a dropped one still carries p into dS."""
    from ragged.ops.attention_reference import reference_dropout_mask

    causal, window = MASKS[mask]
    dtype, p, seed = torch.float16, 0.25, _seed("dropout-seed", mask) % (2**31 - 1)
    q, k, v, do = _inputs(MIXED_Q, MIXED_K, 2, 2, 16, dtype, _seed("dropout", mask))
    what = f"{mask} dropout"
    keep = reference_dropout_mask(seed, p, _cu(MIXED_Q), 2, q.shape[0], max(MIXED_K), q.device)
    out, lse, dq, dk, dv = _direct(q, k, v, do, MIXED_Q, MIXED_K, causal, window, dropout_p=p, seed=seed)
    exact = _exact(q, k, v, do, MIXED_Q, MIXED_K, causal, window, keep, p)
    for name, g, e in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), exact[:1] + exact[2:]):
        assert torch.isfinite(g).all(), f"{what}: {name} has NaN or inf"
        # float16 storage of values of order _AMPLITUDE ** 2 (dV sums several of them)
        torch.testing.assert_close(
            g.double(), e, atol=2e-2 * (1 + e.abs().max().item()), rtol=1e-2, msg=lambda m, n=name: f"{what}: {n}: {m}"
        )
    _check_lse(lse, exact[1], what)


def test_float32_scores_past_float32_range():
    """float32 inputs: with lse below -89, exp(-lse) is inf in float32 itself."""
    dtype = torch.float32
    q, k, v, do = _inputs(ONE_KEY_Q, ONE_KEY_K, 2, 1, 64, dtype, _seed("f32"))
    out, lse, dq, dk, dv = _kernel(q, k, v, do, ONE_KEY_Q, ONE_KEY_K, False, (-1, -1))
    exact = _exact(q, k, v, do, ONE_KEY_Q, ONE_KEY_K, False, (-1, -1))
    assert exact[1][torch.isfinite(exact[1])].min() < -89, "the case no longer passes float32's range"
    for name, g, e in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), exact[:1] + exact[2:]):
        assert torch.isfinite(g).all(), f"float32: {name} has NaN or inf"
        torch.testing.assert_close(
            g.double(), e, atol=1e-4 * (1 + e.abs().max().item()), rtol=1e-4, msg=lambda m, n=name: f"float32: {n}: {m}"
        )
    _check_lse(lse, exact[1], "float32")
