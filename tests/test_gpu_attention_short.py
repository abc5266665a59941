"""The CUDA short-sequence attention kernel (csrc/attention_short.cu) against the float64 reference.

Error rule (flash-attn's): the kernel's max error against the float64 reference may be at most
twice that of the reference itself run in the input dtype, plus 1e-3. Run with ``pytest -m gpu``
on a machine with CUDA (skipped otherwise).
"""

from __future__ import annotations

import itertools
import random
import re

import pytest
import torch

import ragged
from ragged import backends

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS = [32, 64, 128]
HEADS = [(4, 4), (6, 2), (4, 1)]  # (query heads, key/value heads): MHA, GQA, MQA
_rng = random.Random(0)
LENGTH_SETS = {
    "mixed": [0, 1, 7, 16, 17, 31, 32, 5, 0, 13],
    "long": [128, 1, 0, 127, 64, 65, 100, 33],
    "regime": [_rng.randint(8, 32) for _ in range(24)],
    "all_zero": [0, 0, 0],
}


def _kernel():
    reason = backends.cuda_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)
    from ragged.kernels.cuda import attention as cuda_attention

    return cuda_attention


def _forward(kern, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p=0.0, seed=0):
    """The kernel's forward on the operands in the op's order (as the record takes them)."""
    from ragged.ops.attention import AttentionArgs

    args = AttentionArgs(
        q=q,
        k=k,
        v=v,
        cu_q=cu_q,
        cu_k=cu_k,
        max_q=max_q,
        max_k=max_k,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        seed=seed,
    )
    return kern.forward(args)


def _offsets(lengths, dtype=torch.int32):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=dtype, device="cuda")


def _poisoned(tokens, heads, dim, dtype, gen, lead=5, trail=3, extra_heads=2):
    """A [tokens + trail, heads, dim] view of a NaN buffer (NaN tokens before and after it, NaN
    neighbouring heads) whose first `tokens` rows hold random values."""
    buf = torch.full((lead + tokens + trail, heads + extra_heads, dim), float("nan"), dtype=dtype, device="cuda")
    x = buf[lead:, 1 : 1 + heads]
    x[:tokens] = torch.randn((tokens, heads, dim), generator=gen, device="cuda").to(dtype)
    return x


def _inputs(lengths_q, lengths_k, heads, kv_heads, dim, dtype, seed, offsets_dtype=torch.int32):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = _poisoned(sum(lengths_q), heads, dim, dtype, gen)
    k = _poisoned(sum(lengths_k), kv_heads, dim, dtype, gen)
    v = _poisoned(sum(lengths_k), kv_heads, dim, dtype, gen)
    return q, k, v, _offsets(lengths_q, offsets_dtype), _offsets(lengths_k, offsets_dtype)


def _check(out, lse, q, k, v, cu_q, cu_k, causal, scale=None):
    n = int(cu_q[-1])
    ref64, lse64 = ragged.reference_attention(q.double(), k.double(), v.double(), cu_q, cu_k, causal, scale)
    ref_lp, _ = ragged.reference_attention(q, k, v, cu_q, cu_k, causal, scale, compute_dtype=q.dtype)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:2] and lse.dtype == torch.float32
    out, lse = out[:n].double(), lse[:n]
    assert not torch.isnan(out).any(), "NaN in the output"
    if n == 0:
        return
    err = (out - ref64).abs().max().item()
    tol = 2 * (ref_lp.double() - ref64).abs().max().item() + 1e-3
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"
    lse64 = lse64.double()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse64)), "lse = -inf on other rows than the reference"
    assert not torch.isnan(lse).any()
    seen = torch.isfinite(lse64)
    if seen.any():
        lse_err = (lse.double()[seen] - lse64[seen]).abs().max().item()
        assert lse_err <= 1e-3, f"lse error {lse_err:.3g}"
    # A query that sees no key: output 0.
    assert (out[~seen] == 0).all()


@pytest.fixture(params=["pipelined", "per_head"])
def path(request, monkeypatch):
    """Both kernels of the common case: the pipelined one (several heads per block) and the
    one-block-per-head one (which also takes every longer case)."""
    from ragged.kernels.cuda import attention as cuda_attention

    if request.param == "per_head":
        monkeypatch.setattr(cuda_attention, "PIPELINED_HEADS", 0)
    else:  # whatever the batch size
        monkeypatch.setattr(cuda_attention, "PIPELINED_MIN_PAIRS_PER_SM", 0)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_matches_reference(dtype, dim, causal, heads, kv_heads, path):
    kern = _kernel()
    for i, (name, lengths) in enumerate(LENGTH_SETS.items()):
        q, k, v, cu_q, cu_k = _inputs(lengths, lengths, heads, kv_heads, dim, dtype, seed=dim * 10 + i)
        m = max(lengths)
        out, lse = _forward(kern, q, k, v, cu_q, cu_k, m, m, causal, 1.0 / dim**0.5, 0.0, 0)
        try:
            _check(out, lse, q, k, v, cu_q, cu_k, causal)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None


CROSS = {
    "mixed": ([5, 0, 17, 32, 1, 128, 3, 2], [9, 4, 0, 32, 128, 1, 3, 7]),
    "many_rounds": ([128, 100, 3, 40], [32, 7, 0, 31]),  # long queries, one key chunk reused
    "many_chunks": ([16, 2, 1], [128, 100, 65]),  # key chunks with the online rescale
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", sorted(CROSS))
def test_cross_attention_bottom_right_causal(dtype, dim, causal, case, path):
    kern = _kernel()
    lengths_q, lengths_k = CROSS[case]
    q, k, v, cu_q, cu_k = _inputs(lengths_q, lengths_k, 4, 2, dim, dtype, seed=7)
    out, lse = _forward(kern, q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal, 0.3, 0.0, 0)
    _check(out, lse, q, k, v, cu_q, cu_k, causal, scale=0.3)


@pytest.mark.parametrize("heads", [1, 3, 5, 12])
def test_causal_rows_without_keys_are_zero(heads, path):
    kern = _kernel()
    # Lq = 5, Lk = 2: queries 0..2 see no key (bottom-right alignment); Lq = 20, Lk = 3: the
    # second strip's first rows see keys, the first strip's 17 rows none.
    q, k, v, cu_q, cu_k = _inputs([5, 20, 3], [2, 3, 0], heads, 1, 64, torch.bfloat16, seed=3)
    out, lse = _forward(kern, q, k, v, cu_q, cu_k, 20, 3, True, 0.125, 0.0, 0)
    assert (out[:3] == 0).all() and torch.isneginf(lse[:3]).all()
    assert torch.isfinite(lse[3:5]).all()
    _check(out, lse, q, k, v, cu_q, cu_k, True, scale=0.125)


@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_max_seqlen_hints_below_the_lengths(dim, causal, path):
    """Hints smaller than the real lengths pick small tiles; the kernels still cover every token."""
    kern = _kernel()
    lengths_q, lengths_k = [40, 5, 33, 128], [35, 70, 3, 128]
    q, k, v, cu_q, cu_k = _inputs(lengths_q, lengths_k, 6, 3, dim, torch.bfloat16, seed=13)
    out, lse = _forward(kern, q, k, v, cu_q, cu_k, 32, 32, causal, 0.1, 0.0, 0)
    _check(out, lse, q, k, v, cu_q, cu_k, causal, scale=0.1)


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64], ids=str)
def test_offsets_dtypes_and_varlen_api(offsets_dtype):
    _kernel()
    lengths = [3, 0, 17, 9, 1, 32]
    q, k, v, cu_q, cu_k = _inputs(lengths, lengths, 12, 12, 64, torch.bfloat16, seed=11, offsets_dtype=offsets_dtype)
    out, lse = ragged.varlen_attention(q, k, v, cu_q, cu_k, 32, 32, causal=True, return_lse=True, backend="cuda")
    _check(out, lse, q, k, v, cu_q, cu_k, True)


def test_mixed_offsets_dtypes(path):
    kern = _kernel()
    q, k, v, cu_q, cu_k = _inputs([4, 20, 0, 7], [9, 2, 5, 7], 4, 4, 64, torch.float16, seed=5)
    out, lse = _forward(kern, q, k, v, cu_q, cu_k.long(), 20, 9, False, 0.125, 0.0, 0)
    _check(out, lse, q, k, v, cu_q, cu_k, False, scale=0.125)
    out, lse = _forward(kern, q, k, v, cu_q.long(), cu_k, 20, 9, True, 0.125, 0.0, 0)
    _check(out, lse, q, k, v, cu_q, cu_k, True, scale=0.125)


def test_misaligned_and_noncontiguous_inputs(path):
    kern = _kernel()
    gen = torch.Generator(device="cuda").manual_seed(2)
    lengths = [7, 30, 1]
    cu = _offsets(lengths)
    # Rows starting 2 bytes off a 16-byte boundary (copied by the launcher), and a
    # head-major tensor seen as [T, H, D] (strided, but aligned: used in place).
    base = torch.randn(38 * 4 * 64 + 1, generator=gen, device="cuda").to(torch.bfloat16)
    q = base[1:].view(38, 4, 64)
    k = torch.randn(4, 38, 64, generator=gen, device="cuda").to(torch.bfloat16).transpose(0, 1)
    v = torch.randn(38, 4, 64, generator=gen, device="cuda").to(torch.bfloat16)
    out, lse = _forward(kern, q, k, v, cu, cu, 30, 30, False, 0.125, 0.0, 0)
    _check(out, lse, q, k, v, cu, cu, False, scale=0.125)


def test_empty_batches(path):
    kern = _kernel()
    for lengths in ([], [0], [0, 0, 0]):
        q, k, v, cu_q, cu_k = _inputs(lengths, lengths, 4, 4, 64, torch.bfloat16, seed=1)
        out, lse = _forward(kern, q, k, v, cu_q, cu_k, 0, 0, False, 0.125, 0.0, 0)
        assert out.shape == q.shape and lse.shape == q.shape[:2]
    # Queries over empty key sequences: zeros and lse = -inf.
    q, k, v, cu_q, cu_k = _inputs([3, 2], [0, 0], 4, 4, 64, torch.bfloat16, seed=1)
    out, lse = _forward(kern, q, k, v, cu_q, cu_k, 3, 0, False, 0.125, 0.0, 0)
    assert (out[:5] == 0).all() and torch.isneginf(lse[:5]).all()


def test_token_index_past_int32(path):
    kern = _kernel()
    free, _ = torch.cuda.mem_get_info()
    stride = 2**24  # elements between tokens: the last tokens sit past 2**31 elements
    tokens = 140
    if free < (tokens * stride) * 2 + 2**30:
        pytest.skip("not enough GPU memory")
    lengths = [20, 0, 64, 31, 25]
    gen = torch.Generator(device="cuda").manual_seed(9)
    storage = torch.empty(tokens * stride, dtype=torch.bfloat16, device="cuda")
    q = storage.as_strided((tokens, 4, 64), (stride, 64, 1))
    q.copy_(torch.randn((tokens, 4, 64), generator=gen, device="cuda").to(torch.bfloat16))
    k = torch.randn((tokens, 4, 64), generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn((tokens, 4, 64), generator=gen, device="cuda").to(torch.bfloat16)
    cu = _offsets(lengths)
    for max_len in (64, 32):  # hints of 32: tiles smaller than the 64-token sequence
        out, lse = _forward(kern, q, k, v, cu, cu, max_len, max_len, True, 0.125, 0.0, 0)
        _check(out, lse, q.contiguous(), k, v, cu, cu, True, scale=0.125)
    del storage, q


def test_no_host_sync_after_warmup(path):
    kern = _kernel()
    lengths = [_rng.randint(8, 32) for _ in range(64)]
    q, k, v, cu_q, cu_k = _inputs(lengths, lengths, 12, 12, 64, torch.bfloat16, seed=4)
    m = max(lengths)
    expected = ragged.varlen_attention(q, k, v, cu_q, cu_k, m, m, causal=True, backend="cuda")
    _forward(kern, q, k, v, cu_q, cu_k, m, m, False, 0.125, 0.0, 0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ragged.varlen_attention(q, k, v, cu_q, cu_k, m, m, causal=True, backend="cuda")
        _forward(kern, q, k, v, cu_q, cu_k, m, m, False, 0.125, 0.0, 0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    n = sum(lengths)  # (rows past the last sequence are not written)
    assert torch.equal(out[:n], expected[:n])


def test_kernel_choice(monkeypatch):
    kern = _kernel()
    names = []
    real = kern.launch
    monkeypatch.setattr(kern, "launch", lambda src, name, *a: (names.append(name), real(src, name, *a)))
    pairs = kern.PIPELINED_MIN_PAIRS_PER_SM * torch.cuda.get_device_properties(0).multi_processor_count
    batch = -(-pairs // 12)
    for lengths, expected in (
        ([_rng.randint(8, 32) for _ in range(batch)], "pipe_bf16_d64_c32_h"),
        ([3, 9, 32], "short_bf16_d64_c32"),
        ([3, 33], "short_bf16_d64_c64"),
    ):
        q, k, v, cu_q, cu_k = _inputs(lengths, lengths, 12, 12, 64, torch.bfloat16, seed=6)
        m = max(lengths)
        _forward(kern, q, k, v, cu_q, cu_k, m, m, False, 0.125, 0.0, 0)
        assert expected in names[-1], (names[-1], expected)


def _cuda_reasons(q, k, v, cu_q, cu_k, max_q, max_k, causal, dropout_p, needs_grad):
    return ragged.explain("attention", q, k, v, cu_q, cu_k, max_q, max_k, causal, dropout_p, needs_grad)["cuda"]


def test_reasons():
    _kernel()
    q, k, v, cu_q, cu_k = _inputs([3, 5], [3, 5], 4, 2, 64, torch.bfloat16, seed=0)
    if torch.cuda.get_device_capability() < (8, 0):
        assert any("compute capability" in r for r in _cuda_reasons(q, k, v, cu_q, cu_k, 5, 5, False, 0.0, False))
        pytest.skip("compute capability < 8.0")
    assert _cuda_reasons(q, k, v, cu_q, cu_k, 128, 128, True, 0.0, False) == []
    for max_q, max_k in ((129, 5), (5, 129)):
        assert any(
            "128" in r and "129" in r for r in _cuda_reasons(q, k, v, cu_q, cu_k, max_q, max_k, False, 0.0, False)
        )
    assert any("dropout" in r for r in _cuda_reasons(q, k, v, cu_q, cu_k, 5, 5, False, 0.1, False))
    assert any("forward only" in r for r in _cuda_reasons(q, k, v, cu_q, cu_k, 5, 5, False, 0.0, True))
    q32 = q.float()
    assert any("float32" in r for r in _cuda_reasons(q32, k.float(), v.float(), cu_q, cu_k, 5, 5, False, 0.0, False))
    q80 = torch.zeros(8, 4, 80, dtype=torch.bfloat16, device="cuda")
    assert any(
        "head dims" in r and "80" in r for r in _cuda_reasons(q80, q80, q80, cu_q, cu_k, 5, 5, False, 0.0, False)
    )
    qc = q.cpu()
    assert _cuda_reasons(qc, k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), 5, 5, False, 0.0, False)
    # Through the API: a forced backend that cannot take the input raises.
    with pytest.raises(ValueError, match="forward only"):
        ragged.varlen_attention(q.detach().requires_grad_(True), k, v, cu_q, cu_k, 5, 5, backend="cuda")
    with pytest.raises(ValueError, match="dropout"):
        ragged.varlen_attention(q, k, v, cu_q, cu_k, 5, 5, dropout_p=0.1, backend="cuda")
    with pytest.raises(ValueError, match="128"):
        ragged.varlen_attention(q, k, v, cu_q, cu_k, 129, 129, backend="cuda")


def test_declaration_backward_and_extras():
    """The kernel is forward only: its implementation's backward is Triton's; the packed
    inference entry point is an extra of the declaration (what the layers look up)."""
    _kernel()
    from ragged.kernels.triton import attention as ka

    impl = backends.implementation("attention", "cuda")
    assert impl.backward_backend == "triton" and impl.backward_fn is ka.backward
    assert impl.extra("packed_self_attention") is _kernel().packed_self_attention


def test_launcher_table_matches_the_source():
    from ragged.kernels.cuda import attention as ca
    from ragged.kernels.cuda import launch as kc

    src = kc.source("attention_short.cu")
    declared = {
        (int(d), int(c), int(w))
        for d, c, w in re.findall(r"^RAGGED_ATTENTION_SHORT_TYPES\((\d+), (\d+), (\d+), \d+\)", src, re.MULTILINE)
    }
    table = {(d, c, w) for d, configs in ca._CONFIGS.items() for c, w in configs}
    assert declared == table
    assert set(ca._CONFIGS) == set(ca.HEAD_DIMS)
    pipelined = {
        (int(d), int(c), int(w), int(n))
        for d, c, w, n in re.findall(
            r"^RAGGED_ATTENTION_SHORT_PIPELINED_TYPES\((\d+), (\d+), (\d+), (\d+), \d+\)", src, re.MULTILINE
        )
    }
    assert pipelined == {(d, c, w, ca.PIPELINED_HEADS) for d, (c, w) in ca._PIPELINED.items()}


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dim", [64, 128])
def test_packed_self_attention_reads_the_input_projection_in_place(path, dim, causal, offsets_dtype):
    """The inference entry point: q, k, v side by side per token in one [T, 3 H D] tensor, no
    lse written; against the float64 reference on the same q, k, v."""
    kernel = _kernel()
    heads, dtype = 4, torch.bfloat16
    lengths = LENGTH_SETS["mixed"] + LENGTH_SETS["regime"][:6]
    total = sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(dim + causal)
    buf = torch.full((total + 2, 3 * heads * dim), float("nan"), dtype=dtype, device="cuda")
    qkv = buf[:total]  # the rows after it are NaN
    qkv.copy_(torch.randn((total, 3 * heads * dim), generator=gen, device="cuda").to(dtype))
    cu = _offsets(lengths, offsets_dtype)
    out = kernel.packed_self_attention(qkv, cu, max(lengths), heads, causal, dim**-0.5)
    assert out.shape == (total, heads * dim) and out.dtype == dtype
    q, k, v = qkv.view(total, 3, heads, dim).unbind(1)
    ref64, _ = ragged.reference_attention(q.double(), k.double(), v.double(), cu, cu, causal, dim**-0.5)
    ref_lp, _ = ragged.reference_attention(q, k, v, cu, cu, causal, dim**-0.5, compute_dtype=dtype)
    assert not torch.isnan(out).any()
    err = (out.view(total, heads, dim).double() - ref64).abs().max().item()
    tol = 2 * (ref_lp.double() - ref64).abs().max().item() + 1e-3
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"
