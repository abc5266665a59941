"""Eager training with layers replayed from per-bucket graphs (``ragged.nn.layer_graphs``), run
off the GPU through its emulation (each "graph" runs the Python it would capture): the buckets,
filler sequences, the autograd node and the fallbacks are the real path's. Losses and every
gradient equal the same model's without layer graphs (float64), and HuggingFace's."""

from __future__ import annotations

import copy

import pytest
import torch

import ragged
from ragged.nn import layer_graphs

pytest.importorskip("transformers")

from hf_convert_cases import _batch, _model, _ragged  # noqa: E402

TOL = {"rtol": 1e-9, "atol": 1e-10}


def _grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _step(model, ids, mask, labels, graphs: bool):
    model.zero_grad(set_to_none=True)
    ctx = layer_graphs.emulated() if graphs else layer_graphs.off()
    with ctx:
        out = model(input_ids=_ragged(ids, mask), labels=labels)
        out.loss.backward()
    return out.loss.detach(), _grads(model)


def _compare(a, b):
    assert a.keys() == b.keys()
    for name in a:
        if a[name] is None or b[name] is None:
            assert a[name] is None and b[name] is None, name
        else:
            torch.testing.assert_close(a[name], b[name], **TOL, msg=name)


@pytest.fixture(autouse=True)
def _fresh():
    layer_graphs.reset()
    yield
    layer_graphs.reset()


@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_replayed_layers_match_eager(family):
    """First sighting eager, second captured, later ones replayed: every step's loss and gradient
    equal those without layer graphs, across batches of one bucket and of different buckets
    (lengths 0, 1, odd, one long sequence)."""
    ours, _ = _model(family, "sequence", seed=3)
    ref = copy.deepcopy(ours)
    ours.train(), ref.train()
    batches = [[4, 1, 17, 9], [5, 1, 16, 9], [4, 1, 17, 9], [30, 2], [0, 3, 7], [29, 3], [5, 1, 16, 9]]
    calls = []
    for i, lengths in enumerate(batches):
        ids, mask = _batch(lengths, seed=10 + i)
        labels = torch.randint(0, 3, (len(lengths),), generator=torch.Generator().manual_seed(i))
        got = _step(ours, ids, mask, labels, True)
        want = _step(ref, ids, mask, labels, False)
        torch.testing.assert_close(got[0], want[0], **TOL)
        _compare(got[1], want[1])
        calls.append(sum(len(s.entries) for s in layer_graphs._STATES.values()))
    assert calls[-1] > 0, "no layer ran from its graphs"


def test_two_forwards_before_one_backward_fall_back():
    """A second training forward while the first one's backward is due runs the layers eagerly;
    the summed loss's gradients equal those without layer graphs."""
    ours, _ = _model("bert", "sequence", seed=4)
    ref = copy.deepcopy(ours)
    ours.train(), ref.train()
    a, ma = _batch([4, 1, 17, 9], seed=1)
    b, mb = _batch([6, 2, 15, 9], seed=2)
    la, lb = torch.tensor([0, 1, 2, 0]), torch.tensor([2, 2, 1, 0])
    for _ in range(2):  # capture on the second sighting
        _step(ours, a, ma, la, True)

    def both(model, graphs):
        model.zero_grad(set_to_none=True)
        with layer_graphs.emulated() if graphs else layer_graphs.off():
            loss = model(input_ids=_ragged(a, ma), labels=la).loss + model(input_ids=_ragged(b, mb), labels=lb).loss
            loss.backward()
        return loss.detach(), _grads(model)

    got, want = both(ours, True), both(ref, False)
    torch.testing.assert_close(got[0], want[0], **TOL)
    _compare(got[1], want[1])


def test_dropped_forward_releases_the_layer():
    """A training forward whose outputs are dropped without a backward does not keep the layers
    on the eager path: the next step replays them again."""
    ours, _ = _model("bert", "sequence", seed=5)
    ours.train()
    ids, mask = _batch([4, 1, 17, 9], seed=1)
    labels = torch.tensor([0, 1, 2, 0])
    for _ in range(2):
        _step(ours, ids, mask, labels, True)
    with layer_graphs.emulated():
        ours(input_ids=_ragged(ids, mask), labels=labels)  # dropped
    pending = [s.pending for s in layer_graphs._STATES.values()]
    assert all(p is None or p() is None for p in pending)


def test_frozen_parameters_and_input_gradient():
    """Frozen Parameters get no gradient; an input that requires one (inputs_embeds) gets it."""
    ours, _ = _model("bert", "base", seed=6)
    ref = copy.deepcopy(ours)
    for m in (ours, ref):
        m.train()
        for name, p in m.named_parameters():
            if "intermediate" in name or "attention.self.key" in name:
                p.requires_grad_(False)
    emb = torch.randn(30, 32, dtype=torch.float64)
    rt = ragged.RaggedTensor.from_lengths(emb, [9, 1, 20])

    def run(model, graphs):
        model.zero_grad(set_to_none=True)
        x = rt.values.detach().clone().requires_grad_(True)
        with layer_graphs.emulated() if graphs else layer_graphs.off():
            out = model(inputs_embeds=rt.with_values(x)).last_hidden_state
            w = torch.linspace(-1, 1, out.values.numel(), dtype=out.values.dtype).view_as(out.values)
            (out.values * w).sum().backward()
        return x.grad, _grads(model)

    for _ in range(3):
        gx, gp = run(ours, True)
    wx, wp = run(ref, False)
    torch.testing.assert_close(gx, wx, **TOL)
    _compare(gp, wp)
    assert all(gp[n] is None for n, p in ours.named_parameters() if not p.requires_grad)


def test_buckets():
    """Bucket sizes: at most one step of the scale above the tokens, filler sequences of at most
    L_b tokens covering the spare rows, a spare row whenever there are spare sequences."""
    for n in [1, 2, 63, 64, 65, 100, 777, 4096, 4097, 5000, 65536, 100001]:
        for batch, longest in [(1, n), (32, min(n, 512)), (7, min(n, 3))]:
            if longest * batch < n:
                continue
            t_b, b_b, l_b, fillers = layer_graphs.bucket_of(n, batch, longest)
            assert n <= t_b <= max(64, n + max(16, n // 32) + 16)
            assert l_b >= min(longest, t_b) and l_b <= t_b
            assert fillers * l_b >= t_b - n and (fillers - 1) * l_b < max(t_b - n, 1)
            assert b_b >= batch + fillers and b_b % 8 == 0
            if b_b > batch + fillers:
                assert t_b > n


def test_lora_merge_is_part_of_the_key():
    """A peft LoRA model converted: after merge_adapter() (which writes the base weights in place)
    and after unmerge_adapter(), replayed layers compute what the model without layer graphs
    computes (the adapters' state is part of each graph's key)."""
    peft = pytest.importorskip("peft")
    from hf_convert_cases import _randomise

    tf = pytest.importorskip("transformers")
    from hf_convert_cases import _config

    hf = tf.BertForSequenceClassification(_config("bert", "sequence")).to(torch.float64)
    _randomise(hf, 7)
    model = peft.get_peft_model(
        hf, peft.LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["query", "value"], lora_dropout=0.0)
    )
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    ragged.nn.convert(model)
    model.train()
    ids, mask = _batch([4, 1, 17, 9], seed=1)
    labels = torch.tensor([0, 1, 2, 0])

    def loss(graphs):
        with layer_graphs.emulated() if graphs else layer_graphs.off():
            return model(input_ids=_ragged(ids, mask), labels=labels).loss.detach()

    for state in ("unmerged", "merged", "unmerged again"):
        if state == "merged":
            model.merge_adapter()
        elif state == "unmerged again":
            model.unmerge_adapter()
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            with layer_graphs.emulated():
                model(input_ids=_ragged(ids, mask), labels=labels).loss.backward()
        torch.testing.assert_close(loss(True), loss(False), **TOL, msg=state)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_torch_encoder_layers_match_eager(activation):
    """A ragged.nn.TransformerEncoder (torch.nn's) trained with its layers from their graphs:
    outputs, input and Parameter gradients equal those without layer graphs (float64), over
    repeated buckets; a causal call never takes the graphs."""
    torch.manual_seed(0)
    layer = ragged.nn.TransformerEncoderLayer(
        32, 2, 64, dropout=0.0, activation=activation, batch_first=True, dtype=torch.float64
    )
    ours = ragged.nn.TransformerEncoder(layer, 3).train()
    ref = copy.deepcopy(ours)
    for i, lengths in enumerate([[4, 1, 17, 9], [5, 1, 16, 9], [4, 1, 17, 9], [0, 30, 2], [5, 1, 16, 9]]):
        g = torch.Generator().manual_seed(i)
        x = ragged.pack([torch.randn(n, 32, generator=g, dtype=torch.float64) for n in lengths])
        outs = []
        for model, graphs in ((ours, True), (ref, False)):
            model.zero_grad(set_to_none=True)
            xv = x.values.detach().clone().requires_grad_(True)
            with layer_graphs.emulated() if graphs else layer_graphs.off():
                y = model(x.with_values(xv)).values
                (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
            outs.append({"y": y.detach(), "x": xv.grad, **_grads(model)})
        _compare(outs[0], outs[1])
    assert sum(len(s.entries) for s in layer_graphs._STATES.values()) >= 3, "no layer ran from its graphs"
