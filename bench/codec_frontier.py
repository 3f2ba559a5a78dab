"""Lossy hidden-state caches: bytes against the CPU demo drafter's acceptance (issue 16 item 3).

    python bench/codec_frontier.py --out /tmp/cf --seeds 0 1 --mode bf16:1000 \
        --mode fp8 --mode int8:96 --mode int8:32 --mode int4:96 --mode int4:32 \
        [--simulate | --check-against SIMULATED_OUT]

``bf16:K`` is the control: the lossless cache itself, the drafter trained with seed S + K
(training's own randomness, the features unchanged). ``MODE,topk=bfloat16`` also stores
the top-k log-probs at that precision.

Per seed, ``OUT/base_sS`` is a whole CPU demo (``python -m dflash.eval.demo --seed S``):
data, target, regenerated chats, the lossless cache and its drafter, built once and reused
on reruns. Per (mode, seed), ``OUT/MODE_sS`` holds the lossy cache made from that lossless
one (``dflash-cache convert``; or ``--simulate``: see below), then the demo's own training,
export and evaluation steps (``dflash.eval.demo.step_train`` / ``step_eval``, the demo's
settings untouched) on it, and ``result.json``: bytes per token of the hidden states and of
the whole cache, the relative L2 error per layer against the lossless cache (computed here
in float64, independently of the cache's own statistics), training's offline estimate, the
demo's offline replay (on the lossy cache), a replay on the lossless cache (the features
online decoding sees), online acceptance and speed, with the load average around each.

``--simulate``: the lossy cache is the lossless one with every hidden state replaced by
``decode(encode(x))`` (``shared/hidden_codecs.py``), stored losslessly; its hidden bytes are
the encoded payload and scales put through the cache's lossless stage chunk by chunk (byte
shuffle + zstd 1 in blosc, 256-token chunks, a 4-byte checksum each), not read off disk.

Every job (a base demo or a mode) runs as its own process pinned to one core with one
thread, at most ``--jobs`` at once (2 by default: the development machine has 2 cores).
Writes ``OUT/frontier.json`` and prints a markdown table (the mean and each seed's value);
``--check-against`` records, per mode, whether the converted cache decodes bitwise equal
to a ``--simulate`` run's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

LOSSLESS = "bf16"
HIDDEN_CHUNK_TOKENS = 256


# --------------------------------------------------------------------------- modes


def parse_mode(text: str) -> dict:
    """``fp8`` | ``int8:G`` | ``int4:G`` | ``bf16:K``, optionally ``,topk=DTYPE`` ->
    {"mode", "group_size", "name", "seed_offset", "topk_dtype", "spec"}.

    ``bf16:K`` is the control: the lossless cache itself, the drafter trained with seed
    (demo seed + K), so its spread is what training's randomness alone moves acceptance by.
    ``topk=float16|bfloat16`` also stores the top-k log-probs at that precision (convert only)."""
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


def hidden_codec(mode: dict):
    from dflash.shared.hidden_codecs import HiddenCodec

    return HiddenCodec(mode["mode"], mode["group_size"] or 128)


# --------------------------------------------------------------------------- sizes


def array_bytes_on_disk(cache: Path) -> dict[str, int]:
    """Bytes of every array's files summed over the shards, by array name."""
    sizes: dict[str, int] = {}
    for shard in sorted(p for p in (cache / "shards").iterdir() if p.is_dir()):
        for array in shard.iterdir():
            if array.is_dir():
                sizes[array.name] = sizes.get(array.name, 0) + sum(
                    f.stat().st_size for f in array.rglob("*") if f.is_file())
    return sizes


def cache_bytes_on_disk(cache: Path) -> int:
    return sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())


def lossless_stage_bytes(array: np.ndarray) -> int:
    """What the cache's lossless stage makes of one chunk: blosc zstd 1 with byte shuffle,
    512 KiB blocks, plus the crc32c codec's 4 bytes."""
    from numcodecs import Blosc

    codec = Blosc(cname="zstd", clevel=1, shuffle=Blosc.SHUFFLE, typesize=array.dtype.itemsize, blocksize=1 << 19)
    return len(codec.encode(np.ascontiguousarray(array))) + 4


# --------------------------------------------------------------------------- the lossy cache


def hidden_arrays(cache: Path):
    """(shard name, committed tokens) of every shard of a cache."""
    from dflash.shared.cache import CacheReader

    reader = CacheReader(str(cache))
    return [(f"{s.shard_id:05d}", s.tokens) for s in reader.shards]


def simulate_lossy_cache(lossless: Path, out: Path, mode: dict) -> int:
    """Copy ``lossless`` to ``out`` with every hidden state replaced by its codec round trip;
    returns the hidden states' bytes as the codec plus the lossless stage would store them."""
    import torch
    import zarr

    from dflash.shared.cache import bf16_from_bits, bf16_to_bits
    from dflash.shared.hidden_codecs import decode, encode

    codec = hidden_codec(mode)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(lossless, tmp)
    root = zarr.open_group(str(tmp), mode="r+", zarr_format=3)
    stored = 0
    for shard, tokens in hidden_arrays(lossless):
        array = root["shards"][shard]["hidden"]
        for t0 in range(0, tokens, HIDDEN_CHUNK_TOKENS):
            t1 = min(tokens, t0 + HIDDEN_CHUNK_TOKENS)
            x = bf16_from_bits(np.asarray(array[t0:t1]))
            encoded = encode(codec, x)
            stored += lossless_stage_bytes(encoded.payload.numpy()) + lossless_stage_bytes(encoded.scales.numpy())
            array[t0:t1] = bf16_to_bits(decode(codec, encoded, torch.bfloat16))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return stored


def convert_lossy_cache(lossless: Path, out: Path, mode: dict) -> list[float]:
    """``dflash-cache convert`` (the real path); returns the relative L2 error per layer that
    ``dflash-cache stats`` reports for the converted cache over all its samples."""
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


def relative_l2_per_layer(lossless: Path, lossy: Path) -> list[float]:
    """||lossy - lossless|| / ||lossless|| per stored layer over every committed token, in
    float64, both caches read through ``CacheReader`` (so a codec decodes as training sees it)."""
    from dflash.shared.cache import CacheReader

    ref, got = CacheReader(str(lossless)), CacheReader(str(lossy))
    if len(ref) != len(got) or ref.spec.layer_ids != got.spec.layer_ids:
        raise ValueError(f"{lossy} does not hold {lossless}'s samples and layers")
    L = ref.spec.num_layers
    err, norm = np.zeros(L), np.zeros(L)
    for i in range(len(ref)):
        a = ref.read(i, ("hidden",))["hidden"].double().numpy()  # (T, L, D)
        b = got.read(i, ("hidden",))["hidden"].double().numpy()
        err += ((b - a) ** 2).sum(axis=(0, 2))
        norm += (a ** 2).sum(axis=(0, 2))
    return [float(v) for v in np.sqrt(err / norm)]


def outlier_structure(cache: Path, every: int = 10) -> list[dict]:
    """Per stored layer, how far the largest channels stand out (every ``every``-th sample):
    the largest channel's RMS over the median channel's, and the median over tokens of a
    row's absolute maximum over its RMS (what a per-row or per-group scale has to span)."""
    from dflash.shared.cache import CacheReader

    reader = CacheReader(str(cache))
    x = np.concatenate([reader.read(i, ("hidden",))["hidden"].double().numpy()
                        for i in range(0, len(reader), every)])  # (T, L, D)
    rows = []
    for j, layer in enumerate(reader.spec.layer_ids):
        a = x[:, j]
        channel_rms = np.sqrt((a ** 2).mean(axis=0))
        row_rms = np.sqrt((a ** 2).mean(axis=1))
        rows.append({"layer_id": layer,
                     "top_channel_rms_over_median": float(channel_rms.max() / np.median(channel_rms)),
                     "row_absmax_over_rms_median": float(np.median(np.abs(a).max(axis=1) / row_rms)),
                     "absmax_over_rms": float(np.abs(a).max() / np.sqrt((a ** 2).mean()))})
    return rows


def same_decoded_hidden(a: Path, b: Path) -> bool:
    """Whether two caches hold the same samples with bitwise equal hidden states as read."""
    import torch

    from dflash.shared.cache import CacheReader

    ra, rb = CacheReader(str(a)), CacheReader(str(b))
    bits = lambda reader, i: reader.read(i, ("hidden",))["hidden"].view(torch.int16)  # noqa: E731
    return len(ra) == len(rb) and all(torch.equal(bits(ra, i), bits(rb, i)) for i in range(len(ra)))


# --------------------------------------------------------------------------- one mode


def demo_settings(seed: int, small: bool):
    """The demo's own settings (``make demo``; ``--small``: the test suite's reduced demo)."""
    from dflash.eval import demo

    return demo.DemoSettings.small(seed) if small else demo.DemoSettings.full(seed)


def run_mode(base: Path, out: Path, mode: dict, seed: int, simulate: bool, small: bool = False) -> dict:
    """The lossy cache, then the demo's train + eval steps on it; writes OUT/result.json."""
    from dflash.eval import demo

    s = demo_settings(seed, small)
    lossless = base / "cache.zarr"
    cache = out / "cache.zarr" if mode["mode"] != LOSSLESS else lossless
    if mode["seed_offset"]:
        s.train["seed"] = seed + mode["seed_offset"]
    base_record = demo._read(lossless)
    if base_record is None or not (base / "summary.json").is_file():
        raise SystemExit(f"{base}: the lossless demo is not finished (no cache marker or summary.json)")
    out.mkdir(parents=True, exist_ok=True)
    settings = {"lossless": base_record["settings"],
                "codec": {k: mode[k] for k in ("mode", "group_size", "topk_dtype") if k != "topk_dtype" or mode[k]},
                "path": "simulated" if simulate else "convert"}
    echo = lambda m: print(m, flush=True)  # noqa: E731
    if mode["mode"] == LOSSLESS:
        settings, record = base_record["settings"], {"hidden_bytes_estimate": None,
                                                     "rel_l2_per_layer": [0.0] * len(s.layer_ids)}
    else:
        record = demo._fresh(cache, settings)
    if record is None:
        t0 = time.perf_counter()
        stats_l2, hidden_estimate = None, None
        if simulate:
            if mode["topk_dtype"]:
                raise SystemExit(f"{mode['spec']}: reduced top-k precision is not simulated; run without --simulate")
            hidden_estimate = simulate_lossy_cache(lossless, cache, mode)
        else:
            stats_l2 = convert_lossy_cache(lossless, cache, mode)
        record = {"seconds": time.perf_counter() - t0, "hidden_bytes_estimate": hidden_estimate,
                  "rel_l2_per_layer": relative_l2_per_layer(lossless, cache), "stats_rel_l2_per_layer": stats_l2}
        demo._write(cache, settings, **record)
        echo(f"lossy cache {cache} ({settings['path']}) in {record['seconds']:.1f} s, "
             f"relative L2 per layer {[round(e, 4) for e in record['rel_l2_per_layer']]}")
    target, regen = base / "target", base / "regen"
    loads = LoadLog(out / "loads.json")
    with loads.around("train", out / "run.demo.json"):
        trained = demo.step_train(out, s, cache, target, echo)
    with loads.around("eval", out / "eval.json"):
        result = demo.step_eval(out, s, regen, cache, target, echo)
    replay_lossless = replay_on(out, base, s)

    tokens = _tokens(lossless)
    raw_hidden = tokens * len(s.layer_ids) * _hidden_size(lossless) * 2
    sizes, base_sizes = array_bytes_on_disk(cache), array_bytes_on_disk(lossless)
    hidden_disk = sum(v for k, v in sizes.items() if k.startswith("hidden"))
    estimate = record["hidden_bytes_estimate"]
    hidden_bytes = hidden_disk if estimate is None else estimate
    whole = cache_bytes_on_disk(cache) - (hidden_disk - hidden_bytes)
    o = result["overall"]
    row = {
        "mode": mode["name"], "seed": seed, "path": "control" if mode["mode"] == LOSSLESS else settings["path"],
        "train_seed": s.train_overrides()["seed"], "tokens": tokens,
        "hidden_bytes_per_token": hidden_bytes / tokens, "hidden_of_raw_bf16": hidden_bytes / raw_hidden,
        "lossless_hidden_of_raw_bf16": sum(v for k, v in base_sizes.items() if k.startswith("hidden")) / raw_hidden,
        "cache_bytes_per_token": whole / tokens, "cache_of_raw_bf16": whole / raw_hidden,
        "lossless_cache_of_raw_bf16": cache_bytes_on_disk(lossless) / raw_hidden,
        "rel_l2_per_layer": record["rel_l2_per_layer"], "stats_rel_l2_per_layer": record.get("stats_rel_l2_per_layer"),
        "acceptance_offline": trained["eval"]["tau"], "acceptance_offline_replay": result["offline_replay"]["tau"],
        "replay_on_lossless_cache": replay_lossless, "acceptance_online": o["tau"], "lossless": o["lossless"],
        "regenerated_match": o["regenerated_match"], "speedup": o["speedup"],
        "train_seconds": trained["seconds"], "eval_seconds": result["seconds"],
        "load_average": loads.record,
    }
    (out / "result.json").write_text(json.dumps(row, indent=2) + "\n")
    return row


class LoadLog:
    """The load average before and after each step that really ran (a step reused from an
    earlier run keeps the figures recorded then), kept in a JSON file beside the run."""

    def __init__(self, path: Path):
        self.path = path
        self.record = json.loads(path.read_text()) if path.is_file() else {}

    @contextlib.contextmanager
    def around(self, step: str, product: Path):
        stamp = product.stat().st_mtime_ns if product.exists() else None
        before = os.getloadavg()
        yield
        if not product.exists() or product.stat().st_mtime_ns != stamp:
            self.record[step] = {"before": before, "after": os.getloadavg()}
            self.path.write_text(json.dumps(self.record, indent=2) + "\n")


def replay_on(run: Path, base: Path, s) -> float:
    """The drafter of ``run`` replayed on ``base``'s lossless cache (the features online
    decoding gives it), on the demo's held-out samples."""
    from dflash.eval import demo
    from dflash.eval.offline import replay_export

    cache = base / "cache.zarr"
    return replay_export(cache, demo.heldout_samples(cache, s), run / "export", base / "target",
                         max_length=s.max_length, max_new_tokens=s.max_new_tokens)["tau"]


def _tokens(cache: Path) -> int:
    from dflash.shared.cache import CacheReader

    return CacheReader(str(cache)).num_tokens


def _hidden_size(cache: Path) -> int:
    from dflash.shared.cache import CacheReader

    return CacheReader(str(cache)).spec.hidden_size


def base_row(base: Path, seed: int, small: bool = False) -> dict:
    """The lossless demo's own figures, in the same row format."""
    summary = json.loads((base / "summary.json").read_text())
    lossless = base / "cache.zarr"
    tokens = _tokens(lossless)
    s = demo_settings(seed, small)
    raw_hidden = tokens * len(s.layer_ids) * _hidden_size(lossless) * 2
    sizes = array_bytes_on_disk(lossless)
    hidden = sum(v for k, v in sizes.items() if k.startswith("hidden"))
    whole = cache_bytes_on_disk(lossless)
    return {"mode": LOSSLESS, "seed": seed, "path": "demo", "tokens": tokens,
            "hidden_bytes_per_token": hidden / tokens, "hidden_of_raw_bf16": hidden / raw_hidden,
            "cache_bytes_per_token": whole / tokens, "cache_of_raw_bf16": whole / raw_hidden,
            "array_bytes": sizes, "rel_l2_per_layer": [0.0] * len(s.layer_ids),
            "outliers": outlier_structure(lossless),
            "acceptance_offline": summary["acceptance_offline"],
            "acceptance_offline_replay": summary["acceptance_offline_replay"],
            "replay_on_lossless_cache": summary["acceptance_offline_replay"],
            "acceptance_online": summary["acceptance_online"], "lossless": summary["lossless"],
            "regenerated_match": summary["regenerated_match"], "speedup": summary["speedup"],
            "train_seconds": summary["training"]["seconds"], "demo_seconds": summary["demo_seconds"]}


# --------------------------------------------------------------------------- the driver


def run_jobs(jobs: list[dict], slots: list[int], out: Path) -> None:
    """Run ``jobs`` (each {"name", "cmd", "after"}) as processes, one per core of ``slots``, one
    thread each; a job starts once the job it names in ``after`` has succeeded."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    pending, running, done, failed = list(jobs), {}, set(), set()
    while pending or running:
        for core, (job, proc, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                del running[core]
                (done if proc.returncode == 0 else failed).add(job["name"])
                print(f"{time.strftime('%H:%M:%S')} {job['name']}: "
                      f"{'done' if proc.returncode == 0 else f'FAILED rc {proc.returncode}'} "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
        for job in list(pending):
            if job["after"] in failed:
                pending.remove(job)
                failed.add(job["name"])
                print(f"{job['name']}: skipped, {job['after']} failed", flush=True)
        free = [c for c in slots if c not in running]
        for job in [j for j in pending if j["after"] is None or j["after"] in done]:
            if not free:
                break
            core = free.pop(0)
            pending.remove(job)
            log = open(out / f"{job['name']}.log", "a")
            print(f"{time.strftime('%H:%M:%S')} {job['name']}: start on core {core} "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
            running[core] = (job, subprocess.Popen(["taskset", "-c", str(core), *job["cmd"]], stdout=log,
                                                   stderr=subprocess.STDOUT, env=env), log)
        time.sleep(2.0)


def _each(rows: list[dict], key: str, fmt: str) -> str:
    return " / ".join(fmt.format(r[key]) for r in rows)


def summarise(rows: list[dict]) -> list[str]:
    """Markdown table: one line per mode, the mean over seeds and each seed's value."""
    by_mode: dict[str, list[dict]] = {}
    for r in rows:
        by_mode.setdefault(r["mode"], []).append(r)
    base = {r["seed"]: r for r in by_mode.get(LOSSLESS, [])}
    lossless_runs: dict[int, list[float]] = {}  # the demo's drafter and the reseeded controls, per data seed
    for r in rows:
        if r["path"] in ("demo", "control"):
            lossless_runs.setdefault(r["seed"], []).append(r["acceptance_online"])
    lossless_mean = np.mean([np.mean(v) for v in lossless_runs.values()]) if lossless_runs else float("nan")
    lines = ["| mode | path | hidden bytes/token | of raw bf16 | whole cache of raw bf16 | rel. L2 per layer "
             "| online tau, mean (per seed) | vs lossless, mean (per seed) "
             f"| vs every lossless drafter ({lossless_mean:.3f}) | offline: replay on its cache "
             "| replay on the lossless cache | speedup (loaded machine) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, rs in by_mode.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        online = [r["acceptance_online"] for r in rs]
        rel = [r["acceptance_online"] / base[r["seed"]]["acceptance_online"] - 1 for r in rs if r["seed"] in base]
        l2 = np.mean([r["rel_l2_per_layer"] for r in rs], axis=0)
        lines.append(
            f"| {name} | {rs[0]['path']} | {np.mean([r['hidden_bytes_per_token'] for r in rs]):.0f} "
            f"| {np.mean([r['hidden_of_raw_bf16'] for r in rs]):.3f} "
            f"| {np.mean([r['cache_of_raw_bf16'] for r in rs]):.3f} | {' / '.join(f'{e:.4f}' for e in l2)} "
            f"| {np.mean(online):.3f} ({' / '.join(f'{t:.3f}' for t in online)}) "
            f"| {np.mean(rel):+.1%} ({' / '.join(f'{x:+.1%}' for x in rel)}) "
            f"| {np.mean(online) / lossless_mean - 1:+.1%} "
            f"| {_each(rs, 'acceptance_offline_replay', '{:.3f}')} | {_each(rs, 'replay_on_lossless_cache', '{:.3f}')} "
            f"| {_each(rs, 'speedup', '{:.2f}x')} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--mode", type=parse_mode, action="append", default=[],
                   help="fp8 | int8:GROUP | int4:GROUP | bf16:SEED_OFFSET (the control), each optionally "
                        "with ,topk=float16|bfloat16 (repeatable)")
    p.add_argument("--simulate", action="store_true", help="round trip into a lossless cache (no convert)")
    p.add_argument("--small", action="store_true", help="the test suite's reduced demo (checks the harness)")
    p.add_argument("--jobs", type=int, default=2, help="processes at once, each on its own core, one thread")
    p.add_argument("--check-against", type=Path, metavar="SIM_OUT",
                   help="another --out (a --simulate one): record whether each mode's cache decodes "
                        "bitwise equal to its")
    p.add_argument("--one", nargs=2, metavar=("MODE", "SEED"), help=argparse.SUPPRESS)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one:
        mode, seed = parse_mode(args.one[0]), int(args.one[1])
        row = run_mode(args.out / f"base_s{seed}", args.out / f"{mode['name']}_s{seed}", mode, seed, args.simulate,
                       args.small)
        print(json.dumps(row), flush=True)
        return

    cores = sorted(os.sched_getaffinity(0))[: args.jobs]
    flags = ["--small"] if args.small else []
    me = [sys.executable, str(Path(__file__).resolve()), "--out", str(args.out), *flags] + (
        ["--simulate"] if args.simulate else [])
    jobs = []
    for seed in args.seeds:
        base = args.out / f"base_s{seed}"
        if not (base / "summary.json").is_file():
            jobs.append({"name": f"base_s{seed}", "after": None,
                         "cmd": [sys.executable, "-m", "dflash.eval.demo", "--out", str(base), "--seed", str(seed),
                                 *flags]})
    for mode in args.mode:
        for seed in args.seeds:
            base_job = f"base_s{seed}"
            jobs.append({"name": f"{mode['name']}_s{seed}", "cmd": me + ["--one", mode["spec"], str(seed)],
                         "after": base_job if any(j["name"] == base_job for j in jobs) else None})
    load_before = os.getloadavg()
    run_jobs(jobs, cores, args.out)
    rows = [base_row(args.out / f"base_s{seed}", seed, args.small) for seed in args.seeds
            if (args.out / f"base_s{seed}" / "summary.json").is_file()]
    for mode in args.mode:
        for seed in args.seeds:
            result = args.out / f"{mode['name']}_s{seed}" / "result.json"
            if result.is_file():
                row = json.loads(result.read_text())
                other = args.check_against / f"{mode['name']}_s{seed}" / "cache.zarr" if args.check_against else None
                if other is not None and other.is_dir() and mode["mode"] != LOSSLESS:
                    row["decodes_equal_to"] = {"cache": str(other), "equal": same_decoded_hidden(
                        args.out / f"{mode['name']}_s{seed}" / "cache.zarr", other)}
                    print(f"{mode['name']} seed {seed}: hidden states decode bitwise equal to {other}: "
                          f"{row['decodes_equal_to']['equal']}", flush=True)
                rows.append(row)
    (args.out / "frontier.json").write_text(json.dumps(
        {"load_before": load_before, "load_after": os.getloadavg(), "simulate": args.simulate, "rows": rows},
        indent=2) + "\n")
    print("\n".join(summarise(rows)))


if __name__ == "__main__":
    main()
