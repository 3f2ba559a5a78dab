"""DFlash training attention: one mask function, two backends.

Layout for one sequence:

    queries  = N blocks x B slots            (q index -> block q // B)
    keys     = [context (S positions) | blocks (N * B)]

A query of block b sees context key j iff ``j < anchor[b]`` and ``j < ctx_len``, and
sees every key of its OWN block (bidirectional inside the block). A padded block sees
nothing. The rule is keyed on block identity, never on positions: blocks whose anchors
are closer than B overlap in position space but must not see each other.

Backends, both from the same ``mask_mod``:

* ``"flex"``: a ``BlockMask`` built from the mask's intervals with plain tensor ops
  (``dflash_block_mask``) and a compiled ``flex_attention`` (training on CUDA);
* ``"dense"``: a boolean ``(Bsz, 1, Q, S + Q)`` tensor fed to SDPA (the CPU path: flex
  has no CPU backward).

The compiled flex_attention is created lazily, at one place, and entered from the main
thread only (torch.compile is not thread-safe).
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

FLEX_TILE = 128
"""flex_attention's default tile (BLOCK_SIZE) for queries and keys."""

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_compiled_flex_attention = None
_allow_uncompiled_flex = False


def require_main_thread(what: str) -> None:
    """Raise unless on the main thread: torch.compile is not thread-safe. Inside a graph being
    traced it does nothing (the eager caller passed it; dynamo cannot trace ``threading``)."""
    if not torch.compiler.is_compiling() and threading.current_thread() is not threading.main_thread():
        raise RuntimeError(f"{what} must run on the main thread (called from {threading.current_thread().name!r}): "
                           "torch.compile is not thread-safe")


def allow_uncompiled_flex(allowed: bool = True) -> None:
    """Let ``attend`` run flex eagerly: it materialises the full score matrix (tens of GB at
    training shapes), so only for tests and debugging, and only when asked for."""
    global _allow_uncompiled_flex
    _allow_uncompiled_flex = bool(allowed)


def _compile_disabled() -> bool:
    """True when torch.compile would silently run eagerly (dynamo disabled)."""
    import torch._dynamo.config as dynamo_config

    return os.environ.get("TORCHDYNAMO_DISABLE", "") not in ("", "0") or bool(dynamo_config.disable)


def _refuse_silent_eager_on_cuda(device: torch.device, what: str) -> None:
    if device.type == "cuda" and _compile_disabled() and not _allow_uncompiled_flex:
        raise RuntimeError(f"{what}: torch.compile is disabled, so flex would run uncompiled on CUDA and "
                           "materialise the full score matrix. Enable compile, use the dense backend, "
                           "or call dflash.train.attention.allow_uncompiled_flex(True) if you mean it.")


def compiled_flex_attention():
    """The process-wide compiled ``flex_attention`` (created on first use)."""
    global _compiled_flex_attention
    require_main_thread("compiled flex_attention")
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention


def make_mask_mod(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: torch.Tensor, context_len: int,
                  block_size: int) -> MaskMod:
    """The DFlash mask as a flex ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    anchors (Bsz, N) long, block_valid (Bsz, N) bool, ctx_len (Bsz,) long: the number of
    real (unpadded) context positions; context_len S is the padded context length.
    """
    if anchors.dim() != 2 or block_valid.shape != anchors.shape:
        raise ValueError(f"anchors and block_valid must both be (Bsz, N); got {tuple(anchors.shape)} "
                         f"and {tuple(block_valid.shape)}")
    if ctx_len.shape != anchors.shape[:1]:
        raise ValueError(f"ctx_len must be (Bsz,)={tuple(anchors.shape[:1])}, got {tuple(ctx_len.shape)}")
    S, B = int(context_len), int(block_size)
    block_valid = block_valid.to(torch.bool)

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // B
        is_ctx = kv_idx < S
        sees_ctx = is_ctx & (kv_idx < anchors[b, block]) & (kv_idx < ctx_len[b])
        # kv - S is negative for context keys; ~is_ctx keeps them out of the block test.
        sees_own_block = (~is_ctx) & ((kv_idx - S) // B == block)
        return block_valid[b, block] & (sees_ctx | sees_own_block)

    return mask_mod


def dense_mask(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: torch.Tensor, context_len: int,
               block_size: int) -> torch.Tensor:
    """The boolean (Bsz, 1, Q, S + Q) mask, evaluated from ``make_mask_mod`` itself over
    broadcast index grids: one definition of who sees whom for both backends."""
    mask_mod = make_mask_mod(anchors, block_valid, ctx_len, context_len, block_size)
    bsz, q_len = anchors.shape[0], anchors.shape[1] * block_size
    kv_len, device = context_len + q_len, anchors.device
    b = torch.arange(bsz, device=device).view(bsz, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q_idx = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    kv_idx = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    return mask_mod(b, h, q_idx, kv_idx).expand(bsz, 1, q_len, kv_len)


def build_mask(kind: str, anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: torch.Tensor, context_len: int,
               block_size: int) -> BlockMask | torch.Tensor:
    """Build the mask for backend ``kind``: "flex" -> BlockMask, "dense" -> bool tensor."""
    if kind == "dense":
        return dense_mask(anchors, block_valid, ctx_len, context_len, block_size)
    if kind != "flex":
        raise ValueError(f"unknown attention backend {kind!r}; expected 'flex' or 'dense'")
    return dflash_block_mask(anchors, block_valid, ctx_len, context_len, block_size)


def tile_maps(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: torch.Tensor, context_len: int,
              block_size: int, tile: int = FLEX_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (query tile, key tile) pairs hold any visible pair, and which hold only visible
    pairs: two (Bsz, n_q_tiles, n_kv_tiles) bool maps, computed from the mask's intervals.

    Query row q (block n = q // B) sees the context interval [0, c) with c = min(anchor_n,
    ctx_len) and its own block's keys [S + nB, S + nB + B), both empty for a padded block.
    A key tile [k0, k1) then holds a visible key of row q iff one interval meets it, and
    is fully visible iff one interval covers it. A tile that crosses the end of the keys or
    of the queries is never called full, so flex evaluates mask_mod there (always exact).
    """
    bsz, n_blocks = anchors.shape
    B, S = int(block_size), int(context_len)
    q_len = n_blocks * B
    kv_len = S + q_len
    device = anchors.device
    valid = block_valid.to(torch.bool)
    ctx_end = torch.where(valid, torch.minimum(anchors, ctx_len[:, None]).clamp(0, S), 0)  # (Bsz, N)
    blk_start = S + torch.arange(n_blocks, device=device) * B  # (N,)
    blk_start = torch.where(valid, blk_start, kv_len)  # padded blocks see nothing
    blk_end = torch.where(valid, blk_start + B, kv_len)
    # per query row (Bsz, Q, 1), per key tile (1, 1, K)
    c = ctx_end.repeat_interleave(B, dim=1)[..., None]
    s0 = blk_start.repeat_interleave(B, dim=1)[..., None]
    s1 = blk_end.repeat_interleave(B, dim=1)[..., None]
    n_kv = -(-kv_len // tile)
    k0 = (torch.arange(n_kv, device=device) * tile).view(1, 1, n_kv)
    k1 = torch.clamp(k0 + tile, max=kv_len)
    any_row = (c > k0) | ((s0 < k1) & (s1 > k0))
    full_row = ((c >= k1) | ((s0 <= k0) & (s1 >= k1))) & (k1 - k0 == tile)
    n_q = -(-q_len // tile)
    pad = n_q * tile - q_len
    if pad:
        any_row = torch.cat([any_row, any_row.new_zeros(bsz, pad, n_kv)], dim=1)
        full_row = torch.cat([full_row, full_row.new_zeros(bsz, pad, n_kv)], dim=1)
    any_tile = any_row.view(bsz, n_q, tile, n_kv).any(dim=2)
    full_tile = full_row.view(bsz, n_q, tile, n_kv).all(dim=2)
    return any_tile, full_tile


def _kv_blocks(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Bsz, Qt, Kt) bool -> flex's (Bsz, 1, Qt) counts and (Bsz, 1, Qt, Kt) indices (listed first)."""
    counts = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None], order[:, None]


def dflash_block_mask(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: torch.Tensor,
                      context_len: int, block_size: int) -> BlockMask:
    """The flex ``BlockMask`` of the DFlash mask, built from ``tile_maps`` with plain tensor
    ops: unlike ``create_block_mask``, nothing compiles and no dense (Q, KV) grid exists.
    Partial tiles still apply ``mask_mod`` inside flex, so the attention is exact."""
    q_len = anchors.shape[1] * int(block_size)
    kv_len = int(context_len) + q_len
    any_tile, full_tile = tile_maps(anchors, block_valid, ctx_len, context_len, block_size)
    partial_n, partial_idx = _kv_blocks(any_tile & ~full_tile)
    full_n, full_idx = _kv_blocks(full_tile)
    mask_mod = make_mask_mod(anchors, block_valid, ctx_len, context_len, block_size)
    return BlockMask.from_kv_blocks(partial_n, partial_idx, full_n, full_idx, BLOCK_SIZE=FLEX_TILE,
                                    mask_mod=mask_mod, seq_lengths=(q_len, kv_len))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask | torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """Attention with q (Bsz, H, Q, hd), k/v (Bsz, Hkv, KV, hd) -> (Bsz, H, Q, hd).

    GQA is handled here (H must be a multiple of Hkv). Query rows that see no key
    (padded blocks) return exactly zero on both backends. ``mask`` None: every query
    sees every key (one decoding block over its whole context).
    """
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    if n_heads % n_kv_heads != 0:
        raise ValueError(f"{n_heads} query heads is not a multiple of {n_kv_heads} kv heads")
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=n_heads != n_kv_heads)
    if isinstance(mask, BlockMask):
        return _attend_flex(q, k, v, mask, scale, enable_gqa=n_heads != n_kv_heads)
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        return _attend_dense(q, k, v, mask, scale)
    raise TypeError(f"mask must be a flex BlockMask or a bool tensor, got {type(mask).__name__}")


def _attend_flex(q, k, v, block_mask, scale, enable_gqa):
    if torch.compiler.is_compiling():
        # inside the compiled drafter, dynamo lowers flex into the drafter's graph; the lazy
        # global would add a guard on it being None, and so a recompile after warm-up
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    if _allow_uncompiled_flex:
        with warnings.catch_warnings():
            # The "called without torch.compile()" warning is the point of the switch.
            warnings.simplefilter("ignore", UserWarning)
            return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    _refuse_silent_eager_on_cuda(q.device, "attend(flex)")
    fn = compiled_flex_attention()
    # flex already returns 0 for rows with no visible key (its normaliser is guarded).
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def _attend_dense(q, k, v, mask, scale):
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        # Explicit repeat: SDPA's enable_gqa rules out the memory-efficient CUDA kernel.
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    # Rows that see nothing would softmax over all -inf (NaN on some backends); let them
    # see everything, then zero their output, which also zeroes their gradient.
    row_sees_any = mask.any(dim=-1, keepdim=True)  # (Bsz, 1, Q, 1)
    safe_mask = mask | ~row_sees_any
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe_mask, scale=scale)
    return out * row_sees_any.to(out.dtype)
