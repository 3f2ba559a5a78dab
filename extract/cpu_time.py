"""Where a worker's CPU goes: per thread of its process (the forward loop, the writer thread,
zarrs' encoding threads).

The closing timing of a shard (``extract/worker.py``) reports them, so that a benchmark or a
slow run shows which thread or process took the cores.
"""

from __future__ import annotations

import os
import resource
import threading


def read_stat(path: str) -> tuple[str, float, float]:
    """(kernel name, user seconds, system seconds) from a /proc ``stat`` file of a thread
    (``/proc/self/task/<tid>/stat``)."""
    with open(path) as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()  # after the name, which may hold spaces
    tick = os.sysconf("SC_CLK_TCK")
    return stat[stat.index("(") + 1:stat.rindex(")")], int(fields[11]) / tick, int(fields[12]) / tick


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds of each live thread of this process (tid -> (name, seconds)); empty where
    /proc is missing (not Linux). Where the forward loop's process spends its cores."""
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    threads = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return threads
    for tid in tids:
        try:
            kernel_name, user, system = read_stat(f"/proc/self/task/{tid}/stat")
        except OSError:  # the thread ended meanwhile
            continue
        # Python's own name for its threads; the kernel's (e.g. "python", "pt_autograd") for the others
        threads[int(tid)] = (python_names.get(int(tid)) or kernel_name, user + system)
    return threads


def thread_cpu_by_name(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds between two ``thread_cpu`` snapshots, summed by thread name (digits dropped,
    so a pool's threads count as one), largest first, threads under 0.05 s left out."""
    by_name: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        key = name.rstrip("0123456789_-") or name
        by_name[key] = by_name.get(key, 0.0) + cpu - before.get(tid, (name, 0.0))[1]
    return {k: round(v, 2) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1]) if v >= 0.05}


def process_cpu_seconds() -> float:
    """CPU seconds of this process and of its finished (joined) child processes."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))
