"""Does training through ragged learn what HF's padded model learns? Loss curves and held-out
accuracy of the same fine-tune, step for step.

``python -m bench.train_curve --steps 300`` trains BERT-base (``BertForSequenceClassification``,
3 labels, bf16 weights, dropout 0.1 (``--dropout``), AdamW lr 5e-5, random initialisation, the same for every
row) for ``--steps`` steps of 32 sequences with the long-tailed lengths of ``bench.train``
(16..512 tokens) on a synthetic task that needs the whole sequence: three marker tokens are
scattered through random text, and the label is the marker that occurs most often. Rows:
HF SDPA on padded batches (``hf``), the converted model eagerly (``ragged``) and through its
training graphs (``graphed``). The batches are the same for every row; dropout masks differ (each
implementation draws its own). Prints the mean training loss of every ``--every`` steps and
the held-out loss and accuracy (``--eval`` sequences, eval mode) per row; ``--out`` writes
Markdown. ``--device cpu`` runs a tiny model (a smoke run).
"""

from __future__ import annotations

import argparse
import copy
import sys

import numpy as np
import torch

from .train import SEED, bert_config, emit, lengths, padded_batch, ragged_batch, sync

MARKERS = (5, 6, 7)


def marker_features(lens: list[list[int]], vocab: int, seed: int) -> list[list[dict]]:
    """Random text of ids ``8..vocab`` with the three markers scattered in it; the label is the
    marker that occurs most often (a unique maximum)."""
    rng = np.random.default_rng(seed)
    out = []
    for batch in lens:
        feats = []
        for n in batch:
            ids = rng.integers(8, vocab, n)
            label = int(rng.integers(0, 3))
            top = min(3, max(1, n // 6))
            counts = rng.integers(0, top, 3)
            counts[label] = counts.max() + 1
            where = rng.permutation(n)[: int(counts.sum())]
            ids[where] = np.repeat(MARKERS, counts)
            feats.append({"input_ids": ids.tolist(), "labels": label})
        out.append(feats)
    return out


def train(name: str, model, batches: list, make, device, every: int, lr: float) -> list[float]:
    """Train ``model`` (``model(**make(batch)).loss``) one step per batch; the mean loss of each
    ``every`` steps (read once, at the end)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda")
    model.train()
    losses = []
    for b in batches:
        loss = model(**make(b)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    sync(device)
    flat = torch.stack(losses).cpu().numpy()
    return [float(flat[i : i + every].mean()) for i in range(0, len(flat), every)]


def evaluate(model, feats: list[list[dict]], make, device) -> tuple[float, float]:
    """Held-out mean loss and accuracy in eval mode."""
    model.eval()
    losses, right, count = [], 0, 0
    with torch.no_grad():
        for b in feats:
            out = model(**make(b))
            labels = torch.tensor([s["labels"] for s in b], device=out.logits.device)
            losses.append(float(out.loss) * len(b))
            right += int((out.logits.float().argmax(-1) == labels).sum())
            count += len(b)
    return sum(losses) / count, right / count


def main(argv=None) -> int:
    from transformers import BertForSequenceClassification

    import ragged.nn as rnn

    p = argparse.ArgumentParser(prog="python -m bench.train_curve", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--eval", type=int, default=1024)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--rows", default="hf,ragged,graphed")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    tiny = device.type == "cpu"
    lo, hi, median = (16, 64, 24) if tiny else (16, 512, 96)
    config = bert_config(tiny, args.dropout)
    torch.manual_seed(SEED)
    start = BertForSequenceClassification(config).to(device, torch.float32 if tiny else torch.bfloat16)
    start.set_attn_implementation("sdpa")
    train_feats = marker_features(lengths(args.steps, args.batch, lo, hi, median, 1.0), config.vocab_size, SEED)
    eval_lens = lengths(-(-args.eval // 64), 64, lo, hi, median, 1.0, seed=SEED + 7)
    eval_feats = marker_features(eval_lens, config.vocab_size, SEED + 8)
    curves, scores = {}, {}
    for key in args.rows.split(","):
        model = copy.deepcopy(start)
        if key == "hf":
            name, run, make = "HF SDPA, padded + mask", model, lambda b: padded_batch(b, device)
        else:
            model = rnn.convert(model)
            make = lambda b: ragged_batch(b, device)  # noqa: E731
            name, run = "ragged.nn.convert, eager", model
            if key == "graphed":
                budget = max(sum(len(s["input_ids"]) for s in b) for b in train_feats + eval_feats)
                run = rnn.graphed(model, max_tokens=budget, max_batch_size=max(args.batch, 64))
                if tiny:
                    run.capture = False  # the bucketed batches, eagerly
                name = "ragged.nn.graphed, training graphs"
        torch.manual_seed(SEED + 1)
        curves[name] = train(name, run, train_feats, make, device, args.every, args.lr)
        scores[name] = evaluate(run, eval_feats, make, device)
        print(f"{name}: held-out loss {scores[name][0]:.4f}, accuracy {scores[name][1]:.4f}", flush=True)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    names = list(curves)
    lines = [
        f"# bench.train_curve on {where}: {args.steps} steps of {args.batch} sequences, lr {args.lr}, the marker task",
        "",
        "| steps | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for i in range(len(curves[names[0]])):
        upto = min((i + 1) * args.every, args.steps)
        lines.append(f"| {i * args.every + 1}..{upto} | " + " | ".join(f"{curves[n][i]:.4f}" for n in names) + " |")
    lines += [
        "",
        "| held out | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
        "| loss | " + " | ".join(f"{scores[n][0]:.4f}" for n in names) + " |",
        "| accuracy | " + " | ".join(f"{scores[n][1]:.4f}" for n in names) + " |",
    ]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
