"""linear_cross_entropy and shift_labels against float64 oracles written here with plain torch.

CPU: the "torch" backend, and the Triton steps under the interpreter at small sizes (a small
``chunk_size`` makes several vocabulary slices; V = 301 at chunk 64 leaves a ragged last one).
GPU sizes are in test_gpu_linear_ce.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_backends
from test_fused import _gen, _randn

import ragged
from ragged.ops.linear_ce import LINEAR_CROSS_ENTROPY
from ragged.records.linear_ce import LinearCrossEntropyArgs, LinearCrossEntropyOutput

LOWP = [torch.float32, torch.bfloat16, torch.float16]


def _dtypes(backend):
    return ([torch.float64] if backend == "torch" else []) + LOWP


def _oracle(h, w, b, target, ignore_index=-100, softcap=None, lowp_logits=False):
    """Per-token losses in float64: HF's causal-LM path (logits, ``.float()``, cross-entropy).
    ``lowp_logits``: the logits rounded to the operands' dtype first, as a bfloat16 head returns them."""
    z = h @ w.T if b is None else torch.addmm(b, h, w.T)
    if lowp_logits:
        z = z.to(torch.float64)
    else:
        z = h.double() @ w.double().T + (0 if b is None else b.double())
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    return F.cross_entropy(z, target, ignore_index=ignore_index, reduction="none")


def _inputs(key, t, d, v, dtype, bias, ignored=True):
    gen = _gen("linear_ce", *key)
    h = _randn((t, d), dtype, gen)
    w = (_randn((v, d), torch.float64, gen) * d**-0.5).to(dtype)
    b = _randn((v,), dtype, gen) if bias else None
    target = torch.randint(0, v, (t,), generator=gen)
    if ignored and t > 2:
        target[torch.randperm(t, generator=gen)[: t // 3]] = -100
    return h, w, b, target


TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("t,d,v,chunk", [(0, 8, 17, 0), (1, 1, 1, 0), (1, 8, 5, 2), (37, 16, 301, 64), (9, 24, 130, 0)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_values_and_gradients_against_float64(backend, t, d, v, chunk, bias, softcap):
    for dtype in _dtypes(backend):
        h, w, b, target = _inputs((backend, t, d, v, chunk, bias, softcap, str(dtype)), t, d, v, dtype, bias)
        leaves = [x.requires_grad_(True) for x in (h, w) + ((b,) if bias else ())]
        losses = ragged.linear_cross_entropy(
            h, w, target, b, reduction="none", softcap=softcap, chunk_size=chunk, backend=backend
        )
        assert losses.shape == (t,) and losses.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        leaves64 = [x.detach().double().requires_grad_(True) for x in leaves]
        h64, w64 = leaves64[:2]
        b64 = leaves64[2] if bias else None
        ref = _oracle(h64, w64, b64, target, softcap=softcap)
        tol = TOL[dtype]
        scale = max(1.0, ref.abs().max().item()) if t else 1.0
        torch.testing.assert_close(losses.double(), ref.detach(), atol=tol * scale, rtol=tol, msg=str(dtype))
        assert (losses[target == -100] == 0).all()
        if t == 0:
            continue
        gen = _gen("linear_ce grad", backend, t, str(dtype))
        g = torch.rand(t, generator=gen, dtype=torch.float64)
        got = torch.autograd.grad(losses, leaves, g.to(losses.dtype))
        want = torch.autograd.grad(ref, leaves64, g)
        for name, a, c in zip(("hidden", "weight", "bias"), got, want):
            assert a.dtype == dtype, name
            s = max(1e-3, c.abs().max().item())
            torch.testing.assert_close(a.double(), c, atol=tol * s * 4, rtol=tol * 4, msg=f"{name} {dtype}")


@pytest.mark.parametrize("backend", cpu_backends())
def test_bf16_matches_what_a_bf16_head_computes(backend):
    """In bfloat16 the loss is that of the head's bf16 logits read in float32 (HF's path), far closer
    than the float64 oracle's tolerance."""
    h, w, b, target = _inputs(("bf16 head", backend), 40, 32, 700, torch.bfloat16, True)
    got = ragged.linear_cross_entropy(h, w, target, b, reduction="none", chunk_size=128, backend=backend)
    logits = F.linear(h, w, b)  # bf16, as the model's lm_head
    want = F.cross_entropy(logits.float(), target, reduction="none")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", cpu_backends())
def test_reductions_and_num_items_in_batch(backend):
    h, w, _, target = _inputs(("reductions", backend), 23, 8, 50, torch.float32, False)
    per = _oracle(h.double(), w.double(), None, target)
    kept = (target != -100).sum()
    cases = [
        (dict(reduction="mean"), per.sum() / kept),
        (dict(reduction="sum"), per.sum()),
        (dict(reduction="sum", num_items_in_batch=57), per.sum() / 57),
        (dict(num_items_in_batch=torch.tensor(31)), per.sum() / 31),
    ]
    for kwargs, want in cases:
        got = ragged.linear_cross_entropy(h, w, target, chunk_size=16, backend=backend, **kwargs)
        assert got.dim() == 0, kwargs
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=str(kwargs))
    # every token ignored: the mean is NaN, as F.cross_entropy's
    none = torch.full_like(target, -100)
    assert torch.isnan(ragged.linear_cross_entropy(h, w, none, backend=backend))
    assert ragged.linear_cross_entropy(h, w, none, reduction="sum", backend=backend) == 0


@pytest.mark.parametrize("backend", cpu_backends())
def test_custom_ignore_index_strided_hidden_and_transposed_weight(backend):
    gen = _gen("strided", backend)
    wide = _randn((19, 40), torch.float32, gen)
    h = wide[:, 3:19]  # rows of stride 40
    w = _randn((16, 77), torch.float32, gen).T  # [77, 16], column-major
    target = torch.randint(0, 77, (19,), generator=gen)
    target[::4] = 5
    h.requires_grad_(True)
    got = ragged.linear_cross_entropy(h, w, target, ignore_index=5, chunk_size=30, backend=backend)
    h64 = h.detach().double().requires_grad_(True)
    want = _oracle(h64, w.double(), None, target, ignore_index=5)
    want = want.sum() / (target != 5).sum()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        torch.autograd.grad(got, h)[0].double(), torch.autograd.grad(want, h64)[0], atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("backend", cpu_backends())
def test_ragged_inputs_and_shifted_labels_equal_hf_per_sequence(backend):
    """A packed batch against each sequence's HF-style loss (logits, shift by one, sum over the
    batch's items): lengths 0, 1 and odd."""
    lengths = [5, 0, 1, 12, 3]
    gen = _gen("packed", backend)
    v, d = 61, 12
    w = (_randn((v, d), torch.float64, gen) * 0.3).requires_grad_(True)
    seqs = [_randn((n, d), torch.float64, gen) for n in lengths]
    ids = [torch.randint(0, v, (n,), generator=gen) for n in lengths]
    hidden = ragged.pack(seqs)
    labels = ragged.pack(ids)
    targets = ragged.shift_labels(labels)
    items = sum(max(n - 1, 0) for n in lengths)
    got = ragged.linear_cross_entropy(hidden, w, targets, num_items_in_batch=items, backend="torch")
    want = 0
    for x, y in zip(seqs, ids):
        if len(y) > 1:  # logits of every position but the last, against the next tokens
            want = want + F.cross_entropy((x @ w.T)[:-1], y[1:], reduction="sum")
    want = want / items
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, w)[0], torch.autograd.grad(want, w)[0])


def test_shift_labels_against_a_loop():
    gen = _gen("shift")
    for lengths in ([], [0], [1], [0, 0, 3], [4, 1, 0, 7, 2]):
        ids = [torch.randint(0, 100, (n,), generator=gen) for n in lengths]
        rt = ragged.RaggedTensor.from_lengths(torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64), lengths)
        got = ragged.shift_labels(rt, ignore_index=-7)
        want = [torch.cat([s[1:], torch.tensor([-7])]) if len(s) else s for s in ids]
        assert torch.equal(got, torch.cat(want) if want else torch.zeros(0, dtype=torch.int64)), lengths


def test_shift_labels_equals_hf_shift_of_padded_rows():
    """HF pads the labels with -100 and shifts each padded row by one; packing those rows' real
    positions gives shift_labels of the packed labels."""
    gen = _gen("hf shift")
    lengths = [3, 1, 6]
    padded = torch.full((3, 6), -100)
    for i, n in enumerate(lengths):
        padded[i, :n] = torch.randint(0, 50, (n,), generator=gen)
    shifted = F.pad(padded, (0, 1), value=-100)[:, 1:]
    keep = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]
    rt = ragged.RaggedTensor.from_lengths(padded[keep], lengths)
    assert torch.equal(ragged.shift_labels(rt), shifted[keep])


@pytest.mark.parametrize("backend", cpu_backends())
def test_target_outside_the_vocabulary_gives_nan(backend):
    h, w, _, target = _inputs(("oov", backend), 6, 4, 10, torch.float32, False, ignored=False)
    target[2] = 10
    losses = ragged.linear_cross_entropy(h, w, target, reduction="none", backend=backend)
    assert torch.isnan(losses[2]) and torch.isfinite(losses[[0, 1, 3, 4, 5]]).all()


def test_second_order_raises():
    h, w, _, target = _inputs(("second",), 5, 4, 9, torch.float64, False)
    h.requires_grad_(True)
    loss = ragged.linear_cross_entropy(h, w, target)
    (g,) = torch.autograd.grad(loss, h, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        g.sum().backward()


def test_bad_arguments_name_the_function_and_argument():
    h, w, _, t = _inputs(("bad",), 5, 4, 9, torch.float32, False)
    fn = "ragged.linear_cross_entropy"
    cases = [
        (dict(hidden=h[0]), ValueError, "hidden"),
        (dict(weight=w[:, :3]), ValueError, "weight"),
        (dict(weight=w.double()), TypeError, "weight"),
        (dict(target=t.float()), ValueError, "target"),
        (dict(target=t[:3]), ValueError, "target"),
        (dict(bias=torch.zeros(8)), ValueError, "bias"),
        (dict(reduction="avg"), ValueError, "reduction"),
        (dict(softcap=0.0), ValueError, "softcap"),
        (dict(reduction="none", num_items_in_batch=3), ValueError, "num_items_in_batch"),
        (dict(num_items_in_batch="3"), TypeError, "num_items_in_batch"),
        (dict(chunk_size=-1), ValueError, "chunk_size"),
        (dict(ignore_index=1.5), TypeError, "ignore_index"),
        (dict(hidden=h.long()), TypeError, "hidden"),
    ]
    for change, kind, word in cases:
        kwargs = dict(hidden=h, weight=w, target=t)
        kwargs.update(change)
        with pytest.raises(kind, match=rf"{fn}\(\).*{word}"):
            ragged.linear_cross_entropy(**kwargs)
    with pytest.raises(TypeError, match=r"ragged.shift_labels\(\).*labels"):
        ragged.shift_labels(t)


@pytest.mark.parametrize("backend", cpu_backends())
def test_compile_fullgraph_forward_backward(backend):
    torch._dynamo.reset()
    h, w, b, target = _inputs(("compile", backend), 13, 8, 40, torch.float32, True)
    h.requires_grad_(True)
    w.requires_grad_(True)

    def loss(h, w):
        return ragged.linear_cross_entropy(h, w, target, b, softcap=3.0, chunk_size=16, backend=backend)

    out = torch.compile(loss, fullgraph=True, backend="aot_eager")(h, w)
    ref = loss(h, w)
    torch.testing.assert_close(out, ref)
    for a, c in zip(torch.autograd.grad(out, (h, w)), torch.autograd.grad(ref, (h, w))):
        torch.testing.assert_close(a, c)


def test_opcheck():
    ops = torch.ops.ragged
    h, w, b, target = _inputs(("opcheck",), 7, 4, 11, torch.float64, True)
    h.requires_grad_(True)
    torch.library.opcheck(ops.linear_cross_entropy.default, (h, w, b, target, -100, 0.0, 4, "torch"))
    torch.library.opcheck(ops.linear_cross_entropy.default, (h, w, None, target, -100, 2.0, 0, "torch"))


@pytest.mark.parametrize("backend", cpu_backends())
def test_the_op_takes_and_returns_records(backend):
    h, w, _, target = _inputs(("records", backend), 4, 4, 9, torch.float32, False)
    out = LINEAR_CROSS_ENTROPY(LinearCrossEntropyArgs(h, w, None, target, -100, 0.0, 0), backend)
    assert isinstance(out, LinearCrossEntropyOutput) and out.lse.shape == (4,)
    torch.testing.assert_close(out.lse, torch.logsumexp(h @ w.T, dim=1))
