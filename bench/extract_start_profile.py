"""Where the seconds of ``dflash-extract``'s start go, step by step, with a profile of each.

In this process: the imports of the parent (``dflash.extract.runner``), then the tokenizer,
the target's config, the dataset and its fingerprint, each timed and profiled (cProfile,
the top entries by cumulative time), then the planning of the rows. Then, on CUDA, the
compiled log-sum-exp of the LM head in two fresh processes sharing one empty compile
cache folder: a cold compile, then one that finds the first one's graphs.

    python bench/extract_start_profile.py --model /tmp/xbench/target --data /tmp/xbench/rows.jsonl
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import subprocess
import sys
import tempfile
import time

T0 = time.perf_counter()


def profiled(name: str, fn, top: int, results: dict):
    """fn() under cProfile; its wall seconds into ``results``, its top entries printed."""
    profile = cProfile.Profile()
    t = time.perf_counter()
    profile.enable()
    value = fn()
    profile.disable()
    results[name] = round(time.perf_counter() - t, 3)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(top)
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    print(f"--- {name}: {results[name]:.3f} s\n" + "\n".join(lines[:top + 8]), flush=True)
    return value


HEAD = """
import json, sys, time
t = time.perf_counter()
import torch
from dflash.shared.compile_cache import cache_counts, use_compile_cache
from dflash.extract.target import logsumexp_fp32
use_compile_cache(sys.argv[1])
t_import = time.perf_counter() - t
z = torch.zeros((1024, 151936), dtype=torch.bfloat16, device="cuda")
torch._dynamo.mark_dynamic(z, 0)
t = time.perf_counter()
with torch.inference_mode():
    torch.compile(logsumexp_fp32, backend="inductor")(z)
torch.cuda.synchronize()
print(json.dumps({"imports_s": round(t_import, 3), "compile_s": round(time.perf_counter() - t, 3), **cache_counts()}))
"""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--head", action="store_true", help="also time the compiled head, cold then warm (CUDA)")
    args = p.parse_args()
    results: dict[str, float] = {}
    profiled("import dflash.extract.runner", lambda: __import__("dflash.extract.runner"), args.top, results)
    from dflash.extract.config import ExtractConfig

    cfg = ExtractConfig(data=args.data, model=args.model, out=tempfile.mkdtemp() + "/c.zarr", max_length=2048,
                        device="cpu")

    def tokenizer():
        from dflash.extract.tokenizer import load_tokenizer

        return load_tokenizer(cfg)

    def config():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(cfg.model)

    tok = profiled("tokenizer (load_tokenizer)", tokenizer, args.top, results)
    profiled("target config (AutoConfig)", config, args.top, results)
    profiled("tokenizer again (same process)", tokenizer, 10, results)
    from dflash.extract.data import dataset_fingerprint, load_source

    ds = profiled("dataset load", lambda: load_source(cfg.data), 10, results)
    profiled("dataset fingerprint", lambda: dataset_fingerprint(ds, cfg.data, "train"), 10, results)
    from dflash.extract.plan import plan_shard

    profiled("planning", lambda: plan_shard(ds, 0, cfg.data, tok, cfg), 15, results)
    if args.head:
        folder = tempfile.mkdtemp(prefix="compile-")
        for run in ("cold", "warm"):
            out = subprocess.run([sys.executable, "-c", HEAD, folder], capture_output=True, text=True)
            line = out.stdout.strip().splitlines()[-1] if out.returncode == 0 else out.stderr[-2000:]
            print(f"--- compiled head, {run}: {line}", flush=True)
    results["process_total"] = round(time.perf_counter() - T0, 3)
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
