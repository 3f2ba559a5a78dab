"""Training configuration: one dataclass per component, presets as plain functions.

``TrainConfig`` holds the paths and one sub-config per component (``DrafterSpec``,
``DataConfig``, ``OptimConfig``, ``RuntimeConfig``); each function receives only the
sub-config it needs. Field names are unique across sub-configs, so the CLI exposes
every field as one flag (``--max-anchors 64``) without prefixes; ``Literal`` fields list
their choices once, for the CLI and for ``validate``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from dflash.shared.cli_options import check_choices
from dflash.shared.cli_options import override as override_fields


@dataclass
class DrafterSpec:
    """What drafter to build (the rest of its shape comes from the target's config) and what it learns."""

    num_draft_layers: int = 5
    """Decoder layers of the drafter (each the size of one target layer)."""
    block_size: int = 16
    """B: tokens per draft block (anchor + B-1 masks)."""
    target_layer_ids: list[int] | None = None
    """Target layers fed to the drafter (ascending, below L-1); None = the layers the cache stores."""
    mask_token_id: int | None = None
    """Embedding row of the MASK token, absent from the cache's input_ids; None = the tokenizer's <|MASK|>, else the
    first padded row, else the first special token (not eos/bos/pad or the template's) the cache never holds."""
    gamma: float | None = None
    """Decay of the per-slot loss weight exp(-(k-1)/gamma); None = 7/5/4 for B=16/10/8."""
    loss: Literal["ce", "kd", "mix"] = "kd"
    """ce | kd | mix: CE on the labels, KL from the target's stored top-k (+ tail bucket), or both."""
    kd_weight: float = 0.5
    """Weight of the KL term in mix: (1 - kd_weight) * CE + kd_weight * KL."""
    labels: Literal["data", "target"] = "data"
    """data | target: the cached token, or the target's own top-1 prediction of it, as the label."""
    init_from_target_layers: list[int] | None = None
    """Drafter layer i starts as a copy of target layer ids[i] (and its final norm as the target's); None = random."""


@dataclass
class DataConfig:
    """How cache samples become fixed-shape training batches."""

    context_buckets: list[int] = field(default_factory=lambda: [1024, 2048, 3072])
    """Context lengths a batch is padded to (one compiled graph each); the last is max length."""
    max_anchors: int = 512
    """N: anchor blocks per sequence (fewer candidates -> padded, invalid blocks)."""
    batch_size: int = 16
    """Global batch in sequences per optimizer step (all ranks, all accumulation steps)."""
    micro_batch_size: int = 1
    """Sequences per forward pass on one rank; accumulation = batch / (micro * world)."""
    eval_samples: int | None = None
    """Held-out samples (the dataset's last rows) for eval loss and acceptance; None = min(64, a tenth of the cache), at least 1."""
    num_workers: int = 2
    """DataLoader worker processes per rank (0 = load in the main process)."""
    prefetch_factor: int = 4
    """Batches each worker keeps ready."""
    hidden_decode: Literal["auto", "loader", "device"] = "auto"
    """Where a lossy cache's hidden states are decoded: in the loader workers, or on the training device
    after the copy (fewer bytes to copy, no CPU decode); 'auto' = device on CUDA. Same values either way."""


@dataclass
class OptimConfig:
    """AdamW with a cosine schedule after a linear warm-up."""

    lr: float = 6e-4
    """Peak learning rate."""
    min_lr_ratio: float = 0.0
    """Learning rate at the end of the cosine, as a fraction of lr."""
    warmup_ratio: float = 0.04
    """Fraction of all steps spent in linear warm-up."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 = no clipping)."""
    epochs: float = 6.0
    """Passes over the training samples (fractional allowed)."""
    max_steps: int | None = None
    """Optimizer steps in total; overrides epochs when set (defines the schedule)."""


@dataclass
class RuntimeConfig:
    """Devices, precision, compile, logging and checkpointing."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto | cpu | cuda (auto: cuda:LOCAL_RANK when CUDA is there)."""
    attention: Literal["auto", "flex", "dense", "flex-eager"] = "auto"
    """auto | flex | dense | flex-eager (auto: flex on CUDA, dense SDPA on CPU)."""
    compile: Literal["auto", "on", "off"] = "auto"
    """auto | on | off: torch.compile of the drafter (auto: on for CUDA only)."""
    compile_backend: str = "inductor"
    """torch.compile backend (tests use 'eager' to check guards without codegen)."""
    compile_cache: str | None = None
    """Compiled graphs kept for runs of the same shapes (None: $TORCHINDUCTOR_CACHE_DIR or ~/.cache/dflash/compile)."""
    autocast: Literal["auto", "bf16", "on", "off"] = "auto"
    """auto | bf16 | on | off: bf16 autocast around the forward (on = bf16; auto: bf16 on CUDA)."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """ddp | fsdp: data parallel replicas, or FSDP2 fully_shard for big drafters."""
    ce_chunk_size: int = 4096
    """Rows per chunk of the LM-head cross-entropy (bounds the logits memory)."""
    seed: int = 0
    """Seeds the drafter init, data order and anchor draws."""
    log_every: int = 10
    """Optimizer steps between log lines (also the only steps that call .item())."""
    eval_every: int = 500
    """Steps between held-out evaluations (and always at the last step)."""
    save_every: int = 1000
    """Steps between checkpoints (and always at the last step)."""
    keep_checkpoints: int = 3
    """Newest checkpoints kept (0 = keep all)."""
    resume: str | None = "latest"
    """Checkpoint folder to resume from, 'latest' (if any exists in the run) or None."""
    stop_after: int | None = None
    """Stop after this many steps without it being the last (simulates a kill)."""
    peak_tflops: float = 790.0
    """Device peak for MFU: 790 = bf16 matmul measured on H200 (datasheet 989)."""
    tensorboard: bool = True
    """Also write TensorBoard events when tensorboard is importable."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""


@dataclass
class TrainConfig:
    """One training run."""

    cache: str = ""
    """Path of the hidden-state cache (Zarr) written by dflash-extract."""
    target: str = field(default="", metadata={"exists": "model"})
    """Target model folder or name (config, tokenizer, embedding, LM head); default: the one the cache records."""
    out: str = ""
    """Run folder: checkpoints/, metrics.jsonl, config.json, tb/."""
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    @property
    def max_length(self) -> int:
        return self.data.context_buckets[-1]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        kinds = {"drafter": DrafterSpec, "data": DataConfig, "optim": OptimConfig, "runtime": RuntimeConfig}
        top = {k: v for k, v in d.items() if k not in kinds}
        return cls(**top, **{k: kinds[k](**d.get(k, {})) for k in kinds})

    def override(self, **values: Any) -> "TrainConfig":
        """Set fields by flat name (``max_anchors=64``, ``lr=1e-3``, ``cache=...``)."""
        return override_fields(self, values)

    def validate(self) -> None:
        b = self.data.context_buckets
        if not b or any(x <= 0 for x in b) or sorted(set(b)) != list(b):
            raise ValueError(f"context_buckets must be increasing positive lengths, got {b}")
        if self.drafter.block_size < 2:
            raise ValueError("block_size must be at least 2 (an anchor and one prediction)")
        check_choices(self)
        if not 0.0 <= self.drafter.kd_weight <= 1.0:
            raise ValueError(f"kd_weight must be within [0, 1], got {self.drafter.kd_weight}")
        if self.data.max_anchors < 1:
            raise ValueError("max_anchors must be at least 1")


def dflash_recipe() -> TrainConfig:
    """The DFlash recipe: AdamW lr 6e-4, cosine, warm-up 4%, clip 1.0, 6 epochs, max length 3072,
    512 anchors, B = 16 blocks, global batch 16 sequences, 5 drafter layers."""
    return TrainConfig()


def tiny() -> TrainConfig:
    """A CPU-sized run for tests and demos: short contexts, few anchors, dense attention."""
    cfg = TrainConfig()
    cfg.drafter.num_draft_layers = 2
    cfg.drafter.block_size = 4
    cfg.data.context_buckets = [32, 64]
    cfg.data.max_anchors = 8
    cfg.data.batch_size = 4
    cfg.data.micro_batch_size = 2
    cfg.data.num_workers = 0
    cfg.optim.lr = 3e-3
    cfg.optim.epochs = 2
    cfg.runtime.device = "cpu"
    cfg.runtime.ce_chunk_size = 64
    cfg.runtime.log_every = 1
    cfg.runtime.eval_every = 50
    cfg.runtime.save_every = 50
    cfg.runtime.tensorboard = False
    cfg.runtime.progress = False
    return cfg


PRESETS = {"dflash": dflash_recipe, "tiny": tiny}
PresetName = Literal["dflash", "tiny"]


@dataclass
class RunOptions:
    """``dflash-train run``'s own flags, beside every ``TrainConfig`` field."""

    preset: PresetName = "dflash"
    """Starting point (the defaults shown are the dflash preset's; tiny changes several); flags override its fields."""
    print_config: bool = False
    """Print the resolved config as JSON and exit."""


@dataclass
class ExportOptions:
    """``dflash-train export``: which checkpoint of a run, where, checked against which target."""

    run: str = field(metadata={"argument": True, "exists": "dir"})
    """The training run's folder."""
    out: str
    """Export folder (config.json + model.safetensors)."""
    checkpoint: str = "latest"
    """'latest', a step folder name (step_000100) or a checkpoint path."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """dtype of the exported weights."""
    target: str | None = field(default=None, metadata={"exists": "model"})
    """Target folder or hub name the export is checked against and served with; default: the run's."""
