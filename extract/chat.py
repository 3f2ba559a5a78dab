"""A Conversation's token ids (exactly ``apply_chat_template``) and assistant loss mask: each assistant turn from the
end of its header through its end-of-turn token, by ``{% generation %}`` tags or by turn markers probed per template."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .data import Conversation, DataError, SkippedSample

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
RESERVED_TEMPLATE_KWARGS = frozenset({  # arguments of apply_chat_template itself
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})
# tokenizer -> {(template, template kwargs, end_of_turn override): TurnMarkers, or why the probe failed}
_MARKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Plain lowercase ASCII words: templates trim, strip and split contents, never these.
_PROBE_USER = ("qzxprobeuserone", "qzxprobeusertwo")
_PROBE_ASSISTANT = ("qzxprobereplyone", "qzxprobereplytwo")
_PROBE_SYSTEM = "qzxprobesystem"
_PROBE_TOOL = ("qzxprobetool", "qzxprobetoolresult", "qzxcall01")  # name, result, call id (Mistral wants 9 chars)


def check_template_kwargs(template_kwargs: dict) -> None:
    """Raise ValueError where ``--template-kwargs`` sets an argument of apply_chat_template, which every command
    sets itself (passed twice, the template call fails on every row)."""
    if reserved := sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs)):
        raise ValueError(f"--template-kwargs cannot set {reserved}: each command sets those arguments of "
                         "apply_chat_template itself")


class TurnNotFound(ValueError):
    """The template's turn markers cannot be learned from its own renderings, or an assistant turn (or a message
    around it) is not where the walk expects it."""


@dataclass(frozen=True)
class TurnMarkers:
    """What a chat template writes around assistant turns."""

    header: str  # text that opens every assistant turn; "" where the reply follows the user turn directly (Mistral)
    user_close: str  # text the template writes right after a user message's content
    end_of_turn: str  # the token string that closes an assistant turn
    tool_close: str | None = None  # text after a tool result, learned only where there is no header (None: unknown)


@dataclass(frozen=True)
class RenderedSample:
    """Unpacks as `(input_ids, loss_mask)`; `num_tokens` is the length before truncation."""

    input_ids: np.ndarray  # (T,) int32
    loss_mask: np.ndarray  # (T,) bool
    num_tokens: int

    def __iter__(self):
        return iter((self.input_ids, self.loss_mask))

    @property
    def truncated(self) -> bool:
        return self.num_tokens > len(self.input_ids)


def mask_method(tokenizer, tools: list[dict[str, Any]] | None = None) -> str:
    """The mask method "auto" picks: "generation_tags" where the template (for `tools`) tags assistant turns."""
    return "generation_tags" if _GENERATION_TAG.search(tokenizer.get_chat_template(tools=tools)) else "template_probe"


def turn_markers(tokenizer, end_of_turn: str | None = None, template_kwargs: dict[str, Any] | None = None,
                 tools: list[dict[str, Any]] | None = None) -> TurnMarkers:
    """The template's assistant header and end-of-turn token, learned from its own renderings once
    per tokenizer, template, arguments and override; TurnNotFound (a ValueError) otherwise."""
    kwargs = dict(template_kwargs or {})
    template = tokenizer.get_chat_template(tools=tools)
    key = (template, json.dumps(kwargs, sort_keys=True, default=str), end_of_turn)
    cached = _MARKERS.setdefault(tokenizer, {})
    if key not in cached:
        def render_text(messages, add_generation_prompt):
            return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **kwargs)

        try:
            cached[key] = _probe_markers(render_text, tokenizer, end_of_turn)
        except TurnNotFound as exc:
            cached[key] = str(exc)  # raised anew for every row, so no traceback piles up
    if isinstance(cached[key], str):
        raise TurnNotFound(cached[key])
    return cached[key]


def end_of_turn_id(tokenizer, end_of_turn: str | None = None, template_kwargs: dict[str, Any] | None = None) -> int:
    """Token id ending an assistant turn (`end_of_turn`, else the template's); ValueError if not in the vocabulary."""
    if end_of_turn is None:
        end_of_turn = turn_markers(tokenizer, template_kwargs=template_kwargs).end_of_turn
    return _token_id(tokenizer, end_of_turn)


def stop_token_ids(model, tokenizer, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Where generation stops: the generation config's and tokenizer's eos, the end-of-turn token."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = {*([eos] if isinstance(eos, int) else eos or []), tokenizer.eos_token_id}
    with contextlib.suppress(ValueError):
        ids.add(end_of_turn_id(tokenizer, template_kwargs=template_kwargs))
    return sorted(int(i) for i in ids if i is not None)


def render(tokenizer, conv: Conversation, *, max_length: int, truncation: str = "right",
           method: Literal["auto", "generation_tags", "template_probe"] = "auto", end_of_turn: str | None = None,
           template_kwargs: dict[str, Any] | None = None) -> RenderedSample:
    """Token ids (int32) and assistant loss mask (bool) of one conversation; over `max_length`, truncation
    "right" cuts, "error" raises DataError("too_long"), "skip" SkippedSample. DataError names a bad row."""
    r = rendering(tokenizer, conv, method=method, end_of_turn=end_of_turn, template_kwargs=template_kwargs)
    return to_sample(r, *encode(tokenizer, [r])[0], max_length=max_length, truncation=truncation)


@dataclass
class Rendering:
    """A conversation as text, and what masks its tokens: ``render`` is ``rendering``, ``encode``, ``to_sample``."""

    conv: Conversation
    text: str
    spans: list | None = None  # the assistant turns' char spans; None: a text row, every token trained on
    end_of_turn: int | None = None  # the token that closes each span, where the template's markers are known


def rendering(tokenizer, conv: Conversation, *, method: str = "auto", end_of_turn: str | None = None,
              template_kwargs: dict[str, Any] | None = None) -> Rendering:
    """``conv`` as its chat template renders it, with its assistant spans; DataError names a row that fails."""
    if conv.kind == "text":
        return Rendering(conv, conv.text)
    if method == "auto":
        method = mask_method(tokenizer, conv.tools)
    kwargs = dict(template_kwargs or {})
    try:
        markers = turn_markers(tokenizer, end_of_turn, kwargs, conv.tools)
    except TurnNotFound as exc:
        if method != "generation_tags":
            raise DataError("mask_not_located", conv.source, conv.row_index,
                            f"cannot learn the chat template's assistant turns: {exc}") from exc
        markers = None  # the tags alone say where the turns are
    text, spans = _rendering(tokenizer, conv, kwargs, tags=method == "generation_tags")
    if spans is None:
        try:
            spans = locate_turns(text, conv.messages, markers)
        except TurnNotFound as exc:
            raise DataError("mask_not_located", conv.source, conv.row_index, str(exc)) from exc
    return Rendering(conv, text, spans, None if markers is None else _token_id(tokenizer, markers.end_of_turn))


def encode(tokenizer, renderings: list[Rendering]) -> list[tuple[list[int], list | None]]:
    """Each rendering's token ids and char offsets, in one call per kind: the tokenizer spreads a batch over the
    cores (4.8x on 16 cores against one call a row, BENCHMARKS_LOG.md). Text rows take its special tokens (a BOS)."""
    out: list = [None] * len(renderings)
    for text_rows in (False, True):
        picked = [i for i, r in enumerate(renderings) if (r.spans is None) == text_rows]
        if picked:
            enc = tokenizer([renderings[i].text for i in picked], add_special_tokens=text_rows,
                            return_offsets_mapping=not text_rows)
            for i, ids, offsets in zip(picked, enc["input_ids"], enc.get("offset_mapping") or [None] * len(picked)):
                out[i] = ids, offsets
    return out


def to_sample(r: Rendering, ids: list[int], offsets: list | None, *, max_length: int,
              truncation: str = "right") -> RenderedSample:
    """A rendering's encoded ids and their loss mask, as ``render`` returns them."""
    conv, mask = r.conv, np.ones(len(ids), dtype=bool)
    if r.spans is not None:
        mask = _overlap_mask(offsets, r.spans)
        if r.end_of_turn is not None:
            mask = _close_spans_at_end_of_turn(ids, mask, r.end_of_turn)
    num_tokens = len(ids)
    if num_tokens > max_length and truncation != "right":
        error_class = SkippedSample if truncation == "skip" else DataError
        raise error_class("too_long", conv.source, conv.row_index, f"{num_tokens} tokens > max_length {max_length}")
    input_ids, loss_mask = np.asarray(ids[:max_length], dtype=np.int32), np.asarray(mask[:max_length], dtype=bool)
    if not loss_mask.any():
        error_class = SkippedSample if num_tokens > max_length else DataError
        raise error_class("no_loss_tokens", conv.source, conv.row_index,
                          f"no assistant token in the first {len(input_ids)} of {num_tokens} tokens")
    return RenderedSample(input_ids, loss_mask, num_tokens)


def _token_id(tokenizer, token: str) -> int:
    """The id of the end-of-turn ``token``, which must be one entry of the vocabulary; ValueError otherwise."""
    token_id = tokenizer.convert_tokens_to_ids(token)  # not get_vocab(): that copies 150k entries
    if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
        pieces = tokenizer.tokenize(token)
        raise ValueError(f"--end-of-turn {token!r} is not a token of the vocabulary of "
                         f"{tokenizer.name_or_path} (its text tokenizes as {len(pieces)} tokens: {pieces})")
    return int(token_id)


def load_tokenizer(cfg):
    """An ExtractConfig's tokenizer, ``--chat-template`` applied once it compiles and ``--end-of-turn`` checked: the
    one way stage one loads it, so the stored ids match the fingerprint. ValueError naming the cause."""
    from transformers import AutoTokenizer

    if cfg.chat_template:
        from transformers.utils.chat_template_utils import _compile_jinja_template  # HF's own Jinja environment

        where = f"--chat-template {cfg.chat_template}"
        try:
            template = Path(cfg.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{where}: cannot read it: {e}") from None
        if not template.strip():
            raise ValueError(f"{where}: the file is empty")
        try:
            _compile_jinja_template(template)
        except Exception as e:  # noqa: BLE001 - jinja2's TemplateSyntaxError and friends
            raise ValueError(f"{where}: not a valid Jinja template: {type(e).__name__}: {e}") from None
    name = cfg.tokenizer or cfg.model
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, revision=cfg.revision)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer {name!r}: {e}") from e
    if cfg.chat_template:
        tokenizer.chat_template = template
    if cfg.end_of_turn is not None:
        _token_id(tokenizer, cfg.end_of_turn)
    return tokenizer


def special_tokens_in(tokenizer, text: str) -> list[str]:
    """The added (special) tokens the tokenizer finds in `text`, in order."""
    added = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.convert_ids_to_tokens([i for i in ids if i in added])


def _rendering(tokenizer, conv: Conversation, kwargs: dict, tags: bool) -> tuple[str, list | None]:
    """The conversation as its template renders it and, with ``tags``, the char spans of its `{% generation %}`
    blocks (mapped to tokens here: HF's own mapping changed between transformers versions)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        if not tags:
            rendered = tokenizer.apply_chat_template(conv.messages, tools=conv.tools, tokenize=False,
                                                     add_generation_prompt=False, **kwargs)
        else:
            rendered, spans = render_jinja_template(
                conversations=[conv.messages], tools=conv.tools, return_assistant_tokens_mask=True,
                chat_template=tokenizer.get_chat_template(tools=conv.tools), add_generation_prompt=False,
                **{**tokenizer.special_tokens_map, **kwargs})
    except Exception as exc:  # noqa: BLE001 - jinja errors, raise_exception(), ...
        raise DataError("template_rejected", conv.source, conv.row_index,
                        f"chat template rejected the conversation: {type(exc).__name__}: {exc}") from exc
    return (rendered[0], spans[0]) if tags else (rendered, None)


def _overlap_mask(offsets: list[tuple[int, int]], spans) -> np.ndarray:
    """True for every token whose chars [start, end) overlap a non-empty char span [start, end)."""
    flat = np.fromiter(itertools.chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets))
    starts, ends = flat.reshape(-1, 2).T  # fromiter: half np.asarray's time on a list of pairs
    mask = np.zeros(len(starts), dtype=bool)
    for start, end in spans:
        if end > start:
            mask |= (starts < end) & (ends > start)
    return mask


def _close_spans_at_end_of_turn(ids, mask, eot: int) -> np.ndarray:
    """Each run of masked tokens ends with (and includes) its first end-of-turn token, in it or right after it."""
    ids, mask = np.asarray(ids), np.asarray(mask, dtype=bool)
    edges = np.diff(np.concatenate(([False], mask, [False])).astype(np.int8))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)  # runs [start, end)
    eots = np.flatnonzero(ids == eot)
    first = np.append(eots, len(ids) + 1)[np.searchsorted(eots, starts)]  # each run's first end of turn
    stops = np.where(first <= ends, first + 1, ends)
    counts = np.zeros(len(ids) + 1, dtype=np.int64)  # +1 where a kept span starts, -1 where it stops
    counts[starts] += 1
    counts[stops] -= 1
    return np.cumsum(counts[:-1]) > 0


def _probe_markers(render_text, tokenizer, end_of_turn: str | None) -> TurnMarkers:
    """The turn markers learned from probe chats rendered by `render_text(messages, add_generation_prompt)`;
    `end_of_turn` overrides the learned end-of-turn token."""
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
        raise TurnNotFound(
            f"the template rejected the probe chats (user/assistant, with and without a system message first): "
            f"{type(refusal).__name__}: {refusal}") from refusal

    if not with_generation.startswith(prompt):
        raise TurnNotFound("the template's generation prompt does not extend the rendered prompt")
    if u1 not in prompt:
        raise TurnNotFound("the template does not render a user message's content verbatim")
    user_close = prompt[prompt.index(u1) + len(u1):]
    walk = re.search(f"{u1}(.*?){a1}(.*?){u2}(.*?){a2}", full, re.DOTALL)  # each content's first place in order
    if walk is None:
        raise TurnNotFound("the template does not render user and assistant contents verbatim and in order")
    openings, after_reply = (walk[1], walk[3]), walk[2]
    if not all(opening.startswith(user_close) for opening in openings):
        raise TurnNotFound(
            f"the template writes {user_close!r} after a final user message but not before the assistant reply")
    header = os.path.commonprefix([with_generation[len(prompt):]] + [o[len(user_close):] for o in openings])
    if end_of_turn is None:
        found = special_tokens_in(tokenizer, after_reply)
        if not found:
            raise TurnNotFound(
                f"the template writes no special token after an assistant message ({after_reply!r}); pass end_of_turn")
        end_of_turn = found[0]
        if end_of_turn not in full[walk.end():]:
            raise TurnNotFound(f"the template does not close its last assistant turn with {end_of_turn!r}")
    tool_close = None if header else _probe_tool_close(render_text, lead + chat[:1], a2)
    return TurnMarkers(header=header, user_close=user_close, end_of_turn=end_of_turn, tool_close=tool_close)


def _probe_tool_close(render_text, opening: list[dict[str, Any]], reply: str) -> str | None:
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
                forms = (text, json.dumps(text, ensure_ascii=False)[1:-1], json.dumps(text)[1:-1])  # or by `tojson`
                found = next((at + len(form) for form in forms if (at := rendered.find(form, cursor)) >= 0), None)
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
