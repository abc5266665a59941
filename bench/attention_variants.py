"""Every registered attention implementation of the Triton backend, timed on the same inputs, to
set their ranks from measurements (``ragged/kernels/triton/__init__.py``).

Run on a GPU: ``python -m bench.attention_variants [--case c] [--sweep] [--fused-shapes]
[--ws-pingpong] [--ws-stages] [--impl NAME ...] [--forward-only] [--out FILE]``.

* ``--case c``: workload (c) of ``bench.tune_attention`` (16 sequences of 256..4096 tokens,
  seed 0) at head dim 128 (16 heads) and 64 (32 heads), full and causal: each implementation's
  forward and forward+backward in TFLOP/s (useful FLOPs; forward+backward counts 3.5x the
  forward's), beside cuDNN's dense kernel on the padded batch without a mask (dense FLOPs: a
  kernel-rate ceiling) and ``auto``'s choice.
* ``--sweep``: the length rule. Batches of about 32k tokens whose lengths are uniform in
  [L/2, L] for L from 128 to 4096, both head dims, full and causal: each implementation's
  forward and forward+backward, and which is fastest.
* ``--fused-shapes``: the fused backward at each candidate block shape, beside the split one.
* ``--ws-pingpong`` / ``--ws-stages``: also the warp-specialised implementations with their
  consumers in ping-pong / with two K/V stages at head dim 128 instead of three (rows
  ``name+pingpong`` / ``name+stages2``); ``--impl``: only the implementations named;
  ``--forward-only``: the sweep without its fwd+bwd columns; ``--ws SETTING ...``: rows under any
  of :data:`WS_SETTINGS` (``wg3``: three consumer warpgroups at head dim 64; ``persistent``: a
  program per multiprocessor looping over the tiles).

Every timing is the median of ``triton.testing.do_bench`` over a CUDA-graph replay of the call
(the kernels' time: at the short lengths the host's per-call work would hide them). The table
names the GPU and the host CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys

import torch
from triton.testing import do_bench

import ragged
from ragged import backends
from ragged.kernels.triton import attention as ka

from .env import cpu_name
from .measure import graphed_replay

FORWARDS = ("triton", "triton_sm90", "triton_sm90_ws")
TRAINING = (
    "triton",
    "triton_sm90",
    "triton_sm90_full",
    "triton_fused_bwd",
    "triton_sm90_fused_bwd",
    "triton_sm90_ws",
    "triton_sm90_ws_fused_bwd",
)
# the fused backward with dQ by TMA bulk reduce-adds: timed where registered and this GPU takes it
TMA_DQ = ("triton_fused_bwd_tma", "triton_sm90_fused_bwd_tma")


def training() -> tuple[str, ...]:
    """:data:`TRAINING`, and those of :data:`TMA_DQ` that are registered and take a bf16 call
    at head dim 128 on this GPU (an sm_90 one); none elsewhere, so no row fails."""
    q = torch.zeros(8, 2, 128, device="cuda", dtype=torch.bfloat16)
    cu = _cu([8])
    why = ragged.explain("attention", q, q, q, cu, cu, 8, 8, False, 0.0, True)
    return TRAINING + tuple(name for name in TMA_DQ if name in why and not why[name])


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _time(fn) -> float:
    try:
        return do_bench(graphed_replay(fn), warmup=10, rep=60, return_mode="median")
    except Exception as exc:  # a kernel that does not compile or launch: a row that says so
        print(f"    failed: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr, flush=True)
        return float("nan")


# Settings of the warp-specialised forward timed as rows of their own: ``name+setting`` runs the
# implementation ``name`` with ``attention_ws`` set so (``--ws-pingpong``, ``--ws-stages``).
WS_SETTINGS = {
    "pingpong": {"PINGPONG": True},
    "stages2": {"STAGES_D128": 2},
    "wg3": {"CONSUMERS_D64": 3},
    "persistent": {"PERSISTENT": True},
    "persistent-wg3": {"PERSISTENT": True, "CONSUMERS_D64": 3},
}


@contextlib.contextmanager
def _ws_setting(name: str):
    """``attention_ws``'s module settings for the row ``name`` (none without a ``+``)."""
    setting = name.partition("+")[2]
    if not setting:
        yield
        return
    from ragged.kernels.triton import attention_ws

    saved = {key: getattr(attention_ws, key) for key in WS_SETTINGS[setting]}
    for key, value in WS_SETTINGS[setting].items():
        setattr(attention_ws, key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(attention_ws, key, value)


def measure(lengths, heads, dim, causal, names, backward, dense=False):
    """{name: ms} for each implementation (``prefer``-ed, ``"auto"`` as itself; ``name+setting``:
    the implementation under one of :data:`WS_SETTINGS`) and, with ``dense``, cuDNN on the
    padded batch."""
    total, max_len = sum(lengths), max(lengths)
    cu = _cu(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(backward)
        for _ in range(3)
    )
    do = torch.randn_like(q)

    def call():
        out = ragged.varlen_attention(q, k, v, cu, cu, max_len, max_len, causal=causal)
        return torch.autograd.grad(out, (q, k, v), do) if backward else out

    times = {}
    for name in (*names, "auto"):
        impl = name.partition("+")[0]
        with backends.prefer("attention", None if name == "auto" else impl), _ws_setting(name):
            why = ragged.explain("attention", q, k, v, cu, cu, max_len, max_len, causal, 0.0, backward)
            if name != "auto" and why.chosen != impl:
                times[name] = float("nan")  # refused here (e.g. not an sm_90 GPU): no row
                continue
            with torch.set_grad_enabled(backward):
                times[name] = _time(call)
            if name == "auto":
                times["auto"] = (times["auto"], why.chosen)
    if dense:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        batch = len(lengths)
        qd, kd, vd = (
            torch.randn(batch, heads, max_len, dim, device="cuda", dtype=torch.bfloat16).requires_grad_(backward)
            for _ in range(3)
        )
        dod = torch.randn_like(qd)

        def dense_call():
            out = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=causal)
            return torch.autograd.grad(out, (qd, kd, vd), dod) if backward else out

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.set_grad_enabled(backward):
            times["cuDNN dense"] = _time(dense_call)
    return times


def _tf(flops, ms):
    return flops / ms / 1e9 if ms == ms else float("nan")


def _names(settings=(), only=None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(forwards, training)``: the rows timed, every implementation (``only``: those named) and
    the warp-specialised ones again under each of ``settings`` (keys of :data:`WS_SETTINGS`)."""
    names = tuple(n for n in training() if not only or n in only)
    extra = tuple(f"{n}+{s}" for s in settings for n in names if n.startswith("triton_sm90_ws"))
    rows = names + extra
    return tuple(n for n in rows if n.partition("+")[0] in FORWARDS), rows


def case_c(out, settings=(), only=None):
    """Case (c): the rows of :func:`_names`."""
    forwards, training = _names(settings, only)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(256, 4097, (16,), generator=gen).tolist()
    out(f"\n## case (c): 16 sequences of 256..4096 (seed 0), total {sum(lengths)}, max {max(lengths)}\n")
    out("TF/s (useful FLOPs; cuDNN dense: dense FLOPs on the padded batch, no mask)\n")
    for dim, heads in ((128, 16), (64, 32)):
        for causal in (False, True):
            fl = ka.flops(lengths, lengths, heads, dim, causal)
            dense_fl = ka.flops([max(lengths)] * 16, [max(lengths)] * 16, heads, dim, causal)
            fwd = measure(lengths, heads, dim, causal, forwards, False, dense=True)
            both = measure(lengths, heads, dim, causal, training, True, dense=True)
            out(f"\n### D={dim} H={heads} {'causal' if causal else 'full'}\n")
            out("| implementation | forward TF/s | fwd+bwd TF/s |")
            out("|---|---:|---:|")
            for name in training:
                f = f"{_tf(fl, fwd[name]):.0f}" if name in fwd else ""
                out(f"| {name} | {f} | {_tf(3.5 * fl, both[name]):.0f} |")
            (fa, fchoice), (ba, bchoice) = fwd["auto"], both["auto"]
            out(f"| auto ({fchoice} / {bchoice}) | {_tf(fl, fa):.0f} | {_tf(3.5 * fl, ba):.0f} |")
            out(
                f"| cuDNN dense | {_tf(dense_fl, fwd['cuDNN dense']):.0f} | "
                f"{_tf(3.5 * dense_fl, both['cuDNN dense']):.0f} |"
            )


def sweep(out, tokens=32768, settings=(), only=None, forward_only=False):
    """The length rule over the rows of :func:`_names` (``forward_only``: no fwd+bwd columns)."""
    forwards, training = _names(settings, only)
    if forward_only:
        training = ()
    out(f"\n## length rule: about {tokens} tokens in sequences of uniform lengths in [L/2, L]\n")
    out("Forward and fwd+bwd TF/s of each implementation; the fastest in bold.\n")
    gen = torch.Generator().manual_seed(1)
    header = "| L | D | mask | " + " | ".join(f"fwd {n}" for n in forwards) + " | "
    header += " | ".join(f"f+b {n}" for n in training) + (" |" if training else "")
    out(header)
    out("|" + "---|" * (3 + len(forwards) + len(training)))
    for longest in (128, 256, 512, 1024, 2048, 4096):
        lengths = []
        while sum(lengths) < tokens:
            lengths.append(int(torch.randint(longest // 2, longest + 1, (1,), generator=gen)))
        for dim, heads in ((128, 16), (64, 32)):
            for causal in (False, True):
                fl = ka.flops(lengths, lengths, heads, dim, causal)
                fwd = measure(lengths, heads, dim, causal, forwards, False)
                both = measure(lengths, heads, dim, causal, training, True) if training else {}
                f = [_tf(fl, fwd[n]) for n in forwards]
                b = [_tf(3.5 * fl, both[n]) for n in training]

                def cells(values):
                    best = max((x for x in values if x == x), default=None)
                    return [f"**{x:.0f}**" if x == best else f"{x:.0f}" for x in values]

                row = [str(longest), str(dim), "causal" if causal else "full", *cells(f)]
                row += cells(b) if b else []
                out("| " + " | ".join(row) + " |")


FUSED_SHAPES = ((64, 64, 8, 2), (32, 128, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2))


def fused_shapes(out):
    """The fused backward's key-block kernel at each candidate shape (``attention._FUSED_BWD_SHAPE``:
    BLOCK_M, BLOCK_N, warps, stages) on case (c): forward+backward TF/s, beside the split backward.
    128-key blocks halve the dQ reductions per FLOP."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(256, 4097, (16,), generator=gen).tolist()
    out("\n## the fused backward's shapes, case (c), forward+backward TF/s\n")
    out("| D | mask | split (`triton`) | " + " | ".join(f"fused {shape}" for shape in FUSED_SHAPES) + " |")
    out("|" + "---|" * (3 + len(FUSED_SHAPES)))
    chosen = ka._FUSED_BWD_SHAPE
    try:
        for dim, heads in ((128, 16), (64, 32)):
            for causal in (False, True):
                fl = 3.5 * ka.flops(lengths, lengths, heads, dim, causal)
                cells = [_tf(fl, measure(lengths, heads, dim, causal, ("triton",), True)["triton"])]
                for shape in FUSED_SHAPES:
                    ka._FUSED_BWD_SHAPE = shape
                    ms = measure(lengths, heads, dim, causal, ("triton_fused_bwd",), True)["triton_fused_bwd"]
                    cells.append(_tf(fl, ms))
                out(f"| {dim} | {'causal' if causal else 'full'} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    finally:
        ka._FUSED_BWD_SHAPE = chosen


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["c"], default=None)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--fused-shapes", action="store_true", help="the fused backward at each candidate shape")
    parser.add_argument(
        "--ws-pingpong", action="store_true", help="case (c): the warp-specialised forward's consumers in ping-pong"
    )
    parser.add_argument(
        "--ws-stages", action="store_true", help="also the warp-specialised forward with 2 K/V stages at D=128"
    )
    parser.add_argument(
        "--ws", nargs="+", default=[], choices=sorted(WS_SETTINGS), help="also the warp-specialised rows so set"
    )
    parser.add_argument("--impl", nargs="+", default=None, help="only these implementations")
    parser.add_argument("--forward-only", action="store_true", help="--sweep: the forwards only")
    parser.add_argument("--out", default=None, help="also write the tables to this file (rewritten at each line)")
    args = parser.parse_args(argv)
    lines: list[str] = []

    def out(line):
        print(line, flush=True)
        lines.append(line)
        if args.out:  # rewritten at each line: a run stopped at a time limit keeps what it measured
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")

    out(
        f"# attention implementations on {torch.cuda.get_device_name()}, host CPU {cpu_name()}, "
        f"torch {torch.__version__}, python {platform.python_version()}, bf16"
    )
    settings = [s for s, on in (("pingpong", args.ws_pingpong), ("stages2", args.ws_stages)) if on]
    settings += [s for s in args.ws if s not in settings]
    if args.case == "c" or not (args.sweep or args.fused_shapes):
        case_c(out, settings, args.impl)
    if args.sweep:
        sweep(out, settings=settings, only=args.impl, forward_only=args.forward_only)
    if args.fused_shapes:
        fused_shapes(out)


if __name__ == "__main__":
    main()
