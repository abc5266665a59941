"""What ``python -m ragged.embed`` runs (:func:`main`; the command's entry is ``ragged/embed.py``):
embed a text corpus with a sentence-transformers model converted by :func:`ragged.nn.convert`, into
one ``.npy`` or ``.parquet`` file, resumably.

.. code-block:: text

    python -m ragged.embed MODEL INPUT OUTPUT [--field text] [--max-tokens 16384] [--batch-size 32]
           [--dtype bf16|fp16|fp32] [--device cuda|cpu|cuda:1] [--devices all|0,1] [--chunk 65536]
           [--chunk-seconds 60] [--normalize] [--prompt-name NAME] [--prompt TEXT]
           [--out-dtype float32|float16] [--no-progress]

**Model**: a SentenceTransformer folder or hub name (a name already in the local cache is loaded
from there, without asking the hub), loaded once on the device, cast to ``--dtype`` (default bf16
on CUDA, fp32 on the CPU), converted by :func:`ragged.nn.convert`. **Input**
(:mod:`ragged.integrations.embed_io`): ``.txt``, one text per line (its ``\\n`` or ``\\r\\n`` stripped; an
empty line is an empty text); ``.jsonl``, one JSON object per line with the text in its string
field ``--field``; ``.parquet``, the string column ``--field`` (needs pyarrow). A UTF-8
byte-order mark opening a ``.txt`` or ``.jsonl`` file is dropped. The whole corpus is read and
checked before anything is computed: a malformed line (invalid UTF-8 or JSON, the field missing
or not a string) stops the command with the file and the 1-based line (or row) number, nothing
marked done. **Output**: ``.npy``, a ``[N, d]`` array, row ``i`` the embedding of text ``i``
(float32, or ``--out-dtype float16``); ``.parquet``, one column ``embedding`` of lists of floats
(needs pyarrow).

**Chunks.** The texts are embedded in chunks of consecutive texts, each saved once done, sized
by time: the first chunk holds ``min(--chunk, 256)`` texts, and its rate (timed again, warm, when
the first call's own costs made most of its time) sizes the others: the texts done in
``--chunk-seconds`` (default 60), at most ``--chunk`` (default 65536). The sizes are written in
the manifest and kept by every later run, so that a resumed run cuts the texts where the first
did. An input of fewer than 8 batches' worth of tokens runs without CUDA graphs (a capture
would cost more than its replays save).

**Resuming.** Each finished chunk is saved as ``OUTPUT.parts/chunk_{i:06d}.npy`` (float32;
written under a temporary name, flushed to disk, then renamed: a chunk file is complete or absent)
beside ``manifest.json``, which records what the chunks belong to: the input (path, size,
modification time), model, dtype, field, ``--chunk``, normalization, prompt, number of texts and
the chunk sizes. Run again with the same arguments, and the chunks on disk are kept
(``--batch-size``, ``--max-tokens``, ``--device(s)``, ``--chunk-seconds``, ``--out-dtype`` may
change); with others or a changed input, the command refuses and asks for the ``.parts`` folder
to be removed: two runs' embeddings never mix. Once every chunk is there, OUTPUT is written under
a temporary name inside ``.parts`` (the same file system), flushed to disk and renamed onto
OUTPUT; only then is ``.parts`` removed. Killed at any moment, the command leaves OUTPUT absent
(or as it was) or complete.

**Devices.** ``--device`` (default ``cuda`` when a GPU is visible, else ``cpu``): one copy of the
model. ``--devices all`` (every visible GPU) or ``--devices 0,1``: the model loaded once, a copy
and a thread per GPU, the threads taking chunks from one queue (rows stay in input order: each
chunk file carries its index). A chunk is embedded by ``ragged.nn.hf.sentence.pipeline.embed``
(the encode pipeline: batches of at most ``--max-tokens`` real tokens; ``--batch-size`` sizes
them only under a left-padding tokenizer, whose batches are sentence-transformers' own) or,
where that cannot be imported, by sentence-transformers' ``encode`` (batches of ``--batch-size``
texts).

**Reporting.** rich's progress bar (texts done, texts/s, tokens/s) when stdout is a terminal,
unless ``--no-progress`` (which also silences the bars of the model's loading); then two lines
(:mod:`ragged.integrations.embed_report`): ``time: ...``, where the whole run went (``imports``: the
interpreter's start and every import, the lazy ones included; ``input``; ``model``: loading,
casting, converting it; ``embedding``, with the CUDA graphs captured; ``output``; ``other``), and
``embedded N texts (T tokens) in S s: X texts/s, Y tokens/s; whole run W s: Z texts/s``: the
texts this run embedded (not the chunks it resumed from), their tokens, the time spent embedding
them, then the whole run, from the process's start to OUTPUT renamed. ``python -m`` then ends
the process at once (``os._exit``): the interpreter's teardown is skipped. A refusal (arguments,
input, state) prints one line on stderr and exits with status 1 (2 for what argparse refuses, 130
when interrupted). sentence-transformers, rich and pyarrow are imported when needed only.
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
from collections.abc import Callable

import numpy as np
import torch

import ragged.nn

from .embed_io import (
    INPUTS,
    OUTPUTS,
    PROG,
    EmbedError,
    json_kind,
    pyarrow,
    read_texts,
    suffix,
)
from .embed_report import Clock, Progress, graphs_captured, quiet_loading

__all__ = ["EmbedError", "main", "parse_devices", "read_texts"]

MANIFEST = "manifest.json"
_MANIFEST_FORMAT = 2  # bump when the manifest's meaning changes: old folders then refuse
_CHUNK, chunk_name = re.compile(r"chunk_(\d{6,})\.npy"), "chunk_{:06d}.npy".format
_DTYPES = ("bf16", "fp16", "fp32")
FIRST_CHUNK = 256  # texts in the first chunk, whose time sizes the others
CHUNK_SECONDS = 60.0  # default --chunk-seconds
WARM_UP_SECONDS = 2.0  # a first chunk done sooner is timed again: its time was the first call's
GRAPH_BATCHES = 8  # an input of fewer full batches runs without CUDA graphs


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
                f"expected 'all' or comma-separated GPU indices such as 0,1, got {spec!r} ({item!r} is not an index)"
            )
        if int(item) in ids:
            raise argparse.ArgumentTypeError(f"expected distinct GPU indices, got {spec!r} ({item} twice)")
        ids.append(int(item))
    return ids


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Embed a text corpus with a sentence-transformers model "
        "converted by ragged.nn.convert, resumably (see the module's docstring).",
    )
    p.add_argument("model", metavar="MODEL", help="SentenceTransformer folder or hub name")
    p.add_argument("input", metavar="INPUT", help="corpus: .txt (a text per line), .jsonl or .parquet")
    p.add_argument("output", metavar="OUTPUT", help="embeddings: .npy ([N, d]) or .parquet (column 'embedding')")
    p.add_argument("--field", default="text", help="the text's field in .jsonl or column in .parquet (default: text)")
    p.add_argument("--max-tokens", type=_positive, default=16384, help="tokens per batch at most (default: 16384)")
    p.add_argument("--batch-size", type=_positive, default=32, help="texts per batch at most (default: 32)")
    p.add_argument("--dtype", choices=_DTYPES, help="model dtype (default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--device", help="one device: cuda, cpu, cuda:1 (default: cuda when visible, else cpu)")
    p.add_argument("--devices", type=parse_devices, help="several GPUs, a thread each: 'all' or indices such as 0,1")
    p.add_argument("--chunk", type=_positive, default=65536, help="texts per saved chunk at most (default: 65536)")
    p.add_argument(
        "--chunk-seconds",
        type=_seconds,
        default=CHUNK_SECONDS,
        help="seconds of work per saved chunk, measured on the first chunk (default: 60)",
    )
    p.add_argument("--normalize", action="store_true", help="unit-length embeddings")
    p.add_argument("--prompt-name", help="a prompt of the model's configuration, put before each text")
    p.add_argument("--prompt", help="a text put before each text")
    p.add_argument("--out-dtype", choices=("float32", "float16"), default="float32", help="(default: float32)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the model's loading's included)")
    return p


def _resolve_devices(device: str | None, devices: str | list[int] | None) -> list[str]:
    """The devices to run on, checked against what torch sees."""
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
            raise EmbedError(f"{PROG}: expected --device {device} to be a visible CUDA device, got {visible} visible")
        return [str(dev)]
    if device is not None:
        raise EmbedError(f"{PROG}: expected --device or --devices, got both ({device!r} and {devices!r})")
    spec = "all" if devices == "all" else ",".join(map(str, devices))
    if not visible:
        raise EmbedError(f"{PROG}: --devices {spec}: no CUDA device is visible (use --device cpu)")
    ids = list(range(visible)) if isinstance(devices, str) else devices  # a str is "all"
    if max(ids) >= visible:
        raise EmbedError(f"{PROG}: expected --devices among the visible GPUs 0 to {visible - 1}, got {max(ids)}")
    return [f"cuda:{i}" for i in ids]


# --------------------------------------------------------------------------------------
# The .parts folder and its chunks


def chunk_ranges(count: int, first: int, size: int | None) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each chunk of ``count`` texts: the first ``first`` texts, then ``size``
    each (the last shorter); with ``size`` None (not measured yet) the first chunk alone."""
    out = [(0, min(first, count))] if count else []
    if size is not None:
        out += [(lo, min(lo + size, count)) for lo in range(first, count, size)]
    return out


def chunk_size(first: int, seconds: float, target: float, cap: int) -> int:
    """The texts of a chunk after the first: those done in ``target`` seconds at the first
    chunk's rate (``first`` texts in ``seconds``), at least 1 and at most ``cap``."""
    return max(1, min(cap, int(first * target / max(seconds, 1e-6))))


def _manifest(args: argparse.Namespace, stat: os.stat_result, count: int, dtype: str) -> dict:
    """What the chunks in ``OUTPUT.parts`` belong to (every argument that changes a chunk's values)
    and, under ``chunk_sizes``, ``[first, size]`` (size None until measured): where they start."""
    model = os.path.abspath(args.model) if os.path.isdir(args.model) else args.model
    field = None if args.input.lower().endswith(".txt") else args.field
    first = min(args.chunk, FIRST_CHUNK)
    size = args.chunk if args.chunk <= first or count <= first else None  # nothing to measure
    return {
        "format": _MANIFEST_FORMAT,
        "input": os.path.abspath(args.input),
        "input_size": stat.st_size,
        "input_mtime_ns": stat.st_mtime_ns,
        "model": model,
        "dtype": dtype,
        "field": field,
        "chunk": args.chunk,
        "normalize": args.normalize,
        "prompt": args.prompt,
        "prompt_name": args.prompt_name,
        "texts": count,
        "chunk_sizes": [first, size],
    }


def _open_parts(parts: str, manifest: dict) -> set[int]:
    """The indices of the valid chunks of ``manifest``'s run already in ``parts`` (written by
    :func:`_start_parts`); ``manifest["chunk_sizes"]`` set to the sizes recorded there. A folder
    of another run (or with chunks and no manifest) is refused untouched; a chunk that cannot be
    read back with its expected shape is reported and computed again."""
    remove = f"remove the folder {parts} to start over"
    path = os.path.join(parts, MANIFEST)
    names = os.listdir(parts) if os.path.isdir(parts) else []
    found = sorted(int(m.group(1)) for m in map(_CHUNK.fullmatch, names) if m)
    if MANIFEST in names:
        try:
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
        except ValueError as err:
            raise EmbedError(
                f"{PROG}: expected {path} to hold a JSON object, got an unreadable one ({err}); {remove}"
            ) from None
        if not isinstance(old, dict):
            raise EmbedError(f"{PROG}: expected {path} to hold a JSON object, got a JSON {json_kind(old)}; {remove}")
        keys = sorted((set(old) | set(manifest)) - {"chunk_sizes"})
        diff = [f"{k}: {old.get(k)!r} there, {manifest.get(k)!r} now" for k in keys if old.get(k) != manifest.get(k)]
        sizes = old.get("chunk_sizes")
        if not diff and not (
            isinstance(sizes, list)
            and len(sizes) == 2
            and sizes[0] == manifest["chunk_sizes"][0]
            and (sizes[1] is None or isinstance(sizes[1], int) and sizes[1] >= 1)
        ):
            diff = [f"chunk_sizes: {sizes!r} there"]
        if diff:
            raise EmbedError(
                f"{PROG}: {parts} holds the chunks of another run ({'; '.join(diff)}); {remove}, "
                "or run again with that run's arguments and input"
            )
        manifest["chunk_sizes"] = sizes
    elif found:
        raise EmbedError(f"{PROG}: {parts} holds chunk files but no {MANIFEST}; {remove}")
    if manifest["chunk_sizes"][1] is None:  # sizes not measured: no chunk was saved
        return set()
    ranges = chunk_ranges(manifest["texts"], *manifest["chunk_sizes"])
    done = set()
    for i in (i for i in found if i < len(ranges)):
        rows = ranges[i][1] - ranges[i][0]
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
            print(
                f"{PROG}: {chunk_name(i)} in {parts}: expected {rows} float32 rows, got {what}; "
                "embedding this chunk again",
                file=sys.stderr,
            )
    return done


def _write_manifest(parts: str, manifest: dict, replace: bool = False) -> None:
    """Create ``parts`` with ``manifest`` (once the model is loaded and the arguments all checked),
    or (``replace``) write it again, with the measured chunk sizes."""
    os.makedirs(parts, exist_ok=True)
    if replace or not os.path.exists(os.path.join(parts, MANIFEST)):
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
    """The library's per-chunk pipeline, or :func:`_encode` where it cannot be imported (looked
    up at each call, so that a run can be made to take the fallback)."""
    try:
        from ragged.nn.hf.sentence.pipeline import embed
    except ImportError:
        return _encode
    return embed


def _encode(
    st,
    texts: list[str],
    *,
    prompt: str | None = None,
    prompt_name: str | None = None,
    normalize: bool = False,
    max_tokens: int | None = None,
    batch_size: int = 32,
    on_batch: Callable[[int, int], None] | None = None,
) -> np.ndarray:
    """``sentence_pipeline.embed`` through sentence-transformers' ``encode``: float32 ``[n, d]``
    in input order, ``on_batch(texts, tokens)`` after each slice of ``16 * batch_size`` texts
    (tokens counted by a second tokenization); ``max_tokens`` is not used (encode batches by count)."""
    out = []
    step = 16 * batch_size
    for lo in range(0, len(texts), step):
        part = texts[lo : lo + step]
        emb = st.encode(
            part,
            batch_size=batch_size,
            prompt=prompt,
            prompt_name=prompt_name,
            normalize_embeddings=normalize,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
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


def _load(model: str, devices: list[str], dtype: str, quiet: bool = False, clock: Clock | None = None) -> list:
    """The converted model on ``devices[0]`` and a deep copy of it on each further device;
    ``quiet``: no loading bars; ``clock``: the imports' time goes to its ``imports``."""
    clock = clock if clock is not None else Clock(time.perf_counter())
    with clock.phase("imports"):
        from sentence_transformers import SentenceTransformer
    with quiet_loading(quiet):
        st = SentenceTransformer(model, device=devices[0])
    st.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]).eval()
    st = ragged.nn.convert(st)
    return [st] + [copy.deepcopy(st).to(device) for device in devices[1:]]


def _on(device: str):
    """The thread's current device: where kernels launch and streams are."""
    return torch.cuda.device(device) if device.startswith("cuda") else contextlib.nullcontext()


def _embed_chunk(embed: Callable, st, texts: list[str], lo: int, hi: int, options: dict, on_batch) -> np.ndarray:
    """``[hi - lo, d]`` float32 embeddings of ``texts[lo:hi]``."""
    part = texts[lo:hi]
    # no inference_mode: the pipeline's graphs, kept with the model, are filled in place by later
    # calls (of encode too), which an inference tensor would refuse outside that mode
    emb = np.asarray(embed(st, part, on_batch=on_batch, **options), dtype=np.float32)
    if emb.ndim != 2 or emb.shape[0] != len(part):
        raise RuntimeError(
            f"{PROG}: expected [{len(part)}, d] embeddings for texts {lo} to {hi - 1}, got shape {emb.shape}"
        )
    return emb


def _save_chunk(parts: str, i: int, emb: np.ndarray) -> None:
    _write_atomic(os.path.join(parts, chunk_name(i)), lambda f: np.save(f, emb))


def _run_chunks(
    replicas: list[tuple[str, object]],
    texts: list[str],
    todo: list[int],
    ranges: list[tuple[int, int]],
    parts: str,
    options: dict,
    on_batch: Callable[[int, int], None],
) -> None:
    """Embed chunks ``todo`` (``ranges[i]``: chunk ``i``'s texts) of ``texts`` into ``parts``:
    one (device, model) replica in this thread, several in a thread each, taking chunk indices
    from one queue."""
    embed = _embedder()

    def one(st, i: int) -> None:
        _save_chunk(parts, i, _embed_chunk(embed, st, texts, *ranges[i], options, on_batch))

    if len(replicas) == 1:
        with _on(replicas[0][0]):
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
            with _on(device):
                while not stop.is_set():
                    try:
                        i = pending.get_nowait()
                    except queue.Empty:
                        return
                    one(st, i)
        except BaseException as err:  # noqa: BLE001 (handed to the main thread, which raises it)
            failures.append(err)
            stop.set()

    threads = [
        threading.Thread(target=work, args=replica, daemon=True, name=f"embed-{replica[0]}") for replica in replicas
    ]
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


def _few_batches(texts: list[str], max_tokens: int) -> bool:
    """Whether ``texts`` fill fewer than ``GRAPH_BATCHES`` batches of ``max_tokens`` (tokens
    estimated as the pipeline estimates them, a token per 4 characters and 2 more a text): too few
    for a graph's capture (2 runs and the capture) to pay for itself in replays."""
    return sum(len(t) // 4 + 2 for t in texts) < GRAPH_BATCHES * max_tokens


def _no_graphs(models: list) -> None:
    """The pipeline of each converted model set to run eagerly (every batch, no capture)."""
    for st in models:
        settings = getattr(st.__dict__.get("encode"), "pipeline", None)
        if settings is not None:
            settings.graphs = False


# --------------------------------------------------------------------------------------
# Output


def _assemble(output: str, parts: str, ranges: list[tuple[int, int]], dim: int | None, out_dtype: str) -> None:
    """Write OUTPUT from the chunks (in index order; ``ranges[i]``: chunk ``i``'s texts), flushed
    to disk, renamed onto OUTPUT; then remove ``parts``. ``dim``: the embedding width when there
    are no chunks (an empty corpus)."""
    count = ranges[-1][1] if ranges else 0
    paths = [os.path.join(parts, chunk_name(i)) for i in range(len(ranges))]
    for (lo, hi), path in zip(ranges, paths):
        head = np.load(path, mmap_mode="r")
        if head.ndim != 2 or head.shape[0] != hi - lo or (dim is not None and head.shape[1] != dim):
            raise EmbedError(
                f"{PROG}: expected {path} of shape ({hi - lo}, {dim if dim is not None else 'd'}), "
                f"got {head.shape}; remove the folder {parts} to start over"
            )
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
        pa = pyarrow(f"writing {output}")
        kind = pa.list_(pa.float32() if out_dtype == "float32" else pa.float16())
        schema = pa.schema([("embedding", kind)])

        def write(f):
            with pa.parquet.ParquetWriter(f, schema) as writer:
                if not paths:
                    writer.write_table(schema.empty_table())
                rows = max(1, (2**31 - 1) // max(dim, 1))  # a list column's offsets are int32
                for path in paths:
                    emb = np.load(path).astype(dtype)
                    for block in (emb[lo : lo + rows] for lo in range(0, emb.shape[0], rows)):
                        offsets = pa.array(np.arange(0, block.size + 1, dim, dtype=np.int32))
                        column = pa.ListArray.from_arrays(offsets, pa.array(block.reshape(-1)), type=kind)
                        writer.write_table(pa.Table.from_arrays([column], schema=schema))

    _write_atomic(output, write, folder=parts)
    if os.name == "posix":  # the rename itself, durable
        fd = os.open(os.path.dirname(os.path.abspath(output)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    shutil.rmtree(parts)


# --------------------------------------------------------------------------------------
# The command


def _check_paths(args: argparse.Namespace) -> None:
    """The arguments' own checks, before anything is read (pyarrow's presence last: the checks
    that do not need it say what they check wherever it is missing)."""
    in_ext = suffix(args.input, INPUTS, "INPUT")
    out_ext = suffix(args.output, OUTPUTS, "OUTPUT")
    if args.prompt is not None and args.prompt_name is not None:
        raise EmbedError(f"{PROG}: expected --prompt or --prompt-name, got both")
    if os.path.abspath(args.input) == os.path.abspath(args.output):
        raise EmbedError(f"{PROG}: expected OUTPUT other than INPUT, got {args.output!r} for both")
    if ".parquet" in (in_ext, out_ext):
        pyarrow(f"a .parquet {'INPUT' if in_ext == '.parquet' else 'OUTPUT'}")


def _run(args: argparse.Namespace, clock: Clock) -> int:
    with clock.phase("input"):
        _check_paths(args)
        devices = _resolve_devices(args.device, args.devices)
        dtype = args.dtype or ("bf16" if devices[0].startswith("cuda") else "fp32")
        stat = os.stat(args.input)  # before reading: a later change then shows
        texts = read_texts(args.input, args.field)
        count, parts = len(texts), args.output + ".parts"
        manifest = _manifest(args, stat, count, dtype)
        done = _open_parts(parts, manifest)
        ranges = chunk_ranges(count, *manifest["chunk_sizes"])
    if done:
        print(f"resuming: {len(done)} of {len(ranges)} chunks already done", flush=True)
    todo = [i for i in range(len(ranges)) if i not in done]
    dim = None
    options = {
        "prompt": args.prompt,
        "prompt_name": args.prompt_name,
        "normalize": args.normalize,
        "max_tokens": args.max_tokens,
        "batch_size": args.batch_size,
    }
    progress = Progress(
        count,
        sum(hi - lo for i, (lo, hi) in enumerate(ranges) if i in done),
        show=not args.no_progress and sys.stdout.isatty(),
    )
    if todo or count == 0:
        with clock.phase("model"):
            models = _load(args.model, devices, dtype, quiet=args.no_progress, clock=clock)
        prompts = getattr(models[0], "prompts", None) or {}
        if args.prompt_name is not None and args.prompt_name not in prompts:
            raise EmbedError(
                f"{PROG}: expected --prompt-name among the model's prompts {sorted(prompts)}, got {args.prompt_name!r}"
            )
        if count == 0:
            dim = int(np.asarray(_embedder()(models[0], [""], **options)).shape[1])
        if _few_batches(texts, args.max_tokens):
            _no_graphs(models)
        _write_manifest(parts, manifest)
        with clock.phase("embedding"), progress.running():
            if manifest["chunk_sizes"][1] is None:  # the first chunk, timed: the others' size
                with _on(devices[0]):
                    begin = time.perf_counter()
                    emb = _embed_chunk(_embedder(), models[0], texts, *ranges[0], options, progress)
                    seconds = time.perf_counter() - begin
                    if seconds < WARM_UP_SECONDS:  # mostly the first call's own costs: timed again, warm
                        begin = time.perf_counter()
                        _embed_chunk(_embedder(), models[0], texts, *ranges[0], options, None)
                        seconds = time.perf_counter() - begin
                first = manifest["chunk_sizes"][0]
                manifest["chunk_sizes"][1] = chunk_size(first, seconds, args.chunk_seconds, args.chunk)
                _write_manifest(parts, manifest, replace=True)  # the sizes first, then the chunk
                _save_chunk(parts, 0, emb)
                del emb
                ranges = chunk_ranges(count, *manifest["chunk_sizes"])
                todo = list(range(1, len(ranges)))
            _run_chunks(list(zip(devices, models)), texts, todo, ranges, parts, options, progress)
        clock.graphs = graphs_captured(models)
    with clock.phase("output"):
        _assemble(args.output, parts, ranges, dim, args.out_dtype)
    clock.stop()
    print(clock.breakdown(), flush=True)
    print(progress.summary(clock.whole), flush=True)
    return 0


def main(argv: list[str] | None = None, *, started: float | None = None) -> int:
    """Run the command on ``argv`` (default: ``sys.argv[1:]``); returns the exit status.
    ``started``: when the run began on ``time.perf_counter``'s clock (default: now; the command
    ``python -m ragged.embed`` gives the process's start)."""
    clock = Clock(time.perf_counter() if started is None else started)
    clock.seconds["imports"] = time.perf_counter() - clock.start
    args = _parser().parse_args(argv)
    try:
        return _run(args, clock)
    except EmbedError as err:
        print(err, file=sys.stderr)
    except OSError as err:  # a missing input, a full disk, a model not found
        print(f"{PROG}: {err}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; the same command again resumes from the chunks saved", file=sys.stderr)
        return 130
    return 1
