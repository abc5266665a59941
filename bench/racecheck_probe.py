"""Racecheck probes: gl.warp_specialize's argument hand-over, with and without attention.

``compute-sanitizer --tool racecheck`` reports shared-memory hazards in
``ragged.kernels.triton.attention_ws`` that ``bench/results/racecheck_ws_forward_sass.md`` reads
as Gluon's own hand-over (the default partition stores the workers' arguments in shared memory,
named barrier 1, the workers read them; at the end it writes the exit words there) followed by
the loader building a device-side TMA descriptor in the same bytes. Each variant here runs one
piece of that, without or with attention, on an sm_90 GPU and checks its outputs (exit status 1
on a mismatch), printing one line (``--all`` runs the three in turn):

* ``handover``: a Gluon kernel with a default partition and two 4-warp workers (registers as
  attention_ws: 240 a worker thread under ``maxnreg`` 168), each worker reading scalars and a
  pointer it was handed and writing its id and the scalars' sum; no TMA, no shared memory of
  its own;
* ``descriptor``: the same, and the default partition makes a TMA descriptor on the device
  (``tma.make_tensor_descriptor``, as attention_ws's ``_rows_desc``) and loads a tile into
  shared memory on an mbarrier that each worker waits on before copying its half out;
* ``attention``: ragged's warp-specialised forward itself (``triton_sm90_ws``, preferred as
  ``tests/test_gpu_attention_ws.py`` does), once on a small varlen GQA batch, against the
  float64 reference (computed on the CPU, so the GPU runs no other kernel of note).

Use, on an sm_90 GPU (``bash bench/racecheck.sh SUMMARY`` runs the three, one sanitizer each, and
writes their hazard counts to ``SUMMARY``)::

    compute-sanitizer --tool racecheck --racecheck-report hazard python -m bench.racecheck_probe --variant handover
    compute-sanitizer --tool racecheck --racecheck-report hazard python -m bench.racecheck_probe --variant descriptor
    compute-sanitizer --tool racecheck --racecheck-report hazard python -m bench.racecheck_probe --variant attention

and compare the hazard counts: hazards in ``handover`` alone come from Gluon's hand-over, not from
the attention kernel; hazards that appear with ``descriptor`` come from the descriptor's reuse of
the hand-over's bytes. ``--compile [ARCH]`` compiles the two Gluon kernels for ``sm_ARCH`` on any
machine with Triton (no GPU) and prints their resources as JSON lines (``--sass DIR`` keeps their
SASS, to read the addresses a report names).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

VARIANTS = ("handover", "descriptor", "attention")
PROGRAMS = 8  # one row of IN each; more than one block, so the hand-over runs in several SMs
# the probe kernels' pointer arguments (bench.kernel_resources.compile_for knows ragged's names only)
POINTER_TYPES = {"IN": "*i32", "OUT": "*i32", "X": "*fp16", "Y": "*fp16"}


def _kernels():
    """:mod:`bench.racecheck_kernels`, or exit saying why this Triton cannot build it."""
    try:
        from bench import racecheck_kernels
    except ImportError as exc:
        try:
            import triton

            version = f"Triton {triton.__version__}"
        except ImportError:
            version = "no Triton"
        raise SystemExit(
            f"bench.racecheck_probe: the Gluon Hopper language cannot be imported ({version}: {exc}); "
            "the probe needs a Triton with triton.experimental.gluon.language.nvidia.hopper (3.6 and 3.9 compile it)"
        ) from exc
    return racecheck_kernels


def _device():
    """The current CUDA device, or exit: the kernels use TMA and setmaxnreg (sm_90)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.racecheck_probe: needs a CUDA GPU (sm_90); --compile runs without one")
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        raise SystemExit(f"bench.racecheck_probe: needs an sm_90 GPU, this one is sm_{major}{minor}")
    return torch.device("cuda")


def _scalars(device):
    """``IN [PROGRAMS, 4] int32``: ``a, b, c`` different in every program, and the tile's rows."""
    import torch

    from bench.racecheck_kernels import TILE_ROWS

    n = torch.arange(PROGRAMS, dtype=torch.int32)
    return torch.stack([n + 1, 10 * n + 2, 100 * n + 3, torch.full_like(n, TILE_ROWS)], 1).to(device)


def _reports_ok(out, scalars) -> bool:
    """``OUT [PROGRAMS, 3, 2]`` as every partition should have written it: ``(p, a + b + c)``."""
    import torch

    sums = scalars[:, :3].sum(1, dtype=torch.int32)
    parts = torch.arange(3, dtype=torch.int32, device=out.device)
    want = torch.stack([parts.expand(PROGRAMS, 3), sums[:, None].expand(PROGRAMS, 3)], 2)
    return bool(torch.equal(out, want))


def run_handover() -> tuple[bool, str]:
    import torch

    k = _kernels()
    device = _device()
    scalars = _scalars(device)
    out = torch.full((PROGRAMS, 3, 2), -1, dtype=torch.int32, device=device)
    k.handover_kernel[(PROGRAMS,)](scalars, out, num_warps=4, maxnreg=k.MAX_REGISTERS)
    torch.cuda.synchronize()
    ok = _reports_ok(out, scalars)
    return ok, f"handover: {PROGRAMS} programs x 3 partitions, ids and argument sums {'match' if ok else 'WRONG'}"


def run_descriptor() -> tuple[bool, str]:
    import torch

    from ragged.kernels.triton.attention_hopper import _ensure_allocator

    k = _kernels()
    device = _device()
    _ensure_allocator()  # scratch in global memory for the descriptors made on the device
    scalars = _scalars(device)
    out = torch.full((PROGRAMS, 3, 2), -1, dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(PROGRAMS * k.TILE_ROWS, k.TILE_COLS, generator=gen).to(device, torch.float16)
    y = torch.full_like(x, float("nan"))
    k.descriptor_kernel[(PROGRAMS,)](scalars, out, x, y, num_warps=4, maxnreg=k.MAX_REGISTERS)
    torch.cuda.synchronize()
    reports, tiles = _reports_ok(out, scalars), bool(torch.equal(x, y))
    line = (
        f"descriptor: {PROGRAMS} programs x 3 partitions, ids and argument sums {'match' if reports else 'WRONG'}, "
        f"TMA-loaded tiles {'match' if tiles else 'WRONG'}"
    )
    return reports and tiles, line


def run_attention() -> tuple[bool, str]:
    """The ws forward once: bf16, head dim 64, GQA 4/2, full, lengths across a 128-row block."""
    import torch

    import ragged
    from ragged import backends

    _kernels()  # the same Gluon the forward needs: a clear exit where it is missing
    try:
        from ragged.kernels.triton import attention_ws  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"bench.racecheck_probe: ragged's warp-specialised forward cannot be imported: {exc}") from exc
    device = _device()
    lengths = [128, 129, 1, 300]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths), 4, 64, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(sum(lengths), 2, 64, generator=gen).to(torch.bfloat16) for _ in "kv")
    args = (q.to(device), k.to(device), v.to(device), cu.to(device), cu.to(device), max(lengths), max(lengths))
    with backends.prefer("attention", "triton_sm90_ws"):
        why = ragged.explain(ragged.varlen_attention, *args)
        out = ragged.varlen_attention(*args).cpu()
    ref, _ = ragged.reference_attention(q.double(), k.double(), v.double(), cu, cu)
    low, _ = ragged.reference_attention(q, k, v, cu, cu, compute_dtype=torch.bfloat16)
    err, err_low = ((t.double() - ref).abs().max().item() for t in (out, low))
    # flash-attn's rule: the kernel's error at most twice torch's own in bf16, plus bf16's atol
    ok = why.chosen == "triton_sm90_ws" and err <= 2 * err_low + 1e-3
    line = f"attention: {why.chosen} on lengths {lengths}, max error {err:.3g} (torch bf16 {err_low:.3g})"
    if why.chosen != "triton_sm90_ws":
        line += f"; triton_sm90_ws not taken: {'; '.join(why['triton_sm90_ws']) or 'not preferred'}"
    return ok, line


RUNS = {"handover": run_handover, "descriptor": run_descriptor, "attention": run_attention}


def compile_probes(arch: int = 90, sass_dir: str | None = None) -> list[dict]:
    """The two Gluon kernels compiled for ``sm_<arch>`` without a GPU, as attention_ws is by
    :mod:`bench.kernel_resources`: one record each with its resources and ``BAR_SYNC``, the
    named-barrier waits in its code (the hand-over's rounds among them)."""
    from bench import kernel_resources as kr

    k = _kernels()
    records = []
    for name, kernel in (("handover", k.handover_kernel), ("descriptor", k.descriptor_kernel)):
        compiled = kr.compile_for(kernel, {}, arch, 4, 1, maxnreg=k.MAX_REGISTERS, pointers=POINTER_TYPES)
        code = kr.sass(compiled)
        if sass_dir:
            os.makedirs(sass_dir, exist_ok=True)
            with open(os.path.join(sass_dir, f"{name}_sm{arch}.sass"), "w") as f:
                f.write(code)
        records.append(dict(kernel=name, arch=arch, **kr.resources(compiled), BAR_SYNC=code.count("BAR.SYNC")))
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.racecheck_probe",
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="Under racecheck: compute-sanitizer --tool racecheck --racecheck-report hazard "
        "python -m bench.racecheck_probe --variant handover (bench/racecheck.sh runs every variant).",
    )
    parser.add_argument("--variant", choices=VARIANTS, default="handover", help="what to run (default: handover)")
    parser.add_argument("--all", action="store_true", help="run every variant in turn")
    parser.add_argument(
        "--compile",
        type=int,
        nargs="?",
        const=90,
        default=None,
        metavar="ARCH",
        help="compile the Gluon kernels for sm_ARCH (default 90) without a GPU; print JSON lines",
    )
    parser.add_argument("--sass", metavar="DIR", default=None, help="with --compile: write each kernel's SASS here")
    args = parser.parse_args(argv)
    if args.compile is not None:
        for record in compile_probes(args.compile, args.sass):
            print(json.dumps(record), flush=True)
        return 0
    failed = 0
    for name in VARIANTS if args.all else (args.variant,):
        ok, line = RUNS[name]()
        print(line, flush=True)
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
