"""The encoder suite of the benchmark harness (``bench/suites/encoder.py``) on CPU."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import ragged
import ragged.nn as rnn
from bench import report
from bench.harness import SUITES, Config, CopyCeiling, Timing, run_suite
from bench.suites import encoder as E

CPU = torch.device("cpu")
FAST = Config(CPU, quick=True, timing=Timing(warmup_ms=0, rep_ms=0, min_reps=1))
CEILING = CopyCeiling(bytes=2 << 20, median_ms=0.1)
TINY = E.CPU_QUICK_SHAPES[0]  # the case of FAST (--quick): tiny
SMALL = E.Shape("small", torch.float32, E.Model(8, 2, 16, 2), 3, 2, 5)
ENV = {
    "device_name": "cpu",
    "device": "cpu",
    "date": "d",
    "torch": "t",
    "triton": "t",
    "cuda": None,
    "cupy": None,
    "git_commit": None,
}

INFERENCE_ROWS = [E.PADDED, E.PADDED_FAST, E.NESTED, E.DENSE, E.RAGGED, E.RAGGED_PADDED]
TRAINING_ROWS = [E.PADDED, E.DENSE, E.RAGGED]


def status(rows):
    return {(r.case, r.impl): (r.status, r.reason) for r in rows}


def test_registered_last():
    names = list(SUITES)
    assert names.index("vocab") < names.index("encoder")
    suite = SUITES["encoder"]
    assert not suite.memory_bound and suite.speedup_table and suite.dropout == 0.1


def test_cpu_cases():
    cases = SUITES["encoder"].cases(FAST)
    assert [c.group for c in cases] == [E.INFERENCE, E.TRAINING]
    for c in cases:
        assert "|" not in c.name
        assert (c.params["d_model"], c.params["layers"], c.params["gemm_n"]) == (32, 2, 256)
        assert c.params["M"] == 17 and c.params["T"] == sum(E.draw_lengths(TINY))
    assert cases[0].params["dropout"] == 0.0 and cases[1].params["dropout"] == 0.1


def test_gpu_cases():
    """The contract's workloads; listing cases allocates nothing on the device."""
    gpu = Config(torch.device("cuda"))
    suite = SUITES["encoder"]
    cases = suite.cases(gpu)
    shapes = [(c.group, c.params["B"], c.params["lengths"]) for c in cases]
    assert shapes == [
        (E.INFERENCE, 256, "uniform"),
        (E.INFERENCE, 1000, "uniform"),
        (E.INFERENCE, 64, "lognormal"),
        (E.TRAINING, 1000, "uniform"),
        (E.TRAINING, 64, "lognormal"),
    ]
    for c in cases:
        p = c.params
        assert (p["d_model"], p["nhead"], p["dim_feedforward"], p["layers"]) == (768, 12, 3072, 12)
        assert p["dtype"] == "bf16" and p["gemm_n"] == 8192
        if p["lengths"] == "uniform":
            assert (p["min_len"], p["max_len"], p["M"]) == (8, 32, 32) and 8 <= p["mean_len"] <= 32
        else:
            assert p["M"] == 512 and 110 <= p["mean_len"] <= 150  # the distribution's mean is about 137
    assert [c.params["B"] for c in suite.cases(Config(torch.device("cuda"), quick=True))] == [64, 64]
    assert {c.params["dtype"] for c in suite.cases(Config(torch.device("cuda"), dtypes=(torch.float16,)))} == {"fp16"}


@pytest.fixture(scope="module")
def cpu_rows():
    """One run of the suite's CPU cases, shared, on one thread as ``python -m bench`` runs
    them on CPU. Without dropout: under TRITON_INTERPRET=1 (these tests) ragged's dropout
    masks come from an interpreted Triton kernel, seconds per step
    (:func:`test_train_step_checks_first_then_trains` runs one step with dropout)."""
    suite = SUITES["encoder"]
    threads, dropout = torch.get_num_threads(), suite.dropout
    torch.set_num_threads(1)
    suite.dropout = 0.0
    try:
        return run_suite(suite, FAST, CEILING)
    finally:
        torch.set_num_threads(threads)
        suite.dropout = dropout


def test_encoder_suite_on_cpu(cpu_rows):
    suite, rows = SUITES["encoder"], cpu_rows
    cases = suite.cases(FAST)
    assert not [(r.case, r.impl, r.reason) for r in rows if r.status != "ok"]
    lengths = E.draw_lengths(TINY)
    for case, expected in zip(cases, (INFERENCE_ROWS, TRAINING_ROWS)):
        backward = case.group == E.TRAINING
        case_rows = {r.impl: r for r in rows if r.case == case.name}
        ceiling = case_rows.pop(E.gemm_ceiling_name(256, torch.float32))
        assert list(case_rows) == expected
        assert ceiling.flops == 2 * 256**3
        assert ceiling.tflops == pytest.approx(ceiling.flops / (ceiling.median_ms * 1e-3) / 1e12)
        padded, dense = case_rows[E.PADDED], case_rows[E.DENSE]
        for r in case_rows.values():
            assert r.flops == E.encoder_flops(lengths, TINY.model, backward) and r.tflops > 0
            assert r.extra[E.VS_PADDED] == pytest.approx(padded.median_ms / r.median_ms)
            assert r.extra[E.VS_DENSE] == pytest.approx(dense.median_ms / r.median_ms)
            assert r.extra[E.PCT_GEMM] == pytest.approx(100 * r.tflops / ceiling.tflops)
        baselines = {n for n in expected if case_rows[n].kind == "baseline"}
        assert baselines == ({E.PADDED, E.PADDED_FAST, E.NESTED} if not backward else {E.PADDED})
        assert set(case_rows[E.RAGGED].speedup) == baselines
    md = report.markdown(suite, rows, ENV, CEILING)
    assert f"| {E.VS_PADDED} | {E.VS_DENSE} | {E.PCT_GEMM} |" in md and "`ragged (padded in/out)`" in md


def test_flops_by_hand():
    # lengths 2 and 3, d=4, ff=8, 2 layers. One layer: GEMMs 2*5*(4*16 + 2*32) = 1280,
    # attention 4*(4 + 9)*4 = 208.
    model = E.Model(d_model=4, nhead=2, dim_feedforward=8, layers=2)
    assert E.encoder_flops([2, 3], model, backward=False) == 2 * (1280 + 208) == 2976
    assert E.encoder_flops([2, 3], model, backward=True) == 3 * 2976
    bert = E.BERT_BASE
    per_token_layer = 2 * (4 * 768**2 + 2 * 768 * 3072)  # 2 flops per weight per token
    assert E.encoder_flops([1], bert, False) == 12 * (per_token_layer + 4 * 768)


def _wrong_by_one(self, src, *args, **kwargs):
    out = ORIGINAL_FORWARD(self, src, *args, **kwargs)
    if isinstance(out, ragged.RaggedTensor):
        return out.with_values(out.values + 1.0)
    return out + 1.0


ORIGINAL_FORWARD = rnn.TransformerEncoder.forward


def test_gate_rejects_wrong_output(monkeypatch):
    suite = SUITES["encoder"]
    monkeypatch.setattr(rnn.TransformerEncoder, "forward", _wrong_by_one)
    rows = run_suite(suite, FAST, CEILING)
    for r in rows:
        if r.kind == "ragged":
            assert r.status == "failed" and r.median_ms is None
            assert r.reason.startswith("wrong output: out max abs error"), r.reason
        else:
            assert r.status == "ok", (r.impl, r.reason)


def _wrong_gradient(self, src, *args, **kwargs):
    """The right output, half its gradient."""
    out = ORIGINAL_FORWARD(self, src, *args, **kwargs)
    values = out.values
    return out.with_values(values.detach() + 0.5 * (values - values.detach()))


def test_gate_rejects_wrong_gradients(monkeypatch):
    suite = SUITES["encoder"]
    monkeypatch.setattr(rnn.TransformerEncoder, "forward", _wrong_gradient)
    training = [c for c in suite.cases(FAST) if c.group == E.TRAINING]
    rows = run_suite(suite, FAST, CEILING, cases=training)
    ragged_row = next(r for r in rows if r.impl == E.RAGGED)
    assert ragged_row.status == "failed" and "out max abs error" not in ragged_row.reason
    assert "d layers.0." in ragged_row.reason and ragged_row.reason.endswith(" more")  # more than three failed
    assert all(r.status == "ok" for r in rows if r.kind != "ragged")


def test_bound_is_relative_to_torch_error():
    p = E.Problem.make(SMALL, CPU)
    ref = (torch.ones(sum(p.lengths), SMALL.model.d_model),)
    compare = E.make_compare(("out",), p, tol=1e-3, torch_error={"out": 0.1})
    assert compare(ref[0] + 0.29, ref) is None  # < 3 x torch's error
    assert "out max abs error 0.31 > 0.3" in compare(ref[0] + 0.31, ref)
    assert "max abs error nan" in compare(ref[0] * float("nan"), ref)
    no_torch_error = E.make_compare(("out",), p, tol=1e-3, torch_error={"out": 0.0})
    assert no_torch_error(ref[0] + 0.0009, ref) is None and no_torch_error(ref[0] + 0.0011, ref) is not None
    assert "padded output of shape" in compare(torch.zeros(1, 1, 8), ref)


def test_train_step_checks_first_then_trains():
    p = E.Problem.make(SMALL, CPU)
    m = E.Models.make(SMALL.model, SMALL.dtype, CPU, dropout=0.5)
    m.train(True)
    step = next(i for i in E.training_impls(m, p) if i.name == E.RAGGED).fn
    first = step()
    assert len(first) == 1 + len(m.params) and first[0].shape == p.values.shape
    assert m.ragged.training  # the check ran in eval mode and put the mode back
    again = E.TrainStep(m.ragged, step.step, step.check)()
    torch.testing.assert_close(again[1:], first[1:])  # no dropout in the check: deterministic
    grads = step()
    assert len(grads) == len(m.params)
    assert not all(torch.equal(a, b) for a, b in zip(grads, first[1:]))  # dropout in the step


def test_models_share_parameters():
    m = E.Models.make(SMALL.model, SMALL.dtype, CPU, dropout=0.1)
    ids = [id(x) for x in m.params]
    assert [id(x) for x in m.padded.parameters()] == ids
    assert {id(x) for x in m.ragged.parameters()} == set(ids)
    layers = m.padded.layers
    assert not torch.equal(layers[0].linear1.weight, layers[1].linear1.weight)  # each layer its own weights
    assert m.nested.use_nested_tensor and not m.padded.use_nested_tensor


@pytest.mark.parametrize("backward", [False, True])
def test_reference_chunks(monkeypatch, backward):
    """The reference run a few sequences at a time equals one call over the whole batch."""
    p = E.Problem.make(TINY, CPU)
    m = E.Models.make(TINY.model, TINY.dtype, CPU, dropout=0.1)
    m.train(False)
    whole = E.reference_outputs(m, p, backward)
    from bench.suites import encoder_problem

    monkeypatch.setattr(encoder_problem, "REFERENCE_TOKENS", 20)  # one or two sequences per chunk
    chunked = E.reference_outputs(m, p, backward)
    assert len(whole) == len(chunked) == (1 + len(m.params) if backward else 1)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


def _ops(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def test_torch_paths_taken():
    """padded: plain ops; padded fast path: the fused layer, no nested tensor; torch nested:
    the nested tensor; dense: the fused layer."""
    p = E.Problem.make(SMALL, CPU)
    m = E.Models.make(SMALL.model, SMALL.dtype, CPU, dropout=0.1)
    m.train(False)
    impls = {i.name: i.fn for i in E.inference_impls(m, p)}
    fused, nested = "aten::_transformer_encoder_layer_fwd", "aten::_nested_tensor_from_mask"
    plain = _ops(impls[E.PADDED])
    assert fused not in plain and nested not in plain
    assert torch.backends.mha.get_fastpath_enabled()  # put back after the call
    fast = _ops(impls[E.PADDED_FAST])
    assert fused in fast and nested not in fast
    assert {fused, nested} <= _ops(impls[E.NESTED])
    assert fused in _ops(impls[E.DENSE])
    assert fused not in _ops(next(i for i in E.training_impls(m, p) if i.name == E.PADDED).fn)


def test_dropout_is_a_suite_parameter(monkeypatch):
    suite = SUITES["encoder"]
    monkeypatch.setattr(suite, "dropout", 0.25)
    training = [c for c in suite.cases(FAST) if c.group == E.TRAINING]
    assert training[0].params["dropout"] == 0.25
    wl = suite.build(training[0], FAST)
    step = next(i for i in wl.impls if i.name == E.RAGGED).fn
    assert step.module.layers[0].dropout.p == 0.25 and step.module.training


def test_gpu_clocks_reads_nvidia_smi_and_gives_up_quietly(monkeypatch):
    import subprocess
    import types

    from bench import env

    assert env.gpu_clocks(torch.device("cpu")) == {}
    monkeypatch.setattr(env, "_SMI_BROKEN", [])
    monkeypatch.setattr(env.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid="abc-123"))
    calls = []

    def answer(text):
        def run(cmd, **kwargs):
            calls.append(cmd[1])
            return subprocess.CompletedProcess(cmd, 0, stdout=text(cmd[1]), stderr="")

        return run

    monkeypatch.setattr(env.subprocess, "run", answer(lambda target: "1755, 412.37\n"))
    assert env.gpu_clocks(torch.device("cuda", 0)) == {"SM MHz": 1755.0, "W": 412.37}
    assert calls == ["--id=GPU-abc-123"]
    calls.clear()
    # the UUID not known to nvidia-smi: the index next; nothing readable: no values
    monkeypatch.setattr(env.subprocess, "run", answer(lambda target: "" if "GPU-" in target else "990, 700.1\n"))
    assert env.gpu_clocks(torch.device("cuda", 0)) == {"SM MHz": 990.0, "W": 700.1}
    assert calls == ["--id=GPU-abc-123", "--id=0"]
    monkeypatch.setattr(env, "_SMI_BROKEN", [])
    monkeypatch.setattr(env.subprocess, "run", answer(lambda target: "[N/A], [N/A]\n"))
    assert env.gpu_clocks(torch.device("cuda", 0)) == {}
    calls.clear()
    monkeypatch.setattr(env.subprocess, "run", answer(lambda target: "1755, 412.37\n"))
    assert env.gpu_clocks(torch.device("cuda", 0)) == {} and calls == []  # not asked again


def test_gpu_busy_ms_is_none_off_cuda():
    from bench import harness

    assert harness.gpu_busy_ms(lambda: torch.ones(3), torch.device("cpu")) is None


@pytest.mark.gpu
def test_gpu_busy_ms_is_the_kernel_time_without_host_gaps():
    import time

    from bench import harness

    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev)
    timing = harness.Timing(10, 50)
    gemm = harness.median_ms(lambda: a @ a, dev, timing)
    busy = harness.gpu_busy_ms(lambda: a @ a, dev)
    # the kernel's time, within what other processes sharing the GPU (pytest -n) make of it
    assert 0.5 * gemm <= busy <= 2.0 * gemm, (busy, gemm)

    def gappy():  # two GEMMs with 20 ms of host time between them
        b = a @ a
        torch.cuda.synchronize()
        time.sleep(0.02)
        return b @ a

    assert harness.gpu_busy_ms(gappy, dev) <= 3 * max(gemm, busy)  # the 20 ms gap would count otherwise


def test_gpu_busy_is_opt_in(monkeypatch):
    """The profiler slows every later launch of the process: never in a timed run by default."""
    calls = []
    monkeypatch.setattr(E, "gpu_clocks", lambda device: {})
    monkeypatch.setattr(E, "gpu_busy_ms", lambda fn, device: calls.append(fn) or 1.5)
    impl = E.Impl("ragged", "ragged", lambda: None)
    monkeypatch.delenv("BENCH_GPU_BUSY", raising=False)
    assert E.row_diagnostics(impl, torch.device("cuda")) == {} and calls == []
    monkeypatch.setenv("BENCH_GPU_BUSY", "1")
    assert E.row_diagnostics(impl, torch.device("cuda")) == {E.GPU_BUSY: 1.5} and len(calls) == 1
