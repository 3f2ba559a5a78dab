"""Offline replay of speculative decoding for any export or run, on any cache samples:
the acceptance length that online decoding will measure, from the cache and the drafter
alone (``dflash.train.replay``, the same replay training's held-out estimate runs), with
one dense forward per sample scoring a block at every assistant position.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash.train.data import AnchorDataset, Collate
from dflash.train.replay import replay as replay_decoding
from dflash.train.step import StepSpec, argmax_tokens, drafter_hidden


def block_predictor(drafter, head, mask_token_id: int, chunk_size: int = 4096):
    """``predict(batch)`` for ``train.replay``: the drafter's argmax at every slot of every block,
    (Bsz, N, B), from training's forward with dense attention (no loss computed)."""
    spec = StepSpec("dense", drafter.config.block_size, mask_token_id, None, chunk_size, None)

    def predict(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = drafter_hidden(drafter, head, batch, spec)  # (Bsz, N*B, D)
        return argmax_tokens(head, hidden.flatten(0, 1), chunk_size).view(*batch["anchors"].shape, -1)

    return predict


@torch.no_grad()
def replay(reader, samples: list[int], drafter, head, *, mask_token_id: int, max_length: int,
           max_new_tokens: int | None = None, device: str | torch.device = "cpu", ce_chunk_size: int = 4096
           ) -> dict[str, Any]:
    """Replay decoding on cache ``samples`` (global indices of ``reader``).
    ``max_new_tokens``: the online decoding's cap per turn (None: each turn to its end).

    Returns tau (decoding walk: drafted tokens / blocks), blocks, tokens, tau_uniform (mean
    over every assistant anchor, what training's random anchors approximate), anchors and samples.
    """
    dcfg = drafter.config
    data = AnchorDataset(reader, list(dcfg.target_layer_ids), max_length, max_anchors=max_length, seed=0)
    drafter = drafter.eval().to(device)
    result = replay_decoding(data, samples, block_predictor(drafter, head, mask_token_id, ce_chunk_size),
                             Collate(None), max_new_tokens=max_new_tokens, device=device)
    return result.to_dict()


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
