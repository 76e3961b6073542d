"""`spectrain regenerate`: target-answered conversations, checked against HF generate, read back by training,
resumed after a real interruption, seeded sampling, multi-rank merge, and the bad-input errors."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from spectrain.data import generate as G
from spectrain.data import regenerate as rg
from spectrain.data.generate import RegenConfig
from spectrain.data.regenerate import regenerate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_distributed import build_tiny_assets, write_recipe  # noqa: E402

M = 8  # max new tokens: short answers keep every test at a few seconds
TEMPLATE = (  # the tiny tokenizer's template plus a system role
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ 'System: ' + m['content'] + '\n' }}"
    "{% elif m['role'] == 'user' %}{{ '<|user|>\n' + m['content'] + '<|end|>\n' }}"
    "{% else %}{{ '<|assistant|>\n' + m['content'] + '<|end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
LONG = "repeat: " + " ".join(["red green blue cat dog sun moon tree"] * 40)  # > 256 - M tokens


def _msgs(*turns: tuple[str, str]) -> list[dict]:
    return [{"role": r, "content": c} for r, c in turns]


ROWS = [
    {"id": "two-turn", "messages": _msgs(("system", "Be brief."), ("user", "repeat: red cat"), ("assistant", "red cat ."),
                                         ("user", "repeat: sun moon tree"), ("assistant", "sun moon tree ."))},
    {"id": "one", "messages": _msgs(("user", "repeat: one two three four five six"), ("assistant", "x"))},
    {"conversations": [{"from": "human", "value": "repeat: dog"}, {"from": "gpt", "value": "dog ."}]},  # no id
    {"id": "too-long", "messages": _msgs(("user", LONG), ("assistant", "x"))},
    {"id": "cut-later", "messages": _msgs(("user", "repeat: blue"), ("assistant", "blue ."), ("user", LONG),
                                          ("assistant", "x"))},
    {"id": "no-answer", "messages": _msgs(("user", "repeat: stone"))},  # malformed for training: skipped
    {"id": "c5", "messages": _msgs(("user", "repeat: river stone one"), ("assistant", "river ."))},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("regen")
    assets = build_tiny_assets(root, n_rows=16)
    (assets["target"] / "chat_template.jinja").write_text(TEMPLATE)
    data = root / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "{not json\n")
    assets["data"] = data
    return {"root": root, "assets": assets, "recipe": write_recipe(root, assets, "regen")}


def _run(setup, name: str, recipe=None, overrides=(), **kw) -> tuple[Path, G.RegenStats]:
    out = setup["root"] / "out" / f"{name}.jsonl"
    kw = {"max_new_tokens": M, "batch_size": 3, **kw}
    stats = regenerate(str(recipe or setup["recipe"]), list(overrides), out, RegenConfig(**kw))
    return out, stats


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def greedy(setup) -> tuple[Path, G.RegenStats]:
    return _run(setup, "greedy")


def test_answers_equal_hf_greedy_generate_turn_by_turn(setup, greedy):
    from spectrain.targets.model import load_target

    out, stats = greedy
    target = load_target(str(setup["assets"]["target"]), dtype="float32", device="cpu")
    tok, stop = target.tokenizer, sorted(G.stop_token_ids(target))
    assert tok.eos_token_id in stop
    rows = _rows(out)
    by_id = {r.get("id"): r for r in ROWS}
    assert [r["id"] for r in rows][:2] == ["two-turn", "one"] and len(rows) == 5
    checked = 0
    for row in rows:
        src = by_id.get(row["id"])
        if src is not None:  # system / user turns are unchanged and in place
            kept = [m for m in row["messages"] if m["role"] != "assistant"]
            assert kept == [m for m in src["messages"] if m["role"] != "assistant"][: len(kept)]
        for j, m in enumerate(row["messages"]):
            if m["role"] != "assistant":
                continue
            text = tok.apply_chat_template(row["messages"][:j], tokenize=False, add_generation_prompt=True)
            ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
            gen = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=M,
                                        eos_token_id=stop, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
            if gen and gen[-1] in stop:
                gen = gen[:-1]
            text = tok.decode(gen, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            assert m["content"] == text, (row["id"], j)
            checked += 1
    assert checked == 6  # two-turn x2, one, the ShareGPT row, cut-later's first turn, c5
    assert stats.answers == 6 and stats.written == 5 and stats.shortened == 1


def test_skips_are_counted_and_row_ids_kept(greedy):
    out, stats = greedy
    rows = {r["id"]: r for r in _rows(out)}
    assert "too-long" not in rows and [m["role"] for m in rows["cut-later"]["messages"]] == ["user", "assistant"]
    sharegpt = next(r for k, r in rows.items() if k not in {"two-turn", "one", "cut-later", "c5"})
    assert len(sharegpt["id"]) == 16  # the stable hash data.py gives rows without an id
    assert sum(v for k, v in stats.skipped.items() if k.startswith("first turn: prompt longer")) == 1
    assert stats.skipped["malformed input: no assistant turn"] == 1
    assert stats.skipped["malformed input: malformed JSON line"] == 1
    assert stats.truncated <= stats.answers and stats.tokens >= stats.answers
    assert not list(out.parent.glob("greedy.jsonl.*"))  # tmp, meta and marker files are gone


def test_output_is_read_back_by_training(setup, greedy):
    from transformers import AutoTokenizer

    from spectrain.data.dataset import build_dataset
    from spectrain.recipe.schema import DataConfig

    out, _ = greedy
    tok = AutoTokenizer.from_pretrained(setup["assets"]["target"])
    cfg = DataConfig(train_files=[str(out)], max_length=256, heldout_fraction=0.0, cache_dir=str(setup["root"]))
    ds = build_dataset(cfg, tok, "train", use_cache=False, verbose=False)
    assert len(ds) == 5 and ds.report.skipped == {}
    first = _rows(out)[0]["messages"]
    masked = tok.decode(ds[0]["input_ids"][ds[0]["loss_mask"].bool()])
    assert first[2]["content"] in masked and first[4]["content"] in masked  # training sees the target's text


def test_resume_after_interruption_gives_the_same_file(setup, greedy, monkeypatch):
    real, calls = G.regenerate_batch, []

    def dies_on_second_batch(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(rg, "regenerate_batch", dies_on_second_batch)
    with pytest.raises(KeyboardInterrupt):
        _run(setup, "resumed")
    monkeypatch.setattr(rg, "regenerate_batch", real)
    tmp = setup["root"] / "out" / "resumed.jsonl.tmp"
    assert len(tmp.read_text().splitlines()) == 3 and not (setup["root"] / "out" / "resumed.jsonl").exists()
    with open(tmp, "a") as f:
        f.write('{"id": "c5", "messa')  # a write torn by the kill
    out, stats = _run(setup, "resumed")
    assert stats.resumed == 3 and stats.answers < greedy[1].answers
    assert out.read_bytes() == greedy[0].read_bytes()


def test_resume_refuses_other_settings(setup, monkeypatch):
    monkeypatch.setattr(rg, "regenerate_batch", lambda *a, **kw: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        _run(setup, "changed")
    with pytest.raises(ValueError, match="other settings.*temperature"):
        _run(setup, "changed", temperature=1.0)


def test_sampling_is_seeded_and_differs_from_greedy(setup, greedy):
    a, _ = _run(setup, "t-a", temperature=3.0, seed=1)
    b, _ = _run(setup, "t-b", temperature=3.0, seed=1, batch_size=1)  # per-row streams: batching is irrelevant
    c, _ = _run(setup, "t-c", temperature=3.0, seed=2)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != greedy[0].read_bytes() and a.read_bytes() != c.read_bytes()


def test_two_ranks_merge_in_input_order(setup, greedy, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    out, _ = _run(setup, "ranks")
    assert not out.exists() and (out.parent / "ranks.jsonl.rank1.done").exists()
    monkeypatch.setenv("RANK", "0")
    out, stats = _run(setup, "ranks")
    assert out.read_bytes() == greedy[0].read_bytes() and stats.written == 5
    assert stats.answers == greedy[1].answers and stats.tokens == greedy[1].tokens  # rank 1's counts included
    assert not list(out.parent.glob("ranks.jsonl.*"))


def test_generation_stops_at_a_stop_token(setup):
    from spectrain.targets.model import load_target

    target = load_target(str(setup["assets"]["target"]), dtype="float32", device="cpu")
    prompt = target.tokenizer("<s><|user|>\nrepeat: red<|end|>\n<|assistant|>\n", add_special_tokens=False)["input_ids"]
    ((free, truncated),) = G.generate_batch(target, [prompt], [0], M, 0.0, set())
    assert truncated and len(free) == M
    ((cut, truncated),) = G.generate_batch(target, [prompt], [0], M, 0.0, {free[3]})
    assert not truncated and cut == free[: free.index(free[3])]


def test_bad_input_errors(setup, tmp_path):
    with pytest.raises(ValueError, match="--n 0"):
        _run(setup, "e1", n=0)
    with pytest.raises(ValueError, match="is a directory"):
        regenerate(str(setup["recipe"]), [], tmp_path, RegenConfig())
    with pytest.raises(FileNotFoundError, match="data file not found"):
        _run(setup, "e2", overrides=[f"data.train_files=[{tmp_path}/missing.jsonl]"])
    bare = tmp_path / "bare-target"
    shutil.copytree(setup["assets"]["target"], bare)
    (bare / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template.*chat_template"):
        _run(setup, "e3", overrides=[f"target.name_or_path={bare}"])
    done = setup["root"] / "out" / "exists.jsonl"
    done.write_text("")
    with pytest.raises(ValueError, match="already exists"):
        _run(setup, "exists")


def test_stop_ids_include_the_templates_end_of_turn_token():
    from types import SimpleNamespace

    from test_data import CHATML, make_tokenizer

    tok = make_tokenizer(CHATML, "<|begin_of_text|>")  # a base-model eos that is not the end-of-turn token
    fake = SimpleNamespace(model=SimpleNamespace(), config=SimpleNamespace(eos_token_id=None), tokenizer=tok)
    assert G.stop_token_ids(fake) == {tok.convert_tokens_to_ids("<|begin_of_text|>"),
                                       tok.convert_tokens_to_ids("<|im_end|>")}


def test_empty_answers_skip_or_shorten_rows(setup, monkeypatch):
    real = G.generate_batch

    def empty_sometimes(target, prompts, seeds, *a):
        # The target "answers" nothing to c5's first turn and to every later turn.
        texts = [target.tokenizer.decode(p) for p in prompts]
        empty = ["river" in t or t.count("<|assistant|>") > 1 for t in texts]
        return [([], False) if e else r for e, r in zip(empty, real(target, prompts, seeds, *a))]

    monkeypatch.setattr(G, "generate_batch", empty_sometimes)
    out, stats = _run(setup, "empty")
    rows = {r["id"]: r for r in _rows(out)}
    assert [m["role"] for m in rows["two-turn"]["messages"]] == ["system", "user", "assistant"]
    assert "c5" not in rows and stats.skipped["first turn: empty answer"] == 1
    assert stats.shortened == 2  # two-turn (empty second answer) and cut-later (over-long second prompt)
    assert all(m["content"].strip() for r in rows.values() for m in r["messages"])  # nothing training drops


def test_resume_with_repeated_ids_and_an_unterminated_last_line(setup, tmp_path):
    data = tmp_path / "dup.jsonl"
    rows = [{"id": "same", "messages": _msgs(("user", f"repeat: {w}"), ("assistant", "x"))}
            for w in ("red", "green", "blue")]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ov = [f"data.train_files=[{data}]"]
    full, _ = _run(setup, "dup-full", overrides=ov, batch_size=1)
    lines = full.read_text().splitlines()
    tmp = setup["root"] / "out" / "dup-part.jsonl.tmp"
    tmp.write_text(lines[0] + "\n" + lines[1])  # second row complete but without its newline: torn
    with pytest.raises(FileExistsError, match="regenerate did not write it"):  # no .meta.json: not its own part
        _run(setup, "dup-part", overrides=ov, batch_size=1)
    meta = setup["root"] / "out" / "dup-part.jsonl.tmp.meta.json"
    real_merge = rg._merge
    rg._merge = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt)  # killed after the part was written
    try:
        with pytest.raises(KeyboardInterrupt):
            tmp.unlink()
            _run(setup, "dup-part", overrides=ov, batch_size=1)
    finally:
        rg._merge = real_merge
    assert meta.is_file()
    tmp.write_text(lines[0] + "\n" + lines[1])
    out, stats = _run(setup, "dup-part", overrides=ov, batch_size=1)
    assert stats.resumed == 1 and stats.answers == 2
    assert out.read_bytes() == full.read_bytes() and len(lines) == 3


def test_command_line_arguments(setup):
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    rg.add_regenerate_args(p)
    out = setup["root"] / "out" / "cli.jsonl"
    args = p.parse_args([str(setup["recipe"]), "data.max_rows=5", "--out", str(out), "--n", "2",
                         "--max-new-tokens", "4", "--temperature", "0.5", "--seed", "3", "--batch-size", "2"])
    assert rg.main(args) == 0
    rows = _rows(out)
    assert [r["id"] for r in rows] == ["two-turn", "one"]
    assert all(len(m["content"]) > 0 for r in rows for m in r["messages"])


def test_temperature_mix_rows_equal_their_single_temperature_runs(setup, greedy):
    """A mix (0, 3) answers each row exactly as a run at that row's temperature alone (same seed), and the row
    records which temperature wrote it; the choice follows the id, so both kinds occur here."""
    mixed, _ = _run(setup, "mix", temperature=[0.0, 3.0], seed=1)
    hot, _ = _run(setup, "mix-hot", temperature=3.0, seed=1)
    by_t = {0.0: {r["id"]: r for r in _rows(greedy[0])}, 3.0: {r["id"]: r for r in _rows(hot)}}
    rows = _rows(mixed)
    assert {r["temperature"] for r in rows} == {0.0, 3.0}
    for r in rows:
        assert r["messages"] == by_t[r.pop("temperature")][r["id"]]["messages"]


def test_shuffle_orders_by_id_hash_and_skip_continues_an_earlier_n(setup, greedy):
    whole, _ = _run(setup, "shuf", shuffle=True)
    first, _ = _run(setup, "shuf-first", shuffle=True, n=2)
    rest, _ = _run(setup, "shuf-rest", shuffle=True, skip=2)
    ids = [r["id"] for r in _rows(whole)]
    assert ids != [r["id"] for r in _rows(greedy[0])] and sorted(ids) == sorted(r["id"] for r in _rows(greedy[0]))
    assert _rows(first) + _rows(rest) == _rows(whole)
    with pytest.raises(ValueError, match="--skip 99: the data has only .* nothing is left"):
        _run(setup, "shuf-none", shuffle=True, skip=99)


def test_temperature_flag_parses_a_mix_and_names_bad_values():
    assert rg._temperatures("0.7") == 0.7 and rg._temperatures("0,1") == [0.0, 1.0]
    with pytest.raises(Exception, match="comma-separated list"):
        rg._temperatures("0,hot")
    with pytest.raises(ValueError, match="must be >= 0"):
        RegenConfig(temperature=[0.0, -1.0]).validate()
    with pytest.raises(ValueError, match="--skip -1"):
        RegenConfig(skip=-1).validate()


def test_server_requests_carry_the_rows_temperature_and_a_seed_only_when_sampling():
    from spectrain.data import regen_server as rs

    class Client:
        cfg = rs.ServerConfig(urls=["http://x"], model="m")
        bodies: list = []

        def complete(self, body):
            self.bodies.append(body)
            return {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}

    cfg = RegenConfig(temperature=[0.0, 1.0], seed=3)
    rows = [{"id": f"r{i}", "messages": _msgs(("user", "hi"), ("assistant", "x"))} for i in range(12)]
    client = Client()
    outs = [rs.answer_row(client, r, cfg, {})[0] for r in rows]
    for out, body in zip(outs, client.bodies):
        assert body["temperature"] == out["temperature"] == cfg.row_temperature(out["id"])
        assert ("seed" in body) == (body["temperature"] > 0)
    assert {o["temperature"] for o in outs} == {0.0, 1.0}


def test_samples_answer_each_conversation_n_times_on_one_side_of_the_split(setup, greedy):
    """--samples 3 under a (0, 3) mix: each conversation three times in a row, the first exactly as the mix run
    alone, the extra ones (ID#s1, ID#s2) always sampled and different; every answer to a prompt on the side of the
    split its prompt is on, and the held-out set reads one answer per prompt."""
    from spectrain.data.chat import is_heldout, prompt_id
    from spectrain.data.dataset import _split_rows

    mixed, _ = _run(setup, "samples-base", temperature=[0.0, 3.0], seed=1)
    out, _ = _run(setup, "samples", temperature=[0.0, 3.0], seed=1, samples=3)
    rows, base = _rows(out), {r["id"]: r for r in _rows(mixed)}
    assert [r["id"] for r in rows] == [f"{i}{s}" for i in base for s in ("", "#s1", "#s2")]
    for r in rows:
        if r["id"] in base:
            assert r == base[r["id"]]
        else:
            assert r["temperature"] == 3.0 and r["messages"] != base[prompt_id(r["id"])]["messages"]
    for fraction in (0.2, 0.5, 0.8):
        assert all(is_heldout(r["id"], fraction) == is_heldout(prompt_id(r["id"]), fraction) for r in rows)
    cfg = type("D", (), {"heldout_fraction": 0.5, "heldout_rows": 0})()
    held = _split_rows(rows, cfg, "heldout")
    assert held == [r for r in rows if r["id"] in base and is_heldout(r["id"], 0.5)]


def test_samples_refuse_greedy_only_and_resume_reads_older_part_files(setup, tmp_path):
    with pytest.raises(ValueError, match="--samples 2 with --temperature 0.0: every answer after the first would "
                                         "repeat the greedy one"):
        RegenConfig(samples=2).validate()
    with pytest.raises(ValueError, match="--samples 0: must be >= 1"):
        RegenConfig(samples=0).validate()
    part = tmp_path / "x.jsonl.tmp"
    part.write_text("")
    meta = {"input_sha256": "a", **{k: v for k, v in rg.asdict(RegenConfig()).items() if k != "samples"}}
    part.with_name(part.name + ".meta.json").write_text(json.dumps(meta))
    rg._check_meta(part, {**meta, "samples": 1})  # a part file from before --samples resumes
    with pytest.raises(ValueError, match="samples: 1 -> 2"):
        rg._check_meta(part, {**meta, "samples": 2})
