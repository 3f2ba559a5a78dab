"""A small byte-level BPE tokenizer with a ChatML template, trained on local text (the CPU
demo and the tests run offline). The default corpus is the interpreter's standard library."""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

IM_START, IM_END, END_OF_TEXT, MASK_TOKEN = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|MASK|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END, MASK_TOKEN]

DEFAULT_STDLIB_FILES = ("textwrap.py", "string.py", "difflib.py", "argparse.py", "json/decoder.py",
                        "json/encoder.py", "calendar.py", "fractions.py")

# ChatML; @GEN@/@ENDGEN@ become `{% generation %}` tags or nothing. The assistant span includes
# the closing <|im_end|> (the drafter learns to end its turn). Unknown roles and a late system
# message are rejected, so tests can exercise "template rejected the row".
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
    start, end = ("{% generation %}", "{% endgeneration %}") if generation_tags else ("", "")
    return _CHAT_TEMPLATE.replace("@GEN@", start).replace("@ENDGEN@", end)


def default_corpus() -> list[Path]:
    return [Path(sysconfig.get_paths()["stdlib"]) / name for name in DEFAULT_STDLIB_FILES]


def build_tokenizer(out_dir: str | Path, *, vocab_size: int = 512, generation_tags: bool = True,
                    corpus: Sequence[str | Path] | None = None, texts: Sequence[str] = ()):
    """A byte-level BPE trained on ``corpus`` files (default ``default_corpus()``) and ``texts``, saved as a HF fast
    tokenizer: <|endoftext|> is pad and eos; <|MASK|>, which nothing emits, is the drafter's mask id."""
    bpe = Tokenizer(models.BPE())
    # No post-processor: offsets stay untrimmed, which the assistant-mask code relies on.
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # Whole files, not lines, so merges across newlines ("\n\n", "\n    ") are learned.
    files = default_corpus() if corpus is None else corpus  # a missing one: FileNotFoundError naming it
    bpe.train_from_iterator([Path(p).read_text(encoding="utf-8", errors="replace") for p in files] + list(texts),
                            trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT,
                                        extra_special_tokens=[IM_START, IM_END, MASK_TOKEN], model_max_length=1 << 16)
    tokenizer.chat_template = chat_template(generation_tags)
    tokenizer.save_pretrained(out_dir)
    return tokenizer
