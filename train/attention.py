"""DFlash training attention: one ``mask_mod``, two backends (flex from the mask's intervals, dense SDPA). Query q of
block q // B sees context keys j < min(anchor, ctx_len) and its own block's keys (by block); padded blocks see none."""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

FLEX_TILE = 128  # flex_attention's default tile (BLOCK_SIZE) for queries and keys

_allow_uncompiled_flex = False


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention)


def allow_uncompiled_flex(allowed: bool = True) -> None:
    """Let ``attend`` run flex eagerly (the full score matrix: tests and debugging only)."""
    global _allow_uncompiled_flex
    _allow_uncompiled_flex = bool(allowed)


def make_mask_mod(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: torch.Tensor, context_len: int,
                  block_size: int):
    """The DFlash flex ``mask_mod``; ctx_len (Bsz,): real context lengths, context_len S: padded."""
    S, B = int(context_len), int(block_size)
    block_valid = block_valid.to(torch.bool)

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // B
        is_ctx = kv_idx < S
        sees_ctx = is_ctx & (kv_idx < anchors[b, block]) & (kv_idx < ctx_len[b])
        sees_own_block = (~is_ctx) & ((kv_idx - S) // B == block)  # ~is_ctx: kv - S < 0 is no block
        return block_valid[b, block] & (sees_ctx | sees_own_block)

    return mask_mod


def dense_mask(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: torch.Tensor, context_len: int,
               block_size: int) -> torch.Tensor:
    """The bool (Bsz, 1, Q, S + Q) mask: ``make_mask_mod`` itself over broadcast index grids."""
    mask_mod = make_mask_mod(anchors, block_valid, ctx_len, context_len, block_size)
    bsz, q_len = anchors.shape[0], anchors.shape[1] * block_size
    kv_len, device = context_len + q_len, anchors.device
    b, h, q_idx, kv_idx = (torch.arange(n, device=device).view([n if d == i else 1 for d in range(4)])
                           for i, n in enumerate((bsz, 1, q_len, kv_len)))
    return mask_mod(b, h, q_idx, kv_idx).expand(bsz, 1, q_len, kv_len)


def build_mask(kind: str, anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: torch.Tensor, context_len: int,
               block_size: int) -> BlockMask | torch.Tensor:
    """The mask for backend ``kind``: "flex" -> BlockMask, "dense" -> bool tensor."""
    return (dense_mask if kind == "dense" else dflash_block_mask)(anchors, block_valid, ctx_len, context_len,
                                                                   block_size)


def tile_maps(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: torch.Tensor, context_len: int,
              block_size: int, tile: int = FLEX_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, full) (Bsz, Qt, Kt): tile pairs with any / only visible pairs, from each row's intervals
    [0, min(anchor, ctx_len)) and [S + nB, S + nB + B); edge tiles are never full."""
    bsz, n_blocks = anchors.shape
    B, S = int(block_size), int(context_len)
    q_len, device, valid = n_blocks * B, anchors.device, block_valid.to(torch.bool)
    kv_len = S + q_len
    ctx_end = torch.where(valid, torch.minimum(anchors, ctx_len[:, None]).clamp(0, S), 0)  # (Bsz, N)
    blk_start = torch.where(valid, S + torch.arange(n_blocks, device=device) * B, kv_len)  # padded: see nothing
    blk_end = torch.where(valid, blk_start + B, kv_len)
    # per query row (Bsz, Q, 1), per key tile (1, 1, K)
    c, s0, s1 = (t.repeat_interleave(B, dim=1)[..., None] for t in (ctx_end, blk_start, blk_end))
    n_q, n_kv = -(-q_len // tile), -(-kv_len // tile)
    k0 = (torch.arange(n_kv, device=device) * tile).view(1, 1, n_kv)
    k1 = torch.clamp(k0 + tile, max=kv_len)
    any_row = (c > k0) | ((s0 < k1) & (s1 > k0))
    full_row = ((c >= k1) | ((s0 <= k0) & (s1 >= k1))) & (k1 - k0 == tile)
    pad = n_q * tile - q_len  # the last query tile's rows past Q see nothing
    any_row, full_row = (torch.cat([t, t.new_zeros(bsz, pad, n_kv)], dim=1).view(bsz, n_q, tile, n_kv)
                         for t in (any_row, full_row))
    return any_row.any(dim=2), full_row.all(dim=2)


def dflash_block_mask(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: torch.Tensor,
                      context_len: int, block_size: int) -> BlockMask:
    """The flex ``BlockMask`` from ``tile_maps``: no compile, no dense grid; partial tiles apply ``mask_mod``."""
    q_len = anchors.shape[1] * int(block_size)
    any_tile, full_tile = tile_maps(anchors, block_valid, ctx_len, context_len, block_size)

    def kv_blocks(tiles):  # (Bsz, Qt, Kt) -> flex's (Bsz, 1, Qt) counts, (Bsz, 1, Qt, Kt) indices listed first
        order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return tiles.sum(-1, dtype=torch.int32)[:, None], order[:, None]

    return BlockMask.from_kv_blocks(*kv_blocks(any_tile & ~full_tile), *kv_blocks(full_tile), BLOCK_SIZE=FLEX_TILE,
                                    mask_mod=make_mask_mod(anchors, block_valid, ctx_len, context_len, block_size),
                                    seq_lengths=(q_len, int(context_len) + q_len))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask | torch.Tensor,
           scale: float) -> torch.Tensor:
    """q (Bsz, H, Q, hd), k/v (Bsz, Hkv, KV, hd) -> (Bsz, H, Q, hd); rows that see no key give exactly 0."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, BlockMask):
        # inside the compiled drafter dynamo lowers flex into the graph (a global would add a guard)
        if torch.compiler.is_compiling():
            return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
        if _allow_uncompiled_flex:  # the "called without torch.compile()" warning is the point
            with warnings.catch_warnings(action="ignore", category=UserWarning):
                return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
        return _compiled_flex_attention()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:  # an explicit repeat: SDPA's enable_gqa rules out the memory-efficient CUDA kernel
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    # rows that see nothing (NaN softmax) see everything, then are zeroed, gradient included
    row_sees_any = mask.any(dim=-1, keepdim=True)  # (Bsz, 1, Q, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~row_sees_any, scale=scale)
    return out * row_sees_any.to(out.dtype)
