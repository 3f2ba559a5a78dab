"""Look inside a hidden-state cache: what it holds, one sample, its integrity, its statistics.

Every function returns plain, JSON-serialisable dicts; ``cache_cli`` only formats them.
Only committed data is ever read (see the commit protocol in ``cache.py``), and data is
read in whole chunks, because each synchronous zarr read costs ~1.3 ms however small.
``verify_cache`` deliberately does not go through ``CacheReader``: the reader refuses a
shard whose offsets disagree with its commit record, and verify must report that, not die.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import zarr
from tqdm import tqdm

from dflash.shared.cache import (
    ATTRS_KEY, TOKEN_FIELDS, CacheError, CacheReader, CacheSpec, ShardPlan, open_root,
)

META_FIELDS = ("offsets", "source_index", "batches")
BF16_EXP_MASK = 0x7F80  # exponent bits of a bfloat16; all ones = Inf or NaN
MAX_LISTED_SAMPLES = 1000  # per problem, in the JSON; the count is always complete
LOGPROB_TOL = 1e-5  # fp32 log_softmax rounding: "> 0" and "not descending" allow this much


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact bf16 -> fp32: the bf16 bits are the high half of the fp32 bits."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _chunk_tokens(arr: zarr.Array) -> int:
    return int(arr.chunks[0])


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- info


def _store_listing(root: zarr.Group) -> dict[str, int] | None:
    """Key -> bytes of every object in the store, or None where listing is not simple."""
    store = root.store
    if isinstance(store, zarr.storage.LocalStore):
        base = Path(store.root)
        out = {}
        for dirpath, _dirs, files in os.walk(base):
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
            return {key: await store.getsize(key) async for key in store.list()}

        return sync(listing())
    except Exception:
        return None


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


def cache_info(path: str, storage_options: dict | None = None) -> dict[str, Any]:
    """Spec, fingerprint, per-shard state and counts, bytes on disk and compression ratios."""
    reader = CacheReader(path, storage_options)
    spec = reader.spec
    root = reader.root
    listing = _store_listing(root)
    L, D, k = spec.num_layers, spec.hidden_size, spec.topk
    row_bytes = {"input_ids": 4, "loss_mask": 1, "hidden": L * D * 2, "topk_ids": 4 * k, "topk_logprobs": 4 * k}
    raw_hidden = raw_total = disk_hidden = disk_total_committed = 0
    shards = []
    for s in reader.shards:
        key = f"shards/{s.shard_id:05d}"
        g = root[key]
        attrs = g.attrs.asdict()
        assistant = _read_loss_mask_sum(g["loss_mask"], s.tokens)
        entry = {
            "shard_id": s.shard_id, "state": s.state,
            "samples": s.samples, "planned_samples": s.planned_samples,
            "tokens": s.tokens, "planned_tokens": s.planned_tokens,
            "batches": attrs["commit"]["batches"], "planned_batches": attrs["planned"]["batches"],
            "assistant_tokens": assistant, "skipped": dict(s.skipped), "bytes_on_disk": None,
        }
        if listing is not None:
            entry["bytes_on_disk"] = sum(v for kk, v in listing.items() if kk.startswith(key + "/"))
            for f in TOKEN_FIELDS:
                _, committed = _array_disk_bytes(listing, f"{key}/{f}", _ceil_div(s.tokens, _chunk_tokens(g[f])))
                disk_total_committed += committed
                if f == "hidden":
                    disk_hidden += committed
            for f in META_FIELDS:
                disk_total_committed += _array_disk_bytes(listing, f"{key}/{f}", None)[1]
        raw_hidden += s.tokens * row_bytes["hidden"]
        raw_total += s.tokens * sum(row_bytes.values()) + 8 * sum(g[f].shape[0] for f in META_FIELDS)
        shards.append(entry)
    tokens = reader.num_tokens
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
        "shards": shards,
        "num_shards": len(shards), "complete": reader.complete,
        "samples": len(reader), "planned_samples": sum(e["planned_samples"] for e in shards),
        "tokens": tokens, "planned_tokens": sum(e["planned_tokens"] for e in shards),
        "assistant_tokens": assistant_total,
        "assistant_fraction": assistant_total / tokens if tokens else None,
        "skipped": skipped,
        "bytes_on_disk": sum(listing.values()) if listing is not None else None,
        "raw_bytes": {"hidden": raw_hidden, "total": raw_total},
        "committed_bytes_on_disk": (
            {"hidden": disk_hidden, "total": disk_total_committed} if listing is not None else None),
        "compression_ratio": {
            "hidden": raw_hidden / disk_hidden if listing is not None and disk_hidden else None,
            "total": raw_total / disk_total_committed if listing is not None and disk_total_committed else None,
        },
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
    raw = reader.read_raw(index)
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

    x = bf16_bits_to_float32(raw["hidden"]).astype(np.float64)  # (T, L, D)
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


# ----------------------------------------------------------------------------- verify


class _Problems:
    """Collects problems up to a cap, counting all of them."""

    def __init__(self, cap: int):
        self.cap, self.total, self.items = cap, 0, []

    def add(self, shard: int | None, array: str | None, check: str, message: str,
            samples: Iterable[int] | None = None, global_start: int | None = None,
            committed_samples: int = 0, tokens: tuple[int, int] | None = None) -> None:
        self.total += 1
        if len(self.items) >= self.cap:
            return
        local = sorted({int(s) for s in samples}) if samples is not None else None
        num_samples = None if local is None else len(local)
        local = None if local is None else local[:MAX_LISTED_SAMPLES]
        glob = None
        if local is not None and global_start is not None:
            glob = [global_start + s if s < committed_samples else None for s in local]
        where = f"shard {shard:05d}" if shard is not None else "cache"
        if local:
            shown = ", ".join(map(str, local[:5])) + (f", ... ({num_samples} samples)" if num_samples > 5 else "")
            gshown = ", ".join("-" if g is None else str(g) for g in (glob or [])[:5])
            where += f" sample {shown} (global {gshown})"
        if array:
            where += f" {array}"
        self.items.append({"shard": shard, "array": array, "check": check, "samples": local, "num_samples": num_samples,
                           "global_samples": glob, "tokens": list(tokens) if tokens else None,
                           "message": f"{where}: {message}"})


def _bounded_map(fn: Callable, items: list, workers: int) -> Iterator:
    """fn over items, results in order, at most 2 * workers in flight (memory stays bounded)."""
    if workers <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(workers) as pool:
        window: deque = deque()
        for item in items:
            window.append(pool.submit(fn, item))
            if len(window) >= 2 * workers:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()


def _check_token_chunk(arr: zarr.Array, name: str, c: int, committed: int, spec: CacheSpec):
    """Read chunk c whole, check its committed part; returns (error, [(check, bad tokens, facts)])."""
    C = _chunk_tokens(arr)
    t0 = c * C
    try:
        data = np.asarray(arr[t0:min(t0 + C, arr.shape[0])])[: committed - t0]
    except Exception as e:  # crc32c mismatch, truncated or garbled blosc frame, missing key...
        return f"{type(e).__name__}: {e}", []
    found = []
    if name == "hidden":
        bad = (data & BF16_EXP_MASK) == BF16_EXP_MASK  # (n, L, D)
        if bad.any():
            per_layer = bad.any(axis=2)  # (n, L)
            layers = [spec.layer_ids[j] for j in np.flatnonzero(per_layer.any(axis=0))]
            found.append(("nan_inf", t0 + np.flatnonzero(per_layer.any(axis=1)),
                          {"values": int(bad.sum()), "layers": set(layers)}))
    elif name == "topk_logprobs":
        rows = ~np.isfinite(data).all(axis=1)
        if rows.any():
            found.append(("nan_inf", t0 + np.flatnonzero(rows), {"values": int((~np.isfinite(data)).sum())}))
        with np.errstate(invalid="ignore"):
            rows = (data > LOGPROB_TOL).any(axis=1)
            if rows.any():
                found.append(("positive", t0 + np.flatnonzero(rows), {"max": float(np.nanmax(data))}))
            rows = (np.diff(data, axis=1) > LOGPROB_TOL).any(axis=1)
            if rows.any():
                found.append(("not_descending", t0 + np.flatnonzero(rows), {}))
    elif name in ("input_ids", "topk_ids"):
        bad = (data < 0) | (data >= spec.vocab_size)
        rows = bad.reshape(len(data), -1).any(axis=1)
        if rows.any():
            found.append(("out_of_vocab", t0 + np.flatnonzero(rows), {"ids": set(np.unique(data[bad])[:5].tolist())}))
    return None, found


def _read_meta(g: zarr.Group, name: str, shard: int, problems: _Problems, bar) -> np.ndarray | None:
    arr = g[name]
    C = _chunk_tokens(arr)
    parts = []
    for c in range(_ceil_div(arr.shape[0], C)):
        try:
            parts.append(np.asarray(arr[c * C:(c + 1) * C]))
        except Exception as e:
            problems.add(shard, name, "undecodable", f"chunk {c} cannot be decoded: {type(e).__name__}: {e}")
            return None
        finally:
            bar.update(1)
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def verify_cache(path: str, *, max_problems: int = 100, progress: bool = True, workers: int = 4,
                 storage_options: dict | None = None) -> dict[str, Any]:
    """Read every committed chunk of every array of every shard and check what can be checked.

    Structure (commit records, offsets, batches, plan digest, source_index uniqueness) and
    values (checksums, NaN/Inf, log-prob sanity, id ranges). Problems name shard, local and
    global sample indices and array. Raises CacheError only when the store is no cache.
    """
    root = open_root(path, "r", storage_options)
    if ATTRS_KEY not in root.attrs:
        raise CacheError(f"{path}: a Zarr store but not a dflash cache (no '{ATTRS_KEY}' attribute)")
    spec = CacheSpec.from_dict(root.attrs[ATTRS_KEY])
    problems = _Problems(max_problems)
    names = sorted(root["shards"].group_keys()) if "shards" in root else []

    # pass 1: attributes, array presence and shapes; global sample numbering from commit records
    shards, global_start = [], 0
    expected_tail = {"input_ids": (), "loss_mask": (), "hidden": (spec.num_layers, spec.hidden_size),
                     "topk_ids": (spec.topk,), "topk_logprobs": (spec.topk,)}
    for name in names:
        if not name.isdigit():
            problems.add(None, None, "structure", f"unexpected group shards/{name}")
            continue
        sid, g = int(name), root["shards"][name]
        a = g.attrs.asdict()
        try:
            commit, planned = {k: int(v) for k, v in a["commit"].items()}, {k: int(v) for k, v in a["planned"].items()}
        except Exception as e:
            problems.add(sid, None, "structure", f"missing or malformed commit/planned attributes ({e})")
            continue
        arrays = {}
        for f in TOKEN_FIELDS + META_FIELDS:
            if f not in g:
                problems.add(sid, f, "structure", "array missing")
                continue
            arr = g[f]
            want = ((planned["tokens"],) + expected_tail[f]) if f in TOKEN_FIELDS else None
            if want is not None and tuple(arr.shape) != want:
                problems.add(sid, f, "structure", f"shape {tuple(arr.shape)}, spec and plan say {want}")
                continue
            arrays[f] = arr
        shards.append({"shard_id": sid, "group": g, "commit": commit, "planned": planned, "attrs": a,
                       "arrays": arrays, "global_start": global_start})
        global_start += commit["samples"]

    chunk_jobs = []
    for s in shards:
        committed = min(s["commit"]["tokens"], s["planned"]["tokens"])
        for f in TOKEN_FIELDS:
            if f in s["arrays"]:
                chunk_jobs += [(s, f, c, committed) for c in range(_ceil_div(committed, _chunk_tokens(s["arrays"][f])))]
    n_meta = sum(_ceil_div(s["arrays"][f].shape[0], _chunk_tokens(s["arrays"][f]))
                 for s in shards for f in META_FIELDS if f in s["arrays"])
    bar = tqdm(total=len(chunk_jobs) + n_meta, unit="chunk", desc="verify", file=sys.stderr,
               disable=not progress, leave=False)

    # pass 2: per-shard structure from the sample-level arrays
    all_sources = []
    for s in shards:
        sid, commit, planned, gs = s["shard_id"], s["commit"], s["planned"], s["global_start"]
        ns = commit["samples"]
        meta = {f: _read_meta(s["group"], f, sid, problems, bar) if f in s["arrays"] else None for f in META_FIELDS}
        for k in ("batches", "samples", "tokens"):
            if commit[k] > planned[k]:
                problems.add(sid, None, "commit", f"commit record has {commit[k]} {k}, plan has only {planned[k]}")
        if s["attrs"].get("complete") and commit != planned:
            problems.add(sid, None, "commit", f"marked complete but commit {commit} != planned {planned}")
        off, src, bat = meta["offsets"], meta["source_index"], meta["batches"]
        s["mapping"] = None
        if off is not None:
            kw = dict(global_start=gs, committed_samples=ns)
            if len(off) != planned["samples"] + 1:
                problems.add(sid, "offsets", "offsets", f"{len(off)} entries, plan has {planned['samples']} samples")
            elif off[0] != 0:
                problems.add(sid, "offsets", "offsets", f"starts at {off[0]}, not 0", samples=[0], **kw)
            lengths = np.diff(off)
            bad = np.flatnonzero(lengths < 0)
            if len(bad):
                problems.add(sid, "offsets", "offsets", "offsets decrease (negative sample length)", samples=bad, **kw)
            bad = np.flatnonzero(lengths == 0)
            if len(bad):
                problems.add(sid, "offsets", "lengths", "samples of length 0", samples=bad, **kw)
            bad = np.flatnonzero(lengths > spec.max_length)
            if len(bad):
                problems.add(sid, "offsets", "lengths", f"samples longer than max_length {spec.max_length} "
                             f"(longest {int(lengths.max())})", samples=bad, **kw)
            if len(off) > ns and off[ns] != commit["tokens"]:
                problems.add(sid, "offsets", "offsets",
                             f"offsets[{ns}] = {off[ns]}, commit record says {commit['tokens']} tokens")
            if len(off) and off[-1] != planned["tokens"]:
                problems.add(sid, "offsets", "offsets", f"ends at {off[-1]}, plan has {planned['tokens']} tokens")
            s["mapping"] = np.maximum.accumulate(off[: ns + 1]) if len(off) > ns else None
        if bat is not None:
            if len(bat) != planned["batches"] + 1 or len(bat) == 0 or bat[0] != 0 or bat[-1] != planned["samples"] \
                    or np.any(np.diff(bat) <= 0):
                problems.add(sid, "batches", "batches", "batches are not increasing sample offsets from 0 to the planned samples")
            elif commit["batches"] < len(bat) and bat[commit["batches"]] != ns:
                problems.add(sid, "batches", "commit",
                             f"commit record: {commit['batches']} batches = {bat[commit['batches']]} samples, record says {ns}")
        if off is not None and src is not None and bat is not None and "plan_digest" in s["attrs"]:
            try:
                digest = ShardPlan(src, np.diff(off), bat, dict(s["attrs"].get("skipped", {}))).digest()
            except ValueError:
                digest = None  # already reported above
            if digest is not None and digest != s["attrs"]["plan_digest"]:
                problems.add(sid, None, "plan_digest",
                             "offsets/source_index/batches differ from the plan the shard was written with")
        if src is not None:
            if len(src) != planned["samples"]:
                problems.add(sid, "source_index", "structure", f"{len(src)} entries, plan has {planned['samples']} samples")
            all_sources.append((sid, gs, ns, src[:ns]))

    # source_index unique within and across shards (committed samples only)
    if all_sources:
        values = np.concatenate([x[3] for x in all_sources])
        owner = np.concatenate([np.full(len(x[3]), i) for i, x in enumerate(all_sources)])
        local = np.concatenate([np.arange(len(x[3])) for x in all_sources])
        order = np.argsort(values, kind="stable")
        sv = values[order]
        dup = np.flatnonzero(sv[1:] == sv[:-1])
        for v in np.unique(sv[dup + 1]):
            where = order[np.searchsorted(sv, v):np.searchsorted(sv, v, "right")]
            for i in where:
                sid, gs, ns, _ = all_sources[owner[i]]
                others = [f"{all_sources[owner[j]][0]:05d}:{local[j]}" for j in where if j != i]
                problems.add(sid, "source_index", "duplicate", f"source row {int(v)} also at shard:sample {', '.join(others)}",
                             samples=[local[i]], global_start=gs, committed_samples=ns)

    # pass 3: every committed chunk of every token array
    value_findings: dict[tuple[int, str, str], dict[str, Any]] = {}

    def job(j):
        s, f, c, committed = j
        return j, _check_token_chunk(s["arrays"][f], f, c, committed, spec)

    for (s, f, c, committed), (error, found) in _bounded_map(job, chunk_jobs, workers):
        bar.update(1)
        C = _chunk_tokens(s["arrays"][f])
        t0, t1 = c * C, min((c + 1) * C, committed)
        m = s["mapping"]
        kw = dict(global_start=s["global_start"], committed_samples=s["commit"]["samples"])

        def samples_of(tok):
            return None if m is None else np.clip(np.searchsorted(m, tok, side="right") - 1, 0, max(len(m) - 2, 0))

        if error is not None:
            samples = None if m is None else range(int(samples_of(t0)), int(samples_of(t1 - 1)) + 1)
            problems.add(s["shard_id"], f, "undecodable", f"chunk {c} (tokens {t0}:{t1}) cannot be decoded: {error}",
                         samples=samples, tokens=(t0, t1), **kw)
        for check, toks, facts in found:  # merged per (shard, array, check) across chunks
            a = value_findings.setdefault((s["shard_id"], f, check), {
                "shard": s, "tokens": 0, "first": int(toks[0]), "last": 0, "samples": set(), "values": 0,
                "layers": set(), "ids": set(), "max": -np.inf})
            a["tokens"] += len(toks)
            a["last"] = int(toks[-1]) + 1
            a["samples"].update([] if m is None else samples_of(toks).tolist())
            a["values"] += facts.get("values", 0)
            a["layers"] |= facts.get("layers", set())
            a["ids"] |= facts.get("ids", set())
            a["max"] = max(a["max"], facts.get("max", -np.inf))
    bar.close()
    for (sid, f, check), a in value_findings.items():
        what = {
            ("hidden", "nan_inf"): f"{a['values']} NaN/Inf values (layers {sorted(a['layers'])})",
            ("topk_logprobs", "nan_inf"): f"{a['values']} NaN/Inf log-probs",
            ("topk_logprobs", "positive"): f"log-probs > 0 (max {a['max']:.4g})",
            ("topk_logprobs", "not_descending"): "top-k log-probs not descending",
        }.get((f, check), f"ids outside [0, {spec.vocab_size}), e.g. {sorted(a['ids'])[:5]}")
        s = a["shard"]
        problems.add(sid, f, check, f"{what} at {a['tokens']} token(s), first token {a['first']}",
                     samples=a["samples"] if s["mapping"] is not None else None, tokens=(a["first"], a["last"]),
                     global_start=s["global_start"], committed_samples=s["commit"]["samples"])

    summary = [{"shard_id": s["shard_id"], "state": ("complete" if s["attrs"].get("complete") else
                                                     "empty" if s["commit"]["samples"] == 0 else "partial"),
                "samples": s["commit"]["samples"], "planned_samples": s["planned"]["samples"],
                "tokens": s["commit"]["tokens"], "planned_tokens": s["planned"]["tokens"]} for s in shards]
    return {"path": path, "ok": problems.total == 0, "num_problems": problems.total,
            "problems": problems.items, "problems_left_out": problems.total - len(problems.items),
            "chunks_read": len(chunk_jobs) + n_meta, "shards": summary,
            "samples": sum(x["samples"] for x in summary), "tokens": sum(x["tokens"] for x in summary)}


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
                storage_options: dict | None = None) -> dict[str, Any]:
    """Lengths and assistant fraction over every committed sample; activation and top-k
    statistics over ``max_samples`` samples drawn without replacement (seeded; all if fewer)."""
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
        raw = reader.read_raw(int(i), ("input_ids", "loss_mask", "hidden", "topk_ids", "topk_logprobs"))
        x = bf16_bits_to_float32(raw["hidden"]).astype(np.float64)  # (T, L, D)
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
    }
