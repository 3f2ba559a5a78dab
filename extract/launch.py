"""Start this node's worker processes first, before the parent imports torch or transformers.

A spawned worker imports torch and transformers, loads the tokenizer, the dataset and the
model, compiles the LM head and plans its slice: most of a run's start. Started before the
parent's own set-up (which loads the same tokenizer and the target's config to fingerprint
the run and prepare the cache root), both proceed side by side. Until the parent says the
root is ready (``root_ready``: prepared, and no live run writes these shards) a worker only
reads (the root, where one exists, and its shard's lock: where a live run holds that lock it
loads no model before ``root_ready``), so it may be killed at any moment without leaving
anything behind; it writes only once every worker has planned and locked its shard (``go``).

This module imports nothing heavy, so that the command line reaches the spawn at once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass

from .config import ExtractConfig


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


@dataclass
class WorkerTask:
    """Everything a spawned worker needs (picklable); the cache's layout it reads from the root."""

    cfg: ExtractConfig
    shard_id: int
    num_shards: int
    device: str
    """'cpu' or 'cuda:N'."""
    cpu_threads: int | None = None


def node_tasks(cfg: ExtractConfig, layout: NodeLayout) -> list[WorkerTask]:
    """One task per local worker: its global shard, its device, its CPU threads."""
    local = cfg.local_workers
    threads = cfg.cpu_threads or max(1, (os.cpu_count() or 1) // local)
    return [WorkerTask(cfg=cfg, shard_id=s, num_shards=layout.nodes * local, device=d,
                       cpu_threads=threads if cfg.device == "cpu" else None)
            for s, d in zip(layout.shard_ids(local), cfg.worker_devices)]


def worker_entry(task: WorkerTask, messages, stop, root_ready, go) -> None:
    """What a spawned worker runs: imports the worker (torch, transformers) there, not here."""
    from .worker import worker_main

    worker_main(task, messages, stop, go, root_ready)


class Workers:
    """The spawned worker processes of this node and the events the parent drives them with."""

    def __init__(self, tasks: list[WorkerTask]):
        ctx = mp.get_context("spawn")
        self.tasks = tasks
        self.messages = ctx.Queue()
        self.stop = ctx.Event()
        self.root_ready = ctx.Event()
        """Set by the parent once the cache root is prepared: the workers may lock their shards."""
        self.go = ctx.Event()
        """Set once every worker has planned and locked: none writes before all slices are known to be good."""
        self.procs = {t.shard_id: ctx.Process(target=worker_entry,
                                              args=(t, self.messages, self.stop, self.root_ready, self.go),
                                              name=f"dflash-extract-{t.shard_id:05d}")
                      for t in tasks}
        for p in self.procs.values():
            p.start()
        self.spawned_at = time.time()
        """Wall-clock time (epoch seconds) when the last worker was started."""

    def kill(self) -> None:
        """End workers before ``root_ready`` (they have not touched the cache)."""
        for p in self.procs.values():
            p.kill()
        for p in self.procs.values():
            p.join()
