"""The overlapped encode of converted sentence-transformers models (:mod:`ragged.nn.hf.sentence.pipeline`)
on the CPU, against the unconverted model in float64.

The pipeline runs by default on CUDA devices only; here it is switched on for every device
(``st.encode.pipeline.enabled = True``) with a small token budget, so that a handful of texts
makes many batches and several tokenization chunks. The encode tests of
``tests/test_hf_sentence.py`` run again under it (imported below; not its options test, whose
quantized outputs must be equal bit for bit: batches of other sizes move the floats by an ulp,
which can move an int8 step, see ``test_arguments``), and the tests here check that
the pipeline ran, the order of the results, every argument of ``encode``, the calls it leaves to
sentence-transformers' loop, threads, and :func:`embed`.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")

import test_hf_sentence as base  # noqa: E402

# The fixtures, and the tests of test_hf_sentence run again here with the pipeline on everywhere
# (pytest collects imported test functions): F401 would drop them as unused.
from test_hf_sentence import (  # noqa: F401
    TEXTS,
    _close,
    _st,
    folders,
    test_encode_matches_original,
    test_left_padding,
    test_prompt_left_out,
    test_sentence_level_modules,
    transformers_,
)

from ragged.nn.hf import sentence as hf_sentence  # noqa: E402
from ragged.nn.hf.sentence import pipeline as sp  # noqa: E402

M = base.M
BUDGET = 40  # tokens per batch: a few texts each


@pytest.fixture(autouse=True)
def pipeline_everywhere(monkeypatch):
    """Every converted encode made in a test runs the pipeline on the CPU, with a small budget
    and small tokenization chunks; ``calls`` counts the pipelined calls."""
    calls = []
    monkeypatch.setattr(hf_sentence, "Pipeline", lambda: sp.Pipeline(enabled=True, max_tokens=BUDGET, max_batch=7))
    monkeypatch.setattr(sp, "_CHUNK_TOKENS", 64)
    real = hf_sentence.run

    def counted(*args, **kwargs):
        calls.append(args[3].get("inputs"))
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_sentence, "run", counted)
    return calls


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = base.WORDS
    out = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 40))) for _ in range(n)]
    out[3] = base.LONG  # truncated by the tokenizer
    out[5] = out[9]  # a duplicate
    out[7] = ""
    return out


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_order_and_values(transformers_, pipeline_everywhere, family):
    """Texts of 0 to 64 tokens in random order, duplicates included: each result at its text's
    place, many batches and chunks, the same values as the original."""
    original, ours = _st(transformers_, family, "mean")
    texts = _texts(61, 3)
    got = ours.encode(texts, batch_size=4)
    assert pipeline_everywhere == [texts]
    _close(got, original.encode(texts, batch_size=4))
    # each row is its own text's: one at a time gives the same
    for i in (0, 7, 30, 60):
        _close(got[i], original.encode(texts[i]))


def test_arguments(transformers_, pipeline_everywhere):
    """Every argument the pipeline takes, against the original, each call pipelined."""
    original, ours = _st(transformers_, "bert", ("mean", "cls"), [M.Dense(2 * base.D, 24)])
    for st in (original, ours):
        st.prompts = {"query": "query: the ", "doc": ""}
    texts = _texts(23, 5)
    cases = [
        {},
        {"convert_to_tensor": True},
        {"convert_to_numpy": False},
        {"normalize_embeddings": True},
        {"truncate_dim": 8},
        {"truncate_dim": 8, "normalize_embeddings": True},
        {"prompt": "a b c "},
        {"prompt_name": "query"},
        {"prompt_name": "doc"},
        {"show_progress_bar": True},
        {"batch_size": 1},
        {"batch_size": 1000},
        {"precision": "float32"},
        {"device": "cpu"},
    ]
    for kw in cases:
        pipeline_everywhere.clear()
        want, got = original.encode(texts, **kw), ours.encode(texts, **kw)
        assert len(pipeline_everywhere) == 1, kw
        if isinstance(want, list):
            assert isinstance(got, list) and all(torch.is_tensor(g) for g in got)
            want, got = torch.stack(want), torch.stack(got)
        assert type(got) is type(want) and got.dtype == want.dtype, kw
        _close(got, want)
    for precision in ("int8", "uint8", "binary", "ubinary"):
        for kw in ({}, {"convert_to_tensor": True}, {"convert_to_numpy": False}):
            want = original.encode(texts, precision=precision, **kw)
            got = ours.encode(texts, precision=precision, **kw)
            if isinstance(want, list):
                want, got = torch.stack(want), torch.stack(got)
            assert type(got) is type(want) and got.dtype == want.dtype
            # quantization buckets: a value 1e-16 away from an edge may land one step over
            diff = np.abs(np.asarray(got, dtype=np.int64) - np.asarray(want, dtype=np.int64))
            assert diff.max() <= (1 if precision.endswith("int8") else 255) and diff.mean() < 0.05, (precision, kw)
    # a single text gives its row; the default prompt applies as sentence-transformers applies it
    _close(ours.encode("hello world"), original.encode("hello world"))
    for st in (original, ours):
        st.default_prompt_name = "query"
    _close(ours.encode(texts), original.encode(texts))
    with pytest.raises(ValueError, match="nope"):
        ours.encode(texts, prompt_name="nope")


def test_left_padding_keeps_the_original_batches(transformers_, pipeline_everywhere):
    """BERT under a left-padding tokenizer takes the padded batch's columns as positions: a
    text's embedding depends on its batch, so the pipeline runs sentence-transformers' own
    batches (the same texts together) and gives the original's values."""
    original, ours = _st(transformers_, "bert", "mean")
    for st in (original, ours):
        st.tokenizer.padding_side = "left"
    texts = _texts(29, 9)
    for batch_size in (1, 3, 8):
        pipeline_everywhere.clear()
        _close(ours.encode(texts, batch_size=batch_size), original.encode(texts, batch_size=batch_size))
        assert len(pipeline_everywhere) == 1


def test_calls_left_to_the_loop(transformers_, pipeline_everywhere):
    """What the pipeline does not take runs sentence-transformers' loop, with the same results."""
    original, ours = _st(transformers_, "bert", "cls")
    texts = _texts(11, 2)
    for kw in ({"output_value": "token_embeddings"}, {"task": "query"}):
        pipeline_everywhere.clear()
        try:
            want = original.encode(texts, **kw)
        except (ValueError, TypeError) as exc:
            with pytest.raises(type(exc)):
                ours.encode(texts, **kw)
            continue
        got = ours.encode(texts, **kw)
        assert pipeline_everywhere == [] and len(got) == len(want)
    pairs = [("a pair of", "texts"), ("b", "")]
    _close(ours.encode(pairs), original.encode(pairs))
    assert ours.encode([]).shape == original.encode([]).shape
    assert pipeline_everywhere == []
    for bad in ({"batch_size": 0}, {"precision": "int4"}):
        with pytest.raises(ValueError):
            original.encode(texts, **bad)
        with pytest.raises(ValueError):
            ours.encode(texts, **bad)
    ours.encode.pipeline.enabled = False
    ours.encode(texts)
    assert pipeline_everywhere == []


def test_auto_is_cuda_only(transformers_):
    """The default setting keeps CPU encodes on sentence-transformers' loop (no tokenization
    threads competing with torch's on the CPU)."""
    _, ours = _st(transformers_, "bert", "mean")
    settings = sp.Pipeline()
    arguments = {"inputs": TEXTS}
    assert "CUDA" in sp.reason(ours, ours[0].forward, settings, arguments)
    assert sp.reason(ours, ours[0].forward, sp.Pipeline(enabled=True), arguments) is None
    assert sp.reason(ours, ours[0].forward, sp.Pipeline(enabled=True), {"inputs": [TEXTS[0], 3]}) is not None


def test_threads_share_a_model(transformers_):
    """Threads encoding on one converted model at once each get their own texts' embeddings."""
    original, ours = _st(transformers_, "roberta", "mean")
    sets = [_texts(17, s) for s in range(6)]
    want = [original.encode(t) for t in sets]
    got = [None] * len(sets)

    def work(i):
        got[i] = ours.encode(sets[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(sets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, w in zip(got, want):
        _close(g, w)


def test_embed(transformers_):
    original, ours = _st(transformers_, "bert", "mean")
    texts = _texts(37, 4)
    seen = []
    out = sp.embed(ours, texts, normalize=True, on_batch=lambda n, t: seen.append((n, t)))
    assert out.dtype == np.float32 and out.shape == (37, base.D)
    _close(torch.from_numpy(out).double(), original.encode(texts, normalize_embeddings=True), rtol=1e-6, atol=1e-6)
    lengths = [len(ids) for ids in original.tokenize(texts)["attention_mask"].sum(1, keepdim=True)]
    assert sum(n for n, _ in seen) == 37 and len(seen) > 3 and len(lengths) == 37
    assert sum(t for _, t in seen) == int(original.tokenize(texts)["attention_mask"].sum())
    assert sp.embed(ours, []).shape == (0, base.D)
    with pytest.raises(ValueError, match="converted"):
        sp.embed(original, texts)


def test_several_devices_run_sentence_transformers_processes(transformers_, pipeline_everywhere):
    """``encode(device=[...])``: sentence-transformers' processes, each with the converted model
    (pickled; in a process on a GPU its pipeline runs there), results in input order."""
    original, ours = _st(transformers_, "bert", "mean")
    original, ours = original.float(), ours.float()
    texts = _texts(40, 6)
    got = ours.encode(texts, device=["cpu", "cpu"], chunk_size=7)
    assert pipeline_everywhere == []  # this process only hands the texts out
    _close(
        torch.from_numpy(np.asarray(got)), torch.from_numpy(np.asarray(original.encode(texts))), rtol=1e-5, atol=1e-6
    )


def test_a_failed_capture_leaves_the_batch_for_the_eager_run():
    """The forward takes its inputs out of the features dict; when the CUDA-graph capture of a
    batch fails (``CaptureError``), the eager run after it gets the batch whole, graphs are
    turned off with one warning, and the graphs kept are dropped."""
    import contextlib

    from ragged.nn.graphed import CaptureError
    from ragged.nn.hf.sentence import pipeline as pl

    seen, capturing = [], []

    def model(features):
        seen.append(dict(features))
        ids = features.pop("input_ids")  # as the ragged Transformer forward takes its packed input
        if capturing:
            raise CaptureError("the reference attention reads the lengths on the host")
        return {"sentence_embedding": ids.float() * 2}

    @contextlib.contextmanager
    def encoding(forward, kind, graphed):
        capturing[:] = [True] if graphed is not None else []
        try:
            yield
        finally:
            capturing.clear()

    settings = pl.Pipeline()
    settings.cache["old"] = object()
    ids = torch.arange(6).view(2, 3)
    with pytest.warns(RuntimeWarning, match="CUDA graphs are turned off"):
        out, graphs = pl._embed(model, {"input_ids": ids}, None, encoding, object(), settings, {})
    assert graphs is None and settings.graphs is False and not settings.cache
    torch.testing.assert_close(out, ids.float() * 2)
    assert len(seen) == 2 and all(f["input_ids"] is ids for f in seen)
