"""The CUDA fused kernels (csrc/fused.cu) from the host side, without a GPU: what they decline
and why, the launch configuration, the arguments handed to the kernel, and that every kernel
name the launcher can produce is an entry point of the source. GPU runs are in
test_gpu_fused.py."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

import ragged
from ragged import backends
from ragged.kernels.cuda import launch as kc, pack as kp
from ragged.kernels.cuda import fused as cf
from ragged.ops import fused as ops_fused

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
VEC = {torch.bfloat16: 8, torch.float16: 8, torch.float32: 4}


def _only_device_reason(reasons):
    assert len(reasons) == 1 and "CUDA tensor" in reasons[0], reasons


# --------------------------------------------------------------------------------------
# Reasons


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_supported_input_is_declined_only_for_being_on_the_cpu(dtype):
    x = torch.randn(5, 768).to(dtype)
    r, w, b = torch.randn_like(x), torch.randn(768).to(dtype), torch.randn(768).to(dtype)
    _only_device_reason(cf.add_layer_norm_reasons(x, r, w, b))
    _only_device_reason(cf.add_layer_norm_reasons(x, None, None, None))
    for activation in ops_fused.ACTIVATIONS:
        _only_device_reason(cf.bias_act_reasons(x, b, activation))
        _only_device_reason(cf.bias_act_reasons(x, None, activation))


def test_dtypes():
    x64 = torch.randn(4, 64, dtype=torch.float64)
    assert any("got x of dtype torch.float64" in r for r in cf.add_layer_norm_reasons(x64, None, None, None))
    assert any("got x of dtype torch.float64" in r for r in cf.bias_act_reasons(x64, None, "gelu"))
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    reasons = cf.add_layer_norm_reasons(x, torch.randn(4, 64), torch.randn(64), torch.randn(64, dtype=torch.float16))
    for name, got in (("residual", "float32"), ("weight", "float32"), ("bias", "float16")):
        assert any(f"{name} of x's dtype torch.bfloat16, got torch.{got}" in r for r in reasons), reasons
    assert any("bias of x's dtype" in r for r in cf.bias_act_reasons(x, torch.randn(64), "relu"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_feature_counts(dtype):
    vec, limit = VEC[dtype], cf.max_layer_norm_features(dtype)
    assert limit == {8: 4096, 4: 2048}[vec]
    for n_cols in (vec, 768, 1024, limit):
        _only_device_reason(cf.add_layer_norm_reasons(torch.zeros(2, n_cols, dtype=dtype), None, None, None))
    odd = torch.zeros(2, 768 + vec // 2, dtype=dtype)
    assert any(f"multiple of {vec}" in r for r in cf.add_layer_norm_reasons(odd, None, None, None))
    assert any(f"multiple of {vec}" in r for r in cf.bias_act_reasons(odd, None, "gelu"))
    wide = torch.zeros(2, limit + vec, dtype=dtype)
    assert any(f"at most {limit} features" in r for r in cf.add_layer_norm_reasons(wide, None, None, None))
    _only_device_reason(cf.bias_act_reasons(wide, None, "gelu"))  # bias_act takes any width


def test_alignment_and_strides():
    buf = torch.zeros(6, 1024, dtype=torch.bfloat16)
    assert buf.data_ptr() % 16 == 0
    shifted = buf[:, 1:769]          # base 2 bytes past a 16-byte boundary
    reasons = cf.add_layer_norm_reasons(shifted, None, None, None)
    assert any("x 16-byte aligned" in r and "2 bytes" in r for r in reasons), reasons
    odd_rows = torch.zeros(6, 772, dtype=torch.bfloat16)[:, :768]   # 1544-byte rows
    reasons = cf.add_layer_norm_reasons(odd_rows, None, None, None)
    assert any("row strides to be multiples of 16 bytes, got 1544" in r for r in reasons), reasons
    strided_rows = buf[:, :768]      # 2048-byte rows: fine
    _only_device_reason(cf.add_layer_norm_reasons(strided_rows, buf[:, 256:], None, None))
    reasons = cf.add_layer_norm_reasons(strided_rows, buf[:, 1:769], None, None)
    assert any("residual 16-byte aligned" in r for r in reasons), reasons
    w = torch.zeros(2 * 768, dtype=torch.bfloat16)
    reasons = cf.add_layer_norm_reasons(strided_rows, None, w[::2], w[1:769])
    assert any("weight with unit stride" in r for r in reasons) and any("bias 16-byte" in r for r in reasons)
    # a single row has no row stride to check
    _only_device_reason(cf.add_layer_norm_reasons(odd_rows[:1], None, None, None))
    # bias_act wants x contiguous (its kernel walks x as one run of vectors)
    reasons = cf.bias_act_reasons(strided_rows, None, "gelu")
    assert any("contiguous x" in r for r in reasons), reasons
    reasons = cf.bias_act_reasons(buf.view(-1)[1:1 + 6 * 768].view(6, 768), w[1:769], "gelu")
    assert any("x 16-byte aligned" in r for r in reasons) and any("bias 16-byte" in r for r in reasons)


def test_fake_tensors_skip_the_pointer_checks():
    """Under torch.compile the reasons see fake tensors: no data pointer to read, no error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.zeros(6, 1024, dtype=torch.bfloat16))[:, 1:769]
        reasons = cf.add_layer_norm_reasons(x, None, None, None)
        reasons_ba = cf.bias_act_reasons(x.contiguous(), None, "gelu")
    _only_device_reason(reasons)
    _only_device_reason(reasons_ba)


def _cases():
    """(x, residual, weight, bias) for the layer norm; bias_act takes (x, bias)."""
    buf = torch.zeros(6, 1040, dtype=torch.bfloat16)
    x = buf[:, :768]
    p = torch.zeros(2 * 1032, dtype=torch.bfloat16)
    yield x, None, None, None
    yield x, buf[:, 256:1024], p[:768], p[1024:1792]
    yield x.contiguous(), None, p[:768], None
    yield buf[:, 1:769], None, None, None                     # misaligned base
    yield torch.zeros(6, 772, dtype=torch.bfloat16)[:, :768], None, None, None   # misaligned rows
    yield torch.zeros(1, 772, dtype=torch.bfloat16)[:, :768], None, None, None   # one row: fine
    yield x, buf[:, 1:769], None, None
    yield x, x.float(), None, None
    yield x, None, p[1:769], None
    yield x, None, p[::2][:768], None                          # strided weight
    yield x, None, None, p[:768].float()
    yield torch.zeros(3, 772, dtype=torch.bfloat16), None, None, None   # F not a multiple of 8
    yield torch.zeros(3, 4104, dtype=torch.bfloat16), None, None, None  # F past the widest row
    yield torch.zeros(3, 4096, dtype=torch.bfloat16), None, None, None
    yield torch.zeros(3, 2052), None, None, None
    yield torch.zeros(3, 2048), None, None, None
    yield torch.zeros(3, 768, dtype=torch.float64), None, None, None


def test_the_fast_check_agrees_with_the_full_list(monkeypatch):
    """The reasons answer the common case from a short check (*_takes) and build the list of
    messages only otherwise: both must agree. The device is taken as usable here."""
    monkeypatch.setattr(cf, "_on_usable_cuda", lambda device: True)
    monkeypatch.setattr(cf.backends, "cuda_reason", lambda device: None)
    n_takes = 0
    for x, r, w, b in _cases():
        takes = cf._layer_norm_takes(x, r, w, b)
        assert takes == (cf._layer_norm_reasons(x, r, w, b) == []), (x.shape, x.stride(), x.dtype)
        assert cf.add_layer_norm_reasons(x, r, w, b) == cf._layer_norm_reasons(x, r, w, b)
        for bias in (w, b):
            for activation in ("gelu", "swish"):
                takes_ba = cf._bias_act_takes(x, bias, activation)
                assert takes_ba == (cf._bias_act_reasons(x, bias, activation) == []), (x.shape, x.stride())
        n_takes += takes
    assert n_takes == 6


def test_the_op_reports_the_cuda_reasons_and_auto_takes_torch_on_cpu():
    x = torch.randn(3, 768, dtype=torch.bfloat16)
    ln = ragged.explain("add_layer_norm", x, None, None, None)
    ba = ragged.explain("bias_act", x, None, "gelu")
    assert set(ln) == set(ba) == {"torch", "triton", "cuda"}
    assert "CUDA tensor" in ln["cuda"][0] and "CUDA tensor" in ba["cuda"][0]
    x64 = x.double()
    assert any("triton add_layer_norm takes" in r for r in ragged.explain("add_layer_norm", x64, None, None,
                                                                         None)["cuda"])
    with pytest.raises(ValueError, match=r"ragged\.add_layer_norm\(\): backend 'cuda' cannot take this input: "
                                         r"the CUDA kernels need a CUDA tensor"):
        ragged.add_layer_norm(x, None, None, None, backend="cuda")
    with pytest.raises(ValueError, match=r"ragged\.bias_act\(\): backend 'cuda' cannot take this input: "
                                         r"the CUDA kernels need a CUDA tensor"):
        ragged.bias_act(x, None, "gelu", backend="cuda")
    assert backends.select("add_layer_norm", None, x.device, x, None, None, None).name == "torch"
    assert backends._OPS["add_layer_norm"].gpu_order == ("cuda", "triton", "torch")
    assert backends._OPS["bias_act"].gpu_order == ("cuda", "triton", "torch")


def test_the_backward_of_the_cuda_backend_is_the_triton_one():
    for op in ("add_layer_norm", "bias_act"):
        impls = backends._OPS[op].impls
        assert impls["cuda"].fn[1] is impls["triton"].fn[1]


# --------------------------------------------------------------------------------------
# Launch configuration and arguments (the kernel launch itself replaced by a recorder)


@pytest.mark.parametrize("dtype,n_cols,iters", [
    (torch.bfloat16, 8, 1), (torch.bfloat16, 256, 1), (torch.bfloat16, 264, 2), (torch.bfloat16, 768, 3),
    (torch.bfloat16, 1024, 4), (torch.float16, 1032, 6), (torch.bfloat16, 2056, 12), (torch.bfloat16, 4096, 16),
    (torch.float32, 768, 6), (torch.float32, 1024, 8), (torch.float32, 2048, 16),
])
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
        self.calls.append({"src": src, "kernel": kernel, "grid": grid, "block": block,
                           "args": [a.item() for a in params.scalars(args)]})


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
    x = buf[:, :768]                           # strided rows
    r = torch.zeros(7, 768, dtype=torch.bfloat16)
    w = torch.zeros(768, dtype=torch.bfloat16)
    y, s, mean, rstd = cf.add_layer_norm_forward(x, r, w, None, 1e-5, return_sum, stats=stats)
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
    y, s = cf.add_layer_norm_inference(x, r, w, b, 1e-6, return_sum)
    assert y.shape == (5, 768) and y.dtype == torch.bfloat16 and y.is_contiguous()
    assert (s is not None) == return_sum and (s is None or (s.shape == (5, 768) and s.is_contiguous()))
    (call,) = recorder.calls
    assert call["kernel"] == "ragged_add_layer_norm_bf16_i3" and call["grid"] == 2
    px, pr, pw, pb, py, ps, pmean, prstd, n_rows, n_cols, stride_x, stride_r, eps = call["args"]
    assert (px, pr, pw, pb, py) == (x.data_ptr(), r.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr())
    assert ps == (s.data_ptr() if return_sum else 0) and (pmean, prstd) == (0, 0)
    assert (n_rows, n_cols, stride_x, stride_r) == (5, 768, 768, 768) and eps == pytest.approx(1e-6)
    recorder.calls.clear()
    cf.add_layer_norm_inference(x, None, None, None, 1e-5, False)
    assert recorder.calls[0]["args"][1:4] == [0, 0, 0]


def test_layer_norm_empty_and_misaligned(recorder, monkeypatch):
    y, s, mean, rstd = cf.add_layer_norm_forward(torch.zeros(0, 768), None, None, None, 1e-5, True)
    assert y.shape == s.shape == (0, 768) and mean.shape == rstd.shape == (0,) and not recorder.calls
    # Only reachable when the reasons could not look at the pointers (torch.compile): the
    # Triton kernel takes it.
    monkeypatch.setattr(cf, "_triton_add_layer_norm", lambda *args: "triton")
    x = torch.zeros(4, 1024, dtype=torch.float16)[:, 4:772]
    assert cf.add_layer_norm_forward(x, None, None, None, 1e-5, False) == "triton"
    assert not recorder.calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "none"])
def test_bias_act_arguments(recorder, dtype, activation):
    x = torch.zeros(3, 768, dtype=dtype)
    b = torch.zeros(768, dtype=dtype)
    y = cf.bias_act_forward(x, b, activation)
    assert y.shape == (3, 768) and y.dtype == dtype
    (call,) = recorder.calls
    vec = VEC[dtype]
    assert call["kernel"] == f"ragged_bias_act_{cf._TYPES[dtype][0]}_{activation}"
    assert call["args"] == [x.data_ptr(), b.data_ptr(), y.data_ptr(), 3 * 768 // vec, 768 // vec]
    assert call["grid"] == 1 and call["block"] == (cf.BA_THREADS, 1)
    recorder.calls.clear()
    cf.bias_act_forward(x, None, activation)
    assert recorder.calls[0]["args"][1] == 0


@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_launchers_hand_unit_stride_layouts_they_cannot_read_to_triton(recorder, layout):
    """A direct call with a strided or expanded parameter (16-byte aligned, so the pointer check
    passes): the CUDA kernels read parameters as ``ptr + i``, so the Triton launcher takes it
    (under the interpreter here) and gives the right result; nothing is launched."""
    if backends.triton_reason(torch.device("cpu")):
        pytest.skip("the Triton interpreter is off")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 768, generator=gen)
    if layout == "strided":
        w, b = torch.randn(2 * 768, generator=gen)[::2], torch.randn(3 * 768, generator=gen)[::3]
    else:
        w, b = torch.tensor([1.5]).expand(768), torch.tensor([0.25]).expand(768)
    assert w.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    y, _, mean, rstd = cf.add_layer_norm_forward(x, x, w, b, 1e-5, False)
    ref = torch.nn.functional.layer_norm(2 * x.double(), (768,), w.double(), b.double())
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    assert mean.shape == rstd.shape == (3,)
    torch.testing.assert_close(cf.bias_act_forward(x, b, "none"), x + b)
    xt = torch.randn(768, 3, generator=gen).t()   # features not contiguous
    torch.testing.assert_close(cf.add_layer_norm_forward(xt, None, None, None, 1e-5, False)[0],
                               torch.nn.functional.layer_norm(xt, (768,)), atol=1e-5, rtol=1e-5)
    assert not recorder.calls


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
    subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(tmp_path / "fused.cu"), "-o", str(obj)],
                   check=True, capture_output=True, timeout=600)
    if shutil.which("nm") is None:
        return
    symbols = subprocess.run(["nm", str(obj)], check=True, capture_output=True, text=True).stdout
    exported = set(re.findall(r" T (ragged_\w+)$", symbols, re.MULTILINE))
    assert exported == _entry_points(src)
