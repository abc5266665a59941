"""Swap a model's torch.nn.TransformerEncoder for ragged.nn's, check the outputs, time both.

``ragged.nn.convert`` replaces every ``nn.TransformerEncoder`` / ``TransformerEncoderLayer`` /
``MultiheadAttention`` in a model with the padding-free module, keeping the same Parameter
objects; the model's own code (here: a padded batch and a key padding mask) does not change.

On a GPU: BERT-base (12 layers, d=768, 12 heads, feed-forward 3072) in bfloat16 on a
long-tailed batch. On CPU: a small encoder on one thread, in seconds (ragged's CPU attention
is the pure-torch reference, so CPU timings say little). ``python examples/swap_encoder.py --help``.

Timing: first calls cost far more than later ones (torch's nested-tensor fast path, Triton's
compilation), so each path is called until its times settle (the median of a round of calls
within 5% of the previous round's, or a time cap), then the paths of a workload are called in
turn for a fixed time and their medians compared. The output says which paths did not settle.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time
import warnings

import torch
from torch import nn

import ragged


class TextEncoder(nn.Module):
    """A model that happens to hold a torch.nn encoder somewhere inside."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int, num_layers: int):
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward, dropout=0.0, activation="gelu", batch_first=True
        )
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


def _call_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def warm_up(fn, device: torch.device, budget_s: float, tol: float = 0.05, per_round: int = 5) -> bool:
    """Call ``fn`` in rounds of ``per_round`` calls until the median of a round is within
    ``tol`` of the previous round's, or ``budget_s`` runs out. True when the times settled.

    First calls cost far more than later ones (torch's nested-tensor fast path spends about
    300 ms on its first calls in a fresh process; Triton compiles its kernels; allocators
    grow): timing before they settle measures start-up, not the model."""
    start = time.perf_counter()
    previous = None
    while True:
        times = []
        for _ in range(per_round):
            times.append(_call_ms(fn, device))
            if time.perf_counter() - start > budget_s:
                return False
        current = statistics.median(times)
        if previous is not None and abs(current - previous) <= tol * previous:
            return True
        previous = current


@dataclasses.dataclass
class Timing:
    median_ms: float
    spread_ms: float  # half the interquartile range
    calls: int
    settled: bool

    def cell(self) -> str:
        return f"{self.median_ms:.2f} ±{self.spread_ms:.2f}{'' if self.settled else ' *'}"


def compare(fns: dict, device: torch.device, min_calls: int, budget_s: float, warmup_s: float) -> dict:
    """A :class:`Timing` per function: each warmed up until its times settle, then called in
    turn (interleaved, so a change in the machine's load hits every path alike) for at least
    ``min_calls`` rounds and until ``budget_s`` seconds have passed."""
    settled = {name: warm_up(fn, device, warmup_s) for name, fn in fns.items()}
    times: dict = {name: [] for name in fns}
    start = time.perf_counter()
    rounds = 0
    while rounds < max(min_calls, 2) or (time.perf_counter() - start < budget_s and rounds < 10_000):
        for name, fn in fns.items():
            times[name].append(_call_ms(fn, device))
        rounds += 1
    out = {}
    for name, ts in times.items():
        q1, _, q3 = statistics.quantiles(ts, n=4)
        out[name] = Timing(statistics.median(ts), (q3 - q1) / 2, len(ts), settled[name])
    return out


def main() -> None:
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64 if gpu else 8)
    parser.add_argument("--max-len", type=int, default=512 if gpu else 48)
    parser.add_argument(
        "--repeats",
        type=int,
        default=20 if gpu else 5,
        help="at least this many timed calls of each path, after its warm-up",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=5.0 if gpu else 1.5,
        help="seconds of timed calls per workload (more calls when they are short)",
    )
    parser.add_argument(
        "--warmup-budget",
        type=float,
        default=60.0 if gpu else 2.0,
        help="seconds each path may spend warming up before it is timed anyway",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None if gpu else 1,
        help="torch's CPU threads (default on CPU: 1; at the small size threads buy little, and on "
        "a shared machine their spin-waits make times erratic)",
    )
    parser.add_argument("--small", action="store_true", help="the small CPU configuration on any device")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

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
    print(
        f"swapped: {type(swapped.encoder).__module__}.{type(swapped.encoder).__name__} "
        f"({layers} layers, d={d_model}, {nhead} heads, ff={ff}, {dtype}, {device})"
    )

    lengths = long_tailed_lengths(args.batch, args.max_len, gen)
    width = max(lengths)
    x = torch.randn(len(lengths), width, d_model, generator=gen).to(device, dtype)
    pad = torch.arange(width, device=device).unsqueeze(0) >= torch.tensor(lengths, device=device).unsqueeze(1)
    real = sum(lengths)
    print(
        f"batch {len(lengths)}, padded width {width}, {real} real tokens of {len(lengths) * width} "
        f"({100 * real / (len(lengths) * width):.0f}%)"
    )

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

    threads = torch.get_num_threads()
    where = f"{threads} thread{'s' * (threads != 1)}" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(
        f"\ntiming on {device} ({where}, torch {torch.__version__}): each path is warmed up until the median "
        f"of 5 calls moves by less than 5% between rounds (at most {args.warmup_budget:g} s), then the paths "
        f"of a workload are called in turn, at least {args.repeats} times each and for {args.time_budget:g} s"
    )
    model.eval()
    swapped.eval()
    inference = compare(
        {"torch": infer(model), "ragged": infer(swapped), "packed": infer_packed},
        device,
        args.repeats,
        args.time_budget,
        args.warmup_budget,
    )
    model.train()
    swapped.train()
    training = compare(
        {"torch": train(model), "ragged": train(swapped)}, device, args.repeats, args.time_budget, args.warmup_budget
    )
    rows = [
        ("inference, padded input + mask", inference["torch"], inference["ragged"]),
        ("inference, RaggedTensor input", inference["torch"], inference["packed"]),
        ("training step (forward + backward)", training["torch"], training["ragged"]),
    ]

    print()
    print(f"| {'workload':38s} | {'calls':>5s} | {'torch.nn (ms)':>17s} | {'ragged.nn (ms)':>17s} | speed-up |")
    print(f"|{'-' * 40}|------:|{'-' * 18}:|{'-' * 18}:|---------:|")
    for name, theirs, ours in rows:
        print(
            f"| {name:38s} | {ours.calls:5d} | {theirs.cell():>17s} | {ours.cell():>17s} | "
            f"{theirs.median_ms / ours.median_ms:7.2f}x |"
        )
    print("\n(median ± half the interquartile range of the timed calls)")
    paths = {
        "torch.nn inference": inference["torch"],
        "ragged.nn inference": inference["ragged"],
        "ragged.nn inference on a RaggedTensor": inference["packed"],
        "torch.nn training": training["torch"],
        "ragged.nn training": training["ragged"],
    }
    unsettled = [name for name, timing in paths.items() if not timing.settled]
    if unsettled:
        print(
            f"* did not settle within the warm-up budget: {', '.join(unsettled)} (a busy machine? raise "
            "--warmup-budget); those times are less reliable"
        )
    else:
        print("every path settled before it was timed")
    if device.type == "cpu":
        print("(CPU: ragged's attention is the per-sequence pure-torch reference; run on a GPU for kernels)")


if __name__ == "__main__":
    main()
