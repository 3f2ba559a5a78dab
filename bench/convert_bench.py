"""``dflash-cache convert`` on the CPU: tokens per second (wall and CPU seconds of this
process and its threads), bytes on disk per token, and the relative L2 error that ``stats``
reports, for each codec, from one synthetic bf16 source cache.

The source is written through ``ShardWriter`` as extraction writes it: unit normal
activations with a few channels 100x the rest, top-k log-probs from random logits. Real
hidden states compress and quantise differently, so sizes and errors here are a check of
the path, not the issue's measurement on a real cache; the speeds are the conversion's own.

    python bench/convert_bench.py --tokens 8192 --layers 5 --hidden 4096 --topk 64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np
import torch

from dflash.shared import cache as C
from dflash.shared.convert import ConvertSettings, convert_cache
from dflash.shared.inspect import cache_info, conversion_error

MODES = {
    "bf16, zstd 3 (lossless)": dict(compression_level=3),
    "fp8": dict(hidden_codec="fp8"),
    "int8, groups of 128": dict(hidden_codec="int8", hidden_group_size=128),
    "int4, groups of 128, top-k bf16": dict(hidden_codec="int4", hidden_group_size=128, topk_dtype="bfloat16"),
}


def write_source(path: str, tokens: int, layers: int, hidden: int, topk: int, shards: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    spec = C.CacheSpec(layer_ids=list(range(layers)), hidden_size=hidden, topk=topk, vocab_size=151_936,
                       num_target_layers=layers + 2, max_length=4096, truncation="right",
                       fingerprint={"bench": "convert"})
    root = C.create_or_open_cache(path, spec)
    outliers = torch.randperm(hidden, generator=g)[:8]
    per_shard = tokens // shards
    with torch.no_grad():
        for shard in range(shards):
            lengths = []
            while sum(lengths) < per_shard:
                lengths.append(int(min(rng.integers(256, 2048), per_shard - sum(lengths))))
            plan = C.ShardPlan(source_index=np.arange(len(lengths)) + shard * 10_000, lengths=lengths,
                               batches=np.arange(len(lengths) + 1))
            writer = C.ShardWriter(root, shard, plan, spec)
            for b, n in enumerate(lengths):
                x = torch.randn(n, layers, hidden, generator=g)
                x[:, :, outliers] *= 100
                logits = torch.randn(n, 4 * topk, generator=g) * 3
                lp = torch.log_softmax(logits, -1).topk(topk, -1)
                writer.write_batch(b, input_ids=rng.integers(0, 151_936, n).astype(np.int32),
                                   loss_mask=rng.random(n) < 0.8, hidden=C.bf16_to_bits(x.bfloat16()),
                                   topk_ids=lp.indices.numpy().astype(np.int32),
                                   topk_logprobs=lp.values.numpy().astype(np.float32))
            writer.finish()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--dir", default=None, help="where the caches go (default: a temporary folder, removed)")
    args = p.parse_args()
    work = args.dir or tempfile.mkdtemp(prefix="convert_bench_")
    src = os.path.join(work, "src.zarr")
    try:
        t = time.perf_counter()
        write_source(src, args.tokens, args.layers, args.hidden, args.topk, args.shards)
        print(f"source: {args.tokens} tokens x {args.layers} layers x {args.hidden}, written in "
              f"{time.perf_counter() - t:.1f} s; load average {os.getloadavg()[0]:.1f}", flush=True)
        raw_hidden = args.layers * args.hidden * 2
        base = cache_info(src)
        rows = [{"mode": "source (bf16, zstd 1)", "disk_bytes_per_token": round(base["bytes_on_disk"] / args.tokens),
                 "hidden_disk_of_raw_bf16": round(base["bytes_per_token"]["hidden_on_disk"] / raw_hidden, 3)}]
        print(json.dumps(rows[0]), flush=True)
        for name, settings in MODES.items():
            dst = os.path.join(work, name.split(",")[0] + ".zarr")
            cpu0, t0 = time.process_time(), time.perf_counter()
            summary = convert_cache(src, dst, ConvertSettings(**settings), progress=False)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            info = cache_info(dst)
            reader = C.CacheReader(dst)
            err = conversion_error(reader, np.arange(len(reader)))
            rows.append({
                "mode": name, "tokens": summary["tokens_converted"], "wall_s": round(wall, 2),
                "cpu_s": round(cpu, 2), "tokens_per_s": round(summary["tokens_converted"] / wall),
                "raw_hidden_mb_per_s": round(summary["tokens_converted"] * raw_hidden / wall / 1e6, 1),
                "disk_bytes_per_token": round(info["bytes_on_disk"] / args.tokens),
                "hidden_disk_of_raw_bf16": round(info["bytes_per_token"]["hidden_on_disk"] / raw_hidden, 3),
                "rel_l2_per_layer": [round(x["rel_l2"], 4) for x in err["layers"]],
                "topk_rel_l2": err["topk_logprobs"]["rel_l2"],
                "load_average": round(os.getloadavg()[0], 1),
            })
            print(json.dumps(rows[-1]), flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
