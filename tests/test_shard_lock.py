"""One writer per shard: the lock file, with real processes holding it, racing for it and dying.

"store" runs the object-store path (create-if-absent through fsspec) on a local folder reached
as ``local://``, an fsspec URL that is not a plain path or ``file://``."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dflash.shared import shard_lock as L

HOLD = """
import os, sys, time
from dflash.shared.shard_lock import ShardLock, ShardLocked
while not os.path.exists(sys.argv[2]):  # the start signal: every racer tries at once
    time.sleep(0.001)
lock = ShardLock(sys.argv[1], 3)  # kept: filelock releases a lock that is garbage collected
try:
    lock.acquire()
    print("held", flush=True)
except ShardLocked:
    print("refused", flush=True)
time.sleep(600)
"""


def out_url(tmp_path, backend):
    return str(tmp_path / "c.zarr") if backend == "local" else f"local://{tmp_path / 'c.zarr'}"


def start(out, tmp_path, n=1):
    """``n`` processes that each try to take shard 3's lock at once, then sleep; with their answers."""
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", HOLD, out, str(go)], stdout=subprocess.PIPE, text=True)
             for _ in range(n)]
    go.touch()
    return procs, [p.stdout.readline().strip() for p in procs]


def kill9(procs):
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()


def os_lock_free(path) -> bool:
    """Whether an flock of this file can be taken now (read without the module under test)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.parametrize("backend", ["local", "store"])
def test_of_processes_racing_for_a_shard_exactly_one_takes_it(tmp_path, backend):
    procs, answers = start(out_url(tmp_path, backend), tmp_path, n=4)
    try:
        assert sorted(answers) == ["held", "refused", "refused", "refused"], answers
    finally:
        kill9(procs)


def test_local_a_second_run_is_refused_naming_the_holder_and_kill9_frees_the_shard_at_once(tmp_path):
    out = str(tmp_path / "c.zarr")
    lock_file, record_file = tmp_path / "c.zarr/locks/00003.lock", tmp_path / "c.zarr/locks/00003.json"
    (holder,), answers = start(out, tmp_path)
    assert answers == ["held"]
    lock = L.ShardLock(out, 3)
    try:
        assert not os_lock_free(lock_file)
        assert json.loads(record_file.read_bytes())["pid"] == holder.pid
        with pytest.raises(L.ShardLocked) as refused:
            lock.acquire()
        assert str(refused.value).startswith(f"shard 00003 of {out} is being written by another run: "
                                             f"host {L.HOST}, pid {holder.pid}, since ")
        assert lock.probe().pid == holder.pid and L.live_holders(out)[3].pid == holder.pid
    finally:
        kill9([holder])
    assert os_lock_free(lock_file) and record_file.exists()  # the OS lock died with it; its record stays
    assert lock.probe() is None and L.live_holders(out) == {}
    previous = lock.acquire()  # at once: no waiting for a lease to expire
    try:
        assert previous.pid == holder.pid  # the dead holder is named
        assert not os_lock_free(lock_file) and json.loads(record_file.read_bytes())["pid"] == os.getpid()
        lock.check()
    finally:
        lock.release()
    assert os_lock_free(lock_file) and not record_file.exists() and lock.probe() is None
    again = L.ShardLock(out, 3)
    assert again.acquire() is None  # released cleanly: nothing taken over
    again.release()


def test_store_lock_file_is_created_if_absent_removed_on_release_and_left_by_kill9_until_deleted(tmp_path):
    out = out_url(tmp_path, "store")
    lock_file = tmp_path / "c.zarr/locks/00003.lock"
    lock = L.ShardLock(out, 3)
    assert lock.acquire() is None
    assert json.loads(lock_file.read_bytes())["pid"] == os.getpid()
    lock.check()
    lock.release()
    assert not lock_file.exists() and L.live_holders(out) == {}

    (holder,), answers = start(out, tmp_path)
    assert answers == ["held"]
    kill9([holder])
    assert json.loads(lock_file.read_bytes())["pid"] == holder.pid  # a crash leaves it
    assert L.live_holders(out)[3].pid == holder.pid
    with pytest.raises(L.ShardLocked) as refused:
        lock.acquire()
    message = str(refused.value)
    assert f"host {L.HOST}, pid {holder.pid}, since " in message
    assert f"delete file://{lock_file} to release the shard" in message
    os.remove(lock_file)  # what the message tells the user to do
    assert lock.acquire() is None
    lock.release()
    assert not lock_file.exists()


@pytest.mark.parametrize("backend", ["local", "store"])
def test_a_holder_whose_lock_file_was_deleted_refuses_to_commit(tmp_path, backend):
    out = out_url(tmp_path, backend)
    first = L.ShardLock(out, 3)
    first.acquire()
    os.remove(tmp_path / "c.zarr/locks/00003.lock")  # by hand, under a live holder
    successor = L.ShardLock(out, 3)
    successor.acquire()
    with pytest.raises(L.LockLost, match="no longer names this process"):
        first.check()
    first.release()  # leaves the successor's record alone
    successor.check()
    assert L.ShardLock(out, 3).probe().token == successor.record.token
    successor.release()
    assert L.ShardLock(out, 3).probe() is None
