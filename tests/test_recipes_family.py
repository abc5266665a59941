"""ARCHITECTURE.md's recipe "Add a HuggingFace model family", followed on a toy family.

A toy transformers modeling module (``transformers.models.toybert.modeling_toybert``, made in
``sys.modules``) whose base model is BERT's under another name; the family file's part is a
``BertFamily`` subclass declaring only the base model, registered by one entry in
``ragged.nn.hf.families.FAMILIES``. The converted toy model must equal the unconverted one,
its heads (not declared) must be refused, and nothing must remain once the entry is gone.
"""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch

import ragged

tf = pytest.importorskip("transformers")

from hf_convert_cases import _batch, _config, _randomise, _real  # noqa: E402

MODULE = "transformers.models.toybert.modeling_toybert"


@pytest.fixture
def toy(monkeypatch):
    from transformers.models.bert import modeling_bert as bert

    from ragged.nn.hf import families
    from ragged.nn.hf.bert import BertFamily

    module = types.ModuleType(MODULE)
    for name in ("Layer", "Attention", "SelfAttention", "SelfOutput", "Intermediate", "Output"):
        setattr(module, f"ToyBert{name}", getattr(bert, f"Bert{name}"))  # BERT's layers under the family's names
    module.ToyBertModel = type("ToyBertModel", (bert.BertModel,), {"__module__": MODULE})
    module.ToyBertForSequenceClassification = type(
        "ToyBertForSequenceClassification", (bert.BertForSequenceClassification,), {"__module__": MODULE}
    )
    monkeypatch.setitem(sys.modules, MODULE, module)

    class ToyFamily(BertFamily):  # the family file: what differs from BERT (here, only the classes taken)
        kinds = {"Model": "base"}

    monkeypatch.setitem(families.FAMILIES, MODULE, ToyFamily("ToyBERT", MODULE, "ToyBert"))
    return module


def test_a_toy_family_converts_through_the_registry(toy):
    theirs = toy.ToyBertModel(_config("bert")).double().eval()
    _randomise(theirs, 7)
    ours = copy.deepcopy(theirs)
    assert ragged.nn.convert(ours) is ours and type(ours) is toy.ToyBertModel
    for side in ("right", "left"):
        ids, mask = _batch([5, 1, 12], side)
        with torch.no_grad():
            got, want = ours(input_ids=ids, attention_mask=mask), theirs(input_ids=ids, attention_mask=mask)
        torch.testing.assert_close(
            _real(got.last_hidden_state, mask), _real(want.last_hidden_state, mask), rtol=1e-9, atol=1e-10
        )
        if side == "right":
            torch.testing.assert_close(got.pooler_output, want.pooler_output, rtol=1e-9, atol=1e-10)


def test_a_toy_family_refuses_what_it_does_not_declare(toy):
    head = toy.ToyBertForSequenceClassification(_config("bert"))
    with pytest.raises(NotImplementedError, match="not a supported ToyBERT class .*supported: ToyBertModel"):
        ragged.nn.convert(head)
    assert "forward" not in head.__dict__
    with pytest.raises(NotImplementedError, match="ToyBERT"):  # listed among the supported families
        ragged.nn.convert(
            tf.DebertaV2Model(
                tf.DebertaV2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
            )
        )


def test_without_the_entry_the_toy_family_is_unknown(toy, monkeypatch):
    from ragged.nn.hf import families

    monkeypatch.delitem(families.FAMILIES, MODULE)
    model = toy.ToyBertModel(_config("bert"))
    with pytest.raises(NotImplementedError, match="ToyBertModel is not a supported model class"):
        ragged.nn.convert(model)
