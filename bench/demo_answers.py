"""Are the demo target's answers right? Its regenerated chats checked against the tasks.

    python bench/demo_answers.py DEMO_DIR [DEMO_DIR ...]

Every assistant turn of DEMO_DIR/regen (the target's greedy answers, turn by turn on its own
earlier answers) is compared with the right answer (`demo_data.right_answers`), grouped by
the chats the target trained on, the other training chats, and the held-out chats, and per
task on the held-out ones. Chats regeneration dropped (an answer that ran to the token cap)
are counted apart. Prints a table per folder and writes DEMO_DIR/answers.json.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from dflash.eval import demo_data


def check(demo_dir: Path) -> dict:
    source = demo_data.read_jsonl(demo_dir / "data" / "all.jsonl")
    data_settings = json.loads((demo_dir / "data.demo.json").read_text())["settings"]
    target_chats = json.loads((demo_dir / "tokenizer.demo.json").read_text())["settings"]["chats"]
    n_train = data_settings["n_train"]
    answered = [row for part in sorted((demo_dir / "regen" / "parts").glob("part-*.jsonl"))
                for row in demo_data.read_jsonl(part)]

    def group_of(row: int) -> str:
        return "target's chats" if row < target_chats else "other training chats" if row < n_train else "held out"

    turns, right = defaultdict(int), defaultdict(int)
    held_turns, held_right = defaultdict(int), defaultdict(int)
    kept = defaultdict(int)
    for chat in answered:
        row = int(chat["source_row"])
        group = group_of(row)
        kept[group] += 1
        for task, ok in demo_data.right_answers(source[row], chat):
            turns[group] += 1
            right[group] += ok
            if group == "held out":
                held_turns[task] += 1
                held_right[task] += ok
    chats = defaultdict(int)
    for row in range(len(source)):
        chats[group_of(row)] += 1
    groups = {g: {"chats": chats[g], "dropped": chats[g] - kept[g], "turns": turns[g],
                  "right": right[g] / max(1, turns[g])} for g in chats}
    per_task = {t: {"turns": held_turns[t], "right": held_right[t] / held_turns[t]} for t in sorted(held_turns)}
    return {"groups": groups, "held_out_per_task": per_task}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path)
    args = parser.parse_args()
    for demo_dir in args.dirs:
        result = check(demo_dir)
        (demo_dir / "answers.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"{demo_dir}")
        for group, g in result["groups"].items():
            print(f"  {group:22s} {g['chats']:5d} chats, {g['dropped']:4d} dropped, {g['turns']:5d} turns, "
                  f"{100 * g['right']:5.1f}% right")
        print("  held out, per task: " + ", ".join(f"{t} {100 * v['right']:.0f}% ({v['turns']})"
                                                   for t, v in result["held_out_per_task"].items()))


if __name__ == "__main__":
    main()
