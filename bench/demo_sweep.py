"""Several whole CPU demos at once, each pinned to its own 2 cores, under one deadline.

    python bench/demo_sweep.py --out DIR --seeds 0 1 --deadline 300 \
        --variant base --variant "draft2:train.num_draft_layers=2" \
        --variant "tgt8:target.num_hidden_layers=8;layer_ids=[1,3,5]"

Each variant is ``NAME[:KEY=VALUE;KEY=VALUE...]`` (``python -m dflash.eval.demo --set``
assignments). Every (variant, seed) runs ``python -m dflash.eval.demo`` from scratch in
DIR/NAME_sSEED under ``taskset -c 2k,2k+1`` with 2 torch/OpenMP threads, as on a 2-core
machine; runs still going at the deadline are stopped (their log shows how far they got).
Writes DIR/sweep.json (every finished run's summary, the settings, the host's load) and
prints one line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SUMMARY_KEYS = ("acceptance_offline", "acceptance_offline_replay", "acceptance_online", "speedup",
                "tokens_per_target_forward", "demo_seconds", "regenerated_match", "lossless", "acceptance_per_task")


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, rest = text.partition(":")
    return name, [a for a in rest.split(";") if a]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--variant", action="append", required=True)
    parser.add_argument("--cores-per-run", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="the test suite's reduced demo (a quick check)")
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds after which unfinished runs stop")
    args = parser.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    runs = [(name, sets, seed) for name, sets in map(parse_variant, args.variant) for seed in args.seeds]
    k = args.cores_per_run
    if len(runs) * k > len(cores):
        sys.exit(f"{len(runs)} runs x {k} cores need {len(runs) * k} cores, this machine gives {len(cores)}")
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    procs = []
    for i, (name, sets, seed) in enumerate(runs):
        pinned = ",".join(str(c) for c in cores[i * k:(i + 1) * k])
        folder = args.out / f"{name}_s{seed}"
        env = {**os.environ, "OMP_NUM_THREADS": str(k), "MKL_NUM_THREADS": str(k),
               "CUDA_VISIBLE_DEVICES": ""}  # the CPU only, as on the 2-core machine
        cmd = ["taskset", "-c", pinned, sys.executable, "-m", "dflash.eval.demo", "--out", str(folder),
               "--seed", str(seed)] + [f"--set={a}" for a in sets] + (["--small"] if args.small else [])
        log = open(args.out / f"{name}_s{seed}.log", "w")
        procs.append((name, sets, seed, folder, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env),
                      time.perf_counter()))
    deadline = time.perf_counter() + args.deadline
    ended: dict[int, float] = {}
    while len(ended) < len(procs) and time.perf_counter() < deadline:
        for i, (*_, proc, start) in enumerate(procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.perf_counter() - start
        time.sleep(1.0)
    results = []
    for i, (name, sets, seed, folder, proc, start) in enumerate(procs):
        if proc.poll() is None:
            proc.kill()
        row = {"variant": name, "sets": sets, "seed": seed, "returncode": proc.wait(),
               "wall_seconds": ended.get(i)}
        summary = folder / "summary.json"
        if summary.is_file():
            data = json.loads(summary.read_text())
            row.update({key: data.get(key) for key in SUMMARY_KEYS})
            row["drafter_train_seconds"] = data["training"]["seconds"]
            row["target_train_seconds"] = data["target"]["train_seconds"]
        results.append(row)
        tau, speed = row.get("acceptance_online"), row.get("speedup")
        print(f"{name:>12} seed {seed}: " + (f"online {tau:.3f}, {speed:.2f}x greedy, {row['demo_seconds']:.0f} s"
                                             if tau is not None else f"unfinished (rc {row['returncode']})"))
    (args.out / "sweep.json").write_text(json.dumps(
        {"load_before": load_before, "load_after": os.getloadavg(), "cores": len(cores), "runs": results},
        indent=2) + "\n")


if __name__ == "__main__":
    main()
