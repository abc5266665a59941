"""A bounded load test of ``python -m ragged.serve`` beside sentence-transformers behind an ASGI
app (``bench.st_server``: one ``encode`` per request, as FastAPI servers are written), on
loopback only.

``python -m bench.serve_load [--device cuda|cpu] [--clients 1 16 256] [--sizes 1 32]
[--requests 2000] [--seconds 20] [--tiny] [--out FILE.md] [--profile DIR] [--server-env NAME=VALUE ...]``

Both servers load the same model: all-MiniLM-L6-v2's shape (BERT 6 x 384, random weights,
``bench.embed_wall``'s) with the project corpus's tokenizer, bf16 on a GPU, fp32 on the CPU
(``--tiny``: a 2 x 32 model). For every request size (``--sizes``: texts per request, drawn from
the corpus in order) and every count of concurrent clients (``--clients``), each server answers
``--requests`` requests or runs ``--seconds``, whichever ends first, after a warm-up of the same
shape (its compiles and graph captures; at most 5 s); clients are spread over ``--procs`` processes (each an
asyncio loop of kept-alive HTTP/1.1 connections), each client sending its next request when the last one is
answered. Reported per row: requests/s and texts/s over the timed window, latency p50 and p99
(ms), and errors. The converted model's in-process ``encode`` of the same texts (texts/s) is the
reference for the 32-text rows. For ragged.serve a second table gives its batches in each timed row
(from its ``/metrics``): how many, how full, how long. ``--profile DIR`` samples the stacks of
ragged.serve's threads (``RAGGED_SERVE_PROFILE=DIR``) over each row's timed window and prints,
per row and thread, where the host time goes (``DIR/row_<size>x<clients>.txt``). ``--server-env``
sets ragged.serve's environment (``RAGGED_SERVE_WORKERS=process``: the model in a worker process
per GPU rather than the server's threads, for an A/B); the table's header names where it ran its model
(its ``/health``) and that environment.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

JSON = {"content-type": "application/json"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In a child before exec: the kernel sends it SIGTERM when the bench process dies, however it
    dies (a server left behind would load the machine's later runs)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the SIGTERM handler of main() still stops it
        pass


def start(cmd: list[str], url: str, timeout: float = 600, env: dict | None = None) -> subprocess.Popen:
    import httpx

    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[2]} exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd[2]} did not answer /health")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


async def _post(reader, writer, head: bytes, body: bytes) -> bool:
    """One request on a kept-alive HTTP/1.1 connection; True on a 200 answer (its body read whole)."""
    writer.write(head + body)
    status_line = await reader.readuntil(b"\r\n")
    length = 0
    while True:
        line = await reader.readuntil(b"\r\n")
        if line == b"\r\n":
            break
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length:
        await reader.readexactly(length)
    return status_line.split(b" ", 2)[1] == b"200"


def _client_proc(url: str, bodies: list[bytes], clients: int, count: int, seconds: float, start_at: float, out) -> None:
    """One process of clients: ``clients`` kept-alive connections, ``count`` requests in all (or
    ``seconds``). The client is HTTP/1.1 written over asyncio streams (on uvloop where installed):
    a general client (httpx) spends about a millisecond of host per request, which at a few
    hundred clients per process bounded the rows by the load generator, not the server."""
    host, port = url.split("//", 1)[1].split(":")
    head = f"POST /embed HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\ncontent-length: "
    heads = [f"{head}{len(b)}\r\n\r\n".encode() for b in bodies]

    async def run():
        latencies, errors = [], 0
        sent = 0
        end = start_at + seconds

        async def one_client():
            nonlocal sent, errors
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                while sent < count and time.time() < end:
                    k = sent % len(bodies)
                    sent += 1
                    t0 = time.perf_counter()
                    try:
                        ok = await _post(reader, writer, heads[k], bodies[k])
                    except (OSError, asyncio.IncompleteReadError, ValueError):
                        ok = False
                        writer.close()
                        reader, writer = await asyncio.open_connection(host, int(port))
                    if ok:
                        latencies.append(time.perf_counter() - t0)
                    else:
                        errors += 1
            finally:
                writer.close()

        await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.time()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        return latencies, errors, time.time() - t0

    try:
        import uvloop

        out.put(uvloop.run(run()))
    except ImportError:
        out.put(asyncio.run(run()))


def load(url: str, texts: list[str], size: int, clients: int, count: int, seconds: float, procs: int) -> dict:
    """Requests of ``size`` texts from ``clients`` concurrent clients over ``procs`` processes."""
    import json

    # truncate: as sentence-transformers' encode truncates (ragged.serve refuses a long text unless asked)
    starts = range(0, len(texts) - size, size)
    bodies = [json.dumps({"inputs": texts[i : i + size], "truncate": True}).encode() for i in starts][:4096]
    procs = max(1, min(procs, clients))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 2.0  # every process starts together
    workers = []
    for k in range(procs):
        share = clients // procs + (k < clients % procs)
        n = count // procs + (k < count % procs)
        rotated = bodies[k::procs] or bodies
        p = ctx.Process(target=_client_proc, args=(url, rotated, share, n, seconds, start_at, out))
        p.start()
        workers.append(p)
    try:
        results = [out.get() for _ in workers]
    except BaseException:  # stopped (SIGTERM, Ctrl-C): no client left running
        for p in workers:
            p.terminate()
        raise
    for p in workers:
        p.join()
    latencies = np.array([x for r in results for x in r[0]])
    errors = sum(r[1] for r in results)
    wall = max(r[2] for r in results)
    done = latencies.size
    return {
        "wall": wall,
        "rps": done / wall if wall else 0.0,
        "texts_s": done * size / wall if wall else 0.0,
        "p50": float(np.percentile(latencies, 50) * 1e3) if done else float("nan"),
        "p99": float(np.percentile(latencies, 99) * 1e3) if done else float("nan"),
        "errors": errors,
        "done": done,
    }


_COUNTERS = ("ragged_batches_total", "ragged_texts_total", "ragged_tokens_total", "ragged_batch_seconds_sum")
_STAGED = "ragged_request_stage_requests_total"
_STAGE_PREFIX = 'ragged_request_stage_seconds_total{stage="'  # the stages, named and ordered by the server


def server_counters(url: str) -> dict | None:
    """The server's batch counters from its ``/metrics`` (None: a server without them)."""
    import httpx

    try:
        r = httpx.get(url + "/metrics", timeout=5)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out = {}
    for line in r.text.splitlines():
        name, _, value = line.partition(" ")
        if name in _COUNTERS or name == _STAGED:
            out[name] = float(value)
        elif name.startswith(_STAGE_PREFIX):
            out.setdefault("stages", {})[name[len(_STAGE_PREFIX) : -2]] = float(value)
    return out if all(k in out for k in _COUNTERS) else None


def batch_stats(before: dict | None, after: dict | None, wall: float) -> dict | None:
    """Per timed row: batches/s, texts and real tokens per batch, and the mean time from a batch's
    launch to its rows on the host (two batches overlap: busy can pass 1)."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in _COUNTERS}
    n = d["ragged_batches_total"]
    if n <= 0 or wall <= 0:
        return None
    out = {
        "batches_s": n / wall,
        "texts": d["ragged_texts_total"] / n,
        "tokens": d["ragged_tokens_total"] / n,
        "batch_ms": 1e3 * d["ragged_batch_seconds_sum"] / n,
        "busy": d["ragged_batch_seconds_sum"] / wall,
    }
    if all(_STAGED in c and "stages" in c for c in (before, after)):
        staged = after[_STAGED] - before[_STAGED]
        if staged > 0:  # the mean time of a request in each stage, ms
            out["stages"] = {k: 1e3 * (v - before["stages"].get(k, 0.0)) / staged for k, v in after["stages"].items()}
    return out


_IDLE = ("wait (threading.py", "Runner.run (runners.py", "select (selectors.py", "get (queue.py", "_worker (thread.py")


def profile_summary(folder: str, top: int = 12, path: str | None = None) -> str:
    """Per server thread, from the stack samples of ``RAGGED_SERVE_PROFILE`` (``stacks.txt``, or
    ``path``): samples, the share spent waiting (a leaf frame that blocks), the busiest leaf
    frames, and the functions that hold the busy samples inclusively (a frame anywhere on the
    stack; each function counted once per sample)."""
    import collections

    path = path or os.path.join(folder, "stacks.txt")
    if not os.path.exists(path):
        return f"(no {path})"
    total: collections.Counter = collections.Counter()
    idle: collections.Counter = collections.Counter()
    leaves: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            thread, *frames = stack.split(";")
            count = int(n)
            total[thread] += count
            leaf = frames[-1] if frames else "?"
            if any(leaf.startswith(p) for p in _IDLE):
                idle[thread] += count
                continue
            leaves[thread][leaf] += count
            for fn in {frame.partition(" (")[0] for frame in frames}:
                inclusive[thread][fn] += count
    out = []
    for thread, n in total.most_common():
        out.append(f"## {thread}: {n} samples, {100 * idle[thread] / n:.0f}% waiting")
        out += [f"  {100 * c / n:5.1f}%  {leaf}" for leaf, c in leaves[thread].most_common(top)]
        if inclusive[thread]:
            out.append("  inclusive:")
            out += [f"  {100 * c / n:5.1f}%  {fn}" for fn, c in inclusive[thread].most_common(2 * top)]
    return "\n".join(out) + "\n"


def _profile_mark(folder: str, what: str) -> None:
    """Ask ragged.serve's stack sampler to ``reset`` its samples or ``dump`` them to
    ``stacks.txt`` (it deletes the file once done; waits for that, at most 2 s)."""
    os.makedirs(folder, exist_ok=True)
    mark = os.path.join(folder, what)
    open(mark, "w").close()
    deadline = time.perf_counter() + 2.0
    while os.path.exists(mark) and time.perf_counter() < deadline:
        time.sleep(0.01)


def encode_rate(model_dir: str, texts: list[str], device: str) -> float:
    """texts/s of the converted model's in-process ``encode`` (after one warm-up call)."""
    import torch
    from sentence_transformers import SentenceTransformer

    import ragged.nn

    st = ragged.nn.convert(SentenceTransformer(model_dir, device=device))
    if device == "cuda":
        st = st.to(torch.bfloat16)
    st.encode(texts, batch_size=32)
    t0 = time.perf_counter()
    st.encode(texts, batch_size=32)
    return len(texts) / (time.perf_counter() - t0)


def server_workers(url: str) -> str | None:
    """Where the server runs its model: ``process`` or ``thread`` (its ``/health``; None for a
    server that does not say)."""
    import httpx

    try:
        body = httpx.get(url + "/health", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return None
    return body.get("workers") if isinstance(body, dict) else None


def _write(args, device: str, inproc: float, rows: list, workers: str | None = None) -> str:
    """The table of the rows so far (written to ``--out`` after every row: a run cut short keeps them)."""
    import torch

    from bench.env import cpu_name, git_state

    state = git_state()
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    lines = [
        f"# bench.serve_load on {name}: {'tiny' if args.tiny else 'MiniLM-shaped'} model, loopback",
        "",
        f"host CPU {cpu_name()} ({os.cpu_count()} cores), torch {torch.__version__}, tree "
        f"{(state.get('git_commit') or '?')[:12]}; {args.requests} requests or {args.seconds} s per row, "
        f"clients over {args.procs} processes; in-process `encode` of the converted model: {inproc:,.0f} texts/s"
        + (f"; ragged.serve's workers: {workers}" if workers else "")
        + (f"; ragged.serve's environment: {' '.join(args.server_env)}" if args.server_env else ""),
        "",
        "| server | texts/request | clients | requests/s | texts/s | p50 ms | p99 ms | errors | vs ST server |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {(s, c): r for srv, s, c, r in rows if srv == "st"}
    for srv, size, clients, r in rows:
        ref = base.get((size, clients))
        ratio = f"{r['rps'] / ref['rps']:.1f}x" if ref and ref["rps"] and srv == "ragged" else ""
        lines.append(
            f"| {'ragged.serve' if srv == 'ragged' else 'ST server'} | {size} | {clients} | {r['rps']:,.1f} | "
            f"{r['texts_s']:,.0f} | {r['p50']:.2f} | {r['p99']:.2f} | {r['errors']} | {ratio} |"
        )
    stats = [(size, clients, r["batches"]) for srv, size, clients, r in rows if r.get("batches")]
    if stats:
        lines += [
            "",
            "ragged.serve's batches in each timed row (its /metrics): texts and real tokens per batch, and the",
            "mean time from a batch's launch to its rows on the host; busy: that time summed over the row's",
            "wall time (two batches are in flight at once, so it can pass 1).",
            "",
            "| texts/request | clients | batches/s | texts/batch | tokens/batch | batch ms | busy |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for size, clients, b in stats:
            lines.append(
                f"| {size} | {clients} | {b['batches_s']:,.1f} | {b['texts']:,.1f} | {b['tokens']:,.0f} | "
                f"{b['batch_ms']:.2f} | {b['busy']:.2f} |"
            )
    staged = [(size, clients, b["stages"]) for size, clients, b in stats if b.get("stages")]
    if staged:
        names = list(staged[0][2])  # the server's stages, in its order
        lines += [
            "",
            "Where a request's time goes in each timed row (its /metrics, mean ms per answered request): its body",
            "read and parsed, the tokenizer (waiting and tokenizing), the queue, its batch (launch to rows on the",
            "host), the rest of the round trip to a worker process (pipe: the transfers, and the waits for a busy",
            "worker to read the batch and for the finisher to read the answer; 0 with the model in the server's",
            "threads), its response body built, the hand-over to the event loop, the handler resumed.",
            "",
            "| texts/request | clients | " + " | ".join(names) + " |",
            "|---:|---:|" + "---:|" * len(names),
        ]
        for size, clients, st in staged:
            cells = " | ".join(f"{st.get(k, float('nan')):.2f}" for k in names)
            lines.append(f"| {size} | {clients} | {cells} |")
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_load", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    p.add_argument("--servers", nargs="+", default=["ragged", "st"], choices=("ragged", "st"))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="sample ragged.serve's thread stacks (RAGGED_SERVE_PROFILE=DIR) over each timed row",
    )
    p.add_argument(
        "--server-env",
        nargs="*",
        default=[],
        metavar="NAME=VALUE",
        help="environment variables for the ragged.serve process (e.g. RAGGED_SERVE_WORKERS=thread for the "
        "model in the server's threads)",
    )
    args = p.parse_args(argv)
    bad = [kv for kv in args.server_env if "=" not in kv or not kv.split("=", 1)[0]]
    if bad:
        p.error(f"--server-env takes NAME=VALUE pairs, got {' '.join(bad)}")
    # a bench stopped by `timeout` (SIGTERM) unwinds, so the finally below stops its server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch

    sys.path.insert(0, ROOT)
    from bench.embed_wall import build_model
    from bench.embed_wall import texts as corpus_texts

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    texts = corpus_texts(max(4096, 64 * max(args.sizes)))
    rows = []
    workers = None  # ragged.serve's, read from it once it runs
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(tmp, args.tiny)
        inproc = encode_rate(model, texts, device)
        print(f"in-process encode of the converted model: {inproc:,.0f} texts/s", flush=True)
        for server in args.servers:
            port = _port()
            url = f"http://127.0.0.1:{port}"
            if server == "ragged":
                cmd = [sys.executable, "-m", "ragged.serve", model, "--port", str(port), "--device", device]
            else:
                cmd = [sys.executable, "-m", "bench.st_server", model, "--port", str(port), "--device", device]
            profile = {"RAGGED_SERVE_PROFILE": os.path.abspath(args.profile)} if args.profile else {}
            extra = dict(kv.split("=", 1) for kv in args.server_env)
            proc = start(cmd, url, env={**profile, **extra} if server == "ragged" else None)
            if server == "ragged":
                workers = server_workers(url)
            try:
                for size in args.sizes:
                    for clients in args.clients:
                        warm = max(clients * 2, 64 // size)
                        load(url, texts, size, clients, warm, min(args.seconds, 5.0), args.procs)
                        before = server_counters(url) if server == "ragged" else None
                        sampled = bool(profile) and server == "ragged"
                        if sampled:
                            _profile_mark(args.profile, "reset")
                        r = load(url, texts, size, clients, args.requests, args.seconds, args.procs)
                        if sampled:
                            _profile_mark(args.profile, "dump")
                        after = server_counters(url) if server == "ragged" else None
                        if sampled:
                            summary = profile_summary(args.profile)
                            with open(os.path.join(args.profile, f"row_{size}x{clients}.txt"), "w") as f:
                                f.write(summary)
                            print(f"## ragged.serve's threads, {size} texts x {clients} clients\n{summary}", flush=True)
                        r["batches"] = batch_stats(before, after, r["wall"])
                        rows.append((server, size, clients, r))
                        _write(args, device, inproc, rows, workers)
                        print(
                            f"{server:6s} size {size:3d} clients {clients:4d}: {r['rps']:9.1f} req/s "
                            f"{r['texts_s']:10.1f} texts/s p50 {r['p50']:8.2f} ms p99 {r['p99']:8.2f} ms "
                            f"errors {r['errors']}",
                            flush=True,
                        )
            finally:
                stop(proc)
    print(_write(args, device, inproc, rows, workers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
