"""Look inside a hidden-state cache: what it holds, one sample, its integrity, its statistics.

Every function returns plain, JSON-serialisable dicts; ``cache_cli`` only formats them.
Only committed data is ever read (see the commit protocol in ``cache.py``), and data is
read in whole chunks, because each synchronous zarr read has a fixed cost however small.
Integrity checks live in ``verify.py``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

from dflash.shared.cache import (HIDDEN_SCALE, CacheReader, CacheSpec, decode_hidden,
                                 decode_topk_logprobs, token_array_shapes)
from dflash.shared.compare import conversion_error
from dflash.shared.shard_lock import live_holders

META_FIELDS = ("offsets", "source_index", "batches")


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact bf16 -> fp32: the bf16 bits are the high half of the fp32 bits."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def hidden_float32(spec: CacheSpec, raw: dict[str, np.ndarray]) -> np.ndarray:
    """(T, L, D) float32 hidden states from a sample's stored arrays (``read_raw`` with
    ``spec.token_fields``), decoded whatever the codec; exact for the lossless layout."""
    if spec.hidden_codec == "bf16":
        return bf16_bits_to_float32(raw["hidden"])
    return decode_hidden(spec, raw, torch.float32).numpy()


def _chunk_tokens(arr: zarr.Array) -> int:
    return int(arr.chunks[0])


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- info


def _store_listing(root: zarr.Group, prefixes: list[str] | None = None) -> dict[str, int] | None:
    """Key -> bytes of every object in the store (under ``prefixes`` where given), or None where
    listing is not simple."""
    if prefixes is not None:
        parts = [_store_listing_under(root, p) for p in prefixes]
        return None if any(p is None for p in parts) else {k: v for p in parts for k, v in p.items()}
    return _store_listing_under(root, "")


def _store_listing_under(root: zarr.Group, prefix: str) -> dict[str, int] | None:
    store = root.store
    if isinstance(store, zarr.storage.LocalStore):
        base = Path(store.root)
        out = {}
        for dirpath, _dirs, files in os.walk(base / prefix if prefix else base):
            for name in files:
                full = os.path.join(dirpath, name)
                try:
                    out[os.path.relpath(full, base).replace(os.sep, "/")] = os.path.getsize(full)
                except OSError:
                    pass
        return out
    try:  # fsspec, memory, zip...: the generic store API, if it can list
        from zarr.core.sync import sync

        if not store.supports_listing:
            return None

        async def listing():
            return {key: await store.getsize(key) async for key in store.list_prefix(prefix)}

        return sync(listing())
    except Exception:
        return None


def _by_shard(listing: dict[str, int]) -> dict[str, dict[str, int]]:
    """The listing split by shard folder ('shards/00000' -> its keys and sizes), in one pass."""
    out: dict[str, dict[str, int]] = {}
    for key, size in listing.items():
        parts = key.split("/", 2)
        if len(parts) == 3 and parts[0] == "shards":
            out.setdefault(f"shards/{parts[1]}", {})[key] = size
    return out


def _array_disk_bytes(listing: dict[str, int], array_key: str, committed_chunks: int | None) -> tuple[int, int]:
    """(bytes of every chunk, bytes of chunks with first index < committed_chunks) of one array."""
    prefix = array_key + "/c"
    total = committed = 0
    for key, size in listing.items():
        if not key.startswith(prefix) or len(key) == len(prefix) or key[len(prefix)] not in "/.":
            continue
        total += size
        first = key[len(prefix) + 1:].replace(".", "/").split("/")[0]
        if committed_chunks is None or (first.isdigit() and int(first) < committed_chunks):
            committed += size
    return total, committed


def _read_loss_mask_sum(arr: zarr.Array, tokens: int) -> int:
    if tokens == 0:
        return 0
    return int(np.count_nonzero(np.asarray(arr[:tokens])))  # cheap: 1 byte/token


def cache_info(path: str, storage_options: dict | None = None, shard_ids: list[int] | None = None) -> dict[str, Any]:
    """Spec, fingerprint, per-shard state and counts, bytes on disk and compression ratios.

    ``shard_ids`` limits every count to those shards (an extraction node's own summary); a
    listed shard not created yet counts as planned nothing and makes the result incomplete.
    """
    reader = CacheReader(path, storage_options, shard_ids=shard_ids)
    spec = reader.spec
    root = reader.root
    listing = _store_listing(root, None if shard_ids is None else [f"shards/{s:05d}/" for s in shard_ids])
    shard_listing = _by_shard(listing) if listing is not None else {}
    L, D, k = spec.num_layers, spec.hidden_size, spec.topk
    row_bytes = {"input_ids": 4, "loss_mask": 1, "hidden": L * D * 2, "topk_ids": 4 * k, "topk_logprobs": 4 * k}
    """Bytes per token of the raw lossless layout (bf16 hidden states, float32 log-probs): what ratios compare to."""
    stored_row_bytes = {f: int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize
                        for f, (shape, dtype) in token_array_shapes(spec, 1).items()}
    """Bytes per token as stored before the lossless stage (a lossy codec's payload and scales)."""
    raw_hidden = raw_total = disk_hidden = disk_total_committed = 0
    shards = []
    for s in reader.shards:
        if shard_ids is not None and s.shard_id not in shard_ids:
            continue
        key = f"shards/{s.shard_id:05d}"
        g = root[key]
        assistant = _read_loss_mask_sum(g["loss_mask"], s.tokens)
        entry = {
            "shard_id": s.shard_id, "state": s.state,
            "samples": s.samples, "planned_samples": s.planned_samples,
            "tokens": s.tokens, "planned_tokens": s.planned_tokens,
            "batches": s.record.commit.batches, "planned_batches": s.record.planned.batches,
            "assistant_tokens": assistant, "skipped": dict(s.skipped), "bytes_on_disk": None,
            "compute": s.record.compute,
        }
        if listing is not None:
            own = shard_listing.get(key, {})
            entry["bytes_on_disk"] = sum(own.values())
            for f in spec.token_fields:
                _, committed = _array_disk_bytes(own, f"{key}/{f}", _ceil_div(s.tokens, _chunk_tokens(g[f])))
                disk_total_committed += committed
                if f in ("hidden", HIDDEN_SCALE):
                    disk_hidden += committed
            for f in META_FIELDS:
                disk_total_committed += _array_disk_bytes(own, f"{key}/{f}", None)[1]
        raw_hidden += s.tokens * row_bytes["hidden"]
        raw_total += s.tokens * sum(row_bytes.values()) + 8 * sum(g[f].shape[0] for f in META_FIELDS)
        shards.append(entry)
    tokens = sum(e["tokens"] for e in shards)
    missing = sorted(set(shard_ids or ()) - {e["shard_id"] for e in shards})
    assistant_total = sum(e["assistant_tokens"] for e in shards)
    skipped: dict[str, int] = {}
    for e in shards:
        for reason, n in e["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + int(n)
    fp = spec.fingerprint
    target, tok, data = fp.get("target", {}), fp.get("tokenizer", {}), fp.get("dataset", {})
    located = spec.info or {}  # where local data and checkpoints lay (recorded, not compared)
    return {
        "path": path,
        "format": spec.format, "format_version": spec.format_version,
        "fingerprint": {
            "target": {
                "name_or_path": target.get("name_or_path", target.get("name")) or located.get("target_path"),
                "revision": target.get("revision"), "dtype": target.get("dtype"),
                "config_hash": target.get("config_hash"), "weights_hash": target.get("weights_hash"),
            },
            "tokenizer": {"hash": tok.get("hash"), "chat_template_hash": tok.get("chat_template_hash")},
            "chat_template": _chat_template_info(fp, located),
            "dataset": {
                "name": data.get("name", data.get("source")) or located.get("dataset_source"),
                "split": data.get("split"),
                "rows": data.get("rows", data.get("num_rows")),
                "hash": data.get("hash", data.get("content_hash")),
            },
            "full": fp,
        },
        "layer_ids": list(spec.layer_ids), "layer_convention": spec.layer_convention,
        "num_target_layers": spec.num_target_layers, "hidden_size": D, "hidden_dtype": spec.hidden_dtype,
        "topk": k, "vocab_size": spec.vocab_size,
        "max_length": spec.max_length, "truncation": spec.truncation,
        "chunk_tokens": spec.chunk_tokens, "compression_level": spec.compression_level,
        "chunks": {f: spec.chunk_rows(f) for f in spec.token_fields},
        "encoding": {**spec.encoding(), "hidden": spec.codec.describe()},
        "bytes_per_token": {
            "hidden_raw_bf16": row_bytes["hidden"],
            "hidden_encoded": stored_row_bytes["hidden"] + stored_row_bytes.get(HIDDEN_SCALE, 0),
            "hidden_on_disk": disk_hidden / tokens if listing is not None and tokens else None,
            "total_raw": sum(row_bytes.values()),
            "total_encoded": sum(stored_row_bytes.values()),
            "total_on_disk": disk_total_committed / tokens if listing is not None and tokens else None,
        },
        "converted_from": located.get("converted_from"),
        "shards": shards, "shards_not_created": missing,
        "num_shards": len(shards), "complete": bool(shards) and not missing and all(e["state"] == "complete" for e in shards),
        "samples": sum(e["samples"] for e in shards), "planned_samples": sum(e["planned_samples"] for e in shards),
        "tokens": tokens, "planned_tokens": sum(e["planned_tokens"] for e in shards),
        "assistant_tokens": assistant_total,
        "assistant_fraction": assistant_total / tokens if tokens else None,
        "skipped": skipped,
        "writing": {f"{s:05d}": dataclasses.asdict(h) | {"described": h.describe()}
                    for s, h in sorted(live_holders(path, storage_options).items())
                    if shard_ids is None or s in shard_ids},
        "bytes_on_disk": (sum(listing.values()) if shard_ids is None else sum(e["bytes_on_disk"] for e in shards))
        if listing is not None else None,
        "raw_bytes": {"hidden": raw_hidden, "total": raw_total},
        "committed_bytes_on_disk": (
            {"hidden": disk_hidden, "total": disk_total_committed} if listing is not None else None),
        "compression_ratio": {
            "hidden": raw_hidden / disk_hidden if listing is not None and disk_hidden else None,
            "total": raw_total / disk_total_committed if listing is not None and disk_total_committed else None,
        },
    }


def _chat_template_info(fp: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    """How the chats were rendered: the template (its hash, and the file that replaced the
    tokenizer's own, if one did), the template arguments, the end-of-turn token, the mask method."""
    rendering = fp.get("extraction", {}).get("chat_template", {})
    return {
        "hash": fp.get("tokenizer", {}).get("chat_template_hash"),
        "file": (info.get("config") or {}).get("chat_template"),
        "template_kwargs": rendering.get("template_kwargs", {}),
        "end_of_turn": rendering.get("end_of_turn"),
        "end_of_turn_id": rendering.get("end_of_turn_id"),
        "mask_method": rendering.get("mask_method"),
    }


# ----------------------------------------------------------------------------- show


def _load_tokenizer(candidates: list[str | None]) -> tuple[Any, str | None, str | None]:
    """First tokenizer that loads from local files: (tokenizer, path, error of the last try)."""
    error = "no tokenizer path recorded in the cache"
    for cand in candidates:
        if not cand:
            continue
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(cand, local_files_only=True), cand, None
        except Exception as e:  # missing files, no network, foreign format
            error = f"{cand}: {type(e).__name__}: {e}"
    return None, None, error


def _decode(tokenizer, ids: list[int]) -> str:
    try:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    except Exception:
        return "".join(f"<{i}>" for i in ids)


def show_sample(path: str, index: int, *, tokenizer_path: str | None = None, num_tokens: int | None = 32,
                top: int = 3, storage_options: dict | None = None) -> dict[str, Any]:
    """One committed sample by global index: text with assistant spans, top predictions, norms.

    The tokenizer is ``tokenizer_path``, else the one recorded in the fingerprint. Without
    one, texts are None and callers show token ids.
    """
    reader = CacheReader(path, storage_options)
    pos, local = reader.locate(index)
    raw = reader.read_raw(index, reader.spec.token_fields)
    raw["topk_logprobs"] = decode_topk_logprobs(reader.spec, raw["topk_logprobs"]).numpy()
    fp = reader.spec.fingerprint
    candidates = [tokenizer_path] if tokenizer_path else [
        fp.get("tokenizer", {}).get("name_or_path"), fp.get("target", {}).get("name_or_path"),
        (reader.spec.info or {}).get("target_path")]
    tokenizer, tok_path, tok_error = _load_tokenizer(candidates)
    hash_matches = None
    if tokenizer is not None and fp.get("tokenizer", {}).get("hash"):
        from dflash.shared.fingerprint import tokenizer_fingerprint

        hash_matches = tokenizer_fingerprint(tokenizer)["hash"] == fp["tokenizer"]["hash"]

    ids = raw["input_ids"].astype(np.int64)
    mask = raw["loss_mask"].astype(bool)
    T = len(ids)
    segments = []
    start = 0
    for t in range(1, T + 1):
        if t == T or mask[t] != mask[start]:
            seg_ids = ids[start:t].tolist()
            segments.append({"assistant": bool(mask[start]), "start": start, "end": t, "ids": seg_ids,
                             "text": _decode(tokenizer, seg_ids) if tokenizer is not None else None})
            start = t

    n_show = T if num_tokens is None else min(T, max(num_tokens, 0))
    top = min(top, raw["topk_ids"].shape[1])
    tokens = []
    for t in range(n_show):
        tid = int(ids[t])
        nxt = int(ids[t + 1]) if t + 1 < T else None
        preds = [{"id": int(raw["topk_ids"][t, j]), "prob": float(np.exp(raw["topk_logprobs"][t, j]))}
                 for j in range(top)]
        if tokenizer is not None:
            for p in preds:
                p["text"] = _decode(tokenizer, [p["id"]])
        tokens.append({
            "pos": t, "id": tid, "assistant": bool(mask[t]), "next_id": nxt,
            "text": _decode(tokenizer, [tid]) if tokenizer is not None else None,
            "next_text": _decode(tokenizer, [nxt]) if tokenizer is not None and nxt is not None else None,
            "top": preds, "top1_is_next": bool(preds and nxt is not None and preds[0]["id"] == nxt),
        })

    x = hidden_float32(reader.spec, raw).astype(np.float64)  # (T, L, D)
    norms = np.sqrt((x * x).sum(-1)) if T else np.zeros((0, reader.spec.num_layers))  # (T, L)
    layer_norms = [{"layer_id": lid, "mean": float(norms[:, j].mean()) if T else None,
                    "max": float(norms[:, j].max()) if T else None}
                   for j, lid in enumerate(reader.spec.layer_ids)]
    return {
        "path": path, "index": index, "shard_id": reader.shards[pos].shard_id, "local_index": local,
        "source_index": int(reader.source_indices()[index]), "length": T,
        "assistant_tokens": int(mask.sum()),
        "tokenizer": {"path": tok_path, "loaded": tokenizer is not None, "error": tok_error,
                      "hash_matches_cache": hash_matches},
        "segments": segments, "tokens": tokens, "tokens_shown": n_show, "layer_norms": layer_norms,
    }


# ----------------------------------------------------------------------------- stats


def length_histogram(lengths: np.ndarray) -> list[dict[str, int]]:
    """Power-of-two buckets [lo, hi) from the shortest to the longest sample."""
    if len(lengths) == 0:
        return []
    top = int(np.ceil(np.log2(int(lengths.max()) + 1)))
    edges = [0] + [1 << e for e in range(top + 1)]
    counts, _ = np.histogram(lengths, bins=edges)
    first, last = int(np.flatnonzero(counts)[0]), int(np.flatnonzero(counts)[-1])
    return [{"lo": edges[i], "hi": edges[i + 1], "count": int(counts[i])} for i in range(first, last + 1)]


def cache_stats(path: str, *, max_samples: int = 256, seed: int = 0, threshold: float = 100.0,
                against: str | None = None, storage_options: dict | None = None) -> dict[str, Any]:
    """Lengths and assistant fraction over every committed sample; activation and top-k
    statistics over ``max_samples`` samples drawn without replacement (seeded; all if fewer);
    for a converted cache (or with ``against``), the error of those samples against the source."""
    reader = CacheReader(path, storage_options)
    spec = reader.spec
    lengths = reader.lengths()
    n = len(lengths)
    assistant = sum(_read_loss_mask_sum(reader.root[f"shards/{s.shard_id:05d}"]["loss_mask"], s.tokens)
                    for s in reader.shards)
    if n <= max_samples:
        chosen = np.arange(n)
    else:
        chosen = np.sort(np.random.default_rng(seed).choice(n, size=max_samples, replace=False))

    L = spec.num_layers
    s1, s2 = np.zeros(L), np.zeros(L)
    absmax, over = np.zeros(L), np.zeros(L, dtype=np.int64)
    values_per_layer = 0
    top1, mass, entropy, tk_tokens = 0.0, 0.0, 0.0, 0
    match, match_n, match_a, match_an = 0, 0, 0, 0
    for i in chosen:
        raw = reader.read_raw(int(i), spec.token_fields)
        raw["topk_logprobs"] = decode_topk_logprobs(spec, raw["topk_logprobs"]).numpy()
        x = hidden_float32(spec, raw).astype(np.float64)  # (T, L, D)
        s1 += x.sum(axis=(0, 2))
        s2 += (x * x).sum(axis=(0, 2))
        absmax = np.maximum(absmax, np.abs(x).max(axis=(0, 2)))
        over += (np.abs(x) > threshold).sum(axis=(0, 2))
        values_per_layer += x.shape[0] * x.shape[2]
        p = np.exp(raw["topk_logprobs"].astype(np.float64))  # (T, k)
        rest = np.clip(1.0 - p.sum(axis=1), 0.0, 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1) - np.where(rest > 0, rest * np.log(rest), 0.0)
        top1 += p[:, 0].sum()
        mass += p.sum()
        entropy += h.sum()
        tk_tokens += len(p)
        hit = raw["topk_ids"][:-1, 0] == raw["input_ids"][1:]
        nxt_assistant = raw["loss_mask"][1:].astype(bool)
        match += int(hit.sum())
        match_n += len(hit)
        match_a += int(hit[nxt_assistant].sum())
        match_an += int(nxt_assistant.sum())

    layers = []
    for j, lid in enumerate(spec.layer_ids):
        cnt = max(values_per_layer, 1)
        mean = s1[j] / cnt
        layers.append({"layer_id": lid, "mean": mean, "std": float(np.sqrt(max(s2[j] / cnt - mean * mean, 0.0))),
                       "rms": float(np.sqrt(s2[j] / cnt)), "abs_max": float(absmax[j]),
                       "frac_above_threshold": float(over[j] / cnt)})
    tokens = int(lengths.sum())
    return {
        "path": path, "samples": n, "tokens": tokens,
        "lengths": {
            "min": int(lengths.min()) if n else None, "max": int(lengths.max()) if n else None,
            "mean": float(lengths.mean()) if n else None,
            "percentiles": {str(q): float(np.percentile(lengths, q)) for q in (50, 90, 99)} if n else {},
            "at_max_length": int((lengths >= spec.max_length).sum()),
            "histogram": length_histogram(lengths),
        },
        "assistant_tokens": int(assistant), "assistant_fraction": assistant / tokens if tokens else None,
        "sampled": {"samples": len(chosen), "tokens": int(lengths[chosen].sum()) if n else 0, "seed": seed,
                    "indices_all": bool(n <= max_samples)},
        "activations": {"threshold": threshold, "layers": layers},
        "topk": {
            "k": spec.topk,
            "mean_top1_prob": top1 / tk_tokens if tk_tokens else None,
            "mean_topk_mass": mass / tk_tokens if tk_tokens else None,
            "mean_entropy_lower_bound": entropy / tk_tokens if tk_tokens else None,
            "top1_is_next_token": match / match_n if match_n else None,
            "top1_is_next_token_assistant": match_a / match_an if match_an else None,
        },
        "conversion_error": conversion_error(reader, chosen, against, storage_options),
    }
