"""`spectrain regenerate --server`: a local OpenAI-compatible server backed by the bundled reference target
answers; the output equals the in-process regeneration, resumes after a server outage and after a killed
client with no row lost or doubled; chat-template arguments and the reasoning modes reach the answers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spectrain.cli import main as cli_main
from spectrain.data import generate as G
from spectrain.data import regen_server as rs
from spectrain.data import regenerate as rg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openai_server import OpenAIServer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "assets" / "reference-target"
N_ROWS, M = 10, 12


@pytest.fixture(scope="module")
def target():
    from spectrain.targets.model import load_target

    return load_target(str(REF))


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("regen-server")
    rows = [json.loads(line) for line in (ROOT / "data/train/chat_mix_messages.jsonl").open()][:N_ROWS - 1]
    rows.append({"id": "two-turn", "messages": [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one."}, {"role": "assistant", "content": "Red."}]})
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = root / "recipe.yaml"
    path.write_text(f"target: {{name_or_path: {REF}}}\ndata: {{train_files: [{data}]}}\n")
    return path


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _cli(recipe: Path, out: Path, url: str, *extra: str) -> int:
    return cli_main(["regenerate", str(recipe), "--out", str(out), "--server", url, "--max-new-tokens", str(M),
                     "--concurrency", "3", *extra])


def test_server_answers_equal_in_process_and_resume_after_an_outage(target, recipe, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(rs, "BACKOFF_S", 0.01)
    ids = [r["id"] for r in _read(Path(str(recipe).replace("recipe.yaml", "rows.jsonl")))]
    local = tmp_path / "local.jsonl"
    rg.regenerate(str(recipe), [], local, G.RegenConfig(max_new_tokens=M, batch_size=1))
    out = tmp_path / "served.jsonl"
    with OpenAIServer(target, fail_after=4) as srv:  # goes down after 4 answered requests
        assert _cli(recipe, out, srv.url, "--retries", "1") == 1
    said = capsys.readouterr().out
    assert "failed (server: " in said and "not written" in said and not out.exists()
    partial = _read(out.with_name(out.name + ".tmp"))
    assert 0 < len(partial) < N_ROWS and len({r["id"] for r in partial}) == len(partial)
    with OpenAIServer(target) as srv:  # back up: the rerun asks only for the missing rows
        assert _cli(recipe, out, srv.url + "/v1") == 0
        assert len(srv.requests) == N_ROWS + 1 - len(partial) - any(r["id"] == "two-turn" for r in partial)
    said = capsys.readouterr().out
    assert f"regenerate: {N_ROWS} rows written ({len(partial)} from an earlier run)" in said
    assert "answers " in said and "truncated at max_new_tokens " in said
    got = _read(out)
    assert [r["id"] for r in got] == ids  # input order, no row lost or doubled
    # the server decodes what the in-process path decodes; each row says which sampler wrote it: spectrain's own
    # (no truncation) in-process, the temperature alone through a server that was sent nothing else (its defaults)
    mine = _read(local)
    assert [r.pop("sampler") for r in mine] == [{"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}] * N_ROWS
    assert [r.pop("sampler") for r in got] == [{"temperature": 0.0, "top_k": None, "top_p": None, "min_p": None}] * \
        N_ROWS
    assert got == mine
    assert len(got[-1]["messages"]) == 4 and got[-1]["messages"][1]["content"] != "Blue."


@pytest.mark.slow  # a subprocess that imports torch: ~10 s here
def test_killed_client_resumes_without_lost_or_doubled_rows(target, recipe, tmp_path):
    out, tmp = tmp_path / "killed.jsonl", tmp_path / "killed.jsonl.tmp"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with OpenAIServer(target, delay_s=0.3) as srv:
        cmd = [sys.executable, "-m", "spectrain", "regenerate", str(recipe), "--out", str(out), "--server", srv.url,
               "--max-new-tokens", str(M), "--concurrency", "2"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline and (not tmp.exists() or len(tmp.read_text().splitlines()) < 3):
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not out.exists()
        kept = len(tmp.read_text().splitlines())
        assert 3 <= kept < N_ROWS
        srv.delay_s = 0.0
        assert _cli(recipe, out, srv.url) == 0
    ids = [r["id"] for r in _read(out)]
    assert len(ids) == N_ROWS and len(set(ids)) == N_ROWS and not tmp.exists()


def test_chat_template_kwargs_reach_the_template_and_the_request(target, recipe, tmp_path):
    tok = target.tokenizer
    thinking = tok.chat_template.replace("{% if add_generation_prompt %}{{ '<|assistant|>\n' }}",
                                         "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}"
                                         "{% if enable_thinking is defined and not enable_thinking %}"
                                         "{{ '<think>\n\n</think>\n\n' }}{% endif %}")
    assert thinking != tok.chat_template
    msgs = [{"role": "user", "content": "hi"}]
    old, tok.chat_template = tok.chat_template, thinking
    try:
        plain = G._prompt_ids(tok, msgs)
        off = G._prompt_ids(tok, msgs, {"enable_thinking": False})
    finally:
        tok.chat_template = old
    assert len(off) > len(plain) and "</think>" in tok.decode(off)
    with OpenAIServer(target) as srv:
        assert cli_main(["regenerate", str(recipe), "--out", str(tmp_path / "k.jsonl"), "--server", srv.url, "--n", "2",
                         "--max-new-tokens", "4", "--chat-template-kwargs", '{"enable_thinking": false}',
                         "data.chat_template_kwargs={enable_thinking: true, custom: 1}"]) == 0
    assert all(r["chat_template_kwargs"] == {"enable_thinking": False, "custom": 1} for r in srv.requests)


def test_reasoning_modes():
    text = "<think>\nstep 1\n</think>\n\nThe answer."
    assert rs.apply_reasoning(text, "", "strip") == "The answer."
    assert rs.apply_reasoning("<think>\ncut by max_new", "", "strip") == ""
    assert rs.apply_reasoning(text, "", "keep") == text
    assert rs.apply_reasoning("\n\nThe answer.", "step 1", "keep") == text  # a server's reasoning_content
    assert rs.apply_reasoning("The answer.", "step 1", "strip") == "The answer."


def test_server_rejections_skip_rows_and_bad_flags(target, recipe, tmp_path, capsys):
    with OpenAIServer(target) as srv:  # 4000 new tokens do not fit the 2048 positions: every request is a 400
        assert _cli(recipe, tmp_path / "r.jsonl", srv.url, "--max-new-tokens", "4000", "--n", "2") == 0
    said = capsys.readouterr().out
    assert "0 rows written" in said and "2  first turn: server rejected the request: HTTP 400" in said
    for bad, msg in ((["--server", "localhost:8000"], "give an http(s) URL"),
                     (["--server", "http://127.0.0.1:1", "--concurrency", "0"], "--concurrency 0"),
                     (["--chat-template-kwargs", "[1]"], "JSON object"),
                     (["--reasoning", "drop"], "invalid choice")):
        assert cli_main(["regenerate", str(recipe), "--out", str(tmp_path / "b.jsonl"), *bad]) == 2
        assert msg in capsys.readouterr().err
    assert rs.endpoint("http://h:8000/v1/") == "http://h:8000/v1/chat/completions"
    assert rs.endpoint("https://h/v1/chat/completions") == "https://h/v1/chat/completions"
