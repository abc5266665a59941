"""ragged.nn.convert of HuggingFace models, training: losses and gradients against HF's for every
family and head, problem types, question-answering spans, dropout, gradient checkpointing and the
inference cache following the weights."""

from __future__ import annotations

import pytest
import torch

import ragged

tf = pytest.importorskip("transformers")

from hf_convert_cases import (  # noqa: E402
    FAMILIES,
    KINDS,
    LENGTHS,
    TOL,
    _batch,
    _labels,
    _model,
    _ragged,
    _real,
)

# --------------------------------------------------------------------------------------
# Training


def _grads(model):
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_training_loss_and_gradients_match_hf(family, kind):
    """Train mode (dropout 0): the loss and every parameter's gradient equal HuggingFace's,
    for a RaggedTensor input and for the padded one (question answering on full rows:
    HuggingFace's softmax there spans the padding)."""
    ours, hf = _model(family, kind, seed=1)
    ours.train(), hf.train()
    lengths = [6, 6, 6] if kind == "qa" else LENGTHS
    ids, mask = _batch(lengths, seed=2)
    labels = _labels(kind, lengths, mask, 3)

    def loss_of(model, padded):
        if padded:
            out = model(input_ids=ids, attention_mask=mask, **labels)
        else:
            rlabels = {k: (_ragged(v, mask) if v.dim() == 2 else v) for k, v in labels.items()}
            out = model(input_ids=_ragged(ids, mask), **rlabels)
        if kind == "base":
            out_h = out.last_hidden_state
            h = out_h.values if isinstance(out_h, ragged.RaggedTensor) else _real(out_h, mask)
            w = torch.linspace(-1, 1, h.numel(), dtype=h.dtype).view_as(h)
            return (h * w).sum() + out.pooler_output.square().sum() if family in ("bert", "roberta") else (h * w).sum()
        return out.loss

    want = loss_of(hf, True)
    want.backward()
    want_grads = _grads(hf)
    for padded in (False, True):
        ours.zero_grad()
        got = loss_of(ours, padded)
        torch.testing.assert_close(got, want, **TOL)
        got.backward()
        grads = _grads(ours)
        assert grads.keys() == want_grads.keys()
        for name, g in grads.items():
            if want_grads[name] is None:
                assert g is None or torch.all(g == 0), name
            else:
                torch.testing.assert_close(g, want_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("problem", ["regression", "single_label_classification", "multi_label_classification"])
def test_sequence_problem_types(problem):
    num_labels = 1 if problem == "regression" else 3
    ours, hf = _model("roberta", "sequence", num_labels=num_labels)
    ids, mask = _batch(LENGTHS)
    g = torch.Generator().manual_seed(4)
    if problem == "regression":
        labels = torch.randn(len(LENGTHS), generator=g, dtype=torch.float64)
    elif problem == "multi_label_classification":
        labels = (torch.rand(len(LENGTHS), 3, generator=g) < 0.5).double()
    else:
        labels = torch.randint(0, 3, (len(LENGTHS),), generator=g)
    got = ours(input_ids=_ragged(ids, mask), labels=labels).loss
    want = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(got, want, **TOL)
    assert ours.config.problem_type == hf.config.problem_type == problem


def test_question_answering_loss_spans_real_tokens():
    """Ragged and padded inputs: each sequence's softmax over its own tokens; positions past a
    sequence (clamped to the padded width, as HuggingFace clamps) are ignored."""
    ours, hf = _model("bert", "qa")
    lengths = [5, 1, 9]
    n = torch.tensor(lengths)
    starts, ends = torch.tensor([2, 0, 30]), torch.tensor([4, 3, 8])  # 30: clamped, ignored; 3: past length 1

    def ce(logits, mask, target):
        rows = [row[m.bool()] for row, m in zip(logits, mask)]
        return torch.stack([-torch.log_softmax(r, 0)[t] for r, t in zip(rows, target.tolist()) if t < len(r)]).mean()

    for side in ("right", "left"):
        ids, mask = _batch(lengths, side)
        with torch.no_grad():
            out = hf(input_ids=ids, attention_mask=mask)
        want = (ce(out.start_logits, mask, starts) + ce(out.end_logits, mask, ends)) / 2
        shift = ids.shape[1] - n if side == "left" else torch.zeros_like(n)
        # the same targets as columns of the padded batch (past a sequence: beyond the width)
        s = torch.where(starts < n, starts + shift, 99)
        e = torch.where(ends < n, ends + shift, 99)
        with torch.no_grad():
            got = ours(input_ids=ids, attention_mask=mask, start_positions=s, end_positions=e).loss
        torch.testing.assert_close(got, want, **TOL)
        if side == "right":
            with torch.no_grad():
                got = ours(input_ids=_ragged(ids, mask), start_positions=starts, end_positions=ends).loss
            torch.testing.assert_close(got, want, **TOL)


def test_dropout_rates_and_activations():
    from ragged.nn import hf as convert_hf

    def layer_spec(model, layer):
        return convert_hf.identify(model)[0].layer_spec(layer)

    for family, over, style, rates in (
        ("bert", dict(attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.2), "bert", (0.1, 0.2, 0.0, 0.2)),
        ("distilbert", dict(attention_dropout=0.1, dropout=0.2), "distil", (0.1, 0.0, 0.0, 0.2)),
    ):
        ours, _ = _model(family, **over)
        layers = (ours.transformer if style == "distil" else ours.encoder).layer
        ours.train()
        assert layer_spec(ours, layers[0]).dropout == rates
        ours.eval()
        assert layer_spec(ours, layers[0]).dropout == (0.0, 0.0, 0.0, 0.0)
    for act, fused in (
        ("gelu", "gelu"),
        ("gelu_new", "gelu_tanh"),
        ("gelu_pytorch_tanh", "gelu_tanh"),
        ("relu", "relu"),
        ("silu", None),
    ):
        ours, hf = _model("bert", hidden_act=act)
        spec = layer_spec(ours, ours.encoder.layer[0])
        module = ours.encoder.layer[0].intermediate.intermediate_act_fn
        assert spec.activation == fused if fused else spec.activation is module
        ids, mask = _batch(LENGTHS)
        with torch.no_grad():
            got, want = ours(input_ids=ids, attention_mask=mask), hf(input_ids=ids, attention_mask=mask)
        torch.testing.assert_close(_real(got.last_hidden_state, mask), _real(want.last_hidden_state, mask), **TOL)


def test_dropout_active_in_training_only():
    ours, _ = _model("roberta", "token", hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3)
    rt = _ragged(*_batch([5, 2, 7]))
    ours.train()
    a, b = ours(input_ids=rt).logits.values, ours(input_ids=rt).logits.values
    assert not torch.equal(a, b)
    ours.eval()
    with torch.no_grad():
        assert torch.equal(ours(input_ids=rt).logits.values, ours(input_ids=rt).logits.values)


def test_gradient_checkpointing():
    ours, hf = _model("bert", "token")
    for m in (ours, hf):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
    ids, mask = _batch(LENGTHS)
    labels = _labels("token", LENGTHS, mask, 1)
    hf(input_ids=ids, attention_mask=mask, **labels).loss.backward()
    ours(input_ids=_ragged(ids, mask), labels=_ragged(labels["labels"], mask)).loss.backward()
    for (name, p), q in zip(ours.named_parameters(), hf.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_inference_cache_follows_the_weights():
    """The packed Q/K/V of inference is rebuilt after an in-place update, load_state_dict and
    a dtype change."""
    ours, hf = _model("bert")
    rt = _ragged(*_batch(LENGTHS))
    ids, mask = _batch(LENGTHS)

    def check(dtype=torch.float64):
        with torch.no_grad():
            got = ours(input_ids=rt).last_hidden_state.values
            want = _real(hf(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
        tol = TOL if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(got, want, **tol)

    check()
    with torch.no_grad():
        for m in (ours, hf):
            m.encoder.layer[1].attention.self.key.weight.mul_(1.5)
            m.encoder.layer[0].attention.self.value.bias.add_(0.25)
    check()
    state = {k: v + 0.01 for k, v in hf.state_dict().items()}
    hf.load_state_dict(state)
    ours.load_state_dict(state)
    check()
    ours.float(), hf.float()
    check(torch.float32)
