"""Where one regeneration decode step goes on the GPU: transformers' generate() on a static cache (its decode step
compiled and captured, as `dflash-regenerate` runs it) at SmolLM2-135M's shapes with random weights (speed does not
depend on them). Prints the time of a prefill and of N new tokens, then the profiler's kernels by CUDA time.

    python bench/decode_step_profile.py --batch 512 --prompt 300 --room 512 --new 64
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--prompt", type=int, default=300, help="prompt tokens of every row")
    p.add_argument("--room", type=int, default=512, help="the static cache's prompt room (it holds room + new)")
    p.add_argument("--new", type=int, default=64)
    a = p.parse_args()
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()

    def generate(new: int) -> float:
        cache = StaticCache(config=cfg, max_cache_len=a.room + a.new)
        ids = torch.randint(0, cfg.vocab_size, (a.batch, a.prompt), device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():  # no stop token: every row decodes all `new` tokens
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, do_sample=False,
                           max_new_tokens=new, min_new_tokens=new, pad_token_id=0, eos_token_id=None, num_beams=1)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    print(f"first call (compiles): {generate(a.new):.1f} s")
    prefill = [generate(1) for _ in range(2)]
    whole = [generate(a.new) for _ in range(2)]
    step = (min(whole) - min(prefill)) / (a.new - 1)
    print(f"prefill {min(prefill):.3f} s; {a.new} tokens {min(whole):.3f} s; decode step {step * 1e3:.1f} ms, "
          f"{a.batch / step:,.0f} tokens/s")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate(a.new)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))


if __name__ == "__main__":
    main()
