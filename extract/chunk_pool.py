"""Writer processes for a shard's hidden states: whole chunks, encoded in parallel, off the GIL.

One zarr event loop encodes and writes about 0.8-1 GB/s of hidden states and keeps ~5
cores of the forward loop's process busy; an H200 running an 8B target produces more
than that, and the writer thread's share of the GIL slows the forward loop itself
(BENCHMARKS.md). ``ChunkPool`` hands the hidden rows of each flush to ``processes``
child processes through two shared-memory blocks: the shard's writer thread copies the
rows into a free block (numpy copies release the GIL), splits them at chunk boundaries
into one contiguous range per process, and each process writes its range with zarr
(compression, checksums, files) in its own interpreter.

Ranges of one flush are disjoint whole chunks. A flush that ends inside a chunk (the
final flush of a commit) is followed by a ``wait`` before the next write rewrites that
chunk whole, so no two writes of one chunk are ever in flight together; the shard's
commit record is written only after ``wait``, so a crash never records rows a child had
not finished. Children exit when the pool closes or their parent dies (their pipe ends).
"""

from __future__ import annotations

import multiprocessing as mp
import os
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


def _serve(conn, store: str, key: str, names: list[str], row_shape: tuple[int, ...], dtype: str,
           settings: dict[str, Any]) -> None:
    """Child: write the ranges it is sent, answer each with ('ok',) or ('error', ...)."""
    import signal

    import zarr

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent stops us

    zarr.config.set(settings)
    arr = zarr.open_group(store, mode="r+")[key]
    blocks = [shared_memory.SharedMemory(name=n) for n in names]
    row = int(np.prod(row_shape)) * np.dtype(dtype).itemsize
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the parent is gone: nothing more will be committed
                return
            if msg is None:
                return
            block, offset, start, stop = msg
            try:
                view = np.ndarray((stop - start,) + tuple(row_shape), dtype=dtype, buffer=blocks[block].buf,
                                  offset=offset * row)
                arr[start:stop] = view
                del view
                conn.send(("ok",))
            except BaseException as e:  # noqa: BLE001 - handed to the parent, which stops the shard
                conn.send(("error", type(e).__name__, str(e), getattr(e, "errno", None), isinstance(e, OSError)))
    finally:
        for b in blocks:
            b.close()


class ChunkPool:
    """``processes`` children writing rows of one array (``key`` in the group at ``store``)."""

    def __init__(self, store: str, key: str, *, processes: int, chunk: int, max_rows: int,
                 row_shape: tuple[int, ...], dtype: str, settings: dict[str, Any]):
        self.chunk, self.row_shape, self.dtype = chunk, tuple(row_shape), np.dtype(dtype)
        self.max_rows = max_rows
        nbytes = max(1, max_rows * int(np.prod(row_shape)) * self.dtype.itemsize)
        self.blocks = [shared_memory.SharedMemory(create=True, size=nbytes) for _ in range(BLOCKS)]
        self.pending: list[list[Any]] = [[] for _ in range(BLOCKS)]
        self._next = 0
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        try:
            for i in range(processes):
                ours, theirs = ctx.Pipe()
                p = ctx.Process(target=_serve, name=f"{key.replace('/', '-')}-writer{i}", daemon=True,
                                args=(theirs, store, key, [b.name for b in self.blocks], self.row_shape,
                                      self.dtype.str, settings))
                p.start()
                theirs.close()
                self.conns.append(ours)
                self.procs.append(p)
        except BaseException:
            self.close()
            raise

    def write(self, start: int, stop: int, parts: list[np.ndarray]) -> None:
        """Rows [start, stop) of the array: the first stop - start rows of ``parts`` concatenated.

        Returns once the rows are copied into shared memory and handed to the children.
        """
        n = stop - start
        if n > self.max_rows:
            raise ValueError(f"a flush of {n} rows exceeds the pool's {self.max_rows}")
        b = self._next
        self._next = (b + 1) % BLOCKS
        self._wait(b)
        view = np.ndarray((n,) + self.row_shape, dtype=self.dtype, buffer=self.blocks[b].buf)
        at = 0
        for p in parts:
            take = min(len(p), n - at)
            view[at:at + take] = p[:take]
            at += take
            if at == n:
                break
        del view
        for conn, proc, (a, z) in zip(self.conns, self.procs, split_chunks(start, stop, self.chunk, len(self.conns))):
            try:
                conn.send((b, a - start, a, z))
            except (BrokenPipeError, ConnectionResetError):
                proc.join(timeout=5)
                raise ChunkWriteError(f"writer process {proc.name} died (exit code {proc.exitcode})") from None
            self.pending[b].append(conn)

    def wait(self) -> None:
        """Block until every range handed out so far is written; raise the first failure."""
        for b in range(BLOCKS):
            self._wait(b)

    def _wait(self, b: int) -> None:
        error = None
        for conn in self.pending[b]:
            proc = self.procs[self.conns.index(conn)]
            while not conn.poll(0.5):
                if not proc.is_alive():
                    raise ChunkWriteError(f"writer process {proc.name} died (exit code {proc.exitcode})")
            reply = conn.recv()
            if reply[0] == "error" and error is None:
                _, name, message, errno, is_os = reply
                error = OSError(errno, f"{name}: {message}") if is_os else ChunkWriteError(f"{name}: {message}")
        self.pending[b] = []
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
        for blk in self.blocks:
            blk.close()
            blk.unlink()
        self.blocks = []
