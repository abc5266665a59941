"""Training through ``ragged.nn.graphed`` off the GPU with its graphs emulated (each "graph" runs
the Python it would capture, at every replay): the captures' structure is the real path's (the
Parameters as fresh leaves, the backward cut into segments whose gradients go through autograd,
the static buffers). Losses and every gradient equal the eager model's in float64."""

from __future__ import annotations

import copy

import pytest
import torch

import ragged
from ragged.nn import graph_switch, graphed_train

tf = pytest.importorskip("transformers")

TOL = {"rtol": 1e-9, "atol": 1e-11}
BATCHES = [[5, 1, 17, 9], [6, 1, 16, 9], [0, 30, 2], [5, 1, 17, 9], [31, 2], [6, 1, 16, 9]]


def _bert(layers=4, cls="BertForSequenceClassification", seed=0):
    torch.manual_seed(seed)
    config = tf.BertConfig(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
        initializer_range=0.2,
    )
    return ragged.nn.convert(getattr(tf, cls)(config).to(torch.float64)).train()


def _batch(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    ids = ragged.pack([torch.randint(3, 97, (n,), generator=g) for n in lengths])
    labels = torch.randint(0, 3, (len(lengths),), generator=g)
    return ids, labels


def _grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _same(got, want, what=""):
    assert got.keys() == want.keys()
    for name in want:
        if want[name] is None:
            assert got[name] is None, f"{what}{name}"
        else:
            assert got[name] is not None, f"{what}{name} has no gradient"
            torch.testing.assert_close(got[name], want[name], **TOL, msg=f"{what}{name}")


def _entries(g):
    return [e.graph for k, e in g._graphs.items() if k[1] and e.graph is not None]


@pytest.mark.parametrize("hooks", [False, True], ids=["written", "delivered"])
def test_training_matches_eager(hooks):
    """Each step's loss and gradients equal eager's, across repeated and new buckets; with
    gradient hooks on the Parameters the gradients go through autograd (four backward segments
    for four layers), and each hook runs once per step."""
    ours, ref = _bert(), None
    ref = copy.deepcopy(ours)
    seen: dict[str, int] = {}
    if hooks:
        for n, q in ours.named_parameters():
            q.register_post_accumulate_grad_hook(lambda t, n=n: seen.__setitem__(n, seen.get(n, 0) + 1))
    g = ragged.nn.graphed(ours, max_tokens=256, max_batch_size=8)
    with graph_switch.emulated():
        for step, lengths in enumerate(BATCHES):
            ids, labels = _batch(lengths, step)
            ours.zero_grad(set_to_none=step % 2 == 0)
            ref.zero_grad(set_to_none=True)
            got = g(input_ids=ids, labels=labels).loss
            got.backward()
            want = ref(input_ids=ids, labels=labels).loss
            want.backward()
            torch.testing.assert_close(got, want, **TOL)
            _same(_grads(ours), _grads(ref), f"step {step}: ")
    entries = _entries(g)
    assert len(entries) == len({tuple(graphed_train.train_bucket(g, sum(b), len(b), max(b))[:3]) for b in BATCHES})
    for e in entries:
        assert len(e.bwd) == (4 if hooks else 1) and (e.deliver is not None) == hooks
    if hooks:
        assert set(seen.values()) == {len(BATCHES)}, seen


def test_delivered_accumulation_and_autograd_grad():
    """Delivered gradients accumulate over micro-batches as eager's, and ``torch.autograd.grad``
    gets them; a backward of an older forward raises."""
    ours = _bert(seed=1)
    ref = copy.deepcopy(ours)
    for q in ours.parameters():
        q.register_hook(lambda t: t)
    g = ragged.nn.graphed(ours, max_tokens=256, max_batch_size=8)
    micro = [_batch(b, 10 + i) for i, b in enumerate(BATCHES[:3])]
    with graph_switch.emulated():
        for ids, labels in micro + micro:
            g(input_ids=ids, labels=labels).loss.backward()
            ref(input_ids=ids, labels=labels).loss.backward()
        _same(_grads(ours), _grads(ref))
        ids, labels = micro[1]
        got = torch.autograd.grad(g(input_ids=ids, labels=labels).loss, list(ours.parameters()))
        want = torch.autograd.grad(ref(input_ids=ids, labels=labels).loss, list(ref.parameters()))
        for (n, _), a, b in zip(ours.named_parameters(), got, want):
            torch.testing.assert_close(a, b, **TOL, msg=n)
        a = g(input_ids=micro[0][0], labels=micro[0][1]).loss
        b = g(input_ids=micro[1][0], labels=micro[1][1]).loss
        with pytest.raises(RuntimeError, match="backward of a training forward whose saved activations"):
            a.backward()
        b.backward()


def test_tied_weights_keep_one_segment():
    """A masked LM reads its word embeddings at the bottom and the top: no cut separates them, so
    the backward stays one graph, and the gradients still equal eager's."""
    ours = _bert(cls="BertForMaskedLM", seed=2)
    ref = copy.deepcopy(ours)
    for q in ours.parameters():
        q.register_post_accumulate_grad_hook(lambda t: None)
    g = ragged.nn.graphed(ours, max_tokens=256, max_batch_size=8)
    with graph_switch.emulated():
        for step, lengths in enumerate(BATCHES[:4]):
            ids, _ = _batch(lengths, step)
            labels = ids.with_values(torch.where(ids.values % 3 == 0, ids.values, -100))
            ours.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            g(input_ids=ids, labels=labels).loss.backward()
            ref(input_ids=ids, labels=labels).loss.backward()
            _same(_grads(ours), _grads(ref), f"step {step}: ")
    assert all(len(e.bwd) == 1 and e.deliver is not None for e in _entries(g))


def test_torch_encoder_with_input_gradients():
    """ragged.nn's encoder, inputs that require grad: the bottom segment returns their gradient."""
    torch.manual_seed(3)
    layer = ragged.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True, dtype=torch.float64)
    ours = ragged.nn.TransformerEncoder(layer, 4).train()
    ref = copy.deepcopy(ours)
    for q in ours.parameters():
        q.register_post_accumulate_grad_hook(lambda t: None)
    g = ragged.nn.graphed(ours, max_tokens=256, max_batch_size=8)
    with graph_switch.emulated():
        for step, lengths in enumerate(BATCHES):
            gen = torch.Generator().manual_seed(step)
            x = ragged.pack([torch.randn(n, 32, generator=gen, dtype=torch.float64) for n in lengths])
            outs = []
            for model in (g, ref):
                model.zero_grad(set_to_none=True)
                xv = x.values.detach().clone().requires_grad_(True)
                y = model(x.with_values(xv)).values
                (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
                outs.append({"y": y.detach(), "x": xv.grad, **_grads(ours if model is g else ref)})
            _same(outs[0], outs[1], f"step {step}: ")
    assert all(len(e.bwd) == 4 for e in _entries(g))


def test_collected_hidden_states_stay_exact():
    """Hidden states returned as outputs (the embeddings' among them, below every cut) reach the
    loss around the cuts: the backward stays one graph and the gradients equal eager's."""
    ours = _bert(seed=4)
    ref = copy.deepcopy(ours)
    for q in ours.parameters():
        q.register_post_accumulate_grad_hook(lambda t: None)
    g = ragged.nn.graphed(ours, max_tokens=256, max_batch_size=8)
    with graph_switch.emulated():
        for step, lengths in enumerate(BATCHES[:4]):
            ids, labels = _batch(lengths, step)
            grads = []
            for model, owner in ((g, ours), (ref, ref)):
                owner.zero_grad(set_to_none=True)
                out = model(input_ids=ids, labels=labels, output_hidden_states=True)
                extra = sum((h.values * (k + 1)).square().mean() for k, h in enumerate(out.hidden_states))
                (out.loss + extra).backward()
                grads.append(_grads(owner))
            _same(grads[0], grads[1], f"step {step}: ")
    assert all(len(e.bwd) == 1 for e in _entries(g))


def test_fsdp2_parameters_run_eagerly_with_a_warning():
    """Parameters sharded by FSDP2 (DTensors) cannot be held by a graph: the call runs eagerly,
    with a warning that says why, and trains as the module itself."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ours = _bert(layers=2, seed=5)
    ref = copy.deepcopy(ours)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fully_shard(ours, mesh=init_device_mesh("cpu", (1,)))
        g = ragged.nn.graphed(ours, max_tokens=256, max_batch_size=8)
        ids, labels = _batch(BATCHES[0], 0)
        with graph_switch.emulated(), pytest.warns(UserWarning, match="sharded by FSDP2"):
            got = g(input_ids=ids, labels=labels).loss
        got.backward()
        want = ref(input_ids=ids, labels=labels).loss
        want.backward()
        torch.testing.assert_close(got.detach(), want.detach(), **TOL)
        for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, **TOL, msg=n)
        assert g.num_graphs == 0
    finally:
        dist.destroy_process_group()
