"""What the ragged.nn.convert tests of HuggingFace models share (test_hf_convert.py,
test_hf_convert_training.py): the families and head kinds, tiny float64 configs with randomised
weights, padded batches and the comparison at real positions."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ragged

tf = pytest.importorskip("transformers")

VOCAB, D, PAD, MAXPOS = 50, 32, 1, 64

LENGTHS = [4, 1, 17, 9]
TOL = {"rtol": 1e-9, "atol": 1e-10}  # float64 on both sides

FAMILIES = {
    "bert": (tf.BertConfig, "Bert"),
    "roberta": (tf.RobertaConfig, "Roberta"),
    "xlm-roberta": (tf.XLMRobertaConfig, "XLMRoberta"),
    "camembert": (tf.CamembertConfig, "Camembert"),
    "electra": (tf.ElectraConfig, "Electra"),
    "distilbert": (tf.DistilBertConfig, "DistilBert"),
}
KINDS = {
    "base": "Model",
    "sequence": "ForSequenceClassification",
    "token": "ForTokenClassification",
    "masked_lm": "ForMaskedLM",
    "qa": "ForQuestionAnswering",
}


def _config(family: str, kind: str = "base", **over):
    cls = FAMILIES[family][0]
    if family == "distilbert":
        kw = dict(
            vocab_size=VOCAB,
            dim=D,
            n_layers=2,
            n_heads=4,
            hidden_dim=2 * D,
            max_position_embeddings=MAXPOS,
            dropout=0.0,
            attention_dropout=0.0,
            qa_dropout=0.0,
            seq_classif_dropout=0.0,
            pad_token_id=PAD,
        )
    else:
        kw = dict(
            vocab_size=VOCAB,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=2 * D,
            max_position_embeddings=MAXPOS,
            type_vocab_size=2,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=PAD,
        )
        if family == "electra":
            kw["embedding_size"] = 24  # != hidden: embeddings_project
    kw["num_labels"] = 2 if kind == "qa" else 3
    kw.update(over)
    return cls(**kw)


def _randomise(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            if "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif p.dim() == 2:
                p.copy_(noise * p.shape[-1] ** -0.5 * (3.0 if "embeddings" in name else 1.0))
            else:
                p.copy_(0.1 * noise)


def _model(family: str, kind: str = "base", seed: int = 0, dtype=torch.float64, **over):
    """(converted model, untouched HuggingFace copy)."""
    cls = getattr(tf, FAMILIES[family][1] + KINDS[kind])
    hf = cls(_config(family, kind, **over)).to(dtype)
    _randomise(hf, seed)
    hf.eval()
    ours = copy.deepcopy(hf)
    assert ragged.nn.convert(ours) is ours
    return ours, hf


def _batch(lengths, side="right", seed=0, width=None):
    """(ids [B, M], mask [B, M] long): pad id at padding, one real token equal to the pad id."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths) if width is None else width
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=g)
    j = torch.arange(width)
    n = torch.tensor(lengths).unsqueeze(1)
    keep = (j >= width - n) if side == "left" else (j < n)
    ids = ids.masked_fill(~keep, PAD)
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    if lengths[longest] > 3:  # RoBERTa's positions skip a real token equal to the pad id
        ids[longest, keep[longest].nonzero()[2, 0]] = PAD
    return ids, keep.long()


def _ragged(ids, mask):
    return ragged.pack([row[m.bool()] for row, m in zip(ids, mask)])


def _real(x, mask):
    return x[mask.bool()]


def _main(out, kind):
    return {"base": "last_hidden_state", "qa": "start_logits"}.get(kind, "logits")


def _labels(kind, lengths, mask, seed):
    g = torch.Generator().manual_seed(seed)
    b, m = mask.shape
    if kind == "sequence":
        return {"labels": torch.randint(0, 3, (b,), generator=g)}
    if kind == "qa":
        n = torch.tensor(lengths)
        return {
            "start_positions": (torch.rand(b, generator=g) * n).long(),
            "end_positions": (torch.rand(b, generator=g) * n).long(),
        }
    high = 3 if kind == "token" else VOCAB
    labels = torch.randint(0, high, (b, m), generator=g)
    labels[torch.rand(b, m, generator=g) < 0.3] = -100
    return {"labels": labels.masked_fill(~mask.bool(), -100)}
