"""Test helpers for regeneration through a server: a real `transformers serve` process on
127.0.0.1 and a counting proxy in front of it (it sees every request the server gets,
and can kill the server at a chosen request)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# Appended to the served model's chat template: a generation prompt that depends on a
# template argument, so a test can see whether the server applied chat_template_kwargs.
THINKING_SUFFIX = ("{%- if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
                   "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_served_model(source: Path, out: Path) -> Path:
    """A copy of a tiny target folder whose generation config stops at <|im_end|> (as a real
    chat model's does) and whose template reads `enable_thinking`."""
    import shutil

    shutil.copytree(source, out)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    config_path = out / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = sorted({ids["<|endoftext|>"], ids["<|im_end|>"]})
    config_path.write_text(json.dumps(config))
    template = out / "chat_template.jinja"
    template.write_text(template.read_text() + THINKING_SUFFIX)
    return out


class ServeProcess:
    """`transformers serve MODEL_DIR` on 127.0.0.1:port, CPU, offline, logging to a file."""

    def __init__(self, model_dir: Path, port: int, log_path: Path):
        self.model_dir, self.port, self.log_path = model_dir, port, log_path
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 180.0) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        log = self.log_path.open("a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "transformers.cli.transformers", "serve", str(self.model_dir), "--host",
             "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--log-level", "info"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"transformers serve did not answer within {timeout} s:\n{self.log_tail()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self) -> str:
        return self.log_path.read_text()[-3000:] if self.log_path.exists() else ""


class CountingProxy:
    """Forwards every request to the server; counts (and keeps the bodies of) the chat
    completions the server answered. `kill_at = n`: the n-th chat request kills the
    server instead of reaching it. Without a server it closes the connection unanswered."""

    def __init__(self, server: ServeProcess):
        self.server = server
        self.lock = threading.Lock()
        self.bodies: list[dict] = []
        self.arrived = 0
        self.kill_at: int | None = None
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                self._forward(None)

            def do_POST(self):
                self._forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def _forward(self, data):
                chat = self.path.endswith("/chat/completions")
                if chat:
                    with proxy.lock:
                        proxy.arrived += 1
                        if proxy.kill_at is not None and proxy.arrived >= proxy.kill_at:
                            proxy.server.kill()
                request = urllib.request.Request(f"http://127.0.0.1:{proxy.server.port}{self.path}", data=data,
                                                 method=self.command,
                                                 headers={"Content-Type": "application/json"} if data else {})
                try:
                    with urllib.request.urlopen(request, timeout=120) as upstream:
                        status, payload = upstream.status, upstream.read()
                except urllib.error.HTTPError as err:
                    status, payload = err.code, err.read()
                except OSError:
                    self.close_connection = True  # the server is gone: hang up, as a dead server does
                    return
                if chat and status == 200:
                    with proxy.lock:
                        proxy.bodies.append(json.loads(data))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    @property
    def answered(self) -> int:
        return len(self.bodies)

    def reset(self) -> None:
        with self.lock:
            self.bodies, self.arrived, self.kill_at = [], 0, None

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def post_chat(url: str, body: dict) -> dict:
    """One chat-completions request, written out by hand (the reference the client is checked against)."""
    request = urllib.request.Request(url.rstrip("/") + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())
