"""The decoding replay (dflash.train.replay): training's held-out estimate and
dflash.eval.offline both call it, and both must equal a brute-force reference that
decodes each held-out turn block by block with the drafter's own decoding path
(``context_kv`` + ``forward_cached`` on the cached prefix, one block per call), compares
each slot with the target's top-1 stored in the cache, and advances by what was accepted."""

from __future__ import annotations

import pytest
import torch

import train_helpers as H
from dflash.train.loop import train


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pattern_cache(tmp_path_factory, tiny_target_dir, tiny_tokenizer):
    path = tmp_path_factory.mktemp("pattern") / "cache.zarr"
    return H.write_pattern_cache(path, tiny_target_dir, tiny_tokenizer, samples_per_shard=10)


def brute_force_decoding(reader, samples, drafter, head, mask_token_id):
    """(drafted tokens, blocks) of decoding every assistant turn of ``samples`` from its first
    token, one drafter call per block; no code shared with the replay but the model."""
    B = drafter.config.block_size
    slots = reader.layer_slots(list(drafter.config.target_layer_ids))
    tokens = blocks = 0
    for index in samples:
        s = reader.read(int(index))
        ids, mask = s["input_ids"].tolist(), s["loss_mask"].tolist()
        top1 = s["topk_ids"][:, 0].tolist()  # the target's greedy choice for position t + 1
        context = s["hidden"][:, slots].flatten(1).float()  # (T, n * D)
        turns, t = [], 0
        while t < len(mask):  # runs of assistant tokens
            if mask[t]:
                start = t
                while t < len(mask) and mask[t]:
                    t += 1
                turns.append((start, t))
            else:
                t += 1
        for start, stop in turns:
            position = start  # the turn's first token comes from the prefill
            while position < stop - 1:
                kv = drafter.context_kv(context[None, :position], torch.arange(position)[None])
                block = torch.tensor([[ids[position]] + [mask_token_id] * (B - 1)])
                hidden = drafter.forward_cached(head.embed(block), position + torch.arange(B)[None], kv)
                proposal = head.logits(hidden)[0].argmax(-1).tolist()
                accepted = 0
                for k in range(1, B):
                    if position + k >= stop or proposal[k] != top1[position + k - 1]:
                        break
                    accepted += 1
                emitted = min(accepted + 1, stop - 1 - position)  # the bonus token, never past the turn
                position += emitted
                tokens += emitted
                blocks += 1
    return tokens, blocks


def test_training_and_offline_replay_equal_brute_force_decoding(pattern_cache, tiny_target_dir, tmp_path):
    """Training's held-out tau (every assistant anchor in chunks of max_anchors, padded
    batches, the compiled-shape eval step) and dflash.eval.offline (all anchors in one
    forward per sample) give the brute-force decoding's tokens and blocks exactly."""
    from dflash.eval.offline import replay_export
    from dflash.eval.speculative import load_drafter
    from dflash.shared.cache import CacheReader
    from dflash.train.data import Split
    from dflash.train.model import load_target_head

    cfg = H.tiny_config(pattern_cache, tiny_target_dir, tmp_path / "run", max_steps=20, eval_every=20)
    summary = train(cfg)
    reader = CacheReader(pattern_cache)
    held_out = Split.of(len(reader), cfg.data.eval_samples, reader.source_indices()).held_out.tolist()
    drafter, dcfg = load_drafter(tmp_path / "run", dtype=torch.float32)
    head = load_target_head(tiny_target_dir, "cpu", torch.float32)
    with torch.no_grad():
        tokens, blocks = brute_force_decoding(reader, held_out, drafter.eval(), head, dcfg.mask_token_id)
    offline = replay_export(pattern_cache, held_out, tmp_path / "run", tiny_target_dir, max_length=cfg.max_length)
    trained = summary["eval"]
    assert blocks > len(held_out) and 1 < tokens / blocks < dcfg.block_size  # neither trivial nor perfect
    assert (offline["tokens"], offline["blocks"]) == (tokens, blocks)
    assert trained["tau_blocks"] == blocks
    assert trained["tau"] == pytest.approx(tokens / blocks, rel=1e-12)
    assert offline["tau"] == pytest.approx(tokens / blocks, rel=1e-12)
    assert 1.0 <= trained["tau_uniform"] <= dcfg.block_size and 1.0 <= offline["tau_uniform"] <= dcfg.block_size
