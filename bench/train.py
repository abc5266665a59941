"""One fine-tuning step, as a user runs it: where its time goes.

``python -m bench.train`` fine-tunes BERT-base (``BertForSequenceClassification``, 3 labels,
AdamW, dropout 0.1, bf16 weights) on batches of 32 sequences with long-tailed lengths 16..512
(lognormal, median 96, mean about 158 tokens), the same weights and batches for every row, and
prints per row: tokens/s, the step's wall time, the host's enqueue time per step (the loop
returns before the GPU finishes unless the host is the bottleneck), and the GPU busy time per
step (``torch.profiler``: the union of the kernels' intervals). A row whose step is close to its
host time and far above its GPU time waits on Python. Rows (``--rows``): ``hf`` (HF SDPA on
padded batches with a mask), ``hf-compile`` (the same, ``torch.compile(dynamic=True)``),
``ragged`` (``ragged.nn.convert``, eager: its layers replayed from per-layer graphs),
``ragged-nolayergraphs`` (the same with ``ragged.nn.layer_graphs.off()``), ``graphed`` (its
training graphs), ``trainer``
(``RaggedTrainer(graphs=True)`` over the same sequences in token-budget batches, timed per epoch
in the steady state: see :class:`TrainerRow`). ``--profile N`` prints the top ``N``
functions of a ``cProfile`` of the ragged and graphed rows' steps (host time by function),
``--out`` writes the table as Markdown. Runs on a GPU (``--device cpu`` for a smoke run
with a tiny model).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import math
import pstats
import statistics
import sys
import time

import numpy as np
import torch

SEED = 0


def lengths(steps: int, batch: int, lo: int, hi: int, median: float, sigma: float, seed: int = SEED) -> list[list[int]]:
    x = np.random.default_rng(seed).lognormal(math.log(median), sigma, steps * batch)
    flat = np.clip(np.rint(x), lo, hi).astype(int).tolist()
    return [flat[i * batch : (i + 1) * batch] for i in range(steps)]


def make_features(lens: list[list[int]], vocab: int, labels: int) -> list[list[dict]]:
    rng = np.random.default_rng(SEED + 1)
    return [
        [{"input_ids": rng.integers(5, vocab, n).tolist(), "labels": int(rng.integers(0, labels))} for n in b]
        for b in lens
    ]


def padded_batch(batch: list[dict], device) -> dict:
    width = max(len(s["input_ids"]) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
        mask[i, : len(s["input_ids"])] = 1
    out = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([s["labels"] for s in batch])}
    return {k: v.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else v for k, v in out.items()}


def ragged_batch(batch: list[dict], device):
    from ragged.data import collate

    return collate(batch).to(device, non_blocking=True)


class TrainerRow:
    """``RaggedTrainer`` as users run it (``graphs=True`` on a GPU; on the CPU the bucketed
    batches run eagerly): ``epochs`` epochs over the rows' sequences per :meth:`run`, in
    token-budget batches of at most the largest bench batch's tokens. The time of a run is
    that of its epochs after the first (which captures the graphs), from the end of the first
    to the end of the last, with one device sync at each (none per step), per epoch: the steady
    state of a long run, without ``Trainer``'s setup."""

    def __init__(self, name: str, model, feats: list[list[dict]], device, epochs: int = 3):
        import tempfile

        from transformers import TrainerCallback, TrainingArguments

        import ragged.nn as rnn
        from ragged.integrations.trainer import RaggedTrainer

        self.name, self.model, self.device, self.epochs = name, model, device, epochs
        data = [s for b in feats for s in b]
        budget = max(sum(len(s["input_ids"]) for s in b) for b in feats)
        widest = max(map(len, feats))
        cuda = device.type == "cuda"
        self._dir = tempfile.TemporaryDirectory()
        args = TrainingArguments(
            self._dir.name,
            num_train_epochs=epochs,
            learning_rate=2e-5,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=10**9,
            use_cpu=not cuda,
            optim="adamw_torch_fused" if cuda else "adamw_torch",
            seed=SEED,
            dataloader_pin_memory=cuda,
        )
        graphs = True if cuda else rnn.Graphed(model, budget, widest, capture=False)
        marks = self.marks = []

        class Clock(TrainerCallback):
            def on_epoch_end(self, _args, state, control, **kw):
                sync(device)
                marks.append(time.perf_counter())

        self.trainer = RaggedTrainer(
            model,
            args,
            train_dataset=data,
            max_tokens=budget,
            max_batch_size=widest,
            graphs=graphs,
            callbacks=[Clock()],
        )
        self.trainer._train_sampler.set_epoch(0)
        self.batches = range(len(self.trainer._train_sampler))  # optimizer steps of an epoch

    def run(self) -> tuple[float, float]:
        self.marks.clear()
        self.trainer.train()
        per_epoch = (self.marks[-1] - self.marks[0]) / (self.epochs - 1)
        return per_epoch, per_epoch


def emit(lines: list[str], out: str | None) -> None:
    """Print the report (with a line naming the host CPU, torch and the tree after its title),
    and write it to ``out`` (Markdown) when given."""
    from bench.env import cpu_name, git_state

    commit = git_state().get("git_commit") or "unknown"
    lines = [lines[0], "", f"host CPU {cpu_name()}, torch {torch.__version__}, tree {commit[:12]}", *lines[1:]]
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Row:
    def __init__(self, name: str, model, batches: list, device, fused: bool, layer_graphs: bool = True):
        self.name, self.model, self.batches, self.device = name, model, batches, device
        self.opt = torch.optim.AdamW(model.parameters(), lr=2e-5, fused=fused, foreach=None if fused else True)
        self.layer_graphs = layer_graphs

    def step(self, batch) -> torch.Tensor:
        if self.layer_graphs:
            loss = self.model(**batch).loss
            loss.backward()
        else:
            from ragged.nn import layer_graphs

            with layer_graphs.off():
                loss = self.model(**batch).loss
                loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def run(self) -> tuple[float, float]:
        """Wall and host-enqueue seconds of one pass over the batches."""
        sync(self.device)
        start = time.perf_counter()
        for b in self.batches:
            self.step(b)
        host = time.perf_counter() - start
        sync(self.device)
        return time.perf_counter() - start, host


def gpu_busy(row: Row) -> float | None:
    """GPU busy seconds of one pass over the batches (see :func:`bench.harness.gpu_busy_ms`)."""
    from bench.harness import gpu_busy_ms

    ms = gpu_busy_ms(row.run, row.device, calls=1)
    return None if ms is None else ms / 1e3


def bert_config(tiny: bool, dropout: float):
    """BERT-base with 3 labels, or a tiny BERT (CPU smoke runs), with ``dropout`` everywhere."""
    from transformers import BertConfig

    size = (
        dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
        if tiny
        else dict(
            vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072
        )
    )
    return BertConfig(num_labels=3, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, **size)


def build(args, device):
    from transformers import BertForSequenceClassification

    import ragged.nn as rnn

    tiny = device.type == "cpu"
    config = bert_config(tiny, args.dropout)
    torch.manual_seed(SEED)
    dtype = torch.float32 if tiny else torch.bfloat16
    hf = BertForSequenceClassification(config).to(device, dtype)
    hf.set_attn_implementation("sdpa")
    lens = lengths(args.steps, args.batch, 16 if not tiny else 4, 512 if not tiny else 48, 96 if not tiny else 12, 1.0)
    feats = make_features(lens, config.vocab_size, 3)
    tokens = sum(map(sum, lens))
    fused = device.type == "cuda"
    rows = {}
    if "hf" in args.rows:
        rows["hf"] = Row("HF SDPA, padded + mask", hf, [padded_batch(b, device) for b in feats], device, fused)
    if "hf-compile" in args.rows:
        m = copy.deepcopy(hf)
        m.forward = torch.compile(m.forward, dynamic=True)
        rows["hf-compile"] = Row(
            "HF SDPA, torch.compile(dynamic=True)", m, [padded_batch(b, device) for b in feats], device, fused
        )
    if "ragged" in args.rows:
        rows["ragged"] = Row(
            "ragged.nn.convert, RaggedTensor ids",
            rnn.convert(copy.deepcopy(hf)),
            [ragged_batch(b, device) for b in feats],
            device,
            fused,
        )
    if "ragged-nolayergraphs" in args.rows:
        rows["ragged-nolayergraphs"] = Row(
            "ragged.nn.convert, RaggedTensor ids, layer graphs off",
            rnn.convert(copy.deepcopy(hf)),
            [ragged_batch(b, device) for b in feats],
            device,
            fused,
            layer_graphs=False,
        )
    if "graphed" in args.rows and device.type == "cuda":
        converted = rnn.convert(copy.deepcopy(hf))
        g = rnn.graphed(converted, max_tokens=args.batch * max(map(max, lens)), max_batch_size=args.batch)
        rows["graphed"] = Row(
            "ragged.nn.graphed(converted), training graphs", g, [ragged_batch(b, device) for b in feats], device, fused
        )
    if "trainer" in args.rows:
        rows["trainer"] = TrainerRow(
            "RaggedTrainer(graphs=True), steady state", rnn.convert(copy.deepcopy(hf)), feats, device
        )
    for r in rows.values():
        r.model.train()
    return {k: rows[k] for k in args.rows if k in rows}, tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", default="hf,hf-compile,ragged,ragged-nolayergraphs,graphed,trainer")
    p.add_argument(
        "--profile", type=int, default=0, help="top N functions of a cProfile of the ragged and graphed rows"
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.rows = args.rows.split(",")
    device = torch.device(args.device)
    rows, tokens = build(args, device)
    lines = [
        f"# bench.train on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, "
        f"{args.steps} steps of {args.batch} sequences, {tokens} tokens, dropout {args.dropout}",
        "",
        "| path | tokens/s | step ms | host enqueue ms/step | GPU busy ms/step |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, r in rows.items():
        r.run()  # warm-up (compiles, autotunes)
        r.run()
        walls, hosts = zip(*(r.run() for _ in range(args.repeats)))
        wall, host = statistics.median(walls), statistics.median(hosts)
        busy = gpu_busy(r) if isinstance(r, Row) else None
        n = len(r.batches)
        lines.append(
            f"| {r.name} | {tokens / wall / 1e3:.1f}k | {wall / n * 1e3:.2f} | {host / n * 1e3:.2f} | "
            + (f"{busy / n * 1e3:.2f} |" if busy is not None else "n/a |")
        )
        print(lines[-1], flush=True)
    for key in ("ragged", "graphed") if args.profile else ():
        if key not in rows:
            continue
        r = rows[key]
        prof = cProfile.Profile()
        prof.enable()
        r.run()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
        s2 = io.StringIO()
        pstats.Stats(prof, stream=s2).sort_stats("cumulative").print_stats(args.profile)
        lines += [
            "",
            f"## cProfile of the {r.name} row, by own time",
            "```",
            s.getvalue().strip(),
            "```",
            "## by cumulative time",
            "```",
            s2.getvalue().strip(),
            "```",
        ]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
