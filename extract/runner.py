"""The parent of an extraction run: fingerprint, create the cache root, spawn one worker
per device, show one progress bar over all of them, and sum up what is on disk.

Across nodes (``torchrun --nproc-per-node 1 --nnodes N dflash-extract ...``) each node
runs this once; node ``r`` owns global shards ``r * W + 0 .. r * W + W - 1`` for its W
local workers. Rank 0 creates the cache root; the others wait until it exists (polling
the store, which works for any URL zarr can open) and then check its fingerprint.

A root that differs from this run's fingerprint is refused, naming each difference, unless
none of its shards committed a sample: then rank 0 replaces it (a run that failed before its
first commit must not block the corrected rerun at the same ``--out``), and the other ranks
wait for the replacement. The local workers are spawned once the root is ready and touch
the cache only once all of them have planned their slices, so a bad row (under
``--on-bad-row error``) stops a node before any of its shards commits.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import os
import queue
import sys
import time
from dataclasses import dataclass
from typing import Any

import zarr

from dflash.shared.cache import (
    ATTRS_KEY, CacheError, CacheMismatch, CacheSpec, committed_samples, create_or_open_cache, read_shard_states,
)
from dflash.shared.compression import size_text
from dflash.shared.fingerprint import target_fingerprint, tokenizer_fingerprint
from dflash.shared.inspect import cache_info
from dflash.shared.shard_lock import ShardLock, ShardLocked

from .chat import end_of_turn_id, mask_method
from .config import ExtractConfig
from .data import DataError, dataset_fingerprint, load_source
from .estimates import run_space_problem
from .tokenizer import load_tokenizer
from .worker import WorkerTask, worker_main

log = logging.getLogger(__name__)

# what ExtractConfig fields describe the bytes of the cache (the rest is how it was run);
# the attention kernel and the LM head's chunking change the bf16 roundings, so a resume
# with others would mix two roundings in one cache
FINGERPRINTED = ("topk", "max_length", "truncation", "min_length", "on_bad_row", "batch_tokens",
                 "chunk_tokens", "compression_level", "attn_implementation", "lm_head_chunk")
NOT_RECORDED = ("out", "summary_json", "progress", "batch_delay_s", "wait_for_lock", "compile_cache",
                "plan", "json", "ignore_free_space")


class ExtractFailed(Exception):
    """A run that cannot go on; the message is for the user (no traceback needed)."""


@dataclass
class NodeLayout:
    rank: int
    """This node's index (torchrun RANK with one process per node; 0 outside torchrun)."""
    nodes: int
    """Number of nodes (torchrun WORLD_SIZE; 1 outside torchrun)."""

    def shard_ids(self, local_workers: int) -> list[int]:
        """Global shard ids of this node's workers: node ``r`` owns ``r * W .. r * W + W - 1``."""
        return [self.rank * local_workers + j for j in range(local_workers)]


def node_layout() -> NodeLayout:
    """Read the torchrun environment only where it is set."""
    if "WORLD_SIZE" not in os.environ:
        return NodeLayout(0, 1)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world != 1:
        raise ExtractFailed(
            f"LOCAL_WORLD_SIZE={local_world}: run one dflash-extract per node (torchrun --nproc-per-node 1); "
            "it spawns one worker per GPU itself")
    return NodeLayout(int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"]))


def node_tasks(cfg: ExtractConfig, spec: CacheSpec, layout: NodeLayout) -> list[WorkerTask]:
    """One task per local worker: the cache's spec, its global shard, its device, its CPU threads."""
    local = cfg.local_workers
    threads = cfg.cpu_threads or max(1, (os.cpu_count() or 1) // local)
    return [WorkerTask(cfg=cfg, spec=spec, shard_id=s, num_shards=layout.nodes * local, device=d,
                       cpu_threads=threads if cfg.device == "cpu" else None)
            for s, d in zip(layout.shard_ids(local), cfg.worker_devices)]


def package_version() -> str:
    try:
        from importlib.metadata import version

        return version("dflash-pipeline")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"


def checked_layers(cfg: ExtractConfig, model_config) -> list[int]:
    """The layers the run stores, with --layers, --topk and the codec's groups checked against the target
    (ExtractFailed naming the flag)."""
    try:
        layers = cfg.layer_ids(model_config.num_hidden_layers)
    except ValueError as e:
        raise ExtractFailed(f"--layers: {e}") from e
    if cfg.topk > model_config.vocab_size:
        raise ExtractFailed(f"--topk {cfg.topk} exceeds the vocabulary size {model_config.vocab_size}")
    try:
        cfg.codec.check_hidden_size(model_config.hidden_size)
    except ValueError as e:
        raise ExtractFailed(f"--hidden-codec {cfg.hidden_codec}, --hidden-group-size {cfg.hidden_group_size}: {e}"
                            ) from e
    return layers


def build_spec(cfg: ExtractConfig, tokenizer, model_config, ds, num_shards: int) -> CacheSpec:
    """The root CacheSpec of this run: shapes, fingerprint (compared on reopen) and info."""
    num_layers = model_config.num_hidden_layers
    layers = checked_layers(cfg, model_config)
    try:
        eot = end_of_turn_id(tokenizer, cfg.end_of_turn, cfg.template_kwargs)
    except ValueError:
        eot = None
    extraction = {f: getattr(cfg, f) for f in FINGERPRINTED}
    extraction.update({
        "layers": layers,
        "layer_convention": "hidden_states[i + 1]",
        "num_shards": num_shards,
        "shard_rows": "contiguous",
        "chat_template": {
            "mask_method": mask_method(tokenizer),
            "end_of_turn": cfg.end_of_turn,
            "end_of_turn_id": eot,
            "template_kwargs": dict(cfg.template_kwargs),
        },
    })
    info_cfg = {k: v for k, v in cfg.to_dict().items() if k not in NOT_RECORDED}
    dataset = dataset_fingerprint(ds, cfg.data, cfg.split or "train")
    target = target_fingerprint(cfg.model, model_config.to_dict(), cfg.dtype, revision=cfg.revision)
    # Recorded, not compared: `datasets`' own fingerprint (it depends on its cache layout, not
    # on the content) and, where the content is hashed, where the files lie: the same data or
    # checkpoint moved, copied or named by another relative path is the same cache.
    located = {"datasets_fingerprint": dataset.pop("datasets_fingerprint", None)}
    if dataset.get("hash_method") == "files-sha256":
        located["dataset_source"] = dataset.pop("source")
        located["dataset_resolved_path"] = dataset.pop("resolved_path", None)
    if target.get("weights_hash"):
        located["target_path"] = os.path.abspath(target.pop("name_or_path"))  # training's default --target
    spec = CacheSpec(
        layer_ids=layers,
        hidden_size=model_config.hidden_size,
        topk=cfg.topk,
        vocab_size=model_config.vocab_size,
        num_target_layers=num_layers,
        max_length=cfg.max_length,
        truncation=cfg.truncation,
        chunk_tokens=cfg.chunk_tokens,
        compression_level=cfg.compression_level,
        fingerprint={
            "target": target,
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "dataset": dataset,
            "extraction": extraction,
        },
        info={"package_version": package_version(), "config": info_cfg, **located},
        hidden_codec=cfg.hidden_codec, hidden_group_size=cfg.hidden_group_size,
        hidden_scale_dtype=cfg.hidden_scale_dtype, topk_dtype=cfg.topk_dtype,
    )
    if spec.encoded:  # fingerprinted where not lossless, so a lossless cache's fingerprint is as before codecs
        spec.fingerprint["extraction"]["encoding"] = spec.encoding()
    return spec


def prepare_root(cfg: ExtractConfig, spec: CacheSpec, layout: NodeLayout) -> zarr.Group:
    """Rank 0 creates, reopens (and checks) or replaces the root; other ranks wait for it, then check."""
    if layout.rank == 0:
        try:
            return create_or_open_cache(cfg.out, spec, replace_uncommitted=True)
        except CacheError as e:
            raise ExtractFailed(_with_flag_hints(str(e))) from e
    deadline = time.monotonic() + cfg.wait_for_root_s
    mismatch = None
    while True:
        try:
            root = zarr.open_group(store=cfg.out, mode="r", zarr_format=3)
            ready = root.attrs.get(ATTRS_KEY) is not None and "shards" in root
        except Exception:  # noqa: BLE001 - not there yet
            ready = False
        if ready:
            try:
                return create_or_open_cache(cfg.out, spec)
            except CacheMismatch as e:
                if committed_samples(root) > 0:
                    raise ExtractFailed(_with_flag_hints(str(e))) from e
                mismatch = e  # an uncommitted root of an earlier run: rank 0 replaces it
            except CacheError as e:
                raise ExtractFailed(str(e)) from e
        if time.monotonic() > deadline:
            what = (f"still holds a root with another fingerprint:\n{mismatch}" if mismatch is not None
                    else "was not created")
            raise ExtractFailed(f"rank {layout.rank}: {cfg.out} {what}\nafter {cfg.wait_for_root_s:.0f} s of waiting "
                                "for rank 0 (did rank 0 fail, or run with other settings?)")
        time.sleep(1.0)


def check_shard_locks(cfg: ExtractConfig, shard_ids: list[int]) -> None:
    """Refuse at once, naming the holder, where another run holds one of these shards' locks
    (the workers take the locks themselves; this only saves planning a run that would be
    refused); under ``wait_for_lock`` only say which shards the workers will wait for."""
    locks = [ShardLock(cfg.out, s) for s in shard_ids]
    lines = [str(ShardLocked(lock, h)) for lock in locks if (h := lock.probe()) is not None]
    if not lines:
        return
    if cfg.wait_for_lock:
        log.warning("%s; its worker waits for it (--wait-for-lock)", "\n".join(lines))
        return
    raise ExtractFailed("\n".join(lines) + "\nLet that run finish or stop it, or rerun with --wait-for-lock to "
                        "wait for it")


FLAG_HINTS = {
    "fingerprint.tokenizer.chat_template_hash": "the chat template (--chat-template, or the tokenizer's own)",
    "fingerprint.extraction.chat_template.template_kwargs": "--template-kwargs",
    "fingerprint.extraction.chat_template.end_of_turn": "--end-of-turn",
    "hidden_codec": "--hidden-codec", "hidden_group_size": "--hidden-group-size",
    "hidden_scale_dtype": "--hidden-scale-dtype", "topk_dtype": "--topk-dtype",
}
"""Fingerprint entries whose name alone does not say which flag sets them."""


def _with_flag_hints(message: str) -> str:
    """``message`` with each difference line that a flag explains followed by that flag."""
    lines = []
    for line in message.split("\n"):
        key = line.strip().removeprefix("- ").split(":", 1)[0]
        hint = next((h for k, h in FLAG_HINTS.items() if key == k or key.startswith(k + ".")), None)
        lines.append(f"{line}  [{hint}]" if hint else line)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- summary


def summarize(out: str, shard_ids: list[int]) -> dict[str, Any]:
    """What the store holds for these shards (counts, skips, bytes, compression), counted by
    the same ``cache_info`` that ``dflash-cache info`` prints."""
    info = cache_info(out, shard_ids=shard_ids)
    tokens = info["tokens"]
    disk = info["committed_bytes_on_disk"]  # None where the store cannot list its objects
    stored = disk["total"] if disk else None
    return {
        "out": out,
        "shards": shard_ids,
        "complete": info["complete"],
        "samples": info["samples"],
        "planned_samples": info["planned_samples"],
        "skipped": dict(sorted(info["skipped"].items())),
        "tokens": tokens,
        "assistant_tokens": info["assistant_tokens"],
        "bytes_stored": stored,
        "hidden_bytes_raw_bf16": info["raw_bytes"]["hidden"],
        "hidden_bytes_stored": disk["hidden"] if disk else None,
        "hidden_compression": info["compression_ratio"]["hidden"],
        "other_bytes_raw": info["raw_bytes"]["total"] - info["raw_bytes"]["hidden"],
        "other_bytes_stored": stored - disk["hidden"] if disk else None,
        "compression": info["compression_ratio"]["total"],
        "bytes_per_token": stored / tokens if stored is not None and tokens else None,
    }


def format_summary(s: dict[str, Any]) -> str:
    skipped = ", ".join(f"{k}={v}" for k, v in s["skipped"].items()) or "none"
    lines = [
        f"cache {s['out']}: shards {s['shards'][0]:05d}..{s['shards'][-1]:05d} "
        f"{'complete' if s['complete'] else 'INCOMPLETE (rerun the same command to resume)'}",
        f"  samples written  {s['samples']:,} of {s['planned_samples']:,} planned "
        f"({s.get('samples_this_run', 0):,} this run)",
        f"  skipped rows     {sum(s['skipped'].values()):,} ({skipped})",
        f"  tokens           {s['tokens']:,} ({s['assistant_tokens']:,} assistant)",
        f"  on disk          {size_text(s['bytes_stored']) if s['bytes_stored'] is not None else 'unknown (the store cannot list)'}"
        + (f" ({s['bytes_per_token']:,.0f} B/token)" if s["bytes_per_token"] else ""),
    ]
    if s["hidden_compression"]:
        lines.append(f"  compression      hidden states {s['hidden_compression']:.2f}x vs raw bf16 "
                     f"({size_text(s['hidden_bytes_raw_bf16'])} -> {size_text(s['hidden_bytes_stored'])}); all arrays "
                     f"{s['compression']:.2f}x ({size_text(s['hidden_bytes_raw_bf16'] + s['other_bytes_raw'])} raw)")
    if "wall_s" in s:
        rate = f", {s['tokens_per_s']:,.0f} tokens/s" if s.get("tokens_per_s") else ""
        lines.append(f"  wall time        {s['wall_s']:.1f} s{rate}")
    lines += _time_lines(list((s.get("worker_seconds") or {}).values()))
    return "\n".join(lines)


WRITER_BOUND = 0.1
"""Share of the forward loops' time spent waiting for the writers above which the summary
says the run was writer-bound (for loops of 10 s or more: shorter ones are mostly start-up)."""


def _time_lines(timing: list[dict[str, float]]) -> list[str]:
    """Where the workers' time went: the forward loops waiting for the writers (and, on CUDA,
    the GPUs' busy share), with a hint when the writers were the limit."""
    loop = sum(t["loop_s"] for t in timing)
    if loop <= 0:
        return []
    blocked = sum(t.get("submit_blocked", 0.0) for t in timing)
    line = f"  forward loops    {loop:.1f} s, {blocked / loop:.0%} of it waiting for the writers"
    if all("gpu_busy" in t for t in timing):
        line += f"; GPU busy {sum(t['gpu_busy'] for t in timing) / loop:.0%}"
    lines = [line]
    if blocked > WRITER_BOUND * loop and loop >= 10:
        cores = sum(t["cpu_s"] for t in timing) / loop
        lines.append(f"  writer-bound: compression and writes could not keep up on {cores:.1f} CPU cores per "
                     "worker; give each worker more free cores")
    return lines


# ----------------------------------------------------------------------------- run


def run(cfg: ExtractConfig) -> dict[str, Any]:
    """Extract (or resume) this node's shards; returns the summary. Raises ExtractFailed."""
    t_start = time.monotonic()
    phases = Phases(started_at=time.time())
    try:
        cfg.validate()
    except ValueError as e:
        raise ExtractFailed(str(e)) from e
    layout = node_layout()
    root, spec, shard_ids = _prepare(cfg, layout, phases)
    states = read_shard_states(root, shard_ids)
    if all(st is not None and st.complete for st in states.values()):
        summary = summarize(cfg.out, shard_ids)
        summary.update(noop=True, samples_this_run=0, wall_s=time.monotonic() - t_start, tokens_per_s=None)
        log.info("%s: shards %s already complete; nothing to do", cfg.out, shard_ids)
        return summary
    _check_devices(cfg)
    committed = {s: st.commit for s, st in states.items() if st is not None}
    space_check = None if cfg.ignore_free_space else functools.partial(run_space_problem, cfg, spec,
                                                                        committed=committed)
    counts = _run_workers(node_tasks(cfg, spec, layout), cfg, phases, before_go=space_check)

    summary = summarize(cfg.out, shard_ids)
    phases.mark("summary")
    wall = time.monotonic() - t_start
    summary.update(noop=False, samples_this_run=counts["samples"], wall_s=wall, phases=phases.as_dict(),
                   tokens_per_s=counts["tokens"] / counts["forward_s"] if counts["forward_s"] > 0 else None,
                   worker_seconds={f"{s:05d}": t for s, t in sorted(counts["timing"].items())})
    if counts["errors"]:
        summary["errors"] = counts["errors"]
        message = "\n".join(counts["errors"])
        if counts["categories"] - {"data", "cache", "locked", "space"}:  # lost or stopped midway: show what is safe
            message += "\n\n" + format_summary(summary)
        raise ExtractFailed(message)
    if counts["interrupted"]:
        raise ExtractFailed("interrupted; every shard committed what it had. Rerun the same command to resume.\n\n"
                            + format_summary(summary))
    return summary


def load_tokenizer_and_config(cfg: ExtractConfig):
    """The run's tokenizer and the target's config (no weights); ExtractFailed naming what failed."""
    from transformers import AutoConfig

    try:
        tokenizer = load_tokenizer(cfg)
    except ValueError as e:
        raise ExtractFailed(str(e)) from e
    try:
        model_config = AutoConfig.from_pretrained(cfg.model, revision=cfg.revision)
    except (OSError, ValueError) as e:
        raise ExtractFailed(f"cannot load the target {cfg.model!r}: {e}") from e
    return tokenizer, model_config


def _prepare(cfg: ExtractConfig, layout: NodeLayout, phases: Phases) -> tuple[zarr.Group, CacheSpec, list[int]]:
    """The parent's set-up: the run's spec (tokenizer, target config, dataset fingerprint), the
    shard locks probed, the cache root prepared; returns the root, the spec it records (the run's,
    in an older format's layout where it resumes one) and this node's shard ids."""
    shard_ids = layout.shard_ids(cfg.local_workers)
    num_shards = layout.nodes * cfg.local_workers
    tokenizer, model_config = load_tokenizer_and_config(cfg)
    phases.mark("tokenizer_and_config")
    try:
        ds = load_source(cfg.data, cfg.split or "train")
    except DataError as e:
        raise ExtractFailed(str(e)) from e
    phases.mark("dataset_load")
    spec = build_spec(cfg, tokenizer, model_config, ds, num_shards)
    phases.mark("fingerprint")
    check_shard_locks(cfg, shard_ids)
    root = prepare_root(cfg, spec, layout)
    phases.mark("cache_root")
    return root, CacheSpec.from_dict(root.attrs[ATTRS_KEY]), shard_ids


def _check_devices(cfg: ExtractConfig) -> None:
    """The CUDA devices the run names exist."""
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ExtractFailed("--device cuda but no CUDA device is visible (use --device cpu --workers N)")
        missing = [g for g in cfg.gpus if g >= torch.cuda.device_count()]
        if missing:
            raise ExtractFailed(f"--gpus {missing}: only {torch.cuda.device_count()} CUDA devices are visible")


class Phases:
    """Seconds spent in each step of a run, in order (the summary's ``phases``): where the
    time before the first batch and after the last one goes."""

    def __init__(self, started_at: float):
        self.started_at = started_at
        """Wall-clock time (epoch seconds) when ``run`` began; what came before is imports."""
        self._last = time.monotonic()
        self.seconds: dict[str, float] = {}

    def mark(self, name: str, at: float | None = None) -> None:
        """The step ``name`` ended now (or at monotonic time ``at``)."""
        at = max(self._last, time.monotonic() if at is None else at)
        self.seconds[name] = round(self.seconds.get(name, 0.0) + at - self._last, 3)
        self._last = at

    def as_dict(self) -> dict[str, Any]:
        return {"started_at": self.started_at, "seconds": dict(self.seconds)}


def _run_workers(tasks: list[WorkerTask], cfg: ExtractConfig, phases: Phases | None = None,
                 before_go=None) -> dict[str, Any]:
    """Spawn one worker per task, feed the progress bar, let them write once all have planned,
    collect how each one ended; marks the spawn, the workers' start (imports, tokenizer),
    planning, the first batch (model load, head), the forward loop and the end (drain, final
    commit, exit) in ``phases``. ``before_go(planned)``, given each shard's planned ``tokens``
    and ``samples`` once all have planned, returns why the workers must not start writing
    (they are stopped), or None."""
    from tqdm import tqdm

    phases = phases or Phases(time.time())
    seen: dict[str, float] = {}

    def first(event: str) -> None:
        seen.setdefault(event, time.monotonic())

    ctx = mp.get_context("spawn")
    messages, stop = ctx.Queue(), ctx.Event()
    go = ctx.Event()  # set once every worker has planned and locked: none writes before all slices are known good
    procs = {t.shard_id: ctx.Process(target=worker_main, args=(t, messages, stop, go),
                                     name=f"dflash-extract-{t.shard_id:05d}") for t in tasks}
    for p in procs.values():
        p.start()
    phases.mark("spawn")
    ended: dict[int, str] = {}
    errors: list[str] = []
    categories: set[str] = set()
    planned: dict[int, dict] = {}
    ready: dict[int, dict] = {}
    timing: dict[int, dict] = {}
    samples = tokens = 0
    t_first = t_last = None
    interrupted = False
    bar = tqdm(total=0, unit="sample", dynamic_ncols=True, disable=not cfg.progress, desc="planning")

    def handle(kind: str, shard: int, f: dict) -> None:
        nonlocal samples, tokens, t_first, t_last
        if kind == "planning":
            first("workers_start")
        if kind == "plan_ready":
            ready[shard] = f
            if len(ready) == len(tasks):
                problem = None
                try:
                    problem = before_go(ready) if before_go is not None else None
                except Exception as e:  # noqa: BLE001 - a check that fails must not leave the workers waiting
                    bar.write(f"dflash-extract: warning: the free-space check failed ({type(e).__name__}: {e}); "
                              "starting without it", file=sys.stderr)
                if problem is None:
                    go.set()
                else:
                    categories.add("space")
                    errors.append(problem)
                    stop.set()
                first("planning")
        elif kind == "planned":
            planned[shard] = f
            bar.total += f["samples"]
            bar.update(f["done_samples"])
            if len(planned) == len(tasks):
                bar.set_description("extract")
            else:
                bar.set_description(f"planning {len(planned)}/{len(tasks)}")
        elif kind == "started":  # the shard's writer is open: the forward loop begins
            if t_first is None:
                t_first = time.monotonic()
                first("writer_start")
        elif kind == "progress":
            t_last = time.monotonic()
            samples += f["samples"]
            tokens += f["tokens"]
            bar.update(f["samples"])
            elapsed = t_last - (t_first or t_last)
            if elapsed > 0:
                bar.set_postfix_str(f"{tokens / elapsed:,.0f} tok/s", refresh=False)
        elif kind == "timing":  # the steps before the loop, the loop's wall and CPU seconds, the writer's busy/idle split
            timing[shard] = f
        elif kind == "warning":
            bar.write(f"dflash-extract: warning: {f['message']}", file=sys.stderr)
        elif kind in ("done", "stopped"):
            ended[shard] = kind
        elif kind == "error":
            ended[shard] = "error"
            categories.add(f["category"])
            if f["message"] not in errors:
                errors.append(f["message"])
            stop.set()

    try:
        while True:
            try:
                handle(*messages.get(timeout=0.5))
                continue
            except queue.Empty:
                pass
            except KeyboardInterrupt:
                raise
            if all(not p.is_alive() for p in procs.values()):
                break
            if not go.is_set() and any(not p.is_alive() and s not in ended for s, p in procs.items()):
                stop.set()  # a worker died while planning: the others must not wait for it
    except KeyboardInterrupt:
        interrupted = True
        stop.set()
        bar.write("interrupted: workers commit what they have and stop (Ctrl-C again to kill them)")
        try:
            for p in procs.values():
                p.join()
        except KeyboardInterrupt:
            for p in procs.values():
                p.kill()
    # late messages of processes that already exited
    while True:
        try:
            handle(*messages.get(timeout=0.2))
        except queue.Empty:
            break
    for p in procs.values():
        p.join()
    bar.close()
    for event in ("workers_start", "planning", "writer_start"):  # the steps' ends, in order
        if event in seen:
            phases.mark(event, seen[event])
    if t_last is not None:
        phases.mark("forward_loop", t_last)
    phases.mark("drain_and_exit")
    for shard, p in procs.items():
        if shard not in ended:
            categories.add("died")
            errors.append(f"shard {shard:05d}: worker died with exit code {p.exitcode} (killed? out of host memory?); "
                          "its last commit is intact: rerun the same command to resume")
    forward_s = (t_last - t_first) if t_first is not None and t_last is not None else 0.0
    return {"samples": samples, "tokens": tokens, "forward_s": forward_s, "errors": errors, "categories": categories,
            "interrupted": interrupted and not errors, "timing": timing}
