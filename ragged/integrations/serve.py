"""``python -m ragged.serve MODEL [options]``: an HTTP embedding server over a sentence-transformers
model converted by :func:`ragged.nn.convert`, batching the texts of concurrent requests by tokens.

The stack is Starlette on uvicorn, with uvicorn's C HTTP parser and event loop where installed
(httptools and uvloop, both in the ``serve`` extra). Endpoints:

* ``POST /v1/embeddings``, OpenAI's: ``{"input": str | [str], "model": str, "encoding_format":
  "float" | "base64", "dimensions": int}``, answered ``{"object": "list", "data": [{"object":
  "embedding", "index": i, "embedding": [...] | base64 of float32}], "model", "usage":
  {"prompt_tokens", "total_tokens"}}``; embeddings L2-normalised (after ``dimensions`` keeps the
  first dimensions); errors as ``{"error": {"message", "type", "param", "code"}}``, so that the
  ``openai`` client reads them;
* ``POST /embed``, text-embeddings-inference's: ``{"inputs": str | [str], "normalize": true,
  "truncate": false, "prompt_name": null}``, answered ``[[...], ...]``; errors as ``{"error",
  "error_type"}``;
* ``GET /health`` (200 once the model is loaded, ``{"status": "ok", "model", "workers"}``; 503 with
  ``"error"`` once a worker process died), ``GET /metrics`` (Prometheus:
  :mod:`ragged.integrations.serve_metrics`).

Requests are tokenized off the event loop, those posted meanwhile in one call, and batched
across requests by real tokens
(:mod:`ragged.integrations.serve_engine`), one worker per device (``--devices``), CUDA graphs
per bucket on GPUs. ``--workers process`` (``RAGGED_SERVE_WORKERS=process``; opt-in until measured
on a GPU) runs each device's model in a worker process of its own, which loads the model itself
(this process keeps a copy without weights for the tokenizer); ``--workers thread`` (the default)
runs it in this process's threads (:mod:`ragged.integrations.serve_worker` says why a process). The
server starts serving once every worker has loaded its model, and exits with a worker's error if
one could not. Past ``--max-concurrent-requests`` requests in flight the server answers 429
with ``Retry-After``; a request of more than ``--max-client-batch-size`` texts gets 413;
malformed JSON, an empty input, wrong types, an unknown field value and a text longer than the
model takes (without truncation) get 400 with a message. A client that disconnects frees its
place (its queued texts are dropped). SIGTERM (or Ctrl-C) stops accepting connections, answers
the requests in flight, then exits. A batch whose model call raises answers 500 to its own
requests; the server keeps serving. A worker process that dies fails the requests of its batches
(500) and turns ``/health`` to 503.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import signal
import sys
import time
from typing import Any

import numpy as np

__all__ = ["build_app", "main", "parse_args"]

_POLL_S = 0.05  # how often a waiting request checks that its client is still connected
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_WORKERS = ("process", "thread")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ragged.serve", description=__doc__.split("\n")[0])
    p.add_argument("model", metavar="MODEL", help="a sentence-transformers model: a folder or a hub name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda where available")
    p.add_argument("--devices", default="all", help="GPUs to serve from: all, or a list like 0,1 (one worker each)")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default=None, help="default: bf16 on GPUs, fp32 on the CPU")
    p.add_argument("--max-batch-tokens", type=int, default=16384, help="real tokens per batch (a longer text alone)")
    p.add_argument("--max-concurrent-requests", type=int, default=512, help="requests in flight; past it: 429")
    p.add_argument("--max-client-batch-size", type=int, default=256, help="texts per request; past it: 413")
    p.add_argument("--served-model-name", default=None, help="the name answers carry (default: MODEL)")
    p.add_argument(
        "--workers",
        choices=_WORKERS,
        default=None,
        help="each device's model in a process of its own, or in the server's threads (default: "
        "RAGGED_SERVE_WORKERS, else thread)",
    )
    args = p.parse_args(argv)
    if args.workers is None:
        env = os.environ.get("RAGGED_SERVE_WORKERS", "").strip()
        if env and env not in _WORKERS:
            p.error(f"RAGGED_SERVE_WORKERS must be one of {', '.join(_WORKERS)}, got {env!r}")
        args.workers = env or None
    for name in ("max_batch_tokens", "max_concurrent_requests", "max_client_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def _devices(args) -> list:
    import torch

    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cpu":
        return [torch.device("cpu")]
    if not torch.cuda.is_available():
        raise SystemExit("python -m ragged.serve: --device cuda given but no GPU is visible")
    if args.devices == "all":
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    try:
        ids = [int(x) for x in args.devices.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(
            f"python -m ragged.serve: --devices expects all or a list like 0,1, got {args.devices!r}"
        ) from None
    bad = [i for i in ids if not 0 <= i < torch.cuda.device_count()]
    if not ids or bad:
        raise SystemExit(f"python -m ragged.serve: --devices {args.devices}: {torch.cuda.device_count()} GPUs visible")
    return [torch.device("cuda", i) for i in ids]


def _dtype_name(args, devices: list) -> str:
    return _DTYPES[args.dtype or ("bf16" if devices[0].type == "cuda" else "fp32")]


def load_runners(args) -> list:
    """One converted model per device, each in a :class:`ragged.nn.hf.sentence.pipeline.PackedRunner`."""
    import copy

    import torch

    from ragged.nn.hf.sentence import packed_runner

    from .serve_worker import load_converted

    devices = _devices(args)
    st = load_converted(args.model, getattr(torch, _dtype_name(args, devices)))
    runners = []
    for i, device in enumerate(devices):
        model = st if i == len(devices) - 1 else copy.deepcopy(st)
        runners.append(packed_runner(model.to(device), args.max_batch_tokens))
    return runners


def start_workers(args) -> tuple[list, list]:
    """Process mode: one worker process per device, started together and each loading the model
    itself, and a runner over a copy of the model without weights for this process's tokenizer;
    returns once every worker is ready, or raises RuntimeError with a worker's error (every
    worker stopped)."""
    from ragged.nn.hf.sentence import packed_runner

    from .serve_worker import ProcessWorker, WorkerSpec, load_converted

    devices = _devices(args)
    dtype = _dtype_name(args, devices)
    workers: list = []
    try:
        for device in devices:
            workers.append(ProcessWorker(WorkerSpec(args.model, dtype, str(device), args.max_batch_tokens)))
        for worker in workers:  # a model that cannot load fails here, with the worker's error
            worker.wait_ready()
        tokenizer = packed_runner(load_converted(args.model, None, weights=False), args.max_batch_tokens)
    except BaseException:
        for worker in workers:
            worker.stop(5.0)
        raise
    return [tokenizer], workers


def _worker_mode(args) -> str:
    """``--workers``, else ``RAGGED_SERVE_WORKERS``, else ``thread``: worker processes are opt-in
    until a GPU run of ``bench.serve_load`` measures them against threads."""
    return args.workers if args.workers is not None else "thread"


class _Problem(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _texts(body: dict, field: str, limit: int) -> list[str]:
    """The texts of the request's required ``field`` (a string or a list of strings)."""
    if field not in body:
        raise _Problem(400, f"'{field}' is required", field)
    value = body[field]
    if isinstance(value, str):
        texts = [value]
    elif isinstance(value, list) and all(isinstance(t, str) for t in value):
        texts = list(value)
    else:
        raise _Problem(400, f"'{field}' must be a string or a list of strings, got {type(value).__name__}", field)
    if not texts:
        raise _Problem(400, f"'{field}' is empty: give at least one text", field)
    if any(not t for t in texts):
        raise _Problem(400, f"'{field}' holds an empty string (text {texts.index('')})", field)
    if len(texts) > limit:
        raise _Problem(413, f"'{field}' holds {len(texts)} texts, more than the server's {limit} per request", field)
    return texts


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise _Problem(400, f"'{name}' must be true or false, got {json.dumps(value)}", name)
    return value


def build_app(engine, model_name: str, max_concurrent: int, max_client_batch: int, on_shutdown=None):
    """The Starlette application over a running :class:`Engine`."""
    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    metrics = engine.metrics
    state = {"inflight": 0}

    try:
        import orjson

        def dumps(obj: Any) -> bytes:
            return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)

        def loads(raw: bytes) -> Any:
            return orjson.loads(raw)  # its JSONDecodeError is json's

    except ImportError:

        def dumps(obj: Any) -> bytes:
            return json.dumps(obj, default=lambda a: a.tolist()).encode()

        def loads(raw: bytes) -> Any:
            return json.loads(raw)

    def openai_error(p: _Problem) -> Response:
        kind = p.kind if p.status != 429 else "rate_limit_error"
        body = {"error": {"message": p.message, "type": kind, "param": p.param, "code": None}}
        return Response(dumps(body), p.status, media_type="application/json", headers=_retry(p))

    def tei_error(p: _Problem) -> Response:
        kind = {400: "Validation", 413: "Validation", 429: "Overloaded", 503: "Unhealthy"}.get(p.status, "Backend")
        return Response(
            dumps({"error": p.message, "error_type": kind}), p.status, media_type="application/json", headers=_retry(p)
        )

    def _retry(p: _Problem) -> dict:
        return {"Retry-After": "1"} if p.status in (429, 503) else {}

    async def body_of(request: HttpRequest) -> dict:
        raw = await request.body()
        try:
            body = loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _Problem(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise _Problem(400, f"the body must be a JSON object, got {type(body).__name__}")
        return body

    async def embed(request: HttpRequest, texts: list[str], prompt: str | None, truncate: bool, finish):
        """The response body, ``finish(job)`` (run by the engine's thread that completes the
        request: the rows' normalisation and serialisation stay off the event loop), or None
        when the client went away."""
        from .serve_engine import Refused

        try:
            job = engine.post(asyncio.get_running_loop(), texts, prompt, truncate, finish)
        except Refused as e:
            raise _Problem(e.status, e.message, e.param) from None
        # the answer, and every _POLL_S whether the client is still there (no task per request)
        while not job.future.done():
            await asyncio.wait({job.future}, timeout=_POLL_S)
            if not job.future.done() and await request.is_disconnected():
                engine.cancel(job)
                return None
        try:
            out = job.future.result()
        except Refused as e:  # a text over the model's length
            raise _Problem(e.status, e.message, e.param) from None
        except _Problem:  # finish's own refusal
            raise
        except Exception as e:  # the model call of one of its batches raised
            raise _Problem(
                500, f"the model failed on this request's batch: {type(e).__name__}: {e}", None, "server_error"
            ) from None
        job.stamps["answered"] = time.perf_counter()
        metrics.request_stages(request.state.arrived, job.stamps)
        return out

    async def guarded(request: HttpRequest, endpoint: str, handle, error) -> Response:
        started = time.perf_counter()
        request.state.arrived = started
        if state["inflight"] >= max_concurrent:
            metrics.request_done(endpoint, 429, None)
            return error(_Problem(429, f"the server holds {max_concurrent} requests already; retry later"))
        state["inflight"] += 1
        metrics.set_inflight(state["inflight"])
        status = 200
        try:
            out = await handle(request)
            if out is None:  # the client disconnected
                status = 499
                return Response(status_code=499)
            return Response(out, 200, media_type="application/json")
        except _Problem as p:
            status = p.status
            return error(p)
        finally:
            state["inflight"] -= 1
            metrics.set_inflight(state["inflight"])
            metrics.request_done(endpoint, status, time.perf_counter() - started if status == 200 else None)

    async def openai_embeddings(request: HttpRequest) -> Response:
        async def handle(request):
            body = await body_of(request)
            texts = _texts(body, "input", max_client_batch)
            fmt = body.get("encoding_format", "float")
            if fmt not in ("float", "base64"):
                raise _Problem(
                    400, f"'encoding_format' must be 'float' or 'base64', got {json.dumps(fmt)}", "encoding_format"
                )
            dims = body.get("dimensions")
            if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
                raise _Problem(400, f"'dimensions' must be a positive integer, got {json.dumps(dims)}", "dimensions")
            model = body.get("model", model_name)
            if not isinstance(model, str):
                raise _Problem(400, f"'model' must be a string, got {json.dumps(model)}", "model")

            def too_wide(width: int) -> _Problem:
                return _Problem(400, f"'dimensions' is {dims}, more than the model's {width}", "dimensions")

            if dims is not None and engine.dimension is not None and dims > engine.dimension:
                raise too_wide(engine.dimension)

            def finish(job) -> bytes:
                rows = job.rows
                if dims is not None:
                    if dims > rows.shape[1]:
                        raise too_wide(rows.shape[1])
                    rows = rows[:, :dims]
                rows = _normalized(rows)
                if fmt == "base64":
                    data = [
                        {
                            "object": "embedding",
                            "index": i,
                            "embedding": base64.b64encode(r.astype("<f4").tobytes()).decode(),
                        }
                        for i, r in enumerate(rows)
                    ]
                else:
                    data = [{"object": "embedding", "index": i, "embedding": r} for i, r in enumerate(rows)]
                usage = {"prompt_tokens": job.tokens, "total_tokens": job.tokens}
                return dumps({"object": "list", "data": data, "model": model, "usage": usage})

            return await embed(request, texts, None, False, finish)

        return await guarded(request, "/v1/embeddings", handle, openai_error)

    async def tei_embed(request: HttpRequest) -> Response:
        async def handle(request):
            body = await body_of(request)
            texts = _texts(body, "inputs", max_client_batch)
            normalize, truncate = _flag(body, "normalize", True), _flag(body, "truncate", False)
            prompt = None
            name = body.get("prompt_name")
            if name is not None:
                prompts = getattr(engine.runners[0].st, "prompts", None) or {}
                if not isinstance(name, str) or name not in prompts:
                    raise _Problem(
                        400,
                        f"'prompt_name' {json.dumps(name)} is not one of the model's prompts {sorted(prompts)}",
                        "prompt_name",
                    )
                prompt = prompts[name]

            def finish(job) -> bytes:
                return dumps(_normalized(job.rows) if normalize else job.rows)

            return await embed(request, texts, prompt, truncate, finish)

        return await guarded(request, "/embed", handle, tei_error)

    async def health(request: HttpRequest) -> Response:
        problem = engine.problem()
        if problem is not None:
            body = {"status": "unhealthy", "model": model_name, "workers": engine.mode, "error": problem}
            return JSONResponse(body, 503)
        return JSONResponse({"status": "ok", "model": model_name, "workers": engine.mode})

    async def metrics_endpoint(request: HttpRequest) -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if on_shutdown is not None:
            await asyncio.get_running_loop().run_in_executor(None, on_shutdown)

    routes = [
        Route("/v1/embeddings", openai_embeddings, methods=["POST"]),
        Route("/embed", tei_embed, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def _normalized(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.maximum(norms, 1e-12)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        print("python -m ragged.serve needs the serve extra: pip install 'ragged[serve]'", file=sys.stderr)
        return 2
    from .serve_engine import Engine, sample_stacks
    from .serve_metrics import Metrics

    mode = _worker_mode(args)
    if mode == "process":
        try:
            runners, workers = start_workers(args)
        except RuntimeError as e:
            print(f"python -m ragged.serve: {e}", file=sys.stderr, flush=True)
            return 1
        engine = Engine(runners, args.max_batch_tokens, Metrics(), workers=workers)
        where = ", ".join(f"{w.device} (process {w.process.pid})" for w in workers)
    else:
        runners = load_runners(args)
        engine = Engine(runners, args.max_batch_tokens, Metrics())
        where = ", ".join(str(next(r.st.parameters()).device) for r in runners)
    name = args.served_model_name or args.model
    app = build_app(engine, name, args.max_concurrent_requests, args.max_client_batch_size, on_shutdown=engine.stop)
    print(f"ragged.serve: {name} on {where}, http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=60)
    # uvicorn drains on SIGTERM, then raises the signal again for the handler found at its start:
    # this one ends the process with status 0 (a drained, orderly stop)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    profile = os.environ.get("RAGGED_SERVE_PROFILE")
    stop_sampling = sample_stacks(profile) if profile else None
    try:
        uvicorn.Server(config).run()
    finally:
        engine.stop()  # already done by the app's shutdown, unless uvicorn ended without it
        if stop_sampling is not None:
            stop_sampling()
    return 0
