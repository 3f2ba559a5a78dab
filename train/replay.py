"""Speculative decoding replayed on cached samples: the offline estimate of the acceptance
length that online decoding (``dflash.eval.speculative``) measures, from the cache and the
drafter alone (no target forward).

Online decoding starts a turn's first block at the turn's first token and every later
block where the previous one ended, i.e. right after a rejected (or the bonus) token.
Where acceptance depends on the position, the mean over uniformly drawn anchors weighs
every position alike while decoding spends more blocks where blocks are short, so the
two differ (BENCHMARKS_LOG.md, "The CPU demo"). The replay therefore scores a block at EVERY
assistant position with training's step and ``metrics.block_taus`` (end-of-turn cap, no
block on the end-of-turn token), then walks each turn as decoding does: anchor at the
turn's first token, next anchor = anchor + tau. On data the target regenerated, the walk
visits the anchors decoding visits and each block's tau is the one decoding gets (up to
the bf16 rounding of the cached features).

Training's held-out evaluation (``loop.train``, its compiled eval step on fixed shapes)
and ``dflash.eval.offline`` (any export or run, one dense forward per sample) both call
``replay``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from . import metrics
from .data import AnchorDataset
from .step import to_device


@dataclass
class Replay:
    """What a replay counted over its samples."""

    tokens: int = 0
    """Tokens the walks drafted (every assistant token but each turn's first)."""
    blocks: int = 0
    """Blocks (target verifies) the walks took."""
    anchor_tau_sum: int = 0
    """tau summed over every scored assistant anchor."""
    anchors: int = 0
    """Assistant anchors scored."""
    samples: int = 0
    """Samples replayed."""

    @property
    def tau(self) -> float:
        """Acceptance length of the walk: drafted tokens per block (what decoding reports)."""
        return self.tokens / self.blocks if self.blocks else float("nan")

    @property
    def tau_uniform(self) -> float:
        """Mean tau over every assistant anchor (what uniformly drawn anchors estimate)."""
        return self.anchor_tau_sum / self.anchors if self.anchors else float("nan")

    def to_dict(self) -> dict:
        return {"tau": self.tau, "blocks": self.blocks, "tokens": self.tokens, "tau_uniform": self.tau_uniform,
                "anchors": self.anchors, "samples": self.samples}


def turn_spans(loss_mask) -> list[tuple[int, int]]:
    """[start, stop) of every run of assistant tokens (one per turn, end-of-turn token included)."""
    spans, start = [], None
    for t, m in enumerate(list(map(bool, loss_mask)) + [False]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            spans.append((start, t))
            start = None
    return spans


def walk_blocks(taus: dict[int, int], spans: list[tuple[int, int]], max_new_tokens: int | None = None) -> list[int]:
    """Each block's tau, in order, of decoding each turn [s, e) from its first token.

    ``taus[a]``: tokens a block anchored at ``a`` emits (``metrics.block_taus``). Decoding
    starts its first block at the turn's first token and every later one where the
    previous block ended, so this visits the anchors decoding visits. The turn's first
    token comes from the prefill, so e - s - 1 tokens are drafted, or max_new_tokens - 1
    when decoding stops there first (the last block then counts only what fits, as online)."""
    blocks = []
    for s, e in spans:
        budget = e - s - 1 if max_new_tokens is None else min(e - s - 1, max_new_tokens - 1)
        done = 0
        while done < budget:
            blocks.append(min(taus[s + done], budget - done))
            done += blocks[-1]
    return blocks


def walk(taus: dict[int, int], spans: list[tuple[int, int]], max_new_tokens: int | None = None) -> tuple[int, int]:
    """(drafted tokens, blocks) of ``walk_blocks``' walk."""
    blocks = walk_blocks(taus, spans, max_new_tokens)
    return sum(blocks), len(blocks)


def anchor_taus(dataset: AnchorDataset, index: int, predict: Callable[[dict], torch.Tensor], collate,
                group_size: int, fixed_shape: bool, device) -> tuple[dict[int, int], list[tuple[int, int]]]:
    """(tau of a block at every assistant anchor of sample ``index``, its turn spans).

    ``predict(batch)``: the drafter's argmax per slot (Bsz, N, B). With ``fixed_shape`` the
    blocks come in items of ``dataset.max_anchors`` and groups of ``group_size``, topped up
    with weightless samples (the shapes a compiled eval graph was warmed up on); without,
    one item holds exactly the sample's anchors."""
    items = dataset.every_anchor(index, fixed_shape=fixed_shape)
    taus: dict[int, int] = {}
    for start in range(0, len(items), group_size):
        group = items[start:start + group_size]
        if fixed_shape:
            group += [dataset.empty_sample() for _ in range(group_size - len(group))]
        batch = to_device(collate(group), device)
        tau, counted = metrics.block_taus(predict(batch), batch["target_top1"], batch["anchors"],
                                          batch["block_valid"], batch["seq_len"], batch["loss_mask"])
        for row in range(len(group)):
            keep = counted[row]
            taus.update(zip(batch["anchors"][row][keep].tolist(), tau[row][keep].tolist()))
    spans = turn_spans(items[0]["loss_mask"].tolist()) if items else []
    return taus, spans


@torch.no_grad()
def replay(dataset: AnchorDataset, samples: Iterable[int], predict: Callable[[dict], torch.Tensor], collate, *,
           group_size: int = 1, fixed_shape: bool = False, max_new_tokens: int | None = None,
           device: str | torch.device = "cpu") -> Replay:
    """Replay decoding on ``samples`` (global cache indices) of ``dataset`` (which must read
    the target's top-1); ``max_new_tokens``: the online decoding's cap per turn (None: each
    turn to its end). See ``anchor_taus`` for the other arguments."""
    out, device = Replay(), torch.device(device)
    for index in samples:
        taus, spans = anchor_taus(dataset, int(index), predict, collate, group_size, fixed_shape, device)
        tokens, blocks = walk(taus, spans, max_new_tokens)
        out.tokens, out.blocks = out.tokens + tokens, out.blocks + blocks
        out.anchor_tau_sum += sum(taus.values())
        out.anchors += len(taus)
        out.samples += 1
    return out
