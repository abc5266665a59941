"""The ahead-of-time build ragged._C (RAGGED_BUILD_CUDA=1), on any machine: it imports without a GPU,
holds every kernel the NVRTC path's parser reads from csrc/, and the launch path is chosen and
forced as documented. The GPU half (bitwise equal to NVRTC) is tests/test_gpu_aot.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import ragged
from ragged.kernels.cuda import launch

HAVE_C = importlib.util.find_spec("ragged._C") is not None
SOURCES = ("attention_short.cu", "fused.cu", "pack.cu")


@pytest.mark.skipif(not HAVE_C, reason="ragged._C is not built (RAGGED_BUILD_CUDA=1 pip install .)")
def test_binary_holds_every_kernel_of_the_sources():
    from ragged import _C

    parsed = set()
    for src in SOURCES:
        parsed |= set(launch.programs(src))
    assert parsed and set(_C.kernels()) == parsed
    archs = _C.archs()
    assert archs and all(isinstance(a, int) and a >= 70 for a in archs) and _C.ptx_arch == max(archs)
    assert _C.cuda_runtime_version >= 11000 and _C.nvcc_version
    with pytest.raises(KeyError, match="no kernel named ragged_nope"):
        _C.function("ragged_nope", 0)
    info = ragged.build_info()
    assert info["aot_present"] and info["aot_archs"] == archs


@pytest.mark.skipif(not HAVE_C or torch.cuda.is_available(), reason="needs ragged._C and no GPU")
def test_function_without_a_gpu_raises_a_clear_error():
    from ragged import _C

    with pytest.raises(RuntimeError, match="ragged._C: cudaGetDevice"):
        _C.function(next(iter(launch.programs("pack.cu"))), 0)


def test_launch_variable_is_checked(monkeypatch):
    monkeypatch.setattr(launch, "_paths", {})
    monkeypatch.setenv(launch.LAUNCH_VARIABLE, "sometimes")
    with pytest.raises(ValueError, match="expected RAGGED_CUDA_LAUNCH to be aot, jit or auto, got 'sometimes'"):
        launch.launch_path(0)


def test_forced_aot_without_the_binary_says_why(monkeypatch):
    monkeypatch.setattr(launch, "_paths", {})
    monkeypatch.setattr(launch, "_aot_state", [(None, "ragged._C is not built (test)")])
    monkeypatch.setenv(launch.LAUNCH_VARIABLE, "aot")
    with pytest.raises(RuntimeError, match=r"RAGGED_CUDA_LAUNCH=aot, but ragged._C is not built \(test\)"):
        launch.launch_path(0)
    monkeypatch.setenv(launch.LAUNCH_VARIABLE, "jit")
    monkeypatch.setattr(launch, "_paths", {})
    assert launch.launch_path(0) == "jit"


def test_build_info_keys():
    info = ragged.build_info()
    assert set(info) == {
        "launch",
        "aot_present",
        "aot_archs",
        "aot_ptx",
        "aot_nvcc",
        "aot_cuda_runtime",
        "aot_reason",
        "cupy",
        "RAGGED_CUDA_LAUNCH",
    }
    assert info["aot_present"] == HAVE_C
    if not torch.cuda.is_available():
        assert info["launch"] is None


def test_launch_paths_bench_says_it_needs_a_gpu(capsys):
    from bench import launch_paths

    if torch.cuda.is_available():
        pytest.skip("runs on the GPU (bench.launch_paths)")
    assert launch_paths.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert set(launch_paths.MODES) == {"aot", "jit driver", "jit cupy"}
