"""ragged.nn.convert on sentence-transformers models over decoders on the GPU, in bfloat16,
float16 and float32, and ragged.nn.graphed of them.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise). Tiny Qwen3, Llama and
Gemma 3 (bidirectional, EmbeddingGemma's setting) base models (hidden 128, 4 query heads of 32
over 2 key/value heads, sliding windows of 6 for Gemma 3) with the CPU tests' word-level
tokenizer (EOS at the end, texts up to 96 tokens). The oracle is the unconverted model in float64
on the GPU; the converted model in ``dtype`` must be as close to it as the unconverted model in
``dtype`` (flash-attn's rule, :func:`test_gpu_hf_sentence._close`). Also: an encode batch of a
model that takes prepared masks reads nothing from the GPU, training gradients, and the graphs
(``ragged.nn.graphed(st)``) against the eager converted model and the oracle.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ragged

tf = pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer import losses  # noqa: E402
from sentence_transformers.sentence_transformer import modules as M
from sentence_transformers.util import batch_to_device  # noqa: E402
from test_gpu_hf_sentence import _close  # noqa: E402  (flash-attn's rule against the float64 oracle)
from test_hf_sentence import LONG, WORDS  # noqa: E402
from test_hf_sentence_decoder import INSTRUCT, TEXTS, _config, _tokenizer  # noqa: E402

from ragged.nn.hf import decoder as hf_decoder  # noqa: E402
from ragged.nn.hf import sentence as hf_sentence  # noqa: E402

pytestmark = pytest.mark.gpu

D, HEAD, MAXLEN = 128, 32, 256
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GPU_TEXTS = TEXTS + [LONG * 2, " ".join(WORDS[:37]), "x", " ".join(WORDS[5:60])]


@pytest.fixture(scope="module")
def gpu_folders(tmp_path_factory):
    out = {}
    for seed, family in enumerate(("qwen3", "llama", "gemma3")):
        path = tmp_path_factory.mktemp(f"gpu_{family}")
        _tokenizer("eos", max_length=96).save_pretrained(str(path))
        torch.manual_seed(200 + seed)
        model = tf.AutoModel.from_config(
            _config(family, hidden_size=D, intermediate_size=2 * D, head_dim=HEAD, max_position_embeddings=MAXLEN)
        )
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        model.save_pretrained(str(path))
        out[family] = str(path)
    return out


def _models(path: str, mode, dtype, side="left", after=(), **kw):
    """(oracle float64, original in dtype, converted in dtype), on the GPU, eval mode."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = M.Transformer(path)
    tr.tokenizer.padding_side = side
    oracle = SentenceTransformer(modules=[tr, M.Pooling(D, mode, **kw), *after], device="cuda").double().eval()
    theirs = copy.deepcopy(oracle).to(dtype)
    ours = hf_sentence.convert_sentence_transformer(copy.deepcopy(theirs))
    assert ours[0].auto_model.config._attn_implementation == "ragged"
    return oracle, theirs, ours


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
def test_gpu_encode_matches_original(gpu_folders, family, side, dtype):
    for mode, include in (("lasttoken", True), ("mean", True), ("mean", False)):
        oracle, theirs, ours = _models(gpu_folders[family], mode, dtype, side, [M.Normalize()], include_prompt=include)
        for kw in ({}, {"prompt": INSTRUCT}):
            want, hf, got = (
                m.encode(GPU_TEXTS, batch_size=4, convert_to_tensor=True, **kw) for m in (oracle, theirs, ours)
            )
            assert got.dtype == dtype and got.device.type == "cuda"
            _close(got, hf, want, dtype, f"{mode} {kw}")


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_gpu_encode_batch_does_not_sync(gpu_folders, family):
    """A model that takes prepared masks: the forward of an encode batch (packed on the host)
    reads nothing from the GPU."""
    _, _, ours = _models(gpu_folders[family], ("lasttoken", "mean", "cls", "max"), torch.bfloat16)
    with hf_sentence.encoding(ours[0].forward, "sentence"):
        batches = [
            batch_to_device(ours.preprocess(GPU_TEXTS[i : i + 4], prompt=INSTRUCT), "cuda")
            for i in range(0, len(GPU_TEXTS), 4)
        ]
    with torch.no_grad():
        ours(copy.copy(batches[0]))  # first call: kernel compilation and tuning may read the GPU
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [ours(features)["sentence_embedding"] for features in batches[1:]]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert all(o.device.type == "cuda" and o.dtype == torch.bfloat16 for o in outs)


@pytest.mark.parametrize("side", ["left", "right"])
def test_gpu_training_gradients(gpu_folders, side):
    """MultipleNegativesRankingLoss on padded features in bfloat16: loss and every gradient."""
    dtype = torch.bfloat16
    oracle, theirs, ours = _models(gpu_folders["qwen3"], "lasttoken", dtype, side, [M.Dense(D, 32)])
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


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
def test_gpu_graphed_encode_matches_eager(gpu_folders, family, side):
    """ragged.nn.graphed(st): encode() replays graphs of a PackedDecoder of the model (its spare
    bucket rows in sequences of their own), the eager embeddings and the oracle's."""
    dtype = torch.bfloat16
    oracle, theirs, ours = _models(gpu_folders[family], "lasttoken", dtype, side, [M.Normalize()])
    eager = ours.encode(GPU_TEXTS, batch_size=4, convert_to_tensor=True, prompt=INSTRUCT)
    assert ragged.nn.graphed(ours, max_tokens=512, max_batch_size=8) is ours
    graphs = ours[0].forward.graphed
    assert isinstance(graphs.module, hf_decoder.PackedDecoder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ours.encode(GPU_TEXTS, batch_size=4, convert_to_tensor=True, prompt=INSTRUCT)
        again = ours.encode(GPU_TEXTS[::-1], batch_size=3, convert_to_tensor=True, prompt=INSTRUCT)
    assert not [w for w in caught if "running eagerly" in str(w.message)]  # every batch replayed a graph
    assert graphs.num_graphs >= 1  # right padding: the encode pipeline's token-budget batches, one bucket or more
    want = oracle.encode(GPU_TEXTS, batch_size=4, convert_to_tensor=True, prompt=INSTRUCT)
    hf = theirs.encode(GPU_TEXTS, batch_size=4, convert_to_tensor=True, prompt=INSTRUCT)
    _close(got, hf, want, dtype, "graphed sentence_embedding")
    _close(again.flip(0), hf, want, dtype, "graphed sentence_embedding, other batches")
    assert (got.float() - eager.float()).abs().max().item() < 2e-2
    ours[0].forward.graphed = None
    assert ours.encode(GPU_TEXTS[:2], convert_to_tensor=True).shape[0] == 2


def test_gpu_graphed_replay_reads_nothing(gpu_folders):
    """A captured bucket replays without reading the GPU (Llama builds its mask from the position
    ids with one read per eager forward; transformers skips it while a graph is captured)."""
    _, _, ours = _models(gpu_folders["llama"], "mean", torch.bfloat16)
    ragged.nn.graphed(ours, max_tokens=512, max_batch_size=8)
    with hf_sentence.encoding(ours[0].forward, "sentence"):
        features = batch_to_device(ours.preprocess(GPU_TEXTS[:4]), "cuda")
    with torch.no_grad():
        ours(copy.copy(features))  # captures the bucket
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = ours(copy.copy(features))["sentence_embedding"]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (4, D) and torch.isfinite(out).all()
