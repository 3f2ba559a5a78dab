"""DFlash labels and a chunked, weighted cross-entropy through the frozen target LM head.

Label alignment (DESIGN §2): block slot k of the block anchored at position a predicts
the token AT position a + k: same position, no shift. Slot 0 is the anchor itself (given
as input) and carries no loss. A shift by one gives high train accuracy and useless
drafts, so it is tested for.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

_PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """Decay of the per-slot weights: the paper's 7 / 5 / 4 for B = 16 / 10 / 8.

    Other block sizes use B / 2 (which reproduces B = 8 and 10; for 16 the paper chose 7).
    """
    return _PAPER_GAMMA.get(int(block_size), block_size / 2.0)


def block_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_len: torch.Tensor,
    anchors: torch.Tensor,
    block_valid: torch.Tensor,
    block_size: int,
    gamma: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels (Bsz, N, B) long and weights (Bsz, N, B) float32 for every block slot.

    input_ids, loss_mask: (Bsz, T); seq_len: (Bsz,) real length of each row;
    anchors (Bsz, N) long; block_valid (Bsz, N) bool.
    label[b, n, k] = input_ids[b, anchors[b, n] + k]; weight exp(-(k - 1) / gamma), and 0
    at k = 0, past seq_len, where loss_mask is 0 and in invalid blocks (label -100 there).
    """
    gamma = default_gamma(block_size) if gamma is None else float(gamma)
    if gamma <= 0:
        raise ValueError(f"gamma must be positive, got {gamma}")
    bsz, total = input_ids.shape
    device = input_ids.device
    slot = torch.arange(block_size, device=device)  # (B,)
    pos = anchors[..., None].long() + slot  # (Bsz, N, B)
    seq_len = seq_len.to(device).clamp(max=total)
    in_seq = (pos >= 0) & (pos < seq_len[:, None, None])
    flat_pos = pos.clamp(0, total - 1).reshape(bsz, -1)
    labels = input_ids.gather(1, flat_pos).view_as(pos)
    supervised = loss_mask.gather(1, flat_pos).view_as(pos) != 0
    keep = block_valid[..., None].to(torch.bool) & in_seq & supervised & (slot >= 1)
    decay = torch.exp(-(slot.to(torch.float32) - 1.0) / gamma)  # (B,)
    weights = torch.where(keep, decay, torch.zeros((), device=device))
    labels = torch.where(keep, labels.long(), torch.full_like(labels, IGNORE_INDEX, dtype=torch.long))
    return labels, weights


class _ChunkedWeightedCE(torch.autograd.Function):
    """Forward computes, chunk by chunk, the loss AND d(loss)/d(hidden); only that
    (M, D) gradient is kept, so no (M, V) logits tensor ever lives in memory."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk_size, denominator, need_grad):
        n_rows = hidden.shape[0]
        # Ignored labels (< 0) never count, whatever weight they were given.
        w = torch.where(labels >= 0, weights.to(torch.float32), torch.zeros((), device=weights.device))
        if denominator is None:
            denominator = w.sum()
        denominator = torch.as_tensor(denominator, dtype=torch.float32, device=hidden.device)
        safe_denominator = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.zeros(n_rows, dtype=torch.bool, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if need_grad else None
        for start in range(0, n_rows, chunk_size):
            stop = min(start + chunk_size, n_rows)
            logits = F.linear(hidden[start:stop].to(weight.dtype), weight).float()  # (c, V)
            label = labels[start:stop]
            w_chunk = w[start:stop]
            safe_label = label.clamp(min=0)
            lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, safe_label[:, None]).squeeze(1)
            total = total + (w_chunk * (lse - target_logit)).sum()
            correct[start:stop] = (logits.argmax(dim=-1) == label) & (label >= 0)
            if need_grad:
                # d CE / d logits = softmax - onehot, scaled by w / denominator; the
                # softmax is formed in place so a chunk holds one (c, V) buffer.
                grad_logits = logits.sub_(lse[:, None]).exp_()
                grad_logits.scatter_add_(1, safe_label[:, None], -torch.ones_like(target_logit)[:, None])
                grad_logits.mul_((w_chunk / safe_denominator)[:, None])
                grad_hidden[start:stop] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            del logits
        loss = torch.where(denominator > 0, total / safe_denominator, torch.zeros_like(total))
        ctx.save_for_backward(grad_hidden if need_grad else torch.zeros(0))
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, grad_correct):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None, None, None, None


def chunked_weighted_ce(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int = 2048,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum(w * CE(hidden @ W.T, labels)) / sum(w)`` and per-row argmax-correct flags.

    hidden (M, D), lm_head_weight (V, D) frozen, labels (M,) long (negative = ignored:
    such rows count with weight 0 whatever ``weights`` says), weights (M,). Logits are computed in float32 one chunk of
    rows at a time; the matmul runs in the LM head's dtype. ``denominator`` overrides
    sum(w) (e.g. a global token weight under data parallelism). A zero denominator gives
    loss 0 and gradient 0. Returns (loss scalar float32, correct (M,) bool).
    """
    if hidden.dim() != 2 or lm_head_weight.dim() != 2 or hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError(f"hidden (M, D) and lm_head_weight (V, D) expected, got {tuple(hidden.shape)} and {tuple(lm_head_weight.shape)}")
    if labels.shape != hidden.shape[:1] or weights.shape != hidden.shape[:1]:
        raise ValueError("labels and weights must be (M,) like hidden's rows")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    if torch.is_grad_enabled() and lm_head_weight.requires_grad:
        raise ValueError("lm_head_weight requires grad; the target LM head is frozen and gets none here")
    device_type = hidden.device.type
    with torch.autocast(device_type=device_type, enabled=False):
        return _ChunkedWeightedCE.apply(
            hidden, lm_head_weight, labels, weights, int(chunk_size), denominator, need_grad
        )


def accuracy_per_slot(correct: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Fraction of supervised rows predicted right at each block slot, (B,) float.

    correct, weights: (..., B) with slots on the last dim; slots with no supervised row
    give NaN.
    """
    supervised = (weights > 0).reshape(-1, weights.shape[-1]).float()
    hits = (correct.reshape(-1, weights.shape[-1]).float() * supervised).sum(0)
    count = supervised.sum(0)
    return hits / count.where(count > 0, torch.full_like(count, math.nan))
