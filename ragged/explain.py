"""``ragged.explain``: every implementation's reasons for an input, and which one the call runs.

Kept apart from :mod:`ragged.backends` (the choice itself), whose public registry it reads.
:func:`explain` of a public function runs that function inside
:func:`ragged.backends.capturing_choice`, so that :func:`ragged.backends.select_spec` stops it
(raising ``ChoiceCaptured``) at the point where it would pick a backend, with the spec it would
pick for.

The names of public functions in its messages (``ragged.pack``, and ``ragged.<op>`` suggested for
an op name) come from the package's namespace, looked up in ``sys.modules`` when a message is
made: the package imports this module, so this module does not import the package (and nothing
writes into this module when the package is imported).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping

import torch

from .backends import (
    ChoiceCaptured,
    OpEntry,
    auto_choice,
    capturing_choice,
    forced_choice,
    get_backend,
    op_entry,
    op_names,
    preferences,
)


def _public() -> Mapping[str, object]:
    """The package's namespace (the public functions :func:`explain` names in its messages and
    suggests for an op name), as it stands when a message is made; empty while the package is
    not imported."""
    package = sys.modules.get(__name__.rpartition(".")[0])
    return vars(package) if package is not None else {}


def _entry(fn: str, op: object) -> OpEntry:
    if not isinstance(op, str):
        raise TypeError(
            f"{fn}(): expected op to be an op name (one of {op_names()}) or a public function "
            f"of ragged, got {type(op).__name__}"
        )
    entry = op_entry(op)
    if entry is None:
        raise ValueError(f"{fn}(): expected op to be one of {op_names()}, got {op!r}")
    return entry


def _public_name(fn: Callable) -> str:
    name = getattr(fn, "__name__", None)
    if name and _public().get(name) is fn:
        return f"ragged.{name}"
    return getattr(fn, "__qualname__", None) or repr(fn)


def _parameter_list(fn: Callable, skip: tuple[str, ...] = ()) -> str:
    """``"q, k, v, causal=False"``: the parameters of ``fn`` (``...`` for ``*args``)."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.name in skip:
            continue
        if p.kind is p.VAR_POSITIONAL:
            out.append("...")
        elif p.kind is not p.VAR_KEYWORD:
            out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(out)


def _describe_call(args: tuple, kwargs: dict) -> str:
    if not args and not kwargs:
        return "no arguments"
    parts = [f"{len(args)} positional argument{'s' if len(args) != 1 else ''}"] if args else []
    if kwargs:
        parts.append("keywords " + ", ".join(sorted(kwargs)))
    return " and ".join(parts)


def _bad_arguments(op: str, entry: OpEntry, args: tuple, kwargs: dict, why: str) -> TypeError:
    """The TypeError of ``explain(op, ...)`` called with operands its spec cannot take."""
    msg = (
        f"ragged.explain(): expected the arguments that the reasons of op {op!r} take "
        f"({_parameter_list(entry.spec)}), got {_describe_call(args, kwargs)} ({why})"
    )
    public = _public().get(op)
    if callable(public):
        msg += (
            f"; or pass the public function with its own arguments: ragged.explain(ragged.{op}, "
            f"{_parameter_list(public, skip=('backend',))})"
        )
    return TypeError(msg)


def _explain_call(public: Callable, args: tuple, kwargs: dict) -> Explanation:
    """explain() of a public function: run it until it asks select() for a backend."""
    name = _public_name(public)
    selected = get_backend()  # the caller's choice, read before the call runs under _EXPLAIN
    try:
        bound = inspect.signature(public).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(
            f"ragged.explain(): expected the arguments of {name} "
            f"({_parameter_list(public, skip=('backend',))}), got {_describe_call(args, kwargs)} "
            f"({exc})"
        ) from None
    except ValueError:  # no signature (a builtin): pass the arguments as they are
        bound = None
    if bound is not None:
        # A backend= argument would skip the choice that explain() reports on: every backend
        # is reported anyway.
        bound.arguments.pop("backend", None)
        args, kwargs = bound.args, bound.kwargs
    try:
        with capturing_choice():
            public(*args, **kwargs)
    except ChoiceCaptured as captured:
        entry = op_entry(captured.op)
        assert entry is not None  # a choice is captured for a registered op only
        return _spec_reasons(entry, captured.spec, selected)
    raise ValueError(
        f"ragged.explain(): expected a call that picks a backend, got one of {name}() that picks "
        "none (no op with backends runs for these arguments)"
    )


def _reasons(op: str, entry: OpEntry, args: tuple, kwargs: dict) -> Explanation:
    try:
        inspect.signature(entry.spec).bind(*args, **kwargs)
    except TypeError as exc:
        raise _bad_arguments(op, entry, args, kwargs, str(exc)) from None
    try:
        spec = entry.spec(*args, **kwargs)
    except (AttributeError, TypeError, IndexError) as exc:
        raise _bad_arguments(op, entry, args, kwargs, f"{type(exc).__name__}: {exc}") from exc
    return _spec_reasons(entry, spec, get_backend())


class Explanation(dict):
    """What :func:`explain` returns: ``{backend name: [reason, ...]}`` (a plain dict of every
    implementation's reasons), plus

    * ``chosen``: the backend this call runs under the current selection (``set_backend`` /
      ``use_backend``; a ``backend=`` argument of the explained call is ignored), or None where
      the selected backend cannot take it (the call would raise);
    * ``launch``: for a call the ``"cuda"`` backend runs, how its kernels are loaded on that
      device: ``"aot"`` (the ``ragged._C`` binary) or ``"jit"`` (NVRTC), see
      :func:`ragged.build_info`; None for any other backend;
    * ``preferred``: the implementation a preference puts first for this op
      (:func:`ragged.backends.prefer`, ``RAGGED_PREFER``, ``RAGGED_ATTENTION_HOPPER``), or None.

    The keys are implementation names: a backend's name, or ``<backend>_<variant>`` for a second
    implementation of one backend (the sm_90 attention kernels: ``"triton_sm90"``,
    ``"triton_sm90_full"``)."""

    chosen: str | None = None
    launch: str | None = None
    preferred: str | None = None

    def __repr__(self) -> str:
        return (
            f"Explanation({dict.__repr__(self)}, chosen={self.chosen!r}, launch={self.launch!r}, "
            f"preferred={self.preferred!r})"
        )


def _spec_reasons(entry: OpEntry, spec, selected: str) -> Explanation:
    out = Explanation({name: impl.reasons(spec) for name, impl in entry.impls.items()})
    if selected == "auto":
        name: str | None = auto_choice(entry, spec).name
    else:
        try:
            name = forced_choice(entry, selected, spec, "ragged.explain").name
        except ValueError:  # the forced backend cannot take it: the call would raise
            name = None
    out.chosen = name
    out.preferred = preferences().get(entry.op)
    if name == "cuda":
        from .kernels.cuda.launch import launch_path

        index = spec.device.index if spec.device.index is not None else torch.cuda.current_device()
        try:
            out.launch = launch_path(index)
        except (RuntimeError, ValueError) as exc:
            out.launch = f"error: {exc}"
    return out


def explain(op: str | Callable, /, *args, **kwargs) -> Explanation:
    """For each implementation of an op, the reasons it cannot take these arguments.

    Returns an :class:`Explanation`: ``{backend name: [reason, ...]}``, an empty list for a
    backend that can take the input, with ``.chosen`` (the backend the call runs) and
    ``.launch`` (``"aot"`` or ``"jit"`` where that is the ``"cuda"`` backend). ``op`` is either

    * a public function of ragged, followed by that function's own arguments: it is run
      up to the point where it picks a backend (its argument checks included, no kernel),
      and its op's reasons for the inputs it would pass are returned. A ``backend=``
      argument is ignored: every backend is reported.
    * an op name (``"pack"``, ``"unpack"``, ``"attention"``, ``"bias_act"``, ``"gated_act"``,
      ``"add_layer_norm"``, ``"vocab_projection"``, ``"vocab_cross_entropy"``, ``"pool"``,
      ``"rotary_embedding"``),
      followed by the arguments the op's spec function takes, which are the op's internal
      operands, not the public function's:

      ==========================  ====================================================
      op                          arguments
      ==========================  ====================================================
      ``pack``                    ``padded [B, M, *F], offsets [B+1]``
      ``unpack``                  ``values [T, *F], offsets [B+1]``
      ``attention``               ``q, k, v [T, H, D], cu_q, cu_k [B+1], max_q, max_k,
                                  causal, dropout_p, needs_grad, window_size,
                                  position_bias (table, buckets) or None``
      ``bias_act``                ``x [N, F], bias [F] or None, activation``
      ``gated_act``               ``x [N, 2F], activation``
      ``add_layer_norm``          ``x [N, F], residual [N, F] or None, weight, bias``
      ``vocab_projection``,       ``hidden [T, d], h_off [B+1], weight [V, d], bias,
      ``vocab_cross_entropy``     ids [N], v_off [B+1] or None``
      ``pool``                    ``values [T, F], offsets [B+1], mode``
      ``rotary_embedding``        ``x [T, N, D], positions [T], inv_freq [D/2], scaling``
      ==========================  ====================================================

    An unknown op name raises ``ValueError`` listing the ops; arguments the reasons cannot
    take raise ``TypeError`` naming the ones they need.

    >>> import torch, ragged
    >>> x = torch.randn(2, 4, 8)
    >>> rt = ragged.pack(x, lengths=[1, 3])
    >>> ragged.explain(ragged.pack, x, lengths=[1, 3])["torch"]
    []
    >>> ragged.explain("pack", x, rt.offsets)["cuda"]
    ['the CUDA kernels need a CUDA tensor, got a cpu tensor']
    >>> why = ragged.explain(ragged.pack, x, lengths=[1, 3])
    >>> why.chosen, why.launch
    ('torch', None)
    >>> ragged.explain(ragged.unpack, rt)["torch"], ragged.explain("unpack", rt.values, rt.offsets)["torch"]
    ([], [])
    >>> q = ragged.pack([torch.randn(n, 2, 16) for n in (3, 5)])
    >>> ragged.explain(ragged.attention, q, q, q, causal=True)["torch"]
    []
    >>> ragged.explain("attention", q.values, q.values, q.values, q.offsets, q.offsets, q.max_len, q.max_len,
    ...                True, 0.0, False)["torch"]
    []
    >>> bias = (torch.zeros(32, 2), torch.zeros(2 * q.max_len - 1, dtype=torch.int32))
    >>> ragged.explain(ragged.attention, q, q, q, position_bias=bias)["torch"]
    []
    >>> ragged.explain("attention", q.values, q.values, q.values, q.offsets, q.offsets, q.max_len, q.max_len,
    ...                False, 0.0, False, (-1, -1), bias)["torch"]
    []
    >>> h, b = torch.randn(5, 8), torch.zeros(8)
    >>> ragged.explain(ragged.bias_act, h, b, "gelu")["torch"], ragged.explain("bias_act", h, b, "gelu")["torch"]
    ([], [])
    >>> ragged.explain(ragged.gated_act, h, "gelu")["torch"], ragged.explain("gated_act", h, "gelu")["torch"]
    ([], [])
    >>> ragged.explain(ragged.add_layer_norm, h, h, None, None)["torch"]
    []
    >>> ragged.explain("add_layer_norm", h, h, None, None)["torch"]
    []
    >>> hidden = ragged.pack([torch.randn(n, 8) for n in (2, 3)])
    >>> vocab = ragged.pack([torch.tensor([1, 4, 7]), torch.tensor([0, 2])])
    >>> w = torch.randn(10, 8)
    >>> ragged.explain(ragged.vocab_projection, hidden, w, vocab)["torch"]
    []
    >>> ragged.explain("vocab_projection", hidden.values, hidden.offsets, w, None, vocab.values,
    ...                vocab.offsets)["torch"]
    []
    >>> target = torch.tensor([4, 1, 2, 0, 2])
    >>> ragged.explain(ragged.vocab_cross_entropy, hidden, w, vocab, target)["torch"]
    []
    >>> ragged.explain(ragged.pool, hidden, "max")["torch"], ragged.explain("pool", hidden.values, hidden.offsets,
    ...                                                                      "max")["torch"]
    ([], [])
    >>> x, pos, inv_freq = torch.randn(5, 4, 8), torch.arange(5), torch.ones(4)
    >>> ragged.explain(ragged.rotary_embedding, x, pos, inv_freq)["torch"]
    []
    >>> ragged.explain("rotary_embedding", x, pos, inv_freq, 1.0)["torch"]
    []
    """
    if callable(op):
        return _explain_call(op, args, kwargs)
    return _reasons(op, _entry("ragged.explain", op), args, kwargs)
