"""ragged.nn.fuse_lm_loss: a causal LM's training loss and every gradient equal to the model's own
(float64, tiny configs of each family), without logits; the model's own forward elsewhere."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ragged  # noqa: E402
import ragged.nn  # noqa: E402

V = 97


def _config(name):
    common = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    if name == "llama":
        return transformers.LlamaConfig(**common)
    if name == "qwen2":
        return transformers.Qwen2Config(**common)
    if name == "qwen3":
        return transformers.Qwen3Config(**common)
    if name == "mistral":
        return transformers.MistralConfig(**common)
    if name == "gemma":
        return transformers.GemmaConfig(**common)
    if name == "gemma2":
        return transformers.Gemma2Config(**common, final_logit_softcapping=3.0, attn_logit_softcapping=None)
    if name == "gemma3":
        return transformers.Gemma3TextConfig(**common, final_logit_softcapping=2.0)
    raise AssertionError(name)


MODELS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def _model(name):
    torch.manual_seed(hash(name) % 1000)
    model = getattr(transformers, MODELS[name])(_config(name)).double().train()
    return model


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 12]
    ids = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(0, V, (n,), generator=g)
        mask[i, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _loss64(logits, labels, num_items):
    """HF's causal-LM loss kept in float64 (HF's own upcasts the logits to float32 only)."""
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    flat, target = logits.reshape(-1, logits.shape[-1]), shift.reshape(-1)
    if num_items is None:
        return torch.nn.functional.cross_entropy(flat, target, ignore_index=-100)
    return torch.nn.functional.cross_entropy(flat, target, ignore_index=-100, reduction="sum") / num_items


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("num_items", [None, 23])
def test_loss_and_gradients_equal_the_models_own(name, num_items):
    ref = _model(name)
    mine = ragged.nn.fuse_lm_loss(copy.deepcopy(ref))
    ids, mask, labels = _batch()
    kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    got = mine(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
    assert got.logits is None
    # the model's own loss, computed in float32 from float64 logits: equal to its precision
    hf = ref(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
    torch.testing.assert_close(got.loss.float(), hf.loss, atol=1e-6, rtol=1e-6)
    # and the same loss kept in float64, from the model's own logits: equal to float64's
    logits = ref(input_ids=ids, attention_mask=mask).logits
    assert logits.dtype == torch.float64
    want = _loss64(logits, labels, num_items)
    torch.testing.assert_close(got.loss, want, atol=1e-12, rtol=1e-12)
    want.backward()
    got.loss.backward()
    gw, gg = _grads(ref), _grads(mine)
    assert gw.keys() == gg.keys() and len(gg) == len(list(ref.parameters()))
    for n in gw:
        torch.testing.assert_close(gg[n], gw[n], atol=1e-12, rtol=1e-10, msg=n)


def test_eval_no_labels_and_logits_to_keep_run_the_models_forward():
    ref = _model("llama")
    mine = ragged.nn.fuse_lm_loss(copy.deepcopy(ref))
    ids, mask, labels = _batch(1)
    assert mine(input_ids=ids, attention_mask=mask).logits is not None
    # logits_to_keep asks for logits: the model's own forward, logits and loss
    out = mine(input_ids=ids, attention_mask=mask, labels=labels, logits_to_keep=ids.shape[1])
    want = ref(input_ids=ids, attention_mask=mask, labels=labels, logits_to_keep=ids.shape[1])
    assert out.logits is not None
    torch.testing.assert_close(out.loss, want.loss)
    mine.eval()
    ref.eval()
    with torch.no_grad():
        got = mine(input_ids=ids, attention_mask=mask, labels=labels)
        want = ref(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.loss, want.loss)


def test_flattened_batch_under_ragged_attention_with_shift_labels():
    """DataCollatorWithFlattening's batch (one row, -100 at each sequence's first label) under
    attn_implementation="ragged": the fused loss equals the model's own."""
    import ragged.integrations.transformers  # noqa: F401  (registers "ragged")

    ref = _model("qwen2")
    ref.set_attn_implementation("ragged")
    mine = ragged.nn.fuse_lm_loss(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(4)
    lengths = [5, 1, 9]
    seqs = [torch.randint(0, V, (n,), generator=g) for n in lengths]
    ids = torch.cat(seqs)[None]
    labels = torch.cat([torch.cat([torch.tensor([-100]), s[1:]]) for s in seqs])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    kw = dict(position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
    want = ref(input_ids=ids, labels=labels, **kw)
    got = mine(input_ids=ids, labels=labels, **kw)
    torch.testing.assert_close(got.loss.float(), want.loss, atol=1e-6, rtol=1e-6)  # HF's is float32
    want64 = _loss64(ref(input_ids=ids, **kw).logits, labels, None)
    torch.testing.assert_close(got.loss, want64, atol=1e-12, rtol=1e-12)
    # shift_labels given (the packed targets of ragged.shift_labels): the same loss again
    rt = ragged.RaggedTensor.from_lengths(torch.cat(seqs), lengths)
    got2 = mine(input_ids=ids, labels=labels, shift_labels=ragged.shift_labels(rt)[None], **kw)
    torch.testing.assert_close(got2.loss, want64, atol=1e-12, rtol=1e-12)


def test_refusals_and_undo():
    with pytest.raises(TypeError, match=r"ragged.nn.fuse_lm_loss\(\).*GPT2LMHeadModel"):
        ragged.nn.fuse_lm_loss(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2)))
    model = _model("llama")
    assert ragged.nn.fuse_lm_loss(model) is model
    ragged.nn.fuse_lm_loss(model)  # twice: no change
    assert "forward" in model.__dict__
    twin = copy.deepcopy(model)  # a copy computes its own loss through its own parameters
    assert twin.forward.module is twin
    ids, mask, labels = _batch(2)
    torch.testing.assert_close(
        twin(input_ids=ids, attention_mask=mask, labels=labels).loss,
        model(input_ids=ids, attention_mask=mask, labels=labels).loss,
    )
    ragged.nn.unfuse_lm_loss(model)
    assert "forward" not in model.__dict__
    ids, mask, labels = _batch()
    assert model(input_ids=ids, attention_mask=mask, labels=labels).logits is not None
