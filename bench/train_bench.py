"""Drafter training step at Qwen3-8B dimensions: compiled flex against dense SDPA; or at a small target's
(``--shape small``: SmolLM2-135M's, the small preset's batch) with the loss's chunks eager against compiled.

Synthetic batches of the loader's shape (`--rows` sequences of `--ctx` context tokens, `--anchors` blocks each,
5 target layers), the real step code (train/step.py), fp32 master weights + bf16 autocast, fused AdamW. MFU:
train/metrics.step_flops over 790 TFLOP/s, the H200's measured bf16 matmul peak (``--peak`` measures the device's).

    python bench/train_bench.py --ctx 3072 --attention flex,dense --steps 6
    python bench/train_bench.py --ctx 2048,4096,8192,16384 --attention flex --steps 2
    python bench/train_bench.py --shape small --rows 32 --ctx 1024 --anchors 256 --layers 3 --loss kd \
        --attention flex --loss-compile off,on --steps 20
"""

import argparse
import itertools
import json
import statistics
import sys
import time

import torch

from dflash.train import compile as dcompile
from dflash.train.metrics import step_flops
from dflash.train.model import DFlashDrafter, DrafterConfig, TargetHead
from dflash.train.step import StepSpec, forward_loss, work_counts


SHAPES = {  # the drafter of an 8B-class target, and of SmolLM2-135M-Instruct
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, vocab_size=151936, block_size=16,
               target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36, mask_token_id=151669),
    "small": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                  rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192, vocab_size=49152, block_size=8,
                  target_layer_ids=[1, 8, 14, 21, 27], num_target_layers=30, mask_token_id=4),
}
TOPK = 64


def make_batch(rows: int, S: int, n_anchors: int, width: int, vocab: int, device, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    anchors = torch.stack([torch.randperm(S - 1, generator=g)[:n_anchors].sort().values + 1 for _ in range(rows)])
    logp, ids = torch.log_softmax(torch.randn(rows, S, 4 * TOPK, generator=g) * 3, -1).topk(TOPK, dim=-1)
    batch = {
        "input_ids": torch.randint(0, vocab, (rows, S), generator=g),
        "loss_mask": torch.ones(rows, S, dtype=torch.bool),
        "context_hidden": torch.randn(rows, S, width, generator=g).bfloat16(),
        "target_top1": torch.randint(0, vocab, (rows, S), generator=g),
        "topk_ids": ids * (vocab // (4 * TOPK)),  # spread over the vocabulary
        "topk_logprobs": logp,
        "seq_len": torch.full((rows,), S),
        "anchors": anchors,
        "block_valid": torch.ones(rows, n_anchors, dtype=torch.bool),
    }
    return {k: v.to(device) for k, v in batch.items()}


def run(kind: str, S: int, loss_compile: str, args, cfg: DrafterConfig, head: TargetHead) -> dict:
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = DFlashDrafter(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    choice = dcompile.CompileChoice(kind, True, "inductor", False)
    cmodel = dcompile.compile_model(model, choice, graphs_needed=2)
    spec = StepSpec(attention=kind, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id, gamma=None,
                    ce_chunk_size=4096, autocast_dtype=torch.bfloat16, loss=args.loss,
                    loss_backend="inductor" if loss_compile == "on" else None)
    batches = [make_batch(args.rows, S, args.anchors, cfg.num_context_layers * cfg.hidden_size, cfg.vocab_size,
                          device, i) for i in range(4)]

    def step(batch):
        out = forward_loss(cmodel, head, batch, spec)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    before = dcompile.compile_count()
    t_warm = time.perf_counter()
    step(batches[0])  # warm-up: a real training step
    warm_graphs = dcompile.compile_count() - before
    torch.cuda.synchronize()
    t_warm = time.perf_counter() - t_warm
    print(f"  {kind} ctx {S} loss-compile {loss_compile}: warm-up step (compile) {t_warm:.1f}s, {warm_graphs} graphs", file=sys.stderr, flush=True)
    torch.cuda.reset_peak_memory_stats()
    times = []
    with torch.compiler.set_stance("fail_on_recompile"):  # any recompile raises, naming its guard
        for i in range(args.steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step(batches[i % len(batches)])
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    recompiles = dcompile.compile_count() - before - warm_graphs
    ctx, block, pairs = work_counts(batches[0], cfg.block_size).tolist()
    flops = step_flops(cfg, cfg.vocab_size, int(ctx), int(block), int(pairs))
    med = statistics.median(times)
    res = {"attention": kind, "loss_compile": loss_compile, "ctx": S, "rows": args.rows, "anchors": args.anchors,
           "median_step_ms": round(med * 1e3, 1),
           "block_tok_s": round(block / med), "mfu_vs_790": round(flops / med / 790e12, 3),
           "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
           "graphs_at_warmup": warm_graphs, "recompiles_after": recompiles, "warmup_s": round(t_warm, 1)}
    cmodel = model = opt = batches = None  # frees their memory before the cache is emptied (not del: step names them)
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return res


def matmul_peak(n: int = 8192, reps: int = 20) -> dict:
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(5):
        a @ b
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    tflops = 2 * n**3 / statistics.median(times) / 1e12
    return {"device": torch.cuda.get_device_name(), "matmul_bf16_tflops": round(tflops, 1)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ctx", default="3072")
    p.add_argument("--attention", default="flex,dense")
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--rows", type=int, default=1, help="sequences a batch")
    p.add_argument("--loss", choices=["ce", "kd"], default="ce")
    p.add_argument("--loss-compile", default="off", help="comma-separated: off (eager chunks), on (inductor)")
    p.add_argument("--peak", action="store_true", help="only print the device's bf16 matmul ceiling")
    args = p.parse_args()
    if args.peak:
        return print(json.dumps(matmul_peak()))
    cfg = DrafterConfig(num_hidden_layers=args.layers, **SHAPES[args.shape])
    g = torch.Generator().manual_seed(1)
    head = TargetHead(*((torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02).bfloat16().cuda()
                        for _ in range(2)))
    for S in [int(x) for x in args.ctx.split(",")]:
        for kind, loss_compile in itertools.product(args.attention.split(","), args.loss_compile.split(",")):
            try:
                print(json.dumps(run(kind, S, loss_compile, args, cfg, head)), flush=True)
            except torch.OutOfMemoryError as e:
                print(json.dumps({"attention": kind, "ctx": S, "error": f"OOM: {str(e)[:120]}"}), flush=True)
                torch._dynamo.reset()
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
