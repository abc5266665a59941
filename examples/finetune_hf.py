"""Padding-free fine-tuning of a HuggingFace sequence classifier: batches cut by a token budget,
collated into RaggedTensors, never padded.

Synthetic task: each example is a sequence of token ids; its label is whether a marker token
occurs in it. ``ragged.data.TokenBudgetSampler`` cuts the dataset into batches of at most
``--max-tokens`` tokens, ``ragged.data.collate`` turns each batch into RaggedTensors (plus the
``[B]`` labels), and ``ragged.nn.convert`` makes ``AutoModelForSequenceClassification`` take
them: every layer runs on the real tokens only.

Without ``--model`` the classifier is a tiny BERT built from a config (random weights: a few
seconds on a CPU); ``--model PATH`` loads a BERT-family checkpoint folder and draws the ids from
its tokenizer's vocabulary. ``python examples/finetune_hf.py --help``.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig

import ragged.nn
from ragged.data import TokenBudgetSampler, collate


def synthetic_dataset(size: int, vocab: int, cls: int, sep: int, marker: int, gen: torch.Generator) -> list[dict]:
    """``size`` examples as a tokenized dataset holds them: ``[CLS] ids... [SEP]`` of 3 to 64
    tokens (ids drawn from ``[5, vocab)``, never the marker), label 1 when the marker was put in."""
    data = []
    for _ in range(size):
        n = int(torch.randint(1, 63, (), generator=gen))
        ids = torch.randint(5, vocab, (n,), generator=gen)
        ids[ids == marker] = 5
        label = int(torch.randint(0, 2, (), generator=gen))
        if label:
            ids[int(torch.randint(0, n, (), generator=gen))] = marker
        data.append({"input_ids": [cls, *ids.tolist(), sep], "labels": label})
    return data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", metavar="PATH", help="a BERT-family checkpoint folder (default: a tiny random BERT)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=1024, help="token budget of a batch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    device = torch.device(args.device)

    if args.model is None:
        config = BertConfig(
            vocab_size=64,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            num_labels=2,
        )
        model = AutoModelForSequenceClassification.from_config(config)
        vocab, cls, sep = config.vocab_size, 2, 3
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2)
        vocab, cls, sep = model.config.vocab_size, tokenizer.cls_token_id, tokenizer.sep_token_id
    model = ragged.nn.convert(model).to(device)  # forward patched in place: same modules and parameters
    dataset = synthetic_dataset(args.examples, vocab, cls, sep, marker=vocab - 1, gen=torch.Generator().manual_seed(0))

    sampler = TokenBudgetSampler(
        [len(x["input_ids"]) for x in dataset], max_tokens=args.max_tokens, shuffle=True, seed=0
    )
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, pin_memory=device.type == "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:  # input_ids: a RaggedTensor; labels: [B]
            batch = batch.to(device, non_blocking=True)
            out = model(**batch)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 5 == 0:
                ids = batch["input_ids"]
                print(
                    f"epoch {epoch} step {step:3d}: {ids.batch_size:3d} sequences, {ids.values.numel():4d} tokens "
                    f"(longest {ids.max_len:2d}), loss {out.loss.item():.4f}"
                )
            step += 1

    model.eval()
    with torch.no_grad():
        batch = collate(dataset[:128]).to(device)
        accuracy = (model(**batch).logits.argmax(-1) == batch["labels"]).float().mean().item()
    print(f"accuracy on the first 128 examples: {accuracy:.2f}")


if __name__ == "__main__":
    main()
