"""dflash-eval's replay mode and --capture on a GPU, with the tests' tiny target and a drafter
fitted on the spot: replay vs real speculative decoding prompt by prompt (float32: must be
equal; bfloat16: reported), --capture's tokens and taus vs the eager path's, and the times.

    python bench/replay_eval_gpu.py [--device cuda] [--prompts 24] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    from toy_target import build_qwen3, fit_drafter
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.eval import replay_eval as rp
    from dflash.eval import speculative as spec
    from dflash.eval.toy_tokenizer import build_tokenizer
    from dflash.train.model import DrafterConfig

    tmp = Path(tempfile.mkdtemp())
    build_tokenizer(tmp / "tok", generation_tags=True)
    tokenizer = AutoTokenizer.from_pretrained(tmp / "tok")
    build_qwen3(tmp / "target", tokenizer)
    words = ["maple", "stone", "river", "cloud", "seven", "amber", "north", "quiet"]
    texts = [f"Tell me about {words[i % 8]} and {words[(3 * i + 1) % 8]} ({i})." for i in range(args.prompts)]
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                       tokenize=False), add_special_tokens=False)["input_ids"]
               for t in texts]
    n = args.max_new_tokens
    target32 = AutoModelForCausalLM.from_pretrained(tmp / "target", dtype=torch.float32).to(args.device).eval()
    config = DrafterConfig.from_target_config(target32.config, [0, 2], tokenizer.convert_tokens_to_ids("<|MASK|>"),
                                              block_size=4, num_hidden_layers=2)
    drafter32 = fit_drafter(target32, config, prompts, 2 * n)
    reference = spec.greedy_generate(target32, prompts[0], n).tokens
    eos = [reference[n // 2]]
    for dtype in (torch.float32, torch.bfloat16):
        target, drafter = target32.to(dtype), drafter32.to(dtype)
        t0 = time.perf_counter()
        replay = rp.replay_benchmark(target, drafter, prompts, max_new_tokens=n, eos_token_ids=eos, batch_size=8)
        replay_s = time.perf_counter() - t0
        runs = {}
        for capture in (False, True):
            runs[capture] = spec.evaluate(target, drafter, prompts, max_new_tokens=n, eos_token_ids=eos, check=False,
                                          capture=capture)
        eager, captured = runs[False], runs[True]
        same = lambda a, b, key: sum(x[key] == y[key] for x, y in zip(a, b))  # noqa: E731
        print(f"== {dtype} on {args.device}: {len(prompts)} prompts, {n} new tokens, block 4")
        print(f"replay: tau {replay['summary']['tau']:.3f}, {replay_s:.2f} s "
              f"({', '.join(f'{k} {v:.2f}' for k, v in replay['seconds'].items())}), "
              f"top-1 disagreements {replay['summary']['disagreements']}")
        for name, run in (("eager", eager), ("capture", captured)):
            o = run["overall"]
            print(f"{name:>8}: tau {o['tau']:.3f}, lossless {sum(r['lossless'] for r in run['per_prompt'])}/"
                  f"{len(prompts)}, tokens = replay {same(run['per_prompt'], replay['per_prompt'], 'tokens')}, "
                  f"taus = replay {same(run['per_prompt'], replay['per_prompt'], 'block_taus')}, "
                  f"greedy {o['greedy_tokens_per_s']:.0f} tok/s, spec {o['spec_tokens_per_s']:.0f} tok/s, "
                  f"speedup {o['speedup']:.2f}x")
        print(f"capture vs eager: tokens equal {same(captured['per_prompt'], eager['per_prompt'], 'tokens')}, "
              f"taus equal {same(captured['per_prompt'], eager['per_prompt'], 'block_taus')}")


if __name__ == "__main__":
    main()
