"""Extraction throughput against the forward pass alone, same batches, same run.

Builds a Qwen3-8B-shaped target with random weights (bf16) and `--samples` text rows of
exactly `--length` tokens, then on one GPU: (1) the planned batches through ``TargetRunner``
(forward + capture + top-k: the reference of every ratio) and HF's causal-LM forward,
nothing copied or written; (2) ``runner.run``, the real extraction, its forward loop from the first
batch to the last commit, a JSON line per run. ``--codecs`` runs the worker once per hidden codec
(interleaved, ``--repeat`` times), then each codec's medians and its rate against bf16's.

    python bench/extract_bench.py --samples 400 --length 2048 --batch-tokens 8192 --references runner --repeat 3
    python bench/extract_bench.py --samples 100 --length 2048 --repeat 2 --codecs bf16,fp8,int8,int4 --references runner
"""

import argparse
import dataclasses
import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch


def build(work: Path, args) -> tuple[Path, Path]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.eval.toy_tokenizer import build_tokenizer

    model_dir, data = work / "target", work / "rows.jsonl"
    if not (model_dir / "config.json").exists():
        tok = build_tokenizer(work / "tok", vocab_size=512)
        cfg = Qwen3Config(hidden_size=args.hidden, intermediate_size=args.intermediate,
                          num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, vocab_size=args.vocab, max_position_embeddings=40960,
                          tie_word_embeddings=False)
        torch.manual_seed(0)
        with torch.device(args.device):
            model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
        t = time.perf_counter()
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        print(f"saved target in {time.perf_counter() - t:.1f}s", flush=True)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    rng = np.random.default_rng(0)
    words = [w for w in Path(np.__file__).read_text().split() if w.isalpha()] or ["alpha", "beta"]
    with data.open("w") as f:
        for i in range(args.samples):
            # enough words for --length tokens (then cut there); with --min-length, fewer for some
            n_words = args.length * 2 if args.min_length is None else int(rng.integers(args.min_length // 2, args.length * 2))
            text = " ".join(rng.choice(words, size=n_words))
            f.write(json.dumps({"text": text}) + "\n")
    return model_dir, data


def codec_summary(results: list[dict]) -> dict:
    """Per codec: medians over its repeats, and its throughput against the lossless (bf16) runs'."""
    by = {}
    for r in results:
        by.setdefault(r["worker_settings"], []).append(r)
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    keys = ("extract_tok_s", "extract_vs_forward_capture_topk", "steady_vs_forward_capture_topk",
            "hidden_bytes_per_token", "hidden_vs_raw_bf16", "bytes_per_token_total", "cpu_cores_busy")
    base = by.get("bf16")
    return {name: {"runs": len(rows), "extract_tok_s": [r["extract_tok_s"] for r in rows],
                   **{f"median_{k}": med(rows, k) for k in keys},
                   "median_vs_bf16": round(med(rows, "extract_tok_s") / med(base, "extract_tok_s"), 3) if base else None}
            for name, rows in by.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--min-length", type=int, default=None, help="samples of varied lengths (padded batches), about min..length tokens")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=12288)
    p.add_argument("--vocab", type=int, default=151936, help="the target's vocabulary (a CPU dry run: 512, the tokenizer's)")
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--work", default="/tmp/xbench")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script")
    p.add_argument("--references", default="runner,hf",
                   help="forward-only references to time (runner, the denominator of every ratio, is always timed)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each worker variant (the machine is shared: medians)")
    p.add_argument("--build-only", action="store_true", help="only write the target and the rows (for a dflash-extract run)")
    p.add_argument("--codecs", default="", help="e.g. bf16,fp8,int8,int4: one worker variant per hidden codec")
    p.add_argument("--hidden-group-size", type=int, default=128, help="group size of the int codecs")
    p.add_argument("--topk-dtype", default="float32", help="top-k log-prob dtype of the --codecs variants")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, data = build(work, args)
    if args.build_only:
        print(json.dumps({"model": str(model_dir), "data": str(data)}), flush=True)
        return

    from transformers import AutoConfig, AutoTokenizer

    from dflash.extract.config import ExtractConfig
    from dflash.extract.data import load_source
    from dflash.extract.plan import plan_shard
    from dflash.extract.runner import build_spec, run
    from dflash.shared.cache import CacheReader
    from dflash.extract.target import TargetRunner, head_backend_for, load_target

    out = work / "cache.zarr"
    shutil.rmtree(out, ignore_errors=True)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = ExtractConfig(data=str(data), model=str(model_dir), out=str(out), max_length=args.length,
                        batch_tokens=args.batch_tokens, device=args.device, progress=False,
                        dtype="bfloat16" if cuda else "float32")
    cfg.validate()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ds = load_source(str(data), "train")
    planned = plan_shard(ds, 0, str(data), tok, cfg)
    plan = planned.plan
    n_tok = plan.num_tokens
    print(f"{len(plan.source_index)} samples, {n_tok} tokens, {len(plan.batches) - 1} batches", flush=True)

    # ---- 1. forward only, same batches
    model = load_target(str(model_dir), dtype=cfg.dtype, device=args.device)
    spec = build_spec(cfg, tok, AutoConfig.from_pretrained(model_dir), ds, 1)
    t = time.perf_counter()
    runner = TargetRunner(model, spec.layer_ids, spec.topk, cfg.lm_head_chunk, head_backend_for(args.device))
    t_head_compile = time.perf_counter() - t
    off = plan.offsets
    batches = []
    for b in range(len(plan.batches) - 1):
        s0, s1 = int(plan.batches[b]), int(plan.batches[b + 1])
        samples = [torch.from_numpy(planned.input_ids[off[s]:off[s + 1]]).long() for s in range(s0, s1)]
        batches.append(TargetRunner.pad_batch(samples, tok.pad_token_id or 0))

    def timed(fn):
        fn(batches[0])  # warm-up
        sync()
        t = time.perf_counter()
        for bt in batches:
            fn(bt)
        sync()
        return time.perf_counter() - t

    with torch.inference_mode():
        refs = args.references.split(",")
        t_runner = timed(lambda bt: runner.forward(*bt))
        # HF's own causal-LM forward: every position's logits over the vocabulary (the hooks stay idle)
        t_hf = timed(lambda bt: model(input_ids=bt[0].to(args.device), attention_mask=bt[1].to(args.device),
                                      use_cache=False).logits) if "hf" in refs else float("nan")
    runner.close()
    model = runner = None  # frees the target for the worker (not del: the lambdas above name both)
    if cuda:
        torch.cuda.empty_cache()

    # ---- 2. the real worker (the default settings, or one variant per --codecs entry), same batches
    hidden_raw = n_tok * len(spec.layer_ids) * spec.hidden_size * 2
    variants = [("default", {})]
    if args.codecs:
        variants = [(c, {"hidden_codec": c, "hidden_group_size": args.hidden_group_size,
                         "topk_dtype": args.topk_dtype}) for c in args.codecs.split(",")]
    results = []
    for name, overrides in [v for _ in range(args.repeat) for v in variants]:  # interleaved: drift hits all alike
        shutil.rmtree(out, ignore_errors=True)
        vcfg = dataclasses.replace(cfg, **overrides)
        timing = run(vcfg)["worker_seconds"]["00000"]
        t_extract = timing["loop_s"]  # the forward loop, first batch to last commit
        # steady state, what a long run approaches: on CUDA the GPU's span from the first batch's
        # start to the last one's end (the rest, the last batch's writes and the final commit, is
        # paid once per shard); elsewhere the whole loop
        t_steady = timing["gpu_busy"] + timing["gpu_gap"] if cuda else t_extract
        cores = timing["cpu_s"] / t_extract
        stored = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        hidden_stored = sum(f.stat().st_size for name in ("hidden", "hidden_scale")
                            for f in (out / "shards" / "00000" / name).rglob("*") if f.is_file())
        result = {
            "worker_settings": name, "commit_seconds": vcfg.commit_seconds,
            "encoding": CacheReader(str(out)).spec.encoding(),
            "samples": len(plan.source_index), "tokens": n_tok, "batch_tokens": args.batch_tokens,
            "forward_capture_topk_tok_s": round(n_tok / t_runner),
            "extract_tok_s": round(n_tok / t_extract),
            "extract_vs_forward_capture_topk": round(t_runner / t_extract, 3),
            "steady_vs_forward_capture_topk": round(t_runner / t_steady, 3),
            "hf_causal_lm_forward_tok_s": n_tok / t_hf, "extract_vs_hf_causal_lm_forward": round(t_hf / t_extract, 3),
            "cpu_cores_busy": round(cores, 2), "head_backend": head_backend_for(args.device),
            "head_compile_s": round(t_head_compile, 2),
            "bytes_per_token_total": round(stored / n_tok), "total_vs_raw_bf16_hidden": round(stored / hidden_raw, 4),
            "hidden_bytes_per_token": round(hidden_stored / n_tok), "hidden_vs_raw_bf16": round(hidden_stored / hidden_raw, 4),
            "worker_seconds": timing,
            # the GPU's share of the loop, and its time inside the batches against the bare forward's
            "gpu_busy_vs_loop": round(timing["gpu_busy"] / timing["loop_s"], 3) if cuda else None,
            "gpu_busy_vs_forward_capture_topk": round(timing["gpu_busy"] / t_runner, 3) if cuda else None,
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        }
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.codecs:
        print(json.dumps({"codecs": codec_summary(results)}, indent=1), flush=True)


if __name__ == "__main__":
    main()
