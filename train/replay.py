"""Speculative decoding replayed from cached target features: a block scored at every assistant
position, each turn walked as decoding walks it (next anchor = anchor + tau)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import torch

from . import metrics
from .data import AnchorDataset
from .step import StepSpec, argmax_tokens, drafter_hidden, to_device


@dataclass
class Replay:
    """What a replay counted over its samples."""
    tokens: int = 0  # tokens the walks drafted (every assistant token but each turn's first)
    blocks: int = 0  # blocks (target verifies) the walks took
    anchor_tau_sum: int = 0  # tau summed over every scored assistant anchor
    anchors: int = 0  # assistant anchors scored
    samples: int = 0  # samples replayed

    @property
    def tau(self) -> float:
        """Acceptance length of the walk: drafted tokens per block (what decoding reports)."""
        return self.tokens / self.blocks if self.blocks else float("nan")

    @property
    def tau_uniform(self) -> float:
        """Mean tau over every assistant anchor (what uniformly drawn anchors estimate)."""
        return self.anchor_tau_sum / self.anchors if self.anchors else float("nan")

    def to_dict(self) -> dict:
        return {**asdict(self), "tau": self.tau, "tau_uniform": self.tau_uniform}


def turn_spans(loss_mask) -> list[tuple[int, int]]:
    """[start, stop) of every run of assistant tokens (one per turn, end-of-turn token included)."""
    flags = [False, *map(bool, loss_mask), False]
    edges = [t for t in range(1, len(flags)) if flags[t] != flags[t - 1]]
    return [(edges[i] - 1, edges[i + 1] - 1) for i in range(0, len(edges), 2)]


def walk_blocks(taus: dict[int, int], spans: list[tuple[int, int]], max_new_tokens: int | None = None) -> list[int]:
    """Each block's tau, in order, decoding each turn [s, e) from its first token (drafting e - s - 1,
    at most max_new_tokens - 1); ``taus[a]``: tokens a block anchored at ``a`` emits."""
    blocks = []
    for s, e in spans:
        budget, done = e - s - 1 if max_new_tokens is None else min(e - s - 1, max_new_tokens - 1), 0
        while done < budget:
            blocks.append(min(taus[s + done], budget - done))
            done += blocks[-1]
    return blocks


def block_predictor(drafter, head):
    """``predict(batch)``: the drafter's argmax (Bsz, N, B) by training's forward, dense attention."""
    spec = StepSpec("dense", drafter.config.block_size, drafter.config.mask_token_id, None, 4096, None)

    def predict(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = drafter_hidden(drafter, head, batch, spec)  # (Bsz, N*B, D)
        return argmax_tokens(head, hidden.flatten(0, 1), spec.ce_chunk_size).view(*batch["anchors"].shape, -1)

    return predict


def sample_blocks(items: list[dict], predict: Callable[[dict], torch.Tensor], collate, device, group_size: int = 1,
                  empty: Callable[[], dict] | None = None, max_new_tokens: int | None = None
                  ) -> tuple[list[int], dict[int, int]]:
    """(walked block taus, tau at every anchor) of one sample's ``every_anchor`` items, ``group_size``
    at a time, the last group topped up with ``empty()`` items when given."""
    taus: dict[int, int] = {}
    for start in range(0, len(items), group_size):
        group = items[start:start + group_size]
        if empty is not None:
            group += [empty() for _ in range(group_size - len(group))]
        batch = to_device(collate(group), device)
        tau, counted = metrics.block_taus(predict(batch), batch["target_top1"], batch["anchors"],
                                          batch["block_valid"], batch["seq_len"], batch["loss_mask"])
        for row, keep in enumerate(counted):
            taus.update(zip(batch["anchors"][row][keep].tolist(), tau[row][keep].tolist()))
    return walk_blocks(taus, turn_spans(items[0]["loss_mask"].tolist()) if items else [], max_new_tokens), taus


@torch.no_grad()
def replay(dataset: AnchorDataset, samples: Iterable[int], predict: Callable[[dict], torch.Tensor], collate, *,
           group_size: int = 1, fixed_shape: bool = False, max_new_tokens: int | None = None,
           device: str | torch.device = "cpu") -> Replay:
    """Replay decoding on ``samples`` (cache indices) of ``dataset``; ``fixed_shape``: compiled shapes;
    ``max_new_tokens``: the online cap per turn."""
    out, device = Replay(), torch.device(device)
    empty = dataset.empty_sample if fixed_shape else None
    for index in samples:
        items = dataset.every_anchor(int(index), fixed_shape=fixed_shape)
        blocks, taus = sample_blocks(items, predict, collate, device, group_size, empty, max_new_tokens)
        out.tokens, out.blocks, out.samples = out.tokens + sum(blocks), out.blocks + len(blocks), out.samples + 1
        out.anchor_tau_sum, out.anchors = out.anchor_tau_sum + sum(taus.values()), out.anchors + len(taus)
    return out
