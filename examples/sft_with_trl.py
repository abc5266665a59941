"""Supervised fine-tuning of a causal LM with TRL's ``SFTTrainer`` and ``padding_free=True`` on
``attn_implementation="ragged"``.

TRL's padding-free collator puts a batch's sequences end to end in one row and restarts
``position_ids`` at each sequence; ragged's attention reads the sequences from those positions
(see :mod:`ragged.integrations.transformers`) and attends within each one, so no token is padding and no sequence sees
another. The model is a tiny Llama from a config (random weights, seconds on a CPU), the data a
synthetic language (each sequence counts up from a random start, so the loss can fall). The
script checks, before training, that the padding-free loss of a batch equals the mean of the
same model's per-sequence losses (to float32 rounding), then trains and prints the loss curve.

``--convert`` trains ``ragged.nn.convert`` of the model instead (the decoder core on the same
padding-free batches, the loss from the hidden states without logits).

Needs this project's ``trl`` extra (``pip install -e ".[trl]"`` from a checkout: TRL, which brings
``datasets``); where a module of it is missing, exits with status 1 naming the module and that line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import numpy as np
import torch


def counting_dataset(n: int, vocab: int, rng: np.random.Generator) -> list[dict]:
    """Sequences of 4..48 tokens that count up (mod the vocabulary) from a random start."""
    out = []
    for _ in range(n):
        length, start = int(rng.integers(4, 49)), int(rng.integers(3, vocab))
        out.append({"input_ids": [3 + (start + i) % (vocab - 3) for i in range(length)]})
    return out


def tokenizer(vocab: int):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def padding_free_matches_per_sequence(model, collator, batch: list[dict]) -> float:
    """Largest difference between the padding-free loss of ``batch`` (token-weighted mean) and
    the same mean computed one sequence at a time."""
    flat = collator(batch)
    with torch.no_grad():
        together = float(model(**flat).loss)
        sums, count = 0.0, 0
        for item in batch:
            ids = torch.tensor([item["input_ids"]])
            n = ids.shape[1] - 1  # predicted tokens
            sums += float(model(input_ids=ids, labels=ids).loss) * n
            count += n
    return abs(together - sums / count)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even where a GPU is found")
    parser.add_argument("--convert", action="store_true", help="train ragged.nn.convert(model), the decoder core")
    args = parser.parse_args(argv)
    try:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer
    except ImportError as e:
        missing = e.name or str(e)
        print(
            f"sft_with_trl.py: the module '{missing}' could not be imported ({e}); it comes with this project's "
            f'trl extra: pip install -e ".[trl]" (from the checkout)',
            file=sys.stderr,
        )
        return 1
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    import ragged.integrations.transformers  # noqa: F401  (registers attn_implementation="ragged")

    vocab = 64
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if args.convert:
        import ragged.nn

        ragged.nn.convert(model)
    else:
        model.set_attn_implementation("ragged")
    data = counting_dataset(args.examples, vocab, np.random.default_rng(0))

    losses = []

    class Record(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    with tempfile.TemporaryDirectory() as out:
        cfg = SFTConfig(
            out,
            padding_free=True,
            per_device_train_batch_size=args.batch,
            max_steps=args.steps,
            learning_rate=args.lr,
            logging_steps=10,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=args.cpu or not torch.cuda.is_available(),
            seed=0,
            max_length=None,
            dataset_kwargs={"skip_prepare_dataset": True},
            remove_unused_columns=False,
        )
        trainer = SFTTrainer(
            model, cfg, train_dataset=Dataset.from_list(data), processing_class=tokenizer(vocab), callbacks=[Record()]
        )
        model.eval()
        diff = padding_free_matches_per_sequence(model.to(trainer.args.device), trainer.data_collator, data[:8])
        print(f"padding-free loss vs per-sequence losses: |difference| {diff:.2e}")
        if diff > 1e-4:
            print("the padding-free loss differs from the per-sequence one")
            return 1
        trainer.train()
    print("training loss every 10 steps: " + " ".join(f"{x:.3f}" for x in losses))
    if len(losses) >= 2 and not losses[-1] < losses[0]:
        print("the loss did not fall")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
