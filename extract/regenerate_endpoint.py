"""Regeneration through an OpenAI-compatible chat-completions server (vLLM, SGLang,
`transformers serve`): the in-process engine's output, at serving-engine speed.

`--concurrency` conversations are in flight, the turns of one in order. Each request
carries the row's `tools`, the template arguments as `chat_template_kwargs`, `max_tokens`,
`temperature` and, when sampling, `top_p` and a `seed` drawn from (seed, row, turn), plus
`--extra-body`. Every answered turn is appended to the part's turn journal as it arrives,
so a rerun after a kill or a server crash asks only for the turns not answered yet; the
journal goes once the part's rows and done record are written. A request the server
rejects while staying up cuts that conversation (counted, `server_rejected`) or, with
`--on-bad-row error`, stops the run; a server that stays down stops it (`EndpointDown`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .data import Conversation, DataError, SkipCounter
from .endpoint import ChatEndpoint, Reply, RequestRejected
from .regenerate import (PARTS_DIR, Chat, GenerationSettings, RegenConfig, collect_rows, finalize, open_source,
                         part_chats, part_paths, regenerated_message, run_record, start_run, write_part)

log = logging.getLogger(__name__)


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
    return {**body, **extra_body}


def reply_tool_calls(reply: Reply) -> list[dict] | None:
    """The server's tool calls in the dataset's shape: arguments decoded to an object
    (kept as the string the model wrote where that is not JSON)."""
    calls = []
    for call in reply.tool_calls or []:
        function = dict(call.get("function") or {})
        try:
            function["arguments"] = json.loads(function["arguments"])
        except (KeyError, TypeError, json.JSONDecodeError):
            pass
        calls.append({**({"id": call["id"]} if call.get("id") else {}), "type": call.get("type", "function"),
                      "function": function})
    return calls or None


def turn_event(chat: Chat, turn: int, reply: Reply, settings: GenerationSettings) -> dict[str, Any]:
    """What an answer does to the conversation, as a journal line."""
    where = {"row": chat.conv.row_index, "turn": turn}
    if settings.max_prompt_tokens is not None and (reply.prompt_tokens or 0) > settings.max_prompt_tokens:
        return {**where, "cut": "prompt_too_long"}
    tool_calls = reply_tool_calls(reply)
    if not reply.content.strip() and not reply.reasoning and not tool_calls:
        return {**where, "cut": "empty_generation"}
    truncated = reply.finish_reason == "length"
    if truncated and settings.drop_truncated:
        return {**where, "cut": "truncated"}
    message = regenerated_message(chat.messages[turn], reply.content, reply.reasoning, tool_calls)
    return {**where, "message": message, "truncated": truncated, "tokens": reply.completion_tokens or 0,
            "model": reply.model}


def read_journal(path: Path) -> list[dict]:
    """A part's journaled turns (JSON lines); a torn last line (killed mid-write) is cut off the file."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.exists() else []
    events = []
    for number, line in enumerate(lines, 1):
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number < len(lines) or line.endswith("\n"):
                raise ValueError(f"{path} line {number} is not JSON ({err}); delete the file to redo "
                                 "that part") from err
            path.write_text("".join(lines[:-1]), encoding="utf-8")
    return events


@dataclass
class Part:
    """One part being regenerated: its chats as far as its turn journal got."""

    index: int
    rows: int  # source rows it covers
    chats: list[Chat]
    skips: SkipCounter
    journal: Path
    running: int = 0  # conversations in flight
    models: Counter = field(default_factory=Counter)  # answers per served model
    file: Any = None  # the journal, once open for appends

    def apply(self, chat: Chat, event: dict, *, journal: bool = False) -> None:
        """One answered turn applied to its chat (the answer, or a cut there); with ``journal``,
        appended to the journal first."""
        if journal:
            self.file = self.file or self.journal.open("a", encoding="utf-8")
            self.file.write(json.dumps(event, ensure_ascii=False) + "\n")
            self.file.flush()  # in the OS's hands: survives a kill of this process
        if event["turn"] != chat.next_turn:
            raise ValueError(f"{self.journal}: row {chat.conv.row_index} does not match the source (turn "
                             f"{event['turn']}, expected {chat.next_turn}); delete the file to redo the part")
        if "cut" in event:
            chat.cut(event["turn"], event["cut"], self.skips)
        else:
            chat.answer(event["turn"], event["message"], event["truncated"], event["tokens"])
            self.models[event["model"]] += 1


def open_part(out: Path, index: int, rows: int, convs: list[Conversation], skips: SkipCounter) -> Part:
    """Start a part's chats and replay its journal onto them."""
    part = Part(index, rows, [Chat.start(conv, skips) for conv in convs], skips,
                out / PARTS_DIR / f"part-{index:05d}.turns.jsonl")
    by_row = {chat.conv.row_index: chat for chat in part.chats}
    for event in read_journal(part.journal):
        if event.get("row") not in by_row:
            raise ValueError(f"{part.journal}: row {event.get('row')} is not a conversation of this part; "
                             "delete the file to redo the part")
        part.apply(by_row[event["row"]], event)
    return part


def finish_part(out: Path, part: Part) -> None:
    """Write the part's rows and done record, then drop its journal."""
    rows, totals = collect_rows(part.chats, part.skips)
    write_part(out, part.index, rows, {"part": part.index, "rows_in": part.rows, "rows_out": len(rows), **totals,
                                       "skipped": part.skips.to_dict(), "served_models": dict(part.models)})
    if part.file is not None:
        part.file.close()
    part.journal.unlink(missing_ok=True)


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
    """Run (or resume) the job through the server; returns the metadata written to regenerate.json."""
    from tqdm.auto import tqdm

    job.validate()
    if job.endpoint is None:
        raise ValueError("regeneration through a server needs its URL: give --endpoint")
    client = ChatEndpoint(job.endpoint)
    try:
        model = served_model(client, job.model)
    except RequestRejected as err:
        raise ValueError(str(err)) from err
    ds, num_rows, source_fp = open_source(job)
    # the URL is not recorded: a restarted server can listen elsewhere
    record = run_record(job, source_fp, num_rows, engine="endpoint", target={"served_model": model},
                        generation={k: v for k, v in asdict(job.generation).items() if k != "dtype"},
                        extra_body=job.extra_body)
    out = start_run(job, record, overwrite)
    lock, turns = threading.Lock(), Counter()

    def run_chat(part: Part, chat: Chat) -> None:
        """Ask the chat's turns in order; each answer is journaled and applied under the lock."""
        while chat.next_turn is not None and not chat.dropped and not client.stop.is_set():
            turn, row = chat.next_turn, chat.conv.row_index
            body = request_body(model, chat.messages[:turn], chat.conv.tools, job.generation, job.extra_body, row,
                                turn)
            try:
                event = turn_event(chat, turn, client.chat(body), job.generation)
            except RequestRejected as err:
                if job.on_bad_row == "error":
                    raise DataError("server_rejected", chat.conv.source, row, f"turn {turn}: {err}") from err
                log.warning("%s row %d turn %d: server rejected the request: %s", chat.conv.source, row, turn, err)
                event = {"row": row, "turn": turn, "cut": "server_rejected"}
            with lock:
                part.apply(chat, event, journal=True)
                turns["answered"] += "model" in event

    num_parts = math.ceil(num_rows / job.part_size)
    bar = tqdm(total=num_rows, desc="regenerate", unit="row", disable=not job.progress)
    inflight: dict[Future, Part] = {}
    pool = ThreadPoolExecutor(max_workers=job.concurrency, thread_name_prefix="regenerate")

    def settle(done) -> None:
        for future in done:
            part = inflight.pop(future)
            future.result()  # a failed conversation stops the run here
            part.running -= 1
            bar.update(1)
            if part.running == 0:
                finish_part(out, part)
        bar.set_postfix(turns=turns["answered"], refresh=False)

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
                inflight[pool.submit(run_chat, part, chat)] = part
            part.running -= 1
            if part.running == 0:
                finish_part(out, part)
        while inflight:
            settle(wait(inflight, return_when=FIRST_COMPLETED).done)
    except BaseException as err:
        client.stop.set()  # no new turn starts; answers of requests in flight are still journaled
        pool.shutdown(wait=not isinstance(err, KeyboardInterrupt), cancel_futures=True)
        raise
    finally:
        bar.close()
    pool.shutdown()
    served = Counter()
    for index in range(num_parts):
        served.update(json.loads(part_paths(out, index)[1].read_text()).get("served_models", {}))
    target_fp = {"endpoint": client.base, "served_model": model, "answered_by": dict(served)}
    return finalize(out, num_parts, record, target_fp, source_fp,
                    extra={"endpoint": {"url": client.base, "concurrency": job.concurrency,
                                        "request_timeout": job.endpoint.request_timeout,
                                        "retries": job.endpoint.retries}})
