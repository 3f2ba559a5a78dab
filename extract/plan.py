"""Plan one shard before any forward, deterministically (ShardWriter checks its digest): samples longest first (an
out-of-memory batch shows at once), ties by source row, cut greedily into batches of ``batch_tokens`` padded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from dflash.shared.cache import ShardPlan

from .chat import render
from .config import ExtractConfig
from .data import SkipCounter, SkippedSample, guard, normalize_row


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


def plan_shard(rows, row_offset: int, source: str, tokenizer, cfg: ExtractConfig,
               on_row: Callable[[int], None] = lambda done: None) -> PlannedShard:
    """Tokenise and plan ``rows`` (numbered from ``row_offset``); DataError on the first bad row unless
    ``cfg.on_bad_row == "skip"``. ``on_row(done)`` every 256 rows."""
    skips, kept_rows, samples = SkipCounter(), [], []

    def one(row: dict, index: int):
        conv = normalize_row(row, index, source)
        sample = render(tokenizer, conv, max_length=cfg.max_length, truncation=cfg.truncation,
                        end_of_turn=cfg.end_of_turn, template_kwargs=cfg.template_kwargs)
        if len(sample.input_ids) < cfg.min_length:
            raise SkippedSample("too_short", source, index,
                                f"{len(sample.input_ids)} tokens < min_length {cfg.min_length}")
        return sample

    for index, row in enumerate(rows, start=row_offset):
        if (sample := guard(cfg.on_bad_row, skips, one, row, index)) is not None:
            kept_rows.append(index)
            samples.append(sample)
        if (index - row_offset + 1) % 256 == 0:
            on_row(index - row_offset + 1)
    on_row(len(rows))
    source_index = np.asarray(kept_rows, dtype=np.int64)
    lengths = np.asarray([len(x.input_ids) for x in samples], dtype=np.int64)
    order, batches = length_bucketed_batches(lengths, source_index, cfg.batch_tokens)
    plan = ShardPlan(source_index=source_index[order], lengths=lengths[order], batches=batches,
                     skipped=skips.to_dict())
    input_ids = np.concatenate([np.zeros(0, np.int32)] + [samples[i].input_ids for i in order])  # (T,) int32
    loss_mask = np.concatenate([np.zeros(0, bool)] + [samples[i].loss_mask for i in order])
    return PlannedShard(plan, input_ids, loss_mask, sum(x.truncated for x in samples))
