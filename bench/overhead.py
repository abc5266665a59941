"""Host cost of one eager call of the pack/unpack path, layer by layer (tiny inputs).

Development tool, run on a GPU: ``python -m bench.overhead``. Small problems in eager
mode are bound by this cost, not by the kernels: it is what separates a 20 us kernel
from a 35 us call.
"""

import time

import torch

import ragged
from ragged.kernels.cuda import pack as kp
from ragged.kernels.triton import pack as kt
from ragged.ops import pack as ops


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def main():
    x = torch.randn(4, 8, 16, device="cuda")
    lengths = [3, 8, 0, 5]
    rt = ragged.pack(x, lengths=lengths)
    off, total, vals = rt.offsets, rt.num_tokens, rt.values
    idx = torch.arange(total, device="cuda")
    flat = x.view(-1, 16)
    rows = [
        ("index_select (torch op)", lambda: flat.index_select(0, idx)),
        ("torch.empty", lambda: torch.empty(total, 16, device="cuda")),
    ]
    for be in ("cuda", "triton", "torch"):
        rows += [
            (f"{be}: ragged.pack(x, lengths=...)", lambda be=be: ragged.pack(x, lengths=lengths, backend=be)),
            (f"{be}: pack_values", lambda be=be: ragged.pack_values(x, off, total, backend=be)),
            (f"{be}: torch.ops.ragged.pack", lambda be=be: ops.PACK.forward_op(x, off, total, False, be)),
            (f"{be}: unpack_values", lambda be=be: ragged.unpack_values(vals, off, 8, backend=be)),
        ]
    rows += [
        ("cuda launcher only", lambda: kp.pack(x, off, total, False)),
        ("triton launcher only", lambda: kt.pack(x, off, total, False)),
        ("backends.select", lambda: ragged.backends.select("pack", "cuda", x.device, x, off)),
    ]
    heads, dim = 12, 64
    qa = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    from ragged.kernels.triton import attention as ka
    rows += [
        ("attention triton: varlen_attention", lambda: ragged.varlen_attention(qa, qa, qa, off, off, 8, 8,
                                                                             backend="triton")),
        ("attention triton: kernel launcher", lambda: ka.forward(qa, qa, qa, off, off, 8, 8, False, 0.125, 0.0, 0)),
        ("attention: block_cum", lambda: ka._block_cum(off, 16)),
    ]
    for name, fn in rows:
        print(f"{name:42s} {per_call_us(fn):7.1f} us/call", flush=True)


if __name__ == "__main__":
    main()
