"""Every Triton kernel compiles for sm_90 (ahead of time; no GPU needed)."""

import os
import pathlib
import subprocess
import sys

import pytest


# The longest test of the suite on a CPU (the compiler, not the interpreter, runs for every kernel
# variant): `-m slow`, which CI runs right after the README's command.
@pytest.mark.slow
def test_triton_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, TRITON_INTERPRET="0")
    script = pathlib.Path(__file__).with_name("aot_sm90.py")
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
