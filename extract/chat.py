"""Render a Conversation to token ids plus the assistant loss mask.

What the mask covers: every token of every assistant turn's rendered content, plus the
end-of-turn token that closes the turn (the drafter must learn to stop). Role headers,
system/user/tool turns, and the separator after end-of-turn are 0. Anything the
template itself writes inside an assistant turn after its header (e.g. Qwen3's empty
`<think>\\n\\n</think>\\n\\n`) counts as assistant, since the target emits it too.

Two ways to find those tokens, giving the same mask for the same template:
  * "generation_tags": templates with `{% generation %}` blocks; HF's Jinja renderer
    gives each block's char span, and every token overlapping a span is marked.
  * "prefix_diff": templates without tags (Qwen3's real one). For assistant message i,
    render messages[:i] with add_generation_prompt=True; that string must be a prefix
    of the full rendering (checked, else DataError "mask_fallback_failed"). The turn
    starts at the end of that prefix and ends at the first end-of-turn token after it.
    Characters map to tokens by the same overlap rule, so a BPE merge across the
    header/content boundary does not break the row and both methods agree on it.
In both, each span is then cut after its first end-of-turn token, or extended by one
token when the token right after it is end-of-turn, so where a template puts
`{% endgeneration %}` relative to <|im_end|> does not change the mask.

Plain text rows are tokenized as is (with the tokenizer's own special tokens, e.g.
BOS) and trained on in full: the mask is all ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from .data import Conversation, DataError, SkippedSample

Truncation = Literal["right", "error", "skip"]
MaskMethod = Literal["auto", "generation_tags", "prefix_diff"]

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


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


def has_generation_tags(tokenizer) -> bool:
    return bool(_GENERATION_TAG.search(tokenizer.get_chat_template()))


def end_of_turn_id(tokenizer, end_of_turn: str | None = None) -> int:
    """Token id that ends an assistant turn: `end_of_turn` if given, else <|im_end|>
    when the vocab has it (ChatML, Qwen), else the tokenizer's eos token."""
    candidates = [end_of_turn] if end_of_turn else ["<|im_end|>", tokenizer.eos_token]
    for token in candidates:
        if token is None:
            continue
        token_id = tokenizer.convert_tokens_to_ids(token)  # not get_vocab(): that copies 150k entries
        if token_id is not None and (token_id != tokenizer.unk_token_id or token == tokenizer.unk_token):
            return token_id
    raise ValueError(f"end-of-turn token not in the vocabulary (tried {candidates})")


def stop_token_ids(model, tokenizer) -> list[int]:
    """Where generation stops: the generation config's eos ids, the tokenizer's eos and
    the end-of-turn token."""
    ids: set[int] = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    try:
        ids.add(end_of_turn_id(tokenizer))
    except ValueError:
        pass
    return sorted(int(i) for i in ids)


def render(
    tokenizer,
    conv: Conversation,
    *,
    max_length: int,
    truncation: Truncation = "right",
    method: MaskMethod = "auto",
    end_of_turn: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> RenderedSample:
    """Token ids (int32) and assistant loss mask (bool) of one conversation.

    truncation: "right" keeps the first `max_length` tokens; "error" raises
    DataError("too_long"); "skip" raises SkippedSample("too_long"), which the bad-row
    policy always counts. A sample left with no loss token after right truncation is a
    SkippedSample("no_loss_tokens"). `template_kwargs` go to the chat template (e.g.
    enable_thinking=False). A template that raises gives DataError("template_rejected").
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if truncation not in ("right", "error", "skip"):
        raise ValueError(f"truncation must be 'right', 'error' or 'skip', not {truncation!r}")

    if conv.kind == "text":
        ids = _flat_ids(tokenizer(conv.text)["input_ids"])
        mask = [1] * len(ids)
    else:
        if method == "auto":
            method = "generation_tags" if has_generation_tags(tokenizer) else "prefix_diff"
        eot = end_of_turn_id(tokenizer, end_of_turn)
        kwargs = dict(template_kwargs or {})
        if method == "generation_tags":
            ids, mask = _mask_from_generation_tags(tokenizer, conv, kwargs)
        elif method == "prefix_diff":
            ids, mask = _mask_from_prefix_diff(tokenizer, conv, eot, kwargs)
        else:
            raise ValueError(f"unknown mask method {method!r}")
        mask = _close_spans_at_end_of_turn(ids, mask, eot)

    input_ids = np.asarray(ids, dtype=np.int32)
    loss_mask = np.asarray(mask, dtype=bool)
    num_tokens = len(input_ids)
    if num_tokens > max_length:
        if truncation != "right":
            error_class = SkippedSample if truncation == "skip" else DataError
            raise error_class("too_long", conv.source, conv.row_index, f"{num_tokens} tokens > max_length {max_length}")
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    if not loss_mask.any():
        error_class = SkippedSample if num_tokens > max_length else DataError
        raise error_class(
            "no_loss_tokens",
            conv.source,
            conv.row_index,
            f"no assistant token in the first {len(input_ids)} of {num_tokens} tokens",
        )
    return RenderedSample(input_ids, loss_mask, num_tokens)


# ---------------------------------------------------------------------------------


def _apply_template(tokenizer, conv: Conversation, messages, what: str, **kwargs):
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as exc:  # noqa: BLE001 - jinja errors, raise_exception(), ...
        raise DataError(
            "template_rejected", conv.source, conv.row_index, f"chat template rejected {what}: {type(exc).__name__}: {exc}"
        ) from exc


def _render_text(tokenizer, conv: Conversation, messages, what: str, kwargs: dict, **extra) -> str:
    text = _apply_template(tokenizer, conv, messages, what, tokenize=False, **extra, **kwargs)
    if isinstance(text, list):  # some versions wrap single renderings
        (text,) = text
    return text


def _flat_ids(ids) -> list[int]:
    """input_ids as a flat list, whatever container this transformers version returns."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        (ids,) = ids
    return [int(i) for i in ids]


def _mask_from_generation_tags(tokenizer, conv: Conversation, kwargs: dict) -> tuple[list[int], list[int]]:
    """Char spans of the `{% generation %}` blocks from HF's own Jinja renderer, mapped
    to tokens here. Not `apply_chat_template(return_assistant_tokens_mask=True)`: its
    char-to-token mapping changed between 5.17 (char_to_token on the span ends, which
    drops or over-extends spans at some boundaries) and 5.24 (overlap), so the mask
    would depend on the installed version."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, spans = render_jinja_template(
            conversations=[conv.messages],
            chat_template=tokenizer.get_chat_template(),
            return_assistant_tokens_mask=True,
            add_generation_prompt=False,
            **{**tokenizer.special_tokens_map, **kwargs},
        )
    except Exception as exc:  # noqa: BLE001 - jinja errors, raise_exception(), ...
        raise DataError(
            "template_rejected", conv.source, conv.row_index, f"chat template rejected the conversation: {type(exc).__name__}: {exc}"
        ) from exc
    ids, offsets = _tokenize_with_offsets(tokenizer, rendered[0])
    return ids, _overlap_mask(offsets, spans[0])


def _tokenize_with_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    if hasattr(offsets, "tolist"):
        offsets = offsets.tolist()
    return _flat_ids(enc["input_ids"]), [(int(a), int(b)) for a, b in offsets]


def _overlap_mask(offsets: list[tuple[int, int]], spans) -> list[int]:
    """1 for every token overlapping a char span [start, end) (spans and tokens sorted)."""
    mask = [0] * len(offsets)
    span_idx = 0
    spans = [(int(a), int(b)) for a, b in spans if b > a]
    for t, (tok_start, tok_end) in enumerate(offsets):
        while span_idx < len(spans) and tok_start >= spans[span_idx][1]:
            span_idx += 1
        if span_idx == len(spans):
            break
        if tok_end > spans[span_idx][0]:
            mask[t] = 1
    return mask


def _mask_from_prefix_diff(tokenizer, conv: Conversation, eot: int, kwargs: dict) -> tuple[list[int], list[int]]:
    messages = conv.messages

    def fail(problem: str) -> DataError:
        return DataError("mask_fallback_failed", conv.source, conv.row_index, problem)

    full = _render_text(tokenizer, conv, messages, "the conversation", kwargs, add_generation_prompt=False)
    ids, offsets = _tokenize_with_offsets(tokenizer, full)
    token_ends = [end for _start, end in offsets]
    mask = [0] * len(ids)

    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise fail("message 0 is an assistant turn: a template without generation tags cannot locate it")
        prompt = _render_text(
            tokenizer, conv, messages[:i], f"messages[:{i}]", kwargs, add_generation_prompt=True
        )
        if not full.startswith(prompt):
            common = _common_prefix_length(prompt, full)
            raise fail(
                f"the rendering of messages[:{i}] + generation prompt is not a prefix of the full rendering "
                f"(differs at char {common}: {prompt[common:common + 30]!r} vs {full[common:common + 30]!r}); "
                "the template renders this turn differently as history than as a prompt; "
                "use a template with generation tags"
            )
        start = next((t for t, end in enumerate(token_ends) if end > len(prompt)), len(ids))
        stop = next((t for t in range(start, len(ids)) if ids[t] == eot), None)
        if stop is None:
            token = tokenizer.convert_ids_to_tokens(eot)
            raise fail(f"no end-of-turn token {token!r} after assistant message {i}; pass end_of_turn=")
        mask[start : stop + 1] = [1] * (stop + 1 - start)
    return ids, mask


def _common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def _close_spans_at_end_of_turn(ids: list[int], mask: list[int], eot: int) -> list[int]:
    """Each run of 1s ends with (and includes) its first end-of-turn token."""
    out = list(mask)
    t, n = 0, len(ids)
    while t < n:
        if not out[t]:
            t += 1
            continue
        end = t
        while end < n and out[end]:
            end += 1
        # run is [t, end)
        eot_in_run = next((k for k in range(t, end) if ids[k] == eot), None)
        if eot_in_run is not None:
            out[eot_in_run + 1 : end] = [0] * (end - eot_in_run - 1)
        elif end < n and ids[end] == eot:
            out[end] = 1
            end += 1
        t = end
    return out
