"""Offline replay of speculative decoding on cached samples: the acceptance length that
online decoding (``dflash.eval.speculative``) will measure, from the cache and the
drafter alone (no target forward).

Why not the mean over random anchors. Online decoding starts its first block at a
turn's first token and every later block where the previous one ended, i.e. right after
a rejected (or the bonus) token. Where acceptance depends on the position, a mean over
uniformly drawn anchors differs: it weights every position equally, decoding spends
more blocks where blocks are short. On the demo (regenerated chats, every online output
equal to its cached turn) the uniform mean was 2.49 and online 2.01 on the same chats;
this replay gave 2.00. Training's held-out evaluation (``dflash.train.loop``) runs the
same walk through its compiled eval step; this module does it for any export or run,
on any cache samples, with one dense forward per sample.

The replay scores a block at EVERY assistant position of a sample with training's own
step and metric code (one teacher-forced drafter forward over the cached context, the
block rules of ``metrics.block_taus``: end-of-turn cap, no block on the end-of-turn
token), then walks each turn the way decoding does: anchor at the turn's first token,
next anchor = anchor + tau. On data the target regenerated, the walk visits the anchors
decoding visits and each block's tau is the one decoding gets (up to the bf16 rounding
of the cached features), so the two agree; on other data they measure different
continuations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash.train import metrics
from dflash.train.data import AnchorDataset, Collate, EVAL_EPOCH
from dflash.train.step import StepSpec, evaluate_batch


@torch.no_grad()
def replay(reader, samples: list[int], drafter, head, *, mask_token_id: int, max_length: int,
           max_new_tokens: int | None = None, device: str | torch.device = "cpu", ce_chunk_size: int = 4096
           ) -> dict[str, Any]:
    """Replay decoding on cache ``samples`` (global indices of ``reader``); see the module docstring.
    ``max_new_tokens``: the online decoding's cap per turn (None: each turn to its end).

    Returns tau (decoding walk: drafted tokens / blocks), blocks, tau_uniform (mean over
    every assistant anchor, what training's estimate approximates with its random
    anchors) and anchors.
    """
    dcfg = drafter.config
    B = dcfg.block_size
    data = AnchorDataset(reader, list(dcfg.target_layer_ids), max_length, max_anchors=max_length, seed=0)
    spec = StepSpec("dense", B, mask_token_id, None, ce_chunk_size, None)
    drafter = drafter.eval().to(device)
    tokens = blocks = 0
    uniform_sum, uniform_n = 0, 0
    for index in samples:
        item = data[(EVAL_EPOCH, int(index))]  # every assistant position a, 1 <= a <= T-2, is an anchor
        n = int(item["block_valid"].sum())  # the valid anchors come first: drop the padding blocks
        item["anchors"], item["block_valid"] = item["anchors"][:n], item["block_valid"][:n]
        T = len(item["input_ids"])
        batch = {k: v.to(device) for k, v in Collate([T], force_length=T)([item]).items()}
        _, _, pred = evaluate_batch(drafter, head, batch, spec)
        tau, counted = metrics.block_taus(pred, batch["target_top1"], batch["anchors"], batch["block_valid"],
                                          batch["seq_len"], batch["loss_mask"])
        anchors = batch["anchors"][0][counted[0]].tolist()
        by_anchor = dict(zip(anchors, tau[0][counted[0]].tolist()))
        t, b = metrics.walk(by_anchor, metrics.turn_spans(item["loss_mask"].tolist()), max_new_tokens)
        tokens, blocks = tokens + t, blocks + b
        uniform_sum, uniform_n = uniform_sum + sum(by_anchor.values()), uniform_n + len(by_anchor)
    return {"tau": tokens / blocks if blocks else float("nan"), "blocks": blocks, "tokens": tokens,
            "tau_uniform": uniform_sum / uniform_n if uniform_n else float("nan"), "anchors": uniform_n,
            "samples": len(samples)}


def replay_export(cache: str | Path, samples: list[int], export: str | Path, target: str | Path,
                  max_length: int = 4096, max_new_tokens: int | None = None) -> dict[str, Any]:
    """``replay`` with a drafter from an export / run folder and the target's embedding and head."""
    from dflash.eval.speculative import load_drafter
    from dflash.shared.cache import CacheReader
    from dflash.train.model import load_target_head

    drafter, config = load_drafter(export, dtype=torch.float32)
    head = load_target_head(target, "cpu", torch.float32)
    return replay(CacheReader(str(cache)), samples, drafter, head, mask_token_id=config.mask_token_id,
                  max_length=max_length, max_new_tokens=max_new_tokens)
