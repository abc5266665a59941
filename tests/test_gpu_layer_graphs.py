"""Eager training with each layer replayed from its CUDA graphs (``ragged.nn.layer_graphs``) on
the GPU: losses and gradients against the same model with layer graphs off (fp32: the GEMMs of a
bucket's row count may pick other cuBLAS kernels; bf16 at its own tolerance), a converted
HuggingFace BERT and torch.nn's encoder, over batches that meet a bucket once, twice and more,
across buckets; dropout drawing new masks per replay; two forwards before one backward; no host
sync on a replayed step; and layers' graphs really replayed.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import ragged
from ragged.nn import layer_graphs

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

tf = pytest.importorskip("transformers")

TOL = {torch.float32: dict(rtol=2e-3, atol=2e-4), torch.bfloat16: dict(rtol=5e-2, atol=2e-2)}
BATCHES = [[5, 0, 1, 9], [31, 2, 17], [5, 0, 1, 9], [100, 3, 250, 1, 64, 7, 7], [6, 0, 1, 8], [31, 2, 17], [5, 1]]


@pytest.fixture(autouse=True)
def _fresh():
    layer_graphs.reset()
    yield
    layer_graphs.reset()


def _bert(dtype, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    cfg = tf.BertConfig(
        vocab_size=500,
        hidden_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=1024,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=3,
    )
    hf = tf.BertForSequenceClassification(cfg).to("cuda", dtype).train()
    return ragged.nn.convert(hf)


def _ids(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return ragged.pack([torch.randint(3, 500, (n,), generator=g) for n in lengths]).to("cuda")


def _grads(model):
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, ids, labels, graphs):
    model.zero_grad(set_to_none=True)
    with layer_graphs.off() if not graphs else contextlib.nullcontext():
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
    return loss.detach().float(), _grads(model)


def _replays():
    return sum(len(s.entries) for s in layer_graphs._STATES.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bert_matches_layers_off(dtype):
    ours = _bert(dtype)
    ref = copy.deepcopy(ours)
    for i, lengths in enumerate(BATCHES):
        ids = _ids(lengths, i)
        labels = torch.arange(len(lengths), device="cuda") % 3
        got, want = _step(ours, ids, labels, True), _step(ref, ids, labels, False)
        torch.testing.assert_close(got[0], want[0], **TOL[dtype])
        assert got[1].keys() == want[1].keys()
        for name in want[1]:
            torch.testing.assert_close(got[1][name], want[1][name], **TOL[dtype], msg=name)
    assert _replays() >= 3, "the layers were not captured"


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_torch_encoder_matches_layers_off(activation):
    torch.manual_seed(0)
    layer = ragged.nn.TransformerEncoderLayer(
        256, 4, 1024, dropout=0.0, activation=activation, batch_first=True, device="cuda"
    )
    enc = ragged.nn.TransformerEncoder(layer, 2).train()
    ref = copy.deepcopy(enc)
    for i, lengths in enumerate(BATCHES):
        g = torch.Generator(device="cuda").manual_seed(i)
        x = ragged.pack([torch.randn(n, 256, generator=g, device="cuda") for n in lengths])
        outs = []
        for model, graphs in ((enc, True), (ref, False)):
            model.zero_grad(set_to_none=True)
            xv = x.values.detach().clone().requires_grad_(True)
            with layer_graphs.off() if not graphs else contextlib.nullcontext():
                y = model(x.with_values(xv)).values
                w = torch.linspace(-1, 1, y.numel(), device="cuda").view_as(y)
                (y * w).sum().backward()
            outs.append((y.detach(), xv.grad, _grads(model)))
        (y1, gx1, gp1), (y2, gx2, gp2) = outs
        torch.testing.assert_close(y1, y2, **TOL[torch.float32])
        torch.testing.assert_close(gx1, gx2, **TOL[torch.float32])
        for name in gp2:
            torch.testing.assert_close(gp1[name], gp2[name], **TOL[torch.float32], msg=name)
    assert _replays() >= 2


def test_dropout_new_masks_and_reproducible():
    """With dropout, replays draw new masks (two steps on one batch differ) and runs repeat under
    torch.manual_seed."""
    ids, labels = _ids([40, 3, 17, 9], 0), torch.tensor([0, 1, 2, 0], device="cuda")

    def run():
        model = _bert(torch.float32, dropout=0.1, seed=1)
        torch.manual_seed(5)
        return [_step(model, ids, labels, True)[0] for _ in range(5)]

    a = run()
    layer_graphs.reset()
    b = run()
    assert len({round(float(v), 6) for v in a[2:]}) > 1, "replays drew the same masks"
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v)


def test_no_host_sync_on_a_replayed_step():
    model = _bert(torch.bfloat16)
    ids, labels = _ids([40, 3, 17, 9], 0), torch.tensor([0, 1, 2, 0], device="cuda")
    for _ in range(3):
        _step(model, ids, labels, True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=labels).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_two_forwards_then_backward():
    ours = _bert(torch.float32)
    ref = copy.deepcopy(ours)
    a, b = _ids([40, 3, 17, 9], 0), _ids([41, 3, 16, 9], 1)
    la, lb = torch.tensor([0, 1, 2, 0], device="cuda"), torch.tensor([2, 1, 0, 0], device="cuda")
    for _ in range(2):
        _step(ours, a, la, True)
    outs = []
    for model, graphs in ((ours, True), (ref, False)):
        model.zero_grad(set_to_none=True)
        with layer_graphs.off() if not graphs else contextlib.nullcontext():
            loss = model(input_ids=a, labels=la).loss + model(input_ids=b, labels=lb).loss
            loss.backward()
        outs.append((loss.detach(), _grads(model)))
    torch.testing.assert_close(outs[0][0], outs[1][0], **TOL[torch.float32])
    for name in outs[1][1]:
        torch.testing.assert_close(outs[0][1][name], outs[1][1][name], **TOL[torch.float32], msg=name)
