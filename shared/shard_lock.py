"""One writer per shard: a lock file per shard, ``CACHE/locks/NNNNN.lock``.

A shard is written by one process at a time. Its lock file names the holder (host, pid,
since when) and carries a heartbeat the holder refreshes every few seconds, so that a
second run is refused naming who writes the shard, and a holder that died is taken over:

* Local folders (plain paths and ``file://`` URLs): the holder keeps an exclusive
  ``flock`` on the file, which the kernel drops when the process dies (``kill -9``
  included), so the next run takes the lock at once. On a shared filesystem whose
  ``flock`` does not reach across nodes (NFS mounted with ``local_lock``, Lustre without
  ``-o flock``), a record of another host whose heartbeat is fresh still refuses; it is
  taken over once that heartbeat is older than ``stale_after_s``.
* Other fsspec URLs (object stores): the file is created only if absent, atomically where
  the filesystem implements it (``pipe_file(mode="create")``), then read back after
  ``settle_s``: of two runs racing for it, only the one whose record survived holds it. A
  holder is dead when its pid is gone (same host) or its heartbeat is stale (other hosts).

A holder that finds its record replaced (it was presumed dead) refuses to commit again
(``check``, called before every commit record).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

LOCKS_DIR = "locks"
"""Folder of the lock files inside the cache (a Zarr group of its own, so that zarr lists no lock file)."""
HEARTBEAT_S = 10.0
"""Seconds between the holder's heartbeats."""
STALE_AFTER_S = 120.0
"""A holder on another host whose heartbeat is older than this is presumed dead."""
HOST = socket.gethostname()
RECORD_BYTES = 512


@dataclass
class LockHolder:
    """Who holds a shard's lock, as its lock file records it."""

    host: str
    pid: int
    since: float
    """Epoch seconds when the lock was taken."""
    heartbeat: float
    """Epoch seconds of the holder's last heartbeat."""
    token: str
    """Unique per acquisition: tells this holder's record from a successor's."""
    pid_started: str | None = None
    """The process's start time (Linux ``/proc``): tells the holder from a process that reused its pid."""

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        since = datetime.fromtimestamp(self.since, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"host {self.host}, pid {self.pid}, since {since} (last heartbeat {max(now - self.heartbeat, 0):.0f} s ago)"

    def to_bytes(self) -> bytes:
        """JSON padded with spaces to a fixed size, so that a heartbeat overwrites the record whole."""
        return json.dumps(asdict(self), sort_keys=True).encode().ljust(RECORD_BYTES)

    @classmethod
    def from_bytes(cls, data: bytes) -> "LockHolder | None":
        """The record, or None for an empty (released) or unreadable file."""
        try:
            return cls(**json.loads(data.decode())) if data.strip() else None
        except (ValueError, TypeError):
            return None


class LockError(Exception):
    """A shard's lock is not this process's to take, or no longer is."""


class ShardLocked(LockError):
    """Another live process holds the shard's lock; ``holder`` names it."""

    def __init__(self, out: str, shard_id: int, holder: LockHolder | None):
        self.shard_id, self.holder = shard_id, holder
        who = holder.describe() if holder is not None else "a process whose record is not written yet"
        super().__init__(f"shard {shard_id:05d} of {out} is being written by another run: {who}")


class LockLost(LockError):
    """This process no longer holds the lock of the shard it writes."""


def _proc_stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command name (Linux), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()
    except (OSError, ValueError):
        return None


def _pid_started(pid: int) -> str | None:
    """Start time of a process in clock ticks since boot (Linux), None where unknown."""
    fields = _proc_stat(pid)
    return fields[19].decode() if fields is not None and len(fields) > 19 else None


def _pid_alive(pid: int) -> bool:
    """The process runs: it exists and is not a zombie (a killed process nobody has reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    fields = _proc_stat(pid)
    return fields is None or fields[0] not in (b"Z", b"X")


def holder_alive(holder: LockHolder, stale_after_s: float = STALE_AFTER_S, now: float | None = None) -> bool:
    """Same host: its process still runs (and is the same process); other hosts: a fresh heartbeat."""
    if holder.host == HOST:
        if not _pid_alive(holder.pid):
            return False
        started = _pid_started(holder.pid)
        return holder.pid_started is None or started is None or started == holder.pid_started
    now = time.time() if now is None else now
    return now - holder.heartbeat < stale_after_s


def _local_path(out: str) -> str | None:
    """The folder of a cache on the local filesystem, None for other URLs."""
    if "://" not in out:
        return out
    if out.startswith("file://"):
        return out[len("file://"):]
    return None


class _LocalLockFile:
    """A lock file on a local (or shared POSIX) filesystem, held with ``flock``."""

    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = None

    def read(self) -> LockHolder | None:
        try:
            with open(self.path, "rb") as f:
                return LockHolder.from_bytes(f.read())
        except FileNotFoundError:
            return None

    def _read_fd(self, fd: int) -> LockHolder | None:
        return LockHolder.from_bytes(os.pread(fd, 1 << 16, 0))

    def take(self, record: LockHolder, stale_after_s: float) -> tuple[bool, LockHolder | None]:
        """(True, the previous record) once held; (False, the holder) when another process holds it."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read_fd(fd)
            os.close(fd)
            return False, holder
        previous = self._read_fd(fd)
        if previous is not None and holder_alive(previous, stale_after_s):
            # flock did not see it: a filesystem whose locks stay on each node (another host), or a
            # lock file deleted and made anew under a live holder (this host)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return False, previous
        self.fd = fd
        self._write(record)
        return True, previous

    def _write(self, record: LockHolder) -> None:
        data = record.to_bytes()
        os.pwrite(self.fd, data, 0)
        if os.fstat(self.fd).st_size > len(data):
            os.ftruncate(self.fd, len(data))
        os.fsync(self.fd)

    def refresh(self, record: LockHolder) -> LockHolder | None:
        """Write the heartbeat; returns the record found instead of ours, if any (the lock is lost)."""
        try:
            replaced = os.stat(self.path).st_ino != os.fstat(self.fd).st_ino
        except FileNotFoundError:
            replaced = True
        if replaced:  # the file was deleted under us: whoever made the new one may hold it
            return self.read() or LockHolder("?", 0, 0.0, 0.0, "", None)
        current = self._read_fd(self.fd)
        if current is not None and current.token != record.token:
            return current
        self._write(record)
        return None

    def release(self, record: LockHolder) -> None:
        if self.fd is None:
            return
        try:
            current = self._read_fd(self.fd)
            if current is None or current.token == record.token:
                os.ftruncate(self.fd, 0)  # empty: released, not died (the file stays for the flock's sake)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


class _StoreLockFile:
    """A lock file on an fsspec filesystem: create-if-absent, then read back."""

    def __init__(self, fs, path: str, settle_s: float):
        self.fs, self.path, self.settle_s = fs, path, settle_s

    def read(self) -> LockHolder | None:
        try:
            return LockHolder.from_bytes(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None

    def take(self, record: LockHolder, stale_after_s: float) -> tuple[bool, LockHolder | None]:
        previous = self.read()
        if previous is not None and holder_alive(previous, stale_after_s):
            return False, previous
        try:
            if previous is None:
                try:  # folders exist only on filesystems that have them (fsspec's local one)
                    self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
                except Exception:  # noqa: BLE001 - object stores: no folders, nothing to make
                    pass
                self.fs.pipe_file(self.path, record.to_bytes(), mode="create")
            else:  # a dead holder's record: replaced, and whoever replaced it last wins below
                self.fs.pipe_file(self.path, record.to_bytes())
        except FileExistsError:
            return False, self.read()
        time.sleep(self.settle_s)
        current = self.read()
        if current is None or current.token != record.token:
            return False, current
        return True, previous

    def refresh(self, record: LockHolder) -> LockHolder | None:
        current = self.read()
        if current is not None and current.token != record.token:
            return current
        self.fs.pipe_file(self.path, record.to_bytes())
        return None

    def release(self, record: LockHolder) -> None:
        current = self.read()
        if current is not None and current.token == record.token:
            self.fs.rm_file(self.path)


def _lock_file(out: str, shard_id: int, storage_options: dict | None, settle_s: float, backend: str | None):
    name = f"{LOCKS_DIR}/{shard_id:05d}.lock"
    local = _local_path(out)
    if backend is None:
        backend = "local" if local is not None else "store"
    if backend == "local":
        if local is None:
            raise ValueError(f"{out}: not a local folder")
        return _LocalLockFile(os.path.join(local, *name.split("/")))
    import fsspec

    fs, root = fsspec.core.url_to_fs(out, **(storage_options or {}))
    return _StoreLockFile(fs, f"{root.rstrip('/')}/{name}", settle_s)


class ShardLock:
    """The right to write one shard of the cache at ``out``, held by this process.

    ``acquire`` takes it or raises ``ShardLocked`` naming the live holder; a dead holder's
    lock is taken over (``acquire`` returns its record). While held, a daemon thread
    refreshes the heartbeat; ``check`` raises ``LockLost`` once another process has taken
    the lock over, or the heartbeat could not be written for half of ``stale_after_s``.
    ``backend`` ('local' or 'store') overrides the choice made from ``out`` (tests).
    """

    def __init__(self, out: str, shard_id: int, storage_options: dict | None = None, *,
                 heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S, settle_s: float = 1.0,
                 backend: str | None = None):
        self.out, self.shard_id = out, shard_id
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.file = _lock_file(out, shard_id, storage_options, settle_s, backend)
        self.record: LockHolder | None = None
        self._lost: str | None = None
        self._last_beat = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def probe(self) -> LockHolder | None:
        """The live holder of the lock, if any, from its record alone (takes nothing)."""
        holder = self.file.read()
        return holder if holder is not None and holder_alive(holder, self.stale_after_s) else None

    def acquire(self) -> LockHolder | None:
        """Take the lock; returns the record of a dead holder it replaced (None if it was free)."""
        now = time.time()
        record = LockHolder(HOST, os.getpid(), now, now, uuid.uuid4().hex, _pid_started(os.getpid()))
        held, other = self.file.take(record, self.stale_after_s)
        if not held:
            raise ShardLocked(self.out, self.shard_id, other)
        self.record, self._last_beat, self._lost = record, time.monotonic(), None
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"shard-{self.shard_id:05d}-lock", daemon=True)
        self._thread.start()
        return other

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.record.heartbeat = time.time()
            try:
                other = self.file.refresh(self.record)
            except Exception:  # noqa: BLE001 - retried at the next beat; check() gives up once the lease may expire
                continue
            if other is not None:
                self._lost = f"it was taken over by {other.describe()}"
                return
            self._last_beat = time.monotonic()

    def check(self) -> None:
        """Raise LockLost unless this process still holds the lock."""
        if self.record is None:
            raise LockLost(f"shard {self.shard_id:05d}: its lock is not held")
        silent = time.monotonic() - self._last_beat
        if self._lost is None and silent > self.stale_after_s / 2:
            self._lost = f"its heartbeat could not be written for {silent:.0f} s"
        if self._lost is not None:
            raise LockLost(f"shard {self.shard_id:05d} of {self.out}: this process lost its lock ({self._lost}); "
                           "stopping without recording more. Its last commit is intact")

    def release(self) -> None:
        """Give the lock up (the record is emptied or removed); a no-op when not held."""
        if self.record is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.file.release(self.record)  # leaves a successor's record alone
        finally:
            self.record = None


def live_holders(out: str, storage_options: dict | None = None,
                 stale_after_s: float = STALE_AFTER_S) -> dict[int, LockHolder]:
    """Every shard of the cache at ``out`` whose lock a live process holds, with its holder."""
    local = _local_path(out)
    if local is not None:
        try:
            names = os.listdir(os.path.join(local, LOCKS_DIR))
        except FileNotFoundError:
            return {}
    else:
        import fsspec

        fs, root = fsspec.core.url_to_fs(out, **(storage_options or {}))
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(f"{root.rstrip('/')}/{LOCKS_DIR}", detail=False)]
        except FileNotFoundError:
            return {}
    out_holders = {}
    for name in names:
        stem = name.removesuffix(".lock")
        if name.endswith(".lock") and stem.isdigit():
            holder = ShardLock(out, int(stem), storage_options, stale_after_s=stale_after_s).probe()
            if holder is not None:
                out_holders[int(stem)] = holder
    return out_holders
