"""Host cost of one eager call of ragged's ops, layer by layer (tiny inputs, so the GPU waits).

Development tool, run on a GPU: ``python -m bench.overhead`` (or ``python bench/overhead.py``
with another tree's ragged first on ``PYTHONPATH``, as :mod:`bench.ab` does). Small problems in
eager mode are bound by this cost, not by the kernels. Each row is the mean time per call over
2000 calls (``--calls``) after a warm-up; a row the ragged it runs against cannot run prints
``n/a`` with the reason (an older tree without that function, say), so the same script compares
two trees. ``--out`` compares the rows with the per-call budgets, GPU targets: on CPU
(``--device cpu``, or no GPU) they are not judged.
"""

import sys
import time

import torch

import ragged


def per_call_us(fn, n=2000, device="cuda"):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(min(50, n)):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    sync()  # the GPU caught up: a host-bound row is then host time
    return (time.perf_counter() - start) / n * 1e6


def rows(dev: str = "cuda"):
    """``(name, fn)`` per row, on tensors of device ``dev``."""
    x = torch.randn(4, 8, 16, device=dev)
    lengths = [3, 8, 0, 5]
    rt = ragged.pack(x, lengths=lengths)
    off, total, vals = rt.offsets, rt.num_tokens, rt.values
    idx = torch.arange(total, device=dev)
    flat = x.view(-1, 16)
    yield "index_select (torch op)", lambda: flat.index_select(0, idx)
    yield "torch.empty", lambda: torch.empty(total, 16, device=dev)
    for be in ("cuda", "triton", "torch"):
        yield f"{be}: ragged.pack(x, lengths=...)", lambda be=be: ragged.pack(x, lengths=lengths, backend=be)
        yield f"{be}: pack_values", lambda be=be: ragged.pack_values(x, off, total, backend=be)
        yield f"{be}: torch.ops.ragged.pack", lambda be=be: torch.ops.ragged.pack(x, off, total, False, be)
        yield f"{be}: unpack_values", lambda be=be: ragged.unpack_values(vals, off, 8, backend=be)
    yield "backends.select of pack, cuda forced", lambda: ragged.backends.select("pack", "cuda", x.device, x, off)

    bf = torch.bfloat16
    q = ragged.RaggedTensor(torch.randn(total, 12, 64, device=dev, dtype=bf), off, rt.max_len, rt.host_offsets())
    qg = q.with_values(q.values.detach().clone().requires_grad_(True))
    for be in ("cuda", "triton"):
        yield f"attention {be}: forward", lambda be=be: ragged.attention(q, q, q, backend=be)
    yield (
        "attention triton: varlen_attention",
        lambda: ragged.varlen_attention(q.values, q.values, q.values, off, off, 8, 8, backend="triton"),
    )
    yield (
        "attention triton: forward+backward",
        lambda: ragged.attention(qg, qg, qg, backend="triton").values.sum().backward(),
    )

    h = torch.randn(total, 768, device=dev, dtype=bf)
    hg = h.detach().clone().requires_grad_(True)
    b = torch.randn(768, device=dev, dtype=bf)
    w = torch.ones(768, device=dev, dtype=bf)
    for be in ("cuda", "triton"):
        yield f"bias_act {be}", lambda be=be: ragged.bias_act(h, b, "gelu", backend=be)
        yield f"add_layer_norm {be}", lambda be=be: ragged.add_layer_norm(h, h, w, b, backend=be)
    yield "bias_act auto: forward+backward", lambda: ragged.bias_act(hg, b, "gelu").sum().backward()
    yield "add_layer_norm auto: forward+backward", lambda: ragged.add_layer_norm(hg, h, w, b).sum().backward()

    hidden = ragged.RaggedTensor(h, off, rt.max_len, rt.host_offsets())
    hidden_g = hidden.with_values(hg)
    weight = torch.randn(1000, 768, device=dev, dtype=bf)
    vocab = ragged.pack(
        [
            torch.arange(0, 200, 7, device=dev),
            torch.arange(3, 90, 5, device=dev),
            torch.arange(10, 20, device=dev),
            torch.arange(0, 999, 37, device=dev),
        ]
    )
    target = torch.cat([vocab[i][torch.arange(n, device=dev) % max(len(vocab[i]), 1)] for i, n in enumerate(lengths)])
    yield "vocab_projection triton", lambda: ragged.vocab_projection(hidden, weight, vocab, backend="triton")
    yield (
        "vocab_cross_entropy triton: forward+backward",
        lambda: ragged.vocab_cross_entropy(hidden_g, weight, vocab, target, backend="triton").backward(),
    )
    yield (
        "vocab_cross_entropy triton, out_of_vocab='ignore': forward+backward",
        lambda: ragged.vocab_cross_entropy(
            hidden_g, weight, vocab, target, out_of_vocab="ignore", backend="triton"
        ).backward(),
    )
    if hasattr(ragged, "pool"):
        yield "pool triton: mean", lambda: ragged.pool(hidden, "mean", backend="triton")

    layer = ragged.nn.TransformerEncoderLayer(
        768, 12, 3072, dropout=0.0, activation="gelu", batch_first=True, device=dev, dtype=bf
    )
    enc = ragged.nn.TransformerEncoder(layer, 2).eval()
    xg = hidden.with_values(hg)
    train = ragged.nn.TransformerEncoder(layer, 2).train()

    one = ragged.nn.TransformerEncoder(layer, 1).eval()

    def infer():
        with torch.no_grad():
            enc(hidden)

    def infer_one():
        with torch.no_grad():
            one(hidden)

    yield "BERT-base layer (encoder of 1 layer d=768): inference", infer_one
    yield "encoder 2 layers d=768: inference", infer
    graphed = ragged.nn.graphed(enc, max_tokens=64, max_batch_size=4)
    yield "encoder 2 layers d=768: inference, graphed", lambda: graphed(hidden)
    yield "encoder 2 layers d=768: train step", lambda: train(xg).values.sum().backward()
    train_one = ragged.nn.TransformerEncoder(layer, 1).train()
    yield "BERT-base layer (encoder of 1 layer d=768): forward+backward", lambda: train_one(xg).values.sum().backward()


# The per-call host budgets (us) of the eager rows they apply to: GPU targets.
BUDGETS = {
    "cuda: pack_values": 12,
    "triton: pack_values": 12,
    "attention cuda: forward": 25,
    "attention triton: forward": 25,
    "BERT-base layer (encoder of 1 layer d=768): inference": 120,
    "BERT-base layer (encoder of 1 layer d=768): forward+backward": 500,
    "vocab_cross_entropy triton: forward+backward": 150,
    "vocab_cross_entropy triton, out_of_vocab='ignore': forward+backward": 150,
}


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the rows as a markdown table to this file")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda when available")
    ap.add_argument("--calls", type=int, default=2000, help="timed calls per row (default 2000)")
    args = ap.parse_args(argv)
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    table = []
    for name, fn in rows(device):
        try:
            us = per_call_us(fn, args.calls, device)
            line = f"{us:7.1f} us/call"
        except Exception as exc:  # an older tree without the function: the row is left out
            us, line = None, f"n/a ({type(exc).__name__}: {str(exc)[:80]})"
        print(f"{name:46s} {line}", flush=True)
        table.append((name, us, line))
    if args.out:
        from bench.env import cpu_name, device_name, git_state
        from bench.targets import gpu_verdict

        on_gpu = device == "cuda"
        where = f"GPU {device_name(torch.device('cuda'))}, host CPU" if on_gpu else "CPU"
        lines = [
            "# Host time per eager call (tiny inputs: the GPU waits on the host)",
            "",
            f"{where} {cpu_name()}, torch {torch.__version__}, tree {git_state()['git_commit']}, "
            f"{time.strftime('%Y-%m-%d')}; mean of {args.calls} calls after {min(50, args.calls)} warm-up "
            f"calls{', ended by a synchronize' if on_gpu else ''}.",
            "",
            "| row | us/call | budget (GPU target) | |",
            "|---|---|---|---|",
        ]
        for name, us, line in table:
            budget = BUDGETS.get(name)
            verdict = "" if budget is None or us is None else gpu_verdict(us <= budget, on_gpu)
            cell = "" if us is None else f"{us:.1f}"
            lines.append(f"| {name} | {cell} | {budget or ''} | {verdict if us is not None else line} |")
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
