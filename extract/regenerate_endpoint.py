"""Regeneration through an OpenAI-compatible chat-completions server (vLLM, SGLang, `transformers serve`):
`--concurrency` conversations in flight, the turns of one in order, each answer journaled as it arrives."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .data import DataError

if TYPE_CHECKING:
    from .regenerate import Chat, GenerationSettings, Part, RegenConfig

log = logging.getLogger(__name__)


class EndpointDown(RuntimeError):
    """The server cannot be reached (or keeps failing) after every retry."""


class RequestRejected(ValueError):
    """The server answered this one request with an error while staying up."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}")


@dataclass
class ChatEndpoint:
    """Thread-safe: one instance serves every worker thread (each request opens its own connection)."""

    url: str
    request_timeout: float
    retries: int
    retry_wait: float  # first backoff in seconds; doubles per retry, capped at 30 s
    api_key: str | None = None
    stop: threading.Event = field(default_factory=threading.Event)  # set to end retries early

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /chat/completions (non-streaming): the answer, checked to hold ``choices[0].message``."""
        answer = self.with_retries("POST", "/chat/completions", body)
        try:
            answer["choices"][0]["message"]
        except (KeyError, IndexError, TypeError) as err:
            raise RequestRejected(200, f"{self.url}: answer without choices[0].message: {str(answer)[:300]}") from err
        return answer

    def with_retries(self, method: str, path: str, body: dict | None = None) -> dict:
        """``method path``, retried with backoff on connection errors, timeouts, 408, 429 and 5xx; then EndpointDown,
        unless the server still answers ``GET /models``: then, as for a 4xx, RequestRejected (only this request)."""
        url, failures, started = self.url + path, [], time.monotonic()  # failures: (HTTP status or None, what)
        for attempt in range(self.retries + 1):
            if attempt and self.stop.wait(min(30.0, self.retry_wait * 2 ** (attempt - 1))):
                break
            try:
                return self._request(method, url, body)
            except urllib.error.HTTPError as err:
                detail = str(err.reason)
                with contextlib.suppress(Exception):  # the server's own words, where its answer can be read
                    detail = (err.read().decode("utf-8", "replace") or detail).strip()[:500]
                if err.code not in (408, 429) and err.code < 500:
                    raise RequestRejected(err.code, f"{method} {url}: {detail}") from err
                failures.append((err.code, f"HTTP {err.code} ({detail})"))
            except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
                reason = getattr(err, "reason", None) or err
                failures.append((None, f"{type(reason).__name__}: {reason}"))
        last_status, last = failures[-1] if failures else (None, "stopped")
        if method == "POST" and last_status is not None:  # a server that still answers is up
            try:
                self._request("GET", self.url + "/models", None)
            except Exception:  # noqa: BLE001 - any failure means "not answering"
                pass
            else:
                raise RequestRejected(last_status, f"{method} {url}: {last} (the server is up; "
                                                   "this request keeps failing)")
        raise EndpointDown(f"{method} {url} failed {len(failures)} time(s) over {time.monotonic() - started:.0f} s "
                           f"(last: {last}); is the server at {self.url} running? "
                           "Rerun the same command once it is: finished turns are kept.")

    def _request(self, method: str, url: str, body: dict | None) -> dict:
        data = None if body is None else json.dumps(body, ensure_ascii=False).encode("utf-8")
        headers = {"Accept": "application/json", **({"Content-Type": "application/json"} if data else {}),
                   **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})}
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        with urllib.request.urlopen(request, timeout=self.request_timeout) as response:
            payload = response.read()
        try:
            return json.loads(payload)
        except json.JSONDecodeError as err:
            raise http.client.HTTPException(f"not JSON: {payload[:200]!r}") from err


def request_seed(seed: int, row: int, turn: int) -> int:
    """A per-turn sampling seed, the same for a turn however the run was interrupted."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{row}:{turn}".encode()).digest()[:4], "little") >> 1


def answer_event(chat: Chat, turn: int, settings: GenerationSettings, content: str, truncated: bool, tokens: int,
                 reasoning: str | None = None, tool_calls: list | None = None) -> dict[str, Any]:
    """What an answer does to turn ``turn`` of ``chat``, as a journal line: a cut there, or the source assistant
    message with the target's content, reasoning and tool calls in place of its own."""
    where = {"row": chat.conv.row_index, "turn": turn}
    if not content.strip() and not reasoning and not tool_calls:
        return {**where, "cut": "empty_generation"}
    if truncated and settings.drop_truncated:
        return {**where, "cut": "truncated"}
    source = chat.messages[turn]
    message = {k: v for k, v in source.items() if k not in ("reasoning_content", "tool_calls") and v is not None}
    message = {**message, "content": content, **({"reasoning_content": reasoning} if reasoning else {}),
               **({"tool_calls": tool_calls} if tool_calls else {})}
    return {**where, "message": message, "truncated": truncated, "tokens": tokens}


def wire_message(message: dict) -> dict:
    """A message as the chat-completions API takes it and the output rows store it: no None fields,
    tool-call arguments as JSON strings (Arrow cannot hold free-form objects)."""
    wire = {k: v for k, v in message.items() if v is not None}
    if wire.get("tool_calls"):
        wire["tool_calls"] = [{k: v for k, v in call.items() if v is not None} for call in wire["tool_calls"]]
        for call in wire["tool_calls"]:
            function = call.get("function")
            if isinstance(function, dict) and not isinstance(function.get("arguments"), str):
                call["function"] = {**function, "arguments": json.dumps(function.get("arguments") or {},
                                                                        ensure_ascii=False)}
    return wire


def request_body(model: str, history: list[dict], tools: list | None, settings: GenerationSettings,
                 extra_body: dict, row: int, turn: int) -> dict[str, Any]:
    """The chat-completions request for the turn that follows ``history``."""
    sampling = {"top_p": settings.top_p, "seed": request_seed(settings.seed, row, turn)}
    return {"model": model, "messages": [wire_message(m) for m in history], "max_tokens": settings.max_new_tokens,
            "temperature": settings.temperature, "stream": False, **(sampling if settings.temperature > 0 else {}),
            **({"tools": tools} if tools else {}),
            **({"chat_template_kwargs": settings.template_kwargs} if settings.template_kwargs else {}), **extra_body}


def turn_event(chat: Chat, turn: int, answer: dict[str, Any], settings: GenerationSettings) -> dict[str, Any]:
    """``answer_event`` of a chat completion's first choice, naming the model that answered: reasoning from
    `reasoning_content` or `reasoning` (vLLM), tool-call arguments decoded where JSON."""
    choice, usage = answer["choices"][0], answer.get("usage") or {}
    message = choice["message"]
    if settings.max_prompt_tokens is not None and (usage.get("prompt_tokens") or 0) > settings.max_prompt_tokens:
        return {"row": chat.conv.row_index, "turn": turn, "cut": "prompt_too_long"}
    tool_calls = []
    for call in message.get("tool_calls") or []:
        function = dict(call.get("function") or {})
        with contextlib.suppress(KeyError, TypeError, json.JSONDecodeError):
            function["arguments"] = json.loads(function["arguments"])
        tool_calls.append({**({"id": call["id"]} if call.get("id") else {}), "type": call.get("type", "function"),
                           "function": function})
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    event = answer_event(chat, turn, settings, message.get("content") or "", choice.get("finish_reason") == "length",
                         usage.get("completion_tokens") or 0, reasoning, tool_calls)
    return {**event, "model": answer.get("model")} if "message" in event else event


class EndpointEngine:
    """The server at ``cfg.endpoint``, asked for the model ``cfg.model`` names."""

    def __init__(self, cfg: RegenConfig):
        self.cfg, url = cfg, cfg.endpoint.rstrip("/")
        self.client = client = ChatEndpoint(url, cfg.request_timeout, cfg.retries, cfg.retry_wait, cfg.api_key)
        listed = [m["id"] for m in client.with_retries("GET", "/models").get("data", [])
                  if isinstance(m, dict) and "id" in m]
        if cfg.model is None and len(listed) != 1:
            raise ValueError(f"{client.url}/models lists {listed or 'no model'}; choose one with --model")
        self.model = listed[0] if cfg.model is None else cfg.model
        if self.model not in listed:  # a one-token request: some servers list their cache, not what they serve
            try:
                client.chat({"model": self.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
            except RequestRejected as err:
                raise ValueError(f"{client.url} does not serve {self.model!r} (it lists {listed}; a test "
                                 f"request was answered with {err})") from err
        # the URL is not recorded: a restarted server can listen elsewhere
        self.record = {"engine": "endpoint", "target": {"served_model": self.model}, "extra_body": cfg.extra_body,
                       "generation": {k: v for k, v in asdict(cfg.generation).items() if k != "dtype"}}

    def metadata(self, stats: list[dict]) -> dict:
        served = sum((Counter(s.get("served_models", {})) for s in stats), Counter())
        return {"target_fingerprint": {"endpoint": self.client.url, "served_model": self.model,
                                       "answered_by": dict(served)},
                "endpoint": {"url": self.client.url, "concurrency": self.cfg.concurrency,
                             "request_timeout": self.cfg.request_timeout, "retries": self.cfg.retries}}

    def run_chat(self, part: Part, chat: Chat, lock: threading.Lock) -> None:
        """Ask the chat's turns in order, journaling each answer under the lock. A rejected request cuts
        the conversation (counted) or, with --on-bad-row error, stops the run."""
        cfg, client = self.cfg, self.client
        while chat.next_turn is not None and not client.stop.is_set():
            turn, row = chat.next_turn, chat.conv.row_index
            body = request_body(self.model, chat.messages[:turn], chat.conv.tools, cfg.generation, cfg.extra_body,
                                row, turn)
            try:
                event = turn_event(chat, turn, client.chat(body), cfg.generation)
            except RequestRejected as err:
                if cfg.on_bad_row == "error":
                    raise DataError("server_rejected", chat.conv.source, row, f"turn {turn}: {err}") from err
                log.warning("%s row %d turn %d: server rejected the request: %s", chat.conv.source, row, turn, err)
                event = {"row": row, "turn": turn, "cut": "server_rejected"}
            with lock:
                part.apply(chat, event, journal=True)

    def run(self, parts, finish, progress) -> None:
        """``concurrency`` chats in flight, the next part's queued behind this one's; a part finished with its chats."""
        lock, queued = threading.Lock(), []
        pool = ThreadPoolExecutor(max_workers=self.cfg.concurrency, thread_name_prefix="regenerate")

        def settle(part, futures) -> None:
            for future in as_completed(futures):
                future.result()  # a failed conversation stops the run here
                progress(part, futures[future])
            finish(part)

        try:
            for part in parts:
                queued.append((part, {pool.submit(self.run_chat, part, chat, lock): chat for chat in part.chats
                                      if chat.next_turn is not None}))
                if len(queued) == 2:
                    settle(*queued.pop(0))
            for part, futures in queued:
                settle(part, futures)
        except BaseException as err:
            self.client.stop.set()  # no new turn starts; answers of requests in flight are still journaled
            pool.shutdown(wait=not isinstance(err, KeyboardInterrupt), cancel_futures=True)
            raise
        pool.shutdown()
