"""The batching engine of ``python -m ragged.serve`` (:mod:`ragged.integrations.serve`): texts of
many requests tokenized off the event loop, queued in arrival order, cut into batches of at most
``max_batch_tokens`` real tokens and run by one worker thread per device, each request answered
when its last text is done.

* **Tokenization** runs in one thread, off the event loop, over every request posted since its
  last round at once (:meth:`Engine.post`): one call of the model's own preprocess, unpadded
  (:func:`ragged.nn.hf.sentence.packed_runner`), for the texts of many requests, so that its
  per-call cost is paid per round, not per request (the fast tokenizers spread a call's texts
  over cores). Texts are truncated to the model's length; a request holding a longer text is
  refused (400) unless it allows truncation, the others of the round go on.
* **The queue** holds one item per text. A worker takes the oldest items up to the token budget
  (a longer text alone), skipping those of cancelled requests, and only items of one prompt per
  batch (a prompt changes the features the pooling reads).
* **Overlap.** A worker launches a batch and hands its output to its finisher thread, which waits
  for the GPU and copies the rows to the host, while the worker already packs and launches the
  next batch (at most two batches in flight per device). On the CPU a batch runs to its end and
  the worker answers it itself.
* **Failure.** When a batch raises, each of its requests runs again alone: those that raise
  again get the error (500), the others their rows; no other batch is touched.
* **Requests** are futures of the event loop, resolved from the finisher thread through
  ``loop.call_soon_threadsafe``; a request cancelled by its client marks its items, which no
  batch takes any more.

``RAGGED_SERVE_BATCH_DELAY`` (seconds) makes each batch wait before it runs, and
``RAGGED_SERVE_FAULT`` (a text) makes a batch holding that exact text raise: both for testing the
server's behaviour under load and failure, never set in production.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import queue
import threading
import time
from typing import Any

import numpy as np
import torch

_log = logging.getLogger("ragged.serve")

__all__ = ["Engine", "Refused", "Request"]


class Refused(Exception):
    """A request the engine will not run: ``status`` (HTTP) and a message for the client."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class Request:
    """One HTTP request's texts: the embeddings as their rows arrive (from any device's finisher
    thread), and the event loop's future answered when the last row is in."""

    def __init__(self, loop: asyncio.AbstractEventLoop, texts: list[str], prompt: str | None) -> None:
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()
        self.texts = texts
        self.remaining = len(texts)
        self.rows: np.ndarray | None = None
        self.prompt = prompt
        self.truncate = False
        self.tokens = 0  # real tokens of its texts, set when tokenized
        self.cancelled = False
        self.failed = False
        self._lock = threading.Lock()

    def _resolve(self, value: Any, error: BaseException | None) -> None:
        if self.future.done():
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(value)

    def put(self, index: int, row: np.ndarray) -> bool:
        """Row ``index`` of the request's embeddings; True when it was the last one: the caller
        then hands the request to the event loop (:func:`_resolve_on_loops`, once per batch)."""
        with self._lock:
            if self.failed:
                return False
            if self.rows is None:
                self.rows = np.empty((len(self.texts), row.shape[0]), np.float32)
            self.rows[index] = row
            self.remaining -= 1
            return self.remaining == 0

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.failed:
                return
            self.failed = True
        self.loop.call_soon_threadsafe(self._resolve, None, error)


class _Item:
    __slots__ = ("request", "index", "ids", "types", "extra")

    def __init__(self, request: Request, index: int, ids: np.ndarray, types, extra: dict) -> None:
        self.request, self.index, self.ids, self.types, self.extra = request, index, ids, types, extra


class Engine:
    """Models on their devices (``runners``: one ``PackedRunner`` each), the shared queue,
    one worker and one finisher thread per device. ``metrics``: a
    :class:`ragged.integrations.serve_metrics.Metrics`."""

    def __init__(self, runners: list, max_batch_tokens: int, metrics) -> None:
        self.runners = runners
        self.max_batch_tokens = int(max_batch_tokens)
        self.metrics = metrics
        self.max_length = _max_length(runners[0].st)
        self._items: collections.deque[_Item] = collections.deque()
        self._cond = threading.Condition()
        self._posted: collections.deque[Request] = collections.deque()  # waiting for the tokenizer
        self._posted_cond = threading.Condition()
        self._stopping = False  # no request is posted any more
        self._drained = False  # and the tokenizer has queued the last ones: workers end when empty
        self._delay = float(os.environ.get("RAGGED_SERVE_BATCH_DELAY", "0") or 0)
        self._fault = os.environ.get("RAGGED_SERVE_FAULT") or None
        tokenizer = threading.Thread(target=self._tokenize_loop, name="ragged-tokenize", daemon=True)
        tokenizer.start()
        self._tokenizer = tokenizer
        self._threads: list[threading.Thread] = []
        for i, runner in enumerate(runners):
            done: queue.Queue = queue.Queue(maxsize=2)  # batches in flight past the worker, per device
            finisher = threading.Thread(target=self._finish_loop, args=(done,), name=f"ragged-finish-{i}", daemon=True)
            worker = threading.Thread(
                target=self._work_loop, args=(runner, done), name=f"ragged-batch-{i}", daemon=True
            )
            finisher.start()
            worker.start()
            self._threads += [worker, finisher]

    # ---- requests (event loop side)

    def post(self, loop: asyncio.AbstractEventLoop, texts: list[str], prompt: str | None, truncate: bool) -> Request:
        """Queue one request's texts for the tokenizer; its future is answered with ``[n, d]``
        float32 rows, or fails with :class:`Refused` (a text over the model's length without
        ``truncate``) or the model's error."""
        request = Request(loop, texts, prompt)
        request.truncate = truncate
        with self._posted_cond:
            if self._stopping:
                raise Refused(503, "the server is shutting down")
            self._posted.append(request)
            self._posted_cond.notify()
        return request

    # ---- the tokenizer thread

    def _tokenize_loop(self) -> None:
        while True:
            with self._posted_cond:
                while not self._posted and not self._stopping:
                    self._posted_cond.wait()
                if not self._posted:
                    return
                posted = list(self._posted)
                self._posted.clear()
            # one call per prompt (a prompt prefixes every text of the call), arrival order kept
            rounds: dict[str | None, list[Request]] = {}
            for request in posted:
                if not request.cancelled:
                    rounds.setdefault(request.prompt, []).append(request)
            for prompt, requests in rounds.items():
                try:
                    items = self._tokenized_items(requests, prompt)
                except Exception as error:  # the tokenizer itself failed: these requests only
                    for request in requests:
                        request.fail(error)
                    continue
                with self._cond:
                    self._items.extend(items)
                    self.metrics.queue_depth(len(self._items))
                    self._cond.notify_all()

    def _tokenized_items(self, requests: list[Request], prompt: str | None) -> list[_Item]:
        """The queue items of ``requests``, tokenized in one call; a request over the model's
        length (without truncation) fails with :class:`Refused` and adds none."""
        texts = [t for r in requests for t in r.texts]
        lengths, flat, types, extra = self.runners[0].tokenize(texts, prompt)
        starts = np.concatenate(([0], np.cumsum(lengths)))
        items: list[_Item] = []
        first = 0
        for request in requests:
            n = len(request.texts)
            mine = lengths[first : first + n]
            refused = None if request.truncate else self._over_length(request.texts, mine, prompt)
            if refused is not None:
                request.fail(refused)
            else:
                request.tokens = int(mine.sum())
                for i in range(n):
                    a, b = starts[first + i], starts[first + i + 1]
                    items.append(_Item(request, i, flat[a:b], None if types is None else types[a:b], extra))
            first += n
        return items

    def _over_length(self, texts: list[str], lengths: np.ndarray, prompt: str | None) -> Refused | None:
        """The refusal of a request holding a text over the model's length (tokenized again,
        untruncated, only where the truncated count reached the length), or None."""
        if self.max_length is None:
            return None
        full = np.flatnonzero(lengths >= self.max_length)
        if not full.size:
            return None
        longest = _untruncated_lengths(self.runners[0].st, [texts[i] for i in full], prompt)
        over = [(int(full[j]), n) for j, n in enumerate(longest) if n > self.max_length]
        if not over:
            return None
        index, n = over[0]
        return Refused(
            400,
            f"input {index} has {n} tokens, more than the model's {self.max_length}; shorten it, or ask for "
            'truncation ("truncate": true on /embed)',
            "input",
        )

    def cancel(self, request: Request) -> None:
        """The client went away: its items are skipped, its place freed."""
        request.cancelled = True

    def stop(self, timeout: float = 30.0) -> None:
        """Tokenize and run what is posted and queued, then end the threads."""
        deadline = time.monotonic() + timeout
        with self._posted_cond:
            self._stopping = True
            self._posted_cond.notify_all()
        self._tokenizer.join(max(0.0, deadline - time.monotonic()))  # its last items are queued
        with self._cond:
            self._drained = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # ---- workers

    def _take(self) -> list[_Item] | None:
        """The next batch (None: stopping and nothing left)."""
        with self._cond:
            while True:
                while self._items and self._items[0].request.cancelled:
                    self._items.popleft()
                if self._items:
                    break
                if self._drained:
                    return None
                self._cond.wait()
            head = self._items.popleft()
            batch, tokens = [head], head.ids.size
            prompt = head.request.prompt
            kept: list[_Item] = []
            while self._items and tokens < self.max_batch_tokens:
                item = self._items[0]
                if item.request.cancelled:
                    self._items.popleft()
                    continue
                if item.request.prompt != prompt:  # another prompt: its own batch, order kept
                    kept.append(self._items.popleft())
                    continue
                if tokens + item.ids.size > self.max_batch_tokens:
                    break
                batch.append(self._items.popleft())
                tokens += item.ids.size
            self._items.extendleft(reversed(kept))
            self.metrics.queue_depth(len(self._items))
            return batch

    def _work_loop(self, runner, done: queue.Queue) -> None:
        device = next(runner.st.parameters()).device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        while True:
            batch = self._take()
            if batch is None:
                done.put(None)
                return
            if self._delay:
                time.sleep(self._delay)
            try:
                self._launch(runner, batch, done)
            except Exception as error:
                self.metrics.batch_failed()
                _log.error("a batch of %d texts failed", len(batch), exc_info=error)
                requests = list({id(it.request): it.request for it in batch}.values())
                if len(requests) == 1:
                    requests[0].fail(error)
                    continue
                # which request's texts fail: each again alone, so that the others are answered
                for request in requests:
                    try:
                        self._launch(runner, [it for it in batch if it.request is request], done)
                    except Exception as alone:
                        request.fail(alone)

    def _launch(self, runner, batch: list[_Item], done: queue.Queue) -> None:
        """Run ``batch`` and hand its output to the finisher (raises what the model raises)."""
        if self._fault is not None and any(_text_of(it) == self._fault for it in batch):
            raise RuntimeError("fault injected by RAGGED_SERVE_FAULT")
        lengths = np.fromiter((it.ids.size for it in batch), dtype=np.int64, count=len(batch))
        flat = np.concatenate([it.ids for it in batch])
        types = None if batch[0].types is None else np.concatenate([it.types for it in batch])
        started = time.perf_counter()
        emb = runner.run(lengths, flat, types, batch[0].extra)
        host, event = _to_host(emb)
        if event is None:  # computed already (the CPU): answered here, without a hand-over
            self._answer(batch, host, started, int(lengths.sum()))
        else:
            done.put((batch, host, event, started, int(lengths.sum())))

    def _finish_loop(self, done: queue.Queue) -> None:
        while True:
            entry = done.get()
            if entry is None:
                return
            batch, host, event, started, tokens = entry
            try:
                event.synchronize()
                self._answer(batch, host, started, tokens)
            except Exception as error:
                for request in {id(it.request): it.request for it in batch}.values():
                    request.fail(error)

    def _answer(self, batch: list[_Item], host: torch.Tensor, started: float, tokens: int) -> None:
        rows = host.numpy()
        done = [it.request for it, row in zip(batch, rows) if it.request.put(it.index, row)]
        _resolve_on_loops(done)
        self.metrics.batch_done(len(batch), tokens, time.perf_counter() - started)


def _resolve_on_loops(requests: list[Request]) -> None:
    """Answer the completed ``requests``: one wake-up of each event loop per batch (a
    ``call_soon_threadsafe`` writes to the loop's wake-up pipe: one per request cost a system
    call each, hundreds per batch under load)."""
    by_loop: dict[int, list[Request]] = {}
    for request in requests:
        by_loop.setdefault(id(request.loop), []).append(request)
    for group in by_loop.values():
        group[0].loop.call_soon_threadsafe(_resolve_all, group)


def _resolve_all(requests: list[Request]) -> None:
    for request in requests:
        request._resolve(request.rows, None)


def _to_host(emb: torch.Tensor):
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


def _text_of(item: _Item) -> str:
    return item.request.texts[item.index]


def _max_length(st) -> int | None:
    n = getattr(st, "max_seq_length", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def _untruncated_lengths(st, texts: list[str], prompt: str | None) -> list[int]:
    """The token counts of ``texts`` (with the prompt and special tokens) without truncation."""
    tok = st.tokenizer
    full = [(prompt or "") + t for t in texts]
    return [len(ids) for ids in tok(full, truncation=False, padding=False)["input_ids"]]
