"""Texts for the hf suite's embedding workloads: a generated word-level tokenizer, texts of
given token lengths, the tokenized dataset, and one pass of a HuggingFace model (padded
batches) or of a converted one (collated RaggedTensors, optionally graphed) over it."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch

import ragged

from ..harness import Skip
from .hf_common import SEED, pad_batch, to_device

__all__ = [
    "MeanPooled",
    "Texts",
    "convert_st",
    "embed_file_pass",
    "encode_pass",
    "graphed_encode_pass",
    "load_st",
    "make_texts",
    "padded_pass",
    "ragged_pass",
    "word_tokenizer",
]


def word_tokenizer(vocab: int):
    """A BERT WordPiece tokenizer of ``vocab`` ids: the special tokens, then the words ``w0``, ``w1``, ..."""
    from transformers import BertTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(vocab - 5)]
    return BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}, model_max_length=512)


def make_texts(tokenizer, lengths: list[int], seed: int = SEED) -> list[str]:
    """Texts of random words of the tokenizer's vocabulary that tokenize to ``lengths`` tokens
    (special tokens included, at least one word): only words that are one token are drawn."""
    vocab = tokenizer.get_vocab()
    candidates = sorted((w for w in vocab if w.isascii() and w.isalnum()), key=vocab.get)
    ids = tokenizer(candidates, add_special_tokens=False)["input_ids"]
    words = np.array([w for w, i in zip(candidates, ids) if i == [vocab[w]]])
    if words.size == 0:
        raise Skip("the tokenizer has no word that is one token")
    specials, rng = len(tokenizer("")["input_ids"]), np.random.default_rng(seed)
    return [" ".join(rng.choice(words, max(1, n - specials))) for n in lengths]


class Texts:
    """The tokenized texts as a dataset holds them (a dict of int64 arrays per text)."""

    def __init__(self, tokenizer, texts: list[str], device: torch.device):
        enc = tokenizer(texts, truncation=True)  # to the tokenizer's model_max_length
        self.keys = tuple(k for k in ("input_ids", "token_type_ids") if k in enc)
        self.features = [{k: np.asarray(enc[k][i], dtype=np.int64) for k in self.keys} for i in range(len(texts))]
        self.lengths = np.array([len(x) for x in enc["input_ids"]], dtype=np.int64)
        self.pad_id, self.texts, self.device = tokenizer.pad_token_id or 0, texts, device

    def chunks(self, order: np.ndarray, size: int) -> list[np.ndarray]:
        return [order[i : i + size] for i in range(0, order.size, size)]

    def inverse(self, batches: list[np.ndarray]) -> torch.Tensor:
        """Row of each text in the concatenation of the batches' outputs."""
        return torch.from_numpy(np.argsort(np.concatenate(batches), kind="stable")).to(self.device)


def padded_pass(model, data: Texts, batches: list[np.ndarray]) -> Callable[[], torch.Tensor]:
    """A pass of a HuggingFace model over padded batches: pad, move, run, masked mean; ``[N, d]``."""
    inverse = data.inverse(batches)

    @torch.inference_mode()
    def run() -> torch.Tensor:
        out = []
        for idx in batches:
            b = to_device(pad_batch([data.features[i] for i in idx], data.keys, data.pad_id), data.device)
            h, mask = model(**b).last_hidden_state, b["attention_mask"]
            out.append((h * mask.unsqueeze(-1).to(h.dtype)).sum(1).float() / mask.sum(1, keepdim=True).float())
        return torch.cat(out).index_select(0, inverse)

    return run


class MeanPooled(torch.nn.Module):
    """A converted model and ``ragged.pool(..., "mean")`` as one module (both inside a graph
    when graphed): ``[B, d]`` embeddings of a collated batch."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch):
        return ragged.pool(self.model(**batch).last_hidden_state, "mean")


def ragged_pass(model, data: Texts, batches: list[np.ndarray], graphed: bool = False) -> Callable[[], torch.Tensor]:
    """A pass of a converted model: ``collate``, move, run on RaggedTensors, ``ragged.pool``; ``[N, d]``.
    ``graphed``: the model and the pooling through ``ragged.nn.graphed`` (buckets up to the largest
    batch's tokens and size)."""
    import ragged.nn as rnn
    from ragged.data import collate

    inverse = data.inverse(batches)
    embed = MeanPooled(model).eval()
    if graphed:
        tokens = max(int(data.lengths[idx].sum()) for idx in batches)
        embed = rnn.graphed(embed, max_tokens=1 << tokens.bit_length(), max_batch_size=max(len(i) for i in batches))

    @torch.inference_mode()
    def run() -> torch.Tensor:
        out = []
        for idx in batches:
            b = collate([data.features[i] for i in idx]).to(data.device, non_blocking=True)
            out.append(embed(**b).float())
        return torch.cat(out).index_select(0, inverse)

    return run


def graphed_encode_pass(st, texts: list[str], batch: int, longest: int) -> Callable[[], torch.Tensor]:
    """``encode`` of a copy of the converted ``st`` through ``ragged.nn.graphed`` (buckets up to
    ``batch`` texts of ``longest`` tokens)."""
    import copy

    import ragged.nn as rnn

    top = 1 << int(batch * longest).bit_length()
    return encode_pass(rnn.graphed(copy.deepcopy(st), max_tokens=top, max_batch_size=batch), texts, batch)


def embed_file_pass(st, texts: list[str]) -> Callable[[], torch.Tensor]:
    """``python -m ragged.embed``'s work on a loaded converted model, one chunk: the texts read
    from a JSONL file (checked line by line, :func:`ragged.integrations.embed_io.read_texts`),
    embedded by the encode pipeline (:func:`ragged.nn.hf.sentence.pipeline.embed`), saved as
    ``.npy``; returns the saved embeddings read back."""
    import json
    import tempfile

    from ragged.integrations.embed_io import read_texts
    from ragged.nn.hf.sentence.pipeline import embed

    folder = tempfile.mkdtemp(prefix="ragged_bench_embed_")
    src, out = os.path.join(folder, "texts.jsonl"), os.path.join(folder, "embeddings.npy")
    with open(src, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)

    def run() -> torch.Tensor:
        np.save(out, embed(st, read_texts(src, "text")))
        return torch.from_numpy(np.load(out))

    return run


def encode_pass(st, texts: list[str], batch: int) -> Callable[[], torch.Tensor]:
    return lambda: st.encode(texts, batch_size=batch, convert_to_tensor=True, show_progress_bar=False).float()


def load_st(src: str, dtype: torch.dtype, device: torch.device, dim: int, **model_kwargs):
    """A SentenceTransformer of the folder ``src``: its own modules (modules.json), else the model
    with mean pooling; weights in ``dtype``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    kwargs = {"dtype": dtype, **model_kwargs}
    if os.path.exists(os.path.join(src, "modules.json")):
        return SentenceTransformer(src, device=str(device), model_kwargs=kwargs)
    modules = [Transformer(src, model_kwargs=kwargs), Pooling(dim, "mean")]
    return SentenceTransformer(modules=modules, device=str(device))


def convert_st(st):
    """``ragged.nn.convert(st)``, refused unless its ``encode()`` became the packed one (converting
    only the HuggingFace model inside would leave the batches padded in and out)."""
    import ragged.nn as rnn
    from ragged.nn.hf import sentence as hf_sentence

    converted = rnn.convert(st)
    if not hf_sentence.is_converted(converted):
        raise RuntimeError("encode() was not converted (only the model inside: padded in and out)")
    return converted
