"""Where the demo's decoding time goes: greedy against speculative decoding, interleaved prompt
by prompt in one process (compare ratios, not milliseconds), on the held-out turns of a finished
demo folder, every output checked equal to greedy's; a block's time split into the prefill's
share, the proposal, the verify and the rest of the loop, in greedy steps (the decode's own wall-clock split).
``--clock cpu`` times this process's CPU time (leaves out waiting for a core on a shared machine).

    python bench/demo_decode.py --out demo_out [--rounds 3] [--threads 1] [--clock cpu]
"""

import json
import statistics
import time
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
@click.option("--clock", type=click.Choice(["wall", "cpu"]), default="wall", show_default=True,
              help="wall: time.perf_counter; cpu: time.process_time (this process's CPU time).")
def main(out: str, rounds: int, threads: int, max_new_tokens: int, clock: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.eval import speculative
    from dflash.eval.toy_tokenizer import IM_END

    torch.set_num_threads(threads)
    out = Path(out)
    prompts = heldout_prompts(out)
    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    eos = [AutoTokenizer.from_pretrained(out / "target").convert_tokens_to_ids(IM_END)]
    drafter, _ = speculative.load_drafter(out / "export", dtype=torch.float32)
    now = time.perf_counter if clock == "wall" else time.process_time
    proposer = speculative.DFlashProposer(drafter, target, max(map(len, prompts)) + max_new_tokens)
    speculative.greedy_generate(target, prompts[0], 4, eos)  # warm-up
    speculative.speculative_generate(target, proposer, prompts[0], 16, eos)
    ratios, per_block, per_token, shares = [], [], [], []
    for _ in range(rounds):
        greedy_s = spec_s = 0.0
        tokens = blocks = 0
        specs, greedies = [], []
        for prompt in prompts:
            start = now()
            greedy = speculative.greedy_generate(target, prompt, max_new_tokens, eos)
            greedy_s += now() - start
            tokens += len(greedy.tokens)
            start = now()
            spec = speculative.speculative_generate(target, proposer, prompt, max_new_tokens, eos)
            spec_s += now() - start
            if (mismatch := speculative.mismatch_message(spec.tokens, greedy.tokens, greedy.margins)):
                raise speculative.LosslessError(mismatch)
            blocks += len(spec.block_taus)
            specs.append(spec)
            greedies.append(greedy)
        per_token.append(greedy_s / tokens * 1e3)
        shares.append(speculative.block_parts(specs, greedies, blocks))  # as dflash-eval reports it (wall clock)
        ratios.append(greedy_s / spec_s)
        per_block.append(spec_s / blocks * 1e3)
    tau = (tokens - len(prompts)) / blocks
    print(f"{out}: {len(prompts)} prompts, {tokens} tokens, tau {tau:.3f}, {threads} thread(s), {rounds} rounds, "
          f"{clock} clock; greedy {statistics.median(per_token):.2f} ms/token")
    print(f"  speculative {statistics.median(per_block):.2f} ms/block, speedup vs greedy "
          f"{statistics.median(ratios):.2f}x (rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
    print("  block in greedy steps, median (rounds): " + "; ".join(
        f"{part} {statistics.median(s[part] for s in shares):.2f} ({', '.join(f'{s[part]:.2f}' for s in shares)})"
        for part in shares[0]))


if __name__ == "__main__":
    main()
