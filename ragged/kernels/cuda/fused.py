"""Launchers of the fused per-token kernels of ``csrc/fused.cu`` (forward only).

* :func:`add_layer_norm_forward`: ``s = x + residual`` (rounded to the storage dtype),
  ``y = (s - mean) * rstd * weight + bias``; one warp per row, the row in registers.
* :func:`bias_act_forward`: ``y = act(x + bias)`` over a contiguous ``[N, F]`` tensor.

Both return exactly what the Triton launchers of :mod:`ragged.kernels.triton.fused` return
(same shapes, dtypes, numerics; ``mean`` / ``rstd`` ``[N]`` float32), so the Triton
backward runs on their outputs. They exist for host time: a launch here costs about 5 us
of CPU, a Triton launch 25-40 us on the H200 machine, and a transformer layer at small
batch is bound by it.

What the kernels take (:func:`add_layer_norm_reasons`, :func:`bias_act_reasons` say why
not otherwise): CUDA tensors of float16, bfloat16 or float32, every tensor of x's dtype;
``F`` a multiple of the 16-byte vector (8 elements for 16-bit types, 4 for float32) and,
for the layer norm, at most ``32 * VEC * 16`` (4096 for 16-bit types, 2048 for float32);
16-byte aligned data pointers and row strides; a contiguous ``x`` for ``bias_act``.

Alignment is a property of the pointers, checked on the host without a sync. Under
``torch.compile`` the reasons see fake tensors and cannot check pointers; the launchers
then check them on the real tensors and hand a misaligned input to the Triton kernel
(which takes any alignment; same results).
"""

from __future__ import annotations

import torch

from ... import backends
from ..._utils import eager
from .launch import Params, launch

_SOURCE = "fused.cu"
# dtype -> (kernel name part, elements per 16-byte vector)
_TYPES = {torch.bfloat16: ("bf16", 8), torch.float16: ("f16", 8), torch.float32: ("f32", 4)}
# Row lengths of the layer norm, in vectors per lane (RAGGED_ADD_LAYER_NORM_ITERS lines of the
# source): 768 bf16 = 3, 1024 = 4, 4096 = 16.
LN_ITERS = (1, 2, 3, 4, 6, 8, 12, 16)
LN_ROWS_PER_BLOCK = 4  # RAGGED_LN_WARPS: one warp per row
BA_THREADS = 256       # RAGGED_BA_THREADS
BA_UNROLL = 4          # RAGGED_BA_UNROLL: vectors per thread per trip
# Grid of the bias_act grid-stride loop: at most this many blocks per multiprocessor
# (8 x 256 threads = 2048, a full H100/H200 SM).
BA_BLOCKS_PER_SM = 8
# Activation name (ragged.ops.fused.ACTIVATIONS) -> kernel name part.
ACTIVATION_NAMES = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_tanh", "none": "none"}

_MAX_GRID = 2**31 - 1
# (x, residual, weight, bias, y, sum, mean, rstd, n_rows, n_cols, stride_x, stride_r, eps)
LN_PARAMS = Params("PPPPPPPPqiqqf")
# (x, bias, y, n_vecs, row_vecs)
BA_PARAMS = Params("PPPqi")


def max_layer_norm_features(dtype: torch.dtype) -> int:
    """The widest layer norm row the kernel keeps in registers (elements)."""
    return 32 * _TYPES[dtype][1] * LN_ITERS[-1]


# --------------------------------------------------------------------------------------
# What the kernels take


def _dtype_reason(what: str, name: str, t: torch.Tensor) -> str | None:
    if t.dtype not in _TYPES:
        return f"the CUDA {what} kernel takes float16, bfloat16 and float32, got {name} of dtype {t.dtype}"
    return None


def _same_dtype_reasons(what: str, x: torch.Tensor, **others) -> list[str]:
    return [f"the CUDA {what} kernel takes {name} of x's dtype {x.dtype}, got {t.dtype}"
            for name, t in others.items() if t is not None and t.dtype != x.dtype]


def _rows_reasons(what: str, name: str, t: torch.Tensor, check_pointer: bool) -> list[str]:
    """``t [..., F]`` read in 16-byte vectors: unit feature stride, aligned row strides and base."""
    out = []
    es = t.element_size()
    if t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        out.append(f"the CUDA {what} kernel needs {name} with unit stride along the features, "
                   f"got stride {t.stride(-1)}")
    bad = [s for size, s in zip(t.shape[:-1], t.stride()[:-1]) if size > 1 and (s * es) % 16]
    if bad:
        out.append(f"the CUDA {what} kernel needs {name}'s row strides to be multiples of 16 bytes, "
                   f"got {bad[0] * es} bytes")
    if check_pointer and t.numel() and t.data_ptr() % 16:
        out.append(f"the CUDA {what} kernel needs {name} 16-byte aligned, got an address {t.data_ptr() % 16} "
                   f"bytes past a multiple of 16")
    return out


# The reasons run on every call of an op under "auto", so the common case (the kernel takes
# the input) is answered by a few attribute reads (*_takes, about 3 us on a slow host against
# 10 us for the full list); the messages are built only when something is wrong.
_cuda_usable: list[bool] = []  # [whether backends.cuda_reason passes for CUDA tensors], once known


def _on_usable_cuda(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    if not _cuda_usable:
        _cuda_usable.append(backends.cuda_reason(device) is None)
    return _cuda_usable[0]


def _layer_norm_takes(x, residual, weight, bias) -> bool:
    # Plain tensors only (pointers to read; under torch.compile the full list answers).
    if not eager(*[t for t in (x, residual, weight, bias) if t is not None]):
        return False
    dtype = x.dtype
    info = _TYPES.get(dtype)
    if info is None or x.dim() != 2 or not _on_usable_cuda(x.device):
        return False
    vec = info[1]
    n_rows, n_cols = x.shape
    if n_cols % vec or n_cols > 32 * vec * LN_ITERS[-1] or x.stride(1) != 1:
        return False
    ptrs = x.data_ptr()
    strides = x.stride(0) if n_rows > 1 else 0
    if residual is not None:
        if residual.dtype != dtype or residual.dim() != 2 or residual.stride(1) != 1:
            return False
        ptrs |= residual.data_ptr()
        strides |= residual.stride(0) if n_rows > 1 else 0
    for p in (weight, bias):
        if p is not None:
            if p.dtype != dtype or p.dim() != 1 or p.stride(0) != 1:
                return False
            ptrs |= p.data_ptr()
    # row strides in elements: a multiple of the vector <=> a multiple of 16 bytes
    return not (ptrs & 15) and not (strides % vec) and -(-n_rows // LN_ROWS_PER_BLOCK) <= _MAX_GRID


def _bias_act_takes(x, bias, activation) -> bool:
    if not eager(*([x] if bias is None else [x, bias])):
        return False
    dtype = x.dtype
    info = _TYPES.get(dtype)
    if info is None or activation not in ACTIVATION_NAMES or not _on_usable_cuda(x.device):
        return False
    if x.dim() < 1 or x.shape[-1] % info[1] or not x.is_contiguous():
        return False
    ptrs = x.data_ptr()
    if bias is not None:
        if bias.dtype != dtype or bias.dim() != 1 or bias.stride(0) != 1:
            return False
        ptrs |= bias.data_ptr()
    return not (ptrs & 15)


def add_layer_norm_reasons(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                           bias: torch.Tensor | None) -> list[str]:
    """Every reason the CUDA add + LayerNorm kernel cannot take this input (empty: it can)."""
    if _layer_norm_takes(x, residual, weight, bias):
        return []
    return _layer_norm_reasons(x, residual, weight, bias)


def _layer_norm_reasons(x, residual, weight, bias) -> list[str]:
    what = "add_layer_norm"
    out = [r for r in (backends.cuda_reason(x.device), _dtype_reason(what, "x", x)) if r]
    out += _same_dtype_reasons(what, x, residual=residual, weight=weight, bias=bias)
    if x.dtype in _TYPES and x.dim() >= 1:
        n_cols, vec = x.shape[-1], _TYPES[x.dtype][1]
        if n_cols % vec:
            out.append(f"the CUDA {what} kernel takes a feature count that is a multiple of {vec} for {x.dtype}, "
                       f"got {n_cols}")
        limit = max_layer_norm_features(x.dtype)
        if n_cols > limit:
            out.append(f"the CUDA {what} kernel takes at most {limit} features for {x.dtype}, got {n_cols}")
        n_rows = x.numel() // n_cols if n_cols else 0
        if -(-n_rows // LN_ROWS_PER_BLOCK) > _MAX_GRID:
            out.append(f"the CUDA {what} kernel takes at most {_MAX_GRID * LN_ROWS_PER_BLOCK} rows, got {n_rows}")
    check_pointer = eager(*[t for t in (x, residual, weight, bias) if t is not None])
    for name, t in (("x", x), ("residual", residual), ("weight", weight), ("bias", bias)):
        if t is not None:
            out += _rows_reasons(what, name, t, check_pointer)
    return out


def bias_act_reasons(x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> list[str]:
    """Every reason the CUDA bias + activation kernel cannot take this input (empty: it can)."""
    if _bias_act_takes(x, bias, activation):
        return []
    return _bias_act_reasons(x, bias, activation)


def _bias_act_reasons(x, bias, activation) -> list[str]:
    what = "bias_act"
    out = [r for r in (backends.cuda_reason(x.device), _dtype_reason(what, "x", x)) if r]
    out += _same_dtype_reasons(what, x, bias=bias)
    if activation not in ACTIVATION_NAMES:
        out.append(f"the CUDA {what} kernel takes activations {tuple(ACTIVATION_NAMES)}, got {activation!r}")
    if x.dtype in _TYPES and x.dim() >= 1:
        vec = _TYPES[x.dtype][1]
        if x.shape[-1] % vec:
            out.append(f"the CUDA {what} kernel takes a feature count that is a multiple of {vec} for {x.dtype}, "
                       f"got {x.shape[-1]}")
    if not x.is_contiguous():
        out.append(f"the CUDA {what} kernel needs a contiguous x, got strides {tuple(x.stride())}")
    check_pointer = eager(*[t for t in (x, bias) if t is not None])
    if check_pointer and x.numel() and x.data_ptr() % 16:
        out.append(f"the CUDA {what} kernel needs x 16-byte aligned, got an address {x.data_ptr() % 16} "
                   f"bytes past a multiple of 16")
    if bias is not None:
        out += _rows_reasons(what, "bias", bias, check_pointer)
    return out


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
# Launchers. 2-D inputs with unit feature stride and unit-stride parameters (ragged.ops.fused
# ensures both; a direct call with another layout goes to the Triton launcher).


def _unit_strides(x: torch.Tensor | None, residual: torch.Tensor | None, *params: torch.Tensor | None) -> bool:
    """Whether the kernels can read these tensors: ``x`` / ``residual`` with unit feature
    stride, the 1-D parameters with unit stride (they are read as ``ptr + i``)."""
    for t in (x, residual):
        if t is not None and t.shape[1] > 1 and t.stride(1) != 1:
            return False
    return all(p is None or p.shape[0] <= 1 or p.stride(0) == 1 for p in params)


def _triton_add_layer_norm(*args):
    from ..triton.fused import add_layer_norm_forward

    return add_layer_norm_forward(*args)


def add_layer_norm_forward(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                           bias: torch.Tensor | None, eps: float, return_sum: bool, *, stats: bool = True):
    """``(y, s, mean, rstd)`` as :func:`ragged.kernels.triton.fused.add_layer_norm_forward`:
    ``y`` ``[N, F]`` in x's dtype, ``s`` ``[N, F]`` (an empty ``(0,)`` tensor unless
    ``return_sum``), ``mean`` / ``rstd`` ``[N]`` float32. ``stats=False`` (inference) skips
    writing the statistics and returns empty ``(0,)`` tensors for them."""
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
        return y, s, mean, rstd
    px = x.data_ptr()
    pr = residual.data_ptr() if residual is not None else 0
    pw = weight.data_ptr() if weight is not None else 0
    pb = bias.data_ptr() if bias is not None else 0
    es = x.element_size()
    stride_x = x.stride(0)
    stride_r = residual.stride(0) if residual is not None else 0
    if (px | pr | pw | pb) & 15 or (n_rows > 1 and ((stride_x * es) & 15 or (stride_r * es) & 15)) \
            or not _unit_strides(x, residual, weight, bias):
        # Only reachable when the reasons could not look at the pointers (torch.compile), or
        # from a direct call with a layout the kernel does not read: Triton takes any.
        return _triton_add_layer_norm(x, residual, weight, bias, eps, return_sum)
    kernel = layer_norm_config(dtype, n_cols)[0]
    args = (px, pr, pw, pb, y.data_ptr(), s.data_ptr() if return_sum else 0, mean.data_ptr() if stats else 0,
            rstd.data_ptr() if stats else 0, n_rows, n_cols, stride_x, stride_r, eps)
    launch(_SOURCE, kernel, device, -(-n_rows // LN_ROWS_PER_BLOCK), (LN_ROWS_PER_BLOCK * 32, 1), LN_PARAMS, args)
    return y, s, mean, rstd


def add_layer_norm_inference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                             bias: torch.Tensor | None, eps: float, return_sum: bool):
    """``(y, s or None)``: :func:`add_layer_norm_forward` without statistics, for inputs the
    kernel takes as the caller has checked (``x`` and ``residual`` ``[N, F]`` contiguous,
    ``N > 0``, every tensor x's dtype, 16-byte aligned, weight and bias contiguous): one or
    two allocations and the launch, nothing else."""
    n_rows, n_cols = x.shape
    y = torch.empty_like(x)
    s = torch.empty_like(x) if return_sum else None
    args = (x.data_ptr(), 0 if residual is None else residual.data_ptr(), 0 if weight is None else weight.data_ptr(),
            0 if bias is None else bias.data_ptr(), y.data_ptr(), 0 if s is None else s.data_ptr(), 0, 0, n_rows,
            n_cols, n_cols, n_cols, eps)
    launch(_SOURCE, layer_norm_config(x.dtype, n_cols)[0], x.device, -(-n_rows // LN_ROWS_PER_BLOCK),
           (LN_ROWS_PER_BLOCK * 32, 1), LN_PARAMS, args)
    return y, s


def bias_act_forward(x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """``act(x + bias)`` as :func:`ragged.kernels.triton.fused.bias_act_forward`: ``[N, F]``
    contiguous, x's dtype."""
    n_rows, n_cols = x.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    n = n_rows * n_cols
    if n == 0:
        return y
    px = x.data_ptr()
    pb = bias.data_ptr() if bias is not None else 0
    if (px | pb) & 15 or not x.is_contiguous() or not _unit_strides(None, None, bias):
        # Only reachable when the reasons could not look at the pointers (torch.compile), or
        # from a direct call with a layout the kernel does not read: Triton takes any.
        from ..triton.fused import bias_act_forward as triton_forward

        return triton_forward(x, bias, activation)
    kernel, vec = bias_act_kernel(x.dtype, activation)
    n_vecs = n // vec
    launch(_SOURCE, kernel, x.device, bias_act_grid(n_vecs, x.device), (BA_THREADS, 1), BA_PARAMS,
           (px, pb, y.data_ptr(), n_vecs, n_cols // vec))
    return y
