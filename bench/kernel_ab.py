"""``python -m bench.kernel_ab --base DIR``: a few fixed workloads timed on two trees, rounds interleaved.

Where ``python -m bench.ab`` runs whole suites, this times the handful of calls a kernel-level change
touches, each tree in a process of its own (``bench.ab.package``: its own ``ragged`` first on the
path), rounds alternating base, head, base, head, ... on the same GPU:

* ``attn fwd`` / ``attn fwd+bwd``: ``ragged.varlen_attention`` forward, and forward and backward
  (bf16, GQA off), captured in a CUDA graph and replayed, so the row is GPU time, on the attention
  suite's workloads: (a) 256 sequences of 8..32 and (b) 64 of lognormal lengths 1..512, 12 heads of
  64; (c) 16 sequences of 256..4096, 16 heads of 128; causal and not. ``attn fwd eager``: the
  forward of (a) and (b) called eagerly (host time included).
* ``bert fwd``: a ``BertModel`` (BERT-base shape, random weights) converted by ``ragged.nn.convert``,
  one inference forward on a RaggedTensor of 32 sequences (lognormal lengths 16..512), eager (host
  time included, as a user calls it) and under ``ragged.nn.graphed``.

Prints a table of the median milliseconds per tree and head / base, with the GPU and host CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, math, sys, time
import torch, ragged

torch.manual_seed(0)
dev = torch.device("cuda")
results = {}


def lognormal(n, lo, hi, median, sigma, gen):
    x = torch.empty(n).log_normal_(math.log(median), sigma, generator=gen)
    return [int(min(max(v, lo), hi)) for v in x]


def graph_ms(step, reps=5, calls=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return eager_ms(g.replay, reps, calls)


def eager_ms(fn, reps=5, calls=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


gen = torch.Generator().manual_seed(1)
# the attention suite's workloads: (a) 256 sequences of 8..32, (b) 64 of lognormal lengths to 512
# (median 150 e^-1/2, sigma 1), both 12 heads of 64; (c) 16 of 256..4096, 16 heads of 128
cases = {"a": ([int(v) for v in torch.randint(8, 33, (256,), generator=gen)], 12, 64),
         "b": (lognormal(64, 1, 512, 150 * math.exp(-0.5), 1.0, gen), 12, 64),
         "c": ([int(v) for v in torch.linspace(256, 4096, 16)], 16, 128)}
for name, (lengths, h, d) in cases.items():
    for causal in (False, True):
        t = sum(lengths)
        cu = torch.tensor([0] + lengths, device=dev).cumsum(0).to(torch.int32)
        q, k, v = (torch.randn(t, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn(t, h, d, device=dev, dtype=torch.bfloat16)
        m = max(lengths)
        mask = "causal" if causal else "full"

        def forward():
            with torch.no_grad():
                ragged.varlen_attention(q, k, v, cu, cu, m, m, causal=causal)

        def step():
            out = ragged.varlen_attention(q, k, v, cu, cu, m, m, causal=causal)
            out.backward(do)

        results[f"attn fwd ({name}) {mask}"] = graph_ms(forward)
        results[f"attn fwd+bwd ({name}) {mask}"] = graph_ms(step)
        if name != "c":  # eager, as a user calls it: host time included
            results[f"attn fwd eager ({name}) {mask}"] = eager_ms(forward)

try:
    import transformers
except ImportError:
    transformers = None
if transformers is not None:
    cfg = transformers.BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                  intermediate_size=3072, max_position_embeddings=512)
    model = transformers.BertModel(cfg).to(dev, torch.bfloat16).eval()
    model = ragged.nn.convert(model)
    lengths = lognormal(32, 16, 512, 128, 0.8, gen)
    ids = ragged.pack([torch.randint(1000, 20000, (n,), device=dev) for n in lengths])
    with torch.inference_mode():
        results["bert fwd eager"] = eager_ms(lambda: model(ids), reps=5, calls=10)
        graphed = ragged.nn.graphed(model, max_tokens=sum(lengths), max_batch_size=32)
        results["bert fwd graphed"] = eager_ms(lambda: graphed(ids), reps=5, calls=10)
print("RESULT " + json.dumps(results))
"""


def main(argv: list[str] | None = None) -> int:
    import torch

    from bench.ab import commit_of, package
    from bench.env import cpu_name, device_name

    parser = argparse.ArgumentParser(prog="python -m bench.kernel_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="a copy of the base tree (python -m bench.ab prepare)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    parser.add_argument(
        "--head-label",
        default=None,
        help="what to call this tree in the table (default: its git commit; a copy of a checkout "
        "with uncommitted changes, or one whose .git is older than its files, needs this)",
    )
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="ragged_kab_"))
    trees = {"base": args.base.resolve(), "head": ROOT}
    commits = {tree: commit_of(path) for tree, path in trees.items()}
    if args.head_label:
        commits["head"] = args.head_label
    pkgs = {tree: package(path, scratch / tree) for tree, path in trees.items()}
    times: dict[str, dict[str, list[float]]] = {}
    for r in range(args.rounds):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=str(pkgs[tree]))
            done = subprocess.run([sys.executable, "-c", _CHILD], cwd=scratch, env=env, capture_output=True, text=True)
            line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if done.returncode != 0 or not line:
                print(f"round {r + 1} {tree}: failed\n{done.stderr[-3000:]}", flush=True)
                continue
            for name, ms in json.loads(line[0][len("RESULT ") :]).items():
                times.setdefault(name, {}).setdefault(tree, []).append(ms)
            print(f"round {r + 1} {tree}: ok", flush=True)
    gpu = device_name(torch.device("cuda")) if torch.cuda.is_available() else "none"
    lines = [
        f"# kernel A/B: base {commits['base']} vs head {commits['head']}, {args.rounds} rounds interleaved",
        f"GPU {gpu}, host CPU {cpu_name()} ({os.cpu_count()} cores), torch {torch.__version__}",
        "",
        "| workload | base ms (median) | head ms (median) | head / base | base rounds | head rounds |",
        "|---|---:|---:|---:|---|---|",
    ]
    for name, by_tree in times.items():
        b, h = by_tree.get("base", []), by_tree.get("head", [])
        mb = statistics.median(b) if b else float("nan")
        mh = statistics.median(h) if h else float("nan")
        lines.append(
            f"| {name} | {mb:.4f} | {mh:.4f} | {mh / mb:.3f} | {', '.join(f'{x:.4f}' for x in b)} | "
            f"{', '.join(f'{x:.4f}' for x in h)} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
