"""Tiny, fully local stand-ins for a real target: a BPE tokenizer with a chat template,
a random Qwen3 causal LM, and small generated chat datasets.

Tests and the CPU demo use these instead of hub downloads (there is no network at run
time). Everything here is deterministic for the same inputs; note that the default
tokenizer corpus is the running interpreter's standard library, so two Python versions
give two (equally valid) tokenizers.
"""

from __future__ import annotations

import json
import random
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
MASK_TOKEN = "<|MASK|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END, MASK_TOKEN]

# Stable, plain-prose-heavy modules that exist in every CPython 3.11+.
DEFAULT_STDLIB_FILES = (
    "textwrap.py",
    "string.py",
    "difflib.py",
    "argparse.py",
    "json/decoder.py",
    "json/encoder.py",
    "calendar.py",
    "fractions.py",
)

# ChatML-like template. The @GEN@/@ENDGEN@ markers become `{% generation %}` /
# `{% endgeneration %}` or nothing. The assistant span covers the content AND the
# closing <|im_end|>: the drafter must learn to end its turn. The template rejects
# unknown roles and a system message that is not first, so tests can exercise
# "template rejected the row" with otherwise valid data.
_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown role ' + message['role']) }}"
    "{%- endif %}"
    "{%- if message['role'] == 'system' and not loop.first %}"
    "{{- raise_exception('a system message must come first') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "@GEN@{{- message['content'] + '<|im_end|>' }}@ENDGEN@"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def chat_template(generation_tags: bool = True) -> str:
    """The toy ChatML template, with or without `{% generation %}` tags."""
    start, end = ("{% generation %}", "{% endgeneration %}") if generation_tags else ("", "")
    return _CHAT_TEMPLATE.replace("@GEN@", start).replace("@ENDGEN@", end)


def default_corpus() -> list[Path]:
    """Source files of the running interpreter's standard library: real, local text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [stdlib / name for name in DEFAULT_STDLIB_FILES]


def build_tokenizer(
    out_dir: str | Path,
    *,
    vocab_size: int = 512,
    generation_tags: bool = True,
    corpus: Sequence[str | Path] | None = None,
):
    """Train a byte-level BPE on local files and save it as a HF fast tokenizer.

    `corpus` is a list of text files (default: `default_corpus()`; add e.g.
    data/chats_sample.jsonl to get chat-ish merges). Special tokens: <|endoftext|> (pad
    and eos), <|im_start|>, <|im_end|>, and <|MASK|>, which nothing emits and which the
    drafter uses as its mask id. Returns the `PreTrainedTokenizerFast`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = [Path(p) for p in (default_corpus() if corpus is None else corpus)]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"tokenizer corpus files not found: {missing}")

    bpe = Tokenizer(models.BPE())
    # No post-processor: offsets stay untrimmed, which the assistant-mask code relies on.
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Whole files, not lines, so merges across newlines ("\n\n", "\n    ") are learned.
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    bpe.train_from_iterator(texts, trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        extra_special_tokens=[IM_START, IM_END, MASK_TOKEN],
        model_max_length=1 << 16,
    )
    tokenizer.chat_template = chat_template(generation_tags)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def build_qwen3(
    out_dir: str | Path,
    tokenizer,
    *,
    num_hidden_layers: int = 4,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Save a randomly initialised (seeded) tiny Qwen3ForCausalLM plus `tokenizer`.

    Reload with `AutoModelForCausalLM.from_pretrained(path)`, the same path a real
    target takes. The global torch RNG is left untouched.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model = model.to(dtype).eval()

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# ---------------------------------------------------------------------------------
# Sample chat datasets (data/chats_sample.jsonl, data/chats_sharegpt_sample.jsonl).
# Answers are computed, so they are correct and a toy model could even learn them.


def _task(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["add", "mul", "reverse", "count", "sort", "upper"])
    if kind == "add":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    if kind == "mul":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"Compute {a} times {b}.", f"{a} times {b} is {a * b}."
    words = ["apple", "river", "stone", "cloud", "tiger", "lemon", "pixel", "ocean", "maple"]
    word = rng.choice(words)
    if kind == "reverse":
        return f"Reverse the word '{word}'.", f"'{word}' reversed is '{word[::-1]}'."
    if kind == "count":
        letter = rng.choice(sorted(set(word)))
        n = word.count(letter)
        return (
            f"How many times does '{letter}' appear in '{word}'?",
            f"The letter '{letter}' appears {n} time{'s' if n != 1 else ''} in '{word}'.",
        )
    if kind == "sort":
        nums = rng.sample(range(1, 50), 4)
        return f"Sort these numbers: {nums}.", f"Sorted: {sorted(nums)}."
    return f"Write '{word}' in capital letters.", f"{word.upper()}"


def sample_chats(n: int = 40, seed: int = 0) -> list[dict]:
    """`n` small chats in `messages` format: single and multi-turn, some with a system prompt."""
    rng = random.Random(seed)
    systems = ["You are a helpful assistant.", "Answer briefly and exactly."]
    rows = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(systems)})
        for _turn in range(rng.choice([1, 1, 2, 3])):
            question, answer = _task(rng)
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": answer})
        rows.append({"messages": messages})
    return rows


def sample_sharegpt_chats(n: int = 10, seed: int = 1) -> list[dict]:
    """`n` small chats in ShareGPT format (`conversations` of {from, value})."""
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    return [
        {"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in row["messages"]]}
        for row in sample_chats(n, seed)
    ]


def write_sample_datasets(data_dir: str | Path) -> list[Path]:
    """(Re)write the committed sample datasets under `data_dir`."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, rows in [
        ("chats_sample.jsonl", sample_chats()),
        ("chats_sharegpt_sample.jsonl", sample_sharegpt_chats()),
    ]:
        path = data_dir / name
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        written.append(path)
    return written


if __name__ == "__main__":  # python -m dflash.shared.toy [DATA_DIR]: rewrite the samples
    import sys

    for written_path in write_sample_datasets(sys.argv[1] if len(sys.argv) > 1 else "data"):
        print(written_path)
