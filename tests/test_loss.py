"""Label alignment (no shift!) and the chunked CE against a float64 full-logits reference."""

import math

import pytest
import torch
import torch.nn.functional as F

from dflash.train import loss as L


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
    correct = (logits.argmax(-1) == labels) & (labels >= 0)
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
    loss, correct = L.chunked_weighted_ce(h, weight, labels, weights, chunk_size=chunk_size)
    (loss * 2.5).backward()
    ref_loss, ref_grad, ref_correct = reference_ce(hidden, weight, labels, weights)
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.grad.double(), 2.5 * ref_grad, atol=1e-6, rtol=1e-5)
    assert torch.equal(correct, ref_correct) and bool(correct[1])
    assert not correct.requires_grad


def test_chunked_ce_all_zero_weights():
    hidden, weight, labels, weights = ce_case(0)
    h = hidden.clone().requires_grad_(True)
    loss, _ = L.chunked_weighted_ce(h, weight, labels, torch.zeros_like(weights), chunk_size=8)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(h.grad, torch.zeros_like(h))


def test_chunked_ce_explicit_denominator_and_no_grad():
    hidden, weight, labels, weights = ce_case(1)
    loss_default, _ = L.chunked_weighted_ce(hidden, weight, labels, weights, chunk_size=10)
    w = torch.where(labels >= 0, weights, torch.zeros(()))
    loss_global, _ = L.chunked_weighted_ce(hidden, weight, labels, weights, chunk_size=10, denominator=2 * w.sum())
    torch.testing.assert_close(loss_global, loss_default / 2)
    with torch.no_grad():
        loss_ng, _ = L.chunked_weighted_ce(hidden.requires_grad_(True), weight, labels, weights)
    torch.testing.assert_close(loss_ng, loss_default)


def test_chunked_ce_bf16_head_close_to_reference():
    hidden, weight, labels, weights = ce_case(2)
    h = hidden.clone().requires_grad_(True)
    loss, _ = L.chunked_weighted_ce(h, weight.bfloat16(), labels, weights, chunk_size=9)
    loss.backward()
    ref_loss, ref_grad, _ = reference_ce(hidden, weight.bfloat16().float(), labels, weights)
    torch.testing.assert_close(loss.double(), ref_loss, atol=5e-2, rtol=2e-2)
    assert h.grad.dtype == torch.float32
    torch.testing.assert_close(h.grad.double(), ref_grad, atol=5e-3, rtol=5e-2)


def test_chunked_ce_refuses_trainable_head():
    hidden, weight, labels, weights = ce_case(3)
    with pytest.raises(ValueError, match="frozen"):
        L.chunked_weighted_ce(hidden, weight.requires_grad_(True), labels, weights)


def test_accuracy_per_slot():
    correct = torch.tensor([[[False, True, False], [False, True, True]]])
    weights = torch.tensor([[[0.0, 1.0, 0.5], [0.0, 1.0, 0.0]]])
    acc = L.accuracy_per_slot(correct, weights)
    assert math.isnan(acc[0]) and acc[1] == 1.0 and acc[2] == 0.0
