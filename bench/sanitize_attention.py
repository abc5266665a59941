"""A small driver for compute-sanitizer over the attention implementations taken only where
preferred or off by default: the warp-specialised sm_90 forward (and its settings) and the fused
backward (dQ by atomics or by TMA), alone and paired.

Run on an sm_90 GPU, under the sanitizer:
``compute-sanitizer --tool memcheck python -m bench.sanitize_attention`` (and ``racecheck``;
``--kernel-name regex=_ws_fwd|_bwd_dkdv|_bwd_delta`` keeps the sanitizer to these kernels);
``python -m bench.sanitize_attention NAME ...``: only those of :data:`IMPLEMENTATIONS`.

Varlen batches with lengths 0, 1, a block's worth plus and minus one and a few hundred, cross
lengths with a sequence of no keys, GQA 4/2 heads, bf16 and fp16, head dims 64 and 128, full
and causal; each call's forward and backward run once. Prints how many calls each
implementation took, so that a sanitizer summary with no errors is known to have seen them.
"""

from __future__ import annotations

import argparse

import torch

import ragged
from ragged import backends

from .attention_variants import _ws_setting

# ``name+setting``: the warp-specialised forward under a setting of bench.attention_variants'
# WS_SETTINGS (ping-pong, two K/V stages at D=128, three consumers at D=64, a persistent grid)
IMPLEMENTATIONS = (
    "triton_sm90_ws",
    "triton_sm90_ws+pingpong",
    "triton_sm90_ws+stages2",
    "triton_sm90_ws+wg3",
    "triton_sm90_ws+persistent",
    "triton_fused_bwd",
    "triton_sm90_fused_bwd",
    "triton_sm90_ws_fused_bwd",
    "triton_fused_bwd_tma",
    "triton_sm90_fused_bwd_tma",
)
LENGTHS = (
    ([0, 1, 129, 300, 127, 5], [0, 1, 129, 300, 127, 5]),
    ([3, 1, 77, 300, 64], [5, 0, 200, 64, 1]),
)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"of {', '.join(IMPLEMENTATIONS)} (default: all)")
    names = parser.parse_args(argv).names or list(IMPLEMENTATIONS)
    unknown = [name for name in names if name not in IMPLEMENTATIONS]
    if unknown:
        parser.error(f"not an implementation it takes: {', '.join(unknown)}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    taken = dict.fromkeys(names, 0)
    for name in names:
        for dtype in (torch.bfloat16, torch.float16):
            for dim in (64, 128):
                for causal in (False, True):
                    for lq, lk in LENGTHS:
                        q = torch.randn(sum(lq), 4, dim, device="cuda", dtype=dtype, generator=gen)
                        k, v = (torch.randn(sum(lk), 2, dim, device="cuda", dtype=dtype, generator=gen) for _ in "kv")
                        q, k, v = (t.requires_grad_() for t in (q, k, v))
                        args = (q, k, v, _cu(lq), _cu(lk), max(lq), max(lk))
                        impl = name.partition("+")[0]
                        with backends.prefer("attention", impl), _ws_setting(name):
                            why = ragged.explain("attention", *args, causal, 0.0, True)
                            out = ragged.varlen_attention(*args, causal=causal)
                            out.backward(torch.randn_like(out))
                        taken[name] += why.chosen == impl
    torch.cuda.synchronize()
    print("calls taken:", ", ".join(f"{name} {count}" for name, count in taken.items()), flush=True)


if __name__ == "__main__":
    main()
