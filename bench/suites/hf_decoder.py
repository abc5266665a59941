"""The hf suite's decoder-embedder workload: a sentence-transformers model over a Qwen3 decoder
(Qwen3-Embedding's shape: last-token pooling, normalised, left-padding tokenizer), its
``encode`` as sentence-transformers runs it (``sdpa`` on padded batches; the model compiled)
against the same model converted by ``ragged.nn.convert`` (packed tokens through
``attn_implementation="ragged"``, eager and graphed)."""

from __future__ import annotations

import copy
import tempfile
import warnings
from typing import Any

import torch

from ..harness import Workload
from .hf_common import (
    COSINE_FLOOR,
    DECODER,
    RAG_ST_32,
    RAG_ST_256,
    RAG_ST_GRAPHED_32,
    ROWS,
    SEED,
    SLACK,
    ST_32,
    ST_256,
    ST_COMPILED_32,
    Run,
    Shape,
    assemble,
    attempt,
    broken,
    cosine_checks,
    graphed_row,
    min_cosine,
    quiet,
)
from .hf_texts import encode_pass, graphed_encode_pass

__all__ = ["build_decoder", "decoder_flops"]


def decoder_flops(lengths: list[int], model) -> float:
    """Forward FLOPs of the decoder on texts of ``lengths`` tokens: its matmuls (the embedding
    lookup and no LM head) and causal attention (``2 * L * L * heads * head_dim`` per text)."""
    kv, q = model.kv_heads * model.head_dim, model.heads * model.head_dim
    matmul = model.layers * (model.hidden * (q + 2 * kv) + q * model.hidden + 3 * model.hidden * model.ff)
    tokens = sum(lengths)
    attention = sum(n * n for n in lengths) * 2.0 * model.heads * model.head_dim * model.layers
    return 2.0 * matmul * tokens + attention


def build_decoder(shape: Shape, device: torch.device) -> Workload:
    """Rows: sentence-transformers' ``encode`` of the original (``sdpa``) at batch 32 and 256 and with
    its model under ``torch.compile`` (``dynamic=True``; CUDA) at batch 32; the converted model's
    ``encode`` at 32 and 256 and graphed at 32 (CUDA). Embeddings are checked against the float32
    original (``sdpa``, batch 32)."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    import ragged.nn as rnn

    from .. import corpus

    fns: dict[str, Any] = {}
    texts = shape.lengths.texts(shape.count)
    with quiet(), warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="ragged_bench_decoder_") as tmp:
        warnings.simplefilter("ignore")
        corpus.byte_bpe(shape.lengths.vocab, padding_side="left").save_pretrained(tmp)
        torch.manual_seed(SEED)
        getattr(transformers, shape.model.model_class)(shape.model.config()).save_pretrained(tmp)

        def load(dtype, **kw):
            modules = [
                Transformer(tmp, model_kwargs={"dtype": dtype, "attn_implementation": "sdpa", **kw}),
                Pooling(shape.model.hidden, "lasttoken"),
                Normalize(),
            ]
            return SentenceTransformer(modules=modules, device=str(device)).eval()

        reference = encode_pass(load(torch.float32), texts, 32)()
        st = load(shape.dtype)
    converted, convert_error = attempt(
        "ragged.nn.convert of the SentenceTransformer failed", lambda: rnn.convert(copy.deepcopy(st))
    )
    hf_error = 1.0 - min_cosine(encode_pass(st, texts, 32)(), reference)
    fns[ST_32], fns[ST_256] = Run(encode_pass(st, texts, 32)), Run(encode_pass(st, texts, 256))
    if device.type == "cuda":
        compiled = copy.deepcopy(st)
        compiled[0].auto_model = torch.compile(compiled[0].auto_model, dynamic=True)
        fns[ST_COMPILED_32] = Run(encode_pass(compiled, texts, 32))
    else:
        fns[ST_COMPILED_32] = "CPU smoke run: torch.compile builds for tens of seconds on a CPU (runs on CUDA)"
    for name, batch in ((RAG_ST_32, 32), (RAG_ST_256, 256)):
        fns[name] = broken(convert_error) if converted is None else Run(encode_pass(converted, texts, batch))
    fns[RAG_ST_GRAPHED_32] = graphed_row(
        converted,
        convert_error,
        device,
        lambda m: graphed_encode_pass(
            m, texts, 32, max(len(ids) for ids in m.tokenizer(texts, truncation=True)["input_ids"])
        ),
    )
    bound = max(COSINE_FLOOR.get(shape.dtype, 1e-3), SLACK * hf_error)
    compare, extra = cosine_checks(reference, bound)
    lengths = shape.lengths.draw(shape.count)
    fns = {name: fn for name, fn in fns.items() if name in dict(ROWS[DECODER])}
    return Workload(
        assemble(DECODER, fns),
        reference=reference,
        flops=decoder_flops(lengths, shape.model),
        compare=compare,
        extra=extra,
    )
