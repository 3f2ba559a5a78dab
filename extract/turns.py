"""Where each assistant turn sits in a chat template's full rendering, for templates without
`{% generation %}` tags: history can render differently from a prompt (thinking templates, Mistral's
moved system prompt), so `probe_markers` learns the turn header and end-of-turn token once per template
from probe chats, and `locate_turns` walks the one full rendering, raising TurnNotFound, never guessing.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Plain lowercase ASCII words: templates trim, strip and split contents, never these.
_PROBE_USER = ("qzxprobeuserone", "qzxprobeusertwo")
_PROBE_ASSISTANT = ("qzxprobereplyone", "qzxprobereplytwo")
_PROBE_SYSTEM = "qzxprobesystem"
_PROBE_TOOL = ("qzxprobetool", "qzxprobetoolresult", "qzxcall01")  # name, result, call id (Mistral wants 9 chars)


class TemplateProbeFailed(ValueError):
    """The template's turn markers cannot be learned from its own renderings."""


class TurnNotFound(ValueError):
    """An assistant turn (or a message around it) is not where the walk expects it."""


@dataclass(frozen=True)
class TurnMarkers:
    """What a chat template writes around assistant turns."""

    header: str  # text that opens every assistant turn; "" where the reply follows the user turn directly (Mistral)
    user_close: str  # text the template writes right after a user message's content
    end_of_turn: str  # the token string that closes an assistant turn
    tool_close: str | None = None  # text after a tool result, learned only where there is no header (None: unknown)


RenderText = Callable[[list[dict[str, Any]], bool], str]  # (messages, add_generation_prompt) -> text


def probe_markers(render_text: RenderText, special_tokens_in: Callable[[str], list[str]],
                  end_of_turn: str | None = None) -> TurnMarkers:
    """Learn the turn markers from probe renderings; `special_tokens_in(text)` lists a text's special
    tokens in order, `end_of_turn` overrides the learned end-of-turn token."""
    (u1, u2), (a1, a2) = _PROBE_USER, _PROBE_ASSISTANT
    chat = [{"role": "user", "content": u1}, {"role": "assistant", "content": a1},
            {"role": "user", "content": u2}, {"role": "assistant", "content": a2}]
    for lead in ([], [{"role": "system", "content": _PROBE_SYSTEM}]):  # some templates require a system message
        try:
            full, prompt, with_generation = (render_text(lead + chat, False), render_text(lead + chat[:1], False),
                                             render_text(lead + chat[:1], True))
            break
        except Exception as exc:  # noqa: BLE001 - jinja errors, raise_exception(), ...
            refusal = exc
    else:
        raise TemplateProbeFailed(
            f"the template rejected the probe chats (user/assistant, with and without a system message first): "
            f"{type(refusal).__name__}: {refusal}") from refusal

    if not with_generation.startswith(prompt):
        raise TemplateProbeFailed("the template's generation prompt does not extend the rendered prompt")
    if u1 not in prompt:
        raise TemplateProbeFailed("the template does not render a user message's content verbatim")
    user_close = prompt[prompt.index(u1) + len(u1):]
    walk = re.search(f"{u1}(.*?){a1}(.*?){u2}(.*?){a2}", full, re.DOTALL)  # each content's first place in order
    if walk is None:
        raise TemplateProbeFailed("the template does not render user and assistant contents verbatim and in order")
    openings, after_reply = (walk[1], walk[3]), walk[2]
    if not all(opening.startswith(user_close) for opening in openings):
        raise TemplateProbeFailed(
            f"the template writes {user_close!r} after a final user message but not before the assistant reply")
    header = os.path.commonprefix([with_generation[len(prompt):]] + [o[len(user_close):] for o in openings])
    if end_of_turn is None:
        found = special_tokens_in(after_reply)
        if not found:
            raise TemplateProbeFailed(
                f"the template writes no special token after an assistant message ({after_reply!r}); pass end_of_turn")
        end_of_turn = found[0]
        if end_of_turn not in full[walk.end():]:
            raise TemplateProbeFailed(f"the template does not close its last assistant turn with {end_of_turn!r}")
    tool_close = None if header else _probe_tool_close(render_text, lead + chat[:1], a2)
    return TurnMarkers(header=header, user_close=user_close, end_of_turn=end_of_turn, tool_close=tool_close)


def _probe_tool_close(render_text: RenderText, opening: list[dict[str, Any]], reply: str) -> str | None:
    """What a headerless template writes after a tool result (None: it refuses tools or writes more)."""
    name, result, call_id = _PROBE_TOOL
    chat = opening + [{"role": "assistant", "content": "", "tool_calls": [
                          {"id": call_id, "type": "function", "function": {"name": name, "arguments": {}}}]},
                      {"role": "tool", "tool_call_id": call_id, "name": name, "content": result}]
    try:
        prompt, full = render_text(chat, False), render_text(chat + [{"role": "assistant", "content": reply}], False)
    except Exception:  # noqa: BLE001 - a template without tool support
        return None
    if prompt.count(result) != 1 or not full.startswith(prompt) or reply not in full[len(prompt):]:
        return None
    return prompt[prompt.index(result) + len(result):] or None


def locate_turns(rendered: str, messages: list[dict[str, Any]], markers: TurnMarkers) -> list[tuple[int, int]]:
    """Char spans [start, end) of the assistant turns in `rendered`, each from the end of its header
    through its end-of-turn token; user and tool texts are checked in order on the way."""
    spans, cursor, previous_role = [], 0, None
    for index, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            start = _turn_start(rendered, cursor, previous_role, markers, index)
            eot_at = rendered.find(markers.end_of_turn, start)
            if eot_at < 0:
                raise TurnNotFound(f"no end-of-turn {markers.end_of_turn!r} after assistant message {index}")
            cursor = eot_at + len(markers.end_of_turn)
            spans.append((start, cursor))
        elif role in ("user", "tool"):  # system messages are not checked: templates move (Mistral) or drop them
            content = message.get("content")
            parts = [{"text": content}] if isinstance(content, str) else content if isinstance(content, list) else []
            texts = [p["text"].strip() for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
            for text in filter(None, texts):  # trimmed, as templates often trim
                found = _find_rendered(rendered, text, cursor)
                if found is None:
                    raise TurnNotFound(
                        f"{role} message {index}'s content ({text[:40]!r}) is not rendered after char {cursor} "
                        "(the template changes it, or an earlier turn was not closed where expected)")
                cursor = found
        previous_role = role
    return spans


def _turn_start(rendered: str, cursor: int, previous_role: str | None, markers: TurnMarkers, index: int) -> int:
    if markers.header:
        at = rendered.find(markers.header, cursor)
        if at < 0:
            raise TurnNotFound(f"no assistant header {markers.header!r} for assistant message {index}")
        return at + len(markers.header)
    close = {"user": markers.user_close, "tool": markers.tool_close}.get(previous_role)  # no header: after the close
    if close:
        at = rendered.find(close, cursor)
        if at < 0:
            raise TurnNotFound(f"no {close!r} closing the {previous_role} turn before assistant message {index}")
        return at + len(close)
    if previous_role == "assistant":
        return cursor
    after = f"a {previous_role} message" if previous_role else "the start of the chat"
    raise TurnNotFound(f"the template writes no assistant header and nothing known after {after}, "
                       f"so assistant message {index} cannot be placed")


def _find_rendered(rendered: str, text: str, cursor: int) -> int | None:
    """End of `text` in `rendered` after `cursor`, as written or JSON-escaped (`tojson`)."""
    for form in (text, json.dumps(text, ensure_ascii=False)[1:-1], json.dumps(text)[1:-1]):
        at = rendered.find(form, cursor)
        if at >= 0:
            return at + len(form)
    return None
