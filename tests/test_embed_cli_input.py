"""``python -m ragged.embed``: what it reads and says before any embedding, on the tiny model of
:mod:`test_embed_cli` (CPU, float32): a UTF-8 byte-order mark at the start of a ``.txt`` or
``.jsonl`` corpus is dropped (the first text as without it), one elsewhere is kept; json's
error messages are quoted without a doubled word; the argument checks that need no pyarrow give
their own message when pyarrow cannot be imported; ``--no-progress`` silences transformers'
loading bar."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")

from sentence_transformers import SentenceTransformer
from test_embed_cli import CPU, TEXTS, TOL, _final, _run, _write, make_model

from ragged.integrations import embed as E

BOM = b"\xef\xbb\xbf"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(model_dir):
    return SentenceTransformer(model_dir, device="cpu")


def test_bom_txt(model_dir, reference, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(BOM + "".join(t + "\n" for t in TEXTS).encode())
    assert E.read_texts(str(corpus)) == TEXTS
    rc, stdout, err = _run(capsys, model_dir, corpus, tmp_path / "emb.npy", *CPU)
    assert rc == 0, err
    np.testing.assert_allclose(np.load(tmp_path / "emb.npy"), reference.encode(TEXTS), **TOL)
    assert _final(stdout)[0] == len(TEXTS)
    # only a leading mark is the file's: one inside a line is that text's character
    corpus.write_bytes(BOM + "a\n\ufeffb\n".encode())
    assert E.read_texts(str(corpus)) == ["a", "\ufeffb"]
    corpus.write_bytes(BOM)
    assert E.read_texts(str(corpus)) == []


def test_bom_jsonl(model_dir, reference, tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(BOM + "".join(json.dumps({"text": t}) + "\r\n" for t in TEXTS).encode())
    assert E.read_texts(str(corpus)) == TEXTS
    rc, _, err = _run(capsys, model_dir, corpus, tmp_path / "emb.npy", *CPU)
    assert rc == 0, err
    np.testing.assert_allclose(np.load(tmp_path / "emb.npy"), reference.encode(TEXTS), **TOL)
    # a malformed line after the mark is still named by its number in the file
    corpus.write_bytes(BOM + b'{"text": "a"}\n{"text": 3}\n')
    with pytest.raises(E.EmbedError, match="line 2 of .*number 3"):
        E.read_texts(str(corpus))


def test_json_error_message(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": "cut\n')
    with pytest.raises(E.EmbedError) as info:
        E.read_texts(str(corpus))
    message = str(info.value)
    want = json.JSONDecodeError
    try:
        json.loads('{"text": "cut')
    except want as err:
        column = err.colno
    assert f"line 2 of {corpus}: expected a JSON object with a string field 'text', got invalid JSON " in message
    assert message.endswith(f"starting at column {column})") and " at at " not in message, message
    corpus.write_text('{"text": }\n')
    with pytest.raises(E.EmbedError, match=r"invalid JSON \(Expecting value at column 10\)$"):
        E.read_texts(str(corpus))


def test_checks_without_pyarrow(model_dir, tmp_path, capsys, monkeypatch):
    """pyarrow made unimportable: the checks that do not need it say what they check; the ones
    that do name pyarrow; nothing is written."""
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    corpus = _write(tmp_path / "corpus.txt", TEXTS)
    for argv, message in (
        ([tmp_path / "same.parquet", tmp_path / "same.parquet"], "expected OUTPUT other than INPUT"),
        ([corpus, corpus], "expected OUTPUT to end with .npy, .parquet"),
        ([tmp_path / "c.parquet", tmp_path / "x.npy", "--prompt", "a", "--prompt-name", "q"], "got both"),
        ([tmp_path / "c.parquet", tmp_path / "x.npy"], "a .parquet INPUT needs pyarrow"),
        ([corpus, tmp_path / "x.parquet"], "a .parquet OUTPUT needs pyarrow"),
    ):
        rc, _, err = _run(capsys, model_dir, *argv, *CPU)
        assert rc == 1 and message in err and "Traceback" not in err, (argv, err)
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt"]


def test_no_progress_is_quiet(model_dir, tmp_path, capsys):
    """Under ``--no-progress`` nothing draws a bar: not transformers' loading of the weights."""
    corpus = _write(tmp_path / "corpus.txt", TEXTS)
    rc, _, err = _run(capsys, model_dir, corpus, tmp_path / "emb.npy", *CPU)
    assert rc == 0, err
    assert "Loading weights" not in err and "it/s]" not in err, err
    import transformers

    assert transformers.utils.logging.is_progress_bar_enabled()  # the process's setting given back
