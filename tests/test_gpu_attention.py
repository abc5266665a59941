"""ragged.attention / ragged.varlen_attention on the GPU against the float64 reference.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise). Errors follow
flash-attn's rule: a kernel's max abs error against the float64 reference may be at most
twice that of the reference computed in the input dtype (``compute_dtype=q.dtype``), plus
``atol`` (1e-4 for float32, 1e-3 for float16 and bfloat16). The same rule holds for the
gradients. ``ragged.reference_attention`` itself is checked against an independent SDPA
loop in ``test_attention.py``.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import ragged
from ragged import RaggedTensor, backends

pytestmark = pytest.mark.gpu

DIMS = [32, 64, 80, 96, 128, 256]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
ATOL = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-3}
KERNELS = ["triton", "cuda"]

# name: (query lengths, key lengths). "short*" fit the CUDA short-sequence kernel
# (<= 128 tokens); "tiny" stays <= 64 tokens (the Triton launcher's short-sequence shapes).
LENGTHS = {
    "self": ([1, 17, 0, 130, 64, 257, 33, 7], [1, 17, 0, 130, 64, 257, 33, 7]),
    "cross": ([3, 100, 0, 200, 1, 77], [50, 7, 9, 0, 300, 77]),
    "short_self": ([1, 17, 0, 128, 64, 33, 7, 100], [1, 17, 0, 128, 64, 33, 7, 100]),
    "short_cross": ([3, 100, 0, 50, 1, 128], [50, 7, 9, 0, 128, 77]),
    "tiny": ([1, 17, 0, 64, 33, 7, 5], [1, 17, 0, 64, 33, 7, 5]),
}
BACKWARD_SETS = ("self", "cross", "tiny")


def _cu(lengths, dtype=torch.int32):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype, device="cuda")


def _qkv(lq, lk, heads, kv_heads, dim, dtype, gen):
    q = torch.randn(sum(lq), heads, dim, generator=gen, device="cuda").to(dtype)
    k = torch.randn(sum(lk), kv_heads, dim, generator=gen, device="cuda").to(dtype)
    v = torch.randn(sum(lk), kv_heads, dim, generator=gen, device="cuda").to(dtype)
    return q, k, v


def _gen(*parts):
    return torch.Generator(device="cuda").manual_seed(zlib.crc32("/".join(map(str, parts)).encode()))


def _blind_rows(lq, lk, causal):
    """[Tq] bool on the GPU: queries that see no key (bottom-right causal)."""
    rows = []
    for nq, nk in zip(lq, lk):
        i = torch.arange(nq)
        rows.append((nk == 0) | ((i + nk - nq < 0) if causal else torch.zeros(nq, dtype=torch.bool)))
    return torch.cat(rows).cuda() if rows else torch.zeros(0, dtype=torch.bool, device="cuda")


def _reasons(backend, q, k, v, cu_q, cu_k, max_q, max_k, causal, dropout_p=0.0, needs_grad=False):
    return ragged.explain("attention", q, k, v, cu_q, cu_k, max_q, max_k, causal, dropout_p, needs_grad)[backend]


def _needs(backend):
    reason = backends.triton_reason(torch.device("cuda")) if backend == "triton" else \
        backends.cuda_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)


def _max_err(a, b):
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def _assert_rule(name, got, ref64, low, atol):
    """flash-attn's rule: err(got) <= 2 * err(low) + atol, both against float64."""
    assert not torch.isnan(got).any(), f"{name}: NaN"
    err = _max_err(got, ref64)
    err_low = _max_err(low, ref64)
    assert err <= 2 * err_low + atol, f"{name}: error {err:.3g} > 2 * {err_low:.3g} + {atol}"


def _check_forward(backend, lq, lk, q, k, v, causal, tag):
    cu_q, cu_k = _cu(lq), _cu(lk)
    out, lse = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, return_lse=True,
                                       backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:2] and lse.dtype == torch.float32
    ref, ref_lse = ragged.reference_attention(q.double(), k.double(), v.double(), cu_q, cu_k, causal)
    low, low_lse = ragged.reference_attention(q, k, v, cu_q, cu_k, causal, compute_dtype=q.dtype)
    atol = ATOL[q.dtype]
    _assert_rule(f"{tag} out", out, ref, low, atol)
    blind = _blind_rows(lq, lk, causal)
    assert torch.all(out[blind] == 0), f"{tag}: a query that sees no key must get zeros"
    assert torch.all(torch.isneginf(lse[blind])), f"{tag}: a query that sees no key must get lse = -inf"
    assert torch.all(torch.isfinite(lse[~blind])), f"{tag}: lse"
    _assert_rule(f"{tag} lse", lse[~blind], ref_lse[~blind], low_lse[~blind], atol)


def _check_backward(lq, lk, q, k, v, causal, tag, backend="triton", cu_q=None, cu_k=None):
    """Gradients of ``backend`` against the reference; ``cu_q`` / ``cu_k``: the offsets the
    backend gets (default: contiguous ones from the lengths; the reference always gets those)."""
    ref_cq, ref_ck = _cu(lq), _cu(lk)
    cu_q = ref_cq if cu_q is None else cu_q
    cu_k = ref_ck if cu_k is None else cu_k
    gen = _gen("up", tag)
    up = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        return torch.autograd.grad(fn(*leaves), leaves, up.to(dtype))

    got = grads(lambda a, b, c: ragged.varlen_attention(a, b, c, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                                        backend=backend), q.dtype)
    ref = grads(lambda a, b, c: ragged.reference_attention(a, b, c, ref_cq, ref_ck, causal)[0], torch.float64)
    low = grads(lambda a, b, c: ragged.reference_attention(a, b, c, ref_cq, ref_ck, causal,
                                                           compute_dtype=q.dtype)[0], q.dtype)
    for name, g, r, lo, t in zip("qkv", got, ref, low, (q, k, v)):
        assert g.shape == t.shape and g.dtype == t.dtype
        _assert_rule(f"{tag} d{name}", g, r, lo, ATOL[q.dtype])


# --------------------------------------------------------------------------------------
# Accuracy


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", DIMS)
def test_accuracy(backend, dim, dtype, causal):
    """GQA (H = 4, H_kv = 2), self and cross lengths; forward for every backend that takes
    the input, backward for Triton."""
    _needs(backend)
    ran = []
    for name, (lq, lk) in LENGTHS.items():
        q, k, v = _qkv(lq, lk, 4, 2, dim, dtype, _gen(backend, dim, dtype, causal, name))
        reasons = _reasons(backend, q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal)
        if backend == "triton":
            assert reasons == [], f"triton refuses {name}: {reasons}"
        elif reasons:
            continue
        tag = f"{backend}/{name}/D={dim}/{dtype}/causal={causal}"
        _check_forward(backend, lq, lk, q, k, v, causal, tag)
        if backend == "triton" and name in BACKWARD_SETS:
            _check_backward(lq, lk, q, k, v, causal, tag)
        ran.append(name)
    if not ran:
        pytest.skip(f"{backend} takes none of these inputs")


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [8, 1])
def test_heads_mha_and_mqa(backend, kv_heads, causal):
    _needs(backend)
    ran = False
    for name in ("cross", "short_self"):
        lq, lk = LENGTHS[name]
        q, k, v = _qkv(lq, lk, 8, kv_heads, 64, torch.bfloat16, _gen("heads", backend, kv_heads, causal, name))
        if _reasons(backend, q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal):
            assert backend != "triton"
            continue
        tag = f"{backend}/{name}/H_kv={kv_heads}/causal={causal}"
        _check_forward(backend, lq, lk, q, k, v, causal, tag)
        if backend == "triton":
            _check_backward(lq, lk, q, k, v, causal, tag)
        ran = True
    if not ran:
        pytest.skip(f"{backend} takes none of these inputs")


@pytest.mark.parametrize("backend", KERNELS)
def test_int64_cu_seqlens_and_strided_inputs(backend):
    _needs(backend)
    lq, lk = LENGTHS["short_cross"]
    gen = _gen("strided", backend)
    # q as a head-major buffer seen token-major; k, v with a NaN head and NaN columns beside them
    q = torch.randn(4, sum(lq), 64, generator=gen, device="cuda").to(torch.float16).transpose(0, 1)
    kbuf = torch.full((sum(lk), 3, 72), float("nan"), dtype=torch.float16, device="cuda")
    vbuf = torch.full((sum(lk), 3, 72), float("nan"), dtype=torch.float16, device="cuda")
    k, v = kbuf[:, :2, :64], vbuf[:, :2, :64]
    k.copy_(torch.randn(k.shape, generator=gen, device="cuda"))
    v.copy_(torch.randn(v.shape, generator=gen, device="cuda"))
    cu_q, cu_k = _cu(lq, torch.int64), _cu(lk, torch.int64)
    if _reasons(backend, q, k, v, cu_q, cu_k, max(lq), max(lk), True):
        pytest.skip(f"{backend} cannot take int64 cu_seqlens here")
    out = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, backend=backend)
    ref, _ = ragged.reference_attention(q.double(), k.double(), v.double(), cu_q, cu_k, True)
    low, _ = ragged.reference_attention(q, k, v, cu_q, cu_k, True, compute_dtype=q.dtype)
    _assert_rule(backend, out, ref, low, ATOL[q.dtype])


# --------------------------------------------------------------------------------------
# Dropout


def _drawn_seed(manual_seed: int) -> int:
    """The dropout seed a call draws after ``torch.manual_seed(manual_seed)`` (torch's CPU generator)."""
    torch.manual_seed(manual_seed)
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_dropout_against_reference(dtype, causal):
    _needs("triton")
    from ragged.kernels.triton.attention import dropout_keep_mask

    lq, lk = LENGTHS["cross"]
    p = 0.3
    q, k, v = _qkv(lq, lk, 4, 2, 64, dtype, _gen("dropout", dtype, causal))
    cu_q, cu_k = _cu(lq), _cu(lk)
    up = torch.randn(q.shape, generator=_gen("dropout-up"), device="cuda").to(dtype)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    torch.manual_seed(2024)
    out = ragged.varlen_attention(*leaves, cu_q, cu_k, max(lq), max(lk), causal=causal, dropout_p=p,
                                  backend="triton")
    got = torch.autograd.grad(out, leaves, up)
    torch.manual_seed(2024)
    again = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, dropout_p=p,
                                    backend="triton")
    assert torch.equal(out.detach(), again)
    plain = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, backend="triton")
    assert not torch.allclose(out.detach(), plain)

    mask = dropout_keep_mask(_drawn_seed(2024), p, cu_q, 4, q.shape[0], max(lk), q.device)
    assert abs(mask.float().mean().item() - (1 - p)) < 4 * (p * (1 - p) / mask.numel()) ** 0.5

    def grads(dtype_, compute):
        ls = [t.detach().to(dtype_).requires_grad_(True) for t in (q, k, v)]
        o, _ = ragged.reference_attention(*ls, cu_q, cu_k, causal, None, mask, p, compute_dtype=compute)
        return o, torch.autograd.grad(o, ls, up.to(dtype_))

    ref, ref_grads = grads(torch.float64, torch.float64)
    low, low_grads = grads(dtype, dtype)
    _assert_rule("dropout out", out, ref, low, ATOL[dtype])
    for name, g, r, lo in zip("qkv", got, ref_grads, low_grads):
        _assert_rule(f"dropout d{name}", g, r, lo, ATOL[dtype])


# --------------------------------------------------------------------------------------
# No host sync, torch.compile, auto


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_no_host_sync(backend, dropout_p):
    _needs(backend)
    lq, lk = LENGTHS["short_cross"]
    gen = _gen("sync", backend)
    q, k, v = (RaggedTensor.from_lengths(t, n) for t, n in
               zip(_qkv(lq, lk, 4, 2, 64, torch.bfloat16, gen), (lq, lk, lk)))
    train = backend == "triton"
    if _reasons(backend, q.values, k.values, v.values, q.offsets, k.offsets, q.max_len, k.max_len, True, dropout_p,
                train):
        pytest.skip(f"{backend} cannot take this input")
    if train:
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    up = torch.randn(q.values.shape, generator=gen, device="cuda").to(torch.bfloat16)

    def step():
        out, lse = ragged.attention(q, k, v, causal=True, dropout_p=dropout_p, return_lse=True, backend=backend)
        if train:
            out.values.backward(up)
        return out, lse

    step()                       # warm up: compile the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert not torch.isnan(out.values).any()
    if train:
        assert q.values.grad is not None and k.values.grad is not None and v.values.grad is not None


def test_compile_fullgraph_with_backward():
    _needs("triton")
    torch._dynamo.reset()

    def f(q, k, v, cu_q, cu_k, max_q: int, max_k: int):
        out = ragged.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend="triton")
        return out.float() * 2

    compiled = torch.compile(f, fullgraph=True)
    for name in ("cross", "tiny"):
        lq, lk = LENGTHS[name]
        gen = _gen("compile", name)
        q, k, v = _qkv(lq, lk, 4, 2, 64, torch.bfloat16, gen)
        cu_q, cu_k = _cu(lq), _cu(lk)
        up = torch.randn(q.shape, generator=gen, device="cuda")
        a = [t.clone().requires_grad_(True) for t in (q, k, v)]
        b = [t.clone().requires_grad_(True) for t in (q, k, v)]
        got = compiled(*a, cu_q, cu_k, max(lq), max(lk))
        exp = f(*b, cu_q, cu_k, max(lq), max(lk))
        torch.testing.assert_close(got, exp, atol=1e-3, rtol=1e-3)
        ga = torch.autograd.grad(got, a, up)
        gb = torch.autograd.grad(exp, b, up)
        for name_, x, y in zip("qkv", ga, gb):
            torch.testing.assert_close(x, y, atol=1e-2, rtol=1e-2, msg=lambda m, n=name_: f"d{n}: {m}")
        low, _ = ragged.reference_attention(q, k, v, cu_q, cu_k, True, compute_dtype=q.dtype)
        ref, _ = ragged.reference_attention(q.double(), k.double(), v.double(), cu_q, cu_k, True)
        _assert_rule(f"compiled {name}", got / 2, ref, low, ATOL[q.dtype])


def test_compile_fullgraph_cuda_forward():
    _needs("cuda")
    torch._dynamo.reset()
    lq, lk = LENGTHS["short_cross"]
    q, k, v = _qkv(lq, lk, 4, 2, 64, torch.float16, _gen("compile-cuda"))
    cu_q, cu_k = _cu(lq), _cu(lk)
    if _reasons("cuda", q, k, v, cu_q, cu_k, max(lq), max(lk), True):
        pytest.skip("the CUDA kernel cannot take this input")

    def f(q, k, v):
        return ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, backend="cuda")

    got = torch.compile(f, fullgraph=True)(q, k, v)
    assert torch.equal(got, f(q, k, v))


def test_auto_backend_on_cuda():
    lq, lk = LENGTHS["short_cross"]
    q, k, v = _qkv(lq, lk, 4, 2, 64, torch.bfloat16, _gen("auto"))
    cu_q, cu_k = _cu(lq), _cu(lk)
    ref, _ = ragged.reference_attention(q.double(), k.double(), v.double(), cu_q, cu_k, True)
    low, _ = ragged.reference_attention(q, k, v, cu_q, cu_k, True, compute_dtype=q.dtype)
    out = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True)
    _assert_rule("auto", out, ref, low, 1e-3)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = ragged.varlen_attention(*leaves, cu_q, cu_k, max(lq), max(lk), causal=True)   # needs a backward
    _assert_rule("auto (grad)", out.detach(), ref, low, 1e-3)
    out.float().sum().backward()
    assert all(t.grad is not None and not torch.isnan(t.grad).any() for t in leaves)


# --------------------------------------------------------------------------------------
# More than 2**31 elements


def test_int64_indexing_many_short_sequences():
    """B = 2**16 sequences of 17 tokens, H = 16, D = 128, bf16: T * H * D = 2.28e9 > 2**31 elements
    per tensor. Memory: q, k, v and out take 4.25 GiB each (about 17 GiB together)."""
    free, _ = torch.cuda.mem_get_info()
    if free < 20 * 2**30:
        pytest.skip("needs 20 GiB of free GPU memory")
    batch, length, heads, dim = 2**16, 17, 16, 128
    total = batch * length
    assert total * heads * dim > 2**31
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(total, heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, total + 1, length, dtype=torch.int32, device="cuda")
    samples = [0, 1, 12345, batch // 2, 61_681, batch - 2, batch - 1]   # 61_681 * 17 * 2048 > 2**31
    ran = []
    for backend in KERNELS:
        reasons = _reasons(backend, q, k, v, cu, cu, length, length, True)
        if reasons:
            assert backend != "triton", reasons
            continue
        out, lse = ragged.varlen_attention(q, k, v, cu, cu, length, length, causal=True, return_lse=True,
                                           backend=backend)
        for b in samples:
            s = slice(b * length, (b + 1) * length)
            one = torch.tensor([0, length], dtype=torch.int32, device="cuda")
            ref, ref_lse = ragged.reference_attention(q[s].double(), k[s].double(), v[s].double(), one, one, True)
            low, low_lse = ragged.reference_attention(q[s], k[s], v[s], one, one, True, compute_dtype=q.dtype)
            _assert_rule(f"{backend} sequence {b}", out[s], ref, low, 1e-3)
            _assert_rule(f"{backend} lse {b}", lse[s], ref_lse, low_lse, 1e-3)
        assert torch.isfinite(out[-4096:]).all() and torch.isfinite(out[:4096]).all()
        del out, lse
        ran.append(backend)
    assert "triton" in ran


# --------------------------------------------------------------------------------------
# Offsets: strided views, the data contract, kernels on offsets nobody checked

ALL_BACKENDS = ["torch", "triton", "cuda", "auto"]


def _strided_cu(lengths, dtype=torch.int32, junk=10**6):
    """The offsets of ``lengths`` as a non-contiguous view (``buf[::2]``), junk in between."""
    cu = _cu(lengths, dtype)
    buf = torch.full((2 * cu.shape[0],), junk, dtype=dtype, device="cuda")
    buf[::2] = cu
    view = buf[::2]
    assert not view.is_contiguous()
    return view


def _skip_unless_takes(backend, q, k, v, cu_q, cu_k, max_q, max_k, causal, needs_grad=False):
    if backend in KERNELS:
        _needs(backend)
    if backend != "auto" and _reasons(backend, q, k, v, cu_q, cu_k, max_q, max_k, causal, 0.0, needs_grad):
        pytest.skip(f"{backend} cannot take this input")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_strided_offsets_every_backend(backend, causal, offsets_dtype):
    """cu_seqlens / RaggedTensor offsets as strided views, forward (varlen_attention and
    attention over plain-constructor RaggedTensors) and backward (not the forward-only CUDA
    kernel), against the reference with contiguous offsets."""
    lq, lk = LENGTHS["short_cross"]
    q, k, v = _qkv(lq, lk, 4, 2, 64, torch.bfloat16, _gen("strided-cu", backend, causal, offsets_dtype))
    cu_q, cu_k = _strided_cu(lq, offsets_dtype), _strided_cu(lk, offsets_dtype)
    _skip_unless_takes(backend, q, k, v, cu_q, cu_k, max(lq), max(lk), causal)
    ref, _ = ragged.reference_attention(q.double(), k.double(), v.double(), _cu(lq), _cu(lk), causal)
    low, _ = ragged.reference_attention(q, k, v, _cu(lq), _cu(lk), causal, compute_dtype=q.dtype)
    out = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, backend=backend)
    _assert_rule(f"{backend} varlen", out, ref, low, ATOL[q.dtype])
    rq, rk, rv = RaggedTensor(q, cu_q, max(lq)), RaggedTensor(k, cu_k, max(lk)), RaggedTensor(v, cu_k, max(lk))
    out = ragged.attention(rq, rk, rv, causal=causal, backend=backend)
    _assert_rule(f"{backend} ragged", out.values, ref, low, ATOL[q.dtype])
    if backend != "cuda":
        _check_backward(lq, lk, q, k, v, causal, f"strided/{backend}/{causal}", backend=backend, cu_q=cu_q, cu_k=cu_k)


def _break(kind, lengths):
    """Offsets (host list) of ``lengths`` breaking the data contract as ``kind`` says."""
    good = [0]
    for n in lengths:
        good.append(good[-1] + n)
    if kind == "last_past_T":
        return good[:-1] + [good[-1] + 5]
    if kind == "last_short_of_T":
        return good[:-1] + [good[-1] - 2]
    if kind == "first_not_0":
        return [2] + good[1:]
    if kind == "decreasing":
        return [good[0], good[2] + 1] + good[2:]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["last_past_T", "last_short_of_T", "first_not_0", "decreasing", "max_seqlen"])
@pytest.mark.parametrize("side", ["q", "k"])
def test_validate_gives_one_error_on_every_backend(kind, side):
    """validate=True reads CUDA offsets once and raises the same ValueError whatever the backend;
    the "torch" backend (which reads the offsets anyway) raises it without being asked."""
    lq, lk = [3, 0, 17, 9], [5, 2, 0, 20]
    q, k, v = _qkv(lq, lk, 4, 2, 64, torch.bfloat16, _gen("validate", kind, side))
    off = {"q": [0] + [sum(lq[:i + 1]) for i in range(len(lq))], "k": [0] + [sum(lk[:i + 1]) for i in range(len(lk))]}
    maxima = {"q": max(lq), "k": max(lk)}
    if kind == "max_seqlen":
        maxima[side] -= 1
    else:
        off[side] = _break(kind, lq if side == "q" else lk)
    cu_q = torch.tensor(off["q"], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(off["k"], dtype=torch.int32, device="cuda")
    messages = set()
    for backend in ALL_BACKENDS:
        if backend in KERNELS and (backends.triton_reason(q.device) if backend == "triton"
                                   else backends.cuda_reason(q.device)):
            continue
        for validate in ((False, True) if backend == "torch" else (True,)):
            with pytest.raises(ValueError) as info:
                ragged.varlen_attention(q, k, v, cu_q, cu_k, maxima["q"], maxima["k"], backend=backend,
                                        validate=validate)
            messages.add(str(info.value))
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("ragged.varlen_attention()"), message
    assert (f"max_seqlen_{side}" if kind == "max_seqlen" else f"cu_seqlens_{side}") in message, message


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_validate_on_good_offsets_and_no_sync_without_it(backend):
    lq, lk = LENGTHS["short_cross"]
    q, k, v = _qkv(lq, lk, 4, 2, 64, torch.bfloat16, _gen("validate-good", backend))
    cu_q, cu_k = _cu(lq), _cu(lk)
    _skip_unless_takes(backend, q, k, v, cu_q, cu_k, max(lq), max(lk), True)
    checked = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, backend=backend,
                                      validate=True)
    out = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, backend=backend)
    assert torch.equal(out, checked)
    if backend == "torch":
        return  # the reference reads the offsets on the host
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(again, out)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_ragged_host_offsets_against_values_without_sync(backend):
    """A RaggedTensor whose host offsets end past its values: ValueError, read from the host copy
    (no sync), before any backend runs."""
    lengths = [3, 0, 5]
    q = torch.randn(8, 4, 64, device="cuda", dtype=torch.bfloat16)
    good = RaggedTensor.from_lengths(q, lengths)
    bad = RaggedTensor(q[:7], good.offsets, good.max_len, good.host_offsets())
    if backend in KERNELS:
        _needs(backend)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(ValueError, match=r"ragged\.attention\(\): expected q\.offsets\[-1\] == q\.num_tokens "
                                             r"\(7\), got 8"):
            ragged.attention(bad, good, good, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _nan_guarded(x, lead=3, trail=64):
    """``x`` copied into the middle of a NaN buffer (NaN rows before and after, a NaN head beside)."""
    buf = torch.full((lead + x.shape[0] + trail, x.shape[1] + 1, x.shape[2]), float("nan"), dtype=x.dtype,
                     device=x.device)
    view = buf[lead:lead + x.shape[0], 1:]
    view.copy_(x)
    return view


# Backends whose kernels read their offsets as given (the contract: validate=True checks them).
_TRUSTS_OFFSETS = {"triton": "the Triton attention kernels trust their offsets (clipping cost 45% of the causal "
                             "forward); validate=True checks them"}


@pytest.mark.parametrize("backend", [*KERNELS, "auto"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("side", ["q", "k", "both"])
def test_kernels_clip_offsets_past_T(backend, side, causal):
    """CUDA offsets past T, unchecked (validate=False): each sequence is clipped to the rows the
    tensors have. Inputs sit in NaN buffers (a read past T gives NaN); the Triton backward writes
    into sentinel buffers (a write past T changes a sentinel)."""
    if backend in _TRUSTS_OFFSETS:
        pytest.skip(_TRUSTS_OFFSETS[backend])
    if backend in KERNELS:
        _needs(backend)
    lq, lk = [3, 0, 17, 9], [5, 2, 0, 20]
    gen = _gen("clip", backend, side, causal)
    q0, k0, v0 = _qkv(lq, lk, 4, 2, 64, torch.bfloat16, gen)
    tq = q0.shape[0]
    off_q = [0] + [sum(lq[:i + 1]) for i in range(len(lq))]
    off_k = [0] + [sum(lk[:i + 1]) for i in range(len(lk))]
    ref_cq, ref_ck = _cu(lq), _cu(lk)       # the clipped offsets are the valid ones
    if side in ("q", "both"):
        off_q[-1] += 11
    if side in ("k", "both"):
        off_k[-1] += 13
    cu_q = torch.tensor(off_q, dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(off_k, dtype=torch.int32, device="cuda")
    q, k, v = _nan_guarded(q0), _nan_guarded(k0), _nan_guarded(v0)
    if backend != "auto" and _reasons(backend, q, k, v, cu_q, cu_k, max(lq), max(lk), causal):
        pytest.skip(f"{backend} cannot take this input")
    out, lse = ragged.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, return_lse=True,
                                       backend=backend)
    ref, ref_lse = ragged.reference_attention(q0.double(), k0.double(), v0.double(), ref_cq, ref_ck, causal)
    low, _ = ragged.reference_attention(q0, k0, v0, ref_cq, ref_ck, causal, compute_dtype=q0.dtype)
    _assert_rule(f"{backend} out", out, ref, low, ATOL[q0.dtype])
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    if backend != "triton":
        return
    # gradients through the public path (the leaves are the guarded views themselves) ...
    _check_backward(lq, lk, q, k, v, causal, f"clip/{side}/{causal}", backend="triton", cu_q=cu_q, cu_k=cu_k)
    # ... and through the launcher, into sentinel buffers, with do, out and lse guarded too
    from ragged.kernels.triton import attention as ka

    do = _nan_guarded(torch.randn(q0.shape, generator=gen, device="cuda").to(q0.dtype))
    lse_g = torch.full((tq + 64, 4), float("nan"), device="cuda")[:tq]
    lse_g.copy_(lse)
    buffers = [torch.full((t.shape[0] + 64, *t.shape[1:]), 1234.5, dtype=t.dtype, device="cuda") for t in (q0, k0, v0)]
    views = tuple(b[:t.shape[0]] for b, t in zip(buffers, (q0, k0, v0)))
    grads = ka.backward(do, q, k, v, _nan_guarded(out), lse_g, cu_q, cu_k, max(lq), max(lk), causal, 0.125, 0.0, 0,
                        grads=views)
    for name, g, view, buf in zip("qkv", grads, views, buffers):
        assert g is view
        assert torch.all(buf[view.shape[0]:] == 1234.5), f"d{name}: written past T"
        assert not torch.isnan(g).any(), f"d{name}: read past T"


@pytest.mark.parametrize("layout", ["feature_strided", "packed_qkv"])
def test_triton_backward_grads_buffers_of_any_strides(layout):
    _needs("triton")
    from ragged.kernels.triton import attention as ka

    lengths = [5, 0, 1, 70, 33]
    gen = _gen("grads", layout)
    q, k, v = _qkv(lengths, lengths, 4, 4, 64, torch.bfloat16, gen)
    do = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
    cu = _cu(lengths)
    out, lse = ka.forward(q, k, v, cu, cu, 70, 70, True, 0.125, 0.0, 0)
    if layout == "feature_strided":
        grads = tuple(torch.full((t.shape[2], t.shape[1], t.shape[0]), 7.0, dtype=t.dtype, device="cuda")
                      .permute(2, 1, 0) for t in (q, k, v))
    else:
        grads = torch.full((q.shape[0], 3, 4, 64), 7.0, dtype=q.dtype, device="cuda").unbind(1)
    got = ka.backward(do, q, k, v, out, lse, cu, cu, 70, 70, True, 0.125, 0.0, 0, grads=grads)
    expected = ka.backward(do, q, k, v, out, lse, cu, cu, 70, 70, True, 0.125, 0.0, 0)
    for name, g, buf, e in zip("qkv", got, grads, expected):
        assert g is buf
        torch.testing.assert_close(g, e, atol=0, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")
