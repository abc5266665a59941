"""Host time of a CUDA C++ kernel launch by launch path, in one process on one GPU.

``python -m bench.launch_paths [--out FILE] [--rounds 5] [--calls 2000]``. Three paths:

* ``aot``: the kernel's ``CUfunction`` from ``ragged._C``, launched through the driver's
  ``cuLaunchKernel`` with one packed parameter buffer (the default where ``_C`` is built);
* ``jit driver``: the same launch of the NVRTC-compiled function (the default without ``_C``);
* ``jit cupy``: the NVRTC function launched through CuPy's kernel call
  (``launch.DRIVER_LAUNCH = False``: typed NumPy scalars, CuPy's own argument handling).

Rows: the bare ``launch()`` of one pack kernel (the path alone, arguments prepared once), and
whole eager calls (tiny inputs, so the GPU waits and the row is host time) of pack, unpack,
bias_act, add_layer_norm and short attention with ``backend="cuda"``. The paths alternate in
``rounds`` rounds; each cell is the median of the rounds' means, in microseconds per call.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys

import torch

import ragged
from ragged.kernels.cuda import launch
from ragged.kernels.cuda import pack as cuda_pack

from .env import collect, device_label
from .overhead import per_call_us

MODES = {"aot": ("aot", True), "jit driver": ("jit", True), "jit cupy": ("jit", False)}


def use(mode: str) -> None:
    """Load and launch kernels through ``mode`` (a key of :data:`MODES`) from here on."""
    path, driver = MODES[mode]
    os.environ[launch.LAUNCH_VARIABLE] = path
    launch._paths.clear()
    launch._functions.clear()
    launch.DRIVER_LAUNCH = driver
    launch._driver_launch.clear()


def rows(dev: str = "cuda"):
    x = torch.randn(4, 8, 16, device=dev)
    lengths = [3, 8, 0, 5]
    rt = ragged.pack(x, lengths=lengths)
    off, total = rt.offsets, rt.num_tokens
    out = torch.empty(total, 16, device=dev)
    args = (x.data_ptr(), out.data_ptr(), off.data_ptr(), 4, total, 8, x.stride(0) * 4, x.stride(1) * 4, 4, 0)
    kernel = "ragged_pack_v16_" + ("i32" if off.dtype == torch.int32 else "i64")
    device = x.device
    yield (
        "launch() of one pack kernel",
        lambda: launch.launch("pack.cu", kernel, device, 1, (4, 4), cuda_pack._PACK_PARAMS, args),
    )
    yield "ragged.pack_values", lambda: ragged.pack_values(x, off, total, backend="cuda")
    yield "ragged.unpack_values", lambda: ragged.unpack_values(rt.values, off, 8, backend="cuda")
    bf = torch.bfloat16
    h = torch.randn(total, 768, device=dev, dtype=bf)
    b = torch.randn(768, device=dev, dtype=bf)
    w = torch.ones(768, device=dev, dtype=bf)
    yield "ragged.bias_act (gelu)", lambda: ragged.bias_act(h, b, "gelu", backend="cuda")
    yield "ragged.add_layer_norm", lambda: ragged.add_layer_norm(h, h, w, b, backend="cuda")
    q = ragged.RaggedTensor(torch.randn(total, 12, 64, device=dev, dtype=bf), off, rt.max_len, rt.host_offsets())
    yield "ragged.attention forward (short)", lambda: ragged.attention(q, q, q, backend="cuda")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.launch_paths", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.launch_paths: needs a CUDA device", file=sys.stderr)
        return 2
    modes = [m for m in MODES if m != "aot" or launch.aot_reason(torch.cuda.current_device()) is None]
    if importlib.util.find_spec("cupy") is None:
        modes = [m for m in modes if not m.startswith("jit")]
    saved = os.environ.get(launch.LAUNCH_VARIABLE), launch.DRIVER_LAUNCH
    table: dict[str, dict[str, list[float]]] = {}
    try:
        for mode in modes:  # compile / look up every kernel once before timing
            use(mode)
            for _, fn in rows():
                fn()
        for _ in range(opts.rounds):
            for mode in modes:
                use(mode)
                for name, fn in rows():
                    table.setdefault(name, {}).setdefault(mode, []).append(per_call_us(fn, opts.calls))
    finally:
        if saved[0] is None:
            os.environ.pop(launch.LAUNCH_VARIABLE, None)
        else:
            os.environ[launch.LAUNCH_VARIABLE] = saved[0]
        launch.DRIVER_LAUNCH = saved[1]
        launch._paths.clear()
        launch._functions.clear()
        launch._driver_launch.clear()
    env = collect(torch.device("cuda"))
    lines = [
        f"# Host time per call by launch path (us, median of {opts.rounds} rounds of {opts.calls} calls)",
        "",
        f"{device_label(env)}, {env['cpu_count']} cores, torch {torch.__version__}, CuPy {env['cupy']}, "
        f"tree {env.get('git_commit')}",
        "",
        "| call | " + " | ".join(modes) + " |",
        "|---|" + "---|" * len(modes),
    ]
    for name, cells in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{statistics.median(cells[m]):.1f}" for m in modes) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if opts.out:
        with open(opts.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
