"""The proposer's private fast path: a decoding block is so small that kernel calls cost more than
arithmetic, so projections of one input are one matmul, rope a table, RMSNorm one call."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash.train.model import DFlashDrafter, rope_cos_sin


@dataclass
class DecodingLayer:
    """One drafter layer's weights, projections of the same input in one matrix."""

    input_norm: torch.Tensor  # (D,) input_layernorm
    qkv: torch.Tensor  # ((H + 2 Hkv) hd, D): q_proj, k_proj, v_proj rows
    qkv_bias: torch.Tensor | None  # their biases (attention_bias), else None
    qk_norm: torch.Tensor  # (H + Hkv, hd): q_norm for each query head, then k_norm for each key head
    o: torch.Tensor  # (D, H hd) o_proj
    o_bias: torch.Tensor | None  # o_proj bias, else None
    post_norm: torch.Tensor  # (D,) post_attention_layernorm
    gate_up: torch.Tensor  # (2 F, D): gate_proj, up_proj rows
    down: torch.Tensor  # (D, F) down_proj


@dataclass
class DecodingWeights:
    """The drafter's weights regrouped (copies: take new ones after a change of weights)."""

    layers: list[DecodingLayer]  # per drafter layer
    context_kv: torch.Tensor  # (L * 2 * Hkv * hd, D): k_proj, v_proj rows of layer 0, then layer 1...
    context_kv_bias: torch.Tensor | None  # their biases, else None
    context_k_norm: torch.Tensor  # (L, 1, hd): each layer's k_norm, broadcast over its key heads
    rope_cos: torch.Tensor  # (max_position_embeddings, hd) float32 cos of every position
    rope_sin: torch.Tensor  # (max_position_embeddings, hd) float32 sin, first half negated (rotate_half folded in)
    dtype: torch.dtype  # the drafter's weight dtype

    @classmethod
    def of(cls, drafter: DFlashDrafter) -> "DecodingWeights":
        c = drafter.config
        attn = [layer.self_attn for layer in drafter.layers]

        def rows(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
            biases = torch.cat([lin.bias for lin in linears]) if linears[0].bias is not None else None
            return torch.cat([lin.weight for lin in linears]), biases

        layers = []
        for layer, a in zip(drafter.layers, attn):
            qkv, qkv_bias = rows(a.q_proj, a.k_proj, a.v_proj)
            qk_norm = torch.cat([a.q_norm.weight.expand(a.n_heads, -1), a.k_norm.weight.expand(a.n_kv_heads, -1)])
            layers.append(DecodingLayer(
                input_norm=layer.input_layernorm.weight, qkv=qkv, qkv_bias=qkv_bias, qk_norm=qk_norm,
                o=a.o_proj.weight, o_bias=a.o_proj.bias, post_norm=layer.post_attention_layernorm.weight,
                gate_up=rows(layer.mlp.gate_proj, layer.mlp.up_proj)[0], down=layer.mlp.down_proj.weight))
        context_kv, context_kv_bias = rows(*[lin for a in attn for lin in (a.k_proj, a.v_proj)])
        cos, sin = _rope_table(c.max_position_embeddings, c.head_dim, c.rope_theta, str(drafter.fc.weight.device))
        return cls(layers=layers, context_kv=context_kv, context_kv_bias=context_kv_bias,
                   context_k_norm=torch.stack([a.k_norm.weight for a in attn])[:, None],
                   rope_cos=cos, rope_sin=sin, dtype=drafter.fc.weight.dtype)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (Bsz, T, hd) each
        return self.rope_cos[positions].to(self.dtype), self.rope_sin[positions].to(self.dtype)


@functools.lru_cache(maxsize=8)
def _rope_table(length: int, head_dim: int, theta: float, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_cos_sin`` of positions 0 .. length-1, the sin's first half negated (see ``_rotate``)."""
    with torch.inference_mode(False), torch.no_grad():
        cos, sin = rope_cos_sin(torch.arange(length, device=device)[None], head_dim, theta)
        half = head_dim // 2
        return cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` with a sign-folded sin: rotate_half(x) * sin == roll(x, half) * signed_sin."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm as the model rounds it: normalise in float32, scale in the input dtype."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = torch.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return normed if weight is None else weight * normed


def context_kv(drafter: DFlashDrafter, w: DecodingWeights, context_hidden: torch.Tensor,
               context_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's context keys and values (L, Bsz, Hkv, S, hd), as ``DFlashDrafter.forward`` projects them."""
    c = drafter.config
    eps, n_layers, n_kv, hd = c.rms_norm_eps, c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    ctx = _rms_norm(F.linear(context_hidden.to(w.dtype), drafter.fc.weight), drafter.hidden_norm.weight, eps)
    kv = F.linear(ctx, w.context_kv, w.context_kv_bias).view(*ctx.shape[:-1], n_layers, 2, n_kv, hd)  # k, v per layer
    cos, sin = w.rope(context_positions)  # (Bsz, S, hd)
    keys = _rms_norm(kv[..., 0, :, :], None, eps) * w.context_k_norm  # (Bsz, S, L, Hkv, hd)
    keys = _rotate(keys, cos[:, :, None, None], sin[:, :, None, None])
    return keys.permute(2, 0, 3, 1, 4), kv[..., 1, :, :].permute(2, 0, 3, 1, 4)


def block_forward(drafter: DFlashDrafter, w: DecodingWeights, block_embeds: torch.Tensor,
                  block_positions: torch.Tensor, context_kv: tuple[torch.Tensor, torch.Tensor],
                  context_valid: torch.Tensor | None = None) -> torch.Tensor:
    """``DFlashDrafter.forward`` for one block (Bsz, B, D) over ``context_kv``'s keys and values;
    ``context_valid`` (S,): only those positions are seen."""
    c = drafter.config
    eps, n_heads, n_kv, hd = c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    keys, values = context_kv
    bsz, q_len, _ = block_embeds.shape
    cos, sin = (t[:, :, None] for t in w.rope(block_positions))  # (Bsz, B, 1, hd)
    x = block_embeds.to(w.dtype)
    mask = None if context_valid is None else torch.cat([context_valid, context_valid.new_ones(q_len)])[None]
    for i, layer in enumerate(w.layers):
        qkv = F.linear(_rms_norm(x, layer.input_norm, eps), layer.qkv, layer.qkv_bias).view(bsz, q_len, -1, hd)
        qk = _rotate(_rms_norm(qkv[:, :, :n_heads + n_kv], None, eps) * layer.qk_norm, cos, sin).transpose(1, 2)
        v = qkv[:, :, n_heads + n_kv:].transpose(1, 2)  # (Bsz, Hkv, B, hd)
        k_all = torch.cat([keys[i], qk[:, n_heads:]], dim=2)  # (Bsz, Hkv, S + B, hd)
        v_all = torch.cat([values[i], v], dim=2)
        out = F.scaled_dot_product_attention(qk[:, :n_heads], k_all, v_all, attn_mask=mask, scale=hd**-0.5,
                                             enable_gqa=True)
        x = x + F.linear(out.transpose(1, 2).reshape(bsz, q_len, n_heads * hd), layer.o, layer.o_bias)
        gate, up = F.linear(_rms_norm(x, layer.post_norm, eps), layer.gate_up).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, layer.down)
    return _rms_norm(x, drafter.norm.weight, eps)
