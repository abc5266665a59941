"""The metrics of ``python -m ragged.serve`` in Prometheus' text exposition format (``GET
/metrics``): requests by endpoint and status, texts and tokens embedded, the queue's depth, the
requests in flight, batches (their real tokens, their run time, failures), request latency, and
texts per second over the last ten seconds. Updated from the event loop and the engine's threads
under one lock."""

from __future__ import annotations

import collections
import threading
import time

__all__ = ["Metrics"]

_LATENCY_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TOKEN_BOUNDS = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
_WINDOW_S = 10.0
# a request's way through the server, each stage from the stamp before it (Request.stamps):
# its body read and parsed, waiting for and in the tokenizer, queued for a batch, its batch in the
# worker until its last rows are on the host, the rest of the round trip to a worker process (from
# the batch's send to its rows in the server, less the worker's own time on it: the transfers both
# ways, the wait for a busy worker to read the batch and for the finisher to read the answer; 0 in
# thread mode), its response body built, handed to the event loop, and the handler resumed
_STAGES = (
    ("read", "posted"),
    ("tokenize", "tokenized"),
    ("queue", "launched"),
    ("batch", "computed"),
    ("pipe", "rows"),
    ("finish", "finished"),
    ("hand_over", "resolved"),
    ("resume", "answered"),
)


class _Histogram:
    def __init__(self, bounds: tuple) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.bounds):
            if value <= b:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        out, running = [], 0
        sep = "," if labels else ""
        for b, c in zip((*self.bounds, float("inf")), self.counts):
            running += c
            le = "+Inf" if b == float("inf") else repr(float(b))
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {running}')
        suffix = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{suffix} {self.sum!r}", f"{name}_count{suffix} {self.count}"]
        return out


class Metrics:
    """Counters, gauges and histograms of one server process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()  # (endpoint, status) -> count
        self.texts = 0
        self.tokens = 0
        self.batches = 0
        self.failed_batches = 0
        self.depth = 0
        self.inflight = 0
        self.latency = {e: _Histogram(_LATENCY_BOUNDS) for e in ("/v1/embeddings", "/embed")}
        self.batch_tokens = _Histogram(_TOKEN_BOUNDS)
        self.batch_seconds = _Histogram(_LATENCY_BOUNDS)
        self._recent: collections.deque = collections.deque()  # (time, texts) of the last batches
        self.stage_seconds = dict.fromkeys((name for name, _ in _STAGES), 0.0)
        self.staged = 0  # requests whose stages are summed

    def request_stages(self, arrived: float, stamps: dict[str, float]) -> None:
        """Add one answered request's time in each stage (``stamps``: perf_counter times named as
        in ``_STAGES``; ``arrived``: when its HTTP request came in). A request missing a stamp (say,
        one answered without a batch) is not counted."""
        times = [arrived]
        for _, key in _STAGES:
            if key not in stamps:
                return
            times.append(stamps[key])
        with self._lock:
            for (name, _), a, b in zip(_STAGES, times, times[1:]):
                self.stage_seconds[name] += b - a
            self.staged += 1

    def request_done(self, endpoint: str, status: int, seconds: float | None) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1
            if seconds is not None and endpoint in self.latency:
                self.latency[endpoint].observe(seconds)

    def set_inflight(self, n: int) -> None:
        with self._lock:
            self.inflight = n

    def queue_depth(self, n: int) -> None:
        self.depth = n  # one int: a plain store

    def batch_done(self, texts: int, tokens: int, seconds: float) -> None:
        now = time.monotonic()
        with self._lock:
            self.batches += 1
            self.texts += texts
            self.tokens += tokens
            self.batch_tokens.observe(tokens)
            self.batch_seconds.observe(seconds)
            self._recent.append((now, texts))
            while self._recent and self._recent[0][0] < now - _WINDOW_S:
                self._recent.popleft()

    def batch_failed(self) -> None:
        with self._lock:
            self.failed_batches += 1

    def texts_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - _WINDOW_S:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / _WINDOW_S

    def render(self) -> str:
        rate = self.texts_per_second()
        with self._lock:
            lines = [
                "# HELP ragged_requests_total HTTP requests answered, by endpoint and status.",
                "# TYPE ragged_requests_total counter",
            ]
            for (endpoint, status), n in sorted(self.requests.items()):
                lines.append(f'ragged_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
            lines += [
                "# HELP ragged_texts_total Texts embedded.",
                "# TYPE ragged_texts_total counter",
                f"ragged_texts_total {self.texts}",
                "# HELP ragged_tokens_total Real tokens embedded.",
                "# TYPE ragged_tokens_total counter",
                f"ragged_tokens_total {self.tokens}",
                "# HELP ragged_batches_total Batches run.",
                "# TYPE ragged_batches_total counter",
                f"ragged_batches_total {self.batches}",
                "# HELP ragged_batch_failures_total Batches whose model call raised (their requests got 500).",
                "# TYPE ragged_batch_failures_total counter",
                f"ragged_batch_failures_total {self.failed_batches}",
                "# HELP ragged_queue_depth Texts waiting for a batch.",
                "# TYPE ragged_queue_depth gauge",
                f"ragged_queue_depth {self.depth}",
                "# HELP ragged_inflight_requests Requests accepted and not yet answered.",
                "# TYPE ragged_inflight_requests gauge",
                f"ragged_inflight_requests {self.inflight}",
                "# HELP ragged_texts_per_second Texts embedded per second over the last 10 s.",
                "# TYPE ragged_texts_per_second gauge",
                f"ragged_texts_per_second {rate!r}",
                "# HELP ragged_batch_tokens Real tokens per batch.",
                "# TYPE ragged_batch_tokens histogram",
                *self.batch_tokens.lines("ragged_batch_tokens"),
                "# HELP ragged_batch_seconds From a batch's launch to its rows on the host.",
                "# TYPE ragged_batch_seconds histogram",
                *self.batch_seconds.lines("ragged_batch_seconds"),
                "# HELP ragged_request_stage_seconds_total Time answered requests spent in each stage: body read, "
                "tokenize (waiting and tokenizing), queue, batch (launch to rows on the host), pipe (the rest of "
                "the round trip to a worker process: transfers, waits to be read), finish (response body), "
                "hand_over (to the event loop), resume (the handler).",
                "# TYPE ragged_request_stage_seconds_total counter",
                *(f'ragged_request_stage_seconds_total{{stage="{k}"}} {v!r}' for k, v in self.stage_seconds.items()),
                "# HELP ragged_request_stage_requests_total Requests counted in ragged_request_stage_seconds_total.",
                "# TYPE ragged_request_stage_requests_total counter",
                f"ragged_request_stage_requests_total {self.staged}",
                "# HELP ragged_request_seconds Request latency, from its arrival to its answer, by endpoint.",
                "# TYPE ragged_request_seconds histogram",
            ]
            for endpoint, h in self.latency.items():
                lines += h.lines("ragged_request_seconds", f'endpoint="{endpoint}"')
        return "\n".join(lines) + "\n"
