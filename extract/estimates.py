"""What an extraction will cost before it runs: bytes on disk per token and GPU-hours, from
measured compression ratios and extraction rates scaled to the run's shape, and the free-space
check a real run makes before its workers write anything.

These are estimates: the ratios were measured on one kind of activations and the rate on
one GPU and shape; the report says so wherever it prints them.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash.shared.compression import is_local, size_text

if TYPE_CHECKING:  # imported where used: the parent of a run starts without torch
    from dflash.shared.hidden_codecs import HiddenCodec

log = logging.getLogger(__name__)

HIDDEN_STAGE_RATIO = {
    "bf16": 28_159 / 40_960,
    "fp8": 16_780 / 20_490,
    "int8": 19_548 / 20_800,
    "int4": 8_907 / 10_560,
}
"""Stored over encoded bytes of the hidden states after the lossless stage (byte shuffle + zstd 1),
per hidden codec: BENCHMARKS_LOG.md "Lossy hidden-state codecs in the cache (issue 16)" (the real
writer on a Qwen3-8B-shaped target with random weights, layers 1,9,17,25,33; the int modes in
groups of 128 with float16 scales): bytes/token on disk over the codec's bytes/token."""

RATIO_MEASURED_AT = {"fp8": "float16 scales", "int8": "groups of 128, float16 scales",
                     "int4": "groups of 128, float16 scales"}
"""The codec settings those ratios were measured with."""

SMALL_ARRAYS_RATIO = (28_350 - 28_159) / (4 + 1 + 4 * 64 + 4 * 64)
"""Stored over raw bytes of the token ids, loss mask and top-k ids and log-probs: the same
lossless cache's 28,350 B/token in all minus its hidden states, over 517 raw bytes (top-64,
float32)."""

TOPK_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class MeasuredRate:
    """An extraction rate measured on one GPU: tokens per second from first batch to last commit."""

    shape: str
    """What was measured, for the report."""
    config: dict[str, Any]
    """The target's config fields (a Qwen3Config) whose forward cost the rate is scaled from."""
    sample_tokens: int
    """Length of the measured samples (sets the attention share of the forward)."""
    tokens_per_s: float
    """Tokens per second per GPU, steady state (start-up not included)."""
    gpu: str
    """The GPU it ran on."""


EXTRACTION_RATES = (
    MeasuredRate(
        shape="Qwen3-8B",
        config=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
        sample_tokens=2048, tokens_per_s=27_870, gpu="H200"),
)
"""Measured rates; BENCHMARKS_LOG.md "One write path: the writer thread with the zarrs codec pipeline"
(median of write path (b), 400 x 2048 tokens, layers 1,9,17,25,33, top-64, bf16)."""


# ----------------------------------------------------------------------------- bytes


@dataclass(frozen=True)
class SizeEstimate:
    """Expected bytes on disk per token of a cache, by part."""

    codec: "HiddenCodec"
    """How the hidden states are stored."""
    hidden_raw_bf16: int
    """Raw bf16 bytes of one token's hidden states (the reference every ratio is quoted against)."""
    hidden_encoded: int
    """Bytes of one token's hidden states before the lossless stage (payload + scales for lossy codecs)."""
    hidden_ratio: float
    """Measured stored/encoded ratio of the lossless stage for this codec."""
    ratio_measured_at: str
    """The codec settings of that measurement."""
    other_raw: int
    """Raw bytes of one token's ids, mask and top-k."""

    @property
    def hidden_per_token(self) -> float:
        return self.hidden_encoded * self.hidden_ratio

    @property
    def other_per_token(self) -> float:
        return self.other_raw * SMALL_ARRAYS_RATIO

    @property
    def per_token(self) -> float:
        return self.hidden_per_token + self.other_per_token

    def total(self, tokens: int, samples: int = 0) -> int:
        """Bytes of ``tokens`` tokens in ``samples`` samples (offsets and source rows: 16 bytes a sample)."""
        return int(math.ceil(tokens * self.per_token + 16 * samples))

    def as_dict(self) -> dict[str, Any]:
        return {"hidden_codec": self.codec.mode, "codec": self.codec.describe(),
                "hidden_raw_bf16_per_token": self.hidden_raw_bf16, "hidden_encoded_per_token": self.hidden_encoded,
                "hidden_stage_ratio": self.hidden_ratio, "ratio_measured_at": self.ratio_measured_at,
                "hidden_per_token": self.hidden_per_token, "other_raw_per_token": self.other_raw,
                "other_per_token": self.other_per_token, "per_token": self.per_token}


def size_estimate(num_layers: int, hidden_size: int, topk: int, codec: "HiddenCodec | None" = None,
                  topk_dtype: str = "float32") -> SizeEstimate:
    """Expected bytes per token: each array's encoded bytes times its measured lossless-stage ratio
    (lossless bf16 hidden states without ``codec``)."""
    if codec is None:
        from dflash.shared.hidden_codecs import HiddenCodec

        codec = HiddenCodec("bf16")
    if topk_dtype not in TOPK_DTYPE_BYTES:
        raise ValueError(f"top-k dtype {topk_dtype!r}: expected one of {sorted(TOPK_DTYPE_BYTES)}")
    measured_at = codec.mode + (f", {RATIO_MEASURED_AT[codec.mode]}" if codec.mode in RATIO_MEASURED_AT else "")
    return SizeEstimate(
        codec=codec, hidden_raw_bf16=num_layers * hidden_size * 2,
        hidden_encoded=codec.bytes_per_token(num_layers, hidden_size), hidden_ratio=HIDDEN_STAGE_RATIO[codec.mode],
        ratio_measured_at=measured_at, other_raw=4 + 1 + topk * (4 + TOPK_DTYPE_BYTES[topk_dtype]))


# ----------------------------------------------------------------------------- time


def _text_config(model_config):
    get = getattr(model_config, "get_text_config", None)
    return get() if get is not None else model_config


def matmul_parameters(model_config) -> int:
    """Weights of the target's linear layers, LM head included (2 FLOPs each per token), counted on
    a model built on the meta device: no memory, no weights read."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def attention_flops_per_token(model_config, sequence_tokens: int) -> float:
    """Scores and weighted values of causal attention, per token of a sequence of ``sequence_tokens``
    (each token attends to half of it on average): 2 x 2 x heads x head_dim x tokens / 2 per layer."""
    c = _text_config(model_config)
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return 2.0 * c.num_hidden_layers * heads * head_dim * sequence_tokens


@dataclass(frozen=True)
class TimeEstimate:
    """GPU time of a run, scaled from a measured rate by forward FLOPs per token."""

    reference: MeasuredRate
    matmul_parameters: int
    flops_per_token: float
    reference_flops_per_token: float
    tokens_per_s_per_gpu: float
    gpu_hours: float
    gpus: int

    @property
    def wall_hours(self) -> float:
        return self.gpu_hours / self.gpus

    def as_dict(self) -> dict[str, Any]:
        return {"reference": {"shape": self.reference.shape, "gpu": self.reference.gpu,
                              "tokens_per_s": self.reference.tokens_per_s,
                              "sample_tokens": self.reference.sample_tokens,
                              "flops_per_token": self.reference_flops_per_token},
                "matmul_parameters": self.matmul_parameters, "flops_per_token": self.flops_per_token,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "gpu_hours": self.gpu_hours, "gpus": self.gpus,
                "wall_hours": self.wall_hours}


def forward_flops_per_token(model_config, sequence_tokens: int, matmul_params: int | None = None) -> float:
    """2 x the linear layers' weights + causal attention at ``sequence_tokens``."""
    params = matmul_parameters(model_config) if matmul_params is None else matmul_params
    return 2.0 * params + attention_flops_per_token(model_config, sequence_tokens)


def reference_flops(rate: MeasuredRate) -> float:
    from transformers import Qwen3Config

    return forward_flops_per_token(Qwen3Config(**rate.config), rate.sample_tokens)


def time_estimate(model_config, max_length: int, tokens: int, gpus: int) -> TimeEstimate:
    """GPU-hours for ``tokens`` forward tokens (padding included) at the measured rate of the
    reference whose forward cost is nearest, scaled by FLOPs per token at ``max_length``."""
    params = matmul_parameters(model_config)
    flops = forward_flops_per_token(model_config, max_length, params)
    by_rate = [(rate, reference_flops(rate)) for rate in EXTRACTION_RATES]
    rate, ref_flops = min(by_rate, key=lambda r: abs(math.log(r[1] / flops)))
    per_gpu = rate.tokens_per_s * ref_flops / flops
    return TimeEstimate(rate, params, flops, ref_flops, per_gpu, tokens / per_gpu / 3600, max(1, gpus))


# ----------------------------------------------------------------------------- free space


def nearest_existing(path: str) -> str:
    """``path`` or its nearest parent that exists (where the cache's bytes will land)."""
    current = os.path.abspath(path)
    while not os.path.exists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def free_bytes(out: str) -> tuple[int, str] | None:
    """(free bytes, the folder asked) for a local ``out``; None for fsspec URLs, which are not checked."""
    if not is_local(out):
        return None
    where = nearest_existing(out)
    return shutil.disk_usage(where).free, where


def free_space_problem(out: str, needed: int, what: str) -> str | None:
    """A message naming both numbers where ``out``'s free space is below ``needed`` bytes, else None
    (a URL is not checked: logged)."""
    free = free_bytes(out)
    if free is None:
        log.info("%s: free space not checked (an fsspec URL)", out)
        return None
    available, where = free
    if available >= needed:
        return None
    return (f"not enough free space for {out}: {size_text(available)} ({available:,} B) free at {where}, "
            f"{what} needs about {size_text(needed)} ({needed:,} B, an estimate from measured compression ratios). "
            "Free some space, choose another --out, or rerun with --ignore-free-space to start anyway")


def run_space_problem(cfg, spec, planned: dict[int, dict[str, int]], committed: dict[int, Any]) -> str | None:
    """Before a run's workers write: the message where ``cfg.out`` has less free space than the
    estimate of what is left to write (each shard's planned ``tokens``/``samples`` minus its
    ``committed`` counts, so a resumed run needs only the rest), else None."""
    size = size_estimate(spec.num_layers, spec.hidden_size, spec.topk, spec.codec, spec.topk_dtype)
    tokens = sum(max(0, p["tokens"] - (committed[s].tokens if s in committed else 0)) for s, p in planned.items())
    samples = sum(max(0, p["samples"] - (committed[s].samples if s in committed else 0)) for s, p in planned.items())
    needed = size.total(tokens, samples)
    resumed = any(s in committed and committed[s].tokens for s in planned)
    what = f"{'the rest of ' if resumed else ''}this run ({tokens:,} tokens x {size.per_token:,.0f} B/token)"
    problem = free_space_problem(cfg.out, needed, what)
    if problem is None and is_local(cfg.out):
        log.info("%s: %s free, %s needs about %s (an estimate)", cfg.out, size_text(free_bytes(cfg.out)[0]), what,
                 size_text(needed))
    return problem
