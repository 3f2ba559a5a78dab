"""End-to-end training loop on random data: throughput, compiles, loader, guards.

Builds a fake target folder (a Qwen3 config + only the embedding and LM head tensors,
all that training reads) and a random cache (fixed length ``--ctx``, or lengths drawn
from ``[--min-ctx, --ctx]``), then runs ``dflash.train.loop.train`` and prints the
per-step time, block tokens/s, MFU, peak memory and compile count of its log lines.

``--loader-workers 1,2,4`` then times the training DataLoader alone (same dataset,
sampler and collate, pinned memory) and states its rate against what the measured
training step consumed, with the CPU cores it kept busy. ``--guards`` exercises, on
CUDA, the main-thread guard of the compiled drafter and of compiled flex, and the
refusal of uncompiled flex when dynamo is disabled.

    python bench/train_loop.py --out /tmp/bench --hidden 4096 --ctx 3072 --anchors 512
    python bench/train_loop.py --hidden 1024 --intermediate 3072 --heads 8 --kv-heads 4 --vocab 32000 \
        --min-ctx 200 --ctx 3072 --buckets 1024,2048,3072 --steps 300 --samples 256 --guards
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import threading
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


def loader_rate(cfg, workers: int, n_batches: int, decode_on_device: bool = False) -> dict:
    """Micro-batches/s of the training DataLoader alone, and the CPU cores it kept busy; with
    ``decode_on_device`` (a lossy cache) the batches hold payload + scales, and the copy to the
    GPU with its decode is timed apart (``device_decode_ms``, per micro-batch, synchronised)."""
    from dflash.shared.cache import CacheReader
    from dflash.train.data import AnchorDataset, GlobalBatchSampler, Split, make_loader
    from dflash.train.step import to_device

    reader = CacheReader(cfg.cache)
    d = cfg.data
    split = Split.of(len(reader), d.eval_samples)
    dataset = AnchorDataset(reader, [1, 9, 17, 25, 33], cfg.max_length, d.max_anchors, cfg.runtime.seed,
                            decode_on_device=decode_on_device)
    sampler = GlobalBatchSampler(split.train, d.batch_size, d.micro_batch_size, 0, 1, cfg.runtime.seed,
                                 n_batches + 4)
    loader = make_loader(dataset, sampler, d.context_buckets, workers, d.prefetch_factor,
                         pin_memory=torch.cuda.is_available())
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
            else "loader", "micro_batches_s": round(n_batches / dt, 2),
            "cpu_cores_busy_upper_bound": round((c1 - c0) / dt, 2), "to_device_ms": device_ms}


def decode_cpu_equals_cuda(cache: str) -> bool | None:
    """One sample's hidden states decoded on the CPU and on the GPU: bitwise equal?"""
    from dflash.shared.cache import HIDDEN_SCALE, CacheReader, decode_hidden

    reader = CacheReader(cache)
    if not torch.cuda.is_available() or not reader.spec.codec.lossy:
        return None
    s = reader.read(0, ["hidden"], decode=False)
    cpu = decode_hidden(reader.spec, s)
    gpu = decode_hidden(reader.spec, {"hidden": s["hidden"].cuda(), HIDDEN_SCALE: s[HIDDEN_SCALE].cuda()}).cpu()
    return bool(torch.equal(cpu.view(torch.int16), gpu.view(torch.int16)))


def guards(hidden: int, vocab: int) -> dict:
    """The main-thread guard and the uncompiled-flex refusal, exercised on CUDA."""
    from dflash.train import attention, compile as dcompile
    from dflash.train.config import RuntimeConfig
    from dflash.train.model import DFlashDrafter, DrafterConfig

    dev = torch.device("cuda")
    result = {}
    cfg = DrafterConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8, rms_norm_eps=1e-6,
                        rope_theta=1e6, max_position_embeddings=8192, vocab_size=vocab, block_size=16,
                        target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36, mask_token_id=vocab - 1)
    choice = dcompile.resolve(RuntimeConfig(), dev)
    model = dcompile.compile_model(DFlashDrafter(cfg).to(dev), choice, 4)
    anchors = torch.tensor([[5, 9, 40]], device=dev)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    ctx_len = torch.tensor([64], device=dev)
    q = torch.randn(1, 8, 48, 64, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(1, 8, 64 + 48, 64, device=dev, dtype=torch.bfloat16)
    mask = attention.build_mask("flex", anchors, valid, ctx_len, 64, 16)
    attention.attend(q, kv, kv, mask, 0.125)  # main thread: fine

    def from_thread(name, fn):
        err = []

        def run():
            try:
                fn()
                err.append("NOT REFUSED")
            except Exception as e:  # noqa: BLE001 - reported, whatever it is
                msg = str(e).split("\n")[0][:160]
                err.append(("refused: " if "main thread" in msg else f"NOT REFUSED ({type(e).__name__}): ") + msg)

        t = threading.Thread(target=run, name="not-main")
        t.start()
        t.join()
        result[name] = err[0]

    from_thread("thread_compiled_drafter", lambda: model())  # the hook fires before forward
    from_thread("thread_attend_flex", lambda: attention.attend(q, kv, kv, mask, 0.125))
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        for name, fn in (("dynamo_off_resolve_auto", lambda: dcompile.resolve(RuntimeConfig(), dev)),
                         ("dynamo_off_attend_flex", lambda: attention.attend(q, kv, kv, mask, 0.125))):
            try:
                fn()
                result[name] = "NOT REFUSED"
            except RuntimeError as e:
                result[name] = "refused: " + str(e).split("\n")[0][:160]
        result["dynamo_off_flex_eager_by_name"] = dcompile.resolve(RuntimeConfig(attention="flex-eager"), dev).eager_flex
    finally:
        del os.environ["TORCHDYNAMO_DISABLE"]
        attention.allow_uncompiled_flex(False)
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/dflash_bench")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=12288)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--ctx", type=int, default=3072)
    p.add_argument("--min-ctx", type=int, default=None, help="variable lengths in [min-ctx, ctx]")
    p.add_argument("--buckets", default=None, help="context buckets (default: ctx)")
    p.add_argument("--loader-workers", default="", help="e.g. 1,2,4: time the DataLoader alone")
    p.add_argument("--guards", action="store_true", help="exercise the thread guard and the dense refusal")
    p.add_argument("--loader-only", type=float, default=None, metavar="STEP_S",
                   help="skip training; compare the loader with this measured step time (s)")
    p.add_argument("--hidden-codecs", default="bf16", help="with --loader-only: e.g. bf16,fp8,int8,int4, a cache each")
    p.add_argument("--loader-batches", type=int, default=None, help="micro-batches timed (default: samples - 2, at most 48)")
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
    lengths = fake_cache(out / "cache.zarr", layer_ids, args.hidden, 36, args.vocab, args.samples + 1, args.ctx,
                         args.min_ctx or args.ctx)
    buckets = [int(b) for b in args.buckets.split(",")] if args.buckets else [args.ctx]
    print(f"setup {time.time() - t0:.1f}s; lengths {int(lengths.min())}..{int(lengths.max())}, buckets {buckets}",
          flush=True)

    from dflash.train.config import dflash_recipe
    from dflash.train.loop import train

    cfg = dflash_recipe().override(
        cache=str(out / "cache.zarr"), target=str(out / "target"), out=str(out / "run"),
        context_buckets=buckets, max_anchors=args.anchors, batch_size=1, micro_batch_size=1,
        eval_samples=1, max_steps=args.steps, log_every=5, eval_every=10**9, save_every=10**9,
        mask_token_id=args.vocab - 1, attention=args.attention, progress=False, tensorboard=False,
        num_workers=2, resume=None)
    cfg.runtime.save_every = args.steps  # the last step saves anyway
    if args.loader_only:
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
                    r = loader_rate(cfg, w, n_batches, decode_on_device=on_device)
                    r["vs_training_step"] = round(r["micro_batches_s"] * args.loader_only, 2)
                    print(json.dumps({"loader": r, "step_s": args.loader_only}), flush=True)
        return
    t = time.time()
    summary = train(cfg)
    wall = time.time() - t
    rows = [r for r in summary["history"] if r["kind"] == "train"]
    for r in rows:
        print(json.dumps({k: r[k] for k in ("step", "loss", "step_s", "tok_s", "mfu", "peak_mem_gb", "compiles")}))
    steady = rows[1:] or rows
    step_s = statistics.median(r["step_s"] for r in steady)
    print(json.dumps({"steps": summary["step"], "wall_s": round(wall, 1),
                      "warmup_compiled_graphs": summary["warmup_compiled_graphs"],
                      "compile_count_per_log_row": sorted({r["compiles"] for r in rows}),
                      "compiles_at_end": summary["compiles"],
                      "eval_compiled_graphs": summary["eval_compiled_graphs"],  # at the first evaluation, expected
                      "recompiles_after_warmup": summary["compiles"] - (summary["eval_compiled_graphs"] or 0)
                      - rows[0]["compiles"],
                      "median_step_s": round(step_s, 4), "median_mfu": round(statistics.median(r["mfu"] for r in steady), 3),
                      "median_block_tok_s": round(statistics.median(r["tok_s"] for r in steady)),
                      "peak_mem_gb": max(r["peak_mem_gb"] or 0 for r in rows),
                      "eval_tau": (summary["eval"] or {}).get("tau")}), flush=True)
    if args.loader_workers:
        need = 1.0 / step_s  # micro-batches the step consumed per second (batch = micro = 1)
        for w in (int(x) for x in args.loader_workers.split(",")):
            r = loader_rate(cfg, w, n_batches=min(args.samples, 48))
            r["vs_training_step"] = round(r["micro_batches_s"] / need, 2)
            print(json.dumps({"loader": r}), flush=True)
    if args.guards and torch.cuda.is_available():
        print(json.dumps({"guards": guards(args.hidden, args.vocab)}, indent=1), flush=True)


if __name__ == "__main__":
    main()
