"""Regressions of ragged.nn.convert on HuggingFace models on the GPU: inference in bf16 after
weights are written through ``.data`` (eager and CUDA-graph replays), and
``torch.nn.DataParallel`` / ``torch.nn.parallel.replicate`` over two GPUs, each replica on its
own device with its own parameters (HuggingFace models and converted SentenceTransformers), and
one graphed model called from several threads.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise); the two-GPU tests skip
with fewer than two GPUs. The oracle is the HuggingFace model in float64 with the same weights,
compared by the rule of tests/test_gpu_hf_convert.py (the converted model's error at most twice
HuggingFace's own in the same dtype, plus a floor)."""

from __future__ import annotations

import concurrent.futures
import copy
import importlib
import sys
import threading

import pytest
import torch
from hf_convert_cases import _randomise
from test_gpu_hf_convert import _batch, _close, _models, _values

import ragged

tf = pytest.importorskip("transformers")

pytestmark = pytest.mark.gpu

two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")


def _write_through_data(oracle, theirs, ours, seed: int) -> None:
    """An EMA step toward a fresh set of weights on the float64 oracle, copied into the two
    bf16 models through ``.data`` (which changes no version counter and no address)."""
    student = copy.deepcopy(oracle)
    _randomise(student, seed)
    for o, s in zip(oracle.parameters(), student.parameters()):
        o.data.mul_(0.5).add_(s.data, alpha=0.5)
    for o, t, u in zip(oracle.parameters(), theirs.parameters(), ours.parameters()):
        t.data.copy_(o.data)
        u.data.copy_(o.data)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_gpu_bf16_inference_sees_weights_written_through_data(family, mode):
    dtype = torch.bfloat16
    oracle, theirs, ours = _models(family, "base", dtype)
    ids, mask = _batch()
    rt = ragged.pack([row[m.bool()] for row, m in zip(ids, mask)])
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode

    def check():
        with context():
            want = oracle(input_ids=ids, attention_mask=mask).last_hidden_state
            hf = theirs(input_ids=ids, attention_mask=mask).last_hidden_state
            padded = ours(input_ids=ids, attention_mask=mask).last_hidden_state
            packed = ours(input_ids=rt).last_hidden_state
        for got in (padded, packed):
            _close(_values(got, mask), _values(hf, mask), _values(want, mask), dtype, "last_hidden_state")
        return _values(packed, mask).float()

    before = check()
    _write_through_data(oracle, theirs, ours, 31)
    after = check()
    assert (after - before).abs().max() > 0.1  # the update moved the output far past bf16 rounding


def test_gpu_graph_replays_see_weights_written_through_data():
    """A graph captures the concatenation of Q, K and V: a replay after a ``.data`` write reads
    the new weights (the graphs hold the parameters' addresses, which such a write keeps)."""
    dtype = torch.bfloat16
    oracle, theirs, ours = _models("bert", "base", dtype)
    g = ragged.nn.graphed(ours, max_tokens=512, max_batch_size=16)
    ids, mask = _batch()
    rt = ragged.pack([row[m.bool()] for row, m in zip(ids, mask)])
    for step in range(2):
        if step:
            _write_through_data(oracle, theirs, ours, 32)
        with torch.no_grad():
            want = oracle(input_ids=ids, attention_mask=mask).last_hidden_state
            hf = theirs(input_ids=ids, attention_mask=mask).last_hidden_state
        got = g(input_ids=rt).last_hidden_state
        _close(got.values, _values(hf, mask), _values(want, mask), dtype, f"replay {step}")


@two_gpus
@pytest.mark.parametrize("kind", ["base", "sequence"])
def test_gpu_replicate_runs_each_replica_on_its_own_device(kind):
    dtype = torch.bfloat16
    oracle, theirs, ours = _models("bert", kind, dtype)
    ids, mask = _batch()
    main = "last_hidden_state" if kind == "base" else "logits"
    replicas = torch.nn.parallel.replicate(ours, [0, 1], detach=True)
    with torch.no_grad():
        want = oracle(input_ids=ids, attention_mask=mask)[main]
        hf = theirs(input_ids=ids, attention_mask=mask)[main]
        for device, replica in enumerate(replicas):
            with torch.cuda.device(device):  # as DataParallel's parallel_apply runs each replica
                got = replica(input_ids=ids.to(device), attention_mask=mask.to(device))[main]
            assert got.device == torch.device("cuda", device)
            _close(
                _values(got.to(want.device), mask), _values(hf, mask), _values(want, mask), dtype, f"replica {device}"
            )


@two_gpus
@pytest.mark.parametrize("kind", ["base", "token", "sequence"])
def test_gpu_data_parallel_matches_hf(kind):
    """DataParallel (what HuggingFace's Trainer wraps a model in on several GPUs): inference
    and a training step's loss and gradients, the batch split over two GPUs."""
    dtype = torch.float32
    oracle, theirs, ours = _models("bert", kind, dtype)
    ids, mask = _batch([37, 3, 130, 1, 64, 9])
    main = "last_hidden_state" if kind == "base" else "logits"
    parallel = torch.nn.DataParallel(ours, device_ids=[0, 1])
    with torch.no_grad():
        want = oracle(input_ids=ids, attention_mask=mask)[main]
        hf = theirs(input_ids=ids, attention_mask=mask)[main]
        got = parallel(input_ids=ids, attention_mask=mask)[main]
    _close(_values(got, mask), _values(hf, mask), _values(want, mask), dtype, main)
    if kind == "base":
        return
    g = torch.Generator().manual_seed(3)
    if kind == "token":
        labels = torch.randint(0, 3, ids.shape, generator=g).cuda().masked_fill(mask == 0, -100)
    else:
        labels = torch.randint(0, 3, (ids.shape[0],), generator=g).cuda()
    grads = {}
    for name, model in (("oracle", oracle), ("theirs", theirs), ("ours", parallel)):
        model.train()  # dropout rates are 0 in these configs
        half = ids.shape[0] // 2  # DataParallel's split: one loss per replica, on its half of the batch
        if name == "ours":
            losses = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            assert losses.shape == (2,)
            loss = losses.sum()
        else:
            loss = sum(
                model(input_ids=ids[s], attention_mask=mask[s], labels=labels[s]).loss
                for s in (slice(0, half), slice(half, None))
            )
        loss.backward()
        target = model.module if name == "ours" else model
        grads[name] = ({n: p.grad for n, p in target.named_parameters() if p.grad is not None}, loss.detach())
    _close(grads["ours"][1], grads["theirs"][1], grads["oracle"][1], dtype, "loss")
    assert grads["ours"][0].keys() == grads["theirs"][0].keys()
    for n, want_grad in grads["oracle"][0].items():
        _close(grads["ours"][0][n], grads["theirs"][0][n], want_grad, dtype, n)


# --------------------------------------------------------------------------------------
# Converted SentenceTransformers under DataParallel; one graphed model from several threads


def _sentence_models(tmp_path, dtype):
    """The GPU sentence tests' module and its (oracle float64, original in ``dtype``, converted in
    ``dtype``) SentenceTransformers with mean pooling over its tiny BERT and tokenizer."""
    pytest.importorskip("sentence_transformers")
    gpu_st = importlib.import_module("test_gpu_hf_sentence")
    (tmp_path / "vocab.txt").write_text("\n".join(gpu_st.VOCAB) + "\n")
    tf.BertTokenizerFast(str(tmp_path / "vocab.txt"), model_max_length=gpu_st.MAXLEN).save_pretrained(str(tmp_path))
    torch.manual_seed(100)
    model = tf.AutoModel.from_config(gpu_st._config("bert"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(tmp_path))
    return gpu_st, gpu_st._models(str(tmp_path), "mean", dtype)


@two_gpus
def test_gpu_data_parallel_sentence_transformer_matches_original(tmp_path):
    """DataParallel over a converted SentenceTransformer (what sentence-transformers' trainer
    gets from HuggingFace's Trainer on several GPUs): st(features) and a training step's loss
    and gradients, the batch split over two GPUs, each replica on its own parameters."""
    dtype = torch.float32
    gpu_st, (oracle, theirs, ours) = _sentence_models(tmp_path, dtype)
    features = theirs.preprocess(gpu_st.GPU_TEXTS)
    features = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in features.items()}
    parallel = torch.nn.DataParallel(ours, device_ids=[0, 1])
    results = {}
    for name, model in (("oracle", oracle), ("theirs", theirs), ("ours", parallel)):
        with torch.no_grad():
            emb = model(dict(features))["sentence_embedding"]
        model.train()  # dropout rates are 0 in these configs
        loss = model(dict(features))["sentence_embedding"].pow(2).sum()
        loss.backward()
        target = model.module if name == "ours" else model
        results[name] = (emb, loss.detach(), {n: p.grad for n, p in target.named_parameters() if p.grad is not None})
    (want, want_loss, want_grads), (hf, hf_loss, hf_grads), (got, got_loss, got_grads) = (
        results[k] for k in ("oracle", "theirs", "ours")
    )
    assert got.device == torch.device("cuda", 0) and got.shape == hf.shape
    _close(got, hf, want, dtype, "sentence_embedding")
    _close(got_loss, hf_loss, want_loss, dtype, "loss")
    # DataParallel's broadcast gives the parameters no replica used (BERT's pooler, which
    # sentence-transformers never reads) zero gradients where the plain module leaves None
    assert hf_grads.keys() <= got_grads.keys()
    for n in got_grads.keys() - hf_grads.keys():
        assert n.split(".")[-3] == "pooler" or ".pooler." in n, n
        assert not got_grads[n].any(), n
    for n, g in want_grads.items():
        _close(got_grads[n], hf_grads[n], g, dtype, n)


def _threads(calls: list, rounds: int) -> list:
    """Each of ``calls`` (functions returning a list of mismatches) from its own thread at once,
    ``rounds`` times, threads switched often; the mismatches of all."""
    barrier = threading.Barrier(len(calls))
    found = []

    def run(call):
        barrier.wait()
        for _ in range(rounds):
            found.extend(call())

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # calls interleave between copying inputs in and reading outputs out
    try:
        with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
            for f in [pool.submit(run, c) for c in calls]:
                f.result()
    finally:
        sys.setswitchinterval(interval)
    return found


def _mismatch(what: str, got: torch.Tensor, want: torch.Tensor) -> list:
    # graph replays and eager calls may differ in the GEMMs' last bits; another batch's values, by far more
    return [] if torch.allclose(got, want, rtol=1e-3, atol=1e-3) else [what]


def test_gpu_graphed_model_from_several_threads():
    """Threads replaying one Graphed model's graphs with batches of the same buckets: each gets
    its own batch's result (the static buffers are taken one call at a time)."""
    _, _, ours = _models("bert", "base", torch.float32)
    g = ragged.nn.graphed(ours, max_tokens=512, max_batch_size=16)
    gen = torch.Generator().manual_seed(40)
    batches = [
        ragged.pack([torch.randint(3, 50, (n,), generator=gen) for n in lengths]).to("cuda")
        for lengths in ([37, 5, 60], [12, 41, 33], [58, 2, 40], [20, 20, 61])
    ]
    with torch.no_grad():
        eager = [ours(input_ids=rt).last_hidden_state.values for rt in batches]
    for rt, want in zip(batches, eager):  # captured here: the threads replay
        assert not _mismatch("capture", g(input_ids=rt).last_hidden_state.values, want)

    def call(i):
        return lambda: _mismatch(f"batch {i}", g(input_ids=batches[i]).last_hidden_state.values, eager[i])

    assert _threads([call(i) for i in range(len(batches))], 50) == []


def test_gpu_graphed_sentence_transformer_from_several_threads(tmp_path):
    """Threads encoding with one graphed converted SentenceTransformer, batches of several sizes:
    each result equals the eager converted model's."""
    dtype = torch.float32
    gpu_st, (_, _, ours) = _sentence_models(tmp_path, dtype)
    eager = copy.deepcopy(ours)
    ragged.nn.graphed(ours, max_tokens=1024, max_batch_size=16)
    texts = gpu_st.GPU_TEXTS
    batches = [texts[i : i + n] for i, n in ((0, 4), (2, 5), (5, 6), (1, 3))]
    want = [eager.encode(b, batch_size=len(b), convert_to_tensor=True) for b in batches]
    for b, w in zip(batches, want):  # captured here: the threads replay
        assert not _mismatch("capture", ours.encode(b, batch_size=len(b), convert_to_tensor=True), w)

    def call(i):
        b = batches[i]
        return lambda: _mismatch(f"batch {i}", ours.encode(b, batch_size=len(b), convert_to_tensor=True), want[i])

    assert _threads([call(i) for i in range(len(batches))], 20) == []
