"""Padding-free data-parallel fine-tuning: DDP or FSDP2 over token-budget batches.

Every rank builds the same tiny random ``BertForSequenceClassification``, converts it with
``ragged.nn.convert`` and trains it on a synthetic task with long-tailed lengths (4 to 256
tokens; the label says whether a sequence holds more even than odd token ids).
``TokenBudgetSampler`` plans each epoch identically on every rank and gives each rank its own
batches of at most ``--max-tokens`` tokens, with similar loads at each step; ``collate`` packs
them into RaggedTensors. The ranks' batches then hold different numbers of sequences, so the
loss is weighted with the sequence counts of the whole step, read from the sampler's plan
(see the training loop): the gradient is that of the mean loss over all the step's sequences.

Launch (CPU: gloo; GPUs: NCCL, one GPU per rank, bf16)::

    torchrun --nproc-per-node 2 examples/ddp_train.py --device cpu            # DDP
    torchrun --nproc-per-node 2 examples/ddp_train.py --device cpu --fsdp     # FSDP2
    torchrun --nproc-per-node 8 examples/ddp_train.py --device cuda --fsdp --steps 200
    python examples/ddp_train.py                                              # one process

``--fsdp`` makes each encoder layer an FSDP2 unit (``fully_shard(layer)``, then the model).
``python examples/ddp_train.py --help`` lists the sizes.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification

import ragged.nn
from ragged.data import TokenBudgetSampler, collate

CLS = 1  # ids below 6 are special; a sequence's other ids are drawn from [6, vocab)


def synthetic_dataset(size: int, vocab: int, seed: int) -> list[dict]:
    """``size`` examples ``{"input_ids": [CLS, ids...], "labels": 0 or 1}``: lengths lognormal
    (median 24) clipped to 4..256; label 1 when the sequence holds more even ids than odd ones.
    Each sequence favours even or odd ids (70/30), so its label can be read from few tokens."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(24), 0.9, size), 4, 256).astype(np.int64)
    data = []
    for n in lengths.tolist():
        even = rng.random(n - 1) < rng.choice((0.3, 0.7))
        ids = 6 + 2 * rng.integers(0, (vocab - 6) // 2, n - 1) + ~even  # even where even
        label = int(2 * even.sum() > n - 1)
        data.append({"input_ids": np.concatenate(([CLS], ids)), "labels": label})
    return data


def init_distributed(device_type: str) -> torch.device:
    """Join the group torchrun describes, or form a group of one process when run alone."""
    if "RANK" not in os.environ:
        with socket.socket() as s:  # a free port on this machine for the one-process group
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def wrap(model: torch.nn.Module, args, device: torch.device) -> torch.nn.Module:
    if not args.fsdp:
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    for layer in model.bert.encoder.layer:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def step_totals(sampler: TokenBudgetSampler) -> tuple[np.ndarray, np.ndarray]:
    """``[steps]`` sequences and tokens of each step of the current epoch, over all ranks.

    Read from the sampler's plan, which is the same on every rank: no communication.
    ``step_loads(cost)[i, r]`` is the cost of rank r's batch at step i (the batch that rank's
    loader yields i-th); a cost of 1 per sequence counts the batch's sequences.
    """
    sequences = sampler.step_loads(cost=lambda lengths: np.ones(len(lengths))).sum(1)
    return sequences, sampler.step_loads("tokens").sum(1)


def train(args, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP would broadcast them anyway)
    vocab = 64
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        num_labels=2,
    )
    model = ragged.nn.convert(BertForSequenceClassification(config)).to(device)
    model = wrap(model, args, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # after wrapping: FSDP2 shards
    autocast = device.type == "cuda" and not args.fsdp  # FSDP2 casts by its policy

    dataset = synthetic_dataset(args.examples, vocab, seed=0)
    sampler = TokenBudgetSampler(
        [len(x["input_ids"]) for x in dataset], max_tokens=args.max_tokens, shuffle=True, seed=0
    )  # num_replicas, rank from dist
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, pin_memory=device.type == "cuda")
    if rank == 0:
        b = sampler.balance()
        print(
            f"{world} ranks ({'FSDP2' if args.fsdp else 'DDP'}, {device.type}), {len(sampler)} steps per "
            f"epoch; token loads max/mean per step: worst {b.worst:.3f}, mean {b.mean:.3f}, "
            f"efficiency {b.efficiency:.1%}",
            flush=True,
        )

    model.train()
    step, epoch, sequences, tokens, loss_total = 0, 0, 0, 0, torch.zeros((), device=device)
    start = time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)
        step_sequences, step_tokens = step_totals(sampler)
        for i, batch in enumerate(loader):  # input_ids: a RaggedTensor; labels: [B]
            batch = batch.to(device, non_blocking=True)
            with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
                logits = model(input_ids=batch["input_ids"]).logits  # [B, 2]
            loss_sum = F.cross_entropy(logits.float(), batch["labels"], reduction="sum")
            # DDP and FSDP average gradients over the W ranks. With this rank's *sum* of
            # per-sequence losses scaled by W / N (N: the step's sequences over all ranks) the
            # average is (1/W) sum_r (W/N) sum_{j in r} grad l_j = (1/N) sum_j grad l_j: the
            # gradient of the mean loss over the union of the ranks' batches. A mean per rank
            # would weigh a sequence of a 10-sequence batch like 3 of a 30-sequence one.
            (loss_sum * (world / step_sequences[i])).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            sequences += int(step_sequences[i])
            tokens += int(step_tokens[i])
            loss_total += loss_sum.detach()
            if step % args.log_every == 0 or step == args.steps:
                dist.all_reduce(loss_total)  # for display only: the mean loss since the last line
                elapsed = time.perf_counter() - start
                if rank == 0:
                    print(
                        f"step {step:4d}  loss {loss_total.item() / sequences:.4f}  "
                        f"{tokens / elapsed:,.0f} tokens/s (all ranks)",
                        flush=True,
                    )
                sequences, tokens, start = 0, 0, time.perf_counter()
                loss_total.zero_()
            if step == args.steps:
                break
        epoch += 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (each encoder layer a unit) instead of DDP")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--examples", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=1024, help="token budget of one rank's batch")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args(argv)

    device = init_distributed(args.device)
    train(args, device)
    # Free the model (DDP's reducer, FSDP's state) and let every rank arrive before the group
    # goes: gloo's threads otherwise sometimes abort or hang at exit (torch 2.13, CPU).
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
