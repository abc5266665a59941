"""``python -m bench.ddp``: data-parallel training (DistributedDataParallel) on 1..N GPUs, ragged
against HuggingFace's padded baseline.

    python -m bench.ddp [--gpus 1 2] [--workload fine-tune lm] [--quick] [--out FILE.md]
                        [--device auto|cpu|cuda] [--steps N] [--processes row|world]

Every row trains the same seeded random model (DDP also broadcasts rank 0's weights) on the same
dataset (seeded lognormal lengths, random token ids) with AdamW (lr 1e-5, fused on CUDA):

* ``HF SDPA padded + DistributedSampler`` (the baseline): ``attn_implementation="sdpa"``; each
  rank takes ``DistributedSampler(shuffle=True, seed=0)``'s indices in batches of a fixed number
  of sequences (fine-tune 32, lm 8), right-padded to the longest, with an ``attention_mask``
  (causal LM: labels -100 at padding).
* ``ragged + DistributedSampler (unbalanced)``: the same batches without padding.
* ``ragged + balanced TokenBudgetSampler``: ``TokenBudgetSampler(lengths, budget, shuffle=True,
  seed=0, num_replicas=W, rank=r)``, budget = the baseline's sequences per batch x the mean
  length; its steps deal batches of similar token counts to the ranks.
* ``ragged graphed + balanced TokenBudgetSampler`` (fine-tune): the same batches through
  ``DistributedDataParallel(ragged.nn.graphed(converted))`` (largest bucket: the budget), each
  step's forward and backward replayed from its bucket's CUDA graphs, the gradients handed to
  DDP's reducer.

Fine-tune: ``BertForSequenceClassification``, ragged: ``ragged.nn.convert`` on
``ragged.data.collate`` batches; lm: ``LlamaForCausalLM``, ragged: ``attn_implementation="ragged"``
on ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` batches. GPU: BERT-base (dropout
0.1) and a Llama of about 0.5B in bf16; CPU: tiny float32 models, no dropout (a smoke run).

A world size W runs W spawned processes (one GPU each, NCCL; gloo on the CPU), each pinned to
its own share of the host's cores. Each rank builds
its batches on the host first (as a DataLoader's workers would), then runs: warm-up steps (the
first in eval mode under ``no_sync()``, no update: the loss at initialisation, kernels compiled
rank by rank), then every timed batch's forward + backward twice under ``no_sync()`` with no update
(the steady state of a later epoch: cuBLAS's choices, each bucket's graphs captured: whole-model
graphs capture a bucket when they first meet it, layer graphs the second time); the timed
steps (copy to the device, forward, backward with DDP's all-reduce,
AdamW step; wall time from a barrier to a synchronize); an untimed pass over the same batches,
each rank timing its own forward + backward under ``no_sync()`` between synchronizes.

Columns (per world size, ``rank`` = one GPU):

* ``tokens/s per GPU``: real tokens (padding never counted) of all ranks' timed steps / the
  slowest rank's wall time / W; ``seqs/s per GPU`` the same in sequences; ``ms/step``: it / steps.
* ``spread ms``: per step, the slowest rank's local forward + backward minus the fastest's, in
  the untimed pass, averaged over the steps: the time a step's fastest rank would wait at the
  all-reduce; ``spread/step``: it over ``ms/step``.
* ``load max/mean``: per step, the largest rank load over the mean rank load, averaged over the
  timed steps; the load is the tokens a rank computes (padded tokens for the baseline; for the
  balanced row, ``sampler.balance()``'s token loads).
* ``scaling``: tokens/s per GPU at W / at W=1 (same row); ``vs padded``, ``spread vs padded``:
  over the baseline's at the same W; ``loss diff``: |loss at initialisation - the baseline's| on
  the same first batches (unbalanced row: both models must compute the same loss).

GPU targets (reported, never asserted, not judged on CPU), balanced ragged row at W > 1: scaling >=
90%, spread <= 1/3 of the baseline's. ``--processes row`` (CUDA's default) spawns fresh processes
for every row (an empty GPU each); ``world`` (the CPU's: start-up dominates) runs a world size's
rows in the same processes. A rank that raises reports the exception; its peers are stopped after a
grace period; rows left unrun are failed. ``--out FILE.md`` also writes ``FILE.json`` (raw numbers).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import queue as queue_module
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.ddp_report import (  # noqa: F401  (SCALING_TARGET, SPREAD_TARGET, UNBALANCED: re-exported)
    BALANCED,
    GRAPHED,
    GRAPHED_WORKLOADS,
    PADDED,
    ROWS,
    SCALING_TARGET,
    SPREAD_TARGET,
    UNBALANCED,
    derive,
    markdown,
)
from bench.suites.hf import BERT_BASE, LLAMA_05B, SEED, TINY_BERT, TINY_LLAMA, Lengths, pad_batch, quiet

COLLECTIVE_TIMEOUT_S = 300  # init and every collective; a stuck row is stopped by the parent sooner
GRACE_S = 30.0  # after one rank failed, how long its peers get to finish before they are killed
ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@dataclasses.dataclass(frozen=True)
class Spec:
    """A workload: ``per_rank`` sequences per baseline batch, ``sequences`` in the dataset at
    least, ``steps`` timed steps at most (``--steps`` overrides), ``warmup`` steps before."""

    name: str
    model: Any  # Bert | Llama
    dtype: torch.dtype
    lengths: Lengths
    per_rank: int
    sequences: int
    steps: int
    warmup: int
    dropout: float = 0.0

    def dataset_size(self, max_world: int) -> int:
        """Sequences: enough for the warm-up and timed steps of the baseline at the largest W."""
        return max(self.sequences, self.per_rank * max_world * (self.warmup + self.steps + 2))

    def describe(self) -> str:
        return f"{self.model.name()}, {self.lengths.text()}, {str(self.dtype).replace('torch.', '')}"


def workloads(on_gpu: bool, quick: bool) -> dict[str, Spec]:
    if on_gpu:
        steps = 8 if quick else 32
        return {
            "fine-tune": Spec(
                "fine-tune",
                BERT_BASE,
                torch.bfloat16,
                Lengths(16, 512, 96, 1.0),
                32,
                1024 if quick else 4096,
                steps,
                3,
                dropout=0.1,
            ),
            "lm": Spec(
                "lm",
                LLAMA_05B,
                torch.bfloat16,
                Lengths(32, 2048, 256, 1.0),
                8,
                192 if quick else 448,
                steps if quick else 24,
                3,
            ),
        }
    steps = 3 if quick else 8
    return {
        "fine-tune": Spec("fine-tune", TINY_BERT, torch.float32, Lengths(4, 48, 12, 0.8), 4, 32, steps, 2),
        "lm": Spec("lm", TINY_LLAMA, torch.float32, Lengths(4, 64, 16, 0.8), 4, 32, steps, 2),
    }


# --------------------------------------------------------------------------------------
# The dataset and each rank's batches (the same in the parent and in every worker)


def dataset_lengths(spec: Spec, n: int) -> list[int]:
    return spec.lengths.draw(n, SEED)


def budget(spec: Spec, lengths: list[int]) -> int:
    """The balanced row's tokens per batch: the baseline's sequences per batch x the mean length."""
    return max(1, round(spec.per_rank * float(np.mean(lengths))))


def sampler(spec: Spec, lengths: list[int], world: int, rank: int):
    from ragged.data import TokenBudgetSampler

    return TokenBudgetSampler(lengths, budget(spec, lengths), shuffle=True, seed=0, num_replicas=world, rank=rank)


def plan(spec: Spec, row: str, lengths: list[int], world: int, rank: int) -> list[list[int]]:
    """Every batch of rank ``rank``'s epoch, as dataset indices."""
    if row in (BALANCED, GRAPHED):
        return list(sampler(spec, lengths, world, rank))
    from torch.utils.data import DistributedSampler

    order = list(DistributedSampler(range(len(lengths)), num_replicas=world, rank=rank, shuffle=True, seed=0))
    return [order[i : i + spec.per_rank] for i in range(0, len(order) - spec.per_rank + 1, spec.per_rank)]


def items(spec: Spec, lengths: list[int]):
    """``item(i)``: sequence i as a dict of lists (``input_ids``; fine-tune: an int ``labels``)."""
    rng = np.random.default_rng(SEED + 1)
    low = 5 if spec.name == "fine-tune" else 0
    ids = rng.integers(low, spec.model.vocab, sum(lengths))
    labels = rng.integers(0, 2, len(lengths))
    starts = np.concatenate(([0], np.cumsum(lengths)))

    def item(i: int) -> dict:
        out = {"input_ids": ids[starts[i] : starts[i + 1]].tolist()}
        if spec.name == "fine-tune":
            out["labels"] = int(labels[i])
        return out

    return item


@dataclasses.dataclass(frozen=True)
class Job:
    """One row at one world size: its batches are ``plan(...)[warmup:warmup + steps]`` timed."""

    spec: Spec
    row: str
    world: int
    sequences: int
    steps: int


# --------------------------------------------------------------------------------------
# The worker (one process per rank)


def _build(job: Job, device: torch.device):
    """The row's model on ``device`` (seeded), and the function that makes a host batch."""
    from transformers import BertForSequenceClassification, DataCollatorWithFlattening, LlamaForCausalLM

    spec, ragged_row = job.spec, job.row != PADDED
    with quiet():
        torch.manual_seed(SEED)
        with torch.device(device):
            if spec.name == "fine-tune":
                config = spec.model.config(
                    num_labels=2, hidden_dropout_prob=spec.dropout, attention_probs_dropout_prob=spec.dropout
                )
                model = BertForSequenceClassification(config)
            else:
                model = LlamaForCausalLM(spec.model.config())
        model = model.to(spec.dtype)
        model.set_attn_implementation("sdpa")
        if ragged_row and spec.name == "fine-tune":
            import ragged.nn as rnn

            model = rnn.convert(model)
            if job.row == GRAPHED:  # the largest bucket: the token budget; sequences of 16 tokens at least
                cap = budget(spec, dataset_lengths(spec, job.sequences))
                model = rnn.graphed(model, max_tokens=cap, max_batch_size=max(1, cap // spec.lengths.lo))
        elif ragged_row:
            __import__("ragged.integrations.transformers")  # registers attn_implementation="ragged"
            model.set_attn_implementation("ragged")

    if not ragged_row:

        def make(seqs):
            batch = pad_batch(seqs, ("input_ids",), 0, labels=spec.name == "lm")
            if spec.name == "fine-tune":
                batch["labels"] = torch.tensor([s["labels"] for s in seqs])
            return batch
    elif spec.name == "fine-tune":
        from ragged.data import collate as make
    else:
        make = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    return model, make


def _count(batch, row: str, spec: Spec) -> tuple[int, int]:
    """(real tokens, computed tokens) of a host batch, read from the tensors the model gets."""
    ids = batch["input_ids"]
    if row == PADDED:
        return int(batch["attention_mask"].sum()), ids.numel()
    n = ids.num_tokens if spec.name == "fine-tune" else ids.numel()
    return n, n


def _apply(batch, method: str, *args, **kwargs):
    """``batch.<method>(...)``: a RaggedBatch's own (one copy for all its tensors), else per tensor."""
    if hasattr(batch, method):
        return getattr(batch, method)(*args, **kwargs)
    return {k: getattr(v, method)(*args, **kwargs) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def run_row(job: Job, rank: int, device: torch.device) -> dict:
    """One rank's part of a row; plain Python numbers only (they cross a process boundary)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    spec, cuda = job.spec, device.type == "cuda"
    lengths = dataset_lengths(spec, job.sequences)
    item = items(spec, lengths)
    batches = plan(spec, job.row, lengths, job.world, rank)[: spec.warmup + job.steps]
    if len(batches) < spec.warmup + job.steps:
        raise RuntimeError(f"rank {rank}: {len(batches)} batches, {spec.warmup + job.steps} needed")
    model, make = _build(job, device)
    host = [make([item(i) for i in b]) for b in batches]
    host = [_apply(b, "pin_memory") for b in host] if cuda else host
    counts = [_count(b, job.row, spec) for b in host]
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-5, fused=cuda)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def barrier():
        dist.barrier(device_ids=[device.index]) if cuda else dist.barrier()

    def step(batch):
        loss = ddp(**_apply(batch, "to", device, non_blocking=True)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    # Warm-up: the first batch in eval mode without communication or update (the loss at
    # initialisation; each rank compiles its kernels on its own), then training steps.
    ddp.eval()
    with ddp.no_sync():
        first = ddp(**_apply(host[0], "to", device, non_blocking=True)).loss
        if first.requires_grad:  # graphed: evaluation replays the inference graphs, with no backward
            first.backward()
    first_loss = float(first.detach())
    opt.zero_grad(set_to_none=True)
    ddp.train()
    losses = [step(b) for b in host[1 : spec.warmup]]
    for b in host[spec.warmup :] * 2:  # every timed batch twice, no update: the steady state (caches, graphs)
        with ddp.no_sync():
            ddp(**_apply(b, "to", device, non_blocking=True)).loss.backward()
        opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    sync(), barrier(), sync()
    start = time.perf_counter()
    losses += [step(b) for b in host[spec.warmup :]]
    sync()
    wall = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    losses = [float(x) for x in torch.stack(losses).cpu()] if losses else []

    local = []  # each rank's own forward + backward, no communication
    for b in host[spec.warmup :]:
        barrier()
        batch = _apply(b, "to", device, non_blocking=True)
        sync()
        t = time.perf_counter()
        with ddp.no_sync():
            ddp(**batch).loss.backward()
        sync()
        local.append(time.perf_counter() - t)
        opt.zero_grad(set_to_none=True)
    timed = counts[spec.warmup :]
    return {
        "tokens": sum(c[0] for c in timed),
        "computed_tokens": sum(c[1] for c in timed),
        "sequences": sum(len(b) for b in batches[spec.warmup :]),
        "wall_s": wall,
        "local_s": local,
        "first_loss": first_loss,
        "losses": losses,
        "peak_gib": peak,
        "step_tokens": [c[0] for c in timed],
    }


def _own_cores(rank: int, world: int) -> None:
    """Give each rank its own share of the host's cores (affinity and torch's threads): host-bound
    steps of ranks that share cores run at the scheduler's whim, which shows as step-time spread."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity control on this platform: threads only
        cores = list(range(os.cpu_count() or 1))
    share = cores[rank * len(cores) // world : (rank + 1) * len(cores) // world] or cores
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, share)
    torch.set_num_threads(max(1, len(share)))


def _worker(rank: int, world: int, device_type: str, jobs: list[Job], init_file: str, results) -> None:
    """A rank: joins the process group, runs ``jobs`` in order and puts ``(status, job index,
    rank, payload)`` on ``results`` for each; after a failure it reports and exits at once."""
    import torch.distributed as dist

    index = 0
    try:
        device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        if device_type == "cuda":
            torch.cuda.set_device(device)
        _own_cores(rank, world)
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        for index, job in enumerate(jobs):
            results.put(("ok", index, rank, run_row(job, rank, device)))
            gc.collect()  # the row's model, DDP and optimizer, before the next row's
            torch.cuda.empty_cache()  # a no-op where CUDA was never initialised
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001  (reported as the row's failure)
        text = f"{type(exc).__name__}: {str(exc).strip()[:400]}"
        last = traceback.extract_tb(exc.__traceback__)[-1:]
        where = f" ({os.path.basename(last[0].filename)}:{last[0].lineno})" if last else ""
        results.put(("error", index, rank, text + where))
        results.close(), results.join_thread()
        os._exit(1)  # peers may be blocked in a collective: no clean-up that would wait on them


# --------------------------------------------------------------------------------------
# The parent: spawn, supervise, collect


def _drain(results, got: dict, wait: float) -> None:
    """Every message on ``results`` until none comes for ``wait`` seconds, into ``got``."""
    while True:
        try:
            status, index, rank, payload = results.get(timeout=wait)
        except queue_module.Empty:
            return
        got[(index, rank)] = (status, payload)


def run_group(jobs: list[Job], world: int, device_type: str, timeout_s: float, grace_s: float = GRACE_S) -> list[dict]:
    """Runs ``jobs`` on ``world`` fresh processes; per job ``{"ranks": [payload per rank]}`` or
    ``{"error": text}``. Stops every rank ``grace_s`` after one failed or when ``timeout_s`` has
    passed; no process outlives the call."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    folder = tempfile.mkdtemp(prefix="bench-ddp-")
    init_file = os.path.join(folder, "rendezvous")
    procs = [
        ctx.Process(target=_worker, args=(r, world, device_type, jobs, init_file, results), daemon=True)
        for r in range(world)
    ]
    got: dict[tuple[int, int], tuple[str, Any]] = {}
    problem, failed_at, deadline = None, None, time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while any(p.is_alive() for p in procs):
            _drain(results, got, 0.5)
            now = time.monotonic()
            if failed_at is None and (
                any(s == "error" for s, _ in got.values()) or any(p.exitcode not in (None, 0) for p in procs)
            ):
                failed_at = now
            if failed_at is not None and now - failed_at > grace_s:
                problem = f"stopped {grace_s:.0f} s after a rank failed"
                break
            if now > deadline:
                problem = f"timed out after {timeout_s:.0f} s"
                break
        _drain(results, got, 0.2)  # what the ranks put before they exited
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        results.close()
        shutil.rmtree(folder, ignore_errors=True)

    out, first_missing = [], True
    for index in range(len(jobs)):
        status = [got.get((index, r), ("missing", None)) for r in range(world)]
        if all(s == "ok" for s, _ in status):
            out.append({"ranks": [payload for _, payload in status]})
            continue
        errors = [f"rank {r}: {payload}" for r, (s, payload) in enumerate(status) if s == "error"]
        if first_missing:  # the first row left incomplete: what stopped it (a crash says nothing)
            crashed = (
                []
                if errors
                else [
                    f"rank {r} exited with code {p.exitcode}"
                    for r, p in enumerate(procs)
                    if p.exitcode not in (0, None) and not (problem and p.exitcode == -9)
                ]
            )
            errors += ([problem] if problem else []) + crashed
        first_missing = False
        out.append({"error": "; ".join(errors) or "not run: an earlier row of the same processes failed"})
    return out


def _load_ratio(loads: np.ndarray) -> float:
    """Mean over steps of max / mean load over the ranks (``loads [steps, W]``)."""
    top, mean = loads.max(1).astype(np.float64), loads.mean(1)
    return float(np.divide(top, mean, out=np.ones_like(top), where=mean > 0).mean()) if loads.size else 1.0


def summarize(job: Job, result: dict) -> dict:
    """A row's numbers from its ranks' payloads, and what the plan says it must have fed."""
    spec, warm, W = job.spec, job.spec.warmup, job.world
    lengths = dataset_lengths(spec, job.sequences)
    arr = np.asarray(lengths)
    plans = [plan(spec, job.row, lengths, W, r)[warm : warm + job.steps] for r in range(W)]
    real = np.array([[int(arr[b].sum()) for b in p] for p in plans]).T  # [steps, W]
    computed = np.array([[len(b) * int(arr[b].max()) for b in p] for p in plans]).T if job.row == PADDED else real
    row = {
        "workload": spec.name,
        "world": W,
        "impl": job.row,
        "steps": job.steps,
        "warmup": warm,
        "planned_tokens": int(real.sum()),
        "planned_computed_tokens": int(computed.sum()),
        "load_ratio": _load_ratio(computed),
    }
    if job.row == BALANCED:
        bal = sampler(spec, lengths, W, 0).balance()
        row["load_ratio"] = float(bal.ratio[warm : warm + job.steps].mean())
        row["epoch_balance"] = {"mean": bal.mean, "worst": bal.worst, "efficiency": bal.efficiency}
    if "error" in result:
        return {**row, "status": "failed", "error": result["error"]}
    ranks = result["ranks"]
    wall = max(r["wall_s"] for r in ranks)
    tokens, seqs = sum(r["tokens"] for r in ranks), sum(r["sequences"] for r in ranks)
    local = np.array([r["local_s"] for r in ranks])  # [W, steps]
    spread = float((local.max(0) - local.min(0)).mean()) if local.size else 0.0
    step_s = wall / job.steps
    row.update(
        status="ok",
        ranks=ranks,
        wall_s=wall,
        tokens=tokens,
        sequences=seqs,
        computed_tokens=sum(r["computed_tokens"] for r in ranks),
        tokens_per_s_per_rank=tokens / wall / W,
        sequences_per_s_per_rank=seqs / wall / W,
        step_ms=step_s * 1e3,
        spread_ms=spread * 1e3,
        spread_fraction=spread / step_s,
        local_ms=float(local.mean() * 1e3),
        first_loss=float(np.mean([r["first_loss"] for r in ranks])),
        peak_gib=max((r["peak_gib"] or 0.0) for r in ranks) if ranks[0]["peak_gib"] is not None else None,
    )
    if tokens != row["planned_tokens"] or not all(math.isfinite(x) for r in ranks for x in r["losses"]):
        row.update(
            status="failed",
            error=f"fed {tokens} real tokens, the plan holds {row['planned_tokens']}"
            if tokens != row["planned_tokens"]
            else "a loss is not finite",
        )
    return row


# --------------------------------------------------------------------------------------
# CLI


def plan_jobs(specs: dict[str, Spec], worlds: list[int]) -> list[Job]:
    """Every row at every world size, with its timed steps: as many as both samplers give after
    the warm-up, at most ``spec.steps`` (0: too few batches)."""
    jobs = []
    for W in worlds:
        for spec in specs.values():
            n = spec.dataset_size(max(worlds))
            lengths = dataset_lengths(spec, n)
            avail = min(len(plan(spec, PADDED, lengths, W, 0)), len(sampler(spec, lengths, W, 0)))
            rows = [r for r in ROWS if r != GRAPHED or spec.name in GRAPHED_WORKLOADS]
            jobs += [Job(spec, row, W, n, max(0, min(avail - spec.warmup, spec.steps))) for row in rows]
    return jobs


def run_jobs(jobs: list[Job], worlds: list[int], device_type: str, per_row: bool) -> dict[Job, dict]:
    """Each world size's jobs on fresh processes: one group per job (``per_row``) or one in all."""
    row_timeout = 600.0 if device_type == "cuda" else 300.0
    results: dict[Job, dict] = {}
    for W in worlds:
        mine = [j for j in jobs if j.world == W and j.steps > 0]
        results.update(
            {
                j: {"error": f"the dataset gives fewer than {j.spec.warmup + 1} batches per rank"}
                for j in jobs
                if j.world == W and j.steps == 0
            }
        )
        for group in [[j] for j in mine] if per_row else [mine] if mine else []:
            t = time.perf_counter()
            results.update(zip(group, run_group(group, W, device_type, row_timeout * len(group))))
            names = ", ".join(f"{j.spec.name} / {j.row}" for j in group)
            print(f"W={W}: {names}: {time.perf_counter() - t:.1f} s", flush=True)
    return results


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.ddp", description=__doc__.splitlines()[0])
    p.add_argument(
        "--gpus", type=int, nargs="+", metavar="W", help="world sizes (default: 1..the GPU count; on CPU: 1 2)"
    )
    p.add_argument("--workload", nargs="+", choices=("fine-tune", "lm"), default=["fine-tune", "lm"])
    p.add_argument("--quick", action="store_true", help="fewer steps and smaller datasets")
    p.add_argument("--out", type=Path, metavar="FILE.md", help="write the table here and the raw numbers to FILE.json")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--steps", type=int, metavar="N", help="timed steps per rank at most")
    p.add_argument(
        "--processes",
        choices=("row", "world"),
        help="fresh processes per row, or per world size (default: row on CUDA, world on CPU)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from bench import env as envmod

    args = parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise SystemExit("python -m bench.ddp: --device cuda given but torch.cuda.is_available() is False")
    available = torch.cuda.device_count() if cuda else None
    worlds = args.gpus or (list(range(1, available + 1)) if cuda else [1, 2])
    if any(w < 1 for w in worlds) or (cuda and max(worlds) > available):
        raise SystemExit(f"python -m bench.ddp: expected world sizes in 1..{available or 'any'}, got {worlds}")
    if args.steps is not None and args.steps < 1:
        raise SystemExit(f"python -m bench.ddp: expected --steps >= 1, got {args.steps}")
    worlds = sorted(set(worlds))
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    specs = {k: v for k, v in workloads(cuda, args.quick).items() if k in args.workload}
    if args.steps is not None:
        specs = {k: dataclasses.replace(v, steps=args.steps) for k, v in specs.items()}
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    import transformers

    env = {
        **envmod.collect(device),
        "transformers": transformers.__version__,
        **{k: os.environ.get(k) for k in ENV_DEFAULTS},
    }
    print(
        f"device: {envmod.device_label(env)}  torch {env['torch']}  transformers {env['transformers']}  "
        f"commit {(env['git_commit'] or 'unknown')[:12]}",
        flush=True,
    )

    jobs = plan_jobs(specs, worlds)
    per_row = (args.processes or ("row" if cuda else "world")) == "row"
    results = run_jobs(jobs, worlds, "cuda" if cuda else "cpu", per_row)
    order = list(specs)
    rows = [
        summarize(j, results[j])
        for j in sorted(jobs, key=lambda j: (order.index(j.spec.name), j.world, ROWS.index(j.row)))
    ]
    derive(rows, cuda)
    args_text = " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(rows, env, specs, args_text)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        sizes = {k: s.dataset_size(max(worlds)) for k, s in specs.items()}
        doc = {
            "env": env,
            "args": args_text,
            "worlds": worlds,
            "rows": rows,
            "workloads": {
                k: {
                    "model": s.model.name(),
                    "dtype": str(s.dtype),
                    "lengths": dataclasses.asdict(s.lengths),
                    "per_rank": s.per_rank,
                    "warmup": s.warmup,
                    "dropout": s.dropout,
                    "sequences": sizes[k],
                    "budget": budget(s, dataset_lengths(s, sizes[k])),
                }
                for k, s in specs.items()
            },
        }
        args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"written to {args.out} and {args.out.with_suffix('.json')}")
    failed = [r for r in rows if r["status"] != "ok"]
    for r in failed:
        print(f"FAILED {r['workload']} W={r['world']} {r['impl']}: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    from bench.ddp import main as _main  # the workers unpickle bench.ddp's classes, not __main__'s

    sys.exit(_main())
