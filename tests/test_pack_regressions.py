"""Regressions of pack / unpack and the RaggedTensor constructors, on CPU (Triton through
the interpreter where it runs here).

* strided offsets / lengths / cu_seqlens: stored contiguous, read right by every backend;
* a padded width smaller than a sequence (or negative): one ValueError on every backend;
* the padding value: torch's cast of it to the dtype on every backend (bool included);
* masks: an HF mask holds only 0/1 whatever its dtype; an integer ``mask=`` is refused;
* numpy ints wherever an int is taken; meta-device lengths; ``to_nested`` says nothing.

Expected outputs come from per-sequence Python loops and from ``torch.full``, never from
ragged itself.
"""

import logging
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from conftest import TRITON_ON_CPU, cpu_backends

import ragged
from ragged import RaggedTensor
from ragged.records.pack import PackArgs, UnpackArgs

BACKENDS = cpu_backends() + ["auto"]
LENGTH_CASES = [[5, 0, 1, 7], [1], [0], [3, 0, 0, 9, 1], []]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _strided(host, dtype, garbage=99):
    """``host`` as a tensor view of stride 2 (every other entry of a buffer holding garbage)."""
    buf = torch.full((2 * len(host),), garbage, dtype=dtype)
    buf[::2] = torch.tensor(host, dtype=dtype)
    view = buf[::2]
    assert view.stride() == (2,)  # one entry (B = 0) still counts as contiguous: its stride is what kernels see
    return view


def _loop_unpack(values, lengths, width, fill=0.0, side="right"):
    out = torch.full((len(lengths), width, *values.shape[1:]), fill, dtype=values.dtype)
    t = 0
    for b, n in enumerate(lengths):
        start = 0 if side == "right" else width - n
        out[b, start : start + n] = values[t : t + n]
        t += n
    return out


def _loop_pack(x, lengths, side="right"):
    width = x.shape[1]
    rows = [x[b, :n] if side == "right" else x[b, width - n :] for b, n in enumerate(lengths)]
    return torch.cat(rows) if rows else x.new_empty((0, *x.shape[2:]))


# --------------------------------------------------------------------------------------
# 1. Strided offsets


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths", LENGTH_CASES, ids=str)
@pytest.mark.parametrize("odtype", [torch.int32, torch.int64])
def test_from_offsets_strided_offsets(backend, lengths, odtype):
    values = torch.randn(sum(lengths), 3, generator=_gen(len(lengths)))
    offsets = _strided(_offsets(lengths), odtype)
    rt = RaggedTensor.from_offsets(values, offsets)
    assert rt.offsets.is_contiguous() and rt.offsets.tolist() == _offsets(lengths)
    width = max(lengths, default=0) + 2
    for side in ("right", "left"):
        got = rt.to_padded(padding_value=-2.5, total_length=width, padding_side=side, backend=backend)
        assert torch.equal(got, _loop_unpack(values, lengths, width, -2.5, side))
    # validate=False with max_len: stored contiguous too (no read of the values needed).
    fast = RaggedTensor.from_offsets(values, offsets, max(lengths, default=0), validate=False)
    assert fast.offsets.is_contiguous()
    assert torch.equal(fast.to_padded(backend=backend), _loop_unpack(values, lengths, max(lengths, default=0)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths", LENGTH_CASES, ids=str)
@pytest.mark.parametrize("side", ["right", "left"])
def test_pack_values_unpack_values_strided_offsets(backend, lengths, side):
    width = max(lengths, default=0) + 1
    x = torch.randn(len(lengths), width, 2, generator=_gen(7))
    offsets = _strided(_offsets(lengths), torch.int32)
    got = ragged.pack_values(x, offsets, sum(lengths), padding_side=side, backend=backend)
    assert torch.equal(got, _loop_pack(x, lengths, side))
    back = ragged.unpack_values(got, offsets, width, padding_value=0.25, padding_side=side, backend=backend)
    assert torch.equal(back, _loop_unpack(got, lengths, width, 0.25, side))


@pytest.mark.skipif(not TRITON_ON_CPU, reason="Triton runs on CPU tensors only under the interpreter")
@pytest.mark.parametrize("left", [False, True])
def test_triton_launchers_take_strided_offsets(left):
    """The launchers themselves make offsets contiguous, whoever calls them."""
    from ragged.kernels.triton import pack as kernels

    lengths = [2, 0, 5, 1]
    width = 6
    x = torch.randn(len(lengths), width, 3, generator=_gen(8))
    offsets = _strided(_offsets(lengths), torch.int64)
    side = "left" if left else "right"
    values = kernels.pack(PackArgs(x, offsets, sum(lengths), left)).values
    assert torch.equal(values, _loop_pack(x, lengths, side))
    out = kernels.unpack(UnpackArgs(values, offsets, width, 1.5, left)).padded
    assert torch.equal(out, _loop_unpack(values, lengths, width, 1.5, side))


@pytest.mark.parametrize("backend", cpu_backends())
def test_the_ops_take_and_return_records(backend):
    """pack and unpack: one operand record each, an output record, and each other's gradient."""
    from ragged.packing import PACK, UNPACK
    from ragged.records.pack import PackOutput, UnpackOutput

    lengths, width = [2, 0, 4], 5
    x = torch.randn(len(lengths), width, 3, generator=_gen(21), requires_grad=True)
    offsets = torch.tensor(_offsets(lengths))
    packed = PACK(PackArgs(padded=x, offsets=offsets, total=6, left=True), backend)
    assert isinstance(packed, PackOutput)
    assert torch.equal(packed.values, _loop_pack(x.detach(), lengths, "left"))
    padded = UNPACK(
        UnpackArgs(values=packed.values, offsets=offsets, width=width, padding_value=0.0, left=True), backend
    )
    assert isinstance(padded, UnpackOutput)
    (grad,) = torch.autograd.grad(padded.padded.sum(), x)
    assert torch.equal(grad, _loop_unpack(torch.ones(6, 3), lengths, width, 0.0, "left"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_from_cu_seqlens_and_from_lengths_strided(backend):
    lengths = [4, 0, 1, 6]
    values = torch.randn(sum(lengths), 2, generator=_gen(9))
    rt = ragged.from_cu_seqlens(values, _strided(_offsets(lengths), torch.int32), max(lengths), validate=False)
    assert rt.offsets.is_contiguous()
    assert torch.equal(rt.to_padded(backend=backend), _loop_unpack(values, lengths, 6))
    rt = RaggedTensor.from_lengths(values, _strided(lengths, torch.int64))
    assert rt.host_lengths() == lengths and rt.offsets.is_contiguous()
    assert torch.equal(rt.to_padded(backend=backend), _loop_unpack(values, lengths, 6))
    x = torch.randn(4, 7, 2, generator=_gen(10))
    rt = ragged.pack(x, lengths=_strided(lengths, torch.int32), backend=backend)
    assert torch.equal(rt.values, _loop_pack(x, lengths))


# --------------------------------------------------------------------------------------
# 2. A padded width smaller than a sequence, or negative


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_unpack_values_width_below_a_length_raises(backend, side):
    lengths = [2, 5, 0, 1]
    values = torch.randn(8, 3, generator=_gen(11))
    offsets = torch.tensor(_offsets(lengths), dtype=torch.int32)
    for width in (4, 0):
        with pytest.raises(
            ValueError,
            match=r"ragged\.unpack_values\(\): expected every length <= width "
            rf"\({width}\), got a length of 5",
        ):
            ragged.unpack_values(values, offsets, width, padding_side=side, backend=backend)
    # The longest sequence exactly fills the width: fine.
    assert torch.equal(
        ragged.unpack_values(values, offsets, 5, padding_side=side, backend=backend),
        _loop_unpack(values, lengths, 5, 0.0, side),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_unpack_values_width_negative_or_not_an_int(backend):
    values = torch.randn(3, 2)
    offsets = torch.tensor([0, 3], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"ragged\.unpack_values\(\): expected width >= 0, got -1"):
        ragged.unpack_values(values, offsets, -1, backend=backend)
    for bad in (3.0, "3", None, True):
        with pytest.raises(TypeError, match=r"ragged\.unpack_values\(\): expected width to be an int"):
            ragged.unpack_values(values, offsets, bad, backend=backend)
    got = ragged.unpack_values(values, offsets, np.int64(4), backend=backend)
    assert torch.equal(got, _loop_unpack(values, [3], 4))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_to_padded_max_len_below_a_length_raises(backend, side):
    """max_len trusted by validate=False: checked against the host lengths, no device read."""
    lengths = [2, 3, 0]
    values = torch.randn(5, 2, generator=_gen(12))
    rt = RaggedTensor.from_lengths(values, lengths, max_len=2, validate=False)
    with pytest.raises(
        ValueError,
        match=r"ragged\.unpack\(\): expected max_len >= the longest sequence \(3\), "
        r"got 2",
    ):
        rt.to_padded(padding_side=side, backend=backend)
    with pytest.raises(ValueError, match=r"ragged\.unpack\(\).*total_length.*\(3\).*got 2"):
        rt.to_padded(total_length=2, padding_side=side, backend=backend)
    assert torch.equal(
        rt.to_padded(total_length=3, padding_side=side, backend=backend), _loop_unpack(values, lengths, 3, 0.0, side)
    )
    # No host offsets: CPU offsets are read (free) to check the width.
    rt = RaggedTensor.from_offsets(values, torch.tensor(_offsets(lengths), dtype=torch.int32), 2, validate=False)
    assert rt._host_offsets is None
    with pytest.raises(
        ValueError,
        match=r"ragged\.unpack\(\): expected every length <= max_len \(2\), "
        r"got a length of 3",
    ):
        rt.to_padded(padding_side=side, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_values_checks_cpu_offsets(backend):
    x = torch.randn(2, 3, 2, generator=_gen(13))
    with pytest.raises(
        ValueError,
        match=r"ragged\.pack_values\(\): expected every length <= the padded width "
        r"padded\.shape\[1\] \(3\), got a length of 4",
    ):
        ragged.pack_values(x, torch.tensor([0, 1, 5], dtype=torch.int32), 5, backend=backend)
    with pytest.raises(ValueError, match=r"ragged\.pack_values\(\): expected offsets\[-1\] == total \(3\), got 4"):
        ragged.pack_values(x, torch.tensor([0, 1, 4], dtype=torch.int32), 3, backend=backend)
    with pytest.raises(ValueError, match=r"ragged\.pack_values\(\): expected offsets\[0\] == 0, got 1"):
        ragged.pack_values(x, torch.tensor([1, 2, 4], dtype=torch.int32), 4, backend=backend)
    with pytest.raises(ValueError, match=r"ragged\.pack_values\(\): expected non-decreasing offsets"):
        ragged.pack_values(x, torch.tensor([0, 3, 2], dtype=torch.int32), 2, backend=backend)
    with pytest.raises(ValueError, match=r"ragged\.pack_values\(\): expected total >= 0, got -1"):
        ragged.pack_values(x, torch.tensor([0, 0, 0], dtype=torch.int32), -1, backend=backend)
    with pytest.raises(TypeError, match=r"ragged\.pack_values\(\): expected total to be an int, got 4\.0"):
        ragged.pack_values(x, torch.tensor([0, 1, 4], dtype=torch.int32), 4.0, backend=backend)
    got = ragged.pack_values(x, torch.tensor([0, 1, 4], dtype=torch.int64), np.int32(4), backend=backend)
    assert torch.equal(got, _loop_pack(x, [1, 3]))


# --------------------------------------------------------------------------------------
# 3. The padding value: torch's cast, on every backend

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
FILL_VALUES = [
    0.5,
    -1.0,
    -1,
    1e10,
    float("nan"),
    float("inf"),
    float("-inf"),
    -0.0,
    0.0,
    True,
    300,
    2**40 + 1,
    1e300,
    -0.7,
    np.float32(2.5),
    np.int64(-3),
]


def _torch_cast(value, dtype):
    """torch's element for ``value`` in ``dtype``, or None where torch refuses the cast."""
    try:
        return torch.full((), value.item() if isinstance(value, np.generic) else value, dtype=dtype)
    except (RuntimeError, OverflowError):
        return None


def _random_of(dtype, n, seed):
    g = _gen(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n, 2), generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(0, 100, (n, 2), generator=g).to(dtype)
    return torch.randn(n, 2, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FILL_DTYPES, ids=str)
def test_padding_value_is_torchs_cast(backend, dtype):
    lengths = [2, 0, 3]
    width = 4
    values = _random_of(dtype, sum(lengths), seed=14)
    rt = RaggedTensor.from_lengths(values, lengths)
    pad = torch.tensor([[j >= n for j in range(width)] for n in lengths])
    for value in FILL_VALUES:
        want = _torch_cast(value, dtype)
        for side in ("right", "left"):
            side_pad = pad if side == "right" else pad.flip(1)
            if want is None:
                with pytest.raises(
                    ValueError, match=r"ragged\.unpack\(\): expected padding_value representable in " + str(dtype)
                ):
                    rt.to_padded(padding_value=value, total_length=width, padding_side=side, backend=backend)
                with pytest.raises(ValueError, match=r"ragged\.unpack_values\(\): expected padding_value"):
                    ragged.unpack_values(values, rt.offsets, width, padding_value=value, backend=backend)
                continue
            got = rt.to_padded(padding_value=value, total_length=width, padding_side=side, backend=backend)
            # Bit patterns: NaN and -0.0 compare as they are.
            fill = got[side_pad].reshape(-1).view(torch.uint8).view(-1, want.element_size())
            assert fill.shape[0] == int(side_pad.sum()) * 2
            assert torch.equal(fill, want.reshape(1).view(torch.uint8).expand(fill.shape[0], -1)), (value, side)
            assert torch.equal(got[~side_pad], values), (value, side)


def test_padding_value_not_a_number():
    rt = RaggedTensor.from_lengths(torch.randn(3, 2), [1, 2])
    for bad in ("0", None, [0.0], torch.zeros(2)):
        with pytest.raises(TypeError, match=r"ragged\.unpack\(\): expected padding_value to be a number"):
            rt.to_padded(padding_value=bad)
    assert torch.equal(rt.to_padded(padding_value=torch.tensor(2.0)), rt.to_padded(padding_value=2.0))


@pytest.mark.parametrize("dtype", FILL_DTYPES, ids=str)
def test_kernel_fill_patterns_are_torchs_cast(dtype):
    """The bits the Triton and CUDA launchers hand their kernels, checked without running them."""
    from ragged.kernels.cuda import pack as kp

    for value in FILL_VALUES:
        want = _torch_cast(value, dtype)
        if want is None:
            with pytest.raises(ValueError, match=r"padding_value"):
                kp._fill_words(value, dtype)
            continue
        words = np.array(kp._fill_words(value, dtype), dtype=np.uint32)
        raw = torch.from_numpy(words.view(np.uint8).copy())
        assert torch.equal(raw, want.reshape(1).view(torch.uint8).repeat(16 // want.element_size())), value
        if TRITON_ON_CPU:
            from ragged.kernels.triton.pack import _fill_bits

            bits, _ = _fill_bits(value, dtype)
            int_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
            assert bits == want.reshape(1).view(int_dtype).item(), value


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_padding_value_stays_exact(backend):
    """Beyond 2**53 a float would round: the value reaches the kernels as an int."""
    values = torch.arange(3, dtype=torch.int64)
    rt = RaggedTensor.from_lengths(values, [1, 2])
    fill = 2**62 + 1
    got = rt.to_padded(padding_value=fill, total_length=3, backend=backend)
    assert got[0, 1].item() == fill and got[1, 2].item() == fill


# --------------------------------------------------------------------------------------
# 4. Masks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.float32, torch.float16])
@pytest.mark.parametrize("bad", [[[1, 2, 0]], [[1, -1, 0]], [[1, 1, 3]]], ids=str)
def test_attention_mask_other_values_raise(backend, dtype, bad):
    x = torch.randn(1, 3, 2)
    m = torch.tensor(bad).to(dtype)
    with pytest.raises(
        ValueError,
        match=r"ragged\.pack\(\): expected attention_mask values to be 0 \(padding\) "
        r"or 1 \(token\)",
    ):
        ragged.pack(x, attention_mask=m, backend=backend)
    with pytest.raises(ValueError, match=r"ragged\.from_attention_mask\(\): expected attention_mask values"):
        ragged.from_attention_mask(x, m, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float32])
def test_attention_mask_zero_one_any_dtype(backend, dtype):
    lengths = [3, 0, 1]
    x = torch.randn(3, 4, 2, generator=_gen(15))
    m = torch.tensor([[j < n for j in range(4)] for n in lengths]).to(dtype)
    for call in (
        lambda: ragged.pack(x, attention_mask=m, backend=backend),
        lambda: ragged.from_attention_mask(x, m, backend=backend),
    ):
        rt = call()
        assert rt.host_lengths() == lengths
        assert torch.equal(rt.values, _loop_pack(x, lengths))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int8])
def test_integer_key_padding_mask_is_refused(dtype):
    x = torch.randn(2, 3, 2)
    m = torch.tensor([[1, 1, 0], [1, 0, 0]]).to(dtype)
    with pytest.raises(
        TypeError, match=r"ragged\.pack\(\): expected mask of dtype bool .*got " + str(dtype) + r".*use attention_mask="
    ):
        ragged.pack(x, mask=m)


def test_mask_layout_is_read_once(monkeypatch):
    """The 0/1 check shares the one read of the mask (read_mask_layout)."""
    import ragged.interop as pack_ops

    calls = []
    original = pack_ops.read_mask_layout

    def counting(*args):
        calls.append(args)
        return original(*args)

    reads = []
    tolist = torch.Tensor.tolist

    def counting_tolist(self):
        reads.append(self.shape)
        return tolist(self)

    monkeypatch.setattr(pack_ops, "read_mask_layout", counting)
    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    x = torch.randn(2, 3, 2)
    ragged.pack(x, attention_mask=torch.tensor([[1, 1, 0], [1, 0, 0]]), backend="torch")
    assert len(calls) == 1 and calls[0][1] is not None and len(reads) == 1


# --------------------------------------------------------------------------------------
# 5. numpy ints; meta lengths


def test_numpy_ints_wherever_an_int_is_taken():
    lengths = [2, 3]
    values = torch.randn(5, 2, generator=_gen(16))
    rt = RaggedTensor.from_lengths(values, lengths, max_len=np.int64(4))
    assert rt.max_len == 4 and type(rt.max_len) is int
    assert torch.equal(rt.to_padded(total_length=np.int64(5)), _loop_unpack(values, lengths, 5))
    assert torch.equal(ragged.unpack(rt, total_length=np.int32(5)), _loop_unpack(values, lengths, 5))
    assert rt.padding_mask(total_length=np.int16(6)).shape == (2, 6)
    assert rt.attention_mask(total_length=np.int64(6)).shape == (2, 6)
    offsets = torch.tensor(_offsets(lengths), dtype=torch.int32)
    assert RaggedTensor.from_offsets(values, offsets, np.int64(3)).max_len == 3
    assert ragged.from_cu_seqlens(values, offsets, np.int32(3), validate=False).max_len == 3
    with pytest.raises(TypeError, match=r"ragged\.unpack\(\): expected total_length to be an int, got 5\.0"):
        rt.to_padded(total_length=5.0)
    with pytest.raises(TypeError, match=r"ragged\.RaggedTensor\.from_lengths\(\): expected max_len to be an int"):
        RaggedTensor.from_lengths(values, lengths, max_len=4.5)
    with pytest.raises(TypeError, match=r"ragged\.from_cu_seqlens\(\): expected max_seqlen to be an int"):
        ragged.from_cu_seqlens(values, offsets, 3.0)


def test_meta_lengths_raise_naming_the_function():
    from ragged.utils import host_lengths_of

    lengths = torch.tensor([2, 3], device="meta")
    with pytest.raises(ValueError, match=r"ragged\.RaggedTensor\.from_lengths\(\): expected lengths .*meta"):
        RaggedTensor.from_lengths(torch.randn(5, 2), lengths)
    with pytest.raises(ValueError, match=r"ragged\.pack\(\): expected lengths .*meta"):
        ragged.pack(torch.randn(2, 3, 2), lengths=lengths)
    with pytest.raises(ValueError, match=r"my_fn\(\): expected lengths .*meta"):
        host_lengths_of("my_fn", lengths)
    values = torch.empty(5, 2, device="meta")
    offsets = torch.empty(3, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"ragged\.RaggedTensor\.from_offsets\(\): expected offsets .*meta"):
        RaggedTensor.from_offsets(values, offsets)
    rt = RaggedTensor.from_offsets(values, offsets, 3, validate=False)  # nothing to read: fine
    with pytest.raises(ValueError, match=r"host_offsets\(\): expected offsets .*meta"):
        rt.host_offsets()


# --------------------------------------------------------------------------------------
# 6. to_nested prints nothing


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_to_nested_emits_no_fx_tracing_notice():
    import torch.fx._symbolic_trace as fx_trace

    # The notice is issued once per process (an lru_cache): start afresh.
    notice = getattr(fx_trace, "is_fx_tracing_warning", None)
    if notice is not None and hasattr(notice, "cache_clear"):
        notice.cache_clear()
    handler = _Records()
    logger = logging.getLogger(fx_trace.__name__)
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rt = ragged.pack([torch.randn(n, 3, generator=_gen(n)) for n in (2, 0, 5)])
            nt = rt.to_nested()
    finally:
        logger.removeHandler(handler)
    said = [str(w.message) for w in caught] + handler.messages
    assert not [m for m in said if "is_fx_tracing" in m], said
    assert [t.shape[0] for t in nt.unbind()] == [2, 0, 5]
    # Scoped to the call: the logger carries no leftover filter.
    assert not logger.filters


def test_to_nested_prints_nothing_in_a_fresh_process():
    script = (
        "import warnings; warnings.simplefilter('always'); import torch, ragged; "
        "rt = ragged.pack([torch.randn(2, 3), torch.randn(4, 3)]); nt = rt.to_nested(); "
        "print(tuple(t.shape[0] for t in nt.unbind()))"
    )
    done = subprocess.run([sys.executable, "-W", "always", "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(2, 4)"
    assert "is_fx_tracing" not in done.stderr, done.stderr
