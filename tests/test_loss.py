"""Label alignment (no shift!) and the chunked CE against a float64 full-logits reference."""

import math

import pytest
import torch
import torch.nn.functional as F

from dflash.train import loss as L


def weighted_ce(*args, **kwargs):
    """``chunked_block_loss`` as CE only: (loss, per-row argmax-correct flags)."""
    out = L.chunked_block_loss(*args, **kwargs)
    return out.loss, out.correct


# ---------------------------------------------------------------------------- labels


def test_labels_are_same_position_not_shifted():
    T, B = 40, 4
    input_ids = torch.arange(T)[None].repeat(2, 1) + 1000 * torch.arange(2)[:, None]
    loss_mask = torch.ones(2, T, dtype=torch.long)
    anchors = torch.tensor([[0, 3, 10], [5, 6, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    labels, weights = L.block_labels(input_ids, loss_mask, torch.tensor([T, T]), anchors, valid, B)
    assert labels.shape == weights.shape == (2, 3, B)
    for b in range(2):
        for n in range(3):
            if not valid[b, n]:
                continue
            for k in range(1, B):
                assert int(labels[b, n, k]) == 1000 * b + int(anchors[b, n]) + k  # anchor + k
            assert int(labels[b, n, 0]) == L.IGNORE_INDEX and weights[b, n, 0] == 0
    assert (labels[1, 2] == L.IGNORE_INDEX).all() and (weights[1, 2] == 0).all()


def test_weights_decay_and_masks():
    T, B = 12, 8
    input_ids = torch.randint(0, 100, (1, T))
    loss_mask = torch.ones(1, T, dtype=torch.long)
    loss_mask[0, 4] = 0
    anchors = torch.tensor([[2, 7]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    labels, weights = L.block_labels(input_ids, loss_mask, torch.tensor([10]), anchors, valid, B, gamma=4.0)
    w0 = weights[0, 0]
    for k in range(1, B):
        expect = 0.0 if 2 + k == 4 else math.exp(-(k - 1) / 4.0)
        assert w0[k].item() == pytest.approx(expect)
    assert labels[0, 0, 2] == L.IGNORE_INDEX  # position 4 is outside the loss mask
    # block anchored at 7: positions 8, 9 in the sequence (seq_len 10), then past its end
    assert (weights[0, 1, 1:3] > 0).all() and (weights[0, 1, 3:] == 0).all()
    assert (labels[0, 1, 3:] == L.IGNORE_INDEX).all()
    assert torch.equal(labels[0, 1, 1:3], input_ids[0, 8:10])


def test_default_gamma():
    assert L.default_gamma(16) == 7 and L.default_gamma(10) == 5 and L.default_gamma(8) == 4
    assert L.default_gamma(12) == 6
    _, w = L.block_labels(torch.zeros(1, 40, dtype=torch.long), torch.ones(1, 40), torch.tensor([40]),
                          torch.tensor([[0]]), torch.tensor([[True]]), 16)
    assert w[0, 0, 2].item() == pytest.approx(math.exp(-1 / 7))


# ---------------------------------------------------------------------------- chunked CE


def reference_ce(hidden, weight, labels, weights):
    h = hidden.detach().double().requires_grad_(True)
    logits = h @ weight.double().T
    safe = labels.clamp(min=0)
    ce = F.cross_entropy(logits, safe, reduction="none")
    w = torch.where(labels >= 0, weights.double(), torch.zeros((), dtype=torch.float64))
    loss = (w * ce).sum() / w.sum() if w.sum() > 0 else (w * ce).sum() * 0
    loss.backward()
    correct = (logits.argmax(-1) == labels) & (w > 0)  # a row of weight 0 is never scored
    return loss.detach(), h.grad, correct


def ce_case(seed, M=37, D=16, V=53):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, D, generator=gen)
    weight = torch.randn(V, D, generator=gen) * 0.5
    labels = torch.randint(0, V, (M,), generator=gen)
    weights = torch.rand(M, generator=gen)
    labels[::5] = L.IGNORE_INDEX
    weights[::5] = 0.0
    weights[3] = 0.0  # a real label with zero weight
    return hidden, weight, labels, weights


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 37, 1000])
def test_chunked_ce_matches_float64_reference(chunk_size):
    hidden, weight, labels, weights = ce_case(chunk_size)
    # make some rows argmax-correct
    hidden[1] = weight[labels[1]] * 4
    h = hidden.clone().requires_grad_(True)
    loss, correct = weighted_ce(h, weight, labels, weights, chunk_size=chunk_size)
    (loss * 2.5).backward()
    ref_loss, ref_grad, ref_correct = reference_ce(hidden, weight, labels, weights)
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.grad.double(), 2.5 * ref_grad, atol=1e-6, rtol=1e-5)
    assert torch.equal(correct, ref_correct) and bool(correct[1])
    assert not correct.requires_grad


def test_chunked_ce_all_zero_weights():
    hidden, weight, labels, weights = ce_case(0)
    h = hidden.clone().requires_grad_(True)
    loss, _ = weighted_ce(h, weight, labels, torch.zeros_like(weights), chunk_size=8)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(h.grad, torch.zeros_like(h))


def test_chunked_ce_explicit_denominator_and_no_grad():
    hidden, weight, labels, weights = ce_case(1)
    loss_default, _ = weighted_ce(hidden, weight, labels, weights, chunk_size=10)
    w = torch.where(labels >= 0, weights, torch.zeros(()))
    loss_global, _ = weighted_ce(hidden, weight, labels, weights, chunk_size=10, denominator=2 * w.sum())
    torch.testing.assert_close(loss_global, loss_default / 2)
    with torch.no_grad():
        loss_ng, _ = weighted_ce(hidden.requires_grad_(True), weight, labels, weights)
    torch.testing.assert_close(loss_ng, loss_default)


def test_chunked_ce_bf16_head_close_to_reference():
    hidden, weight, labels, weights = ce_case(2)
    h = hidden.clone().requires_grad_(True)
    loss, _ = weighted_ce(h, weight.bfloat16(), labels, weights, chunk_size=9)
    loss.backward()
    ref_loss, ref_grad, _ = reference_ce(hidden, weight.bfloat16().float(), labels, weights)
    torch.testing.assert_close(loss.double(), ref_loss, atol=5e-2, rtol=2e-2)
    assert h.grad.dtype == torch.float32
    torch.testing.assert_close(h.grad.double(), ref_grad, atol=5e-3, rtol=5e-2)


def test_chunked_ce_refuses_trainable_head():
    hidden, weight, labels, weights = ce_case(3)
    with pytest.raises(ValueError, match="frozen"):
        weighted_ce(hidden, weight.requires_grad_(True), labels, weights)


# ---------------------------------------------------------------------------- distillation from the top-k


def target_topk(seed, M, V, k):
    """A target distribution per row, stored as the cache stores it: top-k ids and log-probs
    of a full softmax (so the tail mass 1 - sum(exp) is what the cache leaves out)."""
    gen = torch.Generator().manual_seed(100 + seed)
    logp = torch.log_softmax(torch.randn(M, V, generator=gen, dtype=torch.float64) * 2, -1)
    values, ids = logp.topk(k, dim=-1)
    return ids, values.float()


def reference_block_loss(hidden, weight, labels, weights, ids, logprobs, ce_coef, kd_coef):
    """float64, full logits: CE and the KL between the (top-k + one tail bucket) distributions,
    the tail probability of the drafter summed over every id outside the row's top-k."""
    h = hidden.detach().double().requires_grad_(True)
    logq = torch.log_softmax(h @ weight.double().T, -1)  # (M, V)
    w = torch.where(labels >= 0, weights.double(), torch.zeros((), dtype=torch.float64))
    ce = -logq.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    p = logprobs.double().exp()
    r = (1 - p.sum(-1)).clamp(min=0)
    in_topk = torch.zeros_like(logq, dtype=torch.bool).scatter_(1, ids, True)
    q_tail = logq.exp().masked_fill(in_topk, 0).sum(-1)
    kl = (p * (logprobs.double() - logq.gather(1, ids))).sum(-1) + torch.special.xlogy(r, r) - r * q_tail.log()
    loss = (ce_coef * (w * ce).sum() + kd_coef * (w * kl).sum()) / w.sum()
    loss.backward()
    return loss.detach(), h.grad, (w * ce).sum() / w.sum(), (w * kl).sum() / w.sum()


@pytest.mark.parametrize("chunk_size,ce_coef,kd_coef,k", [(7, 0.0, 1.0, 5), (16, 0.5, 0.5, 5), (1000, 0.0, 1.0, 1),
                                                          (3, 1.0, 0.3, 12)])
def test_kd_matches_float64_reference(chunk_size, ce_coef, kd_coef, k):
    hidden, weight, labels, weights = ce_case(chunk_size + k)
    ids, logprobs = target_topk(chunk_size, hidden.shape[0], weight.shape[0], k)
    h = hidden.clone().requires_grad_(True)
    out = L.chunked_block_loss(h, weight, labels, weights, ids, logprobs, ce_coef, kd_coef, chunk_size)
    (out.loss * 1.5).backward()
    ref_loss, ref_grad, ref_ce, ref_kl = reference_block_loss(hidden, weight, labels, weights, ids, logprobs,
                                                              ce_coef, kd_coef)
    torch.testing.assert_close(out.loss.double(), ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.ce.double(), ref_ce, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.kl.double(), ref_kl, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.grad.double(), 1.5 * ref_grad, atol=1e-6, rtol=1e-4)
    assert ref_kl > 0.05  # the case is not trivially matched


def test_kd_tail_bucket_counts():
    """The KL is zero when the drafter is the target; a drafter that moved the target's tail
    mass into the top-k raises every q_i there, so a KL over the top-k alone would fall below
    zero: only the tail bucket makes it positive."""
    M, V, D, k = 6, 40, 40, 4
    target_logits = torch.randn(M, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logp = torch.log_softmax(target_logits, -1)
    values, ids = logp.topk(k, dim=-1)
    eye = torch.eye(D)  # hidden row = logits
    labels, weights = torch.zeros(M, dtype=torch.long), torch.ones(M)
    same = L.chunked_block_loss(target_logits.float(), eye, labels, weights, ids, values.float(), 0.0, 1.0)
    assert abs(same.kl.item()) < 1e-5
    # the drafter puts the target's tail mass onto its top-1: the top-k-only KL would not see the tail
    moved = target_logits.clone()
    for row in range(M):
        tail = torch.ones(V, dtype=torch.bool)
        tail[ids[row]] = False
        moved[row, tail] = -30.0
    off = L.chunked_block_loss(moved.float(), eye, labels, weights, ids, values.float(), 0.0, 1.0)
    assert off.kl.item() > 0.1


def test_kd_needs_topk_and_no_kd_ignores_it():
    hidden, weight, labels, weights = ce_case(5)
    with pytest.raises(ValueError, match="topk"):
        L.chunked_block_loss(hidden, weight, labels, weights, kd_coef=1.0)
    ids, logprobs = target_topk(5, hidden.shape[0], weight.shape[0], 3)
    plain, _ = weighted_ce(hidden, weight, labels, weights)
    out = L.chunked_block_loss(hidden, weight, labels, weights, ids, logprobs, 1.0, 0.0)
    torch.testing.assert_close(out.loss, plain)
    assert out.kl.item() == 0.0


# ---------------------------------------------------------------------------- the compiled chunk


@pytest.mark.parametrize("chunk_size,ce_coef,kd_coef", [(16, 0.0, 1.0), (10, 1.0, 0.0), (64, 0.5, 0.5)])
def test_compiled_chunks_pad_to_one_shape_and_match_float64(chunk_size, ce_coef, kd_coef):
    """Through torch.compile (dynamo with the eager backend: its graph, the same kernels), the 28 rows of positive
    weight among 37 as 2, 3 or 1 chunks padded to the chunk size: loss, gradient and per-row flags equal the
    float64 reference and the uncompiled path."""
    torch._dynamo.reset()
    hidden, weight, labels, weights = ce_case(4)
    ids, logprobs = target_topk(4, hidden.shape[0], weight.shape[0], 5)
    runs = []
    for backend in (None, "eager"):
        h = hidden.clone().requires_grad_(True)
        out = L.chunked_block_loss(h, weight, labels, weights, ids, logprobs, ce_coef, kd_coef, chunk_size,
                                   backend=backend)
        out.loss.backward()
        runs.append((out, h.grad))
    (plain, plain_grad), (compiled, compiled_grad) = runs
    ref_loss, ref_grad, _, _ = reference_block_loss(hidden, weight, labels, weights, ids, logprobs, ce_coef, kd_coef)
    torch.testing.assert_close(compiled.loss.double(), ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled_grad.double(), ref_grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(compiled.loss, plain.loss)
    torch.testing.assert_close(compiled_grad, plain_grad)
    assert torch.equal(compiled.correct, plain.correct) and compiled.correct.shape == (37,)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_chunks_match_eager_on_cuda():
    """Inductor's fused chunk on the GPU against the uncompiled path, at the small preset's shapes (a bf16 head of
    49,152 rows, KD on the top-64, 4,096-row chunks and a short last one)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    M, D, V, k = 3 * 4096 + 100, 576, 49152, 64
    hidden = torch.randn(M, D, generator=gen).cuda()
    weight = (torch.randn(V, D, generator=gen) * 0.05).bfloat16().cuda()
    labels = torch.randint(0, V, (M,), generator=gen).cuda()
    labels[::7] = L.IGNORE_INDEX
    weights = torch.rand(M, generator=gen).cuda()
    logp = torch.log_softmax(torch.randn(M, V, generator=gen) * 2, -1)
    logprobs, ids = (t.cuda() for t in logp.topk(k, dim=-1))
    runs = []
    for backend in (None, "inductor"):
        h = hidden.clone().requires_grad_(True)
        out = L.chunked_block_loss(h, weight, labels, weights, ids, logprobs, 0.0, 1.0, 4096, backend=backend)
        out.loss.backward()
        runs.append((out, h.grad))
    (plain, plain_grad), (fused, fused_grad) = runs
    torch.testing.assert_close(fused.loss, plain.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_grad, plain_grad, atol=1e-6, rtol=1e-3)
    assert (fused.correct != plain.correct).float().mean() < 1e-3  # argmax may part at a bf16 tie
