"""The hf suite's ModernBERT workload: texts of long-tailed lengths embedded by HuggingFace's
ModernBERT (``sdpa``, which pads: HuggingFace unpads only under flash_attention_2) and by the
same weights converted by ``ragged.nn.convert`` (rotary positions, alternating global and
sliding-window layers, GeGLU, computed on packed tokens)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from ..harness import Workload
from .encoder_problem import Model as EncoderModel, encoder_flops
from .hf_common import (COSINE_FLOOR, HF_COMPILED, HF_DATA, HF_SORTED, MODERN, RAG_DATA, RAG_GRAPHED_DATA, RAG_SORTED,
                        SEED, SLACK, Run, Shape, assemble, attempt, broken, cosine_checks, min_cosine, quiet)
from .hf_texts import Texts, make_texts, padded_pass, ragged_pass, word_tokenizer

__all__ = ["build_modernbert"]


def build_modernbert(shape: Shape, device: torch.device) -> Workload:
    """Rows: HuggingFace ``sdpa`` in data order and sorted, ``torch.compile`` of it (sorted,
    ``dynamic=True``; CUDA), the converted model in data order and sorted, and graphed in data
    order (CUDA). Batches of ``shape.batch`` texts; embeddings are the mean of the last hidden
    state over each text's tokens, checked against the float32 model (``sdpa``, sorted batches)."""
    from transformers import ModernBertModel

    import ragged.nn as rnn

    fns: dict[str, Any] = {}
    with quiet():
        tokenizer = word_tokenizer(shape.model.vocab)
        torch.manual_seed(SEED)
        reference_model = ModernBertModel(shape.model.config(attn_implementation="sdpa"))
        data = Texts(tokenizer, make_texts(tokenizer, shape.lengths.draw(shape.count)), device)
        order = np.argsort(data.lengths, kind="stable")
        reference_model = reference_model.to(device).eval()
        reference = padded_pass(reference_model, data, data.chunks(order, 16))()
        model = copy.deepcopy(reference_model).to(shape.dtype).eval()
        del reference_model
    converted, convert_error = attempt("ragged.nn.convert failed", lambda: rnn.convert(copy.deepcopy(model)))
    B = shape.batch
    data_order, sorted_order = data.chunks(np.arange(len(data.texts)), B), data.chunks(order, B)
    hf_error = 1.0 - min_cosine(padded_pass(model, data, sorted_order)(), reference)
    fns[HF_DATA] = Run(padded_pass(model, data, data_order))
    fns[HF_SORTED] = Run(padded_pass(model, data, sorted_order))
    fns[HF_COMPILED] = Run(padded_pass(torch.compile(model, dynamic=True), data, sorted_order)) \
        if device.type == "cuda" else "CPU smoke run: torch.compile builds for tens of seconds on a CPU (runs on CUDA)"
    for name, batches in ((RAG_DATA, data_order), (RAG_SORTED, sorted_order)):
        fns[name] = broken(convert_error) if converted is None else Run(ragged_pass(converted, data, batches))
    if converted is None:
        fns[RAG_GRAPHED_DATA] = broken(convert_error)
    elif device.type != "cuda":
        fns[RAG_GRAPHED_DATA] = "CUDA graphs: runs on CUDA"
    else:
        fns[RAG_GRAPHED_DATA] = Run(ragged_pass(converted, data, data_order, graphed=True))
    bound = max(COSINE_FLOOR.get(shape.dtype, 1e-3), SLACK * hf_error)

    compare, extra = cosine_checks(reference, bound)

    m = shape.model
    # the GEMM and full-attention flops of a BERT layer of the same sizes, GeGLU's extra input
    # projection left out: a lower bound of the useful work
    flops = encoder_flops(data.lengths.tolist(), EncoderModel(m.hidden, m.heads, m.ff, m.layers), False)
    return Workload(assemble(MODERN, fns), reference=reference, flops=flops, compare=compare, extra=extra)
