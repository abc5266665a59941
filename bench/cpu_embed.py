"""Sentence embedding on the CPU: a SentenceTransformer with all-MiniLM-L6-v2's shape (random
weights, a word-level tokenizer: no download) against ``ragged.nn.convert`` of a copy of it.

``python -m bench.cpu_embed [--texts N] [--repeats R] [--batch B]`` prints texts/s, wall and CPU
seconds (``time.process_time``, all threads) of ``encode(texts, batch_size=B)`` at one torch thread
and at the default thread count, the median of R runs interleaved (original, converted, for each
thread count, R times), with the host CPU named. Texts: lognormal lengths (median 25 tokens,
special tokens included, 3 to 256).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from .env import cpu_name

VOCAB = 30522


def build(count: int, seed: int = 0):
    """``(original, converted, texts)``: the SentenceTransformer (mean pooling), a converted deep
    copy, and ``count`` texts of random one-token words."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    import ragged.nn as rnn

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}, model_max_length=512)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
    )
    with tempfile.TemporaryDirectory(prefix="ragged_cpu_embed_") as tmp:
        BertModel(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        modules = [Transformer(tmp, max_seq_length=256), Pooling(config.hidden_size, "mean")]
        original = SentenceTransformer(modules=modules, device="cpu").eval()
    converted = rnn.convert(copy.deepcopy(original))
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(25), 0.7, count)), 3, 256).astype(int)
    texts = [" ".join(f"w{i}" for i in rng.integers(0, VOCAB - 5, n - 2)) for n in lengths]
    return original, converted, texts


def encode(model, texts: list[str], batch: int) -> tuple[float, float, torch.Tensor]:
    """``(wall s, CPU s, embeddings)`` of one ``encode``."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = model.encode(texts, batch_size=batch, convert_to_tensor=True, show_progress_bar=False)
    return time.perf_counter() - wall, time.process_time() - cpu, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_embed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    default = torch.get_num_threads()
    original, converted, texts = build(args.texts)
    print(
        f"host: {cpu_name()}, {os.cpu_count()} logical CPUs; torch {torch.__version__}, default threads {default}; "
        f"{args.texts} texts, batch {args.batch}, median of {args.repeats}"
    )
    counts = sorted({1, default})
    for threads in counts:  # warm-up, and the two models must agree
        torch.set_num_threads(threads)
        a, b = encode(original, texts[:256], args.batch)[2], encode(converted, texts[:256], args.batch)[2]
        cosine = torch.nn.functional.cosine_similarity(a.double(), b.double()).min().item()
        print(f"threads {threads}: min cosine original/converted {cosine:.6f}")
    runs: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for _ in range(args.repeats):
        for threads in counts:
            torch.set_num_threads(threads)
            for name, model in (("original", original), ("converted", converted)):
                runs.setdefault((threads, name), []).append(encode(model, texts, args.batch)[:2])
    torch.set_num_threads(default)
    print(f"{'threads':>7}  {'model':<9}  {'texts/s':>8}  {'wall s':>7}  {'CPU s':>7}  {'speed-up':>8}")
    for threads in counts:
        base = None
        for name in ("original", "converted"):
            wall = statistics.median(w for w, _ in runs[(threads, name)])
            cpu = statistics.median(c for _, c in runs[(threads, name)])
            base = base or wall
            print(
                f"{threads:>7}  {name:<9}  {args.texts / wall:>8.0f}  {wall:>7.2f}  {cpu:>7.2f}  {base / wall:>7.2f}x"
            )


if __name__ == "__main__":
    main()
