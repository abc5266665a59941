"""``python -m ragged.embed`` on the GPU (bf16), a random model of all-MiniLM-L6-v2's shape
(``bench.embed_wall.build_model``) on the project corpus: the output against the unconverted
model's ``encode``; a small input runs without CUDA graphs, a larger one captures them; the
report's phases add up to the whole run; a resumed run keeps the recorded chunk sizes and the
saved chunks, and its output equals the chunks it kept plus what it computed.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise)."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")

from sentence_transformers import SentenceTransformer

from ragged.integrations import embed as E

TIME = re.compile(
    r"time: imports ([\d.]+) s, input ([\d.]+) s, model ([\d.]+) s, embedding ([\d.]+) s "
    r"\((\d+) CUDA graphs? captured\), output ([\d.]+) s, other (-?[\d.]+) s"
)
WHOLE = re.compile(r".*; whole run ([\d.]+) s: [\d.]+ texts/s")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from bench.embed_wall import build_model

    return build_model(str(tmp_path_factory.mktemp("minilm")), tiny=False)


def _corpus(path, n: int) -> list[str]:
    from bench.embed_wall import texts

    data = texts(n)
    path.write_text("".join(t + "\n" for t in data), encoding="utf-8")
    return data


def _report(out: str) -> tuple[list[float], int, float]:
    lines = out.strip().splitlines()
    phases = TIME.fullmatch(lines[-2])
    whole = WHOLE.fullmatch(lines[-1])
    assert phases and whole, lines[-2:]
    values = [float(v) for v in phases.groups()]
    return values[:4] + values[5:], int(values[4]), float(whole.group(1))


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12)


@pytest.mark.parametrize("n, graphs", [(100, False), (20000, True)])
def test_gpu_embed_against_encode(model_dir, tmp_path, capsys, n, graphs):
    data = _corpus(tmp_path / "corpus.txt", n)
    rc = E.main([model_dir, str(tmp_path / "corpus.txt"), str(tmp_path / "emb.npy"), "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    phases, captured, whole = _report(out)
    assert (captured > 0) == graphs, out
    assert abs(sum(phases) - whole) <= 0.01 * len(phases) + 1e-6 and phases[3] > 0
    want = SentenceTransformer(model_dir, device="cuda").to(torch.bfloat16).encode(data, convert_to_numpy=True)
    got = np.load(tmp_path / "emb.npy")
    assert got.shape == want.shape and np.isfinite(got).all()
    assert _cosine(got, want.astype(np.float32)).min() >= 0.99


def test_gpu_resume_keeps_sizes(model_dir, tmp_path, capsys, monkeypatch):
    _corpus(tmp_path / "corpus.txt", 3000)
    out, parts = tmp_path / "emb.npy", tmp_path / "emb.npy.parts"
    argv = [model_dir, str(tmp_path / "corpus.txt"), str(out), "--chunk", "1000", "--no-progress"]
    real, calls = E._embedder(), []

    def embed(*args, **kwargs):
        calls.append(1)
        if len(calls) > 3:  # the first chunk, its warm timing, one more
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(E, "_embedder", lambda: embed)
        assert E.main(argv) == 130
    capsys.readouterr()
    sizes = json.loads((parts / "manifest.json").read_text())["chunk_sizes"]
    assert sizes == [E.FIRST_CHUNK, 1000]
    kept = [np.load(parts / E.chunk_name(i)) for i in range(2)]
    assert E.main(argv) == 0
    got = np.load(out)
    np.testing.assert_array_equal(got[: E.FIRST_CHUNK + 1000], np.concatenate(kept))
