"""Regeneration through a real `transformers serve` (dflash.extract.regenerate, EndpointEngine):
turns equal the server's own answers to hand-written requests, turn by turn; a server
killed mid-run stops the run with a clear error and the rerun asks only for the turns not
answered before; template arguments reach the server; metadata names the served model.
One server per module, a handful of conversations, a few tokens per turn."""

from __future__ import annotations

import json
import re

import pytest
import serve_helpers as S

from dflash.extract import regenerate as regen
from dflash.extract import regenerate_cli as regen_cli
from dflash.extract.regenerate_endpoint import EndpointDown

LIMIT = 5
MAX_NEW = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_target_dir):
    root = tmp_path_factory.mktemp("serve")
    served = S.ServeProcess(S.make_served_model(tiny_target_dir, root / "model"), S.free_port(), root / "serve.log")
    served.start()
    yield served
    served.kill()


@pytest.fixture(scope="module")
def proxy(server):
    counting = S.CountingProxy(server)
    yield counting
    counting.close()


def _job(url, data, out, *, concurrency=3, part_size=2, retries=2, **generation):
    settings = regen.GenerationSettings(max_new_tokens=MAX_NEW, **generation)
    return regen.RegenConfig(data=str(data), model=None, out=str(out),
                             endpoint=url, retries=retries, retry_wait=0.05,
                             generation=settings, concurrency=concurrency, part_size=part_size, limit=LIMIT,
                             progress=False)


def _rows(out):
    import datasets

    return datasets.load_from_disk(str(out)).to_list()


def _assistant_turns(rows):
    return sum(m["role"] == "assistant" for r in rows for m in r["messages"])


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, proxy, chats_sample_path):
    proxy.reset()
    out = tmp_path_factory.mktemp("regen_endpoint") / "straight"
    meta = regen.regenerate(_job(proxy.url, chats_sample_path, out))
    return out, meta, proxy.answered


def _reference(url, model, messages, **extra):
    """Turn by turn with hand-written requests, each turn asked after the answers before it."""
    history, answers = [], []
    for message in messages:
        if message["role"] != "assistant":
            history.append(message)
            continue
        answer = S.post_chat(url, {"model": model, "messages": history, "max_tokens": MAX_NEW, "temperature": 0,
                                   **extra})
        content = answer["choices"][0]["message"].get("content") or ""
        answers.append(answer)
        history.append({"role": "assistant", "content": content})
    return history, answers


def test_turns_are_the_servers_answers(straight_run, server, chats_sample_path):
    out, meta, requests = straight_run
    source = [json.loads(line) for line in chats_sample_path.read_text().splitlines()][:LIMIT]
    rows = _rows(out)
    assert [r["source_row"] for r in rows] == list(range(LIMIT))
    multi_turn = 0
    for row in rows:
        original = source[row["source_row"]]["messages"]
        expected, _ = _reference(server.url, str(server.model_dir), original)
        assert [{k: v for k, v in m.items() if v is not None} for m in row["messages"]] == expected
        multi_turn += sum(m["role"] == "assistant" for m in original) > 1
    assert multi_turn > 0, "a multi-turn chat must be among them (turn k is asked after regenerated turns)"
    assert requests == _assistant_turns(rows) == meta["counts"]["turns_regenerated"]


def test_metadata_names_the_served_model_and_settings(straight_run, server, proxy):
    out, meta, requests = straight_run
    assert json.loads((out / regen.METADATA_FILE).read_text()) == json.loads(json.dumps(meta))
    model = str(server.model_dir)  # what the server lists under /v1/models
    assert meta["target"] == {"served_model": model}
    assert meta["target_fingerprint"]["answered_by"] == {model: requests}
    assert meta["endpoint"]["url"] == proxy.url and meta["endpoint"]["concurrency"] == 3
    assert meta["generation"]["temperature"] == 0.0 and meta["generation"]["max_new_tokens"] == MAX_NEW
    assert meta["counts"]["rows_in"] == LIMIT and meta["counts"]["rows_out"] == LIMIT


def test_killed_server_stops_the_run_and_the_rerun_asks_only_for_missing_turns(straight_run, server, proxy,
                                                                               chats_sample_path, tmp_path):
    straight, _, total = straight_run
    out = tmp_path / "killed"
    job = _job(proxy.url, chats_sample_path, out, concurrency=2)
    proxy.reset()
    proxy.kill_at = 4  # the 4th request kills the server: 3 turns at most get answered
    try:
        with pytest.raises(EndpointDown) as failure:
            regen.regenerate(job)
    finally:
        server.start()
    message = str(failure.value)
    assert proxy.url in message and "chat/completions failed" in message and "running?" in message
    answered = proxy.answered
    assert 0 < answered < total
    journaled = sum(len(p.read_text().splitlines()) for p in (out / regen.PARTS_DIR).glob("*.turns.jsonl"))
    done_turns = sum(json.loads(p.read_text())["turns_regenerated"]
                     for p in (out / regen.PARTS_DIR).glob("*.done.json"))
    assert journaled + done_turns == answered  # every answered turn was kept
    assert not (out / regen.METADATA_FILE).exists()

    proxy.reset()
    meta = regen.regenerate(job)
    assert proxy.answered == total - answered  # no answered turn was asked again
    assert _rows(out) == _rows(straight)
    assert meta["target_fingerprint"]["answered_by"] == {str(server.model_dir): total}
    assert not list((out / regen.PARTS_DIR).glob("*.turns.jsonl"))


def test_template_kwargs_reach_the_server(proxy, server, chats_sample_path, tmp_path):
    kwargs = {"enable_thinking": False}
    proxy.reset()
    regen.regenerate(_job(proxy.url, chats_sample_path, tmp_path / "kw", template_kwargs=kwargs))
    assert proxy.bodies and all(b["chat_template_kwargs"] == kwargs for b in proxy.bodies)
    source = json.loads(chats_sample_path.read_text().splitlines()[0])["messages"]
    expected, answers = _reference(server.url, str(server.model_dir), source, chat_template_kwargs=kwargs)
    _, plain = _reference(server.url, str(server.model_dir), source[:2])
    # the server rendered the think block that only this argument adds to the prompt
    assert answers[0]["usage"]["prompt_tokens"] > plain[0]["usage"]["prompt_tokens"]
    row = _rows(tmp_path / "kw")[0]
    assert [{k: v for k, v in m.items() if v is not None} for m in row["messages"]] == expected


def test_cli_with_endpoint(proxy, chats_sample_path, tmp_path):
    from click.testing import CliRunner

    out = tmp_path / "cli"
    args = ["--data", str(chats_sample_path), "--endpoint", proxy.url, "--out", str(out), "--limit", "2",
            "--max-new-tokens", "3", "--concurrency", "2", "--template-kwargs", "{}"]
    result = CliRunner().invoke(regen_cli.main, args)
    assert result.exit_code == 0, result.output
    assert "2/2 rows" in result.output and len(_rows(out)) == 2
    refused = CliRunner().invoke(regen_cli.main, [*args[:4], "--out", str(out), "--model", "another-model"])
    assert refused.exit_code != 0 and "does not serve 'another-model'" in refused.output


def test_in_process_path_gives_the_same_turns(straight_run, server, tmp_path):
    """Greedy on the same weights and template: the in-process path and the server agree
    turn for turn (this tiny model emits no special token mid-answer, which the server
    would drop from its text and the in-process path keeps)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, meta, _ = straight_run
    model = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(server.model_dir)
    settings = regen.GenerationSettings(max_new_tokens=MAX_NEW, dtype="float32")
    in_process = regen.regenerate(regen.RegenConfig(data=meta["source"]["source"], model=str(server.model_dir),
                                                    out=str(tmp_path / "hf"), generation=settings, limit=LIMIT,
                                                    progress=False), model=model, tokenizer=tokenizer)
    assert _rows(tmp_path / "hf") == _rows(out)
    assert in_process["counts"] == meta["counts"]


def test_a_request_the_server_refuses_names_the_row(proxy, chats_sample_path, tmp_path):
    """transformers serve answers 422 to fields it does not know (vLLM's top_k here)."""
    from click.testing import CliRunner

    args = ["--data", str(chats_sample_path), "--endpoint", proxy.url, "--limit", "2", "--max-new-tokens", "2",
            "--extra-body", '{"top_k": 5}']
    stopped = CliRunner().invoke(regen_cli.main, [*args, "--out", str(tmp_path / "error"), "--on-bad-row", "error"])
    assert stopped.exit_code != 0
    assert re.search(r"chats_sample\.jsonl row [01]: turn 1: HTTP 422: .*top_k", stopped.output), stopped.output
    skipped = CliRunner().invoke(regen_cli.main, [*args, "--out", str(tmp_path / "skip")])
    assert skipped.exit_code != 0 and "produced no rows" in skipped.output
    stats = json.loads((tmp_path / "skip" / regen.PARTS_DIR / "part-00000.done.json").read_text())
    assert stats["skipped"] == {"server_rejected": 2}


def test_tools_and_tool_messages_reach_the_server(proxy, tmp_path):
    """The row's tools go with every request, exactly as the file gives them (the data
    reader keeps them); the server takes a history with a tool reply; the regenerated turn
    replaces the source's tool call (this tiny model answers in text)."""

    tools = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                               "parameters": {"type": "object", "properties": {
                                                   "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
    messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "content": "5"}, {"role": "assistant", "content": "It is 5."}]
    data = tmp_path / "tools.jsonl"
    data.write_text(json.dumps({"messages": messages, "tools": tools}) + "\n")

    proxy.reset()
    regen.regenerate(_job(proxy.url, data, tmp_path / "out"))
    assert len(proxy.bodies) == 2 and all(b["tools"] == tools for b in proxy.bodies)
    first_answer = proxy.bodies[1]["messages"][1]
    assert proxy.bodies[1]["messages"][2] == messages[2]
    row = _rows(tmp_path / "out")[0]
    assert [m["role"] for m in row["messages"]] == [m["role"] for m in messages]
    assert {k: v for k, v in row["messages"][1].items() if v is not None} == first_answer
    assert "tool_calls" not in first_answer and row["tools"] == tools
