"""Local JSON and JSON-lines files read exactly as written, row for row.

HF `datasets` reads JSON through Arrow, which gives every row one schema: a key that one
row's message, tool-call arguments or tool schema has and another's lacks comes back as
`null` in the other (with the first block's schema, later rows' missing keys are filled
with null; an extra key in a later block fails the whole load). A chat template renders
such a null (`"description": null` inside a tool schema), so the rendering would differ
from the file. These files are therefore parsed with Python's `json` module instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .data import DataError

LAYOUT_HINT = "a .json/.jsonl file holds a JSON array of rows or one JSON object per line"


class JsonRows(Sequence):
    """Rows parsed from local JSON files, in file order, as `json.loads` gives them.

    Stands in for a `datasets.Dataset` where the pipeline uses one: `len`, row access,
    slicing, iteration and `select`. Rows are shared, not copied: readers must not mutate them.
    """

    cache_files: list = []  # no Arrow files behind these rows
    _fingerprint = None  # no `datasets` fingerprint either; the files' bytes are hashed instead

    def __init__(self, rows: list[Any]):
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return JsonRows(self._rows[index])
        return self._rows[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._rows)

    def select(self, indices: Iterable[int]) -> JsonRows:
        return JsonRows([self._rows[i] for i in indices])


def read_json_rows(files: list[Path]) -> JsonRows:
    """Every row of `files`, concatenated in order; DataError("unreadable") naming the file
    and the position of the first thing that is not JSON."""
    rows: list[Any] = []
    for path in files:
        rows.extend(_read_one(path))
    return JsonRows(rows)


def _read_one(path: Path) -> list[Any]:
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError("unreadable", str(path), None, f"not UTF-8 at byte {exc.start}: {exc.reason}") from exc
    except OSError as exc:
        raise DataError("unreadable", str(path), None, f"cannot open: {exc.strerror or exc}") from exc
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _invalid(path, exc, text) from exc
        return rows
    return _read_lines(path, text)


def _read_lines(path: Path, text: str) -> list[Any]:
    rows = []
    line_start = 0
    for line in text.split("\n"):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                error = json.JSONDecodeError(exc.msg, text, line_start + exc.pos)  # position in the whole file
                raise _invalid(path, error, text) from exc
        line_start += len(line) + 1
    return rows


def _invalid(path: Path, exc: json.JSONDecodeError, text: str) -> DataError:
    truncated = exc.msg.startswith("Unterminated") or exc.pos >= len(text.rstrip())
    problem = f"not valid JSON at line {exc.lineno} column {exc.colno} (char {exc.pos} of {len(text)}): {exc.msg}"
    problem += "; the file ends inside a record (truncated?)" if truncated else f"; {LAYOUT_HINT}"
    return DataError("unreadable", str(path), None, problem)


def leading_records(path: str | Path, count: int) -> list[Any]:
    """The first `count` complete records of a JSON-array file (fewer if it has fewer).

    For sampling a large file, or the whole records of one cut off mid-record, without
    parsing all of it; a broken record before the `count`-th raises DataError as above.
    """
    text = Path(path).read_bytes().decode("utf-8-sig")
    decoder = json.JSONDecoder()
    separator = re.compile(r"[\s,]*")
    pos = separator.match(text, 0).end()
    if text[pos : pos + 1] != "[":
        raise DataError("unreadable", str(path), None, f"not a JSON array; {LAYOUT_HINT}")
    records: list[Any] = []
    pos += 1
    while len(records) < count:
        pos = separator.match(text, pos).end()
        if text[pos : pos + 1] in ("]", ""):
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise _invalid(Path(path), exc, text) from exc
        records.append(record)
    return records
