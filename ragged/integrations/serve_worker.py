"""The workers of ``python -m ragged.serve``'s engine (:mod:`ragged.integrations.serve_engine`): what
runs a token batch through the model, in a thread of the server (:class:`ThreadWorker`) or in a
process of its own per device (:class:`ProcessWorker`), both over the same code (:func:`launch`,
:func:`collect`).

Why a process: a torch op releases the GIL and takes it back when it ends; beside the server's event
loop, tokenizer and finisher, which run Python most of the time, each take-back waits up to the
switch interval, and a batch that runs in 1.7 ms alone took 40 ms inside the server on an H200
(``bench/results/serve_load_h200_32text_63553f7.md``). A worker process holds its own GIL.

The protocol of a :class:`ProcessWorker` (a ``multiprocessing`` pipe, spawn context):

* the worker loads the model itself (:class:`WorkerSpec`: the model's name or folder, the dtype,
  the device, the token budget, what the server was started with), so no weight crosses the pipe,
  then answers ``("ready", device)``, or ``("error", traceback)`` and exits;
* the server sends :class:`TokenBatch` records (numpy arrays, pickled), ``None`` to stop;
* the worker answers each batch in order: a pickled header ``(shape, dtype, errors, failed,
  seconds)`` then the rows' bytes (float32, read by the server straight into its array);
  ``errors``: the batch's requests whose texts raised, each run again alone, as in a thread
  (:func:`launch`); ``seconds``: from the worker's receipt of the batch to its answer.

A worker ignores SIGINT and SIGTERM (the server drains, then stops it with ``None``), and ends when
the server's end of the pipe closes (the server died).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from typing import Any, NamedTuple

import numpy as np
import torch

_log = logging.getLogger("ragged.serve")

__all__ = ["Answer", "ProcessWorker", "ThreadWorker", "TokenBatch", "WorkerDied", "WorkerSpec", "load_converted"]

FAULT = "fault injected by RAGGED_SERVE_FAULT"


class TokenBatch(NamedTuple):
    """One batch of texts, tokenized: ``lengths [n]`` (int64), their ids one after the other
    (``ids [sum(lengths)]``) and token types (or None), the tokenizer's other features (``extra``),
    which request of the batch each text belongs to (``owners [n]``, int32, 0 .. k-1 in order); for
    tests, the requests that must raise (``faulty``: ``RAGGED_SERVE_FAULT``'s) and how long the
    worker waits before it runs the batch (``delay``, seconds: ``RAGGED_SERVE_BATCH_DELAY``)."""

    lengths: np.ndarray
    ids: np.ndarray
    types: np.ndarray | None
    extra: dict
    owners: np.ndarray
    faulty: tuple[int, ...] = ()
    delay: float = 0.0


class Answer(NamedTuple):
    """A batch's result: ``rows [n, d]`` float32 (the rows of a request in ``errors`` are not
    read), ``errors`` (request of the batch -> what its run raised), ``failed`` (what the whole
    batch raised, or None: then ``errors`` is empty) and ``seconds`` (a worker process's time
    on the batch, None in a thread: the rest of the round trip is the pipe's)."""

    rows: np.ndarray
    errors: dict
    failed: BaseException | None
    seconds: float | None


class _Launched(NamedTuple):
    parts: list  # (text indices or None for all, host tensor, CUDA event or None)
    errors: dict
    failed: BaseException | None
    texts: int
    requests: int


class WorkerDied(RuntimeError):
    """A worker process ended while the server needed it."""


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker process loads: ``model`` (a sentence-transformers folder or hub name), in
    ``dtype`` (torch's name: ``"bfloat16"``), on ``device`` (``"cuda:0"``), batches of at most
    ``max_batch_tokens`` real tokens."""

    model: str
    dtype: str
    device: str
    max_batch_tokens: int


def load_converted(model: str, dtype: torch.dtype | None, weights: bool = True):
    """The SentenceTransformer ``model`` converted by :func:`ragged.nn.convert`, on the CPU in
    ``dtype``; ``weights=False``: a copy without weights (on the meta device) that tokenizes as the
    model does, for a server whose models run in worker processes."""
    import warnings

    from sentence_transformers import SentenceTransformer

    import ragged.nn

    if weights:
        return ragged.nn.convert(SentenceTransformer(model, device="cpu")).to(dtype).eval()
    try:
        # transformers places the weights on the meta device without reading them; the other
        # modules (pooling, a Dense head) load on the CPU and go there next
        st = SentenceTransformer(model, model_kwargs={"device_map": "meta"}).to("meta")
        return ragged.nn.convert(st).eval()
    except Exception as e:  # a model the meta device does not take: its weights in host memory
        warnings.warn(
            f"ragged.serve: the tokenizer's copy of {model} holds its weights in host memory (no meta copy: "
            f"{type(e).__name__}: {e})",
            RuntimeWarning,
            stacklevel=2,
        )
        return ragged.nn.convert(SentenceTransformer(model, device="cpu")).eval()


def to_host(emb: torch.Tensor):
    """``emb`` as float32 on the host: on CUDA a copy into pinned memory without blocking, and the
    event to wait for."""
    emb = emb.float()
    if emb.device.type != "cuda":
        return emb.detach().cpu(), None
    host = torch.empty(emb.shape, dtype=torch.float32, pin_memory=True)
    host.copy_(emb, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def _run(runner, batch: TokenBatch, owner: int | None):
    """Launch the texts of ``batch`` (those of request ``owner``, or all): ``(text indices or
    None, host tensor, event or None)``; raises what the model raises."""
    if owner is None:
        if batch.faulty:
            raise RuntimeError(FAULT)
        return None, *to_host(runner.run(batch.lengths, batch.ids, batch.types, batch.extra))
    if owner in batch.faulty:
        raise RuntimeError(FAULT)
    mine = np.flatnonzero(batch.owners == owner)
    tokens = np.repeat(batch.owners == owner, batch.lengths)
    types = None if batch.types is None else batch.types[tokens]
    return mine, *to_host(runner.run(batch.lengths[mine], batch.ids[tokens], types, batch.extra))


def launch(runner, batch: TokenBatch) -> _Launched:
    """Launch ``batch`` on ``runner`` (a ``PackedRunner``). When the model raises, each of the
    batch's requests runs again alone: those that raise again are the batch's ``errors``, the
    others are answered (a batch of one request fails without a second run)."""
    n = int(batch.lengths.size)
    requests = int(batch.owners.max()) + 1 if n else 0
    if batch.delay:
        time.sleep(batch.delay)
    try:
        return _Launched([_run(runner, batch, None)], {}, None, n, requests)
    except Exception as error:
        _log.error("a batch of %d texts failed", n, exc_info=error)
        if requests <= 1:
            return _Launched([], {0: error}, error, n, requests)
        parts, errors = [], {}
        for owner in range(requests):
            try:
                parts.append(_run(runner, batch, owner))
            except Exception as alone:
                errors[owner] = alone
        return _Launched(parts, errors, error, n, requests)


def collect(launched: _Launched) -> Answer:
    """The rows of a launched batch, once on the host (waits for the GPU)."""
    for _, _, event in launched.parts:
        if event is not None:
            event.synchronize()
    if len(launched.parts) == 1 and launched.parts[0][0] is None:
        rows = launched.parts[0][1].numpy()
    else:
        width = launched.parts[0][1].shape[1] if launched.parts else 0
        rows = np.zeros((launched.texts, width), np.float32)
        for index, host, _ in launched.parts:
            rows[index] = host.numpy()
    return Answer(rows, launched.errors, launched.failed, None)


class ThreadWorker:
    """A device's model run by the server's own threads (``runner``: a ``PackedRunner``)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.device = next(runner.st.parameters()).device

    def bind(self) -> None:
        """Called by the thread that sends batches, before the first."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def send(self, batch: TokenBatch) -> tuple[_Launched, Answer | None]:
        """Launch ``batch``: ``(what receive takes, the answer if it is done already)`` (the CPU
        computes a batch to its end)."""
        launched = launch(self.runner, batch)
        done = all(event is None for _, _, event in launched.parts)
        return launched, collect(launched) if done else None

    def receive(self, launched: _Launched) -> Answer:
        return collect(launched)

    def problem(self) -> str | None:
        return None

    def stop(self, timeout: float) -> None:
        pass


def _portable(error: BaseException) -> BaseException:
    """``error`` if it pickles, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _worker_main(spec: WorkerSpec, conn) -> None:
    """A worker process: load, answer ready, then run batches until ``None`` or the pipe closes.
    Two threads, as in the server's thread mode: one receives and launches, one waits for the GPU
    and answers (at most two batches launched and not answered)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains, then stops its workers
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = load_converted(spec.model, getattr(torch, spec.dtype)).to(device)
        from ragged.nn.hf.sentence import packed_runner

        runner = packed_runner(model, spec.max_batch_tokens)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", str(device)))
    launched: queue.Queue = queue.Queue(maxsize=2)

    def answer_loop() -> None:
        while True:
            entry = launched.get()
            if entry is None:
                return
            job, received = entry
            try:
                rows, errors, failed, _ = collect(job)
            except Exception as error:  # the device failed under the whole batch: every request
                rows, errors, failed = np.zeros((0, 0), np.float32), dict.fromkeys(range(job.requests), error), error
            rows = np.ascontiguousarray(rows, dtype=np.float32)
            header = (
                rows.shape,
                {k: _portable(e) for k, e in errors.items()},
                None if failed is None else _portable(failed),
                time.perf_counter() - received,
            )
            try:
                conn.send(header)
                conn.send_bytes(rows.data.cast("B") if rows.size else b"")
            except OSError:  # the server is gone
                return

    def guarded(loop) -> None:
        try:
            loop()
        except BaseException:  # a bug here: end the process, so the server sees it die rather than wait
            traceback.print_exc()
            os._exit(70)

    def receive_loop() -> None:
        while True:
            try:
                batch = conn.recv()
            except (EOFError, OSError):  # the server is gone
                batch = None
            if batch is None:
                launched.put(None)
                answerer.join()
                return
            received = time.perf_counter()
            launched.put((launch(runner, batch), received))

    answerer = threading.Thread(target=guarded, args=(answer_loop,), name="ragged-worker-answer", daemon=True)
    answerer.start()
    guarded(receive_loop)


class ProcessWorker:
    """A device's model in a worker process of its own (see the module's docstring). Started
    here; :meth:`wait_ready` waits for the model to load."""

    def __init__(self, spec: WorkerSpec) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.spec = spec
        self.device = spec.device
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(spec, child), name=f"ragged-worker-{spec.device}")
        self.process.start()
        child.close()  # the worker's end lives in the worker only: its death reads as EOF here
        self._died: str | None = None
        self._stopping = False

    def wait_ready(self) -> None:
        """Block until the worker has loaded its model; raise RuntimeError with the worker's
        error (its traceback) if loading failed or the process ended."""
        ready = multiprocessing.connection.wait([self._conn, self.process.sentinel])
        message: Any = None
        if self._conn in ready:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                message = None
        if isinstance(message, tuple) and message[0] == "ready":
            return
        if isinstance(message, tuple) and message[0] == "error":
            raise RuntimeError(f"the worker process for {self.device} could not load the model:\n{message[1]}")
        self.process.join(5)
        raise RuntimeError(f"the worker process for {self.device} {self._exit()} while loading the model")

    def _exit(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "stopped answering"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with status {code}"

    def bind(self) -> None:
        pass

    def send(self, batch: TokenBatch) -> tuple[None, None]:
        """Hand ``batch`` to the worker (answered by :meth:`receive`, in order); raises
        :class:`WorkerDied` if it is gone."""
        try:
            self._conn.send(batch)
        except OSError:
            raise self._death() from None
        return None, None

    def receive(self, _: None = None) -> Answer:
        """The answer to the oldest batch sent; raises :class:`WorkerDied` if the worker is gone."""
        try:
            shape, errors, failed, seconds = self._conn.recv()
            rows = np.empty(shape, np.float32)
            if rows.size:
                self._conn.recv_bytes_into(rows.data.cast("B"))
            else:
                self._conn.recv_bytes()
        except (EOFError, OSError):
            raise self._death() from None
        return Answer(rows, errors, failed, seconds)

    def _death(self) -> WorkerDied:
        if self._died is None:
            self.process.join(2)
            self._died = f"the worker process for {self.device} {self._exit()}"
            _log.error("%s", self._died)
        return WorkerDied(self._died)

    def problem(self) -> str | None:
        """Why the worker cannot serve (None: it can)."""
        if self._died is None and not self._stopping and not self.process.is_alive():
            self._death()
        return self._died

    def stop(self, timeout: float) -> None:
        """Ask the worker to end once its batches are answered (call after the last
        :meth:`send`), wait ``timeout`` seconds for it, then kill it (``timeout`` 0: kill it now,
        without writing to a pipe that may be full)."""
        self._stopping = True
        if timeout > 0:
            try:
                self._conn.send(None)
            except OSError:
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            if timeout > 0:
                _log.error("the worker process for %s did not stop in time: killed", self.device)
            self.process.kill()
            self.process.join(5)
        self._conn.close()
