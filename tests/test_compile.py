"""torch.compile traces ragged ops without graph breaks (CPU here; GPU in test_gpu_pack.py)."""

import pytest
import torch
from conftest import cpu_backends

import ragged


@pytest.mark.parametrize("backend", cpu_backends())
def test_pack_linear_unpack_fullgraph(backend):
    torch._dynamo.reset()
    lin = torch.nn.Linear(8, 5)

    def f(x, lengths):
        rt = ragged.pack(x, lengths=lengths, backend=backend)
        return rt.with_values(lin(rt.values)).to_padded(padding_value=-1.0, backend=backend)

    lengths = [3, 0, 7, 1]
    x = torch.randn(4, 7, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, lengths)
    ref = f(x_ref, lengths)
    torch.testing.assert_close(out, ref)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    # padding positions of x get no gradient
    assert torch.all(x.grad[1] == 0) and torch.all(x.grad[0, 3:] == 0)


def test_ragged_tensor_crosses_the_compile_boundary():
    torch._dynamo.reset()

    def g(rt):
        return rt.with_values(torch.tanh(rt.values) * 2)

    rt = ragged.pack([torch.randn(n, 4) for n in (2, 0, 5)])
    out = torch.compile(g, fullgraph=True, backend="aot_eager")(rt)
    assert isinstance(out, ragged.RaggedTensor)
    assert out.max_len == rt.max_len and torch.equal(out.offsets, rt.offsets)
    torch.testing.assert_close(out.values, torch.tanh(rt.values) * 2)


def test_fake_implementations_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 9, 2, 4)
        offsets = torch.empty(4, dtype=torch.int32)
        v = torch.ops.ragged.pack(x, offsets, 11, False, "torch")
        p = torch.ops.ragged.unpack(v, offsets, 13, 0.0, True, "torch")
    assert v.shape == (11, 2, 4)
    assert p.shape == (3, 13, 2, 4)


def test_opcheck():
    x = torch.randn(3, 6, 5, requires_grad=True)
    offsets = torch.tensor([0, 2, 2, 8], dtype=torch.int32)
    torch.library.opcheck(torch.ops.ragged.pack.default, (x, offsets, 8, False, "torch"))
    v = torch.randn(8, 5, requires_grad=True)
    torch.library.opcheck(torch.ops.ragged.unpack.default, (v, offsets, 6, 0.5, True, "torch"))


def test_public_api_under_fake_tensors_uses_the_ops():
    """Eager calls skip the dispatcher; fake tensors must still reach the fake kernels."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 9, 4)
        offsets = torch.empty(4, dtype=torch.int32)
        v = ragged.pack_values(x, offsets, 11, backend="torch")
        p = ragged.unpack_values(v, offsets, 12, backend="torch")
    assert v.shape == (11, 4) and p.shape == (3, 12, 4)


@pytest.mark.parametrize("backend", cpu_backends())
def test_eager_path_and_op_path_agree(backend):
    x = torch.randn(3, 6, 5, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([0, 2, 2, 8], dtype=torch.int32)
    eager = ragged.pack_values(x, offsets, 8, backend=backend)
    via_op = torch.ops.ragged.pack(x, offsets, 8, False, backend)
    assert torch.equal(eager, via_op)
    w = torch.randn_like(eager)
    (g1,) = torch.autograd.grad((eager * w).sum(), x)
    (g2,) = torch.autograd.grad((via_op * w).sum(), x)
    assert torch.equal(g1, g2)
    # double backward through the eager Functions
    v = eager.detach().requires_grad_(True)
    out = ragged.unpack_values(v, offsets, 6, backend=backend)
    (g,) = torch.autograd.grad((out * out).sum(), v, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), v)
    assert torch.equal(gg, torch.full_like(v, 2.0))
