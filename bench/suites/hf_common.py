"""What the hf suite's three workloads share: row names and targets, the model configs
(BERT, Llama), lengths and shapes, and the helpers of a row (quiet loading, padding a batch,
training steps and the training workload's gate)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..harness import Impl, Workload, peak_memory_bytes
from .encoder_problem import training_mode

SEED = 0
MODEL_VARIABLE, WORKLOADS_VARIABLE = "BENCH_HF_MODEL", "BENCH_HF_WORKLOADS"
EMBEDDING, FINE_TUNE, CAUSAL_LM, MODERN, MPNET = "embedding", "fine-tune", "causal LM", "ModernBERT", "MPNet"
DECODER = "decoder embedder"
WORKLOAD_KEYS = {
    "embedding": EMBEDDING,
    "fine-tune": FINE_TUNE,
    "lm": CAUSAL_LM,
    "modernbert": MODERN,
    "mpnet": MPNET,
    "decoder": DECODER,
}
FAMILY_WORKLOADS = (MODERN, MPNET)  # texts embedded by one model family (bench/suites/hf_families.py)
# workloads that embed N texts and judge the embeddings against the original model's own error
EMBEDDERS = (*FAMILY_WORKLOADS, DECODER)

# Row names (the rows' ``impl``).
HF_DATA, HF_SORTED, HF_COMPILED = "HF SDPA, data order", "HF SDPA, sorted", "HF SDPA compiled, sorted"
# a model with no SDPA path (MPNet: its attention adds a bias to eager scores)
HF_EAGER_DATA, HF_EAGER_SORTED, HF_EAGER_COMPILED = (
    "HF eager, data order",
    "HF eager, sorted",
    "HF eager compiled, sorted",
)
ST_32, ST_256, ST_FA2 = "ST encode, batch 32", "ST encode, batch 256", "ST encode flash_attention_2, batch 256"
ST_COMPILED_32 = "ST encode, model compiled, batch 32"
RAG_ST_GRAPHED_32 = "ragged graphed ST encode, batch 32"
RAG_DATA, RAG_SORTED = "ragged, data order", "ragged, sorted"
RAG_BUDGET_DATA, RAG_BUDGET_SORTED = "ragged, data order, token budget", "ragged, sorted, token budget"
RAG_ST_32, RAG_ST_256 = "ragged ST encode, batch 32", "ragged ST encode, batch 256"
HF_PADDED, HF_FA2, RAGGED = "HF SDPA, padded", "HF flash_attention_2, flattened", "ragged"
RAG_GRAPHED_DATA, RAG_GRAPHED_SORTED = "ragged graphed, data order", "ragged graphed, sorted"
RAG_ST_GRAPHED = "ragged graphed ST encode, batch 256"
RAG_EMBED_FILE = "ragged.embed path (JSONL in, .npy out)"
RAG_GRAPHED_TRAIN = "ragged graphed"
HF_DATA_8, RAG_DATA_8, RAG_GRAPHED_8 = (
    "HF SDPA, data order, batch 8",
    "ragged, data order, batch 8",
    "ragged graphed, data order, batch 8",
)
_B, _R = "baseline", "ragged"
ROWS = {
    EMBEDDING: (
        (HF_DATA, _B),
        (HF_SORTED, _B),
        (HF_COMPILED, _B),
        (ST_32, _B),
        (ST_256, _B),
        (ST_FA2, _B),
        (RAG_DATA, _R),
        (RAG_SORTED, _R),
        (RAG_BUDGET_DATA, _R),
        (RAG_BUDGET_SORTED, _R),
        (RAG_ST_32, _R),
        (RAG_ST_256, _R),
        (RAG_GRAPHED_DATA, _R),
        (RAG_GRAPHED_SORTED, _R),
        (HF_DATA_8, _B),
        (RAG_DATA_8, _R),
        (RAG_GRAPHED_8, _R),
        (RAG_ST_GRAPHED, _R),
        (RAG_EMBED_FILE, _R),
    ),
    FINE_TUNE: ((HF_PADDED, _B), (RAGGED, _R), (RAG_GRAPHED_TRAIN, _R)),
    CAUSAL_LM: ((HF_PADDED, _B), (HF_FA2, _B), (RAGGED, _R)),
    MODERN: (
        (HF_DATA, _B),
        (HF_SORTED, _B),
        (HF_COMPILED, _B),
        (RAG_DATA, _R),
        (RAG_SORTED, _R),
        (RAG_GRAPHED_DATA, _R),
    ),
    MPNET: (
        (HF_EAGER_DATA, _B),
        (HF_EAGER_SORTED, _B),
        (HF_EAGER_COMPILED, _B),
        (ST_32, _B),
        (ST_256, _B),
        (RAG_DATA, _R),
        (RAG_SORTED, _R),
        (RAG_GRAPHED_DATA, _R),
        (RAG_GRAPHED_SORTED, _R),
        (RAG_ST_32, _R),
        (RAG_ST_256, _R),
        (RAG_ST_GRAPHED, _R),
    ),
    DECODER: (
        (ST_32, _B),
        (ST_COMPILED_32, _B),
        (ST_256, _B),
        (RAG_ST_32, _R),
        (RAG_ST_GRAPHED_32, _R),
        (RAG_ST_256, _R),
    ),
}

# The baselines each ragged row does the same work as (``Impl.versus``: its speedups are over these
# only): the same batches of tokenized texts (batch 8 beside batch 8), or texts in through
# sentence-transformers at the same ``batch_size``. A row not named here does the same work as
# every baseline of its case.
_TOKENIZED, _EAGER = (HF_DATA, HF_SORTED, HF_COMPILED), (HF_EAGER_DATA, HF_EAGER_SORTED, HF_EAGER_COMPILED)
VERSUS = {
    EMBEDDING: {
        **dict.fromkeys(
            (RAG_DATA, RAG_SORTED, RAG_BUDGET_DATA, RAG_BUDGET_SORTED, RAG_GRAPHED_DATA, RAG_GRAPHED_SORTED), _TOKENIZED
        ),
        **dict.fromkeys((RAG_DATA_8, RAG_GRAPHED_8), (HF_DATA_8,)),
        RAG_ST_32: (ST_32,),
        RAG_ST_256: (ST_256, ST_FA2),
        RAG_ST_GRAPHED: (ST_256, ST_FA2),
        RAG_EMBED_FILE: (ST_32, ST_256, ST_FA2),
    },
    MPNET: {
        **dict.fromkeys((RAG_DATA, RAG_SORTED, RAG_GRAPHED_DATA, RAG_GRAPHED_SORTED), _EAGER),
        RAG_ST_32: (ST_32,),
        RAG_ST_256: (ST_256,),
        RAG_ST_GRAPHED: (ST_256,),
    },
    DECODER: {RAG_ST_32: (ST_32, ST_COMPILED_32), RAG_ST_GRAPHED_32: (ST_32, ST_COMPILED_32), RAG_ST_256: (ST_256,)},
}

# Extra columns.
COSINE, TEXTS_S, TOKENS_S, STEP_MS = "min cosine vs fp32", "texts/s", "tokens/s", "ms/step"
LOSS_DIFF, LOSS_VS_HF, PEAK, TARGETS = "loss diff vs fp32", "max loss diff vs HF", "peak GiB", "targets"

# GPU targets printed beside the rows (reported, never asserted): (ragged row, baseline row, speedup).
TARGETS_BY_WORKLOAD = {
    EMBEDDING: (
        (RAG_SORTED, HF_SORTED, 2.5),
        (RAG_DATA, HF_DATA, 4.0),
        (RAG_SORTED, HF_COMPILED, 1.25),
        (RAG_BUDGET_SORTED, ST_32, 10.0),
        (RAG_ST_32, ST_32, 10.0),
        (RAG_ST_256, ST_32, 10.0),
        (RAG_ST_256, ST_256, 4.0),
        (RAG_ST_32, RAG_GRAPHED_DATA, 0.6),
        (RAG_EMBED_FILE, RAG_ST_32, 0.9),
        (RAG_GRAPHED_DATA, HF_COMPILED, 2.0),
        (RAG_GRAPHED_8, HF_DATA_8, 2.0),
    ),
    FINE_TUNE: ((RAGGED, HF_PADDED, 2.5), (RAG_GRAPHED_TRAIN, HF_PADDED, 3.0)),
    CAUSAL_LM: ((RAGGED, HF_PADDED, 2.0),),
    MODERN: ((RAG_DATA, HF_DATA, 3.0),),
    MPNET: (
        (RAG_DATA, HF_EAGER_DATA, 3.0),
        (RAG_SORTED, HF_EAGER_COMPILED, 1.5),
        (RAG_GRAPHED_DATA, HF_EAGER_COMPILED, 2.0),
    ),
    DECODER: ((RAG_ST_32, ST_32, 3.0), (RAG_ST_32, ST_COMPILED_32, 1.5), (RAG_ST_GRAPHED_32, ST_COMPILED_32, 2.0)),
}
COSINE_TARGET = 0.9999

# Gates (a row failing one is marked failed and not timed), loose in half precision: the
# columns report the exact errors. Embeddings: 1 - min cosine <= max(floor, SLACK x HF's own);
# training: |step-1 loss - float32's| <= max(floor x max(1, |loss|), SLACK x HF's own).
SLACK = 3.0
COSINE_FLOOR, LOSS_FLOOR = {torch.float32: 1e-6}, {torch.float32: 1e-4}  # half types: 1e-3, 2e-2


@dataclasses.dataclass(frozen=True)
class Bert:
    layers: int
    hidden: int
    heads: int
    ff: int
    vocab: int = 30522
    init: float = 0.02  # initializer_range (HuggingFace's default)

    def name(self) -> str:
        return f"BERT {self.layers}x{self.hidden} h={self.heads} ff={self.ff}"

    def config(self, **kw):
        from transformers import BertConfig

        return BertConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            intermediate_size=self.ff,
            initializer_range=self.init,
            **kw,
        )


@dataclasses.dataclass(frozen=True)
class ModernBert:
    layers: int
    hidden: int
    heads: int
    ff: int
    vocab: int = 50368
    local: int = 128  # local_attention: the window of the local layers, both sides together
    every: int = 3  # global_attn_every_n_layers
    init: float = 0.02
    model_class = "ModernBertModel"
    attention = "sdpa"

    def name(self) -> str:
        return f"ModernBERT {self.layers}x{self.hidden} h={self.heads} ff={self.ff} window={self.local}"

    def config(self, **kw):
        from transformers import ModernBertConfig

        return ModernBertConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            intermediate_size=self.ff,
            local_attention=self.local,
            global_attn_every_n_layers=self.every,
            initializer_range=self.init,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=3,
            cls_token_id=2,
            sep_token_id=3,
            **kw,
        )


@dataclasses.dataclass(frozen=True)
class MPNet:
    layers: int
    hidden: int
    heads: int
    ff: int
    vocab: int = 30527
    init: float = 0.02
    model_class = "MPNetModel"
    attention = "eager"  # HuggingFace's MPNet has no SDPA path

    def name(self) -> str:
        return f"MPNet {self.layers}x{self.hidden} h={self.heads} ff={self.ff}"

    def config(self, **kw):
        from transformers import MPNetConfig

        return MPNetConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            intermediate_size=self.ff,
            initializer_range=self.init,
            **kw,
        )


@dataclasses.dataclass(frozen=True)
class Llama:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ff: int
    vocab: int = 32000
    init: float = 0.02

    def name(self) -> str:
        return (
            f"Llama {self.layers}x{self.hidden} h={self.heads} kv={self.kv_heads} ff={self.ff} "
            f"({self.params() / 1e6:.0f}M)"
        )

    def matmul_params(self) -> int:
        """Matmul weights a token meets: q/k/v/o and the gated MLP of every layer, the LM head."""
        kv = self.kv_heads * (self.hidden // self.heads)
        per_layer = 2 * self.hidden * (self.hidden + kv) + 3 * self.hidden * self.ff
        return self.layers * per_layer + self.hidden * self.vocab

    def params(self) -> int:
        return self.matmul_params() + self.vocab * self.hidden + (2 * self.layers + 1) * self.hidden

    def config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.ff,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            attention_dropout=0.0,
            initializer_range=self.init,
        )


@dataclasses.dataclass(frozen=True)
class Qwen3:
    """A Qwen3 decoder as Qwen3-Embedding uses it (its 0.6B: 28 x 1024, 16 query and 8 key/value
    heads of 128, tied embeddings)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ff: int
    head_dim: int = 128
    vocab: int = 151669
    init: float = 0.02
    model_class = "Qwen3Model"

    def params(self) -> int:
        kv, q = self.kv_heads * self.head_dim, self.heads * self.head_dim
        per_layer = self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.ff + 2 * self.hidden
        return self.layers * per_layer + self.vocab * self.hidden + self.hidden

    def name(self) -> str:
        return (
            f"Qwen3 {self.layers}x{self.hidden} h={self.heads} kv={self.kv_heads} ff={self.ff} "
            f"({self.params() / 1e6:.0f}M)"
        )

    def config(self, **kw):
        from transformers import Qwen3Config

        return Qwen3Config(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.ff,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            initializer_range=self.init,
            pad_token_id=0,
            eos_token_id=0,
            bos_token_id=0,
            **kw,
        )


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Token lengths ``round(lognormal(log(median), sigma))`` clipped to ``[lo, hi]``, seeded."""

    lo: int
    hi: int
    median: float
    sigma: float

    def draw(self, n: int, seed: int = SEED) -> list[int]:
        x = np.random.default_rng(seed).lognormal(math.log(self.median), self.sigma, n)
        return np.clip(np.rint(x), self.lo, self.hi).astype(int).tolist()

    def text(self) -> str:
        return f"lognormal(median {self.median:g}, sigma {self.sigma:g}) in {self.lo}..{self.hi}"


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The first texts of :mod:`bench.corpus` (real prose, no download) as a workload's texts,
    tokenized by a tokenizer trained on the corpus (``kind``: ``"wordpiece"`` or ``"byte_bpe"``)
    of at most ``vocab`` ids. ``draw(n)``: the token lengths of the first ``n`` texts."""

    vocab: int
    kind: str = "wordpiece"

    def tokenizer(self):
        from .. import corpus

        return getattr(corpus, self.kind)(self.vocab)

    def texts(self, n: int) -> list[str]:
        from .. import corpus

        return corpus.texts(n)

    def draw(self, n: int, seed: int = SEED) -> list[int]:
        return [len(ids) for ids in self.tokenizer()(self.texts(n), truncation=True)["input_ids"]]

    def text(self) -> str:
        from .. import corpus

        return f"{corpus.describe()}, {self.kind} tokenizer trained on it ({len(self.tokenizer())} ids)"


@dataclasses.dataclass(frozen=True)
class Shape:
    """A case. ``count``: texts (embedding), sequences per step (fine-tune) or tokens per step (LM);
    ``batch``: texts per batch (embedding); ``steps``: training steps per timed call."""

    workload: str
    label: str
    dtype: torch.dtype
    model: Any  # Bert | ModernBert | MPNet | Llama | Qwen3
    lengths: Lengths | Corpus
    count: int
    batch: int = 0
    steps: int = 1


# The tiny CPU models start from larger weights, so that the fp32 gates see every layer (with
# std 0.02 a tiny model's logits stay near 0 whatever its layers compute).
MINILM, BERT_BASE, TINY_BERT = Bert(6, 384, 12, 1536), Bert(12, 768, 12, 3072), Bert(2, 32, 2, 64, 1000, init=0.2)
MODERNBERT_BASE, TINY_MODERNBERT = ModernBert(22, 768, 12, 1152), ModernBert(3, 32, 2, 48, 1000, local=16, init=0.2)
LONG_TAILED = Lengths(16, 1024, 128, 1.0)
MPNET_BASE, TINY_MPNET = MPNet(12, 768, 12, 3072), MPNet(2, 32, 2, 64, 1000, init=0.2)
LLAMA_05B, TINY_LLAMA = Llama(24, 1280, 20, 4, 3456), Llama(2, 64, 4, 2, 128, vocab=256, init=0.2)
QWEN3_06B, TINY_QWEN3 = Qwen3(28, 1024, 16, 8, 3072), Qwen3(2, 64, 4, 2, 128, head_dim=16, vocab=1000, init=0.2)
SENTENCES = Lengths(3, 256, 25, 0.8)
GPU_SHAPES = (
    Shape(EMBEDDING, "MiniLM-size", torch.bfloat16, MINILM, SENTENCES, 15000, batch=256),
    Shape(EMBEDDING, "BERT-base-size", torch.bfloat16, BERT_BASE, SENTENCES, 15000, batch=256),
    Shape(FINE_TUNE, "BERT-base-size", torch.bfloat16, BERT_BASE, Lengths(16, 512, 96, 1.0), 32, steps=8),
    Shape(CAUSAL_LM, "Llama-style ~0.5B", torch.bfloat16, LLAMA_05B, Lengths(32, 2048, 256, 1.0), 8192, steps=4),
    Shape(MODERN, "ModernBERT-base-size", torch.bfloat16, MODERNBERT_BASE, LONG_TAILED, 2048, batch=32),
    Shape(MPNET, "MPNet-base-size", torch.bfloat16, MPNET_BASE, Corpus(MPNET_BASE.vocab), 12000, batch=256),
    Shape(DECODER, "Qwen3-Embedding-0.6B-size", torch.bfloat16, QWEN3_06B, Corpus(32000, "byte_bpe"), 4096, batch=32),
)
GPU_QUICK_SHAPES = (
    dataclasses.replace(GPU_SHAPES[0], count=3000),
    dataclasses.replace(GPU_SHAPES[2], steps=4),
    dataclasses.replace(GPU_SHAPES[3], steps=2),
    dataclasses.replace(GPU_SHAPES[4], count=512),
    dataclasses.replace(GPU_SHAPES[5], count=3000),
    dataclasses.replace(GPU_SHAPES[6], count=1024),
)
CPU_SHAPES = (
    Shape(EMBEDDING, "tiny", torch.float32, TINY_BERT, Lengths(3, 40, 10, 0.8), 48, batch=16),
    Shape(FINE_TUNE, "tiny", torch.float32, TINY_BERT, Lengths(4, 48, 12, 0.8), 4, steps=2),
    Shape(CAUSAL_LM, "tiny", torch.float32, TINY_LLAMA, Lengths(4, 64, 16, 0.8), 128, steps=2),
    Shape(MODERN, "tiny", torch.float32, TINY_MODERNBERT, Lengths(4, 48, 12, 0.8), 32, batch=8),
    Shape(MPNET, "tiny", torch.float32, TINY_MPNET, Corpus(TINY_MPNET.vocab), 48, batch=16),
    Shape(DECODER, "tiny", torch.float32, TINY_QWEN3, Corpus(TINY_QWEN3.vocab, "byte_bpe"), 40, batch=8),
)


def checkpoint_model(path: str) -> str:
    """The model of a checkpoint folder as its ``config.json`` describes it (read as JSON)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
        return Bert(c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["intermediate_size"]).name()
    except (OSError, ValueError, KeyError, TypeError):
        return "the checkpoint's"


def case_lengths(shape: Shape) -> list[list[int]]:
    """The lengths of a case: one list (embedding), or one per training step (LM: seeded lengths cut
    in order at the token budget by ``ragged.data.TokenBudgetSampler``)."""
    if shape.workload in (EMBEDDING, *EMBEDDERS):
        return [shape.lengths.draw(shape.count)]
    if shape.workload == FINE_TUNE:
        flat = shape.lengths.draw(shape.count * shape.steps)
        return [flat[i * shape.count : (i + 1) * shape.count] for i in range(shape.steps)]
    from ragged.data import TokenBudgetSampler

    pool = shape.lengths.draw(shape.steps * max(2, shape.count // shape.lengths.lo) + 1)
    cuts = list(TokenBudgetSampler(pool, shape.count, shuffle=False))[: shape.steps]
    return [[pool[i] for i in batch] for batch in cuts]


def lm_flops(batches: list[list[int]], m: Llama) -> int:
    """Useful flops of the training steps: 3 x (2 x tokens x matmul weights + causal attention,
    ``2 * L^2 * hidden`` per layer and sequence)."""
    squares = sum(n * n for b in batches for n in b)
    return 3 * (2 * sum(map(sum, batches)) * m.matmul_params() + 2 * m.layers * m.hidden * squares)


# --------------------------------------------------------------------------------------
# Helpers


@contextlib.contextmanager
def quiet():
    """transformers' and sentence-transformers' load reports, progress bars and warnings off."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    st_logger = logging.getLogger("sentence_transformers")
    st_level = st_logger.level
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    st_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
        st_logger.setLevel(st_level)


def attempt(what: str, make: Callable[[], Any]) -> tuple[Any, str | None]:
    """``(make(), None)``, or ``(None, why)`` when it raised: the rows that need it then say why."""
    try:
        return make(), None
    except Exception as exc:  # noqa: BLE001  (any failure of one row's setup is that row's result)
        return None, f"{what}: {type(exc).__name__}: {str(exc).strip()[:300]}"


def broken(reason: str) -> Callable[[], Any]:
    """A row whose setup failed: raising, it is marked skipped (baseline) or failed (ragged)."""

    def fn():
        raise RuntimeError(reason)

    return fn


GRAPHS_ON_CUDA = "CUDA graphs: runs on CUDA"


def graphed_row(model: Any, error: str | None, device: torch.device, make: Callable[[Any], Callable[[], Any]]):
    """A row that replays CUDA graphs of ``model``: ``Run(make(model))``; broken when the conversion
    failed (``model`` None, ``error`` why), skipped off CUDA."""
    if model is None:
        return broken(error or "the model could not be converted")
    if device.type != "cuda":
        return GRAPHS_ON_CUDA
    return Run(make(model))


def flash_attention_skip(device: torch.device) -> str | None:
    """Why the flash_attention_2 rows do not run here (checked before any load: transformers would
    otherwise look for the kernels on the network)."""
    if device.type != "cuda":
        return "flash-attention runs on CUDA only"
    return None if importlib.util.find_spec("flash_attn") else "the flash_attn package is not installed"


def assemble(workload: str, fns: dict[str, Any]) -> list[Impl]:
    """The workload's rows in order: ``fns[name]`` a callable, or a string (the reason to skip);
    each ragged row compared with the baselines of :data:`VERSUS`."""
    versus = VERSUS.get(workload, {})
    return [
        Impl(name, kind, skip=fns[name], versus=versus.get(name))
        if isinstance(fns[name], str)
        else Impl(name, kind, fns[name], versus=versus.get(name))
        for name, kind in ROWS[workload]
    ]


class Run:
    """A row's callable. Its first call (the harness's correctness check) runs ``check`` and keeps
    the output in ``first``; every later call runs ``step``."""

    def __init__(self, step: Callable[[], Any], check: Callable[[], Any] | None = None):
        self.step, self.check, self.first, self.checked = step, check or step, None, False

    def __call__(self) -> Any:
        if self.checked:
            return self.step()
        self.checked = True
        self.first = self.check()
        return self.first


def pad_batch(seqs: list, keys: tuple[str, ...], pad_id: int, labels: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded ``[B, M]`` int64 tensors of ``keys`` (``seqs``: dicts of id arrays or lists) and
    their ``attention_mask``; ``labels``: the ids with -100 at padding (causal LM)."""
    lengths = [len(s[keys[0]]) for s in seqs]
    B, M = len(seqs), max(lengths, default=0)
    out = {k: np.full((B, M), pad_id if k == "input_ids" else 0, dtype=np.int64) for k in keys}
    out["attention_mask"] = mask = np.zeros((B, M), dtype=np.int64)
    for r, (s, n) in enumerate(zip(seqs, lengths)):
        for k in keys:
            out[k][r, :n] = s[k]
        mask[r, :n] = 1
    if labels:
        out["labels"] = np.where(mask == 1, out["input_ids"], -100)
    return {k: torch.from_numpy(v) for k, v in out.items()}


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def min_cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Smallest cosine similarity between a row of ``out`` and the same row of ``ref`` (in float64,
    on ``ref``'s device: a path may return its rows on the host)."""
    return float(F.cosine_similarity(out.to(ref.device, torch.float64), ref.double(), dim=1).min())


def train_steps(model, opt, batches: list, make: Callable[[Any], dict], call=None) -> torch.Tensor:
    """One optimizer step per batch (``call(**make(batch)).loss``, ``call`` the model unless
    given); the losses ``[steps]``."""
    losses = []
    call = model if call is None else call
    for b in batches:
        loss = call(**make(b)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


def training_run(model, device: torch.device, batches: list, make: Callable[[Any], dict], call=None) -> Run:
    """A training row: its own AdamW (lr 1e-5, fused on CUDA); the check call runs the steps in eval
    mode (no dropout), later calls in train mode. ``call``: what runs the model in train mode (its
    training graphs, say; the check call runs the model itself, as graphs of eval mode record no
    backward)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    def step():
        model.train()
        return train_steps(model, opt, batches, make, call)

    def check():
        with training_mode(model, False):
            return train_steps(model, opt, batches, make)

    return Run(step, check)


def training_workload(
    impls: list[Impl], reference: float, hf_error: float, dtype: torch.dtype, flops: int, device: torch.device
) -> Workload:
    """Gate: step 1's loss (before any update) against the float32 model's. Extra columns: that
    error, the ragged row's largest loss difference to the HF padded row over the check call's
    steps (same batches, same updates), peak memory (CUDA)."""
    bound = max(LOSS_FLOOR.get(dtype, 2e-2) * max(1.0, abs(reference)), SLACK * hf_error)
    hf_run = next(i.fn for i in impls if i.name == HF_PADDED)

    def compare(out: torch.Tensor, ref: float) -> str | None:
        err = abs(float(out[0]) - ref)
        return None if err <= bound else f"step-1 loss {float(out[0]):.6g} vs float32 {ref:.6g}: error {err:.3g}"

    def extra(impl: Impl) -> dict[str, Any]:
        out: dict[str, Any] = {}
        first = getattr(impl.fn, "first", None)
        if first is not None:
            out[LOSS_DIFF] = f"{abs(float(first[0]) - reference):.2e}"
            if impl.kind == "ragged" and isinstance(hf_run, Run) and hf_run.first is not None:
                out[LOSS_VS_HF] = f"{float((first.double() - hf_run.first.double()).abs().max()):.2e}"
        if device.type == "cuda":
            out[PEAK] = peak_memory_bytes(impl.fn, device) / 2**30
        return out

    return Workload(impls, reference=reference, flops=flops, compare=compare, extra=extra)


def cosine_checks(reference: torch.Tensor, bound: float):
    """``(compare, extra)`` of an embedding workload: a row passes when ``1 - min cosine`` against
    ``reference`` is at most ``bound``; its min cosine goes in the COSINE column (the row's first
    output, dropped once read)."""

    def compare(out: torch.Tensor, ref: torch.Tensor) -> str | None:
        if tuple(out.shape) != tuple(ref.shape):
            return f"embeddings of shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
        cos = min_cosine(out, ref)
        return None if 1.0 - cos <= bound else f"min cosine {cos:.6f} < {1 - bound:.6f}"  # NaN fails too

    def extra(impl: Impl) -> dict[str, Any]:
        first = getattr(impl.fn, "first", None)
        if first is None:
            return {}
        impl.fn.first = None  # [N, d]: not kept past the row
        return {COSINE: f"{min_cosine(first, reference):.6f}"}

    return compare, extra
