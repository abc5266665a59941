"""``python -m ragged.serve`` on a GPU (``pytest -m gpu``): the tiny model of tests/test_serve.py served
in bf16 from CUDA graphs, against the float32 original on the CPU (cosine), under 200 concurrent
requests of mixed sizes, and in fp32 (close to the original's values); each with the model in a
worker process (the default on CUDA) and in the server's threads."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")

# model_dir and original are fixtures (used by name, not as values): F401 would drop them.
from test_serve import Server, _texts, _want, model_dir, original  # noqa: E402, F401

pytestmark = pytest.mark.gpu


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("workers", ["process", "thread"])
def test_bf16_server_under_concurrent_load(model_dir, original, workers):
    s = Server(model_dir, "--device", "cuda", "--max-batch-tokens", "1024", "--workers", workers)
    try:
        rng = random.Random(5)
        requests = [_texts(rng.randint(1, 40), 300 + i) for i in range(200)]
        unique = sorted({t for r in requests for t in r})
        want = dict(zip(unique, _want(original, unique)))

        async def run():
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as client:
                return await asyncio.gather(*(client.post(s.url + "/embed", json={"inputs": r}) for r in requests))

        for texts, r in zip(requests, asyncio.run(run())):
            assert r.status_code == 200, r.text
            got = np.array(r.json())
            assert _cosines(got, np.stack([want[t] for t in texts])).min() > 0.999
        assert "ragged_batches_total" in httpx.get(s.url + "/metrics").text
        assert httpx.get(s.url + "/health").json()["workers"] == workers
    finally:
        s.stop()


@pytest.mark.parametrize("workers", ["process", "thread"])
def test_fp32_server_values(model_dir, original, workers):
    s = Server(model_dir, "--device", "cuda", "--dtype", "fp32", "--workers", workers)
    try:
        texts = _texts(20, 9)
        r = httpx.post(s.url + "/v1/embeddings", json={"input": texts})
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]])
        np.testing.assert_allclose(got, _want(original, texts), atol=1e-4, rtol=1e-3)
    finally:
        s.stop()
