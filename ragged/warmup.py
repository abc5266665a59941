"""``ragged.warmup``: compile, ahead of serving, the kernels a module's calls will need.

The first call of a ragged model in a fresh process compiles its kernels (Triton, and the CUDA
C++ ones through NVRTC, each only the variant the call asks for; both are cached on disk for
later processes). :func:`warmup` makes that first call on an example batch, outside the
latency that matters: once in inference (``torch.no_grad()``) and, with ``training=True``, once
forward and backward in train mode. Nothing of the module changes, whether the calls return or
raise: every submodule's train/eval flag, the module tree's parameter and buffer entries (a
Parameter a forward replaces, a buffer it registers), every buffer's values (BatchNorm's running
statistics and ``num_batches_tracked`` included, also when written through ``.data``), each
parameter's ``requires_grad`` and ``.grad`` (the backward goes to ``torch.autograd.grad``, never
into ``.grad``; an existing ``.grad``, or None, is put back as the same object) and the random
state of the CPU and of every CUDA device of the module and the inputs (dropout's draws). The
buffers are compared with a host copy taken before the calls; only those that differ are written
back. Parameter values are not copied (a host copy of a large model's weights would cost its size
in host memory): a forward that writes its own weights in place is not undone; none of ragged's
modules does. A lazy module (``nn.LazyLinear``) is initialised by the calls, as by any first call.

Kernel variants depend on the shapes (head dim, dtype, the longest sequence's bucket): warm up
with a batch like the ones served (the lengths of a typical batch, and the longest one).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, cast

import torch

from .tensor import RaggedTensor
from .utils import describe

__all__ = ["compile_only", "warmup"]


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


def _devices(args, kwargs, module: torch.nn.Module) -> list[int]:
    """The CUDA devices of the inputs and of the module's parameters and buffers (their random
    states are forked)."""
    found = set()
    tensors = [x.values if isinstance(x, RaggedTensor) else x for x in [*args, *kwargs.values()]]
    for t in [*tensors, *module.parameters(), *module.buffers()]:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            found.add(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return sorted(found)


def _copyable(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_meta and not t.is_quantized and not torch.nn.parameter.is_lazy(t)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _same_bits(now: torch.Tensor, saved: torch.Tensor) -> bool:
    """Whether ``now`` holds exactly ``saved`` (bitwise: NaN payloads and -0.0 count)."""
    if now.shape != saved.shape or now.dtype != saved.dtype:
        return False
    now = now.detach().to("cpu").contiguous().reshape(-1)
    saved = saved.contiguous().reshape(-1)
    if now.numel() == 0:
        return True
    return torch.equal(now.view(torch.uint8), saved.view(torch.uint8))


def _write_back(t: torch.Tensor, saved: torch.Tensor) -> None:
    # an inference tensor is written in inference mode, any other under no_grad (a Parameter
    # that requires a gradient takes no recorded in-place write)
    with torch.inference_mode() if t.is_inference() else torch.no_grad():
        t.copy_(saved)


class _Snapshot:
    """What :func:`warmup` puts back: per module its train/eval flag and the entries of its
    parameter and buffer dicts; per buffer a host copy of its values; per parameter its
    ``requires_grad`` and its ``.grad`` (the object)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.modules = [
            (m, m.training, dict(m._parameters), dict(m._buffers), set(m._non_persistent_buffers_set))
            for m in module.modules()
        ]
        self.values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.params: dict[int, tuple[torch.nn.Parameter, bool, torch.Tensor | None]] = {}
        for _, _, params, buffers, _ in self.modules:
            for t in buffers.values():
                if t is not None and id(t) not in self.values and _copyable(t):
                    self.values[id(t)] = (t, _host_copy(t))
            for p in params.values():
                if p is not None and id(p) not in self.params:
                    self.params[id(p)] = (p, p.requires_grad, p.grad)

    def restore(self) -> None:
        for m, training, params, buffers, non_persistent in self.modules:
            m.training = training
            for now, saved in ((m._parameters, params), (m._buffers, buffers)):
                # by identity: a tensor's == compares values
                held = cast("dict[str, Any]", now)
                if held.keys() != saved.keys() or any(held[k] is not v for k, v in saved.items()):
                    held.clear()
                    held.update(saved)
            m._non_persistent_buffers_set.clear()
            m._non_persistent_buffers_set.update(non_persistent)
        for t, value in self.values.values():
            if not _same_bits(t, value):
                _write_back(t, value)
        for p, requires_grad, grad in self.params.values():
            if p.requires_grad != requires_grad:
                p.requires_grad_(requires_grad)
            if p.grad is not grad:
                p.grad = grad


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
    devices = _devices(args, kwargs, module)

    def sync() -> None:
        for d in devices:
            torch.cuda.synchronize(d)

    snapshot = _Snapshot(module)
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
                    terms = [o.float().square().mean() for o in outs]
                    loss = terms[0]
                    for term in terms[1:]:  # outputs may sit on several devices: no stack
                        loss = loss + term
                    torch.autograd.grad(loss, params, allow_unused=True)  # nothing lands in .grad
                sync()
                times["training"] = time.perf_counter() - start
        finally:
            snapshot.restore()
    return times


def compile_only(workers: int | None = None) -> contextlib.AbstractContextManager[None] | None:
    """A context inside which, on this thread, a launch of a Triton kernel compiles the variant its
    arguments ask for and runs nothing (the outputs it would write stay as they were), and a
    launch of a CUDA C++ kernel compiles its program through NVRTC (where not loaded) and runs
    nothing: the compiles run on ``workers`` threads each (Triton's and NVRTC's at once) and are
    all done, or raise, when the context ends (see :func:`ragged.kernels.triton.launch.compile_only`
    and :func:`ragged.kernels.cuda.launch.compile_only`; the code inside must not read the skipped
    kernels' outputs). None where Triton cannot be imported: there is nothing to compile ahead.
    The layer core of ``ragged.nn`` compiles a layer's kernels with it before the layer's first
    training call, without reaching into the kernels."""
    try:
        from .kernels.triton.launch import compile_only as triton_compile_only
    except ImportError:
        return None
    from .kernels.cuda.launch import compile_only as cuda_compile_only

    @contextlib.contextmanager
    def both():
        # the NVRTC block inside Triton's: its compiles end first, while Triton's may still run
        with triton_compile_only(workers), cuda_compile_only(workers):
            yield

    return both()
