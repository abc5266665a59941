"""Compiling a layer's kernels ahead of its first training step (ragged.nn.layer._compile_ahead),
on the GPU: the pass compiles exactly what the real step launches, and changes nothing the
step computes (dropout's random stream included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ragged
import ragged.nn

pytestmark = pytest.mark.gpu

_CHILD = textwrap.dedent("""
    import json, time, torch, ragged, ragged.nn
    from ragged.kernels.triton import attention_kernels, fused_kernels
    from ragged.kernels.triton.launch import CachedLaunch

    def compiled():
        n = {}
        for mod in (attention_kernels, fused_kernels):
            for name, k in vars(mod).items():
                if isinstance(k, CachedLaunch):
                    n[name] = sum(len(c[0]) for c in k.jit.device_caches.values())
        return n

    torch.manual_seed(0)
    layer = ragged.nn.TransformerEncoderLayer(256, 4, 512, dropout=0.1, activation="gelu", batch_first=True,
                                              device="cuda", dtype=torch.bfloat16)
    enc = ragged.nn.TransformerEncoder(layer, 2).train()
    x = ragged.pack([torch.randn(n, 256, device="cuda", dtype=torch.bfloat16) for n in (3, 70, 129, 1, 40)])
    x = x.with_values(x.values.detach().requires_grad_(True))
    t0 = time.perf_counter()
    y = enc(x)
    after_forward = compiled()
    y.values.float().square().mean().backward()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    print(json.dumps({"after_forward": after_forward, "after_backward": compiled(), "first_step_s": t1 - t0}))
""")


def test_first_training_forward_compiles_what_the_backward_launches(tmp_path):
    env = dict(
        os.environ,
        TRITON_CACHE_DIR=str(tmp_path / "triton"),
        RAGGED_CACHE_DIR=str(tmp_path / "ragged"),
        CUPY_CACHE_DIR=str(tmp_path / "cupy"),
    )
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    before, after = row["after_forward"], row["after_backward"]
    assert before == after, f"the backward compiled variants the pass did not: {before} -> {after}"
    for name in ("_bwd_dq_kernel", "_bwd_dkdv_kernel", "_ln_bwd_kernel", "_bias_act_bwd_kernel"):
        assert before[name] >= 1, f"{name} was not compiled by the training forward: {before}"
    print(f"first training step, cold caches: {row['first_step_s']:.2f} s")


def test_compile_ahead_pass_changes_nothing_the_step_computes():
    from ragged.nn import layer as core

    torch.manual_seed(0)
    layer = ragged.nn.TransformerEncoderLayer(
        64, 4, 128, dropout=0.2, activation="gelu", batch_first=True, device="cuda", dtype=torch.bfloat16
    ).train()
    x = ragged.pack([torch.randn(n, 64, device="cuda", dtype=torch.bfloat16) for n in (5, 17, 1, 33)])

    def step():
        layer.zero_grad(set_to_none=True)
        xg = x.with_values(x.values.detach().requires_grad_(True))
        torch.manual_seed(123)
        layer(xg).values.float().square().mean().backward()
        return [xg.values.grad, *(p.grad.clone() for p in layer.parameters())]

    core._AHEAD.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = step()  # the pass runs before the layer's first training call
        assert len(core._AHEAD) == 1
        second = step()  # no pass
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(core._AHEAD) == 1
    for a, b in zip(first, second):
        assert torch.equal(a, b), "the compile-ahead pass changed what the step computed (dropout's draws?)"
