"""Chat datasets in, normalised conversations out.

Sources are read through HF `datasets` (local JSON/JSONL/Parquet/Arrow files or folders,
saved datasets, or hub names). Each row becomes a `Conversation`; a row that cannot
become one raises `DataError` naming the file, the row and the problem. Under the
"skip" policy bad rows are counted per reason in a `SkipCounter`, never dropped silently.

Accepted row formats, tried in this order (the first present, non-null column wins):
  * `messages`: a list of {"role", "content"}; roles system / user / assistant / tool.
    Other keys (name, tool_calls, reasoning_content, ...) are dropped. `tool` messages
    are context only: they never enter the loss.
  * `conversations` (ShareGPT): a list of {"from", "value"}; `from` is mapped onto the
    roles above (human -> user, gpt -> assistant, ...; see SHAREGPT_ROLES). A top-level
    string `system` column, if present, becomes a leading system message.
  * `text`: a plain string, trained on as a whole.
Content must be a non-empty string (multimodal content lists are refused), and a chat
needs at least one assistant turn, otherwise it carries no loss.
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
# file extension -> `datasets` builder
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}

OnBadRow = Literal["error", "skip"]


class DataError(ValueError):
    """A source or row that cannot be used. `reason` is a stable code for counting.

    Reason codes: unreadable (file/folder/hub source), missing_columns,
    malformed_message, unknown_role, empty_content, non_string_content,
    no_assistant_turn; extract.chat adds template_rejected, mask_not_located,
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

    kind "chat": `messages` is a list of {"role", "content"} (roles in ROLES).
    kind "text": `text` is the raw string. `source` and `row_index` locate the row for
    error messages raised later (rendering, truncation).
    """

    kind: Literal["chat", "text"]
    messages: list[dict[str, str]] | None = None
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
    """Open `spec` as a `datasets.Dataset`.

    `spec` is, in this order: a local data file (.json, .jsonl, .parquet, .arrow); a
    folder saved by `save_to_disk` (for a DatasetDict, `split` picks the split); a
    folder of data files (all of one format, searched recursively); otherwise a hub
    dataset name, opened with `load_dataset(spec, split=, revision=, data_files=)`.
    For local files the files ARE the requested split. Anything that cannot be read
    raises DataError("unreadable") naming the file and the problem.
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
        return loaded
    if path.exists():
        files = local_data_files(path)
        builder = LOCAL_FORMATS[files[0].suffix]
        try:
            return datasets.load_dataset(
                builder, data_files={split: [str(f) for f in files]}, split=split, cache_dir=cache_dir
            )
        except Exception as exc:  # noqa: BLE001
            bad, problem = _find_unreadable(builder, files, cache_dir) or (spec, str(exc))
            raise DataError("unreadable", str(bad), None, f"cannot read: {problem}") from exc
    if _looks_like_path(spec):
        raise DataError("unreadable", spec, None, "no such file or directory")
    try:
        return datasets.load_dataset(spec, split=split, revision=revision, data_files=data_files, cache_dir=cache_dir)
    except Exception as exc:  # noqa: BLE001
        raise DataError("unreadable", spec, None, f"cannot load hub dataset: {type(exc).__name__}: {exc}") from exc


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


def normalize_row(row: dict[str, Any], row_index: int, source: str) -> Conversation:
    """Turn one dataset row into a Conversation, or raise DataError naming the problem."""

    def fail(reason: str, problem: str) -> DataError:
        return DataError(reason, source, row_index, problem)

    if row.get("messages") is not None:
        messages = _chat_messages(row["messages"], "messages", "role", "content", None, fail)
    elif row.get("conversations") is not None:
        messages = _chat_messages(row["conversations"], "conversations", "from", "value", SHAREGPT_ROLES, fail)
        system = row.get("system")
        if isinstance(system, str) and system.strip() and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
    elif row.get("text") is not None:
        text = row["text"]
        if not isinstance(text, str):
            raise fail("non_string_content", f"'text' is {type(text).__name__}, not a string")
        if not text.strip():
            raise fail("empty_content", "'text' is empty")
        return Conversation("text", text=text, source=source, row_index=row_index)
    else:
        present = sorted(k for k, v in row.items() if v is not None)
        raise fail("missing_columns", f"no 'messages', 'conversations' or 'text' column (has {present})")

    if not any(m["role"] == "assistant" for m in messages):
        raise fail("no_assistant_turn", "no assistant message, so nothing to learn from")
    return Conversation("chat", messages=messages, source=source, row_index=row_index)


def _chat_messages(
    raw: Any,
    column: str,
    role_key: str,
    content_key: str,
    role_map: dict[str, str] | None,
    fail: Callable[[str, str], DataError],
) -> list[dict[str, str]]:
    if not isinstance(raw, (list, tuple)) or not raw:
        raise fail("malformed_message", f"'{column}' must be a non-empty list, got {type(raw).__name__}")
    messages = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict) or msg.get(role_key) is None or content_key not in msg:
            keys = sorted(msg) if isinstance(msg, dict) else type(msg).__name__
            raise fail("malformed_message", f"message {i} needs '{role_key}' and '{content_key}' (got {keys})")
        role = msg[role_key]
        mapped = role_map.get(str(role).lower()) if role_map is not None else role
        if mapped not in ROLES:
            raise fail("unknown_role", f"unknown role {role!r} in message {i}")
        content = msg[content_key]
        if not isinstance(content, str):
            raise fail("non_string_content", f"message {i} ({mapped}) content is {type(content).__name__}, not a string")
        if not content.strip():
            raise fail("empty_content", f"message {i} ({mapped}) has empty content")
        messages.append({"role": mapped, "content": content})
    return messages


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
