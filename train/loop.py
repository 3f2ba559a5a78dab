"""The training loop, ``train(cfg)``. Each micro-batch's loss is divided by the global batch's weight
sum (known from the data before any forward), so any world size or accumulation gives the same update."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from dflash.shared.cache import CacheReader, diff_dicts
from dflash.shared.compression import size_text

from . import checkpoint, compile as compile_path, metrics, replay
from .config import DataConfig, OptimConfig, TrainConfig
from .data import (DEFAULT_EVAL_SAMPLES, PRELOAD_SHARE, AnchorDataset, Collate, GlobalBatchSampler, Split,
                   held_out_batches, make_loader, plan_buckets, preload, preload_bytes, total_steps, truncate_sample)
from .model import DFlashDrafter, init_from_target_layers, load_target_head
from .step import StepSpec, evaluate_batch, forward_loss, labels_and_weights, to_device, work_counts
from .target import build_drafter_config, load_target_meta, resolve_target

log = logging.getLogger("dflash.train")
LOADER_BOUND = 0.3  # the share of a logging window spent waiting on the loader that warns (once a run)


def init_distributed(device: str = "auto") -> tuple[int, int, torch.device, bool]:
    """(rank, world, device, whether this call started the process group) from the torchrun
    environment (nccl on CUDA, gloo on CPU); outside torchrun one process and nothing happens."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if started := world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    return rank, world, dev, started


def _all_reduce(t: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(t)
    return t


_RESUME_NEUTRAL = {"resume", "stop_after", "log_every", "eval_every", "save_every", "keep_checkpoints", "progress",
                   "tensorboard", "num_workers", "preload", "peak_tflops", "out", "cache", "compile_cache"}


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Settings that change the training trajectory and differ between two config dicts."""
    def strip(d):
        return {k: (strip(v) if isinstance(v, dict) else v) for k, v in d.items() if k not in _RESUME_NEUTRAL}

    return diff_dicts(strip(saved), strip(current))


def load_resident(datasets: list[AnchorDataset], indices: np.ndarray, lengths: np.ndarray, dcfg: DataConfig,
                  device: torch.device, progress: bool, step_peak: int | None) -> bool:
    """``preload`` the run's samples where ``--preload`` asks; whether it did. auto: on CUDA, if they fit in what
    the warm-up's measured step peak (``step_peak`` bytes) leaves."""
    if dcfg.preload == "off" or (dcfg.preload == "auto" and (device.type != "cuda" or step_peak is None)):
        return False
    need = preload_bytes(datasets[0], indices, lengths)
    if dcfg.preload == "auto":
        room = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - step_peak
        if need > PRELOAD_SHARE * room:
            log.info("samples not preloaded: they take %s, more than %.0f%% of the %s that the training step leaves "
                     "on %s (--preload on forces it)", size_text(need), 100 * PRELOAD_SHARE, size_text(room), device)
            return False
    start = time.perf_counter()
    preload(datasets, indices, device, progress)
    log.info("preloaded %d samples (%s) into %s memory in %.1f s: batches are cut there, no loader workers",
             len(indices), size_text(need), device, time.perf_counter() - start)
    return True


def make_optimizer(params, ocfg: OptimConfig, total: int, fused: bool):
    """AdamW + linear warm-up + cosine to ``min_lr_ratio``."""
    optimizer = torch.optim.AdamW(params, lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2),
                                  weight_decay=ocfg.weight_decay, fused=fused or None)
    warmup = round(ocfg.warmup_ratio * total)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return ocfg.min_lr_ratio + (1 - ocfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)


def wrap_parallel(drafter: torch.nn.Module, parallel: str, world: int, device: torch.device, choice,
                  graphs_needed: int):
    """(model for training steps, model for eval forwards). Model code stays single-device."""
    if parallel == "fsdp" and world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in drafter.layers:
            fully_shard(layer)
        fully_shard(drafter)
    model = compile_path.compile_model(drafter, choice, graphs_needed)
    if world > 1 and parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None), model
    return model, model


@contextmanager
def _grad_sync(model, enabled: bool):
    """DDP ``no_sync`` / FSDP2 ``set_requires_gradient_sync``: only a step's last micro-step syncs."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
    with model.no_sync() if not enabled and hasattr(model, "no_sync") else nullcontext():
        yield


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or resume) one run; returns a summary. Every rank calls this."""
    cfg.validate()
    rt, dcfg_data, ocfg = cfg.runtime, cfg.data, cfg.optim
    rank, world, device, started_group = init_distributed(rt.device)
    is_main, out, sink = rank == 0, Path(cfg.out), None
    try:
        reader = CacheReader(cfg.cache)
        cfg = dataclasses.replace(cfg, target=resolve_target(cfg.target, reader.spec, cfg.cache))
        cuda = device.type == "cuda"
        autocast_dtype = torch.bfloat16 if {"auto": cuda, "bf16": True, "on": True, "off": False}[rt.autocast] else None
        choice = compile_path.resolve(rt, device)
        compiles = choice.compile_model or (choice.attention == "flex" and not choice.eager_flex)
        compile_cache = compile_path.use_compile_cache(rt.compile_cache) if compiles else None
        hf_config, tokenizer = load_target_meta(cfg.target)
        dcfg = build_drafter_config(cfg, hf_config, tokenizer, reader)
        cfg = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, mask_token_id=dcfg.mask_token_id))
        if is_main:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(cfg.to_json())
        sink = metrics.MetricsSink(out, is_main, rt.tensorboard)

        spec = StepSpec(choice.attention, dcfg.block_size, dcfg.mask_token_id, cfg.drafter.gamma,
                        rt.ce_chunk_size, autocast_dtype, cfg.drafter.loss, cfg.drafter.kd_weight,
                        choice.backend if choice.compile_model else None)

        split = Split.of(len(reader), dcfg_data.eval_samples, reader.source_indices(), dcfg_data.train_samples)
        if is_main:
            held_out, requested = len(split.held_out), dcfg_data.eval_samples
            if requested is None and held_out < DEFAULT_EVAL_SAMPLES:
                log.info("held out %d of %d samples: the default %d is capped at a tenth of a small cache "
                         "(--eval-samples to choose)", held_out, len(reader), DEFAULT_EVAL_SAMPLES)
            elif requested is not None and held_out < requested:
                log.warning("held out %d of %d samples, not the %d asked for: at least one must remain to train on",
                            held_out, len(reader), requested)
            else:
                log.info("held out %d of %d samples", held_out, len(reader))
            log.info("training on %d samples", len(split.train))
        G, micro = dcfg_data.batch_size, dcfg_data.micro_batch_size
        steps = total_steps(len(split.train), G, ocfg.epochs, ocfg.max_steps)
        on_device = dcfg_data.hidden_decode == "device" or (dcfg_data.hidden_decode == "auto" and cuda)
        dataset, eval_dataset = (AnchorDataset(reader, dcfg.target_layer_ids, cfg.max_length, dcfg_data.max_anchors,
                                               rt.seed, top1, spec.needs_topk, on_device)
                                 for top1 in (False, True))  # eval's acceptance needs the target's top-1
        buckets = plan_buckets(reader.lengths(), dcfg_data.context_buckets)
        log.info(buckets.describe())
        setup_start = time.perf_counter()
        head = load_target_head(cfg.target, device, torch.bfloat16 if autocast_dtype is not None else torch.float32)
        torch.manual_seed(rt.seed)
        with torch.device(device):  # a CPU init of 8B-sized layers takes seconds
            drafter = DFlashDrafter(dcfg)  # fp32 master weights
            if cfg.drafter.init_from_target_layers is not None:
                init_from_target_layers(drafter, cfg.target, cfg.drafter.init_from_target_layers)
        model, eval_model = wrap_parallel(drafter, rt.parallel, world, device, choice, 2 * len(buckets.buckets) + 2)
        optimizer, scheduler = make_optimizer(drafter.parameters(), ocfg, steps, fused=cuda)

        start_step, resume_from = 0, checkpoint.resolve(out, rt.resume)
        if resume_from is not None:
            state = checkpoint.load(resume_from, drafter, optimizer, scheduler)
            start_step = int(state["step"])
            if is_main:
                log.info("resumed from %s at step %d", resume_from, start_step)
                if changed := config_changes(state.get("config", {}), cfg.to_dict()):
                    log.warning("resuming with settings that differ from the checkpoint's; the run will not "
                                "be the one it would have been:\n  - %s", "\n  - ".join(changed))

        eval_keys = held_out_batches(split.held_out, micro, rank, world)
        eval_collate = Collate(buckets.buckets)
        sampler = GlobalBatchSampler(split.train, G, micro, rank, world, rt.seed, steps, start_step)
        # the warm-up's samples: step 0's first micro-batch, whatever step the run resumes at
        warm_samples = [dataset[k] for k in sampler.step_batches(0)[0]] if compiles else None
        log.info("drafter, target head and optimizer ready in %.1f s", time.perf_counter() - setup_start)

        compiled_graphs, cache_use, eval_compiled_graphs = 0, {}, None
        if compiles:
            def warm_up():  # one training step per bucket
                for length in buckets.buckets:
                    fitted = [truncate_sample(x, length) for x in warm_samples]
                    batch = to_device(Collate([length])(fitted), device)
                    forward_loss(model, head, batch, spec).loss.backward()
                    optimizer.zero_grad(set_to_none=True)

            _, compiled_graphs, cache_use, seconds = compile_path.compile_then_freeze(warm_up)
            log.info("warm-up compiled %d graphs over %d context buckets in %.1f s; recompiles are now errors",
                     compiled_graphs, len(buckets.buckets), seconds)
            log.info("compile cache %s: inductor graphs %d loaded, %d compiled, %d uncacheable; "
                     "AOTAutograd %d loaded, %d compiled, %d uncacheable", compile_cache, *cache_use.values())
        compiles_after_warm_up = compile_path.compile_count()
        # the step's peak: the warm-up's, and AdamW's two moments (allocated at the first step)
        step_peak = torch.cuda.max_memory_allocated(device) + 2 * sum(
            p.numel() * p.element_size() for p in drafter.parameters()) if cuda and compiles else None
        resident = load_resident([eval_dataset, dataset], np.concatenate([split.train, split.held_out]),
                                 reader.lengths(), dcfg_data, device, rt.progress and is_main, step_peak)
        workers = 0 if resident else dcfg_data.num_workers  # preloaded batches are cut in this process
        data_iter = iter(make_loader(dataset, sampler, buckets.buckets, workers, cuda and not resident))

        def evaluate(step: int) -> dict[str, Any]:
            """Held-out loss, accuracy per slot and tau (the decoding replay's, and over every assistant anchor)."""
            sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss*w, w
            slots = torch.zeros(2, dcfg.block_size, dtype=torch.float64, device=device)
            for keys in eval_keys:
                batch = to_device(eval_collate([eval_dataset[k] for k in keys]), device)
                loss_sum, so, _ = evaluate_batch(eval_model, head, batch, spec)
                sums += torch.stack([loss_sum.double(), so.weights.sum().double()])
                slots += so.per_slot()
            s, _ = _all_reduce(sums, world).tolist(), _all_reduce(slots, world)
            # every rank replays every sample (FSDP forwards are collectives)
            walked = replay.replay(eval_dataset, split.held_out, lambda b: evaluate_batch(eval_model, head, b, spec)[2],
                                   eval_collate, group_size=micro, fixed_shape=True, device=device)
            return {"kind": "eval", "step": step, "loss": s[0] / max(s[1], 1e-12), "tau": walked.tau,
                    "tau_blocks": walked.blocks, "tau_uniform": walked.tau_uniform, "anchors": walked.anchors,
                    "acc_per_pos": (slots[0] / slots[1].clamp(min=1)).tolist()}

        bar = tqdm(total=steps, initial=start_step, disable=not (rt.progress and is_main), desc="train",
                   dynamic_ncols=True)
        # loss, context tokens, block tokens, attention pairs, then per slot: predicted right, supervised
        window = torch.zeros(4 + 2 * dcfg.block_size, dtype=torch.float64, device=device)
        window_steps, window_start, window_data_s = 0, time.perf_counter(), 0.0
        params = [p for p in drafter.parameters() if p.requires_grad]
        history, last_eval, done, loader_warned = [], None, start_step, False
        for step in range(start_step, steps):
            waited = time.perf_counter()
            micro_batches = [to_device(next(data_iter), device) for _ in range(sampler.accum)]
            window_data_s += time.perf_counter() - waited
            labels_weights = [labels_and_weights(b, spec) for b in micro_batches]
            denominator = _all_reduce(torch.stack([w.sum() for _, w in labels_weights]).sum(), world)
            for m, (batch, lw) in enumerate(zip(micro_batches, labels_weights)):
                with _grad_sync(model, enabled=m == sampler.accum - 1):
                    step_out = forward_loss(model, head, batch, spec, denominator, lw)
                    (step_out.loss * world).backward()  # DDP / FSDP average; the loss is a global mean
                window += torch.cat([step_out.loss.detach().double()[None], work_counts(batch, dcfg.block_size),
                                     step_out.per_slot().flatten()])
            grad_norm = torch.nn.utils.clip_grad_norm_(params, ocfg.grad_clip) if ocfg.grad_clip > 0 else None
            lr_used = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            window_steps, done = window_steps + 1, step + 1
            last = done == steps
            bar.update(1)
            if done % rt.log_every == 0 or last:
                _all_reduce(window, world)
                if cuda:
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - window_start
                (loss_sum, ctx_tok, block_tok, pairs), slots = window[:4].tolist(), window[4:].view(2, -1)
                flops = metrics.step_flops(dcfg, len(head.embed_weight), ctx_tok, block_tok, pairs) / elapsed / world
                record = {"kind": "train", "step": done, "epoch": step / sampler.steps_per_epoch,
                          "loss": loss_sum / window_steps, "acc_per_pos": (slots[0] / slots[1].clamp(min=1)).tolist(),
                          "acc": (slots[0].sum() / slots[1].sum().clamp(min=1)).item(),
                          "lr": float(lr_used), "grad_norm": grad_norm.item() if grad_norm is not None else None,
                          "tok_s": block_tok / elapsed, "step_s": elapsed / window_steps,
                          "data_wait": window_data_s / elapsed, "mfu": flops / (rt.peak_tflops * 1e12),
                          "peak_mem_gb": metrics.peak_memory_gb(device), "compiles": compile_path.compile_count()}
                history.append(record)
                sink.write(record)
                if record["data_wait"] > LOADER_BOUND and workers and not loader_warned:
                    loader_warned = True  # once a run: the loader, not the step, sets the pace
                    log.warning("the step waited on the data loader %.0f%% of the last %d steps: raise "
                                "--num-workers (now %d) where cores are free, preload the samples (--preload on) "
                                "where they fit the device, or extract a lossy cache "
                                "(--hidden-codec fp8), which training decodes on the GPU: half the loader's work",
                                100 * record["data_wait"], window_steps, workers)
                bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['acc']:.3f}")
                window.zero_()
                window_steps, window_start, window_data_s = 0, time.perf_counter(), 0.0
            if eval_keys and (done % rt.eval_every == 0 or last):
                if compiles and eval_compiled_graphs is None:  # the first evaluation compiles the no-grad graphs
                    last_eval, eval_compiled_graphs, use, seconds = compile_path.compile_then_freeze(
                        lambda: evaluate(done))
                    log.info("the first evaluation compiled %d eval graphs (inductor %d loaded, %d compiled) and "
                             "took %.1f s; recompiles are errors again", eval_compiled_graphs, use["fx_graph_hit"],
                             use["fx_graph_miss"], seconds)
                else:
                    last_eval = evaluate(done)
                history.append(last_eval)
                sink.write(last_eval)
                window_start = time.perf_counter()
            if done % rt.save_every == 0 or last:
                info = {"data_position": {"global_step": done, "epoch": done // sampler.steps_per_epoch,
                                          "step_in_epoch": done % sampler.steps_per_epoch},
                        "total_steps": steps, "config": cfg.to_dict(), "drafter_config": dcfg.to_dict()}
                checkpoint.save(out, done, drafter, optimizer, scheduler, info, rt.keep_checkpoints)
                window_start = time.perf_counter()
            if rt.stop_after is not None and done >= rt.stop_after and not last:
                break
        bar.close()
        return {"run_dir": str(out), "step": done, "total_steps": steps, "history": history, "eval": last_eval,
                "warmup_compiled_graphs": compiled_graphs, "eval_compiled_graphs": eval_compiled_graphs,
                "compiles_after_warm_up": compiles_after_warm_up, "compiles": compile_path.compile_count(),
                "context_buckets": buckets.buckets, "compile_cache": str(compile_cache) if compile_cache else None,
                "compile_cache_use": cache_use}
    finally:
        compile_path.thaw()
        if sink is not None:
            sink.close()
        if started_group:
            dist.destroy_process_group()
