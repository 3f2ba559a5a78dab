"""``dflash-cache verify``: read every committed chunk of a cache and report each problem.

Checksums (crc32c of every chunk, through zarr), NaN/Inf in the hidden states (a lossy
codec's NaN payloads, and its scales: finite and not negative), monotone offsets, counts
against the commit records, top-k log-probs (in any stored precision). Returns a plain dict that
names shard, array, chunk and sample of every problem; ``cache_cli`` formats it.
``verify_cache`` deliberately does not go through ``CacheReader``: the reader refuses a
shard whose offsets disagree with its commit record, and verify must report that, not die.
"""

from __future__ import annotations

import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import zarr
from tqdm import tqdm

from dflash.shared.cache import (ATTRS_KEY, HIDDEN_SCALE, CacheError, CacheSpec, ShardPlan, decode_topk_logprobs,
                                 open_root, read_shard_state, token_array_shapes)
from dflash.shared.inspect import META_FIELDS, _ceil_div, _chunk_tokens

BF16_EXP_MASK = 0x7F80  # exponent bits of a bfloat16; all ones = Inf or NaN
FP8_NAN_BITS = 0x7F  # e4m3fn has no Inf; NaN is every bit but the sign set
MAX_LISTED_SAMPLES = 1000  # per problem, in the JSON; the count is always complete
LOGPROB_TOL = 1e-5  # fp32 log_softmax rounding: "> 0" and "not descending" allow this much


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
    if name == "topk_logprobs":
        data = decode_topk_logprobs(spec, data).numpy()
    if name == "hidden" and (spec.hidden_codec == "bf16" or spec.hidden_codec == "fp8"):
        if spec.hidden_codec == "bf16":
            bad = (data & BF16_EXP_MASK) == BF16_EXP_MASK  # (n, L, D)
        else:
            bad = (data & 0x7F) == FP8_NAN_BITS  # (n, L, D): int payloads have no NaN
        if bad.any():
            per_layer = bad.any(axis=2)  # (n, L)
            layers = [spec.layer_ids[j] for j in np.flatnonzero(per_layer.any(axis=0))]
            found.append(("nan_inf", t0 + np.flatnonzero(per_layer.any(axis=1)),
                          {"values": int(bad.sum()), "layers": set(layers)}))
    elif name == HIDDEN_SCALE:
        bad = ~np.isfinite(data) | (data < 0)  # (n, L, G)
        if bad.any():
            per_layer = bad.any(axis=2)
            layers = [spec.layer_ids[j] for j in np.flatnonzero(per_layer.any(axis=0))]
            found.append(("bad_scale", t0 + np.flatnonzero(per_layer.any(axis=1)),
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
    expected_tail = {f: shape[1:] for f, (shape, _) in token_array_shapes(spec, 0).items()}
    token_fields = spec.token_fields
    for name in names:
        if not name.isdigit():
            problems.add(None, None, "structure", f"unexpected group shards/{name}")
            continue
        sid, g = int(name), root["shards"][name]
        try:
            state = read_shard_state(g)
        except CacheError as e:
            problems.add(sid, None, "structure", str(e))
            continue
        commit, planned = state.commit.as_dict(), state.planned.as_dict()
        arrays = {}
        for f in token_fields + META_FIELDS:
            if f not in g:
                problems.add(sid, f, "structure", "array missing")
                continue
            arr = g[f]
            want = ((planned["tokens"],) + expected_tail[f]) if f in token_fields else None
            if want is not None and tuple(arr.shape) != want:
                problems.add(sid, f, "structure", f"shape {tuple(arr.shape)}, spec and plan say {want}")
                continue
            arrays[f] = arr
        shards.append({"shard_id": sid, "group": g, "commit": commit, "planned": planned, "state": state,
                       "arrays": arrays, "global_start": global_start})
        global_start += commit["samples"]

    chunk_jobs = []
    for s in shards:
        committed = min(s["commit"]["tokens"], s["planned"]["tokens"])
        for f in token_fields:
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
        if s["state"].complete and commit != planned:
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
        if off is not None and src is not None and bat is not None:
            try:
                digest = ShardPlan(src, np.diff(off), bat, dict(s["state"].skipped)).digest()
            except ValueError:
                digest = None  # already reported above
            if digest is not None and digest != s["state"].plan_digest:
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
            (HIDDEN_SCALE, "bad_scale"): f"{a['values']} scales NaN, Inf or negative (layers {sorted(a['layers'])})",
            ("topk_logprobs", "nan_inf"): f"{a['values']} NaN/Inf log-probs",
            ("topk_logprobs", "positive"): f"log-probs > 0 (max {a['max']:.4g})",
            ("topk_logprobs", "not_descending"): "top-k log-probs not descending",
        }.get((f, check), f"ids outside [0, {spec.vocab_size}), e.g. {sorted(a['ids'])[:5]}")
        s = a["shard"]
        problems.add(sid, f, check, f"{what} at {a['tokens']} token(s), first token {a['first']}",
                     samples=a["samples"] if s["mapping"] is not None else None, tokens=(a["first"], a["last"]),
                     global_start=s["global_start"], committed_samples=s["commit"]["samples"])

    summary = [{"shard_id": s["shard_id"], "state": s["state"].status,
                "samples": s["commit"]["samples"], "planned_samples": s["planned"]["samples"],
                "tokens": s["commit"]["tokens"], "planned_tokens": s["planned"]["tokens"]} for s in shards]
    return {"path": path, "ok": problems.total == 0, "num_problems": problems.total,
            "problems": problems.items, "problems_left_out": problems.total - len(problems.items),
            "chunks_read": len(chunk_jobs) + n_meta, "shards": summary,
            "samples": sum(x["samples"] for x in summary), "tokens": sum(x["tokens"] for x in summary)}
