"""``dflash-extract --plan``: what a run would store and cost, before any of it runs.

The rows are tokenised and planned shard by shard by the workers' own planning
(``extract.plan.plan_shard`` on each shard's slice), so the counts (samples, skips by
reason, truncated samples, tokens, assistant tokens) are the ones the run will record;
only the target's config is read, never its weights. Bytes on disk and GPU-hours are
estimates (``extract.estimates``).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash.shared.compression import size_text

from .config import ExtractConfig
from .estimates import SizeEstimate, TimeEstimate, free_bytes, size_estimate, time_estimate


@dataclass
class PlanCounts:
    """What planning every shard found, summed over the shards."""

    rows: int = 0
    """Rows of the dataset."""
    shards: int = 0
    """Shards the rows were planned in (as the run splits them)."""
    samples: int = 0
    """Samples the run will store."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Rows not stored, by reason (as the cache records them)."""
    truncated: int = 0
    """Stored samples cut to --max-length (right truncation)."""
    tokens: int = 0
    """Tokens stored."""
    assistant_tokens: int = 0
    """Tokens under the loss mask."""
    padded_tokens: int = 0
    """Tokens the target computes: each planned batch's size x its longest sample."""
    longest: int = 0
    """Longest stored sample, in tokens."""


def count_run(cfg: ExtractConfig, tokenizer, ds, num_shards: int, progress: bool = True) -> PlanCounts:
    """Plan each shard's slice of ``ds`` as its worker will, and sum what the plans hold.

    Raises DataError on the first bad row unless ``cfg.on_bad_row == "skip"``, as the run does.
    """
    from tqdm import tqdm

    from .plan import plan_shard, shard_rows

    counts = PlanCounts(rows=len(ds), shards=num_shards)
    skipped: Counter[str] = Counter()
    bar = tqdm(total=len(ds), unit="row", desc="planning", dynamic_ncols=True, disable=not progress)
    try:
        for shard in range(num_shards):
            start, stop = shard_rows(len(ds), num_shards, shard)
            rows = ds.select(range(start, stop)) if hasattr(ds, "select") else ds[start:stop]
            seen = [0]

            def advance(done: int) -> None:
                bar.update(done - seen[0])
                seen[0] = done

            planned = plan_shard(rows, start, cfg.data, tokenizer, cfg, on_row=advance)
            plan = planned.plan
            skipped.update(plan.skipped)
            counts.samples += len(plan.source_index)
            counts.truncated += planned.truncated
            counts.tokens += plan.num_tokens
            counts.assistant_tokens += planned.assistant_tokens
            sizes = plan.batches[1:] - plan.batches[:-1]
            counts.padded_tokens += int((sizes * plan.lengths[plan.batches[:-1]]).sum())
            counts.longest = max(counts.longest, int(plan.lengths.max(initial=0)))
    finally:
        bar.close()
    counts.skipped = dict(sorted(skipped.items()))
    return counts


@dataclass
class RunPlan:
    """The plan's report: counts, expected bytes and GPU time."""

    data: str
    model: str
    out: str
    counts: PlanCounts
    layers: list[int]
    num_target_layers: int
    hidden_size: int
    topk: int
    size: SizeEstimate
    time: TimeEstimate
    free: tuple[int, str] | None
    """(free bytes, folder) at --out; None for URLs."""
    device: str
    dtype: str

    @property
    def expected_bytes(self) -> int:
        return self.size.total(self.counts.tokens, self.counts.samples)

    def as_dict(self) -> dict[str, Any]:
        return {
            "plan": True, "data": self.data, "model": self.model, "out": self.out, **asdict(self.counts),
            "layers": self.layers, "num_target_layers": self.num_target_layers, "hidden_size": self.hidden_size,
            "topk": self.topk,
            "bytes": {**self.size.as_dict(), "expected": self.expected_bytes,
                      "raw_bf16_hidden": self.counts.tokens * self.size.hidden_raw_bf16, "estimate": True},
            "free_space": None if self.free is None else {"bytes": self.free[0], "at": self.free[1],
                                                          "enough": self.free[0] >= self.expected_bytes},
            "time": {**self.time.as_dict(), "estimate": True, "device": self.device, "dtype": self.dtype},
        }


def plan_run(cfg: ExtractConfig) -> RunPlan:
    """Tokenise and plan ``cfg``'s dataset as the run would and estimate its cost; raises
    ExtractFailed with the run's own message where the run would stop (bad settings, a bad row)."""
    from .data import DataError, load_source
    from .runner import ExtractFailed, checked_layers, load_tokenizer_and_config

    try:
        cfg.validate()
    except ValueError as e:
        raise ExtractFailed(str(e)) from e
    num_shards = cfg.shards or int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer, model_config = load_tokenizer_and_config(cfg)
    layers = checked_layers(cfg, model_config)
    size = size_estimate(len(layers), model_config.hidden_size, cfg.topk, cfg.codec, cfg.topk_dtype)
    try:
        ds = load_source(cfg.data, cfg.split or "train")
        counts = count_run(cfg, tokenizer, ds, num_shards, progress=cfg.progress)
    except DataError as e:
        from .worker import bad_row_message

        raise ExtractFailed(bad_row_message(e, cfg)) from e
    gpus = num_shards if cfg.device == "cuda" else 1  # one per shard, as torchrun runs them
    return RunPlan(
        data=cfg.data, model=cfg.model, out=cfg.out, counts=counts, layers=layers,
        num_target_layers=model_config.num_hidden_layers, hidden_size=model_config.hidden_size, topk=cfg.topk,
        size=size, time=time_estimate(model_config, cfg.max_length, counts.padded_tokens, gpus),
        free=free_bytes(cfg.out), device=cfg.device, dtype=cfg.dtype)


def _hours(h: float) -> str:
    return f"{h * 3600:.0f} s" if h < 1 / 60 else f"{h * 60:.1f} min" if h < 1 else f"{h:,.1f} h"


def format_plan(p: RunPlan, cfg: ExtractConfig) -> str:
    """The plan as a short report; every estimate says it is one and where it comes from."""
    c, s, t = p.counts, p.size, p.time
    skipped = ", ".join(f"{k}={v:,}" for k, v in c.skipped.items()) or "none"
    share = f", {c.assistant_tokens / c.tokens:.1%}" if c.tokens else ""
    lines = [
        f"plan of dflash-extract (nothing computed, nothing written): {p.data} -> {p.out}",
        f"  rows             {c.rows:,} in {c.shards} shard{'s' if c.shards != 1 else ''}",
        f"  samples          {c.samples:,} stored; {sum(c.skipped.values()):,} rows skipped ({skipped}); "
        f"{c.truncated:,} truncated to --max-length {cfg.max_length}",
        f"  tokens           {c.tokens:,} ({c.assistant_tokens:,} assistant{share}); longest sample {c.longest:,}; "
        f"{c.padded_tokens:,} computed with the batches' padding",
        f"  cache            layers {','.join(map(str, p.layers))} of {p.num_target_layers} (hidden size "
        f"{p.hidden_size:,}), top-{p.topk} ({cfg.topk_dtype}), hidden {s.codec.describe()}",
        f"  on disk          about {size_text(p.expected_bytes)} ({s.per_token:,.0f} B/token: hidden states "
        f"{s.hidden_per_token:,.0f}, the rest {s.other_per_token:,.0f}; raw bf16 hidden states "
        f"{s.hidden_raw_bf16:,} B/token). An estimate: {s.hidden_encoded:,} encoded B/token x {s.hidden_ratio:.3f}, "
        f"the compression measured for {s.ratio_measured_at}",
    ]
    if p.free is not None:
        enough = ("enough for the whole run" if p.free[0] >= p.expected_bytes
                  else "NOT enough for the whole run: a fresh run would refuse to start")
        lines.append(f"  free space       {size_text(p.free[0])} at {p.free[1]} ({enough})")
    ref = t.reference
    lines.append(
        f"  GPU time         about {t.gpu_hours:,.3g} {ref.gpu} GPU-hours, {_hours(t.wall_hours)} on {t.gpus} "
        f"GPU{'s' if t.gpus != 1 else ''} (start-up not included). An estimate: {ref.tokens_per_s:,.0f} tok/s "
        f"measured on one {ref.gpu} for the {ref.shape} shape, scaled by forward FLOPs per token "
        f"(2 x {t.matmul_parameters / 1e9:,.3g} B linear weights + attention at {cfg.max_length:,} tokens: "
        f"{t.flops_per_token / 1e9:,.3g} GFLOP against {t.reference_flops_per_token / 1e9:,.3g}) to "
        f"{t.tokens_per_s_per_gpu:,.0f} tok/s per GPU")
    if cfg.device != "cuda" or cfg.dtype != "bfloat16":
        lines.append(f"  note             the rate was measured on a GPU in bf16; this run is --device {cfg.device} "
                     f"--dtype {cfg.dtype}")
    return "\n".join(lines)
