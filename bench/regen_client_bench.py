"""The regeneration client's own ceiling in turns per second, against a local server that answers
every chat completion at once (after an optional delay standing in for the engine).

    python bench/regen_client_bench.py --conversations 2000 --concurrency 32 [--delay-ms 0]
"""

import json
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import click


def instant_server(delay_s: float) -> ThreadingHTTPServer:
    answer = json.dumps({"model": "bench", "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "An answer of a few words."}}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 6}}).encode()
    models = json.dumps({"data": [{"id": "bench"}]}).encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, payload: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self):
            self._send(models)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if delay_s:
                time.sleep(delay_s)
            self._send(answer)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@click.command()
@click.option("--conversations", default=2000, show_default=True)
@click.option("--turns", default=2, show_default=True, help="Assistant turns per conversation.")
@click.option("--concurrency", default=32, show_default=True)
@click.option("--delay-ms", default=0.0, show_default=True, help="Server-side delay per request.")
def main(conversations: int, turns: int, concurrency: int, delay_ms: float) -> None:
    from dflash.extract.regenerate import GenerationSettings, RegenConfig, regenerate

    httpd = instant_server(delay_ms / 1000)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "chats.jsonl"
        chat = []
        for k in range(turns):
            chat += [{"role": "user", "content": f"Question {k}?"}, {"role": "assistant", "content": "Old answer."}]
        data.write_text("".join(json.dumps({"messages": chat}) + "\n" for _ in range(conversations)))
        job = RegenConfig(data=str(data), model=None, out=str(Path(tmp) / "out"),
                          generation=GenerationSettings(max_new_tokens=8), endpoint=f"http://127.0.0.1:{httpd.server_address[1]}/v1",
                          concurrency=concurrency, progress=False)
        started = time.perf_counter()
        meta = regenerate(job)
        seconds = time.perf_counter() - started
    done = meta["counts"]["turns_regenerated"]
    click.echo(f"{done} turns in {seconds:.1f} s: {done / seconds:.0f} turns/s (concurrency {concurrency}, "
               f"server delay {delay_ms:g} ms; includes loading the source and writing the dataset)")
    httpd.shutdown()


if __name__ == "__main__":
    main()
