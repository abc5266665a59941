"""Does a converted causal LM learn what HF's learns? Loss curves of the same LM training, step for
step, on the project corpus.

``python -m bench.lm_curve [--steps 200] [--every 10] [--tokens 8192] [--out FILE.md]`` trains the
``bench.lm`` model (Qwen2.5-0.5B-shaped, random initialisation, bf16 weights, fused AdamW lr
``--lr``) from the same weights on the same batches in every row: ``--steps`` steps of about
``--tokens`` real tokens in sequences of 32..2048 tokens (``bench.lm``'s lognormal lengths), cut
from the corpus (``bench.corpus``: paragraphs tokenized by its byte-level BPE, 8000 ids, each
ending with its EOS, one stream, read again from its start where the run needs more tokens than it
holds). Rows: HF SDPA on padded batches (two micro-batches with
gradient accumulation, as ``bench.lm`` runs it when one batch does not fit),
``attn_implementation="ragged"`` on flattened rows, ``ragged.nn.convert`` on RaggedTensors, and
the converted model through ``ragged.nn.graphed``. Prints and writes the mean training loss of
every ``--every`` steps per row, and each row's largest difference from HF's curve. ``--device
cpu`` (or no GPU): a tiny model, a smoke run.
"""

from __future__ import annotations

import argparse
import copy

import torch

from .env import cpu_name, git_state
from .lm import SEED, backward, config, flattened, lengths, packed, padded


def corpus_batches(lens: list[list[int]]) -> list[list[torch.Tensor]]:
    """Sequences of the given lengths cut one after the other from the tokenized corpus."""
    from . import corpus

    tok = corpus.byte_bpe(8000, max_length=1 << 20)
    need = sum(sum(step) for step in lens)
    stream: list[int] = []
    for text in corpus.texts(1 << 30):
        stream.extend(tok(text)["input_ids"])
        if len(stream) >= need:
            break
    passes = -(-need // len(stream))  # a corpus smaller than the run: read again from its start
    ids, out, at = torch.tensor(stream * passes), [], 0
    for step in lens:
        out.append([ids[at + sum(step[:i]) : at + sum(step[: i + 1])] for i in range(len(step))])
        at += sum(step)
    return out


def train(model, call, batches, device, lr: float) -> list[float]:
    """Loss per step (host floats read after the run)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda")
    losses = []
    for batch in batches:
        loss = backward(call, batch)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.float())
    return [float(x) for x in torch.stack(losses).cpu()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lm_curve", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import transformers

    import ragged.integrations.transformers  # noqa: F401  (registers attn_implementation="ragged")
    import ragged.nn

    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    tiny = not cuda
    cfg = config(tiny)
    cfg.vocab_size = 8000 if tiny else cfg.vocab_size
    torch.manual_seed(SEED)
    dtype = torch.bfloat16 if cuda else torch.float32
    base = transformers.Qwen2ForCausalLM(cfg).to(device, dtype).train()
    lens = lengths(args.steps, 512 if tiny else args.tokens, 8 if tiny else 32, 128 if tiny else 2048)
    data = corpus_batches(lens)

    def halves(seqs):
        return [padded(seqs[: len(seqs) // 2], device), padded(seqs[len(seqs) // 2 :], device)]

    def hf(attn):
        m = copy.deepcopy(base)
        m.set_attn_implementation(attn)
        return m, m

    def converted(graphs=False):
        m = ragged.nn.convert(copy.deepcopy(base))
        if not graphs:
            return m, m
        most = max(len(step) for step in lens)
        return m, ragged.nn.graphed(m, max_tokens=max(sum(step) for step in lens), max_batch_size=most)

    rows = [
        ("HF SDPA, padded (2 micro-batches)", lambda: hf("sdpa"), halves),
        ('attn_implementation="ragged", flattened', lambda: hf("ragged"), lambda s: flattened(s, device)),
        ("ragged.nn.convert, RaggedTensor ids", converted, lambda s: packed(s, device)),
        ("ragged.nn.graphed(convert)", (lambda: converted(True)) if cuda else None, lambda s: packed(s, device)),
    ]
    curves: dict[str, list[float]] = {}
    for name, make, fmt in rows:
        if make is None:
            continue
        model, call = make()
        curves[name] = train(model, call, [fmt(seqs) for seqs in data], device, args.lr)
        del model, call
        if cuda:
            torch.cuda.empty_cache()
        print(f"{name}: first {curves[name][0]:.4f}, last {curves[name][-1]:.4f}", flush=True)
    names = list(curves)
    every = max(1, args.every)
    means = {
        n: [sum(c[i : i + every]) / len(c[i : i + every]) for i in range(0, len(c), every)] for n, c in curves.items()
    }  # noqa: E501
    state = git_state()
    lines = [
        f"# bench.lm_curve on {torch.cuda.get_device_name(device) if cuda else 'CPU'}: Qwen2 "
        f"{cfg.num_hidden_layers} layers d={cfg.hidden_size}, {args.steps} steps of "
        f"~{512 if tiny else args.tokens} tokens, "
        f"lr {args.lr}, {dtype}",
        "",
        f"host CPU {cpu_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"tree {(state.get('git_commit') or '?')[:12]}",
        "",
        f"Mean training loss of every {every} steps (same weights, same batches):",
        "",
        "| steps | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for i in range(len(means[names[0]])):
        lo, hi = i * every, min((i + 1) * every, args.steps)
        lines.append(f"| {lo}..{hi - 1} | " + " | ".join(f"{means[n][i]:.4f}" for n in names) + " |")
    lines += ["", "Largest difference from HF's curve (means of the windows above; all steps):", ""]
    ref = names[0]
    for n in names[1:]:
        window = max(abs(a - b) for a, b in zip(means[n], means[ref]))
        step = max(abs(a - b) for a, b in zip(curves[n], curves[ref]))
        lines.append(f"- {n}: {window:.4f} (windows), {step:.4f} (single steps)")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
