"""A driver for Nsight Compute on one attention implementation: workload (c) (16 sequences of
256..4096 tokens, seed 0), bf16, warmed up (compiled) outside the profiled range, then one call
inside ``torch.cuda.profiler.start()`` / ``stop()``.

Run on a GPU, e.g. the warp-specialised forward beside the TMA one::

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        --section WarpStateStats --metrics sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active \\
        python -m bench.ncu_attention --impl triton_sm90_ws triton_sm90 [--dim 128] [--causal] [--backward]

Each implementation named runs once in the profiled range, in the order given (``ragged.backends.prefer``;
``name+setting``: under a setting of ``bench.attention_variants.WS_SETTINGS``, e.g.
``triton_sm90_ws+persistent``); one that the call would not take is refused with its reasons
before anything runs.
"""

from __future__ import annotations

import argparse

import torch

import ragged
from ragged import backends

from .attention_variants import _ws_setting


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ncu_attention", description=__doc__.splitlines()[0])
    p.add_argument("--impl", nargs="+", required=True, help="registered attention implementations, e.g. triton_sm90_ws")
    p.add_argument("--dim", type=int, default=128, choices=(64, 128))
    p.add_argument("--causal", action="store_true")
    p.add_argument("--backward", action="store_true", help="profile the backward too")
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(256, 4097, (16,), generator=gen).tolist()
    heads = 16 if args.dim == 128 else 32
    total, longest = sum(lengths), max(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (
        torch.randn(total, heads, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward)
        for _ in range(3)
    )
    do = torch.randn_like(q)

    def call():
        out = ragged.varlen_attention(q, k, v, cu, cu, longest, longest, causal=args.causal)
        if args.backward:
            torch.autograd.grad(out, (q, k, v), do)

    for name in args.impl:
        impl = name.partition("+")[0]
        with backends.prefer("attention", impl), _ws_setting(name):
            why = ragged.explain("attention", q, k, v, cu, cu, longest, longest, args.causal, 0.0, args.backward)
            if why.chosen != impl:
                raise SystemExit(f"bench.ncu_attention: {name} does not take this call: {why}")
            call()  # compiles, outside the profiled range
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name in args.impl:
        with backends.prefer("attention", name.partition("+")[0]), _ws_setting(name):
            call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled {', '.join(args.impl)}: D={args.dim} H={heads} causal={args.causal} backward={args.backward}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
