"""Result tables in the terminal, laid out from their content so that no number is ever cut.

A :class:`Sheet` holds a table's text: headers, cells, styles and the rows after which a
case ends. :func:`layout` gives every column a fixed width: a numeric column is as wide as
its widest cell, a text column wraps between words. Where the output has no width (a pipe
or a file, ``COLUMNS`` unset) the table is one piece as wide as its content; in a terminal
narrower than that, the columns after the key columns (case, implementation) are dealt
into several tables that each fit, every one repeating the key columns.
"""

from __future__ import annotations

import dataclasses
import os
import sys

TEXT_WIDTH = 40  # a text column wider than this wraps between words (file output included)
HEADER_WIDTH = 20  # a header up to this long stays on one line where the width allows
BORDER = 3  # a column's padding (one space each side) and its left border
NARROW_KEY_SHARE = (6, 4)  # in a narrow terminal, the key columns take at least width / these


@dataclasses.dataclass
class Sheet:
    """A table's content: ``cells[i][j]`` is row ``i``, column ``j``; ``keys`` leading columns
    are repeated in every part of a split table; a section line follows each row of ``ends``."""

    title: str
    headers: list[str]
    numeric: list[bool]
    cells: list[list[str]]
    styles: list[str | None] = dataclasses.field(default_factory=list)
    ends: set[int] = dataclasses.field(default_factory=set)
    caption: str = ""
    keys: int = 2


def cell_len(text: str) -> int:
    """Terminal cells of ``text`` (wide characters count twice)."""
    from rich.cells import cell_len as cells

    return cells(text)


def free_width(stream=None) -> bool:
    """Whether the output has no width of its own: not a terminal, and no ``COLUMNS``."""
    stream = stream or sys.stdout
    return not (hasattr(stream, "isatty") and stream.isatty()) and "COLUMNS" not in os.environ


def _longest_word(text: str) -> int:
    return max((cell_len(word) for line in text.splitlines() for word in line.split()), default=0)


def _widest_line(text: str) -> int:
    return max((cell_len(line) for line in text.splitlines()), default=0)


def column_widths(sheet: Sheet, text_width: int = TEXT_WIDTH, header_width: int = HEADER_WIDTH) -> list[int]:
    """Each column's width: a numeric column as wide as its widest cell, a text column as its
    widest cell up to ``text_width``, both as their header up to ``header_width``; never
    narrower than a word of the column (headers wrap between words)."""
    widths = []
    for j, numeric in enumerate(sheet.numeric):
        body = [row[j] for row in sheet.cells]
        words = max([_longest_word(sheet.headers[j]), *(_longest_word(c) for c in body), 1])
        widest = max([min(_widest_line(sheet.headers[j]), header_width), *(_widest_line(c) for c in body), 1])
        widths.append(max(words, widest if numeric else min(widest, text_width)))
    return widths


def total_width(widths: list[int]) -> int:
    """Characters of a table row with these column widths (borders and padding included)."""
    return sum(w + BORDER for w in widths) + 1


def layout(sheet: Sheet, width: int | None) -> list[list[tuple[int, int]]]:
    """The parts of the table as lists of ``(column, width)``: one part when it fits ``width``
    (``None``: any width); otherwise the key columns narrowed (wrapping between words) and the
    other columns dealt, in order, into as many parts as it takes."""
    columns = list(range(len(sheet.headers)))
    widths = column_widths(sheet)
    if width is not None and total_width(widths) > width:  # headers wrapped between words
        widths = column_widths(sheet, header_width=0)
    if width is None or total_width(widths) <= width:
        return [list(zip(columns, widths))]
    keys = columns[: sheet.keys]
    key_widths = [
        min(
            widths[j],
            max(
                _longest_word("\n".join([sheet.headers[j], *(r[j] for r in sheet.cells)])),
                width // NARROW_KEY_SHARE[min(i, len(NARROW_KEY_SHARE) - 1)],
            ),
        )
        for i, j in enumerate(keys)
    ]
    room = width - total_width(key_widths)
    parts: list[list[tuple[int, int]]] = []
    used: list[int] = []
    for j in columns[sheet.keys :]:
        w = widths[j]
        if not sheet.numeric[j]:  # a text column may wrap down to its longest word, or fold below it
            w = min(w, max(room - BORDER, 1))
        fit = next((k for k, u in enumerate(used) if u + w + BORDER <= room), None)
        if fit is None:
            parts.append([])
            used.append(0)
            fit = len(parts) - 1
        parts[fit].append((j, w))
        used[fit] += w + BORDER
    return [list(zip(keys, key_widths)) + part for part in parts]


def _shown(sheet: Sheet, part: list[tuple[int, int]], split: bool) -> list[tuple[int, list[str], bool]]:
    """``(row, cells, ends a case)`` of a part; in a split table, only the rows with a value in
    the part's own columns, the first of a case carrying its name."""
    out, start, label = [], 0, ""
    for i, row in enumerate(sheet.cells):
        if i == start:
            label, named = row[0], False
        cells = [row[j] for j, _ in part]
        if not split or any(cells[sheet.keys :]):
            if split and sheet.keys and not named:
                cells[0] = label
            named = True
            out.append((i, cells, False))
        if i in sheet.ends or i == len(sheet.cells) - 1:
            start = i + 1
            if out and named:
                out[-1] = (out[-1][0], out[-1][1], True)
    return out


def tables(sheet: Sheet, width: int | None) -> list[tuple[object, int]]:
    """``(rich.table.Table, its width in characters)`` per part of :func:`layout`."""
    from rich.table import Table

    parts = layout(sheet, width)
    out = []
    for n, part in enumerate(parts, 1):
        title = sheet.title if len(parts) == 1 else f"{sheet.title} (part {n} of {len(parts)})"
        table = Table(
            title=title,
            caption=(sheet.caption or None) if n == len(parts) else None,
            title_justify="left",
            caption_justify="left",
        )
        for j, w in part:
            table.add_column(
                sheet.headers[j], justify="right" if sheet.numeric[j] else "left", width=w, overflow="fold"
            )
        for i, cells, end in _shown(sheet, part, len(parts) > 1):
            style = sheet.styles[i] if i < len(sheet.styles) else None
            table.add_row(*cells, style=style, end_section=end)
        out.append((table, total_width([w for _, w in part])))
    return out


def show(console, sheet: Sheet, free: bool | None = None) -> None:
    """Print ``sheet`` on a rich console: as wide as its content where the output has no width
    (``free``, default :func:`free_width` of the console's file; lines without trailing blanks),
    else fitted to the console."""
    free = free_width(console.file) if free is None else free
    for table, need in tables(sheet, None if free else console.width):
        if not free:
            console.print(table)
            continue
        old = console.width
        console.width = max(old, need)
        try:
            with console.capture() as captured:
                console.print(table)
        finally:
            console.width = old
        console.file.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))
        console.file.flush()
