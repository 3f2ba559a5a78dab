"""The run's target (the flag, else what the cache records), its config and tokenizer, and what
follows for the drafter: the layers it fuses and the MASK token's row."""

from __future__ import annotations

import logging
import os

from dflash.shared.cache import CacheMismatch, CacheReader, CacheSpec
from dflash.shared.cli import looks_like_path
from dflash.shared.fingerprint import tokenizer_fingerprint
from dflash.shared.layers import check_layer_ids

from .config import TrainConfig
from .model import DrafterConfig

log = logging.getLogger("dflash.train")

MASK_TOKEN = "<|MASK|>"


def resolve_target(requested: str, spec: CacheSpec, cache_path: str) -> str:
    """``requested``, else the target the cache records (the folder extraction found, else the name it
    was given); a recorded folder that no longer exists is an error saying what to pass."""
    if requested:
        return requested
    located = (spec.info or {}).get("target_path")
    if not (recorded := located or (spec.fingerprint or {}).get("target", {}).get("name_or_path")):
        raise ValueError(f"cache {cache_path} records no target; pass --target (the target's folder or hub name)")
    recorded = str(recorded)
    if (located or looks_like_path(recorded)) and not os.path.exists(recorded):
        raise ValueError(f"cache {cache_path} was extracted from the target {recorded}, which no longer exists; "
                             "pass --target with its folder (or hub name): a moved or copied checkpoint with the "
                             "same config, tokenizer and weights is the same target")
    log.info("target: %s (recorded in the cache)", recorded)
    return recorded


def load_target_meta(target: str):
    """(HF config, tokenizer or None) of the target; no weights are read here."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(target)
    files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if os.path.isdir(target) and not any(os.path.exists(os.path.join(target, f)) for f in files):
        log.warning("%s holds no tokenizer: the cache's tokenizer cannot be checked", target)
        return config, None
    try:
        return config, AutoTokenizer.from_pretrained(target)
    except Exception as e:  # a weights-only folder: the tokenizer check is skipped, loudly
        log.warning("no tokenizer loadable from %s (%s): the cache's tokenizer cannot be checked", target, e)
        return config, None


def tokenizer_mask_id(tokenizer) -> int | None:
    """The tokenizer's <|MASK|> id, where it has one."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    return int(vocab[MASK_TOKEN]) if MASK_TOKEN in vocab else None


def mask_candidates(tokenizer) -> list[int]:
    """The tokenizer's special tokens that chat data never holds (not eos, bos, pad, unk or any token
    the chat template writes), by id: candidates for the MASK row."""
    if tokenizer is None:
        return []
    template = tokenizer.chat_template or ""
    template = " ".join(template.values()) if isinstance(template, dict) else str(template)
    reserved = {tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    return [i for i, token in sorted(tokenizer.added_tokens_decoder.items())
            if token.special and i not in reserved and token.content not in template]


def resolve_mask_token(requested: int | None, tokenizer, vocab_size: int, reader: CacheReader) -> int:
    """An embedding row no input holds: --mask-token-id (refused if the cache holds it), else the
    tokenizer's <|MASK|>, else the first padded row, else the first free ``mask_candidates``."""
    tokenizer_mask = tokenizer_mask_id(tokenizer)
    padded = len(tokenizer) if tokenizer is not None and len(tokenizer) < vocab_size else None
    if requested is None and tokenizer_mask is not None:
        log.info("mask token: the tokenizer's %s (id %d)", MASK_TOKEN, tokenizer_mask)
        return tokenizer_mask
    if requested is None and padded is not None:  # Qwen3: 151669 = first row past the tokenizer
        log.info("mask token: id %d, the first embedding row past the tokenizer's %d tokens (no text maps to it)",
                 padded, padded)
        return padded
    counts = reader.id_counts(minlength=vocab_size)
    candidates = mask_candidates(tokenizer)
    free = [i for i in [tokenizer_mask, padded, *candidates] if i is not None and i < vocab_size and not counts[i]]
    if requested is not None:
        if not 0 <= requested < vocab_size:
            raise ValueError(f"--mask-token-id {requested} is outside the target vocabulary [0, {vocab_size})")
        if counts[requested]:
            hint = f"pass a free one such as --mask-token-id {free[0]}" if free else "pass an id no sample contains"
            raise ValueError(f"--mask-token-id {requested} occurs {int(counts[requested])} times in the input_ids of "
                             f"the cache {reader.path}: the drafter could not tell a MASK from that token; {hint}")
        if tokenizer_mask is not None and requested != tokenizer_mask:
            log.warning("mask_token_id %d is not the tokenizer's %s (%d): SGLang refuses such a drafter",
                        requested, MASK_TOKEN, tokenizer_mask)
        return int(requested)
    if not free:
        raise ValueError(f"no unused embedding row for the MASK token: the tokenizer fills the vocabulary "
                         f"({vocab_size}), has no {MASK_TOKEN}, and each of its special tokens that chat data does not "
                         f"hold ({candidates}) occurs in the cache {reader.path}; pass --mask-token-id with an id no "
                         "sample contains")
    chosen = free[0]
    used = [i for i in candidates if i < chosen]
    log.info("mask token: %r (id %d), a special token of the tokenizer that occurs nowhere in the cache's %d tokens "
             "(the tokenizer fills all %d embedding rows and has no %s%s)", tokenizer.convert_ids_to_tokens(chosen),
             chosen, reader.num_tokens, vocab_size, MASK_TOKEN,
             f"; {used} occur in the cache" if used else "")
    return chosen


def drafter_layer_ids(requested: list[int] | None, spec: CacheSpec) -> list[int]:
    """The layers the drafter fuses: as requested, else every layer the cache stores (checked)."""
    if requested:
        try:
            check_layer_ids(list(requested), spec.num_target_layers)
        except ValueError as e:
            raise ValueError(f"--target-layer-ids: {e}") from None
        return list(requested)
    stored = list(spec.layer_ids)
    try:
        check_layer_ids(stored, spec.num_target_layers)
    except ValueError as e:
        usable = sorted(i for i in set(stored) if i < spec.num_target_layers - 1)
        hint = f"pass --target-layer-ids {','.join(map(str, usable))}" if usable else "extract a new cache"
        raise CacheMismatch("the cache's layers cannot be the drafter's default", [f"{e}; {hint}"]) from e
    return stored


def build_drafter_config(cfg: TrainConfig, hf_config, tokenizer, reader: CacheReader) -> DrafterConfig:
    """The drafter's shapes from the target, its layers and MASK row from the flags or the cache; a cache
    that cannot train it is refused (CacheMismatch, every difference named)."""
    d, text = cfg.drafter, hf_config.get_text_config()
    layer_ids = drafter_layer_ids(d.target_layer_ids, reader.spec)
    mask_id = resolve_mask_token(d.mask_token_id, tokenizer, text.vocab_size, reader)
    dcfg = DrafterConfig.from_target_config(hf_config, layer_ids, mask_id, d.block_size, d.num_draft_layers)
    reader.check_compatible(layer_ids=dcfg.target_layer_ids, hidden_size=text.hidden_size,
                            vocab_size=text.vocab_size, num_target_layers=text.num_hidden_layers,
                            tokenizer_hash=tokenizer_fingerprint(tokenizer)["hash"] if tokenizer is not None else None)
    return dcfg
