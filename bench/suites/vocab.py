"""vocab: logits over per-sequence candidate vocabularies (selected softmax).

Sequence ``i`` of a batch (``T_i`` tokens of hidden size ``d``, ``T = sum T_i``) has
its own sorted set of candidate token ids ``V_i`` out of a vocabulary of ``V`` (a
shortlist, as in Marian's output layer). Its logits are ``h_i @ W[V_i].T (+ b[V_i])``,
``[T_i, |V_i|]``; all sequences' blocks, flattened row-major one after the other, make
the flat ``[sum_i T_i*|V_i|]`` of :func:`ragged.vocab_projection`. Each workload runs
three groups:

* ``fwd``: the selected logits;
* ``fwd+bwd``: the selected logits, then ``torch.autograd.grad`` w.r.t. the hidden states
  and the weight with one fixed random gradient ``g`` of the selected logits;
* ``ce fwd+bwd``: the mean cross-entropy of the (global) targets over each sequence's
  candidates, then its gradients w.r.t. the hidden states and the weight.

Useful flops (what the TFLOP/s of every row divide by its time): forward
``2 * sum_i T_i*|V_i| * d``; forward+backward 3x that (the bias and the softmax are not
counted). Logits of non-candidates count for nothing.

Correctness gate: before timing, each checked row's outputs are compared with a float32
computation of the same candidates on the device (a loop over the sequences:
``index_select`` + matmul, and ``F.cross_entropy`` on the targets' positions within the
candidates); max abs error <= tol * max(1, max |reference|) for each output.

Memory: every measured row also reports its peak memory above what was allocated before
the call (:func:`bench.harness.peak_memory_bytes`; the returned outputs and gradients
count), in MB (10**6 bytes) and as % of the full logits ``[T, V]`` in the input dtype.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import ragged
from ragged.backends import triton_interpreted, triton_reason

from ..harness import (
    Case,
    Config,
    Impl,
    Row,
    Skip,
    Suite,
    Workload,
    _error_text,
    dtype_name,
    max_error_compare,
    peak_memory_bytes,
    register,
)
from .vocab_graphs import graph_impls
from .vocab_problem import (  # noqa: F401  (re-exported: the tests read them here)
    CE,
    CE_FULL,
    CE_GATHER,
    CE_LOOP,
    CPU_QUICK_SHAPES,
    CPU_SHAPES,
    EXTRA_PCT,
    FULL_GATHER,
    FULL_ONLY,
    FWD,
    FWD_BWD,
    GPU_SHAPES,
    GROUPS,
    LOOP,
    PEAK_MB,
    PEAK_PCT,
    RAGGED_BACKENDS,
    SEED,
    TOLERANCE,
    UNION,
    Problem,
    Shape,
    draw,
    full_logits_bytes,
    selected_logits,
    vocab_flops,
)


def loop_logits(p: Problem, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> list[torch.Tensor]:
    """Per sequence: ``F.linear(h_i, W[V_i], b[V_i])``, ``[T_i, |V_i|]``."""
    return [F.linear(h[s:e], w.index_select(0, c), None if b is None else b.index_select(0, c)) for s, e, c in p.spans]


def loop_cross_entropy(p: Problem, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Mean over the tokens of ``F.cross_entropy`` over each sequence's candidates."""
    blocks = loop_logits(p, h, w, b)
    losses = [F.cross_entropy(x, p.local_target[s:e], reduction="sum") for x, (s, e, _) in zip(blocks, p.spans)]
    return torch.stack(losses).sum() / p.total


def reference_outputs(p: Problem, group: str) -> tuple[torch.Tensor, ...]:
    """Float32 (float64 for float64 inputs) ``(logits,)``, ``(logits, dh, dW)`` or
    ``(loss, dh, dW)`` of the same candidates: the loop, in high precision."""
    dtype = torch.float64 if p.hidden.dtype == torch.float64 else torch.float32
    backward = group != FWD
    h = p.hidden.detach().to(dtype, copy=True).requires_grad_(backward)
    w = p.weight.detach().to(dtype, copy=True).requires_grad_(backward)
    b = None if p.bias is None else p.bias.to(dtype)
    with torch.set_grad_enabled(backward):
        if group == CE:
            out = loop_cross_entropy(p, h, w, b)
            grads = torch.autograd.grad(out, (h, w))
        else:
            out = torch.cat([x.reshape(-1) for x in loop_logits(p, h, w, b)])
            grads = torch.autograd.grad(out, (h, w), p.grad.to(dtype)) if backward else ()
    return (out.detach(), *grads)


class UnionLogits:
    """The ``[T, U]`` logits over the union of the candidates (output of the union rows);
    the gate picks each sequence's candidates out of them, outside the timed region."""

    __slots__ = ("logits",)

    def __init__(self, logits: torch.Tensor):
        self.logits = logits


def output_names(group: str) -> tuple[str, ...]:
    return {FWD: ("logits",), FWD_BWD: ("logits", "dh", "dW"), CE: ("loss", "dh", "dW")}[group]


def make_compare(p: Problem, group: str, tol: float) -> Callable[[Any, Any], str | None]:
    """Max abs error of each output against the reference, <= ``tol * max(1, max |ref|)``."""
    names = output_names(group)

    def flat(x: Any) -> torch.Tensor:
        if isinstance(x, UnionLogits):
            return x.logits.reshape(-1).index_select(0, p.union_index)
        if not isinstance(x, torch.Tensor) and isinstance(getattr(x, "values", None), torch.Tensor):
            return x.values  # RaggedLogits
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"expected a tensor, got {type(x).__name__}")
        return x

    return max_error_compare(names, flat, tol)


# --------------------------------------------------------------------------------------
# Implementations


def ragged_api() -> tuple[tuple[Callable, Callable] | None, str | None]:
    """``(vocab_projection, vocab_cross_entropy)``, or ``None`` and why they are not there."""
    try:
        module = importlib.import_module("ragged.ops.vocab")
    except Exception as exc:
        return None, f"ragged.ops.vocab cannot be imported ({_error_text(exc)})"
    fns = tuple(
        getattr(ragged, n, None) or getattr(module, n, None) for n in ("vocab_projection", "vocab_cross_entropy")
    )
    missing = [n for n, f in zip(("vocab_projection", "vocab_cross_entropy"), fns) if f is None]
    if missing:
        return None, f"ragged has no {' / '.join(missing)}"
    return fns, None


def _backend_skip(shape: Shape, group: str, backend: str, device: torch.device) -> str | None:
    if backend == "torch" and not shape.torch_backend:
        return "the torch reference (a host loop over the sequences): measured on the CPU cases only"
    if backend == "triton":
        why = triton_reason(device)
        if why:
            return why
        if device.type == "cpu" and triton_interpreted() and group not in shape.interpreted_triton:
            return (
                "too slow under the Triton interpreter (TRITON_INTERPRET=1); interpreted in the small fwd case "
                "of --quick only"
            )
    return None


def _forced(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)``; a backend that declines this input (the ValueError of
    ``ragged.backends.select`` for a forced backend) is a skip, not a failure."""
    try:
        return fn(*args, **kwargs)
    except ValueError as exc:
        text = str(exc)
        if "cannot take this input" in text or "has no implementation of this op" in text:
            raise Skip(text) from None
        raise


def _values(logits: Any) -> torch.Tensor:
    return logits if isinstance(logits, torch.Tensor) else logits.values


def ragged_impls(p: Problem, group: str, device: torch.device) -> list[Impl]:
    """``ragged <backend>``: :func:`ragged.vocab_projection` / :func:`ragged.vocab_cross_entropy`."""
    api, missing = ragged_api()
    projection, cross_entropy = api or (None, None)
    backward = group != FWD
    impls = []
    for backend in RAGGED_BACKENDS:
        name = f"ragged {backend}"
        why = missing or _backend_skip(p.shape, group, backend, device)
        if why:
            impls.append(Impl(name, "ragged", skip=why))
            continue
        h, w = p.leaves(backward)
        hidden = ragged.RaggedTensor.from_lengths(h, p.lengths)
        vocab = ragged.RaggedTensor.from_lengths(p.vocab_values, p.counts)

        def fwd(b=backend, hidden=hidden, w=w, vocab=vocab):
            return _values(_forced(projection, hidden, w, vocab, bias=p.bias, backend=b))

        def fwd_bwd(b=backend, hidden=hidden, h=h, w=w, vocab=vocab):
            out = _values(_forced(projection, hidden, w, vocab, bias=p.bias, backend=b))
            return (out, *torch.autograd.grad(out, (h, w), p.grad))

        def ce(b=backend, hidden=hidden, h=h, w=w, vocab=vocab):
            loss = _forced(cross_entropy, hidden, w, vocab, p.target, bias=p.bias, reduction="mean", backend=b)
            return (loss, *torch.autograd.grad(loss, (h, w)))

        impls.append(Impl(name, "ragged", {FWD: fwd, FWD_BWD: fwd_bwd, CE: ce}[group]))
        if group == CE:  # the default out_of_vocab="error" reads one flag from the device; "ignore" reads none

            def ce_ignore(b=backend, hidden=hidden, h=h, w=w, vocab=vocab):
                loss = _forced(
                    cross_entropy,
                    hidden,
                    w,
                    vocab,
                    p.target,
                    bias=p.bias,
                    reduction="mean",
                    backend=b,
                    out_of_vocab="ignore",
                )
                return (loss, *torch.autograd.grad(loss, (h, w)))

            impls.append(Impl(f"{name} (out_of_vocab=ignore)", "ragged", ce_ignore))
    return impls


def _timed(
    forward: Callable[[torch.Tensor, torch.Tensor], Any],
    p: Problem,
    backward: bool,
    grad_out: torch.Tensor | None = None,
) -> Callable[[], Any]:
    """``forward(h, W)``; with ``backward``, then ``autograd.grad`` w.r.t. ``(h, W)`` with
    ``grad_out`` (``None`` for a scalar loss), returning ``(out, dh, dW)``."""
    h, w = p.leaves(backward)
    if not backward:
        return lambda: forward(h, w)

    def run():
        out = forward(h, w)
        tensor = out.logits if isinstance(out, UnionLogits) else out
        return (out, *torch.autograd.grad(tensor, (h, w), grad_out))

    return run


def baseline_impls(p: Problem, group: str) -> list[Impl]:
    b = p.bias
    u = p.union

    def full(h, w):
        return F.linear(h, w, b)

    def full_gather(h, w):  # one flat gather of every sequence's candidates
        return full(h, w).reshape(-1).index_select(0, p.full_index)

    def union(h, w):
        return UnionLogits(F.linear(h, w.index_select(0, u), None if b is None else b.index_select(0, u)))

    def loop(h, w):
        return torch.cat([x.reshape(-1) for x in loop_logits(p, h, w, b)])

    if group == FWD:
        return [
            Impl(FULL_GATHER, "baseline", _timed(full_gather, p, False)),
            Impl(FULL_ONLY, "baseline", _timed(full, p, False), check=False),
            Impl(UNION, "baseline", _timed(union, p, False)),
            Impl(LOOP, "baseline", _timed(loop, p, False)),
        ]
    if group == FWD_BWD:
        return [
            Impl(FULL_GATHER, "baseline", _timed(full_gather, p, True, p.grad)),
            Impl(UNION, "baseline", _timed(union, p, True, p.union_grad())),
            Impl(LOOP, "baseline", _timed(loop, p, True, p.grad)),
        ]
    index, pad = p.padded_candidates()

    def ce_full(h, w):
        return F.cross_entropy(full(h, w), p.target)

    def ce_gather(h, w):
        logits = full(h, w).gather(1, index).masked_fill(pad, float("-inf"))
        return F.cross_entropy(logits, p.local_target)

    def ce_loop(h, w):
        return loop_cross_entropy(p, h, w, b)

    return [
        # Normalised over the whole vocabulary: another loss, so not checked.
        Impl(CE_FULL, "baseline", _timed(ce_full, p, True), check=False),
        Impl(CE_GATHER, "baseline", _timed(ce_gather, p, True)),
        Impl(CE_LOOP, "baseline", _timed(ce_loop, p, True)),
    ]


def memory_extra(device: torch.device, full_bytes: int, grad_bytes: int = 0) -> Callable[[Impl], dict[str, Any]]:
    """``Workload.extra``: peak memory of one call in MB and as % of the full logits; with
    ``grad_bytes`` (the gradients of hidden and weight, which every row of a backward group
    returns), also the peak less those, as % of the full logits."""

    def extra(impl: Impl) -> dict[str, Any]:
        peak = peak_memory_bytes(impl.fn, device)
        if peak is None:
            return {}
        out = {PEAK_MB: peak / 1e6, PEAK_PCT: 100.0 * peak / full_bytes}
        if grad_bytes:
            out[EXTRA_PCT] = 100.0 * max(0, peak - grad_bytes) / full_bytes
        return out

    return extra


def build_workload(shape: Shape, group: str, device: torch.device) -> Workload:
    p = Problem.make(shape, device)
    reference = reference_outputs(p, group)
    impls = ragged_impls(p, group, device) + baseline_impls(p, group)
    if group == CE:
        api, _ = ragged_api()
        impls += graph_impls(p, api[1] if api else None, "ragged triton (out_of_vocab=ignore)", CE_GATHER, device)
    flops = vocab_flops(p.lengths, p.counts, shape.dim, backward=group != FWD)
    return Workload(
        impls,
        reference=reference,
        flops=flops,
        compare=make_compare(p, group, TOLERANCE.get(shape.dtype, 2e-2)),
        extra=memory_extra(
            device,
            full_logits_bytes(p.total, shape.vocab, shape.dtype),
            0 if group == FWD else sum(t.numel() * t.element_size() for t in (p.hidden, p.weight)),
        ),
    )


# --------------------------------------------------------------------------------------
# The suite


def claim_key(claim: float) -> str:
    return f"claim: >= {claim:g}x vs {FULL_ONLY}"


@register
class VocabSuite(Suite):
    name = "vocab"
    description = "logits / cross-entropy over per-sequence candidate vocabularies vs full, union and loop baselines"
    memory_bound = False
    speedup_table = True
    notes = """\
Sequence `i` has `T_i` tokens (hidden `h_i`, `[T_i, d]`) and sorted unique candidate ids
`V_i` out of `V`; `W` is `[V, d]`, `b` `[V]` (only in `+bias` cases), `u` the sorted union
of the `V_i` (`U = |u|`). The selected logits are `h_i @ W[V_i].T + b[V_i]` for every `i`,
flat `[sum T_i*|V_i|]`. TFLOP/s count useful flops only: forward `2 * sum T_i*|V_i| * d`,
forward+backward 3x that. The `fwd+bwd` rows time one callable: the forward, then
`torch.autograd.grad(out, (h, W), g)` with one fixed random `g` of the selected logits;
`ce fwd+bwd`: the mean cross-entropy, then `torch.autograd.grad(loss, (h, W))`.
Index tensors (`t*V + id` of every selected logit, positions in `u`, padded candidate
rows) and `u` itself are built outside the timed region.

- `ragged <backend>`: `ragged.vocab_projection(hidden, W, vocab, bias=b, backend=...)`
  (`.values`), `hidden` and `vocab` RaggedTensors; `ce`:
  `ragged.vocab_cross_entropy(hidden, W, vocab, target, bias=b, reduction="mean", backend=...)`
  with global target ids (its default `out_of_vocab="error"` check reads one flag from
  the device per call). `torch` is the reference (measured on the CPU cases only): the
  logits, then a segmented log-softmax over them; the `triton` cross-entropy is fused (the
  logits are never stored; the backward recomputes them in chunks).
- `full h@W.T + gather`: `F.linear(h, W, b)` over the whole vocabulary `[T, V]`, then one
  flat `index_select` of every sequence's candidates (both timed). Backward: through the
  gather (a scatter into a dense `[T, V]` gradient) and the full GEMMs.
- `full h@W.T only`: the full GEMM alone, no gather: the cost of the full projection
  (output not comparable, so not checked). Forward only.
- `union h@W[u].T` (Marian style): `F.linear(h, W.index_select(0, u), b[u])`, one GEMM
  over the union `[T, U]`; each sequence's candidates are picked out for the check
  outside the timed region. Backward: `g` scattered into a dense `[T, U]` gradient
  (outside the timed region), through the GEMM and the `index_select` of `W`.
- `loop index_select + matmul`: per sequence `F.linear(h_i, W.index_select(0, V_i), b[V_i])`,
  flattened and concatenated.
- `full + CE over all V`: `F.cross_entropy(F.linear(h, W, b), target)`, the usual path:
  normalised over the whole vocabulary, a different loss, so not checked.
- `full + gather + CE`: the full logits, `gather(1, idx)` of each token's candidates
  padded to `max |V_i|` (`[T, max |V_i|]`), `-inf` at the padding, `F.cross_entropy` on
  the targets' positions among the candidates.
- `loop + CE`: per sequence the loop's logits and `F.cross_entropy(..., reduction="sum")`,
  summed and divided by `T`.
- `..., CUDA graph` (GPU): the ragged `out_of_vocab="ignore"` row and `full + gather + CE`
  captured once in a CUDA graph and replayed (one launch of host time per call), as a
  training step graphed whole runs them; `out_of_vocab="error"` reads a flag on the host
  every call and cannot be captured.

Correctness: every checked row's outputs (logits, or loss, and `dh`, `dW`) are compared
with a float32 loop over the sequences on the same inputs; max abs error
<= tol x max(1, max |ref|), tol = 2e-2 for bf16, 5e-3 for fp32.

`peak MB`: peak memory of one call above what was allocated before it (the returned
outputs and gradients count; `dW` is a dense `[V, d]`): on CUDA
`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats` minus
`memory_allocated` before the call; on CPU the running sum of the allocations
`torch.profiler` records. `% of full logits`: that over `T * V * element size`.

`claim` column (CPU cases): the selected projection should be at least 8x faster
than the full one; the cell gives `full h@W.T only` ms / this row's ms for
`ragged torch`, with whether that holds, and for the loop baseline (the ratio alone).
"""

    def shapes(self, config: Config) -> list[Shape]:
        """GPU: the target workload (also with --quick); --dtype swaps its dtype. CPU: the
        shortlist case (--quick: the small case and the claim case); with --dtype, the first
        of them in each requested floating dtype and the others in fp32 only."""
        floats = [d for d in (config.dtypes or ()) if d.is_floating_point]
        if config.on_gpu:
            if config.dtypes is None:
                return list(GPU_SHAPES)
            return [dataclasses.replace(s, dtype=d) for s in GPU_SHAPES for d in floats]
        cpu = CPU_QUICK_SHAPES if config.quick else CPU_SHAPES
        if config.dtypes is None:
            return list(cpu)
        first, *others = cpu
        # The claim is about fp32: another dtype's first case carries none.
        return [
            dataclasses.replace(first, dtype=d, claim=first.claim if d == torch.float32 else None) for d in floats
        ] + [s for s in others if config.wants(s.dtype)]

    def cases(self, config: Config) -> list[Case]:
        cases = []
        for group in GROUPS:
            for shape in self.shapes(config):
                if group not in shape.groups:
                    continue
                lengths, cands = draw(shape)
                counts = [int(c.numel()) for c in cands]
                total, selected = sum(lengths), selected_logits(lengths, counts)
                params = {
                    "workload": shape.label,
                    "pass": group,
                    "dtype": dtype_name(shape.dtype),
                    "B": shape.batch,
                    "T": total,
                    "min_len": shape.min_len,
                    "max_len": shape.max_len,
                    "d": shape.dim,
                    "V": shape.vocab,
                    "min_cands": shape.min_cands,
                    "max_cands": shape.max_cands,
                    "mean_cands": round(sum(counts) / len(counts), 1),
                    "union": int(torch.unique(torch.cat(cands)).numel()),
                    "selected_logits": selected,
                    "selected_fraction": round(selected / (total * shape.vocab), 5),
                    "full_logits_bytes": full_logits_bytes(total, shape.vocab, shape.dtype),
                    "bias": shape.bias,
                    "claim": shape.claim,
                    "note": shape.note,
                }
                cases.append(Case(f"{group} {shape.name()}", params, group=group, spec=(shape, group)))
        return cases

    def build(self, case: Case, config: Config) -> Workload:
        shape, group = case.spec
        return build_workload(shape, group, config.device)

    def console_notes(self, rows: list[Row]) -> list[str]:
        """The claim cells of the ragged rows, one line each."""
        return [
            f"{key}: {r.impl}, {r.case}: {r.extra[key]}"
            for r in rows
            if r.kind == "ragged"
            for key in r.extra
            if key.startswith("claim:")
        ]

    def annotate(self, case: Case, rows: list[Row]) -> None:
        """Claim cases: the full projection's time over that of the ragged torch row (with
        whether the claim holds) and of the loop baseline (the ratio alone: the claim is
        ragged's, a baseline's row carries no verdict)."""
        shape, _ = case.spec
        if shape.claim is None:
            return
        full = next((r for r in rows if r.impl == FULL_ONLY and r.status == "ok"), None)
        if full is None:
            return
        for r in rows:
            if r.impl in ("ragged torch", LOOP) and r.status == "ok":
                ratio = full.median_ms / r.median_ms
                verdict = f", {'holds' if ratio >= shape.claim else 'FAILS'}" if r.kind == "ragged" else ""
                r.extra[claim_key(shape.claim)] = f"{ratio:.1f}x{verdict}"
