"""End-to-end training-loop throughput at target-sized dims, on random data.

Builds a fake target folder (a Qwen3 config + only the embedding and LM head tensors,
all that training reads) and a random cache, then runs ``dflash.train.loop.train`` and
prints the per-step time, block tokens/s, MFU and peak memory of its log lines.

    python bench/train_loop.py --out /tmp/bench --hidden 4096 --ctx 3072 --anchors 512
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np
import torch


def fake_target(path: Path, hidden: int, layers: int, vocab: int, intermediate: int, heads: int, kv_heads: int):
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    path.mkdir(parents=True, exist_ok=True)
    Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128).save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    save_file({"model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=g) * 0.02).bfloat16(),
               "lm_head.weight": (torch.randn(vocab, hidden, generator=g) * 0.02).bfloat16()},
              str(path / "model.safetensors"))


def fake_cache(path: Path, layer_ids, hidden: int, layers: int, vocab: int, n: int, length: int):
    from dflash.shared import cache as C

    spec = C.CacheSpec(layer_ids=list(layer_ids), hidden_size=hidden, topk=1, vocab_size=vocab,
                       num_target_layers=layers, max_length=length, truncation="right", chunk_tokens=1024,
                       fingerprint={"tokenizer": {"hash": None}})
    root = C.create_or_open_cache(str(path), spec)
    plan = C.ShardPlan(source_index=np.arange(n), lengths=np.full(n, length), batches=np.arange(n + 1))
    w = C.ShardWriter(root, 0, plan, spec)
    rng = np.random.default_rng(0)
    h = C.bf16_to_bits(torch.randn(length, len(layer_ids), hidden).bfloat16())
    for b in range(n):
        ids = rng.integers(0, vocab, length).astype(np.int32)
        w.write_batch(b, input_ids=ids, loss_mask=np.arange(length) > 16, hidden=h,
                      topk_ids=ids[:, None], topk_logprobs=np.zeros((length, 1), np.float32))
    w.finish()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/dflash_bench")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=12288)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--ctx", type=int, default=3072)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--attention", default="auto")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    layer_ids = [1, 9, 17, 25, 33]
    t0 = time.time()
    fake_target(out / "target", args.hidden, 36, args.vocab, args.intermediate, args.heads, args.kv_heads)
    fake_cache(out / "cache.zarr", layer_ids, args.hidden, 36, args.vocab, args.samples + 1, args.ctx)
    print(f"setup {time.time() - t0:.1f}s", flush=True)

    from dflash.train.config import dflash_recipe
    from dflash.train.loop import train

    cfg = dflash_recipe().override(
        cache=str(out / "cache.zarr"), target=str(out / "target"), out=str(out / "run"),
        context_buckets=[args.ctx], max_anchors=args.anchors, batch_size=1, micro_batch_size=1,
        eval_samples=1, max_steps=args.steps, log_every=5, eval_every=10**9, save_every=10**9,
        mask_token_id=args.vocab - 1, attention=args.attention, progress=False, tensorboard=False,
        num_workers=2, resume=None)
    cfg.runtime.save_every = args.steps  # the last step saves anyway
    summary = train(cfg)
    for r in summary["history"]:
        if r["kind"] == "train":
            print(json.dumps({k: r[k] for k in ("step", "loss", "step_s", "tok_s", "mfu", "peak_mem_gb", "compiles")}))
    print("warm-up graphs", summary["warmup_compiled_graphs"])


if __name__ == "__main__":
    main()
