"""Planning before any forward. Each shard's plan, fixed deterministically (ShardWriter checks its digest): samples
longest first (an out-of-memory batch shows at once), ties by source row, cut greedily into batches of
``batch_tokens`` padded. Then what the run will cost (``dflash-extract --plan``: every shard planned so, bytes and
GPU-hours estimated from measured ratios and rate), and the free-space check before a run writes."""

from __future__ import annotations

import itertools
import logging
import math
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from dflash.shared.cache import ShardPlan
from dflash.shared.compression import is_local, size_text

from .chat import Rendering, encode, rendering, to_sample
from .config import ExtractConfig, ExtractFailed, checked_layers, load_tokenizer_and_config
from .data import DataError, SkipCounter, SkippedSample, guard, load_source, normalize_row

log = logging.getLogger(__name__)


@dataclass
class PlannedShard:
    plan: ShardPlan
    input_ids: np.ndarray  # (T,) int32: every planned sample's ids, concatenated in plan order
    loss_mask: np.ndarray  # (T,) bool
    truncated: int  # samples cut to max_length by right truncation


def shard_rows(num_rows: int, num_shards: int, shard_id: int) -> tuple[int, int]:
    """The contiguous row range [start, stop) that shard ``shard_id`` owns."""
    return shard_id * num_rows // num_shards, (shard_id + 1) * num_rows // num_shards


def shard_slice(ds, num_shards: int, shard_id: int):
    """(the rows shard ``shard_id`` owns, the index of its first row) of a dataset or a list of rows."""
    start, stop = shard_rows(len(ds), num_shards, shard_id)
    return (ds.select(range(start, stop)) if hasattr(ds, "select") else ds[start:stop]), start


def length_bucketed_batches(lengths: np.ndarray, source_index: np.ndarray, batch_tokens: int
                            ) -> tuple[np.ndarray, np.ndarray]:
    """(order, batches): the samples' write order and each batch's sample offsets."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.lexsort((np.asarray(source_index, dtype=np.int64), -lengths))
    batches, longest = [0], 0
    for pos, sample in enumerate(order):
        if pos > batches[-1] and (pos - batches[-1] + 1) * longest > batch_tokens:
            batches.append(pos)
        if pos == batches[-1]:
            longest = int(lengths[sample])  # sorted descending: the first is the longest
    if len(order):
        batches.append(len(order))
    return order, np.asarray(batches, dtype=np.int64)


PLAN_ROWS = 256  # rows rendered, then tokenised in one batch (the tokenizer spreads it over the cores)


def plan_shard(rows, row_offset: int, source: str, tokenizer, cfg: ExtractConfig,
               on_row: Callable[[int], None] = lambda done: None) -> PlannedShard:
    """Tokenise and plan ``rows`` (numbered from ``row_offset``); DataError on the first bad row unless
    ``cfg.on_bad_row == "skip"``. ``on_row(done)`` after every 256 rows and the last."""
    skips, kept_rows, samples = SkipCounter(), [], []

    def rendered(row: dict, index: int) -> Rendering | DataError:  # an error is raised in row order, below
        try:
            conv = normalize_row(row, index, source)
            return rendering(tokenizer, conv, end_of_turn=cfg.end_of_turn, template_kwargs=cfg.template_kwargs)
        except DataError as e:
            return e

    def one(r: Rendering | DataError, encoded: Iterator, index: int):
        if isinstance(r, DataError):
            raise r
        sample = to_sample(r, *next(encoded), max_length=cfg.max_length, truncation=cfg.truncation)
        if len(sample.input_ids) < cfg.min_length:
            raise SkippedSample("too_short", source, index,
                                f"{len(sample.input_ids)} tokens < min_length {cfg.min_length}")
        return sample

    numbered = enumerate(rows, start=row_offset)
    while chunk := [(index, rendered(row, index)) for index, row in itertools.islice(numbered, PLAN_ROWS)]:
        encoded = iter(encode(tokenizer, [r for _, r in chunk if isinstance(r, Rendering)]))
        for index, r in chunk:
            if (sample := guard(cfg.on_bad_row, skips, one, r, encoded, index)) is not None:
                kept_rows.append(index)
                samples.append(sample)
        on_row(chunk[-1][0] - row_offset + 1)  # the last chunk's is len(rows)
    source_index = np.asarray(kept_rows, dtype=np.int64)
    lengths = np.asarray([len(x.input_ids) for x in samples], dtype=np.int64)
    order, batches = length_bucketed_batches(lengths, source_index, cfg.batch_tokens)
    plan = ShardPlan(source_index=source_index[order], lengths=lengths[order], batches=batches,
                     skipped=skips.to_dict())
    input_ids = np.concatenate([np.zeros(0, np.int32)] + [samples[i].input_ids for i in order])  # (T,) int32
    loss_mask = np.concatenate([np.zeros(0, bool)] + [samples[i].loss_mask for i in order])
    return PlannedShard(plan, input_ids, loss_mask, sum(x.truncated for x in samples))


def bad_row_message(e: DataError, cfg: ExtractConfig) -> str:
    """The error (naming file and row) with the flag that would handle such a row."""
    hint = "" if cfg.on_bad_row == "skip" else " (--on-bad-row skip counts and skips such rows)"
    if e.reason == "too_long" and cfg.truncation == "error":
        hint = " (--truncation right|skip handles long samples)"
    return f"{e}{hint}"


# stored over encoded bytes of the hidden states per codec, and of the other arrays (BENCHMARKS_LOG.md, issue 16)
HIDDEN_STAGE_RATIO = {"bf16": (28_159 / 40_960, "bf16"), "fp8": (16_780 / 20_490, "fp8, float16 scales"),
                      "int8": (19_548 / 20_800, "int8, groups of 128, float16 scales"),
                      "int4": (8_907 / 10_560, "int4, groups of 128, float16 scales")}
SMALL_ARRAYS_RATIO = (28_350 - 28_159) / (4 + 1 + 4 * 64 + 4 * 64)
TOPK_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

# the extraction rate measured on one GPU (BENCHMARKS_LOG.md, "One write path") and the config it is scaled from
REFERENCE = {"shape": "Qwen3-8B", "gpu": "H200", "sample_tokens": 2048, "tokens_per_s": 27_870}
REFERENCE_CONFIG = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)


def size_estimate(num_layers: int, hidden_size: int, topk: int, codec=None, topk_dtype: str = "float32"
                  ) -> dict[str, Any]:
    """Expected bytes on disk per token, as ``--plan --json`` prints them: each array's encoded bytes (bf16 without
    ``codec``) times its measured lossless-stage ratio; the hidden states also raw in bf16, what ratios compare to."""
    from dflash.shared.hidden_codecs import HiddenCodec

    codec = codec or HiddenCodec("bf16")
    ratio, measured_at = HIDDEN_STAGE_RATIO[codec.mode]
    encoded = codec.bytes_per_token(num_layers, hidden_size)
    other = 4 + 1 + topk * (4 + TOPK_DTYPE_BYTES[topk_dtype])  # ids, mask, top-k ids and log-probs
    return {"hidden_codec": codec.mode, "codec": codec.describe(),
            "hidden_raw_bf16_per_token": num_layers * hidden_size * 2, "hidden_encoded_per_token": encoded,
            "hidden_stage_ratio": ratio, "ratio_measured_at": measured_at, "hidden_per_token": encoded * ratio,
            "other_raw_per_token": other, "other_per_token": other * SMALL_ARRAYS_RATIO,
            "per_token": encoded * ratio + other * SMALL_ARRAYS_RATIO}


def total_bytes(size: dict[str, Any], tokens: int, samples: int) -> int:
    """Bytes of ``tokens`` tokens in ``samples`` samples (offsets and source rows: 16 bytes a sample)."""
    return int(math.ceil(tokens * size["per_token"] + 16 * samples))


def matmul_parameters(model_config) -> int:
    """Weights of the target's linear layers, LM head included (2 FLOPs each per token), counted on
    a model built on the meta device: no memory, no weights read."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def attention_flops_per_token(model_config, sequence_tokens: int) -> float:
    """Scores and weighted values of causal attention per token of a ``sequence_tokens`` sequence
    (each token attends to half of it on average): 2 x 2 x heads x head_dim x tokens / 2 per layer."""
    c = model_config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2.0 * c.num_hidden_layers * c.num_attention_heads * head_dim * sequence_tokens


def time_estimate(model_config, max_length: int, tokens: int, gpus: int) -> dict[str, Any]:
    """GPU-hours for ``tokens`` forward tokens (padding included) at the reference rate, scaled by
    FLOPs per token (2 x linear weights + attention) at ``max_length``."""
    from transformers import Qwen3Config

    params = matmul_parameters(model_config)
    flops = 2.0 * params + attention_flops_per_token(model_config, max_length)
    c = Qwen3Config(**REFERENCE_CONFIG)
    ref = 2.0 * matmul_parameters(c) + attention_flops_per_token(c, REFERENCE["sample_tokens"])
    per_gpu, gpus = REFERENCE["tokens_per_s"] * ref / flops, max(1, gpus)
    return {"reference": {**REFERENCE, "flops_per_token": ref}, "matmul_parameters": params, "flops_per_token": flops,
            "tokens_per_s_per_gpu": per_gpu, "gpu_hours": tokens / per_gpu / 3600, "gpus": gpus,
            "wall_hours": tokens / per_gpu / 3600 / gpus, "estimate": True}


def free_bytes(out: str) -> tuple[int, str] | None:
    """(free bytes, the nearest existing folder of ``out``) for a local ``out``; None for fsspec URLs."""
    if not is_local(out):
        return None
    where = os.path.abspath(out)
    while not os.path.exists(where) and os.path.dirname(where) != where:  # up to the first folder that exists
        where = os.path.dirname(where)
    return shutil.disk_usage(where).free, where


def run_space_problem(cfg, spec, planned: dict[int, dict[str, int]], committed: dict[int, Any]) -> str | None:
    """The message naming both numbers where ``cfg.out`` has less free space than what is left to write
    (each shard's planned ``tokens``/``samples`` minus its ``committed``), else None; URLs are not checked."""
    free = free_bytes(cfg.out)
    if free is None:
        log.info("%s: free space not checked (an fsspec URL)", cfg.out)
        return None
    available, where = free
    size = size_estimate(spec.num_layers, spec.hidden_size, spec.topk, spec.codec, spec.topk_dtype)
    left = {k: sum(max(0, p[k] - getattr(committed.get(s), k, 0)) for s, p in planned.items())
            for k in ("tokens", "samples")}
    needed = total_bytes(size, left["tokens"], left["samples"])
    resumed = any(getattr(committed.get(s), "tokens", 0) for s in planned)
    what = f"{'the rest of ' if resumed else ''}this run ({left['tokens']:,} tokens x {size['per_token']:,.0f} B/token)"
    if available >= needed:
        log.info("%s: %s free, %s needs about %s (an estimate)", cfg.out, size_text(available), what,
                 size_text(needed))
        return None
    return (f"not enough free space for {cfg.out}: {size_text(available)} ({available:,} B) free at {where}, "
            f"{what} needs about {size_text(needed)} ({needed:,} B, an estimate from measured compression ratios). "
            "Free some space, choose another --out, or rerun with --ignore-free-space to start anyway")


def count_run(cfg: ExtractConfig, tokenizer, ds, num_shards: int) -> dict[str, Any]:
    """Plan each shard's slice of ``ds`` as the run will and sum what the plans hold (padded tokens:
    each batch's size x its longest sample). Raises DataError on a bad row as the run does."""
    from tqdm import tqdm

    counts, skipped, longest = Counter(rows=len(ds), shards=num_shards), Counter(), 0
    with tqdm(total=len(ds), unit="row", desc="planning", dynamic_ncols=True, disable=not cfg.progress) as bar:
        for shard in range(num_shards):
            planned = plan_shard(*shard_slice(ds, num_shards, shard), cfg.data, tokenizer, cfg,
                                 on_row=lambda done, base=bar.n: bar.update(base + done - bar.n))
            plan = planned.plan
            skipped.update(plan.skipped)
            sizes = plan.batches[1:] - plan.batches[:-1]
            counts.update(samples=len(plan.source_index), truncated=planned.truncated, tokens=plan.num_tokens,
                          assistant_tokens=int(planned.loss_mask.sum()),
                          padded_tokens=int((sizes * plan.lengths[plan.batches[:-1]]).sum()))
            longest = max(longest, int(plan.lengths.max(initial=0)))
    return {**counts, "skipped": dict(sorted(skipped.items())), "longest": longest}


def plan_run(cfg: ExtractConfig) -> dict[str, Any]:
    """The plan as ``--json`` prints it; ExtractFailed, with the run's own message, where a run would stop."""
    tokenizer, model_config = load_tokenizer_and_config(cfg)
    num_shards = cfg.shards or int(os.environ.get("WORLD_SIZE", "1"))
    layers = checked_layers(cfg, model_config)
    size = size_estimate(len(layers), model_config.hidden_size, cfg.topk, cfg.codec, cfg.topk_dtype)
    try:
        counts = count_run(cfg, tokenizer, load_source(cfg.data, cfg.split or "train"), num_shards)
    except DataError as e:
        raise ExtractFailed(bad_row_message(e, cfg)) from e
    gpus = num_shards if cfg.device == "cuda" else 1  # one per shard, as torchrun runs them
    expected, free = total_bytes(size, counts["tokens"], counts["samples"]), free_bytes(cfg.out)
    return {
        "plan": True, "data": cfg.data, "model": cfg.model, "out": cfg.out, **counts, "layers": layers,
        "num_target_layers": model_config.num_hidden_layers, "hidden_size": model_config.hidden_size,
        "topk": cfg.topk,
        "bytes": {**size, "expected": expected, "raw_bf16_hidden": counts["tokens"] * size["hidden_raw_bf16_per_token"],
                  "estimate": True},
        "free_space": free and {"bytes": free[0], "at": free[1], "enough": free[0] >= expected},
        "time": {**time_estimate(model_config, cfg.max_length, counts["padded_tokens"], gpus), "device": cfg.device,
                 "dtype": cfg.dtype},
    }


def format_plan(doc: dict[str, Any], cfg: ExtractConfig) -> str:
    """The plan as a short report; every estimate says it is one and where it comes from."""
    s, t, expected = doc["bytes"], doc["time"], doc["bytes"]["expected"]
    ref = t["reference"]
    skipped = ", ".join(f"{k}={v:,}" for k, v in doc["skipped"].items()) or "none"
    share = f", {doc['assistant_tokens'] / doc['tokens']:.1%}" if doc["tokens"] else ""
    h = t["wall_hours"]
    wall = f"{h * 3600:.0f} s" if h < 1 / 60 else f"{h * 60:.1f} min" if h < 1 else f"{h:,.1f} h"
    lines = [
        f"plan of dflash-extract (nothing computed, nothing written): {cfg.data} -> {cfg.out}",
        f"  rows             {doc['rows']:,} in {doc['shards']} shard{'s' if doc['shards'] != 1 else ''}",
        f"  samples          {doc['samples']:,} stored; {sum(doc['skipped'].values()):,} rows skipped ({skipped}); "
        f"{doc['truncated']:,} truncated to --max-length {cfg.max_length}",
        f"  tokens           {doc['tokens']:,} ({doc['assistant_tokens']:,} assistant{share}); longest sample "
        f"{doc['longest']:,}; {doc['padded_tokens']:,} computed with the batches' padding",
        f"  cache            layers {','.join(map(str, doc['layers']))} of {doc['num_target_layers']} (hidden size "
        f"{doc['hidden_size']:,}), top-{cfg.topk} ({cfg.topk_dtype}), hidden {s['codec']}",
        f"  on disk          about {size_text(expected)} ({s['per_token']:,.0f} B/token: hidden states "
        f"{s['hidden_per_token']:,.0f}, the rest {s['other_per_token']:,.0f}; raw bf16 hidden states "
        f"{s['hidden_raw_bf16_per_token']:,} B/token). An estimate: {s['hidden_encoded_per_token']:,} encoded "
        f"B/token x {s['hidden_stage_ratio']:.3f}, the compression measured for {s['ratio_measured_at']}",
    ]
    if free := doc["free_space"]:
        enough = ("enough for the whole run" if free["enough"]
                  else "NOT enough for the whole run: a fresh run would refuse to start")
        lines.append(f"  free space       {size_text(free['bytes'])} at {free['at']} ({enough})")
    lines.append(
        f"  GPU time         about {t['gpu_hours']:,.3g} {ref['gpu']} GPU-hours, {wall} on {t['gpus']} "
        f"GPU{'s' if t['gpus'] != 1 else ''} (start-up not included). An estimate: {ref['tokens_per_s']:,.0f} tok/s "
        f"measured on one {ref['gpu']} for the {ref['shape']} shape, scaled by forward FLOPs per token "
        f"(2 x {t['matmul_parameters'] / 1e9:,.3g} B linear weights + attention at {cfg.max_length:,} tokens: "
        f"{t['flops_per_token'] / 1e9:,.3g} GFLOP against {ref['flops_per_token'] / 1e9:,.3g}) to "
        f"{t['tokens_per_s_per_gpu']:,.0f} tok/s per GPU")
    if cfg.device != "cuda" or cfg.dtype != "bfloat16":
        lines.append(f"  note             the rate was measured on a GPU in bf16; this run is --device {cfg.device} "
                     f"--dtype {cfg.dtype}")
    return "\n".join(lines)
