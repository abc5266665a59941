"""``python -m bench.ws_persistent_ab``: the warp-specialised forward with a program per tile
against the persistent grid, rounds interleaved, on one GPU.

Both settings of ``attention_ws.forward(persistent=...)`` on case (c) of the attention suite (16
sequences of 256..4096, seed 0) and on batches of about 32k tokens with lengths uniform in
[L/2, L] for L = 512 to 4096; head dims 128 (16 heads) and 64 (32 heads), full and causal, bf16.
Each row is five rounds alternating plain, persistent, plain, ... of ``triton.testing.do_bench``
(its L2 flush between calls; the persistent launch includes its work-list sort), the median of
each. Rows of one kernel in separate runs moved by up to 13% on an H200; the interleaving is what
makes the ratio comparable. Prints a Markdown table naming the GPU and the host CPU.
"""

from __future__ import annotations

import statistics

import torch
import triton

from ragged.kernels.triton import attention, attention_ws

from .env import cpu_name


def cases() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(0)
    out = {"c": torch.randint(256, 4097, (16,), generator=gen).tolist()}
    for longest in (512, 1024, 2048, 4096):
        g = torch.Generator().manual_seed(longest)
        lengths: list[int] = []
        while sum(lengths) < 32768:
            lengths.append(int(torch.randint(longest // 2, longest + 1, (1,), generator=g)))
        out[f"[{longest // 2},{longest}]"] = lengths
    return out


def main(rounds: int = 5) -> None:
    print(
        f"# ws forward, plain grid vs persistent, {torch.cuda.get_device_name()}, host {cpu_name()}, "
        f"medians of {rounds} interleaved rounds of do_bench"
    )
    print("| case | D | mask | plain ms | persistent ms | persistent / plain | plain rounds | persistent rounds |")
    print("|---|---|---|---:|---:|---:|---|---|")
    for name, lengths in cases().items():
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        total = sum(lengths)
        steps = max(len(lengths) - 1, 0).bit_length()
        for dim, heads in ((128, 16), (64, 32)):
            q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            out, lse = torch.empty_like(q), torch.empty(total, heads, device="cuda")
            cum = attention._block_cum(cu, attention_ws.block_m(dim))
            for causal in (False, True):
                times: dict[bool, list[float]] = {False: [], True: []}
                for _ in range(rounds):
                    for persistent in (False, True):

                        def call(persistent=persistent):
                            attention_ws.forward(
                                q, k, v, out, lse, cu, cu, cum, steps, causal, dim**-0.5, persistent=persistent
                            )

                        times[persistent].append(triton.testing.do_bench(call, warmup=25, rep=100))
                a, b = statistics.median(times[False]), statistics.median(times[True])
                plain, pers = (", ".join(f"{x:.3f}" for x in times[p]) for p in (False, True))
                mask = "causal" if causal else "full"
                print(f"| {name} | {dim} | {mask} | {a:.3f} | {b:.3f} | {b / a:.3f} | {plain} | {pers} |", flush=True)


if __name__ == "__main__":
    main()
