"""The whole wall time of ``python -m ragged.embed`` against the in-process rate of ``encode``.

``python -m bench.embed_wall [--model DIR] [--device cuda|cpu] [--texts 100,60864] [--repeats 2]
[--tiny] [--out PREFIX] [--profile DIR]`` runs the command in a fresh process per row on the first
N texts of the project corpus (:mod:`bench.corpus`, repeated in order past its end), as a ``.txt``
file, and times it from the parent: interpreter start to exit, what a user waits. The first run
of each size starts with empty kernel caches (Triton, CuPy, ragged's own: a fresh folder), the
later ones reuse them. Each row keeps the command's own ``time:`` line (imports, input, model,
embedding, output) and its rates. Then, in one more process, the same model embeds the same texts
with ``encode`` (and with ``sentence_pipeline.embed``, the command's per-chunk call), once to warm
up (graphs captured) and ``--repeats`` times timed: the in-process rate.

Model: ``--model`` (a SentenceTransformer folder), else one built in a temporary folder with
all-MiniLM-L6-v2's shape (BERT, 6 layers x 384, 12 heads, 1536 wide, 256 tokens at most, mean
pooling then Normalize) with random weights and a WordPiece vocabulary of 30,522 trained on the
corpus; ``--tiny``: 2 layers x 32 and a vocabulary of 1,000 (for a CPU check of the script).

Writes ``PREFIX.json`` and ``PREFIX.md`` (default ``embed_wall_<device>``): host CPU, GPU, versions,
every run, and the targets: the smallest size end to end in at most 8 s, and at the largest the
command's whole-run rate at least half of ``encode``'s in-process rate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_TARGET_S, RATE_TARGET = 8.0, 0.5
_TIME = re.compile(
    r"time: imports ([\d.]+) s, input ([\d.]+) s, model ([\d.]+) s, embedding ([\d.]+) s "
    r"\((\d+) CUDA graphs? captured\), output ([\d.]+) s, other (-?[\d.]+) s"
)
_LAST = re.compile(
    r"embedded (\d+) texts \((\d+) tokens\) in ([\d.]+) s: ([\d.]+) texts/s, ([\d.]+) tokens/s; "
    r"whole run ([\d.]+) s: ([\d.]+) texts/s"
)


def texts(n: int) -> list[str]:
    """The first ``n`` texts of the corpus, repeated in order past its end."""
    sys.path.insert(0, ROOT)
    from bench import corpus

    base = corpus.texts(n)
    return [base[i % len(base)] for i in range(n)]


def build_model(folder: str, tiny: bool) -> str:
    """A SentenceTransformer with all-MiniLM-L6-v2's shape (or a tiny one), random weights, saved in ``folder``."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as M
    from transformers import BertConfig, BertModel

    sys.path.insert(0, ROOT)
    from bench import corpus

    vocab, width, layers, heads = (1000, 32, 2, 4) if tiny else (30522, 384, 6, 12)
    tokenizer = corpus.wordpiece(vocab, 512)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * width,
        max_position_embeddings=512,
    )
    bert_dir = os.path.join(folder, "bert")
    BertModel(config).save_pretrained(bert_dir)
    tokenizer.save_pretrained(bert_dir)
    transformer = M.Transformer(bert_dir, max_seq_length=256)
    st = SentenceTransformer(modules=[transformer, M.Pooling(width, "mean"), M.Normalize()], device="cpu")
    out = os.path.join(folder, "st")
    st.save(out)
    return out


def run_command(model: str, corpus_path: str, device: str, dtype: str | None, cache: str, profile: str | None):
    """One fresh ``python -m ragged.embed``: its wall time from here and its last two lines, parsed."""
    out = corpus_path + ".npy"
    shutil.rmtree(out + ".parts", ignore_errors=True)  # a run of another corpus left behind
    env = dict(
        os.environ,
        TRITON_CACHE_DIR=os.path.join(cache, "triton"),
        CUPY_CACHE_DIR=os.path.join(cache, "cupy"),
        RAGGED_CACHE_DIR=os.path.join(cache, "ragged"),
    )
    cmd = [sys.executable] + (["-X", "importtime", "-m", "cProfile", "-o", profile + ".prof"] if profile else [])
    cmd += ["-m", "ragged.embed", model, corpus_path, out, "--device", device, "--no-progress"]
    cmd += ["--dtype", dtype] if dtype else []
    begin = time.perf_counter()
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - begin
    if done.returncode != 0:
        raise RuntimeError(f"bench.embed_wall: {' '.join(cmd)} failed ({done.returncode}): {done.stderr[-3000:]}")
    if profile:
        with open(profile + ".importtime.txt", "w") as f:
            f.write(done.stderr)
    os.remove(out)
    row = {"wall_s": wall}
    lines = done.stdout.strip().splitlines()
    last = _LAST.fullmatch(lines[-1]) if lines else None
    phases = _TIME.fullmatch(lines[-2]) if len(lines) > 1 else None
    if last:
        n, tokens, s, rate, _, whole, _ = last.groups()
        row.update(
            texts=int(n),
            tokens=int(tokens),
            embedding_s=float(s),
            embedding_texts_per_s=float(rate),
            whole_run_s=float(whole),
        )
    if phases:
        names = ("imports_s", "input_s", "model_s", "embedding_phase_s", "graphs", "output_s", "other_s")
        row.update({k: (int(v) if k == "graphs" else float(v)) for k, v in zip(names, phases.groups())})
    row["last_lines"] = lines[-2:]
    return row


def child_encode(model: str, corpus_path: str, device: str, dtype: str | None, repeats: int) -> dict:
    """In this process: the model loaded and converted once, ``encode`` and ``embed`` of the texts,
    one warm-up call each, then ``repeats`` timed calls; medians."""
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    import ragged.nn
    from ragged.nn.hf.sentence.pipeline import embed

    with open(corpus_path, encoding="utf-8") as f:
        data = f.read().split("\n")[:-1]
    dtype = dtype or ("bf16" if device.startswith("cuda") else "fp32")
    st = SentenceTransformer(model, device=device)
    st.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]).eval()
    st = ragged.nn.convert(st)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    out = {}
    for name, call in (("encode", lambda: st.encode(data, convert_to_numpy=True)), ("embed", lambda: embed(st, data))):
        first = time.perf_counter()
        np.asarray(call())
        sync()
        out[f"{name}_first_s"] = time.perf_counter() - first
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            np.asarray(call())
            sync()
            times.append(time.perf_counter() - begin)
        out[f"{name}_s"] = statistics.median(times)
        out[f"{name}_texts_per_s"] = len(data) / out[f"{name}_s"]
    return out


def _markdown(result: dict) -> str:
    env, lines = result["env"], []
    lines.append(f"# python -m ragged.embed, whole run against encode ({result['model']})\n")
    lines.append(
        f"{env['device_name']}, host CPU {env['cpu_name']} ({env['cpu_count']} cores), torch {env['torch']}, "
        f"commit {env.get('git_commit')}{' (dirty)' if env.get('git_dirty') else ''}, {env['date']}\n"
    )
    lines.append(
        "Corpus: " + result["corpus"] + ". Each run a fresh process timed from its parent; 'cold': empty "
        "kernel caches.\n"
    )
    lines.append(
        "| texts | run | wall (s) | wall texts/s | whole run (s) | imports | input | model | embedding "
        "(graphs) | output | other | embedding texts/s |"
    )
    lines.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in result["runs"]:
        lines.append(
            f"| {r['n']} | {r['run']} | {r['wall_s']:.2f} | {r['n'] / r['wall_s']:,.0f} | "
            f"{r.get('whole_run_s', float('nan')):.2f} | {r.get('imports_s', float('nan')):.2f} | "
            f"{r.get('input_s', float('nan')):.2f} | {r.get('model_s', float('nan')):.2f} | "
            f"{r.get('embedding_phase_s', float('nan')):.2f} ({r.get('graphs', '?')}) | "
            f"{r.get('output_s', float('nan')):.2f} | {r.get('other_s', float('nan')):.2f} | "
            f"{r.get('embedding_texts_per_s', float('nan')):,.0f} |"
        )
    enc = result["encode"]
    lines.append(
        f"\nIn-process, {result['largest']} texts: encode {enc['encode_texts_per_s']:,.0f} texts/s "
        f"(first call {enc['encode_first_s']:.2f} s), sentence_pipeline.embed "
        f"{enc['embed_texts_per_s']:,.0f} texts/s (first call {enc['embed_first_s']:.2f} s).\n"
    )
    for t in result["targets"]:
        lines.append(f"- {t['what']}: {t['value']:.3g} (target {t['target']}): {'met' if t['met'] else 'MISSED'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.embed_wall", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a SentenceTransformer folder (default: a random MiniLM-shaped one)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when visible)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--texts", default="100,60864", help="sizes, comma-separated (default: 100,60864)")
    p.add_argument("--repeats", type=int, default=2, help="runs per size (the first with empty caches)")
    p.add_argument("--tiny", action="store_true", help="a tiny model (2 x 32) instead of MiniLM's shape")
    p.add_argument("--out", help="PREFIX of PREFIX.json and PREFIX.md (default: embed_wall_<device>)")
    p.add_argument("--profile", help="a folder: cProfile and -X importtime of the last run of the largest size")
    p.add_argument("--workdir", help="a folder for the model and corpora, kept (default: a temporary one)")
    p.add_argument("--child-encode", nargs=2, metavar=("MODEL", "CORPUS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_encode:
        device = args.device or "cpu"
        print(json.dumps(child_encode(*args.child_encode, device, args.dtype, args.repeats)))
        return 0
    import torch

    sys.path.insert(0, ROOT)
    from bench import corpus, env

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sizes = sorted(int(s) for s in args.texts.split(","))
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.workdir or scratch
        os.makedirs(tmp, exist_ok=True)
        model = args.model or build_model(tmp, args.tiny)
        runs = []
        for n in sizes:
            path = os.path.join(tmp, f"corpus_{n}.txt")
            with open(path, "w", encoding="utf-8") as f:
                f.write("".join(t + "\n" for t in texts(n)))
            cache = tempfile.mkdtemp(dir=tmp)
            for k in range(max(1, args.repeats)):
                profile = None
                if args.profile and n == sizes[-1] and k == max(1, args.repeats) - 1:
                    os.makedirs(args.profile, exist_ok=True)
                    profile = os.path.join(args.profile, f"embed_{n}")
                row = run_command(model, path, device, args.dtype, cache, profile)
                row.update(n=n, run="cold" if k == 0 else "warm")
                runs.append(row)
                print(
                    f"{n} texts, {row['run']}: wall {row['wall_s']:.2f} s; " + " | ".join(row["last_lines"]), flush=True
                )
        big = os.path.join(tmp, f"corpus_{sizes[-1]}.txt")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--device",
            device,
            "--repeats",
            str(max(1, args.repeats)),
            "--child-encode",
            model,
            big,
        ] + (["--dtype", args.dtype] if args.dtype else [])
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"bench.embed_wall: the in-process encode failed: {done.stderr[-3000:]}")
        enc = json.loads(done.stdout.strip().splitlines()[-1])
    best = {n: min(r["wall_s"] for r in runs if r["n"] == n) for n in sizes}
    targets = [
        {
            "what": f"{sizes[0]} texts end to end, best wall (s)",
            "value": best[sizes[0]],
            "target": f"<= {SMALL_TARGET_S}",
            "met": best[sizes[0]] <= SMALL_TARGET_S,
        },
        {
            "what": f"{sizes[-1]} texts, best wall rate / encode's in-process rate",
            "value": sizes[-1] / best[sizes[-1]] / enc["encode_texts_per_s"],
            "target": f">= {RATE_TARGET}",
            "met": sizes[-1] / best[sizes[-1]] / enc["encode_texts_per_s"] >= RATE_TARGET,
        },
    ]
    result = {
        "env": env.collect(torch.device(device)),
        "model": args.model or ("tiny random BERT" if args.tiny else "random all-MiniLM-L6-v2-shaped BERT"),
        "corpus": corpus.describe(),
        "largest": sizes[-1],
        "runs": runs,
        "encode": enc,
        "targets": targets,
    }
    prefix = args.out or f"embed_wall_{result['env']['device_slug']}"
    with open(prefix + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(prefix + ".md", "w") as f:
        f.write(_markdown(result))
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
