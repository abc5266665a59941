"""The ``"cuda"`` backend: CUDA C++ kernels of ``csrc/`` compiled at first use through CuPy's
NVRTC (:mod:`.launch`), their implementations declared here as data (nothing here imports
CuPy). The backend's device reason is :func:`ragged.backends.cuda_reason`.
"""

from __future__ import annotations

from ...backends import Implementation, register

_HERE = __name__


def _real(spec) -> list[str]:
    return [f"complex dtypes are not supported by the kernels (got {spec.dtype})"] if spec.dtype.is_complex else []


register(
    Implementation("pack", "cuda", f"{_HERE}.pack:pack", check=_real),
    Implementation("unpack", "cuda", f"{_HERE}.pack:unpack", check=_real),
)
