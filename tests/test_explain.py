"""ragged.explain: every backend's reasons for an input, from an op name and the op's
operands, or from a public function and its own arguments; clear errors for the rest."""

from __future__ import annotations

import dataclasses
import doctest
import zlib

import pytest
import torch

import ragged
from ragged import backends

OPS = [
    "add_layer_norm",
    "attention",
    "bias_act",
    "gated_act",
    "pack",
    "pool",
    "rotary_embedding",
    "unpack",
    "vocab_cross_entropy",
    "vocab_projection",
]
LENGTHS = [3, 0, 1, 7]  # a zero, a one, odd sizes


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _seqs(lengths, feat, seed, dtype=torch.float32):
    g = _gen(seed)
    return ragged.pack([torch.randn(n, *feat, generator=g).to(dtype) for n in lengths])


def _vocab(lengths, vocab_size, seed):
    g = _gen(seed)
    return ragged.pack([torch.randperm(vocab_size, generator=g)[:n].sort().values for n in lengths])


def _calls(op, dtype=torch.float32, device="cpu"):
    """(public function, its arguments, the op's reasons arguments) for fresh random inputs."""
    seed = zlib.crc32(f"{op} {dtype}".encode())
    if op in ("pack", "unpack"):
        rt = _seqs(LENGTHS, (5,), seed, dtype)
        rt = ragged.RaggedTensor(rt.values.to(device), rt.offsets.to(device), rt.max_len)
        padded = rt.to_padded()
        if op == "pack":
            return ragged.pack, (padded,), {"lengths": LENGTHS}, (padded, rt.offsets)
        return ragged.unpack, (rt,), {}, (rt.values, rt.offsets)
    if op == "pool":
        rt = _seqs(LENGTHS, (6,), seed, dtype)
        rt = ragged.RaggedTensor(rt.values.to(device), rt.offsets.to(device), rt.max_len)
        return ragged.pool, (rt, "max"), {}, (rt.values, rt.offsets, "max")
    if op == "rotary_embedding":
        g = _gen(seed)
        x = torch.randn(9, 6, 8, generator=g).to(device=device, dtype=dtype)
        pos, inv_freq = torch.arange(9, device=device), torch.rand(4, generator=g).to(device)
        return ragged.rotary_embedding, (x, pos, inv_freq), {}, (x, pos, inv_freq)
    if op == "attention":
        q = _seqs(LENGTHS, (2, 16), seed, dtype)
        q = ragged.RaggedTensor(q.values.to(device), q.offsets.to(device), q.max_len)
        return (
            ragged.attention,
            (q, q, q),
            {"causal": True},
            (q.values, q.values, q.values, q.offsets, q.offsets, q.max_len, q.max_len, True, 0.0, False),
        )
    g = _gen(seed)
    x = torch.randn(9, 24, generator=g).to(device=device, dtype=dtype)
    if op == "bias_act":
        bias = torch.randn(24, generator=g).to(device=device, dtype=dtype)
        return ragged.bias_act, (x, bias, "gelu_tanh"), {}, (x, bias, "gelu_tanh")
    if op == "gated_act":
        return ragged.gated_act, (x, "gelu"), {}, (x, "gelu")
    if op == "add_layer_norm":
        r = torch.randn(9, 24, generator=g).to(device=device, dtype=dtype)
        w = torch.randn(24, generator=g).to(device)
        return ragged.add_layer_norm, (x, r, w, None), {"return_sum": True}, (x, r, w, None)
    hidden = _seqs(LENGTHS, (16,), seed, dtype)
    hidden = ragged.RaggedTensor(hidden.values.to(device), hidden.offsets.to(device), hidden.max_len)
    vocab = _vocab([4, 1, 0, 5], 11, seed)
    vocab = ragged.RaggedTensor(vocab.values.to(device), vocab.offsets.to(device), vocab.max_len)
    weight = torch.randn(11, 16, generator=g).to(device=device, dtype=dtype)
    operands = (hidden.values, hidden.offsets, weight, None, vocab.values, vocab.offsets)
    if op == "vocab_projection":
        return ragged.vocab_projection, (hidden, weight, vocab), {}, operands
    target = torch.full((hidden.num_tokens,), -100, dtype=torch.int64, device=device)
    return ragged.vocab_cross_entropy, (hidden, weight, vocab, target), {}, operands


@pytest.mark.parametrize("op", OPS)
def test_public_function_form_equals_the_operand_form(op):
    public, args, kwargs, operands = _calls(op)
    by_function = ragged.explain(public, *args, **kwargs)
    by_name = ragged.explain(op, *operands)
    assert by_function == by_name
    assert set(by_name) == set(backends._OPS[op].impls)
    assert by_name["torch"] == []


@pytest.mark.parametrize("op", OPS)
def test_explain_runs_no_kernel_and_leaves_the_selection(op, monkeypatch):
    public, args, kwargs, _ = _calls(op)
    entry = backends._OPS[op]
    for name, impl in list(entry.impls.items()):

        def refuse(*_, _name=name):
            raise AssertionError(f"explain ran the {_name} implementation")

        monkeypatch.setitem(entry.impls, name, dataclasses.replace(impl, forward=refuse, backward=refuse))
    ragged.set_backend("torch")
    with ragged.use_backend("cuda"):
        ragged.explain(public, *args, backend="triton", **kwargs)  # backend= is ignored
        assert ragged.get_backend() == "cuda"
    assert ragged.get_backend() == "torch"
    assert backends._stack.get() == ()


def test_unknown_op_lists_the_ops():
    with pytest.raises(ValueError, match=r"ragged.explain\(\): expected op to be one of \[") as info:
        ragged.explain("foo")
    for op in OPS:
        assert repr(op) in str(info.value)
    with pytest.raises(TypeError, match=r"ragged.explain\(\): expected op to be an op name"):
        ragged.explain(3)


@pytest.mark.parametrize("op", OPS)
def test_missing_arguments_name_what_the_reasons_need(op):
    with pytest.raises(TypeError, match=r"ragged.explain\(\): expected the arguments") as info:
        ragged.explain(op)
    message = str(info.value)
    assert "got no arguments" in message
    assert f"ragged.explain(ragged.{op}," in message  # the public form is suggested
    needs = {
        "attention": "q, k, v, cu_q, cu_k, max_q, max_k, causal, dropout_p, needs_grad",
        "pack": "x, offsets",
        "pool": "values, offsets, mode",
        "unpack": "x, offsets",
        "bias_act": "x, bias, activation",
        "gated_act": "x, activation",
        "rotary_embedding": "x, positions, inv_freq, scaling",
        "add_layer_norm": "x, residual, weight, bias",
        "vocab_projection": "hidden, h_off, weight, bias, ids, v_off",
        "vocab_cross_entropy": "hidden, h_off, weight, bias, ids, v_off",
    }[op]
    assert f"({needs}" in message


def test_wrong_arguments_are_a_type_error_naming_explain():
    with pytest.raises(TypeError, match=r"ragged.explain\(\): .*\(q, k, v, .*got 3 positional arguments"):
        ragged.explain("attention", *_calls("attention")[1])  # RaggedTensors: the public form's arguments
    with pytest.raises(TypeError, match=r"ragged.explain\(\): .*\(x, offsets, \.\.\.\).*AttributeError"):
        ragged.explain("pack", [1, 2], [0, 2])
    with pytest.raises(TypeError, match=r"ragged.explain\(\): expected the arguments of ragged.attention \(q, k, v"):
        ragged.explain(ragged.attention, torch.zeros(2, 1, 8))


def test_public_form_reports_the_functions_own_argument_errors():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"ragged.bias_act\(\): expected activation"):
        ragged.explain(ragged.bias_act, x, None, "swish")
    assert ragged.get_backend() == "auto"


def test_public_call_that_picks_no_backend():
    with pytest.raises(
        ValueError,
        match=r"ragged.explain\(\): expected a call that picks a backend, got one of "
        r"ragged.pack\(\)",
    ):
        ragged.explain(ragged.pack, [torch.randn(2, 3), torch.randn(1, 3)])


def test_complex_and_float64_inputs_get_reasons():
    x = torch.randn(2, 4, 3, dtype=torch.complex64)
    reasons = ragged.explain(ragged.pack, x, lengths=[1, 3])
    assert reasons["torch"] == [] and any("complex" in r for r in reasons["triton"])
    h = torch.randn(4, 8, dtype=torch.float64)
    reasons = ragged.explain(ragged.bias_act, h, None, "relu")
    assert any("float64" in r for r in reasons["triton"])


def test_docstring_examples_run():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = finder.find(ragged.explain, "explain", globs={})
    assert tests and tests[0].examples
    for test in tests:
        runner.run(test)
    assert runner.failures == 0
    # every op has an example of both forms
    source = "".join(e.source for e in tests[0].examples)
    for op in OPS:
        assert f"ragged.explain(ragged.{op}," in source
        if op != "vocab_cross_entropy":  # its operands are vocab_projection's
            assert f'ragged.explain("{op}",' in source


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
def test_gpu_both_forms_agree_and_auto_picks_a_backend_without_reasons(op, dtype, monkeypatch):
    public, args, kwargs, operands = _calls(op, dtype, "cuda")
    by_function = ragged.explain(public, *args, **kwargs)
    assert by_function == ragged.explain(op, *operands)
    assert by_function["torch"] == []
    if dtype == torch.float64 and op not in ("pack", "unpack"):  # pack moves bytes of any real dtype
        assert by_function["triton"]  # the other kernels take float16/bfloat16/float32
    # what "auto" runs is a backend explain finds no reason against
    chosen = {}
    entry = backends._OPS[op]
    real_select = backends.select_spec

    def spy(name, *a, **k):
        impl = real_select(name, *a, **k)
        chosen.setdefault(name, impl.name)
        return impl

    monkeypatch.setattr(backends, "select_spec", spy)
    public(*args, **kwargs)
    monkeypatch.undo()
    assert by_function[chosen[op]] == [], (chosen, by_function)
    assert chosen[op] in entry.impls
    for backend, impl in entry.impls.items():  # each forced backend runs or raises with explain's reasons
        if impl.variant:  # a second implementation of a backend (sm_90 attention): forced by its backend's name
            continue
        if by_function[backend]:
            with pytest.raises(ValueError, match=r"cannot take this input"):
                public(*args, backend=backend, **kwargs)
        else:
            public(*args, backend=backend, **kwargs)


def test_explanation_names_the_backend_the_call_runs():
    x = torch.randn(2, 4, 8)
    why = ragged.explain(ragged.pack, x, lengths=[1, 3])
    assert isinstance(why, dict) and set(why) == set(backends._OPS["pack"].impls)
    assert why.chosen == "torch" and why.launch is None  # auto on a CPU tensor
    with ragged.use_backend("torch"):
        assert ragged.explain(ragged.pack, x, lengths=[1, 3]).chosen == "torch"
        assert ragged.explain("pack", x, torch.tensor([0, 1, 4])).chosen == "torch"
    with ragged.use_backend("cuda"):  # the selected backend cannot take a CPU tensor: the call would raise
        why = ragged.explain(ragged.pack, x, lengths=[1, 3])
        assert why.chosen is None and why["cuda"] and why.launch is None
        with pytest.raises(ValueError, match="cannot take this input"):
            ragged.pack(x, lengths=[1, 3])
    assert "chosen='torch'" in repr(ragged.explain(ragged.pack, x, lengths=[1, 3]))
