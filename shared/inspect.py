"""Look inside a hidden-state cache: what it holds, one sample, its statistics and a converted cache's error against
its source, each as a JSON-serialisable dict that ``cache_cli`` formats; only committed data is read."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import Counter
from typing import Any

import numpy as np
import torch
import zarr
from zarr.core.sync import sync
from zarr.storage import LocalStore

from dflash.shared.cache import (ENCODING_DEFAULTS, HIDDEN_SCALE, META_FIELDS, CacheError, CacheReader, ShardInfo,
                                 decode_hidden, decode_topk_logprobs, shard_name, stored_row_bytes)
from dflash.shared.fingerprint import fingerprint_digest, tokenizer_fingerprint
from dflash.shared.shard_lock import live_holders


def _sizes(root: zarr.Group, prefixes: list[str]) -> dict[str, int] | None:
    """Key -> bytes of every object under ``prefixes``, or None where the store cannot list."""
    store = root.store
    if isinstance(store, LocalStore):  # one scandir walk, 3x faster than zarr's listing (BENCHMARKS)
        return {k: v for p in prefixes for k, v in _folder_sizes(str(store.root), p).items()}

    async def listing(prefix):
        sizes = {}
        async for key in store.list_prefix(prefix):
            with contextlib.suppress(FileNotFoundError):  # replaced while listing
                sizes[key] = await store.getsize(key)
        return sizes

    try:
        return {k: v for p in prefixes for k, v in sync(listing(p)).items()}
    except Exception:  # a filesystem that cannot list its files
        return None


def _folder_sizes(base: str, prefix: str) -> dict[str, int]:
    """Key -> bytes of every file below ``base/prefix``, as a LocalStore at ``base`` names them."""
    sizes, folders, cut = {}, [os.path.join(base, prefix)], len(base) + 1
    while folders:
        with contextlib.suppress(FileNotFoundError), os.scandir(folders.pop()) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    folders.append(e.path)
                else:
                    with contextlib.suppress(FileNotFoundError):  # replaced while listing
                        sizes[e.path[cut:]] = e.stat(follow_symlinks=False).st_size
    return sizes


def _chunk_bytes(sizes: dict[str, int], array_key: str, chunks: int | None = None) -> int:
    """Bytes of the chunks of one array whose first index is below ``chunks`` (None: all)."""
    prefix = array_key + "/c/"
    return sum(size for key, size in sizes.items() if key.startswith(prefix)
               and (chunks is None or int(key[len(prefix):].split("/")[0]) < chunks))


def _assistant_tokens(root: zarr.Group, shard: ShardInfo) -> int:
    """Committed assistant tokens of a shard (its loss mask: one byte a token)."""
    return int(np.count_nonzero(root[shard_name(shard.shard_id)]["loss_mask"][:shard.tokens])) if shard.tokens else 0


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def cache_info(path: str, shard_ids: list[int] | None = None) -> dict[str, Any]:
    """Spec, fingerprint, per-shard state and counts, bytes on disk and compression ratios, over ``shard_ids`` only
    where given (a shard of them not created yet makes the result incomplete)."""
    reader = CacheReader(path, shard_ids=shard_ids)
    spec, root = reader.spec, reader.root
    sizes = _sizes(root, [""] if shard_ids is None else [f"shards/{s:05d}/" for s in shard_ids])
    listed = sizes is not None
    # bytes per token of the raw lossless layout (bf16 hidden states, float32 log-probs): what ratios compare to
    row_bytes, stored_bytes = stored_row_bytes(spec.with_encoding(**ENCODING_DEFAULTS)), stored_row_bytes(spec)
    by_shard: dict[str, dict[str, int]] = {}  # 'shards/00000' -> its objects' sizes
    for name, size in (sizes or {}).items():
        by_shard.setdefault(name[:12], {})[name] = size
    raw_total = 0
    disk_hidden = disk_total = 0 if listed else None
    shards = []
    for s in reader.shards:
        key = shard_name(s.shard_id)
        g, own = root[key], by_shard.get(key, {})
        planned = {f"planned_{k}": v for k, v in s.record.planned.as_dict().items()}
        entry = {"shard_id": s.shard_id, "state": s.state, **s.record.commit.as_dict(), **planned,
                 "assistant_tokens": _assistant_tokens(root, s), "skipped": dict(s.record.skipped),
                 "bytes_on_disk": sum(own.values()) if listed else None, "compute": s.record.compute}
        if listed:
            committed = {f: _chunk_bytes(own, f"{key}/{f}", -(-s.tokens // g[f].chunks[0])) for f in spec.token_fields}
            disk_hidden += committed["hidden"] + committed.get(HIDDEN_SCALE, 0)
            disk_total += sum(committed.values()) + sum(_chunk_bytes(own, f"{key}/{f}") for f in META_FIELDS)
        raw_total += s.tokens * sum(row_bytes.values()) + 8 * sum(g[f].shape[0] for f in META_FIELDS)
        shards.append(entry)
    totals = {k: sum(e[k] for e in shards) for k in ("samples", "planned_samples", "tokens", "planned_tokens",
                                                      "assistant_tokens")}
    tokens, raw_hidden = totals["tokens"], totals["tokens"] * row_bytes["hidden"]
    missing = sorted(set(shard_ids or ()) - {e["shard_id"] for e in shards})
    skipped = sum((Counter(e["skipped"]) for e in shards), Counter())  # rows not planned, by reason
    fp = spec.fingerprint
    target, tok, data = fp.get("target", {}), fp.get("tokenizer", {}), fp.get("dataset", {})
    located = spec.info or {}  # where local data and checkpoints lay (recorded, not compared)
    rendering = fp.get("extraction", {}).get("chat_template", {})
    return {
        "path": path, "format": spec.format, "format_version": spec.format_version,
        "fingerprint": {
            "target": {"name_or_path": target.get("name_or_path") or located.get("target_path"),
                       "revision": target.get("revision"), "dtype": target.get("dtype"),
                       "config_hash": target.get("config_hash"), "weights_hash": target.get("weights_hash")},
            "tokenizer": {"hash": tok.get("hash"), "chat_template_hash": tok.get("chat_template_hash")},
            "chat_template": {  # the template (and the file that replaced the tokenizer's), its arguments, mask
                "hash": tok.get("chat_template_hash"), "file": (located.get("config") or {}).get("chat_template"),
                "template_kwargs": rendering.get("template_kwargs", {}), "end_of_turn": rendering.get("end_of_turn"),
                "end_of_turn_id": rendering.get("end_of_turn_id"), "mask_method": rendering.get("mask_method")},
            "dataset": {"name": data.get("source") or located.get("dataset_source"), "split": data.get("split"),
                        "rows": data.get("num_rows"), "hash": data.get("content_hash")},
            "full": fp,
        },
        **{f: getattr(spec, f) for f in ("layer_ids", "layer_convention", "num_target_layers", "hidden_size",
                                         "hidden_dtype", "topk", "vocab_size", "max_length", "truncation",
                                         "chunk_tokens", "compression_level")},
        "chunks": {f: spec.chunk_rows(f) for f in spec.token_fields},
        "encoding": {**spec.encoding(), "hidden": spec.codec.describe()},
        "bytes_per_token": {
            "hidden_raw_bf16": row_bytes["hidden"],
            "hidden_encoded": stored_bytes["hidden"] + stored_bytes.get(HIDDEN_SCALE, 0),
            "hidden_on_disk": _ratio(disk_hidden, tokens),
            "total_raw": sum(row_bytes.values()), "total_encoded": sum(stored_bytes.values()),
            "total_on_disk": _ratio(disk_total, tokens),
        },
        "converted_from": located.get("converted_from"),
        "shards": shards, "shards_not_created": missing, "num_shards": len(shards),
        "complete": bool(shards) and not missing and all(e["state"] == "complete" for e in shards),
        **totals, "assistant_fraction": _ratio(totals["assistant_tokens"], tokens), "skipped": dict(skipped),
        "writing": {f"{s:05d}": dataclasses.asdict(h) | {"described": h.describe()}
                    for s, h in sorted(live_holders(path).items())
                    if shard_ids is None or s in shard_ids},
        "bytes_on_disk": sum(sizes.values()) if listed else None,
        "raw_bytes": {"hidden": raw_hidden, "total": raw_total},
        "committed_bytes_on_disk": {"hidden": disk_hidden, "total": disk_total} if listed else None,
        "compression_ratio": {"hidden": _ratio(raw_hidden, disk_hidden), "total": _ratio(raw_total, disk_total)},
    }


def _load_tokenizer(candidates: list[str | None]) -> tuple[Any, str | None, str | None]:
    """First tokenizer that loads from local files: (tokenizer, path, error of the last try)."""
    error = "no tokenizer path recorded in the cache"
    for cand in filter(None, candidates):
        try:
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(cand, local_files_only=True), cand, None
        except Exception as e:  # missing files, no network, foreign format
            error = f"{cand}: {type(e).__name__}: {e}"
    return None, None, error


def _decode(tokenizer, ids: list[int]) -> str | None:
    if tokenizer is None:
        return None
    try:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    except Exception:
        return "".join(f"<{i}>" for i in ids)


def _read_float(reader: CacheReader, index: int) -> dict[str, np.ndarray]:
    """One sample's stored arrays, with ``hidden`` (T, L, D) and ``topk_logprobs`` as float32."""
    spec = reader.spec
    raw = reader.read_raw(index, spec.token_fields)
    raw["hidden"] = decode_hidden(spec, raw, torch.float32).numpy()  # exact for bf16
    raw["topk_logprobs"] = decode_topk_logprobs(spec, raw["topk_logprobs"]).numpy()
    return raw


def show_sample(path: str, index: int, *, tokenizer_path: str | None = None, num_tokens: int | None = 32,
                top: int = 3) -> dict[str, Any]:
    """One committed sample: text with assistant spans, top predictions, norms; texts are None without a tokenizer."""
    reader = CacheReader(path)
    pos, local = reader.locate(index)
    raw = _read_float(reader, index)
    fp = reader.spec.fingerprint
    candidates = [tokenizer_path] if tokenizer_path else [
        fp.get("target", {}).get("name_or_path"), (reader.spec.info or {}).get("target_path")]
    tokenizer, tok_path, tok_error = _load_tokenizer(candidates)
    recorded = fp.get("tokenizer", {}).get("hash")
    hash_matches = tokenizer_fingerprint(tokenizer)["hash"] == recorded if tokenizer is not None and recorded else None

    ids, mask = raw["input_ids"].astype(np.int64), raw["loss_mask"].astype(bool)
    T = len(ids)
    cuts = [0, *(np.flatnonzero(mask[1:] != mask[:-1]) + 1).tolist(), T]  # where the mask changes
    segments = [{"assistant": bool(mask[a]), "start": a, "end": b, "ids": ids[a:b].tolist(),
                 "text": _decode(tokenizer, ids[a:b].tolist())} for a, b in zip(cuts, cuts[1:]) if a < b]
    n_show = T if num_tokens is None else min(T, max(num_tokens, 0))
    top = min(top, raw["topk_ids"].shape[1])
    tokens = []
    for t in range(n_show):
        nxt = int(ids[t + 1]) if t + 1 < T else None
        preds = [{"id": int(raw["topk_ids"][t, j]), "prob": float(np.exp(raw["topk_logprobs"][t, j])),
                  "text": _decode(tokenizer, [int(raw["topk_ids"][t, j])])} for j in range(top)]
        tokens.append({"pos": t, "id": int(ids[t]), "assistant": bool(mask[t]), "next_id": nxt,
                       "text": _decode(tokenizer, [int(ids[t])]),
                       "next_text": _decode(tokenizer, [nxt]) if nxt is not None else None,
                       "top": preds, "top1_is_next": bool(preds and nxt is not None and preds[0]["id"] == nxt)})
    x = raw["hidden"].astype(np.float64)  # (T, L, D)
    norms = np.sqrt((x * x).sum(-1))  # (T, L)
    layer_norms = [{"layer_id": lid, "mean": float(norms[:, j].mean()) if T else None,
                    "max": float(norms[:, j].max()) if T else None} for j, lid in enumerate(reader.spec.layer_ids)]
    return {
        "path": path, "index": index, "shard_id": reader.shards[pos].shard_id, "local_index": local,
        "source_index": int(reader.source_indices()[index]), "length": T, "assistant_tokens": int(mask.sum()),
        "tokenizer": {"path": tok_path, "loaded": tokenizer is not None, "error": tok_error,
                      "hash_matches_cache": hash_matches},
        "segments": segments, "tokens": tokens, "tokens_shown": n_show, "layer_norms": layer_norms,
    }


def length_histogram(lengths: np.ndarray) -> list[dict[str, int]]:
    """Power-of-two buckets [lo, hi) from the shortest to the longest sample."""
    if len(lengths) == 0:
        return []
    edges = [0] + [1 << e for e in range(int(lengths.max()).bit_length() + 1)]
    counts, _ = np.histogram(lengths, bins=edges)
    first, last = int(np.flatnonzero(counts)[0]), int(np.flatnonzero(counts)[-1])
    return [{"lo": edges[i], "hi": edges[i + 1], "count": int(counts[i])} for i in range(first, last + 1)]


def cache_stats(path: str, *, max_samples: int = 256, seed: int = 0, threshold: float = 100.0,
                against: str | None = None) -> dict[str, Any]:
    """Lengths and assistant fraction over every committed sample; activation, top-k statistics and the error against
    a source over ``max_samples`` samples drawn without replacement (seeded; all if fewer)."""
    reader = CacheReader(path)
    spec = reader.spec
    lengths = reader.lengths()
    n = len(lengths)
    assistant = sum(_assistant_tokens(reader.root, s) for s in reader.shards)
    chosen = np.arange(n) if n <= max_samples else np.sort(
        np.random.default_rng(seed).choice(n, size=max_samples, replace=False))
    s1, s2, over, absmax = np.zeros((4, spec.num_layers))  # per layer: sums of x and x^2, |x| > threshold, max |x|
    sums = np.zeros(9)  # values per layer; top-1 prob, top-k mass, entropy, tokens; top-1 = next (assistant) hits/n
    for i in chosen:
        raw = _read_float(reader, int(i))
        x = raw["hidden"].astype(np.float64)  # (T, L, D)
        s1, s2 = s1 + x.sum(axis=(0, 2)), s2 + (x * x).sum(axis=(0, 2))
        absmax, over = np.maximum(absmax, np.abs(x).max(axis=(0, 2))), over + (np.abs(x) > threshold).sum(axis=(0, 2))
        p = np.exp(raw["topk_logprobs"].astype(np.float64))  # (T, k)
        rest = np.clip(1.0 - p.sum(axis=1), 0.0, 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1) - np.where(rest > 0, rest * np.log(rest), 0.0)
        hit = raw["topk_ids"][:-1, 0] == raw["input_ids"][1:]
        nxt_assistant = raw["loss_mask"][1:].astype(bool)
        sums += [x.shape[0] * x.shape[2], p[:, 0].sum(), p.sum(), h.sum(), len(p), hit.sum(), len(hit),
                 hit[nxt_assistant].sum(), nxt_assistant.sum()]
    cnt, top1, mass, entropy, tk_tokens, match, match_n, match_a, match_an = max(sums[0], 1), *sums[1:]
    mean, mean_sq, above = s1 / cnt, s2 / cnt, over / cnt  # per layer
    layers = [{"layer_id": lid, "mean": mean[j], "std": float(np.sqrt(max(mean_sq[j] - mean[j] ** 2, 0.0))),
               "rms": float(np.sqrt(mean_sq[j])), "abs_max": float(absmax[j]), "frac_above_threshold": float(above[j])}
              for j, lid in enumerate(spec.layer_ids)]
    tokens = int(lengths.sum())
    return {
        "path": path, "samples": n, "tokens": tokens,
        "lengths": {
            "min": int(lengths.min()) if n else None, "max": int(lengths.max()) if n else None,
            "mean": float(lengths.mean()) if n else None,
            "percentiles": {str(q): float(np.percentile(lengths, q)) for q in (50, 90, 99)} if n else {},
            "at_max_length": int((lengths >= spec.max_length).sum()), "histogram": length_histogram(lengths),
        },
        "assistant_tokens": int(assistant), "assistant_fraction": _ratio(assistant, tokens),
        "sampled": {"samples": len(chosen), "tokens": int(lengths[chosen].sum()) if n else 0, "seed": seed,
                    "indices_all": bool(n <= max_samples)},
        "activations": {"threshold": threshold, "layers": layers},
        "topk": {"k": spec.topk, "mean_top1_prob": _ratio(top1, tk_tokens), "mean_topk_mass": _ratio(mass, tk_tokens),
                 "mean_entropy_lower_bound": _ratio(entropy, tk_tokens), "top1_is_next_token": _ratio(match, match_n),
                 "top1_is_next_token_assistant": _ratio(match_a, match_an)},
        "conversion_error": conversion_error(reader, chosen, against),
    }


def conversion_error(reader: CacheReader, indices: np.ndarray, against: str | None = None) -> dict[str, Any] | None:
    """Relative L2 and largest absolute error per layer of the hidden states (and of the top-k log-probs) of samples
    ``indices``, as training reads them, against ``against`` or the recorded source; None without one."""
    record = (reader.spec.info or {}).get("converted_from")
    if against is None and not record:
        return None
    where = against or record["path"]
    try:
        source = CacheReader(where)
    except CacheError as e:
        if against is not None:
            raise
        return {"against": where, "unavailable": f"the recorded source cannot be opened ({e}); pass --against SRC"}
    if not reader.complete:
        return {"against": where, "unavailable": f"{reader.path} is not complete (a conversion that stopped midway? "
                                                  "rerun it to finish)"}
    for name, ours, theirs in (("samples", len(reader), len(source)),
                               ("source rows", reader.source_indices(), source.source_indices()),
                               ("sample lengths", reader.lengths(), source.lengths())):
        if not np.array_equal(ours, theirs):  # (arrays of other lengths differ)
            raise CacheError(f"{source.path} does not hold the samples of {reader.path} ({name} differ): it is not "
                             "the cache it was converted from")
    slots = source.layer_slots(reader.spec.layer_ids)
    fields = ("input_ids", "hidden", "topk_ids", "topk_logprobs")
    err2, ref2, worst = np.zeros((3, reader.spec.num_layers + 1))  # per layer, then of the top-k log-probs
    for i in indices:
        ours, theirs = reader.read(int(i), fields), source.read(int(i), fields)
        if not all(torch.equal(ours[f], theirs[f]) for f in ("input_ids", "topk_ids")):
            raise CacheError(f"sample {int(i)}: token ids or top-k ids differ between {reader.path} and {where}")
        pairs = [*zip(ours["hidden"].unbind(1), theirs["hidden"][:, slots].unbind(1)),  # (T, D) per layer
                 (ours["topk_logprobs"], theirs["topk_logprobs"])]
        for j, (x, ref) in enumerate(pairs):
            x, ref = x.double(), ref.double()
            err2[j] += float(((x - ref) ** 2).sum())
            ref2[j] += float((ref * ref).sum())
            worst[j] = max(worst[j], float((x - ref).abs().max())) if x.numel() else worst[j]
    errors = [{"rel_l2": float(np.sqrt(e / r)) if r > 0 else None, "max_abs_error": float(w)}
              for e, r, w in zip(err2, ref2, worst)]
    return {
        "against": where, "recorded_source": record["path"] if record else None,
        "source_matches_record": None if not record else record["fingerprint_digest"] == fingerprint_digest(
            source.spec.fingerprint),
        "samples": len(indices), "tokens": int(reader.lengths()[indices].sum()),
        "layers": [{"layer_id": lid, **e} for lid, e in zip(reader.spec.layer_ids, errors)],
        "topk_logprobs": errors[-1],
        "topk_reduced": reader.spec.topk_dtype != source.spec.topk_dtype,
    }
