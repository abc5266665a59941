"""``python -m ragged.embed`` on a tiny sentence-transformers model (BERT, 2 layers, hidden 32,
random weights, mean pooling, a prompt named ``query``) saved to a folder, on the CPU in float32.

The command's output against ``SentenceTransformer(folder).encode`` for ``.txt``, ``.jsonl`` and
``.parquet`` corpora (texts of 0, 1 and more tokens than the model takes, duplicates, a count not a
multiple of ``--chunk``, normalization, prompts), through the library's chunk pipeline and through
the fallback on ``encode``; the final line; malformed input (the file and line named, nothing
written); resuming after a kill (the chunks on disk kept as they were) and after an interruption;
manifests of another run refused with the parts untouched; ``--devices`` refusals; the threads of
several replicas.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import string
import subprocess
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

tf = pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as M

from ragged.integrations import embed as E

D, MAXLEN = 32, 64
WORDS = [
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "he",
    "she",
    "they",
    "be",
    "at",
    "one",
    "have",
    "this",
    "from",
    "or",
    "had",
    "by",
    "hot",
    "word",
    "but",
    "what",
    "some",
    "we",
    "can",
    "out",
    "other",
    "were",
    "all",
    "there",
    "when",
    "up",
    "use",
    "your",
    "how",
    "said",
    "an",
    "each",
    "which",
    "do",
    "their",
    "time",
    "quick",
    "brown",
    "fox",
    "jumps",
    "lazy",
    "dog",
    "people",
    "know",
    "water",
    "over",
]
VOCAB = (
    ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    + list(string.ascii_lowercase)
    + list(string.digits)
    + list(".,!?'")
    + ["##" + c for c in string.ascii_lowercase + string.digits]
    + WORDS
)
LONG = " ".join(WORDS[i % len(WORDS)] for i in range(90))  # more than MAXLEN tokens: truncated
# 11 texts: 0, 1 and 64 tokens, duplicates, non-ASCII; 11 is not a multiple of CHUNK.
TEXTS = [
    "",
    "a",
    "hello world",
    LONG,
    "the quick brown fox jumps over the lazy dog",
    "hello world",
    "zz",
    "one two. three!",
    "",
    "people know water",
    "café über naïve",
]
CHUNK = "4"
CPU = ["--dtype", "fp32", "--device", "cpu", "--no-progress"]
TOL = {"rtol": 1e-5, "atol": 1e-6}
FINAL = re.compile(
    r"embedded (\d+) texts \((\d+) tokens\) in (\d+\.\d\d) s: (\d+\.\d) texts/s, (\d+\.\d) tokens/s; "
    r"whole run (\d+\.\d\d) s: (\d+\.\d) texts/s"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model(tmp_path_factory)


def make_model(tmp_path_factory) -> str:
    """A SentenceTransformer folder: wordpiece tokenizer, BERT with random weights, mean pooling."""
    path = tmp_path_factory.mktemp("bert")
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    tf.BertTokenizerFast(str(path / "vocab.txt"), model_max_length=MAXLEN).save_pretrained(str(path))
    torch.manual_seed(0)
    config = tf.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=2 * D,
        max_position_embeddings=MAXLEN,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    bert = tf.AutoModel.from_config(config)
    with torch.no_grad():
        for p in bert.parameters():  # larger than the default init, so that layers matter
            p.add_(0.2 * torch.randn_like(p))
    bert.save_pretrained(str(path))
    folder = tmp_path_factory.mktemp("st")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        st = SentenceTransformer(
            modules=[M.Transformer(str(path)), M.Pooling(D, "mean")], device="cpu", prompts={"query": "the query: "}
        )
    st.save(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The unconverted model, loaded from the folder as the command loads it."""
    return SentenceTransformer(model_dir, device="cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: steady times on a shared machine, and the same kernels in every run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["library", "fallback"])
def pipeline(request, monkeypatch):
    """Each chunk through ``ragged.nn.hf.sentence.pipeline.embed``, or through the fallback on
    ``SentenceTransformer.encode`` (the library's module made unimportable)."""
    if request.param == "fallback":
        # conversion imports the pipeline module too: load it first, so that only the command's own
        # import of it fails (whatever tests this worker ran before)
        import ragged.nn.hf.sentence  # noqa: F401

        monkeypatch.setitem(sys.modules, "ragged.nn.hf.sentence.pipeline", None)
        assert E._embedder() is E._encode
    elif E._embedder() is E._encode:
        pytest.skip("ragged.nn.hf.sentence.pipeline.embed is not importable")
    return request.param


def _write(path: Path, texts: list[str]) -> Path:
    """``texts`` as a corpus in the format of ``path``'s extension."""
    if path.suffix == ".txt":
        path.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    else:
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), str(path))
    return path


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = E.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _final(out: str) -> tuple[int, int, float, float, float]:
    last = out.rstrip("\n").splitlines()[-1]
    match = FINAL.fullmatch(last)
    assert match, f"unexpected final line {last!r}"
    n, tokens, s, x, y = match.groups()[:5]
    return int(n), int(tokens), float(s), float(x), float(y)


def _snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.iterdir())}


def _interrupt_after(monkeypatch, chunks: int) -> None:
    """Make the command's chunk embedding raise KeyboardInterrupt after ``chunks`` chunks."""
    real, calls = E._embedder(), []

    def embed(*args, **kwargs):
        calls.append(1)
        if len(calls) > chunks:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(E, "_embedder", lambda: embed)


# --------------------------------------------------------------------------------------
# Output against encode


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".parquet"])
@pytest.mark.parametrize("normalize", [False, True])
def test_corpus_matches_encode(model_dir, reference, tmp_path, capsys, suffix, normalize):
    texts = TEXTS if suffix == ".txt" else TEXTS + ["two\nlines", 'tab\tand "quotes"']
    corpus = _write(tmp_path / f"corpus{suffix}", texts)
    out = tmp_path / "emb.npy"
    rc, stdout, err = _run(capsys, model_dir, corpus, out, "--chunk", CHUNK, *CPU, *(["--normalize"] * normalize))
    assert rc == 0, err
    got = np.load(out)
    want = reference.encode(texts, normalize_embeddings=normalize)
    assert got.dtype == np.float32 and got.shape == (len(texts), D)
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(got[2], got[5], **TOL)  # a duplicate, in another chunk
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    assert not Path(f"{out}.parts").exists() and sorted(os.listdir(tmp_path)) == sorted([corpus.name, out.name])
    assert _final(stdout)[0] == len(texts) and "resuming" not in stdout


def test_pipelines_and_prompts(model_dir, reference, tmp_path, capsys, pipeline):
    corpus = _write(tmp_path / "corpus.jsonl", TEXTS)
    for extra, want in (
        (["--prompt", "a fox: "], reference.encode(TEXTS, prompt="a fox: ")),
        (["--prompt-name", "query"], reference.encode(TEXTS, prompt_name="query")),
        (["--batch-size", "3", "--max-tokens", "40"], reference.encode(TEXTS)),
    ):
        out = tmp_path / "emb.npy"
        rc, stdout, err = _run(capsys, model_dir, corpus, out, "--chunk", CHUNK, *CPU, *extra)
        assert rc == 0, err
        np.testing.assert_allclose(np.load(out), want, **TOL)
        assert _final(stdout)[0] == len(TEXTS)
    assert not np.allclose(reference.encode(TEXTS, prompt="a fox: ")[1], reference.encode(TEXTS)[1], atol=1e-3)


def test_final_line(model_dir, reference, tmp_path, capsys, pipeline):
    corpus = _write(tmp_path / "corpus.txt", TEXTS)
    rc, stdout, err = _run(capsys, model_dir, corpus, tmp_path / "emb.npy", "--chunk", CHUNK, *CPU)
    assert rc == 0, err
    n, tokens, seconds, texts_s, tokens_s = _final(stdout)
    assert n == len(TEXTS) and tokens > 0 and seconds > 0
    real = int(reference.preprocess(TEXTS)["attention_mask"].sum())  # special tokens in, truncated
    assert tokens == real
    # The rates are the counts over the time (up to the printed roundings).
    assert abs(n / texts_s - seconds) <= 0.006 + seconds * 1e-3
    assert abs(tokens / tokens_s - seconds) <= 0.006 + seconds * 1e-3


def test_output_formats(model_dir, reference, tmp_path, capsys):
    corpus = _write(tmp_path / "corpus.txt", TEXTS)
    assert _run(capsys, model_dir, corpus, tmp_path / "a.npy", "--chunk", CHUNK, *CPU)[0] == 0
    full = np.load(tmp_path / "a.npy")
    assert _run(capsys, model_dir, corpus, tmp_path / "h.npy", "--chunk", CHUNK, *CPU, "--out-dtype", "float16")[0] == 0
    half = np.load(tmp_path / "h.npy")
    assert half.dtype == np.float16 and np.array_equal(half, full.astype(np.float16))
    pq = pytest.importorskip("pyarrow.parquet")
    rc, _, err = _run(capsys, model_dir, corpus, tmp_path / "e.parquet", "--chunk", CHUNK, *CPU)
    assert rc == 0, err
    table = pq.read_table(tmp_path / "e.parquet")
    assert table.column_names == ["embedding"] and table.num_rows == len(TEXTS)
    assert str(table.schema.field("embedding").type) == "list<element: float>"
    np.testing.assert_array_equal(np.array(table.column("embedding").to_pylist(), dtype=np.float32), full)


def test_empty_corpus_and_empty_lines(model_dir, reference, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    rc, stdout, err = _run(capsys, model_dir, empty, tmp_path / "e.npy", *CPU)
    assert rc == 0, err
    assert np.load(tmp_path / "e.npy").shape == (0, D) and _final(stdout)[:2] == (0, 0)
    lines = tmp_path / "lines.txt"
    lines.write_bytes(b"\n\r\nlast line without a newline")  # an empty text, one from \r\n, then one more
    assert E.read_texts(str(lines)) == ["", "", "last line without a newline"]
    assert _run(capsys, model_dir, lines, tmp_path / "l.npy", *CPU)[0] == 0
    np.testing.assert_allclose(
        np.load(tmp_path / "l.npy"), reference.encode(["", "", "last line without a newline"]), **TOL
    )


# --------------------------------------------------------------------------------------
# Malformed input


def _jsonl(*lines: str) -> bytes:
    return "".join(line + "\n" for line in lines).encode()


GOOD = '{"text": "fine"}'
MALFORMED = {
    "invalid json": (".jsonl", _jsonl(GOOD, GOOD, '{"text": "cut', GOOD), 3, "invalid JSON"),
    "missing field": (".jsonl", _jsonl(GOOD, '{"body": "no text"}', GOOD), 2, "without it"),
    "number field": (".jsonl", _jsonl(GOOD, GOOD, GOOD, '{"text": 5}'), 4, "number 5"),
    "null field": (".jsonl", _jsonl('{"text": null}'), 1, "null"),
    "not an object": (".jsonl", _jsonl(GOOD, '["text"]'), 2, "array"),
    "empty line": (".jsonl", _jsonl(GOOD, "", GOOD), 2, "empty line"),
    "lone surrogate": (".jsonl", _jsonl(GOOD, GOOD, '{"text": "a\\ud800b"}'), 3, "surrogate"),
    "invalid utf-8": (".txt", b"ok\nfine\nbad \xff byte\nmore\n", 3, "UTF-8"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_input(model_dir, tmp_path, capsys, case):
    suffix, data, line, what = MALFORMED[case]
    corpus = tmp_path / f"corpus{suffix}"
    corpus.write_bytes(data)
    out = tmp_path / "emb.npy"
    rc, stdout, err = _run(capsys, model_dir, corpus, out, *CPU)
    assert rc == 1 and stdout == ""
    assert err.startswith(f"python -m ragged.embed: line {line} of {corpus}: expected ") and what in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == [corpus.name]  # no OUTPUT, no .parts


def test_malformed_parquet(model_dir, tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    corpus = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), str(corpus))
    rc, _, err = _run(capsys, model_dir, corpus, tmp_path / "emb.npy", *CPU)
    assert rc == 1 and f"row 3 of {corpus}: expected a string in the column 'text', got null" in err
    pq.write_table(pa.table({"text": [1, 2]}), str(corpus))
    rc, _, err = _run(capsys, model_dir, corpus, tmp_path / "emb.npy", *CPU)
    assert rc == 1 and "expected a string column 'text', got a column of int64" in err
    rc, _, err = _run(capsys, model_dir, corpus, tmp_path / "emb.npy", "--field", "body", *CPU)
    assert rc == 1 and "expected a string column 'body', got the columns ['text']" in err
    assert sorted(os.listdir(tmp_path)) == [corpus.name]


def test_field_and_paths(model_dir, reference, tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(_jsonl(*(json.dumps({"body": t}) for t in TEXTS)).decode())
    assert _run(capsys, model_dir, corpus, tmp_path / "emb.npy", "--field", "body", *CPU)[0] == 0
    np.testing.assert_allclose(np.load(tmp_path / "emb.npy"), reference.encode(TEXTS), **TOL)
    for argv, message in (
        ([corpus, tmp_path / "emb.csv"], "expected OUTPUT to end with .npy, .parquet"),
        ([tmp_path / "corpus.csv", tmp_path / "x.npy"], "expected INPUT to end with .txt"),
        ([tmp_path / "missing.txt", tmp_path / "x.npy"], "No such file"),
        ([tmp_path / "same.parquet", tmp_path / "same.parquet"], "expected OUTPUT other than INPUT"),
        ([corpus, tmp_path / "x.npy", "--prompt", "a", "--prompt-name", "query"], "got both"),
        (
            [corpus, tmp_path / "x.npy", "--prompt-name", "passage", "--field", "body"],
            "expected --prompt-name among the model's prompts [",
        ),
    ):
        rc, _, err = _run(capsys, model_dir, *argv, *CPU)
        assert rc == 1 and message in err and "Traceback" not in err, (argv, err)
    assert "'query'" in err and err.rstrip().endswith("got 'passage'")
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl", "emb.npy"]  # no x.npy, no x.npy.parts


# --------------------------------------------------------------------------------------
# Resuming


def test_resume_after_kill(model_dir, reference, tmp_path, capsys, monkeypatch):
    texts = [f"{WORDS[i % len(WORDS)]} {WORDS[7 * i % len(WORDS)]} {i}" for i in range(1200)]
    corpus = _write(tmp_path / "corpus.txt", texts)
    out, parts = tmp_path / "emb.npy", tmp_path / "emb.npy.parts"
    argv = [model_dir, str(corpus), str(out), "--chunk", "4", "--batch-size", "4", *CPU]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ragged.embed", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    try:
        deadline = time.monotonic() + 180
        while len(list(parts.glob("chunk_*.npy")) if parts.exists() else []) < 2:
            assert proc.poll() is None, f"ended before it was killed ({proc.returncode}): {proc.communicate()}"
            assert time.monotonic() < deadline, "no chunk written in 180 s"
            time.sleep(0.002)
    finally:
        proc.kill()
        proc.communicate()
    assert not out.exists()
    before = {p.name: p.stat().st_mtime_ns for p in parts.glob("chunk_*.npy")}
    assert 2 <= len(before) < 300 and (parts / "manifest.json").exists()

    # Other arguments: refused, the parts untouched.
    snapshot = _snapshot(parts)
    rc, stdout, err = _run(capsys, *argv[:3], "--chunk", "5", *argv[5:])
    assert rc == 1 and "chunk: 4 there, 5 now" in err and f"remove the folder {parts}" in err
    assert _snapshot(parts) == snapshot and not out.exists()

    # The same arguments: the chunks on disk are kept as they are, the rest computed.
    seen = {}

    def rmtree(path, *args, **kwargs):
        seen.update({p.name: p.stat().st_mtime_ns for p in Path(path).glob("chunk_*.npy")})
        shutil.rmtree(path, *args, **kwargs)

    monkeypatch.setattr(E, "shutil", types.SimpleNamespace(rmtree=rmtree))
    rc, stdout, err = _run(capsys, *argv)
    assert rc == 0, err
    assert f"resuming: {len(before)} of 300 chunks already done" in stdout.splitlines()
    assert _final(stdout)[0] == len(texts) - 4 * len(before)
    assert len(seen) == 300 and {name: seen[name] for name in before} == before
    assert not parts.exists()
    rc, _, err = _run(capsys, model_dir, corpus, tmp_path / "whole.npy", *argv[3:])
    assert rc == 0, err
    np.testing.assert_array_equal(np.load(out), np.load(tmp_path / "whole.npy"))
    np.testing.assert_allclose(np.load(out), reference.encode(texts), **TOL)


def test_resume_after_interruption(model_dir, reference, tmp_path, capsys, monkeypatch):
    corpus = _write(tmp_path / "corpus.jsonl", TEXTS)
    out, parts = tmp_path / "emb.npy", tmp_path / "emb.npy.parts"
    out.write_bytes(b"an earlier output")
    argv = [model_dir, corpus, out, "--chunk", CHUNK, *CPU]
    with monkeypatch.context() as m:
        _interrupt_after(m, 2)
        rc, _, err = _run(capsys, *argv)
    assert rc == 130 and "interrupted" in err
    assert out.read_bytes() == b"an earlier output"  # replaced only once complete
    assert sorted(p.name for p in parts.glob("chunk_*")) == ["chunk_000000.npy", "chunk_000001.npy"]
    (parts / "chunk_000001.npy").write_bytes(b"\x93NUMPY")  # a damaged chunk: computed again
    rc, stdout, err = _run(capsys, *argv)
    assert rc == 0 and "chunk_000001.npy" in err and "embedding this chunk again" in err
    assert "resuming: 1 of 3 chunks already done" in stdout and _final(stdout)[0] == len(TEXTS) - 4
    np.testing.assert_allclose(np.load(out), reference.encode(TEXTS), **TOL)
    assert not parts.exists()


def test_output_replaced_only_when_complete(model_dir, reference, tmp_path, capsys, monkeypatch):
    """An interruption while OUTPUT is written leaves the earlier OUTPUT and every chunk; the next
    run only writes OUTPUT."""
    corpus = _write(tmp_path / "corpus.txt", TEXTS)
    out, parts = tmp_path / "emb.npy", tmp_path / "emb.npy.parts"
    out.write_bytes(b"an earlier output")
    argv = [model_dir, corpus, out, "--chunk", CHUNK, *CPU]
    real = E._write_atomic

    def interrupted(path, write, folder=None):
        if folder is None:  # the manifest and the chunks
            return real(path, write, folder)

        def half(f):
            write(f)
            f.truncate(f.tell() // 2)
            raise KeyboardInterrupt

        return real(path, half, folder)

    with monkeypatch.context() as m:
        m.setattr(E, "_write_atomic", interrupted)
        assert _run(capsys, *argv)[0] == 130
    assert out.read_bytes() == b"an earlier output"
    assert sorted(p.name for p in parts.iterdir()) == [
        "chunk_000000.npy",
        "chunk_000001.npy",
        "chunk_000002.npy",
        "manifest.json",
    ]
    rc, stdout, err = _run(capsys, *argv)
    assert rc == 0, err
    assert stdout.splitlines()[0] == "resuming: 3 of 3 chunks already done" and _final(stdout)[:2] == (0, 0)
    np.testing.assert_allclose(np.load(out), reference.encode(TEXTS), **TOL)
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt", "emb.npy"]


@pytest.mark.parametrize("change", ["input", "normalize", "model", "no manifest", "bad manifest"])
def test_other_run_refused(model_dir, tmp_path, capsys, monkeypatch, change):
    corpus = _write(tmp_path / "corpus.txt", TEXTS)
    out, parts = tmp_path / "emb.npy", tmp_path / "emb.npy.parts"
    argv = [model_dir, corpus, out, "--chunk", CHUNK, *CPU]
    with monkeypatch.context() as m:
        _interrupt_after(m, 1)
        assert _run(capsys, *argv)[0] == 130
    want = {
        "input": "input_size",
        "normalize": "normalize: False there, True now",
        "model": "model: ",
        "no manifest": "no manifest.json",
        "bad manifest": "expected",
    }[change]
    if change == "input":
        _write(corpus, TEXTS + ["one more"])
    elif change == "normalize":
        argv.append("--normalize")
    elif change == "model":
        other = tmp_path / "other"
        SentenceTransformer(model_dir, device="cpu").save(str(other))
        argv[0] = other
    elif change == "no manifest":
        (parts / "manifest.json").unlink()
    else:
        (parts / "manifest.json").write_text('{"format": 1, "chunk": 4')
    snapshot = _snapshot(parts)
    rc, stdout, err = _run(capsys, *argv)
    assert rc == 1 and stdout == "" and want in err and f"remove the folder {parts} to start over" in err, err
    assert _snapshot(parts) == snapshot and not out.exists()


# --------------------------------------------------------------------------------------
# Devices


@pytest.mark.parametrize(
    "spec, message",
    [
        ("0,x", "'x' is not an index"),
        ("", "is not an index"),
        ("1,1", "expected distinct GPU indices"),
        ("-1", "is not an index"),
    ],
)
def test_devices_syntax(model_dir, tmp_path, capsys, spec, message):
    with pytest.raises(SystemExit) as exit_:
        E.main([model_dir, str(tmp_path / "c.txt"), str(tmp_path / "e.npy"), "--devices", spec])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --devices: expected " in err and message in err
    assert E.parse_devices(" 0, 2") == [0, 2] and E.parse_devices("all") == "all"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--devices", "all"], "--devices all: no CUDA device is visible"),
        (["--devices", "0,1"], "--devices 0,1: no CUDA device is visible"),
        (["--device", "cuda"], "to be a visible CUDA device, got 0 visible"),
        (["--device", "gpu"], "expected --device such as cuda, cpu or cuda:1"),
        (["--device", "cpu", "--devices", "0"], "got both"),
    ],
)
def test_devices_without_cuda(model_dir, tmp_path, capsys, argv, message):
    corpus = _write(tmp_path / "c.txt", TEXTS)
    rc, _, err = _run(capsys, model_dir, corpus, tmp_path / "e.npy", *argv)
    assert rc == 1 and message in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["c.txt"]


def test_replicas_share_the_queue(model_dir, reference, tmp_path, monkeypatch):
    """Two replicas (CPU here) in a thread each: every chunk written once, at its index; a failure in
    one thread stops the others and reaches the caller."""
    st = E._load(model_dir, ["cpu", "cpu"], "fp32")
    assert (
        st[0] is not st[1]
        and st[0][0].auto_model.embeddings.word_embeddings.weight.data_ptr()
        != st[1][0].auto_model.embeddings.word_embeddings.weight.data_ptr()
    )
    texts = TEXTS * 5
    options = {"prompt": None, "prompt_name": None, "normalize": False, "max_tokens": 256, "batch_size": 4}
    counted = []
    ranges = E.chunk_ranges(len(texts), 4, 4)
    E._run_chunks(
        [("cpu", st[0]), ("cpu", st[1])],
        texts,
        list(range(14)),
        ranges,
        str(tmp_path),
        options,
        lambda n, t: counted.append(n),
    )
    got = np.concatenate([np.load(tmp_path / E.chunk_name(i)) for i in range(14)])
    np.testing.assert_allclose(got, reference.encode(texts), **TOL)
    assert sum(counted) == len(texts)

    calls, real = [], E._embedder()

    def embed(model, part, **kwargs):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:
            raise RuntimeError("chunk failed")
        return real(model, part, **kwargs)

    folder = tmp_path / "failing"
    folder.mkdir()
    monkeypatch.setattr(E, "_embedder", lambda: embed)
    with pytest.raises(RuntimeError, match="chunk failed"):
        E._run_chunks(
            [("cpu", st[0]), ("cpu", st[1])], texts, list(range(14)), ranges, str(folder), options, lambda n, t: None
        )
    assert len(list(folder.glob("chunk_*.npy"))) <= 3 and len(calls) <= 4  # of 14 chunks


def test_import_is_cheap():
    code = (
        "import sys, ragged.embed; heavy = [m for m in ('sentence_transformers', 'transformers', 'rich', "
        "'pyarrow') if m in sys.modules]; assert not heavy, heavy"
    )
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
