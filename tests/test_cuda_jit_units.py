"""The per-kernel NVRTC programs of the CUDA backend (ragged.kernels.cuda.launch.programs), without
a GPU: every kernel a launcher can ask for has a program, read from the source's own
instantiation lines; that program defines exactly that kernel, as the whole file does
(nvcc's preprocessor), and compiles on its own (a sample, with nvcc for sm_90); the whole file
still defines every kernel; precompile compiles each program once, concurrently. GPU runs of
the kernels are in test_gpu_*.py."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
import types

import pytest
import torch

from ragged.kernels.cuda import attention as ca
from ragged.kernels.cuda import fused as cf
from ragged.kernels.cuda import launch as kc
from ragged.kernels.cuda import pack as kp
from ragged.ops.attention import AttentionArgs
from ragged.records.fused import AddLayerNormArgs, BiasActArgs
from ragged.records.pack import PackArgs, UnpackArgs

SOURCES = ("attention_short.cu", "fused.cu", "pack.cu")
HAS_NVCC = shutil.which("nvcc") is not None
needs_nvcc = pytest.mark.skipif(not HAS_NVCC, reason="nvcc not found")
# Compiled to sm_90 cubins: one kernel per source, those of a BERT-base bf16 inference.
SAMPLE = (
    ("attention_short.cu", "ragged_attention_short_pipe_bf16_d64_c32_h4"),
    ("fused.cu", "ragged_add_layer_norm_bf16_i3"),
    ("pack.cu", "ragged_unpack_v16_i32"),
)
# ... and the position-bias variant MPNet's inference takes, compiled alone the same way
BIAS_SAMPLE = ("attention_short.cu", "ragged_attention_short_pipe_bias_bf16_d64_c32_h4")


# --------------------------------------------------------------------------------------
# What the launchers ask for: their real name building, with the launch recorded


@pytest.fixture
def launches(monkeypatch):
    """(source, kernel, grid, block) of every launch of the CUDA launchers, on CPU tensors."""
    out = []

    def record(src_name, kernel, device, grid, block, params, values):
        out.append((src_name, kernel, grid, block))

    for module in (ca, cf, kp):
        monkeypatch.setattr(module, "launch", record)
    monkeypatch.setattr(ca, "_multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(cf, "_sm_count", lambda device: 132)
    return out


def _ask_every_kernel():
    """Call every launcher over the inputs that reach each of its kernel choices."""
    for dtype in ca._DTYPES:
        for head_dim in ca.HEAD_DIMS:
            heads = 12
            for batch in (1, 1024):  # few (sequence, head) pairs: one block per head; many: pipelined
                cu = torch.arange(batch + 1, dtype=torch.int32)
                for max_len in (1, 16, 32, 33, 64, 65, 128):
                    q = torch.empty((batch, heads, head_dim), dtype=dtype)
                    args = AttentionArgs(
                        q=q, k=q, v=q, cu_q=cu, cu_k=cu, max_q=max_len, max_k=max_len, causal=False, scale=0.125
                    )
                    ca.forward(args)
                    buckets = torch.zeros(2 * max_len - 1, dtype=torch.int32)
                    ca.forward(args._replace(bias_table=torch.zeros((32, heads)), bias_buckets=buckets))
                    qkv = torch.empty((batch, 3 * heads * head_dim), dtype=dtype)
                    ca.packed_self_attention(qkv, cu, max_len, heads, True, 0.125)
    for dtype, (_, vec) in cf._TYPES.items():
        for iters in cf.LN_ITERS:
            for n_cols in (32 * vec * iters - vec, 32 * vec * iters):
                x = torch.empty((3, n_cols), dtype=dtype)
                cf.add_layer_norm_forward(AddLayerNormArgs(x, x, x[0], x[0], 1e-5, True))
                cf.add_layer_norm_inference(AddLayerNormArgs(x, None, None, None, 1e-5))
        for activation in cf.ACTIVATION_NAMES:
            cf.bias_act_forward(
                BiasActArgs(torch.empty((3, 32), dtype=dtype), torch.empty(32, dtype=dtype), activation)
            )
    # (dtype, features) whose rows are 16, 8, 4, 2 and 1 bytes
    for dtype, features in (
        (torch.float32, 4),
        (torch.float32, 2),
        (torch.float32, 1),
        (torch.float16, 1),
        (torch.int8, 1),
    ):
        for offsets_dtype in (torch.int32, torch.int64):
            offsets = torch.tensor([0, 2, 3], dtype=offsets_dtype)
            kp.pack(PackArgs(torch.zeros((2, 4, features), dtype=dtype), offsets, 3, False))
            kp.unpack(UnpackArgs(torch.zeros((3, features), dtype=dtype), offsets, 4, 0, True))


def test_every_launcher_kernel_has_a_program_and_every_program_a_launcher(launches):
    _ask_every_kernel()
    asked = {(src, kernel) for src, kernel, _, _ in launches}
    declared = {(src, kernel) for src in SOURCES for kernel in kc.programs(src)}
    assert asked - declared == set(), f"kc.programs(): launchers ask for kernels no source defines: {asked - declared}"
    assert declared - asked == set(), f"kc.programs(): kernels no launcher asks for: {declared - asked}"
    # two dtypes, with and without the position bias
    assert len(kc.programs("attention_short.cu")) == 4 * (sum(map(len, ca._CONFIGS.values())) + len(ca._PIPELINED))
    assert len(kc.programs("fused.cu")) == 3 * (len(cf.LN_ITERS) + len(cf.ACTIVATION_NAMES))
    assert len(kc.programs("pack.cu")) == 2 * 2 * len(kp._VEC_NAMES)


def test_attention_launch_geometry_matches_the_macro_arguments(launches):
    """The warps per block (W) and heads per block (HPB) of an attention launch are the arguments
    its kernel was instantiated with (read through its program, not a table)."""
    _ask_every_kernel()
    for src, kernel, grid, block in launches:
        if src != "attention_short.cu":
            continue
        args = dict(kc.program(src, kernel).arguments)
        blocks_per_sequence = -(-12 // int(args.get("HPB", 1)))  # 12 heads
        assert block == (int(args["W"]) * 32, 1), f"ca.forward(): {kernel} launched with {block}, {args}"
        assert grid in (blocks_per_sequence, 1024 * blocks_per_sequence), f"ca.forward(): {kernel} grid {grid}, {args}"


def test_one_kernel_per_program():
    for src in SOURCES:
        for kernel, prog in kc.programs(src).items():
            assert prog.kernels == (kernel,), f"kc.programs({src!r}): {kernel} shares its program: {prog.kernels}"
            assert prog.source == src and prog.text.endswith(f"\n{prog.invocation}\n")
            assert 'extern "C"' not in prog.invocation


def test_programs_keep_the_source_lines_and_blank_the_instantiations():
    """The prefix is the source line for line (line numbers of errors stay right), with the
    instantiation lines empty."""
    for src in SOURCES:
        text = kc.source(src)
        prog = next(iter(kc.programs(src).values()))
        prefix = prog.prefix.split("\n", 1)[1]  # after its #line 1
        lines, kept = text.split("\n"), prefix.split("\n")
        assert len(kept) == len(lines), f"kc.programs({src!r}): the prefix has {len(kept)} lines, not {len(lines)}"
        blanked = [i + 1 for i, (a, b) in enumerate(zip(lines, kept)) if a != b]
        assert all(kept[i - 1] == "" for i in blanked)
        assert {p.line for p in kc.programs(src).values()} == set(blanked)
        assert f'\n#line {prog.line} "{src}"\n' in prog.text


def test_unknown_kernel_names_the_source_and_the_kernel():
    with pytest.raises(
        ValueError,
        match=r"csrc/fused\.cu defines no kernel 'ragged_add_layer_norm_bf16_i5'.*"
        r"closest: ragged_add_layer_norm_bf16_i",
    ):
        kc.program("fused.cu", "ragged_add_layer_norm_bf16_i5")
    with pytest.raises(ValueError, match="csrc/pack.cu defines no kernel 'ragged_bias_act_bf16_relu'"):
        kc.program("pack.cu", "ragged_bias_act_bf16_relu")


# --------------------------------------------------------------------------------------
# The parser on small sources: what it takes, and what it refuses rather than guesses


_TOY = r"""
#define ONE(T, N, C) \
    extern "C" __global__ void __launch_bounds__(C * 32) k_##N##_c##C(T* p) { p[0] = (T)C; }
#define BOTH(N, C) ONE(float, N##f, C) ONE(int, N##i, C)
// ONE(float, commented, 1)
/* BOTH(block,
   2) */
BOTH(a, 1)
ONE(double, b, 2);
"""


def test_parse_expands_groups_and_skips_comments():
    table = kc._parse("toy.cu", _TOY)
    assert sorted(table) == ["k_af_c1", "k_ai_c1", "k_b_c2"]
    assert table["k_ai_c1"].invocation == "ONE(int, ai, 1)"  # C: not substituted in "C"
    assert dict(table["k_b_c2"].arguments) == {"T": "double", "N": "b", "C": "2"}
    assert table["k_af_c1"].line == 8 and table["k_b_c2"].line == 9


@pytest.mark.parametrize(
    "source,message",
    [
        (_TOY + "#if 1\nONE(float, c, 1)\n#endif\n", "inside #if"),
        (_TOY + "ONE(float, af, 1)\n", "kernel k_af_c1 is also defined at line 8"),
        (
            '#define S(N) extern "C" __global__ void k_##N() {}\n#define G(N) S(N) int x;\nG(a)\n',
            "only macro invocations",
        ),
        ('#define S(N) extern "C" __global__ void k_##N() { const char* s = #N; }\nS(a)\n', "'#'"),
        ('#define S(N) extern "C" __global__ void k_##N() {}\nS(a) S(b)\n', "text after the instantiation"),
    ],
)
def test_parse_refuses_what_it_cannot_follow(source, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        kc._parse("toy.cu", source)
    assert "csrc/toy.cu" in str(info.value)


# --------------------------------------------------------------------------------------
# precompile, with a stand-in for CuPy


class _FakeCupy(types.ModuleType):
    """RawModule / cuda.Device as launch._module uses them, recording each compile."""

    def __init__(self, barrier=None, fail=None):
        super().__init__("cupy")
        self.compiled, self.lock, self.barrier, self.fail = [], threading.Lock(), barrier, fail
        fake = self

        class RawModule:
            def __init__(self, code, options):
                self.code, self.options = code, options

            def compile(self):
                invocation = self.code.rstrip("\n").rsplit("\n", 1)[1]
                with fake.lock:
                    fake.compiled.append((self.code, self.options, threading.get_ident()))
                if fake.barrier is not None:
                    fake.barrier.wait()
                if fake.fail == invocation:
                    raise RuntimeError(f"compile failed: {invocation}")

            def get_function(self, kernel):
                assert self.code.endswith(f"\n{kc.program(_source_of(kernel), kernel).invocation}\n")
                return types.SimpleNamespace(kernel=("function", kernel))

        self.RawModule = RawModule
        self.cuda = types.SimpleNamespace(Device=lambda index: contextlib.nullcontext())


def _source_of(kernel: str) -> str:
    return next(src for src in SOURCES if kernel in kc.programs(src))


@pytest.fixture
def fresh_caches(monkeypatch):
    monkeypatch.setattr(kc, "_modules", {})
    monkeypatch.setattr(kc, "_functions", {})
    monkeypatch.setattr(kc, "_compile_locks", {})
    # the NVRTC path (with ragged._C installed the default would be the ahead-of-time binary)
    monkeypatch.setenv(kc.LAUNCH_VARIABLE, "jit")
    monkeypatch.setattr(kc, "_paths", {})


def test_precompile_compiles_each_program_once_concurrently(monkeypatch, fresh_caches):
    items = [SAMPLE[0], SAMPLE[1], SAMPLE[2], SAMPLE[0], ("pack.cu", "ragged_pack_v16_i32")]
    cupy = _FakeCupy(barrier=threading.Barrier(4, timeout=30))  # all four must be compiling at once
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    kc.precompile(items, device=0, max_workers=4)
    assert len(cupy.compiled) == 4, "precompile(): a program compiled twice (or one missing)"
    assert len({ident for *_, ident in cupy.compiled}) == 4, "precompile(): compiles were not concurrent"
    assert {code for code, _, _ in cupy.compiled} == {kc.program(s, k).text for s, k in items}
    assert all(options == ("-std=c++17",) for _, options, _ in cupy.compiled)
    assert kc._functions[("ragged_unpack_v16_i32", 0)] == ("function", "ragged_unpack_v16_i32")
    kc.precompile(items, device=0)  # all cached: nothing compiles
    assert kc._function("fused.cu", "ragged_add_layer_norm_bf16_i3", 0) == ("function", "ragged_add_layer_norm_bf16_i3")
    assert len(cupy.compiled) == 4


def test_launch_path_and_precompile_share_one_compile_per_program(monkeypatch, fresh_caches):
    cupy = _FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    kernels = [("fused.cu", "ragged_bias_act_bf16_gelu")] * 8
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda item: kc._function(item[0], item[1], 0), kernels))
    assert len(cupy.compiled) == 1


def test_precompile_errors_propagate(monkeypatch, fresh_caches):
    cupy = _FakeCupy(fail="RAGGED_ADD_LAYER_NORM(Bf16, bf16, 3)")
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    with pytest.raises(RuntimeError, match=re.escape("compile failed: RAGGED_ADD_LAYER_NORM(Bf16, bf16, 3)")):
        kc.precompile(SAMPLE, device=0)
    assert len(cupy.compiled) == 3  # the others ran to the end
    with pytest.raises(ValueError, match="csrc/pack.cu defines no kernel 'ragged_pack_v32_i32'"):
        kc.precompile([SAMPLE[0], ("pack.cu", "ragged_pack_v32_i32")], device=0)
    assert len(cupy.compiled) == 3  # unknown names raise before anything compiles


def test_compile_only_compiles_launches_concurrently_and_runs_nothing(monkeypatch, fresh_caches):
    """Inside compile_only, a launch compiles its program on the pool (each program once, all at
    once) and launches nothing; the programs are loaded when the block ends."""
    cupy = _FakeCupy(barrier=threading.Barrier(3, timeout=30))  # three programs compile at once
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(kc, "_function", lambda *a: pytest.fail(f"launched {a} inside compile_only"))
    dev = torch.device("cuda", 0)
    with kc.compile_only(workers=3):
        for src, kernel in [SAMPLE[0], SAMPLE[1], SAMPLE[0], SAMPLE[2], SAMPLE[1]]:
            kc.launch(src, kernel, dev, 1, (32, 1), None, ())
    assert len(cupy.compiled) == 3 and len({ident for *_, ident in cupy.compiled}) == 3
    assert {code for code, _, _ in cupy.compiled} == {kc.program(s, k).text for s, k in SAMPLE[:3]}
    with kc.compile_only(workers=2):  # loaded: nothing compiles again
        kc.launch(*SAMPLE[0], dev, 1, (32, 1), None, ())
    assert len(cupy.compiled) == 3


def test_compile_only_raises_a_failed_compile_at_its_end_and_is_not_reentrant(monkeypatch, fresh_caches):
    cupy = _FakeCupy(fail="RAGGED_ADD_LAYER_NORM(Bf16, bf16, 3)")
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    dev = torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match=re.escape("compile failed: RAGGED_ADD_LAYER_NORM(Bf16, bf16, 3)")):
        with kc.compile_only(workers=2):
            for src, kernel in SAMPLE:
                kc.launch(src, kernel, dev, 1, (32, 1), None, ())
    assert len(cupy.compiled) == len({kc.program(s, k).source + kc.program(s, k).kernels[0] for s, k in SAMPLE})
    with pytest.raises(RuntimeError, match="already inside a compile_only"):
        with kc.compile_only(workers=1):
            with kc.compile_only(workers=1):
                pass
    assert kc._AHEAD.pool is None  # the outer block ended too


# --------------------------------------------------------------------------------------
# nvcc: the programs against the real preprocessor, a sample compiled


# An extern "C" definition as nvcc -E writes it (__global__, __launch_bounds__ as attributes); a
# macro expansion is one line, a group's kernels side by side on it.
_DEFINITION = re.compile(
    r'extern\s+"C"\s+__attribute__\(\(global\)\)\s*(?:void\s*|__attribute__\(\((?:[^()]|\([^()]*\))*'
    r"\)\)\s*)*([A-Za-z_]\w*)\s*\("
)


def _preprocess(text: str, path) -> dict[str, str]:
    """kernel name -> its definition in nvcc -E's output of ``text``."""
    path.write_text(text)
    out = subprocess.run(
        ["nvcc", "-E", "-std=c++17", str(path)], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    found: dict[str, str] = {}
    for line in out.splitlines():
        for piece in re.split(r'(?=\bextern\s+"C")', line):
            m = _DEFINITION.match(piece)
            if m:
                assert m.group(1) not in found, f"nvcc -E {path.name}: {m.group(1)} defined twice"
                found[m.group(1)] = piece.strip()
    return found


def _pool():
    return concurrent.futures.ThreadPoolExecutor(max(2, min(16, os.cpu_count() or 2)))


@needs_nvcc
def test_each_program_preprocesses_to_its_kernel_alone_as_in_the_whole_file(tmp_path):
    with _pool() as pool:
        whole = {src: pool.submit(_preprocess, kc.source(src), tmp_path / src) for src in SOURCES}
        per_kernel = {
            (src, kernel): pool.submit(_preprocess, prog.text, tmp_path / f"{kernel}.cu")
            for src in SOURCES
            for kernel, prog in kc.programs(src).items()
        }
    for src in SOURCES:
        definitions = whole[src].result()
        assert set(definitions) == set(kc.programs(src)), (
            f"kc.programs({src!r}) differs from nvcc -E {src}: {set(definitions) ^ set(kc.programs(src))}"
        )
    for (src, kernel), future in per_kernel.items():
        got = future.result()
        assert list(got) == [kernel], f"kc.program({src!r}, {kernel!r}): nvcc -E finds {list(got)}"
        assert got[kernel] == whole[src].result()[kernel], f"kc.program({src!r}, {kernel!r}): not as in {src}"


def _cubin_kernels(text: str, path) -> set[str]:
    path.write_text(text)
    cubin = path.with_suffix(".cubin")
    subprocess.run(
        ["nvcc", "-cubin", "-arch=sm_90", "-std=c++17", str(path), "-o", str(cubin)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return {name.decode() for name in re.findall(rb"ragged_[a-z0-9_]+", cubin.read_bytes())}


@needs_nvcc
def test_a_sample_of_programs_compiles_alone_for_sm90(tmp_path):
    """What NVRTC does with a program (device code, sm_90), by nvcc: each compiles on its own
    and its cubin holds its kernel and no other."""
    with _pool() as pool:
        futures = {
            item: pool.submit(_cubin_kernels, kc.program(*item).text, tmp_path / f"{item[1]}.cu")
            for item in (*SAMPLE, BIAS_SAMPLE)
        }
    for (src, kernel), future in futures.items():
        assert future.result() == {kernel}, f"kc.program({src!r}, {kernel!r}): the cubin has {future.result()}"
