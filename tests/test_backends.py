"""Backend selection: argument > use_backend block > set_backend > RAGGED_BACKEND > auto."""

import ast
import asyncio
import dataclasses
import itertools
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import timeit

import pytest
import torch
from conftest import TRITON_ON_CPU

import ragged
from ragged import backends


def _inputs():
    x = torch.randn(2, 4, 3)
    return x, torch.tensor([0, 1, 4], dtype=torch.int32)


def test_default_is_auto_and_auto_takes_the_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("RAGGED_BACKEND", raising=False)
    assert ragged.get_backend() == "auto"
    x, offsets = _inputs()
    assert backends.select("pack", None, x.device, x, offsets).name == "torch"


def test_precedence(monkeypatch):
    monkeypatch.setenv("RAGGED_BACKEND", "triton")
    assert ragged.get_backend() == "triton"
    ragged.set_backend("torch")
    assert ragged.get_backend() == "torch"
    with ragged.use_backend("cuda"):
        assert ragged.get_backend() == "cuda"
    assert ragged.get_backend() == "torch"
    ragged.set_backend(None)
    assert ragged.get_backend() == "triton"


def test_bad_names(monkeypatch):
    with pytest.raises(ValueError, match=r"ragged.set_backend\(\): expected backend to be one of"):
        ragged.set_backend("cudnn")
    monkeypatch.setenv("RAGGED_BACKEND", "fast")
    with pytest.raises(ValueError, match="RAGGED_BACKEND"):
        ragged.get_backend()
    monkeypatch.delenv("RAGGED_BACKEND")
    x, _ = _inputs()
    with pytest.raises(ValueError, match=r"ragged.pack\(\): expected backend to be one of"):
        ragged.pack(x, lengths=[1, 3], backend="numpy")


def test_forced_backend_that_cannot_run_says_why():
    x, _ = _inputs()
    with pytest.raises(ValueError, match=r"backend 'cuda' cannot take this input: .*CUDA tensor"):
        ragged.pack(x, lengths=[1, 3], backend="cuda")
    with ragged.use_backend("cuda"):
        with pytest.raises(ValueError, match="cannot take this input"):
            ragged.pack(x, lengths=[1, 3])


def test_explain_lists_every_implementation():
    x, offsets = _inputs()
    reasons = ragged.explain("pack", x, offsets)
    assert set(reasons) == {"torch", "triton", "cuda"}
    assert reasons["torch"] == []
    assert reasons["cuda"] and "CUDA tensor" in reasons["cuda"][0]


def test_complex_values_fall_back_to_the_reference_under_auto():
    x = torch.randn(2, 4, 3, dtype=torch.complex64)
    rt = ragged.pack(x, lengths=[1, 3])
    assert torch.equal(rt.values, torch.cat([x[0, :1], x[1, :3]]))
    reasons = ragged.explain("pack", x, rt.offsets)
    assert any("complex" in r for r in reasons["triton"])


# --------------------------------------------------------------------------------------
# use_backend is per thread / asyncio task; set_backend is the process-wide default.


def test_use_backend_is_private_to_its_thread(monkeypatch):
    """Two threads inside different blocks at the same time each see their own, a third
    thread with no block sees the default, and blocks left in either order leave nothing."""
    monkeypatch.delenv("RAGGED_BACKEND", raising=False)
    inside, left_one = threading.Barrier(3), threading.Barrier(3)
    seen: dict[str, list[str]] = {"a": [], "b": [], "plain": []}
    errors = []

    def a():  # leaves its block first
        with ragged.use_backend("triton"):
            inside.wait(timeout=30)
            seen["a"].append(ragged.get_backend())
        seen["a"].append(ragged.get_backend())
        left_one.wait(timeout=30)

    def b():  # looks again after "a" has left
        with ragged.use_backend("cuda"):
            inside.wait(timeout=30)
            seen["b"].append(ragged.get_backend())
            left_one.wait(timeout=30)
            seen["b"].append(ragged.get_backend())
        seen["b"].append(ragged.get_backend())

    def plain():
        inside.wait(timeout=30)
        seen["plain"].append(ragged.get_backend())
        left_one.wait(timeout=30)
        seen["plain"].append(ragged.get_backend())

    def guarded(fn):
        def run():
            try:
                fn()
            except Exception as exc:  # surfaced in the main thread
                errors.append(exc)

        return run

    threads = [threading.Thread(target=guarded(fn)) for fn in (a, b, plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert seen["a"] == ["triton", "auto"]
    assert seen["b"] == ["cuda", "cuda", "auto"]
    assert seen["plain"] == ["auto", "auto"]
    assert ragged.get_backend() == "auto"


def test_op_in_a_thread_runs_its_own_backend():
    """What a thread's op runs follows its own block, not the block of a thread beside it."""
    x, offsets = _inputs()
    barrier = threading.Barrier(2)
    picked = {}

    def run(name):
        with ragged.use_backend(name):
            barrier.wait(timeout=30)
            try:
                picked[name] = backends.select("pack", None, x.device, x, offsets).name
            except ValueError as exc:
                picked[name] = str(exc)
            barrier.wait(timeout=30)

    threads = [threading.Thread(target=run, args=(n,)) for n in ("torch", "cuda")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert picked["torch"] == "torch"
    assert "backend 'cuda' cannot take this input" in picked["cuda"]


def test_blocks_left_out_of_order_in_one_thread(monkeypatch):
    monkeypatch.delenv("RAGGED_BACKEND", raising=False)
    ragged.set_backend("torch")
    outer, inner = ragged.use_backend("triton"), ragged.use_backend("cuda")
    outer.__enter__()
    inner.__enter__()
    assert ragged.get_backend() == "cuda"
    outer.__exit__(None, None, None)  # the outer block closes first: the inner one still holds
    assert ragged.get_backend() == "cuda"
    inner.__exit__(None, None, None)
    assert ragged.get_backend() == "torch"
    assert backends._stack.get() == ()


def test_nested_blocks_and_none(monkeypatch):
    monkeypatch.delenv("RAGGED_BACKEND", raising=False)
    ragged.set_backend("torch")
    with ragged.use_backend("triton"):
        with ragged.use_backend("cuda"):
            assert ragged.get_backend() == "cuda"
            with ragged.use_backend(None):  # steps out of the blocks: the process default
                assert ragged.get_backend() == "torch"
            assert ragged.get_backend() == "cuda"
        assert ragged.get_backend() == "triton"
    assert ragged.get_backend() == "torch"


def test_exception_inside_a_block_restores_it(monkeypatch):
    monkeypatch.delenv("RAGGED_BACKEND", raising=False)
    with pytest.raises(RuntimeError, match="inside"):
        with ragged.use_backend("triton"):
            with ragged.use_backend("cuda"):
                raise RuntimeError("inside")
    assert ragged.get_backend() == "auto"
    with ragged.use_backend("torch"):
        with pytest.raises(ValueError, match=r"ragged.use_backend\(\): expected backend to be one of"):
            with ragged.use_backend("cudnn"):
                pass
        assert ragged.get_backend() == "torch"  # the failed block changed nothing
    assert backends._stack.get() == ()


def test_set_backend_inside_a_block_is_the_default_after_it(monkeypatch):
    monkeypatch.delenv("RAGGED_BACKEND", raising=False)
    with ragged.use_backend("triton"):
        ragged.set_backend("torch")
        assert ragged.get_backend() == "triton"  # the open block still decides
    assert ragged.get_backend() == "torch"


def test_use_backend_as_a_decorator(monkeypatch):
    monkeypatch.delenv("RAGGED_BACKEND", raising=False)

    @ragged.use_backend("triton")
    def inner():
        return ragged.get_backend()

    assert inner() == "triton" and inner() == "triton"
    assert ragged.get_backend() == "auto"


def test_asyncio_tasks_each_see_their_own(monkeypatch):
    monkeypatch.delenv("RAGGED_BACKEND", raising=False)

    async def task(name, entered, other_entered, out):
        with ragged.use_backend(name):
            entered.set()
            await other_entered.wait()  # both tasks are inside their blocks now
            out.append(ragged.get_backend())
            await asyncio.sleep(0)
            out.append(ragged.get_backend())
        out.append(ragged.get_backend())

    async def main():
        ev_a, ev_b = asyncio.Event(), asyncio.Event()
        out_a, out_b = [], []
        with ragged.use_backend("torch"):
            inherited = asyncio.create_task(_get_backend_later())  # copies the creator's block
        await asyncio.gather(task("triton", ev_a, ev_b, out_a), task("cuda", ev_b, ev_a, out_b))
        return out_a, out_b, await inherited

    out_a, out_b, inherited = asyncio.run(main())
    assert out_a == ["triton", "triton", "auto"]
    assert out_b == ["cuda", "cuda", "auto"]
    assert inherited == "torch"
    assert ragged.get_backend() == "auto"


async def _get_backend_later():
    await asyncio.sleep(0)
    return ragged.get_backend()


def _spy_on(monkeypatch, op):
    """Record the name of every implementation of ``op`` that runs."""
    ran = []
    entry = backends._OPS[op]
    for name, impl in list(entry.impls.items()):

        def fn(*args, _fn=impl.forward_fn, _name=name):
            ran.append(_name)
            return _fn(*args)

        monkeypatch.setitem(entry.impls, name, dataclasses.replace(impl, forward=fn))
    return ran


@pytest.mark.skipif(not TRITON_ON_CPU, reason="needs Triton on CPU (TRITON_INTERPRET=1)")
def test_compiled_op_under_use_backend(monkeypatch):
    """torch.compile traces ops under a use_backend block, around the call or inside the
    compiled function, with no graph break and nothing left open."""
    torch._dynamo.reset()
    ran = _spy_on(monkeypatch, "pack")
    lengths = [3, 0, 1, 5]
    x = torch.randn(4, 5, 3)
    expected = torch.cat([x[b, :n] for b, n in enumerate(lengths)])

    def around(x):
        return ragged.pack(x, lengths=lengths).values * 2

    with ragged.use_backend("triton"):
        out = torch.compile(around, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out, expected * 2)
    assert ran == ["triton"]

    def inside(x):
        with ragged.use_backend("triton"):
            a = ragged.pack(x, lengths=lengths).values
        return a + ragged.pack(x, lengths=lengths).values

    ran.clear()
    torch._dynamo.reset()
    out = torch.compile(inside, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out, expected * 2)
    assert ran == ["triton", "torch"]  # "auto" on CPU tensors takes the reference
    assert backends._traced is None and ragged.get_backend() == "auto"
    torch._dynamo.reset()


@pytest.mark.gpu
def test_gpu_threads_run_their_own_backend(monkeypatch):
    """On CUDA tensors, threads inside different use_backend blocks at the same time each run
    their own kernel (or "auto"'s), and every result equals the reference."""
    ran = {}
    lock = threading.Lock()
    entry = backends._OPS["pack"]
    for name, impl in list(entry.impls.items()):

        def fn(*args, _fn=impl.forward_fn, _name=name):
            with lock:
                ran.setdefault(threading.current_thread().name, []).append(_name)
            return _fn(*args)

        monkeypatch.setitem(entry.impls, name, dataclasses.replace(impl, forward=fn))
    lengths = [5, 0, 1, 97, 12]
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(len(lengths), 97, 33, generator=gen, device="cuda")
    expected = torch.cat([x[b, :n] for b, n in enumerate(lengths)])
    usable = ["auto", "torch"] + [
        b for b in ("triton", "cuda") if not ragged.explain(ragged.pack, x, lengths=lengths)[b]
    ]
    barrier = threading.Barrier(len(usable))
    results, errors = {}, []

    def run(name):
        try:
            with ragged.use_backend(name):
                barrier.wait(timeout=60)
                for _ in range(3):
                    results.setdefault(name, []).append(ragged.pack(x, lengths=lengths).values)
                torch.cuda.synchronize()
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,), name=n) for n in usable]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    auto_choice = backends.select("pack", "auto", x.device, x, offsets).name
    for name in usable:
        assert ran[name] == [auto_choice if name == "auto" else name] * 3
        for values in results[name]:
            torch.testing.assert_close(values, expected, rtol=0, atol=0)


def test_get_backend_stays_cheap():
    """get_backend runs once per op: a use_backend block costs about a ContextVar read."""
    with ragged.use_backend("torch"):
        per_call = min(timeit.repeat(ragged.get_backend, number=20000, repeat=5)) / 20000
    assert per_call < 5e-6  # ~0.05 us measured; the bound only catches a gross slowdown


# --------------------------------------------------------------------------------------
# Test setup: the hypothesis profile (tests/conftest.py) decides derandomize, no test does.

_TESTS = pathlib.Path(__file__).resolve().parent


@pytest.mark.parametrize(
    "environ, profile",
    [
        ({}, "dev"),
        ({"CI": "true"}, "ci"),
        ({"CI": "1", "HYPOTHESIS_PROFILE": "dev"}, "ci"),
        ({"CI": "false"}, "dev"),
        ({"HYPOTHESIS_PROFILE": "ci"}, "ci"),
        ({"HYPOTHESIS_PROFILE": "dev"}, "dev"),
    ],
)
def test_hypothesis_profile_for_the_environment(environ, profile):
    import conftest

    assert conftest.hypothesis_profile(environ) == profile


@pytest.mark.parametrize("environ", [{"CI": "1"}, {"HYPOTHESIS_PROFILE": "ci"}], ids=["CI", "HYPOTHESIS_PROFILE"])
def test_ci_profile_draws_the_same_examples_every_run(environ):
    """In CI mode, loading the test setup derandomizes every settings object made after it
    (the way test modules make theirs), and a test draws the same examples run after run."""
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        import conftest
        from hypothesis import given, settings, strategies as st

        def draws():
            seen = []

            @settings(max_examples=20)
            @given(st.lists(st.integers(0, 10**6), max_size=5))
            def t(xs):
                seen.append(xs)

            t()
            return seen

        s = settings(max_examples=3)
        print(settings.default.derandomize, s.derandomize, s.database is None, s.print_blob, draws() == draws())
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "HYPOTHESIS_PROFILE")}
    env.update(environ)
    out = subprocess.run(
        [sys.executable, "-c", script, str(_TESTS)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True", "True", "True"]


def test_no_test_module_overrides_the_profile():
    """A test may set max_examples (or deadline); derandomize and the example database
    belong to the profile, else CI is not reproducible."""
    offenders = []
    for path in sorted(_TESTS.glob("*.py")):
        if path.name == "conftest.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name != "settings":
                continue
            offenders += [
                f"{path.name}:{node.lineno} settings({kw.arg}=...)"
                for kw in node.keywords
                if kw.arg in ("derandomize", "database")
            ]
    assert not offenders, offenders


def test_auto_on_cuda_follows_the_ranks_declared_beside_the_kernels():
    """Every kernel implementation declares its measured rank; "auto" on CUDA inputs tries them
    lowest first, the torch reference last (the orders measured in bench/results)."""
    import ragged  # noqa: F401  (every backend registered)

    expected = {
        "pack": ("cuda", "triton", "torch"),
        "unpack": ("cuda", "triton", "torch"),
        "bias_act": ("cuda", "triton", "torch"),
        "add_layer_norm": ("cuda", "triton", "torch"),
        "vocab_projection": ("triton", "torch"),
        "vocab_cross_entropy": ("triton", "torch"),
        "pool": ("triton", "torch"),
        "rotary_embedding": ("triton", "torch"),
        "gated_act": ("triton", "torch"),
    }
    for op, order in expected.items():
        assert backends.op_entry(op).gpu_preference(None) == order, op
    for op in backends.op_names():
        for name, impl in backends.op_entry(op).impls.items():
            assert (impl.rank is None) == (name == "torch"), f"{op}: {name} declares no rank"
