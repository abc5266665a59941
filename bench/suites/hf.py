"""hf: HuggingFace models as HuggingFace runs them (padded) against the same weights run
padding-free by ragged, every baseline in the same run: sentence embeddings (MiniLM-size and
BERT-base-size BERTs), fine-tuning ``BertForSequenceClassification`` and training a Llama-style
causal LM of about 0.5B parameters. ``HFSuite.notes`` describes every row.

Environment: ``BENCH_HF_MODEL=PATH`` (a checkpoint folder with its tokenizer, e.g. of
all-MiniLM-L6-v2) replaces the first embedding case's random weights and word-level tokenizer;
``BENCH_HF_WORKLOADS`` (comma-separated: ``embedding``, ``fine-tune``, ``lm``) runs a subset.
Without transformers the cases are skipped; without sentence-transformers its rows are.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import tempfile
from typing import Any

import numpy as np
import torch

from ..harness import Case, Config, Row, Skip, Suite, Workload, dtype_name, register
from ..targets import NOT_EVALUATED, speedup_notes, verdict
from .encoder_problem import Model as EncoderModel
from .encoder_problem import encoder_flops
from .hf_common import (  # noqa: F401  (re-exported: bench.ddp and the tests read them here)
    _B,
    _R,
    BERT_BASE,
    CAUSAL_LM,
    COSINE,
    COSINE_FLOOR,
    COSINE_TARGET,
    CPU_SHAPES,
    DECODER,
    EMBEDDERS,
    EMBEDDING,
    FAMILY_WORKLOADS,
    FINE_TUNE,
    GPU_QUICK_SHAPES,
    GPU_SHAPES,
    GRAPHS_ON_CUDA,
    HF_COMPILED,
    HF_DATA,
    HF_DATA_8,
    HF_EAGER_COMPILED,
    HF_EAGER_DATA,
    HF_EAGER_SORTED,
    HF_FA2,
    HF_PADDED,
    HF_SORTED,
    LLAMA_05B,
    LOSS_DIFF,
    LOSS_FLOOR,
    LOSS_VS_HF,
    MINILM,
    MODEL_VARIABLE,
    MODERN,
    MPNET,
    PEAK,
    QWEN3_06B,
    RAG_BUDGET_DATA,
    RAG_BUDGET_SORTED,
    RAG_DATA,
    RAG_DATA_8,
    RAG_EMBED_FILE,
    RAG_GRAPHED_8,
    RAG_GRAPHED_DATA,
    RAG_GRAPHED_SORTED,
    RAG_GRAPHED_TRAIN,
    RAG_SORTED,
    RAG_ST_32,
    RAG_ST_256,
    RAG_ST_GRAPHED,
    RAG_ST_GRAPHED_32,
    RAGGED,
    ROWS,
    SEED,
    SENTENCES,
    SLACK,
    ST_32,
    ST_256,
    ST_COMPILED_32,
    ST_FA2,
    STEP_MS,
    TARGETS,
    TARGETS_BY_WORKLOAD,
    TEXTS_S,
    TINY_BERT,
    TINY_LLAMA,
    TOKENS_S,
    VERSUS,
    WORKLOAD_KEYS,
    WORKLOADS_VARIABLE,
    Bert,
    Corpus,
    Lengths,
    Llama,
    Run,
    Shape,
    assemble,
    attempt,
    broken,
    case_lengths,
    checkpoint_model,
    cosine_checks,
    flash_attention_skip,
    graphed_row,
    lm_flops,
    min_cosine,
    pad_batch,
    quiet,
    to_device,
    train_steps,
    training_run,
    training_workload,
)
from .hf_decoder import build_decoder
from .hf_families import build_family
from .hf_texts import (
    Texts,
    convert_st,
    embed_file_pass,
    encode_pass,  # noqa: F401
    graphed_encode_pass,
    load_st,
    make_texts,
    padded_pass,
    ragged_pass,
    word_tokenizer,
)

# --------------------------------------------------------------------------------------
# Embedding


def build_embedding(shape: Shape, device: torch.device, path: str | None) -> Workload:
    from transformers import AutoModel, AutoTokenizer, BertModel

    import ragged.nn as rnn
    from ragged.data import TokenBudgetSampler

    fns: dict[str, Any] = {}
    with quiet(), tempfile.TemporaryDirectory(prefix="ragged_bench_hf_") as tmp:
        if path is None:
            tokenizer, src = word_tokenizer(shape.model.vocab), tmp
            torch.manual_seed(SEED)
            reference_model = BertModel(shape.model.config(max_position_embeddings=512))
            reference_model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        else:
            tokenizer, src = AutoTokenizer.from_pretrained(path), path
            reference_model = AutoModel.from_pretrained(path, dtype=torch.float32)
        data = Texts(tokenizer, make_texts(tokenizer, shape.lengths.draw(shape.count)), device)
        reference_model.set_attn_implementation("eager")  # the reference: float32, eager, sorted batches of 64
        order = np.argsort(data.lengths, kind="stable")
        reference = padded_pass(reference_model.to(device).eval(), data, data.chunks(order, 64))()
        dim = reference.shape[1]
        del reference_model
        st, st_error = None, "sentence-transformers is not installed"
        if importlib.util.find_spec("sentence_transformers") is None:
            fns.update(dict.fromkeys((ST_32, ST_256, ST_FA2, RAG_ST_32, RAG_ST_256, RAG_EMBED_FILE), st_error))
        else:
            st, st_error = attempt(
                "sentence-transformers could not load the model", lambda: load_st(src, shape.dtype, device, dim)
            )
        model = st[0].auto_model if st is not None else AutoModel.from_pretrained(src, dtype=shape.dtype).to(device)
        model.eval().set_attn_implementation("sdpa")
        if flash_attention_skip(device):
            fns.setdefault(ST_FA2, flash_attention_skip(device))
        elif st is not None:
            st_fa2, why = attempt(
                "flash_attention_2 unavailable",
                lambda: load_st(src, shape.dtype, device, dim, attn_implementation="flash_attention_2"),
            )
            fns[ST_FA2] = why or Run(encode_pass(st_fa2, data.texts, 256))
    # Deep copies: convert(copy=True) of a model that holds a HuggingFace model converts the
    # one inside in place, and the ST's model is the HF rows' model.
    converted, convert_error = attempt("ragged.nn.convert failed", lambda: rnn.convert(copy.deepcopy(model)))
    st_converted, st_convert_error = (
        (None, st_error)
        if st is None
        else attempt("ragged.nn.convert of the SentenceTransformer failed", lambda: convert_st(copy.deepcopy(st)))
    )

    N, B = len(data.texts), shape.batch
    data_order, sorted_order = np.arange(N), np.argsort(data.lengths, kind="stable")
    budget = int(round(B * float(data.lengths.mean())))  # the tokens of B texts on average
    budget_data = [np.asarray(b) for b in TokenBudgetSampler(data.lengths, budget, shuffle=False)]
    budget_sorted = [np.asarray(b) for b in TokenBudgetSampler(data.lengths, budget, shuffle=False, sort_window=N)]
    hf_error = 1.0 - min_cosine(padded_pass(model, data, data.chunks(sorted_order, B))(), reference)
    fns[HF_DATA] = Run(padded_pass(model, data, data.chunks(data_order, B)))
    fns[HF_SORTED] = Run(padded_pass(model, data, data.chunks(sorted_order, B)))
    fns[HF_COMPILED] = (
        Run(padded_pass(torch.compile(model, dynamic=True), data, data.chunks(sorted_order, B)))
        if device.type == "cuda"
        else "CPU smoke run: torch.compile builds for tens of seconds on a CPU, past the run's budget (runs on CUDA)"
    )
    for name, batch in ((ST_32, 32), (ST_256, 256), (ST_FA2, 256)):
        if name not in fns:  # ST_FA2: set above unless sentence-transformers failed to load
            fns[name] = broken(st_error) if st is None else Run(encode_pass(st, data.texts, batch))
    for name, batches in (
        (RAG_DATA, data.chunks(data_order, B)),
        (RAG_SORTED, data.chunks(sorted_order, B)),
        (RAG_BUDGET_DATA, budget_data),
        (RAG_BUDGET_SORTED, budget_sorted),
    ):
        fns[name] = broken(convert_error) if converted is None else Run(ragged_pass(converted, data, batches))
    fns[HF_DATA_8] = Run(padded_pass(model, data, data.chunks(data_order, 8)))
    fns[RAG_DATA_8] = (
        broken(convert_error) if converted is None else Run(ragged_pass(converted, data, data.chunks(data_order, 8)))
    )
    for name, batches in (
        (RAG_GRAPHED_DATA, data.chunks(data_order, B)),
        (RAG_GRAPHED_SORTED, data.chunks(sorted_order, B)),
        (RAG_GRAPHED_8, data.chunks(data_order, 8)),
    ):
        fns[name] = graphed_row(
            converted, convert_error, device, lambda m, batches=batches: ragged_pass(m, data, batches, graphed=True)
        )
    fns[RAG_ST_GRAPHED] = graphed_row(
        st_converted,
        st_convert_error,
        device,
        lambda m: graphed_encode_pass(m, data.texts, 256, int(data.lengths.max())),
    )
    for name, batch in ((RAG_ST_32, 32), (RAG_ST_256, 256)):
        if name not in fns:
            fns[name] = (
                broken(st_convert_error) if st_converted is None else Run(encode_pass(st_converted, data.texts, batch))
            )
    fns[RAG_EMBED_FILE] = (
        broken(st_convert_error) if st_converted is None else Run(embed_file_pass(st_converted, data.texts))
    )
    bound = max(COSINE_FLOOR.get(shape.dtype, 1e-3), SLACK * hf_error)

    compare, extra = cosine_checks(reference, bound)

    c = model.config
    flops = encoder_flops(
        data.lengths.tolist(),
        EncoderModel(c.hidden_size, c.num_attention_heads, c.intermediate_size, c.num_hidden_layers),
        False,
    )
    return Workload(assemble(EMBEDDING, fns), reference=reference, flops=flops, compare=compare, extra=extra)


# --------------------------------------------------------------------------------------
# Training


def build_fine_tune(shape: Shape, device: torch.device, dropout: float) -> Workload:
    from transformers import BertForSequenceClassification

    import ragged.nn as rnn
    from ragged.data import collate

    rng = np.random.default_rng(SEED + 1)
    lengths = case_lengths(shape)
    batches = [
        [{"input_ids": rng.integers(5, shape.model.vocab, n).tolist(), "labels": int(rng.integers(0, 2))} for n in b]
        for b in lengths
    ]

    def padded(batch):
        b = pad_batch(batch, ("input_ids",), 0)
        b["labels"] = torch.tensor([s["labels"] for s in batch])
        return to_device(b, device)

    def packed(batch):
        return collate(batch).to(device, non_blocking=True)

    with quiet():
        torch.manual_seed(SEED)
        config = shape.model.config(num_labels=2, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
        reference_model = BertForSequenceClassification(config).to(device).eval()
        reference_model.set_attn_implementation("eager")
        with torch.no_grad():
            reference = float(reference_model(**padded(batches[0])).loss)
        model = copy.deepcopy(reference_model).to(shape.dtype)
        del reference_model
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            hf_error = abs(float(model(**padded(batches[0])).loss) - reference)
    converted, why = attempt("ragged.nn.convert failed", lambda: rnn.convert(copy.deepcopy(model)))
    fns = {
        HF_PADDED: training_run(model, device, batches, padded),
        RAGGED: broken(why) if converted is None else training_run(converted, device, batches, packed),
    }
    # the same converted model through the training graphs (its own copy: the graphs hold its
    # parameters); skipped off CUDA, where there is no graph to replay (timing the bucketed batches
    # run eagerly would time another row under this one's name)
    if converted is None:
        fns[RAG_GRAPHED_TRAIN] = broken(why)
    elif device.type != "cuda":
        fns[RAG_GRAPHED_TRAIN] = GRAPHS_ON_CUDA
    else:
        twin = copy.deepcopy(converted)
        graphs = rnn.Graphed(twin, max(map(sum, lengths)), shape.count)
        fns[RAG_GRAPHED_TRAIN] = training_run(twin, device, batches, packed, call=graphs)
    m = shape.model
    flops = encoder_flops([n for b in lengths for n in b], EncoderModel(m.hidden, m.heads, m.ff, m.layers), True)
    return training_workload(assemble(FINE_TUNE, fns), reference, hf_error, shape.dtype, flops, device)


def build_causal_lm(shape: Shape, device: torch.device) -> Workload:
    from transformers import DataCollatorWithFlattening, LlamaForCausalLM

    import ragged.integrations.transformers  # noqa: F401  (registers attn_implementation="ragged")

    rng = np.random.default_rng(SEED + 2)
    lengths = case_lengths(shape)
    batches = [[{"input_ids": rng.integers(0, shape.model.vocab, n).tolist()} for n in b] for b in lengths]
    flatten = DataCollatorWithFlattening(return_flash_attn_kwargs=True)

    def padded(batch):
        return to_device(pad_batch(batch, ("input_ids",), 0, labels=True), device)

    def flattened(batch):
        return to_device(flatten(batch), device)

    fns: dict[str, Any] = {}
    with quiet():
        torch.manual_seed(SEED)
        with torch.device(device):
            reference_model = LlamaForCausalLM(shape.model.config()).eval()
        reference_model.set_attn_implementation("eager")
        total, count = 0.0, 0
        with torch.no_grad():  # the float32 loss of the first batch, one sequence at a time
            for s in batches[0]:
                ids = torch.tensor([s["input_ids"]], device=device)
                total += float(reference_model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
                count += ids.shape[1] - 1
        reference = total / count
        model = copy.deepcopy(reference_model).to(shape.dtype)
        del reference_model
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            hf_error = abs(float(model(**padded(batches[0])).loss) - reference)

        def with_attention(name: str):
            other = copy.deepcopy(model)
            other.set_attn_implementation(name)
            return other

        converted, why = attempt('attn_implementation="ragged" failed', lambda: with_attention("ragged"))
        fns[RAGGED] = broken(why) if converted is None else training_run(converted, device, batches, flattened)
        if flash_attention_skip(device):
            fns[HF_FA2] = flash_attention_skip(device)
        else:
            fa2, why = attempt("flash_attention_2 unavailable", lambda: with_attention("flash_attention_2"))
            fns[HF_FA2] = why if fa2 is None else training_run(fa2, device, batches, flattened)
    fns[HF_PADDED] = training_run(model, device, batches, padded)
    return training_workload(
        assemble(CAUSAL_LM, fns), reference, hf_error, shape.dtype, lm_flops(lengths, shape.model), device
    )


# --------------------------------------------------------------------------------------
# The suite


@register
class HFSuite(Suite):
    name = "hf"
    description = "HuggingFace models: padded (SDPA, compiled, sentence-transformers) vs converted by ragged"
    memory_bound = False
    speedup_table = True
    notes = """\
HuggingFace models as HuggingFace runs them against the same weights run padding-free by ragged
(`ragged.nn.convert`, `ragged.data`, `attn_implementation="ragged"`): on a GPU in bf16, on CPU
tiny fp32 models (a smoke run). Random weights from configs (seeded), unless `BENCH_HF_MODEL`
names a checkpoint folder: it replaces the first embedding case's model and tokenizer. A timed
call is a full pass (embedding) or `steps` training steps, host work included; medians as in
every suite, one round (each call spans many batches). TFLOP/s: useful flops (real tokens).
`targets`: the project's GPU targets (reported, not asserted; a CPU run does not judge the speed
targets); the speedup table gives every ragged row over every baseline.

**embedding**: `N` texts of lognormal token lengths (median 25, sigma 0.8, 3..256, special
tokens included) of random words that are one token each (a generated word-level tokenizer, or
the checkpoint's), tokenized once outside the timed call into per-text int64 arrays (a
dataset). A row embeds every text (mean of the last hidden state over its tokens): building
each batch, `.to(device, non_blocking=True)`, the forward (`torch.inference_mode()`), pooling.
- `HF SDPA, data order` / `sorted`: `BertModel` (`attn_implementation="sdpa"`) on batches of
  `batch` texts (256) in data order / by length, right-padded to the longest, `attention_mask`.
- `HF SDPA compiled, sorted`: `torch.compile(model, dynamic=True)`, sorted batches (compiled
  during the untimed check pass; CUDA only).
- `ST encode, batch 32 / 256`: `SentenceTransformer.encode(texts, batch_size)` of the same
  weights (tokenizes, sorts by length, pads per batch): tokenization timed. `ST encode
  flash_attention_2`: loaded with that attention, where sentence-transformers flattens text
  batches itself (skipped without flash-attn).
- `ragged, data order / sorted`: `ragged.nn.convert` of a copy of the model on the HF rows'
  batches, built by `ragged.data.collate` (RaggedTensors), `ragged.pool(h, "mean")`.
- `ragged, ..., token budget`: batches from `TokenBudgetSampler(lengths, max_tokens=batch x
  mean length, shuffle=False)` (sorted: `sort_window=N`).
- `ragged ST encode`: `ragged.nn.convert` of a copy of the SentenceTransformer, `encode()`
  (on a GPU its overlapped pipeline: tokenization in threads, token-budget batches, the
  model graphed; `batch_size` does not size its batches).

`min cosine vs fp32`: smallest cosine similarity over the texts between a row's embedding and
the float32 model's (eager attention); gate: `1 - cos` <= max(1e-3 (fp32: 1e-6), 3 x that of
HF's bf16 sorted pass). Targets: ragged sorted >= 2.5x HF sorted, >= 1.25x HF compiled sorted;
ragged data order >= 4x HF data order (the same batches); ragged token budget sorted
and the ragged ST rows >= 10x ST encode batch 32; ragged ST encode batch 256 >= 4x ST encode
batch 256; ragged ST encode (texts in, tokenization included) >= 0.6x the rate of ragged graphed
on batches collated ahead (`>=0.6x ragged graphed, data order`); `ragged.embed path`: what
`python -m ragged.embed` does per chunk on the loaded converted model (read and check a JSONL
file, the encode pipeline, save `.npy`), within 10% of ragged ST encode's rate; min cosine >=
0.9999.

**fine-tune**: `BertForSequenceClassification` (2 labels; random ids and labels; dropout
0.1), `steps` AdamW steps (lr 1e-5, fused on CUDA, weights in the case's dtype), each on its
own batch of 32 sequences (lognormal, median 96, sigma 1, 16..512). `HF SDPA, padded`:
right-padded with `attention_mask`; `ragged`: the converted model on `collate` batches
(`labels` [B]). Padding / collate and the copy to the device are timed. Target: >= 2.5x.

**causal LM**: `LlamaForCausalLM` of the config shown (GQA, untied head, no gradient
checkpointing), `steps` AdamW steps; each step's sequences (lognormal, median 256, sigma 1,
32..2048) are cut in order at 8192 tokens (`TokenBudgetSampler`): every row runs the same
tokens per step. `HF SDPA, padded`: right-padded, labels -100 at padding; `ragged`:
`attn_implementation="ragged"` on `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`
batches (one row, `cu_seq_lens_*`, restarting `position_ids`); `HF flash_attention_2,
flattened`: the same batches (skipped without flash-attn). transformers' `sdpa` on a flattened
batch attends across sequences (measured: its loss is not the per-sequence loss), so it is no
baseline. Target: tokens/s >= 2x HF padded, with the same loss.

**ModernBERT**: `ModernBertModel` of the config shown (random weights, seeded; 22 layers,
every third global, the others a 128-token window), `N` texts of long-tailed lengths (lognormal,
median 128, sigma 1, 16..1024) from the generated tokenizer, embedded in batches of 32 texts as
in **embedding**: `HF SDPA` (HuggingFace pads under sdpa and gives its local layers a sliding-window
mask; it unpads only under flash_attention_2) in data order and sorted, compiled sorted, and the
converted model (`ragged`) in data order, sorted and graphed. Reference: the float32 model
(sdpa, sorted batches of 16). Targets: ragged data order >= 3x HF SDPA data order; every
ragged row's min cosine at least HF SDPA's own in the case's dtype (less 1e-5).

**MPNet**: `MPNetModel` of the config shown (random weights, seeded; all-mpnet-base-v2's
shape: 12 layers of 768, a relative-position bias in every layer's attention), the
first `N` texts of `bench/corpus.py` (paragraphs of the Python standard library's docstrings:
real prose, median 16 tokens, tail to 512) under a WordPiece tokenizer trained on them, batches
of 256: the same rows as ModernBERT's
plus `ragged graphed, sorted`, and texts in through sentence-transformers (the model and tokenizer
saved, `Transformer` + mean `Pooling` + `Normalize`, all-mpnet-base-v2's structure): `ST encode`
at batch 32 and 256, the converted one's at 32 and 256 and graphed at 256 (tokenization
included). HuggingFace's MPNet has no SDPA path (its attention adds the bias to eager scores):
its rows are `HF eager, ...`. Targets: ragged data order >= 3x HF data order; ragged sorted >= 1.5x
HF compiled sorted; ragged graphed (data order) >= 2x HF compiled sorted; min cosine at least
HF's own (the sentence-transformers rows are reported beside them).

**decoder embedder**: a sentence-transformers model over `Qwen3Model` of the config shown
(random weights, seeded; Qwen3-Embedding-0.6B's shape), last-token pooling and normalisation as
Qwen3-Embedding's, over the first `N` texts of `bench/corpus.py` under a byte-level BPE tokenizer
trained on them (`<|endoftext|>` appended, left padding). `ST encode`: `encode()` of the model in
`sdpa`, batch 32 (its default) and 256, and with the transformer compiled (`dynamic=True`);
`ragged ST encode`: the converted model's `encode()` (packed tokens, `attn_implementation="ragged"`),
eager and graphed. Reference: the float32 original at batch 32. Targets: ragged at batch 32 >= 3x
the original at batch 32, >= 1.5x the compiled original; graphed >= 2x the compiled original;
min cosine at least the original's own.

Training gate: the check call runs the steps in eval mode (no dropout); step 1's loss (before
any update) against the float32 model's (eager; LM: one sequence at a time): error <=
max(2e-2 (fp32: 1e-4) x max(1, |loss|), 3 x HF's bf16 error). `loss diff vs fp32`: that
error; `max loss diff vs HF`: the largest difference between the ragged row's losses and `HF
SDPA, padded`'s over the check call's steps (same batches, same updates from the same
weights). `peak GiB`: peak memory of one call (CUDA). `ms/step`: median / steps.
"""

    dropout: float = 0.1
    """Dropout of the fine-tuned BERT (BERT's); the check call runs in eval mode."""

    def shapes(self, config: Config) -> list[Shape]:
        shapes = list(GPU_QUICK_SHAPES if config.quick else GPU_SHAPES) if config.on_gpu else list(CPU_SHAPES)
        names = [w.strip() for w in os.environ.get(WORKLOADS_VARIABLE, "").split(",") if w.strip()]
        if unknown := [w for w in names if w not in WORKLOAD_KEYS]:
            raise ValueError(
                f"{WORKLOADS_VARIABLE}: expected workloads among {', '.join(WORKLOAD_KEYS)}, got {', '.join(unknown)}"
            )
        if names:
            shapes = [s for s in shapes if s.workload in {WORKLOAD_KEYS[w] for w in names}]
        if config.dtypes is not None:
            shapes = [dataclasses.replace(s, dtype=d) for s in shapes for d in config.dtypes if d.is_floating_point]
        return shapes

    def cases(self, config: Config) -> list[Case]:
        path, cases, first = os.environ.get(MODEL_VARIABLE) or None, [], True
        for shape in self.shapes(config):
            batches = case_lengths(shape)
            flat = [n for b in batches for n in b]
            total, kind = sum(flat), dtype_name(shape.dtype)
            params: dict[str, Any] = {
                "workload": shape.workload,
                "model": shape.model.name(),
                "dtype": kind,
                "lengths": shape.lengths.text(),
                "T": total,
                "mean_len": round(total / len(flat), 2),
                "M": max(flat),
            }
            checkpoint = None
            if shape.workload in EMBEDDERS:
                params.update(texts=len(flat), batch=shape.batch, checkpoint="random weights")
                name = f"{shape.workload} {shape.label} {kind} N={len(flat)} mean={total / len(flat):.0f}"
            elif shape.workload == EMBEDDING:
                checkpoint, first, label = (path if first else None), False, shape.label
                params.update(texts=shape.count, batch=shape.batch, checkpoint=checkpoint or "random weights")
                if checkpoint is not None:
                    label = os.path.basename(os.path.normpath(checkpoint))
                    params["model"] = checkpoint_model(checkpoint)
                name = f"{EMBEDDING} {label} {kind} N={shape.count} mean={total / len(flat):.0f}"
            else:
                padded = sum(len(b) * max(b) for b in batches)
                params.update(
                    steps=shape.steps, sequences=len(flat), padded_tokens=padded, real_fraction=round(total / padded, 4)
                )
                if shape.workload == FINE_TUNE:
                    params.update(batch=shape.count, dropout=self.dropout)
                else:
                    params.update(
                        tokens_per_step=shape.count, params=shape.model.params(), gradient_checkpointing=False
                    )
                name = f"{shape.workload} {shape.label} {kind} steps={shape.steps} T={total}"
            cases.append(Case(name, params, group=shape.workload, spec=(shape, checkpoint, config.on_gpu)))
        return cases

    def build(self, case: Case, config: Config) -> Workload:
        shape, checkpoint, _ = case.spec
        if importlib.util.find_spec("transformers") is None:
            raise Skip("needs transformers (pip install -e '.[hf]')")
        if checkpoint is not None and not os.path.isdir(checkpoint):
            raise Skip(f"{MODEL_VARIABLE}={checkpoint!r} is not a folder")
        if config.on_gpu:
            torch._dynamo.reset()  # compiled graphs of an earlier case hold its model
        try:
            if shape.workload == EMBEDDING:
                return build_embedding(shape, config.device, checkpoint)
            if shape.workload == FINE_TUNE:
                return build_fine_tune(shape, config.device, self.dropout)
            if shape.workload in FAMILY_WORKLOADS:
                return build_family(shape, config.device)
            if shape.workload == DECODER:
                return build_decoder(shape, config.device)
            return build_causal_lm(shape, config.device)
        except (Skip, torch.OutOfMemoryError):
            raise
        except Exception as exc:  # noqa: BLE001  (every row says why; the suite goes on)
            why = f"case not built: {type(exc).__name__}: {str(exc).strip()[:300]}"
            return Workload(assemble(shape.workload, {name: broken(why) for name, _ in ROWS[shape.workload]}))

    def console_notes(self, rows: list[Row]) -> list[str]:
        """What the ``targets`` cells say, counted: whether the speed targets were judged, and how
        many of the output checks (cosine) held."""
        cells = [
            item.strip()
            for r in rows
            if r.kind == "ragged" and r.status == "ok"
            for item in str(r.extra.get(TARGETS, "")).split(";")
            if item.strip()
        ]
        if not cells:
            return []
        unjudged = any(c == NOT_EVALUATED for c in cells)
        checks = [c for c in cells if c.startswith("cos>=")]
        speed = [c for c in cells if c != NOT_EVALUATED and not c.startswith("cos>=")]
        parts = [f"speed targets: {NOT_EVALUATED}"] if unjudged else []
        if speed:
            parts.append(
                f"speed targets: {sum(c.endswith(' met') for c in speed)} met, "
                f"{sum('MISSED' in c for c in speed)} missed of {len(speed)}"
            )
        if checks:
            parts.append(
                f"output checks (min cosine): {sum(c.endswith(': met') for c in checks)} met, "
                f"{sum('MISSED' in c for c in checks)} missed of {len(checks)}"
            )
        return [f"targets (the `{TARGETS}` column of {self.name}.md): " + "; ".join(parts)]

    def annotate(self, case: Case, rows: list[Row]) -> None:
        """Throughput, time per step and the targets (the speed targets judged on a GPU only)."""
        shape, _, on_gpu = case.spec
        ok = {r.impl: r for r in rows if r.status == "ok"}
        for r in ok.values():
            if shape.workload in (EMBEDDING, *EMBEDDERS):
                r.extra[TEXTS_S] = case.params["texts"] / (r.median_ms / 1e3)  # the texts embedded
            else:
                r.extra[TOKENS_S], r.extra[STEP_MS] = case.params["T"] / (r.median_ms / 1e3), r.median_ms / shape.steps
        notes = speedup_notes(TARGETS_BY_WORKLOAD[shape.workload], {k: r.median_ms for k, r in ok.items()}, on_gpu)
        # ModernBERT's embeddings: as close to float32 as HuggingFace's own in the case's dtype
        family = shape.workload in EMBEDDERS
        first = ROWS[shape.workload][0][0]  # the original model: HuggingFace in data order, or ST encode
        own = ok[first].extra.get(COSINE) if family and first in ok else None
        for r in ok.values():
            if r.kind == "ragged" and COSINE in r.extra:  # a check of the output: judged on CPU too
                cos = float(r.extra[COSINE])
                note = (
                    f"cos>={COSINE_TARGET:g}: {verdict(cos >= COSINE_TARGET)}"
                    if not family
                    else f"cos>=HF's own {float(own):.6f}: {verdict(cos >= float(own) - 1e-5)}"
                    if own is not None
                    else None
                )
                if note:
                    notes.setdefault(r.impl, []).append(note)
        for name, items in notes.items():
            ok[name].extra[TARGETS] = "; ".join(items)
