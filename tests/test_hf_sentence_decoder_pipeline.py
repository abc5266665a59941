"""The encode pipeline (:mod:`ragged.nn.hf.sentence.pipeline`) on converted sentence-transformers
models over decoders, on the CPU in float64, against the unconverted model.

The pipeline is switched on for the CPU with a small token budget (many batches of up to 5
texts). Right padding: the original's values for the same call. Left padding (Qwen3-Embedding's):
the pipeline takes its own batches with each text at positions from 0, which is what the
original gives for each text alone (``batch_size=1``: its padded batches move the rotary angles
by float32 rounding, so its results depend on the batch by about 1e-7), for every family,
pooling mode and prompt; ``weightedmean`` before sentence-transformers 6.2 (weights by padded
column) keeps the original's batches and columns.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")

# transformers_ and folders are fixtures (used by name, not as values): F401 would drop them.
from test_hf_sentence_decoder import (  # noqa: F401
    FAMILIES,
    FLOAT32_INSIDE,
    FLOAT32_TOL,
    INSTRUCT,
    TEXTS,
    _close,
    _st,
    folders,
    transformers_,
)

from ragged.nn.hf import sentence as hf_sentence  # noqa: E402
from ragged.nn.hf.sentence import pipeline as sp  # noqa: E402
from ragged.nn.hf.sentence.pooling import weightedmean_origin  # noqa: E402


@pytest.fixture(autouse=True)
def batches(monkeypatch):
    """Every converted encode runs the pipeline on the CPU (small budget and chunks); the list
    holds, per pipelined call, the number of texts of each batch."""
    calls = []
    monkeypatch.setattr(hf_sentence, "Pipeline", lambda: sp.Pipeline(enabled=True, max_tokens=30, max_batch=5))
    monkeypatch.setattr(sp, "_CHUNK_TOKENS", 48)
    real = sp.run

    def counted(model, forward, settings, arguments, target, encoding, on_batch=None):
        sizes = []
        calls.append(sizes)
        return real(model, forward, settings, arguments, target, encoding, lambda n, t: sizes.append(n))

    monkeypatch.setattr(hf_sentence, "run", counted)
    return calls


def _want(original, texts, side, family="qwen3", **kw):
    alone = side == "left" or family in FLOAT32_INSIDE
    return original.encode(texts, batch_size=1 if alone else 3, **kw)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family(transformers_, batches, family, side):
    texts = TEXTS * 2
    for mode in ("lasttoken", "mean"):
        original, ours = _st(transformers_, family, mode, side)
        got = ours.encode(texts, batch_size=3)
        assert len(batches[-1]) > 1 and sum(batches[-1]) == len(texts)
        _close(got, _want(original, texts, side, family), **(FLOAT32_TOL if family in FLOAT32_INSIDE else {}))


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mode", ["lasttoken", "mean", "cls", "max", "weightedmean"])
def test_modes_and_prompts(transformers_, batches, mode, side):
    original, ours = _st(transformers_, "llama-bos", mode, side, prompts={"query": INSTRUCT})
    keeps_batches = side == "left" and mode == "weightedmean" and weightedmean_origin() == "column"
    for kw in ({}, {"prompt": INSTRUCT}, {"prompt_name": "query"}):
        got = ours.encode(TEXTS, batch_size=3, **kw)
        if keeps_batches:  # the original's batches of 3, its columns
            assert max(batches[-1]) == 3
            _close(got, original.encode(TEXTS, batch_size=3, **kw))
        else:
            _close(got, _want(original, TEXTS, side, **kw))
    lost = _st(transformers_, "qwen3", mode, side, include_prompt=False)
    _close(
        lost[1].encode(TEXTS, batch_size=3, prompt=INSTRUCT),
        lost[0].encode(TEXTS, batch_size=1 if side == "left" and not keeps_batches else 3, prompt=INSTRUCT),
    )


def test_left_padded_decoder_takes_budget_batches(transformers_, batches):
    """Left padding, lasttoken: the pipeline's own batches (up to 5 texts, not the 3 asked)."""
    original, ours = _st(transformers_, "qwen3", "lasttoken", "left")
    got = ours.encode(TEXTS * 3, batch_size=3)
    assert len(batches) == 1 and max(batches[0]) > 3
    _close(got, original.encode(TEXTS * 3, batch_size=1))
