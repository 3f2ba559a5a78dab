"""The DFlash drafter: a small Qwen3-style decoder whose keys and values also read fused target
hidden states; no embedding or LM head of its own. ``state_dict()`` keys are the export names."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash.shared.layers import check_layer_ids

from . import attention

logger = logging.getLogger(__name__)


@dataclass
class DrafterConfig:
    """Shapes and DFlash settings of one drafter."""

    hidden_size: int  # model width D, equal to the target's
    intermediate_size: int  # SwiGLU inner width, equal to the target's
    num_attention_heads: int  # query heads per layer
    num_key_value_heads: int  # key/value heads per layer (GQA)
    head_dim: int  # width of one attention head
    vocab_size: int  # the target's (padded) vocabulary size
    target_layer_ids: list[int]  # fused as context, ascending, below L-1; i = HF hidden_states[i + 1]
    num_target_layers: int  # number of decoder layers of the target
    mask_token_id: int  # embedding row used for the B - 1 masked block slots
    num_hidden_layers: int = 5  # drafter decoder layers
    block_size: int = 16  # tokens per draft block: anchor + (B - 1) masks
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    rope_theta: float = 1_000_000.0  # RoPE base
    max_position_embeddings: int = 40960  # longest position the drafter is meant for
    attention_bias: bool = False  # bias on q/k/v/o projections (Qwen3: False)
    initializer_range: float = 0.02  # std of the normal init of linear weights

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is outside the target vocabulary "
                             f"[0, {self.vocab_size})")
        check_layer_ids(self.target_layer_ids, self.num_target_layers)  # what serving engines can feed
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size} must be at least 2")
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers={self.num_hidden_layers} must be at least 1")

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_target_config(cls, hf_config: Any, target_layer_ids: list[int], mask_token_id: int,
                           block_size: int = 16, num_hidden_layers: int = 5) -> "DrafterConfig":
        """Size a drafter after a HF Qwen3-like target config (object or plain dict)."""
        c = hf_config if isinstance(hf_config, dict) else hf_config.get_text_config().to_dict()
        for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size"):
            if k not in c:
                raise ValueError(f"target config lacks {k!r}")
        heads = int(c["num_attention_heads"])
        params = c.get("rope_parameters") or c.get("rope_scaling") or {}  # transformers 5 / 4
        if params.get("rope_type", params.get("type", "default")) not in ("default", None):
            logger.warning("target uses rope_type=%r; the drafter implements plain RoPE only", params.get("rope_type"))
        theta = c.get("rope_theta", params.get("rope_theta"))
        return cls(hidden_size=int(c["hidden_size"]), intermediate_size=int(c["intermediate_size"]),
                   num_attention_heads=heads, num_key_value_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads), vocab_size=int(c["vocab_size"]),
                   target_layer_ids=list(target_layer_ids), num_target_layers=int(c["num_hidden_layers"]),
                   mask_token_id=int(mask_token_id), num_hidden_layers=int(num_hidden_layers),
                   block_size=int(block_size), rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                   rope_theta=float(theta if theta is not None else 10000.0),
                   max_position_embeddings=int(c.get("max_position_embeddings", 40960)),
                   attention_bias=bool(c.get("attention_bias", False)),
                   initializer_range=float(c.get("initializer_range", 0.02)))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DrafterConfig":
        """Inverse of ``to_dict``; unknown keys are an error (catches typos)."""
        if unknown := sorted(set(data) - {f.name for f in fields(cls)}):
            raise ValueError(f"unknown DrafterConfig fields: {unknown}")
        return cls(**data)


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in float32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos, sin (Bsz, T, head_dim) of positions (Bsz, T); computed, not a buffer a bf16 cast would blur."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)  # (head_dim / 2,)
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # (Bsz, T, head_dim / 2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (Bsz, H, T, hd); cos/sin (Bsz, T, hd); rotate_half(x) = (-x2, x1)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None].to(x.dtype) + rotated * sin[:, None].to(x.dtype)


class DFlashAttention(nn.Module):
    """Block queries attend to [context ; block] keys; context enters only via k/v_proj."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        D, hd, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(D, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(D, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(D, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, D, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def forward(self, x, ctx, block_rope, kv_rope, attn_mask):
        bsz, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(bsz, q_len, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, *block_rope)  # (Bsz, H, Q, hd)
        h = torch.cat([ctx, x], dim=1)  # keys and values of [context ; block]: (Bsz, Hkv, S + Q, hd)
        k = self.k_norm(self.k_proj(h).view(bsz, h.shape[1], self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(h).view(bsz, h.shape[1], self.n_kv_heads, self.head_dim).transpose(1, 2)
        out = attention.attend(q, apply_rope(k, *kv_rope), v, attn_mask, self.head_dim**-0.5)  # (Bsz, H, Q, hd)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        D, F_ = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(D, F_, bias=False)
        self.up_proj = nn.Linear(D, F_, bias=False)
        self.down_proj = nn.Linear(F_, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x, ctx, block_rope, kv_rope, attn_mask):
        # ctx was normed by the drafter's hidden_norm; only the block stream goes through input_layernorm
        x = x + self.self_attn(self.input_layernorm(x), ctx, block_rope, kv_rope, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """DFlash drafter: fused target context + block embeddings -> block hidden states."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.fc = nn.Linear(config.num_context_layers * D, D, bias=False)
        self.hidden_norm = RMSNorm(D, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, self.config.initializer_range)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def forward(self, context_hidden: torch.Tensor, context_positions: torch.Tensor, block_embeds: torch.Tensor,
                block_positions: torch.Tensor, attn_mask) -> torch.Tensor:
        """Final-normed block hidden states (Bsz, Q, D) from context_hidden (Bsz, S, n*D) and the
        block embeddings (Bsz, Q, D), attn_mask from ``attention.build_mask``."""
        bsz = block_embeds.shape[0]
        block_positions = _batched(block_positions, bsz)
        hd, theta = self.config.head_dim, self.config.rope_theta
        block_rope = rope_cos_sin(block_positions, hd, theta)
        ctx = self.fuse_context(context_hidden)
        kv_rope = rope_cos_sin(torch.cat([_batched(context_positions, bsz), block_positions], dim=1), hd, theta)
        x = block_embeds
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.fc.weight.dtype)
        for layer in self.layers:
            x = layer(x, ctx, block_rope, kv_rope, attn_mask)
        return self.norm(x)

    def fuse_context(self, context_hidden: torch.Tensor) -> torch.Tensor:
        """The target layers' states fused by ``fc`` and normed, (Bsz, S, D)."""
        if (feat := context_hidden.shape[-1]) != self.fc.in_features:
            raise ValueError(f"context_hidden has {feat} features; expected {self.config.num_context_layers}"
                             f" layers x {self.config.hidden_size} = {self.fc.in_features}")
        if not torch.is_autocast_enabled(context_hidden.device.type):
            context_hidden = context_hidden.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(context_hidden))


def _batched(positions: torch.Tensor, bsz: int) -> torch.Tensor:
    return positions.unsqueeze(0).expand(bsz, -1) if positions.dim() == 1 else positions


class TargetHead(nn.Module):
    """The target's frozen embedding and LM head as non-persistent buffers (never optimized or saved)."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None = None):
        super().__init__()
        self.tied = lm_head_weight is None
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("weight", (embed_weight if self.tied else lm_head_weight).detach(), persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.to(self.weight.dtype), self.weight)


_EMBED_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight")
_LM_HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight")


def _find_name(names, preferred, suffix):
    return next((n for n in preferred if n in names), min((n for n in names if n.endswith(suffix)), default=None))


def _tensor_files(target_path: str) -> dict[str, str]:
    """Tensor name -> safetensors file of a checkpoint folder (its index file when there is one)."""
    from safetensors import safe_open

    if os.path.exists(index_file := os.path.join(target_path, "model.safetensors.index.json")):
        return json.load(open(index_file))["weight_map"]
    if not (files := sorted(p for p in os.listdir(target_path) if p.endswith(".safetensors"))):
        raise FileNotFoundError(f"no *.safetensors files in {target_path}")
    name_to_file = {}
    for fname in files:
        with safe_open(os.path.join(target_path, fname), framework="pt") as handle:
            name_to_file.update(dict.fromkeys(handle.keys(), fname))
    return name_to_file


def _read_tensors(target_path: str, name_to_file: dict[str, str], names) -> dict[str, torch.Tensor]:
    """The named tensors, on the CPU, opening each file that holds any of them once."""
    from safetensors import safe_open

    out = {}
    for fname in {name_to_file[n] for n in names}:
        with safe_open(os.path.join(target_path, fname), framework="pt", device="cpu") as handle:
            out.update({n: handle.get_tensor(n) for n in names if name_to_file[n] == fname})
    return out


def load_target_head(target_path: str | os.PathLike, device: str | torch.device = "cpu",
                     dtype: torch.dtype | None = None) -> TargetHead:
    """Only the target's embedding and LM head (the embedding when tied or absent) from its safetensors."""
    target_path = os.fspath(target_path)
    config_file = os.path.join(target_path, "config.json")
    config = json.load(open(config_file)) if os.path.exists(config_file) else {}
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    tied = bool(config.get("tie_word_embeddings", text_config.get("tie_word_embeddings", False)))
    name_to_file = _tensor_files(target_path)
    if (embed_name := _find_name(name_to_file, _EMBED_NAMES, "embed_tokens.weight")) is None:
        raise KeyError(f"no input embedding (embed_tokens.weight) found in {target_path}")
    head_name = None if tied else _find_name(name_to_file, _LM_HEAD_NAMES, "lm_head.weight")
    if head_name is None and not tied:
        logger.warning("%s: no lm_head tensor and tie_word_embeddings is false; using the embedding", target_path)
    tensors = _read_tensors(target_path, name_to_file, [n for n in (embed_name, head_name) if n is not None])
    embed, head = (tensors[n].to(dtype or tensors[n].dtype).to(device) if n else None for n in (embed_name, head_name))
    if head is not None and head.shape != embed.shape:
        raise ValueError(f"lm_head {tuple(head.shape)} and embedding {tuple(embed.shape)} shapes differ")
    return TargetHead(embed, head).requires_grad_(False)


@torch.no_grad()
def init_from_target_layers(drafter: DFlashDrafter, target_path: str | os.PathLike, layer_ids: list[int]) -> None:
    """Copy target decoder layer ``layer_ids[i]`` into drafter layer i and the target's final norm."""
    target_path, n_layers = os.fspath(target_path), drafter.config.num_hidden_layers
    if len(layer_ids) != n_layers:
        raise ValueError(f"init_from_target_layers has {len(layer_ids)} ids {list(layer_ids)}, but the drafter has "
                         f"{n_layers} layers: give one target layer per drafter layer")
    n_target = drafter.config.num_target_layers
    if bad := [j for j in layer_ids if not 0 <= int(j) < n_target]:
        raise ValueError(f"init_from_target_layers {list(layer_ids)}: ids {bad} are not layers of the target "
                         f"{target_path} (it has {n_target}: 0..{n_target - 1})")
    name_to_file = _tensor_files(target_path)
    sources: dict[str, str] = {}  # drafter state name -> target tensor name
    for i, j in enumerate(layer_ids):
        q_name = f"layers.{int(j)}.self_attn.q_proj.weight"
        if (anchor := _find_name(name_to_file, (f"model.{q_name}", f"model.language_model.{q_name}"),
                                 f".{q_name}")) is None:
            raise KeyError(f"{target_path}: no tensor for decoder layer {j} (layers.{j}.self_attn.q_proj.weight)")
        prefix = anchor[: -len("self_attn.q_proj.weight")]
        sources.update({f"layers.{i}.{name}": prefix + name for name, _ in drafter.layers[i].named_parameters()})
    norm = _find_name(name_to_file, ("model.norm.weight", "model.language_model.norm.weight"), ".norm.weight")
    if norm is None:
        raise KeyError(f"{target_path}: no final norm (model.norm.weight)")
    sources["norm.weight"] = norm
    for name, source in list(sources.items()):
        if source not in name_to_file and name.endswith(("q_norm.weight", "k_norm.weight")):
            del sources[name]  # a Llama-style target has no q/k norms: the drafter's stay at their identity init
        elif source not in name_to_file:
            raise KeyError(f"{target_path}: drafter weight {name} needs {source}, which the checkpoint lacks")
    params, tensors = dict(drafter.named_parameters()), _read_tensors(target_path, name_to_file, sources.values())
    for name, source in sources.items():
        if tensors[source].shape != params[name].shape:
            raise ValueError(f"{target_path}: {source} is {tuple(tensors[source].shape)}, drafter weight "
                             f"{name} is {tuple(params[name].shape)}")
        params[name].copy_(tensors[source])
