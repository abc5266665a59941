"""Training through ragged.nn.graphed, on the CPU: the training buckets (filler sequences own
every spare row), the bucketed batch run eagerly with autograd (``Graphed(..., capture=False)``:
the inputs the graphs see) against the module on the batch itself (loss, outputs, every
parameter's and input's gradient, with NaN left in the buffers' spare rows by earlier batches),
labels of spare sequences ignored, refused float labels, and the attention kernels' seed read
from a tensor. The graphs themselves are captured in tests/test_gpu_graphed_train.py."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hf_convert_cases import _model  # the CPU tests' HuggingFace models
from hypothesis import given, settings
from hypothesis import strategies as st

import ragged
from ragged.nn import graphed_train

D, HEADS = 32, 4


def _encoder(seed=0):
    torch.manual_seed(seed)
    layer = ragged.nn.TransformerEncoderLayer(
        D, HEADS, 2 * D, dropout=0.0, activation="gelu", batch_first=True, dtype=torch.float64
    )
    return ragged.nn.TransformerEncoder(layer, 2).train()


def _values(lengths, seed=1, grad=False):
    g = torch.Generator().manual_seed(seed)
    x = ragged.pack([torch.randn(n, D, generator=g, dtype=torch.float64) for n in lengths])
    return x.with_values(x.values.detach().requires_grad_(grad))


def _poison(g) -> None:
    for buf in g._static_buffers.values():
        if buf.is_floating_point():
            buf.fill_(float("nan"))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2000), st.integers(1, 64), st.integers(1, 512))
def test_training_buckets_give_every_spare_row_to_a_filler(n_tok, batch, longest):
    longest = min(longest, max(n_tok, 1))
    n_tok = max(n_tok, longest if batch == 1 else 0)
    g = ragged.nn.Graphed(_encoder(), 4096, 32, capture=False)
    found = graphed_train.train_bucket(g, n_tok, batch, longest)
    if batch > 32:
        assert found is None
        return
    t_b, b_b, l_b, fillers = found
    assert t_b >= n_tok and l_b >= longest and l_b <= t_b and b_b >= batch + fillers
    assert (b_b > batch) == (t_b > n_tok)  # spare sequences need a spare row to start at, and vice versa
    # the offsets of the spare sequences: monotone, empty ones at T, fillers of at most L_b, ending at T_b
    off = torch.zeros(b_b + 1, dtype=torch.int64)
    off[batch] = n_tok
    ramp = torch.arange(1, b_b + 1, dtype=torch.int64)
    graphed_train.spare_offsets(off, ramp, batch, n_tok, (t_b, b_b, l_b), fillers)
    tail = off[batch:].tolist()
    lens = np.diff(tail)
    assert tail[-1] == t_b and (lens >= 0).all() and (lens <= l_b).all()
    assert (lens > 0).sum() == fillers and all(v == n_tok for v in tail[: b_b - batch - fillers + 1])


def _grads(module):
    return {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


def _same_grads(got, want, tol):
    assert got.keys() == want.keys()
    for n in want:
        if want[n] is None:
            assert got[n] is None, n
        else:
            torch.testing.assert_close(got[n], want[n], rtol=tol, atol=tol, msg=n)


@pytest.mark.parametrize("lengths", [[5, 0, 1, 9], [1], [0, 0, 3], [63], [7, 11, 2, 13, 1, 30, 4], [16] * 8])
def test_bucketed_training_step_equals_eager(lengths):
    enc = _encoder()
    mine = copy.deepcopy(enc)
    g = ragged.nn.Graphed(mine, 256, 8, capture=False)
    x, y = _values(lengths, grad=True), _values(lengths, grad=True)
    g(_values([20, 3]))  # an earlier batch of another bucket
    _poison(g)
    want = enc(x)
    (want.values**2).sum().backward()
    got = g(y)
    assert got.offsets is y.offsets and got.values.shape == want.values.shape
    (got.values**2).sum().backward()
    torch.testing.assert_close(got.values, want.values, rtol=1e-10, atol=1e-10)
    _same_grads(_grads(mine), _grads(enc), 1e-9)
    torch.testing.assert_close(y.values.grad, x.values.grad, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
@pytest.mark.parametrize("kind", ["sequence", "token", "masked_lm"])
def test_converted_model_training_step_equals_eager(family, kind):
    model = _model(family, kind, seed=4)[0].train()
    mine = copy.deepcopy(model)
    g = ragged.nn.Graphed(mine, 256, 8, capture=False)
    gen = torch.Generator().manual_seed(6)
    lengths = [7, 1, 19, 3, 11]
    ids = ragged.pack([torch.randint(5, 50, (n,), generator=gen) for n in lengths])
    if kind == "sequence":
        labels = torch.randint(0, model.num_labels, (len(lengths),), generator=gen)
    else:
        labels = ids.with_values(torch.randint(0, 3 if kind == "token" else 50, (ids.num_tokens,), generator=gen))
        labels.values[::3] = -100  # ignored tokens of the batch itself
    g(input_ids=ragged.pack([torch.randint(5, 50, (n,)) for n in (40, 2)]), labels=None)
    _poison(g)
    for step in range(2):  # accumulation: the second backward adds to the first
        want = model(input_ids=ids, labels=labels)
        want.loss.backward()
        got = g(input_ids=ids, labels=labels)
        got.loss.backward()
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-10, atol=1e-10)
        a, b = got.logits, want.logits
        if isinstance(b, ragged.RaggedTensor):
            assert a.offsets is ids.offsets
            a, b = a.values, b.values
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        _same_grads(_grads(mine), _grads(model), 1e-8)


def test_float_labels_no_loss_takes_are_refused_and_spare_labels_ignored_in_eval():
    model = _model("bert", "sequence", seed=4)[0].train()
    g = ragged.nn.Graphed(model, 256, 8, capture=False)
    ids = ragged.pack([torch.randint(5, 50, (n,)) for n in (4, 9, 2)])
    with pytest.raises(
        ValueError,
        match=r"ragged.nn.Graphed.forward\(\): expected integer labels .* got labels "
        r"of dtype torch.float32",
    ):
        g(input_ids=ids, labels=torch.ones(3))
    assert g.num_graphs == 0
    model.eval()
    labels = torch.tensor([1, 0, 1])
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels).loss
        got = g(input_ids=ids, labels=labels).loss  # 3 sequences in a bucket of 4: the spare one is ignored
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_memory_report_and_reset():
    g = ragged.nn.Graphed(_encoder(), 256, 8, capture=False)
    g(_values([3, 4], grad=True)).values.sum().backward()
    mem = g.memory()
    assert mem["buffers"] > 0 and mem["graphs"] == 0 and mem["gradients"] == 0 and mem["buckets"] == {}
    g.reset()
    assert g.num_graphs == 0 and g.memory()["buffers"] == 0


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_attention_kernels_read_a_seed_tensor_like_the_int(dropout_p):
    from ragged.backends import triton_reason
    from ragged.kernels.triton import attention as ka

    if triton_reason(torch.device("cpu")) is not None:
        pytest.skip("Triton's interpreter is not on (TRITON_INTERPRET=1)")
    torch.manual_seed(2)
    lengths = [5, 1, 12]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    q, k, v, do = (torch.randn(sum(lengths), 2, 16) for _ in range(4))
    from ragged.ops.attention import AttentionArgs, AttentionBackwardInputs

    seed = 12345
    args = AttentionArgs(
        q=q, k=k, v=v, cu_q=cu, cu_k=cu, max_q=12, max_k=12, causal=False, scale=0.25, dropout_p=dropout_p, seed=seed
    )
    on_device = args._replace(seed=torch.tensor([seed]))
    out, lse = ka.forward(args)
    out_t, lse_t = ka.forward(on_device)
    assert torch.equal(out, out_t) and torch.equal(lse, lse_t)
    inputs = AttentionBackwardInputs(grad_out=do, out=out, lse=lse)
    grads = ka.backward(args, inputs)
    grads_t = ka.backward(on_device, inputs)
    for a, b in zip(grads[:3], grads_t[:3]):
        assert torch.equal(a, b)
    if dropout_p:  # another seed, another mask: the tensor is read, not ignored
        other = ka.forward(args._replace(seed=torch.tensor([seed + 1]))).out
        assert not torch.equal(other, out)


def test_outputs_flatten_rebuild_and_cut():
    """The training graphs' outputs as a flat list and back (the replay returns copies of the
    leaves, cut to the caller's rows): RaggedTensors, per-sequence tensors, tuples, ModelOutputs."""
    from transformers.modeling_outputs import SequenceClassifierOutput

    first = _values([3, 5])  # the caller's batch: 8 tokens in 2 sequences
    t_b, b_b = 16, 4
    hidden = [ragged.RaggedTensor(torch.randn(t_b, D), torch.tensor([0, 3, 8, 8, 16]), 8) for _ in range(2)]
    out = SequenceClassifierOutput(loss=torch.tensor(1.5), logits=torch.randn(b_b, 3), hidden_states=tuple(hidden))
    leaves, ragged_flags = [], []
    spec = graphed_train.flatten(out, leaves, ragged_flags)
    assert ragged_flags == [False, False, True, True]

    class Entry:
        outputs, ragged = leaves, ragged_flags

    rows = graphed_train._rows(Entry, b_b, first.num_tokens, first.batch_size)
    assert rows == (None, 2, 8, 8)
    cut = [t if n is None else t[:n] for t, n in zip(leaves, rows)]
    back = graphed_train.rebuild(spec, cut, first)
    assert type(back) is SequenceClassifierOutput and back.loss is cut[0]
    assert torch.equal(back.logits, out.logits[:2])
    for got, want in zip(back.hidden_states, hidden):
        assert got.offsets is first.offsets and torch.equal(got.values, want.values[:8])


def test_captures_pause_the_garbage_collector_until_the_last_one_ends():
    """The collector is off while any capture's turn runs (nested, or on two GPUs at once), back
    on when the last ends, also after an error; a collector the caller had turned off stays off."""
    import gc
    import threading

    assert gc.isenabled()
    inside = threading.Event()
    leave = threading.Event()

    def other_gpu():
        with graphed_train.capturing("cuda:1"):
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other_gpu)
    t.start()
    inside.wait(10)
    with pytest.raises(RuntimeError, match="inside"):
        with graphed_train.capturing("cuda:0"):
            assert not gc.isenabled()
            with graphed_train.capturing("cuda:0"):  # re-entrant on one thread
                assert not gc.isenabled()
            assert not gc.isenabled()
            raise RuntimeError("inside")
    assert not gc.isenabled()  # the other GPU's capture is still under way
    leave.set()
    t.join()
    assert gc.isenabled()
    gc.disable()
    try:
        with graphed_train.capturing("cuda:0"):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_capture_lock_is_one_per_gpu():
    """Captures on one GPU take one lock (re-entrant), those of two GPUs two."""
    a, b = graphed_train.capture_lock("cuda:0"), graphed_train.capture_lock(torch.device("cuda", 1))
    assert a is graphed_train.capture_lock(torch.device("cuda:0")) and a is not b
    with a:
        assert a.acquire(blocking=False)  # the same thread again
        a.release()
