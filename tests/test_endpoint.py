"""The chat-completions client (dflash.extract.regenerate_endpoint) against a scripted stdlib HTTP
server: retries with backoff, rejected requests, a server that is down; and the pieces of
regenerate_endpoint that turn answers into messages (reasoning, tool calls) and requests."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import serve_helpers as S

from dflash.extract import regenerate as regen
from dflash.extract import regenerate_endpoint as rep
from dflash.extract.data import Conversation
from dflash.extract.regenerate_endpoint import ChatEndpoint, EndpointDown, RequestRejected

ANSWER = {"model": "m", "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": "hi"}}],
          "usage": {"prompt_tokens": 7, "completion_tokens": 1}}


class Scripted:
    """Answers POST /v1/chat/completions with the next (status, body) of a script and
    GET /v1/models with `models_status`; records every request."""

    def __init__(self, script, models_status=200):
        self.script, self.models_status, self.requests = list(script), models_status, []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, body):
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                owner.requests.append(("GET", self.path))
                self._send(owner.models_status, {"data": [{"id": "m"}]})

            def do_POST(self):
                owner.requests.append(("POST", json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
                status, body = owner.script.pop(0) if owner.script else (200, ANSWER)
                self._send(status, body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def posts(self):
        return [r for r in self.requests if r[0] == "POST"]


@pytest.fixture
def scripted():
    servers = []

    def make(script, models_status=200):
        servers.append(Scripted(script, models_status))
        return servers[-1]

    yield make
    for server in servers:
        server.httpd.shutdown()
        server.httpd.server_close()


def _client(url, retries=3):
    return ChatEndpoint(url, retries=retries, retry_wait=0.01, request_timeout=10)


def test_5xx_and_429_are_retried(scripted):
    server = scripted([(503, {"error": "loading"}), (429, {"error": "busy"})])
    assert _client(server.url).chat({"messages": []}) == ANSWER
    assert len(server.posts()) == 3


def test_an_answer_without_a_message_is_rejected(scripted):
    server = scripted([(200, {"choices": []})])
    with pytest.raises(RequestRejected, match="HTTP 200: .*without choices"):
        _client(server.url).chat({"messages": []})


def test_4xx_is_rejected_at_once_with_the_servers_reason(scripted):
    server = scripted([(400, {"error": "bad template"})])
    with pytest.raises(RequestRejected, match="HTTP 400: .*bad template"):
        _client(server.url).chat({"messages": []})
    assert len(server.posts()) == 1


def test_persistent_5xx_while_the_server_is_up_rejects_the_request(scripted):
    server = scripted([(500, {"error": "jinja"})] * 4)
    with pytest.raises(RequestRejected, match="the server is up"):
        _client(server.url).chat({"messages": []})
    assert len(server.posts()) == 4


def test_persistent_5xx_without_models_means_down(scripted):
    server = scripted([(502, {"error": "gateway"})] * 4, models_status=502)
    with pytest.raises(EndpointDown, match="HTTP 502"):
        _client(server.url).chat({"messages": []})


def test_nothing_listening_is_a_clear_error_naming_the_url():
    url = f"http://127.0.0.1:{S.free_port()}/v1"
    with pytest.raises(EndpointDown) as err:
        _client(url, retries=2).chat({"messages": []})
    text = str(err.value)
    assert f"POST {url}/chat/completions failed 3 time(s)" in text and f"server at {url} running?" in text


def _chat(messages):
    conv = Conversation(kind="chat", messages=messages, source="s.jsonl", row_index=4)
    return regen.Chat.start(conv, regen.SkipCounter())


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_is_read_from_either_field(field):
    answer = json.loads(json.dumps(ANSWER))
    answer["choices"][0]["message"][field] = "let me think"
    chat = _chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "old"}])
    event = rep.turn_event(chat, 1, answer, regen.GenerationSettings())
    assert event["message"]["reasoning_content"] == "let me think"


def test_answer_becomes_the_message_reasoning_and_tool_calls_kept():
    chat = _chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "old", "name": "bot",
                                                     "reasoning_content": "old thoughts"}])
    answer = json.loads(json.dumps(ANSWER))
    answer["choices"][0]["message"].update(
        content="", reasoning="new thoughts",
        tool_calls=[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}])
    event = rep.turn_event(chat, 1, answer, regen.GenerationSettings())
    assert event["message"] == {"role": "assistant", "name": "bot", "content": "", "reasoning_content": "new thoughts",
                                "tool_calls": [{"id": "c1", "type": "function",
                                                "function": {"name": "f", "arguments": {"x": 1}}}]}


def test_the_targets_answer_replaces_the_source_turns_tool_calls():
    own = [{"type": "function", "function": {"name": "g", "arguments": {"y": 2}}}]
    chat = _chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": own},
                  {"role": "tool", "content": "42"}])
    text_only = rep.turn_event(chat, 1, ANSWER, regen.GenerationSettings())["message"]
    assert text_only == {"role": "assistant", "content": "hi"}
    answer = json.loads(json.dumps(ANSWER))
    answer["choices"][0]["message"]["tool_calls"] = [{"type": "function", "function": {"name": "f",
                                                                                       "arguments": "{}"}}]
    event = rep.turn_event(chat, 1, answer, regen.GenerationSettings())
    assert event["message"]["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": {}}}]


def test_empty_answer_and_length_limits_cut_the_conversation():
    chat = _chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    answer = json.loads(json.dumps(ANSWER))
    answer["choices"][0]["message"]["content"] = "  "
    assert rep.turn_event(chat, 1, answer, regen.GenerationSettings())["cut"] == "empty_generation"
    answer["choices"][0].update(finish_reason="length", message={"role": "assistant", "content": "x"})
    assert rep.turn_event(chat, 1, answer, regen.GenerationSettings())["truncated"] is True
    dropping = regen.GenerationSettings(drop_truncated=True)
    assert rep.turn_event(chat, 1, answer, dropping)["cut"] == "truncated"
    too_long = regen.GenerationSettings(max_prompt_tokens=6)  # the answer says prompt_tokens 7
    assert rep.turn_event(chat, 1, answer, too_long)["cut"] == "prompt_too_long"


def test_request_body_carries_tools_kwargs_and_a_per_turn_seed():
    history = [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    greedy = rep.request_body("m", history, tools, regen.GenerationSettings(template_kwargs={"k": 1}),
                              {"top_k": -1}, 3, 1)
    assert greedy["tools"] == tools and greedy["chat_template_kwargs"] == {"k": 1} and greedy["top_k"] == -1
    assert greedy["temperature"] == 0.0 and "seed" not in greedy and greedy["max_tokens"] == 1024
    assert greedy["messages"] == [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}]
    sampling = regen.GenerationSettings(temperature=0.7, top_p=0.9, seed=5)
    seeds = {rep.request_body("m", [], None, sampling, {}, row, turn)["seed"] for row in (3, 4) for turn in (1, 3)}
    assert len(seeds) == 4
    assert rep.request_body("m", [], None, sampling, {}, 3, 1)["seed"] == rep.request_seed(5, 3, 1)


def test_journal_drops_a_torn_last_line_and_refuses_a_broken_one(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_text('{"row": 0, "turn": 1}\n{"row": 0, "tu')  # killed mid-write
    assert regen.read_journal(path) == [{"row": 0, "turn": 1}]
    assert path.read_text() == '{"row": 0, "turn": 1}\n'
    path.write_text('{"row": 0, "turn": 1}\n{"row": 0, "turn": 3}')  # killed just before the newline
    assert regen.read_journal(path) == [{"row": 0, "turn": 1}]
    assert path.read_text() == '{"row": 0, "turn": 1}\n'
    path.write_text('{"row": 0, "tu\n{"row": 1, "turn": 1}\n')
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        regen.read_journal(path)
    answer = {"row": 2, "turn": 1, "message": {"role": "assistant", "content": "one\u2028two\x85three\u2029"}}
    path.write_text(json.dumps(answer, ensure_ascii=False) + "\n", encoding="utf-8")  # as Part.apply journals
    assert regen.read_journal(path) == [answer]  # line breaks other than \n are inside a JSON string


def test_leading_assistant_messages_are_removed_not_asked(scripted, tmp_path):
    """A chat that starts with the assistant (as split ShareGPT chats do) has no prompt
    for that turn: it is removed and counted; the rest is regenerated."""
    server = scripted([])
    data = tmp_path / "chats.jsonl"
    rows = [[{"role": "assistant", "content": "hello"}, {"role": "user", "content": "q"},
             {"role": "assistant", "content": "a"}],
            [{"role": "assistant", "content": "only me"}]]
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    job = regen.RegenConfig(data=str(data), model=None, out=str(tmp_path / "out"),
                            endpoint=server.url, progress=False)
    meta = regen.regenerate(job)
    assert [body["messages"] for _, body in server.posts()] == [[{"role": "user", "content": "q"}]]
    assert meta["counts"]["skipped"] == {"leading_assistant_removed": 2, "no_assistant_turn": 1}
    import datasets

    (row,) = datasets.load_from_disk(str(tmp_path / "out")).to_list()
    assert [(m["role"], m["content"]) for m in row["messages"]] == [("user", "q"), ("assistant", "hi")]
