"""The decoder core (ragged.nn.decoder_layer: Llama, Mistral, Qwen2/3, Gemma 1-3, EmbeddingGemma),
read from HuggingFace base models by ragged.nn.hf.decoder_core, against the models' own forward,
per sequence, in float64: the last hidden states and every Parameter's gradient."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ragged  # noqa: E402
from ragged.nn.hf import decoder_core  # noqa: E402

V = 101
LENGTHS = [5, 1, 13, 0, 8]


def _config(name, **extra):
    common = dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attn_implementation="eager",
    )  # fmt: skip
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "gemma": transformers.GemmaConfig,
        "gemma2": transformers.Gemma2Config,
        "gemma3": transformers.Gemma3TextConfig,
        "embeddinggemma": transformers.Gemma3TextConfig,
    }[name]
    if name.startswith("gemma") or name == "embeddinggemma":
        common.update(attn_logit_softcapping=None, query_pre_attn_scalar=12, sliding_window=4)
    if name in ("gemma3", "embeddinggemma"):  # a rotary table per layer type (10k local, 1M global)
        common.update(layer_types=["sliding_attention", "full_attention"])
    if name == "embeddinggemma":  # EmbeddingGemma: both ways, |i - j| < window on sliding layers
        common.update(use_bidirectional_attention=True)
    if name == "mistral":
        common.update(sliding_window=6)
    common.update(extra)
    return cls(**common)


MODELS = {
    "llama": "LlamaModel",
    "mistral": "MistralModel",
    "qwen2": "Qwen2Model",
    "qwen3": "Qwen3Model",
    "gemma": "GemmaModel",
    "gemma2": "Gemma2Model",
    "gemma3": "Gemma3TextModel",
    "embeddinggemma": "Gemma3TextModel",
}


def _model(name):
    torch.manual_seed(len(name))
    model = getattr(transformers, MODELS[name])(_config(name)).double()
    with torch.no_grad():  # norms away from their initial values, so that each one matters
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
            elif n.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("name", list(MODELS))
def test_hidden_states_and_gradients_equal_the_models_own(name):
    model = _model(name)
    assert decoder_core.why_not_core(model) is None
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, V, (n,), generator=g) for n in LENGTHS]
    ids = ragged.RaggedTensor.from_lengths(torch.cat(seqs), LENGTHS)
    got = decoder_core.run_packed_core(model, ids)
    weights = torch.randn(got.values.shape, generator=g, dtype=torch.float64)
    (got.values * weights).sum().backward()
    mine = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total = 0
    for seq, part, w in zip(seqs, got.unbind(), weights.split(LENGTHS)):
        if len(seq) == 0:
            continue
        want = model(input_ids=seq[None]).last_hidden_state[0]
        # HF's rotary tables are float32 whatever the model's dtype (cos and sin of a float32
        # angle, then widened); the core takes the cosine of the same float32 angle in float64
        torch.testing.assert_close(part, want, atol=2e-6, rtol=2e-6)
        total = total + (want * w).sum()
    total.backward()
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert mine.keys() == ref.keys()
    for n in ref:
        scale = ref[n].abs().max().item()
        torch.testing.assert_close(mine[n], ref[n], atol=2e-6 * max(scale, 1.0), rtol=1e-5, msg=n)


def test_refusals_of_modules_the_core_would_not_call():
    model = _model("llama")
    model.layers[1].self_attn.v_proj = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(32, 16, bias=False))
    assert "layers.1.self_attn.v_proj is a ParametrizedLinear" in decoder_core.why_not_core(model)
    model = _model("qwen2")
    model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert "layers.0.mlp has a hook" in decoder_core.why_not_core(model)
    # the embeddings are called as a module: their hooks run (Trainer's enable_input_require_grads)
    model = _model("qwen2")
    model.embed_tokens.register_forward_hook(lambda m, i, out: out * 2)
    assert decoder_core.why_not_core(model) is None
    ids = ragged.RaggedTensor.from_lengths(torch.tensor([3, 1, 4]), [3])
    torch.testing.assert_close(
        decoder_core.run_packed_core(model, ids).values, model(input_ids=ids.values[None]).last_hidden_state[0],
        atol=2e-6, rtol=2e-6,
    )  # fmt: skip
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert decoder_core.why_not_core(lora.base_model.model) is None  # read as the Linear it computes
    lora = peft.get_peft_model(_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    assert "DoRA" in decoder_core.why_not_core(lora.base_model.model)


def test_refusals():
    soft = transformers.Gemma2Model(_config("gemma2", attn_logit_softcapping=50.0))
    assert "soft-capping" in decoder_core.why_not_core(soft)
    assert "not a base model" in decoder_core.why_not_core(torch.nn.Linear(2, 2))
    with pytest.raises(NotImplementedError, match="soft-capping"):
        decoder_core.run_packed_core(soft, ragged.RaggedTensor.from_lengths(torch.zeros(3, dtype=torch.long), [3]))
