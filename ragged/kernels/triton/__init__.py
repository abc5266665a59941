"""The ``"triton"`` backend: its implementations, declared as data (nothing here imports Triton).

Each :class:`ragged.backends.Implementation` names its kernels as ``"module:function"``
(imported on the first call) and says what it takes through the op's spec; the device
reason of the backend itself (Triton importable; a CUDA tensor, or a CPU tensor under
``TRITON_INTERPRET=1``) is :func:`ragged.backends.triton_reason`.
"""

from __future__ import annotations

import torch

from ...backends import Implementation, register

_HERE = __name__

# Every dtype but complex: pack and unpack move bytes.


def _real(spec) -> list[str]:
    return [f"complex dtypes are not supported by the kernels (got {spec.dtype})"] if spec.dtype.is_complex else []


register(
    Implementation("pack", "triton", f"{_HERE}.pack:pack", check=_real),
    Implementation("unpack", "triton", f"{_HERE}.pack:unpack", check=_real),
)
