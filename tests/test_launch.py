"""The cached Triton launch path (ragged.kernels.triton.launch) on the GPU: it must pick a
separately compiled kernel whenever Triton would specialise differently (alignment, an
integer equal to 1 or divisible by 16), and give the normal launch's results."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
def test_cached_launch_respecialises_on_alignment_and_ints():
    from ragged.kernels.triton import fused as kf
    from ragged.kernels.triton import launch
    from ragged.kernels.triton.launch import CachedLaunch
    from ragged.ops.fused import reference_bias_act
    from ragged.records.fused import BiasActArgs

    kernel = kf._bias_act_fwd_kernel
    assert isinstance(kernel, CachedLaunch) and kernel._direct
    assert not launch._hooks_installed() and launch._FAST
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(67, 97, device="cuda", dtype=torch.bfloat16, generator=g)
    bias = torch.randn(96, device="cuda", dtype=torch.bfloat16, generator=g)
    before = len(kernel._table)
    cases = [
        base[:, :96],  # aligned rows of stride 97: not divisible by 16
        base[:, 1:],  # a 2-byte misaligned start
        base[:64, :96].contiguous(),  # aligned, stride 96
        base[:1, :96].contiguous(),  # one row
        base[:, :96],  # the first case again: a table hit
    ]
    for x in cases:
        for _ in range(2):  # the first call may compile, the second takes the cached path
            y = kf.bias_act_forward(BiasActArgs(x, bias, "gelu")).out
            torch.testing.assert_close(y.float(), reference_bias_act(x, bias, "gelu").float(), rtol=2e-2, atol=2e-2)
    assert len(kernel._table) - before >= 3, "misaligned or differently divisible arguments shared one kernel"


def test_hook_detection_follows_triton_knobs():
    from ragged.kernels.triton import launch

    if launch._knobs is None:
        pytest.skip("this Triton has no knobs module")
    runtime = launch._knobs.runtime
    assert not launch._hooks_installed()
    hook = runtime.launch_enter_hook
    calls = getattr(hook, "calls", None)
    if calls is not None:
        hook.add(_noop)
        try:
            assert launch._hooks_installed()
        finally:
            hook.remove(_noop)
    else:
        runtime.launch_enter_hook = _noop
        try:
            assert launch._hooks_installed()
        finally:
            runtime.launch_enter_hook = None
    assert not launch._hooks_installed()


def _noop(*args, **kwargs):
    return None


def test_inline_key_is_the_per_argument_spec():
    """The generated key function gives exactly what ``_spec`` gives per argument (one
    table for both), distinguishes what Triton specialises on, and refuses other types."""
    from ragged.kernels.triton import launch

    base = torch.zeros(64)
    ints = [
        0,
        1,
        2,
        15,
        16,
        17,
        48,
        -16,
        -1,
        2**31 - 1,
        2**31,
        -(2**31),
        -(2**31) - 1,
        2**40,
        2**63 - 1,
        2**63,
        2**64 - 16,
    ]
    args = [base, base[1:], base[4:], torch.nn.Parameter(base), *ints, 0.5, 1.0, None, True, False]
    key = launch._key_function(len(args))
    got = key(*args)
    assert got == tuple(launch._spec(a) for a in args)
    assert len(set(got[:2])) == 2 and got[0] == got[2] == got[3], "alignment"  # base[4:] is 16-byte aligned
    codes = dict(zip(ints, got[4 : 4 + len(ints)]))
    assert codes[1] != codes[2] and codes[16] != codes[17] and codes[0] == codes[16] == codes[48] == codes[-16]
    assert codes[2**31 - 1] != codes[2**31] and codes[-(2**31)] != codes[-(2**31) - 1]
    assert codes[2**63 - 1] != codes[2**63]
    assert got[-2] != got[-1] and got[-2] != codes[1], "bools are not ints"
    with pytest.raises(launch._Unsupported):
        launch._key_function(2)(base, "text")
