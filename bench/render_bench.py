"""What finding the loss mask costs per chat on the CPU, against the template's own tokenization.

Renders every chat of a `messages` JSONL file with a tokenizer folder's chat template,
once through `extract.chat.render` (ids + loss mask: the generation tags where the
template has them, else the probe-and-walk search) and once through
`apply_chat_template(tokenize=True)` alone, and reports milliseconds per chat of each
(best of `--repeats` passes; the probe is learned once, outside the timing).

    python bench/render_bench.py --tokenizer TOKENIZER_DIR --data data/chats_sample.jsonl
"""

from __future__ import annotations

import argparse
import json
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", required=True, help="a folder with tokenizer files and a chat template")
    p.add_argument("--data", default="data/chats_sample.jsonl")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    from transformers import AutoTokenizer

    from dflash.extract.chat import mask_method, render
    from dflash.extract.data import normalize_row

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    with open(args.data) as f:
        convs = [normalize_row(json.loads(line), i, args.data) for i, line in enumerate(f)]
    render(tokenizer, convs[0], max_length=1 << 20)  # learns the template's turn markers

    def best(fn) -> float:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for conv in convs:
                fn(conv)
            times.append(time.perf_counter() - start)
        return min(times) / len(convs) * 1e3

    with_mask = best(lambda c: render(tokenizer, c, max_length=1 << 20))
    template_only = best(lambda c: tokenizer.apply_chat_template(c.messages, tools=c.tools, tokenize=True))
    tokens = sum(len(render(tokenizer, c, max_length=1 << 20).input_ids) for c in convs)
    print(json.dumps({"method": mask_method(tokenizer), "chats": len(convs), "mean_tokens": tokens / len(convs),
                      "render_ms_per_chat": round(with_mask, 3), "apply_chat_template_ms_per_chat": round(template_only, 3)}))


if __name__ == "__main__":
    main()
