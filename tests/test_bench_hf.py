"""The hf suite of the benchmark harness (``bench/suites/hf.py``) on CPU: tiny models in float32."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import ragged  # noqa: E402
import ragged.nn as rnn  # noqa: E402
from bench import report  # noqa: E402
from bench.harness import SUITES, Config, Timing, run_suite  # noqa: E402
from bench.suites import hf as H  # noqa: E402

CPU = torch.device("cpu")
FAST = Config(CPU, quick=True, timing=Timing(warmup_ms=0, rep_ms=0, min_reps=1))
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
HAS_ST = importlib.util.find_spec("sentence_transformers") is not None
SKIPPED_ON_CPU = (
    H.HF_COMPILED,
    H.HF_EAGER_COMPILED,
    H.ST_FA2,
    H.HF_FA2,
    H.RAG_GRAPHED_DATA,
    H.RAG_GRAPHED_SORTED,
    H.RAG_GRAPHED_8,
    H.RAG_ST_GRAPHED,
    H.ST_COMPILED_32,
    H.RAG_ST_GRAPHED_32,
    H.RAG_GRAPHED_TRAIN,
)
GRAPHED = tuple(name for name in SKIPPED_ON_CPU if "graphed" in name)


@pytest.fixture(autouse=True)
def no_variables(monkeypatch):
    monkeypatch.delenv(H.MODEL_VARIABLE, raising=False)
    monkeypatch.delenv(H.WORKLOADS_VARIABLE, raising=False)


def run(cases=None):
    """The suite on CPU as ``python -m bench`` runs it there (one thread), without dropout: under
    TRITON_INTERPRET=1 (these tests) ragged's dropout masks come from an interpreted kernel."""
    suite = SUITES["hf"]
    threads, dropout = torch.get_num_threads(), suite.dropout
    torch.set_num_threads(1)
    suite.dropout = 0.0
    try:
        return run_suite(suite, FAST, None, cases=cases)
    finally:
        torch.set_num_threads(threads)
        suite.dropout = dropout


@pytest.fixture(scope="module")
def cpu_rows():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(H.MODEL_VARIABLE, raising=False)
        mp.delenv(H.WORKLOADS_VARIABLE, raising=False)
        return run()


def test_registered():
    suite = SUITES["hf"]
    assert list(SUITES).index("encoder") < list(SUITES).index("hf")
    assert not suite.memory_bound and suite.speedup_table and suite.dropout == 0.1


def test_cpu_cases():
    cases = SUITES["hf"].cases(FAST)
    assert [c.group for c in cases] == [H.EMBEDDING, H.FINE_TUNE, H.CAUSAL_LM, H.MODERN, H.MPNET, H.DECODER]
    for case, shape in zip(cases, H.CPU_SHAPES):
        batches = H.case_lengths(shape)
        flat = [n for b in batches for n in b]
        assert case.params["T"] == sum(flat) and case.params["dtype"] == "fp32"
        if isinstance(shape.lengths, H.Corpus):  # the trained tokenizer's lengths of the corpus' first texts
            tokenizer = shape.lengths.tokenizer()
            assert flat == [len(tokenizer(t, truncation=True)["input_ids"]) for t in shape.lengths.texts(shape.count)]
            assert case.params["M"] == max(flat) <= tokenizer.model_max_length and case.params["texts"] == len(flat)
        else:
            assert case.params["M"] == max(flat) <= shape.lengths.hi and min(flat) >= shape.lengths.lo
    assert cases[0].params["checkpoint"] == "random weights" and cases[0].params["texts"] == 48
    lm = cases[2].params
    assert lm["padded_tokens"] >= lm["T"] and lm["real_fraction"] == round(lm["T"] / lm["padded_tokens"], 4)


def test_gpu_cases():
    """The GPU workloads; listing cases allocates nothing on the device."""
    suite = SUITES["hf"]
    cases = suite.cases(Config(torch.device("cuda")))
    assert [c.group for c in cases] == [
        H.EMBEDDING,
        H.EMBEDDING,
        H.FINE_TUNE,
        H.CAUSAL_LM,
        H.MODERN,
        H.MPNET,
        H.DECODER,
    ]
    assert {c.params["dtype"] for c in cases} == {"bf16"}
    decoder = cases[-1].params
    assert 550e6 <= H.QWEN3_06B.params() <= 650e6 and decoder["model"] == H.QWEN3_06B.name()
    assert (decoder["texts"], decoder["batch"]) == (4096, 32) and 10 <= decoder["mean_len"] <= 60
    minilm, base = cases[0].params, cases[1].params
    assert minilm["model"] == H.Bert(6, 384, 12, 1536).name() and base["model"] == H.Bert(12, 768, 12, 3072).name()
    for p in (minilm, base):
        assert (p["texts"], p["batch"], p["M"]) == (15000, 256, 256) and 28 <= p["mean_len"] <= 40
    lengths = H.case_lengths(H.GPU_SHAPES[0])[0]
    assert 23 <= np.median(lengths) <= 27 and min(lengths) == 3  # long-tailed: median 25, up to 256
    tune = H.case_lengths(H.GPU_SHAPES[2])
    assert [len(b) for b in tune] == [32] * 8 and 16 <= min(map(min, tune)) and max(map(max, tune)) == 512
    lm = H.case_lengths(H.GPU_SHAPES[3])
    assert len(lm) == 4 and all(sum(b) <= 8192 or len(b) == 1 for b in lm)
    assert 0.45e9 <= cases[3].params["params"] <= 0.55e9 and cases[3].params["gradient_checkpointing"] is False
    modern = H.case_lengths(H.GPU_SHAPES[4])[0]  # long-tailed: 16..1024, median 128
    assert min(modern) == 16 and max(modern) == 1024 and 110 <= np.median(modern) <= 145
    assert (cases[4].params["texts"], cases[4].params["batch"]) == (2048, 32)
    quick = suite.cases(Config(torch.device("cuda"), quick=True))
    assert [(c.group, c.params.get("texts"), c.params.get("steps")) for c in quick] == [
        (H.EMBEDDING, 3000, None),
        (H.FINE_TUNE, None, 4),
        (H.CAUSAL_LM, None, 2),
        (H.MODERN, 512, None),
        (H.MPNET, 3000, None),
        (H.DECODER, 1024, None),
    ]
    fp16 = suite.cases(Config(torch.device("cuda"), dtypes=(torch.float16,)))
    assert {c.params["dtype"] for c in fp16} == {"fp16"}


def test_workload_variable(monkeypatch):
    suite = SUITES["hf"]
    monkeypatch.setenv(H.WORKLOADS_VARIABLE, "lm, fine-tune")
    assert [c.group for c in suite.cases(FAST)] == [H.FINE_TUNE, H.CAUSAL_LM]
    monkeypatch.setenv(H.WORKLOADS_VARIABLE, "lm,encoder")
    with pytest.raises(ValueError, match=f"{H.WORKLOADS_VARIABLE}: expected workloads among .*got encoder"):
        suite.cases(FAST)


def test_suite_on_cpu(cpu_rows):
    suite, rows = SUITES["hf"], cpu_rows
    cases = suite.cases(FAST)
    for case in cases:
        case_rows = {r.impl: r for r in rows if r.case == case.name}
        assert list(case_rows) == [name for name, _ in H.ROWS[case.group]]
        for r in case_rows.values():
            if r.impl in SKIPPED_ON_CPU or (not HAS_ST and "ST" in r.impl):
                assert r.status == "skipped", (r.impl, r.status, r.reason)
                if r.impl in GRAPHED:  # no graph to replay off CUDA: skipped, never timed eagerly
                    assert r.reason == H.GRAPHS_ON_CUDA and r.median_ms is None, (r.impl, r.reason)
                continue
            assert r.status == "ok", (r.impl, r.reason)
            assert r.flops and r.tflops == pytest.approx(r.flops / (r.median_ms * 1e-3) / 1e12)
            if case.group in (H.EMBEDDING, *H.EMBEDDERS):
                assert float(r.extra[H.COSINE]) >= 1 - 1e-6  # fp32 against fp32
                assert r.extra[H.TEXTS_S] == pytest.approx(case.params["texts"] / (r.median_ms / 1e3))
            else:
                assert float(r.extra[H.LOSS_DIFF]) <= 1e-5
                assert r.extra[H.STEP_MS] == pytest.approx(r.median_ms / case.params["steps"])
                assert r.extra[H.TOKENS_S] == pytest.approx(case.params["T"] / (r.median_ms / 1e3))
                if r.kind == "ragged":  # the same steps from the same weights as HF padded
                    assert float(r.extra[H.LOSS_VS_HF]) <= 1e-5
            if r.kind == "ragged":  # over the baselines that ran and do the same work (VERSUS), only
                ran = {b for b, row in case_rows.items() if row.kind == "baseline" and row.status == "ok"}
                same = H.VERSUS.get(case.group, {}).get(r.impl)
                assert set(r.speedup) == (ran if same is None else ran & set(same)), (r.impl, r.speedup)
                assert r.versus == (None if same is None else list(same))
        for rag, _, _ in H.TARGETS_BY_WORKLOAD[case.group]:  # GPU targets: not judged on CPU
            if case_rows[rag].status == "ok":
                text = case_rows[rag].extra[H.TARGETS]
                assert text.startswith("GPU targets, not evaluated on CPU") and "MISSED" not in text
    embedding = [r for r in rows if r.group == H.EMBEDDING and r.kind == "ragged" and r.status == "ok"]
    assert embedding and all("cos>=0.9999: met" in r.extra[H.TARGETS] for r in embedding)
    md = report.markdown(suite, rows, ENV, None)
    assert f"| {H.COSINE} |" in md and f"`{H.RAG_BUDGET_SORTED}`" in md and "torch.compile" in md


def test_ragged_rows_are_compared_with_baselines_of_the_same_work():
    """A batch-8 row against the batch-8 baseline only; the rows on tokenized batches against the
    HuggingFace rows of those batches, not the sentence-transformers rows (texts in, other batches)."""
    for workload, rows in H.ROWS.items():
        impls = {i.name: i for i in H.assemble(workload, dict.fromkeys((name for name, _ in rows), "skip"))}
        for name, kind in rows:
            versus = impls[name].versus
            if kind == "baseline" or versus is None:
                assert versus is None or kind == "ragged"
                continue
            assert set(versus) <= {n for n, k in rows if k == "baseline"}, (workload, name, versus)
            batch = [word for word in name.split() if word.isdigit()]  # "batch 8", "batch 256", ...
            for base in versus:
                if batch or "ST encode" not in base:  # texts in by ragged.embed: any ST batch size
                    assert [w for w in base.split() if w.isdigit()] in ([], batch), (workload, name, base)
                assert ("ST encode" in base) == ("ST encode" in name or "embed" in name), (workload, name, base)
    embedding = {i.name: i for i in H.assemble(H.EMBEDDING, dict.fromkeys((n for n, _ in H.ROWS[H.EMBEDDING]), "-"))}
    assert embedding[H.RAG_DATA_8].versus == (H.HF_DATA_8,) and embedding[H.RAG_GRAPHED_8].versus == (H.HF_DATA_8,)
    assert H.HF_DATA_8 not in embedding[H.RAG_DATA].versus


def test_params_and_flops_by_hand():
    from transformers import LlamaForCausalLM

    m = H.TINY_LLAMA
    model = LlamaForCausalLM(m.config())
    assert m.params() == sum(p.numel() for p in model.parameters())
    linears = sum(mod.weight.numel() for mod in model.modules() if isinstance(mod, torch.nn.Linear))
    assert m.matmul_params() == linears
    # lengths 2 and 3: 5 tokens; attention 2 * (4 + 9) * hidden per layer; x3 with the backward
    assert H.lm_flops([[2, 3]], m) == 3 * (2 * 5 * linears + 2 * m.layers * m.hidden * 13)
    assert H.lm_flops([[2], [3]], m) == H.lm_flops([[2, 3]], m)


def test_texts_tokenize_to_their_lengths():
    tokenizer = H.word_tokenizer(1000)
    gen = torch.Generator().manual_seed(7)
    lengths = [3, 4, 511, *torch.randint(3, 60, (37,), generator=gen).tolist()]
    texts = H.make_texts(tokenizer, lengths, seed=11)
    data = H.Texts(tokenizer, texts, CPU)
    assert data.lengths.tolist() == lengths and data.keys == ("input_ids", "token_type_ids")
    ids = data.features[2]["input_ids"]
    assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
    assert tokenizer.unk_token_id not in np.concatenate([f["input_ids"] for f in data.features])
    assert H.make_texts(tokenizer, lengths, seed=11) == texts != H.make_texts(tokenizer, lengths, seed=12)


def test_pad_batch():
    seqs = [
        {"input_ids": [], "token_type_ids": []},
        {"input_ids": [5], "token_type_ids": [1]},
        {"input_ids": [7, 8, 9, 4, 2], "token_type_ids": [0, 0, 1, 1, 1]},
        {"input_ids": np.array([3, 6]), "token_type_ids": np.array([1, 0])},
    ]
    b = H.pad_batch(seqs, ("input_ids", "token_type_ids"), pad_id=99, labels=True)
    assert all(t.shape == (4, 5) and t.dtype == torch.int64 for t in b.values())
    for i, s in enumerate(seqs):
        n = len(s["input_ids"])
        assert b["input_ids"][i, :n].tolist() == list(s["input_ids"]) and set(b["input_ids"][i, n:].tolist()) <= {99}
        assert b["token_type_ids"][i, :n].tolist() == list(s["token_type_ids"]) and not b["token_type_ids"][i, n:].any()
        assert b["attention_mask"][i].tolist() == [1] * n + [0] * (5 - n)
        assert b["labels"][i].tolist() == list(s["input_ids"]) + [-100] * (5 - n)


def test_gates():
    """Each workload's gate passes its reference and rejects a wrong or NaN output."""
    embedding = H.build_embedding(H.CPU_SHAPES[0], CPU, None)
    ref = embedding.reference
    assert embedding.compare(ref.clone(), ref) is None
    assert "min cosine" in embedding.compare(ref.roll(1, 0), ref)
    assert "min cosine" in embedding.compare(ref * float("nan"), ref)
    assert "expected" in embedding.compare(ref[1:], ref)
    shape = H.CPU_SHAPES[1]
    tune = H.build_fine_tune(shape, CPU, 0.0)
    loss = tune.reference
    assert tune.compare(torch.tensor([loss, 0.0]), loss) is None
    assert "step-1 loss" in tune.compare(torch.tensor([loss * (1 + 1e-3), loss]), loss)
    assert "step-1 loss" in tune.compare(torch.tensor([float("nan"), loss]), loss)


def _refuse(*args, **kwargs):
    raise NotImplementedError("refused for the test")


def test_broken_rows_are_reported(monkeypatch):
    """A ragged row whose setup fails is failed with the reason; the baselines still run; a case
    that cannot be built gives every row the reason and the next case still runs."""
    suite = SUITES["hf"]
    tune, lm = [c for c in suite.cases(FAST) if c.group in (H.FINE_TUNE, H.CAUSAL_LM)]
    monkeypatch.setattr(rnn, "convert", _refuse)
    rows = {r.impl: r for r in run([tune])}
    assert rows[H.RAGGED].status == "failed" and "ragged.nn.convert failed" in rows[H.RAGGED].reason
    assert "refused for the test" in rows[H.RAGGED].reason and rows[H.HF_PADDED].status == "ok"
    monkeypatch.undo()
    monkeypatch.setattr(H, "build_fine_tune", _refuse)
    rows = run([tune, lm])
    for r in rows:
        if r.group == H.FINE_TUNE:
            assert r.status == ("failed" if r.kind == "ragged" else "skipped") and "case not built" in r.reason
        else:
            assert r.status == "ok" or r.impl == H.HF_FA2, (r.impl, r.reason)


def test_gate_rejects_wrong_embeddings(monkeypatch):
    """ragged.pool a little off: the ragged rows (all pool with it) fail their check."""
    suite = SUITES["hf"]
    original = ragged.pool
    monkeypatch.setattr(ragged, "pool", lambda rt, mode="mean": original(rt, mode) + 0.05 * rt.values.std())
    rows = run([c for c in suite.cases(FAST) if c.group == H.EMBEDDING])
    for r in rows:
        if r.kind == "ragged" and (HAS_ST or "ST" not in r.impl) and r.impl not in SKIPPED_ON_CPU:
            assert r.status == "failed" and r.reason.startswith("wrong output: min cosine"), (r.impl, r.reason)
        else:
            assert r.status in ("ok", "skipped"), (r.impl, r.reason)


def test_checkpoint_variable(monkeypatch, tmp_path):
    """BENCH_HF_MODEL: the first embedding case loads the folder (model and tokenizer)."""
    from transformers import BertModel

    torch.manual_seed(3)
    with H.quiet():
        BertModel(H.TINY_BERT.config()).save_pretrained(tmp_path)
        H.word_tokenizer(H.TINY_BERT.vocab).save_pretrained(tmp_path)
    monkeypatch.setenv(H.MODEL_VARIABLE, str(tmp_path))
    monkeypatch.setenv(H.WORKLOADS_VARIABLE, "embedding")
    (case,) = SUITES["hf"].cases(FAST)
    assert case.params["checkpoint"] == str(tmp_path) and case.params["model"] == H.TINY_BERT.name()
    assert case.name.startswith(f"{H.EMBEDDING} {tmp_path.name} fp32")
    rows = run([case])
    assert all(r.status == "ok" for r in rows if r.impl not in SKIPPED_ON_CPU and (HAS_ST or "ST" not in r.impl))
    monkeypatch.setenv(H.MODEL_VARIABLE, os.path.join(tmp_path, "missing"))
    (row,) = run(SUITES["hf"].cases(FAST))
    assert row.kind == "case" and row.status == "skipped" and H.MODEL_VARIABLE in row.reason


@pytest.mark.gpu
def test_gpu_paths_at_tiny_size(monkeypatch):
    """The GPU-only paths (bf16, torch.compile, fused AdamW, peak memory, the flash-attention rows'
    skip or run) on the tiny CPU models, before a full run spends minutes on them."""
    tiny = tuple(dataclasses.replace(s, dtype=torch.bfloat16) for s in H.CPU_SHAPES)
    monkeypatch.setattr(H, "GPU_SHAPES", tiny)
    gpu = Config(torch.device("cuda"), timing=Timing(warmup_ms=1, rep_ms=5, settle_rep_ms=1, settle_max_s=0.1))
    rows = run_suite(SUITES["hf"], gpu, None)
    assert not [(r.case, r.impl, r.reason) for r in rows if r.status == "failed"]
    flash = importlib.util.find_spec("flash_attn") is not None
    for r in rows:
        if r.impl in (H.ST_FA2, H.HF_FA2) and not flash:
            assert r.status == "skipped" and "flash_attn" in r.reason
        else:
            assert r.status == "ok", (r.impl, r.reason)
        if r.status == "ok" and r.group not in (H.EMBEDDING, *H.EMBEDDERS):  # inference rows measure no peak
            assert r.extra[H.PEAK] > 0
