"""Every registered op on a bucketed batch: the contract of :mod:`ragged.tensor` ("Bucketed
batches") that lets one CUDA graph of ``ragged.nn.graphed`` serve every batch of its bucket.

The real batch has sequences of ``LENGTHS`` (``T`` tokens, one of them empty). Its bucket has
``T_B`` rows, ``B_B`` sequences and ``L_B`` as ``max_len``, in the two layouts of the graphs:

* inference: the ``T_B - T`` spare rows past ``offsets[-1]`` hold NaN, and the sequences past the
  real ones are empty (their offsets repeat ``T``);
* training: after one empty sequence, filler sequences own the spare rows, which hold finite
  values (random here), and the incoming gradient is zero past the real rows.

Each case runs the real batch through a public function on the ``"torch"`` reference in
float64, then the bucketed batch (through the same public function, or, where that function
checks the offsets and so refuses an inference bucket, through the op definition as the graph
wrapper and the layer core call it: rule 7 of the contract) on every backend that can take it on the CPU (``"torch"`` in
float64; the others in float32, ``"triton"`` under ``TRITON_INTERPRET=1``; a backend whose
reasons for the input, ``ragged.explain``, are not empty is skipped), forward and backward, and
checks: the real part of every result and gradient equals the reference and holds no NaN; in
the inference layout the rest of a result holds what the contract says (zeros from the
reference of an op that works per sequence; the result of an empty sequence wherever the op
defines one; anything from a per-token op); in the training layout the rest is finite, the
gradient of every spare input entry is exactly zero and the parameters' gradients equal the
reference's. While a case runs, uninitialized memory reads NaN (torch's deterministic mode fills
``torch.empty``), so a row a kernel leaves unwritten cannot pass for a zero.

``CASES`` holds the cases by op name: an op registered without one fails
``test_every_registered_op_has_a_bucket_case``. A case that breaks the contract today is listed
in ``BROKEN`` and runs as a strict xfail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from functools import partial

import pytest
import torch

import ragged
from ragged import backends
from ragged.ops.attention import ATTENTION, spec_of
from ragged.ops.attention_reference import effective_window
from ragged.ops.vocab import VOCAB_CROSS_ENTROPY, VOCAB_PROJECTION, vocab_spec
from ragged.packing import PACK, UNPACK, PackSpec
from ragged.records.attention import AttentionArgs
from ragged.records.pack import PackArgs, UnpackArgs
from ragged.records.vocab import VocabCrossEntropyArgs, VocabProjectionArgs

NAN = float("nan")
LENGTHS = (3, 0, 5, 2)
T, B, LONGEST = sum(LENGTHS), len(LENGTHS), max(LENGTHS)
T_B, B_B, L_B = 20, 7, 8


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    offsets: tuple[int, ...]  # the bucket's B_B + 1 offsets

    @property
    def training(self) -> bool:
        return self.name == "training"


INFERENCE = Layout("inference", (0, 3, 3, 8, 10, 10, 10, 10))  # three empty trailing sequences
TRAINING = Layout("training", (0, 3, 3, 8, 10, 10, 18, 20))  # one empty, fillers of 8 and 2 rows
LAYOUTS = (INFERENCE, TRAINING)
REAL_OFFSETS = (0, 3, 3, 8, 10)
FILLERS = (8, 2)  # the fillers' lengths in TRAINING


@dataclasses.dataclass(frozen=True)
class Batch:
    """What a case's call sees: the offsets, ``max_len`` and the number of value rows."""

    offsets: torch.Tensor
    max_len: int
    rows: int
    bucketed: bool
    layout: Layout

    @property
    def lengths(self) -> list[int]:
        o = self.offsets.tolist()
        return [o[i + 1] - o[i] for i in range(len(o) - 1)]


def _internal(batch: Batch) -> bool:
    """Whether a case runs the op definition rather than the public function: on an inference
    bucket, whose spare rows the public functions refuse where they check the offsets (rule 7 of
    the contract; ``test_public_functions_refuse_spare_rows``)."""
    return batch.bucketed and not batch.layout.training


def _batches(layout: Layout) -> tuple[Batch, Batch]:
    real = Batch(torch.tensor(REAL_OFFSETS, dtype=torch.int32), LONGEST, T, False, layout)
    bucket = Batch(torch.tensor(layout.offsets, dtype=torch.int32), L_B, T_B, True, layout)
    return real, bucket


class _Explained(Exception):
    def __init__(self, why):
        super().__init__()
        self.why = why


class Caller:
    """How a case calls a public function: with ``backend=``, or (``explain``) reporting the
    backend's reasons for the input instead of running it."""

    def __init__(self, backend: str, explain: bool = False):
        self.backend, self.explain = backend, explain

    def __call__(self, fn: Callable, *args, **kwargs):
        if self.explain:
            raise _Explained(ragged.explain(fn, *args, **kwargs).get(self.backend))
        return fn(*args, backend=self.backend, **kwargs)

    def op(self, op, args, spec):
        """Run the op definition ``op`` on its operand record, as the layer core and the graph
        wrapper do: the implementation that ``backends.select_spec`` picks for ``spec``."""
        assert not self.explain, "the reasons of a backend come from the real batch's public call"
        return op(args, backends.select_spec(op.name, self.backend, spec).name)


@dataclasses.dataclass
class Run:
    backend: str
    layout: Layout
    gen: torch.Generator = dataclasses.field(default_factory=lambda: torch.Generator().manual_seed(0))

    @property
    def dtype(self) -> torch.dtype:
        return torch.float64 if self.backend == "torch" else torch.float32

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, dtype=torch.float64)

    def grow(self, x: torch.Tensor) -> torch.Tensor:
        """Real rows ``x [T, ...]`` -> the bucket's ``[T_B, ...]``: NaN or the fillers' tokens."""
        shape = (T_B - T, *x.shape[1:])
        spare = self.rand(*shape) if self.layout.training else torch.full(shape, NAN, dtype=x.dtype)
        return torch.cat([x, spare])


def _region(shape) -> tuple[slice, ...]:
    """The real part of a result or gradient of the bucket: the leading block of the reference's shape."""
    return tuple(slice(0, n) for n in shape)


def _rest(t: torch.Tensor, shape) -> torch.Tensor:
    keep = torch.ones(t.shape, dtype=torch.bool)
    keep[_region(shape)] = False
    return t[keep]


def _tolerance(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-4)


def _real_and_spare(run: Run, got: torch.Tensor, want: torch.Tensor, what: str) -> torch.Tensor:
    part = got[_region(want.shape)]
    assert not torch.isnan(part).any() or torch.isnan(want).any(), f"{what}: NaN reached a real entry"
    torch.testing.assert_close(part.double(), want.double(), **_tolerance(run.dtype), msg=what)
    return _rest(got, want.shape)


def check(
    run: Run,
    call: Callable,
    inputs: Mapping[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
    params: Mapping[str, torch.Tensor | None] | None = None,
    *,
    spare: str | float = "token",
) -> tuple[torch.Tensor, ...]:
    """Run ``call(caller, batch, **inputs, **params)`` on the real batch (float64, ``"torch"``)
    and on its bucket (``run.backend``, ``run.dtype``) and check the bucket's results against the
    real ones (see the module docstring).

    ``inputs``: float64 tensors of the real batch with ``T`` rows, grown to the bucket by
    :meth:`Run.grow`, or (real, bucketed) pairs. ``params``: float64 tensors passed as they are
    (weights). ``spare``: what the bucket's results hold outside their real part in the inference
    layout: ``"token"`` (a per-token op: anything), ``"sequence"`` (zeros from the ``"torch"``
    reference, anything from a kernel) or a number every backend returns there (the result of an
    empty sequence)."""
    weights: dict[str, torch.Tensor] = {n: p for n, p in (params or {}).items() if p is not None}
    real, bucket = _batches(run.layout)
    pairs = {n: t if isinstance(t, tuple) else (t, run.grow(t)) for n, t in inputs.items()}

    try:  # the backend's reasons for this input: those of the real batch in the backend's dtype
        call(
            Caller(run.backend, explain=True),
            real,
            **{n: a.to(run.dtype) for n, (a, _) in pairs.items()},
            **{n: p.to(run.dtype) for n, p in weights.items()},
        )
    except _Explained as done:
        if done.why is None:
            pytest.skip(f"no {run.backend} implementation")
        if done.why:
            pytest.skip(f"{run.backend} cannot take this input: {done.why}")
    else:
        raise AssertionError("the case called no public function through its caller")

    def leaves(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {n: t.detach().to(dtype).requires_grad_(t.is_floating_point()) for n, t in tensors.items()}

    want_in = leaves({n: a for n, (a, _) in pairs.items()}, torch.float64)
    want_par = leaves(weights, torch.float64)
    got_in = leaves({n: b for n, (_, b) in pairs.items()}, run.dtype)
    got_par = leaves(weights, run.dtype)

    def outputs(result) -> tuple[torch.Tensor, ...]:
        return tuple(result) if isinstance(result, tuple) else (result,)

    wants = outputs(call(Caller("torch"), real, **want_in, **want_par))
    gots = outputs(call(Caller(run.backend), bucket, **got_in, **got_par))
    assert len(gots) == len(wants)
    for i, (got, want) in enumerate(zip(gots, wants)):
        rest = _real_and_spare(run, got.detach(), want.detach(), f"result {i}")
        if run.layout.training:
            assert torch.isfinite(rest).all(), f"result {i}: a filler's entry is not finite"
        elif spare == "sequence":
            if run.backend == "torch":
                assert (rest == 0).all(), f"result {i}: the reference returns zeros at spare rows"
        elif isinstance(spare, float):
            assert (rest == spare).all(), f"result {i}: expected {spare} past the real entries"

    # backward, where the op has one: the incoming gradient is NaN (inference) or zero (training)
    # outside the real part
    pick = [i for i, w in enumerate(wants) if w.requires_grad]
    if not pick:
        return gots
    ups = [run.rand(*wants[i].shape) for i in pick]
    fill = 0.0 if run.layout.training else NAN
    got_ups = []
    for i, up in zip(pick, ups):
        g = torch.full(gots[i].shape, fill, dtype=gots[i].dtype)
        g[_region(up.shape)] = up.to(g.dtype)
        got_ups.append(g)
    names = [n for n, t in {**want_in, **want_par}.items() if t.requires_grad]
    want_grads = torch.autograd.grad([wants[i] for i in pick], [{**want_in, **want_par}[n] for n in names], ups)
    got_grads = torch.autograd.grad(
        [gots[i] for i in pick], [{**got_in, **got_par}[n] for n in names], got_ups, allow_unused=True
    )
    for name, got, want in zip(names, got_grads, want_grads):
        assert got is not None, f"no gradient of {name}"
        if name in want_par:
            if run.layout.training:  # inference runs no backward; NaN rows may enter a weight's gradient
                torch.testing.assert_close(got.double(), want, **_tolerance(run.dtype), msg=f"gradient of {name}")
            continue
        rest = _real_and_spare(run, got, want, f"gradient of {name}")
        if run.layout.training:
            assert (rest == 0).all(), f"gradient of {name}: not zero at the spare entries"
    return gots


# ------------------------------------------------------------------------------------------
# The cases, by op


def _position_buckets(longest: int) -> torch.Tensor:
    """A position-bias bucket per relative position ``j - i`` in ``[-(longest - 1), longest - 1]``."""
    rel = torch.arange(-(longest - 1), longest)
    return (rel.clamp(-7, 7) + 7).to(torch.int64)


def attention_case(run: Run, causal: bool = False, window=(-1, -1), bias: bool = False) -> None:
    heads, kv_heads, dim = 4, 2, 16

    def call(c, batch, q, k, v, table=None):
        pb = None if table is None else (table, _position_buckets(batch.max_len))
        off, m = batch.offsets, batch.max_len
        if _internal(batch):
            left, right = effective_window(window, causal, m, m)
            args = AttentionArgs(q, k, v, off, off, m, m, causal, dim**-0.5, window_left=left, window_right=right)
            if pb is not None:
                args = args._replace(bias_table=pb[0], bias_buckets=pb[1])
            needs_grad = any(t is not None and t.requires_grad for t in (q, k, v, table))
            return c.op(ATTENTION, args, spec_of(args, needs_grad)).out
        return c(ragged.varlen_attention, q, k, v, off, off, m, m, causal, window_size=window, position_bias=pb)

    tensors = {"q": run.rand(T, heads, dim), "k": run.rand(T, kv_heads, dim), "v": run.rand(T, kv_heads, dim)}
    check(run, call, tensors, {"table": run.rand(15, heads) if bias else None}, spare="sequence")


def add_layer_norm_case(run: Run, residual: bool) -> None:
    features = 32

    def call(c, batch, x, residual=None, weight=None, bias=None):
        return c(ragged.add_layer_norm, x, residual, weight, bias, return_sum=residual is not None)

    inputs = {"x": run.rand(T, features)}
    params = {}
    if residual:
        inputs["residual"] = run.rand(T, features)
        params = {"weight": run.rand(features), "bias": run.rand(features)}
    check(run, call, inputs, params)


def add_rms_norm_case(run: Run, residual: bool, unit_offset: bool) -> None:
    features = 32

    def call(c, batch, x, residual=None, weight=None):
        return c(ragged.add_rms_norm, x, residual, weight, return_sum=residual is not None, unit_offset=unit_offset)

    inputs = {"x": run.rand(T, features)}
    if residual:
        inputs["residual"] = run.rand(T, features)
    check(run, call, inputs, {"weight": run.rand(features)})


def linear_cross_entropy_case(run: Run, softcap: float | None) -> None:
    """Per-token losses (reduction="none"): the targets of a row depend on its index only, so the
    real rows have the same in both batches; ignored rows among them."""

    def call(c, batch, x, weight=None):
        target = (torch.arange(batch.rows) * 7) % VOCAB
        target[::4] = -100
        return c(ragged.linear_cross_entropy, x, weight, target, reduction="none", softcap=softcap, chunk_size=16)

    check(run, call, {"x": run.rand(T, DIM)}, {"weight": run.rand(VOCAB, DIM)})


def bias_act_case(run: Run, activation: str, bias: bool) -> None:
    def call(c, batch, x, bias=None):
        return c(ragged.bias_act, x, bias, activation)

    check(run, call, {"x": run.rand(T, 24)}, {"bias": run.rand(24) if bias else None})


def gated_act_case(run: Run) -> None:
    def call(c, batch, x):
        return c(ragged.gated_act, x, "gelu")

    check(run, call, {"x": run.rand(T, 2 * 12)})


def pool_case(run: Run, mode: str) -> None:
    def call(c, batch, x):
        return c(ragged.pool, ragged.RaggedTensor(x, batch.offsets, batch.max_len), mode)

    # [B_B, F]: an empty sequence pools to zeros on every backend
    check(run, call, {"x": run.rand(T, 6)}, spare=0.0)


def rotary_case(run: Run) -> None:
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))

    def call(c, batch, x):
        positions = ragged.RaggedTensor(x, batch.offsets, batch.max_len).position_ids()
        assert int(positions.max()) < batch.max_len  # a spare row's position exists in the bucket's tables
        return c(ragged.rotary_embedding, x, positions, inv_freq)

    check(run, call, {"x": run.rand(T, 3, 8)})


VOCAB, DIM = 40, 16
# per-sequence candidates: the real sequences', then the fillers' (training; empty for the other spare sequences)
REAL_IDS = ((1, 4, 9, 20, 33), (0, 7, 8), (2, 3, 5, 11, 12, 30, 39), (6, 21, 22, 38))
FILLER_IDS = ((0, 10, 19, 25, 31, 36), (14, 15, 16, 17))
SHARED_IDS = (0, 3, 6, 13, 17, 21, 28, 34, 39)


def _vocab(batch: Batch, shared: bool):
    if shared:
        return torch.tensor(SHARED_IDS)
    ids = list(REAL_IDS)
    if batch.bucketed:
        empty = B_B - B - (len(FILLER_IDS) if batch.layout.training else 0)
        ids += [()] * empty + (list(FILLER_IDS) if batch.layout.training else [])
    return ragged.pack([torch.tensor(i, dtype=torch.int64) for i in ids])


def _vocab_args(batch: Batch, hidden, weight, bias) -> VocabProjectionArgs:
    """The projection's operands on per-sequence vocabularies, laid out as the public functions lay them."""
    vocab = _vocab(batch, shared=False)
    h, v = batch.offsets.tolist(), vocab.offsets.tolist()
    first = [0]
    for b in range(len(h) - 1):
        first.append(first[-1] + (h[b + 1] - h[b]) * (v[b + 1] - v[b]))
    l_off = torch.tensor(first, dtype=torch.int64)
    return VocabProjectionArgs(
        hidden, batch.offsets, weight, bias, vocab.values, vocab.offsets, l_off, first[-1], batch.max_len, vocab.max_len
    )


def vocab_projection_case(run: Run, shared: bool) -> None:
    def call(c, batch, hidden, weight, bias):
        if _internal(batch) and not shared:
            a = _vocab_args(batch, hidden, weight, bias)
            values = c.op(VOCAB_PROJECTION, a, vocab_spec(*a[:6])).logits
            logits = ragged.RaggedLogits(
                values, a.h_off, batch.rows, a.max_t, a.ids, a.v_off, a.max_v, a.l_off, weight.shape[0]
            )
        else:
            h = ragged.RaggedTensor(hidden, batch.offsets, batch.max_len)
            logits = c(ragged.vocab_projection, h, weight, _vocab(batch, shared), bias)
        # shared: [rows, S] (a GEMM, per token); per sequence: the flat blocks, the real sequences' first;
        # then the padded form, [B, L, max candidates]
        flat = logits.values.view(batch.rows, len(SHARED_IDS)) if shared else logits.values
        return flat, logits.to_padded(0.0)

    params = {"weight": run.rand(VOCAB, DIM), "bias": run.rand(VOCAB)}
    check(run, call, {"hidden": run.rand(T, DIM)}, params, spare="token" if shared else "sequence")


def _targets(shared: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    out = []
    for b, n in enumerate(LENGTHS):
        ids = torch.tensor(SHARED_IDS if shared else REAL_IDS[b])
        out.append(ids[torch.randint(0, len(ids), (n,), generator=g)])
    target = torch.cat(out)
    target[1] = -100  # one ignored real token
    return target


def vocab_cross_entropy_case(run: Run, shared: bool, reduction: str) -> None:
    def call(c, batch, hidden, weight, bias):
        h = ragged.RaggedTensor(hidden, batch.offsets, batch.max_len)
        target = _targets(shared)
        if batch.bucketed:  # the graphs' labels: ignored at every spare row
            target = torch.cat([target, torch.full((T_B - T,), -100, dtype=target.dtype)])
        if _internal(batch) and not shared:
            a = _vocab_args(batch, hidden, weight, bias)
            args = VocabCrossEntropyArgs(*a, target, -100, 0.0)
            out = c.op(VOCAB_CROSS_ENTROPY, args, vocab_spec(*a[:6]))
            loss = {"none": out.loss, "sum": out.loss.sum(), "mean": out.loss.sum() / (out.local >= 0).sum()}
            return loss[reduction].to(hidden.dtype)
        return c(ragged.vocab_cross_entropy, h, weight, _vocab(batch, shared), target, bias, reduction=reduction)

    params = {"weight": run.rand(VOCAB, DIM), "bias": run.rand(VOCAB)}
    check(run, call, {"hidden": run.rand(T, DIM)}, params, spare="sequence")


def _padded(x: torch.Tensor, lengths: list[int], width: int) -> torch.Tensor:
    """``[len(lengths), width, F]``: the rows of ``x`` by sequence, NaN at padding."""
    out = torch.full((len(lengths), width, x.shape[1]), NAN, dtype=x.dtype)
    rows = iter(x)
    for b, n in enumerate(lengths):
        for j in range(n):
            out[b, j] = next(rows)
    return out


def pack_case(run: Run) -> None:
    def call(c, batch, padded):
        if _internal(batch):
            args = PackArgs(padded, batch.offsets, batch.rows, False)
            return c.op(PACK, args, PackSpec(padded.device, padded.dtype)).values
        return c(ragged.pack_values, padded, batch.offsets, batch.rows)

    x = run.rand(T, 5)
    real, bucket = _batches(run.layout)
    grown = run.grow(x)  # the fillers' tokens in training
    check(run, call, {"padded": (_padded(x, real.lengths, LONGEST), _padded(grown, bucket.lengths, L_B))})


def unpack_case(run: Run) -> None:
    pad = -2.5

    def call(c, batch, x):
        if _internal(batch):
            args = UnpackArgs(x, batch.offsets, batch.max_len, pad, False)
            return c.op(UNPACK, args, PackSpec(x.device, x.dtype)).padded
        return c(ragged.unpack_values, x, batch.offsets, batch.max_len, padding_value=pad)

    # [B_B, L_B, F]: padding at the real sequences' tail columns and throughout the empty ones
    check(run, call, {"x": run.rand(T, 5)}, spare=pad)


CASES: dict[str, dict[str, Callable[[Run], None]]] = {
    "attention": {
        "plain": attention_case,
        "causal": partial(attention_case, causal=True),
        "window": partial(attention_case, window=(2, 1)),
        "position_bias": partial(attention_case, bias=True),
    },
    "add_layer_norm": {
        "residual": partial(add_layer_norm_case, residual=True),
        "alone": partial(add_layer_norm_case, residual=False),
    },
    "bias_act": {
        "gelu": partial(bias_act_case, activation="gelu", bias=True),
        "relu_no_bias": partial(bias_act_case, activation="relu", bias=False),
    },
    "gated_act": {"gelu": gated_act_case},
    "add_rms_norm": {
        "residual": partial(add_rms_norm_case, residual=True, unit_offset=False),
        "alone_gemma": partial(add_rms_norm_case, residual=False, unit_offset=True),
    },
    "linear_cross_entropy": {
        "plain": partial(linear_cross_entropy_case, softcap=None),
        "softcap": partial(linear_cross_entropy_case, softcap=3.0),
    },
    "pool": {mode: partial(pool_case, mode=mode) for mode in ("mean", "sum", "max", "first", "last")},
    "rotary_embedding": {"rope": rotary_case},
    "vocab_projection": {
        "shared": partial(vocab_projection_case, shared=True),
        "per_sequence": partial(vocab_projection_case, shared=False),
    },
    "vocab_cross_entropy": {
        **{f"shared_{r}": partial(vocab_cross_entropy_case, shared=True, reduction=r) for r in ("none", "sum", "mean")},
        "per_sequence_mean": partial(vocab_cross_entropy_case, shared=False, reduction="mean"),
    },
    "pack": {"padded": pack_case},
    "unpack": {"values": unpack_case},
}

# Cases that break the contract today: (op, variant, backend, layout), None matching any, with the
# exception they raise and why. None does now.
BROKEN: list[tuple[tuple[str | None, ...], type[BaseException], str]] = []


def _broken(key: tuple[str, str, str, str]):
    for pattern, exc, reason in BROKEN:
        if all(p is None or p == k for p, k in zip(pattern, key)):
            return pytest.mark.xfail(strict=True, raises=exc, reason=reason)
    return None


BACKENDS = tuple(b for b in ragged.BACKENDS if b != "auto")


def _params():
    for op, variants in CASES.items():
        for variant in variants:
            for backend in BACKENDS:
                for layout in LAYOUTS:
                    mark = _broken((op, variant, backend, layout.name))
                    yield pytest.param(
                        op,
                        variant,
                        backend,
                        layout,
                        id=f"{op}-{variant}-{backend}-{layout.name}",
                        marks=() if mark is None else (mark,),
                    )


def _refused_calls() -> dict[str, Callable[[], object]]:
    """A call of every public function that checks the offsets at no cost (CPU offsets), on an
    inference bucket: each must refuse it (rule 7)."""
    offsets = torch.tensor(INFERENCE.offsets, dtype=torch.int32)
    x = torch.zeros(T_B, 4)
    q = torch.zeros(T_B, 2, 8)
    hidden = ragged.RaggedTensor(torch.zeros(T_B, DIM), offsets, L_B)
    bucket = _batches(INFERENCE)[1]
    weight = torch.zeros(VOCAB, DIM)
    target = torch.full((T_B,), -100)
    return {
        "varlen_attention": lambda: ragged.varlen_attention(q, q, q, offsets, offsets, L_B, L_B),
        "pack_values": lambda: ragged.pack_values(torch.zeros(B_B, L_B, 4), offsets, T_B),
        "unpack_values": lambda: ragged.unpack_values(x, offsets, L_B),
        "to_padded": lambda: ragged.RaggedTensor(x, offsets, L_B).to_padded(),
        "vocab_projection": lambda: ragged.vocab_projection(hidden, weight, _vocab(bucket, False)),
        "vocab_cross_entropy": lambda: ragged.vocab_cross_entropy(hidden, weight, _vocab(bucket, False), target),
    }


@pytest.mark.parametrize("name", list(_refused_calls()))
def test_public_functions_refuse_spare_rows(name):
    """A public function keeps the data contract: offsets that end short of the values are an
    error, not spare rows (the cases above run the op definitions on such a batch instead)."""
    with pytest.raises(ValueError, match=rf"\[-1\] == .*\({T_B}\), got {T}"):
        _refused_calls()[name]()


@pytest.fixture
def _unwritten_memory_is_nan():
    """``torch.empty`` returns NaN (integers: their largest value) while a case runs."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def test_every_registered_op_has_a_bucket_case():
    # the package's ops: a test module may register a toy op of its own in the same process
    package_ops = {op for op in backends.op_names() if backends.op_entry(op).spec.__module__.startswith("ragged.")}
    assert set(CASES) == package_ops


def _spare_lengths(layout: Layout) -> list[int]:
    o = layout.offsets
    return [o[i + 1] - o[i] for i in range(B, B_B)]


def test_the_layouts_are_the_graphs_buckets():
    """The layouts of the cases, as the graphs lay a batch out (nn/graphed.py, nn/graphed_train.py)."""
    for layout in LAYOUTS:
        assert len(layout.offsets) == B_B + 1 and layout.offsets[: B + 1] == REAL_OFFSETS
        assert LONGEST <= L_B and all(n <= L_B for n in _spare_lengths(layout))
    assert set(INFERENCE.offsets[B:]) == {T}  # empty trailing sequences, spare rows past offsets[-1]
    assert TRAINING.offsets[-1] == T_B and [n for n in _spare_lengths(TRAINING) if n] == list(FILLERS)
    assert _spare_lengths(TRAINING)[0] == 0  # the empty spare sequences come before the fillers


@pytest.mark.usefixtures("_unwritten_memory_is_nan")
@pytest.mark.parametrize(("op", "variant", "backend", "layout"), list(_params()))
def test_bucketed_batch(op, variant, backend, layout):
    CASES[op][variant](Run(backend, layout))
