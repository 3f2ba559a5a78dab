"""Where does one extraction batch synchronise the host with the GPU?

Runs ``TargetRunner.forward`` (a small random Qwen3, padded and unpadded batches) and the
worker's device->host hand-off under ``torch.cuda.set_sync_debug_mode("warn")`` and prints
the Python frames of every synchronising call: each one is a point where the forward loop
stops queueing work until the GPU has caught up.

    python bench/sync_check.py
    python bench/sync_check.py --device cpu     # a dry run of the script (the CPU never syncs)
"""

from __future__ import annotations

import argparse
import traceback
import warnings

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash.extract.target import TargetRunner
from dflash.extract.worker import _to_host


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    device = torch.device(p.parse_args().device)
    cuda = device.type == "cuda"
    cfg = Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg).to(device, torch.bfloat16).eval()
    runner = TargetRunner(model, [0, 2, 3], topk=8, lm_head_chunk=256)
    stream = torch.cuda.Stream() if cuda else None
    g = torch.Generator().manual_seed(0)
    cases = {"padded": [torch.randint(0, 1024, (n,), generator=g) for n in (300, 200, 120)],
             "unpadded": [torch.randint(0, 1024, (256,), generator=g) for _ in range(3)]}
    for name, samples in cases.items():
        ids, mask, index = (t.pin_memory() if cuda else t for t in TargetRunner.pad_batch(samples))
        runner.forward(ids, mask, index)  # warm-up outside the check
        if cuda:
            torch.cuda.synchronize()
        seen = []

        def record(message, category, filename, lineno, *a, **k):
            seen.append((str(message), traceback.format_stack(limit=14)[:-2] + [f"{filename}:{lineno}"]))

        with warnings.catch_warnings():  # restores showwarning on exit
            warnings.simplefilter("always")
            warnings.showwarning = record
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                out = runner.forward(ids, mask, index)
                _to_host(out, device, stream)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
        print(f"== {name}: {len(seen)} synchronising call(s)")
        for message, stack in seen:
            print("  " + message.splitlines()[0][:160])
            for frame in stack[-9:]:
                print("    " + frame.strip().splitlines()[0][:200])


if __name__ == "__main__":
    main()
