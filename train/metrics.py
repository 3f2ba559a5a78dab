"""What a log step reports (acceptance, FLOPs for MFU, peak memory) and where (``MetricsSink``)."""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import sys
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("dflash.train")


def block_taus(pred: torch.Tensor, target_top1: torch.Tensor, anchors: torch.Tensor, block_valid: torch.Tensor,
               seq_len: torch.Tensor, loss_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block (tau (Bsz, N), 0 where not counted; counted): 1 + the leading slots whose argmax
    ``pred`` (Bsz, N, B) equals ``target_top1`` (Bsz, S); with ``loss_mask`` a block stops at its turn's end."""
    (bsz, n_blocks, B), S = pred.shape, target_top1.shape[1]
    pos = anchors[:, :, None] + torch.arange(1, B, device=pred.device)  # (Bsz, N, B-1): predicted positions
    inside = pos < seq_len[:, None, None]
    src = (pos - 1).clamp(max=S - 1).flatten(1)  # (Bsz, N*(B-1))
    want = torch.gather(target_top1, 1, src).view(bsz, n_blocks, B - 1)
    counted = block_valid.bool()
    if loss_mask is not None:
        # positions a+1 .. a+B still inside the anchor's turn: the block emits at most `left` tokens
        reach = anchors[:, :, None] + torch.arange(1, B + 1, device=pred.device)  # (Bsz, N, B)
        in_turn = torch.gather(loss_mask.bool(), 1, reach.clamp(max=S - 1).flatten(1)).view(bsz, n_blocks, B)
        in_turn = (in_turn & (reach < seq_len[:, None, None])).long().cumprod(dim=-1)
        left = in_turn.sum(dim=-1)  # (Bsz, N): tokens of the turn after the anchor, at most B
        inside = inside & in_turn[:, :, :-1].bool()
        counted = counted & (left > 0)
    tau = ((pred[:, :, 1:] == want) & inside).long().cumprod(dim=-1).sum(dim=-1) + 1  # leading run of hits + 1
    tau = tau if loss_mask is None else torch.minimum(tau, left)
    return tau * counted, counted


def step_flops(dcfg, vocab_size: int, context_tokens: int, block_tokens: int, attn_pairs: int) -> float:
    """Matmul FLOPs of forward + backward on the real work (trainable 3x forward, frozen LM head 2x)."""
    D, I, hd, H, Hkv = (dcfg.hidden_size, dcfg.intermediate_size, dcfg.head_dim, dcfg.num_attention_heads,
                        dcfg.num_key_value_heads)
    per_layer = (2 * block_tokens * D * H * hd * 2  # q_proj, o_proj
                 + 2 * (context_tokens + block_tokens) * D * Hkv * hd * 2  # k_proj, v_proj over [ctx; block]
                 + 2 * block_tokens * D * I * 3  # SwiGLU
                 + 2 * attn_pairs * H * hd * 2)  # QK^T and PV
    fc = 2 * context_tokens * dcfg.num_context_layers * D * D
    return 3.0 * (dcfg.num_hidden_layers * per_layer + fc) + 2.0 * (2 * block_tokens * D * vocab_size)


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated device memory (CUDA) or peak resident set size (CPU), in GB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1e9 if sys.platform == "darwin" else 1e6)


class MetricsSink:
    """Rank-0 sink for log records: logging line, ``metrics.jsonl``, TensorBoard if importable."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool):
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1) if enabled else None
        self.tb = None
        if enabled and tensorboard:
            with contextlib.suppress(Exception):  # tensorboard not installed: JSONL is the record
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tb"))

    def write(self, record: dict[str, Any]) -> None:
        if self.jsonl is None:
            return
        self.jsonl.write(json.dumps(record, sort_keys=True) + "\n")
        kind, step = record.get("kind", "train"), record["step"]
        for key, value in record.items() if self.tb is not None else ():
            if isinstance(value, (int, float)) and key != "step":
                self.tb.add_scalar(f"{kind}/{key}", value, step)
            elif isinstance(value, list):
                for i, v in enumerate(value):
                    self.tb.add_scalar(f"{kind}/{key}/{i}", v, step)
        parts = [f"{kind} step {step}"] + [
            f"{key} {v:.4g}" if isinstance(v, float) else f"{key} {v}"
            for key in ("loss", "acc", "tau", "lr", "grad_norm", "tok_s", "mfu", "peak_mem_gb")
            if (v := record.get(key)) is not None]
        if "acc_per_pos" in record:
            parts.append("acc@k " + " ".join(f"{a:.2f}" for a in record["acc_per_pos"][1:]))
        log.info(" | ".join(parts))

    def close(self) -> None:
        for f in (self.jsonl, self.tb):
            if f is not None:
                f.close()

