"""The benchmark harness: suite registry, timing, correctness checks, copy ceiling.

A *suite* (a :class:`Suite` subclass decorated with :func:`register`) lists its
*cases* (one workload each: shapes, dtype, ...) and *builds* each case into a
:class:`Workload`: the inputs, the reference output, the bytes and/or flops of one
call, and the :class:`Impl` objects to measure (ragged kernels, baselines, ceilings).

For every implementation of a case the harness

1. skips it when the suite gave a reason it cannot run (``Impl.skip``);
2. runs it once and compares its output with the reference (``Workload.compare``):
   a mismatch marks the row ``failed`` and it is never timed;
3. warms it up until its times settle (:func:`settle`: the first call may have compiled
   kernels, leaving a GPU idle long enough for its clocks to drop), times it: median
   milliseconds over repeated calls (:func:`median_ms`), then takes the workload's extra
   measurements of it, untimed (``Workload.extra``, e.g. peak memory);
4. derives GB/s, TFLOP/s, % of the copy ceiling and speedups over the baselines, and
   lets the suite annotate the case's rows (:meth:`Suite.annotate`).

The copy ceiling is one large device-to-device copy on a GPU (:func:`measure_copy_ceiling`).
On CPU a copy's rate depends on its size (the caches), so there each case's % copy is
taken against its own ``copy (same bytes)`` row (:func:`copy_impl`), timed twice (before
and after the case's other rows) for its faster median.

The measuring itself (:class:`Timing`, :func:`median_ms`, :func:`settle`, peak memory, GPU busy
time) lives in :mod:`bench.measure`; its names are re-exported here.

Units everywhere: times in milliseconds, sizes in bytes, bandwidth in GB/s
(10**9 bytes per second), compute in TFLOP/s (10**12 flops per second).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from .measure import (  # noqa: F401  (re-exported: the suites read them here)
    Timing,
    gb_per_s,
    gpu_busy_ms,
    median_ms,
    peak_memory_bytes,
    release_memory,
    settle,
    short_median_ms,
    synchronize,
)

KINDS = ("ragged", "baseline", "ceiling")
"""``ragged``: the kernels under test; ``baseline``: what people write without them;
``ceiling``: a reference point that does no useful work (e.g. a plain copy)."""

STATUSES = ("ok", "failed", "skipped")
"""``failed``: raised (ragged rows) or gave a wrong output; never timed. ``skipped``: cannot
run here (reason given). A case that could not be built at all gives one row of kind
``"case"``."""

DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "long": torch.int64,
    "int32": torch.int32,
    "int": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}

_SHORT_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def dtype_name(dtype: torch.dtype) -> str:
    """Short name of a dtype: ``bf16``, ``fp32``, ``int64``, ..."""
    return _SHORT_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def parse_dtype(name: str) -> torch.dtype:
    """``"bf16"`` / ``"bfloat16"`` / ``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    key = name.strip().lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(sorted(DTYPES))}")
    return DTYPES[key]


# --------------------------------------------------------------------------------------
# What a suite declares


class Skip(Exception):
    """Raised by an implementation (or a suite's ``build``) that cannot run this input.

    The message is the reason shown in the results.
    """


@dataclasses.dataclass(frozen=True)
class Case:
    """One workload of a suite.

    ``name`` is unique within the suite and describes the workload (it is the row's
    ``case``); ``group`` gathers related cases (one plot panel and table section each,
    e.g. the op); ``params`` holds the workload parameters as JSON values; ``spec`` is
    whatever the suite needs to build the case (not serialised).
    """

    name: str
    params: dict[str, Any]
    group: str = ""
    spec: Any = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass
class Impl:
    """One implementation measured on a case.

    ``fn`` takes no argument, runs the operation once and returns its output (what the
    correctness check compares). ``skip`` is the reason it cannot run here (then ``fn``
    is never called). ``check=False`` for rows that compute nothing comparable
    (ceilings). ``is_copy``: a plain copy of the case's bytes (:func:`copy_impl`), the
    reference of the case's % copy where no device-wide ceiling is given. ``compare``: this
    row's own correctness check in place of the workload's (a baseline whose published
    numerics are looser than the workload's tolerance, said where it is built). ``versus``
    (ragged rows): the names of the baselines this row does the same work as (the same batches,
    the same inputs), the only ones its speedups are taken over; ``None``: every baseline of
    the case.
    """

    name: str
    kind: str
    fn: Callable[[], Any] | None = None
    skip: str | None = None
    check: bool = True
    is_copy: bool = False
    compare: Callable[[Any, Any], str | None] | None = None
    versus: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Impl {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.fn is None and self.skip is None:
            raise ValueError(f"Impl {self.name!r}: give fn or a skip reason")


def exact_match(out: Any, ref: Any) -> str | None:
    """Bit-exact comparison (``torch.equal``); ``None`` when equal, else what differs."""
    if not isinstance(out, torch.Tensor):
        return f"expected a tensor, got {type(out).__name__}"
    if tuple(out.shape) != tuple(ref.shape):
        return f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    if out.dtype != ref.dtype:
        return f"dtype {out.dtype} != reference {ref.dtype}"
    if out.device != ref.device:
        return f"device {out.device} != reference {ref.device}"
    if torch.equal(out, ref):
        return None
    wrong = int((out != ref).sum())
    return f"{wrong} of {ref.numel()} elements differ from the reference"


def max_error_compare(
    names: tuple[str, ...], flatten: Callable[[Any], torch.Tensor], tol: float, absolute: tuple[str, ...] = ()
) -> Callable[[Any, Any], str | None]:
    """A ``Workload.compare`` for outputs that are close, not equal, to their references.

    ``out`` is one output or a tuple of them (named ``names``), ``ref`` a tuple of float
    references. Each output goes through ``flatten`` (layout of the implementation -> the
    reference's elements) and must have the reference's elements (and shape, when it has
    more than one dimension); its max abs error must be <= ``tol`` for the names in
    ``absolute`` and <= ``tol * max(1, max |ref|)`` for the others. NaN always fails.
    """

    @torch.no_grad()
    def compare(out: Any, ref: tuple[torch.Tensor, ...]) -> str | None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if len(outs) != len(ref):
            return f"expected {len(ref)} outputs, got {len(outs)}"
        problems = []
        for name, o, r in zip(names, outs, ref):
            try:
                o = flatten(o)
            except (TypeError, ValueError) as exc:
                return f"{name}: {exc}"
            if o.numel() != r.numel() or (o.dim() > 1 and tuple(o.shape) != tuple(r.shape)):
                return f"{name}: shape {tuple(o.shape)} != reference {tuple(r.shape)}"
            if not r.numel():
                continue
            bound = tol if name in absolute else tol * max(1.0, float(r.abs().max()))
            err = float((o.detach().reshape(r.shape).to(r.dtype) - r).abs().max())
            if not err <= bound:  # also catches NaN
                problems.append(f"{name} max abs error {err:.3g} > {bound:.3g}")
        return "; ".join(problems) or None

    return compare


@dataclasses.dataclass
class Workload:
    """A case built on a device: what to run, what it must produce, what it costs.

    ``bytes_moved``: bytes read + written by one call of an ideal implementation (the
    GB/s of every row of the case divides this by its time). ``flops``: floating-point
    operations of one call (``None`` for pure data movement). ``reference``: the
    expected output; ``compare(out, reference)`` returns ``None`` or a description of
    the mismatch. ``extra(impl)``: optional measurements of an implementation taken
    after it was timed (untimed; e.g. :func:`peak_memory_bytes`), as a dict of JSON
    values stored in the row's ``extra`` (one table column per key).
    """

    impls: list[Impl]
    reference: Any = None
    bytes_moved: int | None = None
    flops: int | None = None
    compare: Callable[[Any, Any], str | None] = exact_match
    extra: Callable[[Impl], dict[str, Any]] | None = None


@dataclasses.dataclass(frozen=True)
class Config:
    """What a run asks for. ``dtypes=None``: each suite's own choice of dtypes."""

    device: torch.device
    quick: bool = False
    dtypes: tuple[torch.dtype, ...] | None = None
    timing: Timing | None = None
    rows: tuple[str, ...] | None = None

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def timer(self) -> Timing:
        return self.timing or Timing.default(self.device, self.quick)

    def wants(self, dtype: torch.dtype) -> bool:
        """Whether ``--dtype`` (if given) lets cases of this dtype run."""
        return self.dtypes is None or dtype in self.dtypes

    def measures(self, impl: Impl) -> bool:
        """Whether ``--rows`` (if given: substrings of row names) lets this row run."""
        return self.rows is None or any(part in impl.name for part in self.rows)


class Suite:
    """Base class of the benchmark suites; subclass, set ``name``, decorate with :func:`register`.

    ``memory_bound`` suites report GB/s and % of the copy ceiling; the others report
    TFLOP/s (GB/s too where their workloads give bytes). ``notes`` (Markdown) is
    appended to the suite's Markdown results: say there what each implementation is.
    ``speedup_table``: also report the speedup of each ragged row over each baseline
    (a second table), not only over the fastest one. :meth:`annotate` may add derived
    values to a case's rows (``Row.extra``) once all of them are measured.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    rounds: ClassVar[int] = 1
    """GPU runs without --quick: each case's rows are timed this many times, round-robin (all
    rows, then all rows again, ...), and each row reports the median of its rounds (with their
    spread): a drift of the machine during the case then reaches every row alike."""
    memory_bound: ClassVar[bool] = True
    notes: ClassVar[str] = ""
    speedup_table: ClassVar[bool] = False

    def cases(self, config: Config) -> list[Case]:
        """The cases to run for this config (cheap: no tensors yet)."""
        raise NotImplementedError

    def describe(self, params: Iterable[dict[str, Any]]) -> str:
        """The suite's description for a run of cases with these ``params`` (titles of its
        tables and plots): ``description``, unless a suite says what its cases ran (e.g.
        which model)."""
        return self.description

    def build(self, case: Case, config: Config) -> Workload:
        """Allocate the inputs of ``case`` on ``config.device`` and list its implementations."""
        raise NotImplementedError

    def annotate(self, case: Case, rows: list[Row]) -> None:
        """Called with the rows of ``case`` after speedups are derived (default: nothing)."""

    def console_notes(self, rows: list[Row]) -> list[str]:
        """Lines printed under the suite's compact table (CPU runs), for what its ``extra``
        columns say that the table leaves out (default: none)."""
        return []


SUITES: dict[str, Suite] = {}
"""Registered suites by name, in registration order."""


def workload_shapes(config: Config, gpu_shapes, cpu_shapes, quick_index: int, cpu_quick_shapes=None) -> list:
    """The shapes a suite runs: on a GPU every one of ``gpu_shapes`` (only
    ``gpu_shapes[quick_index]`` with --quick), on CPU ``cpu_shapes`` (``cpu_quick_shapes``
    with --quick, when given: tiny smoke cases); --dtype swaps their ``dtype`` field for
    each requested floating dtype (shapes are dataclasses)."""
    if config.on_gpu:
        shapes = [gpu_shapes[quick_index]] if config.quick else list(gpu_shapes)
    else:
        shapes = list(cpu_quick_shapes if config.quick and cpu_quick_shapes is not None else cpu_shapes)
    if config.dtypes is None:
        return shapes
    floats = [d for d in config.dtypes if d.is_floating_point]
    return [dataclasses.replace(s, dtype=d) for s in shapes for d in floats]


def interpreter_skip(config: Config) -> str | None:
    """Why a Triton row does not run in this CPU run, or ``None``: under
    ``TRITON_INTERPRET=1`` the kernels run interpreted, seconds per call on anything but the
    tiny --quick cases."""
    if config.on_gpu or config.quick or os.environ.get("TRITON_INTERPRET") != "1":
        return None
    return "too slow under the Triton interpreter (TRITON_INTERPRET=1); interpreted in the --quick CPU cases only"


def register(cls: type[Suite]) -> type[Suite]:
    """Class decorator: add a suite to :data:`SUITES` under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__}: a suite needs a name")
    if cls.name in SUITES and type(SUITES[cls.name]) is not cls:
        raise ValueError(f"two suites are named {cls.name!r}")
    SUITES[cls.name] = cls()
    return cls


# --------------------------------------------------------------------------------------
# Timing


@dataclasses.dataclass(frozen=True)
class CopyCeiling:
    """A large device-to-device ``dst.copy_(src)``: ``bytes`` = read + written."""

    bytes: int
    median_ms: float

    @property
    def gbps(self) -> float:
        return gb_per_s(self.bytes, self.median_ms)

    def to_dict(self) -> dict[str, float]:
        return {"bytes": self.bytes, "median_ms": self.median_ms, "gbps": self.gbps}


def measure_copy_ceiling(config: Config) -> CopyCeiling | None:
    """Measure the copy ceiling once on a GPU: 1 GiB copied (2 GiB moved; 256 MiB with
    ``quick``). ``None`` on CPU: there a copy's rate depends on its size through the caches
    (a 0.13 MiB copy ran 4x faster per byte than a 32 MiB one), so each case's % copy is
    taken against its own ``copy (same bytes)`` row instead (:func:`run_suite`)."""
    if not config.on_gpu:
        return None
    size = (256 << 20) if config.quick else (1 << 30)
    impl = copy_impl(2 * size, config.device)
    settle(impl.fn, config.device, config.timer)
    ms = median_ms(impl.fn, config.device, config.timer)
    del impl
    release_memory(config.device)
    return CopyCeiling(2 * size, ms)


def copy_impl(bytes_moved: int, device: torch.device, name: str = "copy (same bytes)") -> Impl:
    """A ``ceiling`` row: a plain copy of ``bytes_moved / 2`` bytes, so it moves ``bytes_moved``."""
    n = max(1, bytes_moved // 2)
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return Impl(name, "ceiling", lambda: dst.copy_(src), check=False, is_copy=True)


# --------------------------------------------------------------------------------------
# Running


@dataclasses.dataclass
class Row:
    """One measured (or skipped / failed) implementation of one case: a JSON row."""

    suite: str
    case: str
    group: str
    params: dict[str, Any]
    impl: str
    kind: str
    status: str
    reason: str | None = None
    median_ms: float | None = None
    bytes: int | None = None
    flops: int | None = None
    gbps: float | None = None
    tflops: float | None = None
    pct_of_copy: float | None = None
    speedup: dict[str, float] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    copy_gbps: float | None = None
    """The copy rate ``pct_of_copy`` is taken against: the device's copy ceiling, or (CPU)
    the case's own ``copy (same bytes)`` row."""
    versus: list[str] | None = None
    """Ragged rows: the baselines ``speedup`` may be taken over (:attr:`Impl.versus`); ``None``:
    every baseline of the case."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Hooks:
    """Callbacks of a run (progress display): all optional."""

    on_impl: Callable[[Case, Impl], None] = lambda case, impl: None
    on_case_done: Callable[[Case], None] = lambda case: None
    on_problem: Callable[[Row], None] = lambda row: None


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 300:
        first = first[:297] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _call(impl: Impl, device: torch.device) -> Any:
    out = impl.fn()
    synchronize(device)
    return out


def run_impl(impl: Impl, workload: Workload, row: Row, config: Config) -> Row:
    """Check then time one implementation, filling ``row``."""
    if impl.skip is not None:
        row.status, row.reason = "skipped", impl.skip
        return row
    if not config.measures(impl):
        row.status, row.reason = "skipped", f"not among --rows {' '.join(config.rows)}"
        return row
    try:
        out = _call(impl, config.device)
    except Skip as exc:
        row.status, row.reason = "skipped", str(exc)
        return row
    except torch.OutOfMemoryError:
        release_memory(config.device)
        row.status, row.reason = "skipped", "out of memory"
        return row
    except Exception as exc:  # a baseline missing in this torch is skipped; a broken ragged kernel fails
        release_memory(config.device)
        row.status = "failed" if impl.kind == "ragged" else "skipped"
        row.reason = _error_text(exc)
        return row
    if impl.check:
        problem = (impl.compare or workload.compare)(out, workload.reference)
        if problem is not None:
            row.status, row.reason = "failed", f"wrong output: {problem}"
            return row
    del out
    try:
        settle(impl.fn, config.device, config.timer)
        ms = median_ms(impl.fn, config.device, config.timer)
    except Exception as exc:
        release_memory(config.device)
        row.status, row.reason = "failed", f"while timing: {_error_text(exc)}"
        return row
    row.status, row.median_ms = "ok", ms
    if row.bytes:
        row.gbps = gb_per_s(row.bytes, ms)
    if row.flops:
        row.tflops = row.flops / (ms * 1e-3) / 1e12
    if workload.extra is not None:
        try:
            row.extra.update(workload.extra(impl))
        except Exception as exc:  # the timing stands; say what could not be measured
            release_memory(config.device)
            row.extra["extra error"] = _error_text(exc)
    return row


ROUND_SPREAD = "rounds spread %"


def _more_rounds(impls: list[Impl], rows: list[Row], rounds: int, config: Config) -> None:
    """Time every measured row ``rounds - 1`` more times, round-robin; each row then reports
    the median of its rounds and their spread ((max - min) / median, in %).

    The median, not the minimum or the mean: one round caught in a slow stretch of the host
    moves neither, and a lucky round does not stand for the row either. Each row was settled
    (:func:`settle`) before its first round; the later rounds follow other rows' work, with
    the GPU busy, so they need no warm-up of their own."""
    timed = [(impl, row) for impl, row in zip(impls, rows) if row.status == "ok"]
    samples = {id(row): [row.median_ms] for _, row in timed}
    for _ in range(rounds - 1):
        for impl, row in timed:
            if row.status != "ok":
                continue
            try:
                samples[id(row)].append(median_ms(impl.fn, config.device, config.timer))
            except Exception as exc:
                release_memory(config.device)
                row.status, row.reason = "failed", f"while timing: {_error_text(exc)}"
    for _, row in timed:
        if row.status != "ok":
            continue
        ms = samples[id(row)]
        row.median_ms = statistics.median(ms)
        row.extra[ROUND_SPREAD] = 100.0 * (max(ms) - min(ms)) / row.median_ms
        if row.bytes:
            row.gbps = gb_per_s(row.bytes, row.median_ms)
        if row.flops:
            row.tflops = row.flops / (row.median_ms * 1e-3) / 1e12


def _retime_copy(fn: Callable[[], Any], row: Row, config: Config) -> None:
    """CPU: time the case's copy row again, after the case's other rows, and keep the faster
    of its two medians. It is the ceiling of every row of the case (% copy): on a shared
    CPU a busy moment during its one timing would lift every row's % copy, past 100%."""
    try:
        ms = median_ms(fn, config.device, config.timer)
    except Exception:  # the first timing stands
        return
    if ms < row.median_ms:
        row.median_ms = ms
        if row.bytes:
            row.gbps = gb_per_s(row.bytes, ms)


def _add_derived(
    rows: list[Row], ceiling: CopyCeiling | None, memory_bound: bool, case_copy: Row | None = None
) -> None:
    """% copy (memory-bound suites) and speedups of ragged rows over baselines (those of
    ``Row.versus`` where a row names them).

    % copy divides a row's GB/s by ``ceiling``'s when given, else by that of
    ``case_copy`` (the case's plain copy of the same bytes) when it ran."""
    baselines = {r.impl: r.median_ms for r in rows if r.kind == "baseline" and r.status == "ok"}
    copy_gbps = (
        ceiling.gbps
        if ceiling is not None
        else case_copy.gbps
        if case_copy is not None and case_copy.status == "ok"
        else None
    )
    for r in rows:
        if r.status != "ok":
            continue
        if memory_bound and copy_gbps is not None and r.gbps is not None:
            r.copy_gbps = copy_gbps
            r.pct_of_copy = 100.0 * r.gbps / copy_gbps
        if r.kind == "ragged":
            r.speedup = {
                name: ms / r.median_ms for name, ms in baselines.items() if r.versus is None or name in r.versus
            }


def run_suite(
    suite: Suite,
    config: Config,
    ceiling: CopyCeiling | None,
    cases: Iterable[Case] | None = None,
    hooks: Hooks | None = None,
) -> list[Row]:
    """Run every case of ``suite`` (or the given ``cases``); one :class:`Row` per implementation."""
    hooks = hooks or Hooks()
    rows: list[Row] = []
    for case in suite.cases(config) if cases is None else cases:
        case_rows, case_copy = _run_case(suite, case, config, hooks)
        _add_derived(case_rows, ceiling, suite.memory_bound, case_copy)
        suite.annotate(case, case_rows)
        rows.extend(case_rows)
        hooks.on_case_done(case)
    return rows


def _run_case(suite: Suite, case: Case, config: Config, hooks: Hooks) -> tuple[list[Row], Row | None]:
    """The rows of one case, and its plain-copy row (``None`` where it has none)."""
    base = dict(suite=suite.name, case=case.name, group=case.group, params=dict(case.params))
    try:
        workload = suite.build(case, config)
    except (Skip, torch.OutOfMemoryError) as exc:
        release_memory(config.device)
        reason = str(exc) if isinstance(exc, Skip) else "out of memory"
        return [Row(**base, impl="(case)", kind="case", status="skipped", reason=f"case not built: {reason}")], None
    case_rows, case_copy, copy_fn = [], None, None
    for impl in workload.impls:
        hooks.on_impl(case, impl)
        row = Row(
            **base,
            impl=impl.name,
            kind=impl.kind,
            status="skipped",
            bytes=workload.bytes_moved,
            flops=workload.flops,
            versus=None if impl.versus is None else list(impl.versus),
        )
        row = run_impl(impl, workload, row, config)
        if row.status == "failed":
            hooks.on_problem(row)
        if impl.is_copy and case_copy is None:
            case_copy, copy_fn = row, impl.fn
        case_rows.append(row)
    if case_copy is not None and case_copy.status == "ok" and not config.on_gpu:
        _retime_copy(copy_fn, case_copy, config)
    rounds = suite.rounds if config.on_gpu and not config.quick else 1
    if rounds > 1:
        _more_rounds(workload.impls, case_rows, rounds, config)
    del workload
    release_memory(config.device)
    return case_rows, case_copy
