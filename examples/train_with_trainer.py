"""Fine-tuning a converted HuggingFace classifier with ``transformers.Trainer`` on ragged batches:
``ragged.integrations.trainer.RaggedTrainer``.

Synthetic task: a sequence's label is whether a marker token occurs in it. The trainer cuts the
training set into batches of at most ``--max-tokens`` real tokens (``TokenBudgetSampler``),
collates them into RaggedTensors (``ragged.data.collate``), accumulates gradients over
``--grad-accum`` batches and evaluates on a held-out set; the model is a tiny BERT from a config
(random weights, seconds on a CPU).

On a GPU, ``--graphs`` replays each training and evaluation step from CUDA graphs per bucket
(``RaggedTrainer(graphs=True)``, built on :func:`ragged.nn.graphed`).

Data parallel: ``torchrun --nproc-per-node 2 examples/train_with_trainer.py`` (gloo on CPU): each
rank takes its own token-budget batches, the same number of steps on every rank.

The model is told that its loss takes no ``num_items_in_batch`` (``model.accepts_loss_kwargs =
False``): a sequence classifier's loss is the mean over its batch, and transformers' ``Trainer``,
seeing a ``forward`` with ``**kwargs``, would otherwise take that loss as normalised over all the
accumulated batches. It would then add up the ``--grad-accum`` batches' mean losses (logging, and
stepping on, twice the mean at ``--grad-accum 2``) and multiply the loss by the number of processes
under ``torchrun`` (the eval loss too), as it does for the unconverted HuggingFace model. With the
flag, the logged training loss is the mean over the accumulated batches, on the eval loss's scale.
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, BertConfig, TrainerCallback, TrainingArguments

import ragged.nn
from ragged.integrations.trainer import RaggedTrainer


def synthetic_dataset(size: int, vocab: int, marker: int, gen: np.random.Generator) -> list[dict]:
    """``[CLS] ids... [SEP]`` of 3 to 48 tokens; label 1 when the marker was put in."""
    data = []
    for _ in range(size):
        ids = gen.integers(5, marker, int(gen.integers(1, 47)))
        label = int(gen.integers(0, 2))
        if label:
            ids[gen.integers(0, ids.size)] = marker
        data.append({"input_ids": [2, *ids.tolist(), 3], "labels": label})
    return data


class PrintLosses(TrainerCallback):
    """Trainer's logged loss: the mean over the batches accumulated into each optimizer step, averaged
    over the steps since the last log (``accepts_loss_kwargs = False``, see the module's docstring)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step:3d} (epoch {state.epoch:.2f}): training loss {logs['loss']:.4f}")


def accuracy(prediction) -> dict:
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=768)
    parser.add_argument("--max-tokens", type=int, default=768, help="token budget of a batch (per rank)")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even where a GPU is found")
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="replay the steps from CUDA graphs (RaggedTrainer(graphs=True); a GPU, one process)",
    )
    args = parser.parse_args(argv)

    config = BertConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_labels=2
    )
    torch.manual_seed(0)
    model = ragged.nn.convert(AutoModelForSequenceClassification.from_config(config))
    # The classifier's loss is its batch's mean: Trainer must average the accumulated batches'
    # losses itself, not add them up (see the module's docstring).
    model.accepts_loss_kwargs = False
    data = synthetic_dataset(args.examples + 128, config.vocab_size, config.vocab_size - 1, np.random.default_rng(0))
    train, val = data[: args.examples], data[args.examples :]

    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            out,
            num_train_epochs=args.epochs,
            learning_rate=args.lr,
            gradient_accumulation_steps=args.grad_accum,
            per_device_eval_batch_size=64,
            eval_strategy="epoch",
            logging_steps=5,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=args.cpu or not torch.cuda.is_available(),
            seed=0,
        )
        trainer = RaggedTrainer(
            model,
            training,
            train_dataset=train,
            eval_dataset=val,
            max_tokens=args.max_tokens,
            compute_metrics=accuracy,
            callbacks=[PrintLosses()],
            graphs=args.graphs,
        )
        if training.process_index == 0:
            print(
                f"training loss: the mean over the {args.grad_accum} batch(es) accumulated per optimizer step, "
                "comparable with the eval loss (the model's loss is a per-batch mean: accepts_loss_kwargs=False)"
            )
        before = trainer.evaluate()
        result = trainer.train()
        after = trainer.evaluate()
    if training.process_index == 0:
        print(
            f"{training.world_size} process(es), {result.global_step} optimizer steps, "
            f"final training loss {result.training_loss:.4f}"
        )
        print(
            f"eval loss {before['eval_loss']:.4f} -> {after['eval_loss']:.4f}, "
            f"eval accuracy {before['eval_accuracy']:.2f} -> {after['eval_accuracy']:.2f}"
        )


if __name__ == "__main__":
    main()
