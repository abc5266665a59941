"""Host-side logic of the CUDA launcher (runs without a GPU)."""

import ctypes
import re

import numpy as np
import pytest
import torch

from ragged.kernels.cuda import launch as kc
from ragged.kernels.cuda import pack as kp


def test_every_kernel_the_launcher_asks_for_exists_in_the_source():
    src = kc.source("pack.cu")
    declared = set(re.findall(r"RAGGED_PACK_FOR_OFFSETS\(\s*[\w ]+,\s*(v\d+)\)", src))
    assert declared == set(kp._VEC_NAMES.values())
    assert "RAGGED_PACK_KERNELS(VEC, VNAME, int, i32)" in src
    assert "RAGGED_PACK_KERNELS(VEC, VNAME, long long, i64)" in src
    assert f"#define RAGGED_UNROLL {kp._UNROLL}" in src
    assert f"__launch_bounds__({kp._THREADS})" in src


@pytest.mark.parametrize(
    "quantities,expected",
    [
        ((2048, 0, 4096), 16),
        ((2048, 8), 8),
        ((6, 0), 2),
        ((3,), 1),
        ((16, 16, 4), 4),
        ((32, 48), 16),
    ],
)
def test_vector_width(quantities, expected):
    assert kp._vec_bytes(*quantities) == expected


@pytest.mark.parametrize("row_vecs", [1, 2, 3, 5, 8, 100, 128, 129, 4096])
def test_layout_covers_a_row_and_fills_the_block(row_vecs):
    lanes, rows = kp._layout(row_vecs)
    assert lanes * rows == kp._THREADS
    assert 1 <= lanes <= 32 and lanes & (lanes - 1) == 0
    assert lanes * kp._UNROLL >= min(row_vecs, 32 * kp._UNROLL)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.bool]
)
@pytest.mark.parametrize("value", [0.0, 1.0, -2.5, float("nan"), float("-inf")])
def test_fill_words_repeat_the_element_bit_pattern(dtype, value):
    if not dtype.is_floating_point and (value != value or value in (float("-inf"), -2.5)):
        pytest.skip("not representable")
    words = kp._fill_words(value, dtype)
    raw = torch.from_numpy(np.array(words, dtype=np.uint32).view(np.int32).copy()).view(dtype)
    expected = torch.full_like(raw, value)
    assert torch.equal(raw.view(torch.uint8), expected.view(torch.uint8))


# --------------------------------------------------------------------------------------
# Parameter lists: the packed buffer against the C layout, the codes against the sources


_CTYPES = {"P": ctypes.c_uint64, "q": ctypes.c_int64, "i": ctypes.c_int32, "I": ctypes.c_uint32, "f": ctypes.c_float}


@pytest.mark.parametrize("codes", ["PPPqi", "PPPPPPPPqiqqf", "PPPPPPPiiiqqqqqqfi", "PPPqqqiIIII", "iqifP", "fIqq", "i"])
def test_params_pack_as_a_c_struct_of_the_parameters(codes):
    rng = np.random.default_rng(len(codes))
    values = []
    for c in codes:
        if c == "f":
            values.append(float(np.float32(rng.standard_normal())))
        elif c in "PI":
            values.append(int(rng.integers(0, 2**32 if c == "I" else 2**63)))
        else:
            bits = 31 if c == "i" else 63
            values.append(int(rng.integers(-(2**bits), 2**bits)))

    class Struct(ctypes.Structure):
        _fields_ = [(f"a{i}", _CTYPES[c]) for i, c in enumerate(codes)]

    expected = bytes(Struct(*values))
    params = kc.Params(codes)
    packed = params.pack(values)
    assert packed == expected[: len(packed)] and params.size.value == len(packed)
    assert len(expected) - len(packed) < 8  # at most the struct's tail padding
    scalars = params.scalars(values)
    assert [type(s) for s in scalars] == [kc._NUMPY_TYPES[c] for c in codes]
    assert [s.item() for s in scalars] == values


def test_params_reject_unknown_codes():
    with pytest.raises(ValueError, match="unknown parameter codes"):
        kc.Params("Pd")


_C_CODES = {"i64": "q", "long long": "q", "int": "i", "unsigned int": "I", "float": "f"}


def _codes_of(declaration: str) -> str:
    out = []
    for param in declaration.replace("\\", " ").split(","):
        param = " ".join(param.split())
        if "*" in param:
            out.append("P")
        else:
            ctype = param.rsplit(" ", 1)[0].replace("const ", "")
            out.append(_C_CODES[ctype])
    return "".join(out)


def _signature(src: str, kernel_prefix: str) -> str:
    m = re.search(re.escape(kernel_prefix) + r"[\w#]*\(([^)]*)\)", src)
    assert m, kernel_prefix
    return m.group(1)


def test_every_launcher_param_list_matches_its_kernel():
    from ragged.kernels.cuda import attention as cuda_attention
    from ragged.kernels.cuda import fused as cuda_fused

    fused = kc.source("fused.cu")
    assert _codes_of(_signature(fused, "ragged_add_layer_norm_")) == cuda_fused.LN_PARAMS.codes
    assert _codes_of(_signature(fused, "ragged_bias_act_")) == cuda_fused.BA_PARAMS.codes
    pack = kc.source("pack.cu")
    assert _codes_of(_signature(pack, "ragged_pack_")) == kp._PACK_PARAMS.codes
    assert _codes_of(_signature(pack, "ragged_unpack_")) == kp._UNPACK_PARAMS.codes
    attention = kc.source("attention_short.cu")
    m = re.search(r"#define RAGGED_ATTENTION_PARAMS\s*\\\n(.*?)\n\n", attention, re.S)
    assert _codes_of(m.group(1)) == cuda_attention.PARAMS.codes
