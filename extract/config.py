"""Settings of one extraction run (stage one): what to read, what to keep, how to run."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from dflash.shared.cli_options import check_choices
from dflash.shared.compression import ZSTD_LEVELS, HiddenCodecName, ScaleDtype, TopkDtype
from dflash.shared.layers import check_layer_ids, default_layer_ids  # extraction's default, shared with training

Truncation = Literal["right", "skip", "error"]
BadRowPolicy = Literal["error", "skip"]
Dtype = Literal["bfloat16", "float16", "float32"]
Device = Literal["cuda", "cpu"]
TRUNCATION_POLICIES = get_args(Truncation)
BAD_ROW_POLICIES = get_args(BadRowPolicy)
DTYPES = get_args(Dtype)
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})
"""Arguments of ``apply_chat_template`` itself, which --template-kwargs cannot set."""


@dataclass
class ExtractConfig:
    """Everything ``dflash-extract`` needs; each field is one flag of the CLI, ``runner.run`` consumes it.

    Fields under "what is extracted" go into the cache fingerprint (a resume must match
    them); the rest only change how fast or where the same bytes are produced.
    """

    # -- inputs and output
    data: str
    """Chat dataset: a .jsonl/.json/.parquet file, a folder, or a `datasets` name."""
    model: str
    """Target HF causal LM: a local folder or a hub name already in the local cache."""
    out: str
    """Cache root: a local path or any URL zarr/fsspec can write; rerun to resume."""
    tokenizer: str | None = None
    """Tokenizer folder or name; default: the model's."""
    split: str | None = None
    """Dataset split for `datasets` sources; default: the only or the 'train' split."""
    revision: str | None = None
    """Model revision for hub names (recorded in the fingerprint)."""
    chat_template: str | None = field(default=None, metadata={"exists": "file"})
    """Jinja file that replaces the tokenizer's chat template (its text is fingerprinted, its path recorded)."""

    # -- what is extracted (fingerprinted)
    layers: list[int] | None = None
    """Target layer ids to store, e.g. 1,9,17 (id i = HF hidden_states[i + 1]), ascending, below L-1; default: 5
    spread over 1..L-3."""
    topk: int = 64
    """Target log-probs stored per position (top-k of log_softmax over the vocabulary)."""
    max_length: int = 3072
    """Longest sample in tokens; longer ones are handled by --truncation."""
    truncation: Truncation = "right"
    """Over-long samples: 'right' keeps the first max_length tokens, 'skip' drops them, 'error' stops."""
    min_length: int = 2
    """Shortest sample kept, in tokens: one anchor plus one token to predict is one usable block."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """JSON object of variables passed to the chat template with every row, e.g. '{"enable_thinking": false}'."""
    end_of_turn: str | None = None
    """Token that ends an assistant turn (one vocabulary entry); default: found from the template."""
    on_bad_row: BadRowPolicy = "error"
    """Malformed rows: 'error' stops naming file and row, 'skip' drops them and counts the reason."""
    dtype: Dtype = "bfloat16"
    """Compute dtype of the target; hidden states are stored as bf16 bits, or as --hidden-codec encodes them."""
    chunk_tokens: int = 256
    """Tokens per Zarr chunk of the hidden states (the small arrays are chunked coarsely, see shared/cache.py)."""
    compression_level: int = 1
    """zstd level of the stored chunks: 1, 3, 5, ..., 15 (blosc runs zstd at odd levels only)."""
    hidden_codec: HiddenCodecName = "bf16"
    """How hidden states are stored: 'bf16' lossless, or lossy 'fp8' (e4m3, a scale per token and layer),
    'int8' or 'int4' (a scale per --hidden-group-size channels); decoded to bf16 when read."""
    hidden_group_size: int = 128
    """Channels sharing one scale under --hidden-codec int8/int4 (must divide the hidden size; even for int4)."""
    hidden_scale_dtype: ScaleDtype = "float16"
    """dtype of the lossy codecs' scales; float32 where activations exceed what float16 scales hold."""
    topk_dtype: TopkDtype = "float32"
    """Precision of the stored top-k log-probs (read back as float32)."""

    # -- how it runs (not fingerprinted, except batch_tokens, lm_head_chunk, attn_implementation,
    #    which change padding or roundings, and the shard count)
    device: Device = "cuda"
    """'cuda' (cuda:LOCAL_RANK under torchrun, one process per GPU; cuda:0 alone) or 'cpu'."""
    shards: int | None = None
    """Shards of the cache: rank r of torchrun's W processes writes shards r, r + W, ...; default: W (1 alone)."""
    batch_tokens: int = 16384
    """Token budget of one forward batch, counting padding (batch size x longest sample)."""
    lm_head_chunk: int = 1024
    """Tokens per LM-head chunk: bounds the fp32 logits buffer to chunk x vocab."""
    attn_implementation: str | None = "sdpa"
    """Attention kernel passed to from_pretrained ('sdpa', 'eager', 'flash_attention_2'; none = HF default)."""
    commit_seconds: float = 30.0
    """Seconds between commits of a shard (a crash loses at most this much work); 0 = every batch."""
    queue_depth: int = 2
    """Batches in flight between the forward loop and the writer thread (bounds host memory)."""
    cpu_threads: int | None = None
    """torch threads of each CPU process; default: the machine's cores divided by torchrun's LOCAL_WORLD_SIZE."""
    compile_cache: str | None = None
    """Folder of compiled graphs kept between runs (the LM head's, on CUDA; None: $TORCHINDUCTOR_CACHE_DIR or ~/.cache/dflash/compile)."""
    summary_json: str | None = None
    """Also write the closing summary as JSON to this path."""
    progress: bool = True
    """Show the progress bar (stderr)."""
    wait_for_lock: bool = False
    """A shard whose lock another run holds: wait until it is released, instead of stopping with its holder named."""
    plan: bool = False
    """Only plan: tokenise and count the rows as the run would, estimate its bytes on disk and GPU-hours, and exit
    (no target forward, no weights loaded, nothing written)."""
    json: bool = False
    """With --plan: print the plan as one JSON document instead of the report."""
    ignore_free_space: bool = False
    """Start even where the output's free space is below the estimate of what the run still has to write."""
    batch_delay_s: float = field(default=0.0, metadata={"hidden": True})
    """Sleep after each batch (tests only: makes a run slow enough to interrupt midway)."""

    def validate(self) -> None:
        """Raise ValueError naming the first setting that cannot work."""
        check_choices(self)
        if self.compression_level not in ZSTD_LEVELS:
            raise ValueError(f"--compression-level {self.compression_level}: the cache's codec (zstd inside blosc) "
                             f"runs at zstd levels {', '.join(map(str, ZSTD_LEVELS))} only")
        for name in ("topk", "max_length", "min_length", "batch_tokens", "lm_head_chunk", "chunk_tokens",
                     "queue_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.commit_seconds < 0:
            raise ValueError(f"commit_seconds must be 0 or more, got {self.commit_seconds}")
        for name in ("cpu_threads", "shards"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        try:
            self.codec
        except ValueError as e:
            raise ValueError(f"--hidden-codec {self.hidden_codec}, --hidden-group-size {self.hidden_group_size}: {e}"
                             ) from None
        if self.json and not self.plan:
            raise ValueError("--json goes with --plan (a run writes its summary as JSON with --summary-json PATH)")
        if self.min_length > self.max_length:
            raise ValueError(f"min_length {self.min_length} exceeds max_length {self.max_length}")
        self._validate_template_kwargs()
        if self.end_of_turn is not None and not self.end_of_turn:
            raise ValueError("--end-of-turn is empty")

    def _validate_template_kwargs(self) -> None:
        if not isinstance(self.template_kwargs, dict):
            raise ValueError(f"--template-kwargs must be a JSON object, got {type(self.template_kwargs).__name__}")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(self.template_kwargs))
        if reserved:
            raise ValueError(f"--template-kwargs cannot set {reserved}: stage one sets those arguments of "
                             "apply_chat_template itself")
        try:
            json.dumps(self.template_kwargs, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--template-kwargs must hold JSON values only (they are fingerprinted): {e}") from None

    def layer_ids(self, num_target_layers: int) -> list[int]:
        """The target layers this run stores (--layers, or the default spread); ValueError where they cannot work."""
        layers = list(self.layers) if self.layers is not None else default_layer_ids(num_target_layers)
        check_layer_ids(layers, num_target_layers)
        return layers

    @property
    def codec(self):
        """The ``HiddenCodec`` of --hidden-codec, --hidden-group-size and --hidden-scale-dtype (ValueError where
        they cannot work together); imported here, where it is used, since it needs torch."""
        from dflash.shared.hidden_codecs import HiddenCodec

        return HiddenCodec(self.hidden_codec, self.hidden_group_size, self.hidden_scale_dtype)

    @property
    def render_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``extract.chat.render`` that come from these settings."""
        return {"end_of_turn": self.end_of_turn, "template_kwargs": dict(self.template_kwargs)}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
