"""Sweep of pack/unpack launch shapes at the target size (bf16, B=256, M=512, F=1024).

Development tool, run on a GPU: ``python -m bench.tune_pack``. Prints each variant's
median time and % of the device-copy ceiling measured in the same process; the chosen
shapes live in ``ragged/kernels/cuda.py`` and ``ragged/kernels/triton/pack.py``.
"""

import json
import os

import torch
import triton
from triton.testing import do_bench

import ragged
from ragged.kernels.cuda import pack as kp
from ragged.kernels.triton import pack as kt


def main():
    torch.manual_seed(0)
    batch, width, feat, dtype = 256, 512, 1024, torch.bfloat16
    es = 2
    lengths = torch.randint(1, width + 1, (batch,)).tolist()
    total = sum(lengths)
    x = torch.randn(batch, width, feat, device="cuda", dtype=dtype)
    rt = ragged.pack(x, lengths=lengths, backend="torch")
    off, vals = rt.offsets, rt.values

    src = torch.empty(2**29, dtype=dtype, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    ceiling = 2 * src.numel() * es / ms / 1e6
    print(f"{torch.cuda.get_device_name()}: copy ceiling {ceiling:.0f} GB/s", flush=True)
    pack_bytes = 2 * total * feat * es
    unpack_bytes = total * feat * es + batch * width * feat * es
    rows = []

    def run(name, fn, nbytes):
        ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
        gbs = nbytes / ms / 1e6
        rows.append({"name": name, "ms": ms, "GB/s": gbs, "pct_copy": 100 * gbs / ceiling})
        print(f"{name:44s} {ms * 1e3:8.1f} us {gbs:7.0f} GB/s {100 * gbs / ceiling:5.1f}%", flush=True)

    for be in ("cuda", "triton", "torch"):
        run(f"pack {be}", lambda: ragged.pack_values(x, off, total, backend=be), pack_bytes)
        run(f"unpack {be}", lambda: ragged.unpack_values(vals, off, width, backend=be), unpack_bytes)
    c1 = torch.empty(pack_bytes // 2 // es, dtype=dtype, device="cuda")
    c2 = torch.empty_like(c1)
    run("copy of the pack bytes", lambda: c2.copy_(c1), pack_bytes)

    # Host cost of one call (no sync), which bounds small problems in eager mode.
    import time

    for name, fn in (
        ("pack cuda", lambda: ragged.pack_values(x, off, total, backend="cuda")),
        ("pack triton", lambda: ragged.pack_values(x, off, total, backend="triton")),
        ("unpack cuda", lambda: ragged.unpack_values(vals, off, width, backend="cuda")),
        ("unpack triton", lambda: ragged.unpack_values(vals, off, width, backend="triton")),
        ("index_select", lambda: x.view(-1, feat).index_select(0, off[:1].long())),
    ):
        small = 200
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(small):
            fn()
        host_us = (time.perf_counter() - start) / small * 1e6
        torch.cuda.synchronize()
        rows.append({"name": f"host overhead {name}", "us": host_us})
        print(f"host overhead per call, {name:14s} {host_us:6.1f} us", flush=True)

    layout = kp._layout
    for lanes in (8, 16, 32, 64, 128):
        kp._layout = lambda rv, n=lanes: (n, 256 // n)
        run(f"pack cuda lanes={lanes}", lambda: ragged.pack_values(x, off, total, backend="cuda"), pack_bytes)
        run(f"unpack cuda lanes={lanes}", lambda: ragged.unpack_values(vals, off, width, backend="cuda"), unpack_bytes)
    kp._layout = layout

    tile = kt._tile
    for tile_bytes in (8192, 16384, 32768):
        for row_bytes in (2048, 4096):
            for warps in (4, 8):

                def shape(row, elem, tb=tile_bytes, rb=row_bytes, w=warps):
                    bf = min(triton.next_power_of_2(row), rb // elem)
                    return max(1, min(1024, (tb // elem) // bf)), bf, w

                kt._tile = shape
                tag = f"tile={tile_bytes} row={row_bytes} warps={warps}"
                run(f"pack triton {tag}", lambda: ragged.pack_values(x, off, total, backend="triton"), pack_bytes)
                run(
                    f"unpack triton {tag}",
                    lambda: ragged.unpack_values(vals, off, width, backend="triton"),
                    unpack_bytes,
                )
    kt._tile = tile
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "tune_pack.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": ceiling, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
