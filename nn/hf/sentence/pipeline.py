"""The overlapped ``encode`` of a converted SentenceTransformer (:mod:`ragged.nn.hf.sentence`).

sentence-transformers' ``encode`` runs one loop: sort the texts, then per batch tokenize, pad,
move, run the model and copy the result back. On a GPU the model is the short part (a MiniLM
batch of 256 texts: about 0.35 ms of kernels under about 2 ms of host work), and none of the
host work overlaps it. Here the same call runs as a pipeline:

* **Order.** The texts are sorted once by length in characters, longest first (as
  sentence-transformers sorts them), and go through the pipeline in that order, so that each
  batch holds texts of similar lengths and the largest batches come first.
* **Tokenization** in a background thread, in chunks of the sorted order: the Transformer's own
  ``preprocess`` (prompt, truncation, special tokens as the original) without padding, the ids
  flattened to one array per chunk (a fast tokenizer's read straight into arrays,
  :mod:`ragged.nn.hf.sentence.tokens`). A fast tokenizer spreads a batch over the cores and
  releases the interpreter while it works, so the chunks after the current one are being
  tokenized while its batches run. Calls take the converted preprocess's lock (the tokenizer
  keeps its padding setting in shared state; a copy per thread would cost tens of milliseconds
  per call to make and could miss later changes to the original).
* **Batches by token budget.** Consecutive texts of the sorted order fill a batch up to
  ``max_tokens`` real tokens (a longer text alone) and ``max_batch`` texts, the rules of
  :class:`ragged.data.TokenBudgetSampler`; with packed batches nothing is padded, so the count
  of texts per batch (``batch_size``) does not matter to the GPU. Under a left-padding
  tokenizer a text's positions are the padded batch's columns (HuggingFace's numbers for a
  left-padded batch without position ids): an encoder's absolute position embeddings then make
  a text's result depend on its batch, and so do ``weightedmean``'s weights before
  sentence-transformers 6.2, so the batches are sentence-transformers' own, the same texts in
  the same batches as the original's ``encode`` (the pipeline's graphs are not used: those
  batches are not sized by tokens). A decoder's rotary positions enter attention only as
  differences within a sequence, so a decoder takes token-budget batches there too, each text
  at positions from 0: what the original gives for each text alone (``batch_size=1``); the
  original's own padded batches move its results by float32's rounding of the rotary angles
  (HuggingFace computes them in float32), about 1e-7 relative.
* **One pinned transfer per tensor of a batch**, without blocking, then the model: replayed
  from CUDA graphs (:func:`ragged.nn.graphed` of the model, kept with the converted ``encode``
  for later calls, one set per device and budget) where ``encode`` runs on a GPU, or the
  model's own graphs when :func:`ragged.nn.graphed` was called on it (the batches then sized
  to its largest bucket).
* **Results** go into one preallocated ``[N, d]`` tensor on the device, at their texts' places
  in the input order (``index_copy_``): nothing is read back until the whole call is done.

The host never waits on the GPU inside the loop, so the host work of the next batches (packing,
launching) runs while the GPU computes the current one. What ``encode`` returns is unchanged:
order, dtype, ``normalize_embeddings``, ``truncate_dim``, ``precision``, ``convert_to_numpy`` /
``convert_to_tensor``, prompts, a single text. Calls the pipeline does not take run
sentence-transformers' own loop (:func:`reason`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from ragged import RaggedTensor
from ragged.padding import PaddedLayout

from ...graphed import CaptureError, Graphed
from ...layer_spec import frozen_weights
from .batch import INPUT_KEY, UNPADDED, PackedInput, unpadded_side
from .tokens import Flat, flat_ids

__all__ = ["DEFAULT_MAX_TOKENS", "MAX_BATCH", "PackedRunner", "Pipeline", "embed", "reason"]

DEFAULT_MAX_TOKENS = 16384  # real tokens per batch
MAX_BATCH = 1024  # texts per batch
_CHUNK_TOKENS = 4 * DEFAULT_MAX_TOKENS  # roughly, tokens per tokenization chunk (by characters / 4)


@dataclasses.dataclass
class Pipeline:
    """The pipeline settings of one converted ``encode`` (``st.encode.pipeline``):

    * ``enabled``: ``"auto"`` (on CUDA devices), True (on every device, the CPU included), or
      False (sentence-transformers' own loop);
    * ``max_tokens``: real tokens per batch (default 16384), ``max_batch``: texts per batch;
    * ``graphs``: replay the model from CUDA graphs on a GPU (kept in ``cache`` per device and
      budget; :meth:`reset` drops them);
    * ``workers``: tokenization threads (chunks tokenized ahead of the one running; the calls
      themselves take turns on the tokenizer).

    On a GPU one pipelined call runs at a time per model (``running``): a graph is captured on
    first use, and a capture fails if another thread runs GPU work meanwhile.
    """

    enabled: Any = "auto"
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_batch: int = MAX_BATCH
    graphs: bool = True
    workers: int = 1
    cache: dict = dataclasses.field(default_factory=dict, repr=False)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
    running: threading.RLock = dataclasses.field(default_factory=threading.RLock, repr=False)

    def reset(self) -> None:
        """Drop the graphs kept for later calls (after moving or replacing the model's parameters)."""
        with self.lock:
            self.cache.clear()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("cache", "lock", "running")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.cache, self.lock, self.running = {}, threading.Lock(), threading.RLock()

    def __deepcopy__(self, memo) -> Pipeline:  # settings only: graphs are of the model copied
        return Pipeline(self.enabled, self.max_tokens, self.max_batch, self.graphs, self.workers)


_PIPELINE_ARGS = frozenset(
    {
        "inputs",
        "prompt_name",
        "prompt",
        "batch_size",
        "show_progress_bar",
        "output_value",
        "precision",
        "convert_to_numpy",
        "convert_to_tensor",
        "device",
        "normalize_embeddings",
        "truncate_dim",
    }
)


def reason(model: nn.Module, forward, settings: Pipeline, arguments: dict) -> str | None:
    """Why the pipeline does not take this ``encode`` call (``arguments``: its bound arguments,
    the model excluded); None when it does."""
    if settings.enabled is False:
        return "the pipeline is off"
    extra = set(arguments) - _PIPELINE_ARGS
    for name in ("pool", "chunk_size"):  # sentence-transformers' multi-process encode
        if arguments.get(name) is None:
            extra.discard(name)
    if arguments.get("kwargs"):
        extra.add("kwargs")
    else:
        extra.discard("kwargs")
    if extra:
        return f"arguments {sorted(extra)}"
    batch_size, precision = arguments.get("batch_size", 32), arguments.get("precision", "float32")
    if (
        not isinstance(batch_size, int)
        or isinstance(batch_size, bool)
        or batch_size <= 0
        or precision not in (None, "float32", "int8", "uint8", "binary", "ubinary")
    ):
        return "arguments sentence-transformers refuses (its encode says why)"
    if arguments.get("output_value", "sentence_embedding") != "sentence_embedding":
        return "output_value other than 'sentence_embedding'"
    device = arguments.get("device")
    if isinstance(device, (list, tuple)):
        return "several devices (sentence-transformers' processes)"
    inputs = arguments.get("inputs")
    texts = [inputs] if isinstance(inputs, str) else inputs
    if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(t, str) for t in texts):
        return "inputs other than a non-empty list of strings"
    if not hasattr(model, "_resolve_prompt"):
        return "this sentence-transformers version"
    if forward.pad_token_embeddings or unpadded_side(model[0], {}) is None:
        return "a module on padded token embeddings, or a tokenizer set up to pad its own way"
    try:
        where = torch.device(model.device if device is None else device)
    except (TypeError, RuntimeError):
        return "the device"
    if settings.enabled == "auto" and where.type != "cuda":
        return "not on a CUDA device (set st.encode.pipeline.enabled = True to use it there)"
    return None


def _tokenize(module: nn.Module, lock: threading.Lock, texts: list[str], prompt: str | None):
    """(lengths [n] int64, ids [sum] int64, token types or None, the other features) of
    ``texts`` tokenized without padding by the Transformer's own preprocess. ``lock``: the
    converted preprocess's (a fast tokenizer keeps its padding setting in shared state, which
    every call sets); the tokenizer itself spreads a batch over the cores."""
    with lock, flat_ids(module):
        features = type(module).preprocess(module, texts, prompt=prompt, processing_kwargs={"common": dict(UNPADDED)})
    ids = features.pop("input_ids")
    types = features.pop("token_type_ids", None)
    features.pop("attention_mask", None)
    if isinstance(ids, Flat):  # a fast tokenizer's ids, read straight into arrays
        return ids.lengths, ids.ids, ids.types, features
    lengths = np.fromiter((len(r) for r in ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
    if isinstance(types, list) and len(types) == len(ids):
        types = np.fromiter(itertools.chain.from_iterable(types), dtype=np.int64, count=flat.size)
        types = types if types.size == flat.size else None
    else:
        types = None
    return lengths, flat, types, features


def _weights_by_column(model: nn.Module) -> bool:
    """Whether a Pooling of ``model`` weighs tokens by their column in the padded batch
    (``weightedmean`` before sentence-transformers 6.2)."""
    modes = [m.pooling_mode for m in model if isinstance(getattr(m, "pooling_mode", None), (str, tuple, list))]
    if not any("weightedmean" in ((mode,) if isinstance(mode, str) else mode) for mode in modes):
        return False
    from .pooling import weightedmean_origin

    return weightedmean_origin() != "sequence"


def _chunks(order: np.ndarray, chars: np.ndarray) -> list[np.ndarray]:
    """The sorted order cut into tokenization chunks of about ``_CHUNK_TOKENS`` tokens (4
    characters a token), the first smaller so that the GPU starts early."""
    out, start, goal = [], 0, _CHUNK_TOKENS // 8
    cum = np.cumsum(chars[order] // 4 + 2)
    while start < order.size:
        base = cum[start - 1] if start else 0
        end = max(start + 1, int(np.searchsorted(cum, base + goal, side="right")))
        out.append(order[start:end])
        start, goal = end, _CHUNK_TOKENS
    return out


def _budget_batches(lengths: np.ndarray, max_tokens: int, max_batch: int) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive texts: at most ``max_tokens`` tokens (a longer text
    alone) and ``max_batch`` texts each."""
    out, start, n = [], 0, lengths.size
    cum = np.concatenate(([0], np.cumsum(lengths)))
    while start < n:
        end = int(np.searchsorted(cum, cum[start] + max_tokens, side="right")) - 1
        end = min(max(end, start + 1), start + max_batch, n)
        out.append((start, end))
        start = end
    return out


def _packed(
    lengths: np.ndarray, flat: np.ndarray, types, starts: np.ndarray, rows: np.ndarray, side: str, columns: bool
) -> PackedInput:
    """The PackedInput of texts ``rows`` of a chunk (``starts``: each text's first id in ``flat``)."""
    n = lengths[rows]
    total = int(n.sum())
    first = np.repeat(starts[rows] - (np.cumsum(n) - n), n)
    take = np.arange(total, dtype=np.int64) + first
    rt = RaggedTensor.from_lengths(torch.from_numpy(flat[take]), n)
    positions = None
    if side == "left" and columns and total:
        begin = np.repeat(np.cumsum(n) - n, n)
        positions = torch.from_numpy(np.arange(total, dtype=np.int64) - begin + np.repeat(rt.max_len - n, n))
    return PackedInput(
        rt, None if types is None else torch.from_numpy(types[take]), positions, PaddedLayout(rt.max_len, side)
    )


def _graphs(settings: Pipeline, target: Callable[[], nn.Module], device: torch.device):
    """The pipeline's graphs of the model on ``device`` (made on first use)."""
    module = target()
    # graphs hold the addresses of the parameters: a model moved or cast since (encode(device=...)
    # moves it) gets new graphs, never a replay reading freed memory
    stamp = tuple(t.data_ptr() for t in itertools.chain(module.parameters(), module.buffers()))
    key = (str(device), settings.max_tokens, settings.max_batch)
    with settings.lock:
        held = settings.cache.get(key)
        if held is None or held[0] != stamp:
            settings.cache.clear()  # graphs of the old parameters: their memory pools go too
            # one token over the budget: a full batch with spare sequences keeps a spare row
            held = settings.cache[key] = (stamp, Graphed(module, settings.max_tokens + 1, settings.max_batch))
    return held[1]


def _embed(model, features: dict, forward, encoding: Callable, graphed, settings: Pipeline, frozen: dict):
    """``(sentence embeddings of one batch, the graphs for the next)``; the weights do not change
    meanwhile (``frozen``: the cache of :func:`ragged.nn.layer_spec.frozen_weights`). A model
    whose forward cannot be captured in a CUDA graph (a :class:`~ragged.nn.CaptureError`: say,
    an attention no GPU kernel takes, whose reference reads the lengths on the host) runs eagerly
    from then on: ``settings.graphs`` is turned off, with a warning naming the cause."""
    try:
        # a copy: the forward takes its inputs out of the dict it is given, and a failed capture
        # must leave them for the eager run below
        with torch.no_grad(), frozen_weights(frozen), encoding(forward, "sentence", graphed):
            return model(dict(features))["sentence_embedding"], graphed
    except CaptureError as e:
        if graphed is None:
            raise
        with settings.lock:
            settings.graphs = False
            settings.cache.clear()
        warnings.warn(
            f"encode: CUDA graphs are turned off for this model (st.encode.pipeline.graphs = False); its "
            f"batches run eagerly: {e.__cause__ or e}",
            RuntimeWarning,
            stacklevel=3,
        )
    with torch.no_grad(), frozen_weights(frozen), encoding(forward, "sentence", None):
        return model(features)["sentence_embedding"], None


def run(
    model: nn.Module,
    forward,
    settings: Pipeline,
    arguments: dict,
    target: Callable[[], nn.Module],
    encoding: Callable,
    on_batch: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """``[N, d]`` sentence embeddings of ``arguments["inputs"]`` (before ``truncate_dim`` and
    normalisation), on the device, in the input order. ``target()``: what the graphs capture;
    ``encoding``: :func:`ragged.nn.hf.sentence.encoding`."""
    device = torch.device(model.device if arguments.get("device") is None else arguments["device"])
    if device.type != "cuda":
        return _run(model, forward, settings, arguments, target, encoding, on_batch)
    with settings.running:
        return _run(model, forward, settings, arguments, target, encoding, on_batch)


def _run(model, forward, settings, arguments, target, encoding, on_batch):
    inputs = arguments["inputs"]
    texts = [inputs] if isinstance(inputs, str) else list(inputs)
    prompt = model._resolve_prompt(arguments.get("prompt"), arguments.get("prompt_name"))
    device = torch.device(model.device if arguments.get("device") is None else arguments["device"])
    model.to(device)
    model.eval()
    module = model[0]
    side = unpadded_side(module, {})
    own_batches = side == "left" and not (forward.decoder and not _weights_by_column(model))
    columns = own_batches and not forward.from_ids  # positions: the padded batch's columns, else from 0
    chars = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
    order = np.argsort(-chars)  # sentence-transformers' sort, so that its own batches are the same
    if own_batches and getattr(model, "_can_flatten_inputs", lambda: False)():
        order = np.asarray(model._interleave_sorted_indices(order))
    batch_size = int(arguments.get("batch_size", 32))
    chunks = (
        [order[i : i + batch_size * 64] for i in range(0, order.size, batch_size * 64)]
        if own_batches
        else _chunks(order, chars)
    )
    graphed, max_tokens, max_batch = None, settings.max_tokens, settings.max_batch
    if forward.graphed is not None:  # the model's own graphs (ragged.nn.graphed): batches they take
        max_tokens = min(max_tokens, forward.graphed.max_tokens - 1)  # a spare row for spare sequences
        max_batch = min(max_batch, forward.graphed.max_batch_size)
    elif device.type == "cuda" and settings.graphs and not own_batches:
        graphed = _graphs(settings, target, device)
    bar = _progress(arguments.get("show_progress_bar"), len(texts))
    frozen: dict = {}  # the fused projections' weights, concatenated once for this call
    out = None
    lock = getattr(module.__dict__.get("preprocess"), "lock", None) or threading.Lock()
    workers = max(1, min(settings.workers, os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ragged-tokenize") as pool:
        pending = [pool.submit(_tokenize, module, lock, [texts[i] for i in c], prompt) for c in chunks[: workers + 1]]
        try:
            for k, rows_in_input in enumerate(chunks):
                lengths, flat, types, extra = pending[k].result()
                if k + workers + 1 < len(chunks):
                    nxt = chunks[k + workers + 1]
                    pending.append(pool.submit(_tokenize, module, lock, [texts[i] for i in nxt], prompt))
                starts = np.cumsum(lengths) - lengths
                local_order = np.arange(lengths.size)
                runs = (
                    [(s, min(s + batch_size, lengths.size)) for s in range(0, lengths.size, batch_size)]
                    if own_batches
                    else _budget_batches(lengths, max_tokens, max_batch)
                )
                for s, e in runs:
                    rows = local_order[s:e]
                    packed = _packed(lengths, flat, types, starts, rows, side, columns)
                    features = {**extra, INPUT_KEY: packed}
                    emb, graphed = _embed(model, features, forward, encoding, graphed, settings, frozen)
                    if out is None:
                        out = torch.empty((len(texts), *emb.shape[1:]), dtype=emb.dtype, device=emb.device)
                    where = torch.from_numpy(rows_in_input[s:e].astype(np.int64))
                    if emb.is_cuda:
                        where = where.pin_memory().to(emb.device, non_blocking=True)
                    out.index_copy_(0, where, emb)
                    n_tok = int(lengths[s:e].sum())
                    if on_batch is not None:
                        on_batch(e - s, n_tok)
                    if bar is not None:
                        bar.update(e - s, n_tok)
        finally:
            for f in pending:
                f.cancel()
            if bar is not None:
                bar.close()
    return out


class _Bar:
    """A progress bar over texts, with texts/s and tokens/s."""

    def __init__(self, total: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="Embedding", unit="texts")
        self.tokens, self.start = 0, time.perf_counter()

    def update(self, texts: int, tokens: int) -> None:
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tokens/s", refresh=False)
        self.bar.update(texts)

    def close(self) -> None:
        self.bar.close()


def _progress(show: bool | None, total: int) -> _Bar | None:
    if show is None:
        import logging

        show = logging.getLogger("sentence_transformers").getEffectiveLevel() in (logging.INFO, logging.DEBUG)
    return _Bar(total) if show else None


def finish(model: nn.Module, out: torch.Tensor, arguments: dict, single: bool):
    """What sentence-transformers' ``encode`` returns for the embeddings ``out`` ``[N, d]``
    (input order): ``truncate_dim``, ``normalize_embeddings``, ``precision``,
    ``convert_to_numpy`` / ``convert_to_tensor``, a single text's row."""
    from sentence_transformers.util import quantize_embeddings, truncate_embeddings

    convert_to_tensor = bool(arguments.get("convert_to_tensor", False))
    convert_to_numpy = bool(arguments.get("convert_to_numpy", True)) and not convert_to_tensor
    truncate_dim = arguments.get("truncate_dim")
    truncate_dim = truncate_dim if truncate_dim is not None else model.truncate_dim
    precision = arguments.get("precision", "float32")
    if truncate_dim is not None:
        out = truncate_embeddings(out, truncate_dim)
    if arguments.get("normalize_embeddings", False):
        out = torch.nn.functional.normalize(out, p=2, dim=1)
    if convert_to_numpy:
        out = out.cpu()
    if precision and precision != "float32":
        rows = quantize_embeddings(list(out), precision=precision)
        if convert_to_tensor:
            result = torch.from_numpy(rows)
        elif convert_to_numpy:
            result = rows
        else:
            result = [torch.from_numpy(r) for r in rows]
    elif convert_to_tensor:
        result = out
    elif convert_to_numpy:
        result = (out.float() if out.dtype == torch.bfloat16 else out).numpy()
    else:
        result = list(out)
    return result[0] if single else result


def embed(
    st: nn.Module,
    texts: list[str],
    *,
    prompt: str | None = None,
    prompt_name: str | None = None,
    normalize: bool = False,
    max_tokens: int | None = None,
    batch_size: int = 32,
    on_batch: Callable[[int, int], None] | None = None,
) -> np.ndarray:
    """``[len(texts), d]`` float32 embeddings of ``texts`` in their order, through the pipeline
    on any device (``python -m ragged.embed``'s step): ``st`` a SentenceTransformer converted by
    :func:`ragged.nn.convert`; ``on_batch(texts, tokens)`` after each batch."""
    encode = st.__dict__.get("encode")
    if not callable(getattr(encode, "pipelined", None)):
        raise ValueError(
            "ragged.nn.hf.sentence.pipeline.embed(): expected a SentenceTransformer converted by "
            f"ragged.nn.convert, got {type(st).__name__} not converted"
        )
    if not texts:
        width = getattr(st, "get_embedding_dimension", None) or st.get_sentence_embedding_dimension
        return np.zeros((0, width() or 0), dtype=np.float32)
    settings = dataclasses.replace(
        encode.pipeline,
        enabled=True,
        cache=encode.pipeline.cache,
        lock=encode.pipeline.lock,
        running=encode.pipeline.running,
    )
    if max_tokens is not None:
        settings.max_tokens = int(max_tokens)
    arguments = {
        "inputs": list(texts),
        "prompt": prompt,
        "prompt_name": prompt_name,
        "batch_size": batch_size,
        "show_progress_bar": False,
        "normalize_embeddings": normalize,
        "convert_to_numpy": True,
    }
    why = reason(st, st[0].forward, settings, arguments)
    if why is not None:
        raise ValueError(f"ragged.nn.hf.sentence.pipeline.embed(): the pipeline cannot take this call: {why}")
    out = encode.pipelined(arguments, settings, on_batch)
    return np.asarray(finish(st, out, arguments, False), dtype=np.float32)


class PackedRunner:
    """The pipeline's two steps for a caller that forms its own batches (``ragged.serve``; made by
    :func:`ragged.nn.hf.sentence.packed_runner`): :meth:`tokenize` (the Transformer's own
    preprocess, unpadded, as the pipeline tokenizes) and :meth:`run` (one packed batch through
    the model: each text at positions from 0, replayed from CUDA graphs of ``max_tokens`` /
    ``max_batch`` on a GPU). ``target()``: what the graphs capture; ``encoding``:
    :func:`ragged.nn.hf.sentence.encoding`. The caller owns the model: its weights do not change
    while the runner serves (the fused projections' concatenated weights are kept:
    :func:`ragged.nn.layer_spec.frozen_weights`)."""

    def __init__(
        self, st: nn.Module, forward, target: Callable[[], nn.Module], encoding: Callable, max_tokens: int,
        max_batch: int = MAX_BATCH, graphs: bool = True,
    ) -> None:  # fmt: skip
        self.st, self.forward, self.module = st, forward, st[0]
        self.target, self.encoding = target, encoding
        self.side = unpadded_side(self.module, {})
        self.lock = getattr(self.module.__dict__.get("preprocess"), "lock", None) or threading.Lock()
        self.settings = Pipeline(True, int(max_tokens), int(max_batch), bool(graphs))
        self.frozen: dict = {}  # the caller owns the model: its weights do not change (frozen_weights)

    def tokenize(self, texts: list[str], prompt: str | None = None):
        """``(lengths [n], ids [sum], token types or None, the other features)`` of ``texts``,
        tokenized (and truncated) as the model's own ``encode`` would."""
        return _tokenize(self.module, self.lock, texts, prompt)

    def run(self, lengths: np.ndarray, flat: np.ndarray, types, extra: dict) -> torch.Tensor:
        """``[n, d]`` sentence embeddings (before normalisation) of the texts whose ids ``flat``
        holds one after the other, ``lengths`` each, on the model's device (the caller reads
        them: nothing here waits for the GPU)."""
        st = self.st
        device = next(st.parameters()).device
        graphed = None
        if device.type == "cuda" and self.settings.graphs and self.forward.graphed is None:
            graphed = _graphs(self.settings, self.target, device)
        starts = np.cumsum(lengths) - lengths
        packed = _packed(lengths, flat, types, starts, np.arange(lengths.size), self.side or "right", False)
        features = {**extra, INPUT_KEY: packed}
        return _embed(st, features, self.forward, self.encoding, graphed, self.settings, self.frozen)[0]
