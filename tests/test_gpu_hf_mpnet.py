"""ragged.nn.convert on HuggingFace MPNet on the GPU: the attention kernels with the
relative-position bias behind the converted forward, in bfloat16, float16 and float32.

Run with ``pytest -m gpu``. The oracle is HuggingFace's model in float64 (same weights); the
converted model in ``dtype`` must be as close to it as HuggingFace in ``dtype`` by flash-attn's
rule (``_close`` of test_gpu_hf_convert.py), for outputs, losses and every gradient (the bias
table's included).
"""

from __future__ import annotations

import copy

import pytest
import torch

import ragged
from hf_convert_cases import _labels, _randomise
from test_gpu_hf_convert import _close, _values

tf = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

LENGTHS = [37, 3, 130, 1, 64]  # past 128 tokens apart: every bucket of the bias
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KINDS = {"base": "Model", "sequence": "ForSequenceClassification", "token": "ForTokenClassification",
         "masked_lm": "ForMaskedLM", "qa": "ForQuestionAnswering"}


def _models(kind: str, dtype: torch.dtype, **over):
    kw = dict(vocab_size=50, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
              max_position_embeddings=160, pad_token_id=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
              num_labels=2 if kind == "qa" else 3)
    kw.update(over)
    oracle = getattr(tf, "MPNet" + KINDS[kind])(tf.MPNetConfig(**kw)).double()
    _randomise(oracle, 21)
    with torch.no_grad():
        oracle.base_model.encoder.relative_attention_bias.weight.normal_(0.0, 1.0)
    oracle = oracle.cuda().eval()
    theirs = copy.deepcopy(oracle).to(dtype)
    ours = ragged.nn.convert(copy.deepcopy(theirs))
    return oracle, theirs, ours


def _batch(lengths=LENGTHS, seed=22):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, 50, (len(lengths), width), generator=g)
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long()
    return ids.masked_fill(mask == 0, 1).cuda(), mask.cuda()


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_gpu_mpnet_outputs_match_hf(kind, dtype):
    oracle, theirs, ours = _models(kind, dtype)
    ids, mask = _batch()
    rt = ragged.pack([row[m.bool()] for row, m in zip(ids, mask)])
    with torch.no_grad():
        want = oracle(input_ids=ids, attention_mask=mask)
        hf = theirs(input_ids=ids, attention_mask=mask)
        for got in (ours(input_ids=ids, attention_mask=mask), ours(input_ids=rt)):
            for key in want.keys():
                _close(_values(got[key], mask), _values(hf[key], mask), _values(want[key], mask), dtype, key)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["sequence", "token", "masked_lm"])
def test_gpu_mpnet_training_gradients_match_hf(kind, dtype):
    """Train mode (dropout 0), a RaggedTensor input: loss and every parameter's gradient."""
    oracle, theirs, ours = _models(kind, dtype)
    ids, mask = _batch()
    labels = {k: v.cuda() for k, v in _labels(kind, LENGTHS, mask.cpu(), 23).items()}
    if kind == "masked_lm":
        labels["labels"] = labels["labels"].clamp(max=49)
    rt = ragged.pack([row[m.bool()] for row, m in zip(ids, mask)])
    rlabels = {k: (ragged.pack([row[m.bool()] for row, m in zip(v, mask)]) if v.dim() == 2 else v)
               for k, v in labels.items()}
    losses = {}
    for name, model in (("oracle", oracle), ("theirs", theirs), ("ours", ours)):
        model.train()
        loss = model(input_ids=rt, **rlabels).loss if name == "ours" else \
            model(input_ids=ids, attention_mask=mask, **labels).loss
        loss.backward()
        losses[name] = loss.detach()
    _close(losses["ours"], losses["theirs"], losses["oracle"], dtype, "loss")
    grads = {n: p.grad for n, p in oracle.named_parameters()}
    hf_grads = {n: p.grad for n, p in theirs.named_parameters()}
    for n, p in ours.named_parameters():
        if grads[n] is None:
            assert p.grad is None or torch.all(p.grad == 0), n
            continue
        _close(p.grad, hf_grads[n], grads[n], dtype, f"d {n}")


def test_gpu_mpnet_inference_does_not_sync_and_graphs():
    """A RaggedTensor input reads nothing from the GPU; a graphed model gives the eager outputs."""
    _, _, ours = _models("base", torch.bfloat16)
    rt = ragged.pack([torch.randint(3, 50, (n,), device="cuda") for n in [37, 0, 130, 1, 64]])
    with torch.no_grad():
        want = ours(input_ids=rt).last_hidden_state
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ours(input_ids=rt)
            ours(input_ids=rt, output_hidden_states=True)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        graphed = ragged.nn.graphed(ours, max_tokens=512, max_batch_size=8)
        for _ in range(2):  # capture, then replay
            got = graphed(input_ids=rt).last_hidden_state
            assert got.host_lengths() == want.host_lengths()
            torch.testing.assert_close(got.values, want.values, rtol=2e-2, atol=2e-2)
