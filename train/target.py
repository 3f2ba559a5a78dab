"""The target a run trains for, and what follows from it and from the cache: where the
target is (the flag, else what the cache records), its config and tokenizer, the layers
the drafter fuses (by default those the cache stores) and the MASK token's row."""

from __future__ import annotations

import logging
import os

from dflash.shared.cache import CacheMismatch, CacheReader, CacheSpec
from dflash.shared.cli_options import looks_like_path
from dflash.shared.layers import check_layer_ids

from .config import TrainConfig
from .model import DrafterConfig

log = logging.getLogger("dflash.train")

MASK_TOKEN = "<|MASK|>"


class TargetNotFound(ValueError):
    """The target a cache records is no longer where it was; the message says what to pass."""


def recorded_target(spec: CacheSpec) -> str | None:
    """The target the cache was extracted from: the absolute folder where extraction found
    it (a local checkpoint, known by its content), else the name or path it was given."""
    located = (spec.info or {}).get("target_path")
    if located:
        return str(located)
    name = (spec.fingerprint or {}).get("target", {}).get("name_or_path")
    return str(name) if name else None


def resolve_target(requested: str, spec: CacheSpec, cache_path: str) -> str:
    """``requested`` when given, else the target the cache records; a recorded local
    folder that no longer exists is an error naming it and what to pass instead."""
    if requested:
        return requested
    recorded = recorded_target(spec)
    if recorded is None:
        raise TargetNotFound(f"cache {cache_path} records no target; pass --target (the target's folder or hub name)")
    located = bool((spec.info or {}).get("target_path"))
    if (located or looks_like_path(recorded)) and not os.path.exists(recorded):
        raise TargetNotFound(
            f"cache {cache_path} was extracted from the target {recorded}, which no longer exists; "
            "pass --target with its folder (or hub name): a moved or copied checkpoint with the same "
            "config, tokenizer and weights is the same target")
    log.info("target: %s (recorded in the cache)", recorded)
    return recorded


def load_target_meta(target: str):
    """(HF config, tokenizer or None) of the target; no weights are read here."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(target)
    files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if os.path.isdir(target) and not any(os.path.exists(os.path.join(target, f)) for f in files):
        # transformers 5 builds an empty tokenizer from such a folder; its hash would mean nothing
        log.warning("%s holds no tokenizer: the cache's tokenizer cannot be checked", target)
        return config, None
    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
    except Exception as e:  # a weights-only folder: the tokenizer check is skipped, loudly
        log.warning("no tokenizer loadable from %s (%s): the cache's tokenizer cannot be checked", target, e)
        tokenizer = None
    return config, tokenizer


def text_config(hf_config):
    """The decoder's config (multimodal configs nest it)."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def tokenizer_mask_id(tokenizer) -> int | None:
    """The tokenizer's <|MASK|> id, where it has one."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    return int(vocab[MASK_TOKEN]) if MASK_TOKEN in vocab else None


def resolve_mask_token(requested: int | None, tokenizer, vocab_size: int) -> int:
    """An existing, unused embedding row: as given, else <|MASK|>, else the first padded row."""
    tokenizer_mask = tokenizer_mask_id(tokenizer)
    if requested is not None:
        if not 0 <= requested < vocab_size:
            raise ValueError(f"--mask-token-id {requested} is outside the target vocabulary [0, {vocab_size})")
        if tokenizer_mask is not None and requested != tokenizer_mask:
            log.warning("mask_token_id %d is not the tokenizer's %s (%d): SGLang refuses such a drafter",
                        requested, MASK_TOKEN, tokenizer_mask)
        return int(requested)
    if tokenizer_mask is not None:
        return tokenizer_mask
    if tokenizer is not None and len(tokenizer) < vocab_size:  # Qwen3: 151669 = first row past the tokenizer
        return len(tokenizer)
    raise ValueError("no unused embedding row for the MASK token: the tokenizer fills the vocabulary and has "
                     f"no {MASK_TOKEN}; pass --mask-token-id")


def check_cache(reader: CacheReader, hf_config, tokenizer, layer_ids: list[int]) -> None:
    """Refuse (CacheMismatch, every difference named) a cache that cannot train this drafter."""
    from dflash.shared.fingerprint import tokenizer_fingerprint

    text = text_config(hf_config)
    reader.check_compatible(
        layer_ids=layer_ids, hidden_size=text.hidden_size, vocab_size=text.vocab_size,
        tokenizer_hash=tokenizer_fingerprint(tokenizer)["hash"] if tokenizer is not None else None,
        num_target_layers=text.num_hidden_layers,
    )


def drafter_layer_ids(requested: list[int] | None, spec: CacheSpec) -> list[int]:
    """The layers the drafter fuses: as requested, else every layer the cache stores. A cache
    whose layers break the serving rules (made before they were checked) is refused with a
    valid subset to pass instead."""
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


def build_drafter_config(cfg: TrainConfig, hf_config, tokenizer, spec: CacheSpec) -> DrafterConfig:
    """The drafter's shapes from the target, its layers from the flag or the cache."""
    text = text_config(hf_config)
    d = cfg.drafter
    layer_ids = drafter_layer_ids(d.target_layer_ids, spec)
    mask_id = resolve_mask_token(d.mask_token_id, tokenizer, text.vocab_size)
    return DrafterConfig.from_target_config(hf_config, layer_ids, mask_id, d.block_size, d.num_draft_layers)
