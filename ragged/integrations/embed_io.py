"""The corpus that ``python -m ragged.embed`` reads (:mod:`ragged.integrations.embed`): ``.txt``, ``.jsonl``
and ``.parquet`` files, checked whole before anything is computed, and what the command refuses.

A ``.txt`` or ``.jsonl`` file is UTF-8 text; a byte-order mark at its start (U+FEFF, which some
editors write) is not part of the first text or object: it is dropped, as ``utf-8-sig`` reads it.
Line numbers are 1-based, counted in the file as written.
"""

from __future__ import annotations

import json
import os

__all__ = ["INPUTS", "OUTPUTS", "PROG", "EmbedError", "pyarrow", "read_texts", "suffix"]

PROG = "python -m ragged.embed"
INPUTS, OUTPUTS = (".txt", ".jsonl", ".parquet"), (".npy", ".parquet")
_BOM = "\ufeff"


class EmbedError(ValueError):
    """What the command refuses (arguments, malformed input, chunks of another run); its message
    names the command and what was expected, and :func:`ragged.integrations.embed.main` prints it alone,
    without a traceback."""


def suffix(path: str, allowed: tuple[str, ...], name: str) -> str:
    """``path``'s extension (lower case), refused unless among ``allowed``; ``name``: INPUT or OUTPUT."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in allowed:
        raise EmbedError(f"{PROG}: expected {name} to end with {', '.join(allowed)}, got {path!r}")
    return ext


def read_texts(path: str, field: str = "text") -> list[str]:
    """The texts of a ``.txt``, ``.jsonl`` or ``.parquet`` corpus, in file order, all checked:
    :class:`EmbedError` names the first malformed line (1-based) or row. A leading byte-order
    mark of a ``.txt`` or ``.jsonl`` file is dropped."""
    ext = suffix(path, INPUTS, "INPUT")
    if ext == ".parquet":
        return _read_parquet(path, field)
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise EmbedError(
            f"{PROG}: line {line} of {path}: expected UTF-8 text, got the bytes "
            f"{data[err.start : err.end]!r} ({err.reason})"
        ) from None
    if text.startswith(_BOM):
        text = text[1:]
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the last line's newline, or an empty file
    lines = [line.removesuffix("\r") for line in lines]
    if ext == ".txt":
        return lines
    return [_json_text(path, number, line, field) for number, line in enumerate(lines, 1)]


def _json_text(path: str, number: int, line: str, field: str) -> str:
    """The string ``field`` of the JSON object on line ``number`` of ``path``."""
    expected = f"expected a JSON object with a string field {field!r}"
    try:
        obj = json.loads(line)
    except ValueError as err:
        raise EmbedError(
            f"{PROG}: line {number} of {path}: {expected}, got "
            f"{'an empty line' if not line.strip() else _json_error(err)}"
        ) from None
    value = obj.get(field) if isinstance(obj, dict) else None
    if not isinstance(value, str):
        got = (
            f"a JSON {json_kind(obj)}"
            if not isinstance(obj, dict)
            else f"an object without it (keys: {', '.join(map(repr, list(obj)[:8]))})"
            if field not in obj
            else f"{field!r} holding a JSON {json_kind(value)}"
        )
        raise EmbedError(f"{PROG}: line {number} of {path}: {expected}, got {got}")
    if "\\u" in line:  # escapes may spell lone surrogates, which no tokenizer takes
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise EmbedError(
                f"{PROG}: line {number} of {path}: {expected} of valid Unicode, got a lone surrogate escape"
            ) from None
    return value


def _json_error(err: ValueError) -> str:
    """``invalid JSON (Expecting value at column 3)``; json's messages that end in ``at`` (an
    unterminated string's ``starting at``) take the column without a second ``at``."""
    msg, column = getattr(err, "msg", str(err)), getattr(err, "colno", "?")
    return f"invalid JSON ({msg}{'' if msg.endswith(' at') else ' at'} column {column})"


def json_kind(value: object) -> str:
    """``value``'s JSON type and (shortened) text: ``number 3``, ``array [1, 2]``, ``null``."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    text = json.dumps(value)
    return "null" if value is None else f"{kinds[type(value)]} {text if len(text) <= 60 else text[:57] + '...'}"


def pyarrow(why: str):
    """The ``pyarrow`` module (with ``pyarrow.parquet``), or :class:`EmbedError` saying that ``why`` needs it."""
    try:
        import pyarrow as pa
        import pyarrow.parquet
    except ImportError:
        raise EmbedError(f"{PROG}: {why} needs pyarrow (pip install pyarrow), which is not importable") from None
    return pa


def _read_parquet(path: str, field: str) -> list[str]:
    pa = pyarrow(f"reading {path}")
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
