"""ragged.nn.convert on HuggingFace ModernBERT on the GPU: the rotary, gated-activation and
sliding-window attention kernels behind the converted forward, in bfloat16, float16 and float32.

Run with ``pytest -m gpu``. The oracle is HuggingFace's model in float64 (same weights, its SDPA
path); the converted model in ``dtype`` must be as close to it as HuggingFace in ``dtype`` by
flash-attn's rule (``_close`` of test_gpu_hf_convert.py), for outputs, losses and gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
from gpu_family_cases import check_no_sync_and_graphs, check_outputs, check_training
from hf_convert_cases import _randomise

import ragged

tf = pytest.importorskip("transformers")
if not hasattr(tf, "ModernBertModel"):
    pytest.skip("this transformers has no ModernBERT", allow_module_level=True)

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
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=2,
        global_attn_every_n_layers=3,
        local_attention=64,
        max_position_embeddings=256,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=3,
        cls_token_id=2,
        sep_token_id=3,
        attention_dropout=0.0,
        mlp_dropout=0.0,
        embedding_dropout=0.0,
        classifier_dropout=0.0,
        num_labels=2 if kind == "qa" else 3,
        attn_implementation="sdpa",
    )
    kw.update(over)
    oracle = getattr(tf, "ModernBert" + KINDS[kind])(tf.ModernBertConfig(**kw)).double()
    _randomise(oracle, 21)
    oracle = oracle.cuda().eval()
    theirs = copy.deepcopy(oracle).to(dtype)
    ours = ragged.nn.convert(copy.deepcopy(theirs))
    return oracle, theirs, ours


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_gpu_modernbert_outputs_match_hf(kind, dtype):
    check_outputs(_models, kind, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["sequence", "token", "masked_lm"])
def test_gpu_modernbert_training_gradients_match_hf(kind, dtype):
    check_training(_models, kind, dtype)


def test_gpu_modernbert_inference_does_not_sync_and_graphs():
    check_no_sync_and_graphs(_models)
