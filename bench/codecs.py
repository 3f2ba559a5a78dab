"""Lossless codec choices for cached hidden states, on a Qwen3-8B-shaped target.

Runs the target (random weights, bf16) over random token ids, captures the hidden
states of the default five layers, and measures compression ratio and one-core encode
and decode speed of candidate Zarr/blosc pipelines on those bytes.

    python bench/codecs.py --layers 36 --hidden 4096 --tokens 8192
"""

import argparse
import json
import time

import numpy as np
import torch
from numcodecs import Blosc, Zstd


def capture(args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=8, head_dim=128,
                      vocab_size=151936, max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    L = args.layers
    ids = [int(round(x)) for x in np.linspace(1, L - 3, 5)]
    x = torch.randint(0, cfg.vocab_size, (args.tokens // 2048, 2048), device="cuda")
    with torch.no_grad():
        out = model.model(input_ids=x, output_hidden_states=True)
    hs = torch.stack([out.hidden_states[i + 1] for i in ids], dim=2)  # (B, T, 5, D)
    return ids, hs.reshape(-1, len(ids), args.hidden).contiguous().view(torch.int16).cpu().numpy().view(np.uint16)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=12288)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=256)
    args = p.parse_args()
    ids, bits = capture(args)
    Blosc.use_threads = False
    raw = bits[: (len(bits) // args.chunk) * args.chunk]
    chunks = [raw[i:i + args.chunk].tobytes() for i in range(0, len(raw), args.chunk)]
    total = sum(len(c) for c in chunks)
    cands = {
        "zstd1 (no shuffle)": Zstd(level=1),
        "blosc zstd1 byteshuffle auto-block": Blosc("zstd", 1, Blosc.SHUFFLE, blocksize=0),
        "blosc zstd1 byteshuffle 256K-block": Blosc("zstd", 1, Blosc.SHUFFLE, blocksize=1 << 18),
        "blosc zstd1 byteshuffle 512K-block (cache default)": Blosc("zstd", 1, Blosc.SHUFFLE, blocksize=1 << 19),
        "blosc zstd1 byteshuffle 1M-block": Blosc("zstd", 1, Blosc.SHUFFLE, blocksize=1 << 20),
        "blosc zstd3 byteshuffle": Blosc("zstd", 2, Blosc.SHUFFLE, blocksize=1 << 19),
        "blosc zstd5 byteshuffle": Blosc("zstd", 3, Blosc.SHUFFLE, blocksize=1 << 19),
        "blosc zstd1 bitshuffle": Blosc("zstd", 1, Blosc.BITSHUFFLE, blocksize=1 << 19),
        "blosc lz4 byteshuffle": Blosc("lz4", 5, Blosc.SHUFFLE, blocksize=1 << 19),
    }
    rows = []
    for name, codec in cands.items():
        t = time.perf_counter(); enc = [codec.encode(np.frombuffer(c, np.uint16)) for c in chunks]; te = time.perf_counter() - t
        t = time.perf_counter(); [codec.decode(e) for e in enc]; td = time.perf_counter() - t
        size = sum(len(e) for e in enc)
        rows.append({"codec": name, "ratio": round(total / size, 4), "bytes_per_raw": round(size / total, 4),
                     "encode_MBps_1core": round(total / te / 1e6), "decode_MBps_1core": round(total / td / 1e6)})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"layers": ids, "tokens": len(raw), "raw_bytes": total}))


if __name__ == "__main__":
    main()
