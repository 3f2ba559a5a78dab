"""The drafter's proposal per block on the GPU: DFlashProposer captured (one CUDA graph) against
the same uncaptured, over growing contexts, at the demo's drafter shape with
random weights; prints the median ms a block of each and how far their logits differ.

    python bench/proposer_bench.py /tmp/real/target        # the converted SmolLM2 folder
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from dflash.eval import speculative as spec
from dflash.train.model import DFlashDrafter, DrafterConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("target")
    p.add_argument("--layers", default="1,8,14,21,27")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--draft-layers", type=int, default=3)
    args = p.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16).cuda().eval()
    cfg = DrafterConfig.from_target_config(target.config, layers, mask_token_id=4, block_size=args.block_size,
                                           num_hidden_layers=args.draft_layers)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).to("cuda", torch.bfloat16).eval()
    proposers = {"eager": spec.DFlashProposer(drafter, target, 2048),
                 "captured": spec.DFlashProposer(drafter, target, 2048, capture=True)}
    context = torch.randn(1, 1200, len(layers) * cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(0, 40000, (1200,)).tolist()
    logits = {}
    for name, proposer in proposers.items():
        times, logits[name] = [], []
        for S in range(300, 1100, 3):  # about 3 tokens accepted a block
            torch.cuda.synchronize()
            t = time.perf_counter()
            logits[name].append(proposer.block_logits(context[:, :S], tokens[:S], S).float())
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        print(f"{name}: median {1e3 * statistics.median(times[5:]):.3f} ms/block, first {1e3 * times[0]:.1f} ms, "
              f"blocks {len(times)}")
    pairs = list(zip(logits["eager"], logits["captured"]))
    print(f"max |logit diff| {max((a - b).abs().max().item() for a, b in pairs):.4f}; argmax equal in "
          f"{sum(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in pairs)}/{len(pairs)} blocks")


if __name__ == "__main__":
    main()
