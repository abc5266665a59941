"""Regressions of ragged.nn.convert on HuggingFace models (CPU, float64 against the original
model): hidden-state selection as the installed transformers selects, inference after
weights are written through ``.data``, replicas of ``torch.nn.parallel.replicate`` running
their own parameters, and the copies of a converted model that keep working."""

from __future__ import annotations

import copy
import importlib
import io
import pickle

import pytest
import torch
from hf_convert_cases import LENGTHS, TOL, _batch, _model, _ragged, _real

import ragged
from ragged.nn import hf as hf_convert

tf = pytest.importorskip("transformers")
# the module (torch.nn.parallel re-exports its function under the same name)
replicate_module = importlib.import_module("torch.nn.parallel.replicate")

# --------------------------------------------------------------------------------------
# output_hidden_states: a bool, an int or indices, as the installed transformers reads them

SELECTIONS = [[1], [0, 2], [-1], [-3], (2,), {0, 1}, [1, 1], [5], [-4], 1, 2, -1, 0, [], True, False, None]


def _same_hidden(got, want, mask):
    if want is None:
        assert got is None
        return
    assert got is not None and len(got) == len(want)
    assert [h is None for h in got] == [h is None for h in want]
    for a, b in zip(got, want):
        if b is not None:
            torch.testing.assert_close(_real(a, mask), _real(b, mask), **TOL)


@pytest.mark.parametrize("family,kind", [("bert", "base"), ("distilbert", "token"), ("roberta", "sequence")])
def test_hidden_state_selection_matches_hf(family, kind):
    ours, hf = _model(family, kind, seed=3)
    ids, mask = _batch(LENGTHS, seed=4)
    rt = _ragged(ids, mask)
    with torch.no_grad():
        for sel in SELECTIONS:
            want = hf(input_ids=ids, attention_mask=mask, output_hidden_states=sel).hidden_states
            got = ours(input_ids=ids, attention_mask=mask, output_hidden_states=sel).hidden_states
            _same_hidden(got, want, mask)
            packed = ours(input_ids=rt, output_hidden_states=sel).hidden_states
            assert (packed is None) == (want is None)
            if want is not None:
                assert [h is None for h in packed] == [h is None for h in want]
                for a, b in zip(packed, want):
                    if b is not None:
                        torch.testing.assert_close(a.values, _real(b, mask), **TOL)


def test_hidden_state_selection_from_the_config():
    ours, hf = _model("electra", seed=5)
    ids, mask = _batch([6, 1, 9], seed=6)
    try:
        for m in (hf, ours):
            m.config.output_hidden_states = [1]
    except Exception as err:  # transformers 5.17's config validates a bool there
        pytest.skip(f"this transformers' config takes no selection: {type(err).__name__}")
    with torch.no_grad():
        _same_hidden(
            ours(input_ids=ids, attention_mask=mask).hidden_states,
            hf(input_ids=ids, attention_mask=mask).hidden_states,
            mask,
        )


def test_hidden_state_selection_refuses_what_is_not_an_index():
    ours, _ = _model("bert")
    ids, mask = _batch([3, 2])
    for bad in (["1"], [1.5], [None]):
        with pytest.raises(
            TypeError,
            match=r"BertModel.forward\(\): expected output_hidden_states to be a bool, an "
            r"int or a list of ints",
        ):
            ours(input_ids=ids, attention_mask=mask, output_hidden_states=bad)


# --------------------------------------------------------------------------------------
# Inference reads the weights as they are, however they were written


def _ema(target: torch.nn.Module, source: torch.nn.Module, a: float) -> None:
    for t, s in zip(target.parameters(), source.parameters()):
        t.data.mul_(a).add_(s.data, alpha=1 - a)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_inference_sees_weights_written_through_data(mode):
    """An EMA / target-network update through ``.data`` changes neither a weight's version
    counter nor its address: the next inference call must still read the new Q, K and V."""
    ours, hf = _model("bert", seed=7)
    student, _ = _model("bert", seed=8)
    ids, mask = _batch(LENGTHS, seed=9)
    rt = _ragged(ids, mask)
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode

    def check():
        with context():
            want = _real(hf(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
            got = ours(input_ids=rt).last_hidden_state.values
        torch.testing.assert_close(got, want, **TOL)
        return got

    before = check()
    _ema(ours, student, 0.5)
    _ema(hf, student, 0.5)
    after = check()
    assert (after - before).abs().max() > 1e-3  # the update moved the output
    # re-initialising one projection through .data
    for m in (ours, hf):
        g = torch.Generator().manual_seed(10)
        m.encoder.layer[1].attention.self.value.weight.data.copy_(
            torch.randn(32, 32, generator=g, dtype=torch.float64) / 6
        )
        m.encoder.layer[0].attention.self.query.bias.data.fill_(0.3)
    check()


# --------------------------------------------------------------------------------------
# torch.nn.parallel.replicate (DataParallel): each replica runs its own parameters


def _replicate(model, copies: int, detach: bool, monkeypatch):
    """``torch.nn.parallel.replicate`` itself, with the broadcast of parameters and buffers (CUDA
    only) replaced by clones on the CPU: each replica gets new parameter tensors, as on GPUs."""

    def broadcast(tensors, devices, detach=False):
        return [[t.detach().clone() if detach else t.clone() for t in tensors] for _ in devices]

    monkeypatch.setattr(replicate_module, "_broadcast_coalesced_reshape", broadcast)
    return replicate_module.replicate(model, list(range(copies)), detach)


@pytest.mark.parametrize("family,kind", [("bert", "sequence"), ("distilbert", "base")])
def test_replicas_run_their_own_parameters(family, kind, monkeypatch):
    ours, hf = _model(family, kind, seed=12)
    ids, mask = _batch(LENGTHS, seed=13)
    main = "last_hidden_state" if kind == "base" else "logits"
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask)[main]
    first, second = _replicate(ours, 2, True, monkeypatch)
    assert hf_convert.is_done(first) and hf_convert.is_done(second)
    # change the second replica's weights (its own tensors): only its output follows
    layers = (
        (second.bert if kind == "sequence" else second)
        .__getattr__("transformer" if family == "distilbert" else "encoder")
        .layer
    )
    q = layers[0].attention.q_lin if family == "distilbert" else layers[0].attention.self.query
    q.weight.mul_(-2.0)
    changed = copy.deepcopy(hf)
    q_ref = changed.bert if kind == "sequence" else changed
    q_ref = q_ref.__getattr__("transformer" if family == "distilbert" else "encoder").layer[0]
    q_ref = q_ref.attention.q_lin if family == "distilbert" else q_ref.attention.self.query
    with torch.no_grad():
        q_ref.weight.mul_(-2.0)
        want_changed = changed(input_ids=ids, attention_mask=mask)[main]
        got_first = first(input_ids=ids, attention_mask=mask)[main]
        got_second = second(input_ids=ids, attention_mask=mask)[main]
        got_original = ours(input_ids=ids, attention_mask=mask)[main]
    if kind == "base":
        got_first, got_second, got_original, want, want_changed = (
            _real(t, mask) for t in (got_first, got_second, got_original, want, want_changed)
        )
    torch.testing.assert_close(got_first, want, **TOL)
    torch.testing.assert_close(got_original, want, **TOL)
    torch.testing.assert_close(got_second, want_changed, **TOL)
    assert (want_changed - want).abs().max() > 1e-3


def test_replica_gradients_reach_the_original_parameters(monkeypatch):
    """As in DataParallel's training step: the replicas' parameters are copies that autograd
    links to the originals, and the loss of each replica reaches them."""
    ours, hf = _model("bert", "sequence", seed=14)
    ours.train(), hf.train()  # dropout rates are 0 in these configs
    ids, mask = _batch(LENGTHS, seed=15)
    labels = torch.tensor([0, 2, 1, 1])
    replicas = _replicate(ours, 2, False, monkeypatch)
    copies = [r.bert.encoder.layer[1].attention.self.key.weight for r in replicas]
    for w in copies:
        w.retain_grad()
    halves = [slice(0, 2), slice(2, 4)]
    loss = sum(r(input_ids=ids[h], attention_mask=mask[h], labels=labels[h]).loss for r, h in zip(replicas, halves))
    loss.backward()
    # each replica's loss went through its own copy of the weights
    assert all(w.grad is not None for w in copies)
    original = ours.bert.encoder.layer[1].attention.self.key.weight
    torch.testing.assert_close(copies[0].grad + copies[1].grad, original.grad, **TOL)
    ref = sum(hf(input_ids=ids[h], attention_mask=mask[h], labels=labels[h]).loss for h in halves)
    ref.backward()
    torch.testing.assert_close(loss, ref, **TOL)
    for (name, p), q in zip(ours.named_parameters(), hf.parameters()):
        if q.grad is not None:
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_copies_of_a_converted_model_run_themselves(monkeypatch):
    """deepcopy, pickle and torch.save give converted models whose replicas run the copy's
    parameters; a shallow copy is not converted until convert() is called on it; unpatch
    removes everything patch set."""
    ours, hf = _model("roberta", "token", seed=16)
    ids, mask = _batch(LENGTHS, seed=17)
    rt = _ragged(ids, mask)
    with torch.no_grad():
        want = _real(hf(input_ids=ids, attention_mask=mask).logits, mask)
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours)), torch.load(buffer, weights_only=False)):
        assert hf_convert.is_done(other)
        (replica,) = _replicate(other, 1, True, monkeypatch)
        replica.roberta.encoder.layer[1].attention.self.key.weight.zero_()
        with torch.no_grad():
            kept = other(input_ids=rt).logits.values
            moved = replica(input_ids=rt).logits.values
        torch.testing.assert_close(kept, want, **TOL)
        assert (moved - kept).abs().max() > 1e-3
    shallow = copy.copy(ours)
    assert not hf_convert.is_converted(shallow) and hf_convert.is_done(ours)
    assert ragged.nn.convert(shallow) is shallow and hf_convert.is_done(shallow)
    plain = copy.deepcopy(hf)
    keys = set(plain.__dict__)
    hf_convert.unpatch(hf_convert.patch(plain))
    assert set(plain.__dict__) == keys
