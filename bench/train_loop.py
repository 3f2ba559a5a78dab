"""The training DataLoader at 8B dims against the step it feeds, per hidden codec.

Builds a fake target (a Qwen3 config, the embedding and LM head: all training reads) and a
random cache (every 512th channel x100, as real activations have outliers), then times the
DataLoader alone per number of ``--loader-workers`` against ``--loader-only``, the measured step
time, with the CPU cores it kept busy. ``--hidden-codecs``: a cache per codec, a lossy one decoded
in the workers and on the GPU (the copy and decode timed apart; CPU = GPU decode checked).

    python bench/train_loop.py --out /tmp/tl --samples 20 --loader-workers 1,2,4,8 --loader-only 0.161
    python bench/train_loop.py --out /tmp/tl --samples 10 --loader-batches 32 --loader-workers 4 \
        --loader-only 0.161 --hidden-codecs bf16,fp8,int8,int4
"""

import argparse
import json
import logging
import resource
import shutil
import time
from pathlib import Path

import numpy as np
import torch


def add_target_args(p: argparse.ArgumentParser) -> None:
    """The fake target's shape flags (Qwen3-8B's by default) and --ctx, shared with train_start.py."""
    for flag, default in (("--hidden", 4096), ("--intermediate", 12288), ("--heads", 32), ("--kv-heads", 8),
                          ("--vocab", 151936), ("--ctx", 3072)):
        p.add_argument(flag, type=int, default=default)


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


def fake_cache(path: Path, layer_ids, hidden: int, layers: int, vocab: int, n: int, length: int, min_length: int,
               tokenizer_hash: str | None = None, hidden_codec: str = "bf16"):
    from dflash.shared import cache as C

    spec = C.CacheSpec(layer_ids=list(layer_ids), hidden_size=hidden, topk=1, vocab_size=vocab,
                       num_target_layers=layers, max_length=length, truncation="right", chunk_tokens=256,
                       fingerprint={"tokenizer": {"hash": tokenizer_hash}}, hidden_codec=hidden_codec,
                       hidden_group_size=128)
    root = C.create_or_open_cache(str(path), spec)
    rng = np.random.default_rng(0)
    lengths = rng.integers(min_length, length + 1, n) if min_length < length else np.full(n, length)
    plan = C.ShardPlan(source_index=np.arange(n), lengths=lengths, batches=np.arange(n + 1))
    w = C.ShardWriter(root, 0, plan, spec)
    h = torch.randn(length, len(layer_ids), hidden).bfloat16()
    h[:, :, :: hidden // 8] *= 100  # outlier channels, as real activations have
    stored = {k: C.to_numpy(v) for k, v in C.encode_hidden(spec, h).items()}
    for b, T in enumerate(lengths.tolist()):
        ids = rng.integers(0, vocab, T).astype(np.int32)
        w.write_batch(b, input_ids=ids, loss_mask=np.arange(T) > 16, **{k: v[:T] for k, v in stored.items()},
                      topk_ids=ids[:, None], topk_logprobs=np.zeros((T, 1), np.float32))
    w.finish()
    return lengths


def cpu_seconds(who) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def loader_rate(cfg, workers: int, n_batches: int, decode_on_device: bool = False, resident: bool = False) -> dict:
    """Micro-batches/s of the training DataLoader alone, the CPU cores it kept busy, and ``to_device_ms``: a
    micro-batch's copy to the GPU (with ``decode_on_device``, a lossy cache's payload + scales, and its decode).
    ``resident``: the samples preloaded (span by span) onto the GPU (or into memory), batches cut in the main
    process."""
    from dflash.shared.cache import CacheReader
    from dflash.train.data import AnchorDataset, GlobalBatchSampler, Split, make_loader, preload
    from dflash.train.step import to_device

    reader = CacheReader(cfg.cache)
    d = cfg.data
    split = Split.of(len(reader), d.eval_samples)
    dataset = AnchorDataset(reader, [1, 9, 17, 25, 33], cfg.max_length, d.max_anchors, cfg.runtime.seed,
                            decode_on_device=decode_on_device)
    sampler = GlobalBatchSampler(split.train, d.batch_size, d.micro_batch_size, 0, 1, cfg.runtime.seed,
                                 n_batches + 4)
    preload_s = time.perf_counter()
    if resident:
        preload([dataset], np.arange(len(reader)), torch.device("cuda" if torch.cuda.is_available() else "cpu"),
                progress=False)
    preload_s = round(time.perf_counter() - preload_s, 2)
    loader = make_loader(dataset, sampler, d.context_buckets, 0 if resident else workers,
                         pin_memory=torch.cuda.is_available() and not resident)
    it = iter(loader)
    for _ in range(2):  # workers up, first batches in flight
        next(it)
    c0 = cpu_seconds(resource.RUSAGE_SELF) + cpu_seconds(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    for _ in range(n_batches):
        next(it)
    dt = time.perf_counter() - t
    device_ms = None
    if torch.cuda.is_available():  # the batch's copy to the GPU (and its decode there), per micro-batch
        batch = next(it)
        to_device(batch, torch.device("cuda"))
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            to_device(batch, torch.device("cuda"))
        torch.cuda.synchronize()
        device_ms = round((time.perf_counter() - t) / 5 * 1000, 2)
    del it, loader  # workers exit; their CPU time lands in RUSAGE_CHILDREN
    time.sleep(1.0)
    c1 = cpu_seconds(resource.RUSAGE_SELF) + cpu_seconds(resource.RUSAGE_CHILDREN)
    return {"workers": workers, "codec": reader.spec.hidden_codec, "decode": "device" if dataset.decode_on_device
            else "loader", "preload_s": preload_s if resident else None, "micro_batches_s": round(n_batches / dt, 2),
            "cpu_cores_busy_upper_bound": round((c1 - c0) / dt, 2), "to_device_ms": device_ms}


def decode_cpu_equals_cuda(cache: str) -> bool | None:
    from dflash.shared.cache import HIDDEN_SCALE, CacheReader, decode_hidden

    reader = CacheReader(cache)
    if not torch.cuda.is_available() or not reader.spec.codec.lossy:
        return None
    s = reader.read(0, ["hidden"], decode=False)
    cpu = decode_hidden(reader.spec, s)
    gpu = decode_hidden(reader.spec, {"hidden": s["hidden"].cuda(), HIDDEN_SCALE: s[HIDDEN_SCALE].cuda()}).cpu()
    return bool(torch.equal(cpu.view(torch.int16), gpu.view(torch.int16)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/dflash_bench")
    add_target_args(p)
    p.add_argument("--min-ctx", type=int, default=None, help="variable lengths in [min-ctx, ctx]")
    p.add_argument("--loader-workers", default="4", help="e.g. 1,2,4: a timing per number of workers")
    p.add_argument("--loader-only", type=float, required=True, metavar="STEP_S",
                   help="the measured step time (s) the loader is compared with")
    p.add_argument("--hidden-codecs", default="bf16", help="e.g. bf16,fp8,int8,int4, a cache each")
    p.add_argument("--loader-batches", type=int, default=None, help="micro-batches timed (default: samples - 2, at most 48)")
    p.add_argument("--preload", action="store_true", help="also each codec's samples preloaded (--preload on)")
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (32: --preset small)")
    p.add_argument("--samples", type=int, default=8)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    layer_ids = [1, 9, 17, 25, 33]
    t0 = time.time()
    fake_target(out / "target", args.hidden, 36, args.vocab, args.intermediate, args.heads, args.kv_heads)
    lengths = fake_cache(out / "cache.zarr", layer_ids, args.hidden, 36, args.vocab, args.samples + 1, args.ctx,
                         args.min_ctx or args.ctx)
    print(f"setup {time.time() - t0:.1f}s; lengths {int(lengths.min())}..{int(lengths.max())}", flush=True)

    from dflash.train.config import dflash_recipe

    cfg = dflash_recipe().override(
        cache=str(out / "cache.zarr"), target=str(out / "target"), out=str(out / "run"),
        context_buckets=[args.ctx], max_anchors=args.anchors, batch_size=args.micro_batch,
        micro_batch_size=args.micro_batch, eval_samples=1, mask_token_id=args.vocab - 1, progress=False,
        tensorboard=False, resume=None)
    n_batches = args.loader_batches or min(args.samples - 2, 48)
    for codec in args.hidden_codecs.split(","):
        if codec != "bf16":  # a cache of this codec in place of the bf16 one
            t = time.time()
            shutil.rmtree(out / "cache.zarr")
            fake_cache(out / "cache.zarr", layer_ids, args.hidden, 36, args.vocab, args.samples + 1, args.ctx,
                       args.min_ctx or args.ctx, hidden_codec=codec)
            print(f"{codec} cache written in {time.time() - t:.1f}s; decoded on the GPU bitwise as on the CPU: "
                  f"{decode_cpu_equals_cuda(str(out / 'cache.zarr'))}", flush=True)
        for on_device in ((False, True) if codec != "bf16" else (False,)):
            for w in (int(x) for x in args.loader_workers.split(",")):
                for resident in (False, True) if args.preload else (False,):
                    r = loader_rate(cfg, w, n_batches, decode_on_device=on_device, resident=resident)
                    r["vs_training_step"] = round(r["micro_batches_s"] * args.loader_only, 2)
                    print(json.dumps({"loader": r, "step_s": args.loader_only}), flush=True)


if __name__ == "__main__":
    main()
