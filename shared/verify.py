"""``dflash-cache verify``: read every committed chunk of a cache and report each problem by shard, array, chunk and
samples; directly, since ``CacheReader`` refuses a shard whose offsets disagree with its commit record."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import zarr
from tqdm import tqdm

from dflash.shared.cache import (HIDDEN_SCALE, META_FIELDS, CacheError, CacheSpec, ShardPlan, ShardState,
                                 decode_topk_logprobs, open_spec, read_shard_state, token_array_shapes)

NAN_BITS = {"bf16": 0x7F80, "fp8": 0x7F}  # all set: Inf or NaN (bf16's exponent); NaN (e4m3fn has no Inf)
MAX_LISTED_SAMPLES = 1000  # per problem, in the JSON; the count is always complete
LOGPROB_TOL = 1e-5  # fp32 log_softmax rounding: "> 0" and "not descending" allow this much


@dataclass
class _Shard:
    sid: int
    state: ShardState
    arrays: dict[str, zarr.Array]
    global_start: int  # global index of its first sample (by the commit records of the shards before it)
    mapping: np.ndarray | None = None  # its committed offsets made monotone, to find a token's sample

    def samples_of(self, tokens):
        return np.clip(np.searchsorted(self.mapping, tokens, side="right") - 1, 0, max(len(self.mapping) - 2, 0))


class _Problems:
    """Collects problems up to a cap, counting all of them."""

    def __init__(self, cap: int):
        self.cap, self.total, self.items = cap, 0, []

    def add(self, shard: int | None, array: str | None, check: str, message: str,
            samples: Iterable[int] | None = None, of: _Shard | None = None, tokens: tuple[int, int] | None = None):
        """``samples``: local indices in shard ``of``, which numbers them globally."""
        self.total += 1
        if len(self.items) >= self.cap:
            return
        local = num_samples = glob = None
        if samples is not None:
            local = sorted({int(s) for s in samples})
            num_samples, local = len(local), local[:MAX_LISTED_SAMPLES]
            glob = [of.global_start + s if s < of.state.commit.samples else None for s in local]
        where = f"shard {shard:05d}" if shard is not None else "cache"
        if local:
            shown = ", ".join(map(str, local[:5])) + (f", ... ({num_samples} samples)" if num_samples > 5 else "")
            where += f" sample {shown} (global {', '.join('-' if g is None else str(g) for g in glob[:5])})"
        where += f" {array}" if array else ""
        self.items.append({"shard": shard, "array": array, "check": check, "samples": local, "num_samples": num_samples,
                           "global_samples": glob, "tokens": list(tokens) if tokens else None,
                           "message": f"{where}: {message}"})


def _check_token_chunk(s: _Shard, name: str, c: int, committed: int, spec: CacheSpec):
    """Read chunk c whole, check its committed part; returns (error, [(check, bad tokens, facts)])."""
    arr = s.arrays[name]
    t0 = c * arr.chunks[0]
    try:
        data = np.asarray(arr[t0:t0 + arr.chunks[0]])[: committed - t0]
    except Exception as e:  # crc32c mismatch, truncated or garbled blosc frame, missing key...
        return f"{type(e).__name__}: {e}", []
    checks = []  # (check, the chunk's rows that fail it, what to report: computed only where a row fails)
    if name == HIDDEN_SCALE or name == "hidden" and spec.hidden_codec in NAN_BITS:  # int payloads have no NaN
        bits = NAN_BITS.get(spec.hidden_codec)
        bad = ~np.isfinite(data) | (data < 0) if name == HIDDEN_SCALE else (data & bits) == bits  # (n, L, D or G)
        per_layer = bad.any(axis=2)  # (n, L)
        checks.append(("bad_scale" if name == HIDDEN_SCALE else "nan_inf", per_layer.any(axis=1), lambda: {
            "values": int(bad.sum()), "layers": {spec.layer_ids[j] for j in np.flatnonzero(per_layer.any(axis=0))}}))
    elif name == "topk_logprobs":
        data = decode_topk_logprobs(spec, data).numpy()
        with np.errstate(invalid="ignore"):
            checks += [("nan_inf", ~np.isfinite(data).all(axis=1), lambda: {"values": int((~np.isfinite(data)).sum())}),
                       ("positive", (data > LOGPROB_TOL).any(axis=1), lambda: {"max": float(np.nanmax(data))}),
                       ("not_descending", (np.diff(data, axis=1) > LOGPROB_TOL).any(axis=1), dict)]
    elif name in ("input_ids", "topk_ids"):
        wrong = (data < 0) | (data >= spec.vocab_size)
        checks.append(("out_of_vocab", wrong.reshape(len(data), -1).any(axis=1),
                       lambda: {"ids": set(np.unique(data[wrong])[:5].tolist())}))
    return None, [(check, t0 + np.flatnonzero(rows), facts()) for check, rows, facts in checks if rows.any()]


def _read_meta(s: _Shard, name: str, problems: _Problems) -> np.ndarray | None:
    arr = s.arrays[name]
    C, parts = arr.chunks[0], []
    for c in range(-(-arr.shape[0] // C)):
        try:
            parts.append(np.asarray(arr[c * C:(c + 1) * C]))
        except Exception as e:
            problems.add(s.sid, name, "undecodable", f"chunk {c} cannot be decoded: {type(e).__name__}: {e}")
            return None
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def _check_structure(s: _Shard, spec: CacheSpec, problems: _Problems) -> np.ndarray | None:
    """Commit record, offsets, batches and plan digest of one shard; sets ``s.mapping`` and
    returns its committed source rows (None where unreadable)."""
    sid, commit, planned = s.sid, s.state.commit.as_dict(), s.state.planned.as_dict()
    ns = commit["samples"]
    off, src, bat = (_read_meta(s, f, problems) if f in s.arrays else None for f in META_FIELDS)
    for k in ("batches", "samples", "tokens"):
        if commit[k] > planned[k]:
            problems.add(sid, None, "commit", f"commit record has {commit[k]} {k}, plan has only {planned[k]}")
    if s.state.complete and commit != planned:
        problems.add(sid, None, "commit", f"marked complete but commit {commit} != planned {planned}")
    if off is not None:
        if len(off) != planned["samples"] + 1:
            problems.add(sid, "offsets", "offsets", f"{len(off)} entries, plan has {planned['samples']} samples")
        elif off[0] != 0:
            problems.add(sid, "offsets", "offsets", f"starts at {off[0]}, not 0", samples=[0], of=s)
        lengths = np.diff(off)
        for check, bad, what in (
                ("offsets", lengths < 0, "offsets decrease (negative sample length)"),
                ("lengths", lengths == 0, "samples of length 0"),
                ("lengths", lengths > spec.max_length, f"samples longer than max_length {spec.max_length} "
                 f"(longest {int(lengths.max()) if len(lengths) else 0})")):
            if bad.any():
                problems.add(sid, "offsets", check, what, samples=np.flatnonzero(bad), of=s)
        if len(off) > ns and off[ns] != commit["tokens"]:
            problems.add(sid, "offsets", "offsets",
                         f"offsets[{ns}] = {off[ns]}, commit record says {commit['tokens']} tokens")
        if len(off) and off[-1] != planned["tokens"]:
            problems.add(sid, "offsets", "offsets", f"ends at {off[-1]}, plan has {planned['tokens']} tokens")
        s.mapping = np.maximum.accumulate(off[: ns + 1]) if len(off) > ns else None
    if bat is not None:
        if len(bat) != planned["batches"] + 1 or len(bat) == 0 or bat[0] != 0 or bat[-1] != planned["samples"] \
                or np.any(np.diff(bat) <= 0):
            problems.add(sid, "batches", "batches",
                         "batches are not increasing sample offsets from 0 to the planned samples")
        elif commit["batches"] < len(bat) and bat[commit["batches"]] != ns:
            problems.add(sid, "batches", "commit", f"commit record: {commit['batches']} batches = "
                         f"{bat[commit['batches']]} samples, record says {ns}")
    if off is not None and src is not None and bat is not None:
        try:
            if ShardPlan(src, np.diff(off), bat, dict(s.state.skipped)).digest() != s.state.plan_digest:
                problems.add(sid, None, "plan_digest", "offsets/source_index/batches differ from the plan the shard "
                             "was written with")
        except ValueError:
            pass  # an invalid plan: already reported above
    if src is not None and len(src) != planned["samples"]:
        problems.add(sid, "source_index", "structure", f"{len(src)} entries, plan has {planned['samples']} samples")
    return None if src is None else src[:ns]


def _check_duplicates(shards: list[_Shard], sources: list[np.ndarray | None], problems: _Problems) -> None:
    """source_index unique within and across shards (committed samples only)."""
    owned = [(s, src) for s, src in zip(shards, sources) if src is not None]
    values, counts = np.unique(np.concatenate([np.zeros(0, np.int64)] + [src for _, src in owned]), return_counts=True)
    repeated = values[counts > 1]
    places: dict[int, list[tuple[_Shard, int]]] = {}  # each repeated source row -> the (shard, sample)s holding it
    for s, src in owned:
        for j in np.flatnonzero(np.isin(src, repeated)):
            places.setdefault(int(src[j]), []).append((s, int(j)))
    for v, held in sorted(places.items()):
        for s, j in held:
            others = ", ".join(f"{t.sid:05d}:{k}" for t, k in held if t is not s or k != j)
            problems.add(s.sid, "source_index", "duplicate", f"source row {v} also at shard:sample {others}",
                         samples=[j], of=s)


def verify_cache(path: str, *, max_problems: int = 100, progress: bool = True, workers: int = 4) -> dict[str, Any]:
    """Read and check every committed chunk of every array of every shard; CacheError only for a store not a cache."""
    root, spec = open_spec(path)
    problems = _Problems(max_problems)
    shards: list[_Shard] = []
    for name in sorted(root["shards"].group_keys()) if "shards" in root else []:
        if not name.isdigit():
            problems.add(None, None, "structure", f"unexpected group shards/{name}")
            continue
        sid, g = int(name), root["shards"][name]
        try:
            state = read_shard_state(g)
        except CacheError as e:
            problems.add(sid, None, "structure", str(e))
            continue
        arrays, shapes = {}, token_array_shapes(spec, state.planned.tokens)
        for f in spec.token_fields + META_FIELDS:
            want = shapes[f][0] if f in shapes else None
            if f not in g:
                problems.add(sid, f, "structure", "array missing")
            elif want is not None and tuple(g[f].shape) != want:
                problems.add(sid, f, "structure", f"shape {tuple(g[f].shape)}, spec and plan say {want}")
            else:
                arrays[f] = g[f]
        start = shards[-1].global_start + shards[-1].state.commit.samples if shards else 0
        shards.append(_Shard(sid, state, arrays, start))

    jobs = []  # (shard, array, chunk, committed tokens): every committed chunk of every token array
    for s in shards:
        committed = min(s.state.commit.tokens, s.state.planned.tokens)
        jobs += [(s, f, c, committed) for f in spec.token_fields if f in s.arrays
                 for c in range(-(-committed // s.arrays[f].chunks[0]))]
    n_meta = sum(-(-a.shape[0] // a.chunks[0]) for s in shards for f, a in s.arrays.items() if f in META_FIELDS)
    bar = tqdm(total=len(jobs) + n_meta, unit="chunk", desc="verify", file=sys.stderr, disable=not progress,
               leave=False)
    _check_duplicates(shards, [_check_structure(s, spec, problems) for s in shards], problems)
    bar.update(n_meta)

    findings: dict[tuple[int, str, str], dict[str, Any]] = {}  # merged per (shard, array, check) across chunks
    with ThreadPoolExecutor(max(workers, 1)) as pool:  # each result is small: the chunks are not kept
        results = pool.map(lambda job: _check_token_chunk(*job, spec), jobs)
        for (s, f, c, committed), (error, found) in zip(jobs, results):
            bar.update(1)
            t0, t1 = c * s.arrays[f].chunks[0], min((c + 1) * s.arrays[f].chunks[0], committed)
            if error is not None:
                samples = None if s.mapping is None else range(int(s.samples_of(t0)), int(s.samples_of(t1 - 1)) + 1)
                problems.add(s.sid, f, "undecodable", f"chunk {c} (tokens {t0}:{t1}) cannot be decoded: {error}",
                             samples=samples, of=s, tokens=(t0, t1))
            for check, toks, facts in found:
                a = findings.setdefault((s.sid, f, check), {"shard": s, "toks": [], "values": 0, "layers": set(),
                                                            "ids": set(), "max": -np.inf})
                a["toks"].append(toks)
                for k, v in facts.items():
                    a[k] = a[k] | v if isinstance(v, set) else max(a[k], v) if k == "max" else a[k] + v
    bar.close()
    for (sid, f, check), a in findings.items():
        s, toks = a["shard"], np.concatenate(a["toks"])
        what = {
            ("hidden", "nan_inf"): f"{a['values']} NaN/Inf values (layers {sorted(a['layers'])})",
            (HIDDEN_SCALE, "bad_scale"): f"{a['values']} scales NaN, Inf or negative (layers {sorted(a['layers'])})",
            ("topk_logprobs", "nan_inf"): f"{a['values']} NaN/Inf log-probs",
            ("topk_logprobs", "positive"): f"log-probs > 0 (max {a['max']:.4g})",
            ("topk_logprobs", "not_descending"): "top-k log-probs not descending",
        }.get((f, check), f"ids outside [0, {spec.vocab_size}), e.g. {sorted(a['ids'])[:5]}")
        problems.add(sid, f, check, f"{what} at {len(toks)} token(s), first token {int(toks[0])}",
                     samples=s.samples_of(toks).tolist() if s.mapping is not None else None, of=s,
                     tokens=(int(toks[0]), int(toks[-1]) + 1))

    summary = [{"shard_id": s.sid, "state": s.state.status, "samples": s.state.commit.samples,
                "planned_samples": s.state.planned.samples, "tokens": s.state.commit.tokens,
                "planned_tokens": s.state.planned.tokens} for s in shards]
    return {"path": path, "ok": problems.total == 0, "num_problems": problems.total,
            "problems": problems.items, "problems_left_out": problems.total - len(problems.items),
            "chunks_read": len(jobs) + n_meta, "shards": summary,
            "samples": sum(x["samples"] for x in summary), "tokens": sum(x["tokens"] for x in summary)}
