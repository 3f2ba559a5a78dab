"""One writer per shard: a lock file per shard, ``CACHE/locks/NNNNN.lock``.

* Local folders (plain paths and ``file://`` URLs): an OS lock on the file (``filelock``),
  which dies with its process (``kill -9`` included), so a rerun takes the shard at once.
  ``NNNNN.json`` beside it names the holder; one left behind names a holder that died.
* Other fsspec URLs (object stores): the lock file is created only if absent and names the
  holder; a clean release removes it. One left by a run that died stays until the user
  deletes it: the refusal names the file.

The holder checks before every commit record that the record is still its own (``check``),
so a lock file deleted by hand under a live run stops that run rather than letting two write.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

import filelock

LOCKS_DIR = "locks"  # inside the cache, a Zarr group of its own, so that zarr lists no lock file
HOST = socket.gethostname()
ACQUIRE_WAIT_S = 0.1  # how long acquire retries a local lock: a probe holds it for an instant


@dataclass
class LockHolder:
    """Who holds a shard's lock, as its record says."""

    host: str
    pid: int
    since: float  # epoch seconds
    token: str
    """Unique per acquisition: tells this holder's record from a successor's."""

    def describe(self) -> str:
        if not self.pid:
            return "a process that has not recorded itself yet"
        since = datetime.fromtimestamp(self.since, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"host {self.host}, pid {self.pid}, since {since}"


UNRECORDED = LockHolder("", 0, 0.0, "")  # a holder whose record is not written whole yet


class LockError(Exception):
    """A shard's lock is not this process's to take, or no longer is."""


class ShardLocked(LockError):
    """Another process holds the shard's lock; ``holder`` names it."""

    def __init__(self, lock: "ShardLock", holder: LockHolder | None):
        self.shard_id, self.holder = lock.shard_id, holder
        who = (holder or UNRECORDED).describe()  # None: released since, or not recorded yet
        message = f"shard {lock.shard_id:05d} of {lock.out} is being written by another run: {who}"
        if lock.fs is not None:
            message += (f". If that run has ended (killed, or its machine lost), its lock file stays on the store: "
                        f"delete {lock.fs.unstrip_protocol(lock.path)} to release the shard")
        super().__init__(message)


class LockLost(LockError):
    """This process no longer holds the lock of the shard it writes."""


def _local_path(out: str) -> str | None:
    """The folder of a cache on the local filesystem, None for other URLs."""
    if "://" not in out:
        return out
    return out[len("file://"):] if out.startswith("file://") else None


class ShardLock:
    """The right to write one shard of the cache at ``out``, held by this process."""

    def __init__(self, out: str, shard_id: int, storage_options: dict | None = None):
        self.out, self.shard_id = out, shard_id
        self.record: LockHolder | None = None
        local = _local_path(out)
        if local is not None:
            self.fs = None
            self.path = os.path.join(local, LOCKS_DIR, f"{shard_id:05d}.lock")
            self.record_path = self.path.removesuffix(".lock") + ".json"
            self.os_lock = filelock.FileLock(self.path)
        else:
            import fsspec

            self.fs, root = fsspec.core.url_to_fs(out, **(storage_options or {}))
            self.path = self.record_path = f"{root.rstrip('/')}/{LOCKS_DIR}/{shard_id:05d}.lock"

    def _read(self) -> LockHolder | None:
        """The lock's record: None where there is none, UNRECORDED where it is not written whole yet."""
        try:
            if self.fs is None:
                with open(self.record_path, "rb") as f:
                    data = f.read()
            else:
                data = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None
        try:
            return LockHolder(**json.loads(data.decode()))
        except (ValueError, TypeError):
            return UNRECORDED

    def _mine(self) -> bool:
        current = self._read()
        return self.record is not None and current is not None and current.token == self.record.token

    def probe(self) -> LockHolder | None:
        """The holder of the lock, if any (locally: only a live one); takes nothing."""
        if self.fs is not None:
            return self._read()
        if not os.path.exists(self.path):
            return None
        other = filelock.FileLock(self.path)
        try:
            other.acquire(timeout=0)
        except filelock.Timeout:
            return self._read() or UNRECORDED
        other.release()
        return None

    def acquire(self) -> LockHolder | None:
        """Take the lock or raise ``ShardLocked``; returns the record of a dead holder it replaced, if any."""
        record = LockHolder(HOST, os.getpid(), time.time(), uuid.uuid4().hex)
        data = json.dumps(asdict(record)).encode()
        if self.fs is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            try:
                self.os_lock.acquire(timeout=ACQUIRE_WAIT_S, poll_interval=0.01)
            except filelock.Timeout:
                raise ShardLocked(self, self._read()) from None
            previous = self._read()
            with open(self.record_path, "wb") as f:
                f.write(data)
        else:
            previous = None
            try:  # folders exist only on filesystems that have them (fsspec's local one)
                self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
            except Exception:  # noqa: BLE001 - object stores: no folders, nothing to make
                pass
            try:
                if self.fs.exists(self.path):  # where a store ignores "xb", check-then-create at least
                    raise FileExistsError(self.path)
                with self.fs.open(self.path, "xb") as f:  # create-if-absent, atomic where the store supports it
                    f.write(data)
            except FileExistsError:
                raise ShardLocked(self, self._read()) from None
        self.record = record
        return previous

    def check(self) -> None:
        """Raise LockLost unless the lock's record is still this process's."""
        if not self._mine():
            raise LockLost(f"shard {self.shard_id:05d} of {self.out}: its lock record no longer names this process "
                           "(deleted, or taken by another run); stopping without recording more. Its last commit "
                           "is intact")

    def release(self) -> None:
        """Give the lock up; its record is removed unless it is a successor's. A no-op when not held."""
        if self.record is None:
            return
        try:
            if self._mine():
                if self.fs is None:
                    os.remove(self.record_path)
                else:
                    self.fs.rm_file(self.path)
        finally:
            self.record = None
            if self.fs is None:
                self.os_lock.release()


def live_holders(out: str, storage_options: dict | None = None) -> dict[int, LockHolder]:
    """Every shard of the cache at ``out`` whose lock is held, with its holder."""
    local = _local_path(out)
    try:
        if local is not None:
            names = os.listdir(os.path.join(local, LOCKS_DIR))
        else:
            import fsspec

            fs, root = fsspec.core.url_to_fs(out, **(storage_options or {}))
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(f"{root.rstrip('/')}/{LOCKS_DIR}", detail=False)]
    except FileNotFoundError:
        return {}
    holders = {}
    for name in names:
        stem = name.removesuffix(".lock")
        if name.endswith(".lock") and stem.isdigit():
            holder = ShardLock(out, int(stem), storage_options).probe()
            if holder is not None:
                holders[int(stem)] = holder
    return holders
