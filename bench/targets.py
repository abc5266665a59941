"""The project's GPU targets, printed beside measured rows: reported, never asserted.

The targets are set for GPUs (full-size models, half precision). A CPU run (tiny models whose
times are mostly per-call overhead) gives no verdict on them: its cells say so instead.
"""

from __future__ import annotations

from typing import Any

NOT_EVALUATED = "GPU targets, not evaluated on CPU"


def verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def gpu_verdict(met: bool, on_gpu: bool) -> str:
    """``met`` / ``MISSED`` on a GPU; on CPU, that the GPU target was not evaluated."""
    return verdict(met) if on_gpu else "GPU target, not evaluated on CPU"


def speedup_notes(targets, medians: dict[str, Any], on_gpu: bool) -> dict[str, list[str]]:
    """Per ragged row, its speedup targets ``(ragged row, baseline row, factor)`` with their
    verdicts (``medians``: median ms of the rows that ran); on CPU one :data:`NOT_EVALUATED`."""
    notes: dict[str, list[str]] = {}
    for rag, base, factor in targets:
        if rag not in medians:
            continue
        if not on_gpu:
            notes[rag] = [NOT_EVALUATED]
            continue
        speedup = medians[base] / medians[rag] if base in medians else None
        got = "baseline did not run" if speedup is None else f"{speedup:.2f}x {verdict(speedup >= factor)}"
        notes.setdefault(rag, []).append(f">={factor:g}x {base}: {got}")
    return notes
