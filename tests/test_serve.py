"""``python -m ragged.serve``: a real server process on 127.0.0.1 with a tiny sentence-transformers
model (BERT, 2 layers, random weights, mean pooling), real HTTP clients (httpx, and the ``openai``
client where installed): embeddings against the original model's, 200 concurrent requests of
mixed sizes each answered with its own rows, the error cases, 429 past the concurrency limit, a
cancelled request freeing its place, a failing batch answering 500 to its own requests only,
``/health`` and ``/metrics``, and SIGTERM answering the request in flight before the process
ends. The model's answers, the failing batch and SIGTERM run with the model in the server's
threads and in a worker process (``either_server``, ``RAGGED_SERVE_WORKERS``), where SIGTERM also
leaves no worker behind and a killed worker fails its requests (500) and turns ``/health`` to 503."""

from __future__ import annotations

import asyncio
import base64
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
tf = pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")

import torch  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer import modules as M  # noqa: E402
from test_hf_sentence import MAXLEN, VOCAB, WORDS, _config  # noqa: E402

FAULT = "zz fault zz"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve_model")
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    tok_dir = path / "tok"
    tf.BertTokenizerFast(str(path / "vocab.txt"), model_max_length=MAXLEN).save_pretrained(str(tok_dir))
    torch.manual_seed(0)
    bert = tf.AutoModel.from_config(_config("bert"))
    with torch.no_grad():
        for p in bert.parameters():
            p.add_(0.2 * torch.randn_like(p))
    bert.save_pretrained(str(tok_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        st = SentenceTransformer(modules=[M.Transformer(str(tok_dir), max_seq_length=MAXLEN), M.Pooling(32, "mean")])
        st.save(str(path / "st"))
    return str(path / "st")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, *args: str, env: dict | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "ragged.serve", model, "--port", str(self.port), "--device", "cpu", *args]
        full_env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not answer /health in 120 s")

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.stdout.read() if self.proc.stdout else ""


@pytest.fixture(scope="module")
def original(model_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SentenceTransformer(model_dir, device="cpu")


SERVER_ARGS = ("--max-client-batch-size", "64", "--max-batch-tokens", "512")
PROCESS = {"RAGGED_SERVE_WORKERS": "process"}


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir, *SERVER_ARGS, env={"RAGGED_SERVE_FAULT": FAULT})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def process_server(model_dir):
    s = Server(model_dir, *SERVER_ARGS, env={"RAGGED_SERVE_FAULT": FAULT, **PROCESS})
    yield s
    s.stop()


@pytest.fixture(params=["thread", "process"])
def either_server(request):
    """The server with its model in its own threads, then in a worker process."""
    s = request.getfixturevalue("server" if request.param == "thread" else "process_server")
    assert httpx.get(s.url + "/health").json()["workers"] == request.param
    return s


def _workers_of(pid: int) -> list[int]:
    """The worker processes (multiprocessing's spawned children) of process ``pid``, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            out.append(int(entry))
    return out


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _want(original, texts, normalize=True):
    return original.encode(texts, batch_size=4, normalize_embeddings=normalize, convert_to_numpy=True)


def test_embed_and_openai_routes_equal_the_original(either_server, original):
    server = either_server
    texts = _texts(9, 1) + ["alone"]
    r = httpx.post(server.url + "/embed", json={"inputs": texts})
    assert r.status_code == 200
    np.testing.assert_allclose(np.array(r.json()), _want(original, texts), atol=2e-5, rtol=1e-4)
    r = httpx.post(server.url + "/embed", json={"inputs": texts[0], "normalize": False})
    np.testing.assert_allclose(np.array(r.json()), _want(original, texts[:1], False), atol=2e-5, rtol=1e-4)
    r = httpx.post(server.url + "/v1/embeddings", json={"input": texts, "model": "m"})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "list" and body["model"] == "m"
    assert [d["index"] for d in body["data"]] == list(range(len(texts)))
    got = np.array([d["embedding"] for d in body["data"]])
    np.testing.assert_allclose(got, _want(original, texts), atol=2e-5, rtol=1e-4)
    tokens = sum(len(ids) for ids in original.tokenizer(texts)["input_ids"])
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    # base64 float32 and dimensions (the first dimensions, normalised again)
    r = httpx.post(
        server.url + "/v1/embeddings", json={"input": texts[:2], "encoding_format": "base64", "dimensions": 8}
    )
    rows = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in r.json()["data"]])
    want = _want(original, texts[:2], False)[:, :8]
    np.testing.assert_allclose(rows, want / np.linalg.norm(want, axis=1, keepdims=True), atol=2e-5, rtol=1e-4)


def test_openai_client(server, original):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    texts = _texts(5, 2)
    out = client.embeddings.create(input=texts, model="tiny")  # the client asks for base64
    got = np.array([d.embedding for d in out.data])
    np.testing.assert_allclose(got, _want(original, texts), atol=2e-5, rtol=1e-4)
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.embeddings.create(input=[], model="tiny")


@pytest.fixture(scope="module")
def two_hundred(original):
    """200 requests of 1 to 12 texts, and the original's row of each text."""
    rng = random.Random(3)
    requests = [_texts(rng.randint(1, 12), 100 + i) for i in range(200)]
    unique = sorted({t for r in requests for t in r})
    return requests, dict(zip(unique, _want(original, unique)))


def test_two_hundred_concurrent_requests_get_their_own_rows(either_server, two_hundred):
    server = either_server
    requests, want = two_hundred

    async def run():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as client:
            return await asyncio.gather(*(client.post(server.url + "/embed", json={"inputs": r}) for r in requests))

    answers = asyncio.run(run())
    for texts, r in zip(requests, answers):
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(np.array(r.json()), np.stack([want[t] for t in texts]), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "path,body,status,words",
    [
        ("/embed", b"{not json", 400, "not valid JSON"),
        ("/embed", b"[1, 2]", 400, "JSON object"),
        ("/embed", {"inputs": []}, 400, "empty"),
        ("/embed", {"inputs": ""}, 400, "empty string"),
        ("/embed", {"inputs": [1, 2]}, 400, "string or a list of strings"),
        ("/embed", {"inputs": "a", "normalize": "yes"}, 400, "'normalize' must be true or false"),
        ("/embed", {"inputs": ["a"] * 65}, 413, "65 texts"),
        ("/embed", {"texts": "a"}, 400, "'inputs' is required"),
        ("/embed", {"inputs": "a", "prompt_name": "nope"}, 400, "prompt_name"),
        ("/v1/embeddings", {"input": 3}, 400, "string or a list of strings"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, 400, "encoding_format"),
        ("/v1/embeddings", {"input": "a", "dimensions": 0}, 400, "dimensions"),
        ("/v1/embeddings", {"input": "a", "dimensions": 999}, 400, "more than the model's 32"),
    ],
)
def test_bad_requests(server, path, body, status, words):
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"] if path.startswith("/v1") else r.json()["error"]
    assert words in message
    if path.startswith("/v1"):
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_text_over_the_models_length(server, original):
    long = " ".join(WORDS[i % len(WORDS)] for i in range(MAXLEN + 10))
    r = httpx.post(server.url + "/embed", json={"inputs": ["short", long]})
    assert r.status_code == 400 and "more than the model's 64" in r.json()["error"]
    r = httpx.post(server.url + "/embed", json={"inputs": ["short", long], "truncate": True})
    assert r.status_code == 200
    np.testing.assert_allclose(np.array(r.json()), _want(original, ["short", long]), atol=2e-5, rtol=1e-4)
    r = httpx.post(server.url + "/v1/embeddings", json={"input": long})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_a_failing_batch_answers_500_to_its_requests_only(either_server):
    server = either_server

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            bad = client.post(server.url + "/embed", json={"inputs": [FAULT]})
            good = [client.post(server.url + "/embed", json={"inputs": t}) for t in _texts(6, 7)]
            return await asyncio.gather(bad, *good)

    bad, *good = asyncio.run(run())
    assert bad.status_code == 500 and "fault injected" in bad.json()["error"]
    # requests batched with the failing one run again without it; the server keeps serving
    assert all(r.status_code == 200 for r in good)
    r = httpx.post(server.url + "/embed", json={"inputs": ["after the fault"]})
    assert r.status_code == 200
    assert "ragged_batch_failures_total" in httpx.get(server.url + "/metrics").text


def test_health_and_metrics(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    httpx.post(server.url + "/embed", json={"inputs": ["counted"]})
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "ragged_queue_depth",
        "ragged_batch_tokens_bucket",
        "ragged_request_seconds_bucket",
        "ragged_texts_per_second",
        'ragged_requests_total{endpoint="/embed",status="200"}',
    ):
        assert name in text


def test_429_past_the_limit_and_a_cancelled_request_frees_its_place(model_dir):
    s = Server(model_dir, "--max-concurrent-requests", "1", env={"RAGGED_SERVE_BATCH_DELAY": "1.0"})
    try:

        async def run():
            async with httpx.AsyncClient(timeout=30) as client:
                first = asyncio.ensure_future(client.post(s.url + "/embed", json={"inputs": ["one"]}))
                await asyncio.sleep(0.3)
                second = await client.post(s.url + "/embed", json={"inputs": ["two"]})
                return await first, second

        first, second = asyncio.run(run())
        assert first.status_code == 200
        assert second.status_code == 429 and second.headers["retry-after"] == "1"
        assert second.json()["error_type"] == "Overloaded"

        async def cancel_then_ask():
            async with httpx.AsyncClient(timeout=0.3) as impatient:
                with pytest.raises(httpx.TimeoutException):
                    await impatient.post(s.url + "/embed", json={"inputs": ["given up"]})
            await asyncio.sleep(0.3)  # the server sees the disconnect
            async with httpx.AsyncClient(timeout=30) as client:
                return await client.post(s.url + "/embed", json={"inputs": ["next"]})

        assert asyncio.run(cancel_then_ask()).status_code == 200
    finally:
        s.stop()


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_sigterm_answers_the_request_in_flight(model_dir, original, workers):
    s = Server(model_dir, env={"RAGGED_SERVE_BATCH_DELAY": "1.0", "RAGGED_SERVE_WORKERS": workers})
    children = _workers_of(s.proc.pid) if workers == "process" and os.path.isdir("/proc") else []
    assert len(children) == (1 if os.path.isdir("/proc") and workers == "process" else 0)

    async def run():
        async with httpx.AsyncClient(timeout=30) as client:
            pending = asyncio.ensure_future(client.post(s.url + "/embed", json={"inputs": ["drained"]}))
            await asyncio.sleep(0.4)
            s.proc.send_signal(signal.SIGTERM)
            return await pending

    r = asyncio.run(run())
    assert r.status_code == 200
    np.testing.assert_allclose(np.array(r.json()), _want(original, ["drained"]), atol=2e-5, rtol=1e-4)
    assert s.proc.wait(30) == 0
    assert not [pid for pid in children if _running(pid)]  # the worker ended before the server


def test_a_worker_that_cannot_load_stops_the_server(model_dir, tmp_path):
    """A model whose weights do not read: the worker's error, and the server never serves."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(RuntimeError, match="the worker process for cpu could not load the model") as e:
        Server(str(broken), env=PROCESS)
    assert "safetensors" in str(e.value).lower()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the worker process through /proc")
def test_a_killed_worker_fails_its_requests_and_health(model_dir):
    """A worker process killed while a request waits in it: that request and the next get 500,
    ``/health`` 503 naming the cause, and the server still stops on SIGTERM."""
    s = Server(model_dir, env={"RAGGED_SERVE_BATCH_DELAY": "1.0", **PROCESS})
    try:
        (worker,) = _workers_of(s.proc.pid)

        async def run():
            async with httpx.AsyncClient(timeout=30) as client:
                pending = asyncio.ensure_future(client.post(s.url + "/embed", json={"inputs": ["in flight"]}))
                await asyncio.sleep(0.5)  # the batch waits in the worker
                os.kill(worker, signal.SIGKILL)
                first = await pending
                nxt = await client.post(s.url + "/v1/embeddings", json={"input": "next"})
                return first, nxt, await client.get(s.url + "/health")

        first, nxt, health = asyncio.run(run())
        assert first.status_code == 500 and "killed by SIGKILL" in first.json()["error"], first.text
        assert nxt.status_code == 500 and nxt.json()["error"]["type"] == "server_error", nxt.text
        assert health.status_code == 503 and "killed by SIGKILL" in health.json()["error"]
    finally:
        s.stop()
    assert s.proc.returncode == 0


class _FakeRunner:
    """A model of the engine's runner interface: token ids are the characters' codes, each text's
    embedding the sum of its ids in every column."""

    class st:  # noqa: N801  (what the engine reads of the SentenceTransformer)
        max_seq_length = 64

        @staticmethod
        def parameters():
            return iter([torch.zeros(1)])

        @staticmethod
        def get_sentence_embedding_dimension():
            return 3

    def tokenize(self, texts, prompt=None):
        ids = [np.array([ord(c) for c in t], np.int64) for t in texts]
        return np.array([len(i) for i in ids]), np.concatenate(ids), None, {}

    def run(self, lengths, flat, types, extra):
        sums = np.add.reduceat(flat, np.cumsum(lengths) - lengths)
        return torch.tensor(sums, dtype=torch.float32)[:, None].expand(-1, 3)


def test_engine_finish_runs_off_the_loop_and_fails_its_request_only():
    """``Engine.post(..., finish)``: the future gets ``finish(request)``, computed in the thread
    that completes the request, not the event loop's; a ``finish`` that raises fails its own
    request, and the other requests of the same batch are answered."""
    from ragged.integrations.serve_engine import Engine
    from ragged.integrations.serve_metrics import Metrics

    engine = Engine([_FakeRunner()], 1024, Metrics())
    assert engine.dimension == 3
    threads = []

    def good(request):
        threads.append(threading.get_ident())
        return (request.rows.copy(), request.tokens)

    def bad(request):
        raise ValueError("finish failed")

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [engine.post(loop, ["ab", "c"], None, False, good), engine.post(loop, ["xyz"], None, False, bad),
                engine.post(loop, ["d"], None, False)]  # fmt: skip
        return await asyncio.gather(*(j.future for j in jobs), return_exceptions=True)

    try:
        first, second, third = asyncio.run(main())
    finally:
        engine.stop()
    rows, tokens = first
    np.testing.assert_array_equal(rows, [[ord("a") + ord("b")] * 3, [ord("c")] * 3])
    assert tokens == 3
    assert isinstance(second, ValueError) and "finish failed" in str(second)
    np.testing.assert_array_equal(third, [[ord("d")] * 3])
    assert threads and threading.get_ident() not in threads


def test_engine_batches_split_requests_at_text_boundaries_within_the_budget():
    """Spans of many requests cut into batches of at most ``max_batch_tokens`` real tokens (a
    text longer than the budget alone), split at text boundaries, in arrival order; every
    request gets its own rows, in its order, whatever the cuts."""
    from ragged.integrations.serve_engine import Engine
    from ragged.integrations.serve_metrics import Metrics

    runner, batches, budget = _FakeRunner(), [], 10
    run = runner.run
    runner.run = lambda lengths, flat, types, extra: (
        batches.append(lengths.tolist()),
        run(lengths, flat, types, extra),
    )[1]
    rng = random.Random(3)
    requests = [["x" * rng.randint(1, 7) for _ in range(rng.randint(1, 6))] for _ in range(40)]
    requests[5] = ["y" * 23, "z"]  # one text over the budget
    engine = Engine([runner], budget, Metrics())

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [engine.post(loop, texts, None, False) for texts in requests]
        return await asyncio.gather(*(j.future for j in jobs))

    try:
        got = asyncio.run(main())
    finally:
        engine.stop()
    for texts, rows in zip(requests, got):
        np.testing.assert_array_equal(rows[:, 0], [sum(map(ord, t)) for t in texts])
    assert [n for b in batches for n in b] == [len(t) for texts in requests for t in texts]  # arrival order
    for b in batches:
        assert sum(b) <= budget or len(b) == 1, b
    assert any(sum(b) > budget for b in batches) and len(batches) < sum(map(len, requests))
    assert engine.metrics.texts == sum(map(len, requests))


def test_stack_sampler_sees_a_busy_thread(tmp_path):
    """``RAGGED_SERVE_PROFILE``'s sampler: a thread spinning in a named function shows up in
    ``stacks.txt`` under its thread's name, and bench.serve_load's summary reads the file."""
    from ragged.integrations.serve_engine import sample_stacks

    sys.path.insert(0, ROOT)
    from bench.serve_load import profile_summary

    done = threading.Event()

    def spin_here():
        while not done.is_set():
            sum(range(1000))

    worker = threading.Thread(target=spin_here, name="spinner")
    finish = sample_stacks(str(tmp_path), interval=0.001)
    worker.start()
    time.sleep(0.3)
    done.set()
    worker.join()
    finish()
    lines = (tmp_path / "stacks.txt").read_text().splitlines()
    spun = [ln for ln in lines if ln.startswith("spinner;") and "spin_here" in ln]
    assert spun and all(int(ln.rpartition(" ")[2]) > 0 for ln in spun)
    summary = profile_summary(str(tmp_path))
    assert "## spinner:" in summary and "spin_here" in summary
    mine = summary.split("## spinner:")[1].split("\n## ")[0]  # the spinner's section
    assert "inclusive:" in mine and "spin_here" in mine.split("inclusive:")[1]


def test_stack_sampler_reset_and_dump_window_the_samples(tmp_path):
    """``reset`` drops the samples before it and ``dump`` writes those after it (the window
    bench.serve_load profiles each row over): a thread that stopped spinning before the reset
    is not in the dump, one that spun after it is."""
    from ragged.integrations.serve_engine import sample_stacks

    sys.path.insert(0, ROOT)
    from bench.serve_load import _profile_mark

    def spin(name, seconds):
        def body():
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                sum(range(1000))

        t = threading.Thread(target=body, name=name)
        t.start()
        t.join()

    finish = sample_stacks(str(tmp_path), interval=0.001)
    try:
        spin("before", 0.2)
        _profile_mark(str(tmp_path), "reset")
        assert not (tmp_path / "reset").exists()
        spin("after", 0.2)
        _profile_mark(str(tmp_path), "dump")
        assert not (tmp_path / "dump").exists()
        dumped = (tmp_path / "stacks.txt").read_text()
    finally:
        finish()
    assert "after;" in dumped and "before;" not in dumped


def test_engine_applies_the_models_truncate_dim():
    """A model saved with ``truncate_dim`` answers rows of that width, as its ``encode`` does."""
    from ragged.integrations.serve_engine import Engine
    from ragged.integrations.serve_metrics import Metrics

    runner = _FakeRunner()
    runner.st = type("st", (_FakeRunner.st,), {"truncate_dim": 2})
    engine = Engine([runner], 1024, Metrics())

    async def main():
        job = engine.post(asyncio.get_running_loop(), ["ab", "c"], None, False)
        return await job.future

    try:
        rows = asyncio.run(main())
    finally:
        engine.stop()
    assert engine.truncate_dim == 2 and rows.shape == (2, 2)
    np.testing.assert_array_equal(rows, [[ord("a") + ord("b")] * 2, [ord("c")] * 2])


def test_bench_reads_the_servers_batches_from_metrics(either_server):
    """bench.serve_load's row statistics from two reads of ``/metrics`` around real requests:
    batches, texts and tokens per batch as the counters moved; the time in the pipe to a worker
    process is its own stage (none in thread mode)."""
    server = either_server
    sys.path.insert(0, ROOT)
    from bench.serve_load import batch_stats, server_counters

    before = server_counters(server.url)
    assert before is not None
    texts = _texts(30, 21)
    r = httpx.post(server.url + "/embed", json={"inputs": texts})
    assert r.status_code == 200, r.text
    after = server_counters(server.url)
    stats = batch_stats(before, after, 1.0)
    moved = after["ragged_texts_total"] - before["ragged_texts_total"]
    assert moved == len(texts) and stats is not None
    assert stats["texts"] * stats["batches_s"] == pytest.approx(len(texts))
    assert stats["tokens"] >= stats["texts"] and stats["batch_ms"] > 0
    assert batch_stats(before, before, 1.0) is None  # no batch ran: no row
    # one request counted in the stage times; each stage non-negative, and together no longer
    # than the client waited
    stages = stats["stages"]
    assert after["ragged_request_stage_requests_total"] - before["ragged_request_stage_requests_total"] == 1
    assert set(stages) == {"read", "tokenize", "queue", "batch", "pipe", "finish", "hand_over", "resume"}
    assert all(v >= 0 for v in stages.values()) and stages["batch"] > 0
    workers = httpx.get(server.url + "/health").json()["workers"]
    assert (stages["pipe"] > 0) == (workers == "process")
    assert sum(stages.values()) <= 1e3 * r.elapsed.total_seconds()
