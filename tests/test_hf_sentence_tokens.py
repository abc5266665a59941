"""The encode pipeline's tokenization straight to id arrays (:mod:`ragged.nn.hf.sentence.tokens`)
against sentence-transformers' own preprocess, on the CPU.

Each case tokenizes the same texts twice through the pipeline's tokenization step: with the
fast path, and with it switched off (sentence-transformers' preprocess and the tokenizer's own
call, whose per-text lists are then flattened). Lengths, ids, token types and the other
features must be equal, and the fast path must have run (each case counts its calls): for the
WordPiece tokenizers of the encoder tests, the byte-level BPE tokenizers of the decoder tests
(left and right padding, an end-of-text token added), prompts, truncation, lowercasing,
special-token strings inside a text, ``split_special_tokens``, empty texts, texts that look
like media file names or URLs (text to a model that takes no media), and the calls it must
leave alone.
"""

from __future__ import annotations

import contextlib
import copy
import threading

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")

import test_hf_sentence as enc  # noqa: E402
import test_hf_sentence_decoder as dec  # noqa: E402
from test_hf_sentence import folders, transformers_  # noqa: E402,F401

from ragged.nn.hf.sentence import pipeline as sp  # noqa: E402
from ragged.nn.hf.sentence import tokens as stok  # noqa: E402

TEXTS = [
    *enc.TEXTS,
    "Mixed CASE Words",
    "  padded  spaces  ",
    "a [SEP] inside [CLS] text",
    "ünïcödé ß 東京",
    "the " * 70,
    "",
    "x",
    "photo.jpg",
    "https://example.com/cat.png",
    "song.mp3",
    "clip.mp4",
]


@pytest.fixture
def fast_calls(monkeypatch):
    """The texts of each call the fast path took."""
    calls = []
    real = stok.encode

    def counted(tokenizer, texts, truncation, max_length):
        calls.append(list(texts))
        return real(tokenizer, texts, truncation, max_length)

    monkeypatch.setattr(stok, "encode", counted)
    return calls


def _both(module, texts, prompt=None):
    """(fast, original): the pipeline's tokenization of ``texts`` with and without the fast path."""
    lock = threading.RLock()
    fast = sp._tokenize(module, lock, texts, prompt)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sp, "flat_ids", lambda module: contextlib.nullcontext())
        slow = sp._tokenize(module, lock, texts, prompt)
    return fast, slow


def _same(fast, slow):
    (lf, idf, tf_, xf), (ls, ids, ts, xs) = fast, slow
    np.testing.assert_array_equal(lf, ls)
    np.testing.assert_array_equal(idf, ids)
    assert (tf_ is None) == (ts is None)
    if ts is not None:
        np.testing.assert_array_equal(tf_, ts)
    assert set(xf) == set(xs) and all(np.all(np.asarray(xf[k]) == np.asarray(xs[k])) for k in xs), (xf, xs)
    assert lf.dtype == idf.dtype == np.int64 and idf.size == lf.sum()


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
@pytest.mark.parametrize("prompt", [None, "query: "])
def test_wordpiece(transformers_, fast_calls, family, prompt):
    module = copy.deepcopy(transformers_[family])
    fast, slow = _both(module, TEXTS, prompt)
    _same(fast, slow)
    assert len(fast_calls) == 1 and len(fast_calls[0]) == len(TEXTS)
    assert fast[0].max() == module.max_seq_length  # the long texts were truncated
    assert "_call_single_modality_processor" not in module.__dict__  # nothing left behind


def test_lowercase_truncation_and_types(transformers_, fast_calls):
    """A lowercasing module, a shorter truncation length, token types from a tokenizer that returns them."""
    module = copy.deepcopy(transformers_["bert"])
    module.do_lower_case = True
    module.max_seq_length = 9
    fast, slow = _both(module, TEXTS, "Q: ")
    _same(fast, slow)
    assert fast[2] is not None and fast[0].max() == 9 and fast_calls


def test_split_special_tokens(transformers_, fast_calls):
    module = copy.deepcopy(transformers_["bert"])
    module.tokenizer.split_special_tokens = True
    fast, slow = _both(module, TEXTS, None)
    _same(fast, slow)
    module.tokenizer.split_special_tokens = False
    again, _ = _both(module, TEXTS, None)
    assert not np.array_equal(again[1], fast[1])  # "[SEP]" in a text: split, then one token
    assert len(fast_calls) == 2


@pytest.fixture(scope="module")
def decoder_modules(tmp_path_factory):
    """The decoder tests' word-level tokenizers (an end-of-text token appended, a start token
    prepended, none), each padding left and right."""
    import warnings

    from sentence_transformers.sentence_transformer import modules as M

    out = []
    for family, style in (("qwen3", "eos"), ("llama", "bos"), ("qwen2", "none")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = M.Transformer(dec._save(tmp_path_factory.mktemp(family), family, style))
        for side in ("left", "right"):
            m = copy.deepcopy(module)
            m.tokenizer.padding_side = side
            out.append(m)
    return out


@pytest.mark.parametrize("prompt", [None, dec.INSTRUCT])
def test_decoder_tokenizers(decoder_modules, fast_calls, prompt):
    texts = [*dec.TEXTS, "", "the " * 40]
    for module in decoder_modules:
        fast, slow = _both(module, texts, prompt)
        _same(fast, slow)
    assert len(fast_calls) == len(decoder_modules) == 6


def test_calls_left_to_sentence_transformers(transformers_, fast_calls):
    """A padded call (sentence-transformers' own encode), and a call with a tokenizer argument the
    fast path does not take, go the original way and give the original's result."""
    module = copy.deepcopy(transformers_["bert"])
    with stok.flat_ids(module):
        padded = module.preprocess(TEXTS[:4])
    assert not fast_calls and padded["input_ids"].dim() == 2
    kwargs = {
        "common": {
            "padding": False,
            "return_tensors": None,
            "return_attention_mask": False,
            "return_token_type_ids": False,
        }
    }
    with stok.flat_ids(module):
        out = module.preprocess(TEXTS[:4], processing_kwargs=kwargs)
    assert not fast_calls and isinstance(out["input_ids"], list) and "token_type_ids" not in out
    assert out["input_ids"] == module.preprocess(TEXTS[:4], processing_kwargs=kwargs)["input_ids"]
    assert "_call_single_modality_processor" not in module.__dict__


def test_nested_prompt_length_call(transformers_, fast_calls):
    """The prompt's length is measured by a padded preprocess call inside the pipeline's: it
    stays sentence-transformers' (a tensor), while the outer call takes the fast path."""
    module = copy.deepcopy(transformers_["bert"])
    module._prompt_length_mapping.clear()
    fast, slow = _both(module, TEXTS[:5], "passage: ")
    _same(fast, slow)
    assert fast[3].get("prompt_length") is not None and len(fast_calls) == 1


def test_media_lookalikes_are_text_without_the_search(transformers_, fast_calls):
    """A text-only model's list of strings skips sentence-transformers' per-string media search
    (the same result: text); a formatter that supports images keeps its own parse."""
    module = copy.deepcopy(transformers_["bert"])
    formatter = module.input_formatter
    seen = []
    real = type(formatter).parse_inputs

    def counted(self, inputs):
        seen.append(len(inputs))
        return real(self, inputs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(formatter), "parse_inputs", counted)
        fast, slow = _both(module, TEXTS[-4:] + TEXTS[:3])
        _same(fast, slow)
        assert seen == [7]  # the original's own call only, from the run without the fast path
        formatter.supported_modalities = [*formatter.supported_modalities, "image"]
        lock = threading.RLock()
        sp._tokenize(module, lock, ["hello world", "a"], None)
        assert seen == [7, 2] and "parse_inputs" not in vars(formatter)


def test_tokenizer_classes_with_their_own_call(transformers_, fast_calls):
    """A tokenizer class that overrides a step of the call (as CodeLlama's and the layout models'
    do) keeps sentence-transformers' path, with the same result."""
    module = copy.deepcopy(transformers_["bert"])
    base = type(module.tokenizer)
    seen = []

    class Own(base):
        def _encode_plus(self, *args, **kwargs):
            seen.append(1)
            return super()._encode_plus(*args, **kwargs)

    module.tokenizer.__class__ = Own
    assert module.processor is module.tokenizer
    fast, slow = _both(module, TEXTS)
    _same(fast, slow)
    assert not fast_calls and len(seen) == 2
