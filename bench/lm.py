"""Causal-LM fine-tuning steps, as users run them: where a decoder's step goes with padding, with
padding-free attention, and without the logits.

``python -m bench.lm [--steps 8] [--tokens 8192] [--layers 24] [--rows 0,2] [--out FILE.md]`` on a GPU (on
CPU: a tiny model). A Qwen2.5-0.5B-shaped ``Qwen2ForCausalLM`` (24 layers, d=896, GQA 14/2,
SwiGLU 4864, vocabulary 151,936; random weights, bfloat16, fused AdamW), the same weights and
batches for every row: ``--steps`` timed steps (after two untimed ones) of about ``--tokens``
real tokens each, in sequences of 32..2048 tokens (lognormal, seed 0). Rows:

* ``HF SDPA, padded + mask``: the batch padded to its longest sequence, labels -100 at padding;
* the same under ``torch.compile`` (default options; its recompiles fall in the first pass; CUDA only);
* ``HF SDPA padded + Liger``: the same after ``liger_kernel.transformers.apply_liger_kernel_to_qwen2``
  (fused RMSNorm, RoPE, SwiGLU, linear cross-entropy), where liger-kernel is installed;
* ``attn_implementation="ragged"``: the batch flattened to one row as
  ``DataCollatorWithFlattening`` makes it (positions restart per sequence, ``cu_seq_lens``, each
  sequence's first label -100);
* the same + ``ragged.nn.fuse_lm_loss`` (the loss from the hidden states, no logits);
* the same + Liger (where installed);
* ``ragged.nn.convert`` of the model on RaggedTensor batches (the decoder core; the loss without
  logits);
* the converted model's training steps through ``ragged.nn.graphed`` (CUDA graphs per bucket).

Each row trains on the ``--steps`` batches twice: an untimed first pass, where every shape is new
(Triton compiles, cuDNN plans, graph captures; its wall time is reported), then the timed pass
over the same batches: the steady state of a long run. A padded row that runs out of memory is
run again as a user would, each batch as two micro-batches with gradient accumulation (the loss
normalised by the whole batch's label count, so it stays the same loss). Each row reports real
tokens/s over the timed pass, the step time, the peak memory and the mean loss of the timed steps
(the same data: rows that compute the same loss agree). ``--rows`` picks rows; ``--profile DIR``
writes a torch.profiler table of one more step per row, on a batch of lengths not seen before.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch

from .env import cpu_name, git_state

SEED = 0


def lengths(steps: int, tokens: int, lo: int, hi: int, seed: int = SEED) -> list[list[int]]:
    """Per step, sequence lengths in ``[lo, hi]`` (lognormal) adding up to about ``tokens``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step: list[int] = []
        while sum(step) < tokens:
            n = int((torch.empty(1).log_normal_(0, 1, generator=g) * hi / 8).clamp(lo, hi))
            step.append(min(n, max(lo, tokens - sum(step))) if sum(step) + n > tokens else n)
        out.append(step)
    return out


def config(tiny: bool):
    from transformers import Qwen2Config

    if tiny:
        return Qwen2Config(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        )  # fmt: skip
    return Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
    )  # fmt: skip


def padded(seqs: list[torch.Tensor], device) -> dict:
    m = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), m, dtype=torch.long)
    mask = torch.zeros(len(seqs), m, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def flattened(seqs: list[torch.Tensor], device) -> dict:
    ids = torch.cat(seqs)[None]
    labels = torch.cat([torch.cat([torch.tensor([-100]), s[1:]]) for s in seqs])[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    m = max(len(s) for s in seqs)
    return {
        "input_ids": ids.to(device), "labels": labels.to(device), "position_ids": positions.to(device),
        "cu_seq_lens_q": cu.to(device), "cu_seq_lens_k": cu.to(device), "max_length_q": m, "max_length_k": m,
    }  # fmt: skip


def packed(seqs: list[torch.Tensor], device) -> dict:
    """A converted model's batch: RaggedTensors of ids and labels (shifted per sequence inside)."""
    import ragged

    rt = ragged.RaggedTensor.from_lengths(torch.cat(seqs).to(device), [len(s) for s in seqs])
    return {"input_ids": rt, "labels": rt}


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_step(step, batch, path: str) -> None:
    """One more step under torch.profiler: the ops by device time and by host time, to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(batch)
        torch.cuda.synchronize()
    avg = prof.key_averages()
    with open(path, "w") as f:
        f.write(avg.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70) + "\n")
        f.write(avg.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70) + "\n")


def backward(call, batch) -> torch.Tensor:
    """Forward and backward of one batch (a dict of a model's arguments) or of its micro-batches
    (a list of them, their losses normalised by the whole batch's label count, so that they add
    up to the batch's loss); returns the loss, detached."""
    if not isinstance(batch, list):
        loss = call(**batch).loss
        loss.backward()
        return loss.detach()
    n = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in batch)
    total = torch.zeros(())
    for mb in batch:
        part = call(**mb, num_items_in_batch=n).loss
        part.backward()
        total = total.to(part.device) + part.detach()
    return total


def run_row(model, batches, device, profile_to: str | None = None, call=None) -> dict:
    """Train on ``batches`` twice: a first pass (compiles, cuDNN plans, CUDA-graph captures: the
    costs of a shape seen the first time), then the timed pass over the same batches (steady
    state). ``call``: what runs a batch (default ``model``, e.g. its ``ragged.nn.graphed`` step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    call = call or model
    losses = []

    def step(batch):
        loss = backward(call, batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    timed = batches[:-1] if profile_to else batches
    t0 = time.perf_counter()
    for batch in timed:
        step(batch)
    sync(device)
    first = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for batch in timed:
        losses.append(step(batch))
    sync(device)
    elapsed = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    if profile_to and device.type == "cuda":
        profile_step(step, batches[-1], profile_to)  # a batch of lengths not seen before
    return {"seconds": elapsed, "first": first, "peak_gib": peak, "loss": float(torch.stack(losses).float().mean())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lm", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--rows", default=None, help="comma-separated row numbers to run (0-based; default all)")
    p.add_argument("--profile", default=None, metavar="DIR", help="write one profiled step per row into DIR")
    args = p.parse_args(argv)
    import transformers

    import ragged.integrations.transformers  # noqa: F401  (registers attn_implementation="ragged")
    import ragged.nn

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = device.type != "cuda"
    cfg = config(tiny)
    if args.layers:
        cfg.num_hidden_layers = args.layers
    tokens = 512 if tiny else args.tokens
    hi = 128 if tiny else 2048
    torch.manual_seed(SEED)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = transformers.Qwen2ForCausalLM(cfg).to(device, dtype).train()
    lens = lengths(args.steps + bool(args.profile), tokens, 32 if not tiny else 8, hi)
    g = torch.Generator().manual_seed(SEED + 1)
    data = [[torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in step] for step in lens]
    real = sum(sum(step) for step in lens[: args.steps])
    padded_tokens = sum(len(step) * max(step) for step in lens[: args.steps])
    graphs = device.type == "cuda"
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        liger = None

    def model_for(attn: str, fuse: bool = False, with_liger: bool = False):
        m = copy.deepcopy(base)
        m.set_attn_implementation(attn)
        if with_liger:
            liger.apply_liger_kernel_to_qwen2(model=m)
        if fuse:
            ragged.nn.fuse_lm_loss(m)
        return m

    def converted():
        return ragged.nn.convert(copy.deepcopy(base))

    def compiled():
        return torch.compile(model_for("sdpa"))

    rows = [
        ("HF SDPA, padded + mask", lambda: model_for("sdpa"), padded),
        ("HF SDPA, padded + mask, torch.compile", compiled if graphs else None, padded),
        ("HF SDPA padded + Liger", (lambda: model_for("sdpa", with_liger=True)) if liger else None, padded),
        ('attn_implementation="ragged", flattened', lambda: model_for("ragged"), flattened),
        ('"ragged" + ragged.nn.fuse_lm_loss', lambda: model_for("ragged", fuse=True), flattened),
        ('"ragged" + Liger', (lambda: model_for("ragged", with_liger=True)) if liger else None, flattened),
        ("ragged.nn.convert, RaggedTensor ids", lambda: ragged.nn.convert(copy.deepcopy(base)), packed),
        ("ragged.nn.graphed(convert), CUDA graphs", converted if graphs else None, packed),
    ]
    state = git_state()
    lines = [
        f"# bench.lm on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}: "
        f"Qwen2 {cfg.num_hidden_layers} layers d={cfg.hidden_size} V={cfg.vocab_size}, {args.steps} steps, "
        f"{real} real tokens ({padded_tokens} padded), {dtype}",
        "",
        f"host CPU {cpu_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"tree {(state.get('git_commit') or '?')[:12]}",
        "",
        "Each row trains on the batches twice: a first pass (compiles, cuDNN plans, graph captures),",
        "then the timed pass over the same batches; `first pass s`: the first pass's wall time.",
        "",
        "| path | tokens/s | step ms | peak GiB | mean loss | first pass s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    chosen = {int(i) for i in args.rows.split(",")} if args.rows else set(range(len(rows)))
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    for i, (name, make, fmt) in enumerate(rows):
        if i not in chosen:
            continue
        if make is None:
            line = f"| {name} | skipped: {'liger-kernel not installed' if 'Liger' in name else 'needs CUDA'} | | | | |"
        else:
            batches = [fmt(seqs, device) for seqs in data]
            model = make()
            call = None
            if name.startswith("ragged.nn.graphed"):
                most = max(len(step) for step in lens)
                call = ragged.nn.graphed(model, max_tokens=max(sum(step) for step in lens), max_batch_size=most)
            try:
                where = os.path.join(args.profile, f"row{i}.txt") if args.profile else None
                r = run_row(model, batches, device, where, call)
                line = (
                    f"| {name} | {real / r['seconds'] / 1e3:.1f}k | {1e3 * r['seconds'] / args.steps:.1f} | "
                    f"{r['peak_gib']:.1f} | {r['loss']:.4f} | {r['first']:.1f} |"
                )
            except torch.OutOfMemoryError:
                line = None
            if line is None and fmt is padded:  # as a user would: gradient accumulation over halves
                del model
                torch.cuda.empty_cache()
                halves = [[fmt(seqs[: len(seqs) // 2], device), fmt(seqs[len(seqs) // 2 :], device)] for seqs in data]
                model = make()
                try:
                    r = run_row(model, halves, device, where, call)
                    line = (
                        f"| {name} (out of memory; 2 micro-batches) | {real / r['seconds'] / 1e3:.1f}k | "
                        f"{1e3 * r['seconds'] / args.steps:.1f} | {r['peak_gib']:.1f} | {r['loss']:.4f} | "
                        f"{r['first']:.1f} |"
                    )
                except torch.OutOfMemoryError:
                    pass
            if line is None:
                line = f"| {name} | out of memory | | | | |"
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        lines.append(line)
        print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
