"""lm_head: a causal LM's head and loss, ``cross_entropy(hidden @ W.T, target)`` over a full
vocabulary (``ragged.linear_cross_entropy``), forward and forward+backward.

The workload a decoder fine-tune ends with: ``T`` packed tokens of width ``d`` against a
vocabulary of ``V`` rows (Qwen2.5's 151,936, Llama 3's 128,256, Gemma 2's 256,000 with its logit
soft cap). Baselines: what a HuggingFace model runs (the bf16 head's logits, ``.float()``,
``F.cross_entropy``), the same under ``torch.compile``, and the fused linear cross-entropies
users install (Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``, Apple's cut-cross-entropy
``linear_cross_entropy``, its default ``filter_eps``), each run where its package imports.

Flops: ``2 T V d`` forward, ``6 T V d`` forward+backward (the ragged rows recompute the logits
in the backward, 8 T V d of work; the count stays the useful one). Every row reports its peak
memory above what was allocated before the call (the gradients it returns included), also as
% of the float32 ``[T, V]`` logits HF's path materialises. Correctness: the loss and the
gradients against a float32 computation from the same bf16 logits.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
import torch.nn.functional as F

import ragged

from ..harness import (
    Case,
    Config,
    Impl,
    Suite,
    Workload,
    dtype_name,
    interpreter_skip,
    max_error_compare,
    register,
    workload_shapes,
)
from ..measure import peak_memory_bytes

SEED = 5
FWD, FWD_BWD = "fwd", "fwd+bwd"


@dataclasses.dataclass(frozen=True)
class Shape:
    dtype: torch.dtype
    tokens: int
    width: int
    vocab: int
    softcap: float | None = None
    note: str = ""

    def name(self) -> str:
        cap = f" softcap={self.softcap:g}" if self.softcap else ""
        return f"{dtype_name(self.dtype)} T={self.tokens} d={self.width} V={self.vocab}{cap}"


GPU_SHAPES = (
    Shape(torch.bfloat16, 8192, 896, 151936, None, "Qwen2.5-0.5B head, 8k packed tokens"),
    Shape(torch.bfloat16, 4096, 4096, 128256, None, "Llama-3-8B head"),
    Shape(torch.bfloat16, 4096, 2304, 256000, 30.0, "Gemma-2-2B head, soft cap 30"),
)
CPU_SHAPES = (Shape(torch.float32, 512, 64, 8000, None, "CPU"),)
CPU_QUICK_SHAPES = (Shape(torch.float32, 33, 16, 500, 5.0, "tiny (smoke case)"),)


def _liger(shape: Shape):
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError as exc:
        return None, f"liger-kernel not installed ({exc.name})"
    loss = (
        LigerFusedLinearCrossEntropyLoss(softcap=shape.softcap) if shape.softcap else LigerFusedLinearCrossEntropyLoss()
    )
    return (lambda h, w, t: loss(w, h, t)), None


def _cce(shape: Shape):
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
    except ImportError as exc:
        return None, f"cut-cross-entropy not installed ({exc.name})"
    return (lambda h, w, t: cce(h, w, t, softcap=shape.softcap)), None


def _dense(shape: Shape):
    def loss(h, w, t):
        z = (h @ w.T).float()  # the head's logits in its dtype, then float32 (HF's loss)
        if shape.softcap:
            z = torch.tanh(z / shape.softcap) * shape.softcap
        return F.cross_entropy(z, t)

    return loss


def lm_head_workload(shape: Shape, group: str, device: torch.device, triton_skip: str | None) -> Workload:
    gen = torch.Generator(device=device).manual_seed(SEED)
    t, d, v = shape.tokens, shape.width, shape.vocab
    h0 = torch.randn((t, d), generator=gen, device=device).to(shape.dtype)
    w0 = (torch.randn((v, d), generator=gen, device=device) * d**-0.5).to(shape.dtype)
    target = torch.randint(0, v, (t,), generator=gen, device=device)
    target[::7] = -100
    backward = group == FWD_BWD

    def run(loss_fn):
        def call():
            h = h0.detach().requires_grad_(backward)
            w = w0.detach().requires_grad_(backward)
            with torch.set_grad_enabled(backward):
                loss = loss_fn(h, w, target)
                if not backward:
                    return (loss.float(),)
                gh, gw = torch.autograd.grad(loss, (h, w))
            return (loss.float(), gh, gw)

        return call

    dense = _dense(shape)
    compiled = torch.compile(dense, dynamic=False)
    impls = []
    reasons = ragged.explain("linear_cross_entropy", h0, w0, None, shape.softcap or 0.0)
    for backend in ("triton", "torch"):
        why = reasons.get(backend) or ([triton_skip] if backend == "triton" and triton_skip else [])
        skip = "; ".join(why) if why else None
        fn = run(lambda h, w, tt, b=backend: ragged.linear_cross_entropy(h, w, tt, softcap=shape.softcap, backend=b))
        impls.append(Impl(f"ragged {backend}", "ragged", fn, skip=skip))
    impls.append(Impl("HF: bf16 logits, .float(), F.cross_entropy", "baseline", run(dense)))
    impls.append(Impl("HF path, torch.compile", "baseline", run(compiled)))
    for name, (fn, why) in (("Liger fused linear CE", _liger(shape)), ("cut-cross-entropy", _cce(shape))):
        impls.append(Impl(name, "baseline", run(fn) if fn is not None else None, skip=why))
    ref = run(dense)()
    ref = tuple(r.detach().float() for r in ref)
    tol = 1e-4 if shape.dtype == torch.float32 else 2e-2
    full = t * v * 4

    def extra(impl: Impl) -> dict[str, Any]:
        peak = peak_memory_bytes(impl.fn, device) if impl.fn is not None else None
        if peak is None:
            return {}
        return {"peak MB": round(peak / 2**20, 1), "% of fp32 logits": round(100 * peak / full, 1)}

    return Workload(
        impls,
        reference=ref,
        flops=(6 if backward else 2) * t * v * d,
        compare=max_error_compare(("loss", "d hidden", "d weight")[: len(ref)], lambda x: x.float(), tol),
        extra=extra,
    )


@register
class LmHeadSuite(Suite):
    name = "lm_head"
    description = "LM head + cross-entropy over a full vocabulary (ragged.linear_cross_entropy)"
    notes = __doc__ or ""

    def cases(self, config: Config) -> list[Case]:
        cases = []
        shapes = workload_shapes(config, GPU_SHAPES, CPU_SHAPES, 0, CPU_QUICK_SHAPES)
        for group, shape in itertools.product((FWD, FWD_BWD), shapes):
            params = {
                "dtype": dtype_name(shape.dtype),
                "T": shape.tokens,
                "d": shape.width,
                "V": shape.vocab,
                "softcap": shape.softcap,
                "note": shape.note,
            }
            cases.append(Case(f"{group} {shape.name()}", params, group=group, spec=(group, shape)))
        return cases

    def build(self, case: Case, config: Config) -> Workload:
        group, shape = case.spec
        return lm_head_workload(shape, group, config.device, interpreter_skip(config))
