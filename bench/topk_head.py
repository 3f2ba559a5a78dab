"""The LM head's top-k in stage one: what each way of taking it costs on the GPU.

A Qwen3-8B-shaped head (D 4096, vocabulary 151,936, bf16 weights of std 0.02) over one
batch of 8192 token states, in chunks of 1024 tokens as ``TargetRunner`` runs it:

* ``logits``: the matmul alone (what HF's forward does; the floor);
* ``fp32_log_softmax_topk``: fp32 log_softmax over the vocabulary, then ``topk`` of it;
* ``topk_logits_gather``: ``topk`` of the bf16 logits, fp32 log_softmax gathered at those
  ids (``TargetRunner`` without a compiled head, e.g. on the CPU);
* with ``--compiled``, ``topk_logits_compiled_lse``: ``topk`` of the bf16 logits minus a
  log-sum-exp from one compiled reduction, no fp32 copy of the logits (``TargetRunner`` on
  CUDA, ``head_backend='inductor'``, its row count dynamic).

Prints the median milliseconds per batch of each, and how far the two top-k ways agree
(same ids in the same order, same values).

    python bench/topk_head.py
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--compiled", action="store_true",
                   help="also: top-k of the logits, log-sum-exp in one compiled reduction (TargetRunner's way on CUDA)")
    args = p.parse_args()
    dev = torch.device(args.device)
    g = torch.Generator(dev).manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    h = torch.randn(args.tokens, args.hidden, device=dev, generator=g).to(dtype)
    w = (torch.randn(args.vocab, args.hidden, device=dev, generator=g) * 0.02).to(dtype)
    k, chunk = args.topk, args.chunk

    def logits(x):
        return x @ w.T

    def fp32_log_softmax_topk(x):
        v, i = torch.topk(torch.log_softmax(logits(x).float(), dim=-1), k, dim=-1)
        return v, i

    def topk_logits_gather(x):
        z = logits(x)
        i = torch.topk(z, k, dim=-1).indices
        return torch.log_softmax(z.float(), dim=-1).gather(1, i), i

    def per_batch(fn):
        return [fn(h[t:t + chunk]) for t in range(0, args.tokens, chunk)]

    from dflash.extract.target import logsumexp_fp32

    lse = torch.compile(logsumexp_fp32, backend="inductor")  # compiled as TargetRunner does
    if args.compiled:
        z = torch.zeros((chunk, args.vocab), dtype=dtype, device=dev)
        torch._dynamo.mark_dynamic(z, 0)
        with torch.inference_mode():
            lse(z)

    def topk_logits_compiled_lse(x):
        z = logits(x)
        v, i = torch.topk(z, k, dim=-1)
        return v.float() - lse(z)[:, None], i

    variants = {"logits": logits, "fp32_log_softmax_topk": fp32_log_softmax_topk,
                "topk_logits_gather": topk_logits_gather}
    if args.compiled:
        variants["topk_logits_compiled_lse"] = topk_logits_compiled_lse
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        for fn in variants.values():
            per_batch(fn)  # warm-up
        for _ in range(args.reps):  # interleaved: drift hits all alike
            for name, fn in variants.items():
                if dev.type == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    per_batch(fn)
                    end.record()
                    end.synchronize()
                    times[name].append(start.elapsed_time(end))
                else:
                    import time

                    t = time.perf_counter()
                    per_batch(fn)
                    times[name].append((time.perf_counter() - t) * 1000)
        before = per_batch(fp32_log_softmax_topk)
        now = per_batch(topk_logits_gather)
        if args.compiled:
            c = per_batch(topk_logits_compiled_lse)
            vc, ic = (torch.cat(x) for x in zip(*c))
            v0 = torch.cat([v for v, _ in before])
            compiled_check = {"compiled_rows_same_ids_same_order": round((torch.cat([i for _, i in before]) == ic)
                                                                          .all(-1).float().mean().item(), 4),
                              "compiled_max_abs_value_diff": float((v0 - vc).abs().max())}
    v0, i0 = (torch.cat(x) for x in zip(*before))
    v1, i1 = (torch.cat(x) for x in zip(*now))
    same_set = (i0.sort(-1).values == i1.sort(-1).values).all(-1).float().mean().item()
    result = {name: round(statistics.median(t), 2) for name, t in times.items()}
    floor = result["logits"]
    result.update(
        unit="ms per batch (median)", tokens=args.tokens, vocab=args.vocab, chunk=chunk, topk=k,
        head_beyond_logits_before=round(result["fp32_log_softmax_topk"] - floor, 2),
        head_beyond_logits_now=round(result["topk_logits_gather"] - floor, 2),
        rows_same_ids_same_order=round((i0 == i1).all(-1).float().mean().item(), 4),
        rows_same_id_set=round(same_set, 4),
        max_abs_value_diff=float((v0 - v1).abs().max()),
        device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu")
    if args.compiled:
        result.update(compiled_check, head_beyond_logits_compiled=round(result["topk_logits_compiled_lse"] - floor, 2))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
