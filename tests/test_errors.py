"""Bad inputs: each raises ValueError/TypeError naming the function and the argument.

The ``match`` patterns ask for the function's name and the argument's name in the
message (and, where it is cheap to say, what was expected and what came).
"""

import os
import re

import numpy as np
import pytest
import torch

import ragged
from ragged import RaggedTensor


def _rt(lengths=(2, 0, 3), feat=(2,)):
    return RaggedTensor.from_lengths(torch.randn(sum(lengths), *feat), list(lengths))


FROM_OFFSETS = r"RaggedTensor\.from_offsets"
FROM_LENGTHS = r"RaggedTensor\.from_lengths"
PACK = r"ragged\.pack"
UNPACK = r"ragged\.unpack"


# --------------------------------------------------------------------------------------
# Offsets


@pytest.mark.parametrize(
    "offsets,pattern",
    [
        ([1, 2, 5], r"offsets\[0\].*got 1"),
        ([-1, 2, 5], r"offsets\[0\].*got -1"),
        ([0, 3, 2, 5], r"non-decreasing.*offsets"),
        ([0, 2, 4], r"offsets\[-1\].*5.*got 4"),
        ([0, 2, 6], r"offsets\[-1\].*5.*got 6"),
    ],
    ids=["start1", "start_neg", "decreasing", "end_short", "end_long"],
)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_from_offsets_bad_values(offsets, pattern, dtype):
    with pytest.raises(ValueError, match=FROM_OFFSETS + r".*" + pattern):
        RaggedTensor.from_offsets(torch.randn(5, 2), torch.tensor(offsets, dtype=dtype))


def test_from_cu_seqlens_bad_values():
    with pytest.raises(ValueError, match=r"ragged\.from_cu_seqlens\(\).*cu_seqlens\[0\]"):
        ragged.from_cu_seqlens(torch.randn(5, 2), torch.tensor([1, 2, 5], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8, torch.bool])
def test_from_offsets_wrong_dtype(dtype):
    offsets = torch.tensor([0, 2, 5]).to(dtype)
    with pytest.raises(TypeError, match=FROM_OFFSETS + r".*offsets.*int32.*int64.*" + re.escape(str(dtype))):
        RaggedTensor.from_offsets(torch.randn(5, 2), offsets)


def test_from_offsets_wrong_shape():
    with pytest.raises(ValueError, match=FROM_OFFSETS + r".*offsets.*1-D"):
        RaggedTensor.from_offsets(torch.randn(5, 2), torch.tensor([[0, 2, 5]], dtype=torch.int32))
    with pytest.raises(ValueError, match=FROM_OFFSETS + r".*offsets"):
        RaggedTensor.from_offsets(torch.randn(5, 2), torch.zeros(0, dtype=torch.int32))


def test_from_offsets_not_a_tensor():
    with pytest.raises(TypeError, match=FROM_OFFSETS + r".*offsets.*torch\.Tensor.*list"):
        RaggedTensor.from_offsets(torch.randn(5, 2), [0, 2, 5])
    with pytest.raises(TypeError, match=FROM_OFFSETS + r".*values.*torch\.Tensor"):
        RaggedTensor.from_offsets([1.0, 2.0], torch.tensor([0, 2], dtype=torch.int32))


def test_values_offsets_different_devices():
    values = torch.empty(5, 2, device="meta")
    offsets = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=FROM_OFFSETS + r".*values.*offsets.*meta.*cpu"):
        RaggedTensor.from_offsets(values, offsets, max_len=3, validate=False)
    with pytest.raises(ValueError, match=FROM_OFFSETS + r".*values.*offsets.*(meta.*cpu|cpu.*meta)"):
        RaggedTensor.from_offsets(torch.randn(5, 2), offsets.to("meta"), max_len=3, validate=False)


def test_from_offsets_max_len_too_small():
    with pytest.raises(ValueError, match=FROM_OFFSETS + r".*max_len.*3.*got 2"):
        RaggedTensor.from_offsets(torch.randn(5, 2), torch.tensor([0, 2, 5], dtype=torch.int32), max_len=2)


def test_values_zero_dim():
    with pytest.raises(ValueError, match=FROM_LENGTHS + r".*values"):
        RaggedTensor.from_lengths(torch.tensor(1.0), [1])
    with pytest.raises(ValueError, match=FROM_OFFSETS + r".*values"):
        RaggedTensor.from_offsets(torch.tensor(1.0), torch.tensor([0, 1], dtype=torch.int32))


# --------------------------------------------------------------------------------------
# Lengths


@pytest.mark.parametrize(
    "lengths", [[2, -1, 4], np.array([2, -1, 4]), torch.tensor([2, -1, 4])], ids=["list", "numpy", "tensor"]
)
def test_negative_lengths_pack(lengths):
    with pytest.raises(ValueError, match=PACK + r".*lengths\[1\].*-1"):
        ragged.pack(torch.randn(3, 4, 2), lengths=lengths)


def test_negative_lengths_from_lengths():
    with pytest.raises(ValueError, match=FROM_LENGTHS + r".*lengths.*>= 0.*lengths\[0\] = -2"):
        RaggedTensor.from_lengths(torch.randn(3, 2), [-2, 5])


def test_lengths_longer_than_padded_width():
    with pytest.raises(ValueError, match=PACK + r".*x\.shape\[1\].*4.*lengths\[1\] = 6"):
        ragged.pack(torch.randn(3, 4, 2), lengths=[2, 6, 1])
    with pytest.raises(ValueError, match=PACK + r".*x\.shape\[1\].*lengths\[1\]"):
        ragged.pack(torch.randn(3, 4, 2), lengths=[2, 6, 1], padding_side="left")


def test_lengths_count_mismatch():
    with pytest.raises(ValueError, match=PACK + r".*3 lengths.*got 2"):
        ragged.pack(torch.randn(3, 4, 2), lengths=[2, 1])


def test_lengths_sum_mismatch():
    with pytest.raises(ValueError, match=FROM_LENGTHS + r".*lengths.*values\.shape\[0\].*5.*got 6"):
        RaggedTensor.from_lengths(torch.randn(5, 2), [3, 3])


@pytest.mark.parametrize(
    "lengths", [[1.5, 2], torch.tensor([1.0, 2.0]), ["a", 1], [True, 1]], ids=["float", "float_tensor", "str", "bool"]
)
def test_non_integer_lengths(lengths):
    with pytest.raises(TypeError, match=FROM_LENGTHS + r".*lengths"):
        RaggedTensor.from_lengths(torch.randn(3, 2), lengths)


@pytest.mark.parametrize("lengths", [torch.tensor([[1, 2]]), np.array([[1, 2]])], ids=["tensor", "numpy"])
def test_two_dim_lengths(lengths):
    with pytest.raises(ValueError, match=PACK + r".*1-D lengths.*\(1, 2\)"):
        ragged.pack(torch.randn(2, 3, 2), lengths=lengths)


def test_lengths_wrong_type():
    with pytest.raises(TypeError, match=PACK + r".*lengths"):
        ragged.pack(torch.randn(2, 3, 2), lengths="12")


def test_from_lengths_max_len_too_small():
    with pytest.raises(ValueError, match=FROM_LENGTHS + r".*max_len.*4.*got 3"):
        RaggedTensor.from_lengths(torch.randn(6, 2), [2, 4], max_len=3)


# --------------------------------------------------------------------------------------
# Masks


@pytest.mark.parametrize("arg", ["mask", "attention_mask"])
@pytest.mark.parametrize("shape", [(3, 5), (2, 4), (3, 4, 1), (4,)], ids=str)
def test_mask_shape_mismatch(arg, shape):
    x = torch.randn(3, 4, 2)
    m = torch.zeros(shape, dtype=torch.bool)
    with pytest.raises(ValueError, match=PACK + r".*" + arg + r".*\(3, 4\).*got " + re.escape(str(shape))):
        ragged.pack(x, **{arg: m})


@pytest.mark.parametrize("arg", ["mask", "attention_mask"])
def test_mask_device_mismatch(arg):
    x = torch.randn(2, 3, 2)
    m = torch.zeros(2, 3, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=PACK + r".*" + arg + r".*cpu.*meta"):
        ragged.pack(x, **{arg: m})


def test_mask_int_dtype_rejected():
    with pytest.raises(TypeError, match=PACK + r".*mask.*bool.*int64"):
        ragged.pack(torch.randn(2, 3, 2), mask=torch.zeros(2, 3, dtype=torch.int64))


def test_mask_bad_float_values():
    m = torch.tensor([[0.0, 0.5, float("-inf")]])
    with pytest.raises(ValueError, match=PACK + r".*mask"):
        ragged.pack(torch.randn(1, 3, 2), mask=m)
    am = torch.tensor([[1.0, 0.5, 0.0]])
    with pytest.raises(ValueError, match=PACK + r".*attention_mask"):
        ragged.pack(torch.randn(1, 3, 2), attention_mask=am)


def test_mask_not_a_tensor():
    with pytest.raises(TypeError, match=PACK + r".*mask.*torch\.Tensor"):
        ragged.pack(torch.randn(2, 3, 2), mask=[[True, False, False]] * 2)


def test_more_than_one_of_lengths_and_masks():
    x = torch.randn(2, 3, 2)
    with pytest.raises(ValueError, match=PACK + r".*lengths.*mask"):
        ragged.pack(x, lengths=[1, 2], mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=PACK + r".*mask.*attention_mask"):
        ragged.pack(x, mask=torch.zeros(2, 3, dtype=torch.bool), attention_mask=torch.ones(2, 3))


def test_left_side_requested_on_right_padded_mask():
    am = torch.tensor([[1, 1, 0], [1, 0, 0]])
    with pytest.raises(ValueError, match=PACK + r".*padding_side.*attention_mask"):
        ragged.pack(torch.randn(2, 3, 2), attention_mask=am, padding_side="left")


# --------------------------------------------------------------------------------------
# Lists of sequences


def test_list_feature_shape_mismatch():
    with pytest.raises(ValueError, match=PACK + r".*sequence.*\(3,\).*got \(4,\).*index 1"):
        ragged.pack([torch.randn(2, 3), torch.randn(1, 4)])
    with pytest.raises(ValueError, match=PACK + r".*sequence.*\(2, 3\).*got \(3, 2\).*index 2"):
        ragged.pack([torch.randn(2, 2, 3), torch.randn(1, 2, 3), torch.randn(4, 3, 2)])


def test_list_dtype_mismatch():
    with pytest.raises(TypeError, match=PACK + r".*sequence.*dtype.*float32.*got torch\.float16.*index 1"):
        ragged.pack([torch.randn(2, 3), torch.randn(1, 3, dtype=torch.float16)])


def test_list_device_mismatch():
    with pytest.raises(ValueError, match=PACK + r".*sequence.*cpu.*got meta.*index 1"):
        ragged.pack([torch.randn(2, 3), torch.empty(1, 3, device="meta")])
    with pytest.raises(ValueError, match=PACK + r".*sequence.*meta.*got cpu.*index 1"):
        ragged.pack([torch.empty(1, 3, device="meta"), torch.randn(2, 3)])


def test_list_element_not_a_tensor_or_zero_dim():
    with pytest.raises(TypeError, match=PACK + r".*sequence.*torch\.Tensor.*index 1"):
        ragged.pack([torch.randn(2, 3), [1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match=PACK + r".*sequence.*0-d.*index 0"):
        ragged.pack([torch.tensor(1.0), torch.randn(2)])


def test_list_with_lengths():
    with pytest.raises(ValueError, match=PACK + r".*lengths"):
        ragged.pack([torch.randn(2, 3)], lengths=[2])


def test_pack_wrong_data_type():
    with pytest.raises(TypeError, match=PACK + r".*list of tensors.*padded tensor"):
        ragged.pack("abc")
    with pytest.raises(ValueError, match=PACK + r".*\[B, M, \.\.\.\]"):
        ragged.pack(torch.randn(5))


# --------------------------------------------------------------------------------------
# Backends


def _backend_calls():
    x = torch.randn(2, 3, 2)
    rt = _rt()
    return {
        "pack_padded": (PACK, lambda b: ragged.pack(x, lengths=[1, 3], backend=b)),
        "pack_mask": (PACK, lambda b: ragged.pack(x, mask=torch.zeros(2, 3, dtype=torch.bool), backend=b)),
        "pack_list": (PACK, lambda b: ragged.pack([torch.randn(2, 2), torch.randn(1, 2)], backend=b)),
        "unpack": (UNPACK, lambda b: ragged.unpack(rt, backend=b)),
        "to_padded": (r"(to_padded|ragged\.unpack)", lambda b: rt.to_padded(backend=b)),
        "pack_values": (
            r"ragged\.pack",
            lambda b: ragged.pack_values(x, torch.tensor([0, 1, 4], dtype=torch.int32), 4, backend=b),
        ),
    }


@pytest.mark.parametrize("name", ["nope", "CUDA", "", "torch "])
@pytest.mark.parametrize("call", list(_backend_calls()))
def test_unknown_backend(call, name):
    fn, run = _backend_calls()[call]
    with pytest.raises(ValueError, match=fn + r".*backend.*" + re.escape(repr(name))):
        run(name)


def test_unknown_backend_set_backend_and_env(monkeypatch):
    with pytest.raises(ValueError, match=r"ragged\.set_backend.*backend.*'nope'"):
        ragged.set_backend("nope")
    with pytest.raises(ValueError, match=r"ragged\.use_backend|ragged\.set_backend"), ragged.use_backend("nope"):
        pass
    monkeypatch.setenv("RAGGED_BACKEND", "nope")
    with pytest.raises(ValueError, match=r"RAGGED_BACKEND.*'nope'"):
        ragged.pack(torch.randn(2, 3, 2), lengths=[1, 2])


@pytest.mark.parametrize("call", ["pack_padded", "pack_mask", "unpack", "to_padded", "pack_values"])
def test_forced_cuda_backend_on_cpu(call):
    fn, run = _backend_calls()[call]
    with pytest.raises(ValueError, match=fn + r".*backend 'cuda'.*cannot.*(CUDA|cuda).*cpu"):
        run("cuda")


def test_forced_cuda_backend_through_set_backend():
    ragged.set_backend("cuda")
    with pytest.raises(ValueError, match=PACK + r".*backend 'cuda'.*cpu"):
        ragged.pack(torch.randn(2, 3, 2), lengths=[1, 2])
    with pytest.raises(ValueError, match=UNPACK + r".*backend 'cuda'.*cpu"):
        ragged.unpack(_rt())


def test_forced_triton_backend_on_meta():
    x = torch.empty(2, 3, 2, device="meta")
    with pytest.raises(ValueError, match=PACK + r".*backend 'triton'.*meta"):
        ragged.pack(x, lengths=[1, 2], backend="triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="triton on CPU needs the interpreter")
def test_forced_triton_backend_complex_dtype():
    x = torch.randn(2, 3, 2, dtype=torch.complex64)
    with pytest.raises(ValueError, match=PACK + r".*backend 'triton'.*complex"):
        ragged.pack(x, lengths=[1, 2], backend="triton")


# --------------------------------------------------------------------------------------
# unpack / to_padded / masks arguments


NOT_RAGGED = [torch.randn(2, 3), [torch.randn(2, 3)], None, 3]


@pytest.mark.parametrize("bad", NOT_RAGGED, ids=["tensor", "list", "none", "int"])
def test_unpack_non_ragged(bad):
    with pytest.raises(TypeError, match=UNPACK + r".*expected a RaggedTensor.*got"):
        ragged.unpack(bad)


@pytest.mark.parametrize("bad", NOT_RAGGED, ids=["tensor", "list", "none", "int"])
def test_unpack_non_ragged_names_the_argument(bad):
    # The contract: the message names the argument (``rt``), not only the function.
    with pytest.raises(TypeError, match=UNPACK + r".*\brt\b"):
        ragged.unpack(bad)


def test_total_length_smaller_than_max_len():
    rt = _rt((2, 0, 5))
    with pytest.raises(ValueError, match=UNPACK + r".*total_length.*max_len.*5.*got 4"):
        ragged.unpack(rt, total_length=4)
    with pytest.raises(ValueError, match=r"(to_padded|ragged\.unpack).*total_length.*5.*got 3"):
        rt.to_padded(total_length=3)
    with pytest.raises(ValueError, match=r"RaggedTensor\.padding_mask.*total_length.*5.*got 2"):
        rt.padding_mask(total_length=2)
    with pytest.raises(ValueError, match=r"attention_mask|padding_mask"):
        rt.attention_mask(total_length=2)


@pytest.mark.parametrize("bad", [4.0, "6", True])
def test_total_length_wrong_type(bad):
    with pytest.raises(TypeError, match=UNPACK + r".*total_length"):
        ragged.unpack(_rt(), total_length=bad)


@pytest.mark.parametrize("side", ["middle", "LEFT", "", None])
def test_bad_padding_side_unpack(side):
    rt = _rt()
    with pytest.raises(ValueError, match=UNPACK + r".*padding_side.*" + re.escape(repr(side))):
        ragged.unpack(rt, padding_side=side)
    with pytest.raises(ValueError, match=r"(to_padded|ragged\.unpack).*padding_side"):
        rt.to_padded(padding_side=side)
    with pytest.raises(ValueError, match=r"RaggedTensor\.padding_mask.*padding_side"):
        rt.padding_mask(padding_side=side)


@pytest.mark.parametrize("side", ["middle", "LEFT", ""])
@pytest.mark.parametrize("source", ["lengths", "attention_mask"])
def test_bad_padding_side_pack(side, source):
    x = torch.randn(3, 4, 2)
    kwargs = {"lengths": [1, 2, 3]} if source == "lengths" else {"attention_mask": torch.ones(3, 4)}
    with pytest.raises(ValueError, match=PACK + r".*padding_side.*" + re.escape(repr(side))):
        ragged.pack(x, padding_side=side, **kwargs)


# --------------------------------------------------------------------------------------
# with_values / indexing / interop


def test_with_values_bad():
    rt = _rt()
    with pytest.raises(ValueError, match=r"with_values.*values.*\[5, \.\.\.\].*\(4, 2\)"):
        rt.with_values(torch.randn(4, 2))
    with pytest.raises(ValueError, match=r"with_values.*values.*cpu.*meta"):
        rt.with_values(torch.empty(5, 2, device="meta"))
    with pytest.raises(TypeError, match=r"with_values.*values.*torch\.Tensor"):
        rt.with_values(np.zeros((5, 2)))


def test_getitem_bad_index():
    rt = _rt()
    with pytest.raises(IndexError, match=r"__getitem__.*index 3.*batch size 3"):
        rt[3]
    with pytest.raises(TypeError, match=r"__getitem__.*int.*slice"):
        rt["a"]
    with pytest.raises(ValueError, match=r"__getitem__.*step"):
        rt[::-1]


def test_from_nested_not_nested():
    with pytest.raises(TypeError, match=r"ragged\.from_nested.*nt.*|ragged\.from_nested.*nested tensor"):
        ragged.from_nested(torch.randn(2, 3))
    with pytest.raises(TypeError, match=r"ragged\.from_nested.*nt"):
        ragged.from_nested([torch.randn(2, 3)])


def test_to_packed_sequence_zero_length_message():
    rt = _rt((2, 0, 3))
    with pytest.raises(ValueError, match=r"to_packed_sequence.*length 0.*index 1"):
        rt.to_packed_sequence()
