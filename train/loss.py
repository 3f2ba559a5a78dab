"""DFlash labels and a chunked, weighted loss through the frozen target LM head (CE, KL from the
stored top-k, or both). Slot k of the block anchored at a predicts the token AT a + k (no shift)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

def default_gamma(block_size: int) -> float:
    """Decay of the per-slot weights: the paper's 7 for B = 16, else B / 2 (its 5 and 4 for 10 and 8)."""
    return 7.0 if block_size == 16 else block_size / 2.0


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, seq_len: torch.Tensor, anchors: torch.Tensor,
                 block_valid: torch.Tensor, block_size: int, gamma: float | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Bsz, N, B) labels input_ids[b, anchors[b, n] + k] and weights exp(-(k - 1) / gamma); weight 0
    and label -100 at k = 0, past seq_len, off the loss mask and in invalid blocks."""
    gamma = default_gamma(block_size) if gamma is None else float(gamma)
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


def _chunk_loss(hidden, weight, label, w, scale, ids, target_logp, ce_coef: float, kd_coef: float, need_grad: bool):
    """One chunk of rows: (sum of w * CE, sum of w * KL, argmax == label, d(loss)/d(hidden) or None). Plain tensor
    code, so training can compile it into a few fused passes over the (c, V) logits (eager makes about twenty)."""
    logits = F.linear(hidden.to(weight.dtype), weight).float()  # (c, V)
    safe_label = label.clamp(min=0)
    lse = torch.logsumexp(logits, dim=-1)  # (c,)
    ce_sum = (w * (lse - logits.gather(1, safe_label[:, None]).squeeze(1))).sum()
    correct = (logits.argmax(dim=-1) == label) & (label >= 0)
    kd_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    tail_lse, tail_coef = lse, ce_coef * torch.ones_like(lse)
    if ids is not None:
        ids = ids.long()  # (c, k)
        target_logp = target_logp.float()
        p = target_logp.exp()
        r = (1.0 - p.sum(-1)).clamp(min=0.0)  # target's tail mass
        drafter_logq = logits.gather(1, ids) - lse[:, None]  # (c, k)
        logits.scatter_(1, ids, float("-inf"))
        tail_lse = torch.logsumexp(logits, dim=-1)
        drafter_log_tail = tail_lse - lse  # log of the drafter's mass outside the top-k
        kl = torch.where(p > 0, p * (target_logp - drafter_logq), torch.zeros_like(p)).sum(-1)
        kl = kl + torch.where(r > 0, r * (r.clamp(min=1e-30).log() - drafter_log_tail), torch.zeros_like(r))
        kd_sum = (w * kl).sum()
        mass = p.sum(-1) + r
        tail_lse = torch.where(torch.isfinite(tail_lse), tail_lse, torch.zeros_like(tail_lse))
        # tail entries: (ce + kd * mass) * q - kd * r * s = s * ((ce + kd * mass) * Q_tail - kd * r)
        tail_coef = (ce_coef + kd_coef * mass) * drafter_log_tail.exp() - kd_coef * r
    if not need_grad:
        return ce_sum, kd_sum, correct, None
    grad_logits = logits.sub_(tail_lse[:, None]).exp_()  # (c, V); zero at the top-k ids under kd
    grad_logits.mul_((scale * tail_coef)[:, None])
    if ids is not None:
        topk_grad = (ce_coef + kd_coef * mass)[:, None] * drafter_logq.exp() - kd_coef * p
        grad_logits.scatter_add_(1, ids, scale[:, None] * topk_grad)
    grad_logits.scatter_add_(1, safe_label[:, None], (-ce_coef * scale)[:, None])
    return ce_sum, kd_sum, correct, (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)


@functools.lru_cache(maxsize=None)
def _compiled_chunk_loss(backend: str):
    """``_chunk_loss`` through torch.compile, one graph a (grad, top-k) case: every chunk is padded to full size,
    compiled or not, so the two sum in the same order."""
    return torch.compile(_chunk_loss, backend=backend, dynamic=False)


def _rows(t: torch.Tensor | None, index: torch.Tensor, size: int, fill) -> torch.Tensor | None:
    """t's rows at index, padded with fill to size rows (a padded row weighs 0)."""
    if t is None:
        return None
    t = t[index]
    return t if len(t) == size else torch.cat([t, t.new_full((size - len(t), *t.shape[1:]), fill)])


class _ChunkedBlockLoss(torch.autograd.Function):
    """Forward computes, chunk by chunk over the rows of positive weight, the loss and its (M, D) gradient, so no
    (M, V) logits live.
    With q = softmax(z), target top-k p_i, tail mass r and tail softmax s: dCE/dz = q - onehot(label),
    dKL/dz = (sum p + r) q - sum_i p_i onehot(t_i) - r s."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, topk_ids, topk_logprobs, ce_coef, kd_coef, chunk_size,
                denominator, need_grad, backend):
        w = torch.where(labels >= 0, weights.to(torch.float32), torch.zeros((), device=weights.device))
        denominator = torch.as_tensor(w.sum() if denominator is None else denominator, dtype=torch.float32,
                                      device=hidden.device)
        safe_denominator = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
        scale = w / safe_denominator
        chunk_loss = _chunk_loss if backend is None else _compiled_chunk_loss(backend)
        ce_total = kd_total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if need_grad else None
        # a row of weight 0 adds nothing to the loss or its gradient (the count costs one host sync a call)
        kept = (w > 0).nonzero().squeeze(1)
        for start in range(0, len(kept), chunk_size):
            index = kept[start:start + chunk_size]
            rows = [_rows(t, index, chunk_size, fill) for t, fill in ((hidden, 0), (labels, IGNORE_INDEX), (w, 0),
                    (scale, 0), (topk_ids, 0), (topk_logprobs, 0))]
            ce_sum, kd_sum, chunk_correct, chunk_grad = chunk_loss(rows[0], weight, *rows[1:], ce_coef, kd_coef,
                                                                   need_grad)
            ce_total, kd_total = ce_total + ce_sum, kd_total + kd_sum
            correct[index] = chunk_correct[:len(index)]
            if need_grad:
                grad_hidden[index] = chunk_grad[:len(index)]
        ce, kl = (torch.where(denominator > 0, t / safe_denominator, torch.zeros_like(t)) for t in (ce_total, kd_total))
        ctx.save_for_backward(grad_hidden if need_grad else torch.zeros(0))
        ctx.mark_non_differentiable(correct, ce, kl)
        return ce_coef * ce + kd_coef * kl, correct, ce, kl

    @staticmethod
    def backward(ctx, grad_loss, grad_correct, grad_ce, grad_kl):
        (grad_hidden,) = ctx.saved_tensors
        return (grad_hidden * grad_loss.to(grad_hidden.dtype),) + (None,) * 11


@dataclass
class BlockLoss:
    loss: torch.Tensor  # 0-d float32: ce_coef * ce + kd_coef * kl (the only differentiable output)
    correct: torch.Tensor  # (M,) bool: argmax of the drafter == label (rows of weight 0 never correct)
    ce: torch.Tensor  # 0-d: sum(w * CE) / denominator
    kl: torch.Tensor  # 0-d: sum(w * KL over the top-k and tail buckets) / denominator (0 without top-k)


def chunked_block_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                       topk_ids: torch.Tensor | None = None, topk_logprobs: torch.Tensor | None = None,
                       ce_coef: float = 1.0, kd_coef: float = 0.0, chunk_size: int = 2048,
                       denominator: float | torch.Tensor | None = None, backend: str | None = None) -> BlockLoss:
    """Weighted CE on labels (M,) (negative: ignored) and/or KL from the target's top-k (M, k) of hidden
    (M, D) through lm_head_weight (V, D). The KL is over k + 1 buckets (the top-k and the tail mass), so
    the tail the cache does not itemise is matched as a whole; float32 logits, one chunk at a time, each chunk
    through torch.compile's ``backend`` when one is named."""
    if kd_coef != 0 and (topk_ids is None or topk_logprobs is None):
        raise ValueError("kd_coef > 0 needs the target's topk_ids and topk_logprobs")
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    if torch.is_grad_enabled() and lm_head_weight.requires_grad:
        raise ValueError("lm_head_weight requires grad; the target LM head is frozen and gets none here")
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return BlockLoss(*_ChunkedBlockLoss.apply(
            hidden, lm_head_weight, labels, weights, topk_ids if kd_coef != 0 else None,
            topk_logprobs if kd_coef != 0 else None, float(ce_coef), float(kd_coef), int(chunk_size),
            denominator, need_grad, backend))
