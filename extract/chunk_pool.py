"""Writer processes for a shard's arrays: whole chunks, encoded in parallel, off the GIL.

One zarr event loop encodes and writes about 0.8-1 GB/s of hidden states and keeps ~5
cores of the forward loop's process busy; an H200 running an 8B target produces more
than that, and the writer thread's share of the GIL slows the forward loop itself
(BENCHMARKS.md). ``ChunkPool`` hands the rows of each flush to ``processes`` child
processes through shared memory (two blocks per array): the shard's writer thread copies
the rows into a free block (numpy copies release the GIL), splits them at chunk
boundaries into one contiguous range per process, and each process writes its range in its
own interpreter, with zarr.

Ranges of one flush are disjoint whole chunks. A flush that ends inside a chunk (the
final flush of a commit) is followed by a ``wait`` before the next write rewrites that
chunk whole, so no two writes of one chunk are ever in flight together; the shard's
commit record is written only after ``wait``, so a crash never records rows a child had
not finished. Children exit when the pool closes or their parent dies (their pipe ends).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
from multiprocessing import shared_memory
from typing import Any

import numpy as np

BLOCKS = 2
"""Flushes in flight: one being written by the children while the next is copied in."""


class ChunkWriteError(RuntimeError):
    """A writer process failed with something other than an OSError (message: its traceback line)."""


def shm_free_bytes() -> int | None:
    """Free bytes of /dev/shm (where POSIX shared memory lives on Linux), None if unknown."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def split_chunks(start: int, stop: int, chunk: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) (start on a chunk boundary) cut at chunk boundaries into at most
    ``parts`` contiguous ranges of nearly equal chunk counts."""
    n_chunks = -(-(stop - start) // chunk)
    parts = max(1, min(parts, n_chunks))
    bounds = [start + (n_chunks * j // parts) * chunk for j in range(parts)] + [stop]
    return [(a, min(b, stop)) for a, b in zip(bounds[:-1], bounds[1:]) if a < b]


def _serve(conn, store: str, group: str, layouts: dict[str, tuple[list[str], tuple[int, ...], str]],
           settings: dict[str, Any]) -> None:
    """Child: write the ranges it is sent, answer each with ('ok', seconds it took) or ('error', ...)."""
    import signal

    import zarr

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent stops us
    zarr.config.set(settings)
    g = zarr.open_group(store, mode="r+")[group]
    arrays = {name: g[name] for name in layouts}
    blocks = {name: [shared_memory.SharedMemory(name=n) for n in names] for name, (names, _, _) in layouts.items()}
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the parent is gone: nothing more will be committed
                return
            if msg is None:
                break
            name, block, offset, start, stop = msg
            _, row_shape, dtype = layouts[name]
            t = time.perf_counter()
            try:
                view = np.ndarray((stop - start,) + tuple(row_shape), dtype=dtype, buffer=blocks[name][block].buf,
                                  offset=offset * int(np.prod(row_shape)) * np.dtype(dtype).itemsize)
                arrays[name][start:stop] = view
                del view
                conn.send(("ok", time.perf_counter() - t))
            except BaseException as e:  # noqa: BLE001 - handed to the parent, which stops the shard
                conn.send(("error", type(e).__name__, str(e), getattr(e, "errno", None), isinstance(e, OSError)))
    finally:
        for bs in blocks.values():
            for b in bs:
                b.close()
    # Asked to stop: every range sent was written and answered. Skip the interpreter's teardown
    # (0.6 s with torch imported, which spawn's re-import of the main module brings in): the
    # end of the shard waits for this exit (ChunkPool.close joins us).
    os._exit(0)


def segment_prefix(store: str, group: str) -> str:
    """Names of the pool's shared-memory segments for one shard of one cache: fixed, so that
    a rerun removes what a killed run left in /dev/shm (``kill -9`` skips every cleanup)."""
    where = store if "://" in store else os.path.abspath(store)
    return "dflash_" + hashlib.sha1(f"{where}|{group}".encode()).hexdigest()[:12]


def _create_segment(name: str, size: int) -> shared_memory.SharedMemory:
    try:
        return shared_memory.SharedMemory(name=name, create=True, size=size)
    except FileExistsError:  # left by a run that was killed: this shard has one writer, so it is ours
        stale = shared_memory.SharedMemory(name=name)
        stale.close()
        stale.unlink()
        return shared_memory.SharedMemory(name=name, create=True, size=size)


class _Array:
    """One array's shared-memory blocks and the ranges in flight from each."""

    def __init__(self, prefix: str, max_rows: int, row_shape: tuple[int, ...], dtype: np.dtype):
        self.row_shape, self.dtype = tuple(row_shape), np.dtype(dtype)
        nbytes = max(1, max_rows * int(np.prod(row_shape)) * self.dtype.itemsize)
        self.blocks: list[shared_memory.SharedMemory] = []
        try:
            for b in range(BLOCKS):
                self.blocks.append(_create_segment(f"{prefix}_{b}", nbytes))
        except BaseException:
            self.free()
            raise
        self.pending: list[list[int]] = [[] for _ in range(BLOCKS)]
        """Per block: the processes (indices) still writing a range of it."""
        self.next = 0

    def free(self) -> None:
        for blk in self.blocks:
            blk.close()
            blk.unlink()
        self.blocks = []


class ChunkPool:
    """``processes`` children writing rows of the arrays ``arrays`` (name -> (row shape,
    dtype)) of the zarr group ``group`` in the store at ``store``."""

    def __init__(self, store: str, group: str, arrays: dict[str, tuple[tuple[int, ...], Any]], *, processes: int,
                 chunks: dict[str, int], max_rows: int, settings: dict[str, Any]):
        """``chunks``: rows per chunk of each array; ``max_rows``: rows of one batch at most
        (a flush holds those and the partial chunk left before them)."""
        self.chunks = chunks
        self.max_rows = {name: max_rows + chunks[name] for name in arrays}
        self.seconds = {"pool_copy": 0.0, "pool_wait": 0.0, "writers_busy": 0.0}
        """The shard's writer thread copying rows into shared memory, and waiting for a block
        (or, at a commit, for every block) to be written; the processes' seconds writing ranges
        (summed over processes: divide by ``processes`` for their busy share)."""
        self.arrays: dict[str, _Array] = {}
        self.conns, self.procs = [], []
        try:
            prefix = segment_prefix(store, group)
            for name, (row_shape, dtype) in arrays.items():
                self.arrays[name] = _Array(f"{prefix}_{name}", self.max_rows[name], row_shape, dtype)
            layouts = {name: ([b.name for b in a.blocks], a.row_shape, a.dtype.str) for name, a in self.arrays.items()}
            ctx = mp.get_context("spawn")
            for i in range(processes):
                ours, theirs = ctx.Pipe()
                p = ctx.Process(target=_serve, name=f"{group.replace('/', '-')}-writer{i}", daemon=True,
                                args=(theirs, store, group, layouts, settings))
                p.start()
                theirs.close()
                self.conns.append(ours)
                self.procs.append(p)
        except BaseException:
            self.close()
            raise

    def sink(self, name: str) -> "ArraySink":
        """What ``ShardWriter`` takes as the sink of array ``name``."""
        return ArraySink(self, name)

    def write(self, name: str, start: int, stop: int, parts: list[np.ndarray]) -> None:
        """Rows [start, stop) of array ``name``: the first stop - start rows of ``parts``
        concatenated. Returns once the rows are copied into shared memory and handed over."""
        n = stop - start
        if n > self.max_rows[name]:
            raise ValueError(f"a flush of {n} rows exceeds the pool's {self.max_rows[name]}")
        a = self.arrays[name]
        b = a.next
        a.next = (b + 1) % BLOCKS
        self._wait(a, b)
        t = time.perf_counter()
        view = np.ndarray((n,) + a.row_shape, dtype=a.dtype, buffer=a.blocks[b].buf)
        at = 0
        for p in parts:
            take = min(len(p), n - at)
            view[at:at + take] = p[:take]
            at += take
            if at == n:
                break
        del view
        self.seconds["pool_copy"] += time.perf_counter() - t
        for i, (lo, hi) in enumerate(split_chunks(start, stop, self.chunks[name], len(self.conns))):
            try:
                self.conns[i].send((name, b, lo - start, lo, hi))
            except (BrokenPipeError, ConnectionResetError):
                proc = self.procs[i]
                proc.join(timeout=5)
                raise ChunkWriteError(f"writer process {proc.name} died (exit code {proc.exitcode})") from None
            a.pending[b].append(i)

    def wait(self) -> None:
        """Block until every range handed out so far is written; raise the first failure."""
        for a in self.arrays.values():
            for b in range(BLOCKS):
                self._wait(a, b)

    def _wait(self, a: _Array, b: int) -> None:
        error = None
        t = time.perf_counter()
        for i in a.pending[b]:
            conn, proc = self.conns[i], self.procs[i]
            while not conn.poll(0.5):
                if not proc.is_alive():
                    raise ChunkWriteError(f"writer process {proc.name} died (exit code {proc.exitcode})")
            reply = conn.recv()
            if reply[0] == "ok":
                self.seconds["writers_busy"] += reply[1]
            elif error is None:
                _, name, message, errno, is_os = reply
                error = OSError(errno, f"{name}: {message}") if is_os else ChunkWriteError(f"{name}: {message}")
        a.pending[b] = []
        self.seconds["pool_wait"] += time.perf_counter() - t
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop the children (after their current range) and free the shared memory."""
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        for a in self.arrays.values():
            a.free()
        self.arrays = {}


class ArraySink:
    """One array of a ``ChunkPool`` as a ``shared.cache.ChunkSink``."""

    def __init__(self, pool: ChunkPool, name: str):
        self.pool, self.name = pool, name

    def write(self, start: int, stop: int, parts: list[np.ndarray]) -> None:
        self.pool.write(self.name, start, stop, parts)

    def wait(self) -> None:
        self.pool.wait()
