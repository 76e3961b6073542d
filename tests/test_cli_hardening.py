"""Issue 30's smaller cases, each refused up front with one line or said instead of left silent:
`check --plan ''`, a plan whose global batch cannot be split over its GPUs, absurd `--mfu` values, repeated
eval values (`--k 2 --k 2`), FIFOs inside a directory (`spectrain seal`, drafter loading), HF baselines in the
batch-size and chain-length tables, and the vLLM layout warning without the target's embedding."""

from __future__ import annotations

import json
import os
import signal
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_evaluate import one_thread, write_tiny_chat_world  # noqa: F401  (one_thread: autouse, 1 torch thread)

from spectrain.cli import main as cli_main
from spectrain.drafters import load_drafter
from spectrain.export import eagle3 as export_eagle3
from spectrain.io.integrity import IntegrityError, problems
from spectrain.recipe.load import load_recipe
from spectrain.train.plan import DataSize, batch_split_problem, check_mfu, parse_hardware, plan_lines


def _one_line(err: str, *words: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err


# ---- check --plan / --mfu ---------------------------------------------------------------------------------


def test_check_refuses_an_empty_plan(capsys):
    assert cli_main(["check", "tiny/eagle3", "--plan", ""]) == 2
    _one_line(capsys.readouterr().err, "FAILED: --plan ''", "e.g. 8xH100")


@pytest.mark.parametrize("mfu", ["1e-300", "0", "-0.2", "1.5", "nan", "inf"])
def test_check_refuses_an_absurd_mfu(mfu, capsys):
    assert cli_main(["check", "tiny/eagle3", "--plan", "8xH100", "--mfu", mfu]) == 2
    _one_line(capsys.readouterr().err, f"--mfu {float(mfu)}", "fraction in [0.001, 1]")
    assert cli_main(["check", "tiny/eagle3", "--mfu", mfu]) == 2  # bad without --plan too
    assert check_mfu(0.3) == 0.3 and check_mfu(1.0) == 1.0


def _llama8b():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)


def test_a_plan_that_cannot_split_the_global_batch_fails_with_the_fix():
    r = load_recipe("eagle3")  # global 64, micro 2
    lines, problems_ = plan_lines(r, _llama8b(), DataSize(200_000, 2_000, 1200), parse_hardware("3xH100"))
    assert "global batch 64 is not divisible by micro 2 x 3" in "\n".join(lines)
    assert problems_ == ["global batch 64 cannot be split over 3 GPUs x micro 2 = 6 rows per micro-step: set "
                         "training.global_batch_size=66 (a multiple of 6)"]
    assert "training.micro_batch_size=1" in batch_split_problem(12, 2, 4)  # 12 = 1 x 4 x 3: a smaller micro fits
    _, ok = plan_lines(r, _llama8b(), DataSize(200_000, 2_000, 1200), parse_hardware("8xH100"))
    assert not any("cannot be split" in p for p in ok)


# ---- eval: repeated values ----------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, msg", [
    (["--k", "2", "--k", "2"], "--k 2 is given twice"),
    (["--temperature", "0", "--temperature", "0.0"], "--temperature 0.0 is given twice"),
    (["--tree", "topk=2,depth=3", "--tree", "depth=3,topk=2"], "--tree depth=3,topk=2 is given twice (also as "
                                                               "topk=2,depth=3)"),
    (["--drafter", "ngram", "--drafter", "ngram"], "--drafter ngram is given twice"),
])
def test_eval_refuses_a_repeated_value_before_loading(argv, msg, capsys):
    assert cli_main(["eval", "--target", "does/not/exist", *argv]) == 2  # before the target is even looked for
    _one_line(capsys.readouterr().err, msg, "give each value once")


# ---- FIFOs: seal and drafter loading -------------------------------------------------------------------------


@contextmanager
def _deadline(seconds: int):
    """Fail instead of hanging the suite if a FIFO is opened after all."""
    def boom(*_):
        raise TimeoutError("blocked on a FIFO")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("name", ["model.safetensors", "notes.txt", "sub/config.json"])
def test_a_fifo_in_a_directory_is_refused_not_waited_on(tmp_path, capsys, name):
    d = tmp_path / "head"
    (d / "sub").mkdir(parents=True)
    (d / "drafter_config.json").write_text(json.dumps({"kind": "eagle3"}))
    os.mkfifo(d / name)
    with _deadline(10):
        assert cli_main(["seal", str(d)]) == 2
        _one_line(capsys.readouterr().err, f"{d / name} is a named pipe (FIFO), not a regular file")
        assert not (d / "SHA256SUMS").exists()
        (d / "SHA256SUMS").write_text(f"{'0' * 64}  {name}\n")  # a manifest that lists it: still never opened
        target = SimpleNamespace(vocab_size=8, forward=None)
        with pytest.raises(IntegrityError, match="named pipe"):
            load_drafter(str(d), target)
        (d / "link").symlink_to(d / name)
        assert any("link is a named pipe" in p for p in problems(d))


# ---- HF baselines in the batch-size and chain-length tables --------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    d = write_tiny_chat_world(tmp_path_factory.mktemp("hf-tables"))
    (d / "prompts.jsonl").write_text(json.dumps({"prompt": "what is two plus two? what is two plus two? what"}) + "\n")
    return d


def _eval(world: Path, out: Path, *extra: str) -> int:
    return cli_main(["eval", "--target", str(world / "target"), "--prompts", str(world / "prompts.jsonl"), "--n", "1",
                     "--max-new-tokens", "6", "--k", "2", "--temperature", "0", "--batch-size", "1",
                     "--batch-size", "2", "--out", str(out), *extra])


def test_hf_baselines_are_said_to_be_skipped_not_left_as_empty_tables(world, tmp_path, capsys):
    assert _eval(world, tmp_path / "hf", "--drafter", "hf:plain", "--cost-curve") == 0
    err = capsys.readouterr().err
    assert "note: hf:plain: --batch-size skipped" in err and "note: hf:plain: the chain-length pick skipped" in err
    md = (tmp_path / "hf" / "report.md").read_text()
    assert "## Batch size" not in md and "| drafter | config | B |" not in md  # no header without rows
    costs = (tmp_path / "hf" / "cost_curve.md").read_text()
    assert "No chain length to pick" in costs and "Not in this table: hf:plain" in costs
    assert "| drafter | T | prompt set |" not in costs

    assert _eval(world, tmp_path / "mixed", "--drafter", "ngram", "--drafter", "hf:plain") == 0
    md = (tmp_path / "mixed" / "report.md").read_text()
    assert "| ngram | k=2 T=0 | 1 |" in md and "| hf:plain |" not in md.split("## Batch size")[1]
    assert "Not in these tables: hf:plain (HF's generate decodes one row at a time)." in md


# ---- export: the vLLM layout warning ------------------------------------------------------------------------


def test_vllm_layout_warning_is_printed_without_the_targets_embedding(tmp_path):
    cfg = {"target_vocab_size": 8, "hidden_size": 4, "norm_before_fc": True}
    _, notes = export_eagle3._with_embedding({}, cfg, str(tmp_path / "no-such-target"), "float32")
    assert any("embed_tokens.weight not written" in n for n in notes)
    assert any("layout ['norm_before_fc']" in n for n in notes)  # the head's layout, embedding or not
    _, notes = export_eagle3._with_embedding({}, {**cfg, "norm_before_fc": False}, "", "float32")
    assert not any("layout" in n for n in notes)
