"""One line of JSON per ``dflash-extract`` run of ``bench/extract_write_paths.sh fixed``: the seconds
before the first batch and after the last, from the run's summary JSON and the shell's clock.

    T0=... T1=... RUN=1 LABEL=after BYTECODE=none python bench/fixed_costs_line.py SUMMARY_JSON
"""

import json
import os
import sys

ORDER = ("tokenizer_and_config", "dataset_load", "fingerprint", "cache_root", "planning", "writer_start",
         "forward_loop", "drain_and_exit", "summary")
"""Rank 0's phases in the order they follow each other (the summary JSON sorts its keys)."""


def main() -> None:
    summary = json.load(open(sys.argv[1]))
    t0, t1 = float(os.environ["T0"]), float(os.environ["T1"])
    phases, seconds = summary["phases"], summary["phases"]["seconds"]
    at = phases["started_at"] - t0  # seconds since the shell started the command, phase by phase
    ends = {}
    for name in sorted(seconds, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER)):
        at = ends[name] = at + seconds[name]
    worker = list(summary["worker_seconds"].values())[0]
    line = {
        "run": int(os.environ["RUN"]), "code": os.environ["LABEL"], "bytecode": os.environ.get("BYTECODE", "none"),
        "total_s": round(t1 - t0, 2), "imports_s": round(phases["started_at"] - t0, 2),
        "first_batch_s": round(ends["writer_start"], 2) if "writer_start" in ends else None,
        "forward_loop_s": seconds.get("forward_loop"),
        "after_last_batch_s": round(t1 - t0 - ends["forward_loop"], 2) if "forward_loop" in ends else None,
        **seconds,
        "worker": {k: v for k, v in worker.items() if k.endswith("_s")},
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
