"""DFlash attention mask and backends, checked against a plain-loop reference."""

import os

import pytest
import torch

from dflash.train import attention


def reference_mask(anchors, block_valid, ctx_len, context_len, block_size):
    """The DFlash training-attention rule written out with python loops, independent of mask_mod."""
    bsz, n_blocks = anchors.shape
    q_len = n_blocks * block_size
    out = torch.zeros(bsz, 1, q_len, context_len + q_len, dtype=torch.bool)
    for b in range(bsz):
        for blk in range(n_blocks):
            if not bool(block_valid[b, blk]):
                continue
            for slot in range(block_size):
                q = blk * block_size + slot
                for j in range(context_len):
                    if j < int(anchors[b, blk]) and j < int(ctx_len[b]):
                        out[b, 0, q, j] = True
                for other in range(block_size):
                    out[b, 0, q, context_len + blk * block_size + other] = True
    return out


def random_case(gen, bsz=3, n_blocks=5, context_len=40, block_size=4):
    anchors = torch.zeros(bsz, n_blocks, dtype=torch.long)
    block_valid = torch.zeros(bsz, n_blocks, dtype=torch.bool)
    ctx_len = torch.zeros(bsz, dtype=torch.long)
    for b in range(bsz):
        length = int(torch.randint(block_size + 2, context_len + 1, (1,), generator=gen))
        ctx_len[b] = length
        n_real = int(torch.randint(1, n_blocks + 1, (1,), generator=gen))
        # Sorted, distinct anchors; a dense range forces some closer than block_size.
        pool = torch.randperm(min(length, 12), generator=gen)[:n_real]
        anchors[b, :n_real] = pool.sort().values
        block_valid[b, :n_real] = True
    return anchors, block_valid, ctx_len, context_len, block_size


def test_reference_case_has_close_anchors_and_padding():
    gen = torch.Generator().manual_seed(0)
    anchors, valid, ctx_len, S, B = random_case(gen)
    gaps = [
        int(anchors[b, i + 1] - anchors[b, i])
        for b in range(anchors.shape[0])
        for i in range(anchors.shape[1] - 1)
        if valid[b, i + 1]
    ]
    assert any(g < B for g in gaps), "the case must include anchors closer than B"
    assert (~valid).any() and (ctx_len < S).any()


@pytest.mark.parametrize("seed", range(4))
def test_dense_mask_matches_loop_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    case = random_case(gen)
    got = attention.dense_mask(*case)
    want = reference_mask(*case)
    assert got.shape == want.shape
    assert torch.equal(got, want)


def test_mask_mod_pointwise_matches_reference():
    gen = torch.Generator().manual_seed(7)
    case = random_case(gen, bsz=2, n_blocks=3, context_len=10, block_size=3)
    mod = attention.make_mask_mod(*case)
    want = reference_mask(*case)
    for b in range(2):
        for q in range(want.shape[2]):
            for kv in range(want.shape[3]):
                got = mod(torch.tensor(b), torch.tensor(0), torch.tensor(q), torch.tensor(kv))
                assert bool(got) == bool(want[b, 0, q, kv]), (b, q, kv)


def test_close_anchors_do_not_leak_between_blocks():
    # Anchors 3 and 4 with B=4: their positions overlap, their blocks must not see each other.
    anchors = torch.tensor([[3, 4]])
    valid = torch.tensor([[True, True]])
    mask = attention.dense_mask(anchors, valid, torch.tensor([10]), 10, 4)[0, 0]
    assert not mask[0:4, 10 + 4 : 10 + 8].any()
    assert not mask[4:8, 10 + 0 : 10 + 4].any()
    assert mask[0:4, 10:14].all() and mask[4:8, 14:18].all()
    assert mask[0, :3].all() and not mask[0, 3:10].any()  # strict: context < anchor
    assert mask[4, :4].all() and not mask[4, 4:10].any()


def _random_qkv(gen, mask, heads=4, kv_heads=2, head_dim=8):
    bsz, _, q_len, kv_len = mask.shape
    q = torch.randn(bsz, heads, q_len, head_dim, generator=gen)
    k = torch.randn(bsz, kv_heads, kv_len, head_dim, generator=gen)
    v = torch.randn(bsz, kv_heads, kv_len, head_dim, generator=gen)
    return q, k, v


def _explicit_attention(q, k, v, mask, scale):
    """float64 softmax attention written out, zero for rows that see nothing."""
    rep = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(rep, 1)
    v = v.double().repeat_interleave(rep, 1)
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return probs @ v


def test_dense_attend_matches_explicit_and_zeroes_masked_rows():
    gen = torch.Generator().manual_seed(1)
    case = random_case(gen)
    mask = attention.dense_mask(*case)
    q, k, v = _random_qkv(gen, mask)
    q.requires_grad_(True)
    out = attention.attend(q, k, v, mask, scale=0.3)
    want = _explicit_attention(q, k, v, mask, 0.3)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    dead = ~mask.any(-1)  # (Bsz, 1, Q)
    assert dead.any()
    dead_rows = dead.expand(-1, q.shape[1], -1)
    assert (out[dead_rows] == 0).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    assert (q.grad[dead_rows] == 0).all()


@pytest.fixture
def eager_flex():
    attention.allow_uncompiled_flex(True)
    yield
    attention.allow_uncompiled_flex(False)


def _flex_and_dense(seed):
    """(flex output, dense output, dense mask, q) of one random case through both backends."""
    gen = torch.Generator().manual_seed(seed)
    case = random_case(gen)
    dense = attention.build_mask("dense", *case)
    block_mask = attention.build_mask("flex", *case)
    q, k, v = _random_qkv(gen, dense)
    return attention.attend(q, k, v, block_mask, scale=0.25), attention.attend(q, k, v, dense, scale=0.25), dense, q


def test_flex_forward_matches_dense_on_cpu(eager_flex):
    out_flex, out_dense, dense, q = _flex_and_dense(2)
    torch.testing.assert_close(out_flex, out_dense, atol=1e-5, rtol=1e-5)
    dead_rows = (~dense.any(-1)).expand(-1, q.shape[1], -1)
    assert dead_rows.any() and (out_flex[dead_rows] == 0).all()


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DFLASH_SLOW_TESTS"), reason="compiles flex on CPU (3-25 s); set DFLASH_SLOW_TESTS=1")
def test_compiled_flex_forward_matches_dense_on_cpu():
    out_flex, out_dense, _, _ = _flex_and_dense(3)
    torch.testing.assert_close(out_flex, out_dense, atol=1e-5, rtol=1e-5)


def training_case(gen, bsz=2, n_blocks=26, context_len=700, block_size=16):
    """Flex-sized tiles: Q = 416 and KV = 1116 are not multiples of 128; anchors cluster
    (closer than B) and spread; some blocks padded, one sequence shorter than S."""
    anchors = torch.zeros(bsz, n_blocks, dtype=torch.long)
    valid = torch.zeros(bsz, n_blocks, dtype=torch.bool)
    ctx_len = torch.tensor([context_len, context_len - 77])
    for b in range(bsz):
        n_real = n_blocks - 3 * b
        pool = torch.cat([torch.randperm(20, generator=gen)[:6] + 1,
                          torch.randperm(int(ctx_len[b]) - 25, generator=gen)[:n_real - 6] + 21])
        anchors[b, :n_real] = pool.sort().values
        valid[b, :n_real] = True
    return anchors, valid, ctx_len, context_len, block_size


@pytest.mark.parametrize("seed", range(3))
def test_tile_maps_match_a_dense_evaluation_of_the_mask(seed):
    gen = torch.Generator().manual_seed(seed)
    case = training_case(gen)
    T = attention.FLEX_TILE
    any_tile, full_tile = attention.tile_maps(*case)
    dense = reference_mask(*case)[:, 0]  # (Bsz, Q, KV), python loops
    bsz, Q, KV = dense.shape
    nq, nk = -(-Q // T), -(-KV // T)
    padded = torch.zeros(bsz, nq * T, nk * T, dtype=torch.bool)
    padded[:, :Q, :KV] = dense
    exists = torch.zeros_like(padded)
    exists[:, :Q, :KV] = True
    tiles = padded.view(bsz, nq, T, nk, T)
    truth_any = tiles.any(4).any(2)
    truth_full = (tiles | ~exists.view(bsz, nq, T, nk, T)).all(4).all(2) & exists.view(bsz, nq, T, nk, T).all(4).all(2)
    assert torch.equal(any_tile, truth_any)
    assert torch.equal(full_tile, truth_full)  # whole interior tiles; edge tiles are partial
    assert full_tile.any() and (any_tile & ~full_tile).any() and (~any_tile).any()


def test_dflash_block_mask_attention_equals_dense(eager_flex):
    gen = torch.Generator().manual_seed(7)
    case = training_case(gen)
    block_mask = attention.build_mask("flex", *case)
    dense = attention.build_mask("dense", *case)
    assert int(block_mask.full_kv_num_blocks.sum()) > 0  # full tiles skip mask_mod: they must be right
    q, k, v = _random_qkv(gen, dense)
    out_flex = attention.attend(q, k, v, block_mask, scale=0.25)
    out_dense = attention.attend(q, k, v, dense, scale=0.25)
    torch.testing.assert_close(out_flex, out_dense, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_flex_forward_backward_matches_dense_on_cuda():
    gen = torch.Generator().manual_seed(5)
    anchors, valid, ctx_len, S, B = (t.cuda() if torch.is_tensor(t) else t for t in random_case(gen, context_len=64))
    block_mask = attention.build_mask("flex", anchors, valid, ctx_len, S, B)
    dense = attention.build_mask("dense", anchors, valid, ctx_len, S, B)
    q, k, v = (t.cuda().requires_grad_(True) for t in _random_qkv(gen, dense.cpu(), head_dim=16))
    grads = []
    for mask in (block_mask, dense):
        out = attention.attend(q, k, v, mask, scale=0.25)
        out.square().sum().backward()
        grads.append((out.detach(), *(t.grad.clone() for t in (q, k, v))))
        for t in (q, k, v):
            t.grad = None
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
