"""A client for an OpenAI-compatible chat-completions server, on the standard library so
regeneration needs no HTTP package. Connection errors, timeouts, 429 and 5xx are retried with
exponential backoff; when retries run out the server counts as down (`EndpointDown`), unless it
still answers `GET /models`: then, as for a 4xx, only this request fails (`RequestRejected`).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

RETRY_STATUS = {408, 429}  # plus every 5xx


class EndpointDown(RuntimeError):
    """The server cannot be reached (or keeps failing) after every retry."""


class RequestRejected(RuntimeError):
    """The server answered this one request with an error while staying up."""

    def __init__(self, status: int, detail: str):
        self.status, self.detail = status, detail
        super().__init__(f"HTTP {status}: {detail}")


@dataclass
class EndpointConfig:
    """Where the server is and how hard to try (each field's meaning: its flag's help in extract/regenerate_cli.py;
    ``url`` is --endpoint)."""

    url: str
    api_key: str | None = None
    request_timeout: float = 600.0
    retries: int = 6
    retry_wait: float = 1.0  # first backoff in seconds; doubles per retry, capped at 30 s (no flag)


@dataclass
class Reply:
    """One chat completion, reduced to what regeneration keeps (None: not returned)."""

    content: str  # "" when the server gave none
    reasoning: str | None  # message.reasoning_content or message.reasoning
    tool_calls: list[dict[str, Any]] | None  # as the server returned them
    finish_reason: str | None  # "stop", "length", "tool_calls", ...
    model: str | None  # the model name the server answered with
    prompt_tokens: int | None
    completion_tokens: int | None


@dataclass
class ChatEndpoint:
    """Thread-safe: one instance serves every worker thread (each request opens its own connection)."""

    config: EndpointConfig
    stop: threading.Event = field(default_factory=threading.Event)  # set to end retries early

    @property
    def base(self) -> str:
        return self.config.url.rstrip("/")

    def models(self) -> list[str]:
        """Model ids the server lists under /models."""
        answer = self._with_retries("GET", "/models", None, probe=False)
        return [m["id"] for m in answer.get("data", []) if isinstance(m, dict) and "id" in m]

    def chat(self, body: dict[str, Any]) -> Reply:
        """POST /chat/completions (non-streaming) and parse the first choice."""
        return parse_reply(self._with_retries("POST", "/chat/completions", body, probe=True), self.base)

    def _with_retries(self, method: str, path: str, body: dict | None, *, probe: bool) -> dict:
        cfg, url, failures, last_status, started = self.config, self.base + path, [], None, time.monotonic()
        for attempt in range(cfg.retries + 1):
            if attempt and self.stop.wait(min(30.0, cfg.retry_wait * 2 ** (attempt - 1))):
                break
            try:
                return self._request(method, url, body)
            except urllib.error.HTTPError as err:
                try:
                    detail = (err.read().decode("utf-8", "replace") or str(err.reason)).strip()[:500]
                except Exception:  # noqa: BLE001
                    detail = str(err.reason)
                if err.code not in RETRY_STATUS and err.code < 500:
                    raise RequestRejected(err.code, f"{method} {url}: {detail}") from err
                failures.append(f"HTTP {err.code} ({detail})")
                last_status = err.code
            except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError, OSError) as err:
                reason = getattr(err, "reason", None) or err
                failures.append(f"{type(reason).__name__}: {reason}")
                last_status = None
        if probe and last_status is not None and self._answers_models():
            raise RequestRejected(last_status, f"{method} {url}: {failures[-1]} (the server is up; "
                                               "this request keeps failing)")
        raise EndpointDown(
            f"{method} {url} failed {len(failures)} time(s) over {time.monotonic() - started:.0f} s "
            f"(last: {failures[-1] if failures else 'stopped'}); is the server at {self.base} running? "
            "Rerun the same command once it is: finished turns are kept.")

    def _answers_models(self) -> bool:
        try:
            self._request("GET", self.base + "/models", None)
            return True
        except Exception:  # noqa: BLE001 - any failure means "not answering"
            return False

    def _request(self, method: str, url: str, body: dict | None) -> dict:
        data = None if body is None else json.dumps(body, ensure_ascii=False).encode("utf-8")
        headers = {"Accept": "application/json", **({"Content-Type": "application/json"} if data else {})}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        with urllib.request.urlopen(request, timeout=self.config.request_timeout) as response:
            payload = response.read()
        try:
            return json.loads(payload)
        except json.JSONDecodeError as err:
            raise http.client.HTTPException(f"not JSON: {payload[:200]!r}") from err


def parse_reply(answer: dict[str, Any], base: str = "") -> Reply:
    """The first choice of a chat-completion answer; reasoning is read from
    `reasoning_content` (vLLM before 0.10, SGLang, transformers) or `reasoning` (vLLM now)."""
    try:
        choice, message = answer["choices"][0], answer["choices"][0]["message"]
    except (KeyError, IndexError, TypeError) as err:
        raise RequestRejected(200, f"{base}: answer without choices[0].message: {str(answer)[:300]}") from err
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    usage = answer.get("usage") or {}
    return Reply(content=message.get("content") or "", reasoning=reasoning or None,
                 tool_calls=message.get("tool_calls") or None, finish_reason=choice.get("finish_reason"),
                 model=answer.get("model"), prompt_tokens=usage.get("prompt_tokens"),
                 completion_tokens=usage.get("completion_tokens"))
