"""Training's offline acceptance estimate (dflash.train.metrics.block_taus) and online
speculative decoding (dflash.eval.speculative) measure the same quantity.

The setup where they must agree: the "cache" is the target's own greedy output (what
regenerated data gives), scored by one deterministic proposer both ways. Online, the
proposer drives real decoding; offline, the sequence is rebuilt as extraction stores it
(prompt, generated turn, then non-assistant tokens after the end of the turn), the
target's top-1 comes from one teacher-forced forward (no KV cache, no speculative code)
and the metric scores the proposer's block at each anchor.

* At the anchors decoding visited, every block's offline tau equals the online one
  exactly: same labels, same bonus token, same end-of-turn and max_new_tokens handling.
* Over anchors drawn uniformly from the turn (what training does), the mean agrees with
  the online mean within three standard errors of the online mean, which on this setup is
  under 10%: the proposer's errors do not depend on where a block starts, so only
  sampling noise and the turn's end separate the two.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dflash.eval import speculative as spec
from dflash.train import metrics

BLOCK = 4
LAYERS = [0, 2]
WRONG = 0.3  # chance that a proposal slot is corrupted


@pytest.fixture(scope="module")
def prompts(tiny_target_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    texts = ["What is 17 + 25?", "Count from 3 to 9.", "Spell the word 'maple'.", "Repeat after me: stone river"]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for t in texts]


class NoisyOracle:
    """Proposes the target's greedy continuation (also past an end-of-turn token), each slot
    corrupted with probability WRONG by a generator keyed on the anchor position: the same
    proposals whenever it is asked at the same anchor, offline or online."""

    def __init__(self, sequence: list[int], vocab: int, seed: int):
        self.sequence, self.vocab, self.seed = list(sequence), vocab, seed
        self.block_size, self.target_layer_ids = BLOCK, LAYERS

    def propose(self, context, tokens, position):
        assert list(tokens) == self.sequence[: position + 1]
        want = torch.tensor(self.sequence[position + 1: position + BLOCK], dtype=torch.long)
        rng = np.random.default_rng([self.seed, position])
        wrong = torch.from_numpy(rng.random(BLOCK - 1) < WRONG)
        return torch.where(wrong, (want + 1) % self.vocab, want)


def _decode(target, prompt, max_new, stop_at, seed):
    """Online: (generated tokens, per-block taus, cached sequence, its assistant mask, proposer)."""
    reference = spec.greedy_generate(target, prompt, max_new + 2 * BLOCK).tokens  # never stops early
    eos = [] if stop_at is None else [reference[stop_at]]
    proposer = NoisyOracle(list(prompt) + reference, target.config.vocab_size, seed)
    out = spec.speculative_generate(target, proposer, prompt, max_new, eos)
    n = len(out.tokens)
    assert out.tokens == reference[:n] and (stop_at is None or n == reference.index(eos[0]) + 1)
    # The cache row: prompt, the turn, then BLOCK tokens that are not the assistant's
    # (the next user turn in a real chat; here the continuation, which the target's top-1
    # and the proposer agree on, so a metric that ignored the turn's end would count them).
    sequence = list(prompt) + reference[: n + BLOCK]
    loss_mask = torch.zeros(len(sequence), dtype=torch.bool)
    loss_mask[len(prompt): len(prompt) + n] = True
    return out, sequence, loss_mask, proposer


def _offline(target, proposer, sequence, loss_mask, anchors, use_mask=True):
    """Per-block offline tau at ``anchors`` with the training metric."""
    ids = torch.tensor([sequence])
    with torch.inference_mode():
        top1 = target(input_ids=ids).logits.argmax(-1)  # (1, T): target's token for position t + 1
    taus = []
    for a in anchors:
        pred = torch.zeros(1, 1, BLOCK, dtype=torch.long)
        pred[0, 0, 1:] = proposer.propose(None, sequence[: a + 1], a)
        tau, counted = metrics.block_taus(pred, top1, torch.tensor([[a]]), torch.tensor([[True]]),
                                          torch.tensor([len(sequence)]), loss_mask[None] if use_mask else None)
        taus.append(int(tau.item()) if counted.item() else None)
    return taus


@pytest.mark.parametrize("stop_at,max_new", [(29, 48), (None, 30)], ids=["eos", "max_new_tokens"])
def test_offline_equals_online_at_the_decoding_anchors(target, prompts, stop_at, max_new):
    online_total = unbounded_total = 0
    for index, prompt in enumerate(prompts):
        out, sequence, loss_mask, proposer = _decode(target, prompt, max_new, stop_at, seed=index)
        assert 1 + sum(out.block_taus) == len(out.tokens)  # every emitted token but the prefill's
        anchors = [len(prompt) + sum(out.block_taus[:i]) for i in range(len(out.block_taus))]
        assert _offline(target, proposer, sequence, loss_mask, anchors) == out.block_taus
        online_total += sum(out.block_taus)
        unbounded_total += sum(_offline(target, proposer, sequence, loss_mask, anchors, use_mask=False))
    # without the turn boundary a last block also counts tokens past the turn's end
    assert unbounded_total > online_total


def test_uniform_anchors_estimate_the_online_mean(target, prompts):
    online, offline = [], []
    for index, prompt in enumerate(prompts):
        out, sequence, loss_mask, proposer = _decode(target, prompt, 300, None, seed=100 + index)
        online += out.block_taus
        turn = torch.nonzero(loss_mask).flatten().tolist()
        taus = _offline(target, proposer, sequence, loss_mask, turn)
        assert taus[-1] is None  # an anchor on the turn's last token starts no block
        offline += [t for t in taus if t is not None]
    online_mean, offline_mean = np.mean(online), np.mean(offline)
    three_se = 3 * np.std(online, ddof=1) / math.sqrt(len(online))
    assert three_se / online_mean < 0.10  # the setup is sharp enough to test the 10% claim
    assert abs(offline_mean - online_mean) < three_se, (offline_mean, online_mean, three_se)
    assert 1.5 < online_mean < BLOCK  # the proposer is neither always right nor always wrong


def test_replay_walk_follows_decoding():
    from dflash.train.replay import turn_spans, walk_blocks

    mask = [0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0]  # turns [2, 8) and [10, 13)
    assert turn_spans(mask) == [(2, 8), (10, 13)]
    taus = {2: 2, 3: 9, 4: 3, 5: 9, 6: 9, 7: 1, 10: 1, 11: 1}  # emitted tokens per anchor
    # turn 1: first token from the prefill, blocks at 2 (2 tokens), 4 (3 tokens): 5 drafted;
    # turn 2: blocks at 10, 11: 2 drafted. Anchors 3, 5, 6, 7 are never visited.
    assert walk_blocks(taus, turn_spans(mask)) == [2, 3, 1, 1]
    # max_new_tokens 4: 3 drafted per turn at most, the block at 4 cut to 1 token
    assert walk_blocks(taus, turn_spans(mask), max_new_tokens=4) == [2, 1, 1, 1]
