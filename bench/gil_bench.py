"""How much does the cache writer slow the forward loop's thread? (no GPU)

The worker's forward loop is Python issuing many small torch calls, each of which drops
and retakes the GIL. Whatever else holds the GIL in that process (the writer thread, zarr's
event loop and codec threads) delays every retake by up to the switch interval. This
bench writes paced batches with ``ShardWriter`` while the main thread issues tiny torch
ops, and reports the main thread's op rate against the same loop with no writer:

  thread   the writer thread writes every array with zarr (``--writer-processes 0``)
  hidden   the hidden states go to writer processes, the small arrays stay in the thread
  all      every array goes to writer processes (what the worker does now)
  numpy_copy, torch_copy   no writer: a thread copying hidden batches (does the copy into
           shared memory release the GIL?)

    python bench/gil_bench.py --batches 16 --interval-s 0.25
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import threading
import time

import numpy as np
import torch

from dflash.extract.cpu_time import process_cpu_seconds


def op_loop(stop: threading.Event) -> tuple[int, float]:
    """Tiny torch ops until ``stop``: (ops, seconds)."""
    x = torch.zeros(16)
    n, t0 = 0, time.perf_counter()
    while not stop.is_set():
        for _ in range(100):
            x = x + 1
        n += 100
    return n, time.perf_counter() - t0


def run(mode: str, args) -> dict:
    from dflash.extract.chunk_pool import ChunkPool
    from dflash.shared import cache as C

    L, D, T, k, C_tok = args.layers, args.hidden, args.tokens, 64, 256
    spec = C.CacheSpec(layer_ids=list(range(L)), hidden_size=D, topk=k, vocab_size=151936, num_target_layers=L + 3,
                       max_length=T, truncation="right", chunk_tokens=C_tok, fingerprint={"bench": mode})
    lengths = np.full(args.batches * 4, T // 4)
    plan = C.ShardPlan(source_index=np.arange(len(lengths)), lengths=lengths,
                       batches=np.arange(0, len(lengths) + 1, 4), skipped={})
    g = torch.Generator().manual_seed(0)
    data = {"input_ids": np.random.default_rng(0).integers(0, 151936, T).astype(np.int32),
            "loss_mask": np.ones(T, dtype=bool),
            "hidden": C.bf16_to_bits(torch.randn(T, L, D, generator=g).bfloat16()),
            "topk_ids": np.random.default_rng(1).integers(0, 151936, (T, k)).astype(np.int32),
            "topk_logprobs": -np.random.default_rng(2).random((T, k)).astype(np.float32)}
    stop = threading.Event()
    pool = None
    writer = None
    if mode in ("thread", "hidden", "all"):
        path = f"{args.work}/{mode}.zarr"
        shutil.rmtree(path, ignore_errors=True)
        root = C.create_or_open_cache(path, spec)
        writer = C.ShardWriter(root, 0, plan, spec)
        if mode in ("hidden", "all"):
            names = ("hidden",) if mode == "hidden" else C.TOKEN_FIELDS
            arrays = {f: (writer.arrays[f].shape[1:], writer.arrays[f].dtype) for f in names}
            pool = ChunkPool(path, C.shard_name(0), arrays, processes=args.processes, chunk=C_tok,
                             max_rows=T + C_tok, settings=SETTINGS)
            writer.attach_sinks({f: pool.sink(f) for f in names})
            time.sleep(2.0)  # let the children import zarr before the clock starts
    lag = [0.0]
    dst = np.empty_like(data["hidden"])

    def copies():  # no writer: the thread only copies hidden batches
        t_end = time.perf_counter() + args.batches * args.interval_s
        while time.perf_counter() < t_end:
            if mode == "numpy_copy":
                dst[:] = data["hidden"]
            else:
                torch.from_numpy(dst).copy_(torch.from_numpy(data["hidden"]))
            time.sleep(0.002)
        stop.set()

    def write():
        t0 = time.perf_counter()
        for b in range(args.batches):
            due = t0 + b * args.interval_s
            time.sleep(max(0.0, due - time.perf_counter()))
            lag.append(time.perf_counter() - due)
            if writer is not None:
                writer.write_batch(b, **data)
                if b % 4 == 3:
                    writer.commit()
        if writer is not None:
            writer.finish()
        stop.set()

    cpu0 = process_cpu_seconds()
    thread = threading.Thread(target=copies if mode.endswith("_copy") else write)
    thread.start()
    ops, seconds = op_loop(stop)
    thread.join()
    if pool is not None:
        pool.close()
    return {"mode": mode, "ops_per_s": round(ops / seconds), "seconds": round(seconds, 2),
            "writer_behind_s_max": round(max(lag), 3), "cpu_cores_busy": round((process_cpu_seconds() - cpu0) / seconds, 2)}


SETTINGS = {"async.concurrency": 32, "array.write_empty_chunks": True}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per batch")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--interval-s", type=float, default=0.25, help="one batch every this many seconds")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--switch-ms", type=float, default=0.5, help="GIL switch interval (the worker's)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--modes", default="none,thread,hidden,all")
    p.add_argument("--work", default="/tmp/gil_bench")
    args = p.parse_args()
    import zarr

    zarr.config.set(SETTINGS)
    sys.setswitchinterval(args.switch_ms / 1000)
    torch.set_num_threads(1)
    modes = args.modes.split(",")
    rows = {m: [] for m in modes}
    for _ in range(args.repeat):  # interleaved, so drift hits every mode alike
        for m in modes:
            rows[m].append(run(m, args))
            print(json.dumps(rows[m][-1]), flush=True)
    base = statistics.median(r["ops_per_s"] for r in rows["none"]) if "none" in rows else None
    for m in modes:
        med = statistics.median(r["ops_per_s"] for r in rows[m])
        print(json.dumps({"mode": m, "median_ops_per_s": med,
                          "vs_no_writer": round(med / base, 3) if base else None,
                          "median_cpu_cores": statistics.median(r["cpu_cores_busy"] for r in rows[m]),
                          "writer_behind_s_max": max(r["writer_behind_s_max"] for r in rows[m])}), flush=True)


if __name__ == "__main__":
    main()
