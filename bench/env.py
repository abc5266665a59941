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
"""The project's root: the directory that holds the ``bench`` package."""

COMMIT_VARIABLE = "BENCH_GIT_COMMIT"
"""Names the commit of the tree being run; wins over git (a copy of the tree without
``.git``, or a checkout whose metadata is stale, e.g. on a GPU machine)."""


def _git(*args: str, root: Path | None = None) -> str | None:
    """``git -C <root> <args>`` (default root: :data:`REPO_ROOT`), its stdout stripped;
    ``None`` when git is missing or fails. ``GIT_*`` variables that would point git at
    another repository (``GIT_DIR``, ``GIT_WORK_TREE``, ...) are dropped."""
    root = REPO_ROOT if root is None else root
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _is_checkout(root: Path) -> bool:
    """Whether ``root`` is the top of its own git work tree. git looks for ``.git`` in the
    parent folders too: a copy of the project unpacked inside another repository would
    otherwise report that repository's commit."""
    top = _git("rev-parse", "--show-toplevel", root=root)
    if not top:
        return False
    try:
        return Path(top).resolve() == root.resolve()
    except OSError:
        return False


def git_state(root: Path | None = None) -> dict[str, Any]:
    """``git_commit``, ``git_dirty`` and ``git_commit_source`` of the project at ``root``
    (default :data:`REPO_ROOT`).

    ``BENCH_GIT_COMMIT``, when set, is the commit (source ``"BENCH_GIT_COMMIT"``); ``dirty``
    is then known only when ``root`` is a checkout at that very commit. Otherwise git is
    asked about ``root`` alone (source ``"git"``), never about a repository enclosing it:
    when ``root`` is not the top of a git work tree the commit is ``None`` (shown as
    "unknown").
    """
    root = REPO_ROOT if root is None else root
    named = os.environ.get(COMMIT_VARIABLE, "").strip() or None
    head = _git("rev-parse", "HEAD", root=root) if _is_checkout(root) else None
    commit, source = (named, COMMIT_VARIABLE) if named else (head, "git" if head else None)
    dirty = None
    if head is not None and commit is not None and len(commit) >= 7 and head.startswith(commit.lower()):
        status = _git("status", "--porcelain", "--untracked-files=no", root=root)
        dirty = None if status is None else bool(status)
    return {"git_commit": commit, "git_dirty": dirty, "git_commit_source": source}


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
            done = subprocess.run(
                ["nvidia-smi", f"--id={target}", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=5,
            )
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


def cpu_name() -> str:
    """The host CPU's model name: ``/proc/cpuinfo`` (``model name``; ``Model`` / ``Hardware``
    / ``cpu model`` on some ARM and MIPS kernels), else ``lscpu``, else what ``platform``
    knows (the architecture at worst)."""
    keys = ("model name", "cpu model", "model", "hardware")
    try:
        fields = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and value.strip():
                fields.setdefault(key.strip().lower(), value.strip())
        for key in keys:
            # "model" is a number on x86 (the family's model id): only a name will do
            if key in fields and not fields[key].isdigit():
                return fields[key]
    except OSError:
        pass
    if shutil.which("lscpu"):
        try:
            done = subprocess.run(
                ["lscpu"], capture_output=True, text=True, timeout=5, env={**os.environ, "LC_ALL": "C"}
            )
            for line in done.stdout.splitlines():
                key, sep, value = line.partition(":")
                if sep and key.strip() == "Model name" and value.strip() not in ("", "-"):
                    return value.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(device: torch.device) -> str:
    """``NVIDIA H200``, or the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def device_slug(device: torch.device) -> str:
    """Short file-name form of the device: ``h200``, ``h100-80gb-hbm3``, ``cpu``."""
    if device.type != "cuda":
        return "cpu"
    words = re.findall(r"[a-z0-9]+", device_name(device).lower().replace("nvidia", ""))
    return "-".join(words) or "cuda"


def collect(device: torch.device) -> dict[str, Any]:
    """Date, device, host CPU, library versions and git state, as JSON values.

    ``cpu_name`` / ``cpu_count``: the host's CPU model and logical cores, in every result
    (on a GPU run too: host-bound rows move with the host's speed); ``torch_threads``:
    the intra-op threads of the run's CPU work.
    """
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device.type,
        "device_name": device_name(device),
        "device_slug": device_slug(device),
        "cpu_name": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cupy": _version("cupy") if device.type == "cuda" else None,
        "ragged": _version("ragged"),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        **git_state(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_sm_count"] = props.multi_processor_count
    return info


def device_label(env: dict[str, Any]) -> str:
    """The device of a result, for titles: ``NVIDIA H200 (host CPU: AMD EPYC 9654)``, or
    ``CPU: AMD EPYC 9654``. Takes the ``env`` of a result file (older files have no
    ``cpu_name``: then the device name alone)."""
    host = env.get("cpu_name")
    if env.get("device") == "cpu":
        return f"CPU: {host or env.get('device_name') or 'unknown model'}"
    name = env.get("device_name") or env.get("device") or "unknown device"
    return f"{name} (host CPU: {host})" if host else name
