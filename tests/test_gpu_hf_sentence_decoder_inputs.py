"""A converted SentenceTransformer whose tokenizer returns ``token_type_ids`` (a BERT-style
tokenizer) over a model that takes none (a Qwen3 decoder, a DistilBERT encoder), on the GPU:
``encode`` through the encode pipeline and its graphs (right padding), and through the model's own
graphs (``ragged.nn.graphed(st)``), where the token types used to reach the captured module
(``PackedDecoder.forward() got an unexpected keyword argument 'token_type_ids'``).

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise). Tiny models with random
weights and the CPU file's typed tokenizer; the oracle is the unconverted model in float64, the
converted model in bfloat16 as close to it as the unconverted model in bfloat16
(:func:`test_gpu_hf_sentence._close`).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

tf = pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as M
from test_gpu_hf_sentence import _close
from test_hf_sentence_decoder import TEXTS
from test_hf_sentence_decoder_inputs import save_model

import ragged
from ragged.nn.hf import sentence as hf_sentence

pytestmark = pytest.mark.gpu

DTYPE = torch.bfloat16
HIDDEN = 128  # heads of 32 features: the GPU kernels' head sizes (the CPU file's 8 run only the reference)


@pytest.fixture(scope="module")
def gpu_folders(tmp_path_factory):
    return {
        family: save_model(tmp_path_factory.mktemp(f"gpu_{family}"), family, seed=30 + i, hidden=HIDDEN)
        for i, family in enumerate(("qwen3", "distilbert"))
    }


def _models(path: str, side: str):
    """(oracle float64, original in bfloat16, converted in bfloat16) on the GPU, eval mode."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = M.Transformer(path)
    tr.tokenizer.padding_side = side
    oracle = SentenceTransformer(modules=[tr, M.Pooling(HIDDEN, "mean")], device="cuda").double().eval()
    theirs = copy.deepcopy(oracle).to(DTYPE)
    ours = hf_sentence.convert_sentence_transformer(copy.deepcopy(theirs))
    assert "token_type_ids" in theirs.preprocess(TEXTS[:2])
    return oracle, theirs, ours


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", ["qwen3", "distilbert"])
def test_gpu_encode_with_token_types(gpu_folders, family, side):
    oracle, theirs, ours = _models(gpu_folders[family], side)
    want, hf = (m.encode(TEXTS, batch_size=3, convert_to_tensor=True) for m in (oracle, theirs))
    _close(ours.encode(TEXTS, batch_size=3, convert_to_tensor=True), hf, want, DTYPE, f"{family} pipeline")
    assert ragged.nn.graphed(ours, max_tokens=256, max_batch_size=8) is ours
    got = ours.encode(TEXTS, batch_size=3, convert_to_tensor=True)
    assert ours[0].forward.graphed.num_graphs >= 1
    _close(got, hf, want, DTYPE, f"{family} graphed")
