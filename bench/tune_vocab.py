"""Sweep of the vocab kernels' block shapes on the target workload (bf16, B=64, T_i 16..64,
d=1024, V=32000, |V_i| 500..2000), beside the full projection.

Development tool, run on a GPU: ``python -m bench.tune_vocab``. For each kernel (forward,
d_hidden, d_weight, fused cross-entropy forward and gradient tile) it prints the median
time of every configuration and the best one; the chosen shapes live in
``ragged/kernels/triton/vocab.py`` (``config``, ``_dhidden_config``, ``_dweight_config``)
and ``ragged/kernels/triton/vocab_cross_entropy.py`` (``_ce_config``). The last sweep's
output: ``bench/results/tune_vocab_h200.txt``.
"""

import argparse

import torch
from triton.testing import do_bench

import ragged
from ragged.kernels.triton import vocab as kv
from ragged.kernels.triton import vocab_cross_entropy as kce
from ragged.ops.vocab_checks import prepare
from ragged.records.vocab import (
    VocabCrossEntropyArgs,
    VocabCrossEntropyBackwardInputs,
    VocabProjectionArgs,
    VocabProjectionBackwardInputs,
)

from .suites.vocab import GPU_SHAPES, Problem


def capture(p: Problem) -> VocabProjectionArgs:
    """The projection's operand record for one call on the problem (no bias), as
    :func:`ragged.vocab_projection` builds it."""
    hidden = ragged.RaggedTensor.from_lengths(p.hidden, p.lengths)
    vocab = ragged.RaggedTensor.from_lengths(p.vocab_values, p.counts)
    layout = prepare("bench.tune_vocab", hidden, p.weight, vocab, None, False)
    return VocabProjectionArgs(
        layout.hidden,
        layout.h_off,
        layout.weight,
        layout.bias,
        layout.ids,
        layout.v_off,
        layout.l_off,
        layout.total,
        layout.max_t,
        layout.max_v,
    )


def sweep(label, setter, configs, fn, default):
    results = []
    for cfg in configs:
        setter(cfg)
        try:
            ms = do_bench(fn, return_mode="median")
        except Exception as exc:  # out of shared memory / registers
            print(f"  {label} {cfg} failed: {type(exc).__name__}", flush=True)
            continue
        results.append((ms, cfg))
        print(f"  {label} {cfg}: {ms:.4f} ms", flush=True)
    setter(default)
    results.sort()
    if results:
        print(
            f"{label}: best {results[0][1]} {results[0][0]:.4f} ms; default {default} "
            f"{next((m for m, c in results if c == default), float('nan')):.4f} ms",
            flush=True,
        )
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", default=None, help="fwd dh dw ce cegrad")
    args = parser.parse_args()
    want = lambda k: not args.only or k in args.only  # noqa: E731
    print(torch.cuda.get_device_name(), flush=True)
    p = Problem.make(GPU_SHAPES[0], torch.device("cuda"))
    proj = capture(p)
    hidden, weight, total, max_t, max_v = proj.hidden, proj.weight, proj.total, proj.max_t, proj.max_v
    dim, dt = hidden.shape[1], hidden.dtype
    full = do_bench(lambda: hidden @ weight.T, return_mode="median")
    print(
        f"T={hidden.shape[0]} d={dim} V={weight.shape[0]} selected logits={total}; full h@W.T {full:.4f} ms", flush=True
    )
    grad = torch.randn(total, device="cuda", dtype=dt)

    if want("fwd"):
        default = kv.config(dim, max_t, max_v, dt, False)
        configs = [
            (bm, bn, 64, w, s)
            for bm in (32, 64, 128)
            for bn in (64, 128, 256)
            for w in (4, 8)
            for s in (3, 4)
            if bm * bn <= 128 * 128 and 64 * (bm + bn) * s <= 65536
        ]
        configs += [(64, 128, 32, 4, 4), (64, 128, 128, 8, 2), (64, 64, 128, 4, 3)]
        orig = kv.config
        sweep(
            "fwd",
            lambda c: setattr(kv, "config", (lambda *a, c=c: c) if c != default else orig),
            configs,
            lambda: kv.forward(proj),
            default,
        )
        kv.config = orig
    if want("dh"):
        default = kv._dhidden_config(dim, max_t, dt, False)
        configs = [
            (bm, bd, bk, w, s) for bm in (32, 64) for bd in (64, 128) for bk in (32, 64) for w in (4, 8) for s in (2, 3)
        ]
        orig = kv._dhidden_config
        sweep(
            "d_hidden",
            lambda c: setattr(kv, "_dhidden_config", lambda *a, c=c: c),
            configs,
            lambda: kv.backward(proj, VocabProjectionBackwardInputs(grad, True, False, False, False)),
            default,
        )
        kv._dhidden_config = orig
    if want("dw"):
        default = kv._dweight_config(dim, max_t, dt, False)
        configs = [
            (bn, bd, bk, w, s)
            for bn in (64, 128)
            for bd in (64, 128)
            for bk in (16, 32, 64)
            for w in (4, 8)
            for s in (2, 3)
        ]
        orig = kv._dweight_config
        sweep(
            "d_weight",
            lambda c: setattr(kv, "_dweight_config", lambda *a, c=c: c),
            configs,
            lambda: kv.backward(proj, VocabProjectionBackwardInputs(grad, False, True, False, False)),
            default,
        )
        kv._dweight_config = orig
    ce = VocabCrossEntropyArgs(*proj, target=p.target, ignore_index=-100, label_smoothing=0.0)
    if want("ce"):
        default = kce._ce_config(dim, max_t, max_v, dt, False)
        configs = [
            (bm, bn, 64, w, s)
            for bm in (32, 64, 128)
            for bn in (64, 128, 256)
            for w in (4, 8)
            for s in (3, 4)
            if bm * bn <= 128 * 128 and 64 * (bm + bn) * s <= 65536
        ]
        orig = kce._ce_config
        sweep(
            "ce fwd",
            lambda c: setattr(kce, "_ce_config", lambda *a, c=c: c),
            configs,
            lambda: kce.forward(ce),
            default,
        )
        kce._ce_config = orig
    if want("cegrad"):
        out = kce.forward(ce)
        gl = torch.full((hidden.shape[0],), 1.0 / hidden.shape[0], device="cuda")
        inputs = VocabCrossEntropyBackwardInputs(gl, out.local, out.lse, need_bias=False)
        fn = lambda: kce.backward(ce, inputs)  # noqa: E731
        print(
            f"ce backward (grad tile + d_hidden + d_weight, current configs): "
            f"{do_bench(fn, return_mode='median'):.4f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
