"""Swap a model's torch.nn.TransformerEncoder for ragged.nn's, check the outputs, time both.

``ragged.nn.convert`` replaces every ``nn.TransformerEncoder`` / ``TransformerEncoderLayer`` /
``MultiheadAttention`` in a model with the padding-free module, keeping the same Parameter
objects; the model's own code (here: a padded batch and a key padding mask) does not change.

On a GPU: BERT-base (12 layers, d=768, 12 heads, feed-forward 3072) in bfloat16 on a
long-tailed batch. On CPU: a small encoder, in seconds (ragged's CPU attention is the
pure-torch reference, so CPU timings say little). ``python examples/swap_encoder.py --help``.
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch
from torch import nn

import ragged


class TextEncoder(nn.Module):
    """A model that happens to hold a torch.nn encoder somewhere inside."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int, num_layers: int):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=0.0, activation="gelu",
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers)
        self.head = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x, src_key_padding_mask=padding_mask))


def long_tailed_lengths(batch: int, max_len: int, generator: torch.Generator) -> list[int]:
    """Mostly short sequences and a few long ones (log-normal, clipped to [4, max_len])."""
    raw = torch.empty(batch).log_normal_(mean=0.0, std=0.8, generator=generator) * (max_len / 8)
    lengths = raw.clamp(4, max_len).long().tolist()
    lengths[0] = max_len  # one full-length sequence sets the padded width
    return lengths


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median milliseconds per call (after two warm-up calls)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64 if gpu else 8)
    parser.add_argument("--max-len", type=int, default=512 if gpu else 48)
    parser.add_argument("--repeats", type=int, default=10 if gpu else 3)
    parser.add_argument("--small", action="store_true", help="the small CPU configuration on any device")
    args = parser.parse_args()

    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")  # torch's fast path
    device = torch.device("cuda" if gpu else "cpu")
    big = gpu and not args.small
    d_model, nhead, ff, layers = (768, 12, 3072, 12) if big else (64, 4, 128, 2)
    dtype = torch.bfloat16 if big else torch.float32
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes about its nested-tensor fast path
        model = TextEncoder(d_model, nhead, ff, layers).to(device, dtype)
    swapped = ragged.nn.convert(copy.deepcopy(model))  # in place; same Parameters as the copy it swapped
    print(f"swapped: {type(swapped.encoder).__module__}.{type(swapped.encoder).__name__} "
          f"({layers} layers, d={d_model}, {nhead} heads, ff={ff}, {dtype}, {device})")

    lengths = long_tailed_lengths(args.batch, args.max_len, gen)
    width = max(lengths)
    x = torch.randn(len(lengths), width, d_model, generator=gen).to(device, dtype)
    pad = torch.arange(width, device=device).unsqueeze(0) >= torch.tensor(lengths, device=device).unsqueeze(1)
    real = sum(lengths)
    print(f"batch {len(lengths)}, padded width {width}, {real} real tokens of {len(lengths) * width} "
          f"({100 * real / (len(lengths) * width):.0f}%)")

    # Same values at real positions; zeros at padding on the ragged side.
    with torch.no_grad():
        expected = model.eval()(x, pad)
        got = swapped.eval()(x, pad)
    keep = ~pad
    err = ((got[keep].float() - expected[keep].float()).abs().max() / expected[keep].float().abs().max()).item()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    print(f"max difference at real positions, relative to the largest value: {err:.2e} (tolerance {tol:.0e})")
    assert err < tol, "outputs differ"
    assert torch.all(swapped.encoder(x, src_key_padding_mask=pad)[pad] == 0)

    rt = ragged.pack(x, lengths=lengths)  # what a padding-free pipeline hands over: no mask at all

    def infer(m):
        def run():
            with torch.no_grad():
                m(x, pad)
        return run

    def infer_packed():  # the same model on the RaggedTensor: encoder, then the head on real tokens only
        with torch.no_grad():
            swapped.head(swapped.encoder(rt).values)

    def train(m):
        def run():
            m(x, pad)[keep].float().sum().backward()
        return run

    rows = []
    model.eval()
    swapped.eval()
    rows.append(("inference, padded input + mask", timed(infer(model), args.repeats, device),
                 timed(infer(swapped), args.repeats, device)))
    rows.append(("inference, RaggedTensor input", rows[0][1], timed(infer_packed, args.repeats, device)))
    model.train()
    swapped.train()
    rows.append(("training step (forward + backward)", timed(train(model), args.repeats, device),
                 timed(train(swapped), args.repeats, device)))

    print()
    print(f"| {'workload':38s} | torch.nn (ms) | ragged.nn (ms) | speed-up |")
    print(f"|{'-' * 40}|--------------:|---------------:|---------:|")
    for name, t_torch, t_ragged in rows:
        print(f"| {name:38s} | {t_torch:13.2f} | {t_ragged:14.2f} | {t_torch / t_ragged:7.2f}x |")
    if device.type == "cpu":
        print("\n(CPU: ragged's attention is the per-sequence pure-torch reference; run on a GPU for kernels)")


if __name__ == "__main__":
    main()
