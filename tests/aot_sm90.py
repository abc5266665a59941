"""Compile every Triton kernel of ragged for sm_90 ahead of time, without a GPU.

The interpreter (TRITON_INTERPRET=1, used by the CPU tests) accepts code that the
compiler rejects (a variable bound in one branch only, say); this catches that class of
bug in CI. Run by tests/test_triton_sm90.py in a subprocess with the interpreter off.
Prints one line per kernel variant and exits non-zero if any fails.
"""

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import ragged.kernels.triton.attention as ka
import ragged.kernels.triton.pack as kp
import ragged.kernels.triton.vocab as kv

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn, types, consts, num_warps=4, num_stages=2):
    """``types``: one Triton type string per non-constexpr argument, in order."""
    names = fn.arg_names
    signature, constexprs, it = {}, {}, iter(types)
    for i, name in enumerate(names):
        if name in consts:
            signature[name] = "constexpr"
            constexprs[(i,)] = consts[name]
        else:
            signature[name] = next(it)
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET,
                   options={"num_warps": num_warps, "num_stages": num_stages})


def cases():
    for dt in ("*bf16", "*fp32"):
        prec = "ieee" if dt == "*fp32" else "tf32"
        variants = ((False, False, 1, 64), (True, True, 2, 80), (True, False, 1, 128))
        for causal, dropout, group, dim in variants if dt == "*bf16" else variants[1:2]:
            c = dict(GROUP=group, HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_M=64, BLOCK_N=32,
                     CAUSAL=causal, DROPOUT=dropout, PRECISION=prec, INLINE=not dropout, CHUNK=256)
            scalars = ["i32", "i32", "fp32", "i32", "fp32", "i32", "i32"]
            yield ("attention fwd", ka._fwd_kernel,
                   [dt] * 4 + ["*fp32", "*i32", "*i32", "*i32"] + scalars + ["i32"] * 8, c)
            yield ("attention bwd dk/dv", ka._bwd_dkdv_kernel,
                   [dt] * 4 + ["*fp32", "*fp32", dt, dt, "*i32", "*i32", "*i32"] + scalars + ["i32"] + ["i32"] * 12, c)
            yield ("attention bwd dq", ka._bwd_dq_kernel,
                   [dt] * 4 + ["*fp32", "*fp32", dt, "*i32", "*i32", "*i32"] + scalars + ["i32"] + ["i32"] * 10, c)
    yield ("attention delta", ka._delta_kernel, ["*bf16", "*bf16", "*fp32", "i32", "i32", "i32", "i32", "i32", "i32"],
           dict(HEAD_DIM=80, BLOCK_D=128, BLOCK_R=32))
    yield ("attention block_cum", ka._block_cum_kernel, ["*i32", "*i32", "i32"], dict(BLOCK_M=64, CHUNK=256))
    yield ("attention keep mask", ka._keep_mask_kernel, ["*i8", "i32", "fp32", "i32", "i32"], dict(BLOCK=64))
    offs = ["*i32", "*i32", "*i64", "*i32", "i32", "i32", "i32", "i32"]
    for dt, shared, inline in (("*bf16", False, True), ("*fp32", True, False)):
        prec = "ieee" if dt == "*fp32" else "tf32"
        yield ("vocab fwd", kv._fwd_kernel, [dt, dt, dt, "*i64", dt] + offs + ["i32", "i32"],
               dict(HAS_BIAS=True, SHARED=shared, EVEN_K=inline, PRECISION=prec, BLOCK_M=64, BLOCK_N=128,
                    BLOCK_K=64, INLINE=inline, CHUNK=64))
        yield ("vocab d_hidden", kv._dhidden_kernel, [dt, dt, "*i64", dt] + offs + ["i32", "i32"],
               dict(SHARED=shared, PRECISION=prec, BLOCK_M=64, BLOCK_D=64, BLOCK_K=32, INLINE=inline, CHUNK=64))
        for atomic in (True, False):
            acc_t = dt if atomic else "*fp32"
            yield ("vocab d_weight", kv._dweight_kernel, [dt, dt, "*i64", acc_t, acc_t] + offs + ["i32", "i32"],
                   dict(SHARED=shared, HAS_BIAS=True, ATOMIC=atomic, PRECISION=prec, BLOCK_N=64, BLOCK_D=64,
                        BLOCK_K=32, INLINE=inline, CHUNK=64))
        yield ("vocab ce fwd", kv._ce_fwd_kernel, [dt, dt, dt, "*i64", "*i32", "*fp32", "*fp32"] + offs
               + ["i32", "i32", "fp32"], dict(HAS_BIAS=True, SHARED=shared, EVEN_K=True, PRECISION=prec, BLOCK_M=64,
                                      BLOCK_N=128, BLOCK_K=64, INLINE=inline, CHUNK=64))
        yield ("vocab ce grad", kv._ce_grad_kernel, [dt, dt, dt, "*i64", "*i32", "*fp32", "*fp32", dt] + offs
               + ["i32", "i32", "fp32"], dict(HAS_BIAS=True, SHARED=shared, EVEN_K=True, PRECISION=prec,
                                              BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, INLINE=inline, CHUNK=64))
    for left in (False, True):
        yield ("pack", kp._pack_kernel, ["*bf16", "*bf16", "*i32"] + ["i64"] * 6,
               dict(ROW=1000, SRC_ALIGN=8, LEFT=left, BLOCK_R=4, BLOCK_F=1024))
        yield ("unpack", kp._unpack_kernel, ["*bf16", "*bf16", "*i64", "i64", "i64", "i32"],
               dict(ROW=129, LEFT=left, BITS=triton.language.int16, BLOCK_R=128, BLOCK_F=32))


def main() -> int:
    failed = 0
    for name, fn, types, consts in cases():
        try:
            compile_kernel(fn, types, consts)
            print(f"ok   {name} {consts}")
        except Exception as exc:  # report every failure, then fail
            failed += 1
            print(f"FAIL {name} {consts}\n{exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
