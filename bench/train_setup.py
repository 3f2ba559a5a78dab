"""Where ``dflash-train run`` spends its seconds before the compile warm-up, phase by phase.

Replays the setup of ``train/loop.py`` (imports, cache open, target config, drafter
build, target head, the first micro-batches) on a cache and target made by
``bench/train_start.py``, timing each phase; the drafter is built twice, on the CPU then
moved (as the loop did) and directly on the device, with a device sync after each.

    python bench/train_setup.py --out /tmp/ts      # after bench/train_start.py --out /tmp/ts
"""

from __future__ import annotations

import argparse
import json
import time

T0 = time.perf_counter()
phases: dict[str, float] = {}


def mark(name: str, since: float) -> float:
    now = time.perf_counter()
    phases[name] = round(now - since, 2)
    return now


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/dflash_start")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    t = time.perf_counter()
    import torch

    t = mark("import torch", t)
    import transformers  # noqa: F401

    t = mark("import transformers", t)
    from dflash.shared.cache import CacheReader
    from dflash.train.config import dflash_recipe
    from dflash.train.data import AnchorDataset, Collate, plan_buckets
    from dflash.train.loop import build_drafter_config, load_target_meta
    from dflash.train.model import DFlashDrafter, load_target_head

    t = mark("import dflash.train", t)
    cfg = dflash_recipe().override(cache=f"{args.out}/cache.zarr", target=f"{args.out}/target", out="/tmp/unused")
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.empty(1, device=device)
    t = mark("device init", t)
    reader = CacheReader(cfg.cache)
    t = mark("open cache", t)
    hf_config, tokenizer = load_target_meta(cfg.target)
    cfg.drafter.mask_token_id = hf_config.vocab_size - 1  # as train_start.py passes it
    dcfg = build_drafter_config(cfg, hf_config, tokenizer, reader)
    t = mark("target config + tokenizer", t)
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg)
    t = mark("drafter init on the CPU", t)
    drafter = drafter.to(device)
    sync()
    t = mark("drafter .to(device)", t)
    del drafter
    if device.type == "cuda":
        torch.cuda.empty_cache()
    t = time.perf_counter()
    with torch.device(device):
        drafter = DFlashDrafter(dcfg)
    sync()
    t = mark("drafter init on the device", t)
    head = load_target_head(cfg.target, device, torch.bfloat16)
    sync()
    t = mark("target embedding + head", t)
    buckets = plan_buckets(reader.lengths(), cfg.data.context_buckets)
    dataset = AnchorDataset(reader, dcfg.target_layer_ids, cfg.max_length, cfg.data.max_anchors, 0)
    t = mark("bucket plan + dataset", t)
    samples = [dataset[(0, i)] for i in range(args.batch_size)]
    t = mark(f"read {args.batch_size} samples", t)
    Collate(buckets.buckets)(samples[:1])
    mark("collate one", t)
    n_params = sum(p.numel() for p in drafter.parameters())
    print(json.dumps({"phases_s": phases, "total_s": round(time.perf_counter() - T0, 2),
                      "drafter_params": n_params, "head_vocab": head.vocab_size}, indent=1), flush=True)


if __name__ == "__main__":
    main()
