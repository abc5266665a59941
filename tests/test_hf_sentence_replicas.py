"""Replicas and copies of a converted SentenceTransformer, and one Graphed module called from
several threads (CPU, float64 against the unconverted model).

``torch.nn.parallel.replicate`` (what ``torch.nn.DataParallel`` and HuggingFace's ``Trainer`` on
several GPUs run) copies each module's ``__dict__`` into a replica and gives the replica new
parameter tensors: every replica of a converted model must run its own parameters. It runs here
as it is, with its broadcast of parameters and buffers (CUDA only) replaced by clones on the CPU.
The tiny models, texts and helpers are those of ``test_hf_sentence.py``."""

from __future__ import annotations

import copy
import importlib
import io
import pickle
import threading

import pytest
import torch

import ragged

pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")
from sentence_transformers.sentence_transformer import modules as M  # noqa: E402
from test_hf_sentence import TEXTS, D, _close, _st, folders, transformers_  # noqa: E402, F401  (fixtures)

from ragged.nn import hf
from ragged.nn.hf import sentence as hf_sentence  # noqa: E402

replicate_module = importlib.import_module("torch.nn.parallel.replicate")
scatter_gather = importlib.import_module("torch.nn.parallel.scatter_gather")


def _replicate(model, copies: int, detach: bool, monkeypatch):
    """``torch.nn.parallel.replicate`` itself, the CUDA broadcast replaced by clones on the CPU."""

    def broadcast(tensors, devices, detach=False):
        return [[t.detach().clone() if detach else t.clone() for t in tensors] for _ in devices]

    monkeypatch.setattr(replicate_module, "_broadcast_coalesced_reshape", broadcast)
    return replicate_module.replicate(model, list(range(copies)), detach)


def _query(st):
    """The first layer's query (or q_lin) Linear of a SentenceTransformer or its replica."""
    auto = st[0]._modules["model"]
    base = auto.encoder if hasattr(auto, "encoder") else auto.transformer
    attention = base.layer[0].attention
    return attention.q_lin if hasattr(attention, "q_lin") else attention.self.query


def _embed(st, features):
    return st(dict(features))["sentence_embedding"]


def _owns_its_patches(st) -> bool:
    """Every converted forward, preprocess and encode of ``st`` holds ``st``'s own modules."""
    return (
        hf_sentence.is_converted(st)
        and st.encode.model is st
        and st[0].forward.module is st[0]
        and st[0].preprocess.module is st[0]
        and st[1].forward.module is st[1]
        and hf.is_done(st[0].auto_model)
    )


# --------------------------------------------------------------------------------------
# torch.nn.parallel.replicate: each replica runs its own parameters


@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_replicas_run_their_own_parameters(transformers_, family, monkeypatch):
    original, ours = _st(transformers_, family, ("cls", "max"), [M.Dense(2 * D, 16)])
    f = original.preprocess(TEXTS)
    theirs = _replicate(original, 2, True, monkeypatch)  # the unconverted model's replicas: the oracle
    replicas = _replicate(ours, 2, True, monkeypatch)
    assert all(_owns_its_patches(r) for r in replicas)
    for r in (theirs[1], replicas[1]):  # the second replicas' own tensors change; nothing else does
        _query(r).weight.mul_(-2.0)
    with torch.no_grad():
        want = [_embed(r, f) for r in theirs]
        got = [_embed(r, f) for r in replicas]
        _close(_embed(ours, f), _embed(original, f))
    assert (want[1] - want[0]).abs().max() > 1e-3  # the change moves the output
    for g, w in zip(got, want):
        _close(g, w)


def test_replicas_outputs_gather_as_data_parallel_gathers_them(transformers_, monkeypatch):
    """DataParallel gathers the replicas' output dicts key by key onto one device
    (``torch.nn.parallel.gather``, run here with its CUDA concatenation done on the CPU)."""
    original, ours = _st(transformers_, "bert", "max")
    f = original.preprocess(TEXTS)
    halves = [
        {k: v[h] if isinstance(v, torch.Tensor) else v for k, v in f.items()} for h in (slice(0, 3), slice(3, None))
    ]

    class Concatenate:
        @staticmethod
        def apply(target, dim, *tensors):
            return torch.cat(tensors, dim)

    monkeypatch.setattr(scatter_gather, "Gather", Concatenate)
    with torch.no_grad():
        outputs = [r(dict(h)) for r, h in zip(_replicate(ours, 2, True, monkeypatch), halves)]
        got = scatter_gather.gather(outputs, "cpu")
        want = _embed(original, f)
    _close(got["sentence_embedding"], want)
    _close(got["attention_mask"], f["attention_mask"])


def test_replica_gradients_reach_the_original_parameters(transformers_, monkeypatch):
    """As in DataParallel's training step: each replica's loss goes through its own copies of
    the weights, which autograd links to the originals."""
    original, ours = _st(transformers_, "bert", "mean", [M.Dense(D, 16)])
    for st in (original, ours):
        st.train()  # dropout rates are 0 in these configs
    f = original.preprocess(TEXTS)
    halves = [
        {k: v[h] if isinstance(v, torch.Tensor) else v for k, v in f.items()} for h in (slice(0, 4), slice(4, None))
    ]
    replicas = _replicate(ours, 2, False, monkeypatch)
    copies = [_query(r).weight for r in replicas]
    for w in copies:
        w.retain_grad()
    loss = sum(_embed(r, h).pow(2).sum() for r, h in zip(replicas, halves))
    loss.backward()
    assert all(w.grad is not None for w in copies)  # each loss went through its replica's weights
    _close(copies[0].grad + copies[1].grad, _query(ours).weight.grad)
    ref = sum(_embed(original, h).pow(2).sum() for h in halves)
    ref.backward()
    _close(loss, ref)
    for (name, p), q in zip(ours.named_parameters(), original.parameters()):
        if q.grad is not None:
            assert p.grad is not None, name
            _close(p.grad, q.grad)


def test_copies_of_a_converted_model_run_themselves(transformers_, monkeypatch):
    """deepcopy, pickle and torch.save give converted models whose replicas run the copy's
    parameters; a shallow copy is not converted until convert() is called on it, which leaves
    the modules it shares with the original as they were."""
    original, ours = _st(transformers_, "roberta", "weightedmean")
    f = original.preprocess(TEXTS)
    with torch.no_grad():
        want = _embed(original, f)
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours)), torch.load(buffer, weights_only=False)):
        assert _owns_its_patches(other)
        (replica,) = _replicate(other, 1, True, monkeypatch)
        _query(replica).weight.zero_()
        with torch.no_grad():
            kept, moved = _embed(other, f), _embed(replica, f)
        _close(kept, want)
        assert (moved - kept).abs().max() > 1e-3
    shared = (ours[0].__dict__["forward"], ours[0].__dict__["preprocess"], ours[1].__dict__["forward"])
    shallow = copy.copy(ours)
    assert not hf_sentence.is_converted(shallow) and hf_sentence.is_converted(ours)
    assert ragged.nn.convert(shallow) is shallow and _owns_its_patches(shallow)
    assert (ours[0].__dict__["forward"], ours[0].__dict__["preprocess"], ours[1].__dict__["forward"]) == shared
    assert _owns_its_patches(ours)
    _close(shallow.encode(TEXTS), original.encode(TEXTS))


# --------------------------------------------------------------------------------------
# One Graphed module from several threads


class _Gate(torch.nn.Module):
    """Doubles its input; its first call stops (inputs already in the bucket's buffers, not yet
    read) until ``go`` is set."""

    def __init__(self):
        super().__init__()
        self.inside, self.go, self.calls = threading.Event(), threading.Event(), 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            self.inside.set()
            assert self.go.wait(30)
        return x.with_values(x.values * 2)


class _Watched:
    """A re-entrant lock that reports each thread that arrives to take it."""

    def __init__(self, arrived: threading.Event):
        self.lock, self.arrived = threading.RLock(), arrived

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            self.arrived.set()
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def test_graphed_calls_from_two_threads_take_turns():
    """A second thread's batch of the same bucket must not be copied into the static buffers
    while the first thread's call runs on them: it waits for the first call to end."""
    gate = _Gate().eval()
    g = ragged.nn.Graphed(gate, 64, 4, capture=False)
    batches = [
        ragged.pack([torch.full((n, 3), float(i + 1), dtype=torch.float64) for n in lengths])
        for i, lengths in enumerate(([5, 2, 7], [6, 1, 4]))
    ]
    assert g.bucket(14, 3, 7) == g.bucket(11, 3, 6)  # one bucket: the same buffers
    second_waits = threading.Event()  # the second thread has reached the lock, or run without it
    g.lock = _Watched(second_waits)
    results = {}

    def call(i):
        try:
            results[i] = g(batches[i])
        finally:
            if i == 1:
                second_waits.set()

    first = threading.Thread(target=call, args=(0,))
    first.start()
    assert gate.inside.wait(30)
    second = threading.Thread(target=call, args=(1,))
    second.start()
    assert second_waits.wait(30)
    gate.go.set()
    for t in (first, second):
        t.join(30)
        assert not t.is_alive()
    for i, batch in enumerate(batches):
        _close(results[i].values, batch.values * 2)
        assert results[i].offsets is batch.offsets
