"""dflash-eval's replay mode (dflash.eval.replay_eval): the tau it replays from batched greedy
continuations equals real speculative decoding's, token for token and block for block
(float32, tiny target, a tiny drafter trained on the spot so that blocks accept a varying
number of tokens); batched continuations equal unbatched generate(); the report's numbers
follow from its per-prompt records; the CLI's input errors exit != 0 without a traceback."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from dflash.eval import replay_eval as rp
from dflash.eval import speculative as spec
from dflash.train.model import DrafterConfig

BLOCK = 4
LAYERS = [0, 2]
MAX_NEW = 24
TEXTS = ["What is 17 + 25?", "Reverse the word 'maple'.", "Sort these numbers: [4, 9, 1].",
         "Count from 3 to 9.", "Spell the word 'stone'."]


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=False) for t in TEXTS]
    return [tokenizer(c, add_special_tokens=False)["input_ids"] for c in chats]


@pytest.fixture(scope="module")
def eos(target, prompts):
    """A stop token that ends the first prompt's continuation early, while others run to MAX_NEW."""
    reference = spec.greedy_generate(target, prompts[0], MAX_NEW).tokens
    return [reference[MAX_NEW // 2]]


@pytest.fixture(scope="module")
def drafter(target, tokenizer, prompts):
    """A 2-layer drafter fitted for a few seconds to the target's continuations of the prompts:
    its blocks accept anywhere from 1 to BLOCK tokens, so the replay's walk is exercised."""
    from toy_target import fit_drafter

    config = DrafterConfig.from_target_config(target.config, LAYERS, tokenizer.convert_tokens_to_ids("<|MASK|>"),
                                              block_size=BLOCK, num_hidden_layers=2)
    return fit_drafter(target, config, prompts, 2 * MAX_NEW)


@pytest.fixture(scope="module")
def replayed(target, drafter, prompts, eos):
    return rp.replay_benchmark(target, drafter, prompts, max_new_tokens=MAX_NEW, eos_token_ids=eos, batch_size=2)


def test_replay_equals_speculative_decoding(target, drafter, prompts, eos, replayed):
    online = spec.evaluate(target, drafter, prompts, max_new_tokens=MAX_NEW, eos_token_ids=eos, warmup=False)
    for row, rec in zip(online["per_prompt"], replayed["per_prompt"]):
        assert rec["tokens"] == row["tokens"], rec["index"]
        assert rec["block_taus"] == row["block_taus"], rec["index"]
        assert rec["disagreements"] == 0
    assert [r["truncated"] for r in replayed["per_prompt"]][:2] == [False, True]  # the eos and the cap
    taus = [t for r in replayed["per_prompt"] for t in r["block_taus"]]
    assert len(set(taus)) >= 3, taus  # blocks accept different lengths: a shifted context would show
    assert replayed["summary"]["tau"] == pytest.approx(online["overall"]["tau"])


def test_batched_continuations_equal_unbatched_generate(target, prompts, eos):
    batched = rp.greedy_continuations(target, prompts, MAX_NEW, eos, batch_size=3)
    for prompt, (tokens, truncated) in zip(prompts, batched):
        with torch.inference_mode():
            out = target.generate(input_ids=torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                  eos_token_id=eos, pad_token_id=eos[0])
        new = out[0, len(prompt):].tolist()
        assert tokens + ([] if truncated else eos) == new
        assert truncated == (eos[0] not in new)
    assert not all(t for _, t in batched) and any(t for _, t in batched)
    # the static-KV-cache path that CUDA takes by default (batches padded to its rows)
    assert rp.greedy_continuations(target, prompts, MAX_NEW, eos, batch_size=2, static=True) == batched


def test_walked_block_taus_follow_the_walk():
    from dflash.train.replay import walk_blocks

    taus = {2: 2, 3: 9, 4: 3, 5: 9, 6: 9, 7: 1, 10: 1, 11: 1}
    assert walk_blocks(taus, [(2, 8), (10, 13)]) == [2, 3, 1, 1]


def test_report_numbers_follow_from_the_records(target, drafter, prompts, eos, replayed):
    sample = rp.spec_sample(target, drafter, prompts, replayed, 2, max_new_tokens=MAX_NEW, eos_token_ids=eos,
                            warmup=False)
    assert sample["indices"] == [0, 2]
    line = rp.benchmark_line("bench", replayed, sample)
    records = replayed["per_prompt"]
    blocks = sum(len(r["block_taus"]) for r in records)
    drafted = sum(sum(r["block_taus"]) for r in records)
    assert drafted == sum(len(r["tokens"]) - 1 for r in records)  # every token but each prefill's
    assert line["prompts"] == len(prompts) and line["new_tokens"] == sum(len(r["tokens"]) for r in records)
    assert sum(line["tau_histogram"]) == line["blocks"] == blocks
    assert sum(k * n for k, n in enumerate(line["tau_histogram"], start=1)) == drafted
    assert line["tau"] == pytest.approx(drafted / blocks)
    rows = sample["per_prompt"]
    online_taus = [t for r in rows for t in r["block_taus"]]
    assert line["online_tau"] == pytest.approx(sum(online_taus) / len(online_taus))
    greedy_s, spec_s = sum(r["greedy_seconds"] for r in rows), sum(r["spec_seconds"] for r in rows)
    n_new = sum(r["new_tokens"] for r in rows)
    assert line["greedy_tokens_per_s"] == pytest.approx(n_new / greedy_s)
    assert line["spec_tokens_per_s"] == pytest.approx(n_new / spec_s)
    assert line["speedup"] == pytest.approx(greedy_s / spec_s)
    assert line["lossless"] == line["replay_equal"] == line["sample_prompts"] == 2
    assert line["speedup_at_replay_tau"] == pytest.approx(drafted / blocks / sum(line["block_in_greedy_steps"].values()))
    assert all(r["divergence"] is None and r["replay_tau"] == r["tau"] for r in rows)
    table = rp.format_benchmarks([line])
    assert "bench" in table and f"{line['tau']:.2f}" in table and "2/2" in table


def test_speedup_at_replay_tau_is_every_prompts_tau_at_the_samples_block_cost():
    replay = {"summary": dict(prompts=9, new_tokens=90, tau=3.0, blocks=30, tau_histogram=[0, 0, 30], tau_in_repeats=3.0,
                              blocks_in_repeats=30, tau_elsewhere=None)}
    parts = {"prefill": 0.1, "proposal": 0.2, "verify": 1.1, "loop": 0.1}
    sample = {"overall": dict(tau=2.0, greedy_tokens_per_s=100.0, spec_tokens_per_s=130.0, speedup=1.3,
                              block_in_greedy_steps=parts),
              "per_prompt": [dict(lossless=True, tie=False, tokens_equal=True, taus_equal=False)]}
    line = rp.benchmark_line("b", replay, sample)
    assert line["speedup_at_replay_tau"] == pytest.approx(3.0 / 1.5) and line["speedup"] == 1.3
    assert "| 1.30x | 1.50 | 2.00x |" in rp.format_benchmarks([line], markdown=True)
    assert math.isnan(rp.benchmark_line("b", replay, None)["speedup_at_replay_tau"])  # no sample timed


def test_an_online_divergence_from_the_replay_names_the_online_greedy_margin(target, drafter, prompts, eos, replayed):
    """Where the batched replay took another token, the message gives the online 1-token decode's top-2 margin
    there, computed again here by greedy decoding."""
    tampered = copy.deepcopy(replayed)
    tampered["per_prompt"][0]["tokens"][3] += 1
    row = rp.spec_sample(target, drafter, prompts, tampered, 1, max_new_tokens=MAX_NEW, eos_token_ids=eos,
                         warmup=False)["per_prompt"][0]
    margin = spec.greedy_generate(target, prompts[0], MAX_NEW, eos).margins[3]
    assert row["lossless"] and "online vs batched: speculative output differs from greedy at new token 3" in \
        row["divergence"] and f"greedy top-2 logit margin there {margin:.3g})" in row["divergence"]


def test_a_divergence_is_reported_where_it_starts():
    assert rp.first_divergence([2, 3, 1], [2, 3, 1]) is None
    message = rp.first_divergence([2, 3, 1, 4], [2, 2, 2, 4])
    assert message.startswith("block 1 (after 2 drafted tokens)")
    assert rp.sample_indices(10, 3) == [0, 3, 6] and rp.sample_indices(2, 8) == [0, 1]


# ---------------------------------------------------------------------------- command line


@pytest.fixture(scope="module")
def export(drafter, tmp_path_factory):
    from dflash.train.export import export_drafter

    out = tmp_path_factory.mktemp("replay_export") / "export"
    export_drafter(drafter, drafter.config, out)
    return out


def _invoke(args):
    from click.testing import CliRunner

    from dflash.eval.cli import cli

    return CliRunner().invoke(cli, args)


def test_cli_two_benchmarks(tiny_target_dir, export, chats_sample_path, tmp_path):
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"question": t}) + "\n" for t in TEXTS[:3]))
    report = tmp_path / "report.json"
    result = _invoke(["--target", str(tiny_target_dir), "--drafter", str(export), "--prompts",
                      f"chats={chats_sample_path}", "--prompts", str(questions), "--limit", "3",
                      "--max-new-tokens", "8", "--spec-sample", "2", "--capture", "--json", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert list(data["benchmarks"]) == ["chats", "questions"] and data["settings"]["capture"]
    for name in ("chats", "questions"):
        summary = data["benchmarks"][name]["summary"]
        assert summary["prompts"] == 3 and summary["sample_prompts"] == 2 and summary["replay_equal"] == 2
        assert name in result.output
        steps = summary["block_in_greedy_steps"]  # the sample's block split, printed as reported
        assert list(steps) == ["prefill", "proposal", "verify", "loop"]
        assert f"whole block {sum(steps.values()):.2f}, so replay tau runs at " \
               f"{summary['tau'] / sum(steps.values()):.2f}x" in result.output
    assert "online tau" in result.output and "tau histogram" in result.output
    assert data["seconds"]["load"] > 0  # where the command's time went, printed as reported
    for name in ("chats", "questions"):
        s = data["benchmarks"][name]["seconds"]
        assert 0 < s["generate"] + s["forward"] + s["drafter"] <= s["replay"] and 0 <= s["warmup"] < s["decode"]
        assert f"{name} replay {s['replay']:.1f} (generate {s['generate']:.1f}," in result.output


def test_cli_fails_in_float32_when_the_replay_disagrees(tiny_target_dir, export, chats_sample_path, monkeypatch):
    real = rp.score_sample
    monkeypatch.setattr(rp, "score_sample", lambda *a, **k: [t + 1 for t in real(*a, **k)])
    result = _invoke(["--target", str(tiny_target_dir), "--drafter", str(export), "--prompts", str(chats_sample_path),
                      "--limit", "2", "--max-new-tokens", "8", "--spec-sample", "1"])
    assert result.exit_code == 1, result.output
    assert "REPLAY CHECK FAILED: chats_sample prompt 0: block 0" in result.output
    assert "0/1" in result.output  # the table's "= replay" column


@pytest.mark.parametrize("value,needle", [
    ("missing=/nonexistent/prompts.jsonl", "no such file"),
    ("=prompts.jsonl", "NAME=DATA"),
    ("bench=", "NAME=DATA"),
])
def test_cli_bad_prompts_exit_nonzero_without_traceback(tiny_target_dir, export, value, needle):
    result = _invoke(["--target", str(tiny_target_dir), "--drafter", str(export), "--prompts", value])
    assert result.exit_code != 0
    assert needle in result.output and "Traceback" not in result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)


def test_cli_same_name_twice_is_refused(tiny_target_dir, export, chats_sample_path):
    result = _invoke(["--target", str(tiny_target_dir), "--drafter", str(export), "--prompts",
                      f"a={chats_sample_path}", "--prompts", f"a={chats_sample_path}"])
    assert result.exit_code == 2 and "given twice" in result.output


# ---------------------------------------------------------------------------- static KV cache (--capture)


def test_static_cache_decoding_equals_the_eager_path(target, drafter, prompts, eos):
    """``--capture``'s decoders (one StaticTarget: static KV cache, rejected drafts left in
    place and overwritten; on CUDA also CUDA graphs, not run here) give the eager path's
    tokens and block taus, greedy and speculative, over prompts of different lengths."""
    eager = spec.evaluate(target, drafter, prompts, max_new_tokens=MAX_NEW, eos_token_ids=eos, warmup=False)
    session, proposer = spec.captured_decoders(target, drafter, prompts, MAX_NEW)
    static = spec.evaluate(target, proposer, prompts, max_new_tokens=MAX_NEW, eos_token_ids=eos, warmup=True,
                           session=session)
    assert static["overall"]["lossless"] and static["settings"]["capture"]
    for a, b in zip(eager["per_prompt"], static["per_prompt"]):
        assert (a["tokens"], a["block_taus"]) == (b["tokens"], b["block_taus"])
    assert any(t > 1 for r in static["per_prompt"] for t in r["block_taus"])  # some drafts were kept


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_decoders_equal_the_eager_path_on_cuda(target, drafter, prompts, eos):
    """On CUDA ``--capture`` runs the target's decode and verify forwards through torch.compile's CUDA graphs and
    the proposal as one captured graph: float32, they give the eager path's tokens and block taus."""
    import copy

    target, drafter = copy.deepcopy(target).cuda(), copy.deepcopy(drafter).cuda()
    eager = spec.evaluate(target, drafter, prompts, max_new_tokens=MAX_NEW, eos_token_ids=eos, warmup=False)
    session, proposer = spec.captured_decoders(target, drafter, prompts, MAX_NEW)
    assert proposer._capture
    captured = spec.evaluate(target, proposer, prompts, max_new_tokens=MAX_NEW, eos_token_ids=eos, session=session)
    assert captured["overall"]["lossless"] and proposer._graph is not None
    for a, b in zip(eager["per_prompt"], captured["per_prompt"]):
        assert (a["tokens"], a["block_taus"]) == (b["tokens"], b["block_taus"])


def test_static_cache_rejects_running_past_its_length(target, prompts):
    session = spec.StaticTarget(target, len(prompts[0]) + 2)
    spec.greedy_generate(target, prompts[0], 3, session=session)  # prompt + 2 decoded positions: fits
    with pytest.raises(ValueError, match="static KV cache"):
        spec.greedy_generate(target, prompts[0], 4, session=session)  # 3 positions after the prompt


def test_repeat_split_counts_the_blocks_that_start_in_a_verbatim_repeat():
    """Checked against a direct search: a block starts in a repeat where the 8 tokens from its first position
    occur at an earlier start in the continuation."""
    import random

    rng = random.Random(0)
    records = []
    for _ in range(5):
        loop = [rng.randrange(50) for _ in range(rng.randrange(3, 12))]
        tokens = [rng.randrange(50) for _ in range(rng.randrange(0, 30))] + loop * rng.randrange(1, 6)
        taus, left = [], len(tokens)
        while left > 0:
            taus.append(min(left, rng.randrange(1, 9)))
            left -= taus[-1]
        records.append({"tokens": tokens, "block_taus": taus})
    inside, outside = [], []
    for r in records:
        t, position = r["tokens"], 0
        for tau in r["block_taus"]:
            window = t[position:position + 8]
            earlier = len(window) == 8 and any(t[j:j + 8] == window for j in range(position))
            (inside if earlier else outside).append(tau)
            position += tau
    split = rp.repeat_split(records)
    assert inside and outside and split["blocks_in_repeats"] == len(inside)
    assert split["tau_in_repeats"] == pytest.approx(sum(inside) / len(inside))
    assert split["tau_elsewhere"] == pytest.approx(sum(outside) / len(outside))
