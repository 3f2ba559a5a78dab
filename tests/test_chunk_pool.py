"""Writer processes for the hidden states (extract/chunk_pool.py) behind ShardWriter: the
shard they write equals the one the writer thread writes, bitwise, through resumes inside
a chunk; commits wait for them; their failures reach the caller."""

from __future__ import annotations

import numpy as np
import pytest

from dflash.extract.chunk_pool import ChunkPool, ChunkWriteError, split_chunks
from dflash.shared import cache as C
from test_cache import LENGTHS, batch_data, make_plan, make_spec, write_all

SETTINGS = {"async.concurrency": 4, "array.write_empty_chunks": True}


def test_split_chunks_cuts_whole_chunks_and_covers_the_range():
    for start, stop, chunk, parts in [(0, 100, 16, 3), (32, 33, 16, 4), (48, 200, 16, 2), (0, 64, 16, 8), (16, 17, 16, 1)]:
        ranges = split_chunks(start, stop, chunk, parts)
        assert ranges[0][0] == start and ranges[-1][1] == stop and len(ranges) <= parts
        assert all(a < z for a, z in ranges)
        assert all(z == a2 for (_, z), (a2, _) in zip(ranges, ranges[1:]))  # contiguous, disjoint
        assert all(a % chunk == 0 for a, _ in ranges)  # every range starts on a chunk boundary


def pool_for(path, spec, plan, processes=2, fields=C.TOKEN_FIELDS):
    """``sinks`` for ``write_all``: a new pool writing ``fields`` at each call (kept in ``pools``)."""
    max_rows = int(np.diff(plan.offsets[plan.batches]).max())
    pools = []

    def sinks(root):
        arrays = {f: (a.shape[1:], a.dtype) for f, a in root[C.shard_name(0)].arrays() if f in fields}
        pool = ChunkPool(str(path), C.shard_name(0), arrays, processes=processes, chunks=spec.chunks,
                         max_rows=max_rows, settings=SETTINGS)
        pools.append(pool)
        return {f: pool.sink(f) for f in fields}

    return sinks, pools


def shard(path):
    g = C.open_root(str(path))[C.shard_name(0)]
    return {f: np.asarray(g[f][:]) for f in C.TOKEN_FIELDS + ("offsets",)}, g.attrs.asdict()


def chunk_files(path, field):
    folder = path / "shards" / "00000" / field
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("stop_after,commit_every,fields", [
    (None, 1, C.TOKEN_FIELDS), (3, 1, C.TOKEN_FIELDS), (5, 2, C.TOKEN_FIELDS), (3, 1, ("hidden",))])
def test_writer_processes_write_what_the_thread_writes(tmp_path, stop_after, commit_every, fields):
    """Every array the same as the thread's, every chunk file the same bytes, no file more or less."""
    spec, plan = make_spec(), make_plan(LENGTHS)  # samples cross chunks of 16 everywhere
    write_all(tmp_path / "thread.zarr", spec, plan)
    path = tmp_path / "procs.zarr"
    sinks, pools = pool_for(path, spec, plan, fields=fields)
    try:
        if stop_after is not None:  # stop after a commit that ends inside a chunk, then resume
            write_all(path, spec, plan, commit_every=commit_every, stop_after=stop_after, sinks=sinks)
            pools[-1].close()
        write_all(path, spec, plan, commit_every=commit_every, sinks=sinks)
    finally:
        procs = [proc for p in pools for proc in p.procs]
        for p in pools:
            p.close()
    assert [proc.exitcode for proc in procs] == [0] * len(procs)  # stopped when asked, not killed
    assert all(p.seconds["writers_busy"] > 0 and p.seconds["pool_copy"] > 0 for p in pools)
    a, a_attrs = shard(tmp_path / "thread.zarr")
    b, b_attrs = shard(path)
    for f in a:
        assert a[f].dtype == b[f].dtype and np.array_equal(a[f], b[f]), f
    assert a_attrs == b_attrs
    r = C.CacheReader(str(path))
    assert r.complete and len(r) == len(LENGTHS)
    for f in C.TOKEN_FIELDS:
        zarrs, ours = chunk_files(tmp_path / "thread.zarr", f), chunk_files(path, f)
        assert sorted(zarrs) == sorted(ours), f
        assert all(zarrs[k] == ours[k] for k in zarrs), f


def test_commit_waits_for_the_sink_before_recording(tmp_path):
    """A sink that stores nothing until ``wait``: the commit record must follow the wait."""
    spec, plan = make_spec(), make_plan(LENGTHS)
    events = []

    class Deferred:
        def __init__(self, root):
            self.root, self.pending = root, []

        def write(self, start, stop, parts):
            data = np.concatenate(parts)[: stop - start].copy()
            self.pending.append((start, stop, data))

        def wait(self):
            committed = self.root[C.shard_name(0)].attrs["commit"]["tokens"]
            events.append(("wait", committed, [z for _, z, _ in self.pending]))
            for start, stop, data in self.pending:
                self.root[C.shard_name(0)]["hidden"][start:stop] = data
            self.pending = []

    write_all(tmp_path / "ref.zarr", spec, plan)
    write_all(tmp_path / "c.zarr", spec, plan, commit_every=2, sinks=lambda root: {"hidden": Deferred(root)})
    # at each wait the record still names only what earlier waits had stored
    stored = 0
    for _, committed, stops in events:
        assert committed <= stored
        stored = max(stops, default=stored)
    assert np.array_equal(shard(tmp_path / "ref.zarr")[0]["hidden"], shard(tmp_path / "c.zarr")[0]["hidden"])


def test_a_failed_write_and_a_dead_writer_process_reach_the_caller(tmp_path):
    spec, plan = make_spec(), make_plan(LENGTHS)
    path = tmp_path / "c.zarr"
    root = C.create_or_open_cache(str(path), spec)
    C.ShardWriter(root, 0, plan, spec)  # creates the arrays
    sinks, pools = pool_for(path, spec, plan, processes=1, fields=("hidden",))
    sinks(root)
    pool = pools[0]
    try:
        rows = batch_data(spec, plan, 0)["hidden"]
        chunks = path / "shards" / "00000" / "hidden" / "c"
        assert not chunks.exists()
        chunks.write_text("")  # a file where the chunk folder goes: every chunk write fails
        pool.write("hidden", 0, len(rows), [rows])
        with pytest.raises(OSError) as err:  # handed over as an OSError: the shard stops as on a full disk
            pool.wait()
        assert not isinstance(err.value, ChunkWriteError) and "NotADirectoryError" in str(err.value)
        chunks.unlink()
        pool.procs[0].kill()
        pool.procs[0].join()
        with pytest.raises(ChunkWriteError, match="died"):  # at the hand-over or at the wait
            pool.write("hidden", 0, len(rows), [rows])
            pool.wait()
    finally:
        pool.close()
