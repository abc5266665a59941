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
from gpu_family_cases import check_no_sync_and_graphs, check_outputs, check_training
from hf_convert_cases import _randomise

import ragged

tf = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KINDS = {
    "base": "Model",
    "sequence": "ForSequenceClassification",
    "token": "ForTokenClassification",
    "masked_lm": "ForMaskedLM",
    "qa": "ForQuestionAnswering",
}


def _models(kind: str, dtype: torch.dtype, **over):
    kw = dict(
        vocab_size=50,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=160,
        pad_token_id=1,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2 if kind == "qa" else 3,
    )
    kw.update(over)
    oracle = getattr(tf, "MPNet" + KINDS[kind])(tf.MPNetConfig(**kw)).double()
    _randomise(oracle, 21)
    with torch.no_grad():
        oracle.base_model.encoder.relative_attention_bias.weight.normal_(0.0, 1.0)
    oracle = oracle.cuda().eval()
    theirs = copy.deepcopy(oracle).to(dtype)
    ours = ragged.nn.convert(copy.deepcopy(theirs))
    return oracle, theirs, ours


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_gpu_mpnet_outputs_match_hf(kind, dtype):
    check_outputs(_models, kind, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["sequence", "token", "masked_lm"])
def test_gpu_mpnet_training_gradients_match_hf(kind, dtype):
    check_training(_models, kind, dtype)


def test_gpu_mpnet_inference_does_not_sync_and_graphs():
    check_no_sync_and_graphs(_models)
