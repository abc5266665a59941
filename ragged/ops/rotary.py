"""rotary_embedding: rotary position embedding (RoPE) of packed attention heads.

Shapes (packed token index ``t``, see :mod:`ragged.tensor`; a token's *position* is its index
within its own sequence, ``RaggedTensor.position_ids()``):

* ``x``: ``[T, N, D]``, ``N`` heads of an even head dim ``D`` (queries and keys together, as
  ``qkv.view(T, 3, H, D)[:, :2].flatten(1, 2)`` of a fused QKV projection: ``N = 2H``);
* ``positions``: ``[T]`` int32 / int64, the position of every packed token;
* ``inv_freq``: ``[D/2]``, the rotary frequencies (HuggingFace's ``inv_freq`` buffer);
* ``scaling``: a Python float multiplying cos and sin (HuggingFace's ``attention_scaling``).

The "rotate half" convention of GPT-NeoX and HuggingFace's ``apply_rotary_pos_emb``: with
``x1 = x[..., :D/2]``, ``x2 = x[..., D/2:]``, ``angle[t, i] = positions[t] * inv_freq[i]``,
``c = cos(angle) * scaling`` and ``s = sin(angle) * scaling``::

    out[..., :D/2] = x1 * c - x2 * s
    out[..., D/2:] = x2 * c + x1 * s

Precision: the angle is the float32 product of the position and the frequency, whatever the
dtypes (``positions.float() * inv_freq.float()``, as HuggingFace computes it); cos and sin
are float32 too (HuggingFace's tables: widened for a float64 ``x``, so a float64 model's
numbers are its own), the rotation is computed in float32 (float64 for float64 ``x``) and the
result is rounded once to ``x``'s dtype. HuggingFace rounds cos and sin to ``x``'s dtype
first, so at 16 bits the two differ by a rounding of the inputs.

Layout: ``x`` may have any strides (the kernel reads all three; a unit stride along ``D``
gives vector loads), so the q and k heads of a fused QKV output are read in place. The
output is a new contiguous ``[T, N, D]`` tensor of ``x``'s dtype.

Gradient: to ``x`` only, the rotation by the opposite angle (``dx1 = g1 * c + g2 * s``,
``dx2 = g2 * c - g1 * s``); ``positions`` and ``inv_freq`` get None. Twice differentiable
(the backward is linear in the gradient).

One op carries the work, :data:`ROTARY_EMBEDDING` (``ragged::rotary_embedding`` and
``ragged::rotary_embedding_backward``, defined through :mod:`ragged.opdef` over the records of
:mod:`ragged.records.rotary`; the backward reads the gradient, never ``x``). Implementations
(:mod:`ragged.backends`, read from :class:`RotaryEmbeddingSpec`): ``"torch"``
(:func:`reference_rotary_embedding`; every floating dtype; the CPU path; declared here) and
``"triton"`` (:mod:`ragged.kernels.triton.rotary`, float16 / bfloat16 / float32, forward and
backward in one kernel; declared in :mod:`ragged.kernels.triton`). A per-token op: no host
sync, the grid is sized from ``T`` and ``N``, and the spare rows of a graphed bucket are
rotated like any other.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch
from torch import Tensor

from .. import backends, opdef
from ..records.rotary import (
    RotaryEmbeddingArgs,
    RotaryEmbeddingBackwardInputs,
    RotaryEmbeddingGrads,
    RotaryEmbeddingOutput,
)
from ..utils import OFFSET_DTYPES, check_tensor, check_vector, describe, no_autocast

# --------------------------------------------------------------------------------------
# Reference (pure torch; CPU product path and test oracle)


def _rotate(x: Tensor, positions: Tensor, inv_freq: Tensor, scaling: float, sign: float) -> Tensor:
    """``x`` rotated by ``sign`` times each token's angle (see the module docstring)."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    # the tables in float32 whatever x's dtype, as HuggingFace computes them (the angle is float32
    # already: a float64 cosine of it would only differ from the models' own tables)
    angle = positions.to(torch.float32).unsqueeze(1) * inv_freq.to(torch.float32).unsqueeze(0)
    c = (angle.cos() * scaling).to(dtype).unsqueeze(1)  # [T, 1, D/2]
    s = (angle.sin() * scaling).to(dtype).unsqueeze(1) * sign
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


@no_autocast
def reference_rotary_embedding(x: Tensor, positions: Tensor, inv_freq: Tensor, scaling: float = 1.0) -> Tensor:
    """``x [T, N, D]`` (any strides), ``positions [T]``, ``inv_freq [D/2]`` -> ``out [T, N, D]``,
    contiguous, in ``x``'s dtype (see the module docstring). Differentiable by torch autograd
    when called directly."""
    return _rotate(x, positions, inv_freq, scaling, 1.0)


@no_autocast
def reference_rotary_embedding_backward(
    grad: Tensor, positions: Tensor, inv_freq: Tensor, scaling: float = 1.0
) -> tuple[Tensor]:
    """``grad [T, N, D]`` (any strides) -> ``(grad_x [T, N, D],)`` in ``grad``'s dtype: the
    rotation by the opposite angle. Torch ops: differentiable (``create_graph=True``)."""
    return (_rotate(grad, positions, inv_freq, scaling, -1.0),)


# --------------------------------------------------------------------------------------
# The op


@dataclasses.dataclass(frozen=True)
class RotaryEmbeddingSpec:
    """What an implementation of rotary_embedding is asked to take: x's device and dtype, D."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int


def rotary_embedding_spec(x: Tensor, positions: Tensor, inv_freq: Tensor, scaling: float = 1.0) -> RotaryEmbeddingSpec:
    """The spec of ``rotary_embedding(x [T, N, D], positions [T], inv_freq [D/2], scaling)`` (the
    arguments of ``ragged.explain("rotary_embedding", ...)``)."""
    return RotaryEmbeddingSpec(x.device, x.dtype, x.shape[-1])


def _setup(ctx, args: RotaryEmbeddingArgs, output: RotaryEmbeddingOutput) -> None:
    ctx.save_for_backward(args.positions, args.inv_freq)
    ctx.scaling = args.scaling


def _backward(ctx, grad: Tensor) -> RotaryEmbeddingGrads | None:
    if not ctx.needs_grad.x:
        return None
    positions, inv_freq = ctx.saved_tensors
    if torch.is_grad_enabled():
        # create_graph=True: the gradient must be differentiable itself; a kernel's output would
        # be a constant to autograd, the reference's torch ops are recorded.
        (dx,) = reference_rotary_embedding_backward(grad, positions, inv_freq, ctx.scaling)
        return RotaryEmbeddingGrads(dx)
    # x is not kept: the backward rotates the gradient and reads nothing of x
    args = RotaryEmbeddingArgs(None, positions, inv_freq, ctx.scaling)  # type: ignore[arg-type]
    return ROTARY_EMBEDDING.call_backward(args, RotaryEmbeddingBackwardInputs(grad), ctx.impl)


ROTARY_EMBEDDING = opdef.define(
    "rotary_embedding",
    RotaryEmbeddingArgs,
    RotaryEmbeddingOutput,
    spec=rotary_embedding_spec,
    setup=_setup,
    backward=_backward,
    fake=lambda args: RotaryEmbeddingOutput(args.x.new_empty(args.x.shape)),
    backward_inputs=RotaryEmbeddingBackwardInputs,
    grads=RotaryEmbeddingGrads,
    backward_fake=lambda args, inputs: RotaryEmbeddingGrads(inputs.grad_out.new_empty(inputs.grad_out.shape)),
    backward_unread=("x",),
)


def _reference_forward(args: RotaryEmbeddingArgs) -> RotaryEmbeddingOutput:
    return RotaryEmbeddingOutput(reference_rotary_embedding(args.x, args.positions, args.inv_freq, args.scaling))


def _reference_backward(args: RotaryEmbeddingArgs, inputs: RotaryEmbeddingBackwardInputs) -> RotaryEmbeddingGrads:
    (dx,) = reference_rotary_embedding_backward(inputs.grad_out, args.positions, args.inv_freq, args.scaling)
    return RotaryEmbeddingGrads(dx)


backends.register(
    backends.Implementation("rotary_embedding", "torch", _reference_forward, backward=_reference_backward)
)


# --------------------------------------------------------------------------------------
# Public function


def _validate(fn: str, x: object, positions: object, inv_freq: object, scaling: object) -> tuple[Tensor, float]:
    """Checks the arguments; returns ``(inv_freq, scaling)`` to use (unit-stride frequencies,
    a Python float)."""
    x = check_tensor(fn, "x", x)
    if x.dim() != 3:
        raise ValueError(f"{fn}(): expected x of shape [T, N, D] (tokens, heads, head dim), got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(
            f"{fn}(): expected x of a floating-point dtype (float16, bfloat16, float32, float64), got {x.dtype}"
        )
    total, _, dim = x.shape
    if dim % 2:
        raise ValueError(f"{fn}(): expected x's head dim D (its last dim) to be even, got shape {tuple(x.shape)}")
    positions = check_tensor(fn, "positions", positions)
    if positions.dtype not in OFFSET_DTYPES:
        raise TypeError(f"{fn}(): expected positions of dtype torch.int32 or torch.int64, got {positions.dtype}")
    if tuple(positions.shape) != (total,):
        raise ValueError(
            f"{fn}(): expected positions of shape ({total},) (one per token of x, the first dim of "
            f"x), got {tuple(positions.shape)}"
        )
    if positions.device != x.device:
        raise ValueError(f"{fn}(): expected positions on {x.device} (the device of x), got {positions.device}")
    inv_freq = check_vector(fn, "inv_freq", inv_freq, dim // 2, x.device, what=" (D/2, half of x's last dim)")
    if not inv_freq.dtype.is_floating_point:
        raise TypeError(f"{fn}(): expected inv_freq of a floating-point dtype (float32), got {inv_freq.dtype}")
    if isinstance(scaling, bool) or not isinstance(scaling, numbers.Real):
        raise TypeError(f"{fn}(): expected scaling to be a float, got {describe(scaling)}")
    scaling = float(scaling)
    if not math.isfinite(scaling):
        raise ValueError(f"{fn}(): expected a finite scaling, got {scaling!r}")
    return inv_freq, scaling


def rotary_embedding(
    x: Tensor, positions: Tensor, inv_freq: Tensor, scaling: float = 1.0, *, backend: str | None = None
) -> Tensor:
    """Rotary position embedding of packed heads, HuggingFace's ``apply_rotary_pos_emb``.

    ``x``: ``[T, N, D]`` float16 / bfloat16 / float32 / float64, ``D`` even, any strides (the
    q and k heads of a fused QKV output, ``qkv.view(T, 3, H, D)[:, :2].flatten(1, 2)``, are
    read in place). ``positions``: ``[T]`` int32 / int64 on x's device, each token's position
    in its sequence (``rt.position_ids()``). ``inv_freq``: ``[D/2]`` floating point (the
    model's ``inv_freq``; read as float32). ``scaling``: multiplies cos and sin (HuggingFace's
    ``attention_scaling``).

    Returns a new contiguous ``[T, N, D]`` tensor of x's dtype: ``x1 * c - x2 * s`` and
    ``x2 * c + x1 * s`` for the halves ``x1``, ``x2`` of the head dim, ``c`` / ``s`` the cos /
    sin of ``positions[t] * inv_freq`` times ``scaling``, computed in float32 (as HuggingFace's
    tables; widened for float64 x, whose products are float64). Differentiable in ``x``
    (``positions`` and ``inv_freq`` get no gradient). No host sync (see :mod:`ragged.ops.rotary`).

    >>> import torch, ragged
    >>> x = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]])          # T=2 tokens, N=1 head, D=2
    >>> out = ragged.rotary_embedding(x, torch.tensor([0, 1]), torch.tensor([torch.pi / 2]))
    >>> out[0]                                                   # position 0: unchanged
    tensor([[1., 0.]])
    >>> torch.allclose(out[1], torch.tensor([[0.0, 1.0]]), atol=1e-6)   # position 1: a quarter turn
    True
    """
    fn = "ragged.rotary_embedding"
    inv_freq, scaling = _validate(fn, x, positions, inv_freq, scaling)
    impl = backends.select_spec("rotary_embedding", backend, RotaryEmbeddingSpec(x.device, x.dtype, x.shape[2]), fn=fn)
    return ROTARY_EMBEDDING(RotaryEmbeddingArgs(x, positions, inv_freq, scaling), impl.name).out
