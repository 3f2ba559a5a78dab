"""Fixed-shape batches, keyed anchors, the global-batch sampler, block inputs, metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import train_helpers as H
from dflash.shared.cache import CacheReader
from dflash.train import metrics
from dflash.train.data import (AnchorDataset, Collate, GlobalBatchSampler, Split, draw_anchors, held_out_batches,
                               make_loader, truncate_sample)
from dflash.train.step import StepSpec, block_inputs


@pytest.fixture(scope="module")
def reader(tmp_path_factory, tiny_target_dir, tiny_tokenizer):
    path = tmp_path_factory.mktemp("data") / "c.zarr"
    return CacheReader(str(H.write_pattern_cache(path, tiny_target_dir, tiny_tokenizer, n_samples=12,
                                                 samples_per_shard=5)))


def test_anchors_keyed_sorted_and_on_assistant_tokens():
    mask = torch.zeros(40, dtype=torch.bool)
    mask[10:35] = True
    a1, v1 = draw_anchors(mask, 8, seed=0, epoch=1, index=5)
    a2, v2 = draw_anchors(mask, 8, seed=0, epoch=1, index=5)
    a3, _ = draw_anchors(mask, 8, seed=0, epoch=2, index=5)
    assert torch.equal(a1, a2) and torch.equal(v1, v2) and not torch.equal(a1, a3)
    assert v1.all() and torch.all(a1[1:] > a1[:-1]) and mask[a1].all()
    few, valid = draw_anchors(mask[:14], 8, 0, 0, 0)  # candidates 10, 11, 12 only (a <= T-2)
    assert few[valid].tolist() == [10, 11, 12] and valid.sum() == 3 and (few[~valid] == 0).all()


def test_sampler_deals_each_global_batch_once():
    train = np.arange(30)
    single = GlobalBatchSampler(train, 8, 2, 0, 1, seed=3, total_steps=7)
    ranks = [GlobalBatchSampler(train, 8, 2, r, 2, seed=3, total_steps=7) for r in range(2)]
    assert single.steps_per_epoch == 3 and single.accum == 4 and ranks[0].accum == 2
    for step in range(7):
        whole = [k for mb in single.step_batches(step) for k in mb]
        dealt = [k for r in ranks for mb in r.step_batches(step) for k in mb]
        assert len(whole) == 8 and sorted(whole) == sorted(dealt) and len(set(whole)) == 8
        assert {e for e, _ in whole} == {step // 3}
    epoch0 = [i for s in range(3) for mb in single.step_batches(s) for _, i in mb]
    assert len(set(epoch0)) == 24  # no sample twice in an epoch
    resumed = list(GlobalBatchSampler(train, 8, 2, 1, 2, seed=3, total_steps=7, start_step=4))
    assert resumed == list(ranks[1])[4 * 2:]


def test_uneven_world_is_topped_up_with_empty_slots(reader):
    train = np.arange(30)
    ranks = [GlobalBatchSampler(train, 16, 1, r, 3, seed=0, total_steps=2) for r in range(3)]
    assert ranks[0].accum == 6
    keys = [k for r in ranks for mb in r.step_batches(1) for k in mb]
    real = [i for _, i in keys if i >= 0]
    assert len(keys) == 18 and len(real) == 16 and len(set(real)) == 16
    ds = AnchorDataset(reader, [0, 2], max_length=64, max_anchors=8, seed=0)
    empty = Collate([32, 64])([ds[(0, -1)], ds[(0, 0)]])
    assert not empty["block_valid"][0].any() and empty["seq_len"][0] == 1


def test_collate_pads_to_a_bucket(reader):
    ds = AnchorDataset(reader, [0, 2], max_length=64, max_anchors=8, seed=0)
    samples = [ds[(0, i)] for i in range(3)]
    batch = Collate([32, 64])(samples)
    T = [len(s["input_ids"]) for s in samples]
    S = 32 if max(T) <= 32 else 64
    assert batch["context_hidden"].shape == (3, S, 2 * 64) and batch["context_hidden"].dtype == torch.bfloat16
    assert batch["anchors"].shape == (3, 8) and batch["seq_len"].tolist() == T
    assert not batch["loss_mask"][0, T[0]:].any()
    short = truncate_sample(samples[0], 16)
    assert short["input_ids"].shape == (16,) and (short["anchors"][short["block_valid"]] <= 14).all()


@pytest.mark.parametrize("layers", [[0, 2], H.LAYER_IDS])
def test_context_is_the_chosen_layers_then_zeros(reader, monkeypatch, layers):
    # the big buffer is allocated uninitialised: make "uninitialised" NaN so every unwritten element shows
    import dflash.train.data as D

    monkeypatch.setattr(D, "_batch_buffer", lambda shape, dtype: torch.full(shape, float("nan"), dtype=dtype))
    ds = AnchorDataset(reader, layers, max_length=64, max_anchors=8, seed=0)
    idx = [0, 3, 7]
    batch = Collate([32, 64])([ds[(0, i)] for i in idx])
    slots = reader.layer_slots(layers)
    for row, i in enumerate(idx):
        h = reader[i]["hidden"]  # (T, L, D)
        T = h.shape[0]
        want = torch.stack([h[:, s] for s in slots], dim=1).reshape(T, -1)
        assert torch.equal(batch["context_hidden"][row, :T], want)
        assert (batch["context_hidden"][row, T:] == 0).all()


def test_worker_processes_give_the_same_batches(reader):
    ds = AnchorDataset(reader, [0, 2], max_length=64, max_anchors=8, seed=0)
    split = Split.of(len(reader), 2)
    batches = lambda: GlobalBatchSampler(split.train, 4, 2, 0, 1, seed=0, total_steps=3)
    a = list(make_loader(ds, batches(), [32, 64], 0, 2, False))
    b = list(make_loader(ds, batches(), [32, 64], 2, 2, False))
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert held_out_batches(split.held_out, 2, 0, 1) == [[(2**31 - 1, 10), (2**31 - 1, 11)]]


def test_held_out_split_by_source_row_not_cache_order():
    # cache order: two shards, each longest first, so the last samples are short ones
    source = np.array([3, 0, 4, 1, 2, 8, 6, 9, 5, 7])
    split = Split.of(len(source), 3, source)
    assert source[split.held_out].tolist() == [7, 8, 9]  # the dataset's last rows, ascending
    assert sorted(split.train.tolist() + split.held_out.tolist()) == list(range(10))
    assert split.train.tolist() == [i for i in range(10) if source[i] < 7]  # train keeps cache order
    # the same rows whatever the shard layout (worker count) put them in
    other = np.array([9, 8, 7, 6, 5, 4, 3, 2, 1, 0])
    assert sorted(other[Split.of(10, 3, other).held_out].tolist()) == [7, 8, 9]
    assert Split.of(10, 3).held_out.tolist() == [7, 8, 9]  # without sources: the cache's last samples
    with pytest.raises(ValueError):
        Split.of(10, 3, source[:5])


def test_acceptance_stops_at_the_end_of_the_turn():
    # positions 0..9; the assistant turn is 3..6 (6: its end-of-turn token), 7.. the next user turn
    seq = torch.arange(100, 110)[None]
    top1 = torch.cat([seq[:, 1:], torch.tensor([[0]])], 1)
    mask = torch.zeros(1, 10, dtype=torch.bool)
    mask[0, 3:7] = True
    perfect = lambda a: torch.tensor([[[0, 101 + a, 102 + a, 103 + a]]])  # slot k = token a + k
    T = torch.tensor([10])
    one = lambda a, m: metrics.acceptance(perfect(a), top1, torch.tensor([[a]]), torch.tensor([[True]]), T, m)
    assert [one(a, mask)[0].item() for a in (3, 4, 5)] == [3, 2, 1]  # at most the tokens left in the turn
    assert one(6, mask)[1].item() == 0  # anchor on the end-of-turn token: no block
    assert [one(a, None)[0].item() for a in (3, 4, 5, 6)] == [4, 4, 4, 4]  # no mask: runs on past the turn
    # a full block inside the turn keeps its bonus token
    long = torch.zeros(1, 10, dtype=torch.bool)
    long[0, 1:9] = True
    assert one(2, long)[0].item() == 4


def test_block_inputs_anchor_then_masks():
    class Head:
        def embed(self, ids):
            return ids.float()[..., None]

    batch = {"anchors": torch.tensor([[2, 5]]), "input_ids": torch.arange(100, 110)[None]}
    spec = StepSpec("dense", 3, 7, None, 8, None)
    emb, pos = block_inputs(Head(), batch, spec)
    assert emb[0, :, 0].tolist() == [102, 7, 7, 105, 7, 7]
    assert pos[0].tolist() == [2, 3, 4, 5, 6, 7]


def test_acceptance_counts_leading_matches_against_shifted_top1():
    # target_top1[t] is the target's token for position t + 1
    seq = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    top1 = torch.cat([seq[:, 1:], torch.tensor([[0]])], 1)
    anchors, valid, seq_len = torch.tensor([[1, 4, 6]]), torch.tensor([[True, True, False]]), torch.tensor([8])
    pred = torch.tensor([[[0, 12, 13, 99], [0, 15, 99, 17], [0, 17, 0, 0]]])
    tau, blocks = metrics.acceptance(pred, top1, anchors, valid, seq_len)
    assert blocks.item() == 2 and tau.item() == (2 + 1) + (1 + 1)
    # past the end of the sequence nothing is accepted
    tau, _ = metrics.acceptance(torch.tensor([[[0, 17, 5, 5]]]), top1, torch.tensor([[6]]), torch.tensor([[True]]),
                                seq_len)
    assert tau.item() == 2


def test_step_flops_match_design_figure():
    """DESIGN §4: 8B dims, ctx 3072, 512 x 16 blocks, 182 ms/step at MFU 0.51 of 790 TFLOP/s."""
    from types import SimpleNamespace

    d = SimpleNamespace(hidden_size=4096, intermediate_size=12288, head_dim=128, num_attention_heads=32,
                        num_key_value_heads=8, num_context_layers=5, num_hidden_layers=5)
    pairs = 512 * 16 * (1536 + 16)
    flops = metrics.step_flops(d, 151936, 3072, 512 * 16, pairs)
    assert 0.45 < flops / 0.182 / 790e12 < 0.58
