"""Relative-position bias (``position_bias=(table, buckets)``, MPNet's and T5's form) on CPU.

The oracle is written here from the definition alone: query ``i`` and key ``j`` of a sequence
(positions within it) under head ``h`` score ``scale * q_i . k_j + table[buckets[j - i + max_q
- 1], h]``, the bias materialised per sequence as ``[H, Lq, Lk]``, then masked (bottom-right
causal, windows) and softmaxed in float64; queries that see no key get zeros and ``lse = -inf``.
Gradients of q, k, v and the table are float64 autograd of it. ``ragged.reference_attention``
(and its written-out backward) is checked against it, then every backend that takes CPU tensors
(Triton through the interpreter, see ``conftest.py``) against both. Buckets are random (any
mapping of distances to rows) except where MPNet's own bucketing is the point. Sizes stay
small for the interpreter, whose tiles are 16 x 16: a 40-token sequence spans three blocks.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import pytest
import torch
from conftest import TRITON_ON_CPU, cpu_backends

import ragged
from ragged import backends
from ragged.ops.attention import AttentionArgs, AttentionBackwardInputs, AttentionGrads

BACKENDS = FORWARD_BACKENDS = cpu_backends()
needs_triton = pytest.mark.skipif(not TRITON_ON_CPU, reason="the Triton kernels need TRITON_INTERPRET=1 on CPU")

FWD_TOL = {"atol": 2e-5, "rtol": 2e-5}
BWD_TOL = {"atol": 1e-4, "rtol": 1e-4}
BUCKETS = 7  # a table row count that is no power of two

# name: (query lengths, key lengths, H, H_kv, D)
CASES = {
    "lengths_0_1_odd": ([5, 0, 1, 19, 12], [5, 0, 1, 19, 12], 4, 4, 16),
    "gqa": ([5, 0, 23, 12], [5, 0, 23, 12], 4, 2, 32),
    "one_long_mqa": ([40, 3], [40, 3], 2, 1, 16),
    "cross_q_shorter": ([2, 7, 1, 16], [5, 19, 3, 33], 2, 2, 16),
    "cross_q_longer": ([5, 20, 3, 33], [2, 7, 3, 17], 2, 1, 16),
    "empty_in_k": ([4, 3], [0, 5], 2, 2, 16),
    "single_token": ([1], [1], 1, 1, 16),
    "batch0": ([], [], 2, 2, 16),
}
WINDOWS = [(0, 0), (3, -1), (-1, 2), (2, 5)]


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def _cu(lengths, dtype=torch.int32):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype)


def _randn(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _qkv(lq, lk, heads, kv_heads, dim, seed, dtype=torch.float32):
    return (
        _randn((sum(lq), heads, dim), seed, dtype),
        _randn((sum(lk), kv_heads, dim), seed + 1, dtype),
        _randn((sum(lk), kv_heads, dim), seed + 2, dtype),
    )


def _bias(heads, max_q, max_k, seed, buckets=BUCKETS, dtype=torch.float32):
    """``(table [buckets, heads], buckets [max_q + max_k - 1] int64)``, random rows per distance."""
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, buckets, (max(max_q + max_k - 1, 0),), generator=g)
    return _randn((buckets, heads), seed + 1, dtype), index


def _mpnet_buckets(distance: torch.Tensor, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """T5's bidirectional bucket of each key-minus-query distance (HuggingFace MPNet's formula):
    half the buckets for keys after the query, exact below a quarter of the buckets, then
    logarithmic up to ``max_distance``."""
    n = -distance
    half = num_buckets // 2
    out = (n < 0).long() * half
    n = n.abs()
    exact = half // 2
    large = exact + (torch.log(n.float().clamp_min(1) / exact) / math.log(max_distance / exact) * (half - exact)).long()
    return out + torch.where(n < exact, n, large.clamp_max(half - 1))


def _sees(nq, nk, causal, window):
    """``[nq, nk]`` bool from the definition: aligned position ``a = i + nk - nq``."""
    left, right = window
    a = torch.arange(nq).unsqueeze(1) + (nk - nq)
    j = torch.arange(nk).unsqueeze(0)
    seen = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        seen &= j <= a
    if left >= 0:
        seen &= j >= a - left
    if right >= 0:
        seen &= j <= a + right
    return seen


def _oracle(
    q, k, v, lq, lk, table, buckets, max_q, causal=False, window=(-1, -1), scale=None, keep=None, dropout_p=0.0
):
    """float64 ``(out [Tq, H, D], lse [Tq, H])``, differentiable in q, k, v and table."""
    heads, dim = q.shape[1], q.shape[2]
    group = heads // k.shape[1]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    outs, lses = [], []
    tq = tk = 0
    for nq, nk in zip(lq, lk):
        qb = q[tq : tq + nq].double().transpose(0, 1)
        kb = k[tk : tk + nk].double().transpose(0, 1).repeat_interleave(group, 0)
        vb = v[tk : tk + nk].double().transpose(0, 1).repeat_interleave(group, 0)
        distance = torch.arange(nk).unsqueeze(0) - torch.arange(nq).unsqueeze(1)  # j - i
        bias = table.double()[buckets[distance + max_q - 1]].permute(2, 0, 1)  # [H, nq, nk]
        scores = torch.matmul(qb, kb.transpose(1, 2)) * scale + bias
        seen = _sees(nq, nk, causal, window)
        blind = ~seen.any(1)
        lse = (
            torch.logsumexp(scores.masked_fill(~seen, float("-inf")), dim=-1)
            if nk
            else torch.full((heads, nq), float("-inf"), dtype=torch.float64)
        )
        probs = torch.softmax(scores.masked_fill(~seen & ~blind[:, None], float("-inf")), dim=-1)
        probs = probs * (~blind)[:, None].double()
        if keep is not None:
            probs = probs * keep[:, tq : tq + nq, :nk].double() / (1.0 - dropout_p)
        outs.append(torch.matmul(probs, vb).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
        tq += nq
        tk += nk
    if not outs:
        return q.double() * 0 + table.double().sum() * 0, torch.zeros(q.shape[:2], dtype=torch.float64)
    return torch.cat(outs), torch.cat(lses)


def _blind(lq, lk, causal, window=(-1, -1)):
    rows = [~_sees(nq, nk, causal, window).any(1) for nq, nk in zip(lq, lk)]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.bool)


def _forward_and_grads(fn, tensors, upstream):
    """``(out, lse, grads)`` of ``fn(*leaves) -> (out, lse)``, grads of ``<out, upstream>`` with
    respect to fresh leaves of ``tensors`` (zeros where a leaf gets none)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out, lse = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, upstream.to(out.dtype), allow_unused=True)
    return out.detach(), lse, tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))


def _check(out, lse, exp, exp_lse, blind, tol=FWD_TOL):
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), exp, **tol)
    assert torch.all(out[blind] == 0), "a query that sees no key must get zeros"
    assert lse.dtype == torch.float32 and lse.shape == exp_lse.shape
    assert torch.all(torch.isneginf(lse[blind])), "a query that sees no key must get lse = -inf"
    torch.testing.assert_close(lse[~blind].double(), exp_lse[~blind], **FWD_TOL)  # lse is float32


def _check_grads(got, ref, tol=BWD_TOL, names=("q", "k", "v", "table")):
    for name, g, r in zip(names, got, ref):
        assert not torch.isnan(g).any(), f"d{name} has NaN"
        assert g.shape == r.shape, f"d{name}: shape {tuple(g.shape)}, expected {tuple(r.shape)}"
        torch.testing.assert_close(g.double(), r.double(), **tol, msg=lambda m, n=name: f"d{n}: {m}")


def _run(backend, q, k, v, lq, lk, table, buckets, max_q, max_k, causal=False, window=(-1, -1), **kwargs):
    return ragged.varlen_attention(
        q,
        k,
        v,
        _cu(lq),
        _cu(lk),
        max_q,
        max_k,
        causal=causal,
        return_lse=True,
        backend=backend,
        window_size=window,
        position_bias=(table, buckets),
        **kwargs,
    )


# --------------------------------------------------------------------------------------
# The reference against the oracle


def test_oracle_and_mpnet_buckets_on_a_hand_case():
    """Two queries, three keys, one head: the bias row of each (i, j) is buckets[j - i + 1]."""
    table = torch.tensor([[0.0], [10.0], [20.0], [30.0]], dtype=torch.float64)
    buckets = torch.tensor([3, 2, 1, 0])  # distances -1, 0, 1, 2
    q = torch.zeros(2, 1, 4, dtype=torch.float64)
    kv = torch.zeros(3, 1, 4, dtype=torch.float64)
    _, lse = _oracle(q, kv, kv, [2], [3], table, buckets, 2)
    # i = 0 sees distances 0, 1, 2 -> 20, 10, 0; i = 1 sees -1, 0, 1 -> 30, 20, 10
    expected = [math.log(math.exp(20) + math.exp(10) + 1), math.log(math.exp(30) + math.exp(20) + math.exp(10))]
    torch.testing.assert_close(lse[:, 0], torch.tensor(expected, dtype=torch.float64))
    # MPNet's buckets: exact below 8 apart, keys after the query in the upper half
    got = _mpnet_buckets(torch.tensor([-200, -128, -9, -8, -7, -1, 0, 1, 7, 8, 9, 128, 200]))
    assert got.tolist() == [15, 15, 8, 8, 7, 1, 0, 17, 23, 24, 24, 31, 31]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_the_definition(case, causal):
    lq, lk, heads, kv_heads, dim = CASES[case]
    max_q, max_k = max(lq, default=0), max(lk, default=0)
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed(case, "ref"), torch.float64)
    table, buckets = _bias(heads, max_q, max_k, _seed(case, "bias"), dtype=torch.float64)
    exp, exp_lse = _oracle(q, k, v, lq, lk, table, buckets, max_q, causal)
    out, lse = ragged.reference_attention(q, k, v, _cu(lq), _cu(lk), causal, position_bias=(table, buckets))
    _check(out, lse, exp, exp_lse, _blind(lq, lk, causal), {"atol": 1e-12, "rtol": 1e-12})
    up = _randn(q.shape, _seed(case, "up"), torch.float64)
    tensors = (q, k, v, table)
    ref = _forward_and_grads(lambda a, b, c, t: _oracle(a, b, c, lq, lk, t, buckets, max_q, causal), tensors, up)[2]
    auto = _forward_and_grads(
        lambda a, b, c, t: ragged.reference_attention(a, b, c, _cu(lq), _cu(lk), causal, position_bias=(t, buckets)),
        tensors,
        up,
    )[2]
    _check_grads(auto, ref, {"atol": 1e-10, "rtol": 1e-10})
    written = ragged.reference_attention_backward(up, q, k, v, _cu(lq), _cu(lk), causal, position_bias=(table, buckets))
    assert len(written) == 4 and written[3].dtype == table.dtype
    _check_grads(written, ref, {"atol": 1e-10, "rtol": 1e-10})


def test_reference_takes_buckets_built_for_longer_queries():
    """``max_seqlen_q`` names what the buckets were built for (a padded bucket's length, say)."""
    lq, lk = [3, 6], [4, 2]
    q, k, v = _qkv(lq, lk, 2, 2, 16, _seed("longer"), torch.float64)
    table, buckets = _bias(2, 9, 8, _seed("longer-bias"), dtype=torch.float64)
    exp, _ = _oracle(q, k, v, lq, lk, table, buckets, 9)
    out, _ = ragged.reference_attention(q, k, v, _cu(lq), _cu(lk), position_bias=(table, buckets), max_seqlen_q=9)
    torch.testing.assert_close(out, exp, atol=1e-12, rtol=1e-12)


# --------------------------------------------------------------------------------------
# Every backend against the oracle


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", FORWARD_BACKENDS)
def test_backends_forward_without_grad(backend, case):
    """Inference (nothing requires grad): full, causal and windowed, buckets built for longer
    sequences than the batch's (``max_seqlen_*`` above the longest)."""
    lq, lk, heads, kv_heads, dim = CASES[case]
    max_q, max_k = max(lq, default=0) + 2, max(lk, default=0) + 1
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed(case, "fwd"))
    table, buckets = _bias(heads, max_q, max_k, _seed(case, "fwd-bias"))
    for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (2, 5)), (True, (3, -1))):
        out, lse = _run(backend, q, k, v, lq, lk, table, buckets, max_q, max_k, causal, window)
        exp, exp_lse = _oracle(q, k, v, lq, lk, table, buckets, max_q, causal, window)
        _check(out, lse, exp, exp_lse, _blind(lq, lk, causal, window))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_forward_and_gradients(backend, case, causal):
    lq, lk, heads, kv_heads, dim = CASES[case]
    max_q, max_k = max(lq, default=0), max(lk, default=0)
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed(case, "run"))
    table, buckets = _bias(heads, max_q, max_k, _seed(case, "run-bias"))
    up = _randn(q.shape, _seed(case, "run-up"))
    tensors = (q, k, v, table)
    out, lse, got = _forward_and_grads(
        lambda a, b, c, t: _run(backend, a, b, c, lq, lk, t, buckets, max_q, max_k, causal), tensors, up
    )
    exp, exp_lse, ref = _forward_and_grads(
        lambda a, b, c, t: _oracle(a, b, c, lq, lk, t, buckets, max_q, causal), tensors, up
    )
    _check(out, lse, exp, exp_lse, _blind(lq, lk, causal))
    _check_grads(got, ref)


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_with_windows(backend, window):
    """Windows (and a causal one) with buckets built for longer sequences than the batch's."""
    lq, lk, heads, kv_heads, dim = [5, 0, 35, 1, 12], [7, 3, 35, 1, 9], 2, 1, 16
    max_q, max_k = 38, 40
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed("window", window))
    table, buckets = _bias(heads, max_q, max_k, _seed("window-bias", window))
    up = _randn(q.shape, _seed("window-up", window))
    for causal in (False, True):
        tensors = (q, k, v, table)
        out, lse, got = _forward_and_grads(
            lambda a, b, c, t: _run(backend, a, b, c, lq, lk, t, buckets, max_q, max_k, causal, window), tensors, up
        )
        exp, exp_lse, ref = _forward_and_grads(
            lambda a, b, c, t: _oracle(a, b, c, lq, lk, t, buckets, max_q, causal, window), tensors, up
        )
        _check(out, lse, exp, exp_lse, _blind(lq, lk, causal, window))
        _check_grads(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mpnet_buckets_and_the_ragged_form(backend):
    """MPNet's 32 buckets over distances up to 44 apart, through ``ragged.attention``; a table
    in bfloat16 is read as float32 and gets its gradient in bfloat16; int32 buckets."""
    lengths = [44, 9, 0, 1, 30]
    q, k, v = _qkv(lengths, lengths, 2, 2, 16, _seed("mpnet"))
    max_len = max(lengths)
    buckets = _mpnet_buckets(torch.arange(-(max_len - 1), max_len)).to(torch.int32)
    table = (_randn((32, 2), _seed("mpnet-table")) * 2).to(torch.bfloat16).requires_grad_(True)
    rq, rk, rv = (ragged.RaggedTensor.from_lengths(t, lengths) for t in (q, k, v))
    out, lse = ragged.attention(rq, rk, rv, return_lse=True, backend=backend, position_bias=(table, buckets))
    up = _randn(q.shape, _seed("mpnet-up"))
    (dtable,) = torch.autograd.grad(out.values, table, up)
    assert dtable.dtype == torch.bfloat16 and dtable.shape == (32, 2)
    exp, exp_lse, ref = _forward_and_grads(
        lambda t: _oracle(q, k, v, lengths, lengths, t, buckets.long(), max_len), (table.detach().double(),), up
    )
    _check(out.values, lse, exp, exp_lse, _blind(lengths, lengths, False))
    torch.testing.assert_close(dtable.double(), ref[0].to(torch.bfloat16).double(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_with_bias(backend):
    """Dropout drops the biased probabilities: the reference draws the kernels' mask."""
    from ragged.ops.attention import reference_dropout_mask

    lq, lk, heads = [5, 20, 3], [7, 4, 3], 2
    q, k, v = _qkv(lq, lk, heads, 1, 16, _seed("drop"))
    table, buckets = _bias(heads, 20, 7, _seed("drop-bias"))
    up = _randn(q.shape, _seed("drop-up"))
    p = 0.3
    torch.manual_seed(1234)
    seed = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())
    keep = reference_dropout_mask(seed, p, _cu(lq), heads, q.shape[0], 7, q.device)

    def run(a, b, c, t):
        torch.manual_seed(1234)
        return _run(backend, a, b, c, lq, lk, t, buckets, 20, 7, dropout_p=p)

    tensors = (q, k, v, table)
    out, lse, got = _forward_and_grads(run, tensors, up)
    exp, exp_lse, ref = _forward_and_grads(
        lambda a, b, c, t: _oracle(a, b, c, lq, lk, t, buckets, 20, keep=keep, dropout_p=p), tensors, up
    )
    _check(out, lse, exp, exp_lse, _blind(lq, lk, False))
    _check_grads(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_table_without_grad_and_int32_buckets(backend):
    lq = [6, 17]
    q, k, v = _qkv(lq, lq, 2, 2, 16, _seed("nograd"))
    table, buckets = _bias(2, 17, 17, _seed("nograd-bias"))
    out64 = _run(backend, q, k, v, lq, lq, table, buckets, 17, 17)
    out32 = _run(backend, q, k, v, lq, lq, table, buckets.to(torch.int32), 17, 17)
    assert torch.equal(out64[0], out32[0]) and torch.equal(out64[1], out32[1])
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = _run(backend, *leaves, lq, lq, table, buckets, 17, 17)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    ref = _forward_and_grads(
        lambda a, b, c: _oracle(a, b, c, lq, lq, table, buckets, 17), (q, k, v), torch.ones_like(q)
    )[2]
    _check_grads(grads, ref)


@needs_triton
def test_triton_table_gradient_is_deterministic():
    """Per-program partial sums reduced in a fixed order: two runs give the same bits."""
    lq = [40, 3, 17, 33]
    q, k, v = _qkv(lq, lq, 4, 2, 16, _seed("determinism"))
    table, buckets = _bias(4, 40, 40, _seed("determinism-bias"))
    up = _randn(q.shape, _seed("determinism-up"))
    runs = [
        _forward_and_grads(
            lambda a, b, c, t: _run("triton", a, b, c, lq, lq, t, buckets, 40, 40, True), (q, k, v, table), up
        )[2]
        for _ in range(2)
    ]
    for name, a, b in zip(("q", "k", "v", "table"), *runs):
        assert torch.equal(a, b), f"d{name} differs between two runs"


@needs_triton
@pytest.mark.parametrize("shapes", [((16, 32), (16, 32)), ((32, 16), (16, 64)), ((16, 16), (32, 32))], ids=str)
def test_triton_tile_shapes(shapes, monkeypatch):
    """The bias read and the per-bucket sums of dS on tiles that are not square (a rotated row
    of the dQ tile wraps within ``BLOCK_N`` keys, and the diagonal sums carried from one key
    block to the next) and on the tiles the GPU takes (32 query rows in the dQ kernel)."""
    from ragged.kernels.triton import attention as ka

    (fwd_m, fwd_n), (dq_m, dq_n) = shapes
    monkeypatch.setattr(ka, "_fwd_config", lambda *_: (fwd_m, fwd_n, 4, 1))
    monkeypatch.setattr(ka, "_bwd_config", lambda *_: ((16, 32, 4, 1), (dq_m, dq_n, 4, 1)))
    lq, lk = [45, 3, 0, 20], [37, 9, 4, 20]
    q, k, v = _qkv(lq, lk, 2, 1, 16, _seed("tiles", shapes))
    table, buckets = _bias(2, 45, 37, _seed("tiles-bias", shapes))
    up = _randn(q.shape, _seed("tiles-up", shapes))
    for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (5, 3))):
        tensors = (q, k, v, table)
        out, lse, got = _forward_and_grads(
            lambda a, b, c, t: _run("triton", a, b, c, lq, lk, t, buckets, 45, 37, causal, window), tensors, up
        )
        exp, exp_lse, ref = _forward_and_grads(
            lambda a, b, c, t: _oracle(a, b, c, lq, lk, t, buckets, 45, causal, window), tensors, up
        )
        _check(out, lse, exp, exp_lse, _blind(lq, lk, causal, window))
        _check_grads(got, ref)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_triton_dq_tiles_fit_the_rotation(dtype):
    """The dQ kernel's rotation of dS needs ``BLOCK_M <= BLOCK_N``: every shape the GPU configs
    give with a bias keeps it (cross-attention with short keys included)."""
    from ragged.kernels.triton.attention import _bwd_config

    for head_dim in (32, 64, 80, 128, 256):
        for max_q in (1, 9, 16, 40, 64, 128, 4096):
            for max_k in (1, 9, 16, 40, 64, 128, 4096):
                for causal in (False, True):
                    _, (rows, cols, _, _) = _bwd_config(head_dim, max_q, max_k, causal, dtype, False, True)
                    assert rows <= cols, (head_dim, max_q, max_k, causal, rows, cols)


# --------------------------------------------------------------------------------------
# The op: torch.compile, opcheck, implementations called straight


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph_forward_backward(backend):
    torch._dynamo.reset()
    lq, lk = [3, 0, 19, 5], [6, 2, 19, 0]
    q, k, v = _qkv(lq, lk, 4, 2, 16, _seed("compile", backend))
    table, buckets = _bias(4, 19, 19, _seed("compile-bias", backend))

    def f(a, b, c, t, cq, ck):
        out, lse = ragged.varlen_attention(
            a, b, c, cq, ck, 19, 19, causal=True, return_lse=True, backend=backend, position_bias=(t, buckets)
        )
        return out * 2, lse

    up = _randn(q.shape, _seed("compile-up"))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out, lse, got = _forward_and_grads(lambda a, b, c, t: compiled(a, b, c, t, _cu(lq), _cu(lk)), (q, k, v, table), up)
    exp, exp_lse, ref = _forward_and_grads(
        lambda a, b, c, t: (lambda o: (2 * o[0], o[1]))(_oracle(a, b, c, lq, lk, t, buckets, 19, True)),
        (q, k, v, table),
        up,
    )
    _check(out / 2, lse, exp / 2, exp_lse, _blind(lq, lk, True))
    _check_grads(got, ref)


@pytest.mark.parametrize("backend", BACKENDS[-1:])  # one backend: the fake and the schema are the op's
def test_opcheck(backend):
    lq, lk = [3, 0, 9], [4, 2, 9]
    q, k, v = (t.requires_grad_(True) for t in _qkv(lq, lk, 2, 1, 16, _seed("opcheck")))
    table, buckets = _bias(2, 9, 9, _seed("opcheck-bias"))
    torch.library.opcheck(
        torch.ops.ragged.attention.default,
        (q, k, v, _cu(lq), _cu(lk), 9, 9, True, 0.25, 0.0, 0, -1, -1, table.requires_grad_(True), buckets, backend),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_implementations_called_straight(backend):
    """The layer core calls implementations with an AttentionArgs record: the backward returns
    the table's gradient with a table (after filling the ``grads=`` buffers), None without;
    rows past the last offset (a graphed bucket's spare rows) are left out."""
    impl = backends.implementation("attention", backend)
    lengths = [7, 0, 20, 3]
    q, k, v = _qkv(lengths, lengths, 2, 2, 16, _seed("impl", backend))
    q, k, v = (torch.cat([t, torch.zeros(4, *t.shape[1:])]) for t in (q, k, v))  # 4 spare rows
    cu = _cu(lengths)
    table, buckets = _bias(2, 20, 20, _seed("impl-bias", backend))
    do = _randn(q.shape, _seed("impl-do", backend))
    do[-4:] = 0
    args = AttentionArgs(
        q=q,
        k=k,
        v=v,
        cu_q=cu,
        cu_k=cu,
        max_q=20,
        max_k=20,
        causal=True,
        scale=0.25,
        bias_table=table,
        bias_buckets=buckets,
    )
    out, lse = impl.forward_fn(args)
    n = sum(lengths)
    tensors = (q[:n], k[:n], v[:n], table)
    exp, exp_lse, ref = _forward_and_grads(
        lambda a, b, c, t: _oracle(a, b, c, lengths, lengths, t, buckets, 20, True, scale=0.25), tensors, do[:n]
    )
    _check(out[:n], lse[:n], exp, exp_lse, _blind(lengths, lengths, True))
    buffers = AttentionGrads(*(torch.full_like(t, 7.0) for t in (q, k, v)))
    inputs = AttentionBackwardInputs(grad_out=do, out=out, lse=lse)
    got = impl.backward_fn(args, inputs, grads=buffers)
    assert got.q is buffers.q and got.k is buffers.k and got.v is buffers.v and got.bias_table is not None
    _check_grads((got.q[:n], got.k[:n], got.v[:n], got.bias_table), ref)
    plain = impl.backward_fn(args._replace(bias_table=None, bias_buckets=None), inputs)
    assert plain.bias_table is None


# --------------------------------------------------------------------------------------
# Choosing a backend


def test_cuda_declaration_takes_position_bias_for_inference(monkeypatch):
    """The short-sequence kernel adds the bias in its forward (its ``_bias`` kernels): its check
    takes a table (the device's compute capability stood in for: no GPU here) and refuses only
    what it refuses without one, a gradient among them."""
    import ragged.kernels.cuda as cuda_backend
    from ragged.ops.attention import attention_spec

    monkeypatch.setitem(cuda_backend._attention_capabilities, 0, (9, 0))
    impl = backends.implementation("attention", "cuda")
    q = torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    cu = _cu([4, 6])
    bias = _bias(2, 6, 6, 0)
    for position_bias in (None, bias):
        for needs_grad in (False, True):
            spec = attention_spec(q, q, q, cu, cu, 6, 6, False, 0.0, needs_grad, (-1, -1), position_bias)
            assert spec.bias_buckets == (0 if position_bias is None else BUCKETS)
            reasons = impl.check(dataclasses.replace(spec, device=torch.device("cuda", 0)))
            assert (reasons != []) == needs_grad and not any("position_bias" in r for r in reasons), reasons
    assert backends.implementation("attention", "torch").reasons(spec) == []


def test_cuda_launcher_composes_the_distance_rows():
    """The CUDA launcher's bias rows: ``table[buckets[d], h] * log2(e)`` at ``[h, d]``, float32,
    contiguous, whatever the table's dtype (no GPU needed: the composition is torch's)."""
    from ragged.kernels.cuda.attention import _distance_rows

    table = torch.randn(32, 3, dtype=torch.float64).to(torch.bfloat16)
    buckets = torch.randint(0, 32, (11,), dtype=torch.int32)
    rows = _distance_rows(table, buckets)
    assert rows.dtype == torch.float32 and rows.is_contiguous() and rows.shape == (3, 11)
    want = table.double()[buckets.long()].t() * math.log2(math.e)
    torch.testing.assert_close(rows.double(), want, rtol=1e-6, atol=0)


def test_triton_declares_its_bucket_maximum():
    """The dQ kernel keeps a sum per bucket in registers: tables of more rows go to the reference."""
    from ragged.kernels.triton import ATTENTION_MAX_BUCKETS
    from ragged.ops.attention import attention_spec

    q = torch.zeros(10, 2, 16)
    cu = _cu([4, 6])
    table, buckets = _bias(2, 6, 6, 0, buckets=ATTENTION_MAX_BUCKETS + 1)
    spec = attention_spec(q, q, q, cu, cu, 6, 6, False, 0.0, False, (-1, -1), (table, buckets))
    reasons = backends.implementation("attention", "triton").reasons(spec)
    assert any(f"bias buckets <= {ATTENTION_MAX_BUCKETS}" in r for r in reasons), reasons
    assert backends.implementation("attention", "torch").reasons(spec) == []


def test_explain_both_forms_with_bias():
    lengths = [3, 5]
    q = ragged.pack([_randn((n, 2, 16), _seed("explain", n)) for n in lengths])
    bias = _bias(2, 5, 5, _seed("explain-bias"))
    by_function = ragged.explain(ragged.attention, q, q, q, causal=True, position_bias=bias)
    by_name = ragged.explain(
        "attention", q.values, q.values, q.values, q.offsets, q.offsets, 5, 5, True, 0.0, False, (-1, -1), bias
    )
    assert by_function == by_name and by_name["torch"] == []
    if TRITON_ON_CPU:
        assert by_name["triton"] == []


# --------------------------------------------------------------------------------------
# Bad input: the same ValueError / TypeError on every backend, naming the function and argument


VARLEN = "ragged.varlen_attention()"
ATTN = "ragged.attention()"


def _raises(exc, fn, *words):
    with pytest.raises(exc) as info:
        fn()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def _bad_cases():
    table, buckets = _bias(4, 5, 5, 0)
    return [
        (TypeError, table, ("position_bias", "tuple (table, buckets)")),
        (TypeError, (table, buckets, 5), ("position_bias", "tuple (table, buckets)")),
        (TypeError, (table, buckets.tolist()), ("position_bias buckets", "torch.Tensor")),
        (TypeError, (table.long(), buckets), ("floating-point position_bias table", "torch.int64")),
        (TypeError, (table, buckets.float()), ("position_bias buckets", "int32 or int64", "torch.float32")),
        (ValueError, (table[:, :3], buckets), ("position_bias table", "[num_buckets, 4]", "(7, 3)")),
        (ValueError, (table[0], buckets), ("position_bias table", "[num_buckets, 4]", "(4,)")),
        (ValueError, (table[:0], buckets), ("position_bias table", "num_buckets >= 1")),
        (ValueError, (table, buckets[:-1]), ("position_bias buckets", "[9]", "(8,)")),
        (ValueError, (table, buckets.view(3, 3)), ("position_bias buckets", "[9]", "(3, 3)")),
        (ValueError, (table.to("meta"), buckets), ("position_bias", "q's device", "meta")),
        (ValueError, (table, buckets.clone().fill_(BUCKETS)), ("position_bias buckets in [0, 7)", "from 7 to 7")),
        (ValueError, (table, buckets.clone().fill_(-1)), ("position_bias buckets in [0, 7)", "from -1 to -1")),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index", range(13))
def test_bad_position_bias(backend, index):
    exc, bias, words = _bad_cases()[index]
    lengths = [3, 5]
    q, k, v = _qkv(lengths, lengths, 4, 2, 32, 0)
    _raises(
        exc,
        lambda: ragged.varlen_attention(q, k, v, _cu(lengths), _cu(lengths), 5, 5, backend=backend, position_bias=bias),
        VARLEN,
        *words,
    )
    rq, rk, rv = (ragged.RaggedTensor.from_lengths(t, lengths) for t in (q, k, v))
    words = tuple("q.max_len + k.max_len - 1" if w == "[9]" else w for w in words)
    _raises(exc, lambda: ragged.attention(rq, rk, rv, backend=backend, position_bias=bias), ATTN, *words)


def test_buckets_length_names_the_maxima():
    lq, lk = [3, 5], [2, 6]
    q, k, v = _qkv(lq, lk, 2, 2, 16, 0)
    table, buckets = _bias(2, 5, 6, 0)
    _raises(
        ValueError,
        lambda: ragged.varlen_attention(q, k, v, _cu(lq), _cu(lk), 5, 6, position_bias=(table, buckets[1:])),
        VARLEN,
        "[10] (max_seqlen_q + max_seqlen_k - 1)",
    )


def test_reference_checks_the_bias():
    lq = [3, 5]
    q, k, v = _qkv(lq, lq, 2, 2, 16, 0)
    table, buckets = _bias(2, 5, 5, 0)
    _raises(
        ValueError,
        lambda: ragged.reference_attention(q, k, v, _cu(lq), _cu(lq), position_bias=(table, buckets[:8])),
        "ragged.reference_attention()",
        "position_bias buckets",
        "n >= 9",
    )
    _raises(
        ValueError,
        lambda: ragged.reference_attention(q, k, v, _cu(lq), _cu(lq), position_bias=(table, buckets), max_seqlen_q=4),
        "max_seqlen_q",
    )
