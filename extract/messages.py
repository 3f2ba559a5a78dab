"""Messages of one chat row, kept exactly as a chat template reads them (only JSON-string tool-call arguments and
`tools` decoded); a bad shape goes through `fail(reason, problem)`, which the caller makes an error naming the row."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .regenerate import Chat, GenerationSettings

Fail = Callable[[str, str], Exception]

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
                  "tool": "tool", "function": "tool", "observation": "tool"}


def chat_messages(raw: Any, column: str, fail: Fail) -> list[dict[str, Any]]:
    """The messages of one chat; role/content or ShareGPT from/value, decided by the first message."""
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
