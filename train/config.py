"""Training configuration: one dataclass per component, presets as plain functions. Each field is the
``dflash-train run`` flag of the same name (unique across sections), documented by its help."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from dflash.shared.cli import check_choices


@dataclass
class DrafterSpec:
    """What drafter to build (the rest of its shape comes from the target's config) and what it learns."""

    num_draft_layers: int = 5
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    gamma: float | None = None
    loss: Literal["ce", "kd", "mix"] = "kd"
    kd_weight: float = 0.5
    init_from_target_layers: list[int] | None = None


@dataclass
class DataConfig:
    """How cache samples become fixed-shape training batches."""

    context_buckets: list[int] = field(default_factory=lambda: [1024, 2048, 3072])
    max_anchors: int = 512
    batch_size: int = 16
    micro_batch_size: int = 1
    eval_samples: int | None = None
    train_samples: int | None = None
    num_workers: int = 2
    hidden_decode: Literal["auto", "loader", "device"] = "auto"
    preload: Literal["auto", "on", "off"] = "auto"


@dataclass
class OptimConfig:
    """AdamW with a cosine schedule after a linear warm-up."""

    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    epochs: float = 6.0
    max_steps: int | None = None


@dataclass
class RuntimeConfig:
    """Devices, precision, compile, logging and checkpointing."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    attention: Literal["auto", "flex", "dense", "flex-eager"] = "auto"
    compile: Literal["auto", "on", "off"] = "auto"
    compile_backend: str = "inductor"
    compile_cache: str | None = None
    autocast: Literal["auto", "bf16", "on", "off"] = "auto"
    parallel: Literal["ddp", "fsdp"] = "ddp"
    ce_chunk_size: int = 4096
    seed: int = 0
    log_every: int = 10
    eval_every: int = 500
    save_every: int = 1000
    keep_checkpoints: int = 3
    resume: str | None = "latest"
    stop_after: int | None = None
    peak_tflops: float = 790.0
    tensorboard: bool = True
    progress: bool = True


@dataclass
class TrainConfig:
    """One training run: where the cache, target and run folder are, and one section per component."""

    cache: str = ""
    target: str = ""
    out: str = ""
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
        return cls(**{k: v for k, v in d.items() if k not in kinds}, **{k: kinds[k](**d.get(k, {})) for k in kinds})

    def override(self, **values: Any) -> "TrainConfig":
        """Set fields by flat name (``max_anchors=64``, ``lr=1e-3``, ``cache=...``), each in its section."""
        for name, value in values.items():
            owner = next((s for s in (self, self.drafter, self.data, self.optim, self.runtime)
                          if name in {f.name for f in dataclasses.fields(s)}), None)
            if owner is None or dataclasses.is_dataclass(getattr(owner, name)):
                raise KeyError(f"TrainConfig has no field {name!r}")
            setattr(owner, name, value)
        return self

    def validate(self) -> None:
        """Raise ValueError naming the first setting that cannot work."""
        b = self.data.context_buckets
        if not b or any(x <= 0 for x in b) or sorted(set(b)) != list(b):
            raise ValueError(f"context_buckets must be increasing positive lengths, got {b}")
        if self.drafter.block_size < 2:
            raise ValueError("block_size must be at least 2 (an anchor and one prediction)")
        check_choices(self)
        values = {k: v for s in (self.drafter, self.data, self.optim, self.runtime) for k, v in vars(s).items()}
        for names, ok, want in (
                ("num_draft_layers max_anchors batch_size micro_batch_size train_samples max_steps "
                 "ce_chunk_size log_every eval_every save_every stop_after", lambda v: v >= 1, "at least 1"),
                ("eval_samples num_workers weight_decay grad_clip keep_checkpoints", lambda v: v >= 0, "0 or more"),
                ("gamma lr epochs peak_tflops", lambda v: v > 0, "above 0"),
                ("kd_weight min_lr_ratio warmup_ratio", lambda v: 0 <= v <= 1, "within [0, 1]"),
                ("beta1 beta2", lambda v: 0 <= v < 1, "within [0, 1)")):
            for name in names.split():
                v = values[name]
                if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and ok(v)):
                    raise ValueError(f"{name} must be {want}, got {v!r}")


def dflash_recipe() -> TrainConfig:
    """The DFlash recipe for 8B-class targets: the defaults."""
    return TrainConfig()


def tiny() -> TrainConfig:
    """A CPU-sized run for tests and demos: short contexts, few anchors, dense attention."""
    return TrainConfig().override(num_draft_layers=2, block_size=4, context_buckets=[32, 64], max_anchors=8,
                                  batch_size=4, micro_batch_size=2, num_workers=0, lr=3e-3, epochs=2, device="cpu",
                                  ce_chunk_size=64, log_every=1, eval_every=50, save_every=50, tensorboard=False,
                                  progress=False)


def small() -> TrainConfig:
    """For a small target on one GPU (SmolLM2-135M-Instruct; BENCHMARKS.md, the recipe): a steeper loss decay than
    block 8's default 4, since such a drafter rarely reaches the far positions; 12 loader workers read its samples
    once onto the GPU (--preload), or feed its short steps where they do not fit."""
    return TrainConfig().override(num_draft_layers=3, block_size=8, gamma=2.0, context_buckets=[512, 1024, 1536],
                                  max_anchors=256, batch_size=32, micro_batch_size=32, num_workers=12)


PRESETS = {"dflash": dflash_recipe, "small": small, "tiny": tiny}
