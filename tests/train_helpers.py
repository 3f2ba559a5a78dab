"""Tiny caches and configs for the training tests.

``write_pattern_cache`` writes a cache whose token streams repeat a fixed cycle of
distinct tokens (so token t+k is a function of token t) and whose "hidden states" are
the target's embedding of each token scaled per layer: a drafter can learn it in a few
hundred CPU steps. The stored top-1 at t is the true next token (probability 0.98, then
token 3 at 0.01 and 0.01 left to the tail), so the acceptance estimate can approach B.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from dflash.shared import cache as C
from dflash.shared.fingerprint import tokenizer_fingerprint
from dflash.train.config import tiny

LAYER_IDS = [0, 1, 2]  # stored layers; the drafter uses [0, 2]
CYCLE = [21, 34, 55, 89, 144, 233, 377, 61]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls: intra-op threads only contend (10x slower on a loaded 2-core box). Autouse in
    every module that imports it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def target_embedding(target_dir) -> torch.Tensor:
    with safe_open(str(Path(target_dir) / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("model.embed_tokens.weight")


def write_pattern_cache(path, target_dir, tokenizer, n_samples=24, seed=0, min_len=20, max_len=60,
                        layer_ids=LAYER_IDS, hidden_size=None, vocab_size=None, tokenizer_hash=None,
                        num_target_layers=4, samples_per_shard=None, cycle=CYCLE):
    emb = target_embedding(target_dir).float()
    V, D = emb.shape
    hidden_size = hidden_size or D
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, n_samples)
    spec = C.CacheSpec(
        layer_ids=list(layer_ids), hidden_size=hidden_size, topk=2, vocab_size=vocab_size or V,
        num_target_layers=num_target_layers, max_length=max_len, truncation="right", chunk_tokens=64,
        fingerprint={"target": {"name_or_path": str(target_dir)},
                     "tokenizer": {"hash": tokenizer_hash or tokenizer_fingerprint(tokenizer)["hash"]}},
    )
    root = C.create_or_open_cache(str(path), spec)
    per_shard = samples_per_shard or n_samples
    cycle = np.array(cycle)
    for shard, s0 in enumerate(range(0, n_samples, per_shard)):
        lens = lengths[s0:s0 + per_shard]
        plan = C.ShardPlan(source_index=np.arange(s0, s0 + len(lens)), lengths=lens,
                           batches=np.arange(len(lens) + 1))
        w = C.ShardWriter(root, shard, plan, spec)
        for b, T in enumerate(lens):
            phase = rng.integers(0, len(cycle))
            ids = cycle[(np.arange(T + 1) + phase) % len(cycle)]
            mask = np.zeros(T, bool)
            mask[rng.integers(2, 6):] = True
            h = emb[ids[:T]][:, None, :hidden_size] * torch.arange(1, len(layer_ids) + 1).view(1, -1, 1)
            topk = np.stack([ids[1:T + 1], np.full(T, 3)], axis=1)
            w.write_batch(b, input_ids=ids[:T].astype(np.int32), loss_mask=mask,
                          hidden=C.bf16_to_bits(h.to(torch.bfloat16)), topk_ids=topk.astype(np.int32),
                          topk_logprobs=np.log(np.tile([[0.98, 0.01]], (T, 1))).astype(np.float32))
            w.commit()
        w.finish()
    return path


def tiny_config(cache, target, out, **overrides):
    cfg = tiny()
    cfg.cache, cfg.target, cfg.out = str(cache), str(target), str(out)
    cfg.drafter.target_layer_ids = [0, 2]
    cfg.drafter.mask_token_id = 3
    cfg.data.eval_samples = 4
    return cfg.override(**overrides)


def _ddp_worker(rank: int, world: int, port: int, cfg_dict: dict) -> None:
    import os

    from dflash.train.config import TrainConfig
    from dflash.train.loop import train

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    train(TrainConfig.from_dict(cfg_dict))


def run_distributed(cfg, world: int) -> None:
    """Run ``train(cfg)`` in ``world`` gloo processes (as torchrun would)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork lets the children inherit the imported modules (spawn re-imports torch and
    # transformers: ~10 s each), but after a backward on a machine with CUDA devices the
    # autograd engine's threads make fork unsafe (torch refuses it): spawn there.
    method = "spawn" if torch.cuda.is_available() else "fork"
    mp.start_processes(_ddp_worker, args=(world, port, cfg.to_dict()), nprocs=world, join=True,
                       start_method=method)
