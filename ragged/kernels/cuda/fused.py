"""Launchers of the per-token kernels of ``csrc/fused.cu`` (forward only): the ``"cuda"``
implementations of ``bias_act`` and ``add_layer_norm``, declared with what they take in
:mod:`ragged.kernels.cuda` (their backward is Triton's).

* :func:`add_layer_norm_forward`: ``s = x + residual`` (rounded to the storage dtype),
  ``y = (s - mean) * rstd * weight + bias``; one warp per row, the row in registers.
  :func:`add_layer_norm_inference` is the same without statistics and without checks.
* :func:`bias_act_forward`: ``y = act(x + bias)`` over a contiguous ``[N, F]`` tensor.

Both return exactly what the Triton launchers of :mod:`ragged.kernels.triton.fused` return
(same shapes, dtypes, numerics; ``mean`` / ``rstd`` ``[N]`` float32), so the Triton
backward runs on their outputs. They exist for host time: a launch here costs a fraction
of a Triton launch's, and a transformer layer at small batch is bound by it.

What the kernels take (the declaration's reasons; ``ragged.explain`` lists them): every
tensor of x's dtype (float16, bfloat16 or float32); ``F`` a multiple of the 16-byte vector
(8 elements for 16-bit types, 4 for float32) and, for the layer norm, at most
:func:`max_layer_norm_features`; a contiguous ``x`` for ``bias_act``; data that 16-byte
vector loads read in place (aligned pointers and row strides, unit stride along the
features). Pointers are known only to eager calls: under ``torch.compile`` the reasons cannot
see them, and a launcher handed a tensor it cannot read in place (or called directly with
one) reads an aligned dense copy of it instead; no input goes to another backend from here.
"""

from __future__ import annotations

from typing import cast

import torch

from ...records.fused import AddLayerNormArgs, AddLayerNormOutput, BiasActArgs, BiasActOutput
from . import FUSED_ACTIVATIONS, FUSED_VECTOR
from . import FUSED_LN_ITERS as LN_ITERS
from . import FUSED_LN_ROWS_PER_BLOCK as LN_ROWS_PER_BLOCK
from . import fused_max_features as max_layer_norm_features
from .launch import Params, launch

__all__ = ["add_layer_norm_forward", "add_layer_norm_inference", "bias_act_forward", "max_layer_norm_features"]

_SOURCE = "fused.cu"
_TYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
# dtype -> (kernel name part, elements per 16-byte vector)
_TYPES = {dtype: (_TYPE_NAMES[dtype], vec) for dtype, vec in FUSED_VECTOR.items()}
BA_THREADS = 256  # RAGGED_BA_THREADS
BA_UNROLL = 4  # RAGGED_BA_UNROLL: vectors per thread per trip
# Grid of the bias_act grid-stride loop: at most this many blocks per multiprocessor
# (8 x 256 threads = 2048, a full H100/H200 SM).
BA_BLOCKS_PER_SM = 8
# Activation name (ragged.ops.fused.ACTIVATIONS) -> kernel name part.
ACTIVATION_NAMES = {name: name for name in FUSED_ACTIVATIONS}

# (x, residual, weight, bias, y, sum, mean, rstd, n_rows, n_cols, stride_x, stride_r, eps)
LN_PARAMS = Params("PPPPPPPPqiqqf")
# (x, bias, y, n_vecs, row_vecs)
BA_PARAMS = Params("PPPqi")


# --------------------------------------------------------------------------------------
# Launch configurations (cached: the launchers do no Python work beyond dict lookups)

_ln_configs: dict[tuple[torch.dtype, int], tuple[str, int]] = {}
_ba_kernels: dict[tuple[torch.dtype, str], tuple[str, int]] = {}
_multiprocessors: dict[int, int] = {}


def layer_norm_config(dtype: torch.dtype, n_cols: int) -> tuple[str, int]:
    """(kernel name, elements per vector): the smallest ITERS with ``32 * VEC * ITERS >= n_cols``."""
    key = (dtype, n_cols)
    config = _ln_configs.get(key)
    if config is None:
        tname, vec = _TYPES[dtype]
        iters = next(i for i in LN_ITERS if 32 * vec * i >= n_cols)
        config = _ln_configs[key] = (f"ragged_add_layer_norm_{tname}_i{iters}", vec)
    return config


def bias_act_kernel(dtype: torch.dtype, activation: str) -> tuple[str, int]:
    """(kernel name, elements per vector)."""
    key = (dtype, activation)
    config = _ba_kernels.get(key)
    if config is None:
        tname, vec = _TYPES[dtype]
        config = _ba_kernels[key] = (f"ragged_bias_act_{tname}_{ACTIVATION_NAMES[activation]}", vec)
    return config


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = _multiprocessors.get(index)
    if n is None:
        n = _multiprocessors[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


def bias_act_grid(n_vecs: int, device: torch.device) -> int:
    return max(1, min(-(-n_vecs // (BA_THREADS * BA_UNROLL)), BA_BLOCKS_PER_SM * _sm_count(device)))


# --------------------------------------------------------------------------------------
# Launchers. Their fast path takes 2-D inputs with unit feature stride, aligned rows and
# unit-stride parameters (ragged.ops.fused hands the layouts over so, and the reasons keep
# misaligned data away in eager calls); anything else is copied first (see the docstring).


def _unit_strides(x: torch.Tensor | None, residual: torch.Tensor | None, *params: torch.Tensor | None) -> bool:
    """Whether the kernels can read these tensors: ``x`` / ``residual`` with unit feature
    stride, the 1-D parameters with unit stride (they are read as ``ptr + i``)."""
    for t in (x, residual):
        if t is not None and t.shape[1] > 1 and t.stride(1) != 1:
            return False
    return all(p is None or p.shape[0] <= 1 or p.stride(0) == 1 for p in params)


def _readable(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` if 16-byte vector loads read it in place (aligned data, unit stride along the
    features, rows a multiple of 16 bytes apart), else a dense copy in fresh memory (which the
    caching allocator aligns far past 16 bytes)."""
    if t is None:
        return None
    ok = not t.data_ptr() & 15 and (t.shape[-1] <= 1 or t.stride(-1) == 1)
    if ok and t.dim() == 2 and t.shape[0] > 1:
        ok = not (t.stride(0) * t.element_size()) & 15
    return t if ok else t.clone(memory_format=torch.contiguous_format)


def add_layer_norm_forward(args: AddLayerNormArgs, *, stats: bool = True) -> AddLayerNormOutput:
    """``(y, s, mean, rstd)`` as :func:`ragged.kernels.triton.fused.add_layer_norm_forward`:
    ``x`` / ``residual`` ``[N, F]``, ``weight`` / ``bias`` ``[F]`` (or None), all of x's dtype;
    ``y`` ``[N, F]`` in x's dtype, ``s`` ``[N, F]`` (an empty ``(0,)`` tensor unless
    ``return_sum``), ``mean`` / ``rstd`` ``[N]`` float32. ``stats=False`` (inference) skips
    writing the statistics and returns empty ``(0,)`` tensors for them."""
    x, residual, weight, bias = args.x, args.residual, args.weight, args.bias
    eps, return_sum = args.eps, args.return_sum
    n_rows, n_cols = x.shape
    dtype, device = x.dtype, x.device
    y = torch.empty((n_rows, n_cols), dtype=dtype, device=device)
    s = torch.empty((n_rows, n_cols) if return_sum else (0,), dtype=dtype, device=device)
    if stats:
        mean = torch.empty((n_rows,), dtype=torch.float32, device=device)
        rstd = torch.empty((n_rows,), dtype=torch.float32, device=device)
    else:
        mean = rstd = torch.empty((0,), dtype=torch.float32, device=device)
    if n_rows == 0:
        return AddLayerNormOutput(y, s, mean, rstd)
    px = x.data_ptr()
    pr = residual.data_ptr() if residual is not None else 0
    pw = weight.data_ptr() if weight is not None else 0
    pb = bias.data_ptr() if bias is not None else 0
    es = x.element_size()
    stride_x = x.stride(0)
    stride_r = residual.stride(0) if residual is not None else 0
    if (
        (px | pr | pw | pb) & 15
        or (n_rows > 1 and ((stride_x * es) & 15 or (stride_r * es) & 15))
        or not _unit_strides(x, residual, weight, bias)
    ):
        # Only reachable when the reasons could not look at the pointers (torch.compile), or
        # from a direct call with a layout the kernel does not read: read aligned copies.
        x = cast(torch.Tensor, _readable(x))
        residual, weight, bias = (_readable(t) for t in (residual, weight, bias))
        px, stride_x = x.data_ptr(), x.stride(0)
        pr, stride_r = (residual.data_ptr(), residual.stride(0)) if residual is not None else (0, 0)
        pw = weight.data_ptr() if weight is not None else 0
        pb = bias.data_ptr() if bias is not None else 0
    kernel = layer_norm_config(dtype, n_cols)[0]
    params = (
        px,
        pr,
        pw,
        pb,
        y.data_ptr(),
        s.data_ptr() if return_sum else 0,
        mean.data_ptr() if stats else 0,
        rstd.data_ptr() if stats else 0,
        n_rows,
        n_cols,
        stride_x,
        stride_r,
        eps,
    )
    launch(_SOURCE, kernel, device, -(-n_rows // LN_ROWS_PER_BLOCK), (LN_ROWS_PER_BLOCK * 32, 1), LN_PARAMS, params)
    return AddLayerNormOutput(y, s, mean, rstd)


def add_layer_norm_inference(args: AddLayerNormArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y, s or None)``: :func:`add_layer_norm_forward` without statistics, for inputs the
    kernel takes as the caller has checked (``x`` and ``residual`` ``[N, F]`` contiguous,
    ``N > 0``, every tensor x's dtype, 16-byte aligned, weight and bias contiguous): one or
    two allocations and the launch, nothing else."""
    x, residual, weight, bias = args.x, args.residual, args.weight, args.bias
    n_rows, n_cols = x.shape
    y = torch.empty_like(x)
    s = torch.empty_like(x) if args.return_sum else None
    params = (
        x.data_ptr(),
        0 if residual is None else residual.data_ptr(),
        0 if weight is None else weight.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        0 if s is None else s.data_ptr(),
        0,
        0,
        n_rows,
        n_cols,
        n_cols,
        n_cols,
        args.eps,
    )
    launch(
        _SOURCE,
        layer_norm_config(x.dtype, n_cols)[0],
        x.device,
        -(-n_rows // LN_ROWS_PER_BLOCK),
        (LN_ROWS_PER_BLOCK * 32, 1),
        LN_PARAMS,
        params,
    )
    return y, s


def bias_act_forward(args: BiasActArgs) -> BiasActOutput:
    """``act(x + bias)`` as :func:`ragged.kernels.triton.fused.bias_act_forward`: ``x [N, F]``
    and ``bias [F]`` (or None) of one dtype -> ``[N, F]`` contiguous, x's dtype."""
    x, bias, activation = args.x, args.bias, args.activation
    n_rows, n_cols = x.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    n = n_rows * n_cols
    if n == 0:
        return BiasActOutput(y)
    px = x.data_ptr()
    pb = bias.data_ptr() if bias is not None else 0
    if (px | pb) & 15 or not x.is_contiguous() or not _unit_strides(None, None, bias):
        # Only reachable when the reasons could not look at the pointers (torch.compile), or
        # from a direct call with a layout the kernel does not read: read aligned copies.
        if px & 15 or not x.is_contiguous():
            x = x.clone(memory_format=torch.contiguous_format)
        bias = _readable(bias)
        px, pb = x.data_ptr(), bias.data_ptr() if bias is not None else 0
    kernel, vec = bias_act_kernel(x.dtype, activation)
    n_vecs = n // vec
    launch(
        _SOURCE,
        kernel,
        x.device,
        bias_act_grid(n_vecs, x.device),
        (BA_THREADS, 1),
        BA_PARAMS,
        (px, pb, y.data_ptr(), n_vecs, n_cols // vec),
    )
    return BiasActOutput(y)
