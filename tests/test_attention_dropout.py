"""ragged.attention on CPU: dropout (forward, backward, mask statistics), torch.compile and
opcheck, and the property test of random batches, against the oracle of ``attention_cases``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from attention_cases import (
    BACKENDS,
    BWD_TOL,
    FWD_TOL,
    _blind_rows,
    _check_lse,
    _cu,
    _grads,
    _loop_attention,
    _qkv,
    _randn,
    _run,
    _seed,
    needs_triton,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import ragged

# --------------------------------------------------------------------------------------
# Dropout


def _drawn_seed(manual_seed: int) -> int:
    """The dropout seed a call draws after ``torch.manual_seed(manual_seed)``: one int from
    torch's CPU generator (so that nothing is read from the GPU)."""
    torch.manual_seed(manual_seed)
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())


DROP_CASES = {
    "mixed_gqa": ([5, 0, 31, 12], [5, 0, 31, 12], 4, 2, 32),
    "cross": ([2, 20, 3], [7, 4, 3], 2, 1, 16),
}


@needs_triton
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(DROP_CASES))
def test_dropout_forward(case, causal):
    lq, lk, heads, kv_heads, dim = DROP_CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed("drop", case))
    p = 0.3
    torch.manual_seed(1234)
    out, lse = _run(q, k, v, lq, lk, "triton", causal, dropout_p=p)
    torch.manual_seed(1234)
    again, lse_again = _run(q, k, v, lq, lk, "triton", causal, dropout_p=p)
    assert torch.equal(out, again), "dropout is not reproducible under torch.manual_seed"
    assert torch.equal(lse, lse_again)
    torch.manual_seed(99)
    other, _ = _run(q, k, v, lq, lk, "triton", causal, dropout_p=p)
    assert not torch.equal(out, other), "another seed draws the same dropout"
    plain, plain_lse = _run(q, k, v, lq, lk, "triton", causal)
    assert not torch.allclose(out, plain), "dropout_p = 0.3 changed nothing"
    # lse is the normaliser before dropout
    torch.testing.assert_close(lse, plain_lse, **FWD_TOL)
    assert not torch.isnan(out).any()
    assert torch.all(out[_blind_rows(lq, lk, causal)] == 0)

    from ragged.ops.attention_reference import reference_dropout_mask

    max_k = max(lk)
    mask = reference_dropout_mask(_drawn_seed(1234), p, _cu(lq), heads, q.shape[0], max_k, q.device)
    assert mask.shape == (heads, q.shape[0], max_k) and mask.dtype == torch.bool
    # the kept fraction is 1 - p within 4 standard deviations of a Bernoulli mean
    assert abs(mask.float().mean().item() - (1 - p)) < 4 * (p * (1 - p) / mask.numel()) ** 0.5
    ref, _ = ragged.reference_attention(q.double(), k.double(), v.double(), _cu(lq), _cu(lk), causal, None, mask, p)
    torch.testing.assert_close(out.double(), ref, **FWD_TOL)
    exp, _ = _loop_attention(q, k, v, lq, lk, causal, keep=mask, dropout_p=p)
    torch.testing.assert_close(out.double(), exp, **FWD_TOL)
    # the reference backend draws the same mask under the same seed
    torch.manual_seed(1234)
    via_torch, _ = _run(q, k, v, lq, lk, "torch", causal, dropout_p=p)
    torch.testing.assert_close(via_torch.double(), exp, **FWD_TOL)


@needs_triton
@pytest.mark.parametrize("variant", ["triton", "triton_fused_bwd"], ids=["split", "fused"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(DROP_CASES))
def test_dropout_backward(case, causal, variant):
    """The split and the fused backward draw the forward's mask; the split one's gradients are
    the same bits run to run (the fused one adds dQ atomically: the same here, where the
    interpreter runs one program at a time, not on a GPU)."""
    from ragged import backends

    lq, lk, heads, kv_heads, dim = DROP_CASES[case]
    q, k, v = _qkv(lq, lk, heads, kv_heads, dim, _seed("drop-bwd", case))
    p = 0.3
    up = _randn(q.shape, _seed("drop-bwd-up", case))

    def kernel(a, b, c):
        torch.manual_seed(77)
        return ragged.varlen_attention(
            a, b, c, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal, dropout_p=p, backend="triton"
        )

    from ragged.ops.attention_reference import reference_dropout_mask

    mask = reference_dropout_mask(_drawn_seed(77), p, _cu(lq), heads, q.shape[0], max(lk), q.device)

    def reference(a, b, c):
        return ragged.reference_attention(a, b, c, _cu(lq), _cu(lk), causal, None, mask, p)[0]

    with backends.prefer("attention", variant):
        got = _grads(kernel, q, k, v, up)
        again = _grads(kernel, q, k, v, up)
    ref = _grads(reference, q.double(), k.double(), v.double(), up.double())
    loop = _grads(
        lambda a, b, c: _loop_attention(a, b, c, lq, lk, causal, keep=mask, dropout_p=p)[0],
        q.double(),
        k.double(),
        v.double(),
        up.double(),
    )
    for name, g, r, lo, a in zip("qkv", got, ref, loop, again):
        assert torch.equal(g, a) or (variant != "triton" and name == "q"), f"d{name} is not reproducible"
        torch.testing.assert_close(r, lo, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(g.double(), r.double(), **BWD_TOL, msg=lambda m, n=name: f"d{n}: {m}")


def test_dropout_mask_statistics():
    """The kernels' keep mask (drawn in torch here: bit for bit the same, see
    test_torch_hash_draws_the_kernels_mask) looks independent: at p = 0.5 the kept fraction, and the agreement
    between neighbouring keys, neighbouring queries, two heads and two seeds, are all 1/2
    within 4 standard deviations of a fair coin (a hash with a weak mix fails these)."""
    from ragged.ops.attention_reference import reference_dropout_mask

    lengths, heads, p = [96, 1, 37, 128], 2, 0.5
    cu, total, max_k = _cu(lengths), sum(lengths), max(lengths)
    a = reference_dropout_mask(_drawn_seed(5), p, cu, heads, total, max_k, torch.device("cpu"))
    b = reference_dropout_mask(_drawn_seed(6), p, cu, heads, total, max_k, torch.device("cpu"))
    valid = torch.cat([torch.arange(max_k) < n for n in lengths for _ in range(n)]).view(total, max_k)

    def fair(x: torch.Tensor, what: str) -> None:
        x = x.float()
        assert abs(x.mean().item() - 0.5) < 4 * (0.25 / x.numel()) ** 0.5, f"{what}: {x.mean().item():.4f}"

    fair(a[:, valid], "kept fraction")
    both = valid[:, 1:] & valid[:, :-1]
    fair((a[:, :, 1:] == a[:, :, :-1])[:, both], "neighbouring keys agree")
    rows = valid[1:] & valid[:-1]
    fair((a[:, 1:] == a[:, :-1])[:, rows], "neighbouring queries agree")
    fair((a[0] == a[1])[valid], "two heads agree")
    fair((a == b)[:, valid], "two seeds agree")


@needs_triton
@pytest.mark.parametrize(
    "seed", [0, 1, 2**31 - 2, 2**32 + 5, -3], ids=["zero", "one", "int31", "past32bits", "negative"]
)
def test_torch_hash_draws_the_kernels_mask(seed):
    """:func:`hashed_keep_mask` (torch, any device) is bit for bit the Triton kernels' mask, on
    fresh rates (including ones with no exact float32 form) and shapes with empty sequences, a
    single key, no keys and no queries."""
    from ragged.kernels.triton.attention import dropout_keep_mask
    from ragged.ops.attention_reference import hashed_keep_mask

    gen = torch.Generator().manual_seed(seed & 0xFFFF)
    rates = [1 / 3, torch.rand((), generator=gen).item()]
    for lengths, heads, max_k in (([5, 0, 19, 2], 2, 23), ([1], 1, 1), ([4, 2], 2, 0), ([], 2, 9)):
        total = sum(lengths)
        for p in rates:
            want = dropout_keep_mask(seed, p, _cu(lengths), heads, total, max_k, torch.device("cpu"))
            got = hashed_keep_mask(seed, p, heads, total, max_k, "cpu")
            assert got.shape == want.shape and got.dtype == torch.bool
            assert torch.equal(got, want), f"p={p} lengths={lengths}: {(got != want).sum().item()} entries differ"


def test_hashed_mask_rows_past_32_bits():
    """Row keys of ``h * Tq + t`` past 2**32 mix the high word in (heads x tokens that large
    cannot be allocated here: checked on the mixer's parts against Python's exact integers)."""
    from ragged.ops import attention_reference as R

    def fmix(x: int) -> int:
        m = 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & m
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & m
        return x ^ (x >> 16)

    gen = torch.Generator().manual_seed(0)
    xs = torch.randint(0, 2**32, (4096,), generator=gen, dtype=torch.int64)
    xs[:4] = torch.tensor([0, 1, 2**32 - 1, 2**31])
    got = R._fmix32(xs)
    assert got.tolist() == [fmix(int(x)) for x in xs]
    assert R._mul32(xs, 0x9E3779B1).tolist() == [(int(x) * 0x9E3779B1) & 0xFFFFFFFF for x in xs]


@needs_triton
def test_dropout_reference_backend_without_a_gpu_or_interpreter():
    """The CPU path takes dropout on a machine with neither a GPU nor TRITON_INTERPRET, and drops
    what the kernels' hash drops (the mask :func:`hashed_keep_mask` draws for the call's seed)."""
    code = textwrap.dedent("""
        import torch, ragged
        q = torch.randn(7, 2, 16)
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        torch.manual_seed(0)
        a = ragged.varlen_attention(q, q, q, cu, cu, 4, 4, dropout_p=0.25)
        torch.manual_seed(0)
        b = ragged.varlen_attention(q, q, q, cu, cu, 4, 4, dropout_p=0.25)
        assert torch.equal(a, b) and not torch.isnan(a).any()
        from ragged.ops.attention_reference import hashed_keep_mask
        torch.manual_seed(0)
        seed = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())
        mask = hashed_keep_mask(seed, 0.25, 2, 7, 4, "cpu")
        want = ragged.reference_attention(q.double(), q.double(), q.double(), cu, cu, False, None, mask, 0.25)[0]
        torch.testing.assert_close(a.double(), want, atol=1e-5, rtol=1e-5)
        print("ok")
    """)
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


# --------------------------------------------------------------------------------------
# torch.compile and the torch.library ops


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph_forward_backward(backend):
    torch._dynamo.reset()
    lq, lk = [3, 0, 9, 5], [6, 2, 9, 0]
    q, k, v = _qkv(lq, lk, 4, 2, 16, _seed("compile", backend))
    cu_q, cu_k = _cu(lq), _cu(lk)

    def f(a, b, c, cq, ck):
        out, lse = ragged.varlen_attention(a, b, c, cq, ck, 9, 9, causal=True, return_lse=True, backend=backend)
        return out * 2, lse

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves, cu_q, cu_k)
    exp, exp_lse = _loop_attention(q, k, v, lq, lk, True)
    torch.testing.assert_close(out.double(), 2 * exp, **FWD_TOL)
    _check_lse(lse, exp_lse, _blind_rows(lq, lk, True))
    up = _randn(q.shape, _seed("compile-up"))
    got = torch.autograd.grad(out, leaves, up)
    ref = _grads(lambda a, b, c: 2 * _loop_attention(a, b, c, lq, lk, True)[0], q, k, v, up)
    for name, g, r in zip("qkv", got, ref):
        torch.testing.assert_close(g.double(), r.double(), **BWD_TOL, msg=lambda m, n=name: f"d{n}: {m}")


@needs_triton
def test_compile_new_lengths_each_call():
    """Training-style use: the lengths and max_seqlen change from call to call."""
    torch._dynamo.reset()

    def f(a, b, c, cq, ck, max_q: int, max_k: int):
        return ragged.varlen_attention(a, b, c, cq, ck, max_q, max_k, causal=True, backend="triton") * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for lq, lk in (([3, 0, 9], [3, 0, 9]), ([5, 2, 20, 1], [4, 2, 21, 0]), ([7, 7], [1, 30])):
        q, k, v = _qkv(lq, lk, 2, 1, 16, _seed("dynamic", lq))
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = compiled(*leaves, _cu(lq), _cu(lk), max(lq), max(lk))
        exp, _ = _loop_attention(q, k, v, lq, lk, True)
        torch.testing.assert_close(out.double(), 2 * exp, **FWD_TOL)
        up = _randn(q.shape, _seed("dynamic-up", lq))
        got = torch.autograd.grad(out, leaves, up)
        ref = _grads(lambda a, b, c, lq=lq, lk=lk: 2 * _loop_attention(a, b, c, lq, lk, True)[0], q, k, v, up)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g.double(), r.double(), **BWD_TOL)


@needs_triton
def test_compile_dropout_draws_a_new_mask_per_call():
    torch._dynamo.reset()
    lq = [3, 0, 9]
    q, k, v = _qkv(lq, lq, 2, 1, 16, _seed("compile-drop"))

    def f(a, b, c, cu):
        return ragged.varlen_attention(a, b, c, cu, cu, 9, 9, dropout_p=0.3, backend="triton")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    first = compiled(q, k, v, _cu(lq))
    second = compiled(q, k, v, _cu(lq))
    assert not torch.equal(first, second), "a compiled call reuses the previous call's dropout mask"
    torch.manual_seed(3)
    assert torch.equal(first, f(q, k, v, _cu(lq))), "compiled and eager draw different masks for one seed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    lq, lk = [3, 0, 9], [4, 2, 9]
    q, k, v = (t.requires_grad_(True) for t in _qkv(lq, lk, 2, 1, 16, _seed("opcheck")))
    torch.library.opcheck(
        torch.ops.ragged.attention.default,
        (q, k, v, _cu(lq), _cu(lk), 9, 9, True, 0.25, 0.0, 0, -1, -1, None, None, backend),
    )


# --------------------------------------------------------------------------------------
# Property test


@needs_triton
@settings(max_examples=12, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 19), st.integers(0, 19)), min_size=1, max_size=5),
    kv_heads=st.sampled_from([1, 2]),
    causal=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_triton_random_batches(pairs, kv_heads, causal, seed):
    lq = [a for a, _ in pairs]
    lk = [b for _, b in pairs]
    q, k, v = _qkv(lq, lk, 2, kv_heads, 16, seed)
    out, lse = _run(q, k, v, lq, lk, "triton", causal)
    exp, exp_lse = _loop_attention(q, k, v, lq, lk, causal)
    torch.testing.assert_close(out.double(), exp, **FWD_TOL)
    _check_lse(lse, exp_lse, _blind_rows(lq, lk, causal))
