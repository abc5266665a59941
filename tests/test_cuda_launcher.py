"""Host-side logic of the CUDA launcher (runs without a GPU)."""

import re

import numpy as np
import pytest
import torch

from ragged.kernels import cuda as kc


def test_every_kernel_the_launcher_asks_for_exists_in_the_source():
    src = kc.source("pack.cu")
    declared = set(re.findall(r"RAGGED_PACK_FOR_OFFSETS\(\s*[\w ]+,\s*(v\d+)\)", src))
    assert declared == set(kc._VEC_NAMES.values())
    assert "RAGGED_PACK_KERNELS(VEC, VNAME, int, i32)" in src
    assert "RAGGED_PACK_KERNELS(VEC, VNAME, long long, i64)" in src
    assert f"#define RAGGED_UNROLL {kc._UNROLL}" in src
    assert f"__launch_bounds__({kc._THREADS})" in src


@pytest.mark.parametrize("quantities,expected", [
    ((2048, 0, 4096), 16), ((2048, 8), 8), ((6, 0), 2), ((3,), 1), ((16, 16, 4), 4), ((32, 48), 16),
])
def test_vector_width(quantities, expected):
    assert kc._vec_bytes(*quantities) == expected


@pytest.mark.parametrize("row_vecs", [1, 2, 3, 5, 8, 100, 128, 129, 4096])
def test_layout_covers_a_row_and_fills_the_block(row_vecs):
    lanes, rows = kc._layout(row_vecs)
    assert lanes * rows == kc._THREADS
    assert 1 <= lanes <= 32 and lanes & (lanes - 1) == 0
    assert lanes * kc._UNROLL >= min(row_vecs, 32 * kc._UNROLL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                   torch.int8, torch.bool])
@pytest.mark.parametrize("value", [0.0, 1.0, -2.5, float("nan"), float("-inf")])
def test_fill_words_repeat_the_element_bit_pattern(dtype, value):
    if not dtype.is_floating_point and (value != value or value in (float("-inf"), -2.5)):
        pytest.skip("not representable")
    words = kc._fill_words(value, dtype)
    raw = torch.from_numpy(np.array(words, dtype=np.uint32).view(np.int32).copy()).view(dtype)
    expected = torch.full_like(raw, value)
    assert torch.equal(raw.view(torch.uint8), expected.view(torch.uint8))
