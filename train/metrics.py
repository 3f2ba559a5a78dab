"""What a log step reports, and where it goes.

* ``acceptance``: offline acceptance length tau of each draft block against the target's
  greedy tokens stored in the cache. Slot k of a block anchored at a predicts the token
  at a + k; the target's greedy choice for that position is ``topk_ids[a + k - 1, 0]``
  (the cache stores, at position t, the target's distribution over token t + 1). A block
  accepts the leading slots k = 1..B-1 whose drafter argmax equals it, stopping at the
  first miss; tau = accepted + 1 (the target's own bonus token). With the loss mask
  (what training passes) a block also stops where its assistant turn ends, as online
  decoding stops at the end-of-turn token: only slots inside the anchor's turn count,
  tau is capped at the tokens left in the turn (no bonus after the end-of-turn token),
  and an anchor on the turn's last token, where decoding never starts a block, is not
  counted. This is what ``dflash.eval.speculative`` reports per block (tokens emitted by
  one verify), scored on the cached prefix: it matches real decoding where the data is
  the target's own greedy output (DESIGN §2, Data: regenerated responses). Over
  uniformly drawn anchors its mean is training's ``tau_uniform``; online blocks start
  where the previous block ended, so the estimate of online acceptance is ``walk`` over
  the taus of every anchor (``tau``, train/loop.py; ``dflash.eval.offline``).
* ``step_flops``: matmul FLOPs of one drafter forward + backward on the real (unpadded)
  work of a batch, attention included; MFU divides their rate by ``peak_tflops``.
* ``MetricsSink``: rank 0 only; one log line, one JSONL record, TensorBoard if present.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("dflash.train")


def acceptance(pred: torch.Tensor, target_top1: torch.Tensor, anchors: torch.Tensor, block_valid: torch.Tensor,
               seq_len: torch.Tensor, loss_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of tau over counted blocks, number of counted blocks), as 0-d tensors.

    pred (Bsz, N, B) drafter argmax per slot; target_top1 (Bsz, S); anchors, block_valid
    (Bsz, N); seq_len (Bsz,); loss_mask (Bsz, S) assistant tokens, or None: then a block
    runs to the end of the sequence and every valid block counts (no turn boundaries).
    """
    tau, counted = block_taus(pred, target_top1, anchors, block_valid, seq_len, loss_mask)
    return tau.sum().double(), counted.sum().double()


def block_taus(pred: torch.Tensor, target_top1: torch.Tensor, anchors: torch.Tensor, block_valid: torch.Tensor,
               seq_len: torch.Tensor, loss_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: (tau (Bsz, N) long, 0 where not counted; counted (Bsz, N) bool). See ``acceptance``."""
    bsz, n_blocks, B = pred.shape
    S = target_top1.shape[1]
    k = torch.arange(1, B, device=pred.device)
    pos = anchors[:, :, None] + k  # (Bsz, N, B-1): predicted positions
    inside = pos < seq_len[:, None, None]
    src = (pos - 1).clamp(max=S - 1).flatten(1)  # (Bsz, N*(B-1))
    want = torch.gather(target_top1, 1, src).view(bsz, n_blocks, B - 1)
    counted = block_valid.bool()
    if loss_mask is not None:
        # Positions a+1 .. a+B still inside the anchor's turn (a leading run): slot k
        # counts only there, and the block emits at most `left` tokens (a+B: the bonus).
        reach = anchors[:, :, None] + torch.arange(1, B + 1, device=pred.device)  # (Bsz, N, B)
        in_turn = torch.gather(loss_mask.bool(), 1, reach.clamp(max=S - 1).flatten(1)).view(bsz, n_blocks, B)
        in_turn = (in_turn & (reach < seq_len[:, None, None])).long().cumprod(dim=-1)
        left = in_turn.sum(dim=-1)  # (Bsz, N): tokens of the turn after the anchor, at most B
        inside = inside & in_turn[:, :, :-1].bool()
        counted = counted & (left > 0)
    hit = (pred[:, :, 1:] == want) & inside
    accepted = hit.long().cumprod(dim=-1).sum(dim=-1)  # (Bsz, N): leading run of hits
    tau = accepted + 1
    if loss_mask is not None:
        tau = torch.minimum(tau, left)
    return tau * counted, counted


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


def walk(taus: dict[int, int], spans: list[tuple[int, int]], max_new_tokens: int | None = None) -> tuple[int, int]:
    """(drafted tokens, blocks) of decoding each turn [s, e) from its first token.

    ``taus[a]``: tokens a block anchored at ``a`` emits (``block_taus``). Decoding starts
    its first block at the turn's first token and every later one where the previous
    block ended, so this visits the anchors decoding visits. The turn's first token comes
    from the prefill, so e - s - 1 tokens are drafted, or max_new_tokens - 1 when decoding
    stops there first (the last block then counts only what fits, as online)."""
    tokens = blocks = 0
    for s, e in spans:
        budget = e - s - 1 if max_new_tokens is None else min(e - s - 1, max_new_tokens - 1)
        done = 0
        while done < budget:
            done += min(taus[s + done], budget - done)
            blocks += 1
        tokens += budget
    return tokens, blocks


def step_flops(dcfg, vocab_size: int, context_tokens: int, block_tokens: int, attn_pairs: int) -> float:
    """FLOPs of one forward + backward of the drafter on a batch.

    context_tokens: real context positions (sum of seq_len); block_tokens: slots of valid
    blocks; attn_pairs: (query, key) pairs a valid query may see (its anchor's context
    plus its own block). Trainable matmuls cost 3x their forward (fwd, grad input, grad
    weight); the frozen LM head 2x (fwd, grad input). Masked-out work is not counted.
    """
    D, I, hd = dcfg.hidden_size, dcfg.intermediate_size, dcfg.head_dim
    H, Hkv = dcfg.num_attention_heads, dcfg.num_key_value_heads
    kv_rows = context_tokens + block_tokens
    per_layer = (2 * block_tokens * D * H * hd * 2  # q_proj, o_proj
                 + 2 * kv_rows * D * Hkv * hd * 2  # k_proj, v_proj over [ctx; block]
                 + 2 * block_tokens * D * I * 3  # SwiGLU
                 + 2 * attn_pairs * H * hd * 2)  # QK^T and PV
    fc = 2 * context_tokens * dcfg.num_context_layers * D * D
    trainable = dcfg.num_hidden_layers * per_layer + fc
    lm_head = 2 * block_tokens * D * vocab_size
    return 3.0 * trainable + 2.0 * lm_head


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated device memory (CUDA) or peak resident set size (CPU), in GB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1e9 if sys.platform == "darwin" else 1e6)


class MetricsSink:
    """Rank-0 sink for log records: logging line, ``metrics.jsonl``, TensorBoard if importable."""

    def __init__(self, run_dir: str | Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.jsonl = None
        self.tb = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tb"))
            except Exception:  # tensorboard not installed: JSONL is the record
                self.tb = None

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps(record, sort_keys=True) + "\n")
        if self.tb is not None:
            step = record["step"]
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(f"{record.get('kind', 'train')}/{key}", value, step)
                elif isinstance(value, list):
                    for i, v in enumerate(value):
                        self.tb.add_scalar(f"{record.get('kind', 'train')}/{key}/{i}", v, step)
        log.info(format_line(record))

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


def format_line(record: dict[str, Any]) -> str:
    kind = record.get("kind", "train")
    parts = [f"{kind} step {record['step']}"]
    for key in ("loss", "acc", "tau", "lr", "grad_norm", "tok_s", "mfu", "peak_mem_gb"):
        if key in record and record[key] is not None:
            v = record[key]
            parts.append(f"{key} {v:.4g}" if isinstance(v, float) else f"{key} {v}")
    if "acc_per_pos" in record:
        parts.append("acc@k " + " ".join(f"{a:.2f}" for a in record["acc_per_pos"][1:]))
    return " | ".join(parts)
