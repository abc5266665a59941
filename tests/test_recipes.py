"""The recipes of ARCHITECTURE.md, followed step by step on a copy of the package.

"Add an op": a toy op, ``token_scale`` (``y[t] = x[t] * w[t]``, a weight per packed token),
written at the paths the recipe names (``records/token_scale.py`` with its operand, output,
backward-input and gradient records; ``ops/token_scale.py`` with its reference, spec, fake,
autograd rule, ``"torch"`` implementation and public function; ``kernels/triton/token_scale.py``
with its ``Implementation`` declared in ``kernels/triton/__init__.py``; the export in
``ragged/__init__.py``), then run on every CPU backend, differentiated, compiled and explained.

"Add a backend": a toy backend, ``"toy"``, with one implementation of ``pool``, declared in
``kernels/toy/__init__.py`` beside its kernels and imported by ``ragged/__init__.py``; no op
file changes. It is listed, chosen by ``backend=`` and ``use_backend``, explained, and
ranked by ``"auto"``.

Each copy is imported in a fresh interpreter (without ``site``, so an editable install of
the package cannot shadow the copy), so the registry of this process never sees the toys.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------
# "Add an op", step 1: ragged/records/token_scale.py and ragged/ops/token_scale.py

RECORD_FILE = '''\
"""The records of ``ragged::token_scale`` (see :mod:`ragged.ops.token_scale`)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class TokenScaleArgs(NamedTuple):
    """The operands: ``x [T, F]`` and ``w [T]``, one weight per packed token."""

    x: Tensor
    w: Tensor


class TokenScaleOutput(NamedTuple):
    """``out [T, F]``."""

    out: Tensor


class TokenScaleBackwardInputs(NamedTuple):
    """The gradient of ``out``."""

    grad_out: Tensor


class TokenScaleGrads(NamedTuple):
    """The gradients of ``x`` and ``w``."""

    x: Tensor
    w: Tensor
'''

OP_FILE = '''\
"""token_scale: each token's features times that token's weight.

``values [T, F]`` (packed tokens) and ``w [T]`` (one weight per packed token) give
``out [T, F]``, ``out[t] = values[t] * w[t]``. No host sync.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .. import backends, opdef
from ..records.token_scale import TokenScaleArgs, TokenScaleBackwardInputs, TokenScaleGrads, TokenScaleOutput
from ..tensor import RaggedTensor
from ..utils import describe


def reference_token_scale(x: Tensor, w: Tensor) -> Tensor:
    """``x [T, F]``, ``w [T]`` -> ``x * w[:, None]``."""
    return x * w.unsqueeze(1)


def reference_token_scale_backward(grad: Tensor, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """``grad [T, F]`` -> ``(grad_x [T, F], grad_w [T])``."""
    return grad * w.unsqueeze(1), (grad * x).sum(1)


@dataclasses.dataclass(frozen=True)
class TokenScaleSpec:
    """What an implementation of token_scale is asked to take."""

    device: torch.device
    dtype: torch.dtype


def token_scale_spec(x: Tensor, w: Tensor) -> TokenScaleSpec:
    """The spec of ``token_scale(x [T, F], w [T])``."""
    return TokenScaleSpec(x.device, x.dtype)


def _setup(ctx, args: TokenScaleArgs, output: TokenScaleOutput) -> None:
    ctx.save_for_backward(args.x, args.w)


def _backward(ctx, grad: Tensor) -> TokenScaleGrads:
    x, w = ctx.saved_tensors
    return TOKEN_SCALE.call_backward(TokenScaleArgs(x, w), TokenScaleBackwardInputs(grad), ctx.impl)


TOKEN_SCALE = opdef.define(
    "token_scale", TokenScaleArgs, TokenScaleOutput, spec=token_scale_spec,
    fake=lambda args: TokenScaleOutput(torch.empty_like(args.x)), setup=_setup, backward=_backward,
    backward_inputs=TokenScaleBackwardInputs, grads=TokenScaleGrads,
    backward_fake=lambda args, inputs: TokenScaleGrads(torch.empty_like(args.x), torch.empty_like(args.w)))


def _reference_forward(args: TokenScaleArgs) -> TokenScaleOutput:
    return TokenScaleOutput(reference_token_scale(args.x, args.w))


def _reference_backward(args: TokenScaleArgs, inputs: TokenScaleBackwardInputs) -> TokenScaleGrads:
    return TokenScaleGrads(*reference_token_scale_backward(inputs.grad_out, args.x, args.w))


backends.register(backends.Implementation("token_scale", "torch", _reference_forward, backward=_reference_backward))


def token_scale(rt: RaggedTensor, w: Tensor, *, backend: str | None = None) -> RaggedTensor:
    """``rt`` (values ``[T, F]``) with every token's row times its weight ``w [T]``."""
    fn = "ragged.token_scale"
    if not isinstance(rt, RaggedTensor):
        raise TypeError(f"{fn}(): expected rt to be a RaggedTensor, got {describe(rt)}")
    x = rt.values
    if x.dim() != 2 or not isinstance(w, Tensor) or w.shape != (x.shape[0],) or w.dtype != x.dtype:
        raise ValueError(f"{fn}(): expected rt.values [T, F] and w [T] of its dtype, got {describe(x)} "
                         f"and {describe(w)}")
    impl = backends.select_spec("token_scale", backend, TokenScaleSpec(x.device, x.dtype), fn=fn)
    return rt.with_values(TOKEN_SCALE(TokenScaleArgs(x, w), impl.name).out)
'''

# step 2: ragged/kernels/triton/token_scale.py, and its Implementation in kernels/triton/__init__.py

TRITON_FILE = '''\
"""Triton token_scale kernels: one program per token, the features in one block."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...records.token_scale import TokenScaleArgs, TokenScaleBackwardInputs, TokenScaleGrads, TokenScaleOutput
from .launch import cached_launch


@cached_launch
@triton.jit
def _forward_kernel(x, w, out, n_feat, BLOCK_F: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_F)
    ok = cols < n_feat
    scale = tl.load(w + t).to(tl.float32)
    row = tl.load(x + t * n_feat + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + t * n_feat + cols, (row * scale).to(out.dtype.element_ty), mask=ok)


@cached_launch
@triton.jit
def _backward_kernel(grad, x, w, dx, dw, n_feat, BLOCK_F: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_F)
    ok = cols < n_feat
    scale = tl.load(w + t).to(tl.float32)
    g = tl.load(grad + t * n_feat + cols, mask=ok, other=0.0).to(tl.float32)
    row = tl.load(x + t * n_feat + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(dx + t * n_feat + cols, (g * scale).to(dx.dtype.element_ty), mask=ok)
    tl.store(dw + t, tl.sum(g * row, axis=0).to(dw.dtype.element_ty))


def forward(args: TokenScaleArgs) -> TokenScaleOutput:
    x, w = args.x.contiguous(), args.w.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        _forward_kernel[(x.shape[0],)](x, w, out, x.shape[1], BLOCK_F=triton.next_power_of_2(x.shape[1]))
    return TokenScaleOutput(out)


def backward(args: TokenScaleArgs, inputs: TokenScaleBackwardInputs) -> TokenScaleGrads:
    grad, x, w = inputs.grad_out.contiguous(), args.x.contiguous(), args.w.contiguous()
    dx, dw = torch.empty_like(x), torch.zeros_like(w)
    if x.numel():
        _backward_kernel[(x.shape[0],)](grad, x, w, dx, dw, x.shape[1],
                                        BLOCK_F=triton.next_power_of_2(x.shape[1]))
    return TokenScaleGrads(dx, dw)
'''

TRITON_DECLARATION = """

# ---- token_scale -------------------------------------------------------------
register(Implementation("token_scale", "triton", f"{_HERE}.token_scale:forward",
                        f"{_HERE}.token_scale:backward", dtypes=(torch.float16, torch.bfloat16, torch.float32),
                        rank=0))
"""

# step 3: the export in ragged/__init__.py

OP_EXPORT = """
from .ops.token_scale import token_scale  # noqa: E402

__all__.append("token_scale")
"""

OP_CHECKS = """
import torch

import ragged
from ragged import backends
from ragged.ops.token_scale import TOKEN_SCALE, reference_token_scale
from ragged.records.token_scale import TokenScaleArgs, TokenScaleBackwardInputs, TokenScaleGrads, TokenScaleOutput

assert "token_scale" in backends.op_names()
g = torch.Generator().manual_seed(0)
rt = ragged.pack([torch.randn(n, 5, generator=g, dtype=torch.float64) for n in (3, 0, 1, 7)])
w = torch.randn(rt.num_tokens, generator=g, dtype=torch.float64)
grad = torch.randn(rt.num_tokens, 5, generator=g, dtype=torch.float64)
want = rt.values * w.unsqueeze(1)
want_dx, want_dw = grad * w.unsqueeze(1), (grad * rt.values).sum(1)

# every CPU backend against the float64 reference, forward and backward
cpu = ["torch"] + ([] if backends.triton_reason(torch.device("cpu")) else ["triton"])
for name in cpu:
    dtype = torch.float64 if name == "torch" else torch.float32
    x = rt.values.to(dtype, copy=True).requires_grad_(True)
    scale = w.to(dtype, copy=True).requires_grad_(True)
    out = ragged.token_scale(rt.with_values(x), scale, backend=name)
    assert isinstance(out, ragged.RaggedTensor) and out.offsets is rt.offsets, name
    torch.testing.assert_close(out.values, want.to(dtype))
    dx, dw = torch.autograd.grad(out.values, (x, scale), grad.to(dtype))
    torch.testing.assert_close(dx, want_dx.to(dtype))
    torch.testing.assert_close(dw, want_dw.to(dtype))
    with torch.no_grad():  # the eager path without autograd: the implementation called straight
        torch.testing.assert_close(ragged.token_scale(rt.with_values(x), scale, backend=name).values,
                                   want.to(dtype))
    # the op and its backward over the records, called straight
    args = TokenScaleArgs(x.detach(), scale.detach())
    out = TOKEN_SCALE(args, name)
    assert isinstance(out, TokenScaleOutput), type(out)
    torch.testing.assert_close(out.out, want.to(dtype))
    grads = TOKEN_SCALE.call_backward(args, TokenScaleBackwardInputs(grad.to(dtype)), name)
    assert isinstance(grads, TokenScaleGrads), type(grads)
    torch.testing.assert_close(grads.x, want_dx.to(dtype))
    torch.testing.assert_close(grads.w, want_dw.to(dtype))

# the autograd rule, numerically; the torch.library op's registration
x = rt.values.clone().requires_grad_(True)
scale = w.clone().requires_grad_(True)
torch.autograd.gradcheck(lambda x, s: ragged.token_scale(rt.with_values(x), s, backend="torch").values,
                         (x, scale))
torch.library.opcheck(torch.ops.ragged.token_scale.default, (x, scale, "torch"))

# torch.compile: one graph, forward and backward through ragged::token_scale(_backward)
def step(rt, s):
    return (ragged.token_scale(rt, s, backend="torch").values * grad).sum()

compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
x = rt.values.clone().requires_grad_(True)
scale = w.clone().requires_grad_(True)
loss = compiled(rt.with_values(x), scale)
loss.backward()
torch.testing.assert_close(loss, (want * grad).sum())
torch.testing.assert_close(x.grad, want_dx)
torch.testing.assert_close(scale.grad, want_dw)

# explain finds the op in the registry, by name and through the public function
x32, w32 = rt.values.float(), w.float()
why = ragged.explain("token_scale", x32, w32)
assert set(why) == {"torch", "triton"}, why
assert why["torch"] == [] and why.chosen == "torch", why  # auto on the CPU: the reference
assert why == ragged.explain(ragged.token_scale, rt.with_values(x32), w32), why
assert any("float64" in r for r in ragged.explain(ragged.token_scale, rt, w)["triton"])
try:
    ragged.explain("token_scale")
except TypeError as exc:
    assert "(x, w)" in str(exc) and "ragged.explain(ragged.token_scale, rt, w)" in str(exc), exc
else:
    raise AssertionError("explain() without the op's operands did not raise")
try:
    ragged.token_scale(rt, w, backend="triton")
except ValueError as exc:
    assert "backend 'triton' cannot take this input" in str(exc) and "float64" in str(exc), exc
else:
    raise AssertionError("a forced backend that cannot take the input did not raise")
print("ok", cpu)
"""

# ---------------------------------------------------------------------------------------
# "Add a backend", steps 1 and 2: ragged/kernels/toy/__init__.py and the kernels beside it

BACKEND_INIT = '''\
"""The ``"toy"`` backend: one implementation of pool (modes sum and mean, float32)."""

from __future__ import annotations

import torch

from ...backends import Implementation, register, register_backend


def _device_reason(device: torch.device) -> str | None:
    return None if device.type in ("cpu", "cuda") else f"toy runs on CPU and CUDA tensors, got a {device.type} tensor"


register_backend("toy", _device_reason)


def _rank(spec) -> float:
    # ahead of every other kernel for sums, behind them for means
    return -1 if spec.mode == "sum" else 2


register(Implementation("pool", "toy", f"{__name__}.pool:pool", backward=f"{__name__}.pool:pool_backward",
                        dtypes=(torch.float32,), limits={"mode": ("sum", "mean")}, rank=_rank))
'''

BACKEND_KERNELS = '''\
"""The toy pool kernels (counting their calls): sums and means per sequence, over the op's records."""

from __future__ import annotations

import torch

from ...records.pool import PoolArgs, PoolBackwardInputs, PoolGrads, PoolOutput

CALLS = {"forward": 0, "backward": 0}


def _lengths_and_rows(offsets: torch.Tensor, total: int):
    o = offsets.to(torch.int64)
    lengths = o[1:] - o[:-1]
    return lengths, torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths, output_size=total)


def pool(args: PoolArgs) -> PoolOutput:
    CALLS["forward"] += 1
    values = args.values
    lengths, seq = _lengths_and_rows(args.offsets, values.shape[0])
    out = values.new_zeros((lengths.shape[0], values.shape[1])).index_add(0, seq, values)
    if args.mode == "mean":
        out = out / lengths.clamp(min=1).unsqueeze(1)
    return PoolOutput(out, args.offsets.new_empty(0))


def pool_backward(args: PoolArgs, inputs: PoolBackwardInputs) -> PoolGrads:
    CALLS["backward"] += 1
    grad = inputs.grad_out
    lengths, seq = _lengths_and_rows(args.offsets, inputs.total)
    if args.mode == "mean":
        grad = grad / lengths.clamp(min=1).unsqueeze(1)
    return PoolGrads(grad.index_select(0, seq))
'''

# step 3: import the package in ragged/__init__.py

BACKEND_IMPORT = """
from .kernels import toy as _toy_backend  # noqa: E402,F401  (it registers)
"""

BACKEND_CHECKS = """
import torch

import ragged
from ragged import backends
from ragged.kernels.toy.pool import CALLS
from ragged.ops.pool import PoolSpec

assert "toy" in ragged.BACKENDS and "toy" in backends.BACKENDS, ragged.BACKENDS
g = torch.Generator().manual_seed(0)
rt = ragged.pack([torch.randn(n, 3, generator=g) for n in (2, 0, 5)])
rt = rt.with_values(rt.values.requires_grad_(True))

# backend= routes to the toy kernels, forward and backward
out = ragged.pool(rt, "sum", backend="toy")
assert CALLS == {"forward": 1, "backward": 0}, CALLS
torch.testing.assert_close(out, ragged.pool(rt, "sum", backend="torch"))
(grad,) = torch.autograd.grad(out.sum(), rt.values)
assert CALLS == {"forward": 1, "backward": 1}, CALLS
torch.testing.assert_close(grad, torch.ones_like(rt.values))

# so do use_backend and set_backend
with ragged.use_backend("toy"):
    torch.testing.assert_close(ragged.pool(rt, "mean"), ragged.pool(rt, "mean", backend="torch"))
ragged.set_backend("toy")
ragged.pool(rt, "sum")
ragged.set_backend(None)
assert CALLS["forward"] == 3, CALLS

# a forced backend that cannot take the input says why
try:
    ragged.pool(rt, "max", backend="toy")
except ValueError as exc:
    assert "backend 'toy' cannot take this input: toy pool takes modes ('sum', 'mean'), got 'max'" in str(exc), exc
else:
    raise AssertionError("toy took mode max")

# explain lists it, with its reasons
why = ragged.explain(ragged.pool, rt, "sum")
assert why["toy"] == [] and why.chosen == "torch", why  # auto on the CPU: the reference
assert why == ragged.explain("pool", rt.values, rt.offsets, "sum")
why = ragged.explain("pool", rt.values, rt.offsets, "max")
assert why["toy"] == ["toy pool takes modes ('sum', 'mean'), got 'max'"], why
with ragged.use_backend("toy"):
    assert ragged.explain(ragged.pool, rt, "mean").chosen == "toy"

# auto on CUDA inputs: the implementations by rank, the first with no reasons
cuda = torch.device("cuda")
triton_ok = backends.triton_reason(cuda) is None
entry = backends.op_entry("pool")
assert entry.gpu_preference(PoolSpec(cuda, torch.float32, "sum")) == ("toy", "triton", "torch")
assert entry.gpu_preference(PoolSpec(cuda, torch.float32, "mean")) == ("triton", "toy", "torch")
picked = {(dtype, mode): backends.select_spec("pool", "auto", PoolSpec(cuda, dtype, mode)).backend
          for dtype in (torch.float32, torch.float16) for mode in ("sum", "mean", "max")}
assert picked == {
    (torch.float32, "sum"): "toy",  # ranked first, and takes it
    (torch.float32, "mean"): "triton" if triton_ok else "toy",
    (torch.float32, "max"): "triton" if triton_ok else "torch",  # toy takes no max
    (torch.float16, "sum"): "triton" if triton_ok else "torch",  # toy takes no float16
    (torch.float16, "mean"): "triton" if triton_ok else "torch",
    (torch.float16, "max"): "triton" if triton_ok else "torch",
}, picked
print("ok")
"""


def _copy_package(tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of ragged/ under ``tmp_path`` (its own import root)."""
    shutil.copytree(ROOT / "ragged", tmp_path / "ragged", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "ragged"


def _append(path: pathlib.Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def _run(root: pathlib.Path, checks: str) -> str:
    """Run ``checks`` in a fresh interpreter that imports ragged from ``root``."""
    script = root / "checks.py"
    script.write_text(
        f"import ragged\nassert ragged.__file__ == {str(root / 'ragged' / '__init__.py')!r}, "
        f"ragged.__file__\n" + textwrap.dedent(checks)
    )
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(root), *(p for p in sys.path if p and "__editable__" not in p)]),
    )
    # -S: no site hooks, so an editable install's import finder cannot take ragged from the checkout
    done = subprocess.run(
        [sys.executable, "-S", str(script)], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return done.stdout


def test_add_an_op(tmp_path):
    package = _copy_package(tmp_path)
    (package / "records" / "token_scale.py").write_text(RECORD_FILE)  # step 1
    (package / "ops" / "token_scale.py").write_text(OP_FILE)
    (package / "kernels" / "triton" / "token_scale.py").write_text(TRITON_FILE)  # step 2
    _append(package / "kernels" / "triton" / "__init__.py", TRITON_DECLARATION)
    _append(package / "__init__.py", OP_EXPORT)  # step 3
    out = _run(tmp_path, OP_CHECKS)
    assert out.startswith("ok")
    if importlib.util.find_spec("triton") is not None:
        assert "'triton'" in out, out  # the Triton kernels ran, under the interpreter


def test_add_a_backend(tmp_path):
    package = _copy_package(tmp_path)
    (package / "kernels" / "toy").mkdir()
    (package / "kernels" / "toy" / "__init__.py").write_text(BACKEND_INIT)  # step 1
    (package / "kernels" / "toy" / "pool.py").write_text(BACKEND_KERNELS)  # step 2
    _append(package / "__init__.py", BACKEND_IMPORT)  # step 3
    assert _run(tmp_path, BACKEND_CHECKS).startswith("ok")
