"""The baseline of ``bench.serve_load``: sentence-transformers behind an ASGI app as users write it
(FastAPI's shape: a synchronous endpoint, run in the thread pool, one ``encode`` per request,
no batching across requests), on the same stack as ``ragged.serve`` (Starlette on uvicorn) and
with its ``/embed`` request and answer, so that one load generator drives both.

``python -m bench.st_server MODEL [--port 8081] [--device cuda|cpu] [--dtype bf16|fp16|fp32]``
"""

from __future__ import annotations

import argparse
import json


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.st_server")
    p.add_argument("model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8081)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None)
    args = p.parse_args(argv)
    import orjson
    import torch
    import uvicorn
    from sentence_transformers import SentenceTransformer
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device == "cuda" else "fp32")
    ]
    model = SentenceTransformer(args.model, device=device).to(dtype).eval()

    def encode(texts, normalize):
        return model.encode(texts, batch_size=32, normalize_embeddings=normalize, convert_to_numpy=True)

    async def embed(request):
        body = json.loads(await request.body())
        inputs = body["inputs"]
        texts = [inputs] if isinstance(inputs, str) else inputs
        rows = await run_in_threadpool(encode, texts, bool(body.get("normalize", True)))
        return Response(orjson.dumps(rows, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")

    async def health(request):
        return JSONResponse({"status": "ok"})

    app = Starlette(routes=[Route("/embed", embed, methods=["POST"]), Route("/health", health)])
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
