"""`spectrain regenerate --server` against a misbehaving server (tests/openai_server.py ScriptedServer, on
127.0.0.1, no model): no redirect is followed and the API key never leaves the configured host; setup errors
(401 / 403 / 404 / another model) stop the run at once and leave nothing that blocks the corrected rerun;
answers that do not fit their request are never written; one deadline per request; Retry-After honoured
(bounded); resume refuses changed input rows; one writer per output; no temp name is written through a link."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from spectrain.cli import main as cli_main
from spectrain.data import regen_server as rs
from spectrain.data import regenerate as rg
from spectrain.io.outputs import exclusive_lock, open_nofollow

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openai_server import Reply, ScriptedServer, answer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "assets" / "reference-target"
ROWS = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"},
                                     {"role": "assistant", "content": "old answer"}]} for i in range(3)]


@pytest.fixture
def recipe(tmp_path) -> Path:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    path = tmp_path / "recipe.yaml"
    path.write_text(f"target: {{name_or_path: {REF}}}\ndata: {{train_files: [{data}]}}\n")
    return path


@pytest.fixture(autouse=True)
def _fast(monkeypatch):
    monkeypatch.setattr(rs, "BACKOFF_S", 0.01)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


def _run(recipe: Path, out: Path, url: str, *extra: str) -> int:
    return cli_main(["regenerate", str(recipe), "--out", str(out), "--server", url, "--max-new-tokens", "8",
                     "--concurrency", "2", "--retries", "0", *extra])


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(out.name))


def _one_line_error(err: str, *words: str) -> None:
    """stderr ends in exactly one error line (before it only the progress bar) holding every word."""
    lines = [x for x in err.splitlines() if "error" in x]
    assert len(lines) == 1 and err.endswith(lines[0] + "\n") and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], err


def test_redirect_is_refused_and_the_key_never_leaves_the_configured_host(recipe, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    out = tmp_path / "o.jsonl"
    with ScriptedServer(lambda b, n: Reply()) as other:
        elsewhere = other.url + "/v1/chat/completions"
        with ScriptedServer(lambda b, n: Reply(307, {}, {"Location": elsewhere})) as srv:
            assert _run(recipe, out, srv.url) == 2
        assert other.requests == []  # neither the request nor the key went there
    assert srv.requests and all(r["headers"]["Authorization"] == "Bearer sk-secret" for r in srv.requests)
    _one_line_error(capsys.readouterr().err, "HTTP 307", elsewhere, "follows no redirect")
    assert _leftovers(out) == []


@pytest.mark.parametrize("status, words", [(401, ["OPENAI_API_KEY is not set", "--api-key"]),
                                           (403, ["OPENAI_API_KEY"]),
                                           (404, ["--server-model", "/v1/models"])])
def test_setup_errors_stop_at_once_and_the_corrected_rerun_runs(recipe, tmp_path, capsys, status, words):
    out = tmp_path / "o.jsonl"
    with ScriptedServer(lambda b, n: Reply(status, {"error": {"message": "nope"}})) as srv:
        assert _run(recipe, out, srv.url, "--concurrency", "1") == 2
        assert len(srv.requests) == 1  # the first refusal stops the run: no row after it is asked
    _one_line_error(capsys.readouterr().err, f"HTTP {status}", *words)
    assert _leftovers(out) == []  # no empty output, no temp that would refuse the rerun's other settings
    with ScriptedServer(lambda b, n: Reply()) as srv:
        assert _run(recipe, out, srv.url, "--server-model", "served-name") == 0
    assert [r["id"] for r in map(json.loads, out.read_text().splitlines())] == ["r0", "r1", "r2"]
    assert "answered by served-name (3)" in capsys.readouterr().out
    assert _leftovers(out) == ["o.jsonl"]


@pytest.mark.parametrize("resp, words", [
    ({"content": "x" * 5_000_000}, ["over", "bytes", "max_tokens 8"]),  # a 5 MB answer to 8 tokens
    ({"content": "x" * 4000}, ["4000 bytes", "max_tokens 8"]),
    ({"usage": {"completion_tokens": 9}}, ["usage.completion_tokens = 9 exceeds", "max_tokens 8"]),
    ({"usage": {"completion_tokens": -1}}, ["usage.completion_tokens = -1 is not a non-negative integer"]),
    ({"usage": {"prompt_tokens": "many"}}, ["usage.prompt_tokens = 'many'"]),
    ({"content": ["a"]}, ["choices[0].message.content is a list"]),
    ({"choices": []}, ["not a chat-completion response"]),
])
def test_answers_that_do_not_fit_the_request_are_not_written(recipe, tmp_path, capsys, resp, words):
    def script(body, n):
        if "content" in resp:
            return Reply(body=answer(body, resp["content"]))
        return Reply(body=answer(body, **resp))

    out = tmp_path / "o.jsonl"
    with ScriptedServer(script) as srv:
        assert _run(recipe, out, srv.url) == 1
    said = capsys.readouterr().out
    assert "3 failed (server: " in said and "not written" in said and not out.exists()
    assert all(w in said for w in words), said
    assert (tmp_path / "o.jsonl.tmp").read_text() == ""  # nothing of it kept for the rerun


def test_an_answer_from_another_model_stops_the_run(recipe, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    with ScriptedServer(lambda b, n: Reply(body=answer(b, model="other-model"))) as srv:
        assert _run(recipe, out, srv.url, "--server-model", "mine") == 2
    _one_line_error(capsys.readouterr().err, "answered as model 'other-model'", "not the requested 'mine'")
    assert _leftovers(out) == []
    assert rs._same_model("gpt-4o-2024-08-06", "gpt-4o") and not rs._same_model("gpt-4o", "llama")


def test_a_trickling_server_meets_one_whole_request_deadline():
    client = rs.ChatClient(rs.ServerConfig(urls=["http://127.0.0.1:1"], model="m", timeout_s=0.6, retries=0))
    with ScriptedServer(lambda b, n: Reply(trickle_s=0.05)) as srv:  # a byte every 50 ms: each read is quick
        client.cfg.urls = [rs.endpoint(srv.url)]
        t0 = time.monotonic()
        with pytest.raises(rs.ServerUnavailable, match="no complete answer within --timeout 0.6s"):
            client.complete({"model": "m", "messages": [], "max_tokens": 8})
        assert time.monotonic() - t0 < 3.0


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf"])
def test_a_timeout_that_is_no_deadline_is_refused(recipe, tmp_path, capsys, timeout):
    assert _run(recipe, tmp_path / "o.jsonl", "http://127.0.0.1:1", "--timeout", timeout) == 2
    _one_line_error(capsys.readouterr().err, f"--timeout {float(timeout)}: give seconds > 0")


def test_retry_after_is_honoured_and_bounded(monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(rs, "_sleep", lambda stopped, seconds: waits.append(seconds))
    plan = [Reply(429, {}, {"Retry-After": "3"}), Reply(503, {}, {"Retry-After": "86400"}),
            Reply(503, {}, {"Retry-After": "Thu, 01 Jan 1970 00:00:00 GMT"}), Reply()]
    with ScriptedServer(lambda b, n: plan[n]) as srv:
        client = rs.ChatClient(rs.ServerConfig(urls=[srv.url], model="m", retries=3, timeout_s=5))
        assert client.complete({"model": "m", "messages": [], "max_tokens": 8})["choices"]
    assert waits == [3.0, rs.RETRY_AFTER_MAX_S, 0.04]  # a date in the past: the plain backoff (0.01 * 2**2)
    assert rs.retry_after("nan") == 0.0 and rs.retry_after("-5") == 0.0 and rs.retry_after("soon") == 0.0


def test_a_stopped_client_gives_up_its_retries_at_once(monkeypatch):
    """Ctrl-C stops the engine first; requests still backing off (1 + 2 + 4 + ... s) must not hold the process."""
    import threading

    monkeypatch.setattr(rs, "BACKOFF_S", 1.0)
    with ScriptedServer(lambda b, n: Reply(503)) as srv:
        client = rs.ChatClient(rs.ServerConfig(urls=[srv.url], model="m", retries=5, timeout_s=5))
        threading.Timer(0.3, client.stop).start()
        t0 = time.monotonic()
        with pytest.raises(rs.ServerUnavailable, match=r"HTTP 503 \(the client stopped\)"):
            client.complete({"model": "m", "messages": [], "max_tokens": 8})
        assert time.monotonic() - t0 < 2.0  # unstopped: 1 + 2 + 4 + 8 + 16 s of backoff


def test_resume_refuses_rows_made_from_other_input(recipe, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    with ScriptedServer(lambda b, n: Reply() if n == 0 else Reply(503)) as srv:  # one answer, then down
        assert _run(recipe, out, srv.url, "--concurrency", "1") == 1
    assert len((tmp_path / "o.jsonl.tmp").read_text().splitlines()) == 1
    data = tmp_path / "rows.jsonl"
    original = data.read_text()
    data.write_text(original.replace("question 0", "another question"))  # same file name, other content
    capsys.readouterr()
    with ScriptedServer(lambda b, n: Reply()) as srv:
        assert _run(recipe, out, srv.url) == 2
        assert srv.requests == []
        _one_line_error(capsys.readouterr().err, "started from other input rows", "delete")
        data.write_text(original)  # the data it was started from: resumes
        assert _run(recipe, out, srv.url) == 0
        assert len(srv.requests) == 2
    assert "3 rows written (1 from an earlier run)" in capsys.readouterr().out


def test_one_writer_per_output(recipe, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    with ScriptedServer(lambda b, n: Reply()) as srv:
        with exclusive_lock(tmp_path / "o.jsonl.lock", "--out o.jsonl"):  # a first run holds it
            assert _run(recipe, out, srv.url) == 2
            assert srv.requests == []
        _one_line_error(capsys.readouterr().err, "being written by another spectrain process", "o.jsonl.lock")
        assert _run(recipe, out, srv.url) == 0  # the holder is gone: runs, and leaves no lock file
    assert _leftovers(out) == ["o.jsonl"]


@pytest.mark.parametrize("suffix", [".tmp", ".tmp.meta.json", ".done", ".lock", ".merging"])
def test_no_temp_name_is_written_through_a_planted_link(recipe, tmp_path, capsys, suffix):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "o.jsonl"
    (tmp_path / f"o.jsonl{suffix}").symlink_to(victim)
    with ScriptedServer(lambda b, n: Reply()) as srv:
        assert _run(recipe, out, srv.url) == 2
        assert srv.requests == []
    _one_line_error(capsys.readouterr().err, "symbolic link", f"o.jsonl{suffix}")
    assert victim.read_text() == "keep me" and not out.exists()


def test_a_link_planted_after_the_check_is_refused_at_the_write(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / "o.jsonl.merging"
    link.symlink_to(victim)
    with pytest.raises(FileExistsError, match="symbolic link"):
        rg._merge([], [], tmp_path / "o.jsonl", None)
    for mode in ("a", "w", "r+b"):
        with pytest.raises(FileExistsError, match="symbolic link"):
            open_nofollow(link, mode)
    assert victim.read_text() == "keep me"
