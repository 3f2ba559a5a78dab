"""Online speculative decoding (dflash.eval.speculative): lossless against plain greedy,
KV-crop / accept bookkeeping with perfect proposals, loud failure on a mismatch, and the
export / checkpoint loading paths. Tiny random target from tests/toy_target.py, CPU only."""

from __future__ import annotations

import time

import pytest
import torch

from dflash.eval import speculative as spec
from dflash.train.model import DFlashDrafter, DrafterConfig

MAX_NEW = 24
BLOCK = 4
LAYERS = [0, 2]  # of the 4-layer toy target; id i = HF hidden_states[i + 1]
CAPACITY = 640  # context positions a proposer here keeps (the longest context below has 600)


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="module")
def drafter_config(target, tokenizer):
    return DrafterConfig.from_target_config(
        target.config, LAYERS, tokenizer.convert_tokens_to_ids("<|MASK|>"), block_size=BLOCK, num_hidden_layers=2
    )


@pytest.fixture(scope="module")
def drafter(drafter_config):
    torch.manual_seed(0)
    return DFlashDrafter(drafter_config).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ["What is 17 + 25?", "Reverse the word 'maple'.", "Sort these numbers: [4, 9, 1]."]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=False) for t in texts]
    return [tokenizer(c, add_special_tokens=False)["input_ids"] for c in chats]


class PerfectProposer:
    """Proposes the target's own greedy continuation: every block must be fully accepted."""

    def __init__(self, prompt, continuation, block_size):
        self.sequence = list(prompt) + list(continuation)
        self.block_size = block_size
        self.target_layer_ids = LAYERS

    def propose(self, context, tokens, position):
        assert context.shape[1] == position == len(tokens) - 1
        assert self.sequence[: len(tokens)] == list(tokens), "loop handed over tokens that are not greedy"
        want = self.sequence[position + 1: position + self.block_size]
        return torch.tensor(want, dtype=torch.long)


def test_speculative_equals_greedy_untrained_drafter(target, drafter, prompts):
    result = spec.evaluate(target, drafter, prompts, max_new_tokens=MAX_NEW, warmup=False)
    overall = result["overall"]
    assert overall["lossless"] and overall["prompts"] == len(prompts)
    assert overall["new_tokens"] == len(prompts) * MAX_NEW  # the toy target never says eos this early
    for row in result["per_prompt"]:
        greedy = spec.greedy_generate(target, prompts[row["index"]], MAX_NEW)
        assert row["tokens"] == greedy.tokens
        assert sum(row["tau_histogram"]) == row["blocks"]
        assert row["target_forwards"] == 1 + row["blocks"]
    assert 1.0 <= overall["tau"] < 1.5  # random init: (almost) everything rejected
    assert overall["tau_histogram"][0] >= 0.5 * overall["blocks"]
    assert overall["greedy_target_forwards"] == overall["new_tokens"]
    assert overall["speedup"] > 0 and result["settings"]["block_size"] == BLOCK


def test_perfect_proposals_accept_whole_blocks(target, prompts):
    """Full acceptance exercises the paths rejection never reaches: cropping nothing,
    appending B context positions at once, emitting B tokens per forward."""
    for prompt in prompts:
        reference = spec.greedy_generate(target, prompt, MAX_NEW + BLOCK).tokens
        proposer = PerfectProposer(prompt, reference, BLOCK)
        out = spec.speculative_generate(target, proposer, prompt, MAX_NEW)
        assert out.tokens == reference[:MAX_NEW]
        # every block emits B tokens, the last one what max_new_tokens leaves it
        full, rest = divmod(MAX_NEW - 1, BLOCK)
        assert out.block_taus == [BLOCK] * full + [rest] * (rest > 0)
        # 1 token from prefill, then B per verify forward
        assert out.target_forwards == 1 + -(-(MAX_NEW - 1) // BLOCK)


def test_partial_acceptance(target, prompts):
    """A proposer right for the first slot only: tau == 2 every block (but a cut last one), output still greedy."""
    prompt = prompts[0]
    reference = spec.greedy_generate(target, prompt, MAX_NEW + BLOCK).tokens

    class HalfRight(PerfectProposer):
        def propose(self, context, tokens, position):
            drafts = super().propose(context, tokens, position)
            drafts[1:] = (drafts[1:] + 1) % target.config.vocab_size  # slot 1 right, slots 2.. wrong
            return drafts

    out = spec.speculative_generate(target, HalfRight(prompt, reference, BLOCK), prompt, MAX_NEW)
    assert out.tokens == reference[:MAX_NEW]
    assert out.block_taus == [2] * ((MAX_NEW - 1) // 2) + [1] * ((MAX_NEW - 1) % 2)  # the last cut by max_new_tokens


def test_block_time_split_into_its_parts(target, prompts):
    """A proposal's time goes to "proposal" and nowhere else; the parts add up to the decode's seconds, and the
    report's block split in greedy steps adds up to a block's time."""
    prompt = prompts[0]
    reference = spec.greedy_generate(target, prompt, MAX_NEW + BLOCK).tokens

    class Slow(PerfectProposer):
        def propose(self, context, tokens, position):
            time.sleep(0.02)
            return super().propose(context, tokens, position)

    out = spec.speculative_generate(target, Slow(prompt, reference, BLOCK), prompt, MAX_NEW)
    blocks = len(out.block_taus)
    assert set(out.parts) == {"prefill", "proposal", "verify", "loop"} and min(out.parts.values()) >= 0
    assert sum(out.parts.values()) == pytest.approx(out.seconds)
    assert out.parts["proposal"] >= 0.02 * blocks > out.parts["verify"] + out.parts["loop"] - 0.02 * blocks
    greedy = spec.greedy_generate(target, prompt, MAX_NEW)
    steps = spec._summary([out], [greedy], BLOCK)["block_in_greedy_steps"]
    assert sum(steps.values()) * greedy.seconds / len(greedy.tokens) * blocks == pytest.approx(out.seconds)


def test_eos_stops_both_decoders(target, prompts):
    prompt = prompts[1]
    reference = spec.greedy_generate(target, prompt, MAX_NEW).tokens
    eos = reference[5]  # pretend the 6th greedy token is an end-of-sequence token
    stop = reference.index(eos) + 1
    greedy = spec.greedy_generate(target, prompt, MAX_NEW, [eos])
    fast = spec.speculative_generate(target, PerfectProposer(prompt, reference + [0] * BLOCK, BLOCK), prompt,
                                     MAX_NEW, [eos])
    assert greedy.tokens == fast.tokens == reference[:stop]
    # the perfect proposer's tokens after eos are accepted by verification but not output: not counted
    assert 1 + sum(fast.block_taus) == len(fast.tokens)


def _value_tensors(cache):
    if hasattr(cache, "layers"):
        return [layer.values for layer in cache.layers]
    return list(cache.value_cache)


def test_broken_kv_crop_is_caught_by_position_check(target, drafter, prompts, monkeypatch):
    """Injected bug: rejected drafts stay in the KV cache. The loop notices at once."""
    monkeypatch.setattr(spec.EagerTarget, "crop", lambda self, keep: None)
    with pytest.raises(RuntimeError, match="KV cache holds"):
        spec.speculative_generate(target, spec.DFlashProposer(drafter, target, CAPACITY), prompts[0], MAX_NEW)


def test_corrupted_kv_cache_raises_lossless_error(target, drafter, prompts, monkeypatch):
    """Injected bug of the right length but wrong content (the crop keeps stale values
    for the newest position): only the token-for-token check can see it."""
    real_crop = spec.EagerTarget.crop

    def bad_crop(self, keep):
        real_crop(self, keep)
        for values in _value_tensors(self.cache):
            values[..., -1, :] = 0.0

    monkeypatch.setattr(spec.EagerTarget, "crop", bad_crop)
    with pytest.raises(spec.LosslessError, match="differs from greedy"):
        spec.evaluate(target, drafter, prompts, max_new_tokens=MAX_NEW, warmup=False)


def test_mismatch_raises_lossless_error(target, drafter, prompts, monkeypatch):
    real = spec.speculative_generate

    def off_by_one(*args, **kwargs):
        out = real(*args, **kwargs)
        out.tokens[7] = (out.tokens[7] + 1) % target.config.vocab_size
        return out

    monkeypatch.setattr(spec, "speculative_generate", off_by_one)
    with pytest.raises(spec.LosslessError, match="new token 7"):
        spec.evaluate(target, drafter, prompts[:1], max_new_tokens=MAX_NEW, warmup=False)
    result = spec.evaluate(target, drafter, prompts[:1], max_new_tokens=MAX_NEW, warmup=False, check=False)
    assert result["overall"]["lossless"] is False


def test_divergence_at_a_logit_tie_is_counted_not_raised(target, drafter, prompts, monkeypatch):
    """Two LM-head rows made equal give exact ties: a speculative decode that takes the other
    tied token at the first of them is counted as a tie; a divergence at a clear margin still raises."""
    import copy

    tied = copy.deepcopy(target)
    j = spec.greedy_generate(tied, prompts[0], MAX_NEW).tokens[7]
    k = (j + 1) % tied.config.vocab_size
    with torch.no_grad():  # an LM head of its own (the toy's may be tied to the input embedding), row k = row j
        head = torch.nn.Parameter(tied.get_output_embeddings().weight.clone())
        head[k] = head[j]
        tied.get_output_embeddings().weight = head
    greedy = spec.greedy_generate(tied, prompts[0], MAX_NEW)
    ties = [i for i, t in enumerate(greedy.ties) if t]
    assert ties and ties == [i for i, m in enumerate(greedy.margins) if m == 0.0]  # fp32: a tie is exact
    at, clear = ties[0], next(i for i, t in enumerate(greedy.ties) if not t)
    plain = spec.evaluate(tied, drafter, prompts[:1], max_new_tokens=MAX_NEW, warmup=False)["per_prompt"][0]
    assert plain["lossless"] and not plain["tie"]  # both decoders break an exact tie alike (argmax)
    real = spec.speculative_generate

    def diverging_at(index, token):
        def run(*args, **kwargs):
            out = real(*args, **kwargs)
            out.tokens[index] = token(out.tokens[index])
            return out
        return run

    monkeypatch.setattr(spec, "speculative_generate", diverging_at(at, lambda t: j + k - t))  # the other tied token
    result = spec.evaluate(tied, drafter, prompts[:1], max_new_tokens=MAX_NEW, warmup=False)
    row = result["per_prompt"][0]
    assert not row["lossless"] and row["tie"] and f"new token {at} " in row["mismatch"]
    assert row["greedy_margins"] == greedy.margins[:at + 1]  # only where greedy took the speculative tokens
    assert result["overall"]["lossless"] is True and result["overall"]["ties"] == 1
    monkeypatch.setattr(spec, "speculative_generate",
                        diverging_at(clear, lambda t: (t + 1) % tied.config.vocab_size))
    with pytest.raises(spec.LosslessError, match=f"new token {clear} "):
        spec.evaluate(tied, drafter, prompts[:1], max_new_tokens=MAX_NEW, warmup=False)

def test_crop_cache_keeps_prefix(target, prompts):
    session, n = spec.EagerTarget(target), len(prompts[0])
    with torch.inference_mode():
        session.forward(prompts[0])
        cache = session.cache
        keys_before = [layer.keys.clone() for layer in cache.layers] if hasattr(cache, "layers") else None
        session.crop(n - 3)
        assert session.length == n - 3
        if keys_before is not None:
            for layer, before in zip(session.cache.layers, keys_before):
                assert torch.equal(layer.keys, before[..., : n - 3, :])
        session.crop(n - 3)  # no-op
        assert session.length == n - 3
        with pytest.raises(ValueError):
            session.crop(n)


def test_exported_drafter_gives_same_outputs(target, drafter, drafter_config, prompts, tmp_path):
    from dflash.train.export import export_drafter

    export_drafter(drafter, drafter_config, tmp_path / "export", dtype=torch.float32)
    loaded, config = spec.load_drafter(tmp_path / "export")
    assert config == drafter_config
    a = spec.evaluate(target, drafter, prompts[:2], max_new_tokens=MAX_NEW, warmup=False)
    b = spec.evaluate(target, loaded, prompts[:2], max_new_tokens=MAX_NEW, warmup=False)
    for ra, rb in zip(a["per_prompt"], b["per_prompt"]):
        assert ra["tokens"] == rb["tokens"] and ra["tau_histogram"] == rb["tau_histogram"]
    # and the proposals themselves, not just the (target-determined) output
    ctx = torch.randn(1, 5, len(LAYERS) * drafter_config.hidden_size)
    pa = spec.DFlashProposer(drafter, target, CAPACITY).propose(ctx, [1, 2, 3, 4, 5, 6], 5)
    pb = spec.DFlashProposer(loaded, target, CAPACITY).propose(ctx, [1, 2, 3, 4, 5, 6], 5)
    assert torch.equal(pa, pb)


def test_drafter_from_run_folder_latest_checkpoint(target, drafter, drafter_config, tmp_path):
    from safetensors.torch import save_file

    import json

    for step, scale in [(10, 0.5), (20, 1.0)]:
        folder = tmp_path / "run" / "checkpoints" / f"step_{step:06d}"
        folder.mkdir(parents=True)
        save_file({k: (v * scale).contiguous() for k, v in drafter.state_dict().items()},
                  str(folder / "model.safetensors"))
        (folder / "state.json").write_text(json.dumps({"step": step, "drafter_config": drafter_config.to_dict()}))
    loaded, config = spec.load_drafter(tmp_path / "run")
    assert config == drafter_config
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name  # step 20 (scale 1), not step 10


def test_incompatible_drafter_is_refused(target, tokenizer):
    from transformers import Qwen3Config

    other = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    cfg = DrafterConfig.from_target_config(other, LAYERS, 3, block_size=BLOCK, num_hidden_layers=1)
    with pytest.raises(ValueError, match="hidden size: the drafter has 32, the target 64"):
        spec.DFlashProposer(DFlashDrafter(cfg), target, CAPACITY)


# ---------------------------------------------------------------------------- CLI


def test_load_prompts_cuts_at_last_user_turn(tokenizer, tmp_path):
    import json

    from dflash.eval.cli import load_prompts

    rows = [
        {"messages": [{"role": "user", "content": "a?"}, {"role": "assistant", "content": "b."},
                      {"role": "user", "content": "c?"}, {"role": "assistant", "content": "d."}]},
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"prompt": "a bare prompt"},
        {"text": "plain text prefix"},
        {"conversations": [{"role": "user", "content": "role/content under conversations"}]},
        {"conversations": [{"from": "human", "value": "ShareGPT question"}]},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_prompts(str(path), tokenizer)
    render = lambda msgs: tokenizer(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                                    add_special_tokens=False)["input_ids"]
    assert got[0] == render(rows[0]["messages"][:3])
    assert got[1] == render(rows[1]["messages"])
    assert got[2] == render([{"role": "user", "content": "a bare prompt"}])
    assert got[3] == tokenizer("plain text prefix")["input_ids"]
    assert got[4] == render(rows[4]["conversations"])
    assert got[5] == render([{"role": "user", "content": "ShareGPT question"}])
    assert len(load_prompts(str(path), tokenizer, limit=2)) == 2


def test_cli_end_to_end_and_exit_status(tiny_target_dir, drafter, drafter_config, chats_sample_path, tmp_path,
                                        monkeypatch):
    import json

    from click.testing import CliRunner

    from dflash.eval.cli import cli
    from dflash.train.export import export_drafter

    export_drafter(drafter, drafter_config, tmp_path / "export")
    args = ["--target", str(tiny_target_dir), "--drafter", str(tmp_path / "export"), "--prompts",
            f"chats={chats_sample_path}", "--limit", "2", "--spec-sample", "2", "--max-new-tokens", "8",
            "--json", str(tmp_path / "report.json")]
    ok = CliRunner().invoke(cli, args)
    assert ok.exit_code == 0, ok.output
    assert "tau histogram" in ok.output
    sample = lambda: json.loads((tmp_path / "report.json").read_text())["benchmarks"]["chats"]["sample"]
    assert sample()["overall"]["lossless"] and sample()["overall"]["prompts"] == 2  # every prompt decoded for real

    real = spec.speculative_generate

    def corrupt(*a, **k):
        out = real(*a, **k)
        out.tokens[-1] += 1
        return out

    monkeypatch.setattr(spec, "speculative_generate", corrupt)
    bad = CliRunner().invoke(cli, args)
    assert bad.exit_code == 1
    assert "LOSSLESS CHECK FAILED" in bad.output
    assert sample()["overall"]["lossless"] is False


class Recording:
    """Wraps a proposer and keeps (context, tokens before the anchor) of every block."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []
        self.block_size, self.target_layer_ids = inner.block_size, inner.target_layer_ids

    def propose(self, context, tokens, position):
        self.seen.append((context.clone(), list(tokens[:position])))
        return self.inner.propose(context, tokens, position)


def test_drafter_context_is_the_targets_hidden_states(target, drafter, prompts):
    """Every block's context == HF hidden_states[i + 1] of a fresh full forward over all
    positions < p: checks the layer-id convention and the append-after-verify bookkeeping,
    with rejections (random drafter) and with whole blocks accepted (perfect proposer)."""
    reference = spec.greedy_generate(target, prompts[2], MAX_NEW + BLOCK).tokens
    for inner in (spec.DFlashProposer(drafter, target, CAPACITY), PerfectProposer(prompts[2], reference, BLOCK)):
        proposer = Recording(inner)
        spec.speculative_generate(target, proposer, prompts[2], MAX_NEW)
        assert len(proposer.seen) > 1
        for context, prefix in proposer.seen[-3:]:
            with torch.inference_mode():
                states = target(input_ids=torch.tensor([prefix]), output_hidden_states=True).hidden_states
            want = torch.cat([states[i + 1] for i in LAYERS], dim=-1)
            torch.testing.assert_close(context, want, rtol=1e-4, atol=1e-5)


class FullRecompute(spec.DFlashProposer):
    """The reference proposer: the training forward over the whole context with the decoding block's dense mask."""

    @torch.inference_mode()
    def block_logits(self, context, tokens, position):
        from dflash.train import attention

        B, ctx_len = self.block_size, context.shape[1]
        block_embeds = self.embed(torch.tensor([[tokens[-1]] + [self.config.mask_token_id] * (B - 1)]))
        mask = attention.dense_mask(torch.tensor([[position]]), torch.ones(1, 1, dtype=torch.bool),
                                    torch.tensor([ctx_len]), ctx_len, B)
        hidden = self.drafter(context, torch.arange(ctx_len), block_embeds, torch.arange(position, position + B), mask)
        return self.lm_head(hidden[0, 1:].to(self.lm_head.weight.dtype))


def test_incremental_drafter_context_equals_full_recompute(target, drafter, drafter_config):
    """The kept per-layer context keys/values (only new positions computed per block, a window of B or a prompt's
    at once) give the logits of the training forward over the whole context: blocks after 1, 3 and 21 new
    positions, and after a reset a shorter context and an equally long but different one."""
    full = FullRecompute(drafter, target, CAPACITY)
    incremental = spec.DFlashProposer(drafter, target, CAPACITY)
    generator = torch.Generator().manual_seed(3)
    features = len(LAYERS) * drafter_config.hidden_size
    first, second = torch.randn(1, 40, features, generator=generator), torch.randn(1, 40, features, generator=generator)
    sequences = [[(first, 5), (first, 6), (first, 9), (first, 30)], [(first, 12)], [(second, 12), (second, 20)],
                 [(first, 21)]]
    for calls in sequences:
        incremental.reset()
        for context, position in calls:
            tokens = list(range(1, position + 2))
            want = full.block_logits(context[:, :position], tokens, position)
            got = incremental.block_logits(context[:, :position], tokens, position)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert incremental._context_len == 21
    with pytest.raises(ValueError, match="context of 7 positions after 21 kept"):  # a shorter one needs a reset
        incremental.block_logits(second[:, :7], list(range(8)), 7)


def test_incremental_and_full_proposers_decode_alike(target, drafter, prompts):
    """Whole decodes: the same tokens and the same accepted lengths block by block; one proposer serves every
    prompt (the decoding loop resets it)."""
    proposer = spec.DFlashProposer(drafter, target, CAPACITY)
    for prompt in prompts:
        a = spec.speculative_generate(target, proposer, prompt, MAX_NEW)
        b = spec.speculative_generate(target, FullRecompute(drafter, target, CAPACITY), prompt, MAX_NEW)
        assert a.tokens == b.tokens and a.block_taus == b.block_taus


# ---------------------------------------------------------------------------- the cheaper step


def test_decoding_paths_equal_training_forward_with_bias_and_without_gqa(drafter_config):
    """The proposer's fused path (``eval.fused_drafter``: fused projections, rope from a table, one
    matmul for every layer's context keys/values) against the training forward over the whole
    context with the decoding block's dense mask: with attention biases and as many key heads
    as query heads, which the default drafters never exercise, at positions past 300; values
    and gradients."""
    from dataclasses import replace

    from dflash.eval import fused_drafter as fused
    from dflash.train import attention

    config = replace(drafter_config, attention_bias=True, num_key_value_heads=drafter_config.num_attention_heads,
                     num_hidden_layers=3)
    torch.manual_seed(1)
    drafter = DFlashDrafter(config).eval()
    with torch.no_grad():
        for module in drafter.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.5)
            if isinstance(module, torch.nn.LayerNorm) or type(module).__name__ == "RMSNorm":
                module.weight.uniform_(0.5, 1.5)
    B, ctx_len, offset = config.block_size, 11, 300
    generator = torch.Generator().manual_seed(5)
    context = torch.randn(1, ctx_len, len(LAYERS) * config.hidden_size, generator=generator)
    embeds = torch.randn(1, B, config.hidden_size, generator=generator)
    context_positions = offset + torch.arange(ctx_len)[None]
    block_positions = offset + ctx_len + torch.arange(B)[None]
    mask = attention.build_mask("dense", anchors=torch.tensor([[ctx_len]]), block_valid=torch.ones(1, 1, dtype=torch.bool),
                                ctx_len=torch.tensor([ctx_len]), context_len=ctx_len, block_size=B)
    want = drafter(context, context_positions, embeds, block_positions, mask)
    weights = fused.DecodingWeights.of(drafter)
    fast = fused.block_forward(drafter, weights, embeds, block_positions,
                               fused.context_kv(drafter, weights, context, context_positions))
    probe = torch.randn(want.shape, generator=generator)
    params = [p for p in drafter.parameters()]
    want_grads = torch.autograd.grad((want * probe).sum(), params, retain_graph=True)
    torch.testing.assert_close(fast, want, rtol=1e-5, atol=1e-5)
    fast_grads = torch.autograd.grad((fast * probe).sum(), params)
    for (name, _), g_want, g_fast in zip(drafter.named_parameters(), want_grads, fast_grads):
        torch.testing.assert_close(g_fast, g_want, rtol=1e-4, atol=1e-5, msg=name)


def test_proposer_buffers_hold_its_capacity_and_refuse_more(target, drafter, drafter_config):
    """Contexts up to ``capacity`` positions give the full forward's logits; one more is refused, and so is a
    capacity that runs past the drafter's positions."""
    proposer, full = spec.DFlashProposer(drafter, target, 600), FullRecompute(drafter, target, CAPACITY)
    features = len(LAYERS) * drafter_config.hidden_size
    context = torch.randn(1, 601, features, generator=torch.Generator().manual_seed(2))
    for position in (3, 200, 600):
        tokens = [7] * (position + 1)
        torch.testing.assert_close(proposer.block_logits(context[:, :position], tokens, position),
                                   full.block_logits(context[:, :position], tokens, position), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="context of 601 positions after 600 kept; the buffers hold 600"):
        proposer.block_logits(context, [7] * 602, 601)
    with pytest.raises(ValueError, match="run past the drafter's max_position_embeddings"):
        spec.DFlashProposer(drafter, target, drafter_config.max_position_embeddings)
