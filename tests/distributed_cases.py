"""Data-parallel training cases shared by the CPU (gloo) and GPU distributed tests.

:func:`run_world` starts ``world`` processes (spawned, a file rendezvous) that each run
:func:`step` on their share of a batch under DDP or FSDP2 and send rank 0's gradients back as
numpy arrays; :func:`union_grads` computes the gradients of one process on the union of the
ranks' batches. The loss is a sum over the rank's tokens (or sequences) divided by a constant,
so that the engine's mean over ranks equals the union's loss divided by ``world``.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import tempfile
import time
import traceback

import numpy as np
import torch
import torch.multiprocessing as mp

import ragged

KINDS = ("encoder", "bert", "llama")
# fsdp-bf16: FSDP2 with MixedPrecisionPolicy(param_dtype=bf16); ddp-layer-graphs: DDP with the
# converted model's layers replayed from their graphs (emulated off the GPU), after two warm-up steps;
# ddp-graphed: DDP over ragged.nn.graphed of the model (off the GPU its graphs emulated),
# the step three times (the first captures, the others replay); ddp-graphed-accumulate: the same
# with each step's batch run twice, first under no_sync() (the gradients are twice the step's)
MODES = ("ddp", "fsdp", "fsdp-bf16", "ddp-layer-graphs", "ddp-graphed", "ddp-graphed-accumulate")
GRAPHED_MODES = ("ddp-graphed", "ddp-graphed-accumulate")
GRAPHED_KINDS = ("encoder", "bert")  # what ragged.nn.graphed takes (the Llama runs HuggingFace's own forward)
LAYER_GRAPH_KINDS = ("encoder", "bert")  # models whose layers replay graphs of their own
SCALE = 50.0
# Each rank's sequences: odd sizes, a 1, one long sequence, and a rank with fewer tokens.
LENGTHS = ([5, 1, 13, 2], [9, 30, 3])
SAMPLER_LENGTHS = [7, 0, 31, 12, 5, 19, 1, 44, 8, 3, 26]


def build(kind: str, device: str):
    """The model of ``kind``, seeded: the same weights in every process."""
    torch.manual_seed(0)
    if kind == "encoder":
        import ragged.nn as rnn

        # head dim 16 everywhere: the smallest the attention kernels take (below it, the reference runs)
        layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        model = rnn.TransformerEncoder.from_torch(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    elif kind == "bert":
        from transformers import BertConfig, BertForSequenceClassification

        import ragged.nn as rnn

        config = BertConfig(
            vocab_size=97,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=3,
            initializer_range=0.2,
        )
        model = rnn.convert(BertForSequenceClassification(config))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        import ragged.integrations.transformers  # noqa: F401  (attn_implementation="ragged")

        config = LlamaConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=128,
            initializer_range=0.2,
            attention_dropout=0.0,
        )
        model = LlamaForCausalLM(config)
        model.set_attn_implementation("ragged")
    return model.to(device).train()


def layers(kind: str, model) -> list:
    if kind == "encoder":
        return list(model.layers)
    if kind == "bert":
        return list(model.bert.encoder.layer)
    return list(model.model.layers)


def data(kind: str, lengths: list[int], seed: int):
    """Fresh random inputs of one rank (or of the union, ``lengths`` concatenated)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "encoder":
        return ragged.pack([torch.randn(n, 32, generator=g) for n in lengths])
    return [torch.randint(0, 97, (n,), generator=g) for n in lengths]


def rank_data(kind: str, rank: int):
    """Rank ``rank``'s batch (host tensors: :func:`loss_of` moves them)."""
    return data(kind, LENGTHS[rank], 100 + rank)


def union_data(kind: str):
    parts = [rank_data(kind, r) for r in range(len(LENGTHS))]
    if kind == "encoder":
        return ragged.pack([s for p in parts for s in p.unbind()])
    return [s for p in parts for s in p]


def loss_of(kind: str, model, batch, device: str) -> torch.Tensor:
    """A sum over the batch's tokens (sequences for the classifier) over :data:`SCALE`."""
    if kind == "encoder":
        rt = ragged.RaggedTensor(batch.values.to(device), batch.offsets.to(device), batch.max_len)
        out = model(rt).values.float()
        weight = torch.linspace(-1, 1, out.shape[-1], device=device)
        return (out * weight).sum() / SCALE
    ids = torch.cat(batch).to(device)
    lengths = torch.tensor([len(s) for s in batch])
    if kind == "bert":
        rt = ragged.RaggedTensor.from_lengths(ids, lengths.tolist())
        labels = torch.tensor([int(s.sum()) % 3 for s in batch], device=device)
        logits = model(input_ids=rt).logits.float()
        return torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / SCALE
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()]).to(device)
    m = int(lengths.max())
    logits = (
        model(
            input_ids=ids[None],
            position_ids=positions[None],
            cu_seq_lens_q=cu.to(device),
            cu_seq_lens_k=cu.to(device),
            max_length_q=m,
            max_length_k=m,
        )
        .logits[0]
        .float()
    )
    # next-token targets inside each sequence (the last token of a sequence predicts nothing)
    last = torch.zeros(ids.shape[0], dtype=torch.bool)
    last[(cu[1:] - 1).long()] = True
    keep = (~last).to(device)
    targets = torch.roll(ids, -1)
    return torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum") / SCALE


def wrap(kind: str, model, mode: str, device: str):
    ids = [torch.cuda.current_device()] if device == "cuda" else None
    if mode in ("ddp", "ddp-layer-graphs"):
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if mode in GRAPHED_MODES:
        import ragged.nn as rnn

        graphed = rnn.Graphed(model, 128, 8)  # off the GPU: run inside graph_switch.emulated()
        return torch.nn.parallel.DistributedDataParallel(graphed, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device, (torch.distributed.get_world_size(),))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mode == "fsdp-bf16"
        else MixedPrecisionPolicy()
    )
    for layer in layers(kind, model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _worker(rank: int, world: int, path: str, kind: str, mode: str, device: str, backend: str, queue) -> None:
    try:
        if device == "cuda":  # gloo: every rank shares the first GPU; nccl: a GPU per rank
            torch.cuda.set_device(rank % torch.cuda.device_count() if backend == "nccl" else 0)
        torch.distributed.init_process_group(
            backend, init_method=f"file://{path}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
        )
        model = build(kind, device)
        wrapped = wrap(kind, model, mode, device)
        if mode == "ddp-layer-graphs":
            from ragged.nn import layer_graphs

            with layer_graphs.emulated() if device == "cpu" else contextlib.nullcontext():
                for _ in range(3):  # the first step eager, the second captures, the third replays
                    model.zero_grad(set_to_none=True)
                    loss = loss_of(kind, wrapped, rank_data(kind, rank), device)
                    loss.backward()
                replayed = sum(len(s.entries) for s in layer_graphs._STATES.values())
                assert replayed > 0, "no layer ran from its graphs"
        elif mode in GRAPHED_MODES:
            from ragged.nn import graph_switch

            with graph_switch.emulated() if device == "cpu" else contextlib.nullcontext():
                for _ in range(3):  # the first step captures the bucket's graphs, the others replay
                    model.zero_grad(set_to_none=True)
                    batch = rank_data(kind, rank)
                    if mode == "ddp-graphed-accumulate":
                        with wrapped.no_sync():
                            loss_of(kind, wrapped, batch, device).backward()
                    loss = loss_of(kind, wrapped, batch, device)
                    loss.backward()
            entries = [e.graph for k, e in wrapped.module._graphs.items() if k[1] and e.graph is not None]
            # two layers: the backward in two segments, DDP reducing the top one's while the bottom one runs
            assert entries and all(len(e.bwd) == 2 and e.deliver is not None for e in entries), "not delivered"
        else:
            loss = loss_of(kind, wrapped, rank_data(kind, rank), device)
            loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad
            if g is not None and hasattr(g, "full_tensor"):
                g = g.full_tensor()  # a collective: every rank takes part
            grads[name] = None if g is None else g.detach().float().cpu().numpy()
        # the sampler's replicas default to the process group's
        from ragged.data import TokenBudgetSampler

        sampler = TokenBudgetSampler(SAMPLER_LENGTHS, 40, seed=3)
        plans = [None] * world
        torch.distributed.all_gather_object(plans, (sampler.num_replicas, sampler.rank, list(sampler)))
        if rank == 0:
            queue.put(("ok", (grads, plans)))
        # every rank arrives before the group goes (gloo's threads can otherwise abort at exit)
        del wrapped, model, loss
        gc.collect()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except BaseException:  # report, so that the parent does not wait for a result that never comes
        queue.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def run_world(
    kind: str, mode: str, device: str = "cpu", backend: str = "gloo", world: int = 2, timeout: float = 240.0
) -> tuple[dict[str, np.ndarray | None], list]:
    """Rank 0's gradients after one step of ``world`` processes (raises with a rank's traceback),
    and every rank's ``(num_replicas, rank, batches)`` of a default TokenBudgetSampler."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    fd, path = tempfile.mkstemp(prefix="ragged_dist_")
    os.close(fd)
    os.unlink(path)  # the rendezvous file must not exist yet
    procs = [
        ctx.Process(target=_worker, args=(r, world, path, kind, mode, device, backend, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout
        while queue.empty():  # a rank that dies without reporting, or a hang, fails the test
            if time.monotonic() > deadline or not any(p.is_alive() for p in procs) and queue.empty():
                raise AssertionError(
                    f"no result from the {world} workers of {kind} {mode} "
                    f"(exit codes {[p.exitcode for p in procs]}, {timeout:.0f} s)"
                )
            time.sleep(0.2)
        status, payload = queue.get()
        for p in procs:
            p.join(max(1.0, min(60.0, deadline - time.monotonic())))
    finally:
        stuck = [p for p in procs if p.is_alive()]
        for p in stuck:  # a worker that hangs in the group's teardown after its result
            p.kill()
        if os.path.exists(path):
            os.unlink(path)
    if status != "ok":
        raise AssertionError(payload)
    bad = [p.exitcode for p in procs if p not in stuck and p.exitcode != 0]
    assert not bad, f"worker exit codes {bad}"
    return payload


def union_grads(kind: str, device: str = "cpu", mode: str = "ddp") -> dict[str, np.ndarray | None]:
    """One process, the union of the ranks' batches, the loss over the world size (twice the
    gradients for ``ddp-graphed-accumulate``, which runs each batch twice)."""
    model = build(kind, device)
    times = 2 if mode == "ddp-graphed-accumulate" else 1
    (loss_of(kind, model, union_data(kind), device) * (times / len(LENGTHS))).backward()
    return {n: None if p.grad is None else p.grad.detach().float().cpu().numpy() for n, p in model.named_parameters()}
