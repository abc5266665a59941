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
import ragged.kernels.triton.fused as kf
import ragged.kernels.triton.pack as kp
import ragged.kernels.triton.vocab as kv
import ragged.kernels.triton.vocab_cross_entropy as kce
from ragged.kernels.triton import attention_kernels

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn, types, consts, num_warps=4, num_stages=2):
    """``types``: one Triton type string per non-constexpr argument, in order."""
    fn = getattr(fn, "jit", fn)  # a cached-launch wrapper: its @triton.jit function
    names = fn.arg_names
    signature, constexprs, it = {}, {}, iter(types)
    # a constexpr with a default that ``consts`` leaves out takes it, as a launch that omits it
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    consts = {**{k: v for k, v in defaults.items() if k not in consts}, **consts}
    for i, name in enumerate(names):
        if name in consts:
            signature[name] = "constexpr"
            constexprs[(i,)] = consts[name]
        else:
            signature[name] = next(it)
    triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=TARGET,
        options={"num_warps": num_warps, "num_stages": num_stages},
    )


def cases():
    for dt in ("*bf16", "*fp32"):
        prec = "ieee" if dt == "*fp32" else "tf32"
        # (causal, dropout, group, head dim, sliding window, position bias; a causal window runs as
        # WINDOW alone)
        variants = (
            (False, False, 1, 64, False, False),
            (True, True, 2, 80, False, True),
            (True, False, 1, 128, False, False),
            (False, False, 4, 64, True, True),
            (False, True, 1, 64, True, False),
            (False, False, 1, 64, False, True),
        )
        for causal, dropout, group, dim, window, bias in variants if dt == "*bf16" else variants[1:2]:
            c = dict(
                GROUP=group,
                HEAD_DIM=dim,
                BLOCK_D=triton.next_power_of_2(dim),
                BLOCK_M=64,
                BLOCK_N=32,
                CAUSAL=causal,
                WINDOW=window,
                DROPOUT=dropout,
                SEED_PTR=False,
                BIAS=bias,
                PRECISION=prec,
                INLINE=not dropout,
                CHUNK=256,
                NUM_BUCKETS=32 if bias else 16,
            )
            # batch, n_steps, sm_scale, seed, seed_ptr, dropout_p, total_q, max_k, win_left, win_right
            scalars = ["i32", "i32", "fp32", "i32", "*i64", "fp32", "i32", "i32", "i32", "i32"]
            bias_args = ["*fp32", "i32", "i32"]  # the distance table, max_q, its row length
            yield (
                "attention fwd",
                ka._fwd_kernel,
                [dt] * 4 + ["*fp32", "*i32", "*i32", "*i32"] + scalars + bias_args + ["i32"] * 8,
                c,
            )
            dkdv_types = (
                [dt] * 4
                + ["*fp32", "*fp32", dt, dt, "*i32", "*i32", "*i32"]
                + scalars
                + ["i32"]
                + bias_args
                + ["i32"] * 12
                + ["*fp32", "i32", "i32"]  # the fused backward's float32 dQ and its strides
            )
            yield ("attention bwd dk/dv", ka._bwd_dkdv_kernel, dkdv_types, c)
            if not bias:  # the fused backward: dQ added atomically from the same kernel
                yield ("attention bwd fused dk/dv/dq", ka._bwd_dkdv_kernel, dkdv_types, {**c, "FUSED_DQ": 1})
            if not bias and dim in (64, 128):  # the same with dQ by TMA bulk reduce-adds
                yield ("attention bwd fused dk/dv/dq tma", ka._bwd_dkdv_kernel, dkdv_types, {**c, "FUSED_DQ": 2})
            # the distance table, the buckets, the partial bucket sums, max_q, the table's row length
            dq_bias_args = ["*fp32", "*i64", "*fp32", "i32", "i32"]
            yield (
                "attention bwd dq",
                ka._bwd_dq_kernel,
                [dt] * 5
                + ["*fp32", "*fp32", dt, "*i32", "*i32", "*i32"]
                + scalars
                + ["i32"]
                + dq_bias_args
                + ["i32"] * 12,
                {**c, "BLOCK_M": 32, "BLOCK_N": 64} if bias else c,
            )
    yield (
        "attention block_cum",
        attention_kernels._block_cum_kernel,
        ["*i32", "*i32", "i32"],
        dict(BLOCK_M=64, CHUNK=256),
    )
    for dt in ("*bf16", "*fp32"):
        yield (
            "attention bwd delta",
            ka._bwd_delta_kernel,
            [dt, dt, "*fp32"] + ["i32"] * 6,
            dict(HEAD_DIM=80, BLOCK_D=128, BLOCK_T=32),
        )
    yield ("attention keep mask", ka._keep_mask_kernel, ["*i8", "i32", "fp32", "i32", "i32"], dict(BLOCK=64))
    offs = ["*i32", "*i32", "*i64", "*i32", "i32", "i32", "i32", "i32"]
    for dt, shared, inline in (("*bf16", False, True), ("*fp32", True, False)):
        prec = "ieee" if dt == "*fp32" else "tf32"
        yield (
            "vocab fwd",
            kv._fwd_kernel,
            [dt, dt, dt, "*i64", dt] + offs + ["i32", "i32", "i32"],
            dict(
                HAS_BIAS=True,
                SHARED=shared,
                EVEN_K=inline,
                PRECISION=prec,
                BLOCK_M=64,
                BLOCK_N=128,
                BLOCK_K=64,
                INLINE=inline,
                CHUNK=64,
            ),
        )
        yield (
            "vocab d_hidden",
            kv._dhidden_kernel,
            [dt, dt, "*i64", dt] + offs + ["i32", "i32", "i32"],
            dict(SHARED=shared, PRECISION=prec, BLOCK_M=64, BLOCK_D=64, BLOCK_K=32, INLINE=inline, CHUNK=64),
        )
        for atomic in (True, False):
            acc_t = dt if atomic else "*fp32"
            yield (
                "vocab d_weight",
                kv._dweight_kernel,
                [dt, dt, "*i64", acc_t, acc_t] + offs + ["i32", "i32", "i32"],
                dict(
                    SHARED=shared,
                    HAS_BIAS=True,
                    ATOMIC=atomic,
                    PRECISION=prec,
                    BLOCK_N=64,
                    BLOCK_D=64,
                    BLOCK_K=32,
                    INLINE=inline,
                    CHUNK=64,
                ),
            )
        for tgt, smooth in (("*i32", True), ("*i64", False)):
            yield (
                "vocab ce fwd",
                kce._ce_fwd_kernel,
                [dt, dt, dt, "*i64", tgt, "*i32", "*i64", "*fp32", "*fp32"]
                + offs
                + ["i32", "i32", "i32", "fp32", "i32", "i32"],
                dict(
                    HAS_BIAS=True,
                    SHARED=shared,
                    EVEN_K=True,
                    PRECISION=prec,
                    SMOOTH=smooth,
                    BLOCK_M=32,
                    BLOCK_N=256,
                    BLOCK_K=64,
                    INLINE=inline,
                    CHUNK=64,
                ),
                8,
                3,
            )
        for smooth in (False, True):
            yield (
                "vocab ce grad",
                kce._ce_grad_kernel,
                [dt, dt, dt, "*i64", "*i32", "*fp32", "*fp32", dt] + offs + ["i32", "i32", "i32", "i32", "fp32"],
                dict(
                    HAS_BIAS=True,
                    SHARED=shared,
                    EVEN_K=True,
                    PRECISION=prec,
                    SMOOTH=smooth,
                    BLOCK_M=64,
                    BLOCK_N=128,
                    BLOCK_K=64,
                    INLINE=inline,
                    CHUNK=64,
                ),
            )
    tl = triton.language
    for act, bias in ((0, False), (1, True), (2, True), (3, True)):
        yield (
            "bias_act fwd",
            kf._bias_act_fwd_kernel,
            ["*bf16", "*fp32", "*bf16", "i32", "i32"],
            dict(N_COLS=768, ACT=act, HAS_BIAS=bias, BLOCK_R=16, BLOCK_F=256),
        )
        yield (
            "bias_act bwd",
            kf._bias_act_bwd_kernel,
            ["*bf16", "*bf16", "*fp32", "*bf16", "*fp32", "*i1"] + ["i32"] * 7 + ["fp32"],
            dict(
                N_COLS=777, ACT=act, HAS_BIAS=bias, NEED_DBIAS=bias, HAS_MASK=bias, BLOCK_R=32, BLOCK_F=128, MASK_VEC=8
            ),
        )
    # (F, BLOCK_R, BLOCK_F, N_CHUNKS): rows in registers (several per program, one), chunked rows
    for n_cols, block_r, block_f, chunks, dt, res_t in (
        (768, 4, 1024, 1, "*bf16", "*fp32"),
        (1, 1, 1, 1, "*fp16", "*fp16"),
        (20000, 1, 4096, 5, "*fp32", "*bf16"),
    ):
        sum_t = {"*bf16": "*fp32", "*fp16": "*fp16", "*fp32": "*fp32"}[dt]
        sum_dtype = {"*fp16": tl.float16, "*fp32": tl.float32}[sum_t]
        for extras in (True, False):
            yield (
                "layer_norm fwd",
                kf._ln_fwd_kernel,
                [dt, res_t, "*fp32", "*fp32", sum_t, sum_t, "*fp32", "*fp32", "i32", "i32", "i32", "fp32"],
                dict(
                    N_COLS=n_cols,
                    HAS_RES=extras,
                    HAS_W=extras,
                    HAS_B=extras,
                    STORE_SUM=extras,
                    SUM_DTYPE=sum_dtype,
                    BLOCK_R=block_r,
                    BLOCK_F=block_f,
                    N_CHUNKS=chunks,
                ),
            )
            yield (
                "layer_norm bwd",
                kf._ln_bwd_kernel,
                [sum_t, sum_t, dt, res_t, "*fp32", "*fp32", "*fp32", sum_t, "*fp32", "*i1", sum_t]
                + ["i32"] * 9
                + ["fp32"],
                dict(
                    N_COLS=n_cols,
                    HAS_DS=extras,
                    HAS_BSRC=extras,
                    HAS_W=extras,
                    NEED_DW=extras and chunks == 1,
                    NEED_DB=extras and chunks == 1,
                    HAS_MASK=extras and chunks == 1,
                    NEED_DC=extras and chunks == 1,
                    MASK_VEC=8,
                    SUM_DTYPE=sum_dtype,
                    BLOCK_R=block_r,
                    BLOCK_F=block_f,
                    N_CHUNKS=chunks,
                ),
            )
        yield (
            "layer_norm bwd dw/db",
            kf._ln_bwd_dwdb_kernel,
            [sum_t, dt, res_t, "*fp32", "*fp32", "*fp32", "*fp32"] + ["i32"] * 5,
            dict(
                N_COLS=n_cols,
                HAS_BSRC=True,
                NEED_DW=True,
                NEED_DB=True,
                SUM_DTYPE=sum_dtype,
                BLOCK_R=8,
                BLOCK_F=min(block_f, 1024),
            ),
        )
    for left in (False, True):
        yield (
            "pack",
            kp._pack_kernel,
            ["*bf16", "*bf16", "*i32"] + ["i64"] * 6,
            dict(ROW=1000, SRC_ALIGN=8, LEFT=left, BLOCK_R=4, BLOCK_F=1024),
        )
        yield (
            "unpack",
            kp._unpack_kernel,
            ["*bf16", "*bf16", "*i64", "i64", "i64", "i32"],
            dict(ROW=129, LEFT=left, BITS=triton.language.int16, BLOCK_R=128, BLOCK_F=32),
        )


def main() -> int:
    failed = 0
    for name, fn, types, consts, *launch in cases():  # launch: optional (num_warps, num_stages)
        try:
            compile_kernel(fn, types, consts, *launch)
            print(f"ok   {name} {consts}")
        except Exception as exc:  # report every failure, then fail
            failed += 1
            print(f"FAIL {name} {consts}\n{exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
