"""One process of an extraction run: under torchrun rank r of W extracts shards r, r + W, ... on cuda:LOCAL_RANK; the
ranks meet over gloo (`meeting`) at each step before any shard is written."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import zarr

from dflash.shared.cache import ATTRS_KEY, CacheError, CacheSpec, create_or_open_cache, open_root, read_shard_states
from dflash.shared.compression import size_text
from dflash.shared.fingerprint import target_fingerprint, tokenizer_fingerprint
from dflash.shared.inspect import cache_info
from dflash.shared.shard_lock import ShardLock

from .chat import end_of_turn_id, mask_method
from .config import ExtractConfig, ExtractFailed, checked_layers, load_tokenizer_and_config
from .data import DataError, dataset_fingerprint, load_source
from .plan import plan_shard, run_space_problem, shard_slice
from .worker import WorkerTask, describe_error, extract_shard

log = logging.getLogger(__name__)

# the ExtractConfig fields that decide the cache's bytes (the attention kernel and head chunks change bf16 roundings)
FINGERPRINTED = ("topk", "max_length", "truncation", "min_length", "on_bad_row", "batch_tokens",
                 "chunk_tokens", "compression_level", "attn_implementation", "lm_head_chunk")
NOT_RECORDED = ("out", "summary_json", "progress", "wait_for_lock", "plan", "json", "ignore_free_space")


def build_spec(cfg: ExtractConfig, tokenizer, model_config, ds, num_shards: int) -> CacheSpec:
    """The root CacheSpec of this run: shapes, fingerprint (compared on reopen) and info."""
    from importlib.metadata import PackageNotFoundError, version

    package_version, eot = "unknown", None
    with contextlib.suppress(PackageNotFoundError):
        package_version = version("dflash-pipeline")
    layers = checked_layers(cfg, model_config)
    with contextlib.suppress(ValueError):  # no end of turn found in the template
        eot = end_of_turn_id(tokenizer, cfg.end_of_turn, cfg.template_kwargs)
    extraction = {f: getattr(cfg, f) for f in FINGERPRINTED}
    extraction.update(layers=layers, layer_convention="hidden_states[i + 1]", num_shards=num_shards,
                      shard_rows="contiguous", chat_template={
                          "mask_method": mask_method(tokenizer), "end_of_turn": cfg.end_of_turn,
                          "end_of_turn_id": eot, "template_kwargs": dict(cfg.template_kwargs)})
    info_cfg = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_RECORDED}
    dataset = dataset_fingerprint(ds, cfg.data, cfg.split or "train")
    target = target_fingerprint(cfg.model, model_config.to_dict(), cfg.dtype, revision=cfg.revision)
    # recorded, not compared: `datasets`' own fingerprint and where hashed files lie (moved data is the same cache)
    located = {"datasets_fingerprint": dataset.pop("datasets_fingerprint", None)}
    if dataset.get("hash_method") == "files-sha256":
        located["dataset_source"] = dataset.pop("source")
        located["dataset_resolved_path"] = dataset.pop("resolved_path", None)
    if target.get("weights_hash"):
        located["target_path"] = os.path.abspath(target.pop("name_or_path"))  # training's default --target
    spec = CacheSpec(
        layer_ids=layers, hidden_size=model_config.hidden_size, topk=cfg.topk, vocab_size=model_config.vocab_size,
        num_target_layers=model_config.num_hidden_layers, max_length=cfg.max_length, truncation=cfg.truncation,
        chunk_tokens=cfg.chunk_tokens, compression_level=cfg.compression_level,
        fingerprint={"target": target, "tokenizer": tokenizer_fingerprint(tokenizer), "dataset": dataset,
                     "extraction": extraction},
        info={"package_version": package_version, "config": info_cfg, **located},
        hidden_codec=cfg.hidden_codec, hidden_group_size=cfg.hidden_group_size,
        hidden_scale_dtype=cfg.hidden_scale_dtype, topk_dtype=cfg.topk_dtype,
    )
    if spec.encoded:  # fingerprinted where not lossless, so a lossless cache's fingerprint is as before codecs
        spec.fingerprint["extraction"]["encoding"] = spec.encoding()
    return spec


def prepare_root(cfg: ExtractConfig, spec: CacheSpec, replace: bool = True) -> zarr.Group:
    """Create the cache root, or reopen it once its fingerprint is checked; ``replace`` (rank 0's)
    replaces one that differs but holds no committed sample. ExtractFailed names each difference."""
    try:
        return create_or_open_cache(cfg.out, spec, replace_uncommitted=replace)
    except CacheError as e:
        lines = []  # each difference a flag explains followed by that flag
        for line in str(e).split("\n"):
            key = line.strip().removeprefix("- ").split(":", 1)[0]
            hint = next((h for k, h in FLAG_HINTS.items() if key == k or key.startswith(k + ".")), None)
            lines.append(f"{line}  [{hint}]" if hint else line)
        raise ExtractFailed("\n".join(lines)) from e


FLAG_HINTS = {  # fingerprint entries whose name alone does not say which flag sets them
    "fingerprint.tokenizer.chat_template_hash": "the chat template (--chat-template, or the tokenizer's own)",
    "fingerprint.extraction.chat_template.template_kwargs": "--template-kwargs",
    "fingerprint.extraction.chat_template.end_of_turn": "--end-of-turn",
    "hidden_codec": "--hidden-codec", "hidden_group_size": "--hidden-group-size",
    "hidden_scale_dtype": "--hidden-scale-dtype", "topk_dtype": "--topk-dtype",
    "fingerprint.extraction.num_shards": "--shards (default: torchrun's WORLD_SIZE, 1 without torchrun)",
}


def summarize(out: str, shard_ids: list[int]) -> dict[str, Any]:
    """What the store holds for these shards, as ``dflash-cache info`` counts it."""
    info = cache_info(out, shard_ids=shard_ids)
    disk = info["committed_bytes_on_disk"]  # None where the store cannot list its objects
    stored = disk["total"] if disk else None
    return {
        "out": out, "shards": shard_ids, "skipped": dict(sorted(info["skipped"].items())), "bytes_stored": stored,
        **{k: info[k] for k in ("complete", "samples", "planned_samples", "tokens", "assistant_tokens")},
        "hidden_bytes_raw_bf16": info["raw_bytes"]["hidden"],
        "hidden_bytes_stored": disk["hidden"] if disk else None,
        "hidden_compression": info["compression_ratio"]["hidden"],
        "other_bytes_raw": info["raw_bytes"]["total"] - info["raw_bytes"]["hidden"],
        "other_bytes_stored": stored - disk["hidden"] if disk else None,
        "compression": info["compression_ratio"]["total"],
        "bytes_per_token": stored / info["tokens"] if stored is not None and info["tokens"] else None,
    }


def format_summary(s: dict[str, Any]) -> str:
    skipped = ", ".join(f"{k}={v}" for k, v in s["skipped"].items()) or "none"
    disk = "unknown (the store cannot list)" if s["bytes_stored"] is None else size_text(s["bytes_stored"])
    lines = [
        f"cache {s['out']}: shards {s['shards'][0]:05d}..{s['shards'][-1]:05d} "
        f"{'complete' if s['complete'] else 'INCOMPLETE (rerun the same command to resume)'}",
        f"  samples written  {s['samples']:,} of {s['planned_samples']:,} planned "
        f"({s.get('samples_this_run', 0):,} this run)",
        f"  skipped rows     {sum(s['skipped'].values()):,} ({skipped})",
        f"  tokens           {s['tokens']:,} ({s['assistant_tokens']:,} assistant)",
        f"  on disk          {disk}" + (f" ({s['bytes_per_token']:,.0f} B/token)" if s["bytes_per_token"] else ""),
    ]
    if s["hidden_compression"]:
        lines.append(f"  compression      hidden states {s['hidden_compression']:.2f}x vs raw bf16 "
                     f"({size_text(s['hidden_bytes_raw_bf16'])} -> {size_text(s['hidden_bytes_stored'])}); all arrays "
                     f"{s['compression']:.2f}x ({size_text(s['hidden_bytes_raw_bf16'] + s['other_bytes_raw'])} raw)")
    if "wall_s" in s:
        rate = f", {s['tokens_per_s']:,.0f} tokens/s" if s.get("tokens_per_s") else ""
        lines.append(f"  wall time        {s['wall_s']:.1f} s{rate}")
    timing = list((s.get("worker_seconds") or {}).values())  # where the workers' time went
    loop = sum(t["loop_s"] for t in timing)
    if loop > 0:
        blocked = sum(t.get("submit_blocked", 0.0) for t in timing)
        lines.append(f"  forward loops    {loop:.1f} s, {blocked / loop:.0%} of it waiting for the writers" + (
            f"; GPU busy {sum(t['gpu_busy'] for t in timing) / loop:.0%}" if all("gpu_busy" in t for t in timing)
            else ""))
        if blocked > 0.1 * loop and loop >= 10:  # a tenth of the loop waiting; shorter loops are mostly start-up
            cores = sum(t["cpu_s"] for t in timing) / loop
            lines.append(f"  writer-bound: compression and writes could not keep up on {cores:.1f} CPU cores per "
                         "worker; give each worker more free cores")
    return "\n".join(lines)


MEETING_TIMEOUT = timedelta(days=7)  # at the last meeting, a rank waits for the slowest rank's shards
GIL_SWITCH_S = 0.0005  # at Python's 5 ms the writer thread waits that long at every hand-off (BENCHMARKS_LOG.md)


def run(cfg: ExtractConfig) -> dict[str, Any] | None:
    """Extract (or resume) this process's shards; rank 0 returns the summary of the whole cache,
    the other ranks None. Raises ExtractFailed with this rank's message."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    group = world > 1 and not dist.is_initialized()
    if group:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=MEETING_TIMEOUT)
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # torchrun stopping the run: commit, then stop
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar per process would interleave
    try:
        return _run(cfg, rank, world)
    finally:
        if group:
            dist.destroy_process_group()


def _run(cfg: ExtractConfig, rank: int, world: int) -> dict[str, Any] | None:
    t_start, phases = time.monotonic(), Phases()
    num_shards = cfg.shards or world
    with meeting(world):  # once rank 0 has prepared the root
        tokenizer, model_config = load_tokenizer_and_config(cfg)
        phases.mark("tokenizer_and_config")
        try:
            ds = load_source(cfg.data, cfg.split or "train")
        except DataError as e:
            raise ExtractFailed(str(e)) from e
        phases.mark("dataset_load")
        spec = build_spec(cfg, tokenizer, model_config, ds, num_shards)
        phases.mark("fingerprint")
        if rank == 0:
            prepare_root(cfg, spec)
            phases.mark("cache_root")
    progress, locks = Progress(cfg.progress and rank == 0), []
    try:
        with meeting(world) as planning:  # once every rank has locked and planned its shards
            states, tasks, planned = _lock_and_plan(cfg, rank, world, num_shards, spec, tokenizer, ds, progress, locks)
            planning["share"] = {s: {"tokens": p.plan.num_tokens, "samples": len(p.plan.source_index)}
                                 for s, (p, _) in planned.items()}
        if tasks is None:
            log.info("%s: shards 0..%d already complete; nothing to do", cfg.out, num_shards - 1)
            summary = summarize(cfg.out, list(range(num_shards))) if rank == 0 else None
            return summary and {**summary, "noop": True, "samples_this_run": 0, "tokens_per_s": None,
                                "wall_s": time.monotonic() - t_start}
        with meeting(world):  # once rank 0 has checked the free space for what is left to write
            if rank == 0 and not cfg.ignore_free_space:
                sizes = {s: n for share in planning["shared"] for s, n in share.items()}
                committed = {s: st.commit for s, st in states.items() if st is not None}
                if problem := run_space_problem(cfg, tasks[0].spec, sizes, committed):
                    raise ExtractFailed(problem)
        phases.mark("planning")
        error = _extract_shards(cfg, tasks, planned, locks, tokenizer.pad_token_id, progress)
    finally:
        for lock in locks:
            lock.release()
        progress.bar.close()
    done = _gather(world, {"samples": progress.samples, "tokens": progress.tokens, "timing": progress.timing,
                           "forward_s": progress.last - progress.first if progress.last else 0.0, "error": error})
    if rank != 0:
        if error:
            raise ExtractFailed(error)
        return None
    for name, at in (("writer_start", progress.first), ("forward_loop", progress.last)):
        if at is not None:
            phases.mark(name, at)
    phases.mark("drain_and_exit")
    summary = summarize(cfg.out, list(range(num_shards)))
    phases.mark("summary")
    forward_s = max(d["forward_s"] for d in done)
    summary.update(noop=False, samples_this_run=sum(d["samples"] for d in done), wall_s=time.monotonic() - t_start,
                   phases={"started_at": phases.started_at, "seconds": phases.seconds},
                   worker_seconds=dict(sorted(t for d in done for t in d["timing"].items())),
                   tokens_per_s=sum(d["tokens"] for d in done) / forward_s if forward_s > 0 else None)
    if failed := [str(r) for r, d in enumerate(done) if d["error"]]:
        raise ExtractFailed((error or f"rank {', '.join(failed)} failed (see its error)") + "\n\n"
                            + format_summary(summary))
    return summary


def _lock_and_plan(cfg: ExtractConfig, rank: int, world: int, num_shards: int, spec: CacheSpec, tokenizer, ds,
                   progress: Progress, locks: list):
    """(every shard's state, this rank's tasks, {shard: (plan, its seconds)}), its shards locked into
    ``locks`` (the caller releases them) and planned; tasks None where every shard is complete."""
    root = prepare_root(cfg, spec, replace=False) if rank else open_root(cfg.out)  # the others check it now
    spec = CacheSpec.from_dict(root.attrs[ATTRS_KEY])  # an older format is resumed in its own layout
    states = read_shard_states(root, list(range(num_shards)))
    if all(st is not None and st.complete for st in states.values()):
        return states, None, {}
    device, tasks, planned = use_device(cfg), [], {}
    for shard in range(rank, num_shards, world):
        task = WorkerTask(cfg=cfg, spec=spec, shard_id=shard, device=device)
        try:
            locks.append(ShardLock(cfg.out, shard).take(progress.warn, cfg.wait_for_lock))
            t = time.perf_counter()
            plan = plan_shard(*shard_slice(ds, num_shards, shard), cfg.data, tokenizer, cfg)
            planned[shard] = plan, round(time.perf_counter() - t, 3)
        except Exception as e:  # noqa: BLE001 - said as the user reads it
            raise ExtractFailed(describe_error(e, task)) from e
        tasks.append(task)
    return states, tasks, planned


def use_device(cfg: ExtractConfig) -> str:
    """Set this process up: its torch threads on the CPU (the cores shared by torchrun's local processes),
    the GIL switch interval, cuda:LOCAL_RANK as its CUDA device; that device."""
    sys.setswitchinterval(GIL_SWITCH_S)
    if cfg.device == "cpu":
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(cfg.cpu_threads or max(1, (os.cpu_count() or 1) // local_processes))
        return "cpu"
    local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local >= count:
        raise ExtractFailed("--device cuda but no CUDA device is visible (use --device cpu)" if not count else
                            f"LOCAL_RANK {local}: only {count} CUDA devices are visible (start one process per GPU)")
    torch.cuda.set_device(local)
    return f"cuda:{local}"


def _extract_shards(cfg: ExtractConfig, tasks: list[WorkerTask], planned: dict, locks: list, pad_id: int | None,
                    progress: Progress) -> str | None:
    """Extract this rank's planned, locked shards in turn with one target; the error that stopped them, or None."""
    runners: list = []
    try:
        for task, lock in zip(tasks, locks):
            plan, plan_s = planned[task.shard_id]
            try:
                timing = extract_shard(task, plan, pad_id, lock, progress.report, runners)
            except Exception as e:  # noqa: BLE001 - said as the user reads it
                return describe_error(e, task)
            if timing is not None:  # None: already complete, no loop to time
                progress.timing[f"{task.shard_id:05d}"] = {"plan_s": plan_s, **timing}
    except KeyboardInterrupt:
        raise ExtractFailed("interrupted; every shard committed what it had. Rerun the same command to resume.\n\n"
                            + format_summary(summarize(cfg.out, [t.shard_id for t in tasks]))) from None
    finally:
        for runner in runners:
            runner.close()
    return None


def _gather(world: int, mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order, once every rank has sent its own."""
    if world == 1:
        return [mine]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


@contextlib.contextmanager
def meeting(world: int):
    """A step every rank takes, then waits for all (a failed rank raises its error, the others ExtractFailed
    naming it); ``m["share"]`` set in the step comes back from every rank in ``m["shared"]``."""
    m = {"share": None}
    try:
        yield m
    except Exception:
        _gather(world, (True, None))
        raise
    everyone = _gather(world, (False, m["share"]))
    if failed := [str(r) for r, (bad, _) in enumerate(everyone) if bad]:
        raise ExtractFailed(f"stopped: rank {', '.join(failed)} failed (see its error)")
    m["shared"] = [share for _, share in everyone]


class Progress:
    """This process's ``report(kind, **fields)`` handler: its counts and its shards' timings, warnings
    on stderr, and the progress bar (rank 0's, over its own shards)."""

    def __init__(self, show: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=0, unit="sample", dynamic_ncols=True, disable=not show, desc="extract")
        self.samples = self.tokens = 0
        self.first = self.last = None  # monotonic times of the first loop's start and of the last batch written
        self.timing: dict[str, dict] = {}  # each shard's seconds: planning, model load, head, loop

    def report(self, kind: str, **f) -> None:
        if kind == "planned":
            self.bar.total += f["samples"]
            self.bar.update(f["done_samples"])
        elif kind == "started":
            self.first = self.first or time.monotonic()
        elif kind == "progress":  # from the writer thread
            self.last = time.monotonic()
            self.samples += f["samples"]
            self.tokens += f["tokens"]
            self.bar.update(f["samples"])
            if self.last > self.first:
                self.bar.set_postfix_str(f"{self.tokens / (self.last - self.first):,.0f} tok/s", refresh=False)

    def warn(self, message: str) -> None:
        self.bar.write(f"dflash-extract: warning: {message}", file=sys.stderr)


class Phases:
    """Seconds spent in each step of a run, in order (the summary's ``phases``), from ``started_at``
    (epoch seconds when ``run`` began; what came before is imports)."""

    def __init__(self):
        self.started_at, self._last, self.seconds = time.time(), time.monotonic(), {}

    def mark(self, name: str, at: float | None = None) -> None:  # step ``name`` ended now, or at monotonic ``at``
        at = max(self._last, time.monotonic() if at is None else at)
        self.seconds[name] = round(at - self._last, 3)
        self._last = at
