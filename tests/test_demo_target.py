"""The demo's synthetic chats and its self-built target LM (dflash.eval.demo_target). Replies
are checked against an independent recomputation (regex parse + stdlib calendar/string), and a
tiny target is built and reloaded."""

from __future__ import annotations

import calendar
import json
import re
import random
from collections import Counter
from pathlib import Path

import pytest

from dflash.eval import demo_target as dt
from dflash.eval.benchmarks import read_jsonl

REPO_ROOT = Path(__file__).resolve().parents[1]

TINY = dict(
    num_hidden_layers=2,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    steps=25,
    batch_size=8,
    lr=1e-2,
    warmup_steps=3,
    log_every=5,
)


# --- an independent oracle for every prompt the generator writes ----------------------

_DAYS = list(calendar.day_name)  # Monday first
_MONTHS = list(calendar.month_name)[1:]


def _expected_reply(prompt: str, previous: str | None) -> tuple[str, str]:
    """(task kind, reply) recomputed from the prompt text alone."""
    if m := re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", prompt):
        a, op, b = int(m[1]), m[2], int(m[3])
        value = a + b if op == "+" else a - b
        assert value >= 0
        return "arith", f"{a} {op} {b} = {value}."
    if m := re.fullmatch(r"Count from (\d+) to (\d+)\.", prompt):
        numbers, n = [], int(m[1])
        while n <= int(m[2]):
            numbers.append(str(n))
            n += 1
        return "count_up", ", ".join(numbers) + "."
    if m := re.fullmatch(r"Count down from (\d+) to (\d+)\.", prompt):
        return "count_down", ", ".join(str(n) for n in reversed(range(int(m[2]), int(m[1]) + 1))) + "."
    if m := re.fullmatch(r"Write the (\d) times table up to (\d)\.", prompt):
        n = int(m[1])
        return "times_table", ", ".join(f"{n} x {k} = {sum([n] * k)}" for k in range(1, int(m[2]) + 1)) + "."
    if m := re.fullmatch(r"Repeat after me: (.+)", prompt):
        return "repeat", m[1]
    if m := re.fullmatch(r"Spell the word '([a-z]+)' letter by letter\.", prompt):
        return "spell", "-".join(c.upper() for c in m[1]) + "."
    if m := re.fullmatch(r"List the alphabet from ([A-Z]) to ([A-Z])\.", prompt):
        return "alphabet", ", ".join(chr(c) for c in range(ord(m[1]), ord(m[2]) + 1)) + "."
    if m := re.fullmatch(r"Reverse this list: (.+)\.", prompt):
        return "reverse_list", ", ".join(m[1].split(", ")[::-1]) + "."
    if m := re.fullmatch(r"Name the days of the week starting from (\w+)\.", prompt):
        i = _DAYS.index(m[1])
        return "days", ", ".join((_DAYS + _DAYS)[i : i + 7]) + "."
    if m := re.fullmatch(r"List the months from (\w+) to (\w+)\.", prompt):
        return "months", ", ".join(_MONTHS[_MONTHS.index(m[1]) : _MONTHS.index(m[2]) + 1]) + "."
    if prompt == "Say that again.":
        return "again", previous
    if prompt == "Now in capital letters.":
        return "upper", previous.upper()
    raise AssertionError(f"unknown prompt {prompt!r}")


def _check_chat(chat: dict) -> list[str]:
    messages = chat["messages"]
    assert set(chat) == {"messages"}
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    assert turns and len(turns) % 2 == 0
    kinds = []
    previous = None
    for k in range(0, len(turns), 2):
        user, assistant = turns[k], turns[k + 1]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert user["content"] and assistant["content"]
        kind, reply = _expected_reply(user["content"], previous)
        assert previous is not None or kind not in ("again", "upper"), "follow-up without a previous reply"
        assert assistant["content"] == reply, (user["content"], assistant["content"])
        kinds.append(kind)
        previous = assistant["content"]
    return kinds


# --- the generator ------------------------------------------------------------------


def test_generator_is_deterministic_for_a_seed():
    assert dt.generate_chats(60, seed=3) == dt.generate_chats(60, seed=3)
    assert dt.generate_chats(60, seed=3) != dt.generate_chats(60, seed=4)
    assert dt.generate_chats(60, seed=3)[:20] == dt.generate_chats(20, seed=3)


def test_generated_chats_are_valid_and_correct():
    chats = dt.generate_chats(600, seed=1)
    kinds = Counter(kind for chat in chats for kind in _check_chat(chat))
    # Every task shows up, and there are multi-turn chats and system prompts.
    expected = {"arith", "count_up", "count_down", "times_table", "repeat", "spell", "alphabet",
                "reverse_list", "days", "months", "again", "upper"}  # fmt: skip
    assert set(kinds) == expected
    assert any(len(c["messages"]) >= 5 for c in chats)
    assert any(c["messages"][0]["role"] == "system" for c in chats)


def test_task_of_names_the_task_behind_every_prompt():
    """task_of reads back which generator drew a prompt (per-task acceptance depends on it)."""
    rng = random.Random(5)
    for name in dt.TASKS:
        for _ in range(40):
            prompt, _ = dt.ask(name, rng)
            assert dt.task_of(prompt) == name, prompt
    assert dt.task_of("Say that again.") == "say_again"
    assert dt.task_of("Now in capital letters.") == "capitals"
    assert set(dt.FOLLOW_UPS) == {"Say that again.", "Now in capital letters."}
    assert dt.task_of("What is 3 * 4?") == "other"
    assert dt.task_of("Please count from 1 to 3.") == "other"


def test_jsonl_round_trip_and_committed_sample(tmp_path):
    chats = dt.generate_chats(30, seed=0)
    path = dt.write_jsonl(chats, tmp_path / "chats.jsonl")
    assert read_jsonl(path) == chats
    # data/demo_chats_sample.jsonl is exactly generate_chats(30, seed=0): regenerate with
    # `python -m dflash.eval.demo_target` if the generator changes.
    sample = REPO_ROOT / "data" / "demo_chats_sample.jsonl"
    assert [json.loads(line) for line in sample.read_text().splitlines()] == chats


# --- the target ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_chats():
    return dt.generate_chats(300, seed=0)


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory, demo_chats):
    return dt.build_demo_tokenizer(tmp_path_factory.mktemp("demo_tok"), demo_chats, vocab_size=320)


def test_tokenize_masks_assistant_tokens_only(demo_tokenizer, demo_chats):
    [(ids, mask)] = dt.tokenize_chats(demo_tokenizer, demo_chats[:1], max_length=512)
    assert len(ids) == len(mask) and 0 < sum(mask) < len(mask)
    text = demo_tokenizer.decode([t for t, m in zip(ids, mask) if m])
    replies = [m["content"] for m in demo_chats[0]["messages"] if m["role"] == "assistant"]
    assert text == "".join(r + "<|im_end|>" for r in replies)


def test_assistant_loss_needs_generation_tags(tiny_tokenizer_notags, demo_chats):
    with pytest.raises(ValueError, match="generation"):
        dt.tokenize_chats(tiny_tokenizer_notags, demo_chats[:2], max_length=512)


def test_tiny_build_trains_saves_and_reloads(tmp_path, demo_tokenizer, demo_chats):
    """(Reuse of a built target is the demo's step marker: test_demo.py.)"""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "target"
    lines: list[str] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # far faster for tiny dims on a busy machine
    try:
        record = dt.build_demo_target(out, demo_chats, demo_tokenizer, dt.DemoTargetConfig(**TINY), log=lines.append)
    finally:
        torch.set_num_threads(threads)
    assert record["final_loss"] < record["initial_loss"] - 0.5 and record["num_params"] > 0
    assert any("step" in line for line in lines)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == len(demo_tokenizer)
    assert AutoTokenizer.from_pretrained(out).get_vocab() == demo_tokenizer.get_vocab()
