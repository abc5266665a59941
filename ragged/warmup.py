"""``ragged.warmup``: compile, ahead of serving, the kernels a module's calls will need.

The first call of a ragged model in a fresh process compiles its kernels (Triton, and the CUDA
C++ ones through NVRTC, each only the variant the call asks for; both are cached on disk for
later processes). :func:`warmup` makes that first call on an example batch, outside the
latency that matters: once in inference (``torch.no_grad()``) and, with ``training=True``, once
forward and backward in train mode. Nothing of the module changes: no gradient is accumulated
into ``.grad``, the random state (dropout) is restored, train/eval mode is put back.

Kernel variants depend on the shapes (head dim, dtype, the longest sequence's bucket): warm up
with a batch like the ones served (the lengths of a typical batch, and the longest one).
"""

from __future__ import annotations

import time

import torch

from .tensor import RaggedTensor
from .utils import describe

__all__ = ["warmup"]


def _values(out) -> list[torch.Tensor]:
    """The floating-point tensors of an output (RaggedTensors, tuples, dicts, ModelOutputs)."""
    found: list[torch.Tensor] = []

    def walk(x):
        if isinstance(x, RaggedTensor):
            walk(x.values)
        elif isinstance(x, torch.Tensor):
            if x.is_floating_point() and x.requires_grad:
                found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                walk(v)

    walk(out)
    return found


def _devices(args, kwargs) -> list[int]:
    found = set()
    for x in [*args, *kwargs.values()]:
        t = x.values if isinstance(x, RaggedTensor) else x
        if isinstance(t, torch.Tensor) and t.is_cuda:
            found.add(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return sorted(found)


def warmup(module: torch.nn.Module, *args, training: bool = False, **kwargs) -> dict[str, float]:
    """Run ``module(*args, **kwargs)`` once in inference (and, with ``training=True``, once
    forward + backward in train mode) so that every kernel those calls need is compiled;
    returns the seconds each part took (``{"inference": s, "training": s}``), each ended by a
    synchronize. See the module docstring for what is left unchanged."""
    fn = "ragged.warmup"
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{fn}(): expected module to be a torch.nn.Module, got {describe(module)}")
    if not isinstance(training, bool):
        raise TypeError(f"{fn}(): expected training to be a bool, got {describe(training)}")
    devices = _devices(args, kwargs)
    sync = (lambda: [torch.cuda.synchronize(d) for d in devices]) if devices else (lambda: None)
    was_training = module.training
    times: dict[str, float] = {}
    with torch.random.fork_rng(devices=devices):
        try:
            start = time.perf_counter()
            module.eval()
            with torch.no_grad():
                module(*args, **kwargs)
            sync()
            times["inference"] = time.perf_counter() - start
            if training:
                start = time.perf_counter()
                module.train()
                params = [p for p in module.parameters() if p.requires_grad]
                # leaves that need a gradient, as in training: an input's gradient kernels too
                outs = _values(module(*args, **kwargs))
                if outs and params:
                    loss = sum(o.float().square().mean() for o in outs)
                    torch.autograd.grad(loss, params, allow_unused=True)  # nothing lands in .grad
                sync()
                times["training"] = time.perf_counter() - start
        finally:
            module.train(was_training)
    return times
