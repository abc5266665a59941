"""Regression tests of converted sentence-transformers models: ``weightedmean`` against the
installed sentence-transformers (whose weights changed in 6.2), ``encode(output_value=None)``
rows, and a converted model used from several threads at once.

The tiny models, texts and helpers are those of ``test_hf_sentence.py`` (float64 on the CPU).
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading

import pytest
import torch

import ragged

pytest.importorskip("transformers")
st_package = pytest.importorskip("sentence_transformers")
from packaging.version import Version  # noqa: E402
from sentence_transformers.sentence_transformer import modules as M  # noqa: E402
from test_hf_sentence import TEXTS, D, _close, _st, folders, transformers_  # noqa: E402, F401  (fixtures)

from ragged.nn.hf import sentence as hf_sentence  # noqa: E402
from ragged.padding import PaddedLayout  # noqa: E402

# sentence-transformers 6.2 weighs a token by its place in its own sequence, earlier versions
# by its column in the padded batch: the hand-written reference below follows the installed one.
SEQUENCE_WEIGHTS = Version(st_package.__version__).release >= (6, 2)


def _layouts(lengths, width, g):
    """(name, PaddedLayout, attention mask [B, width]) for right, left and scattered padding."""
    batch = len(lengths)
    out = []
    for side in ("right", "left"):
        rt = ragged.RaggedTensor.from_lengths(torch.zeros(sum(lengths)), lengths)
        out.append((side, PaddedLayout(width, side), rt.attention_mask(total_length=width, padding_side=side)))
    mask = torch.zeros(batch, width, dtype=torch.int64)
    for b, n in enumerate(lengths):  # n columns at random places of the row, in order
        cols = torch.randperm(width, generator=g)[:n].sort().values
        mask[b, cols] = 1
    rows, cols = mask.bool().nonzero(as_tuple=True)
    out.append(("scattered", PaddedLayout(width, "scattered", (rows, cols)), mask))
    return out


@pytest.mark.parametrize("prompt", [None, 2])
def test_weightedmean_weights_follow_the_installed_pooling(prompt):
    """pool_tokens' weightedmean on right, left and scattered layouts (lengths 0, 1, odd) equals
    the installed Pooling on the zero-padded batch and a float64 reference written here (a
    left-out prompt: right and left layouts)."""
    lengths, width = [5, 0, 1, 11, 3, 2], 14
    g = torch.Generator().manual_seed(7 + (prompt or 0))
    for name, layout, mask in _layouts(lengths, width, g):
        if prompt is not None and name == "scattered":
            continue
        x = torch.randn(sum(lengths), D, generator=g, dtype=torch.float64)
        rt = ragged.RaggedTensor.from_lengths(x, lengths)
        pooling = M.Pooling(D, "weightedmean", include_prompt=prompt is None)
        extra = {} if prompt is None else {"prompt_length": prompt}
        got = hf_sentence.pool_tokens(pooling, hf_sentence.TokenEmbeddings(rt, layout, None), extra)
        padded = layout.unpack(rt)
        want = pooling({"token_embeddings": padded, "attention_mask": mask, **extra})["sentence_embedding"]
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")
        for b in range(len(lengths)):
            cols = mask[b].nonzero().flatten()
            weights = (cols - cols[0] + 1 if SEQUENCE_WEIGHTS else cols + 1).double() if len(cols) else None
            if weights is not None and prompt is not None:  # the prompt: the sequence's first tokens
                weights[:prompt] = 0
            if weights is None or weights.sum() == 0:
                assert torch.all(got[b] == 0), (name, b)
                continue
            ref = (padded[b, cols] * weights[:, None]).sum(0) / weights.sum()
            torch.testing.assert_close(got[b], ref, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}, {b}: {m}")


@pytest.mark.parametrize("family", ["bert", "roberta"])
@pytest.mark.parametrize("mode", ["weightedmean", ("mean", "weightedmean")], ids=str)
def test_weightedmean_encode_with_left_padding(transformers_, family, mode):
    """encode and st(features) with a left-padding tokenizer, with and without a left-out
    prompt, equal the unconverted model under the installed sentence-transformers."""
    for kw in ({}, {"include_prompt": False}):
        original, ours = _st(transformers_, family, mode, **kw)
        for st in (original, ours):
            st.tokenizer.padding_side = "left"
        extra = {"prompt": "query: the "} if kw else {}
        _close(ours.encode(TEXTS, batch_size=3, **extra), original.encode(TEXTS, batch_size=3, **extra))
        f = original.preprocess(TEXTS[:5])
        _close(ours(dict(f))["sentence_embedding"], original(dict(f))["sentence_embedding"])


@pytest.mark.parametrize("side", ["right", "left"])
def test_encode_output_none_rows_hold_their_own_tokens(transformers_, side):
    """encode(output_value=None): each row's ragged_token_embeddings is that text's [L, d]
    tokens (in the row's order of texts), not the batch's object."""
    original, ours = _st(transformers_, "bert", ("cls", "weightedmean"))
    for st in (original, ours):
        st.tokenizer.padding_side = side
    texts = TEXTS[::-1] + ["odd one out of nine"]
    want = original.encode(texts, output_value=None, batch_size=4)
    got = ours.encode(texts, output_value=None, batch_size=4)
    assert len(got) == len(want) == len(texts)
    for g, w in zip(got, want):
        keep = w["attention_mask"].bool()
        tokens = g[hf_sentence.TOKENS_KEY]
        assert isinstance(tokens, torch.Tensor), type(tokens)
        assert tokens.shape == (int(keep.sum()), D)
        _close(tokens, w["token_embeddings"][keep])
        _close(g["sentence_embedding"], w["sentence_embedding"])
        _close(g["token_embeddings"][keep], w["token_embeddings"][keep])
        assert torch.equal(g["attention_mask"], w["attention_mask"])


# --------------------------------------------------------------------------------------
# Several threads


def _same(got, want, kind):
    if kind == "tokenize":
        assert got.keys() == want.keys(), (sorted(got), sorted(want))
        for k in want:
            assert torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k], k
    elif kind == "sentence":
        _close(got, want)
    elif kind == "tokens":
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _close(g, w)
    else:
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.keys() == w.keys(), (sorted(g), sorted(w))
            for k in ("sentence_embedding", "token_embeddings", "attention_mask", hf_sentence.TOKENS_KEY):
                _close(g[k], w[k])


def _run_threads(st, texts, rounds):
    """Every kind of call from its own threads at once; each result against the same call made
    alone beforehand."""
    calls = {
        "sentence": lambda: st.encode(texts, batch_size=3),
        "tokens": lambda: st.encode(texts, output_value="token_embeddings", batch_size=4),
        "none": lambda: st.encode(texts, output_value=None, batch_size=4),  # 6.0 indexes "text" too
        "tokenize": lambda: st.tokenize(texts),
    }
    want = {kind: call() for kind, call in calls.items()}
    kinds = list(calls) * 2
    barrier = threading.Barrier(len(kinds))

    def work(kind):
        barrier.wait()
        out = []
        for _ in range(rounds):
            out.append(calls[kind]())
        return out

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: calls interleave inside encode
    try:
        with concurrent.futures.ThreadPoolExecutor(len(kinds)) as pool:
            futures = [(kind, pool.submit(work, kind)) for kind in kinds]
            results = [(kind, f.result()) for kind, f in futures]
    finally:
        sys.setswitchinterval(interval)
    for kind, outs in results:
        for got in outs:
            _same(got, want[kind], kind)


def test_encode_and_tokenize_from_several_threads(transformers_):
    """Threads calling encode() for sentence embeddings, token embeddings and all outputs, and
    tokenize(), on one converted model: every result equals the single-threaded one, which
    equals the unconverted model's."""
    original, ours = _st(transformers_, "bert", "mean")
    texts = TEXTS + ["a b c d e f g", "odd"]
    _close(ours.encode(texts, batch_size=3), original.encode(texts, batch_size=3))
    _run_threads(ours, texts, rounds=6)
