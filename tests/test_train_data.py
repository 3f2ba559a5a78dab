"""Fixed-shape batches, keyed anchors, the global-batch sampler, block inputs, metrics."""

from __future__ import annotations

import math
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import zarr

import train_helpers as H
from dflash.shared import cache as C
from dflash.shared.cache import CacheReader
from dflash.shared.fingerprint import tokenizer_fingerprint
from dflash.train import metrics
from dflash.train.config import tiny
from dflash.train.data import (AnchorDataset, Collate, GlobalBatchSampler, Split, draw_anchors, held_out_batches,
                               make_loader, truncate_sample)
from dflash.train.step import StepSpec, block_inputs, block_loss, labels_and_weights


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

    monkeypatch.setattr(D, "_batch_buffer", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype))
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
    a = list(make_loader(ds, batches(), [32, 64], 0, False))
    b = list(make_loader(ds, batches(), [32, 64], 2, False))
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
    # a smaller dataset: the first N training rows by source row, whatever the cache order
    small = Split.of(len(source), 3, source, train_samples=4)
    assert small.train.tolist() == [i for i in range(10) if source[i] < 4]
    assert small.held_out.tolist() == split.held_out.tolist()
    assert Split.of(len(source), 3, source, train_samples=100).train.tolist() == split.train.tolist()
    with pytest.raises(ValueError, match="train_samples must be at least 1, got 0"):  # checked with the config
        tiny().override(train_samples=0).validate()


def test_acceptance_stops_at_the_end_of_the_turn():
    # positions 0..9; the assistant turn is 3..6 (6: its end-of-turn token), 7.. the next user turn
    seq = torch.arange(100, 110)[None]
    top1 = torch.cat([seq[:, 1:], torch.tensor([[0]])], 1)
    mask = torch.zeros(1, 10, dtype=torch.bool)
    mask[0, 3:7] = True
    perfect = lambda a: torch.tensor([[[0, 101 + a, 102 + a, 103 + a]]])  # slot k = token a + k
    T = torch.tensor([10])
    one = lambda a, m: [t.sum() for t in metrics.block_taus(perfect(a), top1, torch.tensor([[a]]),
                                                             torch.tensor([[True]]), T, m)]
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
    tau, counted = metrics.block_taus(pred, top1, anchors, valid, seq_len)
    assert tau.tolist() == [[2 + 1, 1 + 1, 0]] and counted.tolist() == [[True, True, False]]
    # past the end of the sequence nothing is accepted
    tau, _ = metrics.block_taus(torch.tensor([[[0, 17, 5, 5]]]), top1, torch.tensor([[6]]), torch.tensor([[True]]),
                                seq_len)
    assert tau.item() == 2


def test_step_flops_match_a_measured_step():
    """A plain DFlash step measured at 8B dims (BENCHMARKS_LOG.md, stage two): ctx 3072, 512 x 16 blocks,
    182 ms/step at MFU 0.51 of 790 TFLOP/s."""
    from types import SimpleNamespace

    d = SimpleNamespace(hidden_size=4096, intermediate_size=12288, head_dim=128, num_attention_heads=32,
                        num_key_value_heads=8, num_context_layers=5, num_hidden_layers=5)
    pairs = 512 * 16 * (1536 + 16)
    flops = metrics.step_flops(d, 151936, 3072, 512 * 16, pairs)
    assert 0.45 < flops / 0.182 / 790e12 < 0.58


# ---------------------------------------------------------------------------- the target's top-k and labels


def write_topk_cache(path, target_dir, tokenizer, n_samples=12, k=4, seed=0):
    """A cache whose stored top-k is a real distribution (log-softmax of random logits, so a
    tail mass is left out) whose top-1 is NOT the next data token: data and target labels differ."""
    emb = H.target_embedding(target_dir).float()
    V, D = emb.shape
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 40, n_samples)
    spec = C.CacheSpec(layer_ids=[0, 1, 2], hidden_size=D, topk=k, vocab_size=V, num_target_layers=4, max_length=64,
                       truncation="right", chunk_tokens=64,
                       fingerprint={"target": {"name_or_path": str(target_dir)},
                                    "tokenizer": {"hash": tokenizer_fingerprint(tokenizer)["hash"]}})
    root = C.create_or_open_cache(str(path), spec)
    plan = C.ShardPlan(source_index=np.arange(n_samples), lengths=lengths, batches=np.arange(n_samples + 1))
    w = C.ShardWriter(root, 0, plan, spec)
    for b, T in enumerate(lengths):
        ids = rng.integers(10, V, T)
        mask = np.zeros(T, bool)
        mask[3:] = True
        logp = torch.log_softmax(torch.from_numpy(rng.normal(size=(T, V)) * 3), -1)
        values, top = logp.topk(k, dim=-1)
        w.write_batch(b, input_ids=ids.astype(np.int32), loss_mask=mask,
                      hidden=C.bf16_to_bits(emb[ids][:, None, :].expand(T, 3, D).to(torch.bfloat16)),
                      topk_ids=top.numpy().astype(np.int32), topk_logprobs=values.numpy().astype(np.float32))
        w.commit()
    w.finish()
    return path


@pytest.fixture(scope="module")
def topk_cache(tmp_path_factory, tiny_target_dir, tiny_tokenizer):
    return write_topk_cache(tmp_path_factory.mktemp("topk") / "c.zarr", tiny_target_dir, tiny_tokenizer)


def stored(path, field):
    """A stored array of shard 0 read straight from zarr, and the sample offsets."""
    g = zarr.open_group(str(path), mode="r")["shards"]["00000"]
    return np.asarray(g[field][:]), np.asarray(g["offsets"][:])


def test_reader_without_topk_never_opens_those_arrays(topk_cache, tmp_path):
    copy = tmp_path / "c.zarr"
    shutil.copytree(topk_cache, copy)
    for name in ("topk_ids", "topk_logprobs"):
        shutil.rmtree(copy / "shards" / "00000" / name)
    reader = CacheReader(str(copy))
    plain = AnchorDataset(reader, [0, 2], max_length=64, max_anchors=8, seed=0, target_top1=False)
    assert plain.fields == ("input_ids", "loss_mask", "hidden")
    sample = plain[(0, 1)]
    assert "target_top1" not in sample and "topk_logprobs" not in sample
    batch = Collate([32, 64])([sample, plain[(0, 2)], plain.empty_sample()])
    assert not set(batch) & {"target_top1", "topk_ids", "topk_logprobs"}
    with pytest.raises(C.CacheError, match="topk_ids"):
        AnchorDataset(reader, [0, 2], max_length=64, max_anchors=8, seed=0)[(0, 1)]
    with pytest.raises(C.CacheError, match="topk_logprobs"):
        reader.read(1, ("input_ids", "topk_logprobs"))
    with pytest.raises(ValueError, match="unknown cache fields"):
        reader.read(1, ("input_ids", "logits"))


def test_topk_fields_padded_like_the_tokens(topk_cache):
    reader = CacheReader(str(topk_cache))
    ds = AnchorDataset(reader, [0, 2], max_length=64, max_anchors=8, seed=0, topk=True)
    items = [ds[(0, 0)], ds[(0, 3)], ds.empty_sample()]
    batch = Collate([32, 64])(items)
    ids, off = stored(topk_cache, "topk_ids")
    logp, _ = stored(topk_cache, "topk_logprobs")
    T = int(off[4] - off[3])
    assert batch["topk_ids"].shape == (3, 64, 4) and batch["topk_logprobs"].dtype == torch.float32
    assert batch["topk_ids"][1, :T].tolist() == ids[off[3]:off[4]].tolist()
    assert torch.equal(batch["topk_logprobs"][1, :T], torch.from_numpy(logp[off[3]:off[4]]))
    assert (batch["topk_ids"][1, T:] == 0).all()
    assert batch["target_top1"][1, :T].tolist() == ids[off[3]:off[4], 0].tolist()
    cut = truncate_sample(items[1], 10)
    assert cut["topk_ids"].shape == (10, 4) and cut["topk_logprobs"].shape == (10, 4)


def spec_for(**kw):
    return StepSpec("dense", 4, 3, None, 16, None, **kw)


def reference_slot_kl(logits, topk_ids, topk_logprobs, anchors, weights):
    """float64, slot by slot: KL over the top-k stored at anchor + k - 1 plus the tail bucket."""
    total = 0.0
    bsz, n_blocks, B = weights.shape
    for b in range(bsz):
        for n in range(n_blocks):
            for k in range(B):
                w = float(weights[b, n, k])
                if w == 0:
                    continue
                pos = int(anchors[b, n]) + k - 1
                ids, lp = topk_ids[b, pos], topk_logprobs[b, pos].double()
                logq = torch.log_softmax(logits[b, n * B + k].double(), -1)
                r = max(1 - lp.exp().sum().item(), 0.0)
                q_tail = 1 - logq[ids].exp().sum().item()
                total += w * ((lp.exp() * (lp - logq[ids])).sum().item() + (r * math.log(r / q_tail) if r else 0.0))
    return total / float(weights.sum())


def test_kd_reads_the_target_distribution_at_anchor_plus_k_minus_1(topk_cache):
    """A drafter whose logits ARE the target's stored distribution for each slot scores KL 0;
    the loss agrees with a slot-by-slot float64 reference, and reading the top-k one position
    later (or earlier) gives a clearly positive KL."""
    reader = CacheReader(str(topk_cache))
    ds = AnchorDataset(reader, [0, 2], max_length=64, max_anchors=8, seed=0, topk=True)
    batch = Collate([32, 64])([ds[(0, 1)], ds[(0, 4)]])
    V = int(reader.spec.vocab_size)
    head = SimpleNamespace(weight=torch.eye(V))  # hidden row = logits
    spec = spec_for(loss="kd")
    labels, weights = labels_and_weights(batch, spec)

    def logits_from(shift):
        """Per slot, the logits of the target's top-k at anchor + k - 1 + shift, tail spread evenly."""
        bsz, n_blocks = batch["anchors"].shape
        out = torch.zeros(bsz, n_blocks * 4, V, dtype=torch.float64)
        S = batch["topk_ids"].shape[1]
        for b in range(bsz):
            for n in range(n_blocks):
                for k in range(4):
                    pos = min(max(int(batch["anchors"][b, n]) + k - 1 + shift, 0), S - 1)
                    ids, lp = batch["topk_ids"][b, pos], batch["topk_logprobs"][b, pos].double()
                    tail = max(1 - lp.exp().sum().item(), 1e-12)
                    row = torch.full((V,), math.log(tail / (V - len(ids))), dtype=torch.float64)
                    row[ids] = lp
                    out[b, n * 4 + k] = row
        return out.float()

    aligned = block_loss(head, logits_from(0), batch, spec, labels, weights)
    assert aligned.kl.item() < 1e-4
    for shift in (1, -1):
        logits = logits_from(shift)
        out = block_loss(head, logits, batch, spec, labels, weights)
        ref = reference_slot_kl(logits, batch["topk_ids"], batch["topk_logprobs"], batch["anchors"], weights)
        assert out.kl.item() == pytest.approx(ref, rel=1e-4, abs=1e-5)
        assert out.kl.item() > 0.5
    with pytest.raises(ValueError, match="top-k"):
        block_loss(head, logits_from(0), {k: v for k, v in batch.items() if not k.startswith("topk")}, spec,
                   labels, weights)


def test_training_reads_the_top_k_only_for_distillation(topk_cache, tiny_target_dir, tmp_path):
    """CE on data labels trains on a cache without top-k log-probs (kd, the default, refuses it); kd and mix with target
    labels train (the loss is the objective: mix sits between its CE and KL)."""
    copy = tmp_path / "c.zarr"
    shutil.copytree(topk_cache, copy)
    shutil.rmtree(copy / "shards" / "00000" / "topk_logprobs")
    kw = dict(max_steps=2, eval_every=2, save_every=1000, num_workers=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: more threads only contend
    try:
        check_training_runs(copy, topk_cache, tiny_target_dir, tmp_path, kw)
    finally:
        torch.set_num_threads(threads)


def check_training_runs(copy, topk_cache, tiny_target_dir, tmp_path, kw):
    from dflash.train.loop import train

    assert train(H.tiny_config(copy, tiny_target_dir, tmp_path / "ce-no-topk", loss="ce", **kw))["eval"]["loss"] > 0
    with pytest.raises(C.CacheError, match="topk_logprobs"):
        train(H.tiny_config(copy, tiny_target_dir, tmp_path / "kd-missing", loss="kd", **kw))
    runs = {name: train(H.tiny_config(topk_cache, tiny_target_dir, tmp_path / name, loss=name, seed=0,
                                      **kw))["eval"]["loss"] for name in ("ce", "kd", "mix")}
    assert all(math.isfinite(v) and v > 0 for v in runs.values())
    assert min(runs["ce"], runs["kd"]) < runs["mix"] < max(runs["ce"], runs["kd"])


def test_empty_slots_add_nothing_under_kd(reader, tiny_target_dir):
    """The weightless samples that top up an uneven global batch carry zero top-k rows
    (ids 0, log-prob 0): they must add exactly nothing to the KL's loss and gradient."""
    from dflash.train.loop import build_drafter_config, load_target_head, load_target_meta
    from dflash.train.model import DFlashDrafter
    from dflash.train.step import forward_loss

    cfg = H.tiny_config(reader.path, tiny_target_dir, "unused")
    hf_config, tokenizer = load_target_meta(str(tiny_target_dir))
    dcfg = build_drafter_config(cfg, hf_config, tokenizer, reader)
    head = load_target_head(str(tiny_target_dir), torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg)
    ds = AnchorDataset(reader, dcfg.target_layer_ids, 64, 8, seed=0, target_top1=False, topk=True)
    spec = StepSpec("dense", dcfg.block_size, dcfg.mask_token_id, None, 64, None, "kd")
    grads, losses = [], []
    for items in ([ds[(0, 1)]], [ds[(0, 1)], ds.empty_sample()]):
        drafter.zero_grad()
        out = forward_loss(drafter, head, Collate([32, 64])(items), spec, torch.tensor(5.0))
        out.loss.backward()
        losses.append(out.loss)
        grads.append(torch.cat([p.grad.flatten() for p in drafter.parameters()]))
    assert losses[0] > 0 and grads[0].abs().max() > 0
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)  # equal here; rounding may differ by batch
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("layers", [[0, 2], [0, 1, 2]])
def test_preloaded_samples_are_private_copies_of_what_the_loader_reads(topk_cache, layers, monkeypatch):
    """Preloaded span by span, in any order of indices, every sample equals the loader's read of it (the chosen
    layers; all of them: a view of the read) and lies outside every span read: a view would keep its span alive."""
    from dflash.train.data import preload

    spans, read_span = [], CacheReader._read_span  # the spans kept alive here, so no copy can reuse their memory
    monkeypatch.setattr(CacheReader, "_read_span", lambda *a, **k: spans.append(read_span(*a, **k)) or spans[-1])
    reader = CacheReader(str(topk_cache))
    ds = AnchorDataset(reader, layers, max_length=64, max_anchors=8, seed=0, topk=True)
    loaded = AnchorDataset(reader, layers, max_length=64, max_anchors=8, seed=0, topk=True)
    preload([ds], np.arange(len(reader))[::-1].copy(), torch.device("cpu"), progress=False)
    assert sorted(ds.resident) == list(range(len(reader)))
    for index, sample in ds.resident.items():
        expected = loaded.sample(index)
        assert sample.keys() == {k for k, v in expected.items() if torch.is_tensor(v)}, index
        assert all(torch.equal(sample[k], expected[k]) for k in sample), index
        assert not any(a.ctypes.data <= t.data_ptr() < a.ctypes.data + a.nbytes
                       for t in sample.values() for span in spans for a in span.values()), index
    assert spans


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_preloaded_batches_on_the_gpu_equal_the_loaders(topk_cache):
    """Samples preloaded onto the GPU (the loss mask left on the CPU) make the batches the loader copies there,
    bitwise, a weightless top-up slot and an unchosen layer included."""
    from dflash.train.data import preload
    from dflash.train.step import to_device

    cuda, reader = torch.device("cuda"), CacheReader(str(topk_cache))
    keys = [(0, 0), (3, 1), (0, -1), (1, 2)]
    batches = []
    for resident in (False, True):
        ds = AnchorDataset(reader, [2], max_length=64, max_anchors=8, seed=0, topk=True)
        if resident:
            preload([ds], np.arange(len(reader)), cuda, progress=False)
            assert ds.resident[0]["hidden"].is_cuda and not ds.resident[0]["loss_mask"].is_cuda
        batches.append(to_device(Collate([32, 64])([ds[k] for k in keys]), cuda))
    a, b = batches
    assert a.keys() == b.keys() and b["context_hidden"].is_cuda
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
