"""Sweep of Triton attention block shapes on the target workloads, beside torch's varlen_attn.

Development tool, run on a GPU: ``python -m bench.tune_attention [--bwd]``. Prints TFLOP/s
(useful FLOPs: 4 * sum(L^2) * D * H forward, halved for causal; backward 2.5x that) for
each (BLOCK_M, BLOCK_N, num_warps, num_stages); the chosen shapes live in
``ragged/kernels/triton/attention.py``. ``--bias``: MPNet's shapes (256 sentences of 8..128
tokens, 12 heads of 64) with its relative-position bias, forward and backward, each beside the
same call without the bias, each captured in a CUDA graph and replayed (the kernels' time).
``--hopper`` (sm_90): the shapes of the TMA forward (``attention_hopper.CONFIGS``, one program
per block and persistent) on workload c at head dims 128 and 64, beside the portable kernel
and cuDNN's dense kernel, then the backward's (``attention_hopper_bwd.CONFIGS``) after the best
forward; the chosen shapes live in the two modules' ``config``. ``--hopper-backward``: only the
backward's, after the chosen forward.
"""

import argparse
import inspect

import torch
from triton.testing import do_bench

import ragged
from ragged.kernels.triton import attention as ka

from .measure import graphed_replay


def workloads():
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(8, 33, (256,), generator=gen).tolist()
    b = torch.distributions.LogNormal(4.5, 0.8).sample((64,)).clamp(8, 512).round().int().tolist()
    c = torch.randint(256, 4097, (16,), generator=gen).tolist()
    return {"a": (a, 12, 64), "b": (b, 12, 64), "c": (c, 16, 128)}


def varlen_attn_fn(q, k, v, cu, max_len, causal):
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kw = {"is_causal": causal} if "is_causal" in params else ({"window_size": (-1, 0)} if causal else {})
    return lambda: varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)


def tune_bias():
    """Forward and backward block shapes with MPNet's position bias, against no bias."""
    from ragged.nn.hf.mpnet import relative_buckets

    gen = torch.Generator().manual_seed(0)
    lengths, heads, dim = torch.randint(8, 129, (256,), generator=gen).tolist(), 12, 64
    total, max_len = sum(lengths), max(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (
        torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    do = torch.randn_like(q)
    table = torch.randn(32, heads, device="cuda", requires_grad=True)
    buckets = relative_buckets(torch.arange(-(max_len - 1), max_len, device="cuda")).to(torch.int32)
    fl = ka.flops(lengths, lengths, heads, dim, False)
    print(f"(mpnet) B=256 mean={total / 256:.0f} max={max_len} H={heads} D={dim} bias table [32, {heads}]", flush=True)

    def eager(bias, grad):
        out = ragged.varlen_attention(
            q, k, v, cu, cu, max_len, max_len, backend="triton", position_bias=(table, buckets) if bias else None
        )
        return torch.autograd.grad(out, (q, k, v, table) if bias else (q, k, v), do) if grad else out

    def timed(bias, grad):
        """Median ms of one call captured in a CUDA graph and replayed: the kernels' time (at
        these sizes the host's per-call work is as long as the kernels' and would hide the
        shapes' differences)."""
        with torch.set_grad_enabled(grad):
            replay = graphed_replay(lambda: eager(bias, grad))
        return do_bench(replay, return_mode="median")

    default_f, default_b = ka._fwd_config, ka._bwd_config
    for bias in (False, True):
        ms = timed(bias, False)
        ms2 = timed(bias, True)
        print(
            f"  default, bias={bias}: fwd {ms:.4f} ms {fl / ms / 1e9:6.1f} TF/s | fwd+bwd {ms2:.4f} ms "
            f"{3.5 * fl / ms2 / 1e9:6.1f} TF/s",
            flush=True,
        )
    fwd = []
    for cfg in [(bm, bn, w, st) for bm in (32, 64, 128) for bn in (32, 64, 128) for w in (4, 8) for st in (1, 2, 3)]:
        ka._fwd_config = lambda *a_, cfg=cfg: cfg
        try:
            fwd.append((timed(True, False), cfg))
        except Exception as exc:  # out of resources etc.
            print(f"  fwd {cfg} failed: {type(exc).__name__}", flush=True)
    ka._fwd_config = default_f
    for ms, cfg in sorted(fwd)[:5]:
        print(f"  fwd bias {cfg}: {ms:.4f} ms {fl / ms / 1e9:6.1f} TF/s", flush=True)
    kv_shapes = [(32, 64, 4, 2), (64, 64, 4, 2), (64, 128, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (32, 128, 4, 2)]
    # the dQ kernel's rotation of dS needs BLOCK_M <= BLOCK_N
    dq_shapes = [
        (16, 64, 4, 2),
        (32, 32, 4, 2),
        (32, 64, 4, 2),
        (32, 64, 8, 2),
        (32, 128, 8, 2),
        (64, 64, 4, 2),
        (64, 64, 8, 2),
        (16, 128, 4, 2),
        (64, 128, 8, 2),
    ]
    bwd = []
    for kv in kv_shapes:
        for dq in dq_shapes:
            ka._bwd_config = lambda *a_, pair=(kv, dq): pair
            try:
                bwd.append((timed(True, True), kv, dq))
            except Exception as exc:
                print(f"  bwd {kv} {dq} failed: {type(exc).__name__}", flush=True)
    ka._bwd_config = default_b
    for ms, kv, dq in sorted(bwd)[:6]:
        print(f"  fwd+bwd bias, dk/dv {kv} dq {dq}: {ms:.4f} ms {3.5 * fl / ms / 1e9:6.1f} TF/s", flush=True)


def _tune_hopper_backward(q, k, v, cu, max_len, causal, fl, forward_shape):
    """The backward shapes (``attention_hopper_bwd.CONFIGS``) after the best forward shape,
    beside the portable backward: fwd+bwd TF/s (3.5x the forward's flops)."""
    from ragged.kernels.triton import attention_hopper as hopper
    from ragged.kernels.triton import attention_hopper_bwd as hopper_bwd

    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    do = torch.randn_like(q)

    def step():
        out = ragged.varlen_attention(q, k, v, cu, cu, max_len, max_len, causal=causal, backend="triton")
        return torch.autograd.grad(out, (q, k, v), do)

    with ragged.backends.prefer("attention", "triton"):
        ms = do_bench(step, return_mode="median")
    print(f"  portable fwd+bwd: {ms:.4f} ms {3.5 * fl / ms / 1e9:6.1f} TF/s", flush=True)
    if forward_shape is None:
        return
    default_f, default_b, run = hopper.config, hopper_bwd.config, hopper_bwd.backward
    hopper.config = lambda *a_: forward_shape
    calls = []
    hopper_bwd.backward = lambda *a_, **k_: (calls.append(1), run(*a_, **k_))[1]
    results = []
    try:
        for pair in hopper_bwd.CONFIGS[q.shape[-1]]:
            hopper_bwd.config = lambda *a_, pair=pair: pair
            try:
                with ragged.backends.prefer("attention", "triton_sm90_full"):
                    results.append((do_bench(step, return_mode="median"), pair))
            except Exception as exc:  # out of resources etc.
                print(f"  hopper bwd {pair} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    finally:
        hopper.config, hopper_bwd.config, hopper_bwd.backward = default_f, default_b, run
    if results and not calls:
        raise RuntimeError("the sm_90 backward never ran: the timings above are of the portable one")
    for ms, pair in sorted(results):
        print(
            f"  hopper fwd {forward_shape} + bwd dk/dv {pair[0]} dq {pair[1]}: {ms:.4f} ms "
            f"{3.5 * fl / ms / 1e9:6.1f} TF/s",
            flush=True,
        )


def tune_hopper(only=None, backward_only=False):
    """Every shape of the sm_90 forward (``attention_hopper.CONFIGS``) on workload c at head dims
    128 and 64, full and causal, beside the portable kernel's chosen shape and cuDNN's dense
    kernel on the padded batch (no mask: the ceiling). ``backward_only``: only the backward's
    shapes, after the forward's chosen one (``attention_hopper.config``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ragged.kernels.triton import attention_hopper as hopper

    lengths = workloads()["c"][0]
    total, max_len, batch = sum(lengths), max(lengths), len(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    default = hopper.config
    for dim in (128, 64):
        if only and f"c{dim}" not in only:
            continue
        heads = 16
        q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        padded = torch.randn(batch, heads, max_len, dim, device="cuda", dtype=torch.bfloat16)
        for causal in (False, True):
            fl = ka.flops(lengths, lengths, heads, dim, causal)
            dense = ka.flops([max_len] * batch, [max_len] * batch, heads, dim, causal)
            print(
                f"(c{dim}) B={batch} mean={total / batch:.0f} max={max_len} H={heads} D={dim} causal={causal}",
                flush=True,
            )
            if backward_only:
                _tune_hopper_backward(q, k, v, cu, max_len, causal, fl, default(dim, max_len, causal, False))
                continue

            def call():
                return ragged.varlen_attention(q, k, v, cu, cu, max_len, max_len, causal=causal, backend="triton")

            with ragged.backends.prefer("attention", "triton"):
                ms = do_bench(call, return_mode="median")
            print(
                f"  portable {ka._fwd_config(dim, max_len, max_len, causal, torch.bfloat16, False)}: {ms:.4f} ms "
                f"{fl / ms / 1e9:6.1f} TF/s",
                flush=True,
            )
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ms = do_bench(
                    lambda: torch.nn.functional.scaled_dot_product_attention(padded, padded, padded, is_causal=causal),
                    return_mode="median",
                )
            print(
                f"  cuDNN dense padded [{batch}, {heads}, {max_len}, {dim}]: {ms:.4f} ms "
                f"{dense / ms / 1e9:6.1f} TF/s (dense flops)",
                flush=True,
            )
            results = []
            for cfg in hopper.CONFIGS[dim]:
                hopper.config = lambda *a_, cfg=cfg: cfg
                try:
                    with ragged.backends.prefer("attention", "triton_sm90_full"):
                        results.append((do_bench(call, return_mode="median"), cfg))
                except Exception as exc:  # out of resources (shared memory) etc.
                    print(f"  hopper {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            hopper.config = default
            for ms, cfg in sorted(results):
                print(f"  hopper {cfg}: {ms:.4f} ms {fl / ms / 1e9:6.1f} TF/s", flush=True)
            best = min(results)[1] if results else None
            _tune_hopper_backward(q, k, v, cu, max_len, causal, fl, best)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bwd", action="store_true")
    parser.add_argument("--bias", action="store_true")
    parser.add_argument("--hopper", action="store_true")
    parser.add_argument("--hopper-backward", action="store_true")
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    if args.bias:
        tune_bias()
        return
    if args.hopper or args.hopper_backward:
        tune_hopper(args.only, backward_only=args.hopper_backward)
        return
    for name, (lengths, heads, dim) in workloads().items():
        if args.only and name not in args.only:
            continue
        total = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q, k, v = (
            torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        )
        do = torch.randn_like(q)
        max_len = max(lengths)
        for causal in (False, True):
            fl = ka.flops(lengths, lengths, heads, dim, causal)
            tag = (
                f"({name}) B={len(lengths)} mean={total / len(lengths):.0f} max={max_len} H={heads} D={dim} "
                f"causal={causal}"
            )
            base = varlen_attn_fn(q, k, v, cu, max_len, causal)
            if base is not None:
                ms = do_bench(base, return_mode="median")
                line = f"{tag}  varlen_attn fwd {ms:.4f} ms {fl / ms / 1e9:6.1f} TF/s"
                if args.bwd:
                    out = base()
                    ms2 = do_bench(lambda: torch.autograd.grad(base(), (q, k, v), do), return_mode="median")
                    line += f" | fwd+bwd {ms2:.4f} ms {3.5 * fl / ms2 / 1e9:6.1f} TF/s"
                    del out
                print(line, flush=True)
            default = ka._fwd_config
            configs = [(bm, bn, w, s) for bm in (64, 128) for bn in (64, 128) for w in (4, 8) for s in (2, 3)]
            if name == "a":
                configs = [(bm, bn, 4, s) for bm in (16, 32) for bn in (16, 32) for s in (1, 2)]
            results = []
            if args.bwd:
                configs = [ka._fwd_config(dim, max_len, max_len, causal, torch.bfloat16, False)]
            for cfg in configs:
                ka._fwd_config = lambda *a_, cfg=cfg: cfg
                fn = lambda: ragged.varlen_attention(
                    q.detach(), k.detach(), v.detach(), cu, cu, max_len, max_len, causal=causal, backend="triton"
                )
                try:
                    ms = do_bench(fn, return_mode="median")
                except Exception as exc:  # out of resources etc.
                    print(f"  {cfg} failed: {type(exc).__name__}", flush=True)
                    continue
                results.append((ms, cfg))
            ka._fwd_config = default
            results.sort()
            for ms, cfg in results[:4]:
                print(f"  fwd {cfg}: {ms:.4f} ms {fl / ms / 1e9:6.1f} TF/s", flush=True)
            if args.bwd:
                out = ragged.varlen_attention(q, k, v, cu, cu, max_len, max_len, causal=causal, backend="triton")
                default_b = ka._bwd_config
                fwd_ms = results[0][0]

                def time_bwd(pair):
                    ka._bwd_config = lambda *a_, pair=pair: pair
                    try:
                        return do_bench(
                            lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), return_mode="median"
                        )
                    except Exception as exc:
                        print(f"  bwd {pair} failed: {type(exc).__name__}", flush=True)
                        return float("inf")

                shapes = [
                    (32, 128, 4, 2),
                    (32, 128, 8, 2),
                    (64, 64, 4, 2),
                    (64, 64, 4, 3),
                    (64, 128, 4, 2),
                    (64, 128, 8, 2),
                    (64, 128, 8, 3),
                    (128, 64, 8, 2),
                    (128, 64, 8, 3),
                    (32, 64, 4, 2),
                    (128, 32, 4, 2),
                    (128, 32, 8, 2),
                ]
                if name == "a":
                    shapes = [
                        (16, 16, 4, 2),
                        (16, 32, 4, 2),
                        (32, 16, 4, 2),
                        (32, 32, 4, 2),
                        (32, 64, 4, 2),
                        (64, 32, 4, 2),
                    ]
                base_dq = (64, 64, 4, 2)
                kv = sorted((time_bwd((cfg, base_dq)), cfg) for cfg in shapes)
                best_kv = kv[0][1]
                qq = sorted((time_bwd((best_kv, cfg)), cfg) for cfg in shapes)
                ka._bwd_config = default_b
                for ms, cfg in kv[:3]:
                    print(f"  bwd dk/dv {cfg} (dq {base_dq}): {ms:.4f} ms", flush=True)
                for ms, cfg in qq[:3]:
                    print(
                        f"  bwd dq {cfg} (dk/dv {best_kv}): {ms:.4f} ms; fwd+bwd "
                        f"{3.5 * fl / (ms + fwd_ms) / 1e9:6.1f} TF/s",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
