"""Lossy hidden-state codecs (``shared/hidden_codecs.py``) on the CPU: encode and decode
speed on one thread, bytes per token before and after the cache's lossless stage
(byte shuffle + zstd through blosc, as the cache stores chunks), and the relative error.

The data are synthetic: unit normal activations with a few outlier channels 100x the
rest; real hidden states compress and quantise differently, so the sizes here are a
check of the arithmetic, not the issue's measurement on a real cache.

    python bench/hidden_codecs_bench.py --tokens 2048 --layers 5 --hidden 4096
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from numcodecs import Blosc

from dflash.shared.hidden_codecs import HiddenCodec, decode, encode


def timed(fn, repeat: int):
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def lossless_bytes(array: np.ndarray) -> int:
    codec = Blosc(cname="zstd", clevel=1, shuffle=Blosc.SHUFFLE, typesize=array.dtype.itemsize, blocksize=1 << 19)
    return len(codec.encode(np.ascontiguousarray(array)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--outliers", type=int, default=8, help="channels scaled 100x")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.layers, args.hidden, generator=g)
    x[:, :, torch.randperm(args.hidden, generator=g)[:args.outliers]] *= 100
    x = x.to(torch.bfloat16)
    x64 = x.double()
    raw = x.numel() * 2
    rows = [{"mode": "bf16 (lossless only)", "bytes_per_token": raw / args.tokens,
             "after_zstd_per_token": lossless_bytes(x.view(torch.int16).numpy()) / args.tokens}]
    for codec in (HiddenCodec("fp8"), HiddenCodec("int8", 128), HiddenCodec("int8", 32), HiddenCodec("int4", 128),
                  HiddenCodec("int4", 32)):
        enc, t_enc = timed(lambda: encode(codec, x), args.repeat)
        out, t_dec = timed(lambda: decode(codec, enc), args.repeat)
        packed = lossless_bytes(enc.payload.numpy()) + lossless_bytes(enc.scales.numpy())
        rows.append({
            "mode": f"{codec.mode} group {codec.group_size}" if codec.mode != "fp8" else "fp8 per token-layer",
            "bytes_per_token": enc.nbytes() / args.tokens, "after_zstd_per_token": packed / args.tokens,
            "of_raw_bf16": round(packed / raw, 3),
            "rel_l2_error": round(((out.double() - x64).norm() / x64.norm()).item(), 4),
            "encode_tok_s_1core": round(args.tokens / t_enc), "decode_tok_s_1core": round(args.tokens / t_dec),
            "decode_gb_s_bf16_out": round(raw / t_dec / 1e9, 2),
        })
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
