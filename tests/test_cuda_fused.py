"""The CUDA fused kernels (csrc/fused.cu) from the host side, without a GPU: what they decline
and why, the launch configuration, the arguments handed to the kernel, and that every kernel
name the launcher can produce is an entry point of the source. GPU runs are in
test_gpu_fused.py."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess

import pytest
import torch

import ragged
from ragged import backends
from ragged.kernels.cuda import fused as cf
from ragged.kernels.cuda import launch as kc
from ragged.ops import fused as ops_fused
from ragged.records.fused import AddLayerNormArgs, BiasActArgs

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
VEC = {torch.bfloat16: 8, torch.float16: 8, torch.float32: 4}
SPECS = {"add_layer_norm": ops_fused.add_layer_norm_spec, "bias_act": ops_fused.bias_act_spec}


@pytest.fixture
def gpu_like():
    """The CUDA backend's device reason lifted: the implementation's own reasons (declared dtypes
    and its check) answer for CPU tensors given a CUDA device (no GPU needed)."""
    backends.register_backend("cuda", lambda device: None)
    try:
        yield
    finally:
        backends.register_backend("cuda", backends.cuda_reason)


def _spec(op, *operands):
    return dataclasses.replace(SPECS[op](*operands), device=torch.device("cuda"))


def _reasons(op, *operands):
    """The reasons of the "cuda" implementation of ``op`` for these operands, on a GPU."""
    return backends.implementation(op, "cuda").reasons(_spec(op, *operands))


def _ln(*operands):
    return _reasons("add_layer_norm", *operands)


def _ba(*operands):
    return _reasons("bias_act", *operands)


def _has(reasons, text):
    assert any(text in r for r in reasons), reasons


# --------------------------------------------------------------------------------------
# Reasons


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_supported_input_is_declined_only_for_being_on_the_cpu(dtype, gpu_like):
    x = torch.randn(5, 768).to(dtype)
    r, w, b = torch.randn_like(x), torch.randn(768).to(dtype), torch.randn(768).to(dtype)
    assert _ln(x, r, w, b) == [] and _ln(x, None, None, None) == []
    for activation in ops_fused.ACTIVATIONS:
        assert _ba(x, b, activation) == [] and _ba(x, None, activation) == []
    backends.register_backend("cuda", backends.cuda_reason)
    for op, operands in (("add_layer_norm", (x, r, w, b)), ("bias_act", (x, b, "gelu"))):
        reasons = ragged.explain(op, *operands)["cuda"]
        assert len(reasons) == 1 and "CUDA tensor" in reasons[0], reasons


def test_dtypes(gpu_like):
    x64 = torch.randn(4, 64, dtype=torch.float64)
    _has(_ln(x64, None, None, None), "cuda add_layer_norm takes float16, bfloat16 and float32, got torch.float64")
    _has(_ba(x64, None, "gelu"), "cuda bias_act takes float16, bfloat16 and float32, got torch.float64")
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    reasons = _ln(x, torch.randn(4, 64), torch.randn(64), torch.randn(64, dtype=torch.float16))
    for name, got in (("residual", "float32"), ("weight", "float32"), ("bias", "float16")):
        _has(reasons, f"{name} of x's dtype torch.bfloat16, got torch.{got}")
    _has(_ba(x, torch.randn(64), "relu"), "bias of x's dtype")
    _has(_ba(x, None, "swish"), "takes activations")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_feature_counts(dtype, gpu_like):
    vec, limit = VEC[dtype], cf.max_layer_norm_features(dtype)
    assert limit == {8: 4096, 4: 2048}[vec]
    for n_cols in (vec, 768, 1024, limit):
        assert _ln(torch.zeros(2, n_cols, dtype=dtype), None, None, None) == []
    odd = torch.zeros(2, 768 + vec // 2, dtype=dtype)
    _has(_ln(odd, None, None, None), f"multiple of {vec}")
    _has(_ba(odd, None, "gelu"), f"multiple of {vec}")
    wide = torch.zeros(2, limit + vec, dtype=dtype)
    _has(_ln(wide, None, None, None), f"at most {limit} features")
    assert _ba(wide, None, "gelu") == []  # bias_act takes any width


def test_row_count(gpu_like):
    spec = dataclasses.replace(
        _spec("add_layer_norm", torch.zeros(2, 8, dtype=torch.bfloat16), None, None, None),
        rows=(2**31 - 1) * cf.LN_ROWS_PER_BLOCK + 1,
    )
    _has(backends.implementation("add_layer_norm", "cuda").reasons(spec), "rows")
    assert not backends.implementation("add_layer_norm", "cuda").reasons(
        dataclasses.replace(spec, rows=(2**31 - 1) * cf.LN_ROWS_PER_BLOCK)
    )


def test_alignment_and_strides(gpu_like):
    buf = torch.zeros(6, 1024, dtype=torch.bfloat16)
    assert buf.data_ptr() % 16 == 0
    shifted = buf[:, 1:769]  # base 2 bytes past a 16-byte boundary
    reasons = _ln(shifted, None, None, None)
    assert any("x 16-byte aligned" in r and "2 bytes" in r for r in reasons), reasons
    odd_rows = torch.zeros(6, 772, dtype=torch.bfloat16)[:, :768]  # 1544-byte rows
    _has(_ln(odd_rows, None, None, None), "row strides to be multiples of 16 bytes, got 1544")
    strided_rows = buf[:, :768]  # 2048-byte rows: fine
    assert _ln(strided_rows, buf[:, 256:], None, None) == []
    _has(_ln(strided_rows, buf[:, 1:769], None, None), "residual 16-byte aligned")
    w = torch.zeros(2 * 768, dtype=torch.bfloat16)
    reasons = _ln(strided_rows, None, w[::2], w[1:769])
    _has(reasons, "weight with unit stride along the features, got stride 2")
    _has(reasons, "bias 16-byte")
    _has(_ln(buf.t()[:768], None, None, None), "x with unit stride along the features, got stride 1024")
    # a single row has no row stride to check
    assert _ln(odd_rows[:1], None, None, None) == []
    # bias_act wants x contiguous (its kernel walks x as one run of vectors)
    _has(_ba(strided_rows, None, "gelu"), "contiguous x")
    reasons = _ba(buf.view(-1)[1 : 1 + 6 * 768].view(6, 768), w[1:769], "gelu")
    _has(reasons, "x 16-byte aligned")
    _has(reasons, "bias 16-byte")
    _has(_ba(strided_rows.contiguous(), w[::2], "gelu"), "bias with unit stride")


def test_fake_tensors_skip_the_pointer_checks(gpu_like):
    """Under torch.compile the spec is built from fake tensors: no data pointer to read, no
    error, no address reason (the launcher copies a misaligned tensor it is handed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.zeros(6, 1024, dtype=torch.bfloat16))[:, 1:769]
        spec_ln = _spec("add_layer_norm", x, None, None, None)
        spec_ba = _spec("bias_act", x.contiguous(), None, "gelu")
    assert spec_ln.layout == spec_ba.layout == ()
    assert backends.implementation("add_layer_norm", "cuda").reasons(spec_ln) == []
    assert backends.implementation("bias_act", "cuda").reasons(spec_ba) == []


def _cases():
    """(x, residual, weight, bias) for the layer norm; bias_act takes (x, bias)."""
    buf = torch.zeros(6, 1040, dtype=torch.bfloat16)
    x = buf[:, :768]
    p = torch.zeros(2 * 1032, dtype=torch.bfloat16)
    yield x, None, None, None
    yield x, buf[:, 256:1024], p[:768], p[1024:1792]
    yield x.contiguous(), None, p[:768], None
    yield buf[:, 1:769], None, None, None  # misaligned base
    yield torch.zeros(6, 772, dtype=torch.bfloat16)[:, :768], None, None, None  # misaligned rows
    yield torch.zeros(1, 772, dtype=torch.bfloat16)[:, :768], None, None, None  # one row: fine
    yield x, buf[:, 1:769], None, None
    yield x, x.float(), None, None
    yield x, None, p[1:769], None
    yield x, None, p[::2][:768], None  # strided weight
    yield x, None, None, p[:768].float()
    yield buf.t()[:768], None, None, None  # features strided
    yield torch.zeros(3, 772, dtype=torch.bfloat16), None, None, None  # F not a multiple of 8
    yield torch.zeros(3, 4104, dtype=torch.bfloat16), None, None, None  # F past the widest row
    yield torch.zeros(3, 4096, dtype=torch.bfloat16), None, None, None
    yield torch.zeros(3, 2052), None, None, None
    yield torch.zeros(3, 2048), None, None, None
    yield torch.zeros(3, 768, dtype=torch.float64), None, None, None


def test_the_fast_layout_check_agrees_with_the_full_walk(gpu_like):
    """The specs answer the common case (every tensor read in place) from a few integer reads
    and walk the tensors only otherwise: both must give the same layout faults."""
    n_takes = 0
    for x, r, w, b in _cases():
        named = (("x", x), ("residual", r), ("weight", w), ("bias", b))
        assert ops_fused.add_layer_norm_spec(x, r, w, b).layout == ops_fused._layout(named, True), (x.shape, x.stride())
        for bias in (w, b):
            full = ((("x", "address", x.data_ptr() % 16),) if x.data_ptr() % 16 else ()) + ops_fused._layout(
                (("bias", bias),), True
            )
            assert ops_fused.bias_act_spec(x, bias, "gelu").layout == full, (x.shape, x.stride())
        n_takes += _ln(x, r, w, b) == []
    assert n_takes == 6


def test_the_op_reports_the_cuda_reasons_and_auto_takes_torch_on_cpu():
    x = torch.randn(3, 768, dtype=torch.bfloat16)
    ln = ragged.explain("add_layer_norm", x, None, None, None)
    ba = ragged.explain("bias_act", x, None, "gelu")
    assert set(ln) == set(ba) == {"torch", "triton", "cuda"}
    assert "CUDA tensor" in ln["cuda"][0] and "CUDA tensor" in ba["cuda"][0]
    _has(
        ragged.explain("add_layer_norm", x.double(), None, None, None)["cuda"],
        "cuda add_layer_norm takes float16, bfloat16 and float32, got torch.float64",
    )
    with pytest.raises(
        ValueError,
        match=r"ragged\.add_layer_norm\(\): backend 'cuda' cannot take this input: "
        r"the CUDA kernels need a CUDA tensor",
    ):
        ragged.add_layer_norm(x, None, None, None, backend="cuda")
    with pytest.raises(
        ValueError,
        match=r"ragged\.bias_act\(\): backend 'cuda' cannot take this input: "
        r"the CUDA kernels need a CUDA tensor",
    ):
        ragged.bias_act(x, None, "gelu", backend="cuda")
    assert backends.select("add_layer_norm", None, x.device, x, None, None, None).name == "torch"


def test_auto_prefers_cuda_then_triton_then_torch_on_cuda_tensors(gpu_like):
    """ "auto" on CUDA tensors: the CUDA forward where it takes the input, else Triton, else torch."""
    backends.register_backend("triton", lambda device: None)
    try:
        x = torch.zeros(4, 768, dtype=torch.bfloat16)
        for op, operands in (("add_layer_norm", (x, x, x[0], None)), ("bias_act", (x, x[0], "gelu"))):
            assert backends.select_spec(op, "auto", _spec(op, *operands)).backend == "cuda"
        odd = torch.zeros(4, 770, dtype=torch.bfloat16)
        for op, operands in (("add_layer_norm", (odd, None, None, None)), ("bias_act", (odd, None, "relu"))):
            assert backends.select_spec(op, "auto", _spec(op, *operands)).backend == "triton"
        x64 = x.double()
        for op, operands in (("add_layer_norm", (x64, None, None, None)), ("bias_act", (x64, None, "relu"))):
            assert backends.select_spec(op, "auto", _spec(op, *operands)).backend == "torch"
    finally:
        backends.register_backend("triton", backends.triton_reason)


def test_the_backward_of_the_cuda_backend_is_the_triton_one(gpu_like, monkeypatch):
    """The "cuda" implementations are forward kernels: their backward is Triton's (the same
    function), and they decline what the Triton backward cannot run (Triton missing)."""
    import ragged.kernels.cuda as kernels_cuda

    x = torch.zeros(4, 768, dtype=torch.bfloat16)
    for op, operands in (("add_layer_norm", (x, None, None, None)), ("bias_act", (x, None, "gelu"))):
        impls = {name: backends.implementation(op, name) for name in ("cuda", "triton")}
        assert impls["cuda"].backward_backend == "triton"
        assert impls["cuda"].backward_fn is impls["triton"].backward_fn
        assert _reasons(op, *operands) == []
        monkeypatch.setattr(kernels_cuda, "triton_reason", lambda device: "triton cannot be imported (test)")
        assert _reasons(op, *operands) == ["triton cannot be imported (test)"]
        monkeypatch.undo()


def test_extras():
    """The entry points the fused encoder layer looks up by name (on the implementation that
    runs the backward: a "cuda" forward's extras are its own, never Triton's)."""
    from ragged.kernels.triton import fused as tf

    ln, ba = (backends.implementation(op, "triton") for op in ("add_layer_norm", "bias_act"))
    assert ln.extra("dropout_backward") is tf.add_layer_norm_dropout_backward
    assert ln.extra("partial_groups") is tf.partial_groups
    assert ln.extra("backward_fuses") is tf.layer_norm_backward_fuses
    assert ba.extra("dropout_backward") is tf.bias_act_backward
    cuda_ln = backends.implementation("add_layer_norm", "cuda")
    assert cuda_ln.extra("inference") is cf.add_layer_norm_inference
    assert cuda_ln.extra("dropout_backward") is None and ln.extra("inference") is None
    assert backends.implementation("add_layer_norm", "torch").extra("dropout_backward") is None


# --------------------------------------------------------------------------------------
# Launch configuration and arguments (the kernel launch itself replaced by a recorder)


@pytest.mark.parametrize(
    "dtype,n_cols,iters",
    [
        (torch.bfloat16, 8, 1),
        (torch.bfloat16, 256, 1),
        (torch.bfloat16, 264, 2),
        (torch.bfloat16, 768, 3),
        (torch.bfloat16, 1024, 4),
        (torch.float16, 1032, 6),
        (torch.bfloat16, 2056, 12),
        (torch.bfloat16, 4096, 16),
        (torch.float32, 768, 6),
        (torch.float32, 1024, 8),
        (torch.float32, 2048, 16),
    ],
)
def test_layer_norm_takes_the_smallest_iters_that_covers_the_row(dtype, n_cols, iters):
    name, vec = cf.layer_norm_config(dtype, n_cols)
    assert name == f"ragged_add_layer_norm_{cf._TYPES[dtype][0]}_i{iters}" and vec == VEC[dtype]
    assert 32 * vec * iters >= n_cols
    smaller = [i for i in cf.LN_ITERS if i < iters]
    assert not smaller or 32 * vec * smaller[-1] < n_cols


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, src, kernel, device, grid, block, params, args):
        assert len(args) == len(params.codes)
        params.pack(args)  # every value fits its C type
        self.calls.append(
            {
                "src": src,
                "kernel": kernel,
                "grid": grid,
                "block": block,
                "args": [a.item() for a in params.scalars(args)],
            }
        )


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(cf, "launch", rec)
    monkeypatch.setattr(cf, "_sm_count", lambda device: 132)
    return rec


@pytest.mark.parametrize("return_sum", [False, True])
@pytest.mark.parametrize("stats", [True, False])
def test_layer_norm_arguments(recorder, return_sum, stats):
    buf = torch.zeros(7, 1024, dtype=torch.bfloat16)
    x = buf[:, :768]  # strided rows
    r = torch.zeros(7, 768, dtype=torch.bfloat16)
    w = torch.zeros(768, dtype=torch.bfloat16)
    y, s, mean, rstd = cf.add_layer_norm_forward(AddLayerNormArgs(x, r, w, None, 1e-5, return_sum), stats=stats)
    assert y.shape == (7, 768) and y.dtype == torch.bfloat16 and y.is_contiguous()
    assert s.shape == ((7, 768) if return_sum else (0,)) and s.dtype == torch.bfloat16
    assert mean.shape == rstd.shape == ((7,) if stats else (0,)) and mean.dtype == rstd.dtype == torch.float32
    (call,) = recorder.calls
    assert call["src"] == "fused.cu" and call["kernel"] == "ragged_add_layer_norm_bf16_i3"
    assert call["grid"] == 2 and call["block"] == (cf.LN_ROWS_PER_BLOCK * 32, 1)
    px, pr, pw, pb, py, ps, pmean, prstd, n_rows, n_cols, stride_x, stride_r, eps = call["args"]
    assert (px, pr, pw, pb, py) == (x.data_ptr(), r.data_ptr(), w.data_ptr(), 0, y.data_ptr())
    assert ps == (s.data_ptr() if return_sum else 0)
    assert (pmean, prstd) == ((mean.data_ptr(), rstd.data_ptr()) if stats else (0, 0))
    assert (n_rows, n_cols, stride_x, stride_r) == (7, 768, 1024, 768)
    assert eps == pytest.approx(1e-5)


@pytest.mark.parametrize("return_sum", [False, True])
def test_layer_norm_inference_arguments(recorder, return_sum):
    x, r = torch.zeros(5, 768, dtype=torch.bfloat16), torch.zeros(5, 768, dtype=torch.bfloat16)
    w, b = torch.zeros(768, dtype=torch.bfloat16), torch.zeros(768, dtype=torch.bfloat16)
    y, s = cf.add_layer_norm_inference(AddLayerNormArgs(x, r, w, b, 1e-6, return_sum))
    assert y.shape == (5, 768) and y.dtype == torch.bfloat16 and y.is_contiguous()
    assert (s is not None) == return_sum and (s is None or (s.shape == (5, 768) and s.is_contiguous()))
    (call,) = recorder.calls
    assert call["kernel"] == "ragged_add_layer_norm_bf16_i3" and call["grid"] == 2
    px, pr, pw, pb, py, ps, pmean, prstd, n_rows, n_cols, stride_x, stride_r, eps = call["args"]
    assert (px, pr, pw, pb, py) == (x.data_ptr(), r.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr())
    assert ps == (s.data_ptr() if return_sum else 0) and (pmean, prstd) == (0, 0)
    assert (n_rows, n_cols, stride_x, stride_r) == (5, 768, 768, 768) and eps == pytest.approx(1e-6)
    recorder.calls.clear()
    cf.add_layer_norm_inference(AddLayerNormArgs(x, None, None, None, 1e-5))
    assert recorder.calls[0]["args"][1:4] == [0, 0, 0]


def test_layer_norm_empty_and_misaligned(recorder):
    y, s, mean, rstd = cf.add_layer_norm_forward(AddLayerNormArgs(torch.zeros(0, 768), None, None, None, 1e-5, True))
    assert y.shape == s.shape == (0, 768) and mean.shape == rstd.shape == (0,) and not recorder.calls
    # Only reachable when the reasons could not look at the pointers (torch.compile): the
    # kernel reads an aligned copy.
    x = torch.zeros(4, 1024, dtype=torch.float16)[:, 4:772]
    cf.add_layer_norm_forward(AddLayerNormArgs(x, None, None, None, 1e-5))
    (call,) = recorder.calls
    px, *_, n_rows, n_cols, stride_x, _, _ = call["args"]
    assert px % 16 == 0 and px != x.data_ptr() and (n_rows, n_cols, stride_x) == (4, 768, 768)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "none"])
def test_bias_act_arguments(recorder, dtype, activation):
    x = torch.zeros(3, 768, dtype=dtype)
    b = torch.zeros(768, dtype=dtype)
    y = cf.bias_act_forward(BiasActArgs(x, b, activation)).out
    assert y.shape == (3, 768) and y.dtype == dtype
    (call,) = recorder.calls
    vec = VEC[dtype]
    assert call["kernel"] == f"ragged_bias_act_{cf._TYPES[dtype][0]}_{activation}"
    assert call["args"] == [x.data_ptr(), b.data_ptr(), y.data_ptr(), 3 * 768 // vec, 768 // vec]
    assert call["grid"] == 1 and call["block"] == (cf.BA_THREADS, 1)
    recorder.calls.clear()
    cf.bias_act_forward(BiasActArgs(x, None, activation))
    assert recorder.calls[0]["args"][1] == 0


@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_launchers_copy_layouts_they_cannot_read(recorder, monkeypatch, layout):
    """A direct call with a strided or expanded parameter (16-byte aligned, so the pointer check
    passes) or transposed rows: the CUDA kernels read parameters as ``ptr + i`` and rows with unit
    stride, so the launcher hands them dense copies of exactly those tensors, and nothing else."""
    copies = {}
    readable = cf._readable

    def spy(t):
        out = readable(t)
        if out is not t:
            assert torch.equal(out, t) and out.is_contiguous() and out.data_ptr() % 16 == 0
            copies[out.data_ptr()] = t
        return out

    monkeypatch.setattr(cf, "_readable", spy)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 768, generator=gen)
    if layout == "strided":
        w, b = torch.randn(2 * 768, generator=gen)[::2], torch.randn(3 * 768, generator=gen)[::3]
    else:
        w, b = torch.tensor([1.5]).expand(768), torch.tensor([0.25]).expand(768)
    assert w.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    cf.add_layer_norm_forward(AddLayerNormArgs(x, x, w, b, 1e-5))
    px, pr, pw, pb = recorder.calls[-1]["args"][:4]
    assert px == pr == x.data_ptr() and copies[pw] is w and copies[pb] is b
    cf.bias_act_forward(BiasActArgs(x, b, "none"))
    px, pb = recorder.calls[-1]["args"][:2]
    assert px == x.data_ptr() and copies[pb] is b
    xt = torch.randn(768, 3, generator=gen).t()  # features not contiguous
    cf.add_layer_norm_forward(AddLayerNormArgs(xt, None, None, None, 1e-5))
    args = recorder.calls[-1]["args"]
    assert copies[args[0]] is xt and args[10] == 768  # stride_x of the copy
    cf.bias_act_forward(BiasActArgs(xt, None, "relu"))
    assert recorder.calls[-1]["args"][0] not in (xt.data_ptr(), 0)
    assert len(recorder.calls) == 4


def test_bias_act_grid_is_capped_by_the_multiprocessors(recorder):
    per_block = cf.BA_THREADS * cf.BA_UNROLL
    assert cf.bias_act_grid(1, None) == 1
    assert cf.bias_act_grid(10 * per_block + 1, None) == 11
    assert cf.bias_act_grid(10**9, None) == cf.BA_BLOCKS_PER_SM * 132


# --------------------------------------------------------------------------------------
# The source: entry points, constants, compile check


def _entry_points(src: str) -> set[str]:
    """The extern "C" names the source's macro instantiations produce."""
    names = set()
    ln_types = re.findall(r"^\s+RAGGED_ADD_LAYER_NORM\((\w+), (\w+), ITERS\)", src, re.MULTILINE)
    for iters in re.findall(r"^RAGGED_ADD_LAYER_NORM_ITERS\((\d+)\)$", src, re.MULTILINE):
        names |= {f"ragged_add_layer_norm_{tname}_i{iters}" for _, tname in ln_types}
    ba_types = re.findall(r"^\s+RAGGED_BIAS_ACT\((\w+), (\w+), ACT(?:_BF16)?, ANAME\)", src, re.MULTILINE)
    for *_, aname in re.findall(r"^RAGGED_BIAS_ACT_TYPES\((\w+), (\w+), (\w+)\)$", src, re.MULTILINE):
        names |= {f"ragged_bias_act_{tname}_{aname}" for _, tname in ba_types}
    return names


def _launcher_names() -> set[str]:
    names = set()
    for dtype in DTYPES:
        vec = VEC[dtype]
        for n_cols in range(vec, cf.max_layer_norm_features(dtype) + 1, vec):
            names.add(cf.layer_norm_config(dtype, n_cols)[0])
        for activation in ops_fused.ACTIVATIONS:
            names.add(cf.bias_act_kernel(dtype, activation)[0])
    return names


def test_every_kernel_the_launcher_asks_for_exists_in_the_source():
    src = kc.source("fused.cu")
    declared = _entry_points(src)
    assert len(declared) == 3 * len(cf.LN_ITERS) + 3 * len(cf.ACTIVATION_NAMES)
    assert _launcher_names() == declared
    assert set(cf.ACTIVATION_NAMES) == set(ops_fused.ACTIVATIONS)
    assert f"#define RAGGED_LN_WARPS {cf.LN_ROWS_PER_BLOCK}" in src
    assert f"#define RAGGED_BA_THREADS {cf.BA_THREADS}" in src
    assert f"#define RAGGED_BA_UNROLL {cf.BA_UNROLL}" in src
    assert "#include" not in src  # NVRTC compiles it with no include path


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_the_source_compiles_for_sm90_with_the_expected_entry_points(tmp_path):
    obj = tmp_path / "fused.o"
    src = kc.source("fused.cu")
    (tmp_path / "fused.cu").write_text(src)
    subprocess.run(
        ["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(tmp_path / "fused.cu"), "-o", str(obj)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    if shutil.which("nm") is None:
        return
    symbols = subprocess.run(["nm", str(obj)], check=True, capture_output=True, text=True).stdout
    exported = set(re.findall(r" T (ragged_\w+)$", symbols, re.MULTILINE))
    assert exported == _entry_points(src)
