"""The tokenizer of stage one, loaded one way everywhere it renders chats (planning in the
parent and in every worker), so that the ids a worker stores come from the same chat template
and end-of-turn token that the cache's fingerprint records."""

from __future__ import annotations

from .config import ExtractConfig


def read_chat_template(path: str) -> str:
    """The text of a Jinja chat-template file, checked to compile; ValueError naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {path}: cannot read it: {e}") from None
    if not text.strip():
        raise ValueError(f"--chat-template {path}: the file is empty")
    from transformers.utils.chat_template_utils import _compile_jinja_template  # HF's own Jinja environment

    try:
        _compile_jinja_template(text)
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateSyntaxError and friends
        raise ValueError(f"--chat-template {path}: not a valid Jinja template: {type(e).__name__}: {e}") from None
    return text


def check_end_of_turn(tokenizer, token: str) -> int:
    """The id of ``token``, which must be one entry of the vocabulary; ValueError otherwise."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
        pieces = tokenizer.tokenize(token)
        raise ValueError(f"--end-of-turn {token!r} is not a token of the vocabulary of "
                         f"{tokenizer.name_or_path} (its text tokenizes as {len(pieces)} tokens: {pieces})")
    return int(token_id)


def load_tokenizer(cfg: ExtractConfig):
    """The tokenizer of ``cfg`` with ``--chat-template`` applied and ``--end-of-turn`` checked.

    Raises ValueError with a message for the user (file, token or tokenizer named).
    """
    from transformers import AutoTokenizer

    template = read_chat_template(cfg.chat_template) if cfg.chat_template else None
    name = cfg.tokenizer or cfg.model
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, revision=cfg.revision)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer {name!r}: {e}") from e
    if template is not None:
        tokenizer.chat_template = template
    if cfg.end_of_turn is not None:
        check_end_of_turn(tokenizer, cfg.end_of_turn)
    return tokenizer
