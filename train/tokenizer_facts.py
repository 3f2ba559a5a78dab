"""What training needs of the target's tokenizer (its fingerprint, its <|MASK|> row, its
length), remembered per tokenizer content so that a later start skips loading it.

Loading a tokenizer means importing transformers and parsing its files, seconds at every
start on a slow file system, for three facts that only change when the files do. The
memo is keyed on the bytes of every non-weight file of the target folder, the
transformers version and the fingerprint function's own source, so any change there
loads the tokenizer again.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("dflash.train")

MASK_TOKEN = "<|MASK|>"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
"""Files that do not shape a tokenizer and are too large to hash at every start."""


@dataclass(frozen=True)
class TokenizerFacts:
    """The tokenizer as far as training and export see it."""

    hash: str
    """``tokenizer_fingerprint``'s hash, what the cache records."""
    mask_id: int | None
    """The id of <|MASK|>, where the vocabulary has it."""
    size: int
    """``len(tokenizer)``: ids from here to the vocabulary's end are unused embedding rows."""

    @classmethod
    def of(cls, tokenizer) -> "TokenizerFacts":
        from dflash.shared.fingerprint import tokenizer_fingerprint

        vocab = tokenizer.get_vocab()
        return cls(hash=tokenizer_fingerprint(tokenizer)["hash"],
                   mask_id=int(vocab[MASK_TOKEN]) if MASK_TOKEN in vocab else None, size=len(tokenizer))


def as_facts(tokenizer) -> TokenizerFacts | None:
    """Facts of a loaded tokenizer (facts and None pass through)."""
    if tokenizer is None or isinstance(tokenizer, TokenizerFacts):
        return tokenizer
    return TokenizerFacts.of(tokenizer)


def content_key(folder: str) -> str:
    """Digest of what a tokenizer loaded from ``folder`` depends on: every non-weight file's
    name and bytes, the transformers version and the fingerprint code."""
    from importlib.metadata import version

    from dflash.shared import fingerprint

    h = hashlib.sha256()
    h.update(version("transformers").encode())
    h.update(inspect.getsource(fingerprint.tokenizer_fingerprint).encode())
    h.update(inspect.getsource(TokenizerFacts.of).encode())
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_file() and not entry.name.endswith(WEIGHT_SUFFIXES):
            h.update(entry.name.encode() + b"\0")
            h.update(hashlib.sha256(Path(entry.path).read_bytes()).digest())
    return h.hexdigest()


def remembered_facts(folder: str, memo_dir: str | os.PathLike | None, load) -> TokenizerFacts | None:
    """The facts of the tokenizer in ``folder``: from ``memo_dir`` when this content was seen
    before, else ``load()`` (a tokenizer or None) and remember them there."""
    if memo_dir is None or not os.path.isdir(folder):
        return as_facts(load())
    memo = Path(memo_dir) / f"{content_key(folder)}.json"
    if memo.exists():
        try:
            return TokenizerFacts(**json.loads(memo.read_text()))
        except (ValueError, TypeError) as e:  # a torn or foreign file: load again and rewrite it
            log.warning("ignoring unreadable tokenizer memo %s (%s)", memo, e)
    facts = as_facts(load())
    if facts is not None:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(facts)))
        os.replace(tmp, memo)
    return facts
