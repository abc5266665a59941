"""Environment metadata stored with every result file."""

from __future__ import annotations

import datetime
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


_SMI_BROKEN: list[bool] = []  # [True] once nvidia-smi failed: not asked again in this process


def gpu_clocks(device: torch.device) -> dict[str, float]:
    """The GPU's SM clock (MHz) and power draw (W) at this moment, from ``nvidia-smi``; empty
    where they cannot be read (no CUDA device, no nvidia-smi, an unexpected answer: then not
    asked again). A diagnostic: rows of a GEMM-heavy case that ran slow with a low clock ran
    throttled."""
    if device.type != "cuda" or _SMI_BROKEN or shutil.which("nvidia-smi") is None:
        return {}
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except (RuntimeError, AttributeError, AssertionError):  # AssertionError: a CPU-only torch
        return {}
    # the device by UUID (CUDA_VISIBLE_DEVICES may renumber), else by index
    for target in (uuid if uuid.startswith("GPU-") else f"GPU-{uuid}", str(index)):
        try:
            done = subprocess.run(["nvidia-smi", f"--id={target}", "--query-gpu=clocks.sm,power.draw",
                                   "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
            sm, power = (float(v) for v in done.stdout.strip().splitlines()[0].split(","))
            break
        except (OSError, subprocess.SubprocessError, IndexError, ValueError):
            continue
    else:
        _SMI_BROKEN.append(True)
        return {}
    return {"SM MHz": sm, "W": power}


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: torch.device) -> str:
    """``NVIDIA H200``, or the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpu_name()


def device_slug(device: torch.device) -> str:
    """Short file-name form of the device: ``h200``, ``h100-80gb-hbm3``, ``cpu``."""
    if device.type != "cuda":
        return "cpu"
    words = re.findall(r"[a-z0-9]+", device_name(device).lower().replace("nvidia", ""))
    return "-".join(words) or "cuda"


def collect(device: torch.device) -> dict[str, Any]:
    """Date, device, library versions and git state, as JSON values."""
    commit = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    if commit is None:  # a copy of the tree without .git (e.g. sent to a GPU machine)
        commit = os.environ.get("BENCH_GIT_COMMIT") or None
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device.type,
        "device_name": device_name(device),
        "device_slug": device_slug(device),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cupy": _version("cupy") if device.type == "cuda" else None,
        "ragged": _version("ragged"),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": commit,
        "git_dirty": bool(dirty) if commit is not None and dirty is not None else None,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_sm_count"] = props.multi_processor_count
    return info
