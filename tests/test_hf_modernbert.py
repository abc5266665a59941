"""ragged.nn.convert on HuggingFace ModernBERT, against the unconverted model (CPU).

Tiny models (4 layers: global, local, local, global; hidden 32, 2 heads of 16; local window
of 4 tokens each side, so that sequences of up to 21 tokens are cut by it) with random
weights. Outputs and every parameter's gradient equal HuggingFace's (its SDPA path, with the
sliding-window mask it builds; its eager path gives NaN in float64 under a padding mask) on right-,
left- and scattered-padded batches and RaggedTensors, for every
head, both classifier poolings, sparse masked-LM prediction, hidden states; the float32
comparison is bounded by HuggingFace computing rotary angles in float32 (float64 here would
still differ there).
"""

from __future__ import annotations

import copy

import pytest
import torch

import ragged

tf = pytest.importorskip("transformers")
if not hasattr(tf, "ModernBertModel"):
    pytest.skip("this transformers has no ModernBERT", allow_module_level=True)

from hf_convert_cases import _batch, _labels, _ragged, _randomise, _real  # noqa: E402

VOCAB, D, PAD = 50, 32, 1
LENGTHS = [9, 1, 21, 14, 3]
TOL = {"rtol": 1e-5, "atol": 1e-6}  # float64 both sides; HuggingFace rounds cos and sin to float32
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
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=2,
        global_attn_every_n_layers=3,
        local_attention=8,
        max_position_embeddings=64,
        pad_token_id=PAD,
        bos_token_id=2,
        eos_token_id=3,
        cls_token_id=2,
        sep_token_id=3,
        attention_dropout=0.0,
        mlp_dropout=0.0,
        embedding_dropout=0.0,
        classifier_dropout=0.0,
        num_labels=2 if kind == "qa" else 3,
        attn_implementation="sdpa",
    )
    kw.update(over)
    return tf.ModernBertConfig(**kw)


def _model(kind="base", seed=0, dtype=torch.float64, **over):
    hf = getattr(tf, "ModernBert" + KINDS[kind])(_config(kind, **over)).to(dtype)
    _randomise(hf, seed)
    hf.eval()
    ours = copy.deepcopy(hf)
    assert ragged.nn.convert(ours) is ours
    return ours, hf


def test_layer_types_alternate_and_windows_cut():
    config = _config()
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert config.sliding_window == 4 and max(LENGTHS) > 2 * config.sliding_window + 1


@pytest.mark.parametrize("kind", list(KINDS))
def test_outputs_match_hf(kind):
    ours, hf = _model(kind)
    token_level = kind not in ("sequence",)
    for side in ("right", "left"):
        ids, mask = _batch(LENGTHS, side)
        with torch.no_grad():
            got, want = ours(input_ids=ids, attention_mask=mask), hf(input_ids=ids, attention_mask=mask)
        assert type(got) is type(want) and list(got.keys()) == list(want.keys())
        for key in want.keys():
            if not token_level and key == "logits":
                if side == "right":  # HuggingFace reads column 0: padding when left-padded
                    torch.testing.assert_close(got[key], want[key], **TOL)
                continue
            assert got[key].shape == want[key].shape, key
            torch.testing.assert_close(_real(got[key], mask), _real(want[key], mask), **TOL)
            assert torch.all(got[key][~mask.bool()] == 0), f"{key}: padding is not zero"
    ids, mask = _batch(LENGTHS)
    with torch.no_grad():
        got, want = ours(input_ids=_ragged(ids, mask)), hf(input_ids=ids, attention_mask=mask)
    for key in want.keys():
        if isinstance(got[key], ragged.RaggedTensor):
            assert got[key].host_lengths() == LENGTHS
            torch.testing.assert_close(got[key].values, _real(want[key], mask), **TOL)
        else:
            assert kind == "sequence", key
            torch.testing.assert_close(got[key], want[key], **TOL)


def test_scattered_mask_without_local_cuts_and_position_ids():
    # holes count as columns in HuggingFace's window and as nothing here: a window wider than
    # every row makes the two the same
    ours, hf = _model(local_attention=64)
    ids, mask = _batch([7, 7, 7])
    mask = mask.clone()
    mask[0, 2] = mask[2, 0] = 0
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask).last_hidden_state
        want = hf(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(_real(got, mask), _real(want, mask), **TOL)
    # position_ids given ([1, M] broadcast and [B, M]) are packed like the input
    ids, mask = _batch(LENGTHS, "left")
    for pos in (torch.arange(ids.shape[1]).unsqueeze(0) + 5, torch.randint(0, 40, ids.shape)):
        with torch.no_grad():
            got = ours(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
            want = hf(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        torch.testing.assert_close(_real(got, mask), _real(want, mask), **TOL)


def test_mean_pooling_classifier():
    ours, hf = _model("sequence", classifier_pooling="mean")
    for side in ("right", "left"):
        ids, mask = _batch(LENGTHS, side)
        with torch.no_grad():
            got, want = ours(input_ids=ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(got, want, **TOL)


def test_hidden_states_match_hf():
    ours, hf = _model()
    ids, mask = _batch(LENGTHS)
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        want = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert len(got.hidden_states) == len(want.hidden_states)
    for g, w in zip(got.hidden_states, want.hidden_states):
        torch.testing.assert_close(_real(g, mask), _real(w, mask), **TOL)


@pytest.mark.parametrize("kind", ["sequence", "token", "masked_lm", "qa"])
def test_loss_and_gradients_match_hf(kind):
    ours, hf = _model(kind, seed=1)
    ours.train()
    hf.train()
    lengths = [6, 6, 6] if kind == "qa" else LENGTHS  # HuggingFace's QA softmax spans padding too
    ids, mask = _batch(lengths, "right", seed=2)
    extra = _labels(kind, lengths, mask, seed=3)
    if kind == "masked_lm":
        extra["labels"] = extra["labels"].clamp(max=VOCAB - 1)
    got, want = ours(input_ids=ids, attention_mask=mask, **extra), hf(input_ids=ids, attention_mask=mask, **extra)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    got.loss.backward()
    want.loss.backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        q = theirs[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)


def test_sparse_masked_lm_prediction():
    ours, hf = _model("masked_lm", sparse_prediction=True)
    ids, mask = _batch(LENGTHS, seed=4)
    labels = _labels("masked_lm", LENGTHS, mask, seed=5)["labels"].clamp(max=VOCAB - 1)
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask, labels=labels)
        want = hf(input_ids=ids, attention_mask=mask, labels=labels)
    assert got.logits.shape == want.logits.shape == (int((labels != -100).sum()), VOCAB)
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    torch.testing.assert_close(got.loss, want.loss, **TOL)


def test_bfloat16_within_tolerance_of_float32():
    """The converted model in bf16 is as close to HuggingFace's float32 as HuggingFace's own bf16."""
    ours, hf = _model(dtype=torch.float32)
    ids, mask = _batch(LENGTHS)
    with torch.no_grad():
        ref = _real(hf(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
        got = _real(ours.to(torch.bfloat16)(input_ids=ids, attention_mask=mask).last_hidden_state, mask).float()
        theirs = _real(hf.to(torch.bfloat16)(input_ids=ids, attention_mask=mask).last_hidden_state, mask).float()
    assert (got - ref).abs().max() <= 2 * (theirs - ref).abs().max() + 1e-2


def test_refused_with_the_model_untouched():
    config = _config()
    config.rope_parameters["full_attention"]["rope_type"] = "dynamic"
    config.rope_parameters["full_attention"]["factor"] = 2.0
    model = tf.ModernBertModel(config)
    with pytest.raises(NotImplementedError, match="rope_type='dynamic'"):
        ragged.nn.convert(model)
    assert "forward" not in model.__dict__
    model = tf.ModernBertModel(_config())
    model.layers[1].mlp.register_forward_hook(lambda *a: None)
    with pytest.raises(NotImplementedError, match=r"layers\.1\.mlp has forward hooks"):
        ragged.nn.convert(model)
    assert "forward" not in model.__dict__
    model = tf.ModernBertModel(_config())
    model.layers[2].attn.Wqkv = torch.nn.Sequential(model.layers[2].attn.Wqkv)
    with pytest.raises(NotImplementedError, match=r"layers\.2\.attn\.Wqkv is a Sequential"):
        ragged.nn.convert(model)
    model = tf.ModernBertModel(_config())
    model.rotary_emb.register_forward_pre_hook(lambda *a: None)
    with pytest.raises(NotImplementedError, match="rotary_emb has forward pre hooks"):
        ragged.nn.convert(model)


def test_state_dict_and_save_round_trip(tmp_path):
    ours, hf = _model("masked_lm")
    assert list(ours.state_dict()) == list(hf.state_dict())
    ours.save_pretrained(tmp_path)
    loaded = tf.ModernBertForMaskedLM.from_pretrained(tmp_path, torch_dtype=torch.float64).eval()
    assert "forward" not in loaded.__dict__
    ids, mask = _batch(LENGTHS)
    with torch.no_grad():
        torch.testing.assert_close(
            _real(ragged.nn.convert(loaded)(input_ids=ids, attention_mask=mask).logits, mask),
            _real(hf(input_ids=ids, attention_mask=mask).logits, mask),
            **TOL,
        )


def test_sentence_transformers_over_modernbert(tmp_path):
    """A SentenceTransformer over ModernBERT is converted as a whole: encode's embeddings (every
    pooling mode, with a padding tokenizer) equal the original's."""
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as M
    from test_hf_sentence import MODES, TEXTS, VOCAB

    from ragged.nn.hf import sentence as hf_sentence

    (tmp_path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    tf.BertTokenizerFast(str(tmp_path / "vocab.txt"), model_max_length=64).save_pretrained(str(tmp_path))
    model = tf.ModernBertModel(_config(vocab_size=len(VOCAB), pad_token_id=0))
    _randomise(model, 9)
    model.save_pretrained(str(tmp_path))
    for mode in MODES:
        original = (
            SentenceTransformer(modules=[M.Transformer(str(tmp_path)), M.Pooling(D, mode)], device="cpu")
            .double()
            .eval()
        )
        ours = copy.deepcopy(original)
        assert hf_sentence.convert_sentence_transformer(ours) is ours
        want = original.encode(TEXTS, convert_to_tensor=True, batch_size=3)
        got = ours.encode(TEXTS, convert_to_tensor=True, batch_size=3)
        torch.testing.assert_close(got, want, **TOL, msg=str(mode))
