"""The "cuda" backend of bias_act and add_layer_norm on the GPU (``pytest -m gpu``): the CUDA C++
forward (csrc/fused.cu) against the oracle and against Triton within one ulp, odd and strided
inputs, optional statistics, no sync, auto's choice, int64 offsets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ragged
from ragged import backends
from ragged.records.fused import AddLayerNormArgs, BiasActArgs

pytestmark = pytest.mark.gpu
from gpu_fused_cases import (
    ACTIVATIONS,
    CUDA_LN_VARIANTS,
    DTYPES,
    N_ROWS,
    _check_add_layer_norm,
    _check_bias_act,
    _gen,
    _needs_cuda_kernels,
    _randn,
)

# --------------------------------------------------------------------------------------
# The "cuda" backend: CUDA C++ forward (csrc/fused.cu), Triton backward


def _cuda_fused():
    from ragged.kernels.cuda import fused as cuda_fused

    return cuda_fused


def _triton_fused():
    from ragged.kernels.triton import fused

    return fused


def _assert_within_one_ulp(what: str, out: torch.Tensor, other: torch.Tensor, dtype: torch.dtype):
    """``out`` within one ulp (of ``dtype``, at ``other``'s magnitude) of ``other``, plus some
    float32 roundings: the two kernels sum a row in different orders (a row mean differs by up to
    about 4e-7 at F = 4096, times rstd * |weight|) and take tanh / rsqrt from different formulas,
    so their fp32 values may differ in the last few bits before the final rounding. For 16-bit
    outputs that slack is far below an ulp."""
    assert out.shape == other.shape and out.dtype == other.dtype, what
    a, b = out.double(), other.double()
    mag = b.abs().clamp_min(torch.finfo(dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(mag))) * torch.finfo(dtype).eps
    tol = ulp + 32 * torch.finfo(torch.float32).eps * b.abs().clamp_min(1.0)
    excess = ((a - b).abs() - tol).max().item()
    assert excess <= 0, f"{what}: {excess:.3g} past one ulp of {dtype} (max diff {(a - b).abs().max().item():.3g})"


def _forward_only(backend, fn, *args, **kwargs):
    with torch.no_grad():
        return fn(*args, **kwargs, backend=backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_cols", [768, 1024, 3072])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no_bias"])
def test_cuda_bias_act_accuracy(dtype, n_cols, activation, has_bias):
    """The error rule against float64 (forward CUDA, gradients from the Triton backward), and y
    within one ulp of the Triton kernel's."""
    _needs_cuda_kernels()
    x, b, y = _check_bias_act("cuda", dtype, N_ROWS, n_cols, activation, has_bias)
    assert ragged.explain("bias_act", x.detach(), None if b is None else b.detach(), activation)["cuda"] == []
    y_triton = _forward_only("triton", ragged.bias_act, x.detach(), None if b is None else b.detach(), activation)
    _assert_within_one_ulp(f"y vs triton, {activation}", y.detach(), y_triton, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_cols", [768, 1024, 4096])
@pytest.mark.parametrize("variant", list(CUDA_LN_VARIANTS))
def test_cuda_add_layer_norm_accuracy(dtype, n_cols, variant):
    """The error rule against float64 (forward CUDA, gradients from the Triton backward); y within
    one ulp of the Triton kernel's, s bit-identical, mean / rstd to float32 rounding."""
    _needs_cuda_kernels()
    if n_cols > _cuda_fused().max_layer_norm_features(dtype):  # float32 past 2048 features: Triton's
        x = torch.zeros((4, n_cols), dtype=dtype, device="cuda")
        reasons = ragged.explain("add_layer_norm", x, x, None, None)["cuda"]
        assert any(f"at most {_cuda_fused().max_layer_norm_features(dtype)} features" in r for r in reasons), reasons
        assert backends.select("add_layer_norm", None, x.device, x, x, None, None).name == "triton"
        return
    (x, r, w, b), y, s = _check_add_layer_norm("cuda", dtype, N_ROWS, n_cols, variant)
    inputs = [None if t is None else t.detach() for t in (x, r, w, b)]
    assert ragged.explain("add_layer_norm", *inputs)["cuda"] == []
    return_sum = s is not None
    out = _forward_only("triton", ragged.add_layer_norm, *inputs, return_sum=return_sum)
    y_triton, s_triton = out if return_sum else (out, None)
    _assert_within_one_ulp(f"y vs triton, {variant}", y.detach(), y_triton, dtype)
    if return_sum:
        assert torch.equal(s.detach(), s_triton)
    x2, r2, w2, b2 = inputs
    ours = _cuda_fused().add_layer_norm_forward(AddLayerNormArgs(x2, r2, w2, b2, 1e-5))
    theirs = _triton_fused().add_layer_norm_forward(AddLayerNormArgs(x2, r2, w2, b2, 1e-5))
    torch.testing.assert_close(ours[2], theirs[2], rtol=1e-6, atol=1e-6)  # mean
    torch.testing.assert_close(ours[3], theirs[3], rtol=1e-5, atol=0)  # rstd


def _nan_padded(n_rows, n_cols, dtype, gen, pad=64, shift=0.0):
    """An [n_rows, n_cols] view with row stride n_cols + pad whose padding columns are NaN:
    a kernel that reads past a row poisons its output."""
    buf = torch.full((n_rows, n_cols + pad), float("nan"), dtype=dtype, device="cuda")
    buf[:, :n_cols] = _randn((n_rows, n_cols), dtype, gen, shift)
    return buf[:, :n_cols]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_rows", [1, 7, 20001])
@pytest.mark.parametrize("n_cols", [768, 1024])
def test_cuda_odd_rows_and_strided_inputs(dtype, n_rows, n_cols):
    """Row counts that leave warps of the last block idle, strided x / residual rows with NaN in
    the gaps: the CUDA forward equals the Triton one (within one ulp; the sum bit for bit)."""
    _needs_cuda_kernels()
    gen = _gen("cuda_odd", str(dtype), n_rows, n_cols)
    x = _nan_padded(n_rows, n_cols, dtype, gen, shift=1.0)
    r = _nan_padded(n_rows, n_cols, dtype, gen, pad=32)
    w = 1 + 0.5 * _randn((n_cols,), dtype, gen)
    b = _randn((n_cols,), dtype, gen)
    assert ragged.explain("add_layer_norm", x, r, w, b)["cuda"] == []
    y, s = _forward_only("cuda", ragged.add_layer_norm, x, r, w, b, return_sum=True)
    y_t, s_t = _forward_only("triton", ragged.add_layer_norm, x, r, w, b, return_sum=True)
    assert torch.isfinite(y).all() and torch.equal(s, s_t)
    _assert_within_one_ulp("y", y, y_t, dtype)
    xc = x.contiguous()
    for activation in ACTIVATIONS:
        h = _forward_only("cuda", ragged.bias_act, xc, b, activation)
        _assert_within_one_ulp(
            f"bias_act {activation}", h, _forward_only("triton", ragged.bias_act, xc, b, activation), dtype
        )
    if n_rows == 1:
        return
    # strided x goes to Triton for bias_act (the CUDA kernel walks x as one contiguous run)
    assert any("contiguous x" in m for m in ragged.explain("bias_act", x, b, "gelu")["cuda"])
    assert backends.select("bias_act", None, x.device, x, b, "gelu").name == "triton"


def test_cuda_inference_statistics_are_optional():
    _needs_cuda_kernels()
    gen = _gen("cuda_stats")
    x = _randn((3000, 768), torch.bfloat16, gen)
    r = _randn((3000, 768), torch.bfloat16, gen)
    y, s, mean, rstd = _cuda_fused().add_layer_norm_forward(AddLayerNormArgs(x, r, None, None, 1e-5, True))
    y2, s2, mean2, rstd2 = _cuda_fused().add_layer_norm_forward(
        AddLayerNormArgs(x, r, None, None, 1e-5, True), stats=False
    )
    assert torch.equal(y, y2) and torch.equal(s, s2)
    assert mean.shape == rstd.shape == (3000,) and mean2.numel() == rstd2.numel() == 0
    y3, s3, _, _ = _cuda_fused().add_layer_norm_forward(AddLayerNormArgs(x, r, None, None, 1e-5))
    assert torch.equal(y3, y) and s3.shape == (0,)


def test_cuda_misaligned_inputs_go_to_triton():
    _needs_cuda_kernels()
    gen = _gen("cuda_misaligned")
    buf = _randn((64, 776), torch.float16, gen)
    x = buf[:, 1:769]  # 2 bytes past a 16-byte boundary
    reasons = ragged.explain("add_layer_norm", x, None, None, None)["cuda"]
    assert any("16-byte aligned" in r for r in reasons), reasons
    assert backends.select("add_layer_norm", None, x.device, x, None, None, None).name == "triton"
    with pytest.raises(ValueError, match=r"backend 'cuda' cannot take this input: .*16-byte aligned"):
        ragged.add_layer_norm(x, None, None, None, backend="cuda")
    xb = buf.view(-1)[1 : 1 + 64 * 768].view(64, 768)
    assert any("x 16-byte aligned" in r for r in ragged.explain("bias_act", xb, None, "gelu")["cuda"])
    assert backends.select("bias_act", None, x.device, xb, None, "gelu").name == "triton"
    # the launchers themselves (reached with fake tensors under torch.compile, where the reasons
    # see no pointers) read an aligned copy: the results of an aligned input
    y = _cuda_fused().add_layer_norm_forward(AddLayerNormArgs(x, None, None, None, 1e-5)).out
    assert torch.equal(y, _cuda_fused().add_layer_norm_forward(AddLayerNormArgs(x.clone(), None, None, None, 1e-5)).out)
    h = _cuda_fused().bias_act_forward(BiasActArgs(xb, None, "gelu")).out
    assert torch.equal(h, _cuda_fused().bias_act_forward(BiasActArgs(xb.clone(), None, "gelu")).out)


def test_cuda_no_host_sync():
    _needs_cuda_kernels()
    gen = _gen("cuda_sync")
    x = _randn((3000, 768), torch.bfloat16, gen).requires_grad_(True)
    stream = _randn((3000, 768), torch.bfloat16, gen).requires_grad_(True)
    w = _randn((768,), torch.bfloat16, gen).requires_grad_(True)
    b = _randn((768,), torch.bfloat16, gen).requires_grad_(True)

    def step():
        h = ragged.bias_act(x, b, "gelu", backend="cuda")
        y, s = ragged.add_layer_norm(h, stream, w, b, return_sum=True, backend="cuda")
        z = ragged.add_layer_norm(y, None, None, None, backend="cuda")
        (z.float().square().sum() + s.float().sum()).backward()
        with torch.no_grad():
            _cuda_fused().add_layer_norm_forward(AddLayerNormArgs(y, None, w, b, 1e-5), stats=False)

    step()  # warm up: compile the kernels (NVRTC and Triton)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(w.grad.float()).all() and torch.isfinite(x.grad.float()).all()


def test_auto_takes_cuda():
    _needs_cuda_kernels()
    x = torch.randn(N_ROWS, 768, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, device="cuda", dtype=torch.bfloat16)
    assert backends.select("bias_act", None, x.device, x, w, "gelu").name == "cuda"
    assert backends.select("add_layer_norm", None, x.device, x, x, w, w).name == "cuda"
    assert backends.select("add_layer_norm", None, x.device, x, None, None, None).name == "cuda"
    # what it declines: float32 parameters with bfloat16 activations, F not a multiple of 8
    assert backends.select("add_layer_norm", None, x.device, x, x, w.float(), None).name == "triton"
    x770 = torch.randn(16, 770, device="cuda", dtype=torch.bfloat16)
    assert backends.select("bias_act", None, x.device, x770, None, "relu").name == "triton"


@pytest.mark.slow
def test_cuda_int64_offsets():
    """N * F past 2**31 elements: the last rows of the CUDA forward must still be right."""
    _needs_cuda_kernels()
    free, _ = torch.cuda.mem_get_info()
    n_cols = 768
    n_rows = 2**31 // n_cols + 4096
    if free < 4 * n_rows * n_cols * 2:
        pytest.skip("needs about 18 GB of free GPU memory")
    x = torch.empty((n_rows, n_cols), dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.randn(n_cols, device="cuda", dtype=torch.bfloat16)
    tail = slice(n_rows - 2048, n_rows)
    with torch.no_grad():
        y = ragged.bias_act(x, b, "gelu", backend="cuda")
        torch.testing.assert_close(y[tail], ragged.bias_act(x[tail], b, "gelu", backend="torch"))
        del y
        y = ragged.add_layer_norm(x, None, b, b, backend="cuda")
        torch.testing.assert_close(y[tail], ragged.add_layer_norm(x[tail], None, b, b, backend="torch"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_gelu_against_torch(dtype):
    """The CUDA bias_act's gelu over a dense grid of z (both tails, zero, signed zeros, inf, NaN)
    against torch's own (fp32 erf, rounded to ``dtype``): within one ulp plus the fp32 noise of
    ``1 + erf`` (about |z| * 6e-8 absolute, which both formulas carry in the negative tail). bf16
    (a rational erf) equals torch's for all but a small fraction of |z| <= 4 (about 2e-3 of this
    uniform grid, where the negative half's fp32 noise weighs more; about 4e-5 of normally
    distributed z); fp16 and fp32 take erff, torch's formula."""
    _needs_cuda_kernels()
    z = torch.linspace(-12.0, 12.0, 8 * 200_001, dtype=torch.float64)
    z = torch.cat(
        [z, torch.tensor([0.0, -0.0, 1e-30, -1e-30, float("inf"), 2.5, float("nan"), -0.75], dtype=torch.float64)]
    )
    x = z.to(dtype).view(-1, 8).to("cuda")
    with torch.no_grad():
        y = ragged.bias_act(x, None, "gelu", backend="cuda").view(-1).double()
        ref = F.gelu(x.view(-1).float()).to(dtype).double()
    zz = x.view(-1).double()
    assert torch.equal(torch.isnan(y), torch.isnan(ref)), "NaN where torch has none, or the other way"
    finite = torch.isfinite(ref)
    assert torch.equal(y[~finite & ~torch.isnan(ref)], ref[~finite & ~torch.isnan(ref)])
    a, b, zf = y[finite], ref[finite], zz[finite]
    mag = b.abs().clamp_min(torch.finfo(dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(mag))) * torch.finfo(dtype).eps
    excess = ((a - b).abs() - ulp - 2e-7 * zf.abs()).max().item()
    assert excess <= 0, f"{excess:.3g} past one ulp (max diff {(a - b).abs().max().item():.3g})"
    core = zf.abs() <= 4
    mismatched = (a[core] != b[core]).double().mean().item()
    assert mismatched <= 5e-3, f"{mismatched:.2e} of outputs differ from torch's"
    normal = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)).to("cuda", dtype).view(-1, 8)
    with torch.no_grad():
        got = ragged.bias_act(normal, None, "gelu", backend="cuda")
    normal_mismatched = (got != F.gelu(normal.float()).to(dtype)).double().mean().item()
    assert normal_mismatched <= 5e-4, f"{normal_mismatched:.2e} of N(0, 1) outputs differ from torch's"
