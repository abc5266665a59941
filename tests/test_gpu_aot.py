"""ragged._C on the GPU: every kernel loads, and the CUDA kernels give bitwise the same results
through the ahead-of-time binary as through NVRTC (the same sources). Needs a GPU, ragged._C and
CuPy (skipped otherwise)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import ragged
from ragged.kernels.cuda import launch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or importlib.util.find_spec("ragged._C") is None:
    pytest.skip("needs CUDA and ragged._C", allow_module_level=True)


@pytest.fixture
def path(monkeypatch):
    """``path(mode)``: kernels loaded anew through ``mode`` ("aot" or "jit") from here on."""

    def use(mode: str) -> None:
        monkeypatch.setenv(launch.LAUNCH_VARIABLE, mode)
        monkeypatch.setattr(launch, "_paths", {})
        monkeypatch.setattr(launch, "_functions", {})

    yield use


def test_every_kernel_loads_through_the_binary(path):
    from ragged import _C

    path("aot")
    assert ragged.build_info()["launch"] == "aot"
    index = torch.cuda.current_device()
    assert all(_C.function(name, index) for name in _C.kernels())


def _outputs(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        lengths = [5, 0, 17, 1, 33]
        x = torch.randn(len(lengths), 40, 96, device="cuda", dtype=dtype, generator=g)
        rt = ragged.pack(x, lengths=lengths, backend="cuda")
        out += [rt.values, ragged.unpack(rt, backend="cuda")]
        h = torch.randn(70, 768, device="cuda", dtype=dtype, generator=g)
        b = torch.randn(768, device="cuda", dtype=dtype, generator=g)
        w = torch.randn(768, device="cuda", dtype=dtype, generator=g)
        out += [ragged.bias_act(h, b, "gelu", backend="cuda"), ragged.add_layer_norm(h, h, w, b, backend="cuda")]
        if dtype != torch.float32:
            q = ragged.pack([torch.randn(n, 4, 64, device="cuda", dtype=dtype, generator=g) for n in (9, 1, 31, 0, 64)])
            out.append(ragged.attention(q, q, q, backend="cuda").values)
            out.append(ragged.attention(q, q, q, causal=True, backend="cuda").values)
    return out


def test_binary_and_nvrtc_give_bitwise_the_same_results(path):
    pytest.importorskip("cupy")
    path("jit")
    jit = _outputs(0)
    path("aot")
    aot = _outputs(0)
    assert len(jit) == len(aot)
    for i, (a, b) in enumerate(zip(jit, aot)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a, b.view(torch.uint8)), i


@pytest.mark.parametrize("mode", ["aot", "jit"])
def test_explain_names_the_launch_path_of_a_cuda_call(path, mode):
    if mode == "jit":
        pytest.importorskip("cupy")
    path(mode)
    x = torch.randn(3, 9, 16, device="cuda")
    why = ragged.explain(ragged.pack, x, lengths=[9, 0, 4])
    assert why["cuda"] == [] and why.chosen == "cuda" and why.launch == mode
    assert ragged.build_info()["launch"] == mode
    with ragged.use_backend("triton"):
        why = ragged.explain(ragged.pack, x, lengths=[9, 0, 4])
    assert why.chosen == "triton" and why.launch is None
