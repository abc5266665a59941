"""The overlapped encode of converted sentence-transformers models on the GPU (its default there).

Run with ``pytest -m gpu``. The models and the oracle of ``tests/test_gpu_hf_sentence.py``:
the converted model's embeddings must be as close to the float64 oracle as the unconverted
model's in the same dtype (flash-attn's rule). Checked here: the pipeline runs by default with
its own graphs, in input order over many batches, without reading the GPU inside the loop,
from several threads at once on a model with no graph captured yet, under a left-padding
tokenizer (sentence-transformers' own batches), and ``embed``.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

tf = pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")

from test_gpu_hf_sentence import GPU_TEXTS, _close, _models, gpu_folders  # noqa: E402,F401
from test_hf_sentence import VOCAB, WORDS  # noqa: E402

from ragged.nn.hf import sentence as hf_sentence  # noqa: E402
from ragged.nn.hf.sentence import pipeline as sp  # noqa: E402

pytestmark = pytest.mark.gpu


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 120))) for _ in range(n)]
    return out + GPU_TEXTS


@pytest.fixture
def calls(monkeypatch):
    seen = []
    real = hf_sentence.run

    def counted(*args, **kwargs):
        seen.append(len(args[3]["inputs"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_sentence, "run", counted)
    return seen


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_gpu_pipeline_by_default(gpu_folders, calls, family, dtype):
    oracle, theirs, ours = _models(gpu_folders[family], ("mean", "cls"), dtype)
    ours.encode.pipeline.max_tokens = 256  # many batches, several graph buckets
    texts = _texts(300, 1)
    want = oracle.encode(texts, convert_to_tensor=True)
    hf = theirs.encode(texts, convert_to_tensor=True)
    got = ours.encode(texts, convert_to_tensor=True)
    again = ours.encode(texts[::-1], convert_to_tensor=True)
    assert calls == [len(texts), len(texts)]
    assert got.dtype == dtype and got.device.type == "cuda"
    assert len(ours.encode.pipeline.cache) == 1 and next(iter(ours.encode.pipeline.cache.values()))[1].num_graphs >= 2
    _close(got, hf, want, dtype, "pipelined sentence_embedding")
    _close(again.flip(0), hf, want, dtype, "pipelined, reversed input")
    numpy = ours.encode(texts, normalize_embeddings=True)
    assert isinstance(numpy, np.ndarray) and numpy.dtype == (
        np.float32 if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype
    )
    _close(
        torch.from_numpy(np.asarray(numpy, dtype=np.float64)),
        theirs.encode(texts, normalize_embeddings=True, convert_to_tensor=True),
        oracle.encode(texts, normalize_embeddings=True, convert_to_tensor=True),
        dtype,
        "normalized",
    )


def test_gpu_pipeline_after_moving_the_model(gpu_folders):
    """Moving the model off the GPU and back gives it new parameter tensors (encode(device="cpu")
    moves it too): the graphs of the old ones are dropped and captured again, never replayed on
    freed memory (here overwritten before the next encode)."""
    _, _, ours = _models(gpu_folders["bert"], "mean", torch.float32)
    texts = _texts(80, 5)
    first = ours.encode(texts, convert_to_tensor=True)
    graphs = next(iter(ours.encode.pipeline.cache.values()))[1]
    ours.encode(texts[:5], device="cpu")  # sentence-transformers' loop on the CPU (the pipeline: CUDA only)
    ours.to("cpu")
    junk = torch.full((64 << 20,), float("nan"), device="cuda")  # reuses the freed parameter memory
    ours.to("cuda")
    again = ours.encode(texts, convert_to_tensor=True)
    del junk
    assert next(iter(ours.encode.pipeline.cache.values()))[1] is not graphs
    torch.testing.assert_close(again, first, rtol=1e-5, atol=1e-6)


def test_gpu_pipeline_does_not_sync(gpu_folders):
    """After the first call (compiles, captures), a pipelined call reads nothing from the GPU
    until its result is asked for on the host."""
    _, _, ours = _models(gpu_folders["bert"], "mean", torch.bfloat16)
    texts = _texts(200, 2)
    arguments = {"inputs": texts}
    ours.encode.pipelined(arguments)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ours.encode.pipelined(arguments)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape[0] == len(texts) and out.is_cuda


def test_gpu_pipeline_threads_before_any_capture(gpu_folders):
    """Threads encoding at once on a freshly converted model: graphs are captured while the
    other threads wait (one pipelined call at a time per model on a GPU); each thread gets its
    own texts' embeddings."""
    oracle, theirs, ours = _models(gpu_folders["roberta"], "mean", torch.bfloat16)
    sets = [_texts(60, s) for s in range(4)]
    got = [None] * len(sets)
    barrier = threading.Barrier(len(sets))

    def work(i):
        barrier.wait()
        got[i] = ours.encode(sets[i], convert_to_tensor=True)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(sets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for texts, g in zip(sets, got):
        _close(
            g,
            theirs.encode(texts, convert_to_tensor=True),
            oracle.encode(texts, convert_to_tensor=True),
            torch.bfloat16,
            "threads",
        )


def test_gpu_pipeline_left_padding(gpu_folders, calls):
    """A left-padding tokenizer: sentence-transformers' own batches, no pipeline graphs."""
    oracle, theirs, ours = _models(gpu_folders["bert"], "mean", torch.float16)
    for st in (oracle, theirs, ours):
        st.tokenizer.padding_side = "left"
    texts = _texts(50, 3)
    got = ours.encode(texts, batch_size=7, convert_to_tensor=True)
    assert calls == [len(texts)] and not ours.encode.pipeline.cache
    _close(
        got,
        theirs.encode(texts, batch_size=7, convert_to_tensor=True),
        oracle.encode(texts, batch_size=7, convert_to_tensor=True),
        torch.float16,
        "left padding",
    )


def test_gpu_embed(gpu_folders):
    oracle, theirs, ours = _models(gpu_folders["distilbert"], "mean", torch.bfloat16)
    texts = _texts(120, 4)
    tokens = []
    out = sp.embed(ours, texts, on_batch=lambda n, t: tokens.append(t), max_tokens=512)
    assert out.dtype == np.float32 and out.shape[0] == len(texts) and len(tokens) > 2
    _close(
        torch.from_numpy(out),
        theirs.encode(texts, convert_to_tensor=True),
        oracle.encode(texts, convert_to_tensor=True),
        torch.bfloat16,
        "embed",
    )


def test_gpu_pipeline_model_graphs_cannot_capture(tmp_path):
    """Head dim 8, which no GPU attention kernel takes: the reference attention reads the lengths
    on the host, so the forward cannot be captured in a CUDA graph. The pipeline warns once,
    turns its graphs off and embeds eagerly, as close to the float64 oracle as the original."""
    path = tmp_path / "d8"
    path.mkdir()
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    tf.BertTokenizerFast(str(path / "vocab.txt"), model_max_length=64).save_pretrained(str(path))
    torch.manual_seed(7)
    config = tf.BertConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    tf.AutoModel.from_config(config).save_pretrained(str(path))
    oracle, theirs, ours = _models(str(path), "mean", torch.float32)
    texts = [" ".join(random.Random(i).choices(WORDS, k=1 + i % 40)) for i in range(60)]
    with pytest.warns(RuntimeWarning, match="CUDA graphs are turned off") as caught:
        got = ours.encode(texts, convert_to_tensor=True)
    assert sum("CUDA graphs are turned off" in str(w.message) for w in caught) == 1
    assert ours.encode.pipeline.graphs is False and not ours.encode.pipeline.cache
    want = oracle.encode(texts, convert_to_tensor=True)
    _close(got, theirs.encode(texts, convert_to_tensor=True), want, torch.float32, "eager after a failed capture")
    _close(ours.encode(texts[::-1], convert_to_tensor=True).flip(0), theirs.encode(texts, convert_to_tensor=True),
           want, torch.float32, "the next call")  # fmt: skip
