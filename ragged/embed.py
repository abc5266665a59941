"""``python -m ragged.embed``: embed a text corpus with a sentence-transformers model converted by
:func:`ragged.nn.convert`, into one ``.npy`` or ``.parquet`` file, resumably.

.. code-block:: text

    python -m ragged.embed MODEL INPUT OUTPUT [--field text] [--max-tokens 16384] [--batch-size 32]
           [--dtype bf16|fp16|fp32] [--device cuda|cpu|cuda:1] [--devices all|0,1] [--chunk 65536]
           [--normalize] [--prompt-name NAME] [--prompt TEXT] [--out-dtype float32|float16] [--no-progress]

**Model**: a SentenceTransformer folder or hub name, loaded on the device, cast to ``--dtype``
(default bf16 on CUDA, fp32 on the CPU), converted by :func:`ragged.nn.convert`. **Input**:
``.txt``, one text per line (its ``\\n`` or ``\\r\\n`` stripped; an empty line is an empty text);
``.jsonl``, one JSON object per line with the text in its string field ``--field``; ``.parquet``,
the string column ``--field`` (needs pyarrow). The whole corpus is read and checked before
anything is computed: a malformed line (invalid UTF-8 or JSON, the field missing or not a string)
stops the command with the file and the 1-based line (or row) number, nothing marked done.
**Output**: ``.npy``, a ``[N, d]`` array, row ``i`` the embedding of text ``i`` (float32, or
``--out-dtype float16``); ``.parquet``, one column ``embedding`` of lists of floats (needs pyarrow).

**Resuming.** The texts are embedded in chunks of ``--chunk``. Each finished chunk is saved as
``OUTPUT.parts/chunk_{i:06d}.npy`` (float32; written under a temporary name, flushed to disk, then
renamed: a chunk file is complete or absent) beside ``manifest.json``, which records what the
chunks belong to: the input (path, size, modification time), model, dtype, field, chunk size,
normalization, prompt and number of texts. Run again with the same arguments, and the chunks on
disk are kept (``--batch-size``, ``--max-tokens``, ``--device(s)``, ``--out-dtype`` may change);
with others or a changed input, the command refuses and asks for the ``.parts`` folder to be
removed: two runs' embeddings never mix. Once every chunk is there, OUTPUT is written under a
temporary name inside ``.parts`` (the same file system), flushed to disk and renamed onto OUTPUT;
only then is ``.parts`` removed. Killed at any moment, the command leaves OUTPUT absent (or as it
was) or complete.

**Devices.** ``--device`` (default ``cuda`` when a GPU is visible, else ``cpu``): one copy of the
model. ``--devices all`` (every visible GPU) or ``--devices 0,1``: the model loaded once, a copy
and a thread per GPU, the threads taking chunks from one queue (rows stay in input order: each
chunk file carries its index). A chunk is embedded by ``ragged.nn.hf.sentence_pipeline.embed``
(the encode pipeline: batches of at most ``--max-tokens`` real tokens; ``--batch-size`` sizes
them only under a left-padding tokenizer, whose batches are sentence-transformers' own) or,
where that cannot be imported, by sentence-transformers' ``encode`` (batches of ``--batch-size``
texts).

**Reporting.** rich's progress bar (texts done, texts/s, tokens/s) when stdout is a terminal,
unless ``--no-progress``; always a last line ``embedded N texts (T tokens) in S s: X texts/s, Y
tokens/s`` on stdout: the texts this run embedded (not the chunks it resumed from), their tokens
and the time spent embedding them. A refusal (arguments, input, state) prints one line on stderr
and exits with status 1 (2 for what argparse refuses, 130 when interrupted). sentence-transformers,
rich and pyarrow are imported when needed only.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import queue
import re
import shutil
import sys
import threading
import time
from typing import Callable

import numpy as np

__all__ = ["EmbedError", "main", "parse_devices", "read_texts"]

PROG = "python -m ragged.embed"
MANIFEST = "manifest.json"
_MANIFEST_FORMAT = 1              # bump when the manifest's meaning changes: old folders then refuse
_CHUNK, chunk_name = re.compile(r"chunk_(\d{6,})\.npy"), "chunk_{:06d}.npy".format
_INPUTS, _OUTPUTS = (".txt", ".jsonl", ".parquet"), (".npy", ".parquet")
_DTYPES = ("bf16", "fp16", "fp32")


class EmbedError(ValueError):
    """What the command refuses (arguments, malformed input, chunks of another run); its message
    names the command and what was expected, and :func:`main` prints it alone, without a traceback."""


# --------------------------------------------------------------------------------------
# Arguments


def parse_devices(spec: str) -> str | list[int]:
    """``--devices``: ``"all"``, or a list of distinct GPU indices from ``"0,1"``."""
    if spec.strip() == "all":
        return "all"
    ids: list[int] = []
    for item in spec.split(","):
        item = item.strip()
        if not item.isdigit():
            raise argparse.ArgumentTypeError(
                f"expected 'all' or comma-separated GPU indices such as 0,1, got {spec!r} ({item!r} is not an index)")
        if int(item) in ids:
            raise argparse.ArgumentTypeError(f"expected distinct GPU indices, got {spec!r} ({item} twice)")
        ids.append(int(item))
    return ids


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Embed a text corpus with a sentence-transformers model "
                                "converted by ragged.nn.convert, resumably (see the module's docstring).")
    p.add_argument("model", metavar="MODEL", help="SentenceTransformer folder or hub name")
    p.add_argument("input", metavar="INPUT", help="corpus: .txt (a text per line), .jsonl or .parquet")
    p.add_argument("output", metavar="OUTPUT", help="embeddings: .npy ([N, d]) or .parquet (column 'embedding')")
    p.add_argument("--field", default="text", help="the text's field in .jsonl or column in .parquet (default: text)")
    p.add_argument("--max-tokens", type=_positive, default=16384, help="tokens per batch at most (default: 16384)")
    p.add_argument("--batch-size", type=_positive, default=32, help="texts per batch at most (default: 32)")
    p.add_argument("--dtype", choices=_DTYPES, help="model dtype (default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--device", help="one device: cuda, cpu, cuda:1 (default: cuda when visible, else cpu)")
    p.add_argument("--devices", type=parse_devices, help="several GPUs, a thread each: 'all' or indices such as 0,1")
    p.add_argument("--chunk", type=_positive, default=65536, help="texts per saved chunk (default: 65536)")
    p.add_argument("--normalize", action="store_true", help="unit-length embeddings")
    p.add_argument("--prompt-name", help="a prompt of the model's configuration, put before each text")
    p.add_argument("--prompt", help="a text put before each text")
    p.add_argument("--out-dtype", choices=("float32", "float16"), default="float32", help="(default: float32)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _suffix(path: str, allowed: tuple[str, ...], name: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in allowed:
        raise EmbedError(f"{PROG}: expected {name} to end with {', '.join(allowed)}, got {path!r}")
    return ext


def _resolve_devices(device: str | None, devices: str | list[int] | None) -> list[str]:
    """The devices to run on, checked against what torch sees."""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices is None:
        if device is None:
            return ["cuda" if visible else "cpu"]
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise EmbedError(f"{PROG}: expected --device such as cuda, cpu or cuda:1, got {device!r}") from None
        if dev.type not in ("cuda", "cpu"):
            raise EmbedError(f"{PROG}: expected --device cuda or cpu, got {device!r}")
        if dev.type == "cuda" and not (visible and (dev.index is None or dev.index < visible)):
            raise EmbedError(f"{PROG}: expected --device {device} to be a visible CUDA device, got "
                             f"{visible} visible")
        return [str(dev)]
    if device is not None:
        raise EmbedError(f"{PROG}: expected --device or --devices, got both ({device!r} and {devices!r})")
    spec = "all" if devices == "all" else ",".join(map(str, devices))
    if not visible:
        raise EmbedError(f"{PROG}: --devices {spec}: no CUDA device is visible (use --device cpu)")
    ids = list(range(visible)) if devices == "all" else devices
    if max(ids) >= visible:
        raise EmbedError(f"{PROG}: expected --devices among the visible GPUs 0 to {visible - 1}, got {max(ids)}")
    return [f"cuda:{i}" for i in ids]


# --------------------------------------------------------------------------------------
# Input


def read_texts(path: str, field: str = "text") -> list[str]:
    """The texts of a ``.txt``, ``.jsonl`` or ``.parquet`` corpus, in file order, all checked:
    :class:`EmbedError` names the first malformed line (1-based) or row."""
    ext = _suffix(path, _INPUTS, "INPUT")
    if ext == ".parquet":
        return _read_parquet(path, field)
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise EmbedError(f"{PROG}: line {line} of {path}: expected UTF-8 text, got the bytes "
                         f"{data[err.start:err.end]!r} ({err.reason})") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()                                  # the last line's newline, or an empty file
    lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    if ext == ".txt":
        return lines
    texts = []
    expected = f"expected a JSON object with a string field {field!r}"
    for number, line in enumerate(lines, 1):
        try:
            obj = json.loads(line)
        except ValueError as err:
            got = "an empty line" if not line.strip() else f"invalid JSON ({getattr(err, 'msg', err)} at column " \
                                                           f"{getattr(err, 'colno', '?')})"
            raise EmbedError(f"{PROG}: line {number} of {path}: {expected}, got {got}") from None
        value = obj.get(field) if isinstance(obj, dict) else None
        if not isinstance(value, str):
            got = (f"a JSON {_json_kind(obj)}" if not isinstance(obj, dict) else
                   f"an object without it (keys: {', '.join(map(repr, list(obj)[:8]))})" if field not in obj else
                   f"{field!r} holding a JSON {_json_kind(value)}")
            raise EmbedError(f"{PROG}: line {number} of {path}: {expected}, got {got}")
        if "\\u" in line:                            # escapes may spell lone surrogates, which no tokenizer takes
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise EmbedError(f"{PROG}: line {number} of {path}: {expected} of valid Unicode, got a lone "
                                 "surrogate escape") from None
        texts.append(value)
    return texts


def _json_kind(value: object) -> str:
    """``value``'s JSON type and (shortened) text: ``number 3``, ``array [1, 2]``, ``null``."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    text = json.dumps(value)
    return "null" if value is None else f"{kinds[type(value)]} {text if len(text) <= 60 else text[:57] + '...'}"


def _pyarrow(why: str):
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise EmbedError(f"{PROG}: {why} needs pyarrow (pip install pyarrow), which is not importable") from None
    return pyarrow


def _read_parquet(path: str, field: str) -> list[str]:
    pa = _pyarrow(f"reading {path}")
    try:
        schema = pa.parquet.read_schema(path)
    except pa.ArrowException as err:
        raise EmbedError(f"{PROG}: {path}: expected a Parquet file, got one pyarrow cannot read ({err})") from None
    if field not in schema.names:
        raise EmbedError(f"{PROG}: {path}: expected a string column {field!r}, got the columns {schema.names}")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"):
        raise EmbedError(f"{PROG}: {path}: expected a string column {field!r}, got a column of {kind}")
    column = pa.parquet.read_table(path, columns=[field]).column(field)
    if column.null_count:
        row = column.to_pylist().index(None) + 1
        raise EmbedError(f"{PROG}: row {row} of {path}: expected a string in the column {field!r}, got null")
    return column.to_pylist()


# --------------------------------------------------------------------------------------
# The .parts folder


def _manifest(args: argparse.Namespace, stat: os.stat_result, count: int, dtype: str) -> dict:
    """What the chunks in ``OUTPUT.parts`` belong to (every argument that changes a chunk's values)."""
    model = os.path.abspath(args.model) if os.path.isdir(args.model) else args.model
    field = None if args.input.lower().endswith(".txt") else args.field
    return {"format": _MANIFEST_FORMAT, "input": os.path.abspath(args.input), "input_size": stat.st_size,
            "input_mtime_ns": stat.st_mtime_ns, "model": model, "dtype": dtype, "field": field,
            "chunk": args.chunk, "normalize": args.normalize, "prompt": args.prompt,
            "prompt_name": args.prompt_name, "texts": count}


def _open_parts(parts: str, manifest: dict) -> set[int]:
    """The indices of the valid chunks of ``manifest``'s run already in ``parts`` (written by
    :func:`_start_parts`). A folder of another run (or with chunks and no manifest) is refused
    untouched; a chunk that cannot be read back with its expected shape is reported and computed again."""
    remove = f"remove the folder {parts} to start over"
    path = os.path.join(parts, MANIFEST)
    names = os.listdir(parts) if os.path.isdir(parts) else []
    total, chunk = manifest["texts"], manifest["chunk"]
    found = sorted(i for i in (int(m.group(1)) for m in map(_CHUNK.fullmatch, names) if m) if i * chunk < total)
    if MANIFEST in names:
        try:
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
            if not isinstance(old, dict):
                raise ValueError(f"a JSON {_json_kind(old)}")
        except ValueError as err:
            raise EmbedError(f"{PROG}: expected {path} to hold a JSON object, got an unreadable one ({err}); "
                             f"{remove}") from None
        keys = sorted(set(old) | set(manifest))
        diff = [f"{k}: {old.get(k)!r} there, {manifest.get(k)!r} now" for k in keys if old.get(k) != manifest.get(k)]
        if diff:
            raise EmbedError(f"{PROG}: {parts} holds the chunks of another run ({'; '.join(diff)}); {remove}, "
                             "or run again with that run's arguments and input")
    elif found:
        raise EmbedError(f"{PROG}: {parts} holds chunk files but no {MANIFEST}; {remove}")
    done = set()
    for i in found:
        rows = min(chunk, total - i * chunk)
        try:
            got = np.load(os.path.join(parts, chunk_name(i)), mmap_mode="r")
            ok = got.ndim == 2 and got.shape[0] == rows and got.dtype == np.float32
            what = f"shape {got.shape}, dtype {got.dtype}"
            del got
        except (OSError, ValueError, EOFError) as err:
            ok, what = False, str(err)
        if ok:
            done.add(i)
        else:
            print(f"{PROG}: {chunk_name(i)} in {parts}: expected {rows} float32 rows, got {what}; "
                  "embedding this chunk again", file=sys.stderr)
    return done


def _start_parts(parts: str, manifest: dict) -> None:
    """Create ``parts`` with its manifest (once the model is loaded and the arguments all checked)."""
    os.makedirs(parts, exist_ok=True)
    if not os.path.exists(os.path.join(parts, MANIFEST)):
        _write_atomic(os.path.join(parts, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode()))


def _write_atomic(path: str, write: Callable, folder: str | None = None) -> None:
    """``write(file)`` to a temporary file in ``folder`` (default: beside ``path``; the same file
    system), flushed to disk, then renamed onto ``path``: a reader (or a later run) sees the old
    file, no file, or the whole new one."""
    name = f"{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}.tmp"
    tmp = os.path.join(folder if folder is not None else os.path.dirname(path), name)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


# --------------------------------------------------------------------------------------
# Embedding


def _embedder() -> Callable:
    """The library's per-chunk pipeline, or :func:`_encode` where it cannot be imported."""
    try:
        from ragged.nn.hf.sentence_pipeline import embed
    except ImportError:
        return _encode
    return embed


def _encode(st, texts: list[str], *, prompt: str | None = None, prompt_name: str | None = None,
            normalize: bool = False, max_tokens: int | None = None, batch_size: int = 32,
            on_batch: Callable[[int, int], None] | None = None) -> np.ndarray:
    """``sentence_pipeline.embed`` through sentence-transformers' ``encode``: float32 ``[n, d]``
    in input order, ``on_batch(texts, tokens)`` after each slice of ``16 * batch_size`` texts
    (tokens counted by a second tokenization); ``max_tokens`` is not used (encode batches by count)."""
    out = []
    step = 16 * batch_size
    for lo in range(0, len(texts), step):
        part = texts[lo:lo + step]
        emb = st.encode(part, batch_size=batch_size, prompt=prompt, prompt_name=prompt_name,
                        normalize_embeddings=normalize, convert_to_numpy=True, show_progress_bar=False)
        out.append(np.asarray(emb, dtype=np.float32).reshape(len(part), -1))
        if on_batch is not None:
            on_batch(len(part), _count_tokens(st, part, prompt, prompt_name))
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


def _count_tokens(st, texts: list[str], prompt: str | None, prompt_name: str | None) -> int:
    if prompt is None:
        name = prompt_name if prompt_name is not None else getattr(st, "default_prompt_name", None)
        prompt = st.prompts.get(name) if name is not None else None
    features = st.preprocess(texts, prompt=prompt)
    mask = features.get("attention_mask")
    return int(mask.sum()) if mask is not None else sum(len(ids) for ids in features["input_ids"])


def _load(model: str, devices: list[str], dtype: str) -> list:
    """The converted model on ``devices[0]`` and a deep copy of it on each further device."""
    import torch
    from sentence_transformers import SentenceTransformer

    import ragged.nn

    st = SentenceTransformer(model, device=devices[0])
    st.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]).eval()
    st = ragged.nn.convert(st)
    return [st] + [copy.deepcopy(st).to(device) for device in devices[1:]]


def _run_chunks(replicas: list[tuple[str, object]], texts: list[str], todo: list[int], chunk: int, parts: str,
                options: dict, on_batch: Callable[[int, int], None]) -> None:
    """Embed chunks ``todo`` of ``texts`` into ``parts``: one (device, model) replica in this
    thread, several in a thread each, taking chunk indices from one queue."""
    import torch

    embed = _embedder()

    def on(device: str):    # the thread's current device: where kernels launch and streams are
        return torch.cuda.device(device) if device.startswith("cuda") else contextlib.nullcontext()

    def one(st, i: int) -> None:
        part = texts[i * chunk:(i + 1) * chunk]
        # no inference_mode: the pipeline's graphs, kept with the model, are filled in place by later
        # calls (of encode too), which an inference tensor would refuse outside that mode
        emb = np.asarray(embed(st, part, on_batch=on_batch, **options), dtype=np.float32)
        if emb.ndim != 2 or emb.shape[0] != len(part):
            raise RuntimeError(f"{PROG}: expected [{len(part)}, d] embeddings for chunk {i}, got shape {emb.shape}")
        _write_atomic(os.path.join(parts, chunk_name(i)), lambda f: np.save(f, emb))

    if len(replicas) == 1:
        with on(replicas[0][0]):
            for i in todo:
                one(replicas[0][1], i)
        return
    pending: queue.SimpleQueue = queue.SimpleQueue()
    for i in todo:
        pending.put(i)
    failures: list[BaseException] = []
    stop = threading.Event()

    def work(device: str, st) -> None:
        try:
            with on(device):
                while not stop.is_set():
                    try:
                        i = pending.get_nowait()
                    except queue.Empty:
                        return
                    one(st, i)
        except BaseException as err:   # noqa: BLE001 (handed to the main thread, which raises it)
            failures.append(err)
            stop.set()

    threads = [threading.Thread(target=work, args=replica, daemon=True, name=f"embed-{replica[0]}")
               for replica in replicas]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.2)
    finally:
        stop.set()
    if failures:
        raise failures[0]


class _Progress:
    """Texts and tokens this run has embedded, and the progress bar that shows them (if any)."""

    def __init__(self, total: int, done: int, show: bool):
        self.lock = threading.Lock()
        self.texts = self.tokens = 0
        self.start, self.seconds = time.perf_counter(), 0.0
        self.bar = self.task = None
        if show:
            try:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            except ImportError:
                return
            self.bar = Progress(TextColumn("embedding"), BarColumn(), MofNCompleteColumn(), TextColumn("texts"),
                                TextColumn("{task.fields[speed]}"), TimeRemainingColumn())
            self.task = self.bar.add_task("embedding", total=total, completed=done, speed="")

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.start()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start
        if self.bar is not None:
            self.bar.stop()

    def __call__(self, texts: int, tokens: int) -> None:
        with self.lock:
            self.texts += int(texts)
            self.tokens += int(tokens)
            seconds = max(time.perf_counter() - self.start, 1e-9)
            speed = f"{self.texts / seconds:,.0f} texts/s, {self.tokens / seconds:,.0f} tokens/s"
        if self.bar is not None:
            self.bar.update(self.task, advance=int(texts), speed=speed)

    def summary(self) -> str:
        s = self.seconds
        per_s = [n / s if s > 0 else 0.0 for n in (self.texts, self.tokens)]
        return (f"embedded {self.texts} texts ({self.tokens} tokens) in {s:.2f} s: {per_s[0]:.1f} texts/s, "
                f"{per_s[1]:.1f} tokens/s")


# --------------------------------------------------------------------------------------
# Output


def _assemble(output: str, parts: str, count: int, chunk: int, dim: int | None, out_dtype: str) -> None:
    """Write OUTPUT from the chunks (in index order), flushed to disk, renamed onto OUTPUT; then
    remove ``parts``. ``dim``: the embedding width when there are no chunks (an empty corpus)."""
    n_chunks = -(-count // chunk)
    paths = [os.path.join(parts, chunk_name(i)) for i in range(n_chunks)]
    for i, path in enumerate(paths):
        head = np.load(path, mmap_mode="r")
        rows = min(chunk, count - i * chunk)
        if head.ndim != 2 or head.shape[0] != rows or (dim is not None and head.shape[1] != dim):
            raise EmbedError(f"{PROG}: expected {path} of shape ({rows}, {dim if dim is not None else 'd'}), got "
                             f"{head.shape}; remove the folder {parts} to start over")
        dim = head.shape[1]
        del head
    dtype = np.dtype("<f4" if out_dtype == "float32" else "<f2")
    if output.lower().endswith(".npy"):
        def write(f):
            header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (count, dim)}
            np.lib.format.write_array_header_1_0(f, header)
            for path in paths:
                f.write(np.ascontiguousarray(np.load(path), dtype=dtype).tobytes())
    else:
        pa = _pyarrow(f"writing {output}")
        kind = pa.list_(pa.float32() if out_dtype == "float32" else pa.float16())
        schema = pa.schema([("embedding", kind)])

        def write(f):
            with pa.parquet.ParquetWriter(f, schema) as writer:
                if not paths:
                    writer.write_table(schema.empty_table())
                rows = max(1, (2**31 - 1) // max(dim, 1))    # a list column's offsets are int32
                for path in paths:
                    emb = np.load(path).astype(dtype)
                    for block in (emb[lo:lo + rows] for lo in range(0, emb.shape[0], rows)):
                        offsets = pa.array(np.arange(0, block.size + 1, dim, dtype=np.int32))
                        column = pa.ListArray.from_arrays(offsets, pa.array(block.reshape(-1)), type=kind)
                        writer.write_table(pa.Table.from_arrays([column], schema=schema))
    _write_atomic(output, write, folder=parts)
    if os.name == "posix":                           # the rename itself, durable
        fd = os.open(os.path.dirname(os.path.abspath(output)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    shutil.rmtree(parts)


# --------------------------------------------------------------------------------------
# The command


def _run(args: argparse.Namespace) -> int:
    in_ext = _suffix(args.input, _INPUTS, "INPUT")
    out_ext = _suffix(args.output, _OUTPUTS, "OUTPUT")
    if ".parquet" in (in_ext, out_ext):
        _pyarrow(f"a .parquet {'INPUT' if in_ext == '.parquet' else 'OUTPUT'}")
    if args.prompt is not None and args.prompt_name is not None:
        raise EmbedError(f"{PROG}: expected --prompt or --prompt-name, got both")
    if os.path.abspath(args.input) == os.path.abspath(args.output):
        raise EmbedError(f"{PROG}: expected OUTPUT other than INPUT, got {args.output!r} for both")
    devices = _resolve_devices(args.device, args.devices)
    dtype = args.dtype or ("bf16" if devices[0].startswith("cuda") else "fp32")
    stat = os.stat(args.input)                       # before reading: a later change then shows
    texts = read_texts(args.input, args.field)
    count, chunk = len(texts), args.chunk
    n_chunks = -(-count // chunk)
    parts = args.output + ".parts"
    manifest = _manifest(args, stat, count, dtype)
    done = _open_parts(parts, manifest)
    if done:
        print(f"resuming: {len(done)} of {n_chunks} chunks already done", flush=True)
    todo = [i for i in range(n_chunks) if i not in done]
    dim = None
    options = {"prompt": args.prompt, "prompt_name": args.prompt_name, "normalize": args.normalize,
               "max_tokens": args.max_tokens, "batch_size": args.batch_size}
    progress = _Progress(count, count - sum(min(chunk, count - i * chunk) for i in todo),
                         show=not args.no_progress and sys.stdout.isatty())
    if todo or count == 0:
        models = _load(args.model, devices, dtype)
        prompts = getattr(models[0], "prompts", None) or {}
        if args.prompt_name is not None and args.prompt_name not in prompts:
            raise EmbedError(f"{PROG}: expected --prompt-name among the model's prompts {sorted(prompts)}, got "
                             f"{args.prompt_name!r}")
        if count == 0:
            dim = int(np.asarray(_embedder()(models[0], [""], **options)).shape[1])
        _start_parts(parts, manifest)
        with progress:
            _run_chunks(list(zip(devices, models)), texts, todo, chunk, parts, options, progress)
    _assemble(args.output, parts, count, chunk, dim, args.out_dtype)
    print(progress.summary(), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except EmbedError as err:
        print(err, file=sys.stderr)
    except OSError as err:                           # a missing input, a full disk, a model not found
        print(f"{PROG}: {err}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; the same command again resumes from the chunks saved", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
