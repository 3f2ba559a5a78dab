"""Where the demo's decoding time goes: greedy against speculative decoding with the
drafter's context recomputed every block and kept incrementally, interleaved prompt by
prompt in one process (the machine is shared: compare ratios, not milliseconds), on the
held-out turns a finished demo folder evaluates.

    python bench/demo_decode.py --out demo_out [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import click
import torch


def heldout_prompts(out: Path) -> list[list[int]]:
    """Every assistant turn's prompt of the demo's held-out samples (as ``demo.step_eval``)."""
    from dflash.eval import demo
    from dflash.shared.cache import CacheReader
    from dflash.train.replay import turn_spans

    settings = demo.DemoSettings(**json.loads((out / "summary.json").read_text())["settings"])
    reader = CacheReader(str(out / "cache.zarr"))
    prompts = []
    for index in demo.heldout_samples(out / "cache.zarr", settings):
        sample = reader[index]
        ids = sample["input_ids"].tolist()
        prompts += [ids[:a] for a, _ in turn_spans(sample["loss_mask"].tolist())]
    return prompts


@click.command()
@click.option("--out", "out", default="demo_out", type=click.Path(exists=True, file_okay=False))
@click.option("--rounds", default=3, show_default=True, help="Passes over all prompts; medians are reported.")
@click.option("--threads", default=1, show_default=True, help="torch intra-op threads.")
@click.option("--max-new-tokens", default=96, show_default=True)
def main(out: str, rounds: int, threads: int, max_new_tokens: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.eval.speculative import DFlashProposer, check_lossless, greedy_generate, load_drafter, \
        speculative_generate
    from dflash.eval.toy_tokenizer import IM_END

    torch.set_num_threads(threads)
    out = Path(out)
    prompts = heldout_prompts(out)
    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    eos = [AutoTokenizer.from_pretrained(out / "target").convert_tokens_to_ids(IM_END)]
    drafter, _ = load_drafter(out / "export", dtype=torch.float32)
    proposers = {"recomputed": DFlashProposer(drafter, target, incremental=False),
                 "incremental": DFlashProposer(drafter, target)}
    greedy_generate(target, prompts[0], 4, eos)  # warm-up
    for proposer in proposers.values():
        speculative_generate(target, proposer, prompts[0], 16, eos)
    ratios: dict[str, list[float]] = {name: [] for name in proposers}
    per_block: dict[str, list[float]] = {name: [] for name in proposers}
    per_token: list[float] = []
    for _ in range(rounds):
        seconds = dict.fromkeys(["greedy", *proposers], 0.0)
        tokens, blocks = 0, dict.fromkeys(proposers, 0)
        for prompt in prompts:
            greedy = greedy_generate(target, prompt, max_new_tokens, eos)
            seconds["greedy"] += greedy.seconds
            tokens += len(greedy.tokens)
            for name, proposer in proposers.items():
                spec = speculative_generate(target, proposer, prompt, max_new_tokens, eos)
                check_lossless(spec.tokens, greedy.tokens, greedy.margins)
                seconds[name] += spec.seconds
                blocks[name] += len(spec.block_taus)
        per_token.append(seconds["greedy"] / tokens * 1e3)
        for name in proposers:
            ratios[name].append(seconds["greedy"] / seconds[name])
            per_block[name].append(seconds[name] / blocks[name] * 1e3)
    tau = (tokens - len(prompts)) / blocks["incremental"]
    print(f"{out}: {len(prompts)} prompts, {tokens} tokens, tau {tau:.3f}, {threads} thread(s), {rounds} rounds; "
          f"greedy {statistics.median(per_token):.2f} ms/token")
    for name in proposers:
        print(f"  {name:12s} {statistics.median(per_block[name]):.2f} ms/block, speedup vs greedy "
              f"{statistics.median(ratios[name]):.2f}x (rounds: {', '.join(f'{r:.2f}' for r in ratios[name])})")


if __name__ == "__main__":
    main()
