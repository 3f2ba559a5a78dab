"""A small byte-level BPE tokenizer with a ChatML template, trained on local text: the CPU
demo's target and the tests use it instead of a hub download (there is no network at run
time).

Deterministic for the same inputs; the default corpus is the running interpreter's
standard library, so two Python versions give two (equally valid) tokenizers.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from pathlib import Path

IM_START, IM_END, END_OF_TEXT, MASK_TOKEN = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|MASK|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END, MASK_TOKEN]

# Stable, plain-prose-heavy modules that exist in every CPython 3.11+.
DEFAULT_STDLIB_FILES = ("textwrap.py", "string.py", "difflib.py", "argparse.py", "json/decoder.py",
                        "json/encoder.py", "calendar.py", "fractions.py")

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


def build_tokenizer(out_dir: str | Path, *, vocab_size: int = 512, generation_tags: bool = True,
                    corpus: Sequence[str | Path] | None = None, texts: Sequence[str] = ()):
    """Train a byte-level BPE on local text and save it as a HF fast tokenizer; returns the
    ``PreTrainedTokenizerFast``. ``corpus``: text files (default ``default_corpus()``; add e.g.
    data/chats_sample.jsonl for chat-ish merges), ``texts``: more text. Special tokens:
    <|endoftext|> (pad and eos), <|im_start|>, <|im_end|>, and <|MASK|>, which nothing emits and
    which the drafter uses as its mask id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = [Path(p) for p in (default_corpus() if corpus is None else corpus)]
    if missing := [str(p) for p in files if not p.is_file()]:
        raise FileNotFoundError(f"tokenizer corpus files not found: {missing}")
    bpe = Tokenizer(models.BPE())
    # No post-processor: offsets stay untrimmed, which the assistant-mask code relies on.
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # Whole files, not lines, so merges across newlines ("\n\n", "\n    ") are learned.
    bpe.train_from_iterator([p.read_text(encoding="utf-8", errors="replace") for p in files] + list(texts),
                            trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT,
                                        extra_special_tokens=[IM_START, IM_END, MASK_TOKEN], model_max_length=1 << 16)
    tokenizer.chat_template = chat_template(generation_tags)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer
