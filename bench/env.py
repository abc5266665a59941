"""Environment metadata stored with every result file."""

from __future__ import annotations

import datetime
import os
import platform
import re
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
