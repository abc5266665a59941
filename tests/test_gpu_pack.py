"""pack / unpack on the GPU: every kernel backend against the reference, bit-exact.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import ragged
from ragged import RaggedTensor, backends
from ragged.records.pack import PackArgs, UnpackArgs

pytestmark = pytest.mark.gpu

KERNELS = ["cuda", "triton"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool]
FEATURES = [(), (768,), (12, 64), (129,), (3,), (1000,)]
LENGTH_SETS = {
    "mixed": [5, 0, 31, 12, 1, 97, 7, 64],
    "one_long": [1, 2, 1025, 0, 3],
    "all_zero": [0, 0, 0],
    "single": [1],
}


def _needs(backend: str):
    reason = (
        backends.cuda_reason(torch.device("cuda"))
        if backend == "cuda"
        else backends.triton_reason(torch.device("cuda"))
    )
    if reason:
        pytest.skip(reason)


def _random(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen, device="cuda") > 0.5
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=gen, device="cuda")
    return torch.randn(shape, generator=gen, device="cuda").to(dtype)


def _padded_with_poison(lengths, feat, dtype, gen, side="right", width=None):
    width = max(lengths, default=0) if width is None else width
    x = _random((len(lengths), width, *feat), dtype, gen)
    if dtype.is_floating_point:
        pad = ragged.pack([torch.empty(n, device="cuda") for n in lengths]).padding_mask(width, side)
        x[pad] = float("nan")
    return x


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feat", FEATURES, ids=str)
@pytest.mark.parametrize("side", ["right", "left"])
def test_pack_unpack_bit_exact(backend, dtype, feat, side):
    _needs(backend)
    gen = torch.Generator(device="cuda").manual_seed(hash((backend, str(dtype), feat, side)) % 2**31)
    for name, lengths in LENGTH_SETS.items():
        x = _padded_with_poison(lengths, feat, dtype, gen, side, width=max(lengths) + 3)
        rt = ragged.pack(x, lengths=lengths, padding_side=side, backend=backend)
        ref = ragged.pack(x, lengths=lengths, padding_side=side, backend="torch")
        assert torch.equal(rt.values, ref.values), name
        if dtype.is_floating_point:
            assert not torch.isnan(rt.values).any(), f"padding leaked into values ({name})"
        fill = float("nan") if dtype.is_floating_point else 1
        out = rt.to_padded(padding_value=fill, total_length=max(lengths) + 5, padding_side=side, backend=backend)
        exp = ref.to_padded(padding_value=fill, total_length=max(lengths) + 5, padding_side=side, backend="torch")
        assert out.shape == exp.shape
        assert (
            torch.equal(out, exp)
            if not dtype.is_floating_point
            else torch.allclose(out.double(), exp.double(), rtol=0, atol=0, equal_nan=True)
        ), name


@pytest.mark.parametrize("backend", KERNELS)
def test_offsets_int64_and_strided_padded(backend):
    _needs(backend)
    gen = torch.Generator(device="cuda").manual_seed(1)
    lengths = [3, 0, 17, 9, 1]
    seq_first = torch.randn(20, 5, 64, generator=gen, device="cuda")
    x = seq_first.transpose(0, 1)  # [B, M, F] view with strided B/M dims
    offsets = torch.tensor([0, 3, 3, 20, 29, 30], dtype=torch.int64, device="cuda")
    got = ragged.pack_values(x, offsets, 30, backend=backend)
    assert torch.equal(got, ragged.reference_pack(x, offsets, 30))
    back = ragged.unpack_values(got, offsets, 20, padding_value=-1.0, backend=backend)
    assert torch.equal(back, ragged.reference_unpack(got, offsets, 20, -1.0))
    assert sum(lengths) == 30


@pytest.mark.parametrize("backend", KERNELS)
def test_misaligned_and_noncontiguous_features(backend):
    _needs(backend)
    gen = torch.Generator(device="cuda").manual_seed(2)
    base = torch.randn(4 * 9 * 10 + 1, generator=gen, device="cuda").half()
    x = base[1:].view(4, 9, 10)  # data_ptr off 16-byte alignment
    lengths = [9, 2, 0, 5]
    got = ragged.pack(x, lengths=lengths, backend=backend)
    assert torch.equal(got.values, ragged.pack(x, lengths=lengths, backend="torch").values)
    y = torch.randn(4, 9, 6, 5, generator=gen, device="cuda").transpose(2, 3)  # features not contiguous
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = ragged.pack(y, lengths=lengths, backend=backend)
    assert torch.equal(got.values, ragged.pack(y, lengths=lengths, backend="torch").values)


@pytest.mark.parametrize("backend", KERNELS)
def test_gradients(backend):
    _needs(backend)
    lengths = [3, 0, 5, 1]
    x = torch.randn(4, 6, 3, device="cuda", dtype=torch.float64, requires_grad=True)
    fn = lambda t: ragged.pack(t, lengths=lengths, backend=backend).values  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))
    rt = ragged.pack(x.detach(), lengths=lengths)
    v = rt.values.clone().requires_grad_(True)
    fn2 = lambda t: ragged.unpack_values(t, rt.offsets, 7, padding_value=2.0, backend=backend)  # noqa: E731
    assert torch.autograd.gradcheck(fn2, (v,))


@pytest.mark.parametrize("backend", KERNELS)
def test_no_host_sync(backend):
    _needs(backend)
    lengths = [5, 0, 31, 12]
    x = torch.randn(4, 40, 32, device="cuda", requires_grad=True)
    ragged.pack(x, lengths=lengths, backend=backend)  # warm up: compile kernels, pin buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rt = ragged.pack(x, lengths=lengths, backend=backend)
        y = rt.with_values(rt.values * 2)
        out = y.to_padded(total_length=40, backend=backend)
        rt.position_ids(), rt.seq_ids(), rt.padding_mask(), rt.lengths, rt.attention_mask()
        ragged.pack([torch.randn(n, 32, device="cuda") for n in lengths])
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert x.grad is not None


@pytest.mark.parametrize("backend", KERNELS)
def test_compile_fullgraph(backend):
    _needs(backend)
    torch._dynamo.reset()
    lin = torch.nn.Linear(64, 64, device="cuda")

    def f(x, lengths):
        rt = ragged.pack(x, lengths=lengths, backend=backend)
        return rt.with_values(lin(rt.values)).to_padded(backend=backend)

    x = torch.randn(3, 17, 64, device="cuda", requires_grad=True)
    lengths = [17, 0, 9]
    out = torch.compile(f, fullgraph=True)(x, lengths)
    ref = f(x, lengths)
    torch.testing.assert_close(out, ref)
    out.sum().backward()


@pytest.mark.parametrize("backend", KERNELS)
def test_cuda_graph_capture(backend):
    _needs(backend)
    lengths = [7, 0, 3]
    x = torch.randn(3, 8, 16, device="cuda")
    rt = ragged.pack(x, lengths=lengths, backend=backend)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ragged.pack_values(x, rt.offsets, rt.num_tokens, backend=backend)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ragged.pack_values(x, rt.offsets, rt.num_tokens, backend=backend)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ragged.reference_pack(x, rt.offsets, rt.num_tokens))


def test_auto_prefers_a_kernel_on_cuda():
    x = torch.randn(2, 4, 8, device="cuda")
    offsets = torch.tensor([0, 1, 5], dtype=torch.int32, device="cuda")
    impl = backends.select("pack", "auto", x.device, x, offsets)
    assert impl.name in ("cuda", "triton")


@pytest.mark.parametrize("backend", KERNELS)
def test_int64_indexing(backend):
    """B * M * row > 2**31 elements: index arithmetic must not wrap."""
    _needs(backend)
    free, _ = torch.cuda.mem_get_info()
    batch, width, feat = 2, 2**20 + 7, 1100  # 2.3e9 elements of bf16 in the padded tensor
    if free < 12 * 2**30:
        pytest.skip("needs 12 GiB of free GPU memory")
    x = torch.empty(batch, width, feat, dtype=torch.bfloat16, device="cuda")
    x[0].fill_(1.0)
    x[1].fill_(2.0)
    x[1, -1].fill_(3.0)
    lengths = [5, width]
    rt = ragged.pack(x, lengths=lengths, backend=backend)
    assert rt.values.shape == (5 + width, feat)
    assert torch.all(rt.values[:5] == 1) and torch.all(rt.values[5:-1] == 2) and torch.all(rt.values[-1] == 3)
    del x
    out = rt.to_padded(padding_value=-1.0, backend=backend)
    assert torch.all(out[0, :5] == 1) and torch.all(out[0, 5:] == -1)
    assert torch.all(out[1, -1] == 3) and torch.all(out[1, :-1] == 2)


# --------------------------------------------------------------------------------------
# Regressions: strided offsets, widths below a length, the padding value, mask checks


ALL_BACKENDS = ["torch", "triton", "cuda", "auto"]


def _needs_backend(backend: str):
    if backend in KERNELS:
        _needs(backend)


def _host_offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _strided_cuda(host, dtype):
    """``host`` as a CUDA view of stride 2 over a buffer holding garbage in between."""
    buf = torch.full((2 * len(host),), 99, dtype=dtype, device="cuda")
    buf[::2] = torch.tensor(host, dtype=dtype, device="cuda")
    return buf[::2]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("odtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("side", ["right", "left"])
def test_strided_offsets_every_entry_point(backend, odtype, side):
    _needs_backend(backend)
    gen = torch.Generator(device="cuda").manual_seed(11)
    lengths = [5, 0, 1, 97, 7]
    width = max(lengths) + 2
    left = side == "left"
    x = _padded_with_poison(lengths, (33,), torch.float32, gen, side, width=width)
    host = _host_offsets(lengths)
    total = host[-1]
    dense = torch.tensor(host, dtype=odtype, device="cuda")
    offsets = _strided_cuda(host, odtype)
    ref = ragged.reference_pack(x, dense, total, left)
    ref_padded = ragged.reference_unpack(ref, dense, width, -3.0, left)
    assert torch.equal(ragged.pack_values(x, offsets, total, padding_side=side, backend=backend), ref)
    got = ragged.unpack_values(ref, offsets, width, padding_value=-3.0, padding_side=side, backend=backend)
    assert torch.equal(got, ref_padded)
    for rt in (
        RaggedTensor.from_offsets(ref, offsets),
        RaggedTensor.from_offsets(ref, offsets, max(lengths), validate=False),
        ragged.from_cu_seqlens(ref, offsets, max(lengths), validate=False),
    ):
        assert rt.offsets.is_contiguous()
        got = rt.to_padded(padding_value=-3.0, total_length=width, padding_side=side, backend=backend)
        assert torch.equal(got, ref_padded)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("left", [False, True])
def test_kernel_launchers_take_strided_offsets(backend, left):
    """The launchers make offsets contiguous themselves, whoever calls them."""
    _needs(backend)
    if backend == "cuda":
        from ragged.kernels.cuda import pack as kernels
    else:
        from ragged.kernels.triton import pack as kernels
    gen = torch.Generator(device="cuda").manual_seed(12)
    lengths = [3, 0, 64, 1]
    width = 70
    x = torch.randn(len(lengths), width, 16, generator=gen, device="cuda")
    host = _host_offsets(lengths)
    dense = torch.tensor(host, dtype=torch.int64, device="cuda")
    offsets = _strided_cuda(host, torch.int64)
    values = kernels.pack(PackArgs(x, offsets, host[-1], left)).values
    assert torch.equal(values, ragged.reference_pack(x, dense, host[-1], left))
    out = kernels.unpack(UnpackArgs(values, offsets, width, 1.5, left)).padded
    assert torch.equal(out, ragged.reference_unpack(values, dense, width, 1.5, left))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_width_checks_on_cuda(backend):
    """Host-side checks raise with no sync; validate=True checks CUDA offsets with one read."""
    _needs_backend(backend)
    lengths = [2, 5, 0, 1]
    values = torch.randn(8, 3, device="cuda")
    offsets = torch.tensor(_host_offsets(lengths), dtype=torch.int32, device="cuda")
    rt = RaggedTensor.from_lengths(values, lengths, max_len=2, validate=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(ValueError, match=r"ragged\.unpack_values\(\): expected width >= 0, got -1"):
            ragged.unpack_values(values, offsets, -1, backend=backend)
        with pytest.raises(ValueError, match=r"ragged\.unpack\(\): expected max_len >= the longest sequence \(5\)"):
            rt.to_padded(backend=backend)
        with pytest.raises(ValueError, match=r"ragged\.unpack\(\): expected padding_value representable"):
            ragged.unpack(
                RaggedTensor.from_lengths(values.to(torch.uint8), lengths), padding_value=-1.0, backend=backend
            )
    finally:
        torch.cuda.set_sync_debug_mode(0)
    with pytest.raises(
        ValueError,
        match=r"ragged\.unpack_values\(\): expected every length <= width \(4\), "
        r"got a length of 5",
    ):
        ragged.unpack_values(values, offsets, 4, backend=backend, validate=True)
    padded = torch.randn(4, 4, 3, device="cuda")
    with pytest.raises(ValueError, match=r"ragged\.pack_values\(\): expected every length <= the padded width"):
        ragged.pack_values(padded, offsets, 8, backend=backend, validate=True)
    with pytest.raises(ValueError, match=r"ragged\.pack_values\(\): expected offsets\[-1\] == total \(7\), got 8"):
        ragged.pack_values(torch.randn(4, 5, 3, device="cuda"), offsets, 7, backend=backend, validate=True)
    got = ragged.unpack_values(values, offsets, 5, backend=backend, validate=True)
    assert torch.equal(got, ragged.reference_unpack(values, offsets, 5))


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_unchecked_length_past_width_stays_in_bounds(backend, side):
    """CUDA offsets unchecked (validate=False) with a length past the width: the kernels
    read and write only inside their tensors (pack writes zeros for rows it cannot read)."""
    _needs(backend)
    lengths = [2, 5, 0, 1]
    width = 4
    gen = torch.Generator(device="cuda").manual_seed(13)
    host = _host_offsets(lengths)
    offsets = torch.tensor(host, dtype=torch.int32, device="cuda")
    values = torch.randn(host[-1], 3, generator=gen, device="cuda")
    out = ragged.unpack_values(values, offsets, width, padding_value=-1.0, padding_side=side, backend=backend)
    padded = torch.randn(len(lengths), width, 3, generator=gen, device="cuda")
    packed = ragged.pack_values(padded, offsets, host[-1], padding_side=side, backend=backend)
    torch.cuda.synchronize()
    exp_out = torch.full((len(lengths), width, 3), -1.0)
    exp_packed = torch.zeros(host[-1], 3)
    for b, n in enumerate(lengths):
        for k in range(n):
            j = k if side == "right" else k + width - n
            if 0 <= j < width:
                exp_out[b, j] = values[host[b] + k].cpu()
                exp_packed[host[b] + k] = padded[b, j].cpu()
    assert torch.equal(out.cpu(), exp_out)
    assert torch.equal(packed.cpu(), exp_packed)


FILL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]
FILL_VALUES = [0.5, -1.0, -1, 1e10, float("nan"), float("inf"), -0.0, True, 300, 2**62 + 1, 1e300, -0.7]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", FILL_DTYPES, ids=str)
@pytest.mark.parametrize("feat", [(), (8,), (3,)], ids=str)
def test_padding_value_is_torchs_cast(backend, dtype, feat):
    _needs_backend(backend)
    lengths = [2, 0, 3]
    width = 5
    values = _random((sum(lengths), *feat), dtype, torch.Generator(device="cuda").manual_seed(14))
    rt = ragged.RaggedTensor.from_lengths(values, lengths)
    pad = torch.tensor([[j >= n for j in range(width)] for n in lengths], device="cuda")
    for value in FILL_VALUES:
        try:
            want = torch.full((), value, dtype=dtype)
        except (RuntimeError, OverflowError):
            with pytest.raises(ValueError, match=r"ragged\.unpack\(\): expected padding_value representable"):
                rt.to_padded(padding_value=value, total_length=width, backend=backend)
            continue
        got = rt.to_padded(padding_value=value, total_length=width, backend=backend)
        fill = got[pad].reshape(-1).view(torch.uint8).view(-1, want.element_size()).cpu()
        assert torch.equal(fill, want.reshape(1).view(torch.uint8).expand(fill.shape[0], -1)), value
        assert torch.equal(got[~pad], values), value


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_mask_value_check_adds_no_sync(backend):
    """An HF mask's 0/1 check rides on the one read of the mask."""
    _needs_backend(backend)
    lengths = [3, 0, 5]
    x = torch.randn(3, 5, 4, device="cuda")
    good = torch.tensor([[j < n for j in range(5)] for n in lengths], device="cuda")
    with pytest.raises(ValueError, match=r"ragged\.pack\(\): expected attention_mask values"):
        ragged.pack(x, attention_mask=torch.where(good, 2, 0), backend=backend)
    with pytest.raises(TypeError, match=r"use attention_mask="):
        ragged.pack(x, mask=good.long(), backend=backend)

    def syncs(mask):
        ragged.pack(x, attention_mask=mask, backend=backend)  # warm up (kernels compiled)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                rt = ragged.pack(x, attention_mask=mask, backend=backend)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert rt.host_lengths() == lengths
        return sum("synchroniz" in str(w.message) for w in caught)

    bool_syncs = syncs(good)
    assert bool_syncs >= 1
    assert syncs(good.long()) == bool_syncs
    assert syncs(good.float()) == bool_syncs
