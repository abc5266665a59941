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
* **The queue** holds one span per request: its texts' token ids one after the other, and their
  lengths. A worker takes the oldest spans up to the token budget, splitting a span at a text
  boundary where the budget ends (a text longer than the budget runs alone), skipping those of
  cancelled requests, and only spans of one prompt per batch (a prompt changes the features the
  pooling reads). Spans, not texts, keep the Python work per request, not per text.
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
server's behaviour under load and failure, never set in production. ``RAGGED_SERVE_PROFILE`` (a
folder) samples every thread's Python stack every few milliseconds (:func:`sample_stacks`) and
writes the counts there when the server stops: where the host's time goes under load (``python -m
bench.serve_load --profile DIR``).
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

    def __init__(self, loop: asyncio.AbstractEventLoop, texts: list[str], prompt: str | None, finish=None) -> None:
        self.loop = loop
        # what the future gets: finish(request) run by the thread that completes the request (the
        # response body: serialising a request's floats costs the event loop more than its HTTP),
        # or the rows themselves
        self.finish = finish
        self.future: asyncio.Future = loop.create_future()
        self.texts = texts
        self.remaining = len(texts)
        self.rows: np.ndarray | None = None
        self.prompt = prompt
        self.truncate = False
        self.tokens = 0  # real tokens of its texts, set when tokenized
        self.answer: Any = None
        self.cancelled = False
        self.failed = False
        self._lock = threading.Lock()
        # perf_counter times of the request's way through the engine (Metrics.request_stages)
        self.stamps: dict[str, float] = {"posted": time.perf_counter()}

    def _resolve(self, value: Any, error: BaseException | None) -> None:
        if self.future.done():
            return
        self.stamps["resolved"] = time.perf_counter()
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(value)

    def put(self, start: int, rows: np.ndarray) -> bool:
        """Rows ``start, start + 1, ...`` of the request's embeddings; True when they were the last
        ones: the caller then hands the request to the event loop (:func:`_resolve_on_loops`,
        once per batch)."""
        with self._lock:
            if self.failed:
                return False
            if self.rows is None:
                self.rows = np.empty((len(self.texts), rows.shape[1]), np.float32)
            self.rows[start : start + rows.shape[0]] = rows
            self.remaining -= rows.shape[0]
            return self.remaining == 0

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.failed:
                return
            self.failed = True
        self.loop.call_soon_threadsafe(self._resolve, None, error)


class _Span:
    """Texts ``start, start + 1, ...`` of one request, tokenized: their lengths and their ids (and
    token types) one after the other."""

    __slots__ = ("request", "start", "lengths", "ids", "types", "extra")

    def __init__(self, request: Request, start: int, lengths: np.ndarray, ids: np.ndarray, types, extra: dict) -> None:
        self.request, self.start, self.lengths, self.ids, self.types, self.extra = (
            request, start, lengths, ids, types, extra
        )  # fmt: skip

    @property
    def texts(self) -> int:
        return int(self.lengths.size)

    def fitting(self, room: int) -> int:
        """How many of its first texts fit in ``room`` tokens."""
        return int(np.searchsorted(np.cumsum(self.lengths), room, side="right"))

    def split(self, k: int) -> tuple[_Span, _Span]:
        """Its first ``k`` texts and the others (0 < k < texts)."""
        cut = int(self.lengths[:k].sum())
        types = (None, None) if self.types is None else (self.types[:cut], self.types[cut:])
        return (
            _Span(self.request, self.start, self.lengths[:k], self.ids[:cut], types[0], self.extra),
            _Span(self.request, self.start + k, self.lengths[k:], self.ids[cut:], types[1], self.extra),
        )


class Engine:
    """Models on their devices (``runners``: one ``PackedRunner`` each), the shared queue,
    one worker and one finisher thread per device. ``metrics``: a
    :class:`ragged.integrations.serve_metrics.Metrics`."""

    def __init__(self, runners: list, max_batch_tokens: int, metrics) -> None:
        self.runners = runners
        self.max_batch_tokens = int(max_batch_tokens)
        self.metrics = metrics
        self.max_length = _max_length(runners[0].st)
        self.dimension = _dimension(runners[0].st)  # of the embeddings (None: not known before a batch)
        # the model's own truncation of its embeddings (sentence-transformers' truncate_dim), as encode applies it
        truncate = getattr(runners[0].st, "truncate_dim", None)
        self.truncate_dim = int(truncate) if isinstance(truncate, int) and truncate > 0 else None
        self._items: collections.deque[_Span] = collections.deque()
        self._queued = 0  # texts in the queue's spans
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

    def post(
        self, loop: asyncio.AbstractEventLoop, texts: list[str], prompt: str | None, truncate: bool, finish=None
    ) -> Request:
        """Queue one request's texts for the tokenizer; its future is answered with ``[n, d]``
        float32 rows (or, given ``finish``, with ``finish(request)`` computed off the event loop
        once its rows are in: ``request.rows``, ``request.tokens``), or fails with
        :class:`Refused` (a text over the model's length without ``truncate``), the model's
        error or ``finish``'s."""
        request = Request(loop, texts, prompt, finish)
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
                now = time.perf_counter()
                for span in items:
                    span.request.stamps["tokenized"] = now
                with self._cond:
                    self._items.extend(items)
                    self._queued += sum(span.texts for span in items)
                    self.metrics.queue_depth(self._queued)
                    self._cond.notify_all()

    def _tokenized_items(self, requests: list[Request], prompt: str | None) -> list[_Span]:
        """The queue spans of ``requests`` (one each), tokenized in one call; a request over the
        model's length (without truncation) fails with :class:`Refused` and adds none."""
        texts = [t for r in requests for t in r.texts]
        lengths, flat, types, extra = self.runners[0].tokenize(texts, prompt)
        lengths = np.asarray(lengths, dtype=np.int64)
        ends = np.cumsum(lengths)
        spans: list[_Span] = []
        first = 0
        for request in requests:
            n = len(request.texts)
            mine = lengths[first : first + n]
            refused = None if request.truncate else self._over_length(request.texts, mine, prompt)
            if refused is not None:
                request.fail(refused)
            else:
                a, b = int(ends[first] - mine[0]), int(ends[first + n - 1])
                request.tokens = b - a
                spans.append(_Span(request, 0, mine, flat[a:b], None if types is None else types[a:b], extra))
            first += n
        return spans

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

    def _take(self) -> list[_Span] | None:
        """The next batch (None: stopping and nothing left)."""
        budget = self.max_batch_tokens
        with self._cond:
            while True:
                while self._items and self._items[0].request.cancelled:
                    self._queued -= self._items.popleft().texts
                if self._items:
                    break
                if self._drained:
                    return None
                self._cond.wait()
            head = self._items.popleft()
            k = max(head.fitting(budget), 1)  # a text longer than the budget runs alone
            if k < head.texts:
                head, rest = head.split(k)
                self._items.appendleft(rest)
            batch, tokens = [head], head.ids.size
            prompt = head.request.prompt
            kept: list[_Span] = []
            while self._items and tokens < budget:
                span = self._items[0]
                if span.request.cancelled:
                    self._queued -= self._items.popleft().texts
                    continue
                if span.request.prompt != prompt:  # another prompt: its own batch, order kept
                    kept.append(self._items.popleft())
                    continue
                if tokens + span.ids.size > budget:
                    k = span.fitting(budget - tokens)
                    if k:
                        first, self._items[0] = span.split(k)
                        batch.append(first)
                        tokens += first.ids.size
                    break
                batch.append(self._items.popleft())
                tokens += span.ids.size
            self._items.extendleft(reversed(kept))
            self._queued -= sum(span.texts for span in batch)
            self.metrics.queue_depth(self._queued)
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
                requests = list({id(span.request): span.request for span in batch}.values())
                if len(requests) == 1:
                    requests[0].fail(error)
                    continue
                # which request's texts fail: each again alone, so that the others are answered
                for request in requests:
                    try:
                        self._launch(runner, [span for span in batch if span.request is request], done)
                    except Exception as alone:
                        request.fail(alone)

    def _launch(self, runner, batch: list[_Span], done: queue.Queue) -> None:
        """Run ``batch`` and hand its output to the finisher (raises what the model raises)."""
        if self._fault is not None and any(self._fault in _texts_of(span) for span in batch):
            raise RuntimeError("fault injected by RAGGED_SERVE_FAULT")
        one = len(batch) == 1
        lengths = batch[0].lengths if one else np.concatenate([span.lengths for span in batch])
        flat = batch[0].ids if one else np.concatenate([span.ids for span in batch])
        types = None
        if batch[0].types is not None:
            types = batch[0].types if one else np.concatenate([span.types for span in batch])
        started = time.perf_counter()
        for span in batch:
            span.request.stamps.setdefault("launched", started)
        emb = runner.run(lengths, flat, types, batch[0].extra)
        host, event = _to_host(emb)
        if event is None:  # computed already (the CPU): answered here, without a hand-over
            self._answer(batch, host, started, int(flat.size))
        else:
            done.put((batch, host, event, started, int(flat.size)))

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
                for request in {id(span.request): span.request for span in batch}.values():
                    request.fail(error)

    def _answer(self, batch: list[_Span], host: torch.Tensor, started: float, tokens: int) -> None:
        rows = host.numpy()
        if self.truncate_dim is not None:
            rows = rows[:, : self.truncate_dim]
        done = []
        at = 0
        for span in batch:
            n = span.texts
            if span.request.put(span.start, rows[at : at + n]):
                done.append(span.request)
            at += n
        answered = []
        now = time.perf_counter()
        for request in done:
            request.stamps["rows"] = now
            if request.finish is None:
                request.answer = request.rows
            else:
                try:
                    request.answer = request.finish(request)
                except Exception as error:  # this request's answer only
                    if getattr(error, "status", 500) >= 500:  # not a refusal of the request's own
                        _log.error("finishing a request failed", exc_info=error)
                    request.fail(error)
                    continue
            request.stamps["finished"] = time.perf_counter()
            answered.append(request)
        _resolve_on_loops(answered)
        self.metrics.batch_done(at, tokens, time.perf_counter() - started)


def sample_stacks(folder: str, interval: float = 0.005):
    """Start a thread that samples the Python stack of every other thread each ``interval``
    seconds; the returned callable stops it and writes ``folder/stacks.txt``: one line per
    distinct stack, ``thread;outer frame;...;inner frame count`` (the collapsed format flame-graph
    tools read). A sample is taken when the sampler holds the GIL, so a thread running Python is
    seen where it runs and a thread waiting in C where it waits.

    Two files steer it while it runs (so a load generator can profile one phase of a run): a
    file ``folder/reset`` clears the samples taken so far, ``folder/dump`` writes
    ``stacks.txt`` now; the sampler deletes each once it has acted on it."""
    import sys

    counts: collections.Counter = collections.Counter()
    stop = threading.Event()
    reset, dump = os.path.join(folder, "reset"), os.path.join(folder, "dump")

    def write() -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "stacks.txt"), "w") as f:
            f.writelines(f"{stack} {n}\n" for stack, n in counts.most_common())

    def frames(frame) -> str:
        out = []
        while frame is not None:
            code = frame.f_code
            name = getattr(code, "co_qualname", code.co_name)
            out.append(f"{name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})")
            frame = frame.f_back
        return ";".join(reversed(out))

    def run() -> None:
        me = threading.get_ident()
        while not stop.wait(interval):
            if os.path.exists(reset):
                counts.clear()
                os.unlink(reset)
            if os.path.exists(dump):
                write()
                os.unlink(dump)
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    counts[f"{names.get(ident, ident)};{frames(frame)}"] += 1

    sampler = threading.Thread(target=run, name="ragged-stack-sampler", daemon=True)
    sampler.start()

    def finish() -> None:
        stop.set()
        sampler.join()
        write()

    return finish


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
        request._resolve(request.answer, None)


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


def _texts_of(span: _Span) -> list[str]:
    return span.request.texts[span.start : span.start + span.texts]


def _max_length(st) -> int | None:
    n = getattr(st, "max_seq_length", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def _dimension(st) -> int | None:
    try:
        n = st.get_sentence_embedding_dimension()
    except Exception:  # a module without a declared width: known from the first batch
        return None
    return int(n) if isinstance(n, int) and n > 0 else None


def _untruncated_lengths(st, texts: list[str], prompt: str | None) -> list[int]:
    """The token counts of ``texts`` (with the prompt and special tokens) without truncation."""
    tok = st.tokenizer
    full = [(prompt or "") + t for t in texts]
    return [len(ids) for ids in tok(full, truncation=False, padding=False)["input_ids"]]
