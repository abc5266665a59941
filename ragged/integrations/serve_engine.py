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
* **Workers** (:mod:`ragged.integrations.serve_worker`): per device, a thread takes batches and
  hands them to the device's worker, and a finisher thread answers them in order. The worker is a
  process of its own (``RAGGED_SERVE_WORKERS=process``, opt-in: the model's torch ops then never
  wait for the GIL that this process's threads hold), which gets token arrays and answers rows over
  a pipe, or runs in those two threads (``thread``, the default).
* **Overlap.** The thread launches a batch (or sends it) and hands it to its finisher, which waits
  for the rows, while the thread already packs and launches the next batch (at most two batches
  in flight per device). On the CPU in thread mode a batch runs to its end and the thread answers
  it itself.
* **Failure.** When a batch raises, each of its requests runs again alone (in the worker): those
  that raise again get the error (500), the others their rows; no other batch is touched. A
  worker process that dies fails the requests of its batches (500), and :meth:`Engine.problem`
  says so (``/health`` answers 503); its device takes no batch any more.
* **Requests** are futures of the event loop, resolved from the finisher thread through
  ``loop.call_soon_threadsafe``; a request cancelled by its client marks its items, which no
  batch takes any more.

``RAGGED_SERVE_BATCH_DELAY`` (seconds) makes each batch wait in its worker before it runs, and
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

from .serve_worker import Answer, ThreadWorker, TokenBatch, WorkerDied

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
    """The tokenizer thread, the shared queue, and per device a thread that sends batches and a
    finisher thread. ``runners``: one ``PackedRunner`` per device, each run by a
    :class:`~ragged.integrations.serve_worker.ThreadWorker`; or, given ``workers`` (one
    :class:`~ragged.integrations.serve_worker.ProcessWorker` per device, ready), one runner whose
    model may hold no weights (the meta device), used to tokenize only. ``metrics``: a
    :class:`ragged.integrations.serve_metrics.Metrics`."""

    def __init__(self, runners: list, max_batch_tokens: int, metrics, workers: list | None = None) -> None:
        self.runners = runners
        self.workers = workers if workers is not None else [ThreadWorker(r) for r in runners]
        self.mode = "thread" if workers is None else "process"
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
        self._dead: set[int] = set()  # workers that died (their threads take no batch)
        self._stopped = False
        self._threads: list[threading.Thread] = []
        for i in range(len(self.workers)):
            done: queue.Queue = queue.Queue(maxsize=2)  # batches in flight past the sender, per device
            finisher = threading.Thread(
                target=self._finish_loop, args=(i, done), name=f"ragged-finish-{i}", daemon=True
            )
            sender = threading.Thread(target=self._work_loop, args=(i, done), name=f"ragged-batch-{i}", daemon=True)
            finisher.start()
            sender.start()
            self._threads += [sender, finisher]

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

    def problem(self) -> str | None:
        """Why the engine cannot serve every device (a worker process died), or None."""
        reasons = [p for w in self.workers if (p := w.problem()) is not None]
        return "; ".join(reasons) or None

    def stop(self, timeout: float = 30.0) -> None:
        """Tokenize and run what is posted and queued, then end the threads and the workers (a
        second call returns at once)."""
        if self._stopped:
            return
        self._stopped = True
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
        # a thread still running may be blocked on its worker: that worker is killed at once
        late = any(t.is_alive() for t in self._threads)
        for worker in self.workers:
            worker.stop(0.0 if late else max(1.0, deadline - time.monotonic()))

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

    def _work_loop(self, i: int, done: queue.Queue) -> None:
        worker = self.workers[i]
        worker.bind()
        while True:
            batch = self._take()
            if batch is None:
                break
            if i in self._dead:
                if self._give_back(batch):
                    break
                continue
            tokens = sum(int(span.ids.size) for span in batch)
            started = time.perf_counter()
            for span in batch:
                span.request.stamps.setdefault("launched", started)
            try:
                handle, answer = worker.send(self._token_batch(batch))
            except WorkerDied as error:
                self._died(i, batch, error)
                continue
            if answer is not None:  # computed already (the CPU): answered here, without a hand-over
                self._answer(batch, answer, started, tokens)
            else:
                done.put((batch, handle, started, tokens))
        done.put(None)

    def _token_batch(self, batch: list[_Span]) -> TokenBatch:
        """The arrays of ``batch``, each text marked with its request's place in the batch."""
        one = len(batch) == 1
        lengths = batch[0].lengths if one else np.concatenate([span.lengths for span in batch])
        flat = batch[0].ids if one else np.concatenate([span.ids for span in batch])
        types = None
        if batch[0].types is not None:
            types = batch[0].types if one else np.concatenate([span.types for span in batch])
        places: dict[int, int] = {}
        owner = [places.setdefault(id(span.request), len(places)) for span in batch]
        owners = np.repeat(np.asarray(owner, np.int32), [span.texts for span in batch])
        faulty: tuple[int, ...] = ()
        if self._fault is not None:
            faulty = tuple(sorted({o for o, span in zip(owner, batch) if self._fault in _texts_of(span)}))
        return TokenBatch(lengths, flat, types, batch[0].extra, owners, faulty, self._delay)

    def _finish_loop(self, i: int, done: queue.Queue) -> None:
        worker = self.workers[i]
        while True:
            entry = done.get()
            if entry is None:
                return
            batch, handle, started, tokens = entry
            try:
                answer = worker.receive(handle)
            except WorkerDied as error:
                self._died(i, batch, error)
                continue
            except Exception as error:  # the device failed under the whole batch
                for request in {id(span.request): span.request for span in batch}.values():
                    request.fail(error)
                continue
            self._answer(batch, answer, started, tokens)

    def _died(self, i: int, batch: list[_Span], error: WorkerDied) -> None:
        """Worker ``i`` is gone: ``batch``'s requests fail, and the device takes no more batches."""
        for request in {id(span.request): span.request for span in batch}.values():
            request.fail(error)
        with self._cond:
            self._dead.add(i)

    def _give_back(self, batch: list[_Span]) -> bool:
        """A dead worker's thread took ``batch``: back to the queue's head for another worker
        (True: this thread ends), or, when every worker is dead, failed (False: this thread goes
        on failing what is queued, so that no request waits for ever)."""
        with self._cond:
            if len(self._dead) < len(self.workers):
                self._items.extendleft(reversed(batch))
                self._queued += sum(span.texts for span in batch)
                self._cond.notify_all()
                return True
        error = WorkerDied(self.problem() or "every worker process died")
        for request in {id(span.request): span.request for span in batch}.values():
            request.fail(error)
        return False

    def _answer(self, batch: list[_Span], answer: Answer, started: float, tokens: int) -> None:
        rows = answer.rows
        if answer.failed is not None:
            self.metrics.batch_failed()
        if self.truncate_dim is not None:
            rows = rows[:, : self.truncate_dim]
        now = time.perf_counter()
        # a worker process's time on the batch; the rest of the round trip is the pipe's
        pipe = 0.0 if answer.seconds is None else max(0.0, now - started - answer.seconds)
        done = []
        places: dict[int, int] = {}
        at = 0
        answered_texts = 0
        for span in batch:
            n = span.texts
            error = answer.errors.get(places.setdefault(id(span.request), len(places)))
            if error is not None:
                span.request.fail(error)
            elif span.request.put(span.start, rows[at : at + n]):
                done.append(span.request)
            if error is None:
                answered_texts += n
            at += n
        answered = []
        for request in done:
            request.stamps["computed"] = now - pipe
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
        self.metrics.batch_done(answered_texts, tokens, time.perf_counter() - started)


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
