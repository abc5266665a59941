"""``python -m ragged.embed``'s chunks sized by time, on the tiny model of :mod:`test_embed_cli`
(CPU, float32), the embedding slowed down by a known time per text: the first chunk's rate sizes
the others (``--chunk`` an upper bound), the sizes are recorded in the manifest, and a resumed run
keeps them (and the chunks saved) whatever its own speed; the output equals ``encode``."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")

from sentence_transformers import SentenceTransformer
from test_embed_cli import (
    CPU,
    TOL,
    WORDS,
    _final,
    _interrupt_after,
    _run,
    _write,
    make_model,
)

from ragged.integrations import embed as E

TEXTS = [f"{WORDS[i % len(WORDS)]} {WORDS[(5 * i) % len(WORDS)]} {i}" for i in range(700)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(model_dir):
    return SentenceTransformer(model_dir, device="cpu")


def _slow(monkeypatch, per_text: float) -> None:
    """Each chunk's embedding takes ``per_text`` seconds a text more than it does."""
    real = E._embedder()

    def embed(st, part, **kwargs):
        time.sleep(per_text * len(part))
        return real(st, part, **kwargs)

    monkeypatch.setattr(E, "_embedder", lambda: embed)


def test_chunk_helpers():
    assert E.chunk_ranges(10, 4, 3) == [(0, 4), (4, 7), (7, 10)]
    assert E.chunk_ranges(3, 4, None) == [(0, 3)] and E.chunk_ranges(0, 4, 4) == []
    assert E.chunk_size(256, 10.0, 60.0, 65536) == 1536
    assert E.chunk_size(256, 1e-4, 60.0, 65536) == 65536 and E.chunk_size(256, 1e4, 60.0, 100) == 1


def test_default_chunks_by_time(model_dir, reference, tmp_path, capsys, monkeypatch):
    """Under the default ``--chunk`` (65536) an input of 700 texts is cut so that a chunk takes
    about ``CHUNK_SECONDS``: here 0.6 s at 4 ms a text, 150 texts a chunk, not one chunk of 700."""
    monkeypatch.setattr(E, "CHUNK_SECONDS", 0.6)
    monkeypatch.setattr(E, "WARM_UP_SECONDS", 0.0)
    corpus = _write(tmp_path / "corpus.txt", TEXTS)
    out, parts = tmp_path / "emb.npy", tmp_path / "emb.npy.parts"
    argv = [model_dir, corpus, out, *CPU]
    with monkeypatch.context() as m:
        _slow(m, 0.004)
        _interrupt_after(m, 2)  # wraps the slowed embedder: the first chunk and one more
        assert _run(capsys, *argv)[0] == 130
    manifest = json.loads((parts / "manifest.json").read_text())
    first, size = manifest["chunk_sizes"]
    assert first == E.FIRST_CHUNK and 60 <= size <= 150, size  # 0.6 s at a bit over 4 ms a text
    saved = sorted(p.name for p in parts.glob("chunk_*.npy"))
    assert saved == ["chunk_000000.npy", "chunk_000001.npy"]
    kept = {name: (parts / name).read_bytes() for name in saved}
    assert np.load(parts / saved[1]).shape[0] == size

    # resumed at another speed: the recorded sizes, the saved chunks as they were
    seen = {}
    real_assemble = E._assemble

    def assemble(output, folder, ranges, dim, out_dtype):
        seen.update({p.name: p.read_bytes() for p in parts.glob("chunk_*.npy")}, ranges=ranges)
        return real_assemble(output, folder, ranges, dim, out_dtype)

    monkeypatch.setattr(E, "_assemble", assemble)
    rc, stdout, err = _run(capsys, *argv)
    assert rc == 0, err
    assert seen["ranges"] == E.chunk_ranges(len(TEXTS), first, size)
    assert {name: seen[name] for name in kept} == kept
    assert _final(stdout)[0] == len(TEXTS) - first - size
    np.testing.assert_allclose(np.load(out), reference.encode(TEXTS), **TOL)


def test_chunk_is_an_upper_bound(model_dir, reference, tmp_path, capsys, monkeypatch):
    """A fast run keeps ``--chunk`` texts a chunk at most; ``--chunk`` under the first chunk's
    size is every chunk's size (nothing measured)."""
    corpus = _write(tmp_path / "corpus.txt", TEXTS)
    out, parts = tmp_path / "emb.npy", tmp_path / "emb.npy.parts"
    for chunk, want, calls in (("300", [256, 300], 2), ("100", [100, 100], 1)):  # 2: the first chunk timed again
        with monkeypatch.context() as m:
            _interrupt_after(m, calls)
            assert _run(capsys, model_dir, corpus, out, "--chunk", chunk, "--chunk-seconds", "3600", *CPU)[0] == 130
        assert json.loads((parts / "manifest.json").read_text())["chunk_sizes"] == want
        rc, _, err = _run(capsys, model_dir, corpus, out, "--chunk", chunk, *CPU)
        assert rc == 0, err
        np.testing.assert_allclose(np.load(out), reference.encode(TEXTS), **TOL)
        assert not parts.exists()
