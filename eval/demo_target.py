"""A small target LM the demo builds itself: a Qwen3ForCausalLM trained on the CPU, in a few
minutes, on the synthetic chats of `demo_data`.

Not a good language model but a *predictable* one: its greedy replies to deterministic tasks
are (mostly) right, so a drafter trained on its hidden states has something to learn. The loss
covers assistant tokens only (the `{% generation %}` span, closing <|im_end|> included): the
user prompts are random draws whose loss is noise the demo never generates (`loss_on="all"`
for comparison). The folder is a normal HF model folder plus `demo_target.json`, written last,
holding the build settings and data fingerprints: the same settings reuse the model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dflash.eval import demo_data
from dflash.eval import toy_tokenizer as toy
from dflash.shared.fingerprint import tokenizer_fingerprint

MARKER = "demo_target.json"
BUILD_FORMAT = 1  # bump when the training recipe changes, so old builds are redone


@dataclass(frozen=True)
class DemoTargetConfig:
    """Model shape and training recipe of the demo target (the defaults are the demo's)."""

    num_hidden_layers: int = 4  # decoder layers; the drafter's context layers come from these
    hidden_size: int = 192  # model width
    intermediate_size: int = 512  # SwiGLU width
    num_attention_heads: int = 4  # query heads
    num_key_value_heads: int = 2  # GQA key/value heads
    head_dim: int = 48  # per-head width
    steps: int = 600  # optimizer steps
    batch_size: int = 32  # chats per step
    lr: float = 3e-3  # peak AdamW learning rate
    min_lr_ratio: float = 0.05  # cosine floor, as a fraction of `lr`
    warmup_steps: int = 30  # linear warm-up steps
    weight_decay: float = 0.1  # AdamW decoupled weight decay (matrices only)
    grad_clip: float = 1.0  # max global grad norm
    max_length: int = 256  # chats longer than this (in tokens) are dropped
    loss_on: str = "assistant"  # "assistant": assistant tokens only; "all": every token
    seed: int = 0  # init, batch order
    log_every: int = 50  # progress line every this many steps


@dataclass
class DemoTargetBuild:
    """What `build_demo_target` made (or found): the folder and its build record."""

    path: Path
    reused: bool
    record: dict[str, Any]


def build_demo_tokenizer(out_dir: str | Path, chats: Sequence[dict], *, vocab_size: int = 512):
    """The toy byte-level BPE (`toy.build_tokenizer`) with merges learned from `chats`."""
    out_dir = Path(out_dir)
    corpus = demo_data.write_corpus(chats, out_dir / "corpus.txt")
    # Role names are rendered by the template, not present in the messages: add them.
    with open(corpus, "a", encoding="utf-8") as handle:
        handle.write("system\nuser\nassistant\n" * 64)
    tokenizer = toy.build_tokenizer(out_dir, vocab_size=vocab_size, generation_tags=True, corpus=[corpus])
    corpus.unlink()
    return tokenizer


def build_demo_target(out_dir: str | Path, *, train_chats: Sequence[dict], tokenizer,
                      config: DemoTargetConfig | None = None, log: Callable[[str], None] = print,
                      num_threads: int | None = None, **overrides: Any) -> DemoTargetBuild:
    """Train (or reuse) the demo target in `out_dir`. `tokenizer`: a HF fast tokenizer or its folder,
    whose chat template marks assistant content with `{% generation %}`; `overrides` replace fields
    of `config`, e.g. `steps=20, hidden_size=32`; `num_threads`: torch's threads for this build only
    (speed, not a setting: on a busy 2-core machine 1 thread can be much faster for tiny models)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = dataclasses.replace(config or DemoTargetConfig(), **overrides)
    if config.loss_on not in ("assistant", "all"):
        raise ValueError(f"loss_on must be 'assistant' or 'all', not {config.loss_on!r}")
    if isinstance(tokenizer, (str, Path)):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    out_dir = Path(out_dir)
    settings = {"format": BUILD_FORMAT, "config": dataclasses.asdict(config), "data_hash": _chats_hash(train_chats),
                "num_chats": len(train_chats), "tokenizer": tokenizer_fingerprint(tokenizer)}
    previous = _read_marker(out_dir)
    if previous is not None and previous.get("settings") == settings:
        log(f"demo target: reusing {out_dir} (trained {previous['train_seconds']:.0f} s, "
            f"final loss {previous['final_loss']:.4f})")
        return DemoTargetBuild(out_dir, reused=True, record=previous)

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MARKER).unlink(missing_ok=True)  # a half-built folder must not look finished
    examples = tokenize_chats(tokenizer, train_chats, max_length=config.max_length, loss_on=config.loss_on)
    if not examples:
        raise ValueError("no training chats left after tokenization")
    model = _init_model(config, tokenizer)
    n_params, threads_before = sum(p.numel() for p in model.parameters()), torch.get_num_threads()
    torch.set_num_threads(num_threads or threads_before)
    log(f"demo target: {n_params / 1e6:.2f}M params, {len(examples)} chats, "
        f"{config.steps} steps x {config.batch_size}, {torch.get_num_threads()} threads")
    try:
        history = train(model, examples, config, pad_id=tokenizer.pad_token_id, log=log)
    finally:
        torch.set_num_threads(threads_before)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _check_same_weights(model, AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32))
    record = {"settings": settings, "num_params": n_params, **history}
    (out_dir / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    log(f"demo target: saved {out_dir} ({history['train_seconds']:.0f} s, "
        f"loss {history['initial_loss']:.3f} -> {history['final_loss']:.4f})")
    return DemoTargetBuild(out_dir, reused=False, record=record)


# --- data ---------------------------------------------------------------------------


def tokenize_chats(tokenizer, chats: Sequence[dict], *, max_length: int, loss_on: str = "assistant"):
    """(input_ids, loss_mask) per chat, the mask 1 on tokens the loss covers."""
    examples = []
    for chat in chats:
        encoded = tokenizer.apply_chat_template(chat["messages"], tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
        ids = list(encoded["input_ids"])
        if len(ids) > max_length:
            continue
        mask = list(encoded["assistant_masks"]) if loss_on == "assistant" else [1] * len(ids)
        if loss_on == "assistant" and not any(mask):
            raise ValueError("the chat template gave no assistant tokens: it needs {% generation %} tags "
                             "for loss_on='assistant'")
        examples.append((ids, mask))
    return examples


def _batches(lengths: Sequence[int], batch_size: int, rng: random.Random) -> Iterator[list[int]]:
    """Endless batches of indices; each epoch is shuffled, then grouped by length in
    windows of 16 batches so that little of a padded batch is padding."""
    order = list(range(len(lengths)))
    window = batch_size * 16
    while True:
        rng.shuffle(order)
        batches = []
        for start in range(0, len(order), window):
            chunk = sorted(order[start : start + window], key=lengths.__getitem__)
            batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        rng.shuffle(batches)
        yield from batches


def _collate(examples, indices: list[int], pad_id: int):
    width = max(len(examples[i][0]) for i in indices)
    ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(indices), width), dtype=torch.long)
    loss_mask = torch.zeros((len(indices), width), dtype=torch.bool)
    for row, i in enumerate(indices):
        tokens, mask = examples[i]
        ids[row, : len(tokens)] = torch.tensor(tokens)
        attention[row, : len(tokens)] = 1
        loss_mask[row, : len(tokens)] = torch.tensor(mask, dtype=torch.bool)
    return ids, attention, loss_mask


# --- model and training -------------------------------------------------------------


def _init_model(config: DemoTargetConfig, tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model_config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, max_position_embeddings=4096,
        tie_word_embeddings=False, eos_token_id=tokenizer.convert_tokens_to_ids(toy.IM_END),
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = Qwen3ForCausalLM(model_config)
    model.generation_config.eos_token_id = model_config.eos_token_id
    model.generation_config.pad_token_id = model_config.pad_token_id
    return model


def lm_loss(model, ids: torch.Tensor, attention: torch.Tensor, loss_mask: torch.Tensor):
    """Mean next-token CE over positions whose *target* token is in the loss mask."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]  # (B, T-1, V)
    target = ids[:, 1:]
    weight = loss_mask[:, 1:]
    ce = F.cross_entropy(logits[weight].float(), target[weight])
    correct = (logits[weight].argmax(-1) == target[weight]).float().mean()
    return ce, correct


def _lr_at(step: int, config: DemoTargetConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train(model, examples, config: DemoTargetConfig, *, pad_id: int, log: Callable[[str], None] = print):
    """Plain AdamW + cosine loop; returns losses and timing for the build record."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.95))
    batches = _batches([len(ids) for ids, _ in examples], config.batch_size, random.Random(config.seed))
    model.train()
    losses: list[float] = []
    tokens = 0
    start = time.perf_counter()
    for step in range(config.steps):
        ids, attention, loss_mask = _collate(examples, next(batches), pad_id)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, config)
        loss, accuracy = lm_loss(model, ids, attention, loss_mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        tokens += int(attention.sum())

        if step == 0 or (step + 1) % config.log_every == 0 or step + 1 == config.steps:
            now = time.perf_counter()
            losses.append(loss.item())
            log(f"  step {step + 1:5d}/{config.steps}  loss {losses[-1]:.4f}  acc {accuracy.item():.3f}  "
                f"lr {_lr_at(step, config):.2e}  {tokens / (now - start):.0f} tok/s  {now - start:.0f} s")
    return {"train_seconds": round(time.perf_counter() - start, 2), "train_tokens": tokens,
            "initial_loss": losses[0], "final_loss": losses[-1], "logged_losses": losses}


# --- helpers ------------------------------------------------------------------------


def _chats_hash(chats: Sequence[dict]) -> str:
    digest = hashlib.sha256()
    for chat in chats:
        digest.update(json.dumps(chat, sort_keys=True, ensure_ascii=False).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def _read_marker(out_dir: Path) -> dict | None:
    path = out_dir / MARKER
    if not path.is_file() or not (out_dir / "model.safetensors").is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def _check_same_weights(model, reloaded) -> None:
    ours, theirs = model.state_dict(), reloaded.state_dict()
    for name, tensor in ours.items():
        if name not in theirs or not torch.equal(tensor, theirs[name]):
            raise RuntimeError(f"reloaded demo target differs from the trained one at {name}")
