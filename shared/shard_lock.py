"""One writer per shard, through ``CACHE/locks/NNNNN.lock``: locally an OS lock (dies with its process) with
``NNNNN.json`` naming the holder; on fsspec URLs the file itself, created only if absent, names the holder (and outlives
a dead run until deleted). The holder ``check``s the record is still its own before each commit record."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Callable

import filelock
import fsspec

from .compression import is_local

LOCKS_DIR = "locks"  # inside the cache, a Zarr group of its own, so that zarr lists no lock file
HOST = socket.gethostname()
POLL_S = 2.0  # seconds between attempts to take a lock while waiting for it


@dataclass
class LockHolder:
    """Who holds a shard's lock, as its record says; ``token`` is unique per acquisition."""

    host: str
    pid: int
    since: float  # epoch seconds
    token: str

    def describe(self) -> str:
        if not self.pid:
            return "a process that has not recorded itself yet"
        since = datetime.fromtimestamp(self.since, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"host {self.host}, pid {self.pid}, since {since}"


UNRECORDED = LockHolder("", 0, 0.0, "")  # a holder whose record is not written whole yet


class LockError(Exception):
    """A shard's lock is not this process's to take, or no longer is."""


class ShardLocked(LockError):
    """Another process holds the shard's lock; ``holder`` names it (None: released since)."""

    def __init__(self, lock: "ShardLock", holder: LockHolder | None):
        self.holder = holder
        super().__init__(f"shard {lock.shard_id:05d} of {lock.out} is being written by another run: "
                         + (holder or UNRECORDED).describe() + ("" if lock.local else
                         f". If that run has ended (killed, or its machine lost), its lock file stays on the store: "
                         f"delete {lock.fs.unstrip_protocol(lock.path)} to release the shard"))


class LockLost(LockError):
    """This process no longer holds the lock of the shard it writes."""


def _locks_folder(out: str):
    """(fsspec filesystem, the folder of the lock files) of the cache at ``out``."""
    fs, root = fsspec.core.url_to_fs(out)
    return fs, f"{root.rstrip('/')}/{LOCKS_DIR}"


class ShardLock:
    """The right to write one shard of the cache at ``out``, held by this process."""

    def __init__(self, out: str, shard_id: int):
        self.out, self.shard_id = out, shard_id
        self.record: LockHolder | None = None
        self.local = is_local(out) or out.startswith("file://")  # where an OS lock works
        self.fs, self.folder = _locks_folder(out)
        self.path = f"{self.folder}/{shard_id:05d}.lock"
        # locally the OS lock is on the .lock file and the record beside it; on a store the file is the record
        self.record_path = self.path.removesuffix(".lock") + ".json" if self.local else self.path
        self.os_lock = filelock.FileLock(self.path) if self.local else None

    def _read(self) -> LockHolder | None:
        """The lock's record: None where there is none, UNRECORDED where it is not written whole yet."""
        try:
            data = self.fs.cat_file(self.record_path)
        except FileNotFoundError:
            return None
        try:
            return LockHolder(**json.loads(data.decode()))
        except (ValueError, TypeError):
            return UNRECORDED

    def _mine(self) -> bool:
        return self.record is not None and getattr(self._read(), "token", None) == self.record.token

    def probe(self) -> LockHolder | None:
        """The holder of the lock, if any (locally: only a live one); takes nothing."""
        if not self.local:
            return self._read()
        if not self.fs.exists(self.path):
            return None
        try:
            with filelock.FileLock(self.path).acquire(timeout=0):
                return None
        except filelock.Timeout:
            return self._read() or UNRECORDED

    def acquire(self) -> LockHolder | None:
        """Take the lock or raise ``ShardLocked``; returns the record of a dead holder it replaced, if any."""
        record = LockHolder(HOST, os.getpid(), time.time(), uuid.uuid4().hex)
        data = json.dumps(asdict(record)).encode()
        with contextlib.suppress(Exception):  # object stores have no folders to make
            self.fs.makedirs(self.folder, exist_ok=True)
        previous = None
        if self.local:
            try:  # a short wait: a probe holds the lock for an instant
                self.os_lock.acquire(timeout=0.1, poll_interval=0.01)
            except filelock.Timeout:
                raise ShardLocked(self, self._read()) from None
            previous = self._read()
            self.fs.pipe_file(self.record_path, data)
        else:
            try:
                if self.fs.exists(self.path):  # where a store ignores "xb", check-then-create at least
                    raise FileExistsError(self.path)
                with self.fs.open(self.path, "xb") as f:  # create-if-absent, atomic where the store supports it
                    f.write(data)
            except FileExistsError:
                raise ShardLocked(self, self._read()) from None
        self.record = record
        return previous

    def take(self, warn: Callable[[str], None], wait: bool = False) -> "ShardLock":
        """``acquire``, warning of a dead holder replaced; with ``wait``, waits for a live holder to release it."""
        said = None
        while True:
            try:
                previous = self.acquire()
                break
            except ShardLocked as e:
                if not wait:
                    raise
                if said != (e.holder and e.holder.token):
                    warn(f"{e}; waiting for it (--wait-for-lock)")
                    said = e.holder and e.holder.token
            time.sleep(POLL_S)
        if previous is not None:
            warn(f"shard {self.shard_id:05d}: took over the lock of {previous.describe()}, which ended without "
                 "releasing it (killed, or its node was lost)")
        return self

    def check(self) -> None:
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
                self.fs.rm_file(self.record_path)
        finally:
            self.record = None
            if self.local:
                self.os_lock.release()


def live_holders(out: str) -> dict[int, LockHolder]:
    """Every shard of the cache at ``out`` whose lock is held, with its holder."""
    fs, folder = _locks_folder(out)
    names = [path.rsplit("/", 1)[-1].removesuffix(".lock") for path in fs.glob(f"{folder}/*.lock")]
    holders = {int(n): ShardLock(out, int(n)).probe() for n in names if n.isdigit()}
    return {s: h for s, h in holders.items() if h is not None}
