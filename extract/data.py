"""Chat datasets in, normalised conversations out.

Local .json/.jsonl files (a JSON array of rows, or one JSON object per line) are parsed
with Python's `json` module, so every row is exactly what the file says (see
extract/json_rows.py for why not Arrow). Parquet/Arrow files, saved datasets and hub
names are read through HF `datasets`; there a null inside a message or a tool schema
cannot be told from an absent key, so null-valued keys inside those columns are dropped.
Each row becomes a `Conversation`; a row that cannot become one raises `DataError`
naming the file, the row and the problem. Under the "skip" policy bad rows are counted
per reason in a `SkipCounter`, never dropped silently.

Row formats, tried in this order (the first present, non-null column wins):
  * `messages` or `conversations`: a list of messages, each either {"role", "content"}
    (roles system / user / assistant / tool) or ShareGPT's {"from", "value"} (`from`
    mapped onto those roles: human -> user, gpt -> assistant, ...; see SHAREGPT_ROLES);
    the first message decides which, for the whole list.
  * `text`: a plain non-empty string, trained on as a whole.
What a chat template reads is kept, as given: per message `content` (a string, empty
included, or a list of {"type": "text", "text"} parts; absent or null only on an
assistant message with `tool_calls` or `reasoning_content`), `reasoning_content`,
`tool_calls` (JSON-string arguments decoded to an object), `tool_call_id`, `name`; per
row `tools` (a list of tool schemas, or a JSON string of one) and a top-level `system`
string (a leading system message; "" means none). Other keys are dropped. A chat needs
at least one assistant message, otherwise it carries no loss.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
# columns holding messages or tool schemas, whose nested nulls Arrow-backed sources drop
CHAT_COLUMNS = ("messages", "conversations", "tools")
# local files read with Python's `json` (exact) rather than through Arrow
JSON_SUFFIXES = (".json", ".jsonl")
# file extension -> `datasets` builder
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}

OnBadRow = Literal["error", "skip"]


class DataError(ValueError):
    """A source or row that cannot be used. `reason` is a stable code for counting.

    Reason codes: unreadable (file/folder/hub source), missing_columns, malformed_row,
    malformed_message, malformed_tools, unknown_role, empty_content (an empty `text`
    row), non_string_content, no_assistant_turn; extract.chat adds template_rejected, mask_not_located,
    too_long, no_loss_tokens.
    """

    def __init__(self, reason: str, source: str, row: int | None, problem: str):
        self.reason, self.source, self.row, self.problem = reason, source, row, problem
        where = f"{source} row {row}" if row is not None else source
        super().__init__(f"{where}: {problem}")


class SkippedSample(DataError):
    """A row dropped by an explicit policy (e.g. truncation="skip"): always counted,
    never raised, whatever `on_bad_row` says."""


@dataclass
class Conversation:
    """One normalised training sample.

    kind "chat": `messages` are exactly what the chat template receives: "role" (in
    ROLES) plus whichever of content, reasoning_content, tool_calls, tool_call_id and
    name the row gives (absent keys stay absent). kind "text": `text` is the raw string.
    `source` and `row_index` locate the row for errors raised later (rendering, truncation).
    """

    kind: Literal["chat", "text"]
    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    source: str = ""
    row_index: int = -1
    tools: list[dict[str, Any]] | None = None  # passed to the chat template as tools=


# ---------------------------------------------------------------------------------
# Loading


def load_source(
    spec: str,
    split: str = "train",
    *,
    revision: str | None = None,
    data_files: str | list[str] | dict | None = None,
    cache_dir: str | None = None,
):
    """Open `spec` as a sequence of rows: `JsonRows` for local JSON, else a `datasets.Dataset`.

    `spec` is, in this order: a folder saved by `save_to_disk` (for a DatasetDict,
    `split` picks the split); a local data file (.json, .jsonl, .parquet, .arrow) or a
    folder of them (all of one format, searched recursively, concatenated in sorted
    order); otherwise a hub dataset name, opened with `load_dataset(spec, split=,
    revision=, data_files=)`. For local files the files ARE the requested split. Both
    kinds give `len`, row access, slicing and `select`; Arrow-backed rows come with
    nulls inside the chat columns dropped. Anything that cannot be read raises
    DataError("unreadable") naming the file and the problem (for JSON, the line,
    column and character where parsing stopped).
    """
    import datasets

    path = Path(spec)
    if path.is_dir() and _is_saved_dataset(path):
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as exc:  # noqa: BLE001 - re-raised with the path in it
            raise DataError("unreadable", spec, None, f"cannot load saved dataset: {exc}") from exc
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError("unreadable", spec, None, f"no split {split!r} (has {sorted(loaded)})")
            loaded = loaded[split]
        return loaded.with_transform(_without_nulls)
    if path.exists():
        files = local_data_files(path)
        if files[0].suffix in JSON_SUFFIXES:
            from .json_rows import read_json_rows

            return read_json_rows(files)
        builder = LOCAL_FORMATS[files[0].suffix]
        try:
            loaded = datasets.load_dataset(
                builder, data_files={split: [str(f) for f in files]}, split=split, cache_dir=cache_dir
            )
        except Exception as exc:  # noqa: BLE001
            bad, problem = _find_unreadable(builder, files, cache_dir) or (spec, str(exc))
            raise DataError("unreadable", str(bad), None, f"cannot read: {problem}") from exc
        return loaded.with_transform(_without_nulls)
    if _looks_like_path(spec):
        raise DataError("unreadable", spec, None, "no such file or directory")
    try:
        loaded = datasets.load_dataset(spec, split=split, revision=revision, data_files=data_files, cache_dir=cache_dir)
    except Exception as exc:  # noqa: BLE001
        raise DataError("unreadable", spec, None, f"cannot load hub dataset: {type(exc).__name__}: {exc}") from exc
    return loaded.with_transform(_without_nulls)


def _without_nulls(batch: dict[str, list]) -> dict[str, list]:
    """Drop null-valued keys inside the chat columns of an Arrow-backed batch.

    Arrow gives every struct one schema, so a key that some rows' messages (or tool-call
    arguments, or tool schemas) lack is null in those rows; a null there cannot be told
    from an absent key, and absent is what the row most likely meant.
    """
    return {column: [_drop_nulls(v) for v in values] if column in CHAT_COLUMNS else values
            for column, values in batch.items()}


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def local_data_files(path: Path) -> list[Path]:
    """The data files behind a local file or folder spec, sorted; all of one format."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOCAL_FORMATS)
        if not files:
            raise DataError("unreadable", str(path), None, f"no data files ({', '.join(LOCAL_FORMATS)}) in folder")
    for f in files:
        if f.suffix not in LOCAL_FORMATS:
            raise DataError("unreadable", str(f), None, f"unsupported file type {f.suffix!r}")
        try:
            with open(f, "rb") as handle:
                handle.read(1)
        except OSError as exc:
            raise DataError("unreadable", str(f), None, f"cannot open: {exc.strerror or exc}") from exc
    builders = {LOCAL_FORMATS[f.suffix] for f in files}
    if len(builders) > 1:
        raise DataError("unreadable", str(path), None, f"mixed file formats {sorted(builders)} in one source")
    return files


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or Path(spec).suffix in LOCAL_FORMATS or spec.count("/") > 1


def _find_unreadable(builder: str, files: list[Path], cache_dir: str | None) -> tuple[Path, str] | None:
    """On a failed multi-file load, find the first file that fails on its own (error path only)."""
    import datasets

    for f in files:
        try:
            datasets.load_dataset(builder, data_files=[str(f)], split="train", cache_dir=cache_dir)
        except Exception as exc:  # noqa: BLE001
            cause = exc.__cause__ or exc.__context__ or exc
            return f, f"{type(cause).__name__}: {cause}"
    return None


# ---------------------------------------------------------------------------------
# Row normalisation


def normalize_row(row: Any, row_index: int, source: str) -> Conversation:
    """Turn one dataset row into a Conversation, or raise DataError naming the problem.

    The messages keep exactly what a chat template reads, as the row gives it (see the
    module docstring); only JSON-string tool-call arguments and a JSON-string `tools`
    are decoded, since templates serialise them as objects.
    """

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

    messages = _chat_messages(row[column], column, fail)
    _add_system(messages, row.get("system"), fail)
    if not any(m["role"] == "assistant" for m in messages):
        raise fail("no_assistant_turn", "no assistant message, so nothing to learn from")
    tools = _tools(row.get("tools"), fail)
    return Conversation("chat", messages=messages, source=source, row_index=row_index, tools=tools)


def _chat_messages(raw: Any, column: str, fail: Callable[[str, str], DataError]) -> list[dict[str, Any]]:
    """The messages of one chat; role/content or ShareGPT from/value, decided by the first message."""
    if not isinstance(raw, (list, tuple)):
        raise fail("malformed_message", f"'{column}' must be a list of messages, got {type(raw).__name__}")
    if not raw:
        raise fail("no_assistant_turn", f"'{column}' is empty, so nothing to learn from")
    first = raw[0] if isinstance(raw[0], dict) else {}
    role_key, content_key, role_map = ("from", "value", SHAREGPT_ROLES) if "role" not in first and "from" in first \
        else ("role", "content", None)
    return [_message(msg, i, role_key, content_key, role_map, fail) for i, msg in enumerate(raw)]


def _message(msg: Any, i: int, role_key: str, content_key: str, role_map: dict[str, str] | None,
             fail: Callable[[str, str], DataError]) -> dict[str, Any]:
    if not isinstance(msg, dict) or msg.get(role_key) is None:
        keys = sorted(msg) if isinstance(msg, dict) else type(msg).__name__
        raise fail("malformed_message", f"message {i} needs '{role_key}' (this list uses "
                                        f"{role_key}/{content_key}; got {keys})")
    role = msg[role_key]
    mapped = role_map.get(str(role).lower()) if role_map is not None else role
    if mapped not in ROLES:
        raise fail("unknown_role", f"unknown role {role!r} in message {i}")
    where = f"message {i} ({mapped})"
    out: dict[str, Any] = {"role": mapped}
    if content_key in msg:
        out["content"] = _content(msg[content_key], where, fail)
    for key in ("reasoning_content", "tool_call_id", "name"):
        if key in msg:
            if msg[key] is not None and not isinstance(msg[key], str):
                raise fail("malformed_message", f"{where} '{key}' is {type(msg[key]).__name__}, not a string")
            out[key] = msg[key]
    if "tool_calls" in msg:
        out["tool_calls"] = _tool_calls(msg["tool_calls"], where, fail)
    if out.get("content") is None:
        if mapped != "assistant":
            raise fail("malformed_message", f"{where} has no '{content_key}'")
        if not out.get("tool_calls") and out.get("reasoning_content") is None:
            raise fail("malformed_message", f"{where} has no '{content_key}', 'tool_calls' or 'reasoning_content'")
    return out


def _content(content: Any, where: str, fail: Callable[[str, str], DataError]) -> Any:
    """A string (empty allowed: the template renders it) or a list of text parts, as given; None kept."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise fail("non_string_content", f"{where} content part {j} is {kind!r}, not a text part "
                                                 "({'type': 'text', 'text': str})")
        return content
    raise fail("non_string_content", f"{where} content is {type(content).__name__}, not a string or text parts")


def _tool_calls(calls: Any, where: str, fail: Callable[[str, str], DataError]) -> Any:
    """Tool calls as given, JSON-string arguments decoded to an object (OpenAI nests name and
    arguments under 'function'; rows that put them on the call itself keep that shape)."""
    if calls is None:
        return None
    if not isinstance(calls, list):
        raise fail("malformed_message", f"{where} 'tool_calls' is {type(calls).__name__}, not a list")
    out = []
    for j, call in enumerate(calls):
        nested = isinstance(call, dict) and isinstance(call.get("function"), dict)
        function = call["function"] if nested else call
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise fail("malformed_message", f"{where} tool call {j} needs a 'name' string "
                                            "(in 'function' or on the call)")
        if "arguments" in function:
            function = {**function, "arguments": _arguments(function["arguments"], f"{where} tool call {j}", fail)}
        out.append({**call, "function": function} if nested else function)
    return out


def _arguments(arguments: Any, where: str, fail: Callable[[str, str], DataError]) -> Any:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise fail("malformed_message", f"{where} arguments are not valid JSON ({exc})") from exc
    if not isinstance(arguments, dict):
        raise fail("malformed_message", f"{where} arguments are {type(arguments).__name__}, not a JSON object")
    return arguments


def _tools(tools: Any, fail: Callable[[str, str], DataError]) -> list[dict[str, Any]] | None:
    """The row's tool schemas (a list of objects, or a JSON string of one), or None."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise fail("malformed_tools", f"'tools' is a string but not valid JSON ({exc})") from exc
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise fail("malformed_tools", f"'tools' must be a list of tool schemas (objects), got {type(tools).__name__}")
    return tools


def _add_system(messages: list[dict[str, Any]], system: Any, fail: Callable[[str, str], DataError]) -> None:
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


# ---------------------------------------------------------------------------------
# Bad-row policy


@dataclass
class SkipCounter:
    """Skipped rows per reason code, plus the first message seen for each reason."""

    counts: Counter = field(default_factory=Counter)
    first_message: dict[str, str] = field(default_factory=dict)

    def record(self, error: DataError) -> None:
        if error.reason not in self.first_message:
            self.first_message[error.reason] = str(error)
            log.warning("skipping row (%s): %s; further %r skips are only counted", error.reason, error, error.reason)
        self.counts[error.reason] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))

    def summary(self) -> str:
        if not self.counts:
            return "no rows skipped"
        return f"{self.total} rows skipped: " + ", ".join(f"{k}={v}" for k, v in self.to_dict().items())


def guard(on_bad_row: OnBadRow, skips: SkipCounter, fn: Callable, /, *args, **kwargs):
    """Call fn(*args, **kwargs); on DataError either re-raise ("error") or count it in
    `skips` and return None ("skip"). SkippedSample is always counted, never raised."""
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', not {on_bad_row!r}")
    try:
        return fn(*args, **kwargs)
    except SkippedSample as err:
        skips.record(err)
    except DataError as err:
        if on_bad_row == "error":
            raise
        skips.record(err)
    return None


def iter_conversations(
    rows: Iterable[dict], source: str, *, on_bad_row: OnBadRow = "error", skips: SkipCounter | None = None
) -> Iterator[Conversation]:
    """Normalise rows in order, applying the bad-row policy (skips land in `skips`)."""
    skips = SkipCounter() if skips is None else skips
    for index, row in enumerate(rows):
        conv = guard(on_bad_row, skips, normalize_row, row, index, source)
        if conv is not None:
            yield conv


# ---------------------------------------------------------------------------------
# Fingerprint


def dataset_fingerprint(ds, spec: str, split: str, revision: str | None = None) -> dict[str, Any]:
    """What a cache records about its input, to tell later whether the data changed.

    Local sources hash the bytes of their data files ("files-sha256": sorted relative
    path, size and content of every file; for a saved dataset, its split's Arrow
    files), which is cheap and independent of how `datasets` caches them. Hub and other
    sources hash the rows themselves ("rows-sha256": each row as canonical JSON with
    sorted keys, in order), which is exact but reads the whole dataset once; the
    `datasets` fingerprint is recorded too but is not a content hash (it depends on the
    cache layout and library version).
    """
    path = Path(spec)
    info: dict[str, Any] = {
        "source": spec,
        "split": split,
        "revision": revision,
        "num_rows": len(ds),
        "datasets_fingerprint": getattr(ds, "_fingerprint", None),
    }
    if path.exists():
        if path.is_dir() and _is_saved_dataset(path):
            files = sorted(Path(f["filename"]) for f in ds.cache_files)
            root = path.resolve()
        else:
            files = local_data_files(path)
            root = path.resolve() if path.is_dir() else path.resolve().parent
        info["resolved_path"] = str(path.resolve())
        info["hash_method"] = "files-sha256"
        info["content_hash"] = _hash_files(files, root)
    else:
        info["hash_method"] = "rows-sha256"
        info["content_hash"] = _hash_rows(ds)
    return info


def _hash_files(files: list[Path], root: Path) -> str:
    digest = hashlib.sha256()
    for f in files:
        resolved = f.resolve()
        name = resolved.relative_to(root).as_posix() if resolved.is_relative_to(root) else resolved.name
        digest.update(f"{name}\0{resolved.stat().st_size}\0".encode())
        with open(resolved, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return "sha256:" + digest.hexdigest()


def _hash_rows(ds, batch_size: int = 1024) -> str:
    digest = hashlib.sha256()
    for start in range(0, len(ds), batch_size):
        batch = ds[start : start + batch_size]  # dict of columns
        columns = sorted(batch)
        for values in zip(*(batch[c] for c in columns)):
            row = dict(zip(columns, values))
            digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode())
            digest.update(b"\n")
    return "sha256:" + digest.hexdigest()
