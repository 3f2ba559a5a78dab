"""Cache samples -> fixed-shape batches (one compiled graph per context bucket) in a resumable order; randomness is
keyed, never stateful: anchors from (seed, epoch, index), epoch e's order from (seed, e), step s reads batch s."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from dflash.shared.cache import HIDDEN_SCALE, CacheReader
from dflash.shared.hidden_codecs import EncodedHidden, HiddenCodec, decode

EVAL_EPOCH = 2**31 - 1  # epoch key of the held-out samples' anchors: every eval sees the same blocks
_ORDER_SALT = 0x5EED
TARGET_FIELDS = ("target_top1", "topk_ids", "topk_logprobs")  # what the target predicted, where asked for
ENCODED_FIELDS = ("context_payload", "context_scale")  # a lossy cache's context still encoded (decode_on_device)
PER_TOKEN_FIELDS = ("input_ids", "loss_mask", "context_hidden") + ENCODED_FIELDS + TARGET_FIELDS  # padded, cut


@dataclass
class EncodedContext:
    """A batch's context still encoded: ``to(device)`` copies the fewer bytes and decodes there, bitwise
    the (Bsz, S, n*D) bf16 tensor ``Collate`` gives otherwise."""

    payload: torch.Tensor  # (Bsz, S, n, W) uint8, padded with the codec's zero byte
    scales: torch.Tensor  # (Bsz, S, n, G), padded with 0
    codec: HiddenCodec

    def pin_memory(self) -> "EncodedContext":
        return EncodedContext(self.payload.pin_memory(), self.scales.pin_memory(), self.codec)

    def to(self, device, non_blocking: bool = False) -> torch.Tensor:
        encoded = EncodedHidden(*(t.to(device, non_blocking=non_blocking) for t in (self.payload, self.scales)))
        return decode(self.codec, encoded).flatten(2)  # (Bsz, S, n * D) bf16


def candidate_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions a block may start at, ascending: assistant tokens at 1 <= a <= T-2."""
    return torch.nonzero(loss_mask[1:-1], as_tuple=False).flatten() + 1


def draw_anchors(loss_mask: torch.Tensor, max_anchors: int, seed: int, epoch: int, index: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors (N,), valid (N,)): up to ``max_anchors`` sorted candidates drawn by an RNG keyed on
    (seed, epoch, index), padded."""
    if len(cand := candidate_anchors(loss_mask)) > max_anchors:
        pick = np.sort(np.random.default_rng([seed, epoch, index]).choice(len(cand), size=max_anchors, replace=False))
        cand = cand[torch.from_numpy(pick)]
    return _padded_anchors(cand, max_anchors)


def _padded_anchors(cand: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    anchors, valid = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.bool)
    anchors[: len(cand)], valid[: len(cand)] = cand, True
    return anchors, valid


class AnchorDataset(Dataset):
    """Item ``(epoch, index)`` -> one unpadded sequence: input_ids, loss_mask, context_hidden (T, n*D),
    anchors, block_valid and, as asked, target_top1 (at t: its prediction of t + 1), topk_ids/logprobs."""

    def __init__(self, reader: CacheReader, layer_ids: list[int], max_length: int, max_anchors: int, seed: int,
                 target_top1: bool = True, topk: bool = False, decode_on_device: bool = False):
        self.reader, self.codec = reader, reader.spec.codec
        self.decode_on_device = decode_on_device and self.codec.lossy  # else the loader workers decode
        self.target_top1, self.topk = target_top1, topk
        self.fields = ("input_ids", "loss_mask", "hidden") + (("topk_ids",) if target_top1 or topk else ()) \
            + (("topk_logprobs",) if topk else ())  # the cache arrays read for each sample
        self.slots = reader.layer_slots(layer_ids)
        self._all_slots = self.slots == list(range(reader.spec.num_layers))  # the context is then a view
        self.max_length, self.max_anchors, self.seed = max_length, max_anchors, seed
        self.resident: dict[int, dict[str, torch.Tensor]] | None = None  # preload's copy: index -> sample

    def __getitem__(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        """Index -1: ``empty_sample``."""
        epoch, index = key
        s = self.sample(int(index)) if index >= 0 else self._empty()
        T = min(len(s["input_ids"]), self.max_length)
        loss_mask = s["loss_mask"][:T]
        anchors, valid = draw_anchors(loss_mask, self.max_anchors, self.seed, int(epoch), int(index))
        out = {"input_ids": s["input_ids"][:T], "loss_mask": loss_mask, "anchors": anchors, "block_valid": valid}
        if self.decode_on_device:
            out["context_payload"], out["context_scale"] = s["hidden"][:T], s[HIDDEN_SCALE][:T]  # (T, n, W), (T, n, G)
            out["hidden_codec"] = self.codec
        else:
            out["context_hidden"] = s["hidden"][:T].reshape(T, -1)
        if self.target_top1:
            out["target_top1"] = s["topk_ids"][:T, 0]
        if self.topk:
            out["topk_ids"], out["topk_logprobs"] = s["topk_ids"][:T], s["topk_logprobs"][:T]
        return out

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """Sample ``index``'s arrays as batches use them: the chosen layers only, a lossy context still encoded
        with ``decode_on_device``; from the preloaded copy where there is one."""
        if self.resident is not None:
            return self.resident[index]
        return self._chosen(self.reader.read(index, self.fields, decode=not self.decode_on_device))

    def samples(self, indices: Iterable[int]):
        """``(index, sample(index))`` for ascending ``indices``, read from the cache span by span (preload)."""
        for index, s in self.reader.read_many(indices, self.fields, decode=not self.decode_on_device):
            yield index, self._chosen(s)

    def _chosen(self, s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The per-layer arrays (T, L, ...) cut to the chosen layers (T, n, ...), left whole where they are all."""
        if self._all_slots:
            return s
        slots = torch.tensor(self.slots)
        return {k: v.index_select(1, slots) if k in ("hidden", HIDDEN_SCALE) else v for k, v in s.items()}

    def every_anchor(self, index: int, fixed_shape: bool = True) -> list[dict[str, torch.Tensor]]:
        """Sample ``index`` as items that together hold a block at every candidate anchor: of
        ``max_anchors`` blocks each with ``fixed_shape`` (compiled shapes), else one item."""
        sample = self[(EVAL_EPOCH, index)]
        cand = candidate_anchors(sample["loss_mask"])
        per_item = self.max_anchors if fixed_shape else max(len(cand), 1)
        return [{**sample, **dict(zip(("anchors", "block_valid"), _padded_anchors(cand[i:i + per_item], per_item)))}
                for i in range(0, len(cand), per_item)]

    def empty_sample(self) -> dict[str, torch.Tensor]:
        """A weightless one-token sample with no valid block: fills a batch that does not split evenly."""
        return self[(0, -1)]

    def _empty(self) -> dict[str, torch.Tensor]:
        """All-zero sample arrays of one token (the codec's zero byte for an encoded context), on the
        devices of the preloaded copy's."""
        spec, c, n = self.reader.spec, self.codec, len(self.slots)
        D, k = spec.hidden_size, spec.topk or 1
        raw = {"input_ids": torch.zeros(1, dtype=torch.long), "loss_mask": torch.zeros(1, dtype=torch.bool),
               "topk_ids": torch.zeros(1, k, dtype=torch.long), "topk_logprobs": torch.zeros(1, k),
               "hidden": torch.zeros(1, n, D, dtype=torch.bfloat16)}
        if self.decode_on_device:
            raw["hidden"] = torch.full((1, n, c.payload_width(D)), c.zero_byte, dtype=torch.uint8)
            raw[HIDDEN_SCALE] = torch.zeros(1, n, c.groups(D), dtype=c.torch_scale_dtype)
        if self.resident:
            placed = next(iter(self.resident.values()))
            raw = {name: v.to(placed[name].device) for name, v in raw.items() if name in placed}
        return raw


def bucket_for(length: int, buckets: list[int]) -> int:
    if length <= buckets[-1]:
        return next(b for b in buckets if length <= b)
    raise ValueError(f"length {length} exceeds the largest context bucket {buckets[-1]}")


@dataclass
class BucketPlan:
    """The context buckets a run compiles: those its samples' lengths fall into."""

    buckets: list[int]  # buckets some sample falls into, ascending: the only shapes warmed up and batched
    samples: dict[int, int]  # samples per configured bucket (0 for one that is not compiled)

    def describe(self) -> str:
        used = ", ".join(f"{b} ({self.samples[b]} samples)" for b in self.buckets)
        unused = [str(b) for b, n in self.samples.items() if n == 0]
        why = f"; not {', '.join(unused)}: no sample falls into them" if unused else ""
        return f"context buckets compiled: {used}{why}"


def plan_buckets(lengths: np.ndarray, buckets: list[int]) -> BucketPlan:
    """Which of ``buckets`` the samples of ``lengths`` (capped at the largest) fall into: the only
    ones a batch can be padded to."""
    lengths = np.minimum(np.asarray(lengths, dtype=np.int64), buckets[-1])
    if len(lengths) == 0:
        raise ValueError("no samples: no context bucket to compile")
    which = np.searchsorted(np.asarray(buckets), lengths, side="left")  # first bucket >= length, as bucket_for
    samples = {b: int(n) for b, n in zip(buckets, np.bincount(which, minlength=len(buckets)))}
    return BucketPlan([b for b in buckets if samples[b] > 0], samples)


def _batch_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor, in shared memory inside a loader worker (as ``default_collate``)."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype, device=device)
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


class Collate:
    """Stack samples, zero-padding per-token fields to the smallest bucket that fits them all (None:
    the longest sample); adds ``seq_len`` (Bsz,)."""

    def __init__(self, buckets: list[int] | None):
        self.buckets = buckets

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        lengths = [len(s["input_ids"]) for s in samples]
        S = bucket_for(max(lengths), self.buckets) if self.buckets is not None else max(lengths)
        first = samples[0]
        out = {"seq_len": torch.tensor(lengths, dtype=torch.long),
               "anchors": torch.stack([s["anchors"] for s in samples]),
               "block_valid": torch.stack([s["block_valid"] for s in samples])}
        for name in (n for n in PER_TOKEN_FIELDS if n in first):
            big = name in ENCODED_FIELDS + ("context_hidden",)  # written once (tokens, then padding)
            shape = (len(samples), S, *first[name].shape[1:])
            out[name] = buf = (_batch_buffer if big else torch.zeros)(shape, dtype=first[name].dtype,
                                                                      device=first[name].device)
            for i, (s, T) in enumerate(zip(samples, lengths)):
                buf[i, :T] = s[name]
                if big:
                    buf[i, T:] = first["hidden_codec"].zero_byte if name == "context_payload" else 0
        if "context_payload" in first:  # decoded by to(device), where the batch lands
            out["context_hidden"] = EncodedContext(out.pop("context_payload"), out.pop("context_scale"),
                                                   first["hidden_codec"])
        return out


def truncate_sample(sample: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """The first ``length`` tokens of a sample, blocks that no longer fit invalidated (for the warm-up)."""
    out = {k: (v[:length] if k in PER_TOKEN_FIELDS else v) for k, v in sample.items()}
    fits = sample["anchors"] <= length - 2
    out["block_valid"], out["anchors"] = sample["block_valid"] & fits, torch.where(fits, sample["anchors"], 0)
    return out


DEFAULT_EVAL_SAMPLES = 64  # held-out samples of a large cache when none are asked for (at most a tenth of a small one)


def held_out_count(num_samples: int, eval_samples: int | None) -> int:
    """``eval_samples``, else min(64, a tenth of the cache) and at least 1; one always left to train on."""
    if eval_samples is None:
        eval_samples = max(1, min(DEFAULT_EVAL_SAMPLES, int(num_samples * 0.1)))
    return min(eval_samples, max(num_samples - 1, 0))


@dataclass
class Split:
    """Which cache samples train and which are held out (the dataset's last rows)."""

    train: np.ndarray
    held_out: np.ndarray

    @classmethod
    def of(cls, num_samples: int, eval_samples: int | None, source_index: np.ndarray | None = None,
           train_samples: int | None = None) -> "Split":
        """By ``source_index`` (source rows) when given, not cache order (longest first, by shard);
        ``train_samples`` keeps the first N training samples by source row."""
        n_eval = held_out_count(num_samples, eval_samples)
        by_row = np.arange(num_samples) if source_index is None else np.argsort(np.asarray(source_index), kind="stable")
        train = np.sort(by_row[: num_samples - n_eval][:train_samples])
        return cls(train=train, held_out=by_row[num_samples - n_eval:])


class GlobalBatchSampler:
    """This rank's micro-batches of ``(epoch, index)`` keys from ``start_step``: micro-batch ``m * world
    + rank`` of global batch s to accumulation step m, padded with weightless slots (index -1)."""

    def __init__(self, train: np.ndarray, global_batch: int, micro_batch: int, rank: int, world: int,
                 seed: int, total_steps: int, start_step: int = 0):
        if len(train) < global_batch:
            raise ValueError(f"{len(train)} training samples cannot fill one global batch of {global_batch}")
        self.train = np.asarray(train)
        self.global_batch, self.micro, self.rank, self.world = global_batch, micro_batch, rank, world
        self.accum = -(-global_batch // (micro_batch * world))  # ceil
        self.seed, self.total_steps, self.start_step = seed, total_steps, start_step

    @property
    def steps_per_epoch(self) -> int:
        return len(self.train) // self.global_batch

    @functools.lru_cache(maxsize=1)
    def order(self, epoch: int) -> np.ndarray:
        return self.train[np.random.default_rng([self.seed, epoch, _ORDER_SALT]).permutation(len(self.train))]

    def step_batches(self, step: int) -> list[list[tuple[int, int]]]:
        """The ``accum`` micro-batches this rank reads at global step ``step``."""
        epoch, k = divmod(step, self.steps_per_epoch)
        batch = self.order(epoch)[k * self.global_batch:(k + 1) * self.global_batch]
        batch = np.pad(batch, (0, self.accum * self.world * self.micro - len(batch)), constant_values=-1)
        starts = ((m * self.world + self.rank) * self.micro for m in range(self.accum))
        return [[(epoch, int(i)) for i in batch[j:j + self.micro]] for j in starts]

    def __iter__(self):
        for step in range(self.start_step, self.total_steps):
            yield from self.step_batches(step)


def total_steps(num_train: int, global_batch: int, epochs: float, max_steps: int | None) -> int:
    """Optimizer steps of the run: ``max_steps`` if given, else ceil(epochs x steps per epoch)."""
    if max_steps is not None:
        return int(max_steps)
    return max(1, math.ceil(epochs * (num_train // global_batch)))


def held_out_batches(held_out: np.ndarray, micro_batch: int, rank: int, world: int) -> list[list[tuple[int, int]]]:
    """This rank's full held-out micro-batches, round-robin; every rank gets as many (FSDP collectives)."""
    full = (len(held_out) // micro_batch) // world * world
    batches = [[(EVAL_EPOCH, int(i)) for i in held_out[b * micro_batch:(b + 1) * micro_batch]] for b in range(full)]
    return batches[rank::world]


PRELOAD_SHARE = 0.9  # --preload auto: samples that take at most this share of what the training step leaves


def preload_bytes(dataset: AnchorDataset, indices: np.ndarray, lengths: np.ndarray) -> int:
    """Device memory that ``preload`` takes, from the first sample's bytes per token."""
    first = dataset.sample(int(indices[0]))
    per_token = sum(v.nbytes for k, v in first.items() if torch.is_tensor(v) and k != "loss_mask")
    return int(per_token / len(first["input_ids"]) * lengths[indices].sum())


def preload(datasets: list[AnchorDataset], indices: np.ndarray, device: torch.device, progress: bool) -> None:
    """Samples ``indices`` read once for all ``datasets`` (one reader; the first reads every field the others do)
    into ``device`` memory, where batches are then cut; the loss mask stays on the CPU, where anchors are drawn."""
    reading = datasets[0].samples(np.sort(indices).tolist())
    resident = {}
    for index, s in tqdm(reading, "preload", len(indices), disable=not progress):
        # copies: a sample's arrays may be views of the whole span read with it
        resident[index] = {k: v.to("cpu" if k == "loss_mask" else device, copy=True) for k, v in s.items()
                           if torch.is_tensor(v)}
    for d in datasets:
        d.resident = resident


def make_loader(dataset: AnchorDataset, batches, buckets: list[int], num_workers: int, pin_memory: bool
                ) -> DataLoader:
    """A DataLoader over explicit micro-batches, each worker keeping 4 ready."""
    return DataLoader(dataset, batch_sampler=batches, collate_fn=Collate(buckets), num_workers=num_workers,
                      pin_memory=pin_memory, prefetch_factor=4 if num_workers > 0 else None)
