"""Regeneration in process: the plain path (dynamic KV cache, eager decode) against the static
KV cache whose decode step generate() captures in CUDA graphs, same rows, one process: generated
tokens per second and how many rows come out equal. The plain path runs on the first
--plain-rows rows, the static path on --rows rows twice (the first pass compiles every prompt
room it meets, the second is timed). Every assistant turn of a row is answered.

    python bench/regen_speed.py --model TARGET_DIR --data rows.jsonl --rows 1024 --plain-rows 256 \
        --batch-size 512 --max-new-tokens 256 --max-prompt-tokens 1024 [--json out.json]
"""

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--plain-rows", type=int, default=256)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[256])
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from dflash.extract.data import SkipCounter, load_source
    from dflash.extract.regenerate import (Chat, GenerationSettings, StaticDecoder, chat_totals, part_chats,
                                          regenerate_conversations)
    from dflash.extract.target import load_target

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = load_target(args.model, dtype="bfloat16", device=args.device)
    ds = load_source(args.data)
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens)

    def run(rows: int, batch_size: int, static: StaticDecoder | None) -> tuple[list[dict], dict]:
        skips = SkipCounter()
        convs = part_chats(ds, 0, min(rows, len(ds)), args.data, "skip", skips)
        torch.cuda.synchronize() if args.device.startswith("cuda") else None
        t0 = time.perf_counter()
        chats = [Chat.start(c, skips) for c in convs]
        regenerate_conversations(model, tokenizer, chats, settings, batch_size, skips, static)
        out = [{"source_row": c.conv.row_index, "messages": c.messages} for c in chats if not c.dropped]
        totals = chat_totals(chats)
        torch.cuda.synchronize() if args.device.startswith("cuda") else None
        seconds = time.perf_counter() - t0
        stats = {"static": static is not None, "rows": len(convs), "batch_size": batch_size, "seconds": round(seconds, 2),
                 **totals, "tokens_per_s": round(totals["generated_tokens"] / seconds),
                 "rows_per_s": round(len(convs) / seconds, 2)}
        print(json.dumps(stats), flush=True)
        return out, stats

    plain_rows, plain = run(args.plain_rows, args.batch_size[0], None)
    results = [{**plain, "label": "plain"}]
    for batch_size in args.batch_size:
        decoder = StaticDecoder(model, batch_size, settings.max_new_tokens, settings.max_prompt_tokens)
        # Warm-up (compile + graph capture of every room these rows need), reported apart.
        _, warm = run(args.rows, batch_size, decoder)
        results.append({**warm, "label": f"static bs {batch_size} warm-up (compile)"})
        static_rows, static = run(args.rows, batch_size, decoder)
        by_row = {r["source_row"]: r["messages"] for r in static_rows}
        both = [r for r in plain_rows if r["source_row"] in by_row]
        same = sum(r["messages"] == by_row[r["source_row"]] for r in both)
        static["equal_rows_vs_plain"] = f"{same}/{len(both)}"
        static["speedup_vs_plain"] = round(static["tokens_per_s"] / plain["tokens_per_s"], 2)
        results.append({**static, "label": f"static bs {batch_size}"})
        print(json.dumps(static), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results,
                       "versions": {"torch": torch.__version__}}, f, indent=2)


if __name__ == "__main__":
    main()
