"""ragged.attention / ragged.varlen_attention on bad input: a ValueError or TypeError whose
message names the function and the argument, on every backend."""

from __future__ import annotations

import pytest
import torch
from attention_cases import (
    _cu,
    _qkv,
    needs_triton,
)
from conftest import TRITON_ON_CPU

import ragged
from ragged import RaggedTensor

# --------------------------------------------------------------------------------------
# Bad input: a ValueError or TypeError whose message names the function and the argument


VARLEN = "ragged.varlen_attention()"
ATTN = "ragged.attention()"


def _varlen_args(**overrides):
    lq = [3, 5]
    q, k, v = _qkv(lq, lq, 4, 2, 32, 0)
    args = {
        "q": q,
        "k": k,
        "v": v,
        "cu_seqlens_q": _cu(lq),
        "cu_seqlens_k": _cu(lq),
        "max_seqlen_q": 5,
        "max_seqlen_k": 5,
    }
    args.update(overrides)
    return args


def _ragged_args(**overrides):
    """q, k, v RaggedTensors (lengths [3, 5]); an override is a tensor of values or any object."""
    lengths = [3, 5]
    q, k, v = _qkv(lengths, lengths, 4, 2, 32, 0)
    values = {"q": q, "k": k, "v": v}
    values.update(overrides)
    return {
        name: RaggedTensor.from_lengths(t, lengths) if isinstance(t, torch.Tensor) else t for name, t in values.items()
    }


def _raises(exc, fn, *words):
    with pytest.raises(exc) as info:
        fn()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_varlen_batch_sizes_differ():
    for cu_q, cu_k in ((_cu([3, 5]), _cu([8])), (_cu([3, 5, 0]), _cu([3, 5]))):
        args = _varlen_args(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        _raises(
            ValueError,
            lambda args=args: ragged.varlen_attention(**args),
            VARLEN,
            "cu_seqlens_q",
            "cu_seqlens_k",
            "batch size",
        )


@pytest.mark.parametrize("kv_heads", [3, 0])
def test_varlen_bad_head_counts(kv_heads):
    k = torch.randn(8, kv_heads, 32)
    _raises(
        ValueError, lambda: ragged.varlen_attention(**_varlen_args(k=k, v=k.clone())), VARLEN, "heads", f"({kv_heads})"
    )


@needs_triton
def test_varlen_head_dim_a_forced_backend_cannot_take():
    q, k, v = (torch.randn(8, 2, 48) for _ in range(3))
    args = _varlen_args(q=q, k=k, v=v)
    _raises(ValueError, lambda: ragged.varlen_attention(**args, backend="triton"), VARLEN, "triton", "head dim", "48")
    reasons = ragged.explain("attention", q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], 5, 5, False, 0.0, False)
    assert reasons["torch"] == [] and any("48" in r for r in reasons["triton"])


@needs_triton
def test_varlen_float64_with_triton():
    args = _varlen_args()
    args.update({name: args[name].double() for name in "qkv"})
    _raises(ValueError, lambda: ragged.varlen_attention(**args, backend="triton"), VARLEN, "triton", "float64")


def test_varlen_cuda_backend_on_cpu_tensors():
    _raises(ValueError, lambda: ragged.varlen_attention(**_varlen_args(), backend="cuda"), VARLEN, "cuda")


def test_varlen_head_dims_of_q_and_k_differ():
    k = torch.randn(8, 2, 16)
    _raises(ValueError, lambda: ragged.varlen_attention(**_varlen_args(k=k, v=k.clone())), VARLEN, "head dim")


def test_varlen_k_and_v_differ():
    _raises(ValueError, lambda: ragged.varlen_attention(**_varlen_args(v=torch.randn(8, 2, 16))), VARLEN, "k", "v")


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_varlen_bad_dtypes(which):
    args = _varlen_args()
    args[which] = args[which].half()
    _raises(TypeError, lambda: ragged.varlen_attention(**args), VARLEN, "dtype", "torch.float16")


def test_varlen_integer_inputs():
    ints = _varlen_args(
        q=torch.ones(8, 4, 32, dtype=torch.int64),
        k=torch.ones(8, 2, 32, dtype=torch.int64),
        v=torch.ones(8, 2, 32, dtype=torch.int64),
    )
    _raises(TypeError, lambda: ragged.varlen_attention(**ints), VARLEN, "floating", "torch.int64")


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_varlen_device_mismatch(which):
    args = _varlen_args()
    args[which] = args[which].to("meta")
    _raises(ValueError, lambda: ragged.varlen_attention(**args), VARLEN, "device", "meta")


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
@pytest.mark.parametrize("bad", ["float", "int16", "empty", "2d", "meta"])
def test_varlen_bad_cu_seqlens(which, bad):
    cu = _cu([3, 5])
    value = {
        "float": cu.float(),
        "int16": cu.to(torch.int16),
        "empty": cu[:0],
        "2d": cu.view(1, 3),
        "meta": cu.to("meta"),
    }[bad]
    exc = TypeError if bad in ("float", "int16") else ValueError
    _raises(exc, lambda: ragged.varlen_attention(**_varlen_args(**{which: value})), VARLEN, which)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_varlen_takes_tensors_only(which):
    args = _varlen_args()
    args[which] = args[which].tolist()
    _raises(TypeError, lambda: ragged.varlen_attention(**args), VARLEN, which)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_varlen_bad_ranks(which):
    args = _varlen_args()
    args[which] = args[which].flatten(1)
    _raises(ValueError, lambda: ragged.varlen_attention(**args), VARLEN, which)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan"), float("inf")])
def test_varlen_bad_dropout_p(p):
    _raises(ValueError, lambda: ragged.varlen_attention(**_varlen_args(), dropout_p=p), VARLEN, "dropout_p")


def test_varlen_dropout_p_not_a_number():
    with pytest.raises((TypeError, ValueError)) as info:
        ragged.varlen_attention(**_varlen_args(), dropout_p="0.1")
    assert VARLEN in str(info.value) and "dropout_p" in str(info.value)


@pytest.mark.parametrize("which", ["max_seqlen_q", "max_seqlen_k"])
@pytest.mark.parametrize("bad", [-1, 2.5, None])
def test_varlen_bad_max_seqlen(which, bad):
    with pytest.raises((TypeError, ValueError)) as info:
        ragged.varlen_attention(**_varlen_args(**{which: bad}))
    assert VARLEN in str(info.value) and which in str(info.value)


def test_varlen_bad_scale():
    _raises(TypeError, lambda: ragged.varlen_attention(**_varlen_args(), scale="0.5"), VARLEN, "scale")


def test_varlen_bad_backend_name():
    _raises(ValueError, lambda: ragged.varlen_attention(**_varlen_args(), backend="flash"), "backend", "flash")


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("bad", ["tensor", "list", "none"])
def test_attention_takes_ragged_tensors_only(which, bad):
    args = _ragged_args()
    args[which] = {"tensor": args[which].values, "list": [1.0], "none": None}[bad]
    _raises(TypeError, lambda: ragged.attention(**args), ATTN, which, "RaggedTensor")


def test_attention_batch_sizes_differ():
    q = RaggedTensor.from_lengths(torch.randn(8, 2, 16), [3, 5])
    k = RaggedTensor.from_lengths(torch.randn(8, 2, 16), [8])
    _raises(ValueError, lambda: ragged.attention(q, k, k), ATTN, "batch size", "2", "1")


def test_attention_k_and_v_sequences_differ():
    q = RaggedTensor.from_lengths(torch.randn(8, 2, 16), [3, 5])
    k = RaggedTensor.from_lengths(torch.randn(8, 2, 16), [3, 5])
    v = RaggedTensor.from_lengths(torch.randn(8, 2, 16), [5, 3])
    _raises(ValueError, lambda: ragged.attention(q, k, v), ATTN, "k and v")


def _attention_bad_input(kind):
    """(exception, call, words the message must hold) for bad input to ragged.attention."""
    if kind == "heads":
        return ValueError, _ragged_args(k=torch.randn(8, 3, 32), v=torch.randn(8, 3, 32)), {}, ("heads",)
    if kind == "head_dim_triton":
        return (
            ValueError,
            _ragged_args(**{n: torch.randn(8, 2, 48) for n in "qkv"}),
            {"backend": "triton"},
            ("head dim", "48", "triton"),
        )
    if kind == "dtype":
        return TypeError, _ragged_args(v=torch.randn(8, 2, 32, dtype=torch.float16)), {}, ("dtype",)
    if kind == "device":
        return ValueError, _ragged_args(k=torch.randn(8, 2, 32, device="meta")), {}, ("device", "meta")
    if kind == "dropout_p":
        return ValueError, _ragged_args(), {"dropout_p": 1.0}, ("dropout_p",)
    if kind == "scale":
        return TypeError, _ragged_args(), {"scale": "0.5"}, ("scale",)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["heads", "head_dim_triton", "dtype", "device", "dropout_p", "scale"])
def test_attention_bad_input_names_attention(kind):
    """Errors raised for ragged.attention name ragged.attention, not a function it calls."""
    if kind == "head_dim_triton" and not TRITON_ON_CPU:
        pytest.skip("the Triton kernels need TRITON_INTERPRET=1 on CPU")
    exc, args, kwargs, words = _attention_bad_input(kind)
    _raises(exc, lambda: ragged.attention(**args, **kwargs), ATTN, *words)


@needs_triton
def test_global_backend_that_cannot_take_the_input():
    args = _ragged_args(**{n: torch.randn(8, 2, 48) for n in "qkv"})
    with ragged.use_backend("triton"):
        _raises(ValueError, lambda: ragged.attention(**args), "head dim", "48", "triton")


def test_reference_under_autocast_computes_in_float32():
    """Autocast must not push the reference's float32 math into bf16 (it raised before)."""
    gen = torch.Generator().manual_seed(11)
    q = ragged.pack([torch.randn(n, 2, 8, generator=gen) for n in (3, 0, 5)])
    k = ragged.pack([torch.randn(n, 2, 8, generator=gen) for n in (4, 2, 5)])
    expected = ragged.attention(q, k, k, causal=True, backend="torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ragged.attention(q, k, k, causal=True, backend="torch")
    assert got.values.dtype == torch.float32
    torch.testing.assert_close(got.values, expected.values)
