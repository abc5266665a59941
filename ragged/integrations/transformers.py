"""``attn_implementation="ragged"`` for any transformers model: importing this module registers
ragged's attention with transformers' ``AttentionInterface`` and its padding-mask function with
``AttentionMaskInterface``, under the name ``"ragged"``::

    import ragged.integrations.transformers
    lm = AutoModelForCausalLM.from_pretrained(path, attn_implementation="ragged")
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(examples)
    lm(**batch).loss.backward()        # padding-free, on ragged.varlen_attention

Any model whose attention layers call ``ALL_ATTENTION_FUNCTIONS.get_interface(...)`` (Llama,
Qwen2, Mistral, BERT, ...) then runs its attention on :func:`ragged.varlen_attention`, from
flattened batches (``cu_seq_lens_*``, or position ids that restart), padded batches with a
padding mask, or dense ones. What each kind of batch costs, and what is refused, is the
documentation of the functions registered, :mod:`ragged.nn.hf.attention` (the same functions a
converted sentence-transformers model over a decoder runs under). This module imports
transformers; ``import ragged`` does not import it.
"""

from __future__ import annotations

from ragged.nn.hf.attention import NAME, attention_forward, padding_mask, register

__all__ = ["NAME", "attention_forward", "padding_mask", "register"]

register()
