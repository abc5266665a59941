"""ragged.nn.convert on sentence-transformers models on the GPU, in float16, bfloat16 and float32.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise). Tiny BERT-family models
(hidden 128, 2 heads of 64) with the CPU tests' tokenizer; the oracle is the unconverted model in
float64 on the GPU, and the converted model in ``dtype`` must be as close to it as the
unconverted model in ``dtype``, by flash-attn's rule (tests/test_gpu_hf_convert.py). Also: an
encode batch reads nothing from the GPU inside the model, training gradients, and
(``RAGGED_TEST_MINILM=/path``) all-MiniLM-L6-v2 in float16 against float32.
"""

from __future__ import annotations

import copy
import os
import warnings

import numpy as np
import pytest
import torch

import ragged

tf = pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer import losses  # noqa: E402
from sentence_transformers.sentence_transformer import modules as M
from sentence_transformers.util import batch_to_device  # noqa: E402
from test_hf_sentence import LONG, MODES, TEXTS, VOCAB, WORDS  # noqa: E402  (the CPU tests' tokenizer and texts)

from ragged.nn.hf import sentence as hf_sentence  # noqa: E402

pytestmark = pytest.mark.gpu

D, HEADS, MAXLEN = 128, 2, 160
ATOL = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-3}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
GPU_TEXTS = TEXTS + [LONG * 2, " ".join(WORDS[:37]), "x"]


def _config(family: str):
    if family == "distilbert":
        return tf.DistilBertConfig(
            vocab_size=len(VOCAB),
            dim=D,
            n_layers=2,
            n_heads=HEADS,
            hidden_dim=2 * D,
            max_position_embeddings=MAXLEN,
            dropout=0.0,
            attention_dropout=0.0,
            pad_token_id=0,
        )
    cls = tf.RobertaConfig if family == "roberta" else tf.BertConfig
    return cls(
        vocab_size=len(VOCAB),
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        intermediate_size=2 * D,
        max_position_embeddings=MAXLEN + 2,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )


@pytest.fixture(scope="module")
def gpu_folders(tmp_path_factory):
    out = {}
    for seed, family in enumerate(("bert", "roberta", "distilbert")):
        path = tmp_path_factory.mktemp(f"gpu_{family}")
        (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
        tf.BertTokenizerFast(str(path / "vocab.txt"), model_max_length=MAXLEN).save_pretrained(str(path))
        torch.manual_seed(100 + seed)
        model = tf.AutoModel.from_config(_config(family))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(str(path))
        out[family] = str(path)
    return out


def _models(path: str, mode, dtype, after=()):
    """(oracle float64, original in dtype, converted in dtype), on the GPU, eval mode."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = M.Transformer(path)
    oracle = (
        SentenceTransformer(modules=[tr, M.Pooling(tr.get_embedding_dimension(), mode), *after], device="cuda")
        .double()
        .eval()
    )
    theirs = copy.deepcopy(oracle).to(dtype)
    ours = hf_sentence.convert_sentence_transformer(copy.deepcopy(theirs))
    return oracle, theirs, ours


def _close(got, theirs, want, dtype, what):
    """Flash-attn's rule: our error at most twice the original's in ``dtype`` plus a floor."""
    got, theirs, want = (torch.as_tensor(np.asarray(x)) if not torch.is_tensor(x) else x for x in (got, theirs, want))
    want = want.double().cpu()
    ours_err = (got.double().cpu() - want).abs().max().item()
    their_err = (theirs.double().cpu() - want).abs().max().item()
    floor = max(ATOL[dtype], torch.finfo(dtype).eps) * max(1.0, want.abs().max().item())
    assert ours_err <= 2 * their_err + floor, (what, ours_err, their_err)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_gpu_encode_matches_original(gpu_folders, family, mode, dtype):
    oracle, theirs, ours = _models(gpu_folders[family], mode, dtype, [M.Normalize()])
    want = oracle.encode(GPU_TEXTS, batch_size=4, convert_to_tensor=True)
    hf = theirs.encode(GPU_TEXTS, batch_size=4, convert_to_tensor=True)
    got = ours.encode(GPU_TEXTS, batch_size=4, convert_to_tensor=True)
    assert got.dtype == dtype and got.device.type == "cuda"
    _close(got, hf, want, dtype, "sentence_embedding")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_token_embeddings(gpu_folders, dtype):
    oracle, theirs, ours = _models(gpu_folders["bert"], "mean", dtype)
    want, hf, got = (m.encode(GPU_TEXTS, output_value="token_embeddings", batch_size=5) for m in (oracle, theirs, ours))
    for w, h, g in zip(want, hf, got):
        assert g.shape == w.shape
        _close(g, h, w, dtype, "token_embeddings")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_gpu_encode_batch_does_not_sync(gpu_folders, family, dtype):
    """The forward of an encode batch (packed on the host by preprocess) reads nothing from the GPU."""
    _, _, ours = _models(gpu_folders[family], ("mean", "cls", "max", "weightedmean", "lasttoken"), dtype)
    with hf_sentence.encoding(ours[0].forward, "sentence"):
        batches = [batch_to_device(ours.preprocess(GPU_TEXTS[i : i + 4]), "cuda") for i in range(0, len(GPU_TEXTS), 4)]
    with torch.no_grad():
        ours(copy.copy(batches[0]))  # first call: kernel compilation and tuning may read the GPU
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [ours(features)["sentence_embedding"] for features in batches[1:]]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert all(o.device.type == "cuda" and o.dtype == dtype for o in outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_training_gradients(gpu_folders, dtype):
    """MultipleNegativesRankingLoss on padded features: loss and every parameter's gradient."""
    oracle, theirs, ours = _models(gpu_folders["bert"], "mean", dtype, [M.Dense(D, 32)])
    results = {}
    for name, st in (("oracle", oracle), ("theirs", theirs), ("ours", ours)):
        st.train()
        features = [
            batch_to_device(st.preprocess(GPU_TEXTS[:6]), "cuda"),
            batch_to_device(st.preprocess(GPU_TEXTS[5:11]), "cuda"),
        ]
        loss = losses.MultipleNegativesRankingLoss(st)(features, torch.zeros(0))
        loss.backward()
        results[name] = (loss.detach(), {n: p.grad for n, p in st.named_parameters()})
    _close(results["ours"][0], results["theirs"][0], results["oracle"][0], dtype, "loss")
    for n, g in results["ours"][1].items():
        want = results["oracle"][1][n]
        if want is None:
            assert g is None or torch.all(g == 0), n
            continue
        _close(g, results["theirs"][1][n], want, dtype, f"d {n}")


@pytest.mark.skipif(not os.environ.get("RAGGED_TEST_MINILM"), reason="set RAGGED_TEST_MINILM=/path/to/all-MiniLM-L6-v2")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_gpu_minilm_checkpoint(dtype):
    path = os.environ["RAGGED_TEST_MINILM"]
    oracle = SentenceTransformer(path, device="cuda").float().eval()
    ours = ragged.nn.convert(copy.deepcopy(oracle).to(dtype))
    g = np.random.default_rng(1)
    texts = ["", "a", LONG * 8] + [" ".join(g.choice(WORDS, g.integers(1, 200))) for _ in range(97)]
    want, got = oracle.encode(texts, batch_size=32), ours.encode(texts, batch_size=32)
    cosine = (want * got).sum(1) / np.linalg.norm(want, axis=1) / np.linalg.norm(got, axis=1)
    assert cosine.min() >= (0.99999 if dtype == torch.float32 else 0.999), cosine.min()


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_gpu_graphed_encode_matches_eager(gpu_folders, family, mode):
    """ragged.nn.graphed(st): encode() replays graphs of the model, same embeddings as eager."""
    dtype = torch.bfloat16
    oracle, theirs, ours = _models(gpu_folders[family], mode, dtype, [M.Normalize()])
    eager = ours.encode(GPU_TEXTS, batch_size=4, convert_to_tensor=True)
    assert ragged.nn.graphed(ours, max_tokens=512, max_batch_size=8) is ours
    graphs = ours[0].forward.graphed
    got = ours.encode(GPU_TEXTS, batch_size=4, convert_to_tensor=True)
    again = ours.encode(GPU_TEXTS[::-1], batch_size=4, convert_to_tensor=True)
    assert graphs.num_graphs >= 1
    want = oracle.encode(GPU_TEXTS, batch_size=4, convert_to_tensor=True)
    hf = theirs.encode(GPU_TEXTS, batch_size=4, convert_to_tensor=True)
    _close(got, hf, want, dtype, "graphed sentence_embedding")
    _close(again.flip(0), hf, want, dtype, "graphed sentence_embedding, other batches")
    assert (got.float() - eager.float()).abs().max().item() < 2e-2
    ours[0].forward.graphed = None
    assert ours.encode(GPU_TEXTS[:2], convert_to_tensor=True).shape[0] == 2


def test_gpu_graphed_encode_from_several_threads(gpu_folders):
    """ragged.nn.graphed(st): threads replaying the model's graphs at once each get the embeddings
    of a single-threaded graphed pass (captured first: a capture is not made while other threads
    run GPU work)."""
    import concurrent.futures
    import threading

    _, _, ours = _models(gpu_folders["bert"], "mean", torch.bfloat16)
    eager = ours.encode(GPU_TEXTS, batch_size=3, convert_to_tensor=True)
    assert ragged.nn.graphed(ours, max_tokens=512, max_batch_size=8) is ours
    want = ours.encode(GPU_TEXTS, batch_size=3, convert_to_tensor=True)  # captures the buckets
    barrier = threading.Barrier(4)

    def work(i):
        barrier.wait()
        texts = GPU_TEXTS if i % 2 == 0 else GPU_TEXTS[::-1]
        got = [ours.encode(texts, batch_size=3, convert_to_tensor=True) for _ in range(4)]
        return [g if i % 2 == 0 else g.flip(0) for g in got]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = [f.result() for f in [pool.submit(work, i) for i in range(4)]]
    assert (want.float() - eager.float()).abs().max().item() < 2e-2
    for got in (g for out in outs for g in out):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
