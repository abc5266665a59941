"""What the attn_implementation="ragged" tests share (test_hf_attention.py, test_hf_attention_calls.py):
the tiny model families with seeded weights, the lengths, tolerances, the per-sequence SDPA oracle
of the loss and gradients, and flattened batches."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from transformers import DataCollatorWithFlattening  # noqa: E402

import ragged  # noqa: E402
import ragged.integrations.transformers  # noqa: E402,F401  (registers attn_implementation="ragged")

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
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        attention_dropout=0.0,
    )
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


def _bert_pair(seed=0, dtype=torch.float32):
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
    )
    torch.manual_seed(seed)
    reference = transformers.BertModel(config, add_pooling_layer=False).to(dtype)
    reference.set_attn_implementation("sdpa")
    model = copy.deepcopy(reference)
    model.set_attn_implementation("ragged")
    return model.train(), reference.train()
