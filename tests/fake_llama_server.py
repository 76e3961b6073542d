"""A fake `llama-server` for tests/test_engines.py: stdlib only, 127.0.0.1 only, gone by itself after 60 s.

Installed as ``ROOT/build/bin/llama-server`` (this file with a shebang) so ``Engine(ROOT)`` starts it. It
answers what spectrain/engines/server.py asks of the real one (llama.cpp 0c1e570, tools/server):

- ``/health``: 503 "Loading model" for the first 0.3 s, then ``{"status": "ok"}``;
- ``/metrics``: the cumulative ``llamacpp:spec_decode_*`` counters, as the real server prints them (HELP/TYPE
  lines, the per-position series only once a request has speculated);
- ``/props``: ``model_path`` (the ``-m`` path, as the real server reports it);
- ``/v1/chat/completions``: "echo: " + the last message's text (at most ``max_tokens`` words), as the model
  named by ``-m`` (what the real server reports), with ``usage`` and ``finish_reason``;
- ``/completion``: ``n_predict`` tokens ``prompt[-1] + 1 ...``, ``timings``, ``completion_probabilities``
  with ``n_probs`` top entries, and (started with ``--spec-type``) per request ``n_predict`` verification steps
  whose per-position accepted counts are ``[n, n - 1, 1]`` (so two requests in a row have different counts),
  with the drafter's cumulative ``statistics`` line in its log.

It writes ``{"argv", "pid", "child", "omp_wait_policy"}`` to ``fake-state.json`` beside itself, and starts a ``sleep 60``
child, so a test can check that the whole process group is stopped. ``FAKE_LLAMA_DIE=MESSAGE`` in its
environment makes it print MESSAGE and exit 3 at once (a model that does not load); ``FAKE_LLAMA_EXIT_AFTER=N``
makes it die (exit 137, as if killed) at the first request after N answers; every request body it receives is
appended to ``fake-requests.jsonl`` beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

STATE = "fake-state.json"
REQUESTS = "fake-requests.jsonl"
K = 3  # positions of the per-position series


def install(root: Path):
    """`Engine(root)` whose llama-server is this fake."""
    from spectrain.engines.llama_cpp import Engine

    exe = root / "build" / "bin" / "llama-server"
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text(f"#!{sys.executable}\n" + Path(__file__).read_text())
    exe.chmod(0o755)
    return Engine(root)


def state(root: Path) -> dict:
    return json.loads((root / "build" / "bin" / STATE).read_text())


def requests(root: Path) -> list[dict]:
    """Every request body the fake received (POSTs), in order."""
    f = root / "build" / "bin" / REQUESTS
    return [json.loads(line) for line in f.read_text().splitlines()] if f.is_file() else []


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie no parent has reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class _Counters:
    def __init__(self):
        self.lock = threading.Lock()
        self.drafts = self.drafted = self.accepted = self.answered = self.requests = 0
        self.per_pos: list[int] = []

    def add(self, n: int) -> tuple[int, int]:
        per_pos = [n, max(n - 1, 0), 1 if n else 0]
        with self.lock:
            self.drafts += n
            self.drafted += K * n
            self.accepted += sum(per_pos)
            self.per_pos = [a + b for a, b in zip(self.per_pos or [0] * K, per_pos)]
        return K * n, sum(per_pos)

    def prometheus(self) -> str:
        with self.lock:
            items = [("spec_decode_num_draft_tokens_total", self.drafted),
                     ("spec_decode_num_accepted_tokens_total", self.accepted),
                     ("spec_decode_num_drafts_total", self.drafts), ("requests_processing", 0)]
            out = [f"# HELP llamacpp:{name} fake\n# TYPE llamacpp:{name} counter\nllamacpp:{name} {value}"
                   for name, value in items]
            if self.per_pos:
                out.append("# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total fake\n"
                           "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter")
                out += [f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {v}'
                        for i, v in enumerate(self.per_pos)]
        return "\n".join(out) + "\n"


def _handler(counters: _Counters, ready_at: float, model: str = "", speculating: bool = True):
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body, kind: str = "application/json"):
            data = (body if isinstance(body, str) else json.dumps(body)).encode()
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                if time.monotonic() < ready_at:
                    self._send(503, {"error": {"code": 503, "message": "Loading model"}})
                else:
                    self._send(200, {"status": "ok"})
            elif self.path == "/metrics":
                self._send(200, counters.prometheus(), "text/plain; version=0.0.4")
            elif self.path == "/props":
                self._send(200, {"model_path": model, "total_slots": 1})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            with counters.lock:
                counters.answered += 1
                if counters.answered > int(os.environ.get("FAKE_LLAMA_EXIT_AFTER") or 1 << 30):
                    os._exit(137)  # killed mid-run: this and every later request get no answer
                with open(Path(__file__).resolve().parent / REQUESTS, "a") as f:
                    f.write(json.dumps(body) + "\n")
            if self.path == "/v1/chat/completions":
                words = ("echo: " + body["messages"][-1]["content"]).split()
                cut = words[:int(body.get("max_tokens", 16))]
                self._send(200, {"model": model, "choices": [{"message": {"role": "assistant", "content": " ".join(cut)},
                                 "finish_reason": "length" if len(cut) < len(words) else "stop"}],
                                 "usage": {"completion_tokens": len(cut)}})
                return
            prompt, n = body.get("prompt") or [], int(body.get("n_predict", 0))
            if self.path != "/completion" or not prompt:
                self._send(400, {"error": {"code": 400, "message": "empty prompt"}})
                return
            tokens = [prompt[-1] + 1 + i for i in range(n)]
            draft_n, accepted = counters.add(n) if speculating else (0, 0)
            if speculating:  # the drafter's cumulative statistics line, logged as the real server does at trace level
                counters.requests += 1
                r = counters.requests
                print(f"statistics fake: #calls(b,g,a) = {r} {r * n} {r * n}, dur(b,g,a) = 0.000, {0.5 * r:.3f}, "
                      f"{0.1 * r:.3f} ms", file=sys.stderr, flush=True)
            probs = [{"id": t, "token": f"t{t}", "bytes": [], "logprob": -0.25,
                      "top_logprobs": [{"id": t + j, "token": f"t{t + j}", "bytes": [], "logprob": -0.25 - 2 * j}
                                       for j in range(int(body.get("n_probs", 0)))]} for t in tokens]
            res = {"content": " ".join(f"t{t}" for t in tokens), "tokens": tokens, "stop": True,
                   "timings": {"predicted_n": n, "predicted_ms": 10.0 * n, "predicted_per_second": 100.0,
                               "draft_n": draft_n, "draft_n_accepted": accepted}}
            if body.get("n_probs"):
                res["completion_probabilities"] = probs
            self._send(200, res)

        def log_message(self, fmt, *args):
            print(fmt % args, file=sys.stderr, flush=True)

    return Handler


def main(argv: list[str]) -> None:
    threading.Timer(60.0, os._exit, (0,)).start()  # never outlives a test run, whatever happens to the caller
    if os.environ.get("FAKE_LLAMA_DIE"):
        print(os.environ["FAKE_LLAMA_DIE"], file=sys.stderr, flush=True)
        os._exit(3)
    port = int(argv[argv.index("--port") + 1])
    child = subprocess.Popen(["sleep", "60"])
    here = Path(__file__).resolve().parent
    (here / STATE).write_text(json.dumps({"argv": argv, "pid": os.getpid(), "child": child.pid,
                                          "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}))
    server = ThreadingHTTPServer(("127.0.0.1", port), _handler(_Counters(), time.monotonic() + 0.3,
                                                                      argv[argv.index("-m") + 1], "--spec-type" in argv))
    print(f"main: server is listening on http://127.0.0.1:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
