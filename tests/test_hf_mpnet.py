"""ragged.nn.convert on HuggingFace MPNet, against the unconverted model (CPU, float64).

Tiny models (2 layers, hidden 32, 4 heads) with random weights, the relative-position bias
table included; lengths up to 45 so that the bias's logarithmic buckets are reached. Outputs
and every parameter's gradient (the bias table's too) equal HuggingFace's on right- and
left-padded batches and RaggedTensors, for the base model and every head.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ragged

tf = pytest.importorskip("transformers")

from hf_convert_cases import _batch, _labels, _ragged, _randomise, _real  # noqa: E402

VOCAB, D, PAD = 50, 32, 1
LENGTHS = [9, 1, 45, 14, 3]
TOL = {"rtol": 1e-9, "atol": 1e-10}
KINDS = {
    "base": "Model",
    "sequence": "ForSequenceClassification",
    "token": "ForTokenClassification",
    "masked_lm": "ForMaskedLM",
    "qa": "ForQuestionAnswering",
}


def _config(kind="base", **over):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=2 * D,
        max_position_embeddings=64,
        pad_token_id=PAD,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2 if kind == "qa" else 3,
    )
    kw.update(over)
    return tf.MPNetConfig(**kw)


def _model(kind="base", seed=0, **over):
    hf = getattr(tf, "MPNet" + KINDS[kind])(_config(kind, **over)).double()
    _randomise(hf, seed)
    with torch.no_grad():  # a bias of the size of the scores, so that a wrong bucket shows
        hf.base_model.encoder.relative_attention_bias.weight.normal_(0.0, 1.0)
    hf.eval()
    ours = copy.deepcopy(hf)
    assert ragged.nn.convert(ours) is ours
    return ours, hf


def test_buckets_are_huggingface_s():
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    from ragged.nn.hf.mpnet import relative_buckets

    d = torch.arange(-700, 701)
    assert torch.equal(relative_buckets(d), MPNetEncoder.relative_position_bucket(d))


@pytest.mark.parametrize("kind", list(KINDS))
def test_outputs_match_hf(kind):
    ours, hf = _model(kind)
    token_level = kind != "sequence"
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
            torch.testing.assert_close(_real(got[key], mask), _real(want[key], mask), **TOL)
    ids, mask = _batch(LENGTHS)
    with torch.no_grad():
        got, want = ours(input_ids=_ragged(ids, mask)), hf(input_ids=ids, attention_mask=mask)
    for key in want.keys():
        if isinstance(got[key], ragged.RaggedTensor):
            torch.testing.assert_close(got[key].values, _real(want[key], mask), **TOL)
        else:
            torch.testing.assert_close(got[key], want[key], **TOL)


def test_hidden_states_match_hf():
    ours, hf = _model()
    ids, mask = _batch(LENGTHS)
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        want = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(_real(g, mask), _real(w, mask), **TOL)


def _same_loss_and_gradients(got, want, ours, hf):
    """HuggingFace's loss, and after backward every parameter's gradient (None where HF's is)."""
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    got.loss.backward()
    want.loss.backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        q = theirs[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-7, atol=1e-9, msg=name)


@pytest.mark.parametrize("kind", ["sequence", "token", "masked_lm", "qa"])
def test_loss_and_gradients_match_hf(kind):
    ours, hf = _model(kind, seed=1)
    ours.train()
    hf.train()
    lengths = [6, 6, 6] if kind == "qa" else LENGTHS  # HuggingFace's QA softmax spans padding too
    ids, mask = _batch(lengths, seed=2)
    extra = _labels(kind, lengths, mask, seed=3)
    got, want = ours(input_ids=ids, attention_mask=mask, **extra), hf(input_ids=ids, attention_mask=mask, **extra)
    _same_loss_and_gradients(got, want, ours, hf)
    table = "relative_attention_bias.weight"
    assert any(table in n and p.grad is not None and p.grad.abs().sum() > 0 for n, p in ours.named_parameters())


def test_one_node_training_matches_hf(monkeypatch):
    """The layers' one-autograd-node training step (the GPU path: the fused ops and the
    hand-written layer backward, here through the torch backends) with the bias: every gradient,
    the shared table's summed over the layers, equals HuggingFace's."""
    import ragged.nn.hf.family as family
    from ragged.nn import layer as layer_mod

    monkeypatch.setattr(family, "fused_backend", lambda x: "torch")
    nodes = []
    real = layer_mod.LayerFunction.apply
    monkeypatch.setattr(layer_mod.LayerFunction, "apply", lambda *a: nodes.append(a[6]) or real(*a))
    ours, hf = _model("sequence", seed=4)
    ours.train()
    hf.train()
    ids, mask = _batch(LENGTHS, seed=5)
    extra = _labels("sequence", LENGTHS, mask, seed=6)
    got, want = ours(input_ids=ids, attention_mask=mask, **extra), hf(input_ids=ids, attention_mask=mask, **extra)
    table = ours.base_model.encoder.relative_attention_bias.weight
    assert len(nodes) == 2 and all(t is table for t in nodes), "the one-node step was not taken with the table"
    _same_loss_and_gradients(got, want, ours, hf)
    assert table.grad.abs().sum() > 0


def test_refused_with_the_model_untouched():
    model = tf.MPNetModel(_config(relative_attention_num_buckets=16))
    with pytest.raises(NotImplementedError, match="relative_attention_num_buckets=16"):
        ragged.nn.convert(model)
    assert "forward" not in model.__dict__
    model = tf.MPNetModel(_config())
    model.encoder.relative_attention_bias.register_forward_hook(lambda *a: None)
    with pytest.raises(NotImplementedError, match="relative_attention_bias has forward hooks"):
        ragged.nn.convert(model)
    assert "forward" not in model.__dict__


@pytest.mark.parametrize(
    "mode", ["mean", "cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken", ("cls", "mean", "max")], ids=str
)
def test_sentence_transformers_over_mpnet(tmp_path, mode):
    """A SentenceTransformer over MPNet (all-mpnet-base-v2's structure: a pooling, then
    Normalize) is converted as a whole: encode's embeddings equal the original's, every pooling."""
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as M
    from test_hf_sentence import TEXTS
    from test_hf_sentence import VOCAB as WORDS

    from ragged.nn.hf import sentence as hf_sentence

    (tmp_path / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    tf.BertTokenizerFast(str(tmp_path / "vocab.txt"), model_max_length=60).save_pretrained(str(tmp_path))
    model = tf.MPNetModel(_config(vocab_size=len(WORDS), pad_token_id=0))
    _randomise(model, 9)
    model.save_pretrained(str(tmp_path))
    modes = mode if isinstance(mode, tuple) else (mode,)
    original = (
        SentenceTransformer(modules=[M.Transformer(str(tmp_path)), M.Pooling(D, modes), M.Normalize()], device="cpu")
        .double()
        .eval()
    )
    ours = copy.deepcopy(original)
    assert hf_sentence.convert_sentence_transformer(ours) is ours
    want = original.encode(TEXTS, convert_to_tensor=True, batch_size=3)
    got = ours.encode(TEXTS, convert_to_tensor=True, batch_size=3)
    torch.testing.assert_close(got, want, **TOL)
