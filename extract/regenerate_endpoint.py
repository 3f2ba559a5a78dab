"""Regeneration through an OpenAI-compatible chat-completions server (vLLM, SGLang,
`transformers serve`): the same output as the in-process path, at serving-engine speed.

    python -m dflash.extract.regenerate_cli --data chats.jsonl --endpoint http://HOST:8000/v1 --out regen/ \\
        [--model NAME] [--concurrency 32] [--max-new-tokens 1024] [--template-kwargs JSON]

Conversations run in parallel (`--concurrency` in flight), the turns of one conversation
in order: turn k is asked with turns < k already replaced by their regenerated answers.
Each request carries the row's `tools`, the template arguments as `chat_template_kwargs`
(read by vLLM, SGLang and `transformers serve`), `max_tokens`, `temperature` (0 =
greedy, the default) and, when sampling, `top_p` and a `seed` drawn from (seed, row,
turn); `--extra-body JSON` adds server-specific fields (vLLM's `top_k`, ...). The answer's
`content` replaces the turn's; its `reasoning_content` (or `reasoning`) becomes the
message's `reasoning_content` and its tool calls the message's `tool_calls` (arguments
decoded to an object); the source turn's own reasoning and tool calls are dropped, as the
drafter is to learn what the target writes. `finish_reason == "length"` marks a truncated
turn; `--max-prompt-tokens` is checked against the server's `usage.prompt_tokens`.

Resume is per turn: every answered turn is appended to `OUT/parts/part-NNNNN.turns.jsonl`
as it arrives, so a rerun after a kill or a server crash replays that journal and asks
only for the turns that were not answered yet. A part's journal is deleted once the
part's rows and done record are written (the same part files and journal as in process).
A request the server rejects while staying up (4xx, or a 5xx that persists while
`/models` answers) cuts that conversation at that turn (counted, `server_rejected`) or,
with `--on-bad-row error`, stops the run; a server that stays down stops the run with
the URL and what failed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import threading
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .data import Conversation, DataError, SkipCounter, dataset_fingerprint, load_source
from .endpoint import ChatEndpoint, Reply, RequestRejected
from .regenerate import (FORMAT_VERSION, PARTS_DIR, Chat, GenerationSettings, RegenConfig, _check_resume,
                         collect_rows, finalize, part_chats, part_paths, regenerated_message, write_part)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- requests


def wire_message(message: dict) -> dict:
    """A message as the chat-completions API takes it: no None fields, tool-call
    arguments as JSON strings (the API's type; servers decode them for the template)."""
    wire = {k: v for k, v in message.items() if v is not None}
    if wire.get("tool_calls"):
        calls = []
        for call in wire["tool_calls"]:
            call = {k: v for k, v in call.items() if v is not None}
            function = call.get("function")
            if isinstance(function, dict) and not isinstance(function.get("arguments"), str):
                call["function"] = {**function, "arguments": json.dumps(function.get("arguments") or {},
                                                                        ensure_ascii=False)}
            calls.append(call)
        wire["tool_calls"] = calls
    return wire


def request_seed(seed: int, row: int, turn: int) -> int:
    """A per-turn sampling seed, the same for a turn however the run was interrupted."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{row}:{turn}".encode()).digest()[:4], "little") >> 1


def request_body(model: str, history: list[dict], tools: list | None, settings: GenerationSettings,
                 extra_body: dict, row: int, turn: int) -> dict[str, Any]:
    """The chat-completions request for the turn that follows ``history``."""
    body: dict[str, Any] = {"model": model, "messages": [wire_message(m) for m in history],
                            "max_tokens": settings.max_new_tokens, "temperature": settings.temperature,
                            "stream": False}
    if settings.temperature > 0:
        body.update(top_p=settings.top_p, seed=request_seed(settings.seed, row, turn))
    if tools:
        body["tools"] = tools
    if settings.template_kwargs:
        body["chat_template_kwargs"] = settings.template_kwargs
    body.update(extra_body)
    return body


def reply_tool_calls(reply: Reply) -> list[dict] | None:
    """The server's tool calls in the dataset's shape: arguments decoded to an object."""
    if not reply.tool_calls:
        return None
    calls = []
    for call in reply.tool_calls:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except json.JSONDecodeError:
                pass  # kept as the string the model wrote
        calls.append({**({"id": call["id"]} if call.get("id") else {}), "type": call.get("type", "function"),
                      "function": function})
    return calls


def turn_event(chat: Chat, turn: int, reply: Reply, settings: GenerationSettings) -> dict[str, Any]:
    """What an answer does to the conversation, as a journal line."""
    row = chat.conv.row_index
    if settings.max_prompt_tokens is not None and (reply.prompt_tokens or 0) > settings.max_prompt_tokens:
        return {"row": row, "turn": turn, "cut": "prompt_too_long"}
    tool_calls = reply_tool_calls(reply)
    if not reply.content.strip() and not reply.reasoning and not tool_calls:
        return {"row": row, "turn": turn, "cut": "empty_generation"}
    truncated = reply.finish_reason == "length"
    if truncated and settings.drop_truncated:
        return {"row": row, "turn": turn, "cut": "truncated"}
    message = regenerated_message(chat.messages[turn], reply.content, reply.reasoning, tool_calls)
    return {"row": row, "turn": turn, "message": message, "truncated": truncated,
            "tokens": reply.completion_tokens or 0, "model": reply.model,
            "server_tool_calls": bool(tool_calls)}


def apply_event(chat: Chat, event: dict, skips: SkipCounter) -> None:
    """Apply one answered turn (a journal line) to its chat: the answer, or a cut there."""
    if event["turn"] != chat.next_turn:
        raise ValueError(f"turn journal of row {chat.conv.row_index} does not match the source "
                         f"(turn {event['turn']}, expected {chat.next_turn}); delete that part's journal to redo it")
    if "cut" in event:
        chat.cut(event["turn"], event["cut"], skips)
    else:
        chat.answer(event["turn"], event["message"], event["truncated"], event["tokens"])


# ---------------------------------------------------------------------------- the turn journal


def journal_path(out: Path, part: int) -> Path:
    return out / PARTS_DIR / f"part-{part:05d}.turns.jsonl"


class TurnJournal:
    """Append-only JSON lines of one part's answered turns: the unit of resume."""

    def __init__(self, path: Path):
        self.path = path
        self._file = None

    def read(self) -> list[dict]:
        """Events written so far; a torn last line (killed mid-write) is dropped."""
        if not self.path.exists():
            return []
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        events = []
        for number, line in enumerate(lines, 1):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError as err:
                if number < len(lines) or line.endswith("\n"):
                    raise ValueError(f"{self.path} line {number} is not JSON ({err}); delete the file to redo "
                                     "that part") from err
                self.path.write_text("".join(lines[:-1]), encoding="utf-8")
        return events

    def append(self, event: dict) -> None:
        if self._file is None:
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps(event, ensure_ascii=False) + "\n")
        self._file.flush()  # in the OS's hands: survives a kill of this process

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


@dataclass
class Part:
    """One part being regenerated: its chats as far as the journal got."""

    index: int
    rows: int  # source rows it covers
    chats: list[Chat]
    skips: SkipCounter
    journal: TurnJournal
    running: int = 0  # conversations in flight
    models: Counter = field(default_factory=Counter)  # answers per served model


def open_part(out: Path, index: int, rows: int, convs: list[Conversation], skips: SkipCounter) -> Part:
    """Start a part's chats and replay its journal onto them."""
    chats = [Chat.start(conv, skips) for conv in convs]
    part = Part(index, rows, chats, skips, TurnJournal(journal_path(out, index)))
    by_row = {chat.conv.row_index: chat for chat in chats}
    for event in part.journal.read():
        chat = by_row.get(event.get("row"))
        if chat is None:
            raise ValueError(f"{part.journal.path}: row {event.get('row')} is not a conversation of this part; "
                             "delete the file to redo the part")
        apply_event(chat, event, skips)
        if "model" in event:
            part.models[event["model"]] += 1
    return part


def finish_part(out: Path, part: Part) -> None:
    """Write the part's rows and done record, then drop its journal."""
    rows, totals = collect_rows(part.chats, part.skips)
    write_part(out, part.index, rows, {"part": part.index, "rows_in": part.rows, "rows_out": len(rows), **totals,
                                       "skipped": part.skips.to_dict(), "served_models": dict(part.models)})
    part.journal.remove()


# ---------------------------------------------------------------------------- the job


class _Runner:
    """Turns of many conversations in flight; the journal and the counts under one lock."""

    def __init__(self, job: RegenConfig, client: ChatEndpoint, model: str):
        self.job, self.client, self.model = job, client, model
        self.lock = threading.Lock()
        self.turns = 0

    def run_chat(self, part: Part, chat: Chat) -> None:
        job = self.job
        while chat.next_turn is not None and not chat.dropped:
            if self.client.stop.is_set():
                return
            turn = chat.next_turn
            body = request_body(self.model, chat.messages[:turn], getattr(chat.conv, "tools", None),
                                job.generation, job.extra_body, chat.conv.row_index, turn)
            try:
                event = turn_event(chat, turn, self.client.chat(body), job.generation)
            except RequestRejected as err:
                if job.on_bad_row == "error":
                    raise DataError("server_rejected", chat.conv.source, chat.conv.row_index,
                                    f"turn {turn}: {err}") from err
                log.warning("%s row %d turn %d: server rejected the request: %s", chat.conv.source,
                            chat.conv.row_index, turn, err)
                event = {"row": chat.conv.row_index, "turn": turn, "cut": "server_rejected"}
            with self.lock:
                part.journal.append(event)
                apply_event(chat, event, part.skips)
                if "model" in event:
                    part.models[event["model"]] += 1
                    self.turns += 1


def _run_record(job: RegenConfig, model: str, source_fp: dict, num_rows: int) -> dict:
    """Everything that decides the output rows; a resume must match it exactly (the URL
    may change: a restarted server can listen elsewhere)."""
    generation = {k: v for k, v in asdict(job.generation).items() if k != "dtype"}
    return {
        "format": FORMAT_VERSION,
        "engine": "endpoint",
        "source": {k: source_fp.get(k) for k in ("source", "split", "revision", "num_rows", "hash_method",
                                                 "content_hash")},
        "target": {"served_model": model},
        "generation": generation,
        "extra_body": job.extra_body,
        "part_size": job.part_size,
        "num_rows": num_rows,
        "on_bad_row": job.on_bad_row,
    }


def served_model(client: ChatEndpoint, requested: str | None) -> str:
    """The model name to request: the only one the server lists, or ``requested``; a name
    the server does not list is tried with a one-token request first (some servers list
    their cache rather than what they serve)."""
    listed = client.models()
    if requested is None:
        if len(listed) != 1:
            raise ValueError(f"{client.base}/models lists {listed or 'no model'}; choose one with --model")
        return listed[0]
    if requested not in listed:
        try:
            client.chat({"model": requested, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
        except RequestRejected as err:
            raise ValueError(f"{client.base} does not serve {requested!r} (it lists {listed}; a test "
                                       f"request was answered with {err})") from err
    return requested


def regenerate_via_endpoint(job: RegenConfig, *, overwrite: bool = False) -> dict[str, Any]:
    """Run (or resume) the job; returns the metadata written to regenerate.json."""
    from tqdm.auto import tqdm

    job.generation.validate()
    if job.endpoint is None:
        raise ValueError("regeneration through a server needs its URL: give --endpoint")
    if job.part_size < 1 or job.concurrency < 1:
        raise ValueError("part_size and concurrency must be >= 1")
    out = Path(job.out)
    client = ChatEndpoint(job.endpoint)
    try:
        model = served_model(client, job.model)
    except RequestRejected as err:
        raise ValueError(str(err)) from err
    if overwrite and out.exists():
        shutil.rmtree(out)
    (out / PARTS_DIR).mkdir(parents=True, exist_ok=True)
    ds = load_source(job.data, job.split)
    num_rows = len(ds) if job.limit is None else min(len(ds), job.limit)
    source_fp = dataset_fingerprint(ds, job.data, job.split)
    record = _run_record(job, model, source_fp, num_rows)
    _check_resume(out, record)

    num_parts = math.ceil(num_rows / job.part_size)
    runner = _Runner(job, client, model)
    bar = tqdm(total=num_rows, desc="regenerate", unit="row", disable=not job.progress)
    inflight: dict[Future, tuple[Part, Chat]] = {}
    pool = ThreadPoolExecutor(max_workers=job.concurrency, thread_name_prefix="regenerate")

    def settle(done) -> None:
        for future in done:
            part, _ = inflight.pop(future)
            future.result()  # a failed conversation stops the run here
            part.running -= 1
            bar.update(1)
            if part.running == 0:
                finish_part(out, part)
        bar.set_postfix(turns=runner.turns, refresh=False)

    try:
        for index in range(num_parts):
            start, stop = index * job.part_size, min(num_rows, (index + 1) * job.part_size)
            if part_paths(out, index)[1].exists():
                bar.update(stop - start)
                continue
            skips = SkipCounter()
            part = open_part(out, index, stop - start, part_chats(ds, start, stop, job.data, job.on_bad_row, skips),
                             skips)
            waiting = [c for c in part.chats if c.next_turn is not None and not c.dropped]
            bar.update(stop - start - len(waiting))
            part.running = len(waiting) + 1  # +1 until every chat is submitted
            for chat in waiting:
                while len(inflight) >= job.concurrency:
                    settle(wait(inflight, return_when=FIRST_COMPLETED).done)
                inflight[pool.submit(runner.run_chat, part, chat)] = (part, chat)
            part.running -= 1
            if part.running == 0:
                finish_part(out, part)
        while inflight:
            settle(wait(inflight, return_when=FIRST_COMPLETED).done)
    except BaseException as err:
        client.stop.set()  # no new turn starts; answers of requests in flight are still journaled
        pool.shutdown(wait=not isinstance(err, KeyboardInterrupt), cancel_futures=True)
        bar.close()
        raise
    pool.shutdown()
    bar.close()
    served = Counter()
    for index in range(num_parts):
        served.update(json.loads(part_paths(out, index)[1].read_text()).get("served_models", {}))
    target_fp = {"endpoint": client.base, "served_model": model, "answered_by": dict(served)}
    return finalize(out, num_parts, record, target_fp, source_fp,
                    extra={"endpoint": {"url": client.base, "concurrency": job.concurrency,
                                        "request_timeout": job.endpoint.request_timeout,
                                        "retries": job.endpoint.retries}})
