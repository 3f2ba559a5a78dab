"""How many decode steps in-process regeneration's batching takes on real chats, on the CPU without a model:
`regenerate_conversations` replays a dflash-regenerate OUT (its run.json and finished parts), each turn answered
with its recorded answer, so a batch lasts as long as its longest answer (plus the stop token, up to
max_new_tokens). Prints, per batch order (and part size, part=N; default one part): batches, decode steps, and
the share of row-steps that make a token.

    python bench/regen_schedule.py OUT TARGET_DIR 512 1024 [part=256 part=2048]
"""

import itertools
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from dflash.extract import regenerate as regen
from dflash.extract.data import SkipCounter, normalize_row

out, tokenizer = Path(sys.argv[1]), AutoTokenizer.from_pretrained(sys.argv[2])
sizes = [int(a) for a in sys.argv[3:] if a.isdigit()]
part_sizes = [int(a.removeprefix("part=")) for a in sys.argv[3:] if a.startswith("part=")] or [None]
settings = regen.GenerationSettings(**json.loads((out / regen.RUN_FILE).read_text())["generation"])
rows = [json.loads(line) for part in sorted((out / regen.PARTS_DIR).glob("part-*[0-9].jsonl"))
        for line in part.read_text(encoding="utf-8").split("\n") if line]
convs = [normalize_row(row, i, str(out)) for i, row in enumerate(rows)]
answers, askers = {}, {}  # each recorded turn's prompt ids -> its answer's tokens (None: two answers); -> its chats
for index, conv in enumerate(convs):
    for turn, message in enumerate(conv.messages):
        if message["role"] == "assistant":
            prompt = tokenizer.apply_chat_template(conv.messages[:turn], add_generation_prompt=True, tokenize=False,
                                                   **settings.template_kwargs)
            prompt = tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"])  # as the pool holds it
            tokens = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
            answers[prompt] = tokens if answers.get(prompt, tokens) == tokens else None
            askers.setdefault(prompt, set()).add(index)
# one prompt with two recorded answers (bf16 near-ties between batches) cannot be replayed: its chats are left out
left_out = set().union(*(askers[p] for p, a in answers.items() if a is None))
print(f"{len(convs) - len(left_out)} chats replayed, {len(left_out)} left out (a prompt with two recorded answers)")
steps_of = lambda p: min(len(answers[p]) + 1, settings.max_new_tokens)  # noqa: E731  (the stop token is a step)
useful = sum(steps_of(p) for p, chats in askers.items() if not chats & left_out)
batches = []  # (rows, decode steps)
regen.generate_batch = lambda model, prompts, *rest: batches.append((len(prompts), max(steps_of(tuple(p)) for p in
                                                                                    prompts))) \
    or [(answers[tuple(p)], len(answers[tuple(p)]) >= settings.max_new_tokens) for p in prompts]
orders = {"most turns left, then longest prompt": regen.batch_priority, "longest prompt (before)": lambda i: -len(i[2])}
for batch_size, part, (name, order) in itertools.product(sizes, part_sizes, orders.items()):
    regen.batch_priority = order
    batches.clear()
    chats = [regen.Chat.start(conv, SkipCounter()) for i, conv in enumerate(convs) if i not in left_out]
    for start in range(0, len(chats), part or len(chats)):  # a part's chats go through the pool alone
        regen.regenerate_conversations(None, tokenizer, chats[start:start + (part or len(chats))], settings,
                                       batch_size, SkipCounter())
    steps = sum(s for _, s in batches)
    print(json.dumps({"batch_size": batch_size, "part_size": part or len(chats), "order": name,
                      "turns": sum(r for r, _ in batches),
                      "batches": len(batches), "decode_steps": steps,
                      "rows_busy": round(useful / (steps * batch_size), 3)}), flush=True)
