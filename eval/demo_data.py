"""Synthetic chats for the CPU demo: deterministic tasks a tiny LM can learn in minutes.

Every assistant reply is a pure function of the conversation so far (arithmetic,
counting, copying, spelling, sequences, reversing), so a target trained on these chats
has predictable greedy continuations and a drafter trained after it can reach a
judgeable acceptance length. The answers are computed, never typed, so they are right.

Same `(n, seed)`, same chats, on any machine: only `random.Random(seed)` is used.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Callable, Iterable
from pathlib import Path

ALPHABET = string.ascii_uppercase
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = (
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
)  # fmt: skip
WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "lemon", "pixel", "ocean", "maple",
    "green", "house", "light", "bread", "chair", "music", "water", "piano", "robot",
    "sugar", "table", "zebra", "candle", "forest", "garden", "yellow", "planet",
)  # fmt: skip
SYSTEM_PROMPTS = ("You are a helpful assistant.", "Answer briefly and exactly.")

# A task draws its parameters from `rng` and returns (user prompt, assistant reply).
Task = Callable[[random.Random], tuple[str, str]]


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."


def _subtract(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(0, 50)
    b = rng.randint(0, a)
    return f"What is {a} - {b}?", f"{a} - {b} = {a - b}."


def _count_up(rng: random.Random) -> tuple[str, str]:
    start = rng.randint(0, 80)
    stop = start + rng.randint(3, 15)
    return f"Count from {start} to {stop}.", ", ".join(map(str, range(start, stop + 1))) + "."


def _count_down(rng: random.Random) -> tuple[str, str]:
    stop = rng.randint(0, 60)
    start = stop + rng.randint(3, 12)
    return f"Count down from {start} to {stop}.", ", ".join(map(str, range(start, stop - 1, -1))) + "."


def _times_table(rng: random.Random) -> tuple[str, str]:
    n, upto = rng.randint(2, 9), rng.randint(3, 6)
    table = ", ".join(f"{n} x {k} = {n * k}" for k in range(1, upto + 1))
    return f"Write the {n} times table up to {upto}.", table + "."


def _repeat(rng: random.Random) -> tuple[str, str]:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
    return f"Repeat after me: {text}", text


def _spell(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Spell the word '{word}' letter by letter.", "-".join(word.upper()) + "."


def _alphabet(rng: random.Random) -> tuple[str, str]:
    start = rng.randint(0, 20)
    stop = rng.randint(start + 3, min(start + 12, 25))
    return f"List the alphabet from {ALPHABET[start]} to {ALPHABET[stop]}.", ", ".join(ALPHABET[start:stop + 1]) + "."


def _reverse_list(rng: random.Random) -> tuple[str, str]:
    items = rng.sample(WORDS, rng.randint(3, 6))
    return f"Reverse this list: {', '.join(items)}.", ", ".join(reversed(items)) + "."


def _days(rng: random.Random) -> tuple[str, str]:
    start = rng.randrange(7)
    week = ", ".join(DAYS[(start + k) % 7] for k in range(7))
    return f"Name the days of the week starting from {DAYS[start]}.", week + "."


def _months(rng: random.Random) -> tuple[str, str]:
    start = rng.randint(0, 8)
    stop = rng.randint(start + 2, 11)
    return f"List the months from {MONTHS[start]} to {MONTHS[stop]}.", ", ".join(MONTHS[start : stop + 1]) + "."


TASKS: dict[str, Task] = {
    "add": _add, "subtract": _subtract, "count_up": _count_up, "count_down": _count_down, "times_table": _times_table,
    "repeat": _repeat, "spell": _spell, "alphabet": _alphabet, "reverse_list": _reverse_list, "days": _days,
    "months": _months,
}

# Follow-up turns that depend on the previous assistant reply: the model must read
# its own earlier answer, as in a real multi-turn chat.
FOLLOW_UPS = {
    "Say that again.": lambda previous: previous,
    "Now in capital letters.": lambda previous: previous.upper(),
}


# How each task's user prompt begins (follow-ups by their fixed text): `task_of` reads it back.
PROMPT_PREFIXES = {
    "add": "What is {} + ", "subtract": "What is {} - ", "count_up": "Count from ", "count_down": "Count down from ",
    "times_table": "Write the ", "repeat": "Repeat after me: ", "spell": "Spell the word ",
    "alphabet": "List the alphabet ", "reverse_list": "Reverse this list: ", "days": "Name the days ",
    "months": "List the months ", "say_again": "Say that again.", "capitals": "Now in capital letters.",
}
_PROMPT_PATTERNS = [(name, re.compile(re.escape(prefix).replace(r"\{\}", r"\d+")))
                    for name, prefix in PROMPT_PREFIXES.items()]


def task_of(prompt: str) -> str:
    """The task a user prompt asks for (a `TASKS` name, or "say_again"/"capitals" for the
    follow-ups), or "other" for a prompt these chats never contain."""
    for name, pattern in _PROMPT_PATTERNS:
        if pattern.match(prompt):
            return name
    return "other"


def generate_chat(rng: random.Random) -> dict:
    """One chat: optional system prompt, then 1-3 turns, some of them follow-ups."""
    messages: list[dict] = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    task_names = sorted(TASKS)
    for turn in range(rng.choice((1, 1, 1, 2, 2, 3))):
        if turn > 0 and rng.random() < 0.25:
            prompt = rng.choice(sorted(FOLLOW_UPS))
            reply = FOLLOW_UPS[prompt](messages[-1]["content"])
        else:
            prompt, reply = TASKS[rng.choice(task_names)](rng)
        messages.append({"role": "user", "content": prompt})
        messages.append({"role": "assistant", "content": reply})
    return {"messages": messages}


def generate_chats(n: int, seed: int = 0) -> list[dict]:
    """`n` synthetic chats in `messages` format, the same for the same `(n, seed)`.

    A prefix property holds too: `generate_chats(n, s)[:m] == generate_chats(m, s)`.
    """
    rng = random.Random(seed)
    return [generate_chat(rng) for _ in range(n)]


def write_jsonl(chats: Iterable[dict], path: str | Path) -> Path:
    """Write chats one JSON object a line (the format `dflash-extract` reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for chat in chats:
            handle.write(json.dumps(chat, ensure_ascii=False) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_corpus(chats: Iterable[dict], path: str | Path) -> Path:
    """Plain text of every message, one a line: the tokenizer's training corpus."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for chat in chats:
            for message in chat["messages"]:
                handle.write(message["content"] + "\n")
    return path


if __name__ == "__main__":  # python -m dflash.eval.demo_data [PATH]: rewrite the sample
    import sys

    print(write_jsonl(generate_chats(30, seed=0), sys.argv[1] if len(sys.argv) > 1 else "data/demo_chats_sample.jsonl"))
