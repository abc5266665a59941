"""``import ragged.integrations.transformers``: attn_implementation="ragged" in transformers models, on the CPU.

Tiny models (2 layers, hidden 64, GQA: 4 query heads over 2 key/value heads) with random weights,
run with "ragged" and with transformers' own "sdpa" on copies of the same weights, in float32:
flattened batches (DataCollatorWithFlattening) against per-sequence runs (loss combined as the
flattened labels combine it, every parameter's gradient), padded batches against sdpa's padded
run at the real positions (NaN-poisoned padding on the ragged side), decoding with a cache, a
BERT encoder (non-causal), sliding windows and the refusals.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from conftest import cpu_backends  # noqa: E402
from hf_attention_cases import (
    DTYPES,
    FAMILIES,
    LENGTHS,
    VOCAB,
    _assert_grads,
    _bert_pair,
    _close,
    _flat,
    _ids,
    _padded,
    _pair,
    _per_sequence_loss,
)

import ragged  # noqa: E402
import ragged.integrations.transformers  # noqa: E402,F401  (registers "ragged")
from ragged.nn.hf import attention as attn  # noqa: E402

# --------------------------------------------------------------------------------------
# Flattened batches


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_flattened_loss_and_gradients_equal_per_sequence_sdpa(family, dtype):
    model, reference = _pair(family, dtype=dtype)
    ids = _ids(LENGTHS, seed=1)
    batch = _flat(ids, return_flash_attn_kwargs=True)
    loss = model(**batch).loss
    loss.backward()
    expected = _per_sequence_loss(reference, ids)
    expected.backward()
    _close(loss, expected)
    _assert_grads(model, reference)


@pytest.mark.skipif("triton" not in cpu_backends(), reason="Triton runs on the CPU only under TRITON_INTERPRET=1")
def test_on_the_triton_backend():
    model, reference = _pair("llama")
    ids = _ids([1, 6, 11], seed=2)
    batch = _flat(ids, return_flash_attn_kwargs=True)
    with ragged.use_backend("triton"):
        loss = model(**batch).loss
        loss.backward()
    expected = _per_sequence_loss(reference, ids)
    expected.backward()
    _close(loss, expected)
    _assert_grads(model, reference)
    # a left-padded batch: Triton's pack and unpack too
    model.eval(), reference.eval()
    ids, mask = _padded([2, 7, 0], "left", seed=22)
    real = mask.bool()
    with ragged.use_backend("triton"):
        got = model(input_ids=ids, attention_mask=mask).logits
    _close(got[real], reference(input_ids=ids, attention_mask=mask).logits[real])


def test_flattened_by_position_ids_only(monkeypatch):
    """No cu_seq_lens: the sequences are read from where the position ids restart (one read per
    forward, by its first layer), with a first position other than 0 too."""
    model, reference = _pair("llama")
    ids = _ids(LENGTHS, seed=3)
    reads = []
    real = attn._read_starts
    monkeypatch.setattr(attn, "_read_starts", lambda row: reads.append(row) or real(row))
    for start in (0, 2):
        batch = _flat(ids, position_ids_start=start)
        assert "cu_seq_lens_q" not in batch
        reads.clear()
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        assert model.config.num_hidden_layers > 1 and len(reads) == 1
        offsets = [0]
        for x in ids:
            offsets.append(offsets[-1] + len(x))
        for i, x in enumerate(ids):
            positions = torch.arange(start, start + len(x)).unsqueeze(0)
            expected = reference(input_ids=torch.tensor([x]), position_ids=positions).logits[0]
            _close(logits[offsets[i] : offsets[i + 1]], expected)


def test_flattened_kwargs_read_nothing_on_the_host(monkeypatch):
    model, _ = _pair("qwen2")
    calls = []
    monkeypatch.setattr(attn, "read_mask_layout", lambda *a: calls.append("mask"))
    monkeypatch.setattr(attn, "_read_starts", lambda *a: calls.append("positions"))
    batch = _flat(_ids(LENGTHS, seed=4), return_flash_attn_kwargs=True)
    model(**batch, use_cache=False).loss.backward()
    assert calls == []


def test_from_config_and_from_pretrained_take_the_name(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="ragged")
    assert model.config._attn_implementation == "ragged"
    model.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="ragged")
    assert again.config._attn_implementation == "ragged"
    ids = torch.randint(0, VOCAB, (2, 7))
    torch.testing.assert_close(again(input_ids=ids).logits, model(input_ids=ids).logits)


# --------------------------------------------------------------------------------------
# Padded, dense and cached batches


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_padded_batch_equals_sdpa_at_real_positions(family, side, dtype, monkeypatch):
    model, reference = _pair(family, dtype=dtype)
    model.eval(), reference.eval()
    ids, mask = _padded([5, 1, 33, 0, 17], side, seed=5)
    real = mask.bool()
    embeds = model.get_input_embeddings()(ids).detach()
    poisoned = embeds.masked_fill(~real.unsqueeze(-1), float("nan")).requires_grad_(True)
    clean = embeds.clone().requires_grad_(True)
    reads = []
    real_read = attn.read_mask_layout
    monkeypatch.setattr(attn, "read_mask_layout", lambda keep, bad=None: reads.append(1) or real_read(keep, bad))
    got = model(inputs_embeds=poisoned, attention_mask=mask).logits
    assert len(reads) == 1  # one read of the mask per forward, whatever the number of layers
    expected = reference(inputs_embeds=clean, attention_mask=mask).logits
    _close(got[real], expected[real])
    # gradients into the real positions' inputs, through the packing
    up = torch.randn_like(expected)
    (got[real] * up[real]).sum().backward()
    (expected[real] * up[real]).sum().backward()
    _close(poisoned.grad[real], clean.grad[real])
    assert torch.isfinite(poisoned.grad[real]).all()  # (padded rows run the position-wise layers on NaN)


def test_mask_with_holes_is_gathered_by_index():
    model, reference = _pair("llama")
    model.eval(), reference.eval()
    ids, mask = _padded([9, 6, 12], "right", seed=6)
    mask[0, 3] = 0
    mask[2, 0] = 0
    mask[2, 7:9] = 0
    real = mask.bool()
    ragged.utils._warned.discard("hf-scattered-mask")  # a warning given once per process
    with pytest.warns(UserWarning, match="not one contiguous run"):
        attn.mask_layout(real.clone())
    got = model(input_ids=ids, attention_mask=mask).logits
    expected = reference(input_ids=ids, attention_mask=mask).logits
    _close(got[real], expected[real])


def test_dense_batch_without_mask_equals_sdpa():
    model, reference = _pair("qwen2")
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(7))
    got = model(input_ids=ids, labels=ids)
    expected = reference(input_ids=ids, labels=ids)
    _close(got.logits, expected.logits)
    got.loss.backward()
    expected.loss.backward()
    _assert_grads(model, reference)


def test_decoding_with_a_cache_and_a_left_padded_mask():
    model, reference = _pair("llama")
    model.eval(), reference.eval()
    ids, mask = _padded([4, 9, 1], "left", seed=8)
    outs = []
    for m in (model, reference):
        step_ids, step_mask, cache, logits = ids, mask, None, []
        for _ in range(3):
            positions = (step_mask.cumsum(-1) - 1).clamp_min(0)[:, -step_ids.shape[1] :]
            out = m(
                input_ids=step_ids,
                attention_mask=step_mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits.append(out.logits[:, -1])
            step_ids = out.logits[:, -1:].argmax(-1)
            step_mask = torch.cat([step_mask, torch.ones_like(step_ids)], dim=1)
        outs.append(torch.stack(logits))
    _close(outs[0], outs[1])


def test_mask_function_hands_over_the_2d_mask_or_none():
    from transformers.masking_utils import create_causal_mask

    model, _ = _pair("llama")
    embeds = torch.zeros(2, 6, 64)
    full = torch.ones(2, 6, dtype=torch.long)
    assert create_causal_mask(model.config, embeds, full, None) is None
    padded = full.clone()
    padded[1, 4:] = 0
    mask = create_causal_mask(model.config, embeds, padded, None)
    assert mask.shape == (2, 6) and mask.dtype == torch.bool
    assert torch.equal(mask, padded.bool())
    assert attn.mask_layout(mask).host == (0, 6, 10)


# --------------------------------------------------------------------------------------
# An encoder: BERT (non-causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("side", ["right", "left"])
def test_bert_padded_non_causal(side, dtype):
    model, reference = _bert_pair(dtype=dtype)
    ids, mask = _padded([3, 1, 20, 0, 11], side, seed=9)
    real = mask.bool()
    got = model(input_ids=ids, attention_mask=mask).last_hidden_state
    expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    _close(got[real], expected[real])
    up = torch.randn_like(expected)
    (got[real] * up[real]).sum().backward()
    (expected[real] * up[real]).sum().backward()
    _assert_grads(model, reference)


@pytest.mark.parametrize("encoder_length", [9, 12])
def test_bert_decoder_with_cross_attention(encoder_length):
    """A BERT decoder (causal self-attention) attending to padded encoder states: the encoder mask
    describes the keys only, also where the two lengths coincide (12)."""
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        initializer_range=0.1,
        is_decoder=True,
        add_cross_attention=True,
    )
    torch.manual_seed(2)
    reference = transformers.BertModel(config, add_pooling_layer=False).double()
    reference.set_attn_implementation("sdpa")
    model = copy.deepcopy(reference)
    model.set_attn_implementation("ragged")
    ids, mask = _padded([12, 4, 7], "right", seed=19)
    gen = torch.Generator().manual_seed(20)
    encoded = torch.randn(3, encoder_length, 64, generator=gen, dtype=torch.float64)
    encoder_mask = torch.zeros(3, encoder_length, dtype=torch.long)
    for b, n in enumerate([encoder_length, 2, 5]):
        encoder_mask[b, :n] = 1
    real = mask.bool()
    outs = [
        m(
            input_ids=ids,
            attention_mask=mask,
            encoder_hidden_states=encoded,
            encoder_attention_mask=encoder_mask,
            use_cache=False,
        ).last_hidden_state
        for m in (model, reference)
    ]
    _close(outs[0][real], outs[1][real])


def test_bert_flattened_equals_per_sequence():
    model, reference = _bert_pair(seed=1)
    ids = _ids([1, 4, 19, 8], seed=10)
    batch = _flat(ids, return_flash_attn_kwargs=True)
    got = model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], **{k: batch[k] for k in attn._FLAT_KEYS}
    ).last_hidden_state[0]
    start = 0
    for x in ids:
        expected = reference(input_ids=torch.tensor([x])).last_hidden_state[0]
        _close(got[start : start + len(x)], expected)
        start += len(x)
