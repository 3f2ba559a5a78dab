"""Time from process start to the first training step, cold and warm compile caches.

Builds a fake Qwen3-8B-shaped target (with a small tokenizer whose hash the cache records,
so every start checks it) and a random cache (``bench/train_loop.py``), then runs ``dflash-train
run`` as one process per entry of ``--runs``: ``cold`` empties the compile cache folder first,
``warm`` keeps what the runs before left; ``old-cold`` / ``old-warm`` run the ``dflash`` package
found at ``--old-path`` (put first on PYTHONPATH) on the same cache and folder: before and after
in one call. Per process, the figures ``run_once`` reads from its log lines and metrics.jsonl.

    python bench/train_start.py --out /tmp/ts --runs cold,old-warm,warm --steps 3 --samples 6 --eval-every 2 \
        --old-path /tmp/old_ns
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_loop import add_target_args, fake_cache, fake_target  # noqa: E402


def run_once(args, out: Path, name: str, log_dir: Path, old: bool = False) -> dict:
    """One ``dflash-train run`` process; its output lines are timestamped as they arrive."""
    run_dir = out / f"run_{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "dflash.train.cli", "run", "--cache", str(out / "cache.zarr"),
           "--target", str(out / "target"), "--out", str(run_dir), "--context-buckets", args.buckets,
           "--max-anchors", str(args.anchors), "--batch-size", str(args.batch_size), "--micro-batch-size", "1",
           "--eval-samples", "1", "--max-steps", str(args.steps + 1), "--stop-after", str(args.steps),
           "--log-every", "1", "--eval-every", str(args.eval_every), "--save-every", "1000000",
           "--no-progress", "--no-tensorboard",
           "--resume", "none", "--compile-cache", str(args.compile_cache)] + args.train_args.split()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if old:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.old_path, env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    marks = {"buckets": "context buckets compiled", "ready": "loader ready in", "warm_up_done": "warm-up compiled",
             "first_step": r"\btrain step 1 \|"}  # "loader ready in": logged by the code after 79a7383 only
    lines, at = [], {}
    for line in proc.stdout:
        now = time.perf_counter() - t0
        lines.append(f"{now:8.2f} {line.rstrip()}")
        at.update({k: round(now, 1) for k, pattern in marks.items() if k not in at and re.search(pattern, line)})
    rc = proc.wait()
    total_s = time.perf_counter() - t0
    text = "\n".join(lines)
    (log_dir / f"log_{name}.txt").write_text(text + "\n")
    warm = re.search(r"warm-up compiled (\d+) graphs over (\d+) context buckets in ([\d.]+) s", text)
    cache = re.search(r"inductor graphs (\d+) loaded, (\d+) compiled, (\d+) uncacheable; "
                      r"AOTAutograd (\d+) loaded, (\d+) compiled, (\d+) uncacheable", text)
    buckets = re.search(r"context buckets compiled: (.*)", text)
    first_eval = re.search(r"the first evaluation compiled (\d+) eval graphs .* took ([\d.]+) s", text)
    metrics_file = run_dir / "metrics.jsonl"
    records = list(map(json.loads, metrics_file.read_text().splitlines())) if metrics_file.exists() else []
    rows = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    steady = rows[1:]
    return {
        "run": name, "rc": rc, **{f"spawn_to_{k}_s": at.get(k) for k in marks},
        "warm_up_s": float(warm.group(3)) if warm else None,
        "warm_up_graphs": int(warm.group(1)) if warm else None,
        "buckets": buckets.group(1) if buckets else None,
        "inductor_loaded_compiled_uncacheable": [int(cache.group(i)) for i in (1, 2, 3)] if cache else None,
        "aot_loaded_compiled_uncacheable": [int(cache.group(i)) for i in (4, 5, 6)] if cache else None,
        "first_step_s": round(rows[0]["step_s"], 3) if rows else None,
        "median_step_s": round(statistics.median(r["step_s"] for r in steady), 4) if steady else None,
        "median_mfu": round(statistics.median(r["mfu"] for r in steady), 3) if steady else None,
        "steps": len(rows), "losses": [round(r["loss"], 6) for r in rows],
        "eval": [{"step": r["step"], "loss": round(r["loss"], 6), "tau": round(r["tau"], 4)} for r in evals],
        "first_eval_graphs": int(first_eval.group(1)) if first_eval else None,
        "first_eval_s": float(first_eval.group(2)) if first_eval else None,
        "compiles_by_step": [r["compiles"] for r in rows],
        "process_s": round(total_s, 1),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/dflash_start")
    p.add_argument("--results", default=None, help="folder for the logs and results.json (default: --out)")
    p.add_argument("--compile-cache", default=None, help="default: OUT/compile_cache")
    p.add_argument("--runs", default="cold,warm,warm", help="comma list of cold|warm")
    add_target_args(p)
    p.add_argument("--min-ctx", type=int, default=2900)
    p.add_argument("--buckets", default="1024,2048,3072")
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--samples", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=1000000, help="steps between evaluations (default: none)")
    p.add_argument("--old-path", default=None, help="PYTHONPATH entry with the code the old-* runs use")
    p.add_argument("--train-args", default="", help="more dflash-train flags, e.g. '--attention dense --compile on' "
                   "for the CPU")
    args = p.parse_args()
    out = Path(args.out)
    results = Path(args.results or out)
    results.mkdir(parents=True, exist_ok=True)
    args.compile_cache = Path(args.compile_cache or out / "compile_cache")
    t = time.time()
    if not (out / "cache.zarr").exists():
        out.mkdir(parents=True, exist_ok=True)
        fake_target(out / "target", args.hidden, 36, args.vocab, args.intermediate, args.heads, args.kv_heads)
        from dflash.eval import toy_tokenizer as toy
        from dflash.shared.fingerprint import tokenizer_fingerprint

        tokenizer_hash = tokenizer_fingerprint(toy.build_tokenizer(out / "target"))["hash"]
        lengths = fake_cache(out / "cache.zarr", [1, 9, 17, 25, 33], args.hidden, 36, args.vocab, args.samples,
                             args.ctx, args.min_ctx, tokenizer_hash)
        print(f"setup {time.time() - t:.1f} s; lengths {int(lengths.min())}..{int(lengths.max())}", flush=True)
    summary = []
    for i, kind in enumerate(args.runs.split(",")):
        old = kind.startswith("old-")
        if kind.removeprefix("old-") == "cold":
            shutil.rmtree(args.compile_cache, ignore_errors=True)
        elif kind.removeprefix("old-") != "warm":
            raise SystemExit(f"--runs: unknown kind {kind!r} (cold|warm|old-cold|old-warm)")
        if old and not args.old_path:
            raise SystemExit(f"--runs {kind} needs --old-path")
        r = run_once(args, out, f"{i}_{kind}", results, old)
        summary.append(r)
        print(json.dumps(r), flush=True)
        (results / "results.json").write_text(json.dumps(summary, indent=1))
    for r in summary:
        print(f"{r['run']:>10}: step 1 logged {r['spawn_to_first_step_s']} s after spawn; " + ", ".join(
            f"{k} {r[k]}" for k in ("spawn_to_buckets_s", "warm_up_s", "median_step_s", "first_eval_s", "rc")))

if __name__ == "__main__":
    main()
