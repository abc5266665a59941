"""What the attention kernels cost the hardware, compiled for a GPU without one: registers,
spills, shared memory and the machine instructions that matter, per kernel and shape.

Development tool: ``python -m bench.kernel_resources [--arch 90] [--only portable hopper bwd hopper-bwd]
[--chosen]``
runs on any machine with Triton (its bundled ``ptxas`` and ``cuobjdump`` compile and read the
binary). For each kernel at each shape it prints:

* ``regs`` (per thread) and ``stack`` (bytes of local memory per thread; above 0 the kernel
  spills), ``LDL``/``STL`` (the spill loads and stores in the code);
* ``shared`` (bytes per block, Triton's figure: the limit on an H100/H200 is 232,448);
* instruction counts: ``HGMMA`` (Hopper's asynchronous warpgroup matrix products), ``HMMA``
  (the warp-level tensor-core products of earlier GPUs), ``UTMALDG``/``UTMASTG``/``UTMAREDG``
  (TMA loads, stores and bulk reduce-adds), ``REDG`` (element atomics into global memory whose
  result is unused), ``LDGSTS`` (cp.async copies into shared memory), ``SYNCS`` (the barriers of
  an asynchronous pipeline).

Static facts, not times: a kernel that spills or copies through registers is slower than one
that does not, by an amount only a GPU measures (``bench/tune_attention.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ragged.kernels.triton import attention as launcher
from ragged.kernels.triton import attention_hopper as hopper
from ragged.kernels.triton import attention_hopper_bwd as hopper_bwd
from ragged.kernels.triton import attention_kernels as kernels

_POINTERS = {
    "Q",
    "K",
    "V",
    "O",
    "DO",
    "DQ",
    "DK",
    "DV",
    "LSE",
    "DELTA",
    "cu_q",
    "cu_k",
    "block_cum",
    "order",
    "seed_ptr",
    "DIST",
    "BUCKETS",
    "PARTIAL",
}
_POINTER_TYPES = {
    "LSE": "*fp32",
    "DELTA": "*fp32",
    "DIST": "*fp32",
    "PARTIAL": "*fp32",
    "cu_q": "*i32",
    "cu_k": "*i32",
    "block_cum": "*i32",
    "order": "*i32",
    "BUCKETS": "*i32",
    "seed_ptr": "*i64",
}
_FLOATS = {"sm_scale", "dropout_p", "qk_scale"}
_COUNTED = ("HGMMA", "HMMA", "UTMALDG", "UTMASTG", "UTMAREDG", "REDG", "LDGSTS", "SYNCS", "LDL", "STL", "USETMAXREG")


def _tool(name: str) -> str:
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return bundled if os.path.exists(bundled) else name


def compile_for(
    kernel,
    constants: dict,
    arch: int,
    warps: int,
    stages: int,
    dtype: str = "bf16",
    maxnreg: int | None = None,
    pointers: dict[str, str] | None = None,
):
    """The compiled kernel (``triton.compile``) for ``sm_<arch>``: pointers of ``dtype`` (16-byte
    aligned), integers as int32, the float arguments as fp32, ``constants`` as constexprs;
    ``maxnreg``: the register limit a warp-specialised kernel divides among its partitions;
    ``pointers``: the pointer arguments of a kernel outside ragged's names, with their types
    (``{"OUT": "*i32"}``)."""
    pointer_types = {**_POINTER_TYPES, **(pointers or {})}
    fn = getattr(kernel, "jit", kernel)
    # a constexpr left out takes its default, as a launch that does not pass it
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    constants = {**{k: v for k, v in defaults.items() if k not in constants}, **constants}
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name == "DQ" and constants.get("FUSED_DQ"):
            signature[name] = "*fp32"  # the fused backward adds dQ atomically into a float32 buffer
        elif name in _POINTERS or name in pointer_types:
            signature[name] = pointer_types.get(name, f"*{dtype}")
        else:
            signature[name] = "fp32" if name in _FLOATS else "i32"
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if name in _POINTERS or name in pointer_types
    }
    # a Gluon kernel compiles through Gluon's own pipeline (its source class), not Triton's passes
    make = ASTSource
    if type(fn).__name__ == "GluonJITFunction":
        from triton.experimental.gluon._runtime import GluonASTSource as make
    source = make(fn=fn, signature=signature, constexprs=dict(constants), attrs=attrs)
    options = dict(num_warps=warps, num_stages=stages, **({} if maxnreg is None else {"maxnreg": maxnreg}))
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def _cuobjdump(compiled, flag: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([_tool("cuobjdump"), flag, path], capture_output=True, text=True, check=True).stdout


def sass(compiled) -> str:
    """The compiled kernel's machine code as ``cuobjdump --dump-sass`` prints it."""
    return _cuobjdump(compiled, "--dump-sass")


def resources(compiled) -> dict:
    """``regs``, ``stack``, ``shared`` and the instruction counts of :data:`_COUNTED`."""
    usage = _cuobjdump(compiled, "--dump-resource-usage")
    code = sass(compiled)
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", usage.replace("\n", " "))
    out = {
        "regs": int(found.group(1)) if found else -1,
        "stack": int(found.group(2)) if found else -1,
        "shared": compiled.metadata.shared,
    }
    out.update({op: len(re.findall(rf"\b{op}\b", code)) for op in _COUNTED})
    out["WGMMA_OVERLAP"] = wgmma_overlap(code)
    return out


def wgmma_overlap(sass: str) -> int:
    """How many times a warpgroup issues a group of wgmma while its previous group is still in
    flight (a ``WARPGROUP.ARRIVE`` opening a group after ``HGMMA`` with no ``WARPGROUP.DEPBAR``
    between them): 0 in code that waits for each product before the next, as a kernel whose
    softmax should run beside its products must not."""
    count, pending = 0, False
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR" in line:
            pending = False
        elif "WARPGROUP.ARRIVE" in line:
            count += pending
        elif "HGMMA" in line:
            pending = True
    return count


def _portable_forward(head_dim: int, causal: bool) -> dict:
    return dict(
        GROUP=1,
        HEAD_DIM=head_dim,
        BLOCK_D=head_dim,
        CAUSAL=causal,
        WINDOW=False,
        DROPOUT=False,
        SEED_PTR=False,
        BIAS=False,
        PRECISION="tf32",
        INLINE=True,
        CHUNK=16,
    )


def rows(arch: int, only) -> list[tuple[str, tuple, dict | str]]:
    """(kernel, shape, resources or the failure) for each kernel and shape asked for."""
    out = []

    def add(name, shape, kernel, constants, warps, stages):
        try:
            out.append((name, shape, resources(compile_for(kernel, constants, arch, warps, stages))))
        except Exception as exc:  # noqa: BLE001 - a shape the compiler refuses is a row, too
            out.append((name, shape, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"))
        print(_line(*out[-1]), flush=True)

    for head_dim in (128, 64):
        for causal in (False, True):
            tag = f"D={head_dim} {'causal' if causal else 'full'}"
            if not only or "portable" in only:
                bm, bn, w, s = launcher._fwd_config(head_dim, 4096, 4096, causal, None, False)
                add(
                    f"forward (portable) {tag}",
                    (bm, bn, w, s),
                    kernels._fwd_kernel,
                    dict(_portable_forward(head_dim, causal), BLOCK_M=bm, BLOCK_N=bn),
                    w,
                    s,
                )
            if not only or "hopper" in only:
                for shape in hopper.CONFIGS[head_dim]:
                    bm, bn, w, s, persistent, pipe = shape
                    add(
                        f"forward (sm_90 TMA) {tag}",
                        shape,
                        hopper._fwd_tma_kernel,
                        dict(
                            GROUP=1,
                            HEAD_DIM=head_dim,
                            BLOCK_M=bm,
                            BLOCK_N=bn,
                            CAUSAL=causal,
                            WINDOW=False,
                            DROPOUT=False,
                            SEED_PTR=False,
                            PERSISTENT=persistent,
                            INLINE=True,
                            CHUNK=16,
                            PIPE=pipe,
                        ),
                        w,
                        s,
                    )
            if not only or "bwd" in only:
                kv, dq = launcher._bwd_config(head_dim, 4096, 4096, causal, None, False)
                common = dict(_portable_forward(head_dim, causal))
                add(
                    f"backward dK/dV (portable) {tag}",
                    kv,
                    kernels._bwd_dkdv_kernel,
                    dict(common, BLOCK_M=kv[0], BLOCK_N=kv[1]),
                    kv[2],
                    kv[3],
                )
                fused = launcher._FUSED_BWD_SHAPE  # what backward_fused launches at D <= 128
                for mode, how in ((1, "atomics"), (2, "TMA")):
                    add(
                        f"backward fused dK/dV/dQ ({how}) {tag}",
                        fused,
                        kernels._bwd_dkdv_kernel,
                        dict(common, BLOCK_M=fused[0], BLOCK_N=fused[1], FUSED_DQ=mode),
                        fused[2],
                        fused[3],
                    )
                add(
                    f"backward dQ (portable) {tag}",
                    dq,
                    kernels._bwd_dq_kernel,
                    dict(common, BLOCK_M=dq[0], BLOCK_N=dq[1], NUM_BUCKETS=16),
                    dq[2],
                    dq[3],
                )
            if not only or "hopper-bwd" in only:
                seen = set()
                for kv, dq in hopper_bwd.CONFIGS[head_dim]:
                    tma = dict(
                        GROUP=1,
                        HEAD_DIM=head_dim,
                        CAUSAL=causal,
                        WINDOW=False,
                        DROPOUT=False,
                        SEED_PTR=False,
                        INLINE=True,
                        CHUNK=16,
                    )
                    if ("kv", kv) not in seen:
                        seen.add(("kv", kv))
                        add(
                            f"backward dK/dV (sm_90 TMA) {tag}",
                            kv,
                            hopper_bwd._bwd_dkdv_tma_kernel,
                            dict(tma, BLOCK_M=kv[0], BLOCK_N=kv[1]),
                            kv[2],
                            kv[3],
                        )
                    if ("dq", dq) not in seen:
                        seen.add(("dq", dq))
                        add(
                            f"backward dQ (sm_90 TMA) {tag}",
                            dq,
                            hopper_bwd._bwd_dq_tma_kernel,
                            dict(tma, BLOCK_M=dq[0], BLOCK_N=dq[1]),
                            dq[2],
                            dq[3],
                        )
    return out


def chosen(arch: int) -> list[dict]:
    """The shapes the sm_90 launchers pick (``config``) at head dims 64 and 128, full and causal,
    and with a window or dropout at 128: one record per kernel with its resources (what
    ``tests/test_kernel_resources.py`` checks)."""
    out = []
    variants = [(d, c, "plain") for d in (64, 128) for c in (False, True)] + [
        (128, False, "window"),
        (128, True, "dropout"),
    ]
    for head_dim, causal, variant in variants:
        bm, bn, w, s, persistent, pipe = hopper.config(head_dim, 4096, causal, False, variant == "window")
        runs = [("forward", (bm, bn, w, s), hopper._fwd_tma_kernel, dict(PERSISTENT=persistent, PIPE=pipe))]
        kv, dq = hopper_bwd.config(head_dim, causal, False, variant == "window", variant == "dropout")
        runs += [("dkdv", kv, hopper_bwd._bwd_dkdv_tma_kernel, {}), ("dq", dq, hopper_bwd._bwd_dq_tma_kernel, {})]
        for name, (bm, bn, w, s), kernel, extra in runs:
            constants = dict(
                GROUP=1,
                HEAD_DIM=head_dim,
                BLOCK_M=bm,
                BLOCK_N=bn,
                CAUSAL=causal and variant != "window",
                WINDOW=variant == "window",
                DROPOUT=variant == "dropout",
                SEED_PTR=False,
                INLINE=True,
                CHUNK=16,
                **extra,
            )
            out.append(
                dict(
                    kernel=name,
                    head_dim=head_dim,
                    causal=causal,
                    variant=variant,
                    shape=[bm, bn, w, s],
                    **resources(compile_for(kernel, constants, arch, w, s)),
                )
            )
    out += _fused_tma(arch)
    out += _warp_specialised(arch)
    return out


def _fused_tma(arch: int) -> list[dict]:
    """The fused backward's key-block kernel with dQ added by TMA bulk reduce-adds
    (``FUSED_DQ=2``, ``attention.py:backward_fused_tma``) at head dims 64 and 128, full and
    causal, at the shape its launcher picks."""
    out = []
    bm, bn, w, s = launcher._FUSED_BWD_SHAPE
    for head_dim in (64, 128):
        for causal in (False, True):
            constants = dict(_portable_forward(head_dim, causal), BLOCK_M=bm, BLOCK_N=bn, FUSED_DQ=2)
            compiled = compile_for(kernels._bwd_dkdv_kernel, constants, arch, w, s)
            out.append(
                dict(
                    kernel="dkdv_fused_tma",
                    head_dim=head_dim,
                    causal=causal,
                    variant="plain",
                    shape=[bm, bn, w, s],
                    **resources(compiled),
                )
            )
    return out


def _warp_specialised(arch: int) -> list[dict]:
    """The warp-specialised forward (``attention_ws``, Gluon) at head dims 64 and 128, full and
    causal, the consumers' softmax overlapped with their products; none where this Triton has
    no Gluon for Hopper."""
    try:
        from ragged.kernels.triton import attention_ws as ws
    except ImportError:
        return []
    out = []
    for head_dim in (64, 128):
        for causal in (False, True):
            bn, stages, consumers = ws.config(head_dim)
            # the launch default (the persistent grid, ws.PERSISTENT), then the consumers in
            # ping-pong (a program per tile), then (D=128) two K/V stages or (D=64) three consumers
            variants = [("plain", bn, stages, False, consumers), ("pingpong", bn, stages, True, 2)]
            if head_dim == 128:
                variants.append(("stages2", bn, 2, False, consumers))
            else:
                saved, ws.CONSUMERS_D64 = ws.CONSUMERS_D64, 3
                try:
                    variants.append(("wg3", *ws.config(head_dim)[:2], False, 3))
                finally:
                    ws.CONSUMERS_D64 = saved
            for variant, block_n, depth, pingpong, wgs in variants:
                constants = dict(
                    GROUP=1,
                    HEAD_DIM=head_dim,
                    BLOCK_N=block_n,
                    STAGES=depth,
                    CAUSAL=causal,
                    OVERLAP=True,
                    PINGPONG=pingpong,
                    CONSUMERS=wgs,
                    CONSUMER_REGS=ws._REGISTERS[wgs][1],
                    SORTED=ws.PERSISTENT and not pingpong,
                    PERSISTENT=ws.PERSISTENT and not pingpong,
                )
                compiled = compile_for(ws._ws_fwd_kernel, constants, arch, 4, 1, maxnreg=ws.max_registers(wgs))
                out.append(
                    dict(
                        kernel="forward_ws",
                        head_dim=head_dim,
                        causal=causal,
                        variant=variant,
                        shape=[64 * wgs, block_n, 4, depth],
                        **resources(compiled),
                    )
                )
    return out


def _line(name, shape, res) -> str:
    if isinstance(res, str):
        return f"{name:44s} {str(shape):20s} failed: {res}"
    counts = " ".join(f"{op} {res[op]}" for op in _COUNTED)
    return (
        f"{name:44s} {str(shape):20s} regs {res['regs']:3d} stack {res['stack']:4d} shared {res['shared']:6d}  {counts}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability as an integer (90: sm_90)")
    parser.add_argument("--only", nargs="*", choices=("portable", "hopper", "bwd", "hopper-bwd"), default=None)
    parser.add_argument("--chosen", action="store_true", help="the launchers' chosen sm_90 shapes, as JSON lines")
    args = parser.parse_args()
    if args.chosen:
        for record in chosen(args.arch):
            print(json.dumps(record), flush=True)
        return
    print(f"# Triton {triton.__version__}, sm_{args.arch}, bf16, compiled without a GPU", flush=True)
    rows(args.arch, args.only)


if __name__ == "__main__":
    main()
