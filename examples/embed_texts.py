"""Embed texts with a sentence-transformers model converted by ``ragged.nn.convert`` and compare it
with the original: throughput of each and how far apart their embeddings are.

    python examples/embed_texts.py                      # a tiny random model and generated sentences
    python examples/embed_texts.py --model PATH --texts FILE --device cuda --dtype float16

``--model``: a SentenceTransformer folder or name (default: a 2-layer BERT with random weights and
a small wordpiece vocabulary, built in a temporary folder, so the example runs on a CPU in
seconds with no download). ``--texts``: a file with one text per line (default: generated
sentences of 1 to 120 words).
"""

from __future__ import annotations

import argparse
import copy
import random
import string
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import ragged

WORDS = (
    "the of and to in is it that was for on are with as he she they be at one have this from or had by word "
    "but what some we can out other were all there when up use your how said an each which do their time if "
    "will way about many then them write would like so these her long make thing see him two has look more day "
    "could go come did number sound no most people my over know water than call first who may down side been "
    "now find quick brown fox jumps lazy dog river city night light music"
).split()


def tiny_model(folder: Path):
    """A SentenceTransformer (BERT, 2 layers, hidden 64; mean pooling; normalized) with random weights."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules
    from transformers import BertConfig, BertModel, BertTokenizerFast

    vocab = (
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        + list(string.ascii_lowercase + string.digits + ".,!?'")
        + ["##" + c for c in string.ascii_lowercase]
        + WORDS
    )
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(str(folder / "vocab.txt"), model_max_length=256).save_pretrained(str(folder))
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=256,
    )
    BertModel(config).save_pretrained(str(folder))
    transformer = modules.Transformer(str(folder))
    return SentenceTransformer(modules=[transformer, modules.Pooling(64, "mean"), modules.Normalize()])


def generated_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(int(rng.paretovariate(1.2) * 6) % 120 + 1)) for _ in range(n)]


def texts_per_second(model, texts, batch_size: int, repeat: int) -> tuple[float, np.ndarray]:
    """The best of ``repeat`` timed runs (after one warm-up) and the embeddings."""
    out = model.encode(texts[: 4 * batch_size], batch_size=batch_size)
    best = float("inf")
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.encode(texts, batch_size=batch_size, convert_to_numpy=True)
        best = min(best, time.perf_counter() - start)
    return len(texts) / best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="SentenceTransformer folder or name (default: a tiny random model)")
    parser.add_argument("--texts", help="file with one text per line (default: generated sentences)")
    parser.add_argument("--num-texts", type=int, default=512, help="generated texts when --texts is not given")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per model (the best is reported)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            from sentence_transformers import SentenceTransformer

            original = SentenceTransformer(args.model)
        else:
            original = tiny_model(Path(tmp))
    original = original.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    texts = Path(args.texts).read_text().splitlines() if args.texts else generated_texts(args.num_texts)
    converted = ragged.nn.convert(copy.deepcopy(original))

    rate_original, want = texts_per_second(original, texts, args.batch_size, args.repeat)
    rate_converted, got = texts_per_second(converted, texts, args.batch_size, args.repeat)
    want, got = want.astype(np.float64), got.astype(np.float64)
    cosine = (want * got).sum(1) / np.maximum(np.linalg.norm(want, axis=1) * np.linalg.norm(got, axis=1), 1e-30)
    tokens = sum(len(ids) for ids in original.tokenizer(texts, truncation=True)["input_ids"])
    print(f"{len(texts)} texts, {tokens} tokens, batch size {args.batch_size}, {args.device}, {args.dtype}")
    print(f"original:  {rate_original:10.1f} texts/s")
    print(f"converted: {rate_converted:10.1f} texts/s  ({rate_converted / rate_original:.2f}x)")
    print(f"max cosine difference: {np.max(1.0 - cosine):.2e}, max abs difference: {np.abs(want - got).max():.2e}")
    if torch.device(args.device).type == "cpu":
        print(
            "on CPU ragged runs its pure-torch reference kernels and the default model is tiny: the ratio above "
            "shows the CPU path, not the GPU kernels (python -m bench --suite hf on a GPU measures those)"
        )


if __name__ == "__main__":
    main()
