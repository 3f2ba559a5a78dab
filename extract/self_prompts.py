"""Magpie-style self-prompting (``dflash-regenerate --self-prompts N``): the target writes the user turn
itself, continuing the template's user header until a stop token or the end of a user turn, then answers it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .chat import as_text, special_tokens_in
from .data import Conversation

SENTINEL = "dflashSelfPromptSentinel7f3a"
SOURCE = "self_prompt"  # the `source` of a self-prompted chat (errors and skip counts name it)


def user_header(tokenizer, template_kwargs: dict[str, Any] | None = None) -> tuple[str, str | None]:
    """The text a first user turn starts with (default system prompt included) and the first special
    token after the user's text (the end of a user turn: `<|im_end|>`, `<|eot_id|>`, `[/INST]`), if any."""
    text = as_text(tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                                  add_generation_prompt=False, **(template_kwargs or {})))
    if text.count(SENTINEL) != 1:
        raise ValueError(f"the chat template does not write a user message's text once and unchanged (found "
                         f"{text.count(SENTINEL)} times in {text!r}): --self-prompts cannot find its user header")
    header, after = text.split(SENTINEL)
    if not header:
        raise ValueError("the chat template writes nothing before a user message: --self-prompts has no header to "
                         "continue")
    return header, next(iter(special_tokens_in(tokenizer, after)), None)


@dataclass
class QuestionSampler:
    """Samples questions after ``header`` through ``generate`` (prompt ids -> [(tokens, truncated)]);
    ``seen``: the dedup keys of every question kept in the run."""

    generate: Callable[[list[list[int]]], list[tuple[list[int], bool]]]
    tokenizer: Any
    header: str
    min_chars: int  # shorter questions (whitespace collapsed) are dropped
    batch_size: int
    seen: set[str] = field(default_factory=set)

    def chats(self, indices: range) -> tuple[list[Conversation], dict]:
        """The chats [user: question, assistant: ""] of samples ``indices`` (source_row -1 - index), and
        the part record's counts and kept dedup keys; bad and duplicate questions are dropped, counted."""
        counts = dict.fromkeys(("generated", "truncated", "empty", "too_short", "duplicates", "kept"), 0)
        convs, keys = [], []
        header = self.tokenizer(self.header, add_special_tokens=False)["input_ids"]
        for start in range(0, len(indices), self.batch_size):
            batch = indices[start:start + self.batch_size]
            for index, (tokens, truncated) in zip(batch, self.generate([header] * len(batch))):
                counts["generated"] += 1
                question = self.tokenizer.decode(tokens, skip_special_tokens=False).strip()
                key = " ".join(question.split())  # the dedup key: whitespace runs collapsed
                reason = ("truncated" if truncated else "empty" if not key else "too_short"
                          if len(key) < self.min_chars else "duplicates" if key in self.seen else "kept")
                counts[reason] += 1
                if reason == "kept":
                    self.seen.add(key)
                    keys.append(key)
                    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": ""}]
                    convs.append(Conversation(kind="chat", messages=messages, source=SOURCE, row_index=-1 - index))
        return convs, {"self_prompts": counts, "questions": keys}
