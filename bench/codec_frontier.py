"""Lossy hidden-state caches: bytes against the CPU demo drafter's acceptance (issue 16 item 3).

    python bench/codec_frontier.py --out /tmp/cf --seeds 0 1 --mode bf16:1000 \
        --mode fp8 --mode int8:96 --mode int8:32 --mode int4:96 --mode int4:32

``bf16:K`` is the control: the lossless cache, the drafter trained with seed S + K (training's
own randomness). ``MODE,topk=bfloat16`` also stores the top-k log-probs at that precision.
Per seed, ``OUT/base_sS`` is a whole CPU demo (``python -m dflash.eval.demo --seed S``), built
once. Per (mode, seed), ``OUT/MODE_sS`` holds the lossy cache made from it by ``dflash-cache
convert``, the demo's own training, export and evaluation steps on it (settings untouched),
and ``result.json`` (``run_mode``'s row; the replay on the lossless cache gives the features
online decoding sees). Every job runs pinned to one core with one thread, ``--jobs`` at once.
Writes ``OUT/frontier.json`` and prints a markdown table (the mean and each seed's value).
"""

import argparse
import json
import os
import queue
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

LOSSLESS = "bf16"


def parse_mode(text: str) -> dict:
    """``fp8`` | ``int8:G`` | ``int4:G`` | ``bf16:K``, optionally ``,topk=DTYPE``, as the dict a job runs from."""
    codec, *extras = text.split(",")
    topk = None
    for extra in extras:
        key, _, value = extra.partition("=")
        if key != "topk" or value not in ("float16", "bfloat16"):
            raise argparse.ArgumentTypeError(f"mode {text!r}: {extra!r} is not topk=float16 or topk=bfloat16")
        topk = value
    mode, _, group = codec.partition(":")
    suffix = f"_topk{topk}" if topk else ""
    base = {"seed_offset": 0, "topk_dtype": topk, "spec": text, "group_size": None, "mode": mode}
    if mode not in ("fp8", "int8", "int4", LOSSLESS):
        raise argparse.ArgumentTypeError(f"mode {text!r}: expected fp8, int8:GROUP, int4:GROUP or bf16:SEED_OFFSET")
    if mode == "fp8":
        return {**base, "name": "fp8" + suffix}
    if not group.isdigit() or int(group) < 1:
        raise argparse.ArgumentTypeError(f"mode {text!r}: needs a positive number after the colon, e.g. {mode}:32")
    if mode == LOSSLESS:
        if topk:
            raise argparse.ArgumentTypeError(f"mode {text!r}: the control keeps the lossless cache as it is")
        return {**base, "name": f"bf16seed+{group}", "seed_offset": int(group)}
    return {**base, "group_size": int(group), "name": f"{mode}g{group}{suffix}"}


def sizes(cache: Path, tokens: int, raw_hidden: int) -> dict:
    hidden = sum(f.stat().st_size for f in (cache / "shards").glob("*/hidden*/**/*") if f.is_file())
    whole = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    return {"hidden_bytes_per_token": hidden / tokens, "hidden_of_raw_bf16": hidden / raw_hidden,
            "cache_bytes_per_token": whole / tokens, "cache_of_raw_bf16": whole / raw_hidden}


def convert_lossy_cache(lossless: Path, out: Path, mode: dict) -> list[float]:
    """``dflash-cache convert``, then ``dflash-cache stats``' relative L2 error per layer over all samples."""
    cli = [sys.executable, "-m", "dflash.shared.cache_cli"]
    cmd = cli + ["convert", str(lossless), str(out), "--hidden-codec", mode["mode"], "--no-progress"]
    if mode["group_size"]:
        cmd += ["--hidden-group-size", str(mode["group_size"])]
    if mode["topk_dtype"]:
        cmd += ["--topk-dtype", mode["topk_dtype"]]
    subprocess.run(cmd, check=True)
    stats = subprocess.run(cli + ["stats", str(out), "--json", "--max-samples", str(10 ** 9)], check=True,
                           capture_output=True, text=True)
    return [layer["rel_l2"] for layer in json.loads(stats.stdout)["conversion_error"]["layers"]]


def run_mode(base: Path, out: Path, mode: dict, seed: int) -> dict:
    """The lossy cache, then the demo's train + eval steps on it; writes OUT/result.json."""
    from dflash.eval import demo
    from dflash.eval.replay_eval import replay_export
    from dflash.shared.cache import CacheReader

    s = demo.DemoSettings(seed=seed)
    lossless = base / "cache.zarr"
    cache = out / "cache.zarr" if mode["mode"] != LOSSLESS else lossless
    if mode["seed_offset"]:
        s.train["seed"] = seed + mode["seed_offset"]
    base_record = demo._read(lossless)
    if base_record is None or not (base / "summary.json").is_file():
        raise SystemExit(f"{base}: the lossless demo is not finished (no cache marker or summary.json)")
    out.mkdir(parents=True, exist_ok=True)
    echo = lambda m: print(m, flush=True)  # noqa: E731
    if mode["mode"] == LOSSLESS:
        record = {"rel_l2_per_layer": [0.0] * len(s.layer_ids)}
    else:
        settings = {"lossless": base_record["settings"], "path": "convert",
                    "codec": {k: mode[k] for k in ("mode", "group_size", "topk_dtype") if k != "topk_dtype" or mode[k]}}
        record = demo._fresh(cache, settings)
        if record is None:
            t0 = time.perf_counter()
            record = {"rel_l2_per_layer": convert_lossy_cache(lossless, cache, mode),
                      "seconds": time.perf_counter() - t0}
            demo._write(cache, settings, **record)
            echo(f"lossy cache {cache} in {record['seconds']:.1f} s, relative L2 per layer "
                 f"{[round(e, 4) for e in record['rel_l2_per_layer']]}")
    target, load_before = base / "target", os.getloadavg()
    trained = demo.step_train(out, s, cache, target, echo)
    result = demo.step_eval(out, s, base / "regen", cache, target, echo)
    replay_lossless = replay_export(lossless, demo.heldout_samples(lossless, s), out / "export", target,
                                    max_length=s.max_length, max_new_tokens=s.max_new_tokens)["tau"]
    r = CacheReader(str(lossless))
    raw_hidden = r.num_tokens * len(s.layer_ids) * r.spec.hidden_size * 2
    o = result["overall"]
    row = {
        "mode": mode["name"], "seed": seed, "path": "control" if mode["mode"] == LOSSLESS else "convert",
        "train_seed": s.train_overrides()["seed"], "tokens": r.num_tokens, **sizes(cache, r.num_tokens, raw_hidden),
        "lossless": sizes(lossless, r.num_tokens, raw_hidden),
        "rel_l2_per_layer": record["rel_l2_per_layer"],
        "acceptance_offline": trained["eval"]["tau"], "acceptance_offline_replay": result["offline_replay"]["tau"],
        "replay_on_lossless_cache": replay_lossless, "acceptance_online": o["tau"], "lossless_decoding": o["lossless"],
        "regenerated_match": o["regenerated_match"], "speedup": o["speedup"],
        "train_seconds": trained["seconds"], "eval_seconds": result["seconds"],
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }
    (out / "result.json").write_text(json.dumps(row, indent=2) + "\n")
    return row


def base_row(base: Path, seed: int) -> dict:
    """The lossless demo's own figures, in the same row format."""
    from dflash.eval import demo
    from dflash.shared.cache import CacheReader

    summary = json.loads((base / "summary.json").read_text())
    lossless = base / "cache.zarr"
    r, n_layers = CacheReader(str(lossless)), len(demo.DemoSettings(seed=seed).layer_ids)
    return {"mode": LOSSLESS, "seed": seed, "path": "demo", "tokens": r.num_tokens,
            **sizes(lossless, r.num_tokens, r.num_tokens * n_layers * r.spec.hidden_size * 2),
            "rel_l2_per_layer": [0.0] * n_layers,
            "acceptance_offline": summary["acceptance_offline"],
            "acceptance_offline_replay": summary["acceptance_offline_replay"],
            "replay_on_lossless_cache": summary["acceptance_offline_replay"],
            "acceptance_online": summary["acceptance_online"], "lossless_decoding": summary["lossless"],
            "regenerated_match": summary["regenerated_match"], "speedup": summary["speedup"],
            "train_seconds": summary["training"]["seconds"], "demo_seconds": summary["demo_seconds"]}


def run_jobs(jobs: list[list[str]], out: Path, cores: list[int]) -> None:
    """Each job ([name, *command]) a process on a free core of ``cores``, one thread; a failure is reported."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    free = queue.Queue()
    for core in cores:
        free.put(core)

    def one(job: list[str]) -> None:
        core = free.get()
        print(f"{time.strftime('%H:%M:%S')} {job[0]}: start on core {core} (load {os.getloadavg()[0]:.1f})",
              flush=True)
        with open(out / f"{job[0]}.log", "a") as log:
            rc = subprocess.run(["taskset", "-c", str(core), *job[1:]], stdout=log, stderr=subprocess.STDOUT,
                                env=env).returncode
        free.put(core)
        print(f"{time.strftime('%H:%M:%S')} {job[0]}: {'done' if rc == 0 else f'FAILED rc {rc}'} "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)

    with ThreadPoolExecutor(len(cores)) as pool:
        list(pool.map(one, jobs))


def summarise(rows: list[dict]) -> list[str]:
    by_mode: dict[str, list[dict]] = {}
    lossless_runs: dict[int, list[float]] = {}  # the demo's drafter and the reseeded controls, per data seed
    for r in rows:
        by_mode.setdefault(r["mode"], []).append(r)
        if r["path"] in ("demo", "control"):
            lossless_runs.setdefault(r["seed"], []).append(r["acceptance_online"])
    base = {r["seed"]: r for r in by_mode.get(LOSSLESS, [])}
    lossless_mean = np.mean([np.mean(v) for v in lossless_runs.values()]) if lossless_runs else float("nan")
    each = lambda rs, key, fmt: " / ".join(fmt.format(r[key]) for r in rs)  # noqa: E731
    mean = lambda rs, key: np.mean([r[key] for r in rs])  # noqa: E731
    lines = ["| mode | path | hidden bytes/token | of raw bf16 | whole cache of raw bf16 | rel. L2 per layer "
             "| online tau, mean (per seed) | vs lossless, mean (per seed) "
             f"| vs every lossless drafter ({lossless_mean:.3f}) | offline: replay on its cache "
             "| replay on the lossless cache | speedup (loaded machine) |", "| --- " * 12 + "|"]
    for name, rs in by_mode.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        rel = [r["acceptance_online"] / base[r["seed"]]["acceptance_online"] - 1 for r in rs if r["seed"] in base]
        l2 = np.mean([r["rel_l2_per_layer"] for r in rs], axis=0)
        lines.append(
            f"| {name} | {rs[0]['path']} | {mean(rs, 'hidden_bytes_per_token'):.0f} | {mean(rs, 'hidden_of_raw_bf16'):.3f} "
            f"| {mean(rs, 'cache_of_raw_bf16'):.3f} | {' / '.join(f'{e:.4f}' for e in l2)} "
            f"| {mean(rs, 'acceptance_online'):.3f} ({each(rs, 'acceptance_online', '{:.3f}')}) "
            f"| {np.mean(rel):+.1%} ({' / '.join(f'{x:+.1%}' for x in rel)}) "
            f"| {mean(rs, 'acceptance_online') / lossless_mean - 1:+.1%} "
            f"| {each(rs, 'acceptance_offline_replay', '{:.3f}')} | {each(rs, 'replay_on_lossless_cache', '{:.3f}')} "
            f"| {each(rs, 'speedup', '{:.2f}x')} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--mode", type=parse_mode, action="append", default=[],
                   help="fp8 | int8:GROUP | int4:GROUP | bf16:SEED_OFFSET (the control), each optionally "
                        "with ,topk=float16|bfloat16 (repeatable)")
    p.add_argument("--jobs", type=int, default=2, help="processes at once, each on its own core, one thread")
    p.add_argument("--one", nargs=2, metavar=("MODE", "SEED"), help=argparse.SUPPRESS)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one:
        mode, seed = parse_mode(args.one[0]), int(args.one[1])
        print(json.dumps(run_mode(args.out / f"base_s{seed}", args.out / f"{mode['name']}_s{seed}", mode, seed)))
        return

    cores = sorted(os.sched_getaffinity(0))[: args.jobs]
    load_before = os.getloadavg()
    run_jobs([[f"base_s{seed}", sys.executable, "-m", "dflash.eval.demo", "--out", str(args.out / f"base_s{seed}"),
               "--seed", str(seed)] for seed in args.seeds if not (args.out / f"base_s{seed}" / "summary.json").is_file()],
             args.out, cores)  # the lossless demos first: every mode starts from one
    run_jobs([[f"{mode['name']}_s{seed}", sys.executable, str(Path(__file__).resolve()), "--out", str(args.out),
               "--one", mode["spec"], str(seed)] for mode in args.mode for seed in args.seeds], args.out, cores)
    rows = [base_row(args.out / f"base_s{seed}", seed) for seed in args.seeds
            if (args.out / f"base_s{seed}" / "summary.json").is_file()]
    rows += [json.loads(f.read_text()) for mode in args.mode for seed in args.seeds
             if (f := args.out / f"{mode['name']}_s{seed}" / "result.json").is_file()]
    (args.out / "frontier.json").write_text(json.dumps(
        {"load_before": load_before, "load_after": os.getloadavg(), "rows": rows}, indent=2) + "\n")
    print("\n".join(summarise(rows)))


if __name__ == "__main__":
    main()
