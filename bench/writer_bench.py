"""The shard writer alone (no GPU): how fast the cache takes Qwen3-8B-shaped batches.

Feeds ``ShardWriter.write_batch`` the batches stage one produces (8192 tokens x 5 layers
x 4096 bf16 Gaussian hidden states, top-64) and reports tokens/s, hidden MB/s and CPU
cores busy, under zarr/numcodecs settings, and with a thread that keeps the GIL busy
the way the forward loop of an HF model does.

    python bench/writer_bench.py --batches 12
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import threading
import time

import numpy as np
import torch


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def setup(args, name: str):
    """The cache spec of an 8B target's batches, a fresh store path, and one batch's arrays:
    hidden states (Gaussian bf16 bits, 5 layers x 4096), ids, top-64 ids and log-probs."""
    from dflash.shared import cache as C

    L, D, T = 5, 4096, args.tokens
    spec = C.CacheSpec(layer_ids=[1, 9, 17, 25, 33], hidden_size=D, topk=64, vocab_size=151936,
                       num_target_layers=36, max_length=T, truncation="right", chunk_tokens=256,
                       fingerprint={"tokenizer": {"hash": None}})
    path = f"{args.work}/{name}.zarr"
    shutil.rmtree(path, ignore_errors=True)
    g = torch.Generator().manual_seed(0)
    h = C.bf16_to_bits(torch.randn(T, L, D, generator=g).bfloat16())
    ids = np.random.default_rng(0).integers(0, 151936, T).astype(np.int32)
    tk = np.random.default_rng(1).integers(0, 151936, (T, 64)).astype(np.int32)
    lp = np.random.default_rng(2).standard_normal((T, 64)).astype(np.float32)
    return spec, path, (h, ids, tk, lp)


def run(name: str, args, settings: dict, blosc_threads: int, gil_busy: bool, switch_ms: float = 5.0,
        barrier=None) -> dict:
    import numcodecs.blosc
    import zarr

    from dflash.shared import cache as C

    L, D, T, nb = 5, 4096, args.tokens, args.batches
    spec, path, (h, ids, tk, lp) = setup(args, name)
    stop = threading.Event()

    def busy():  # pure-Python work holding the GIL between short releases
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i

    with zarr.config.set(settings):
        numcodecs.blosc.use_threads = blosc_threads > 0
        if blosc_threads:
            numcodecs.blosc.set_nthreads(blosc_threads)
        root = C.create_or_open_cache(path, spec)
        plan = C.ShardPlan(source_index=np.arange(nb), lengths=np.full(nb, T), batches=np.arange(nb + 1))
        w = C.ShardWriter(root, 0, plan, spec)
        sys.setswitchinterval(switch_ms / 1000)
        bg = threading.Thread(target=busy, daemon=True)
        if gil_busy:
            bg.start()
        if barrier is not None:
            barrier.wait()
        c0, t0, wall0 = cpu(), time.perf_counter(), time.time()
        for b in range(nb):
            w.write_batch(b, input_ids=ids, loss_mask=np.ones(T, bool), hidden=h, topk_ids=tk, topk_logprobs=lp)
        w.finish()
        dt, c1 = time.perf_counter() - t0, cpu()
        stop.set()
        numcodecs.blosc.use_threads = False
        sys.setswitchinterval(0.005)
    if gil_busy:
        bg.join()
    busy_cores = 1.0 if gil_busy else 0.0
    return {"variant": name, "tok_s": round(nb * T / dt), "hidden_MB_s": round(nb * T * L * D * 2 / dt / 1e6),
            "cpu_cores_busy": round((c1 - c0) / dt - busy_cores, 2), "wall": (wall0, wall0 + dt)}


def _proc(i: int, args, settings: dict, out, barrier) -> None:
    out.put(run(f"proc{i}", args, settings, 0, False, 0.5, barrier))


def parallel(n: int, args, settings: dict) -> dict:
    """``n`` processes, each one writer on its own shard: does the rate scale past one event loop?"""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out, barrier = ctx.Queue(), ctx.Barrier(n)
    procs = [ctx.Process(target=_proc, args=(i, args, settings, out, barrier)) for i in range(n)]
    for p in procs:
        p.start()
    rows = [out.get() for _ in procs]
    for p in procs:
        p.join()
    dt = max(r["wall"][1] for r in rows) - min(r["wall"][0] for r in rows)  # all start at the barrier
    return {"variant": f"{n} processes x concurrency32+write_empty",
            "hidden_MB_s_sum": sum(r["hidden_MB_s"] for r in rows),
            "hidden_MB_s_wall": round(n * args.batches * args.tokens * 5 * 4096 * 2 / dt / 1e6),
            "cpu_cores_busy_sum": round(sum(r["cpu_cores_busy"] for r in rows), 2)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--work", default="/tmp/writer_bench")
    p.add_argument("--procs", default="", help="e.g. 2,4: also run that many processes at once, each writing its own shard")
    p.add_argument("--only-procs", action="store_true", help="skip the single-process variants")
    args = p.parse_args()
    tuned = {"async.concurrency": 32, "array.write_empty_chunks": True}
    for n in [int(x) for x in args.procs.split(",") if x]:
        print(json.dumps(parallel(n, args, tuned)), flush=True)
    if args.only_procs:
        return
    variants = [
        ("default", {}, 0, False),
        ("default+gil_busy", {}, 0, True),
        ("concurrency32+write_empty", {"async.concurrency": 32, "array.write_empty_chunks": True}, 0, False),
        ("blosc_threads8", {}, 8, False),
        ("default+gil_busy+switch_0.5ms", {}, 0, True, 0.5),
        ("concurrency32+write_empty+gil_busy+switch_0.5ms",
         {"async.concurrency": 32, "array.write_empty_chunks": True}, 0, True, 0.5),
        ("zarrs+gil_busy+switch_0.5ms (the worker's settings)",  # extract/worker.py _zarr_settings
         {"codec_pipeline.path": "zarrs.ZarrsCodecPipeline", "async.concurrency": 32, "array.write_empty_chunks": True},
         0, True, 0.5),
    ]
    for name, settings, bt, gb, *sw in variants:
        row = run(name, args, settings, bt, gb, *sw)
        del row["wall"]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
