"""The one-node decoder layer (ragged.nn.decoder_node: a hand-written backward) against the same
layer recorded op by op (ragged.nn.decoder_layer.run_layer), in float64 on the CPU, for every
family the core reads: the last hidden states and every Parameter's gradient, with the
gradient entering both outputs of the stack's layers; lengths 0, 1 and odd; LoRA's effective
weights and biases on every projection."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_decoder_core import LENGTHS, MODELS, V, _config, _model  # noqa: E402

import ragged  # noqa: E402
from ragged.nn import decoder_layer, decoder_node  # noqa: E402
from ragged.nn.hf import decoder_core  # noqa: E402


def _run(model, ids, node: bool, monkeypatch, weights):
    monkeypatch.setattr(decoder_layer, "_NODE", node)
    calls = []
    apply = decoder_node.DecoderLayerFunction.apply
    monkeypatch.setattr(decoder_node.DecoderLayerFunction, "apply", lambda *a: calls.append(1) or apply(*a))
    model.zero_grad()
    hidden: list = []
    out = decoder_core.run_packed_core(model, ids, hidden_states=hidden)
    # a gradient into the last output and into an intermediate stream (both outputs of a layer)
    (out.values * weights).sum().backward(retain_graph=True)
    (hidden[1] * weights.flip(0)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.values.detach(), grads, len(calls)


def _check(model, ids, monkeypatch):
    g = torch.Generator().manual_seed(2)
    weights = torch.randn(ids.values.shape[0], model.config.hidden_size, generator=g, dtype=torch.float64)
    want, want_g, none = _run(model, ids, False, monkeypatch, weights)
    got, got_g, calls = _run(model, ids, True, monkeypatch, weights)
    assert none == 0 and calls == (len(model.layers) if ids.values.shape[0] else 0)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    assert got_g.keys() == want_g.keys()
    for n in want_g:
        torch.testing.assert_close(got_g[n], want_g[n], atol=1e-11, rtol=1e-9, msg=n)


@pytest.mark.parametrize("name", list(MODELS))
def test_node_equals_the_recorded_layer(name, monkeypatch):
    model = _model(name)
    g = torch.Generator().manual_seed(1)
    ids = ragged.RaggedTensor.from_lengths(torch.randint(0, V, (sum(LENGTHS),), generator=g), LENGTHS)
    _check(model, ids, monkeypatch)


@pytest.mark.parametrize("lengths", [[1], [0, 0], [1, 0, 3], [31]])
def test_node_edge_lengths(lengths, monkeypatch):
    model = _model("qwen3")
    ids = ragged.RaggedTensor.from_lengths(torch.randint(0, V, (sum(lengths),)), lengths)
    if sum(lengths) == 0:
        out = decoder_core.run_packed_core(model, ids)
        assert out.values.shape == (0, model.config.hidden_size)
        return
    _check(model, ids, monkeypatch)


def test_node_with_biases_and_lora(monkeypatch):
    peft = pytest.importorskip("peft")
    torch.manual_seed(3)
    base = transformers.LlamaModel(_config("llama", attention_bias=True, mlp_bias=True)).double()
    with torch.no_grad():
        for n, p in base.named_parameters():
            if n.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.3)
    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    model = peft.get_peft_model(
        copy.deepcopy(base), peft.LoraConfig(r=2, target_modules=targets, init_lora_weights=False)
    ).base_model.model
    ids = ragged.RaggedTensor.from_lengths(torch.randint(0, V, (14,)), [5, 9])
    _check(model, ids, monkeypatch)


def test_node_is_not_used_where_it_does_not_apply(monkeypatch):
    model = _model("llama")
    ids = ragged.RaggedTensor.from_lengths(torch.randint(0, V, (9,)), [4, 5])
    calls = []
    apply = decoder_node.DecoderLayerFunction.apply
    monkeypatch.setattr(decoder_node.DecoderLayerFunction, "apply", lambda *a: calls.append(1) or apply(*a))
    with torch.no_grad():
        decoder_core.run_packed_core(model, ids)  # inference: no gradient wanted
    model.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        decoder_core.run_packed_core(model, ids).values.float().sum().backward()  # autocast: recorded
    model.double()
    model.layers[0].input_layernorm.weight.data = model.layers[0].input_layernorm.weight.data.float()
    decoder_core.run_packed_core(model, ids).values.sum().backward()  # mixed dtypes: layer 0 recorded
    assert len(calls) == len(model.layers) - 1


@pytest.mark.parametrize("node", [True, False])
def test_gradient_checkpointing_recomputes_each_layer(node, monkeypatch):
    """HuggingFace's gradient_checkpointing_enable() on a converted causal LM: each layer's forward
    runs again in the backward, and the loss and every gradient are the same as without it."""
    import ragged.nn

    monkeypatch.setattr(decoder_layer, "_NODE", node)
    torch.manual_seed(6)
    ref = transformers.Qwen2ForCausalLM(_config("qwen2")).double().train()
    plain = ragged.nn.convert(copy.deepcopy(ref))
    saving = ragged.nn.convert(copy.deepcopy(ref))
    saving.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = ragged.RaggedTensor.from_lengths(torch.randint(0, V, (12,)), [7, 5])
    calls = []
    run = decoder_layer.run_layer
    apply = decoder_node.DecoderLayerFunction.apply
    monkeypatch.setattr(decoder_layer, "run_layer", lambda *a: calls.append(1) or run(*a))
    monkeypatch.setattr(decoder_node.DecoderLayerFunction, "apply", lambda *a: calls.append(1) or apply(*a))
    out = {}
    for name, model in (("plain", plain), ("saving", saving)):
        calls.clear()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out[name] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()}, len(calls))
    layers = len(ref.model.layers)
    assert out["plain"][2] == layers and out["saving"][2] == 2 * layers  # recomputed in the backward
    torch.testing.assert_close(out["saving"][0], out["plain"][0], atol=1e-12, rtol=1e-12)
    for n, g in out["plain"][1].items():
        torch.testing.assert_close(out["saving"][1][n], g, atol=1e-12, rtol=1e-10, msg=n)
