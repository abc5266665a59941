"""Inputs a converted SentenceTransformer takes where the original takes them: a decoder (Qwen3,
Llama) whose tokenizer returns ``token_type_ids`` (a BERT-style tokenizer), and encoders whose
model has no token types (DistilBERT, ModernBERT) under such a tokenizer. transformers' forward
ignores token types it has no use for (its ``**kwargs``), so the original encodes; the converted
model must too, with the original's embeddings.

On the CPU in float64: ``encode`` (sentence-transformers' batches, and the encode pipeline),
``st(features)`` on padded features holding the token types, and the module the graphs capture
(:class:`ragged.nn.hf.decoder.PackedDecoder`) called with them. The GPU file
(``test_gpu_hf_sentence_decoder_inputs.py``) runs the graphed encode, where the types reached
the captured module.
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
from test_hf_sentence_decoder import TEXTS, VOCAB, D, _close, _config
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

import ragged
from ragged.nn.hf import decoder as hf_decoder
from ragged.nn.hf import sentence as hf_sentence
from ragged.nn.hf.sentence import pipeline as sp

TYPED = ["input_ids", "token_type_ids", "attention_mask"]
ROTARY_TOL = {"rtol": 1e-5, "atol": 1e-6}  # ModernBERT: HuggingFace rounds its rotary angles to float32


def typed_tokenizer(max_length: int = 24):
    """A word-level tokenizer that ends each text with ``</s>`` and returns ``token_type_ids``
    (1 on every token of a single text, so that a model reading them would change)."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.post_processor = processors.TemplateProcessing(
        single="$A:1 </s>:1", pair="$A:0 </s>:0 $B:1 </s>:1", special_tokens=[("</s>", 3)]
    )
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="</s>",
        model_max_length=max_length,
        model_input_names=TYPED,
    )


def _encoder_config(family: str, hidden: int):
    if family == "distilbert":
        return tf.DistilBertConfig(
            vocab_size=len(VOCAB),
            dim=hidden,
            n_layers=2,
            n_heads=4,
            hidden_dim=2 * hidden,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            pad_token_id=0,
        )
    return tf.ModernBertConfig(
        vocab_size=len(VOCAB),
        hidden_size=hidden,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        global_attn_every_n_layers=2,
        local_attention=8,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        cls_token_id=2,
        sep_token_id=3,
        attention_dropout=0.0,
        mlp_dropout=0.0,
        embedding_dropout=0.0,
        attn_implementation="sdpa",
    )


def save_model(path, family: str, seed: int = 0, hidden: int = D) -> str:
    """A tiny model of ``family`` (``hidden`` features, 4 heads; ModernBERT 2) with random
    weights and the typed tokenizer, saved to ``path``."""
    typed_tokenizer().save_pretrained(str(path))
    torch.manual_seed(seed)
    if family in ("qwen3", "llama"):
        cfg = _config(family, hidden_size=hidden, intermediate_size=2 * hidden, head_dim=hidden // 4)
    else:
        cfg = _encoder_config(family, hidden)
    model = tf.AutoModel.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {
        family: save_model(tmp_path_factory.mktemp(family), family, seed=i)
        for i, family in enumerate(("qwen3", "llama", "distilbert", "modernbert"))
    }


def _st(path: str, mode: str = "lasttoken", side: str = "left"):
    """(original, converted) SentenceTransformers in float64."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = M.Transformer(path)
    tr.tokenizer.padding_side = side
    original = SentenceTransformer(modules=[tr, M.Pooling(D, mode)], device="cpu").double().eval()
    ours = hf_sentence.convert_sentence_transformer(copy.deepcopy(original))
    return original, ours


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", ["qwen3", "llama", "distilbert", "modernbert"])
def test_encode_with_token_types_matches_original(folders, family, side):
    original, ours = _st(folders[family], "mean" if family in ("distilbert", "modernbert") else "lasttoken", side)
    features = original.preprocess(TEXTS[:3])
    assert "token_type_ids" in features and int(features["token_type_ids"].max()) == 1
    tol = ROTARY_TOL if family == "modernbert" else {}
    _close(ours.encode(TEXTS, batch_size=3), original.encode(TEXTS, batch_size=3), **tol)
    padded = original.preprocess(TEXTS)
    want = original(dict(padded))["sentence_embedding"]
    _close(ours(dict(padded))["sentence_embedding"], want, **tol)


@pytest.mark.parametrize("family", ["qwen3", "distilbert"])
def test_encode_pipeline_with_token_types_matches_original(folders, family, monkeypatch):
    """The encode pipeline (switched on for the CPU), which tokenizes without padding and packs
    the token types with the ids."""
    monkeypatch.setattr(hf_sentence, "Pipeline", lambda: sp.Pipeline(enabled=True, max_tokens=30, max_batch=5))
    original, ours = _st(folders[family], "mean", "right")
    _close(ours.encode(TEXTS * 2, batch_size=3), original.encode(TEXTS * 2, batch_size=3))


def test_packed_decoder_takes_token_types_and_ignores_them(folders):
    """The module ``ragged.nn.graphed`` captures for a converted decoder takes the token types
    the Transformer's features hold, as transformers' forward takes and ignores them."""
    model = tf.AutoModel.from_pretrained(folders["qwen3"]).double().eval()
    hf_decoder.use_ragged_attention(model)
    packed = hf_decoder.PackedDecoder(model)
    ids = ragged.pack([torch.tensor([5, 9, 3]), torch.tensor([7, 3]), torch.tensor([11, 12, 13, 3])])
    types = ids.with_values(torch.ones_like(ids.values))
    with torch.no_grad():
        want = packed(ids)["last_hidden_state"].values
        got = packed(ids, token_type_ids=types)["last_hidden_state"].values
        flat = packed(ids, token_type_ids=types.values)["last_hidden_state"].values
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(flat, want, rtol=0, atol=0)
