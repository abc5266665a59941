"""examples/ddp_train.py run for real: two CPU processes under torchrun (gloo), with DDP and with
FSDP2. Both must train, print their progress and exit cleanly, and give the same losses (the
same weights, batches and gradient weighting; only the way gradients are reduced differs)."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEP = re.compile(r"^step +(\d+) +loss (\d+\.\d+) +[\d,]+ tokens/s", re.MULTILINE)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(*flags: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        "examples/ddp_train.py",
        "--device",
        "cpu",
        "--steps",
        "3",
        "--log-every",
        "1",
        *flags,
    ]
    # As a user runs it on a CPU: without TRITON_INTERPRET (set for the test session by conftest),
    # which would run every kernel through Triton's interpreter (about a minute a step here).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    # A session of its own: on a timeout the launcher and both ranks are killed together.
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in 180 s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-4000:]}"
    return out


def _losses(out: str) -> list[float]:
    steps = STEP.findall(out)
    assert [int(s) for s, _ in steps] == [1, 2, 3], out  # rank 0 alone prints, once per step
    return [float(loss) for _, loss in steps]


def test_ddp_and_fsdp2_train_two_cpu_ranks():
    ddp, fsdp = _run(), _run("--fsdp")
    assert re.search(
        r"^2 ranks \(DDP, cpu\), \d+ steps per epoch; token loads max/mean per step: worst [\d.]+, "
        r"mean [\d.]+, efficiency [\d.]+%$",
        ddp,
        re.MULTILINE,
    ), ddp
    assert "2 ranks (FSDP2, cpu)" in fsdp, fsdp
    ddp_losses, fsdp_losses = _losses(ddp), _losses(fsdp)
    assert all(0.3 < loss < 1.2 for loss in ddp_losses), ddp_losses  # near ln 2 at the start
    assert ddp_losses == pytest.approx(fsdp_losses, abs=2e-4), (ddp_losses, fsdp_losses)
