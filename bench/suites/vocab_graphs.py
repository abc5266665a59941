"""CUDA-graph rows of the vocab suite's cross-entropy case: one forward + backward captured
once and replayed, for ragged (``out_of_vocab="ignore"``: nothing read on the host, so it can
be captured) and for the padded baseline, the way a training step graphed whole runs them
(``ragged.nn.graphed``, ``torch.compile(mode="reduce-overhead")``). A replay costs one launch
of host time: these rows measure the kernels without the per-op host cost of the eager rows.
``out_of_vocab="error"`` reads a flag on the host after every call and cannot be captured."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..harness import Impl
from ..measure import cuda_graph

GRAPH = ", CUDA graph"


def _graphed(run: Callable[[], tuple[torch.Tensor, ...]]) -> Callable[[], tuple[torch.Tensor, ...]]:
    """``run`` captured in a CUDA graph after warm-up calls on a side stream; the returned
    function replays it and returns the graph's own outputs (overwritten by the next replay)."""
    graph, out = cuda_graph(run)

    def replay():
        graph.replay()
        return out

    # the graph reads memory it did not allocate (the inputs, their offsets): keep its owners
    replay.graph, replay.run = graph, run
    return replay


def graph_impls(
    p: Any, cross_entropy: Callable | None, ragged_name: str, gather_name: str, device: torch.device
) -> list[Impl]:
    """The graphed rows of the ``ce`` group (CUDA only): ragged's fused loss and the
    full + gather + CE baseline, each one forward and ``autograd.grad`` w.r.t. ``(h, W)``."""
    if device.type != "cuda":
        return []
    import ragged

    impls = []
    if cross_entropy is not None:
        h, w = p.leaves(True)
        hidden = ragged.RaggedTensor.from_lengths(h, p.lengths)
        vocab = ragged.RaggedTensor.from_lengths(p.vocab_values, p.counts)

        def ours():
            loss = cross_entropy(hidden, w, vocab, p.target, bias=p.bias, reduction="mean", out_of_vocab="ignore")
            return (loss, *torch.autograd.grad(loss, (h, w)))

        impls.append(_row(ragged_name + GRAPH, "ragged", ours))
    hb, wb = p.leaves(True)
    index, pad = p.padded_candidates()

    def theirs():
        logits = F.linear(hb, wb, p.bias).gather(1, index).masked_fill(pad, float("-inf"))
        loss = F.cross_entropy(logits, p.local_target)
        return (loss, *torch.autograd.grad(loss, (hb, wb)))

    impls.append(_row(gather_name + GRAPH, "baseline", theirs))
    return impls


def _row(name: str, kind: str, run: Callable) -> Impl:
    try:
        return Impl(name, kind, _graphed(run))
    except Exception as exc:  # a capture this torch or device refuses: reported as a skip
        torch.cuda.synchronize()
        return Impl(name, kind, skip=f"capture failed ({type(exc).__name__}: {str(exc)[:160]})")
