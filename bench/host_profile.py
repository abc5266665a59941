"""Where the host time of an eager layer call goes: a development tool, run on a GPU.

``python -m bench.host_profile [--out DIR]`` profiles the rows of :mod:`bench.overhead` that
carry the layer budgets (one BERT-base layer, inference and forward+backward, tiny inputs so
that the GPU waits on the host) and one eager training step of the converted BERT-base of
:mod:`bench.train`: per row the mean host time per call, the CUDA kernels launched per call, a
``cProfile`` by own time and ``torch.profiler``'s aten ops by self CPU time. It also times the
cost of single launches of each kind (a torch op, a Triton kernel through ragged's launcher, a
CUDA kernel through ragged's launcher, ``torch.mm`` at a new M each call), the units the rows
are made of.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch


def per_call_us(fn, n: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def kernels_per_call(fn, n: int = 5) -> tuple[float, str]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    table = events.table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=70)
    return launches / n, table


def cprofile(fn, n: int) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(45)
    return s.getvalue()


def units(dev="cuda"):
    import ragged
    from ragged import backends
    from ragged.records.fused import BiasActArgs

    bf = torch.bfloat16
    h = torch.randn(64, 768, device=dev, dtype=bf)
    b = torch.randn(768, device=dev, dtype=bf)
    w = torch.randn(768, 768, device=dev, dtype=bf)
    yield "torch.add", lambda: torch.add(h, h)
    yield "F.linear [64,768]x[768,768]^T", lambda: torch.nn.functional.linear(h, w, b)
    ms = iter(range(10**9))
    big = torch.randn(4096, 768, device=dev, dtype=bf)
    yield "torch.mm, a new M every call", lambda: torch.mm(big[: 64 + next(ms) % 3000], w)
    for name in ("triton", "cuda"):
        impl = backends.implementation("bias_act", name)
        fwd = impl.forward_fn
        args = BiasActArgs(h, b, "gelu")
        yield f"bias_act {name}: implementation forward_fn", lambda fwd=fwd, args=args: fwd(args)
        yield f"ragged.bias_act backend={name}", lambda name=name: ragged.bias_act(h, b, "gelu", backend=name)


def layer_rows(dev="cuda"):
    import ragged
    import ragged.nn  # noqa: F401

    bf = torch.bfloat16
    x = torch.randn(4, 8, 16, device=dev)
    rt = ragged.pack(x, lengths=[3, 8, 0, 5])
    h = torch.randn(rt.num_tokens, 768, device=dev, dtype=bf)
    hidden = ragged.RaggedTensor(h, rt.offsets, rt.max_len, rt.host_offsets())
    hg = hidden.with_values(h.detach().clone().requires_grad_(True))
    layer = ragged.nn.TransformerEncoderLayer(
        768, 12, 3072, dropout=0.1, activation="gelu", batch_first=True, device=dev, dtype=bf
    )
    one_eval = ragged.nn.TransformerEncoder(layer, 1).eval()
    one_train = ragged.nn.TransformerEncoder(layer, 1).train()

    def infer():
        with torch.no_grad():
            one_eval(hidden)

    yield "BERT-base layer: inference", infer
    yield "BERT-base layer, dropout 0.1: forward+backward", lambda: one_train(hg).values.sum().backward()
    yield "BERT-base layer, dropout 0.1: forward only (grad kept)", lambda: one_train(hg)


def train_step(dev="cuda"):
    import copy
    import types

    from transformers import BertForSequenceClassification

    import ragged.nn as rnn
    from bench.train import bert_config, lengths, make_features, ragged_batch

    torch.manual_seed(0)
    hf = BertForSequenceClassification(bert_config(False, 0.1)).to(dev, torch.bfloat16)
    model = rnn.convert(copy.deepcopy(hf)).train()
    lens = lengths(16, 32, 16, 512, 96, 1.0)
    feats = make_features(lens, 30522, 3)
    batches = [ragged_batch(b, torch.device(dev)) for b in feats]
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, fused=True)
    it = iter(range(10**9))
    state = types.SimpleNamespace(tokens=sum(map(sum, lens)) / len(lens))

    def step():
        loss = model(**batches[next(it) % len(batches)]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def forward():
        return model(**batches[next(it) % len(batches)]).loss

    return step, forward, state


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for the report (profile.md)")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)
    from bench.env import cpu_name, device_name, git_state

    lines = [
        "# Host profile of eager layer calls",
        "",
        f"GPU {device_name(torch.device('cuda'))}, host CPU {cpu_name()}, torch {torch.__version__}, "
        f"tree {git_state()['git_commit']}, {time.strftime('%Y-%m-%d')}",
        "",
        "## Single launches",
        "",
        "| unit | us/call |",
        "|---|---:|",
    ]
    for name, fn in units():
        lines.append(f"| {name} | {per_call_us(fn, 2000):.1f} |")
        print(lines[-1], flush=True)
    detail = []
    lines += ["", "## Rows", "", "| row | us/call | CUDA kernels/call |", "|---|---:|---:|"]
    rows = list(layer_rows())
    step, forward, _ = train_step()
    rows += [("converted BERT-base train step (bench.train batches)", step)]
    rows += [("converted BERT-base forward only (bench.train batches)", forward)]
    for name, fn in rows:
        n = args.calls if "BERT-base train" not in name and "forward only (bench" not in name else 32
        us = per_call_us(fn, n)
        k, table = kernels_per_call(fn)
        prof = cprofile(fn, n)
        lines.append(f"| {name} | {us:.1f} | {k:.0f} |")
        print(lines[-1], flush=True)
        detail += [f"## {name}", "", "### torch.profiler, self CPU", "```", table, "```", "### cProfile", "```"]
        detail += [prof, "```", ""]
    text = "\n".join(lines + [""] + detail)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_profile.md"), "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
