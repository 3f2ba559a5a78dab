"""One DFlash training (or eval) forward on a ``data.Collate`` batch: each block's [anchor, MASK x
(B-1)] embedded, slot k at position anchor + k over the target context, scored by ``loss.py``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import attention
from .loss import block_labels, chunked_block_loss
from .model import TargetHead


@dataclass
class StepSpec:
    attention: str  # 'flex' or 'dense' (see compile.resolve)
    block_size: int  # B
    mask_token_id: int  # embedding row of the B-1 masked slots
    gamma: float | None  # loss weight decay (None = paper default for B)
    ce_chunk_size: int  # rows per LM-head chunk
    autocast_dtype: torch.dtype | None  # bf16 on CUDA; None = no autocast
    loss: str = "ce"  # ce | kd | mix (see DrafterSpec.loss)
    kd_weight: float = 0.5  # weight of the KL in mix
    loss_backend: str | None = None  # torch.compile backend of the loss's chunks (None: eager)

    @property
    def loss_coefs(self) -> tuple[float, float]:
        """(CE coefficient, KL coefficient) of the objective."""
        return {"ce": (1.0, 0.0), "kd": (0.0, 1.0), "mix": (1.0 - self.kd_weight, self.kd_weight)}[self.loss]

    @property
    def needs_topk(self) -> bool:
        return self.loss_coefs[1] != 0


@dataclass
class StepOutput:
    loss: torch.Tensor  # 0-d: sum(w * (ce_coef * CE + kd_coef * KL)) / denominator (global weight sum if given)
    weights: torch.Tensor  # (Bsz, N, B) float32 label weights
    correct: torch.Tensor  # (Bsz, N, B) bool: drafter argmax == label

    def per_slot(self) -> torch.Tensor:
        """(2, B) float64: per block slot, the supervised slots predicted right, and all supervised."""
        sup = self.weights > 0
        return torch.stack([(self.correct & sup).flatten(0, -2).sum(0), sup.flatten(0, -2).sum(0)]).double()


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=device.type == "cuda") for k, v in batch.items()}


def labels_and_weights(batch: dict[str, torch.Tensor], spec: StepSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(Bsz, N, B) labels and weights, from data only."""
    return block_labels(batch["input_ids"], batch["loss_mask"], batch["seq_len"], batch["anchors"],
                        batch["block_valid"], spec.block_size, spec.gamma)


def block_loss(head: TargetHead, hidden: torch.Tensor, batch: dict[str, torch.Tensor], spec: StepSpec,
               labels: torch.Tensor, weights: torch.Tensor, denominator: torch.Tensor | None = None):
    """``loss.BlockLoss`` of hidden (Bsz, N*B, D) against (Bsz, N, B) labels, weights (and top-k)."""
    topk_ids = topk_logprobs = None
    if spec.needs_topk:
        if "topk_logprobs" not in batch:
            raise ValueError(f"loss={spec.loss!r} needs the batch's top-k (AnchorDataset(topk=True))")
        S, k = batch["topk_ids"].shape[1:]
        # slot k predicts the token at anchor + k, whose target distribution the cache stores at anchor + k - 1
        pos = batch["anchors"][..., None].long() + torch.arange(spec.block_size, device=batch["anchors"].device) - 1
        index = pos.clamp(0, S - 1).flatten(1)[..., None].expand(-1, -1, k)  # (Bsz, N*B, k)
        topk_ids, topk_logprobs = (batch[n].gather(1, index).reshape(-1, k) for n in ("topk_ids", "topk_logprobs"))
    return chunked_block_loss(hidden.reshape(-1, hidden.shape[-1]), head.weight, labels.reshape(-1),
                              weights.reshape(-1), topk_ids, topk_logprobs, *spec.loss_coefs, spec.ce_chunk_size,
                              denominator, spec.loss_backend)


def block_inputs(head: TargetHead, batch: dict[str, torch.Tensor], spec: StepSpec
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings (Bsz, N*B, D) of [anchor, MASK x (B-1)] per block and their positions (Bsz, N*B)."""
    anchors, B = batch["anchors"], spec.block_size  # (Bsz, N)
    bsz, n_blocks = anchors.shape
    ids = torch.full((bsz, n_blocks, B), spec.mask_token_id, dtype=torch.long, device=anchors.device)
    ids[:, :, 0] = torch.gather(batch["input_ids"], 1, anchors)
    positions = anchors[:, :, None] + torch.arange(B, device=anchors.device)  # (Bsz, N, B)
    return head.embed(ids.view(bsz, n_blocks * B)), positions.view(bsz, n_blocks * B)


def drafter_hidden(model, head: TargetHead, batch: dict[str, torch.Tensor], spec: StepSpec) -> torch.Tensor:
    """Drafter output for every block slot, (Bsz, N*B, D)."""
    S = batch["context_hidden"].shape[1]
    mask = attention.build_mask(spec.attention, batch["anchors"], batch["block_valid"], batch["seq_len"], S,
                                spec.block_size)
    embeds, positions = block_inputs(head, batch, spec)
    ctx_pos = torch.arange(S, device=positions.device).expand(positions.shape[0], S)
    with torch.autocast(positions.device.type, dtype=spec.autocast_dtype, enabled=spec.autocast_dtype is not None):
        return model(batch["context_hidden"], ctx_pos, embeds, positions, mask)


def forward_loss(model, head: TargetHead, batch: dict[str, torch.Tensor], spec: StepSpec,
                 denominator: torch.Tensor | None = None, labels_weights=None) -> StepOutput:
    """Forward + loss of one micro-batch (call ``.backward()`` on ``out.loss``)."""
    labels, weights = labels_weights if labels_weights is not None else labels_and_weights(batch, spec)
    hidden = drafter_hidden(model, head, batch, spec)
    out = block_loss(head, hidden, batch, spec, labels, weights, denominator)
    return StepOutput(out.loss, weights, out.correct.view_as(weights))


def argmax_tokens(head: TargetHead, hidden: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Greedy token of each row of hidden (M, D) through the LM head, chunked: (M,) long."""
    return torch.cat([head.logits(hidden[i:i + chunk_size]).argmax(-1) for i in range(0, len(hidden), chunk_size)])


@torch.no_grad()
def evaluate_batch(model, head: TargetHead, batch: dict[str, torch.Tensor], spec: StepSpec
                   ) -> tuple[torch.Tensor, StepOutput, torch.Tensor]:
    """One no-grad forward: (sum(w * loss), StepOutput with the local mean loss, argmax (Bsz, N, B))."""
    labels, weights = labels_and_weights(batch, spec)
    hidden = drafter_hidden(model, head, batch, spec)
    out = block_loss(head, hidden, batch, spec, labels, weights)
    pred = argmax_tokens(head, hidden.reshape(-1, hidden.shape[-1]), spec.ce_chunk_size).view_as(labels)
    return out.loss * weights.sum(), StepOutput(out.loss, weights, out.correct.view_as(weights)), pred


def work_counts(batch: dict[str, torch.Tensor], block_size: int) -> torch.Tensor:
    """(context tokens, valid block tokens, visible attention pairs) of a batch, as a (3,) tensor."""
    valid, seen_ctx = batch["block_valid"], torch.minimum(batch["anchors"], batch["seq_len"][:, None])
    pairs = ((seen_ctx + block_size) * valid).sum() * block_size
    return torch.stack([batch["seq_len"].sum(), valid.sum() * block_size, pairs]).double()
