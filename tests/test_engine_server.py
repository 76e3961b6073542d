"""The llama-server spectrain talks to is the one it started (spectrain/engines/server.py), with the fake server of
tests/fake_llama_server.py: a port another process took between the probe and the start is refused and nothing is
sent to it; a server that dies fails the very next request, in `eval --engine` and in `regenerate --engine` (no
retries against a dead port); every request names every sampler; a SIGTERM during llama-bench stops it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import fake_llama_server as fake
import pytest

from spectrain.cli import main as cli_main
from spectrain.data import regen_server
from spectrain.engines import llama_cpp, server
from spectrain.engines.server import LlamaServer, ServerError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECTRAIN_DEBUG", raising=False)
    monkeypatch.delenv("FAKE_LLAMA_EXIT_AFTER", raising=False)


@pytest.fixture
def engine(tmp_path):
    return fake.install(tmp_path / "engine")


class Squatter:
    """Another process's HTTP server on a port: answers /health ok, records every request."""

    def __init__(self):
        seen = self.seen = []

        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                seen.append(("GET", self.path))
                data = b'{"status": "ok"}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_POST = do_GET

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_port_another_process_took_is_refused_and_nothing_is_sent_to_it(engine, tmp_path, monkeypatch):
    squatter = Squatter()
    try:
        monkeypatch.setattr(server, "free_port", lambda: squatter.port)
        s = LlamaServer(engine, tmp_path / "m.gguf", log=tmp_path / "s.log")
        with pytest.raises(ServerError, match="not from the llama-server spectrain started.*another process"):
            s.__enter__()
        assert all(m == "GET" for m, _ in squatter.seen)  # health probes only: no prompt reached it
        assert s.proc.poll() is not None  # ours was stopped (or died at the bind)
    finally:
        squatter.close()


def test_our_own_server_is_recognised_as_the_listener(engine, tmp_path):
    with LlamaServer(engine, tmp_path / "m.gguf", log=tmp_path / "s.log") as s:
        held = server.port_listeners(s.port)
        assert held and held <= server.socket_inodes(s.proc.pid)


def test_a_server_killed_mid_run_fails_the_next_request_at_once(engine, tmp_path):
    with LlamaServer(engine, tmp_path / "m.gguf", log=tmp_path / "s.log") as s:
        s.complete([1, 2], n_predict=2, temperature=0.0, seed=0)
        os.kill(s.proc.pid, signal.SIGKILL)  # the server we started
        s.proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises(ServerError, match=r"exited with -9 during the run.*s\.log"):
            s.complete([1, 2], n_predict=2, temperature=0.0, seed=0)
        assert time.monotonic() - t0 < 5


def test_every_request_names_every_sampler(engine, tmp_path):
    with LlamaServer(engine, tmp_path / "m.gguf", log=tmp_path / "s.log") as s:
        s.complete([1, 2], n_predict=2, temperature=1.0, seed=0, top_k=7, top_p=0.5)
    (body,) = fake.requests(engine.root)
    assert {k: body[k] for k in ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty")} == \
        {"temperature": 1.0, "top_k": 7, "top_p": 0.5, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0}


def _recipe(tmp_path, gguf: Path, rows: int) -> Path:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q {i}"},
                                                                   {"role": "assistant", "content": "x"}]}) + "\n"
                            for i in range(rows)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"target: {{name_or_path: {gguf}}}\ndata: {{train_files: [{data}]}}\n")
    return recipe


def test_regenerate_stops_at_once_when_the_engine_dies_and_resumes(engine, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(llama_cpp, "require", lambda: engine)
    monkeypatch.setattr(regen_server, "BACKOFF_S", 1.0)  # retries against a dead port would take many seconds
    monkeypatch.setenv("FAKE_LLAMA_EXIT_AFTER", "3")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "out" / "regen.jsonl"
    args = ["regenerate", str(_recipe(tmp_path, gguf, 40)), "--out", str(out), "--engine", "llama.cpp",
            "--parallel", "1", "--threads", "1", "--max-new-tokens", "2", "--retries", "5"]
    t0 = time.monotonic()
    assert cli_main(args) == 2
    assert time.monotonic() - t0 < 15
    err = capsys.readouterr().err.strip().splitlines()
    assert len([x for x in err if "error" in x]) == 1 and "Traceback" not in "\n".join(err)
    assert "llama-server (pid" in err[-1] and "exited with 137" in err[-1] and "rerun the same command" in err[-1]
    kept = (out.parent / "regen.jsonl.tmp").read_text().splitlines()
    assert len(kept) == 3 and not out.exists()
    monkeypatch.delenv("FAKE_LLAMA_EXIT_AFTER")
    meta = out.parent / "regen.jsonl.tmp.meta.json"
    settings = json.loads(meta.read_text())
    meta.write_text(json.dumps({k: v for k, v in settings.items() if k != "samplers"}))  # rows of an older client
    assert cli_main(args) == 2  # rows sampled with the server's defaults are not mixed with untruncated ones
    assert "samplers: None ->" in capsys.readouterr().err
    meta.write_text(json.dumps(settings))
    assert cli_main(args) == 0  # the rerun resumes after the rows already written
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [f"r{i}" for i in range(40)]


def test_regenerate_through_the_engine_names_every_sampler_and_each_row_records_it(engine, tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp, "require", lambda: engine)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "out" / "regen.jsonl"
    assert cli_main(["regenerate", str(_recipe(tmp_path, gguf, 8)), "--out", str(out), "--engine", "llama.cpp",
                     "--parallel", "2", "--threads", "1", "--max-new-tokens", "2", "--temperature", "0,1"]) == 0
    chats = [r for r in fake.requests(engine.root) if "messages" in r]
    assert len(chats) == 8  # llama-server's defaults (top-k 40, top-p 0.95, min-p 0.05) never apply
    assert {(r["top_k"], r["top_p"], r["min_p"], r["typical_p"], r["repeat_penalty"]) for r in chats} == \
        {(0, 1.0, 0.0, 1.0, 1.0)}
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert {r["temperature"] for r in rows} == {0.0, 1.0}
    assert sorted(r["temperature"] for r in chats) == sorted(r["temperature"] for r in rows)
    assert all(r["sampler"] == {"temperature": r["temperature"], "top_k": 0, "top_p": 1.0, "min_p": 0.0} for r in rows)


@pytest.mark.parametrize("temp", ["1e9", "1e-6", "nan", "inf", "0,1e9"])
def test_a_temperature_the_decoder_refuses_is_refused_by_every_regenerate_path(engine, tmp_path, capsys, monkeypatch,
                                                                             temp):
    monkeypatch.setattr(llama_cpp, "require", lambda: engine)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    recipe = str(_recipe(tmp_path, gguf, 2))
    for path in (["--engine", "llama.cpp"], ["--server", "http://127.0.0.1:9"], []):  # engine, server, in-process
        out = tmp_path / f"o{len(path)}.jsonl"
        assert cli_main(["regenerate", recipe, "--out", str(out), "--temperature", temp, *path]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "error: --temperature" in err[0] and str(float(temp.split(",")[-1])) in err[0], err
        assert "outside the supported range" in err[0] or "finite" in err[0]
    assert not engine.binary(fake.STATE).exists()  # no server was started


BENCH = """#!/bin/sh
echo $$ > "{pid}"; sleep 60 & echo $! > "{child}"; wait
"""
SCRIPT = """import sys
from pathlib import Path
from spectrain.engines.llama_cpp import Engine
from spectrain.eval.engine import cost_curve
cost_curve(Engine(Path({root!r})), Path("m.gguf"), 64, 1)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(path: Path, seconds: float = 60) -> int:
    deadline = time.monotonic() + seconds
    while not (path.is_file() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return int(path.read_text())


def test_sigterm_during_llama_bench_stops_it(tmp_path):
    exe = tmp_path / "e" / "build" / "bin" / "llama-bench"
    exe.parent.mkdir(parents=True)
    exe.write_text(BENCH.format(pid=tmp_path / "pid", child=tmp_path / "child"))
    exe.chmod(0o755)
    p = subprocess.Popen([sys.executable, "-c", SCRIPT.format(root=str(tmp_path / "e"))], stderr=subprocess.DEVNULL,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    bench, child = _wait_for(tmp_path / "pid"), _wait_for(tmp_path / "child")
    try:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while (_alive(bench) or _alive(child)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(bench) and not _alive(child)
    finally:
        for pid in (bench, child):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
