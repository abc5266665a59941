"""``import ragged.hf``: attn_implementation="ragged" in transformers models, on the CPU.

Tiny models (2 layers, hidden 64, GQA: 4 query heads over 2 key/value heads) with random weights,
run with "ragged" and with transformers' own "sdpa" on copies of the same weights, in float32:
flattened batches (DataCollatorWithFlattening) against per-sequence runs (loss combined as the
flattened labels combine it, every parameter's gradient), padded batches against sdpa's padded
run at the real positions (NaN-poisoned padding on the ragged side), decoding with a cache, a
BERT encoder (non-causal), sliding windows and the refusals.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from transformers import DataCollatorWithFlattening  # noqa: E402

import ragged  # noqa: E402
import ragged.hf  # noqa: E402
from ragged import hf  # noqa: E402

from conftest import cpu_backends  # noqa: E402

VOCAB = 97
LENGTHS = [1, 5, 17, 33]
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}
# float32 against float32 with another summation order (per-sequence sdpa runs): relative error
# 1e-5, absolute error 1e-6 of the largest magnitude compared (over all of a model's gradients
# for gradients: a gradient that is zero in exact arithmetic, such as a key bias's, carries the
# rounding of the sums it comes from). In float64 both sides agree to rounding.
TOLS = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-10, 1e-12)}
DTYPES = [torch.float32, torch.float64]


def _close(got, expected, scale=None, name=""):
    rtol, atol = TOLS[expected.dtype]
    if scale is None:
        scale = float(expected.detach().abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol * max(1.0, scale), msg=lambda m: f"{name} {m}")


def _pair(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    """(ragged model, sdpa model): the same random weights in ``dtype``, train mode, no dropout."""
    config_cls, model_cls = FAMILIES[family]
    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    initializer_range=0.1, attention_dropout=0.0)
    config = config_cls(**{**settings, **overrides})
    torch.manual_seed(seed)
    reference = model_cls(config).to(dtype)
    reference.set_attn_implementation("sdpa")
    model = copy.deepcopy(reference)
    model.set_attn_implementation("ragged")
    return model.train(), reference.train()


def _ids(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _per_sequence_loss(model, ids):
    """The flattened batch's loss from one run per sequence: each sums its token losses, divided
    by the predicted tokens of the whole batch (the flattened mean)."""
    count = sum(max(len(x) - 1, 0) for x in ids)
    total = 0.0
    for x in ids:
        t = torch.tensor([x])
        total = total + model(input_ids=t, labels=t, num_items_in_batch=count).loss
    return total


def _grads(model):
    return {name: p.grad for name, p in model.named_parameters()}


def _assert_grads(model, reference):
    got, expected = _grads(model), _grads(reference)
    assert got.keys() == expected.keys()
    scale = max(float(g.abs().max()) for g in expected.values() if g is not None and g.numel())
    for name in expected:
        assert got[name] is not None, name
        _close(got[name], expected[name], scale=scale, name=name)


def _flat(ids, **kwargs):
    return DataCollatorWithFlattening(**kwargs)([{"input_ids": x} for x in ids])


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
    real = hf._read_starts
    monkeypatch.setattr(hf, "_read_starts", lambda row: reads.append(row) or real(row))
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
            _close(logits[offsets[i]:offsets[i + 1]], expected)


def test_flattened_kwargs_read_nothing_on_the_host(monkeypatch):
    model, _ = _pair("qwen2")
    calls = []
    monkeypatch.setattr(hf, "read_mask_layout", lambda *a: calls.append("mask"))
    monkeypatch.setattr(hf, "_read_starts", lambda *a: calls.append("positions"))
    batch = _flat(_ids(LENGTHS, seed=4), return_flash_attn_kwargs=True)
    model(**batch, use_cache=False).loss.backward()
    assert calls == []


def test_from_config_and_from_pretrained_take_the_name(tmp_path):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="ragged")
    assert model.config._attn_implementation == "ragged"
    model.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="ragged")
    assert again.config._attn_implementation == "ragged"
    ids = torch.randint(0, VOCAB, (2, 7))
    torch.testing.assert_close(again(input_ids=ids).logits, model(input_ids=ids).logits)


# --------------------------------------------------------------------------------------
# Padded, dense and cached batches


def _padded(lengths, side, seed):
    width = max(lengths)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(lengths), width), generator=gen)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        if side == "right":
            mask[b, :n] = 1
        elif n:
            mask[b, -n:] = 1
    return ids, mask


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
    real_read = hf.read_mask_layout
    monkeypatch.setattr(hf, "read_mask_layout", lambda keep, bad=None: reads.append(1) or real_read(keep, bad))
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
        hf.mask_layout(real.clone())
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
            positions = (step_mask.cumsum(-1) - 1).clamp_min(0)[:, -step_ids.shape[1]:]
            out = m(input_ids=step_ids, attention_mask=step_mask, position_ids=positions, past_key_values=cache,
                    use_cache=True)
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
    assert hf.mask_layout(mask).host == (0, 6, 10)


# --------------------------------------------------------------------------------------
# An encoder: BERT (non-causal)


def _bert_pair(seed=0, dtype=torch.float32):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, initializer_range=0.1)
    torch.manual_seed(seed)
    reference = transformers.BertModel(config, add_pooling_layer=False).to(dtype)
    reference.set_attn_implementation("sdpa")
    model = copy.deepcopy(reference)
    model.set_attn_implementation("ragged")
    return model.train(), reference.train()


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
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, initializer_range=0.1, is_decoder=True,
                                     add_cross_attention=True)
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
    outs = [m(input_ids=ids, attention_mask=mask, encoder_hidden_states=encoded, encoder_attention_mask=encoder_mask,
              use_cache=False).last_hidden_state for m in (model, reference)]
    _close(outs[0][real], outs[1][real])


def test_bert_flattened_equals_per_sequence():
    model, reference = _bert_pair(seed=1)
    ids = _ids([1, 4, 19, 8], seed=10)
    batch = _flat(ids, return_flash_attn_kwargs=True)
    got = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                **{k: batch[k] for k in hf._FLAT_KEYS}).last_hidden_state[0]
    start = 0
    for x in ids:
        expected = reference(input_ids=torch.tensor([x])).last_hidden_state[0]
        _close(got[start:start + len(x)], expected)
        start += len(x)


# --------------------------------------------------------------------------------------
# What reaches ragged.varlen_attention


def _spy(monkeypatch):
    calls = []
    real = ragged.varlen_attention

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, causal=False, scale=None, dropout_p=0.0, **kwargs):
        calls.append(dict(heads=q.shape[1], kv_heads=k.shape[1], max_q=max_q, max_k=max_k, causal=causal,
                          scale=scale, dropout_p=dropout_p, **kwargs))
        return real(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale, dropout_p=dropout_p, **kwargs)

    monkeypatch.setattr(ragged, "varlen_attention", spy)
    return calls


def test_gqa_scale_causal_and_dropout_reach_the_kernel(monkeypatch):
    calls = _spy(monkeypatch)
    model, _ = _pair("llama", attention_dropout=0.25)
    model.train()
    model(**_flat(_ids([2, 4], seed=11), return_flash_attn_kwargs=True))
    model.eval()
    model(**_flat(_ids(LENGTHS, seed=11), return_flash_attn_kwargs=True))
    assert len(calls) == 4
    for call, rate, longest in zip(calls, (0.25, 0.25, 0.0, 0.0), (4, 4, 33, 33)):
        assert (call["heads"], call["kv_heads"]) == (4, 2)  # the key/value heads are not repeated
        assert call["causal"] is True
        assert call["scale"] == pytest.approx(16 ** -0.5)
        assert call["dropout_p"] == rate
        assert (call["max_q"], call["max_k"]) == (longest, longest)
        assert "window_size" not in call
    bert, _ = _bert_pair()
    calls.clear()
    bert(input_ids=torch.ones(2, 5, dtype=torch.long))
    assert [c["causal"] for c in calls] == [False, False]


def test_attention_dropout_drops_in_training_only():
    model, reference = _pair("llama", attention_dropout=0.5)
    batch = _flat(_ids([3, 6], seed=12), return_flash_attn_kwargs=True)
    torch.manual_seed(0)
    a = model(**batch).logits
    torch.manual_seed(0)
    b = model(**batch).logits
    torch.manual_seed(1)
    c = model(**batch).logits
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    model.eval(), reference.eval()
    flat = model(**batch).logits[0]
    _close(flat[:3], reference(input_ids=batch["input_ids"][:, :3]).logits[0])


def test_value_head_dim_narrower_than_query():
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(2, 4, 9, 16, generator=gen)
    k = torch.randn(2, 2, 9, 16, generator=gen)
    v = torch.randn(2, 2, 9, 8, generator=gen)
    module = torch.nn.Module()
    module.is_causal = True
    out, weights = hf.attention_forward(module, q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (2, 9, 4, 8)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), is_causal=True, scale=0.3)
    _close(out, expected.transpose(1, 2).float())


def test_direct_call_with_empty_sequences_and_a_padded_mask():
    """Lengths 0 in a flattened batch and all-padding rows in a padded one, against float64 SDPA."""
    gen = torch.Generator().manual_seed(14)
    module = torch.nn.Module()
    module.is_causal = True
    lengths = [0, 1, 7, 0, 12]
    total = sum(lengths)
    q = torch.randn(1, 4, total, 16, generator=gen)
    k = torch.randn(1, 2, total, 16, generator=gen)
    v = torch.randn(1, 2, total, 16, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out, _ = hf.attention_forward(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12,
                                  max_length_k=12)
    start = 0
    for n in lengths:
        if n:
            part = slice(start, start + n)
            expected = torch.nn.functional.scaled_dot_product_attention(
                q[:, :, part].double(), k[:, :, part].double().repeat_interleave(2, 1),
                v[:, :, part].double().repeat_interleave(2, 1), is_causal=True)
            _close(out[:, part], expected.transpose(1, 2).float())
        start += n
    for batch in (0, 2):  # no tokens at all
        out, _ = hf.attention_forward(module, *(torch.randn(batch, h, 0, 16) for h in (4, 2, 2)), None)
        assert out.shape == (batch, 0, 4, 16)
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    q, k, v = (torch.randn(3, h, 4, 16, generator=gen) for h in (4, 2, 2))
    nan = ~mask[:, None, :, None]
    out, _ = hf.attention_forward(module, q.masked_fill(nan, float("nan")), k.masked_fill(nan, float("nan")),
                                  v.masked_fill(nan, float("nan")), mask)
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))
    for b in (0, 2):
        n = int(mask[b].sum())
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[b:b + 1, :, :n].double(), k[b:b + 1, :, :n].double().repeat_interleave(2, 1),
            v[b:b + 1, :, :n].double().repeat_interleave(2, 1), is_causal=True)
        _close(out[b, :n], expected[0].transpose(0, 1).float())


# --------------------------------------------------------------------------------------
# Sliding windows


def _windowed_reference(q, k, v, cu_q, cu_k, max_q, max_k, causal=False, scale=None, dropout_p=0.0,
                        window_size=(-1, -1), **_):
    """Attention with flash-attn's window rule, per sequence, in float64 (differentiable): query
    ``i`` (aligned to the end of the keys) sees key ``j`` iff ``i - left <= j <= i + right``."""
    left, right = window_size
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    outs = []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qb = q[cq[b]:cq[b + 1]].double().transpose(0, 1)
        kb = k[ck[b]:ck[b + 1]].double().transpose(0, 1).repeat_interleave(group, 0)
        vb = v[ck[b]:ck[b + 1]].double().transpose(0, 1).repeat_interleave(group, 0)
        lq, lk = qb.shape[1], kb.shape[1]
        i = torch.arange(lq).unsqueeze(1) + (lk - lq)
        j = torch.arange(lk).unsqueeze(0)
        seen = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            seen &= j <= i
        if left >= 0:
            seen &= j >= i - left
        if right >= 0:
            seen &= j <= i + right
        s = (qb @ kb.transpose(1, 2) * scale).masked_fill(~seen, float("-inf"))
        outs.append((torch.softmax(s, -1).nan_to_num(0.0) @ vb).transpose(0, 1))
    return torch.cat(outs).to(q.dtype)


def _windowed_kernel(request, monkeypatch):
    if request.param == "reference":
        monkeypatch.setattr(ragged, "varlen_attention", _windowed_reference)
    elif not hf._window_param(ragged.varlen_attention):
        pytest.skip("ragged.varlen_attention takes no window_size yet")


@pytest.fixture(params=["reference", "ragged"])
def windowed(request, monkeypatch):
    """"reference": a float64 windowed attention stands in for the kernels (checks what
    attention_forward passes); "ragged": ragged's own kernels, once they take a window."""
    _windowed_kernel(request, monkeypatch)
    return request.param


def test_mistral_sliding_window_flattened(windowed):
    model, reference = _pair("mistral", sliding_window=4)
    ids = _ids(LENGTHS, seed=15)
    loss = model(**_flat(ids, return_flash_attn_kwargs=True)).loss
    loss.backward()
    expected = _per_sequence_loss(reference, ids)
    expected.backward()
    _close(loss, expected)
    _assert_grads(model, reference)


@pytest.mark.parametrize("side", ["right", "left"])
def test_mistral_sliding_window_padded(windowed, side):
    model, reference = _pair("mistral", sliding_window=6)
    model.eval(), reference.eval()
    ids, mask = _padded([3, 17, 9, 1], side, seed=16)
    real = mask.bool()
    got = model(input_ids=ids, attention_mask=mask).logits
    expected = reference(input_ids=ids, attention_mask=mask).logits
    _close(got[real], expected[real])


def test_window_longer_than_every_sequence_is_not_passed(monkeypatch):
    calls = _spy(monkeypatch)
    model, reference = _pair("mistral", sliding_window=33)
    ids = _ids(LENGTHS, seed=17)
    loss = model(**_flat(ids, return_flash_attn_kwargs=True)).loss
    assert calls and all("window_size" not in c for c in calls)
    _close(loss, _per_sequence_loss(reference, ids))


def test_window_without_kernel_support_raises(monkeypatch):
    real = ragged.varlen_attention
    monkeypatch.setattr(ragged, "varlen_attention",
                        lambda q, k, v, cu_q, cu_k, max_q, max_k, causal=False, scale=None, dropout_p=0.0:
                        real(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p))
    model, _ = _pair("mistral", sliding_window=8)
    with pytest.raises(NotImplementedError, match=r"MistralAttention attends within a sliding window of 8 tokens"):
        model(**_flat(_ids(LENGTHS, seed=18), return_flash_attn_kwargs=True))


def test_window_over_a_mask_with_holes_raises():
    model, _ = _pair("mistral", sliding_window=4)
    ids, mask = _padded([9, 6], "right", seed=21)
    mask[0, 2] = 0
    with pytest.raises(NotImplementedError, match="sliding window of 4 tokens with a padding mask whose tokens"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(input_ids=ids, attention_mask=mask)


# --------------------------------------------------------------------------------------
# Refusals


def _module(causal=True):
    module = torch.nn.Module()
    module.is_causal = causal
    return module


def _qkv(batch=1, length=5):
    return torch.randn(batch, 4, length, 16), torch.randn(batch, 2, length, 16), torch.randn(batch, 2, length, 16)


@pytest.mark.parametrize("key,value,feature", [
    ("softcap", 30.0, "soft-capping"),
    ("s_aux", torch.zeros(4), "attention sinks"),
    ("sinks", torch.zeros(4), "attention sinks"),
    ("head_mask", torch.ones(4), "head_mask"),
    ("position_bias", torch.zeros(1, 4, 5, 5), "position bias"),
    ("output_attentions", True, "output_attentions"),
])
def test_unsupported_features_are_refused(key, value, feature):
    with pytest.raises(NotImplementedError, match=rf"ragged\.hf\.attention_forward\(\): Module .*{feature}"):
        hf.attention_forward(_module(), *_qkv(), None, **{key: value})


def test_output_attentions_through_a_model():
    model, _ = _pair("llama")
    with pytest.raises(NotImplementedError, match="output_attentions"):
        model(input_ids=torch.ones(1, 4, dtype=torch.long), output_attentions=True)


def test_a_4d_mask_is_refused():
    model, _ = _pair("llama")
    mask = torch.zeros(2, 1, 4, 4)
    with pytest.raises(NotImplementedError, match=r"LlamaAttention got an attention mask Tensor\(shape=\(2, 1, 4, 4\)"):
        model(input_ids=torch.ones(2, 4, dtype=torch.long), attention_mask=mask)


def test_mask_and_flattened_kwargs_together_are_refused():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="either a padding mask or cu_seq_lens_q/k"):
        hf.attention_forward(_module(), *_qkv(), torch.ones(1, 5, dtype=torch.bool), cu_seq_lens_q=cu,
                             cu_seq_lens_k=cu, max_length_q=3, max_length_k=3)
    with pytest.raises(ValueError, match="missing max_length_q, max_length_k"):
        hf.attention_forward(_module(), *_qkv(), None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(TypeError, match="expected max_length_q to be an int, got 3.0"):
        hf.attention_forward(_module(), *_qkv(), None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=3.0,
                             max_length_k=3)
    with pytest.raises(ValueError, match=r"expected a padding mask of shape \[1, 5\]"):
        hf.attention_forward(_module(), *_qkv(), torch.ones(2, 5, dtype=torch.bool))


def test_overlaid_mask_functions_are_refused():
    from transformers.masking_utils import create_causal_mask

    model, _ = _pair("llama")
    embeds = torch.zeros(1, 4, 64)
    with pytest.raises(NotImplementedError, match="LlamaConfig overlays a custom mask function"):
        create_causal_mask(model.config, embeds, torch.ones(1, 4, dtype=torch.long), None,
                           or_mask_function=lambda b, h, q, kv: q == kv)


def test_import_ragged_does_not_import_transformers():
    probe = ("import json, sys; import ragged; mods = ['transformers', 'ragged.hf']; "
             "print(json.dumps([m for m in mods if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={"PATH": "", "PYTHONPATH": ":".join(p for p in sys.path if p)})
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    assert transformers.AttentionInterface._global_mapping["ragged"] is hf.attention_forward
    assert transformers.AttentionMaskInterface._global_mapping["ragged"] is hf.padding_mask


def test_autocast_takes_q_k_v_in_autocasts_dtype():
    """Under autocast, rotary embeddings computed in float32 can leave q and k in float32 beside
    a bfloat16 v (TRL's bf16 training through accelerate does): the attention runs in autocast's
    dtype, as torch's SDPA does, instead of refusing the mixed dtypes."""
    model, _ = _pair("llama")
    module = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(4)
    q, k = (torch.randn(2, 4, 9, 16, generator=gen) for _ in range(2))
    v = torch.randn(2, 4, 9, 16, generator=gen).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = hf.attention_forward(module, q, k, v, None, is_causal=True)
    assert out.dtype == torch.bfloat16
    low = [t.to(torch.bfloat16).float() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*low, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
