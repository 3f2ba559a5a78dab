"""``dflash-cache convert``: re-encode a finished cache into another layout, without the target. Each shard keeps the
source's plan and is written by ``ShardWriter``; an array whose encoding is unchanged is copied as stored."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import zarr
from tqdm import tqdm

from dflash.shared.cache import (
    HIDDEN_SCALE, SPAN_BYTES, CacheError, CacheMismatch, CacheReader, CacheSpec, ShardInfo, ShardPlan, ShardWriter,
    create_or_open_cache, decode_hidden, decode_topk_logprobs, encode_hidden, encode_topk_logprobs,
    read_shard_states, shard_name, stored_row_bytes, to_numpy, writer_zarr_settings,
)
from dflash.shared.compression import ZSTD_LEVELS, HiddenCodecName, ScaleDtype, TopkDtype, is_local
from dflash.shared.fingerprint import fingerprint_digest
from dflash.shared.shard_lock import ShardLock, live_holders


@dataclass
class ConvertSettings:
    """How the converted cache stores its values (unset: the source's); each field's help is its flag's."""

    hidden_codec: HiddenCodecName | None = None
    hidden_group_size: int | None = None
    hidden_scale_dtype: ScaleDtype | None = None
    topk_dtype: TopkDtype | None = None
    chunk_tokens: int | None = None
    compression_level: int | None = None
    commit_seconds: float = 10.0

    def validate(self) -> None:
        """Raise ValueError for a zstd level blosc cannot run (the flags' ranges are checked as they are parsed)."""
        if self.compression_level is not None and self.compression_level not in ZSTD_LEVELS:
            raise ValueError(f"--compression-level {self.compression_level}: the cache's codec (zstd inside blosc) "
                             f"runs at zstd levels {', '.join(map(str, ZSTD_LEVELS))} only")


def _location(path: str) -> str:  # a local path made absolute: where a later ``stats`` finds the source
    return os.path.abspath(path) if is_local(path) else path


def converted_spec(src: CacheSpec, settings: ConvertSettings, src_path: str) -> CacheSpec:
    """The spec of ``src`` converted with ``settings`` (fingerprint too), its source in ``info.converted_from``."""
    encoding = dict(hidden_codec=settings.hidden_codec or src.hidden_codec,
                    hidden_group_size=settings.hidden_group_size or src.hidden_group_size or 128,
                    hidden_scale_dtype=settings.hidden_scale_dtype or src.hidden_scale_dtype or "float16",
                    topk_dtype=settings.topk_dtype or src.topk_dtype)
    try:  # in the current format: 2 lossless, 3 with an encoding
        spec = src.with_encoding(**encoding, chunk_tokens=settings.chunk_tokens or src.chunk_tokens,
                                 compression_level=settings.compression_level or src.compression_level,
                                 fingerprint=copy.deepcopy(src.fingerprint), info=copy.deepcopy(src.info or {}))
    except CacheError as e:
        raise CacheError(f"{e} (--hidden-codec {encoding['hidden_codec']}, --hidden-group-size "
                         f"{encoding['hidden_group_size']})") from None
    fingerprint = spec.fingerprint
    extraction = fingerprint.get("extraction")
    if isinstance(extraction, dict):
        extraction.update({k: getattr(spec, k) for k in ("chunk_tokens", "compression_level") if k in extraction})
        extraction.pop("encoding", None)
        if spec.encoded:  # as extraction records it: a lossless cache's fingerprint has no encoding
            extraction["encoding"] = spec.encoding()
    if (src.codec.lossy and src.codec != spec.codec) or src.topk_dtype not in ("float32", spec.topk_dtype):
        # the values went through an encoding the new one does not name
        fingerprint["decoded_from"] = list(fingerprint.get("decoded_from", [])) + [src.encoding()]
    spec.info["converted_from"] = {
        "path": _location(src_path), "fingerprint_digest": fingerprint_digest(src.fingerprint),
        "format_version": src.format_version, "chunk_tokens": src.chunk_tokens,
        "compression_level": src.compression_level, "encoding": src.encoding(), "hidden": src.codec.describe(),
        "previous": (src.info or {}).get("converted_from")}
    return spec


def _check_source(reader: CacheReader) -> None:
    """Refuse a source with a shard being written, created but not recorded, partial or empty."""
    src, writing = reader.path, live_holders(reader.path)
    problems = [f"shard {s:05d} is being written now by {h.describe()}" for s, h in sorted(writing.items())]
    problems += [f"shard {s:05d} was created but never recorded (its extraction died creating it)"
                 for s, state in read_shard_states(reader.root).items() if state is None and s not in writing]
    problems += [f"shard {s.shard_id:05d} is {s.state}: {s.samples:,} of {s.record.planned.samples:,} samples committed"
                 for s in reader.shards if not s.complete and s.shard_id not in writing]
    if problems:
        raise CacheError(f"{src}: only a finished cache can be converted; finish its extraction first (rerun "
                         "dflash-extract with the same flags):\n  - " + "\n  - ".join(problems))
    if not reader.shards:
        raise CacheError(f"{src}: the cache holds no shards; nothing to convert")


class Interrupted(Exception):
    """A stop was asked for (Ctrl-C): the shard being converted committed what it had."""


@contextlib.contextmanager
def _stop_on_ctrl_c():
    """Yields the flag the first Ctrl-C sets: the shard commits and stops after its current read, never inside a write
    (zarr's own thread would go on writing); a second Ctrl-C interrupts at once."""
    stop = threading.Event()

    def handle(signum, frame):
        stop.set()
        sys.stderr.write("\ndflash-cache convert: stopping after the current read, once it is committed "
                         "(Ctrl-C again stops at once)\n")
        signal.signal(signal.SIGINT, previous)

    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def _reencode(src: CacheSpec, dst: CacheSpec, stored: dict[str, np.ndarray], plan: ShardPlan, t0: int,
              where: str) -> dict[str, np.ndarray]:
    """A source shard's stored token arrays from token ``t0`` -> the converted shard's, refusing new scales that are
    not finite; ``where`` names the source shard."""
    out = {f: stored[f] for f in ("input_ids", "loss_mask", "topk_ids")}
    out["topk_logprobs"] = stored["topk_logprobs"] if src.topk_dtype == dst.topk_dtype else to_numpy(
        encode_topk_logprobs(dst, decode_topk_logprobs(src, stored["topk_logprobs"])))
    if src.codec == dst.codec:
        return out | {f: stored[f] for f in ("hidden", HIDDEN_SCALE) if f in stored}
    hidden = decode_hidden(src, stored, torch.float32)  # (T, L, D)
    out.update({f: to_numpy(t) for f, t in encode_hidden(dst, hidden, validate=False).items()})
    scales = out.get(HIDDEN_SCALE)  # a lossy codec's
    bad = [] if scales is None else np.flatnonzero(~np.isfinite(scales.reshape(len(scales), -1)).all(axis=1))
    if len(bad):
        token = t0 + int(bad[0])
        sample = int(np.searchsorted(plan.offsets, token, side="right") - 1)
        raise CacheError(f"{where}: {len(bad)} token(s) hold NaN or Inf hidden states, or magnitudes past the "
                         f"scales' dtype ({dst.codec.describe()}; --hidden-scale-dtype float32 holds larger ones); the "
                         f"first in sample {sample} of the shard (source row {int(plan.source_index[sample])}), token "
                         f"{token - int(plan.offsets[sample])}; dflash-cache verify lists every one")
    return out


def _convert_shard(reader: CacheReader, shard: ShardInfo, dst: str, dst_root: zarr.Group, dst_spec: CacheSpec,
                   settings: ConvertSettings, bar, say: Callable[[str], None], stop: threading.Event) -> dict[str, int]:
    """Convert one shard under its lock, counting its tokens on ``bar``; returns them (converted now, found done)."""
    shard_id, state, group = shard.shard_id, shard.record, reader.root[shard_name(shard.shard_id)]
    plan = ShardPlan(group["source_index"][:], np.diff(group["offsets"][:]), group["batches"][:],
                     dict(state.skipped))  # as written
    if plan.digest() != state.plan_digest:
        raise CacheError(f"{group.path}: its offsets, source rows or batches do not match its recorded plan "
                         "digest; run dflash-cache verify on the source")
    lock = ShardLock(dst, shard_id).take(say)  # ShardLocked (a LockError) where another run holds it
    try:
        writer = ShardWriter(dst_root, shard_id, plan, dst_spec, compute=state.compute, guard=lock.check)
        done = writer.committed["tokens"]
        bar.update(done)
        if done and not writer.complete:
            say(f"shard {shard_id:05d}: resumed at batch {writer.next_batch:,} of {len(plan.batches) - 1:,}")
        arrays = {f: group[f] for f in reader.spec.token_fields}
        window = max(1, SPAN_BYTES // sum(stored_row_bytes(reader.spec).values()))  # tokens, as read_many reads
        bounds = plan.offsets[plan.batches]  # each batch's first token
        last_commit = time.monotonic()
        while not writer.complete:
            b0 = writer.next_batch
            t0 = int(bounds[b0])  # whole batches up to the window's size (one at least)
            b1 = max(b0 + 1, int(np.searchsorted(bounds, t0 + window, side="right")) - 1)
            t1 = int(bounds[b1])
            data = _reencode(reader.spec, dst_spec, {f: np.asarray(a[t0:t1]) for f, a in arrays.items()}, plan, t0,
                             where=f"{reader.path} shard {shard_id:05d}")
            for b in range(b0, b1):
                writer.write_batch(b, **{f: v[bounds[b] - t0:bounds[b + 1] - t0] for f, v in data.items()})
            bar.update(t1 - t0)
            if stop.is_set():
                writer.commit()
                raise Interrupted(f"shard {shard_id:05d} committed {writer.committed['tokens']:,} of "
                                  f"{plan.num_tokens:,} tokens")
            if time.monotonic() - last_commit >= settings.commit_seconds:
                writer.commit()
                last_commit = time.monotonic()
        writer.finish()
        return {"tokens_converted": plan.num_tokens - done, "tokens_found_done": done}
    finally:
        lock.release()


def convert_cache(src: str, dst: str, settings: ConvertSettings, *, progress: bool = True) -> dict[str, Any]:
    """Convert cache ``src`` into ``dst`` (created, or resumed) with validated ``settings``; returns a summary. Raises
    CacheError for an unfinished source or a ``dst`` holding another cache or being written; Interrupted on Ctrl-C."""
    if _location(src).rstrip("/") == _location(dst).rstrip("/"):
        raise CacheError(f"{dst}: the destination is the source; convert into another path")
    reader = CacheReader(src)
    _check_source(reader)
    spec = converted_spec(reader.spec, settings, src)
    t_start = time.monotonic()
    try:
        dst_root = create_or_open_cache(dst, spec, replace_uncommitted=True)
    except CacheMismatch as e:
        raise CacheMismatch(f"{dst} holds another cache (not {src} converted with these settings); choose another "
                            "destination or delete it", e.differences) from None
    bar = tqdm(total=reader.num_tokens, unit="tok", unit_scale=True, desc="convert", file=sys.stderr,
               dynamic_ncols=True, disable=not progress)

    def say(message: str) -> None:
        bar.write(f"dflash-cache convert: {message}", file=sys.stderr)

    with zarr.config.set(writer_zarr_settings(dst)), _stop_on_ctrl_c() as stop, bar:
        results = [_convert_shard(reader, s, dst, dst_root, spec, settings, bar, say, stop) for s in reader.shards]
    totals = {k: sum(r[k] for r in results) for k in ("tokens_converted", "tokens_found_done")}
    seconds = time.monotonic() - t_start
    return {"source": _location(src), "destination": dst, "shards": len(reader.shards), "samples": len(reader),
            "tokens": reader.num_tokens, **totals, "seconds": round(seconds, 3),
            "tokens_per_s": totals["tokens_converted"] / seconds if seconds > 0 else None,
            "settings": dataclasses.asdict(settings) | spec.encoding() | {
                "chunk_tokens": spec.chunk_tokens, "compression_level": spec.compression_level}}
