"""bench.corpus: the real-text corpus the benchmarks embed, and the tokenizers trained on it."""

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from bench import corpus  # noqa: E402


def test_texts_are_prose_deterministic_and_many():
    texts = corpus.texts(20000)
    assert len(texts) >= 10000, corpus.describe()  # the stdlib's docstrings hold this many paragraphs
    assert len(set(texts)) == len(texts)
    assert texts[:50] == corpus.texts(50) and corpus.texts(0) == []
    assert corpus.texts(50, seed=1) != texts[:50]  # the order is a seeded shuffle
    for t in texts:
        assert t == " ".join(t.split()) and len(t.split()) >= 3 and ">>>" not in t
    words = np.array([len(t.split()) for t in texts])
    assert 5 <= np.median(words) <= 40 and words.max() > 100  # sentences, with a long tail
    with pytest.raises(ValueError, match=r"bench.corpus.texts\(\): expected n >= 0, got -1"):
        corpus.texts(-1)


def test_wordpiece_is_bert_style_and_subword():
    tok = corpus.wordpiece(2000)
    ids = tok("Return the number of items in the container.")["input_ids"]
    assert ids[0] == tok.cls_token_id == 2 and ids[-1] == tok.sep_token_id == 3 and tok.pad_token_id == 0
    assert len(tok) <= 2000 and tok.unk_token_id not in ids
    long = tok(" ".join(corpus.texts(200)), truncation=True)["input_ids"]
    assert len(long) == 512
    # a small vocabulary splits more words: more tokens per text than a larger one
    text = corpus.texts(1000)
    small = sum(len(x) for x in tok(text)["input_ids"])
    large = sum(len(x) for x in corpus.wordpiece(8000)(text)["input_ids"])
    assert small > large > sum(len(t.split()) for t in text)


def test_byte_bpe_appends_eos_and_pads_with_it():
    tok = corpus.byte_bpe(3000, padding_side="left")
    ids = tok("Receive data from the socket.")["input_ids"]
    assert ids[-1] == tok.eos_token_id == tok.pad_token_id == 0 and 0 not in ids[:-1]
    assert tok.decode(ids[:-1]) == "Receive data from the socket."
    batch = tok(["a b", "Receive data from the socket."], padding=True)
    assert batch["attention_mask"][0][0] == 0 and batch["input_ids"][0][-1] == 0  # left padding
