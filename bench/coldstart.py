"""Cold start: the first BERT-base inference (and training step) of a ragged.nn encoder in a fresh
process, with empty kernel caches and then with the caches the first run left.

``python -m bench.coldstart [--out FILE.md] [--profile DIR] [--warmup] [--no-ahead]`` on a GPU
host. Each row runs in its own child process (this script with ``--child``) whose Triton and CuPy
caches point at a fresh folder (cold) or at the folder a cold run filled (warm); the child
reports ``import torch``, ``import ragged`` (beyond torch), building the model, the first
inference, the second inference and the first training step, each ended by a synchronize.
``--warmup`` adds rows where the child calls ``ragged.warmup`` on the model before its first
inference (the time of the warm-up is then its own column); ``--no-ahead`` adds rows with
``RAGGED_COMPILE_AHEAD=0`` (each kernel compiled as it first launches, not all of a layer's at
once before its first training step). ``--profile DIR`` writes a cProfile dump of a cold child
there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_BATCH = [8 + (i * 37) % 121 for i in range(32)]  # 32 sequences of 8..128 tokens


def _child(warmup: bool) -> dict:
    t0 = time.perf_counter()
    import torch

    t1 = time.perf_counter()
    import ragged
    import ragged.nn  # noqa: F401

    t2 = time.perf_counter()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    layer = ragged.nn.TransformerEncoderLayer(
        768, 12, 3072, dropout=0.1, activation="gelu", batch_first=True, device=dev, dtype=dt
    )
    enc = ragged.nn.TransformerEncoder(layer, 12).eval()
    x = ragged.pack([torch.randn(n, 768, device=dev, dtype=dt) for n in _BATCH])
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    row = {"import_torch_s": t1 - t0, "import_ragged_s": t2 - t1, "build_s": t3 - t2}
    if warmup:
        ragged.warmup(enc, x, training=True)
        torch.cuda.synchronize()
        t3b = time.perf_counter()
        row["warmup_s"] = t3b - t3
        t3 = t3b
    with torch.no_grad():
        enc(x)
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    with torch.no_grad():
        enc(x)
    torch.cuda.synchronize()
    t5 = time.perf_counter()
    enc.train()
    xg = x.with_values(x.values.detach().requires_grad_(True))
    enc(xg).values.float().square().mean().backward()
    torch.cuda.synchronize()
    t6 = time.perf_counter()
    row.update(first_inference_s=t4 - t3, second_inference_s=t5 - t4, first_train_step_s=t6 - t5)
    return row


def _run_child(cache: str, warmup: bool, profile: str | None, ahead: bool = True) -> dict:
    env = dict(os.environ)
    env["RAGGED_COMPILE_AHEAD"] = "1" if ahead else "0"
    env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    env["CUPY_CACHE_DIR"] = os.path.join(cache, "cupy")
    env["RAGGED_CACHE_DIR"] = os.path.join(cache, "ragged")
    # the script by path, not -m bench.coldstart: the bench package imports torch and ragged,
    # which the child times
    cmd = [sys.executable] + (["-m", "cProfile", "-o", profile] if profile else []) + [os.path.abspath(__file__)]
    cmd += ["--child"] + (["--warmup"] if warmup else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--warmup", action="store_true")
    p.add_argument("--no-ahead", action="store_true")
    p.add_argument("--out")
    p.add_argument("--profile")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.warmup)), flush=True)
        return 0
    import torch

    from bench.env import cpu_name, device_name, git_state

    rows = []
    # A first child, not reported, on its own empty caches: it writes the Python bytecode of the
    # modules a step imports lazily (pip writes it at install; an environment installed without
    # it would charge it to whichever row ran first).
    with tempfile.TemporaryDirectory() as cache:
        _run_child(cache, False, None)
    cases = [(False, True, "eager")] + ([(False, False, "eager, RAGGED_COMPILE_AHEAD=0")] if args.no_ahead else [])
    cases += [(True, True, "ragged.warmup first")] if args.warmup else []
    for warmup, ahead, label in cases:
        with tempfile.TemporaryDirectory() as cache:
            name = f"cold_{'warmup' if warmup else 'eager'}{'' if ahead else '_no_ahead'}.prof"
            prof = os.path.join(args.profile, name) if args.profile else None
            if prof:
                os.makedirs(args.profile, exist_ok=True)
            rows.append((f"{label}, cold caches", _run_child(cache, warmup, prof, ahead)))
            rows.append((f"{label}, warm caches", _run_child(cache, warmup, None, ahead)))
    dev = torch.device("cuda")
    env = {"gpu": device_name(dev), "cpu": cpu_name(), "torch": torch.__version__, "commit": git_state()["git_commit"]}
    cols = [
        "import_torch_s",
        "import_ragged_s",
        "build_s",
        "warmup_s",
        "first_inference_s",
        "second_inference_s",
        "first_train_step_s",
    ]
    lines = [
        "# Cold start: BERT-base ragged.nn encoder (12 layers, d=768, bf16), B=32 of 8..128 tokens",
        "",
        f"GPU {env.get('gpu')}, host CPU {env.get('cpu')}, torch {env.get('torch')}, "
        f"tree {env.get('commit')}, {time.strftime('%Y-%m-%d')}",
        "",
        "| run | " + " | ".join(c[:-2].replace("_", " ") + " (s)" for c in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for name, row in rows:
        if "error" in row:
            lines.append(f"| {name} | error: {row['error'][:200]} |")
            continue
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:.2f}" if c in row else "" for c in cols) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
