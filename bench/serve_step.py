"""``python -m bench.serve_step``: ragged.serve's engine step without the server, on a GPU.

The MiniLM-shaped model of ``bench.serve_load`` (bf16), the corpus cut into batches of 611 texts
(at most 16,384 real tokens: the server's batches at 32-text requests and 256 clients), each run
as the server's batch thread runs it (``PackedRunner.run`` and the copy to pinned host memory),
timed over all batches: one after the other without waiting (pipelined), waiting for each, with
the GPU's own span, then beside a second thread that tokenizes in a loop (the tokenizer's Rust
code releases the GIL) and beside one busy in Python (holding the GIL but for the switch
interval), at the default switch interval and at 0.5 ms. Each torch op releases the GIL and
takes it back: beside a thread running Python that costs up to the switch interval per op.
"""

import sys
import tempfile
import threading
import time

import numpy as np
import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("python -m bench.serve_step: needs a CUDA GPU", file=sys.stderr)
        return 2
    from sentence_transformers import SentenceTransformer

    import ragged.nn
    from bench.embed_wall import build_model
    from bench.embed_wall import texts as corpus_texts
    from ragged.integrations.serve_worker import to_host
    from ragged.nn.hf.sentence import packed_runner

    texts = corpus_texts(16384)
    N = 611  # texts per batch
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(tmp, False)
        st = ragged.nn.convert(SentenceTransformer(model, device="cuda")).to(torch.bfloat16)
        r = packed_runner(st, 16384)
        batches = []
        for i in range(0, len(texts) - N, N):
            lengths, flat, types, extra = r.tokenize(texts[i : i + N])
            lengths = np.asarray(lengths, dtype=np.int64)
            while lengths.sum() > 16384:
                lengths, flat = lengths[:-1], flat[: int(lengths[:-1].sum())]
            batches.append((lengths, np.asarray(flat), types, extra))
        print("batches", len(batches), "tokens/batch", np.mean([b[0].sum() for b in batches]), flush=True)

        def rate(label, sync_each):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ev = None
            for b in batches:
                h, ev = to_host(r.run(*b))
                if sync_each:
                    ev.synchronize()
            ev.synchronize()
            dt = time.perf_counter() - t0
            print(
                f"{label}: {1e3 * dt / len(batches):.2f} ms/batch, {sum(len(b[0]) for b in batches) / dt:,.0f} texts/s",
                flush=True,
            )

        for _ in range(2):
            rate("warm", False)
        rate("pipelined", False)
        rate("sync each", True)
        g = torch.cuda.Event(enable_timing=True)
        g2 = torch.cuda.Event(enable_timing=True)
        g.record()
        rate("pipelined (gpu timed)", False)
        g2.record()
        g2.synchronize()
        print(f"  gpu span {g.elapsed_time(g2) / len(batches):.2f} ms/batch", flush=True)
        stop = threading.Event()

        def busy_tokenize():
            while not stop.is_set():
                r.tokenize(texts[:2000])

        def busy_python():
            while not stop.is_set():
                sum(i * i for i in range(10000))

        for name, fn in (("tokenizer thread", busy_tokenize), ("python thread", busy_python)):
            t = threading.Thread(target=fn, daemon=True)
            stop.clear()
            t.start()
            rate(f"pipelined + a busy {name}", False)
            stop.set()
            t.join()
        sys.setswitchinterval(0.0005)
        t = threading.Thread(target=busy_python, daemon=True)
        stop.clear()
        t.start()
        rate("pipelined + a busy python thread, switch 0.5 ms", False)
        stop.set()
        t.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
