"""ragged inside other frameworks: each module here imports its framework and ``ragged.nn`` (the
layer below), and nothing imports this package with ``import ragged`` or ``import ragged.nn``.

* :mod:`ragged.integrations.transformers`: ``attn_implementation="ragged"`` for any transformers
  model (importing it registers the implementation);
* :mod:`ragged.integrations.trainer`: :class:`~ragged.integrations.trainer.RaggedTrainer`,
  transformers' ``Trainer`` on token-budget batches;
* :mod:`ragged.integrations.embed`: what ``python -m ragged.embed`` runs (with
  :mod:`~ragged.integrations.embed_io` and :mod:`~ragged.integrations.embed_report`).
"""
