"""ragged.rotary_embedding against a float64 oracle written here as complex multiplication, and
against HuggingFace's ``apply_rotary_pos_emb`` (Llama's and ModernBERT's) where transformers is
importable.

Each case runs on every backend that can take CPU tensors here (``conftest.cpu_backends``: the
torch reference, and the Triton kernel under TRITON_INTERPRET=1). The inputs are views into
larger buffers whose other rows and columns hold NaN (for the fused QKV layout, the v heads
too), so that anything read outside the rotated heads shows.
"""

from __future__ import annotations

import dataclasses
import doctest
import zlib

import pytest
import torch
from conftest import cpu_backends

import ragged
from ragged import backends
from ragged.ops import rotary as rotary_module
from ragged.ops.rotary import ROTARY_EMBEDDING
from ragged.records.rotary import (
    RotaryEmbeddingArgs,
    RotaryEmbeddingBackwardInputs,
    RotaryEmbeddingGrads,
    RotaryEmbeddingOutput,
)

BACKENDS = cpu_backends()
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Output rounding of each dtype (the oracle is float64; the Triton interpreter rounds float32 ->
# bfloat16 toward zero, one unit in the last place off round-to-nearest).
TOL = {
    torch.float64: (1e-6, 1e-6),  # float32 cos/sin tables (as HuggingFace's), float64 products
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}
LAYOUTS = ("slice", "qkv", "strided")
LENGTHS = [5, 0, 1, 7]  # the positions of a packed batch: a zero, a one, odd sizes


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(" ".join(map(str, parts)).encode()))


def _inv_freq(dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def _positions(total: int, dtype=torch.int64, gen=None) -> torch.Tensor:
    """Packed positions: those of LENGTHS repeated, the last few far out (angles in the thousands)."""
    rt = ragged.pack([torch.zeros(n) for n in LENGTHS * (total // sum(LENGTHS) + 1)])
    pos = rt.position_ids()[:total].clone()
    if total > 3:
        pos[-3:] = torch.tensor([8191, 40000, 123457])
    return pos.to(dtype)


def _x(total, heads, dim, dtype, layout, gen) -> torch.Tensor:
    """Random ``[total, heads, dim]`` values as a view: rows ``[2, 2 + total)`` of a NaN buffer
    (``"slice"``), the q and k heads of a fused QKV buffer whose v heads are NaN (``"qkv"``,
    ``heads`` even) or every other element of the head dim (``"strided"``, a last-dim stride
    of 2)."""
    data = torch.randn((total, heads, dim), generator=gen, dtype=torch.float64).to(dtype)
    if layout == "slice":
        buf = torch.full((total + 4, heads, dim), float("nan"), dtype=dtype)
        view = buf[2 : 2 + total]
    elif layout == "qkv":
        h = heads // 2
        buf = torch.full((total + 3, 3 * h * dim), float("nan"), dtype=dtype)
        view = buf[1 : 1 + total].view(total, 3, h, dim)[:, :2].flatten(1, 2)
    else:
        buf = torch.full((total, heads, 2 * dim), float("nan"), dtype=dtype)
        view = buf[..., 1::2]
    view.copy_(data)
    return view


def _oracle(x, positions, inv_freq, scaling=1.0):
    """float64 ``[T, N, D]``: each pair ``(x1_i, x2_i)`` as the complex number ``x1 + i x2``
    times ``scaling * e^(i angle)``, the angle the float32 product of the position and the
    frequency. Differentiable in ``x``."""
    half = x.shape[-1] // 2
    angle = (positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]).to(torch.float64)
    turn = torch.polar(torch.full_like(angle, scaling), angle)[:, None, :]
    z = torch.complex(x[..., :half].to(torch.float64), x[..., half:].to(torch.float64)) * turn
    return torch.cat((z.real, z.imag), dim=-1)


def _assert_close(out, expected, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.to(torch.float64), expected.to(torch.float64), rtol=rtol, atol=atol)


def _supported(backend, dtype):
    return backend == "torch" or dtype in KERNEL_DTYPES


# --------------------------------------------------------------------------------------
# Forward


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_matches_the_oracle(backend, dtype, layout):
    if not _supported(backend, dtype):
        pytest.skip(f"{backend} does not take {dtype}")
    for total, heads, dim in [(13, 6, 16), (1, 2, 2), (9, 4, 20), (0, 4, 8)]:
        gen = _gen(backend, dtype, layout, total, heads, dim)
        x = _x(total, heads, dim, dtype, layout, gen)
        # Each position dtype (a kernel specialisation) once, each scaling (a runtime float, the same
        # code) once: the pairs cover both without their product (interpreted calls are slow).
        for pos_dtype, scaling in ((torch.int64, 1.0), (torch.int32, 0.7)):
            positions = _positions(total, pos_dtype)
            inv_freq = _inv_freq(dim)
            out = ragged.rotary_embedding(x, positions, inv_freq, scaling, backend=backend)
            assert out.shape == (total, heads, dim) and out.dtype == dtype and out.is_contiguous()
            assert not out.isnan().any(), "NaN outside the rotated heads leaked in"
            _assert_close(out, _oracle(x, positions, inv_freq, scaling), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_odd_heads_empty_heads_and_one_token(backend):
    gen = _gen("odd", backend)
    inv_freq = torch.rand(3, generator=gen)
    for shape in [(7, 5, 6), (1, 3, 6), (1, 1, 6), (4, 0, 6), (0, 0, 6)]:
        x = torch.randn(shape, generator=gen)
        positions = torch.randint(0, 50, (shape[0],), generator=gen)
        out = ragged.rotary_embedding(x, positions, inv_freq, backend=backend)
        assert out.shape == shape
        _assert_close(out, _oracle(x, positions, inv_freq), torch.float32)
    # D = 0 is even: nothing to rotate
    out = ragged.rotary_embedding(torch.zeros(3, 2, 0), torch.arange(3), torch.zeros(0), backend=backend)
    assert out.shape == (3, 2, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_token_does_not_depend_on_the_others(backend):
    gen = _gen("invariant", backend)
    x = _x(13, 6, 16, torch.float32, "qkv", gen)
    positions, inv_freq = _positions(13), _inv_freq(16)
    whole = ragged.rotary_embedding(x, positions, inv_freq, backend=backend)
    part = ragged.rotary_embedding(x[4:9], positions[4:9], inv_freq, backend=backend)
    assert torch.equal(whole[4:9], part)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inv_freq_is_read_as_float32(backend):
    gen = _gen("freq", backend)
    x = torch.randn(6, 2, 8, generator=gen)
    positions = torch.arange(6) * 97
    inv_freq = _inv_freq(8, 500.0).to(torch.float64)
    out = ragged.rotary_embedding(x, positions, inv_freq, backend=backend)
    assert torch.equal(out, ragged.rotary_embedding(x, positions, inv_freq.float(), backend=backend))
    strided = torch.stack([inv_freq.float(), torch.full_like(inv_freq.float(), float("nan"))], 1)[:, 0]
    assert torch.equal(out, ragged.rotary_embedding(x, positions, strided, backend=backend))
    assert torch.equal(out, ragged.rotary_embedding(x, positions.int(), inv_freq, backend=backend))


# --------------------------------------------------------------------------------------
# HuggingFace's rotary embedding


def _hf_case(module, rope_parameters, dtype, backend):
    """Our op on a fused QKV layout against ``module.apply_rotary_pos_emb`` with cos / sin from
    Llama's rotary embedding for ``rope_parameters`` (its ``inv_freq`` and ``attention_scaling``
    passed to the op), packed positions as ``position_ids [1, T]``."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    heads, dim, total = 3, 16, 21
    config = transformers.LlamaConfig(
        hidden_size=heads * dim,
        num_attention_heads=heads,
        head_dim=dim,
        max_position_embeddings=256,
        rope_parameters=rope_parameters,
    )
    rope = LlamaRotaryEmbedding(config)
    gen = _gen("hf", module.__name__, rope_parameters["rope_type"], dtype, backend)
    qkv = torch.randn(total, 3 * heads * dim, generator=gen).to(dtype)
    positions = _positions(total)
    positions[-3:] = torch.tensor([100, 200, 255])
    x = qkv.view(total, 3, heads, dim)[:, :2].flatten(1, 2)
    out = ragged.rotary_embedding(x, positions, rope.inv_freq, rope.attention_scaling, backend=backend)
    q, k = out[:, :heads], out[:, heads:]
    cos, sin = rope(qkv, positions[None])
    hq, hk, _ = qkv.view(1, total, 3, heads, dim).unbind(dim=2)  # [1, T, H, D]
    want_q, want_k = module.apply_rotary_pos_emb(hq.transpose(1, 2), hk.transpose(1, 2), cos, sin)
    return (q, k), (want_q[0].transpose(0, 1), want_k[0].transpose(0, 1)), rope


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_matches_huggingface_llama(backend, rope_type):
    pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    params = {"rope_type": rope_type, "rope_theta": 10000.0}
    if rope_type == "yarn":  # an attention_scaling other than 1
        params.update(factor=4.0, original_max_position_embeddings=64)
    got, want, rope = _hf_case(modeling_llama, params, torch.float32, backend)
    assert (rope.attention_scaling != 1.0) == (rope_type == "yarn")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_matches_huggingface_modernbert(backend, dtype):
    modeling = pytest.importorskip("transformers.models.modernbert.modeling_modernbert")
    got, want, _ = _hf_case(modeling, {"rope_type": "default", "rope_theta": 160000.0}, dtype, backend)
    # HuggingFace rounds cos and sin to the dtype first: a rounding of the inputs apart
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------
# Gradients


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradients_match_the_oracle(backend, dtype, layout):
    if not _supported(backend, dtype):
        pytest.skip(f"{backend} does not take {dtype}")
    for total, heads, dim in [(13, 6, 16), (1, 2, 2), (0, 4, 8)]:
        gen = _gen("grad", backend, dtype, layout, total)
        base = _x(total, heads, dim, dtype, layout, gen)
        x = base.detach().requires_grad_(True)
        ref = base.detach().to(torch.float64).requires_grad_(True)
        positions, inv_freq = _positions(total), _inv_freq(dim)
        out = ragged.rotary_embedding(x, positions, inv_freq, 0.8, backend=backend)
        expected = _oracle(ref, positions, inv_freq, 0.8)
        g = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
        (got,) = torch.autograd.grad(out, x, g)
        (want,) = torch.autograd.grad(expected, ref, g.to(torch.float64))
        assert got.shape == x.shape and got.dtype == dtype
        _assert_close(got, want, dtype)
        # an expanded gradient (the one of .sum()): stride 0 everywhere
        (got,) = torch.autograd.grad(ragged.rotary_embedding(x, positions, inv_freq, 0.8, backend=backend).sum(), x)
        (want,) = torch.autograd.grad(_oracle(ref, positions, inv_freq, 0.8).sum(), ref)
        _assert_close(got, want, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_gradient_to_positions_or_inv_freq(backend):
    x = torch.randn(5, 2, 8, requires_grad=True)
    inv_freq = _inv_freq(8).requires_grad_(True)
    out = ragged.rotary_embedding(x, torch.arange(5), inv_freq, backend=backend)
    dx, dfreq = torch.autograd.grad(out.square().sum(), [x, inv_freq], allow_unused=True)
    assert dx is not None and dfreq is None
    # only inv_freq requiring a gradient: it still gets none
    out = ragged.rotary_embedding(x.detach(), torch.arange(5), inv_freq, backend=backend)
    assert torch.autograd.grad(out.sum(), [inv_freq], allow_unused=True) == (None,)


def test_gradcheck_and_gradgradcheck_float64():
    gen = _gen("gradcheck")
    x = torch.randn(6, 3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    positions, inv_freq = torch.tensor([0, 1, 2, 0, 5, 900]), _inv_freq(8)

    def f(t):
        return ragged.rotary_embedding(t, positions, inv_freq, 1.3, backend="torch")

    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))
    # the reference itself, called directly, is differentiable by torch autograd
    assert torch.autograd.gradcheck(lambda t: rotary_module.reference_rotary_embedding(t, positions, inv_freq), (x,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_create_graph_gives_a_differentiable_gradient(backend):
    # dx = R^T g is linear in g: d<dx, w>/dg = R w, the forward of w
    gen = _gen("create_graph", backend)
    x = torch.randn(7, 4, 8, generator=gen, requires_grad=True)
    g = torch.randn(7, 4, 8, generator=gen, requires_grad=True)
    w = torch.randn(7, 4, 8, generator=gen)
    positions, inv_freq = _positions(7), _inv_freq(8)
    out = ragged.rotary_embedding(x, positions, inv_freq, 0.9, backend=backend)
    (dx,) = torch.autograd.grad(out, x, g, create_graph=True)
    (dg,) = torch.autograd.grad((dx * w).sum(), g)
    _assert_close(dg, _oracle(w, positions, inv_freq, 0.9), torch.float32)


def test_reference_backward_is_the_autograd_of_the_reference():
    gen = _gen("refbwd")
    x = torch.randn(9, 3, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    positions, inv_freq = _positions(9), _inv_freq(10)
    out = rotary_module.reference_rotary_embedding(x, positions, inv_freq, 0.6)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (want,) = torch.autograd.grad(out, x, g)
    (got,) = rotary_module.reference_rotary_embedding_backward(g, positions, inv_freq, 0.6)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


# --------------------------------------------------------------------------------------
# The op: torch.compile, opcheck, fake tensors, explain, auto


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph(backend):
    torch._dynamo.reset()
    heads, dim = 2, 8
    lin = torch.nn.Linear(3 * heads * dim, 3 * heads * dim)

    def f(h, positions, inv_freq):
        qkv = lin(h)
        x = qkv.view(h.shape[0], 3, heads, dim)[:, :2].flatten(1, 2)
        return ragged.rotary_embedding(x, positions, inv_freq, 0.9, backend=backend) * 2

    gen = _gen("compile", backend)
    values = torch.randn(11, 3 * heads * dim, generator=gen)
    positions, inv_freq = _positions(11), _inv_freq(dim)
    h = values.clone().requires_grad_(True)
    h_ref = values.clone().requires_grad_(True)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(h, positions, inv_freq)
    ref = f(h_ref, positions, inv_freq)
    torch.testing.assert_close(out, ref)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(h.grad, h_ref.grad)
    torch._dynamo.reset()


def test_opcheck():
    gen = _gen("opcheck")
    x = torch.randn(10, 3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    positions, inv_freq = _positions(10), _inv_freq(8)
    args = RotaryEmbeddingArgs(x, positions, inv_freq, 0.5)
    torch.library.opcheck(torch.ops.ragged.rotary_embedding.default, (*args, "torch"))
    # the backward op takes the operands it reads (no x), then the gradient
    grad = torch.randn(10, 3, 8, generator=gen, dtype=torch.float64)
    torch.library.opcheck(torch.ops.ragged.rotary_embedding_backward.default, (positions, inv_freq, 0.5, grad, "torch"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_op_takes_and_returns_records(backend):
    gen = _gen("records", backend)
    x = torch.randn(7, 2, 8, generator=gen)
    positions, inv_freq = _positions(7), _inv_freq(8)
    args = RotaryEmbeddingArgs(x=x, positions=positions, inv_freq=inv_freq, scaling=0.75)
    out = ROTARY_EMBEDDING(args, backend)
    assert isinstance(out, RotaryEmbeddingOutput)
    torch.testing.assert_close(out.out, rotary_module.reference_rotary_embedding(x, positions, inv_freq, 0.75))
    g = torch.randn(7, 2, 8, generator=gen)
    # the backward reads no x: an unread operand may be None
    got = ROTARY_EMBEDDING.call_backward(args._replace(x=None), RotaryEmbeddingBackwardInputs(g), backend)
    assert isinstance(got, RotaryEmbeddingGrads)
    (want,) = rotary_module.reference_rotary_embedding_backward(g, positions, inv_freq, 0.75)
    torch.testing.assert_close(got.x, want)


def test_fake_tensors_reach_the_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        qkv = torch.empty(11, 3 * 4 * 8, dtype=torch.bfloat16)
        x = qkv.view(11, 3, 4, 8)[:, :2].flatten(1, 2)
        out = ragged.rotary_embedding(x, torch.empty(11, dtype=torch.int64), torch.empty(4), backend="torch")
    assert out.shape == (11, 8, 8) and out.dtype == torch.bfloat16 and out.is_contiguous()


def test_explain():
    x, positions, inv_freq = torch.randn(5, 2, 8), torch.arange(5), _inv_freq(8)
    reasons = ragged.explain(ragged.rotary_embedding, x, positions, inv_freq, 0.5)
    assert set(reasons) == {"torch", "triton"}
    assert reasons["torch"] == []
    assert (reasons["triton"] == []) == ("triton" in BACKENDS)
    assert ragged.explain("rotary_embedding", x, positions, inv_freq, 0.5) == reasons
    assert ragged.explain("rotary_embedding", x, positions, inv_freq) == reasons
    reasons = ragged.explain(ragged.rotary_embedding, x.double(), positions, inv_freq)
    assert reasons["torch"] == [] and any("float64" in r for r in reasons["triton"])
    with pytest.raises(ValueError, match=r"ragged.rotary_embedding\(\): expected x's head dim D"):
        ragged.explain(ragged.rotary_embedding, torch.randn(5, 2, 7), positions, inv_freq)


def test_auto_takes_the_reference_on_cpu_and_the_kernel_first_on_cuda(monkeypatch):
    ran = []
    entry = backends.op_entry("rotary_embedding")
    impl = entry.impls["torch"]
    monkeypatch.setitem(
        entry.impls,
        "torch",
        dataclasses.replace(impl, forward=lambda args: ran.append("torch") or impl.forward_fn(args)),
    )
    ragged.rotary_embedding(torch.randn(3, 2, 4), torch.arange(3), _inv_freq(4))
    assert ran == ["torch"]
    assert entry.gpu_preference(None) == ("triton", "torch")  # on CUDA inputs


def test_docstring_examples_run():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    tests = finder.find(rotary_module.rotary_embedding, "rotary_embedding", globs={})
    assert tests and tests[0].examples
    for test in tests:
        runner.run(test)
    assert runner.failures == 0


# --------------------------------------------------------------------------------------
# Errors


def _errors():
    """(arguments, exception type, message pattern) of bad calls."""
    x, pos, freq = torch.randn(5, 2, 8), torch.arange(5), _inv_freq(8)
    fn = r"ragged.rotary_embedding\(\): "
    return [
        ((x.numpy(), pos, freq), TypeError, fn + r"expected x to be a torch.Tensor, got ndarray"),
        ((x[0], pos, freq), ValueError, fn + r"expected x of shape \[T, N, D\] .*got shape \(2, 8\)"),
        ((x[None], pos, freq), ValueError, fn + r"expected x of shape \[T, N, D\] .*got shape \(1, 5, 2, 8\)"),
        ((pos.view(5, 1, 1), pos, freq), TypeError, fn + r"expected x of a floating-point dtype .*got torch.int64"),
        ((x.to(torch.complex64), pos, freq), TypeError, fn + r"expected x of a floating-point .*got torch.complex64"),
        ((torch.randn(5, 2, 7), pos, freq), ValueError, fn + r"expected x's head dim D .* even, got shape \(5, 2, 7\)"),
        ((x, [0, 1, 2, 3, 4], freq), TypeError, fn + r"expected positions to be a torch.Tensor, got list"),
        (
            (x, pos.float(), freq),
            TypeError,
            fn + r"expected positions of dtype torch.int32 or torch.int64, "
            r"got torch.float32",
        ),
        ((x, pos[None], freq), ValueError, fn + r"expected positions of shape \(5,\) \(one per token .*got \(1, 5\)"),
        ((x, pos[:4], freq), ValueError, fn + r"expected positions of shape \(5,\) .*got \(4,\)"),
        ((x, pos.to("meta"), freq), ValueError, fn + r"expected positions on cpu \(the device of x\), got meta"),
        ((x, pos, None), TypeError, fn + r"expected inv_freq to be a torch.Tensor, got NoneType"),
        ((x, pos, freq[:3]), ValueError, fn + r"expected inv_freq of shape \(4,\) \(D/2, .*got \(3,\)"),
        ((x, pos, _inv_freq(16)), ValueError, fn + r"expected inv_freq of shape \(4,\) .*got \(8,\)"),
        ((x, pos, freq.to("meta")), ValueError, fn + r"expected inv_freq on cpu, got meta"),
        ((x, pos, torch.arange(4)), TypeError, fn + r"expected inv_freq of a floating-point dtype .*got torch.int64"),
        ((x, pos, freq, "1.0"), TypeError, fn + r"expected scaling to be a float, got '1.0'"),
        ((x, pos, freq, True), TypeError, fn + r"expected scaling to be a float, got True"),
        ((x, pos, freq, float("nan")), ValueError, fn + r"expected a finite scaling, got nan"),
    ]


@pytest.mark.parametrize("backend", [*BACKENDS, "auto", "cuda"])
def test_errors_name_the_function_the_argument_and_what_came(backend):
    for args, kind, pattern in _errors():
        with pytest.raises(kind, match=pattern):
            ragged.rotary_embedding(*args, backend=backend)
    # the integer scaling of a caller is taken as a float
    x = torch.randn(3, 1, 4)
    assert torch.equal(
        ragged.rotary_embedding(x, torch.arange(3), _inv_freq(4), 1, backend="torch"),
        ragged.rotary_embedding(x, torch.arange(3), _inv_freq(4), backend="torch"),
    )


def test_backend_errors():
    x, pos, freq = torch.randn(5, 2, 8), torch.arange(5), _inv_freq(8)
    with pytest.raises(ValueError, match=r"ragged.rotary_embedding\(\): expected backend to be one of"):
        ragged.rotary_embedding(x, pos, freq, backend="numpy")
    with pytest.raises(ValueError, match=r"ragged.rotary_embedding\(\): backend 'cuda' has no implementation"):
        ragged.rotary_embedding(x, pos, freq, backend="cuda")
    with pytest.raises(
        ValueError,
        match=r"ragged.rotary_embedding\(\): backend 'triton' cannot take this input: "
        r".*float64",
    ):
        ragged.rotary_embedding(x.double(), pos, freq, backend="triton")
