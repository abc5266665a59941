"""RaggedTensor: a batch of variable-length sequences stored without padding.

Coordinates used throughout ragged:

* **packed token index** ``t`` in ``[0, T)``: row ``t`` of ``values``;
* **sequence index** ``b`` in ``[0, B)``;
* **position** ``j`` in ``[0, L_b)``: position of a token within its sequence, so that
  ``t = offsets[b] + j``.

The data contract:

* ``values``: ``[T, *F]`` tensor, contiguous in the token dimension.
* ``offsets``: ``[B+1]`` int32 (int64 once a token count can pass 2**31 - 1) on
  ``values.device``; ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == T``. It is
  flash-attn's ``cu_seqlens`` and torch.nested's ``offsets``.
* ``max_len``: Python int, the longest sequence, kept on the host so that no kernel
  launch needs to read the GPU.

Sequences of length 0 and B = 0 are legal. Autograd flows through ``values``.

Bucketed batches
----------------

A CUDA graph (``ragged.nn.graphed``) runs every batch of its bucket ``(T_b, B_b, L_b)`` as
one batch of fixed sizes: ``values [T_b, *F]``, ``offsets [B_b + 1]``, ``max_len = L_b``,
the batch's ``T`` tokens in ``B`` sequences first. Such a batch breaks ``offsets[-1] == T``:

* a **spare row** is a row of ``values`` past the batch's tokens (``t >= T``). In inference
  buckets it belongs to no sequence (``t >= offsets[-1]``) and holds whatever the buffer held:
  an earlier batch's values, NaN;
* an **empty trailing sequence** is a sequence ``b >= B`` of no tokens whose offsets repeat
  ``T``; inference buckets fill ``B_b`` with them;
* a **filler sequence** owns spare rows: training buckets give every spare row to fillers of at
  most ``L_b`` tokens, after the empty trailing sequences (which start at row ``T``, a filler's
  first row), so that ``offsets[-1] == T_b`` again, every kernel writes every row, the spare
  rows hold finite values and, the incoming gradient being zero there, their gradient is zero.

Every op (each backend's implementation, and the public function around it) keeps, for such
a batch:

1. **Grid from host ints.** Its launch sizes come from host ints (``T_b``, ``B_b``, ``L_b``,
   shapes), never from a value read on the device: a read cannot be captured, and a size
   taken from one batch would be frozen into the graph.
2. **Work from the offsets, on the device.** Each program finds its sequence, rows and
   length from the offsets it reads on the device, and exits when it has no work (a sequence
   of no tokens, a row past ``offsets[-1]``).
3. **Nothing real reads a spare row.** Nothing that writes a real token's result reads a row
   past ``offsets[-1]``: not of the inputs, not of its own scratch, not of the incoming
   gradient. The real rows of every result and gradient equal those of the same call on the
   batch alone, and a NaN in a spare row reaches none of them. A reduction over tokens (the
   ``sum`` and ``mean`` of a cross-entropy) covers the real rows only; the graphs also set the
   targets of spare rows to the ignored index (``-100``).
4. **Spare rows of a result.** An op that works per sequence (attention, pack, a
   cross-entropy, a projection on per-sequence vocabularies) writes nothing real there: its
   ``"torch"`` reference returns zeros at spare rows, so that an eager run is deterministic,
   and a kernel may leave them unwritten (they then hold stale memory). A per-token op
   (``add_layer_norm``, ``bias_act``, ``gated_act``, ``rotary_embedding``, a projection on a
   vocabulary the batch shares, the GEMMs between them) may compute spare rows as it computes
   real ones, NaN in and NaN out, on every backend. An empty trailing sequence gets what any
   sequence of no tokens gets (``pool``: zeros; ``unpack``: padding) on every backend.
5. **Tokens to sequences by search.** A map from tokens to sequences or positions is computed
   with ``torch.searchsorted`` on the offsets (:meth:`RaggedTensor.seq_ids`: ``B_b`` at a spare
   row, one past the last sequence; :meth:`RaggedTensor.position_ids`: below ``max_len``, so a
   position table of ``L_b`` rows covers every row), never with ``repeat_interleave`` of the
   lengths, whose ``output_size=T`` assumes ``offsets[-1] == T``.
6. **Random draws seeded from device memory.** A kernel with a random draw (attention
   dropout) takes its seed from a device tensor while a graph is captured
   (``ragged.ops.attention.dropout_seed`` returns one then): a host int would be frozen into the
   graph, and every replay would draw the same mask.
7. **The ops take it, the public functions need not.** A bucketed batch is internal to the
   graph wrapper and the layer core, which call the op definitions directly (``ATTENTION(args,
   impl)`` and their kind): every implementation keeps rules 1-6. A public function keeps the
   data contract above, so the checks it makes for free (offsets on the CPU, offsets known on
   the host) refuse ``offsets[-1] != T`` as they refuse any other wrong offsets: a user's
   offsets that fall short of the values are an error, not spare rows.

``tests/test_bucket_contract.py`` runs every registered op on a bucketed batch of both kinds,
on every backend that runs on the CPU, forward and backward; the cases that break these rules
today are its strict xfails. ``tests/test_graphed.py`` and ``tests/test_graphed_train.py`` run
whole modules' buckets eagerly; the GPU tests capture them.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence

from . import backends
from .packing import UNPACK, PackSpec, check_offsets, reads_offsets, unpack_fill
from .records.pack import UnpackArgs
from .utils import (
    check_int,
    check_offsets_tensor,
    check_side,
    check_tensor,
    describe,
    host_lengths_of,
    host_offsets_from_lengths,
    max_length,
    offsets_dtype_for,
    to_device,
)


@dataclasses.dataclass(init=False, repr=False, eq=False)
class RaggedTensor:
    """``values [T, *F]`` + ``offsets [B+1]`` + host-side ``max_len``.

    Build one with :func:`ragged.pack`, :meth:`from_lengths` or :meth:`from_offsets`;
    the plain constructor trusts its arguments and checks nothing (it is the cheap
    path kernels use).

    It is a pytree node (``values``, ``offsets``; torch.compile, ``torch.utils._pytree``) and
    a dataclass of ``values``, ``offsets`` and ``max_len`` for the container walks of
    ``torch.distributed`` (DDP's input moves, FSDP2's input casts and gradient hooks), which
    rebuild it with ``dataclasses.replace``: a module that takes or returns RaggedTensors can
    be an FSDP2 unit. A rebuilt RaggedTensor does not carry the host copy of the offsets.
    """

    __slots__ = ("values", "offsets", "max_len", "_host_offsets", "_longest")
    values: torch.Tensor
    offsets: torch.Tensor
    max_len: int

    def __init__(
        self, values: torch.Tensor, offsets: torch.Tensor, max_len: int, host_offsets: tuple[int, ...] | None = None
    ):
        self.values = values
        self.offsets = offsets
        self.max_len = int(max_len)
        # Host copy of the offsets when known without reading the GPU (pack from a
        # list or from host lengths); used by unbind()/indexing/interop.
        self._host_offsets = host_offsets
        # The longest length of _host_offsets once computed (None: not yet). max_len is
        # trusted from the caller here, so unpack checks its width against this instead.
        self._longest: int | None = None

    # ----------------------------------------------------------------------------------
    # Constructors

    @classmethod
    def from_lengths(
        cls, values: torch.Tensor, lengths, *, max_len: int | None = None, validate: bool = True
    ) -> RaggedTensor:
        """Wrap ``values [T, *F]`` split into sequences of ``lengths`` (host or device).

        Host lengths (list, tuple, numpy array, CPU tensor) cost no sync. CUDA lengths
        are read back once.
        """
        fn = "ragged.RaggedTensor.from_lengths"
        check_tensor(fn, "values", values)
        if values.dim() < 1:
            raise ValueError(f"{fn}(): expected values with a token dimension ([T, ...]), got a 0-d tensor")
        if (
            isinstance(lengths, np.ndarray)
            and lengths.ndim == 1
            and lengths.dtype.kind in "iu"
            and not torch.compiler.is_compiling()
        ):
            # integer arrays (a data pipeline's batches) in whole-array steps, the same checks
            negative = np.flatnonzero(lengths < 0)
            if negative.size:
                i = int(negative[0])
                raise ValueError(f"{fn}(): expected lengths >= 0, got lengths[{i}] = {int(lengths[i])}")
            host = [0, *np.cumsum(lengths, dtype=np.int64).tolist()]
            longest = int(lengths.max()) if lengths.size else 0
        else:
            host = host_offsets_from_lengths(fn, host_lengths_of(fn, lengths))
            longest = None
        total = host[-1]
        if total != values.shape[0]:
            raise ValueError(f"{fn}(): expected sum(lengths) == values.shape[0] ({values.shape[0]}), got {total}")
        longest = max_length(host) if longest is None else longest
        width = longest
        if max_len is not None:
            width = check_int(fn, "max_len", max_len, minimum=0)
            if validate and width < longest:
                raise ValueError(f"{fn}(): expected max_len >= the longest length ({longest}), got {width}")
        offsets = to_device(host, offsets_dtype_for(total), values.device)
        rt = cls(values, offsets, width, tuple(host))
        rt._longest = longest
        return rt

    @classmethod
    def from_offsets(
        cls, values: torch.Tensor, offsets: torch.Tensor, max_len: int | None = None, *, validate: bool = True
    ) -> RaggedTensor:
        """Wrap ``values [T, *F]`` with ``offsets [B+1]`` (int32 or int64, same device).

        With ``validate=False`` and ``max_len`` given this reads nothing from the GPU.
        Otherwise the offsets are read back once (one sync on CUDA) to check them
        (``offsets[0] == 0``, non-decreasing, ``offsets[-1] == T``) and to find ``max_len``.
        """
        return cls.from_offsets_named(
            "ragged.RaggedTensor.from_offsets", values, offsets, max_len, validate, "offsets", "max_len"
        )

    @classmethod
    def from_offsets_named(
        cls,
        fn: str,
        values: torch.Tensor,
        offsets: torch.Tensor,
        max_len,
        validate: bool,
        offsets_name: str,
        max_len_name: str,
    ) -> RaggedTensor:
        """:meth:`from_offsets` for a function that wraps it: its errors name that function
        (``fn``) and its arguments (``offsets_name``, ``max_len_name``)."""
        check_tensor(fn, "values", values)
        if values.dim() < 1:
            raise ValueError(f"{fn}(): expected values with a token dimension ([T, ...]), got a 0-d tensor")
        # Stored as returned: kernels read offsets with unit stride.
        offsets = check_offsets_tensor(fn, offsets, values, name=offsets_name)
        if max_len is not None:
            max_len = check_int(fn, max_len_name, max_len, minimum=0)
        if not validate and max_len is not None:
            return cls(values, offsets, max_len)
        if offsets.device.type == "meta":
            raise ValueError(
                f"{fn}(): expected {offsets_name} with values to read (validate=True or no "
                f"{max_len_name}), got a tensor on the meta device; pass {max_len_name} with "
                "validate=False"
            )
        host = offsets.detach().to("cpu", torch.int64).tolist()
        validate_host_offsets(fn, host, values.shape[0], offsets_name)
        longest = max_length(host)
        width = longest
        if max_len is not None:
            if max_len < longest:
                raise ValueError(f"{fn}(): expected {max_len_name} >= the longest length ({longest}), got {max_len}")
            width = max_len
        rt = cls(values, offsets, width, tuple(host))
        rt._longest = longest
        return rt

    # ----------------------------------------------------------------------------------
    # Shape and metadata

    @property
    def batch_size(self) -> int:
        return self.offsets.shape[0] - 1

    def __len__(self) -> int:
        return self.batch_size

    @property
    def num_tokens(self) -> int:
        return self.values.shape[0]

    @property
    def feature_shape(self) -> torch.Size:
        return self.values.shape[1:]

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` lengths on ``self.device`` (same dtype as offsets); no sync."""
        return self.offsets[1:] - self.offsets[:-1]

    def host_offsets(self) -> tuple[int, ...]:
        """Offsets as Python ints (cached; one device-to-host sync the first time on CUDA)."""
        if self._host_offsets is None:
            if self.offsets.device.type == "meta":
                raise ValueError(
                    "ragged.RaggedTensor.host_offsets(): expected offsets with values to read, "
                    "got a tensor on the meta device"
                )
            self._host_offsets = tuple(self.offsets.detach().to("cpu", torch.int64).tolist())
        return self._host_offsets

    @property
    def known_host_offsets(self) -> tuple[int, ...] | None:
        """The offsets as Python ints if they are already known on the host (given at
        construction, or read once), else None; never reads the device."""
        return self._host_offsets

    def remember_host_offsets(self, host) -> None:
        """Record the offsets' values read on the host by the caller (several RaggedTensors'
        offsets read in one copy, say): ``host`` must have ``B + 1`` ints, the last the number
        of tokens. Later :meth:`host_offsets` calls then read nothing."""
        host = tuple(int(o) for o in host)
        if len(host) != self.offsets.shape[0]:
            raise ValueError(
                f"ragged.RaggedTensor.remember_host_offsets(): expected {self.offsets.shape[0]} "
                f"offsets, got {len(host)}"
            )
        validate_host_offsets("ragged.RaggedTensor.remember_host_offsets", host, self.values.shape[0])
        self._host_offsets = host

    def host_lengths(self) -> list[int]:
        """Lengths as Python ints (see :meth:`host_offsets` for the cost)."""
        o = self.host_offsets()
        return [o[i + 1] - o[i] for i in range(len(o) - 1)]

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def requires_grad(self) -> bool:
        return self.values.requires_grad

    @property
    def is_cuda(self) -> bool:
        return self.values.is_cuda

    def __repr__(self) -> str:
        if self._host_offsets is not None:
            lens = self.host_lengths()
            if len(lens) <= 8:
                lengths = f"lengths={lens}"
            else:
                lengths = f"lengths=[min {min(lens)}, mean {sum(lens) / len(lens):.1f}, max {max(lens)}]"
        else:
            lengths = f"max_len={self.max_len}"
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (
            f"RaggedTensor(batch_size={self.batch_size}, num_tokens={self.num_tokens}, {lengths}, "
            f"feature_shape={tuple(self.feature_shape)}, dtype={self.dtype}, device={self.device}{grad})"
        )

    # ----------------------------------------------------------------------------------
    # Per-token metadata (no sync)

    def seq_ids(self, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """``[T]`` sequence index ``b`` of every packed token (``B`` for rows past ``offsets[-1]``,
        the spare rows of a graphed bucket)."""
        off = self.offsets
        t = torch.arange(self.num_tokens, device=off.device, dtype=off.dtype)
        return torch.searchsorted(off[1:], t, right=True).to(dtype)

    def position_ids(self, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """``[T]`` position ``j`` of every packed token within its sequence (0-based). Rows past
        ``offsets[-1]`` (the spare rows of a graphed bucket) get positions below ``max_len``."""
        off = self.offsets
        t = torch.arange(self.num_tokens, device=off.device, dtype=off.dtype)
        pos = t - off.index_select(0, torch.searchsorted(off[1:], t, right=True))
        return pos.clamp_max_(max(self.max_len - 1, 0)).to(dtype)

    def padding_mask(self, total_length: int | None = None, padding_side: str = "right") -> torch.Tensor:
        """``[B, M]`` bool, torch convention: True at padding. ``M = total_length or max_len``."""
        m = self._width("ragged.RaggedTensor.padding_mask", total_length)
        j = torch.arange(m, device=self.device)
        lengths = self.lengths.unsqueeze(1)
        if check_side("ragged.RaggedTensor.padding_mask", padding_side) == "left":
            return j.unsqueeze(0) < (m - lengths)
        return j.unsqueeze(0) >= lengths

    def attention_mask(
        self, total_length: int | None = None, padding_side: str = "right", dtype: torch.dtype = torch.int64
    ) -> torch.Tensor:
        """``[B, M]`` HuggingFace convention: 1 at tokens, 0 at padding."""
        return (~self.padding_mask(total_length, padding_side)).to(dtype)

    def _width(self, fn: str, total_length: int | None) -> int:
        """The padded width ``M``: ``total_length`` (an int >= max_len) or ``max_len``.

        With host offsets it is also checked against the longest sequence (max_len given to
        a constructor with ``validate=False`` is not): on the host, no sync.
        """
        if total_length is None:
            width = self.max_len
            if width < 0:
                raise ValueError(f"{fn}(): expected max_len >= 0, got {width}")
        else:
            width = check_int(fn, "total_length", total_length)
            if width < self.max_len:
                raise ValueError(f"{fn}(): expected total_length >= max_len ({self.max_len}), got {width}")
        longest = self._host_longest()
        if longest is not None and width < longest:
            name = "max_len" if total_length is None else "total_length"
            raise ValueError(f"{fn}(): expected {name} >= the longest sequence ({longest}), got {width}")
        return width

    def _host_longest(self) -> int | None:
        """The longest length when the host offsets are known (cached), else None; no sync."""
        if self._longest is not None or self._host_offsets is None:
            return self._longest
        longest = max_length(self._host_offsets)
        if not torch.compiler.is_compiling():  # a traced function leaves the object as it was
            self._longest = longest
        return longest

    def _derived(self, values: torch.Tensor, offsets: torch.Tensor) -> RaggedTensor:
        """Same sequences over new ``values``/``offsets`` tensors: host metadata carried over."""
        out = RaggedTensor(values, offsets, self.max_len, self._host_offsets)
        out._longest = self._longest
        return out

    # ----------------------------------------------------------------------------------
    # Conversions

    def to_padded(
        self,
        padding_value: float = 0.0,
        total_length: int | None = None,
        padding_side: str = "right",
        backend: str | None = None,
    ) -> torch.Tensor:
        """``[B, M, *F]`` with ``padding_value`` at padding; ``M = total_length or max_len``
        (see :func:`ragged.unpack`)."""
        return self._to_padded("ragged.unpack", padding_value, total_length, padding_side, backend)

    def _to_padded(self, fn: str, padding_value, total_length, padding_side, backend) -> torch.Tensor:
        width = self._width(fn, total_length)
        left = check_side(fn, padding_side) == "left"
        values, offsets = self.values, self.offsets
        fill = unpack_fill(fn, padding_value, values, offsets)
        impl = backends.select_spec("unpack", backend, PackSpec(values.device, values.dtype), fn=fn)
        if self._host_offsets is None and reads_offsets(False, values, offsets):
            check_offsets(
                fn,
                offsets,
                values.shape[0],
                "values.shape[0]",
                width,
                "max_len" if total_length is None else "total_length",
            )
        return UNPACK(UnpackArgs(values, offsets, width, fill, left), impl.name).padded

    def unbind(self) -> tuple[torch.Tensor, ...]:
        """Views ``values[offsets[b]:offsets[b+1]]``, one per sequence (host offsets needed)."""
        o = self.host_offsets()
        return tuple(self.values[o[i] : o[i + 1]] for i in range(len(o) - 1))

    def __getitem__(self, index):
        """``rt[b]``: the ``[L_b, *F]`` view of sequence ``b``; ``rt[a:b]``: a RaggedTensor."""
        o = self.host_offsets()
        batch = self.batch_size
        if isinstance(index, slice):
            start, stop, step = index.indices(batch)
            if step != 1:
                raise ValueError(f"RaggedTensor.__getitem__(): expected a slice with step 1, got step {step}")
            stop = max(start, stop)
            base = o[start]
            host = tuple(x - base for x in o[start : stop + 1])
            offsets = self.offsets[start : stop + 1] - self.offsets[start]
            return exact_ragged(self.values[o[start] : o[stop]], offsets, host, max_length(host))
        if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            i = int(index)
            if not -batch <= i < batch:
                raise IndexError(f"RaggedTensor.__getitem__(): index {i} is out of range for batch size {batch}")
            i %= batch
            return self.values[o[i] : o[i + 1]]
        raise TypeError(f"RaggedTensor.__getitem__(): expected an int or a slice, got {describe(index)}")

    def with_values(self, values: torch.Tensor) -> RaggedTensor:
        """Same sequences, new ``values`` (``[T, *F']`` on the same device)."""
        fn = "ragged.RaggedTensor.with_values"
        check_tensor(fn, "values", values)
        if values.dim() < 1 or values.shape[0] != self.num_tokens:
            raise ValueError(f"{fn}(): expected values of shape [{self.num_tokens}, ...], got {tuple(values.shape)}")
        if values.device != self.device:
            raise ValueError(f"{fn}(): expected values on {self.device}, got {values.device}")
        return self._derived(values, self.offsets)

    def to(self, *args, **kwargs) -> RaggedTensor:
        """Like ``Tensor.to``: a dtype applies to ``values``; a device moves both tensors."""
        values = self.values.to(*args, **kwargs)
        offsets = self.offsets
        if values.device != offsets.device:
            non_blocking = bool(kwargs.get("non_blocking", False))
            offsets = offsets.to(values.device, non_blocking=non_blocking)
        return self._derived(values, offsets)

    def cuda(self, device=None, non_blocking: bool = False) -> RaggedTensor:
        return self.to(
            torch.device("cuda")
            if device is None
            else torch.device("cuda", device)
            if isinstance(device, int)
            else device,
            non_blocking=non_blocking,
        )

    def cpu(self) -> RaggedTensor:
        return self.to("cpu")

    def pin_memory(self) -> RaggedTensor:
        """Both tensors in page-locked host memory (``DataLoader(pin_memory=True)`` calls this),
        so that ``.to("cuda", non_blocking=True)`` does not wait for the copy."""
        return self._derived(self.values.pin_memory(), self.offsets.pin_memory())

    def half(self) -> RaggedTensor:
        return self.to(torch.float16)

    def bfloat16(self) -> RaggedTensor:
        return self.to(torch.bfloat16)

    def float(self) -> RaggedTensor:
        return self.to(torch.float32)

    def double(self) -> RaggedTensor:
        return self.to(torch.float64)

    def detach(self) -> RaggedTensor:
        return self.with_values(self.values.detach())

    def requires_grad_(self, requires_grad: bool = True) -> RaggedTensor:
        self.values.requires_grad_(requires_grad)
        return self

    def clone(self) -> RaggedTensor:
        return self._derived(self.values.clone(), self.offsets.clone())

    def cu_seqlens(self) -> torch.Tensor:
        """flash-attn's ``cu_seqlens``: the offsets as int32 (no copy when already int32)."""
        if self.offsets.dtype == torch.int32:
            return self.offsets
        if self.num_tokens > 2**31 - 1:
            raise ValueError(
                f"RaggedTensor.cu_seqlens(): flash-attn's int32 cu_seqlens cannot hold {self.num_tokens} tokens"
            )
        return self.offsets.to(torch.int32)

    def flash_kwargs(self, other: RaggedTensor | None = None) -> dict:
        """Keyword arguments of ``flash_attn_varlen_func`` (``other``: the key/value side)."""
        k = self if other is None else other
        return {
            "cu_seqlens_q": self.cu_seqlens(),
            "cu_seqlens_k": k.cu_seqlens(),
            "max_seqlen_q": self.max_len,
            "max_seqlen_k": k.max_len,
        }

    def to_nested(self) -> torch.Tensor:
        """A jagged-layout nested tensor ``[B, j, *F]`` that shares ``values`` (no copy).

        torch.nested keeps int64 offsets; int32 offsets are widened (a small device op).
        The host ``max_len`` is passed along so that NJT ops need not read it back.
        """
        return _to_nested(self)

    def to_packed_sequence(self, enforce_sorted: bool = False):
        """A ``torch.nn.utils.rnn.PackedSequence`` (time-major, sequences sorted by decreasing length).

        Needs the host lengths (one sync the first time when they are not known). Sequences
        of length 0 cannot be represented in a PackedSequence and raise ValueError.
        """
        return _to_packed_sequence(self, enforce_sorted)

    # ----------------------------------------------------------------------------------
    # Serialisation: torch.save / torch.load (weights_only too) round-trip.

    def __reduce__(self):
        return (_rebuild_ragged, (self.values, self.offsets, self.max_len, self._host_offsets))


def exact_ragged(values: torch.Tensor, offsets: torch.Tensor, host: Sequence[int], longest: int) -> RaggedTensor:
    """A RaggedTensor built from host offsets whose ``max_len`` is their longest length
    (``longest``, computed by the caller), so that no later check recomputes it."""
    rt = RaggedTensor(values, offsets, longest, tuple(host))
    rt._longest = longest
    return rt


def _rebuild_ragged(values, offsets, max_len, host_offsets):
    return RaggedTensor(values, offsets, max_len, host_offsets)


def validate_host_offsets(fn: str, host: Sequence[int], total: int, name: str = "offsets") -> None:
    if len(host) < 1:
        raise ValueError(f"{fn}(): expected {name} with B+1 >= 1 entries, got none")
    if host[0] != 0:
        raise ValueError(f"{fn}(): expected {name}[0] == 0, got {host[0]}")
    for i in range(len(host) - 1):
        if host[i + 1] < host[i]:
            raise ValueError(
                f"{fn}(): expected non-decreasing {name}, got {name}[{i}] = {host[i]} > {name}[{i + 1}] = {host[i + 1]}"
            )
    if host[-1] != total:
        raise ValueError(f"{fn}(): expected {name}[-1] == values.shape[0] ({total}), got {host[-1]}")


def _flatten(rt: RaggedTensor):
    return [rt.values, rt.offsets], (rt.max_len, rt._host_offsets)


def _unflatten(children, context):
    values, offsets = children
    max_len, host = context
    return RaggedTensor(values, offsets, max_len, host)


def _flatten_with_keys(rt: RaggedTensor):
    from torch.utils._pytree import GetAttrKey

    return [(GetAttrKey("values"), rt.values), (GetAttrKey("offsets"), rt.offsets)], (rt.max_len, rt._host_offsets)


def _register() -> None:
    import torch.utils._pytree as pytree

    try:
        pytree.register_pytree_node(
            RaggedTensor,
            _flatten,
            _unflatten,
            serialized_type_name="ragged.RaggedTensor",
            flatten_with_keys_fn=_flatten_with_keys,
        )
    except TypeError:  # older torch without flatten_with_keys_fn
        pytree.register_pytree_node(RaggedTensor, _flatten, _unflatten)
    torch.serialization.add_safe_globals([RaggedTensor, _rebuild_ragged])


_register()


# --------------------------------------------------------------------------------------
# torch.nested and PackedSequence


# nested_tensor_from_jagged asks torch.fx whether it is tracing, and that query reports a
# deprecation notice addressed to fx users (through logging in torch 2.13, as a
# UserWarning in some other releases), once per process: to a ragged user it is noise.
_FX_TRACING_NOTICE = "is_fx_tracing will return true"
_FX_LOGGER = "torch.fx._symbolic_trace"


class _DropFxTracingNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _FX_TRACING_NOTICE not in record.getMessage()


_DROP_FX_TRACING_NOTICE = _DropFxTracingNotice()


def _to_nested(rt: RaggedTensor) -> torch.Tensor:
    """A jagged-layout nested tensor ``[B, j, *F]`` that shares ``rt.values`` (no copy).

    torch.nested keeps int64 offsets; int32 offsets are widened (a small device op).
    The host ``max_len`` is passed along so that NJT ops need not read it back.
    """
    min_len = None
    if rt._host_offsets is not None:
        o = rt._host_offsets
        min_len = min((o[i + 1] - o[i] for i in range(len(o) - 1)), default=0)
    offsets = rt.offsets.to(torch.int64)
    if torch.compiler.is_compiling():  # filters are host state; a traced call builds the tensor only
        return torch.nested.nested_tensor_from_jagged(rt.values, offsets, max_seqlen=rt.max_len, min_seqlen=min_len)
    # The notice is filtered for this one call only, by its text, on the logger that emits it.
    logger = logging.getLogger(_FX_LOGGER)
    logger.addFilter(_DROP_FX_TRACING_NOTICE)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_FX_TRACING_NOTICE)
            return torch.nested.nested_tensor_from_jagged(rt.values, offsets, max_seqlen=rt.max_len, min_seqlen=min_len)
    finally:
        logger.removeFilter(_DROP_FX_TRACING_NOTICE)


def _to_packed_sequence(rt: RaggedTensor, enforce_sorted: bool = False) -> PackedSequence:
    """A ``PackedSequence`` (time-major, sequences sorted by decreasing length).

    Needs the host lengths (one sync the first time when they are not known). Sequences
    of length 0 cannot be represented in a PackedSequence and raise ValueError.
    """
    fn = "ragged.RaggedTensor.to_packed_sequence"
    lengths = np.asarray(rt.host_lengths(), dtype=np.int64)
    if lengths.size and lengths.min() == 0:
        raise ValueError(
            f"{fn}(): PackedSequence cannot hold sequences of length 0, got length 0 at index {int(np.argmin(lengths))}"
        )
    if lengths.size == 0:
        raise ValueError(f"{fn}(): PackedSequence cannot hold an empty batch (B = 0)")
    if enforce_sorted:
        if np.any(np.diff(lengths) > 0):
            raise ValueError(
                f"{fn}(): enforce_sorted=True needs lengths sorted in decreasing order, got {lengths.tolist()}"
            )
        order = np.arange(lengths.size)
    else:
        order = np.argsort(-lengths, kind="stable")
    starts = np.asarray(rt.host_offsets()[:-1], dtype=np.int64)[order]
    sorted_lengths = lengths[order]
    steps = np.arange(int(sorted_lengths[0]))
    present = steps[:, None] < sorted_lengths[None, :]  # [max_len, B], time-major
    index = (starts[None, :] + steps[:, None])[present]
    batch_sizes = torch.from_numpy(present.sum(1).astype(np.int64))
    data = rt.values.index_select(0, to_device(index.tolist(), torch.int64, rt.device))
    if enforce_sorted:
        return PackedSequence(data, batch_sizes, None, None)
    sorted_indices = to_device(order.tolist(), torch.int64, rt.device)
    unsorted_indices = to_device(np.argsort(order).tolist(), torch.int64, rt.device)
    return PackedSequence(data, batch_sizes, sorted_indices, unsorted_indices)
