"""Where one regeneration decode step goes on the GPU: transformers' generate() on a static cache (its decode step
compiled and captured, as `dflash-regenerate` runs it) at SmolLM2-135M's shapes with random weights (speed does not
depend on them). Prints the time of a prefill and of N new tokens per attention, then the profiler's kernels.

`packed` runs a one-token query's 9 heads as 3 groups of 3 over the 3 key/value heads, as transformers' eager SDPA
path does, instead of copying the keys and values to 9 heads (what its SDPA path does whenever a mask is given).

    python bench/decode_step_profile.py --batch 512 --prompt 300 --room 512 --new 64 --attention sdpa,packed --padded
    python bench/decode_step_profile.py ... --attention packed --compile inductor,cudagraphs    # compile time and step
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from transformers import AttentionInterface, CompileConfig, LlamaConfig, LlamaForCausalLM, StaticCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


def packed_sdpa(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """SDPA with a one-token query's heads grouped onto their key/value head: no copy of the cache."""
    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    b, heads, _, d = query.shape
    out = F.scaled_dot_product_attention(query.reshape(b, heads // groups, groups, d), key, value,
                                         attn_mask=attention_mask, scale=scaling)  # mask (b, 1, 1, L) broadcasts
    return out.reshape(b, heads, 1, d).transpose(1, 2).contiguous(), None


AttentionInterface.register("packed", packed_sdpa)
AttentionMaskInterface.register("packed", sdpa_mask)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--prompt", type=int, default=300, help="prompt tokens of the longest row")
    p.add_argument("--room", type=int, default=512, help="the static cache's prompt room (it holds room + new)")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--attention", default="sdpa,packed", help="comma-separated: sdpa, packed")
    p.add_argument("--compile", default="inductor", help="comma-separated torch.compile backends of the decode step: "
                   "inductor (generate()'s default, with CUDA graphs), cudagraphs (CUDA graphs of the eager kernels)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--device", default="cuda")
    p.add_argument("--padded", action="store_true", help="left-pad every other row by a third, as real batches are")
    p.add_argument("--no-profile", action="store_true")
    a = p.parse_args()
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=a.layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      tie_word_embeddings=True)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(a.device, dtype).eval()
    ids = torch.randint(1, cfg.vocab_size, (a.batch, a.prompt), device=a.device)
    mask = torch.ones_like(ids)
    if a.padded:
        mask[1::2, : a.prompt // 3] = 0

    def generate(new: int) -> tuple[float, torch.Tensor]:
        cache = StaticCache(config=cfg, max_cache_len=a.room + a.new)
        if a.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():  # no stop token: every row decodes all `new` tokens
            out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, pad_token_id=0, eos_token_id=None,
                                 num_beams=1)
        if a.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, out[:, a.prompt:]

    tokens = {}
    for attention, backend in [(att, b) for att in a.attention.split(",") for b in a.compile.split(",")]:
        model.set_attn_implementation(attention)
        model.generation_config.compile_config = CompileConfig(
            backend=backend, mode="reduce-overhead" if backend == "inductor" else None)
        attention = attention if a.compile == "inductor" else f"{attention}/{backend}"
        print(f"{attention}: first call (compiles) {generate(a.new)[0]:.1f} s")
        prefill = [generate(1)[0] for _ in range(2)]
        (t1, tokens[attention]), (t2, _) = generate(a.new), generate(a.new)
        whole = min(t1, t2)
        step = (whole - min(prefill)) / (a.new - 1)
        print(f"{attention}: prefill {min(prefill):.3f} s; {a.new} tokens {whole:.3f} s; "
              f"decode step {step * 1e3:.1f} ms, {a.batch / step:,.0f} tokens/s")
        if not a.no_profile:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                generate(a.new)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
    first, *others = tokens
    for name in others:
        same = (tokens[name] == tokens[first]).all(dim=1).float().mean().item()
        print(f"{name}: rows equal to {first}'s tokens: {same:.3f}")


if __name__ == "__main__":
    main()
