"""Chat datasets in, normalised conversations out (README.md, "Stage one"). Local JSON is read with Python's `json`,
each row exactly as the file says it; other sources go through `datasets`, nulls in the chat columns dropped."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dflash.shared.cli import looks_like_path

log = logging.getLogger(__name__)

CHAT_COLUMNS = ("messages", "conversations", "tools")  # whose nested nulls Arrow-backed sources drop
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
LAYOUT_HINT = "a .json/.jsonl file holds a JSON array of rows or one JSON object per line"
Fail = Callable[[str, str], Exception]  # fail(reason, problem): the DataError naming the row
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
                  "tool": "tool", "function": "tool", "observation": "tool"}


class DataError(ValueError):
    """A source or row that cannot be used; `reason` is a stable code for counting (unreadable,
    malformed_row, ...; chat.py adds template_rejected, mask_not_located, too_long, ...)."""

    def __init__(self, reason: str, source: str, row: int | None, problem: str):
        self.reason, self.source, self.row, self.problem = reason, source, row, problem
        super().__init__(f"{source if row is None else f'{source} row {row}'}: {problem}")


class SkippedSample(DataError):
    """A row dropped by an explicit policy (e.g. truncation="skip"): counted, whatever `on_bad_row` says."""


@dataclass
class Conversation:
    """One normalised sample: "chat" `messages` exactly as the chat template receives them, or raw
    "text"; `source` and `row_index` locate the row for later errors."""

    kind: Literal["chat", "text"]
    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    source: str = ""
    row_index: int = -1
    tools: list[dict[str, Any]] | None = None  # passed to the chat template as tools=


def load_source(spec: str, split: str = "train", *, cache_dir: str | None = None):
    """`spec` as rows (a list for local JSON, else a `datasets.Dataset`): a `save_to_disk` folder, a data file or
    a folder of one format (the files are the split), else a hub name; DataError names what fails."""
    import datasets

    path = Path(spec)
    if _is_saved_dataset(path):
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as exc:  # noqa: BLE001 - re-raised with the path in it
            raise DataError("unreadable", spec, None, f"cannot load saved dataset: {exc}") from exc
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError("unreadable", spec, None, f"no split {split!r} (has {sorted(loaded)})")
            loaded = loaded[split]
    elif path.exists():
        files = local_data_files(path)
        if (builder := LOCAL_FORMATS[files[0].suffix]) == "json":
            return [row for f in files for row in _read_json(f)]
        try:
            loaded = datasets.load_dataset(builder, data_files={split: [str(f) for f in files]}, split=split,
                                           cache_dir=cache_dir)
        except Exception as exc:  # noqa: BLE001 - named after the first file that fails on its own
            for f in files:
                try:
                    datasets.load_dataset(builder, data_files=[str(f)], split="train", cache_dir=cache_dir)
                except Exception as alone:  # noqa: BLE001
                    cause = alone.__cause__ or alone.__context__ or alone
                    problem = f"cannot read: {type(cause).__name__}: {cause}"
                    raise DataError("unreadable", str(f), None, problem) from exc
            raise DataError("unreadable", spec, None, f"cannot read: {exc}") from exc
    elif looks_like_path(spec) or path.suffix in LOCAL_FORMATS:
        raise DataError("unreadable", spec, None, "no such file or directory")
    else:
        try:
            loaded = datasets.load_dataset(spec, split=split, cache_dir=cache_dir)
        except Exception as exc:  # noqa: BLE001
            raise DataError("unreadable", spec, None, f"cannot load hub dataset: {type(exc).__name__}: {exc}") from exc
    return loaded.with_transform(_without_nulls)


def _read_json(path: Path) -> list[Any]:
    """The rows of one .json/.jsonl file; DataError naming the file and where parsing stopped."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError("unreadable", str(path), None, f"not UTF-8 at byte {exc.start}: {exc.reason}") from exc
    except OSError as exc:
        raise DataError("unreadable", str(path), None, f"cannot open: {exc.strerror or exc}") from exc
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise _invalid(path, exc, text) from exc
    rows = []
    for line in re.finditer(r".+", text):  # each line without its "\n"
        if line[0].strip():
            try:
                rows.append(json.loads(line[0]))
            except json.JSONDecodeError as exc:
                whole = json.JSONDecodeError(exc.msg, text, line.start() + exc.pos)  # position in the whole file
                raise _invalid(path, whole, text) from exc
    return rows


def _invalid(path: Path, exc: json.JSONDecodeError, text: str) -> DataError:
    truncated = exc.msg.startswith("Unterminated") or exc.pos >= len(text.rstrip())
    problem = f"not valid JSON at line {exc.lineno} column {exc.colno} (char {exc.pos} of {len(text)}): {exc.msg}"
    problem += "; the file ends inside a record (truncated?)" if truncated else f"; {LAYOUT_HINT}"
    return DataError("unreadable", str(path), None, problem)


def leading_records(path: str | Path, count: int) -> list[Any]:
    """The first `count` complete records of a JSON-array file, parsing no further (large, or cut mid-record)."""
    text, decoder, separator = Path(path).read_bytes().decode("utf-8-sig"), json.JSONDecoder(), re.compile(r"[\s,]*")
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


def _without_nulls(batch: dict[str, list]) -> dict[str, list]:
    """An Arrow-backed batch without the null-valued keys inside its chat columns (absent is what a row meant)."""
    def drop(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: drop(v) for k, v in value.items() if v is not None}
        return [drop(v) for v in value] if isinstance(value, list) else value

    return {column: drop(values) if column in CHAT_COLUMNS else values for column, values in batch.items()}


def local_data_files(path: Path) -> list[Path]:
    """The data files behind a local file or folder spec, sorted; all of one format."""
    files = [path] if path.is_file() else sorted(
        f for f in path.rglob("*") if f.is_file() and f.suffix in LOCAL_FORMATS)
    if not files:
        raise DataError("unreadable", str(path), None, f"no data files ({', '.join(LOCAL_FORMATS)}) in folder")
    if path.suffix not in LOCAL_FORMATS and path.is_file():  # a folder's files are of these formats
        raise DataError("unreadable", str(path), None, f"unsupported file type {path.suffix!r}")
    if len(builders := {LOCAL_FORMATS[f.suffix] for f in files}) > 1:
        raise DataError("unreadable", str(path), None, f"mixed file formats {sorted(builders)} in one source")
    return files


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or ((path / "state.json").is_file()
                                                       and (path / "dataset_info.json").is_file())


def normalize_row(row: Any, row_index: int, source: str) -> Conversation:
    """A row as a Conversation (the first non-null of `messages`, `conversations`, or plain `text`), or DataError."""

    def fail(reason: str, problem: str) -> DataError:
        return DataError(reason, source, row_index, problem)

    if not isinstance(row, dict):
        raise fail("malformed_row", f"a row must be a JSON object, got {type(row).__name__}")
    column = next((c for c in ("messages", "conversations") if row.get(c) is not None), None)
    if column is None:
        if row.get("text") is None:
            present = sorted(k for k, v in row.items() if v is not None)
            raise fail("missing_columns", f"no 'messages', 'conversations' or 'text' column (has {present})")
        text = row["text"]
        if not isinstance(text, str):
            raise fail("non_string_content", f"'text' is {type(text).__name__}, not a string")
        if not text.strip():
            raise fail("empty_content", "'text' is empty")
        return Conversation("text", text=text, source=source, row_index=row_index)

    messages = chat_messages(row[column], column, fail)
    add_system(messages, row.get("system"), fail)
    if not any(m["role"] == "assistant" for m in messages):
        raise fail("no_assistant_turn", "no assistant message, so nothing to learn from")
    tools = row_tools(row.get("tools"), fail)
    return Conversation("chat", messages=messages, source=source, row_index=row_index, tools=tools)


def chat_messages(raw: Any, column: str, fail: Fail) -> list[dict[str, Any]]:
    """The messages of one chat, kept exactly as a chat template reads them (only JSON-string tool-call arguments
    decoded); role/content or ShareGPT from/value, decided by the first message."""
    if not isinstance(raw, (list, tuple)):
        raise fail("malformed_message", f"'{column}' must be a list of messages, got {type(raw).__name__}")
    if not raw:
        raise fail("no_assistant_turn", f"'{column}' is empty, so nothing to learn from")
    first = raw[0] if isinstance(raw[0], dict) else {}
    sharegpt = "role" not in first and "from" in first
    return [_message(msg, i, sharegpt, fail) for i, msg in enumerate(raw)]


def _message(msg: Any, i: int, sharegpt: bool, fail: Fail) -> dict[str, Any]:
    """Message `i`, role mapped, with the keys a template reads, each checked for shape (content kept as given)."""
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    if not isinstance(msg, dict) or msg.get(role_key) is None:
        keys = sorted(msg) if isinstance(msg, dict) else type(msg).__name__
        raise fail("malformed_message", f"message {i} needs '{role_key}' (this list uses "
                                        f"{role_key}/{content_key}; got {keys})")
    role, content = msg[role_key], msg.get(content_key)
    mapped = SHAREGPT_ROLES.get(str(role).lower()) if sharegpt else role
    if mapped not in ROLES:
        raise fail("unknown_role", f"unknown role {role!r} in message {i}")
    where = f"message {i} ({mapped})"
    if isinstance(content, list):  # of text parts; else a string (empty too: the template renders it) or None
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise fail("non_string_content", f"{where} content part {j} is {kind!r}, not a text part "
                                                 "({'type': 'text', 'text': str})")
    elif content is not None and not isinstance(content, str):
        raise fail("non_string_content", f"{where} content is {type(content).__name__}, not a string or text parts")
    out: dict[str, Any] = {"role": mapped, "content": content} if content_key in msg else {"role": mapped}
    for key in ("reasoning_content", "tool_call_id", "name"):
        if key in msg:
            if msg[key] is not None and not isinstance(msg[key], str):
                raise fail("malformed_message", f"{where} '{key}' is {type(msg[key]).__name__}, not a string")
            out[key] = msg[key]
    if "tool_calls" in msg:
        out["tool_calls"] = _tool_calls(msg["tool_calls"], where, fail)
    if content is None and mapped != "assistant":
        raise fail("malformed_message", f"{where} has no '{content_key}' (absent or null)")
    if content is None and not out.get("tool_calls") and out.get("reasoning_content") is None:
        raise fail("malformed_message", f"{where} has no '{content_key}', 'tool_calls' or 'reasoning_content'")
    return out


def _tool_calls(calls: Any, where: str, fail: Fail) -> Any:
    """Tool calls as given, JSON-string arguments decoded (under 'function' as OpenAI nests them, or on the call)."""
    if calls is not None and not isinstance(calls, list):
        raise fail("malformed_message", f"{where} 'tool_calls' is {type(calls).__name__}, not a list")
    out = []
    for j, call in enumerate(calls or []):
        what = f"{where} tool call {j}"
        nested = isinstance(call, dict) and isinstance(call.get("function"), dict)
        function = call["function"] if nested else call
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise fail("malformed_message", f"{what} needs a 'name' string (in 'function' or on the call)")
        if "arguments" in function:
            arguments = _json(function["arguments"], "malformed_message", f"{what} arguments are", fail)
            if not isinstance(arguments, dict):
                raise fail("malformed_message", f"{what} arguments are {type(arguments).__name__}, not a JSON object")
            function = {**function, "arguments": arguments}
        out.append({**call, "function": function} if nested else function)
    return None if calls is None else out


def _json(value: Any, reason: str, what: str, fail: Fail) -> Any:
    """``value`` decoded if it is a string, else as given."""
    try:
        return json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as exc:
        raise fail(reason, f"{what} not valid JSON ({exc})") from exc


def row_tools(tools: Any, fail: Fail) -> list[dict[str, Any]] | None:
    """The row's tool schemas (a list of objects, or a JSON string of one), or None."""
    tools = _json(tools, "malformed_tools", "'tools' is a string but", fail)
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise fail("malformed_tools", f"'tools' must be a list of tool schemas (objects), got {type(tools).__name__}")
    return tools


def add_system(messages: list[dict[str, Any]], system: Any, fail: Fail) -> None:
    """A top-level `system` string becomes the leading system message; an empty one means none."""
    if system is None or system == "":
        return
    if not isinstance(system, str):
        raise fail("malformed_row", f"'system' is {type(system).__name__}, not a string")
    if messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    elif messages[0].get("content") != system:
        raise fail("malformed_row", "both a top-level 'system' and a different first system message: "
                                    "which one the template should see is ambiguous")


class SkipCounter:
    """Skipped rows per reason code, plus the first message seen for each reason."""

    def __init__(self):
        self.counts, self.first_message = Counter(), {}

    def record(self, error: DataError) -> None:
        if error.reason not in self.first_message:
            self.first_message[error.reason] = str(error)
            log.warning("skipping row (%s): %s; further %r skips are only counted", error.reason, error,
                        error.reason)
        self.counts[error.reason] += 1

    @property
    def total(self) -> int:
        return self.counts.total()

    def to_dict(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))

    def summary(self) -> str:
        return f"{self.total} rows skipped: " + ", ".join(f"{k}={v}" for k, v in self.to_dict().items())


def guard(on_bad_row: Literal["error", "skip"], skips: SkipCounter, fn: Callable, /, *args, **kwargs):
    """fn(*args, **kwargs), or None with its DataError counted in `skips` (under "skip"; a SkippedSample always)."""
    try:
        return fn(*args, **kwargs)
    except DataError as err:
        if on_bad_row == "error" and not isinstance(err, SkippedSample):
            raise
        skips.record(err)
    return None


def dataset_fingerprint(ds, spec: str, split: str, revision: str | None = None) -> dict[str, Any]:
    """What tells later whether the input changed: local sources hash their files (relative path, size,
    content), hub sources their rows (each as canonical JSON, in order)."""
    path, digest = Path(spec), hashlib.sha256()
    info: dict[str, Any] = {"source": spec, "split": split, "revision": revision, "num_rows": len(ds),
                            "datasets_fingerprint": getattr(ds, "_fingerprint", None)}
    if not path.exists():
        for start in range(0, len(ds), 1024):
            batch = ds[start : start + 1024]  # dict of columns
            for values in zip(*batch.values()):
                row = json.dumps(dict(zip(batch, values)), sort_keys=True, ensure_ascii=False, default=str)
                digest.update(row.encode() + b"\n")
        return {**info, "hash_method": "rows-sha256", "content_hash": "sha256:" + digest.hexdigest()}
    if _is_saved_dataset(path):
        files, root = sorted(Path(f["filename"]) for f in ds.cache_files), path.resolve()
    else:
        files, root = local_data_files(path), path.resolve() if path.is_dir() else path.resolve().parent
    for file in (f.resolve() for f in files):
        name = file.relative_to(root).as_posix() if file.is_relative_to(root) else file.name
        digest.update(f"{name}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return {**info, "resolved_path": str(path.resolve()), "hash_method": "files-sha256",
            "content_hash": "sha256:" + digest.hexdigest()}
