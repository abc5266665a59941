"""HuggingFace encoder models computed padding-free (what :func:`ragged.nn.convert` does to them).

Families, one file each: BERT (``bert.py``), RoBERTa, XLM-RoBERTa and CamemBERT
(``roberta.py``), ELECTRA (``electra.py``), DistilBERT (``distilbert.py``), ModernBERT
(``modernbert.py``) and MPNet (``mpnet.py``); for each the base model (``AutoModel``) and its
``ForSequenceClassification``, ``ForTokenClassification``, ``ForMaskedLM`` and
``ForQuestionAnswering`` heads. Sentence-transformers models over them, or over the decoders
``decoder.py`` runs on packed batches under ``attn_implementation="ragged"`` (its attention and
mask functions: ``attention.py``; Qwen3-Embedding, EmbeddingGemma): the package ``sentence/``
(``__init__.py``: what conversion does, read first with ``plan.py``; the pooling: ``pooling.py``;
the packed input: ``batch.py``; the overlapped encode: ``pipeline.py`` and its tokenization
``tokens.py``).

**Layout of this package.** ``family.py`` says what a family declares (its layer modules,
attention shape, embeddings, heads, outputs and what it refuses) and holds the machinery the
BERT-like families share; ``batch.py`` reads a call's batch once; ``encoder.py`` runs any
family's embeddings and layers; ``heads.py`` its heads and losses; ``forward.py`` identifies,
checks and patches models and is the converted forward; ``lora.py`` reads a layer's Linear
(peft's LoRA Linear as the Linear it computes); ``families.py`` lists the families;
``graphs.py`` tells :func:`ragged.nn.graphed` what only these families know (its hooks).

**Mechanism.** Conversion patches forward behaviour and nothing else: the model (and, for a
head, its base model) gets an instance attribute ``forward``, a :class:`RaggedForward`
that ``nn.Module.__call__`` finds before the class's method. The class, the module tree,
the Parameter objects, the ``state_dict`` keys and ``config.architectures`` stay as they
were, so ``save_pretrained`` / ``from_pretrained`` round-trip unchanged (a reloaded model is
a plain HuggingFace model until it is converted again), an optimizer built before keeps
training the model, and ``isinstance`` / ``type`` checks see HuggingFace's classes. A
subclass swapped in under the same name would do the same but break ``pickle`` (the name
would resolve to the original class); the instance attribute holds a reference to its
module only, so ``copy.deepcopy`` and ``pickle`` / ``torch.save`` of a converted model give
a converted model. Its ``__signature__`` is the original forward's (what ``Trainer`` reads).
``torch.nn.DataParallel`` (``torch.nn.parallel.replicate``) copies each module's ``__dict__``
into a replica: a converted module also gets an instance ``_replicate_for_data_parallel`` that
gives each replica a forward of its own, which runs the replica's parameters; a shallow
``copy.copy`` is not converted (:func:`is_converted`) until ``convert`` is called on it.

**Inputs** (keywords or HuggingFace's positional order):

* ``input_ids`` (or ``inputs_embeds``) padded ``[B, M]`` (``[B, M, E]``) with an optional
  2-D ``attention_mask`` (1 at tokens, 0 at padding; right, left or scattered): packed once
  at the top. Reading the mask costs one device-to-host read (its lengths and layout, in
  :func:`ragged.padding.read_mask_layout`); without a mask every row is full and nothing is
  read. ``token_type_ids``, ``position_ids`` (``[B, M]`` or ``[1, M]``) and token labels
  are packed with the same layout. Outputs come back padded like the input, with HuggingFace's
  output types and shapes; **padded positions hold zeros** (HuggingFace computes values
  there that no real token depends on).
* a :class:`ragged.RaggedTensor` of ids (values ``[T]``) or of embeddings (``[T, E]``):
  nothing is padded and nothing is read from the device; ``token_type_ids`` /
  ``position_ids`` / token labels as RaggedTensors (or packed ``[T]`` tensors);
  ``last_hidden_state``, hidden states and token-level logits come back as RaggedTensors,
  ``pooler_output`` and sequence-level logits as ``[B, ...]`` tensors.

**Positions.** As HuggingFace computes them: BERT, ELECTRA, DistilBERT and ModernBERT (its
rotary positions) number the columns of the padded input (so a left-padded row starts past 0, as in
HuggingFace), RoBERTa-style
models count the ids that are not ``padding_idx`` from ``padding_idx + 1`` (a segment
cumulative sum on the packed tokens, on the device: HuggingFace's values whenever the
padding holds the pad id, as tokenizers write it) and their ``inputs_embeds`` columns from
``padding_idx + 1``. A RaggedTensor input numbers each sequence from its first token.
Token types default to the embeddings' registered ``token_type_ids`` buffer, as in
HuggingFace.

**Differences from HuggingFace**, all at padding: sequence-level outputs (``pooler_output``,
sequence classification) read each sequence's first real token, where HuggingFace reads
column 0 (padding, for a left-padded row); token-level losses count the real tokens (the
same value when labels at padding are -100); the question-answering softmax spans the
sequence's real tokens (see :mod:`ragged.nn.hf.heads`).

**Sentence-transformers.** ``convert(st[0].auto_model)`` (a base model) accepts ``input_ids``
and ``token_type_ids`` as RaggedTensors and returns ``last_hidden_state`` as a RaggedTensor of
``[T, hidden]`` values with the input's offsets: the contract the sentence-transformers
adapter builds on.

**Compute.** The embeddings, the pooler and the heads are the model's own modules, called on
the packed tokens; the layers are read into :class:`ragged.nn.layer.LayerSpec` s once per
forward (Q, K and V concatenated on every forward, never cached, so that no write to the
weights goes unseen; see :func:`ragged.nn.hf.family.packed_in_projection`) and run by the
layer core, with the dropout rates of the layers' own Dropout modules in training (none in
the feed-forward hidden layer, as in HuggingFace) and HuggingFace's gradient checkpointing
honoured. ``output_hidden_states`` gives HuggingFace's tuple (the input of every layer, then
the last output), padded or ragged like the output; indices select as the installed
transformers selects them (see :func:`hidden_picks`). Loss keyword arguments (``num_items_in_batch``,
``ignore_index``) reach the loss of the heads whose HuggingFace loss takes them (the family's
``loss_function_heads``, see :mod:`ragged.nn.hf.heads`). Other keyword arguments are accepted
and ignored, as HuggingFace's attention ignores them, except those below.

**Refused**, with the model untouched: other transformers classes (DeBERTa's relative
attention; causal-LM, pre-training, next-sentence and multiple-choice heads; a subclass
defined outside transformers is an ordinary container, whose supported models inside are
converted), ``is_decoder``, ``add_cross_attention``,
a ``position_embedding_type`` other than ``"absolute"``, layers whose modules are not
HuggingFace's (a custom layer class, a Linear subclass; peft's LoRA Linear is taken, see
below), hooks on the modules the converted
forward does not call (the base model of a head, the encoder and everything in it; HuggingFace's
own output-capturing hooks are fine; hooks added there after conversion do not run, except on
the layers themselves, see below) and models dispatched by accelerate. A layer Linear replaced
after conversion (an adapter) raises at the
next call instead of being read as a plain Linear. At call time:
``output_attentions=True`` (the attention probabilities are never formed), ``head_mask``,
cross-attention inputs, ``past_key_values``, ``is_causal=True`` and flash-attention packing
arguments raise NotImplementedError.

**peft's LoRA adapters** (``get_peft_model``: ``ragged.nn.convert`` looks through the
``PeftModel`` and its ``LoraModel`` to the transformers model; transformers' and
sentence-transformers' ``add_adapter``, which put LoRA Linears in the model itself): the layers
of the families whose layers are read into a spec (all but ModernBERT, which refuses them) read
each LoRA Linear on every forward as the one Linear it computes, ``W + scaling * B @ A`` over
its active adapters (:mod:`ragged.nn.hf.lora`): merging, unmerging, disabling and switching
adapters act as in peft, the gradients reach the adapters, and the embeddings, heads and
``modules_to_save`` run as peft's modules. Refused: ``lora_dropout > 0``, DoRA and the other
LoRA variants, other tuners, and peft's ``adapter_names`` at call time.

**Data parallel**: DDP wraps a converted model as any other. Under FSDP2, each layer may be a
unit (``fully_shard(layer)`` for every ``model.<base>.encoder.layer[i]``, then the model): a
layer with hooks is called as a module with the packed values ``[T, d]`` in and out (its
parameters are read inside the call, once FSDP2 has gathered them), so FSDP2's hooks gather,
reshard and reduce as around HuggingFace's own forward; hooks registered on a layer after
conversion see those packed values.
"""

from __future__ import annotations

from .forward import (
    FAMILIES,
    RaggedForward,
    convert_model,
    hidden_picks,
    identify,
    is_converted,
    is_done,
    is_hf_model,
    patch,
    unpatch,
    why_not,
)

__all__ = [
    "FAMILIES",
    "RaggedForward",
    "convert_model",
    "hidden_picks",
    "identify",
    "is_converted",
    "is_done",
    "is_hf_model",
    "patch",
    "unpatch",
    "why_not",
]
