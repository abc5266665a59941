"""The fused attention backward (``triton_fused_bwd``: dK, dV and dQ from one key-block kernel,
dQ added atomically in float32) on the GPU: flash-attn's error rule against the float64
reference for every gradient, zero-length, one-token, cross and long sequences, GQA, both head
dims, fp16 and bf16, causal and not, after each forward it is paired with (the portable one,
the sm_90 TMA one, the warp-specialised one), with dQ added by element atomics or (the
``_tma`` pairs, sm_90) by TMA bulk reduce-adds; deterministic mode takes the split kernels."""

from __future__ import annotations

import types

import pytest
import torch

from ragged import backends

pytestmark = pytest.mark.gpu

from gpu_attention_cases import LENGTHS as CASES  # noqa: E402
from gpu_attention_cases import _check_backward, _gen, _needs, _qkv  # noqa: E402

LENGTHS = {
    "self": CASES["self"],
    "cross": CASES["cross"],
    "long_tail": ([4000, 3, 1, 129, 0, 700], [4000, 3, 1, 129, 0, 700]),
}


PAIRS = [
    "triton_fused_bwd",
    "triton_sm90_fused_bwd",
    "triton_sm90_ws_fused_bwd",
    "triton_fused_bwd_tma",
    "triton_sm90_fused_bwd_tma",
]


class _LaunchSpy:
    """The dK/dV kernel, each launch's ``FUSED_DQ`` recorded (0: the split backward's)."""

    def __init__(self, kernel, modes: list) -> None:
        self.kernel, self.modes = kernel, modes

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **meta):
            self.modes.append(meta.get("FUSED_DQ", 0))
            return launch(*args, **meta)

        return run


@pytest.fixture(params=PAIRS)
def fused(monkeypatch, request):
    """The fused backward's calls (the query shape of each) and the dK/dV kernel's launches (the
    ``FUSED_DQ`` of each), with ``request.param`` preferred; ``.tma``: dQ by TMA."""
    _needs("triton")
    if ("sm90" in request.param or "tma" in request.param) and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm_90 forwards and the TMA reduce-add of dQ run on sm_90 only")
    from ragged.kernels.triton import attention as launcher

    seen = types.SimpleNamespace(calls=[], modes=[], tma=request.param.endswith("_tma"))
    real = launcher._backward_fused
    monkeypatch.setattr(launcher, "_backward_fused", lambda *a: seen.calls.append(a[1].shape) or real(*a))
    monkeypatch.setattr(launcher, "_bwd_dkdv_kernel", _LaunchSpy(launcher._bwd_dkdv_kernel, seen.modes))
    with backends.prefer("attention", request.param):
        yield seen


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim", [64, 128])
def test_fused_backward_accuracy(dim, dtype, causal, fused):
    for name, (lq, lk) in LENGTHS.items():
        q, k, v = _qkv(lq, lk, 4, 2, dim, dtype, _gen("fused-bwd", dim, dtype, causal, name))
        before, launched = len(fused.calls), len(fused.modes)
        _check_backward(lq, lk, q, k, v, causal, f"fused-bwd/{name}/D={dim}/{dtype}/causal={causal}", backend="auto")
        assert len(fused.calls) == before + 1, f"{name}: the fused backward did not run"
        # one launch of the key-block kernel, adding dQ the way the implementation says
        assert fused.modes[launched:] == [2 if fused.tma else 1], f"{name}: {fused.modes[launched:]}"


def test_deterministic_mode_takes_the_split_kernels(fused):
    lq, lk = LENGTHS["self"]
    q, k, v = _qkv(lq, lk, 4, 2, 64, torch.bfloat16, _gen("fused-det"))
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _check_backward(lq, lk, q, k, v, True, "fused-det", backend="auto")
    finally:
        torch.use_deterministic_algorithms(False)
    assert not fused.calls and 1 not in fused.modes and 2 not in fused.modes
