"""``transformers.Trainer`` on ragged batches: :class:`RaggedTrainer`.

.. code-block:: python

    import ragged.nn
    from ragged.integrations.trainer import RaggedTrainer

    model = ragged.nn.convert(AutoModelForSequenceClassification.from_pretrained(path))
    trainer = RaggedTrainer(model, TrainingArguments("out", gradient_accumulation_steps=2),
                            train_dataset=train, eval_dataset=val, max_tokens=8192)
    trainer.train(); trainer.evaluate(); trainer.predict(test)

A ``Trainer`` whose batches are never padded:

* **Training batches** come from :class:`ragged.data.TokenBudgetSampler` (at most
  ``max_tokens`` real tokens each), seeded from ``args.data_seed`` (else ``args.seed``), with the
  rank and world size of ``args`` (under ``torchrun`` every rank takes its own share and the
  same number of steps), re-planned each epoch. Several GPUs in one process (where ``Trainer``
  would use ``torch.nn.DataParallel``, which cannot split a RaggedTensor batch) train on one
  GPU, with a warning: ``torchrun`` gives data parallelism. Lengths come from ``lengths=``,
  else from the dataset's ``args.length_column_name`` column (a ``datasets.Dataset``), else from
  ``len(item["input_ids"])`` over the dataset, read once.
* **Collation**: :func:`ragged.data.collate` unless a ``data_collator`` is given: per-token
  fields become RaggedTensors, per-sequence labels ``[B]`` tensors. ``remove_unused_columns``
  works as in ``Trainer`` (the columns collate needs are the model's inputs).
* **Device**: RaggedTensors and :class:`ragged.data.RaggedBatch` es go to ``args.device`` with
  ``non_blocking=True`` (``Trainer`` moves only tensors).
* **Loss normalisation** as ``Trainer`` does it for the unconverted model on padded batches:
  ``num_items_in_batch`` counts the labels that are not -100 of RaggedTensor labels too
  (``Trainer`` cannot read them, and would then scale the loss differently).
* **Epochs differ in length** (packing a new permutation gives a few batches more or less):
  each epoch runs all of its own batches, and an epoch-based run plans its optimizer steps
  (and learning-rate schedule) from the real count of every epoch.
* **No sync per step**: ``Trainer``'s filter of non-finite losses (``logging_nan_inf_filter``,
  on by default) reads every step's loss on the host; here the same rule runs on the device, so
  the host can queue the next steps while the GPU computes.
* **Evaluation / prediction** keep ``Trainer``'s sequential batches of
  ``per_device_eval_batch_size`` sequences (dataset order, also across ranks), collated without
  padding; RaggedTensor outputs (token logits) and labels are padded with -100 per batch, as
  ``Trainer`` pads across batches, so ``predict()`` returns arrays.

* **CUDA graphs** (``graphs=True``, a model converted by :func:`ragged.nn.convert`): the
  training forward and backward (and the evaluation forward) replay graphs per bucket of
  :func:`ragged.nn.graphed`, with ``max_tokens`` and ``max_batch_size`` as the largest bucket
  (batches over it run eagerly, with one warning); ``graphs=`` also takes a
  :class:`ragged.nn.Graphed` of the model built with other buckets. Under ``torchrun`` with
  ``DistributedDataParallel`` (the model as ``Trainer`` wraps it) the step runs inside DDP's
  forward, so the graphs hand their gradients to autograd and DDP all-reduces them as for the
  eager model (:mod:`ragged.nn.graphed_train`); ``no_sync`` (gradient accumulation) is DDP's. A
  model wrapped otherwise (FSDP2, say) trains eagerly, with a warning; there the eager step of a
  converted encoder still replays each layer from its own graphs (:mod:`ragged.nn.layer_graphs`).

Resuming mid-epoch from a checkpoint skips batches by the first epoch's count, an
approximation when the epoch's count differs. This module imports transformers; ``import
ragged`` does not import it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import torch
from transformers import Trainer

import ragged.nn
from ragged.collate import RaggedBatch, collate
from ragged.data import TokenBudgetSampler
from ragged.nn import hf
from ragged.nn.hf import forward as hf_forward
from ragged.tensor import RaggedTensor
from ragged.utils import check_int, describe

__all__ = ["RaggedTrainer"]

_NAME = "ragged.integrations.trainer.RaggedTrainer"


class RaggedTrainer(Trainer):
    """``transformers.Trainer`` with token-budget batches of RaggedTensors (see the module).

    ``max_tokens``: the token budget of a training batch (per device); ``max_batch_size``,
    ``sort_window``, ``cost``: as :class:`ragged.data.TokenBudgetSampler` takes them;
    ``lengths``: the training sequences' token counts, when the dataset should not be read for
    them; ``graphs``: replay the steps from CUDA graphs (see the module). Every other argument is
    ``Trainer``'s; ``data_collator`` defaults to :func:`ragged.data.collate`.
    """

    def __init__(
        self,
        model=None,
        args=None,
        *,
        max_tokens: int,
        max_batch_size: int | None = None,
        sort_window: int | None = None,
        cost="tokens",
        lengths=None,
        graphs=False,
        data_collator=None,
        **kwargs,
    ):
        self.max_tokens = check_int(_NAME, "max_tokens", max_tokens, minimum=1)
        self.max_batch_size, self.sort_window = (
            None if v is None else check_int(_NAME, name, v, minimum=1)
            for name, v in (("max_batch_size", max_batch_size), ("sort_window", sort_window))
        )
        self.cost = cost
        self._lengths = lengths
        _check_dataset(kwargs.get("train_dataset"))
        self._train_sampler: TokenBudgetSampler | None = None
        super().__init__(model, args, data_collator=collate if data_collator is None else data_collator, **kwargs)
        if self.args.n_gpu > 1:
            # Trainer would wrap the model in torch.nn.DataParallel, whose scatter splits the
            # per-sequence tensors of a batch but not its RaggedTensors.
            warnings.warn(
                f"{_NAME}: {self.args.n_gpu} GPUs in one process: training on one of them; "
                "use torchrun (one process per GPU) for data parallelism",
                stacklevel=2,
            )
            self.args._n_gpu = 1
        self._graphs = _check_graphs(graphs, self.model)
        if self.train_dataset is not None:
            self._train_sampler = self._make_sampler(self.train_dataset)  # bad lengths raise here, not in train()

    # ---- training batches -------------------------------------------------------------

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(eval_dataset, str):  # Trainer.evaluate passes the name of one of a dict's datasets
            dataset = self.eval_dataset[eval_dataset]
        if dataset is not None and not isinstance(dataset, dict) and hasattr(dataset, "__len__") and len(dataset) == 0:
            # Trainer's own answer depends on the release (no loss, or a crash on a None batch)
            raise ValueError(
                f"{_NAME}.evaluate(): expected an eval_dataset with at least one sequence, got an "
                f"empty {type(dataset).__name__}"
            )
        return super().get_eval_dataloader(eval_dataset)

    def _make_sampler(self, dataset) -> TokenBudgetSampler:
        _check_dataset(dataset)
        lengths = self._lengths if self._lengths is not None else _read_lengths(dataset, self.args.length_column_name)
        args = self.args
        sampler = TokenBudgetSampler(
            lengths,
            self.max_tokens,
            shuffle=True,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            num_replicas=max(1, args.world_size),
            rank=args.process_index if args.world_size > 1 else 0,
            drop_last=args.dataloader_drop_last,
            max_batch_size=self.max_batch_size,
            sort_window=self.sort_window,
            cost=self.cost,
        )
        if sampler.lengths.size != len(dataset):
            raise ValueError(
                f"{_NAME}(): expected one length per training sequence ({len(dataset)}), got {sampler.lengths.size}"
            )
        return sampler

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError(f"{_NAME}.get_train_dataloader(): training needs a train_dataset, got None")
        if self._train_sampler is None or self._train_sampler.lengths.size != len(self.train_dataset):
            self._train_sampler = self._make_sampler(self.train_dataset)
        dataset, collator = self.train_dataset, self.data_collator
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        args = self.args
        params = {
            "batch_sampler": self._train_sampler,
            "collate_fn": collator,
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
        }
        if args.dataloader_num_workers > 0:
            params["prefetch_factor"] = args.dataloader_prefetch_factor
        loader = self.accelerator.prepare(torch.utils.data.DataLoader(dataset, **params))
        # The sampler already takes this rank's share: accelerate's batch sharding must pass it through.
        shard = getattr(loader, "batch_sampler", None)
        if shard is not None and getattr(shard, "batch_sampler", None) is self._train_sampler:
            shard.num_processes, shard.process_index = 1, 0
        return loader

    def set_initial_training_values(self, args, dataloader):
        values = list(super().set_initial_training_values(args, dataloader))
        epochs = args.num_train_epochs
        if args.max_steps <= 0 and self._train_sampler is not None and float(epochs).is_integer():
            values[-1] = max(1, sum(self._update_steps(e) for e in range(int(epochs))))  # max_steps
            self._train_sampler.set_epoch(0)
        return tuple(values)

    def _update_steps(self, epoch: int) -> int:
        sampler = self._train_sampler
        assert sampler is not None  # called only with a sampler made
        sampler.set_epoch(epoch)
        return -(-len(sampler) // self.args.gradient_accumulation_steps)

    def _run_epoch(self, **kwargs):
        if self._train_sampler is not None:
            self._train_sampler.set_epoch(kwargs["epoch"])
            batches = len(self._train_sampler)
            kwargs["steps_in_epoch"] = batches
            kwargs["num_update_steps_per_epoch"] = max(1, self._update_steps(kwargs["epoch"]))
            if batches == 0:
                return None
        args = self.args
        device_filter = (
            args.logging_nan_inf_filter and hasattr(self, "_tr_loss") and hasattr(self, "_globalstep_last_logged")
        )
        if not device_filter:
            return super()._run_epoch(**kwargs)
        # Trainer's filter of non-finite losses reads the loss on the host: a sync every step,
        # which stalls the host behind the GPU. training_step applies the same rule on the device.
        args.logging_nan_inf_filter, self._filter_on_device = False, True
        try:
            return super()._run_epoch(**kwargs)
        finally:
            args.logging_nan_inf_filter, self._filter_on_device = True, False

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if getattr(self, "_filter_on_device", False) and isinstance(loss, torch.Tensor):
            # a non-finite loss counts as the mean of the losses since the last log (Trainer's rule)
            mean = self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
            loss = torch.where(torch.isfinite(loss), loss, mean.to(loss.dtype))
        return loss

    # ---- inputs and loss ---------------------------------------------------------------

    def _prepare_input(self, data):
        if isinstance(data, (RaggedBatch, RaggedTensor)):
            return data.to(self.args.device, non_blocking=True)
        return super()._prepare_input(data)

    def _get_num_items_in_batch(self, batch_samples, device):
        # Trainer counts labels != -100 with tensor methods a RaggedTensor lacks: count its values.
        if not getattr(self, "_loss_shifts_labels", False):
            batch_samples = [
                {**b, "labels": b["labels"].values}
                if isinstance(b, Mapping) and isinstance(b.get("labels"), RaggedTensor)
                else b
                for b in batch_samples
            ]
        return super()._get_num_items_in_batch(batch_samples, device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        graphs = self._graphs
        if graphs is not None:
            if model is self.model:
                graphs = self._graphs = self._graphs_of(graphs)
                model = _GraphedCall(graphs, model)
            elif _ddp_of(model, self.model):
                graphs = self._graphs = self._graphs_of(graphs)
                model = _DDPCall(model, _GraphedCall(graphs, self.model))
            elif not getattr(self, "_warned_graphs", False):
                self._warned_graphs = True
                warnings.warn(
                    f"{_NAME}: graphs=True runs eagerly here: the model is wrapped in "
                    f"{type(model).__name__}, not DistributedDataParallel; a converted encoder's layers "
                    "still replay their own graphs (ragged.nn.layer_graphs)",
                    stacklevel=2,
                )
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def _graphs_of(self, graphs):
        if graphs is True:
            return ragged.nn.graphed(
                self.model, max_tokens=self.max_tokens, max_batch_size=self.max_batch_size or self.max_tokens
            )
        return graphs

    def floating_point_ops(self, inputs) -> int:
        return super().floating_point_ops(_flat(inputs))

    def _track_num_input_tokens(self, inputs):
        # A RaggedTensor's values are its real tokens: what Trainer counts, padding aside.
        return super()._track_num_input_tokens(_flat(inputs))

    # ---- evaluation ------------------------------------------------------------------

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        return loss, _padded(logits), _padded(labels)


def _ddp_of(wrapper, model) -> bool:
    """Whether ``wrapper`` is a DistributedDataParallel of ``model``."""
    dist = torch.distributed
    if not dist.is_available():
        return False
    return isinstance(wrapper, torch.nn.parallel.DistributedDataParallel) and wrapper.module is model


class _DDPCall:
    """``call`` (the model's graphs) run as DistributedDataParallel runs its module: DDP's
    work before and after the forward (its reducer's preparation for the backward, buffer
    broadcast), the forward inside DDP's, where the graphs hand their gradients to autograd."""

    def __init__(self, ddp, call) -> None:
        self._ddp, self._call = ddp, call

    def __call__(self, **inputs):
        ddp = self._ddp
        args, kwargs = ddp._pre_forward(**inputs)
        with ddp._inside_ddp_forward():
            out = self._call(*args, **kwargs)
        return ddp._post_forward(out)

    def __getattr__(self, name):
        return getattr(self._ddp, name)


class _GraphedCall:
    """The model as ``Trainer.compute_loss`` calls it, through its graphs, which do not take
    ``num_items_in_batch`` (a graph cannot key on its value): most heads' losses ignore it, as
    HuggingFace's do; a masked-LM loss that divides by it (HuggingFace's ``loss_function``:
    :func:`ragged.nn.hf.forward.loss_function_head`) is the graphs' mean times the count of
    labelled tokens it averages, over ``num_items_in_batch``; another such head runs eagerly.
    Every attribute is the model's."""

    def __init__(self, graphs, model) -> None:
        self._graphs, self._model = graphs, model
        self._takes_items = hf_forward.loss_function_head(model) is not None

    def __call__(self, *args, **inputs):
        if args:  # DDP's input move hands keyword arguments back as keywords; positional ones pass through
            return self._graphs(*args, **inputs)
        items = inputs.pop("num_items_in_batch", None)
        if items is None or not self._takes_items:
            return self._graphs(**inputs)
        count = hf_forward.loss_items(self._model, inputs.get("labels"))
        if count is None:
            return self._model(**inputs, num_items_in_batch=items)
        out = self._graphs(**inputs)
        loss = out["loss"] if isinstance(out, Mapping) else out[0]
        if torch.is_tensor(items):
            items = items.to(loss.device)
        # a batch of no labelled token: the mean is NaN, HuggingFace's sum over none is 0
        scaled = torch.where(count > 0, loss * count / items, torch.zeros_like(loss))
        if not isinstance(out, Mapping):
            return (scaled, *out[1:])
        fresh = type(out)()  # a new output object: the graphs may hand out the same one again
        for key, value in out.items():
            fresh[key] = scaled if key == "loss" else value
        return fresh

    def __getattr__(self, name):
        return getattr(self._model, name)


def _check_graphs(graphs, model):
    """None (no graphs), True (built on first use) or the given Graphed of ``model``."""
    if graphs is False or graphs is None:
        return None
    if not (hf.is_hf_model(model) and hf.is_converted(model)):
        raise ValueError(
            f"{_NAME}(): graphs= needs a model converted by ragged.nn.convert (its forward takes the "
            f"RaggedTensor batches the graphs replay), got {type(model).__name__}, not converted"
        )
    if graphs is True:
        return True
    if isinstance(graphs, ragged.nn.Graphed):
        if graphs.module is not model:
            raise ValueError(
                f"{_NAME}(): expected graphs= to be a ragged.nn.Graphed of the trainer's model, got "
                f"one of another {type(graphs.module).__name__}"
            )
        return graphs
    raise TypeError(f"{_NAME}(): expected graphs= to be a bool or a ragged.nn.Graphed, got {describe(graphs)}")


def _flat(inputs):
    """The batch with each RaggedTensor as its ``values [T, ...]`` (for token counts)."""
    if not isinstance(inputs, Mapping):
        return inputs
    return {k: v.values if isinstance(v, RaggedTensor) else v for k, v in inputs.items()}


def _padded(x):
    """RaggedTensors (also inside tuples / lists) as ``[B, max_len, ...]`` padded with -100."""
    if isinstance(x, RaggedTensor):
        return x.to_padded(padding_value=-100)
    if isinstance(x, (tuple, list)):
        return type(x)(_padded(v) for v in x)
    return x


def _check_dataset(dataset) -> None:
    if dataset is None:
        return
    if (
        isinstance(dataset, torch.utils.data.IterableDataset)
        or not hasattr(dataset, "__len__")
        or not hasattr(dataset, "__getitem__")
    ):
        raise TypeError(
            f"{_NAME}(): expected train_dataset with a length and items by index (token-budget "
            f"batches are planned over the whole dataset), got {describe(dataset)}"
        )
    if len(dataset) == 0:
        # Trainer would fail later, on the empty loader's missing max_steps, without naming the dataset
        raise ValueError(
            f"{_NAME}(): expected a train_dataset with at least one sequence, got an empty {type(dataset).__name__}"
        )


def _is_hf_dataset(dataset) -> bool:
    return type(dataset).__module__.startswith("datasets.") and hasattr(dataset, "column_names")


def _read_lengths(dataset, column: str) -> np.ndarray:
    """Token counts of the dataset's sequences: its length column, else ``len(item["input_ids"])``."""
    names = getattr(dataset, "column_names", None)
    if _is_hf_dataset(dataset) and isinstance(names, list):
        if column in names:
            return np.asarray(dataset[column])
        if "input_ids" in names:
            return np.fromiter(map(len, dataset["input_ids"]), dtype=np.int64, count=len(dataset))
    lengths = np.empty(len(dataset), dtype=np.int64)
    for i in range(len(dataset)):
        item = dataset[i]
        ids = item.get("input_ids") if isinstance(item, Mapping) else None
        if ids is None or not hasattr(ids, "__len__"):
            got = f"keys {list(item.keys())}" if isinstance(item, Mapping) else describe(item)
            raise ValueError(
                f"{_NAME}(): expected every training item to be a mapping with 'input_ids' (or "
                f"lengths= or a {column!r} column), got item {i} with {got}"
            )
        lengths[i] = len(ids)
    return lengths
