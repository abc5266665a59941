"""ragged.nn.convert of HuggingFace models: what is kept (module tree, Parameters, state_dict,
copies and pickles, mixed and subclassed models, the sentence-transformers contract, no
transformers import for torch models) and what is refused, leaving the model untouched."""

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

from hf_convert_cases import (  # noqa: E402
    LENGTHS,
    TOL,
    VOCAB,
    D,
    _batch,
    _config,
    _model,
    _ragged,
    _randomise,
    _real,
)

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
    assert ragged.nn.hf.is_converted(model.text)
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
    assert "forward" not in model.__dict__ and ragged.nn.hf.is_converted(model.bert)
    ids, mask = _batch(LENGTHS)
    with torch.no_grad():  # HuggingFace's head code on the converted base model's padded outputs
        torch.testing.assert_close(
            model(input_ids=ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits, **TOL
        )


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
    code = (
        "import sys, torch, ragged, ragged.nn\n"
        "m = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1,"
        " enable_nested_tensor=False)\n"
        "ragged.nn.convert(m)\nprint('transformers' in sys.modules)\n"
    )
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
        deberta = tf.DebertaModel(
            tf.DebertaConfig(
                vocab_size=VOCAB, hidden_size=D, num_hidden_layers=1, num_attention_heads=4, intermediate_size=2 * D
            )
        )
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
    for kw, what in (
        ({"output_attentions": True}, "output_attentions"),
        ({"head_mask": torch.ones(2, 4)}, "head_mask"),
        ({"encoder_hidden_states": torch.zeros(4, 3, D)}, "cross-attention"),
        ({"past_key_values": object()}, "past_key_values"),
    ):
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
