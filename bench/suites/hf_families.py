"""The hf suite's model-family workloads: texts embedded by one HuggingFace model family as
HuggingFace runs it (``sdpa``, padded batches; compiled) and by the same weights converted by
``ragged.nn.convert``: ModernBERT (rotary positions, alternating global and sliding-window
layers, GeGLU; HuggingFace unpads it only under flash_attention_2) on long-tailed texts, MPNet
(a relative-position bias in every layer's attention; HuggingFace runs it eagerly) on sentences."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from ..harness import Workload
from .encoder_problem import Model as EncoderModel
from .encoder_problem import encoder_flops
from .hf_common import (
    COSINE_FLOOR,
    HF_COMPILED,
    HF_DATA,
    HF_EAGER_COMPILED,
    HF_EAGER_DATA,
    HF_EAGER_SORTED,
    HF_SORTED,
    RAG_DATA,
    RAG_GRAPHED_DATA,
    RAG_GRAPHED_SORTED,
    RAG_SORTED,
    RAG_ST_32,
    RAG_ST_256,
    RAG_ST_GRAPHED,
    ROWS,
    SEED,
    SLACK,
    ST_32,
    ST_256,
    Corpus,
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
from .hf_texts import (
    Texts,
    convert_st,
    encode_pass,
    graphed_encode_pass,
    make_texts,
    padded_pass,
    ragged_pass,
    word_tokenizer,
)

ST_ROWS = (ST_32, ST_256, RAG_ST_32, RAG_ST_256, RAG_ST_GRAPHED)

__all__ = ["build_family"]


def build_family(shape: Shape, device: torch.device) -> Workload:
    """Rows (those of ``ROWS[shape.workload]``): HuggingFace (``sdpa``, or eager for a model
    without it: ``shape.model.attention``) in data order and sorted,
    ``torch.compile`` of it (sorted, ``dynamic=True``; CUDA), the converted model in data order
    and sorted, and graphed (CUDA). Batches of ``shape.batch`` texts; embeddings are the mean of
    the last hidden state over each text's tokens, checked against the float32 model (``sdpa``,
    sorted batches)."""
    import transformers

    import ragged.nn as rnn

    fns: dict[str, Any] = {}
    with quiet():
        if isinstance(shape.lengths, Corpus):
            tokenizer, texts = shape.lengths.tokenizer(), shape.lengths.texts(shape.count)
        else:
            tokenizer = word_tokenizer(shape.model.vocab)
            texts = make_texts(tokenizer, shape.lengths.draw(shape.count))
        torch.manual_seed(SEED)
        attention = shape.model.attention
        reference_model = getattr(transformers, shape.model.model_class)(
            shape.model.config(attn_implementation=attention)
        )
        data = Texts(tokenizer, texts, device)
        order = np.argsort(data.lengths, kind="stable")
        reference_model = reference_model.to(device).eval()
        reference = padded_pass(reference_model, data, data.chunks(order, 16))()
        model = copy.deepcopy(reference_model).to(shape.dtype).eval()
        del reference_model
    converted, convert_error = attempt("ragged.nn.convert failed", lambda: rnn.convert(copy.deepcopy(model)))
    B = shape.batch
    data_order, sorted_order = data.chunks(np.arange(len(data.texts)), B), data.chunks(order, B)
    hf_error = 1.0 - min_cosine(padded_pass(model, data, sorted_order)(), reference)
    hf_data, hf_sorted, hf_compiled = (
        (HF_DATA, HF_SORTED, HF_COMPILED)
        if attention == "sdpa"
        else (HF_EAGER_DATA, HF_EAGER_SORTED, HF_EAGER_COMPILED)
    )
    fns[hf_data] = Run(padded_pass(model, data, data_order))
    fns[hf_sorted] = Run(padded_pass(model, data, sorted_order))
    fns[hf_compiled] = (
        Run(padded_pass(torch.compile(model, dynamic=True), data, sorted_order))
        if device.type == "cuda"
        else "CPU smoke run: torch.compile builds for tens of seconds on a CPU (runs on CUDA)"
    )
    for name, batches in ((RAG_DATA, data_order), (RAG_SORTED, sorted_order)):
        fns[name] = broken(convert_error) if converted is None else Run(ragged_pass(converted, data, batches))
    for name, batches in ((RAG_GRAPHED_DATA, data_order), (RAG_GRAPHED_SORTED, sorted_order)):
        fns[name] = graphed_row(
            converted, convert_error, device, lambda m, batches=batches: ragged_pass(m, data, batches, graphed=True)
        )
    if any(name in dict(ROWS[shape.workload]) for name in ST_ROWS):
        fns.update(_sentence_rows(model, tokenizer, data, device))
    bound = max(COSINE_FLOOR.get(shape.dtype, 1e-3), SLACK * hf_error)

    compare, extra = cosine_checks(reference, bound)

    m = shape.model
    # the GEMM and full-attention flops of a BERT layer of the same sizes, GeGLU's extra input
    # projection left out: a lower bound of the useful work
    flops = encoder_flops(data.lengths.tolist(), EncoderModel(m.hidden, m.heads, m.ff, m.layers), False)
    fns = {name: fn for name, fn in fns.items() if name in dict(ROWS[shape.workload])}
    return Workload(assemble(shape.workload, fns), reference=reference, flops=flops, compare=compare, extra=extra)


def _sentence_rows(model, tokenizer, data: Texts, device: torch.device) -> dict[str, Any]:
    """sentence-transformers over the model as a sentence model is shipped (the model and its
    tokenizer saved, ``Transformer`` + mean ``Pooling`` + ``Normalize``: all-mpnet-base-v2's
    structure): ``encode`` of the texts at batch 32 and 256, and of the converted model at 32,
    256 and graphed at 256 (CUDA). Texts in, tokenization included."""
    import importlib.util
    import tempfile

    if importlib.util.find_spec("sentence_transformers") is None:
        return dict.fromkeys(ST_ROWS, "sentence-transformers is not installed")
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    dim = model.config.hidden_size
    with quiet(), tempfile.TemporaryDirectory(prefix="ragged_bench_st_") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        st, why = attempt(
            "sentence-transformers could not load the model",
            lambda: SentenceTransformer(
                modules=[Transformer(tmp, model_kwargs={"dtype": model.dtype}), Pooling(dim, "mean"), Normalize()],
                device=str(device),
            ).eval(),
        )
    if st is None:
        return dict.fromkeys(ST_ROWS, why)
    converted, convert_error = attempt(
        "ragged.nn.convert of the SentenceTransformer failed", lambda: convert_st(copy.deepcopy(st))
    )
    fns: dict[str, Any] = {ST_32: Run(encode_pass(st, data.texts, 32)), ST_256: Run(encode_pass(st, data.texts, 256))}
    for name, batch in ((RAG_ST_32, 32), (RAG_ST_256, 256)):
        fns[name] = broken(convert_error) if converted is None else Run(encode_pass(converted, data.texts, batch))
    fns[RAG_ST_GRAPHED] = graphed_row(
        converted, convert_error, device, lambda m: graphed_encode_pass(m, data.texts, 256, int(data.lengths.max()))
    )
    return fns
