"""ragged.nn.convert on HuggingFace BERT-family models, against the unconverted model.

Tiny float64 models (2 layers, hidden 32, 4 heads, vocabulary 50) with random weights, for
every family and head: outputs at real positions, losses and every parameter's gradient
equal HuggingFace's on right-, left- and scattered-padded batches and on RaggedTensors
(lengths 1 to 17, one sequence of length 0 where the model allows it); what is kept
(module tree, Parameters, state_dict keys, save_pretrained round trip, deepcopy, pickle);
what is refused, with the model untouched.
"""

from __future__ import annotations

import copy
import inspect
import io
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import ragged

tf = pytest.importorskip("transformers")

VOCAB, D, PAD, MAXPOS = 50, 32, 1, 64
LENGTHS = [4, 1, 17, 9]
TOL = {"rtol": 1e-9, "atol": 1e-10}  # float64 on both sides

FAMILIES = {
    "bert": (tf.BertConfig, "Bert"),
    "roberta": (tf.RobertaConfig, "Roberta"),
    "xlm-roberta": (tf.XLMRobertaConfig, "XLMRoberta"),
    "camembert": (tf.CamembertConfig, "Camembert"),
    "electra": (tf.ElectraConfig, "Electra"),
    "distilbert": (tf.DistilBertConfig, "DistilBert"),
}
KINDS = {"base": "Model", "sequence": "ForSequenceClassification", "token": "ForTokenClassification",
         "masked_lm": "ForMaskedLM", "qa": "ForQuestionAnswering"}


def _config(family: str, kind: str = "base", **over):
    cls = FAMILIES[family][0]
    if family == "distilbert":
        kw = dict(vocab_size=VOCAB, dim=D, n_layers=2, n_heads=4, hidden_dim=2 * D, max_position_embeddings=MAXPOS,
                  dropout=0.0, attention_dropout=0.0, qa_dropout=0.0, seq_classif_dropout=0.0, pad_token_id=PAD)
    else:
        kw = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=2 * D, max_position_embeddings=MAXPOS, type_vocab_size=2,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD)
        if family == "electra":
            kw["embedding_size"] = 24  # != hidden: embeddings_project
    kw["num_labels"] = 2 if kind == "qa" else 3
    kw.update(over)
    return cls(**kw)


def _randomise(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            if "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif p.dim() == 2:
                p.copy_(noise * p.shape[-1] ** -0.5 * (3.0 if "embeddings" in name else 1.0))
            else:
                p.copy_(0.1 * noise)


def _model(family: str, kind: str = "base", seed: int = 0, dtype=torch.float64, **over):
    """(converted model, untouched HuggingFace copy)."""
    cls = getattr(tf, FAMILIES[family][1] + KINDS[kind])
    hf = cls(_config(family, kind, **over)).to(dtype)
    _randomise(hf, seed)
    hf.eval()
    ours = copy.deepcopy(hf)
    assert ragged.nn.convert(ours) is ours
    return ours, hf


def _batch(lengths, side="right", seed=0, width=None):
    """(ids [B, M], mask [B, M] long): pad id at padding, one real token equal to the pad id."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths) if width is None else width
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=g)
    j = torch.arange(width)
    n = torch.tensor(lengths).unsqueeze(1)
    keep = (j >= width - n) if side == "left" else (j < n)
    ids = ids.masked_fill(~keep, PAD)
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    if lengths[longest] > 3:  # RoBERTa's positions skip a real token equal to the pad id
        ids[longest, keep[longest].nonzero()[2, 0]] = PAD
    return ids, keep.long()


def _ragged(ids, mask):
    return ragged.pack([row[m.bool()] for row, m in zip(ids, mask)])


def _real(x, mask):
    return x[mask.bool()]


def _main(out, kind):
    return {"base": "last_hidden_state", "qa": "start_logits"}.get(kind, "logits")


# --------------------------------------------------------------------------------------
# Outputs


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_outputs_match_hf(family, kind):
    ours, hf = _model(family, kind)
    token_level = kind not in ("sequence",)
    for side in ("right", "left"):
        ids, mask = _batch(LENGTHS, side)
        with torch.no_grad():
            got, want = ours(input_ids=ids, attention_mask=mask), hf(input_ids=ids, attention_mask=mask)
        assert type(got) is type(want) and list(got.keys()) == list(want.keys())
        for key in want.keys():
            if key == "pooler_output" or (not token_level and key == "logits"):
                if side == "right":  # HuggingFace reads column 0: padding when left-padded
                    torch.testing.assert_close(got[key], want[key], **TOL)
                continue
            assert got[key].shape == want[key].shape, key
            torch.testing.assert_close(_real(got[key], mask), _real(want[key], mask), **TOL)
            assert torch.all(got[key][~mask.bool()] == 0), f"{key}: padding is not zero"
    # a RaggedTensor in: token-level outputs ragged, sequence-level ones [B, ...]
    ids, mask = _batch(LENGTHS)
    with torch.no_grad():
        got, want = ours(input_ids=_ragged(ids, mask)), hf(input_ids=ids, attention_mask=mask)
    for key in want.keys():
        if isinstance(got[key], ragged.RaggedTensor):
            assert got[key].host_lengths() == LENGTHS
            torch.testing.assert_close(got[key].values, _real(want[key], mask), **TOL)
        else:
            assert key == "pooler_output" or kind == "sequence", key
            torch.testing.assert_close(got[key], want[key], **TOL)


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_scattered_mask_and_full_rows(family):
    ours, hf = _model(family)
    ids, mask = _batch([6, 6, 6])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).last_hidden_state, hf(ids).last_hidden_state, **TOL)
    mask = mask.clone()
    mask[0, 2] = mask[2, 0] = 0  # holes: tokens are no single run at either end
    ids = ids.masked_fill(mask == 0, PAD)  # RoBERTa's positions match HuggingFace's when padding holds the pad id
    with torch.no_grad():
        got, want = ours(input_ids=ids, attention_mask=mask), hf(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(_real(got.last_hidden_state, mask), _real(want.last_hidden_state, mask), **TOL)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_garbage_at_padding_does_not_leak(family):
    """Any id at padding (and NaN embeddings at padding) leaves the real positions as they were."""
    ours, _ = _model(family, "token")
    ids, mask = _batch(LENGTHS, "left")
    dirty = torch.where(mask.bool(), ids, torch.randint(0, VOCAB, ids.shape))
    with torch.no_grad():
        clean = ours(input_ids=ids, attention_mask=mask).logits
        got = ours(input_ids=dirty, attention_mask=mask).logits
        torch.testing.assert_close(got, clean, rtol=0, atol=0)
        emb = ours.get_input_embeddings()(ids)
        poisoned = emb.masked_fill(~mask.bool().unsqueeze(-1), float("nan"))
        a = ours(inputs_embeds=emb, attention_mask=mask).logits
        b = ours(inputs_embeds=poisoned, attention_mask=mask).logits
    torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_embeddings_token_types_and_positions(family):
    ours, hf = _model(family)
    ids, mask = _batch(LENGTHS)
    g = torch.Generator().manual_seed(5)
    extra = {}
    if family != "distilbert":
        extra["token_type_ids"] = torch.randint(0, 2, ids.shape, generator=g) * mask
    with torch.no_grad():
        emb = hf.get_input_embeddings()(ids)
        for kw in ({"input_ids": ids}, {"inputs_embeds": emb}):
            want = hf(attention_mask=mask, **kw, **extra).last_hidden_state
            got = ours(attention_mask=mask, **kw, **extra).last_hidden_state
            torch.testing.assert_close(_real(got, mask), _real(want, mask), **TOL)
            # RaggedTensor in: inputs_embeds, token types and explicit positions as RaggedTensors
            rkw = {k: _ragged(v, mask) for k, v in kw.items()}
            rextra = {k: _ragged(v, mask) for k, v in extra.items()}
            got = ours(**rkw, **rextra).last_hidden_state
            torch.testing.assert_close(got.values, _real(want, mask), **TOL)
        # explicit position ids, padded [B, M] and broadcast [1, M], and ragged
        pos = torch.arange(3, 3 + ids.shape[1]).unsqueeze(0)
        want = hf(input_ids=ids, attention_mask=mask, position_ids=pos.expand_as(ids), **extra).last_hidden_state
        got = ours(input_ids=ids, attention_mask=mask, position_ids=pos, **extra).last_hidden_state
        torch.testing.assert_close(_real(got, mask), _real(want, mask), **TOL)
        got = ours(input_ids=_ragged(ids, mask), position_ids=_ragged(pos.expand_as(ids), mask),
                   **{k: _ragged(v, mask) for k, v in extra.items()}).last_hidden_state
        torch.testing.assert_close(got.values, _real(want, mask), **TOL)


def test_hidden_states_and_tuples():
    ours, hf = _model("electra")
    ids, mask = _batch(LENGTHS)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        got = ours(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        assert len(got.hidden_states) == len(want.hidden_states) == 3
        for a, b in zip(got.hidden_states, want.hidden_states):
            torch.testing.assert_close(_real(a, mask), _real(b, mask), **TOL)
        rt = ours(input_ids=_ragged(ids, mask), output_hidden_states=True).hidden_states
        for a, b in zip(rt, want.hidden_states):
            torch.testing.assert_close(a.values, _real(b, mask), **TOL)
        # a selection of layers, as HuggingFace selects
        sel = ours(input_ids=ids, attention_mask=mask, output_hidden_states=[1]).hidden_states
        ref = hf(input_ids=ids, attention_mask=mask, output_hidden_states=[1]).hidden_states
        assert [h is None for h in sel] == [h is None for h in ref]
        torch.testing.assert_close(_real(sel[1], mask), _real(ref[1], mask), **TOL)
        # HuggingFace's own output-capturing hooks (now on hf's layers) do not stop a conversion
        assert any(layer._forward_hooks for layer in hf.encoder.layer)
        again = ragged.nn.convert(copy.deepcopy(hf))
        torch.testing.assert_close(again(input_ids=ids, attention_mask=mask).last_hidden_state,
                                   got.last_hidden_state, rtol=0, atol=0)
        # return_dict=False: HuggingFace's tuple
        t_ours = ours(input_ids=ids, attention_mask=mask, return_dict=False)
        t_hf = hf(input_ids=ids, attention_mask=mask, return_dict=False)
    assert isinstance(t_ours, tuple) and len(t_ours) == len(t_hf)
    clf, clf_hf = _model("bert", "sequence")
    with torch.no_grad():
        a = clf(ids, mask, return_dict=False)  # positional arguments in HuggingFace's order
        b = clf_hf(ids, mask, return_dict=False)
    assert len(a) == len(b) == 1
    torch.testing.assert_close(a[0], b[0], **TOL)


def test_empty_sequences_and_empty_batch():
    ours, hf = _model("bert")
    lengths = [3, 0, 5]
    ids, mask = _batch(lengths, width=6)
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask)
        rt = ours(input_ids=_ragged(ids, mask))
        want = hf(input_ids=ids[[0, 2]], attention_mask=mask[[0, 2]])
    torch.testing.assert_close(_real(got.last_hidden_state, mask), _real(want.last_hidden_state, mask[[0, 2]]), **TOL)
    assert rt.last_hidden_state.host_lengths() == lengths
    torch.testing.assert_close(rt.pooler_output[[0, 2]], want.pooler_output, **TOL)
    empty = ragged.RaggedTensor.from_lengths(torch.zeros(0, dtype=torch.long), [])
    with torch.no_grad():
        out = ours(input_ids=empty)
    assert out.last_hidden_state.values.shape == (0, D) and out.pooler_output.shape == (0, D)


# --------------------------------------------------------------------------------------
# Training


def _labels(kind, lengths, mask, seed):
    g = torch.Generator().manual_seed(seed)
    b, m = mask.shape
    if kind == "sequence":
        return {"labels": torch.randint(0, 3, (b,), generator=g)}
    if kind == "qa":
        n = torch.tensor(lengths)
        return {"start_positions": (torch.rand(b, generator=g) * n).long(),
                "end_positions": (torch.rand(b, generator=g) * n).long()}
    high = 3 if kind == "token" else VOCAB
    labels = torch.randint(0, high, (b, m), generator=g)
    labels[torch.rand(b, m, generator=g) < 0.3] = -100
    return {"labels": labels.masked_fill(~mask.bool(), -100)}


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
    from ragged.nn.hf_encoder import layer_spec

    for family, over, style, rates in (
            ("bert", dict(attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.2), "bert", (0.1, 0.2, 0.0, 0.2)),
            ("distilbert", dict(attention_dropout=0.1, dropout=0.2), "distil", (0.1, 0.0, 0.0, 0.2))):
        ours, _ = _model(family, **over)
        layers = (ours.transformer if style == "distil" else ours.encoder).layer
        ours.train()
        assert layer_spec(style, layers[0]).dropout == rates
        ours.eval()
        assert layer_spec(style, layers[0]).dropout == (0.0, 0.0, 0.0, 0.0)
    for act, fused in (("gelu", "gelu"), ("gelu_new", "gelu_tanh"), ("gelu_pytorch_tanh", "gelu_tanh"),
                       ("relu", "relu"), ("silu", None)):
        ours, hf = _model("bert", hidden_act=act)
        spec = layer_spec("bert", ours.encoder.layer[0])
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


# --------------------------------------------------------------------------------------
# What is kept


def test_module_tree_parameters_and_state_dict_are_kept(tmp_path):
    hf = tf.RobertaForMaskedLM(_config("roberta", "masked_lm"))
    params = {n: p for n, p in hf.named_parameters()}
    keys = list(hf.state_dict())
    modules = [type(m) for m in hf.modules()]
    ragged.nn.convert(hf)
    assert {n: p for n, p in hf.named_parameters()} == params  # the same objects
    assert list(hf.state_dict()) == keys and [type(m) for m in hf.modules()] == modules
    assert type(hf) is tf.RobertaForMaskedLM
    assert inspect.signature(hf.forward) == inspect.signature(tf.RobertaForMaskedLM.forward.__get__(hf))
    hf.save_pretrained(tmp_path)
    assert tf.AutoConfig.from_pretrained(tmp_path).architectures == ["RobertaForMaskedLM"]
    again = tf.RobertaForMaskedLM.from_pretrained(tmp_path)
    assert "forward" not in again.__dict__  # a plain HuggingFace model until converted
    for a, b in zip(again.state_dict().values(), hf.state_dict().values()):
        assert torch.equal(a, b)
    ragged.nn.convert(again)
    rt = _ragged(*_batch(LENGTHS))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=rt).logits.values, hf(input_ids=rt).logits.values)


def test_deepcopy_pickle_and_convert_twice():
    ours, hf = _model("distilbert", "sequence")
    assert ragged.nn.convert(ours) is ours  # a second conversion changes nothing
    rt = _ragged(*_batch(LENGTHS))
    with torch.no_grad():
        want = ours(input_ids=rt).logits
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours)), torch.load(buffer, weights_only=False)):
        assert other.forward.module is other and other.distilbert.forward.module is other.distilbert
        with torch.no_grad():
            torch.testing.assert_close(other(input_ids=rt).logits, want, rtol=0, atol=0)
    copied = ragged.nn.convert(hf, copy=True)
    assert copied is not hf and "forward" not in hf.__dict__
    with torch.no_grad():
        torch.testing.assert_close(copied(input_ids=rt).logits, want, **TOL)


class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.text = tf.BertModel(_config("bert")).double()
        layer = nn.TransformerEncoderLayer(D, 4, 2 * D, dropout=0.0, batch_first=True, dtype=torch.float64)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)


def test_model_with_torch_and_hf_parts():
    model = _Mixed().eval()
    ref = copy.deepcopy(model)
    copied = ragged.nn.convert(model, copy=True)
    assert copied is model and model.text is not ref.text and isinstance(model.enc, ragged.nn.TransformerEncoder)
    assert ragged.nn.hf_bert.is_converted(model.text)
    ids, mask = _batch(LENGTHS)
    with torch.no_grad():
        got = model.text(input_ids=ids, attention_mask=mask).last_hidden_state
        want = ref.text(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(_real(got, mask), _real(want, mask), **TOL)


class _MyClassifier(tf.BertForSequenceClassification):
    """A subclass defined outside transformers: a container whose BertModel is converted."""


def test_subclass_defined_elsewhere_converts_its_base_model():
    model = _MyClassifier(_config("bert", "sequence")).double().eval()
    _randomise(model, 3)
    ref = copy.deepcopy(model)
    assert ragged.nn.convert(model) is model
    assert "forward" not in model.__dict__ and ragged.nn.hf_bert.is_converted(model.bert)
    ids, mask = _batch(LENGTHS)
    with torch.no_grad():  # HuggingFace's head code on the converted base model's padded outputs
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits,
                                   ref(input_ids=ids, attention_mask=mask).logits, **TOL)


def test_nested_model_that_cannot_be_converted():
    """Inside another model, a HuggingFace model convert cannot take is left with the reason
    (a warning; strict=True raises and changes nothing), as a torch.nn module would be."""
    model = _Mixed()
    model.text = tf.BertModel(_config("bert", is_decoder=True))
    with pytest.warns(UserWarning, match="'text' \\(BertModel\\): config.is_decoder"):
        ragged.nn.convert(model)
    assert "forward" not in model.text.__dict__ and isinstance(model.enc, ragged.nn.TransformerEncoder)
    model = _Mixed()
    model.text = tf.BertModel(_config("bert", is_decoder=True))
    with pytest.raises(NotImplementedError, match="is_decoder"):
        ragged.nn.convert(model, strict=True)
    assert type(model.enc) is nn.TransformerEncoder and "forward" not in model.text.__dict__


def test_sentence_transformers_contract():
    """A base model takes input_ids and token_type_ids as RaggedTensors and gives
    last_hidden_state as a RaggedTensor over the input's offsets."""
    ours, hf = _model("bert")
    ids, mask = _batch(LENGTHS)
    rt = _ragged(ids, mask)
    types = rt.with_values(torch.ones_like(rt.values))
    with torch.no_grad():
        out = ours(input_ids=rt, token_type_ids=types, return_dict=True)[0]
        want = hf(input_ids=ids, attention_mask=mask, token_type_ids=torch.ones_like(ids)).last_hidden_state
    assert isinstance(out, ragged.RaggedTensor) and out.offsets is rt.offsets and out.max_len == rt.max_len
    torch.testing.assert_close(out.values, _real(want, mask), **TOL)


def test_converting_a_torch_model_imports_no_transformers():
    code = ("import sys, torch, ragged, ragged.nn\n"
            "m = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1,"
            " enable_nested_tensor=False)\n"
            "ragged.nn.convert(m)\nprint('transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


# --------------------------------------------------------------------------------------
# Refusals


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _refused(model, *words):
    before, ref = _state(model), copy.deepcopy(model).eval()
    with pytest.raises(NotImplementedError) as err:
        ragged.nn.convert(model)
    text = str(err.value)
    for word in (type(model).__name__, *words):
        assert word in text, (word, text)
    assert "forward" not in model.__dict__ and all("forward" not in m.__dict__ for m in model.modules())
    after = _state(model)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    ids, mask = _batch([3, 5])
    with torch.no_grad():
        a, b = model.eval()(input_ids=ids, attention_mask=mask), ref(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)


def test_refusals_leave_the_model_untouched():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # DeBERTa builds with torch.jit.script
        deberta = tf.DebertaModel(tf.DebertaConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=1,
                                                   num_attention_heads=4, intermediate_size=2 * D))
    _refused(deberta, "DeBERTa")
    _refused(tf.BertForNextSentencePrediction(_config("bert")), "not a supported BERT class")
    _refused(tf.BertModel(_config("bert", is_decoder=True)), "is_decoder")
    config = _config("roberta")
    config.position_embedding_type = "relative_key"
    _refused(tf.RobertaModel(config), "position_embedding_type")
    hooked = tf.ElectraForTokenClassification(_config("electra", "token"))
    hooked.electra.encoder.layer[1].output.register_forward_hook(lambda *a: None)
    _refused(hooked, "electra.encoder.layer.1.output", "hook")

    class LoraLinear(nn.Linear):
        pass

    lora = tf.BertForSequenceClassification(_config("bert", "sequence"))
    old = lora.bert.encoder.layer[0].attention.self.query
    new = LoraLinear(D, D)
    new.load_state_dict(old.state_dict())
    lora.bert.encoder.layer[0].attention.self.query = new
    _refused(lora, "LoraLinear")
    # a Linear swapped in after conversion is refused at call time, not read as a plain Linear
    ours, _ = _model("bert")
    ours.encoder.layer[1].attention.self.value = new.double()
    with pytest.raises(NotImplementedError, match="v projection is a LoraLinear"):
        ours(input_ids=_ragged(*_batch(LENGTHS)))
    dispatched = tf.DistilBertModel(_config("distilbert"))
    dispatched.transformer.layer[0]._hf_hook = object()
    _refused(dispatched, "accelerate")


def test_call_time_refusals_and_bad_inputs():
    ours, _ = _model("bert")
    ids, mask = _batch(LENGTHS)
    rt = _ragged(ids, mask)
    fn = "BertModel.forward"
    for kw, what in (({"output_attentions": True}, "output_attentions"),
                     ({"head_mask": torch.ones(2, 4)}, "head_mask"),
                     ({"encoder_hidden_states": torch.zeros(4, 3, D)}, "cross-attention"),
                     ({"past_key_values": object()}, "past_key_values")):
        with pytest.raises(NotImplementedError, match=what):
            ours(input_ids=rt, **kw)
    with pytest.raises(NotImplementedError, match="4-D"):
        ours(input_ids=ids, attention_mask=mask[:, None, None, :])
    with pytest.raises(ValueError, match=f"{fn}.*attention_mask applies to padded inputs"):
        ours(input_ids=rt, attention_mask=mask)
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        ours(input_ids=ids, inputs_embeds=torch.zeros(4, 17, D, dtype=torch.float64))
    with pytest.raises(ValueError, match="1 \\(token\\) and 0 \\(padding\\)"):
        ours(input_ids=ids, attention_mask=mask * 2)
    with pytest.raises(ValueError, match="token_type_ids"):
        ours(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="token_type_ids"):
        ours(input_ids=rt, token_type_ids=torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="input_ids"):
        ours(input_ids=[[1, 2]])
    with pytest.raises(TypeError, match="multiple values"):
        ours(ids, input_ids=ids)
