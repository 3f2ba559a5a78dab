"""Settings of one extraction run (stage one): what to read, what to keep, how to run."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from dflash.shared.cli import check_choices
from dflash.shared.compression import ZSTD_LEVELS, HiddenCodecName, ScaleDtype, TopkDtype
from dflash.shared.layers import check_layer_ids, default_layer_ids  # extraction's default, shared with training

from .chat import check_template_kwargs

Truncation = Literal["right", "skip", "error"]
BadRowPolicy = Literal["error", "skip"]
Dtype = Literal["bfloat16", "float16", "float32"]
TRUNCATION_POLICIES, BAD_ROW_POLICIES, DTYPES = get_args(Truncation), get_args(BadRowPolicy), get_args(Dtype)


@dataclass
class ExtractConfig:
    """Everything ``dflash-extract`` needs; each field is the flag of the same name (its help in
    ``extract/cli.py``). Fields under "what is extracted" are fingerprinted (a resume must match them)."""

    # -- inputs and output
    data: str
    model: str
    out: str
    tokenizer: str | None = None
    split: str | None = None
    revision: str | None = None
    chat_template: str | None = None

    # -- what is extracted (fingerprinted)
    layers: list[int] | None = None
    topk: int = 64
    max_length: int = 3072
    truncation: Truncation = "right"
    min_length: int = 2
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    end_of_turn: str | None = None
    on_bad_row: BadRowPolicy = "error"
    dtype: Dtype = "bfloat16"
    chunk_tokens: int = 256
    compression_level: int = 1
    hidden_codec: HiddenCodecName = "bf16"
    hidden_group_size: int = 128
    hidden_scale_dtype: ScaleDtype = "float16"
    topk_dtype: TopkDtype = "float32"

    # -- how it runs (not fingerprinted, but for the shard count and runner.FINGERPRINTED: padding, roundings)
    device: Literal["cuda", "cpu"] = "cuda"
    shards: int | None = None
    batch_tokens: int = 16384
    lm_head_chunk: int = 1024
    attn_implementation: str | None = "sdpa"
    commit_seconds: float = 30.0
    queue_depth: int = 2
    cpu_threads: int | None = None
    summary_json: str | None = None
    progress: bool = True
    wait_for_lock: bool = False
    plan: bool = False
    json: bool = False
    ignore_free_space: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the first setting that cannot work."""
        check_choices(self)
        if self.compression_level not in ZSTD_LEVELS:
            raise ValueError(f"--compression-level {self.compression_level}: the cache's codec (zstd inside blosc) "
                             f"runs at zstd levels {', '.join(map(str, ZSTD_LEVELS))} only")
        for name in ("topk", "max_length", "min_length", "batch_tokens", "lm_head_chunk", "chunk_tokens",
                     "queue_depth", "cpu_threads", "shards"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.commit_seconds < 0:
            raise ValueError(f"commit_seconds must be 0 or more, got {self.commit_seconds}")
        try:
            self.codec
        except ValueError as e:
            raise ValueError(f"--hidden-codec {self.hidden_codec}, --hidden-group-size {self.hidden_group_size}: {e}"
                             ) from None
        if self.json and not self.plan:
            raise ValueError("--json goes with --plan (a run writes its summary as JSON with --summary-json PATH)")
        if self.min_length > self.max_length:
            raise ValueError(f"min_length {self.min_length} exceeds max_length {self.max_length}")
        if self.end_of_turn is not None and not self.end_of_turn:
            raise ValueError("--end-of-turn is empty")
        check_template_kwargs(self.template_kwargs)
        try:
            json.dumps(self.template_kwargs, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--template-kwargs must hold JSON values only (they are fingerprinted): {e}") from None

    @property
    def codec(self):
        """The ``HiddenCodec`` of the --hidden-* flags (ValueError where they cannot work together); needs torch."""
        from dflash.shared.hidden_codecs import HiddenCodec

        return HiddenCodec(self.hidden_codec, self.hidden_group_size, self.hidden_scale_dtype)


class ExtractFailed(Exception):
    """A run that cannot go on; the message is for the user (no traceback needed)."""


def checked_layers(cfg: ExtractConfig, model_config) -> list[int]:
    """The layers the run stores (--layers, or the default spread), with them, --topk and the codec's
    groups checked against the target (ExtractFailed naming the flag)."""
    n = model_config.num_hidden_layers
    layers = list(cfg.layers) if cfg.layers is not None else default_layer_ids(n)
    try:
        check_layer_ids(layers, n)
    except ValueError as e:
        raise ExtractFailed(f"--layers: {e}") from e
    if cfg.topk > model_config.vocab_size:
        raise ExtractFailed(f"--topk {cfg.topk} exceeds the vocabulary size {model_config.vocab_size}")
    try:
        cfg.codec.check_hidden_size(model_config.hidden_size)
    except ValueError as e:
        raise ExtractFailed(f"--hidden-codec {cfg.hidden_codec}, --hidden-group-size {cfg.hidden_group_size}: {e}"
                            ) from e
    return layers


def load_tokenizer_and_config(cfg: ExtractConfig):
    """Settings checked, the run's tokenizer and the target's config (no weights); ExtractFailed naming the cause."""
    from transformers import AutoConfig

    from .chat import load_tokenizer

    try:
        cfg.validate()
        tokenizer = load_tokenizer(cfg)
    except ValueError as e:
        raise ExtractFailed(str(e)) from e
    try:
        model_config = AutoConfig.from_pretrained(cfg.model, revision=cfg.revision)
    except (OSError, ValueError) as e:
        raise ExtractFailed(f"cannot load the target {cfg.model!r}: {e}") from e
    return tokenizer, model_config
