"""A small OpenAI-compatible chat-completions server on 127.0.0.1 that really decodes with a target
(tests only): POST /v1/chat/completions renders the messages with the target's chat template (plus the
request's chat_template_kwargs, as vLLM and SGLang do), decodes greedily or sampled with the request's seed
through spectrain.data.regenerate.generate_batch, and answers with content, finish_reason and usage.

    with OpenAIServer(target, fail_after=3) as srv:   # srv.url = http://127.0.0.1:PORT
        ...

`fail_after=N` answers HTTP 503 to every request after the N-th (a server that goes down mid-run);
`delay_s` sleeps before each answer; `requests` records every request body.

`ScriptedServer(script)` needs no model: a misbehaving server whose every POST is answered by
``script(body, n) -> Reply`` (redirects, 401 / 404, oversized or inconsistent answers, Retry-After, a body
trickled one byte at a time). Each request's headers are kept, so a test sees where a key went.

    with ScriptedServer(lambda body, n: Reply(401)) as srv:
        ...
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from spectrain.data import generate as G


class OpenAIServer:
    def __init__(self, target, fail_after: int | None = None, delay_s: float = 0.0, reasoning_split: bool = False):
        self.target, self.fail_after, self.delay_s = target, fail_after, delay_s
        self.reasoning_split = reasoning_split  # answer <think> blocks as reasoning_content (a reasoning parser)
        self.requests: list[dict] = []
        self.answered = 0
        self._lock = threading.Lock()  # one decode at a time: the model is not thread-safe
        self._stop = G.stop_token_ids(target)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> OpenAIServer:
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def complete(self, body: dict) -> tuple[int, dict]:
        tok = self.target.tokenizer
        with self._lock:
            self.requests.append(body)
            if self.fail_after is not None and self.answered >= self.fail_after:
                return 503, {"error": {"message": "server overloaded"}}
            try:
                ids = G._prompt_ids(tok, body["messages"], body.get("chat_template_kwargs"))
            except Exception as e:  # a template error is the client's fault: 400, like vLLM
                return 400, {"error": {"message": f"template: {e}"}}
            if len(ids) + body["max_tokens"] > self.target.max_positions:
                return 400, {"error": {"message": "This model's maximum context length is exceeded"}}
            time.sleep(self.delay_s)
            [(out, truncated)] = G.generate_batch(self.target, [ids], [int(body.get("seed", 0))], body["max_tokens"],
                                                   float(body.get("temperature", 0.0)), self._stop)
            self.answered += 1
        text = tok.decode(out, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        msg = {"role": "assistant", "content": text}
        if self.reasoning_split and "</think>" in text:
            think, _, answer = text.partition("</think>")
            msg = {"role": "assistant", "reasoning_content": think.replace("<think>", "").strip(), "content": answer}
        return 200, {"id": "cmpl-test", "object": "chat.completion", "model": body["model"],
                     "choices": [{"index": 0, "message": msg, "finish_reason": "length" if truncated else "stop"}],
                     "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out) + (not truncated)}}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                if self.path != "/v1/chat/completions":
                    code, resp = 404, {"error": {"message": f"no route {self.path}"}}
                else:
                    code, resp = server.complete(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                data = json.dumps(resp).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # keep the test output clean
                pass

        return Handler


# ---- a scripted, misbehaving server (no model) -----------------------------------------------------------
TRICKLE_MAX_S = 10.0  # a trickling answer stops by itself after this (the client should give up long before)


@dataclass
class Reply:
    status: int = 200
    body: dict | bytes | None = None  # None: answer(request) below, a valid completion
    headers: dict = field(default_factory=dict)
    trickle_s: float = 0.0  # > 0: announce a long body, then send one byte per trickle_s (never finishes)


def answer(body: dict, content: str = "ok", **top) -> dict:
    """A valid chat completion for request ``body``; ``top`` replaces top-level fields (model, usage ...)."""
    resp = {"id": "cmpl-x", "object": "chat.completion", "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    return {**resp, **top}


class ScriptedServer:
    def __init__(self, script: Callable[[dict, int], Reply]):
        self.script = script
        self.requests: list[dict] = []  # {"path", "headers", "body"} per POST
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> ScriptedServer:
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _reply(self, path: str, headers: dict, body: dict) -> Reply:
        with self._lock:
            n = len(self.requests)
            self.requests.append({"path": path, "headers": headers, "body": body})
        return self.script(body, n)

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                r = server._reply(self.path, dict(self.headers), body)
                data = r.body if isinstance(r.body, bytes) else json.dumps(
                    answer(body) if r.body is None else r.body).encode()
                self.send_response(r.status)
                for k, v in {"Content-Type": "application/json", **r.headers}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data) * (1000 if r.trickle_s else 1)))
                self.end_headers()
                if not r.trickle_s:
                    self.wfile.write(data)
                    return
                end = time.monotonic() + TRICKLE_MAX_S
                try:
                    for b in (data * 1000)[:int(TRICKLE_MAX_S / r.trickle_s)]:
                        if time.monotonic() > end:
                            break
                        self.wfile.write(bytes([b]))
                        self.wfile.flush()
                        time.sleep(r.trickle_s)
                except OSError:  # the client hung up: what a deadline should do
                    pass

            def log_message(self, *args):
                pass

        return Handler
