"""The CPU demo's synthetic chats (each reply a pure function of the chat so far) and a small Qwen3 target trained on
them on the CPU in minutes, the loss on assistant tokens only (the prompts are random draws)."""

from __future__ import annotations

import math
import random
import re
import string
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash.eval import toy_tokenizer as toy
from dflash.eval.benchmarks import write_jsonl

ALPHABET = string.ascii_uppercase
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "pixel", "ocean", "maple", "green", "house", "light",
         "bread", "chair", "music", "water", "piano", "robot", "sugar", "table", "zebra", "candle", "forest",
         "garden", "yellow", "planet")
SYSTEM_PROMPTS = ("You are a helpful assistant.", "Answer briefly and exactly.")
PROMPTS = {  # each task's user prompt, its drawn parameters in the braces; `task_of` reads them back
    "add": "What is {} + {}?", "alphabet": "List the alphabet from {} to {}.",
    "count_down": "Count down from {} to {}.", "count_up": "Count from {} to {}.",
    "days": "Name the days of the week starting from {}.", "months": "List the months from {} to {}.",
    "repeat": "Repeat after me: {}", "reverse_list": "Reverse this list: {}.",
    "spell": "Spell the word '{}' letter by letter.", "subtract": "What is {} - {}?",
    "times_table": "Write the {} times table up to {}.",
    "say_again": "Say that again.", "capitals": "Now in capital letters.",  # the follow-ups
}
TASKS = sorted(set(PROMPTS) - {"say_again", "capitals"})
FOLLOW_UPS: dict[str, Callable[[str], str]] = {PROMPTS["say_again"]: lambda previous: previous,
                                               PROMPTS["capitals"]: str.upper}
_PATTERNS = {name: re.compile(re.escape(p).replace(r"\{\}", "(.+)")) for name, p in PROMPTS.items()}


def ask(task: str, r: random.Random) -> tuple[str, str]:
    """(user prompt, assistant reply) of one of ``TASKS``, its parameters drawn from ``r``."""
    if task in ("add", "subtract"):
        a = r.randint(0, 50)
        b = r.randint(0, 50 if task == "add" else a)
        args, reply = (a, b), f"{a} + {b} = {a + b}." if task == "add" else f"{a} - {b} = {a - b}."
    elif task == "count_up":
        start = r.randint(0, 80)
        stop = start + r.randint(3, 15)
        args, reply = (start, stop), ", ".join(map(str, range(start, stop + 1))) + "."
    elif task == "count_down":
        stop = r.randint(0, 60)
        start = stop + r.randint(3, 12)
        args, reply = (start, stop), ", ".join(map(str, range(start, stop - 1, -1))) + "."
    elif task == "times_table":
        n, upto = r.randint(2, 9), r.randint(3, 6)
        args, reply = (n, upto), ", ".join(f"{n} x {k} = {n * k}" for k in range(1, upto + 1)) + "."
    elif task == "repeat":
        text = " ".join(r.choice(WORDS) for _ in range(r.randint(3, 8)))
        args, reply = (text,), text
    elif task == "spell":
        word = r.choice(WORDS)
        args, reply = (word,), "-".join(word.upper()) + "."
    elif task == "alphabet":
        start = r.randint(0, 20)
        stop = r.randint(start + 3, min(start + 12, 25))
        args, reply = (ALPHABET[start], ALPHABET[stop]), ", ".join(ALPHABET[start:stop + 1]) + "."
    elif task == "reverse_list":
        items = r.sample(WORDS, r.randint(3, 6))
        args, reply = (", ".join(items),), ", ".join(reversed(items)) + "."
    elif task == "days":
        start = r.randrange(7)
        args, reply = (DAYS[start],), ", ".join(DAYS[(start + k) % 7] for k in range(7)) + "."
    elif task == "months":
        start = r.randint(0, 8)
        stop = r.randint(start + 2, 11)
        args, reply = (MONTHS[start], MONTHS[stop]), ", ".join(MONTHS[start:stop + 1]) + "."
    else:
        raise ValueError(f"unknown task {task!r} (tasks: {', '.join(TASKS)})")
    return PROMPTS[task].format(*args), reply


def task_of(prompt: str) -> str:
    """The task a user prompt asks for (a ``PROMPTS`` name), or "other" for one these chats never contain."""
    return next((name for name, pattern in _PATTERNS.items() if pattern.fullmatch(prompt)), "other")


def generate_chats(n: int, seed: int = 0) -> list[dict]:
    """``n`` chats: an optional system prompt, then 1-3 turns, some of them follow-ups of the previous
    reply; ``generate_chats(n, s)[:m] == generate_chats(m, s)``."""
    r, chats = random.Random(seed), []
    for _ in range(n):
        messages: list[dict] = []
        if r.random() < 0.2:
            messages.append({"role": "system", "content": r.choice(SYSTEM_PROMPTS)})
        for turn in range(r.choice((1, 1, 1, 2, 2, 3))):
            if turn > 0 and r.random() < 0.25:
                prompt = r.choice(sorted(FOLLOW_UPS))
                reply = FOLLOW_UPS[prompt](messages[-1]["content"])
            else:
                prompt, reply = ask(r.choice(TASKS), r)
            messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
        chats.append({"messages": messages})
    return chats


@dataclass(frozen=True)
class DemoTargetConfig:
    """Model shape and training recipe of the demo target (the defaults are ``make demo``'s)."""

    num_hidden_layers: int = 4  # decoder layers; the drafter's context layers come from these
    hidden_size: int = 96  # model width
    intermediate_size: int = 256  # SwiGLU width
    num_attention_heads: int = 4  # query heads
    num_key_value_heads: int = 2  # GQA key/value heads
    head_dim: int = 24  # per-head width
    steps: int = 600  # optimizer steps
    batch_size: int = 32  # chats per step
    lr: float = 3e-3  # peak AdamW learning rate
    min_lr_ratio: float = 0.05  # cosine floor, as a fraction of `lr`
    warmup_steps: int = 20  # linear warm-up steps
    weight_decay: float = 0.1  # AdamW decoupled weight decay (matrices only)
    grad_clip: float = 1.0  # max global grad norm
    max_length: int = 256  # chats longer than this (in tokens) are dropped
    seed: int = 0  # init, batch order
    log_every: int = 100  # progress line every this many steps


def build_demo_tokenizer(out_dir: str | Path, chats: Sequence[dict], *, vocab_size: int = 512):
    """The toy BPE with merges learned from every message of ``chats`` and the role names."""
    text = "".join(m["content"] + "\n" for chat in chats for m in chat["messages"])
    return toy.build_tokenizer(out_dir, vocab_size=vocab_size, corpus=[],
                               texts=[text + "system\nuser\nassistant\n" * 64])


def tokenize_chats(tokenizer, chats: Sequence[dict], *, max_length: int):
    """(input_ids, loss_mask) per chat of at most ``max_length`` tokens, the mask 1 on assistant tokens."""
    examples = []
    for chat in chats:
        encoded = tokenizer.apply_chat_template(chat["messages"], tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
        if len(ids := list(encoded["input_ids"])) > max_length:
            continue
        if not any(mask := list(encoded["assistant_masks"])):
            raise ValueError("the chat template gave no assistant tokens: it needs {% generation %} tags")
        examples.append((ids, mask))
    return examples


def build_demo_target(out_dir: str | Path, train_chats: Sequence[dict], tokenizer, config: DemoTargetConfig, *,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train the demo target and save it as an HF model folder; returns its build record."""
    if not (examples := tokenize_chats(tokenizer, train_chats, max_length=config.max_length)):
        raise ValueError("no training chats left after tokenization")
    eos, c = tokenizer.convert_tokens_to_ids(toy.IM_END), config
    model_config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, max_position_embeddings=4096,
        tie_word_embeddings=False, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(c.seed)
        model = Qwen3ForCausalLM(model_config)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"demo target: {n_params / 1e6:.2f}M params, {len(examples)} chats, "
        f"{c.steps} steps x {c.batch_size}, {torch.get_num_threads()} threads")
    history = train(model, examples, c, pad_id=tokenizer.pad_token_id, log=log)
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    log(f"demo target: saved {out_dir} ({history['train_seconds']:.0f} s, "
        f"loss {history['initial_loss']:.3f} -> {history['final_loss']:.4f})")
    return {"num_params": n_params, **history}


def _batches(lengths: Sequence[int], batch_size: int, r: random.Random) -> Iterator[list[int]]:
    """Endless batches of indices, each epoch shuffled, grouped by length in windows of 16 batches."""
    order, window = list(range(len(lengths))), batch_size * 16
    while True:
        r.shuffle(order)
        batches = []
        for start in range(0, len(order), window):
            chunk = sorted(order[start:start + window], key=lengths.__getitem__)
            batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
        r.shuffle(batches)
        yield from batches


def _lr_at(step: int, c: DemoTargetConfig) -> float:
    if step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    progress = (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps)
    floor = c.lr * c.min_lr_ratio
    return floor + (c.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train(model, examples, c: DemoTargetConfig, *, pad_id: int, log: Callable[[str], None] = print) -> dict:
    """AdamW + cosine on the mean next-token CE of tokens whose *target* is in the loss mask."""
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": c.weight_decay},
                                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=c.lr, betas=(0.9, 0.95))
    batches = _batches([len(ids) for ids, _ in examples], c.batch_size, random.Random(c.seed))
    model.train()
    losses, tokens, start = [], 0, time.perf_counter()
    for step in range(c.steps):
        rows = [examples[i] for i in next(batches)]  # right-padded to (N, T)
        ids = pad_sequence([torch.tensor(t) for t, _ in rows], batch_first=True, padding_value=pad_id)
        attention = pad_sequence([torch.ones(len(t), dtype=torch.long) for t, _ in rows], batch_first=True)
        loss_mask = pad_sequence([torch.tensor(mask, dtype=torch.bool) for _, mask in rows], batch_first=True)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, c)
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1][loss_mask[:, 1:]]  # (N, V)
        target = ids[:, 1:][loss_mask[:, 1:]]
        loss = F.cross_entropy(logits.float(), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, c.grad_clip)
        optimizer.step()
        tokens += int(attention.sum())
        if step == 0 or (step + 1) % c.log_every == 0 or step + 1 == c.steps:
            now, accuracy = time.perf_counter(), (logits.argmax(-1) == target).float().mean().item()
            losses.append(loss.item())
            log(f"  step {step + 1:5d}/{c.steps}  loss {losses[-1]:.4f}  acc {accuracy:.3f}  "
                f"lr {_lr_at(step, c):.2e}  {tokens / (now - start):.0f} tok/s  {now - start:.0f} s")
    return {"train_seconds": round(time.perf_counter() - start, 2), "train_tokens": tokens,
            "initial_loss": losses[0], "final_loss": losses[-1], "logged_losses": losses}


if __name__ == "__main__":  # python -m dflash.eval.demo_target [PATH]: rewrite the committed sample
    print(write_jsonl(generate_chats(30), sys.argv[1] if len(sys.argv) > 1 else "data/demo_chats_sample.jsonl"))
