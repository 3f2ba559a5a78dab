"""One shard on one device: ShardWriter (the resume point), the forward loop, and a writer thread that writes each
batch (encoded on the device, copied to pinned memory on a side stream) and commits every ``commit_seconds``; the
bounded queue caps host memory at ``queue_depth`` + 2 batches."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import zarr

from dflash.shared.cache import (HIDDEN_SCALE, CacheError, CacheSpec, ShardWriter, encode_hidden,
                                 encode_topk_logprobs, open_root, to_numpy, writer_zarr_settings)
from dflash.shared.hidden_codecs import check_scales
from dflash.shared.shard_lock import LockError, ShardLock, ShardLocked

from .config import ExtractConfig, ExtractFailed
from .data import DataError
from .plan import PlannedShard, bad_row_message
from .target import TargetRunner, compute_environment, head_backend_for, load_target


@dataclass
class WorkerTask:
    """One shard's job: the run's settings, the spec its root records, which shard, on which device."""

    cfg: ExtractConfig
    spec: CacheSpec
    shard_id: int
    device: str


class WriterFailed(Exception):
    """The writer thread hit ``cause``; ``committed`` is the last good commit."""

    def __init__(self, cause: BaseException, committed: dict[str, int]):
        self.cause, self.committed = cause, committed
        super().__init__(f"{type(cause).__name__}: {cause}")


class WriterThread:
    """Owns the ShardWriter from the first batch on: write_batch, periodic commit, finish. ``blocked``:
    the loop's seconds waiting for it; ``gpu``: the GPU's seconds in and between the batches."""

    def __init__(self, writer: ShardWriter, planned: PlannedShard, depth: int, commit_seconds: float, report):
        self.writer, self.planned, self.commit_seconds, self.report = writer, planned, commit_seconds, report
        self.offsets = planned.plan.offsets
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.blocked = 0.0
        self.gpu = {"gpu_busy": 0.0, "gpu_gap": 0.0}
        self._thread = threading.Thread(target=self._run, name=f"shard-{writer.shard_id:05d}-writer", daemon=True)
        self._thread.start()

    def submit(self, item) -> None:
        """Queue one batch (None: the end); blocks while the queue is full; raises if the thread failed."""
        t = time.perf_counter()
        while True:
            self.check()
            with contextlib.suppress(queue.Full):
                self.queue.put(item, timeout=0.2)
                break
        self.blocked += time.perf_counter() - t

    def check(self) -> None:
        if self.error is not None:
            raise WriterFailed(self.error, self.writer.committed)

    def close(self) -> None:
        """Drain the queue, then finish the shard (or, where batches are left, commit what is written)."""
        self.submit(None)
        self._thread.join()
        self.check()

    def _run(self) -> None:
        last_commit, last_end = time.monotonic(), None  # last_end: the previous batch's end event
        try:
            while (item := self.queue.get()) is not None:
                batch, event, host, marks = item
                if event is not None:
                    event.synchronize()  # the device->host copies of this batch have landed
                if marks is not None:  # recorded before those copies: complete too
                    self.gpu["gpu_busy"] += marks[0].elapsed_time(marks[1]) / 1000
                    if last_end is not None:
                        self.gpu["gpu_gap"] += last_end.elapsed_time(marks[0]) / 1000
                    last_end = marks[1]
                s0, s1 = self.writer.batch_samples(batch)
                t0, t1 = int(self.offsets[s0]), int(self.offsets[s1])
                stored = {name: to_numpy(t) for name, t in host.items()}  # as the cache stores them
                if HIDDEN_SCALE in stored:  # encoded without a device sync: checked here
                    check_scales(self.writer.spec.codec, stored[HIDDEN_SCALE])
                self.writer.write_batch(batch, input_ids=self.planned.input_ids[t0:t1],
                                        loss_mask=self.planned.loss_mask[t0:t1], **stored)
                del host, item
                self.report("progress", samples=s1 - s0, tokens=t1 - t0)
                if time.monotonic() - last_commit >= self.commit_seconds:
                    self.writer.commit()
                    last_commit = time.monotonic()
            self.writer.finish() if self.writer.complete else self.writer.commit()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread; nothing more is committed
            self.error = e


def _mark(stream=None, timing: bool = True):
    """An event recorded on ``stream`` (the current one); blocking: a thread waiting for it sleeps, not spins."""
    event = torch.cuda.Event(enable_timing=timing, blocking=True)
    event.record(stream)
    return event


def _to_host(out, spec: CacheSpec, copy_stream=None) -> tuple[dict[str, torch.Tensor], Any]:
    """One batch's outputs encoded on the device (fewer bytes cross) and, on CUDA, copied into pinned
    buffers on ``copy_stream`` while the next forward runs; the returned event marks their end."""
    tensors = {
        **encode_hidden(spec, out.hidden, validate=False),  # (N, L, D) bits or (N, L, W) + (N, L, G)
        "topk_ids": out.topk_ids,
        "topk_logprobs": encode_topk_logprobs(spec, out.topk_logprobs),
    }
    if copy_stream is None:
        return tensors, None
    copy_stream.wait_stream(torch.cuda.current_stream(copy_stream.device))  # the outputs are computed
    host = {}
    with torch.cuda.stream(copy_stream):
        for name, t in tensors.items():
            host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            t.record_stream(copy_stream)  # the compute stream reuses t's memory only after the copy
    return host, _mark(copy_stream, timing=False)


def extract_shard(task: WorkerTask, planned: PlannedShard, pad_id: int | None, lock: ShardLock, report,
                  runners: list) -> dict[str, float] | None:
    """Resume one planned, locked shard: the forward loop here, the writer thread behind it; its seconds,
    None where it was complete. ``runners`` keeps the loaded target for the next shard (the caller closes it)."""
    cfg, device, timing = task.cfg, torch.device(task.device), {}
    with zarr.config.set(writer_zarr_settings(cfg.out)):  # the shard's write path; other zarr users keep theirs
        writer = ShardWriter(open_root(cfg.out, "r+"), task.shard_id, planned.plan, task.spec,
                             compute=compute_environment(device), guard=lock.check)
        report("planned", samples=len(planned.plan.source_index), done_samples=writer.committed["samples"])
        if writer.complete:
            if not writer.state.complete:
                writer.finish()
            return None
        if not runners:
            t = time.perf_counter()
            try:
                model = load_target(cfg.model, dtype=cfg.dtype, device=device,
                                    attn_implementation=cfg.attn_implementation, revision=cfg.revision)
            except (OSError, ValueError) as e:  # e.g. an attention kernel this transformers does not know
                raise ExtractFailed(f"cannot load the target {cfg.model!r} with --attn-implementation "
                                    f"{cfg.attn_implementation}: {e}") from e
            timing["model_load_s"] = round(time.perf_counter() - t, 3)
            t = time.perf_counter()
            runners.append(TargetRunner(model, task.spec.layer_ids, task.spec.topk, cfg.lm_head_chunk,
                                        head_backend_for(device)))  # compiles the head on CUDA
            timing["head_setup_s"] = round(time.perf_counter() - t, 3)
        offsets = planned.plan.offsets
        report("started")
        t_loop, cpu_loop = time.perf_counter(), time.process_time()
        thread = WriterThread(writer, planned, cfg.queue_depth, cfg.commit_seconds, report)
        copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        marks = None  # (start, end) timing events of the previous batch's forward, on CUDA
        try:
            for batch in range(writer.next_batch, len(planned.plan.batches) - 1):
                s0, s1 = writer.batch_samples(batch)
                samples = [torch.from_numpy(planned.input_ids[offsets[s]:offsets[s + 1]]) for s in range(s0, s1)]
                ids, mask, index = TargetRunner.pad_batch(samples, pad_id or 0)
                if copy_stream is not None:
                    ids, mask, index = ids.pin_memory(), mask.pin_memory(), index.pin_memory()
                if marks is not None:
                    # sleep until the previous batch is done: HF's mask code waits for it anyway, spinning a core
                    marks[1].synchronize()
                start = _mark() if copy_stream is not None else None
                out = runners[0].forward(ids, mask, index)
                marks = (start, _mark()) if start is not None else None
                host, event = _to_host(out, writer.spec, copy_stream)
                del out
                thread.submit((batch, event, host, marks))
        except BaseException as e:
            if not isinstance(e, WriterFailed):  # the forward loop failed (e.g. out of memory): commit what is written
                with contextlib.suppress(WriterFailed):
                    thread.close()
            raise
        thread.close()
    timing.update(loop_s=round(time.perf_counter() - t_loop, 3), cpu_s=round(time.process_time() - cpu_loop, 3),
                  submit_blocked=round(thread.blocked, 3))
    if copy_stream is not None:
        timing.update({k: round(v, 3) for k, v in thread.gpu.items()})
    return timing


def describe_error(e: BaseException, task: WorkerTask) -> str:
    """The message for the user: a bad row's file and row, an I/O error's last good commit (a rerun
    resumes from it), the lock's holder, the cache's problem, out of memory, or a bug with its traceback."""
    shard = f"shard {task.shard_id:05d}"
    if isinstance(e, DataError):
        return bad_row_message(e, task.cfg)
    if isinstance(e, WriterFailed):
        c, cause = e.committed, e.cause
        what = "I/O error" if isinstance(cause, OSError) else "error"
        return (f"{shard}: {what} while writing {task.cfg.out}: {type(cause).__name__}: {cause}. "
                f"Committed and intact: {c['batches']} batches, {c['samples']} samples, {c['tokens']} tokens. "
                "Fix the cause (disk space, permissions) and rerun the same command to resume.")
    if isinstance(e, ShardLocked):
        return f"{e}. Let it finish or stop it, or rerun with --wait-for-lock to wait for it"
    if isinstance(e, (LockError, ExtractFailed)):
        return str(e)
    if isinstance(e, CacheError):
        return f"{shard}: {e}"
    if isinstance(e, torch.OutOfMemoryError):
        return (f"{shard}: out of memory on {task.device}: {e}. Lower --batch-tokens (batches are planned at "
                "shard creation: a cache with committed samples keeps its plan, so use a new --out; one with none "
                "is replaced by the rerun).")
    return f"{shard}: unexpected {type(e).__name__}: {e}\n{traceback.format_exc()}"
