"""Converted decoders with peft's LoRA adapters and with biases on every projection, against the
unconverted model (CPU, float64, tiny configs, random weights and a random non-zero ``lora_B``):
the loss and every trainable Parameter's gradient, merge / unmerge / disabled adapters, a head
peft wraps (``modules_to_save``: the loss through the logits, with a warning) and a sequence
classifier whose ``score`` peft wraps."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_decoder_convert import CAUSAL, TOL, _padded  # noqa: E402
from test_decoder_core import _config  # noqa: E402

import ragged  # noqa: E402
import ragged.nn  # noqa: E402
from ragged.nn.hf import decoder_core  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft(name, **lora):
    torch.manual_seed(5)
    base = getattr(transformers, CAUSAL[name])(_config(name, tie_word_embeddings=False)).double()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, **lora)
    ref = peft.get_peft_model(base, config)
    return ref, ragged.nn.convert(copy.deepcopy(ref))


def _loss_and_grads(model, ids, mask, labels):
    model.zero_grad()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _compare(ref, mine, ids, mask, labels, lora=True):
    want, want_g = _loss_and_grads(ref, ids, mask, labels)
    got, got_g = _loss_and_grads(mine, ids, mask, labels)
    torch.testing.assert_close(got.double(), want.double(), **TOL)  # HF's causal-LM loss is float32
    assert got_g.keys() == want_g.keys() and any("lora_B" in n for n in got_g) == lora
    for n, g in want_g.items():
        scale = max(g.abs().max().item(), 1e-3)
        torch.testing.assert_close(got_g[n], g, atol=1e-5 * scale, rtol=1e-4, msg=n)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_lora_on_every_projection(name):
    ref, mine = _peft(name)
    inner = mine.base_model.model
    assert "forward" in inner.__dict__ and decoder_core.why_not_core(inner.model) is None  # converted
    ids, mask, labels = _padded("right")
    ref.train(), mine.train()
    _compare(ref, mine, ids, mask, labels)  # training: the fused loss, no logits
    ref.eval(), mine.eval()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
        got = mine(input_ids=ids, attention_mask=mask).logits
        keep = mask.bool()
        torch.testing.assert_close(got[keep], want[keep], **TOL)
        # merged, then disabled: what peft's forward computes in each state
        for m in (ref, mine):
            m.merge_adapter()
        torch.testing.assert_close(mine(input_ids=ids, attention_mask=mask).logits[keep], want[keep], **TOL)
        for m in (ref, mine):
            m.unmerge_adapter()
        with ref.disable_adapter(), mine.disable_adapter():
            base = ref(input_ids=ids, attention_mask=mask).logits
            torch.testing.assert_close(mine(input_ids=ids, attention_mask=mask).logits[keep], base[keep], **TOL)
        assert (base[keep] - want[keep]).abs().max() > 1e-3  # the adapters matter


def test_lora_dropout_is_refused_with_the_model_unchanged():
    torch.manual_seed(5)
    base = transformers.LlamaForCausalLM(_config("llama")).double()
    ref = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.1))
    with pytest.raises(NotImplementedError, match="lora_dropout=0.1"):
        ragged.nn.convert(ref)
    assert "forward" not in ref.base_model.model.__dict__


def test_a_head_peft_wraps_takes_the_logits_path_with_a_warning():
    ref, mine = _peft("llama", modules_to_save=["lm_head"])
    ids, mask, labels = _padded("right")
    ref.train(), mine.train()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _compare(ref, mine, ids, mask, labels)
    assert any("through the [T, V] logits" in str(w.message) for w in seen)


def test_biases_on_every_projection():
    torch.manual_seed(2)
    ref = transformers.LlamaForCausalLM(_config("llama", attention_bias=True, mlp_bias=True)).double()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.3)
    mine = ragged.nn.convert(copy.deepcopy(ref))
    ids, mask, labels = _padded("right")
    ref.train(), mine.train()
    _compare(ref, mine, ids, mask, labels, lora=False)


def test_sequence_classifier_under_peft():
    torch.manual_seed(4)
    config = _config("qwen2", num_labels=3, pad_token_id=0)
    base = transformers.Qwen2ForSequenceClassification(config).double()
    lora = peft.LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False, task_type="SEQ_CLS")
    ref = peft.get_peft_model(base, lora)
    mine = ragged.nn.convert(copy.deepcopy(ref))
    assert "forward" in mine.base_model.model.__dict__
    ids, mask, _ = _padded("right")
    ids = ids.clamp_min(1).masked_fill(mask == 0, 0)
    labels = torch.tensor([2, 0, 1])
    ref.train(), mine.train()
    _compare(ref, mine, ids, mask, labels)
