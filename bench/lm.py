"""Causal-LM fine-tuning steps, as users run them: where a decoder's step goes with padding, with
padding-free attention, and without the logits.

``python -m bench.lm [--steps 8] [--tokens 8192] [--layers 24] [--out FILE.md]`` on a GPU (on
CPU: a tiny model). A Qwen2.5-0.5B-shaped ``Qwen2ForCausalLM`` (24 layers, d=896, GQA 14/2,
SwiGLU 4864, vocabulary 151,936; random weights, bfloat16, fused AdamW), the same weights and
batches for every row: ``--steps`` timed steps (after two untimed ones) of about ``--tokens``
real tokens each, in sequences of 32..2048 tokens (lognormal, seed 0). Rows:

* ``HF SDPA, padded + mask``: the batch padded to its longest sequence, labels -100 at padding;
* ``HF SDPA padded + Liger``: the same after ``liger_kernel.transformers.apply_liger_kernel_to_qwen2``
  (fused RMSNorm, RoPE, SwiGLU, linear cross-entropy), where liger-kernel is installed;
* ``attn_implementation="ragged"``: the batch flattened to one row as
  ``DataCollatorWithFlattening`` makes it (positions restart per sequence, ``cu_seq_lens``, each
  sequence's first label -100);
* the same + ``ragged.nn.fuse_lm_loss`` (the loss from the hidden states, no logits);
* the same + Liger (where installed);
* ``ragged.nn.convert`` of the model on RaggedTensor batches (the decoder core; the loss without
  logits).

Each row reports real tokens/s over the timed steps, the step time, the peak memory and the
mean loss of the timed steps (the same data: rows that compute the same loss agree).
"""

from __future__ import annotations

import argparse
import copy
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


def run_row(model, batches, device) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    losses = []

    def step(batch):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for batch in batches[:2]:
        step(batch)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for batch in batches[2:]:
        losses.append(step(batch))
    sync(device)
    elapsed = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"seconds": elapsed, "peak_gib": peak, "loss": float(torch.stack(losses).float().mean())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lm", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--out", default=None)
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
    lens = lengths(args.steps + 2, tokens, 32 if not tiny else 8, hi)
    g = torch.Generator().manual_seed(SEED + 1)
    data = [[torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in step] for step in lens]
    real = sum(sum(step) for step in lens[2:])
    padded_tokens = sum(len(step) * max(step) for step in lens[2:])
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

    rows = [
        ("HF SDPA, padded + mask", lambda: model_for("sdpa"), padded),
        ("HF SDPA padded + Liger", (lambda: model_for("sdpa", with_liger=True)) if liger else None, padded),
        ('attn_implementation="ragged", flattened', lambda: model_for("ragged"), flattened),
        ('"ragged" + ragged.nn.fuse_lm_loss', lambda: model_for("ragged", fuse=True), flattened),
        ('"ragged" + Liger', (lambda: model_for("ragged", with_liger=True)) if liger else None, flattened),
        ("ragged.nn.convert, RaggedTensor ids", lambda: ragged.nn.convert(copy.deepcopy(base)), packed),
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
        "| path | tokens/s | step ms | peak GiB | mean loss |",
        "|---|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for name, make, fmt in rows:
        if make is None:
            line = f"| {name} | skipped: liger-kernel not installed | | | |"
        else:
            batches = [fmt(seqs, device) for seqs in data]
            model = make()
            try:
                r = run_row(model, batches, device)
                line = (
                    f"| {name} | {real / r['seconds'] / 1e3:.1f}k | {1e3 * r['seconds'] / args.steps:.1f} | "
                    f"{r['peak_gib']:.1f} | {r['loss']:.4f} |"
                )
            except torch.OutOfMemoryError:
                line = f"| {name} | out of memory | | | |"
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
