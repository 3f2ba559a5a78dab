"""One writer per shard: the lock file, with real processes holding it, dying and being taken over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dflash.shared import shard_lock as L

HOLD = """
import sys, time
from dflash.shared.shard_lock import ShardLock
lock = ShardLock(sys.argv[1], 3, heartbeat_s=0.1, settle_s=0.2, backend=sys.argv[2])
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def out_url(tmp_path, backend):
    """The cache root as each backend is reached: a plain folder, or an fsspec URL of one."""
    return str(tmp_path / "c.zarr") if backend == "local" else f"file://{tmp_path / 'c.zarr'}"


def start_holder(out, backend):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, out, backend], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.parametrize("backend", ["local", "store"])
def test_a_second_process_is_refused_naming_the_holder_then_takes_over_after_kill9(tmp_path, backend):
    out = out_url(tmp_path, backend)
    holder = start_holder(out, backend)
    try:
        lock = L.ShardLock(out, 3, settle_s=0.2, backend=backend)
        with pytest.raises(L.ShardLocked) as refused:
            lock.acquire()
        assert refused.value.holder.pid == holder.pid and refused.value.holder.host == L.HOST
        assert f"pid {holder.pid}" in str(refused.value) and "shard 00003" in str(refused.value)
        first_beat = lock.probe().heartbeat
        deadline = time.monotonic() + 10
        while lock.probe().heartbeat == first_beat:  # the holder keeps its heartbeat going
            assert time.monotonic() < deadline, "no heartbeat within 10 s"
            time.sleep(0.05)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert lock.probe() is None  # its pid is gone
    previous = lock.acquire()
    try:
        assert previous.pid == holder.pid  # taken over, and the dead holder is named
        assert lock.probe().pid == os.getpid()
        lock.check()
    finally:
        lock.release()
    assert lock.probe() is None
    again = L.ShardLock(out, 3, settle_s=0.2, backend=backend)
    assert again.acquire() is None  # released cleanly: nothing to take over
    again.release()


@pytest.mark.parametrize("backend", ["local", "store"])
def test_a_holder_on_another_host_is_refused_while_its_heartbeat_is_fresh(tmp_path, backend):
    """Another node's holder cannot be checked by pid: its heartbeat decides (even where flock
    would let this host take the file, as on a filesystem whose locks stay on each node)."""
    out = out_url(tmp_path, backend)
    path = tmp_path / "c.zarr" / "locks" / "00003.lock"
    path.parent.mkdir(parents=True)

    def other_node(age_s):
        now = time.time()
        record = L.LockHolder("other-node", 4242, now - 1000, now - age_s, "t" * 32, None)
        path.write_bytes(record.to_bytes())

    other_node(age_s=5)
    lock = L.ShardLock(out, 3, stale_after_s=60, settle_s=0.2, backend=backend)
    with pytest.raises(L.ShardLocked) as refused:
        lock.acquire()
    assert "host other-node, pid 4242" in str(refused.value)
    other_node(age_s=61)
    previous = lock.acquire()
    assert previous.host == "other-node"
    assert json.loads(path.read_bytes())["pid"] == os.getpid()
    lock.release()


@pytest.mark.parametrize("backend", ["local", "store"])
def test_a_holder_that_was_taken_over_refuses_to_commit(tmp_path, backend):
    out = out_url(tmp_path, backend)
    lock = L.ShardLock(out, 3, heartbeat_s=0.05, settle_s=0.2, backend=backend)
    lock.acquire()
    lock.check()
    path = tmp_path / "c.zarr" / "locks" / "00003.lock"
    successor = L.LockHolder("other-node", 4242, time.time(), time.time(), "s" * 32, None)
    path.write_bytes(successor.to_bytes())  # what a node that presumed this one dead writes
    time.sleep(0.3)
    with pytest.raises(L.LockLost, match="taken over by host other-node, pid 4242"):
        lock.check()
    lock.release()
    assert json.loads(path.read_bytes())["host"] == "other-node"  # the successor's record is left alone


def test_a_reused_pid_or_a_zombie_is_no_holder():
    me = L.LockHolder(L.HOST, os.getpid(), 0.0, 0.0, "x", L._pid_started(os.getpid()))
    assert L.holder_alive(me)
    assert not L.holder_alive(L.LockHolder(L.HOST, os.getpid(), 0.0, 0.0, "x", "1"))  # same pid, another process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while L._proc_stat(child.pid)[0] != b"Z":  # exited, not reaped yet
        time.sleep(0.01)
    assert not L.holder_alive(L.LockHolder(L.HOST, child.pid, 0.0, 0.0, "x", None))
    child.wait()


def test_a_holder_whose_lock_file_was_deleted_refuses_to_commit(tmp_path):
    out = str(tmp_path / "c.zarr")
    lock = L.ShardLock(out, 3, heartbeat_s=0.05, backend="local")
    lock.acquire()
    os.unlink(tmp_path / "c.zarr" / "locks" / "00003.lock")
    successor = L.ShardLock(out, 3, backend="local")
    successor.acquire()  # nothing on disk tells it about the first holder any more
    time.sleep(0.3)
    with pytest.raises(L.LockLost, match=f"taken over by host {L.HOST}, pid {os.getpid()}"):
        lock.check()
    lock.release()
    successor.check()
    successor.release()
