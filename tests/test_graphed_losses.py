"""Losses through ragged.nn.graphed on the CPU (``Graphed(..., capture=False)``: the bucketed
batch the graphs see, run eagerly): a bucket's spare sequences and rows never reach a loss,
whatever the head's loss and the labels' dtype, in training and in evaluation.

Five sequences in a bucket of eight, float64: every head kind of the converted families
(sequence classification as regression with integer and float labels, as single-label and as
multi-label classification; token classification; question answering; masked LM) gives the
loss, the logits and every parameter's gradient of the eager converted model, and the loss and
gradients of HuggingFace's own model on the padded batch (question answering: the converted
model only, whose softmax spans each sequence's real tokens). Labels that no loss of the call
could keep the spare entries out of are refused before anything runs."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_convert_cases import _model as _bert_like
from torch import nn

import ragged

tf = pytest.importorskip("transformers")

LENGTHS = [7, 1, 19, 3, 11]  # 41 tokens, 5 sequences: a bucket of 64 tokens and 8 sequences
PAD = 1
GRAPHED = "ragged.nn.Graphed.forward"


def _family_model(family: str, kind: str, **over):
    """(converted model, HuggingFace's copy), float64."""
    if family == "modernbert":
        from test_hf_modernbert import _model

        return _model(kind, seed=4, **over)
    if family == "mpnet":
        from test_hf_mpnet import _model

        return _model(kind, seed=4, **over)
    return _bert_like(family, kind, seed=4, **over)


# case -> (head kind, config overrides, labels for (generator, B))
CASES = {
    "regression-int": ("sequence", {"num_labels": 1}, lambda g, b: torch.randint(0, 5, (b,), generator=g)),
    "regression-float": ("sequence", {"num_labels": 1}, lambda g, b: torch.randn(b, generator=g, dtype=torch.float64)),
    "regression-float-column": (
        "sequence",
        {"num_labels": 1},
        lambda g, b: torch.randn(b, 1, generator=g, dtype=torch.float64),
    ),
    "regression-3": (
        "sequence",
        {"num_labels": 3, "problem_type": "regression"},
        lambda g, b: torch.randn(b, 3, generator=g, dtype=torch.float64),
    ),
    "single-label": ("sequence", {"num_labels": 3}, lambda g, b: torch.randint(0, 3, (b,), generator=g)),
    "multi-label": (
        "sequence",
        {"num_labels": 3},
        lambda g, b: torch.randint(0, 2, (b, 3), generator=g).to(torch.float64),
    ),
    "multi-label-set": (
        "sequence",
        {"num_labels": 3, "problem_type": "multi_label_classification"},
        lambda g, b: torch.rand(b, 3, generator=g, dtype=torch.float64),
    ),
    "token": ("token", {}, None),
    "masked-lm": ("masked_lm", {}, None),
    "qa": ("qa", {}, None),
}


def _sequences(seed=6):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 50, (n,), generator=g) for n in LENGTHS]


def _padded(seqs, fill):
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), fill, dtype=seqs[0].dtype)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


def _inputs(case: str, kind: str, labels_fn, seed=7):
    """(keyword arguments of the ragged call, those of HuggingFace's padded call)."""
    seqs = _sequences()
    ids = ragged.pack(seqs)
    padded = _padded(seqs, PAD)
    mask = _padded([torch.ones(len(s), dtype=torch.long) for s in seqs], 0)
    g = torch.Generator().manual_seed(seed)
    ours, theirs = {"input_ids": ids}, {"input_ids": padded, "attention_mask": mask}
    if kind == "sequence":
        labels = labels_fn(g, len(seqs))
        ours["labels"], theirs["labels"] = labels, labels
    elif kind == "qa":
        n = torch.tensor(LENGTHS)
        start = (torch.rand(len(seqs), generator=g) * n).long()
        end = (torch.rand(len(seqs), generator=g) * n).long()
        end[2] = 40  # past its sequence: ignored
        ours.update(start_positions=start, end_positions=end)
    else:
        high = 3 if kind == "token" else 50
        token = [torch.randint(0, high, (n,), generator=g) for n in LENGTHS]
        for t in token:
            t[::3] = -100  # ignored tokens of the batch itself
        ours["labels"] = ragged.pack(token)
        theirs["labels"] = _padded(token, -100)
    return ours, theirs


def _poison(g: ragged.nn.Graphed) -> None:
    for buf in g._static_buffers.values():
        if buf.is_floating_point():
            buf.fill_(float("nan"))


def _main(out):
    return out.start_logits if "start_logits" in out else out.logits


def _as_tensor(x):
    return x.values if isinstance(x, ragged.RaggedTensor) else x


def _grads(module):
    return {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


def _same_grads(got, want, tol):
    assert got.keys() == want.keys()
    for n in want:
        if want[n] is None:
            assert got[n] is None or torch.all(got[n] == 0), n
        else:
            assert got[n] is not None, n
            torch.testing.assert_close(got[n], want[n], rtol=tol, atol=tol, msg=n)


def _hf_tol(family: str) -> float:
    return 1e-5 if family == "modernbert" else 1e-8  # HuggingFace's ModernBERT rounds its rotary angles to float32


def _check(family: str, case: str, train: bool) -> None:
    kind, over, labels_fn = CASES[case]
    ours, hf = _family_model(family, kind, **over)
    mine = copy.deepcopy(ours)
    for m in (ours, hf, mine):
        m.train(train)
    g = ragged.nn.Graphed(mine, 256, 8, capture=False)
    kw, hf_kw = _inputs(case, kind, labels_fn)
    # an earlier batch of another bucket, then NaN in every buffer: nothing real may read a spare row
    g(input_ids=ragged.pack([torch.randint(5, 50, (n,)) for n in (40, 2)]))
    _poison(g)
    with torch.set_grad_enabled(train):
        want = ours(**kw)
        got = g(**kw)
        theirs = hf(**hf_kw) if kind != "qa" else None
    assert got.loss is not None and got.loss.dim() == 0
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(_as_tensor(_main(got)), _as_tensor(_main(want)), rtol=1e-10, atol=1e-10)
    assert list(got.keys()) == list(want.keys())
    if theirs is not None:
        torch.testing.assert_close(got.loss, theirs.loss, rtol=_hf_tol(family), atol=_hf_tol(family))
    if not train:
        assert not got.loss.requires_grad
        return
    got.loss.backward()
    want.loss.backward()
    _same_grads(_grads(mine), _grads(ours), 1e-8)
    if theirs is not None:
        theirs.loss.backward()
        _same_grads(_grads(mine), _grads(hf), 10 * _hf_tol(family))


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("case", list(CASES))
def test_bert_losses_skip_spare_sequences(case, train):
    _check("bert", case, train)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("case", ["regression-int", "regression-float", "multi-label", "single-label", "token", "qa"])
@pytest.mark.parametrize("family", ["roberta", "distilbert", "electra", "mpnet", "modernbert"])
def test_other_families_losses_skip_spare_sequences(family, case, train):
    _check(family, case, train)


def test_tuple_outputs_put_the_loss_first():
    ours, _ = _family_model("bert", "sequence", num_labels=1)
    g = ragged.nn.Graphed(copy.deepcopy(ours), 256, 8, capture=False)
    kw, _ = _inputs("regression-float", "sequence", CASES["regression-float"][2])
    with torch.no_grad():
        want = ours(**kw, return_dict=False)
        got = g(**kw, return_dict=False)
    assert type(got) is tuple and len(got) == len(want) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_labels_no_loss_could_keep_spare_entries_out_of_are_refused(train):
    def call(model, **kw):
        model.train(train)
        g = ragged.nn.Graphed(model, 256, 8, capture=False)
        with (
            pytest.raises(ValueError, match=GRAPHED.replace(".", r"\.") + r"\(\): expected .*") as err,
            torch.set_grad_enabled(train),
        ):
            g(input_ids=ragged.pack(_sequences()), **kw)
        assert g.num_graphs == 0
        return str(err.value)

    b = len(LENGTHS)
    # float labels of a shape neither a multi-label nor a regression loss of 3 labels takes
    why = call(_family_model("bert", "sequence")[0], labels=torch.ones(b, dtype=torch.float64))
    assert "got labels of dtype torch.float64 and shape (5,)" in why
    why = call(_family_model("bert", "sequence", num_labels=1)[0], labels=torch.ones(b, 2))
    assert "shape (5, 2)" in why
    # float labels of a cross-entropy head
    ids = ragged.pack(_sequences())
    why = call(_family_model("bert", "token")[0], labels=ids.with_values(torch.zeros(ids.num_tokens)))
    assert "integer labels" in why and "torch.float32" in why
    why = call(
        _family_model("bert", "sequence", problem_type="single_label_classification")[0],
        labels=torch.ones(b, dtype=torch.float64),
    )
    assert "integer labels" in why
    # float span positions
    why = call(_family_model("bert", "qa")[0], start_positions=torch.zeros(b), end_positions=torch.zeros(b))
    assert "start_positions" in why


class _Scored(nn.Module):
    """A module of its own with a loss the graphs cannot see into: a float label per sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 1, dtype=torch.float64)

    def forward(self, x: ragged.RaggedTensor, labels: torch.Tensor):
        score = self.proj(ragged.pool(x, "mean")).squeeze(-1)
        return score, ((score - labels) ** 2).mean()


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_float_labels_of_other_modules_are_refused(train):
    model = _Scored().train(train)
    g = ragged.nn.Graphed(model, 256, 8, capture=False)
    x = ragged.pack([torch.randn(n, 4, dtype=torch.float64) for n in LENGTHS])
    with (
        pytest.raises(
            ValueError,
            match=r"ragged\.nn\.Graphed\.forward\(\): expected integer labels .* got labels "
            r"of dtype torch\.float64",
        ),
        torch.set_grad_enabled(train),
    ):
        g(x, labels=torch.randn(len(LENGTHS), dtype=torch.float64))
    assert g.num_graphs == 0
