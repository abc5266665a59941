"""Converted decoders on the GPU (``pytest -m gpu``): bf16 Qwen2-, Gemma2- and Gemma3-shaped models on a
packed batch against the models' own forward per sequence, the training step without a host
sync, and the fused loss's gradients against HF's."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ragged  # noqa: E402
import ragged.nn  # noqa: E402

pytestmark = pytest.mark.gpu

LENGTHS = [300, 17, 1, 0, 700]


def _model(name):
    common = dict(
        vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    if name == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif name == "gemma2":
        common.update(attn_logit_softcapping=None, final_logit_softcapping=30.0, sliding_window=128)
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common))
    else:  # Gemma3: q/k norms, a rotary table per layer type
        common.update(sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 2)
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**common))
    return model.to("cuda", torch.bfloat16)


@pytest.mark.parametrize("name", ["qwen2", "gemma2", "gemma3"])
def test_logits_loss_and_gradients_against_the_models_own(name):
    ref = _model(name)
    mine = ragged.nn.convert(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 32000, (n,), generator=g).cuda() for n in LENGTHS]
    rt = ragged.RaggedTensor.from_lengths(torch.cat(seqs), LENGTHS)
    ref.eval(), mine.eval()
    with torch.no_grad():
        got = mine(input_ids=rt).logits
        for seq, part in zip(seqs, got.unbind()):
            if len(seq):
                want = ref(input_ids=seq[None]).logits[0]
                err = (part.float() - want.float()).abs().max().item()
                assert err <= 0.05 * want.float().abs().max().item(), err
    ref.train(), mine.train()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = mine(input_ids=rt, labels=rt)
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.logits is None
    total, count = 0.0, 0
    for seq in seqs:
        if len(seq) > 1:
            logits = ref(input_ids=seq[None]).logits[0]
            total = total + torch.nn.functional.cross_entropy(logits[:-1].float(), seq[1:], reduction="sum")
            count += len(seq) - 1
    want = total / count
    want.backward()
    torch.testing.assert_close(out.loss.float(), want.float(), atol=2e-2, rtol=2e-2)
    for (n, p), q in zip(ref.named_parameters(), mine.parameters()):
        a, b = q.grad.float(), p.grad.float()
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
        assert cos > 0.99, (n, cos)


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_one_node_layer_equals_the_recorded_layer_on_the_gpu(name, monkeypatch):
    """The one-node decoder layer (hand-written backward, the GPU kernels) against the same layers
    recorded op by op, float32: the loss and every gradient."""
    from ragged.nn import decoder_layer

    ref = _model(name).float()
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 32000, (n,), generator=g).cuda() for n in LENGTHS]
    rt = ragged.RaggedTensor.from_lengths(torch.cat(seqs), LENGTHS)
    out = {}
    for node in (False, True):
        monkeypatch.setattr(decoder_layer, "_NODE", node)
        mine = ragged.nn.convert(copy.deepcopy(ref)).train()
        loss = mine(input_ids=rt, labels=rt).loss
        loss.backward()
        out[node] = (loss.detach(), {n: p.grad for n, p in mine.named_parameters()})
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-5, rtol=1e-5)
    for n, want in out[False][1].items():
        scale = max(want.abs().max().item(), 1e-6)
        torch.testing.assert_close(out[True][1][n], want, atol=2e-4 * scale, rtol=2e-3, msg=n)
