import json

import pytest

from dflash.extract import data as D
from dflash.extract.data import Conversation, DataError, SkipCounter

SRC = "data/x.jsonl"


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- normalize_row ------------------------------------------------------------------


def test_messages_row():
    row = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U", "name": "bob"},
            {"role": "assistant", "content": "A", "reasoning_content": None},
            {"role": "tool", "content": "T"},
            {"role": "assistant", "content": "B"},
        ],
        "id": 7,
    }
    conv = D.normalize_row(row, 3, SRC)
    assert conv == Conversation(
        "chat",
        messages=[
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"},
            {"role": "tool", "content": "T"},
            {"role": "assistant", "content": "B"},
        ],
        source=SRC,
        row_index=3,
    )


def test_sharegpt_row_maps_roles():
    row = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "U"},
            {"from": "gpt", "value": "A"},
            {"from": "Human", "value": "U2"},
            {"from": "chatgpt", "value": "A2"},
            {"from": "observation", "value": "T"},
        ]
    }
    conv = D.normalize_row(row, 0, SRC)
    assert conv.kind == "chat"
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "user", "assistant", "tool"]
    assert [m["content"] for m in conv.messages] == ["S", "U", "A", "U2", "A2", "T"]


def test_sharegpt_top_level_system():
    row = {"system": "Be brief.", "conversations": [{"from": "human", "value": "U"}, {"from": "gpt", "value": "A"}]}
    conv = D.normalize_row(row, 0, SRC)
    assert conv.messages[0] == {"role": "system", "content": "Be brief."}


def test_text_row():
    conv = D.normalize_row({"text": "hello", "messages": None}, 5, SRC)
    assert conv == Conversation("text", text="hello", source=SRC, row_index=5)


def test_messages_take_precedence_over_text():
    row = {"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}], "text": "t"}
    assert D.normalize_row(row, 0, SRC).kind == "chat"


BAD_ROWS = [
    ({"prompt": "p", "response": "r"}, "missing_columns", "no 'messages', 'conversations' or 'text' column"),
    ({"messages": None, "text": None}, "missing_columns", "no 'messages'"),
    ({"messages": [{"role": "user", "content": "U"}, {"role": "robot", "content": "R"}]}, "unknown_role", "unknown role 'robot' in message 1"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown_role", "unknown role 'alien' in message 0"),
    ({"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "  \n"}]}, "empty_content", "message 1 (assistant) has empty content"),
    ({"text": ""}, "empty_content", "'text' is empty"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "U"}]}, {"role": "assistant", "content": "A"}]}, "non_string_content", "message 0 (user) content is list"),
    ({"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": 42}]}, "non_string_content", "message 1 (assistant) content is int"),
    ({"text": 3.5}, "non_string_content", "'text' is float"),
    ({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}, "no_assistant_turn", "no assistant message"),
    ({"messages": []}, "malformed_message", "must be a non-empty list"),
    ({"messages": "hi"}, "malformed_message", "must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, "malformed_message", "message 0 needs 'role' and 'content'"),
    ({"conversations": [{"role": "user", "content": "U"}]}, "malformed_message", "message 0 needs 'from' and 'value'"),
]


@pytest.mark.parametrize("row,reason,problem", BAD_ROWS, ids=[f"{r}-{i}" for i, (_, r, _) in enumerate(BAD_ROWS)])
def test_bad_rows_raise_named_errors(row, reason, problem):
    with pytest.raises(DataError) as info:
        D.normalize_row(row, 17, SRC)
    err = info.value
    assert err.reason == reason
    assert (err.source, err.row) == (SRC, 17)
    assert str(err).startswith("data/x.jsonl row 17: ")
    assert problem in str(err)


def test_error_message_format():
    with pytest.raises(DataError, match=r"^data/x\.jsonl row 17: unknown role 'robot' in message 2$"):
        D.normalize_row(
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "robot", "content": "c"}]},
            17,
            SRC,
        )


# --- bad-row policy -----------------------------------------------------------------


def _mixed_rows():
    good = {"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]}
    return [
        good,
        {"messages": [{"role": "robot", "content": "x"}]},
        {"text": "plain"},
        {"foo": 1},
        {"messages": [{"role": "user", "content": "U"}]},
        {"messages": [{"role": "user", "content": "U"}, {"role": "sprite", "content": "x"}]},
        good,
    ]


def test_skip_policy_counts_every_reason():
    skips = SkipCounter()
    convs = list(D.iter_conversations(_mixed_rows(), SRC, on_bad_row="skip", skips=skips))
    assert [c.row_index for c in convs] == [0, 2, 6]
    assert skips.to_dict() == {"missing_columns": 1, "no_assistant_turn": 1, "unknown_role": 2}
    assert skips.total == 4
    assert "row 1" in skips.first_message["unknown_role"]
    assert skips.summary() == "4 rows skipped: missing_columns=1, no_assistant_turn=1, unknown_role=2"


def test_error_policy_raises_on_first_bad_row():
    with pytest.raises(DataError, match="row 1: unknown role 'robot'"):
        list(D.iter_conversations(_mixed_rows(), SRC, on_bad_row="error"))


def test_guard_always_counts_skipped_samples():
    skips = SkipCounter()

    def too_long():
        raise D.SkippedSample("too_long", SRC, 4, "99 tokens > max_length 8")

    assert D.guard("error", skips, too_long) is None
    assert skips.to_dict() == {"too_long": 1}
    assert D.guard("error", skips, lambda x: x + 1, 1) == 2
    with pytest.raises(ValueError, match="on_bad_row"):
        D.guard("ignore", skips, too_long)


# --- load_source ----------------------------------------------------------------------

ROWS = [
    {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(5)
]


@pytest.fixture
def cache_dir(tmp_path):
    return str(tmp_path / "hf_cache")


def _rows(ds):
    return [dict(r) for r in ds]


def test_load_jsonl_and_json(tmp_path, cache_dir):
    jsonl = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    as_json = tmp_path / "b.json"
    as_json.write_text(json.dumps(ROWS))
    for path in (jsonl, as_json):
        ds = D.load_source(str(path), cache_dir=cache_dir)
        assert _rows(ds) == ROWS


def test_load_parquet_arrow_and_saved(tmp_path, cache_dir):
    import datasets

    ref = datasets.Dataset.from_list(ROWS)
    ref.to_parquet(str(tmp_path / "a.parquet"))
    ref.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ref, "test": ref.select([0, 1])}).save_to_disk(str(tmp_path / "saved_dict"))
    arrow_file = next((tmp_path / "saved").glob("*.arrow"))

    assert _rows(D.load_source(str(tmp_path / "a.parquet"), cache_dir=cache_dir)) == ROWS
    assert _rows(D.load_source(str(arrow_file), cache_dir=cache_dir)) == ROWS
    assert _rows(D.load_source(str(tmp_path / "saved"))) == ROWS
    assert _rows(D.load_source(str(tmp_path / "saved_dict"), split="test")) == ROWS[:2]
    with pytest.raises(DataError, match=r"no split 'validation'"):
        D.load_source(str(tmp_path / "saved_dict"), split="validation")


def test_load_folder_of_files(tmp_path, cache_dir):
    folder = tmp_path / "shards"
    (folder / "sub").mkdir(parents=True)
    _write_jsonl(folder / "part-0.jsonl", ROWS[:2])
    _write_jsonl(folder / "sub" / "part-1.jsonl", ROWS[2:])
    (folder / "README.md").write_text("ignored")
    ds = D.load_source(str(folder), cache_dir=cache_dir)
    assert sorted(r["messages"][0]["content"] for r in ds) == [f"q{i}" for i in range(5)]


def test_load_sample_datasets(chats_sample_path, chats_sharegpt_sample_path, cache_dir):
    for path, n in [(chats_sample_path, 40), (chats_sharegpt_sample_path, 10)]:
        ds = D.load_source(str(path), cache_dir=cache_dir)
        skips = SkipCounter()
        convs = list(D.iter_conversations(ds, str(path), on_bad_row="skip", skips=skips))
        assert len(convs) == n and skips.total == 0


def test_unreadable_sources_name_the_file(tmp_path, cache_dir):
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file or directory") as info:
        D.load_source(str(tmp_path / "missing.jsonl"), cache_dir=cache_dir)
    assert info.value.reason == "unreadable"

    folder = tmp_path / "shards"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", ROWS)
    (folder / "b.jsonl").write_text('{"messages": [}\n')
    with pytest.raises(DataError, match=r"shards/b\.jsonl: cannot read: .*JSON"):
        D.load_source(str(folder), cache_dir=cache_dir)
    with pytest.raises(DataError, match=r"b\.jsonl: cannot read"):
        D.load_source(str(folder / "b.jsonl"), cache_dir=cache_dir)

    (tmp_path / "bad.parquet").write_bytes(b"not a parquet file")
    with pytest.raises(DataError, match=r"bad\.parquet: cannot read"):
        D.load_source(str(tmp_path / "bad.parquet"), cache_dir=cache_dir)

    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match=r"empty_dir: no data files"):
        D.load_source(str(tmp_path / "empty_dir"), cache_dir=cache_dir)

    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"notes\.txt: unsupported file type"):
        D.load_source(str(tmp_path / "notes.txt"), cache_dir=cache_dir)

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _write_jsonl(mixed / "a.jsonl", ROWS)
    import datasets

    datasets.Dataset.from_list(ROWS).to_parquet(str(mixed / "b.parquet"))
    with pytest.raises(DataError, match=r"mixed file formats"):
        D.load_source(str(mixed), cache_dir=cache_dir)


def test_hub_names_go_to_load_dataset(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, **kwargs):
        calls.append((name, kwargs))
        if name == "org/broken":
            raise ConnectionError("offline")
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = D.load_source("org/chats", split="train_sft", revision="abc123", data_files="x/*.parquet")
    assert len(ds) == 5
    assert calls == [("org/chats", {"split": "train_sft", "revision": "abc123", "data_files": "x/*.parquet", "cache_dir": None})]
    with pytest.raises(DataError, match=r"^org/broken: cannot load hub dataset: ConnectionError: offline"):
        D.load_source("org/broken")


# --- dataset_fingerprint -----------------------------------------------------------------


def test_fingerprint_local_files(tmp_path, cache_dir):
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    fp = D.dataset_fingerprint(D.load_source(str(path), cache_dir=cache_dir), str(path), "train", None)
    assert fp["hash_method"] == "files-sha256"
    assert (fp["source"], fp["split"], fp["revision"], fp["num_rows"]) == (str(path), "train", None, 5)
    assert fp["content_hash"].startswith("sha256:")
    again = D.dataset_fingerprint(D.load_source(str(path), cache_dir=cache_dir), str(path), "train", None)
    assert again["content_hash"] == fp["content_hash"]
    _write_jsonl(path, ROWS[:4] + [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "changed"}]}])
    changed = D.dataset_fingerprint(D.load_source(str(path), cache_dir=cache_dir), str(path), "train", None)
    assert changed["content_hash"] != fp["content_hash"]


def test_fingerprint_saved_dataset_and_rows(tmp_path):
    import datasets

    ref = datasets.Dataset.from_list(ROWS)
    ref.save_to_disk(str(tmp_path / "saved"))
    fp = D.dataset_fingerprint(D.load_source(str(tmp_path / "saved")), str(tmp_path / "saved"), "train")
    assert fp["hash_method"] == "files-sha256" and fp["num_rows"] == 5

    # not a local path (e.g. a hub dataset): hash of the rows, stable and content-sensitive
    a = D.dataset_fingerprint(ref, "org/chats", "train", "main")
    b = D.dataset_fingerprint(datasets.Dataset.from_list(ROWS), "org/chats", "train", "main")
    c = D.dataset_fingerprint(datasets.Dataset.from_list(ROWS[::-1]), "org/chats", "train", "main")
    assert a["hash_method"] == "rows-sha256" and a["revision"] == "main"
    assert a["content_hash"] == b["content_hash"] != c["content_hash"]
