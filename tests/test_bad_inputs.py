"""The catalogue of bad inputs and faults (issue 11): for every case, the exit status (CLI, run in-process)
or the exception type (API), a message naming the problem, and no traceback. Cases that must be *accepted*
(an extended run, --force onto a symlink, a rebuilt cache ...) are here too, with what they must produce.

One tiny trained EAGLE-3 run + one export per module (a few seconds); each case corrupts a copy.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from test_evaluate import _tiny_tokenizer

from spectrain.cli import main as cli_main

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """target/ (tiny llama + chat tokenizer), chat.jsonl, recipe.yaml, run/ (2 steps: step-1, step-2, last,
    best, init) and exp/ (its vllm-eagle3 export)."""
    d = tmp_path_factory.mktemp("bad-inputs")
    tok = _tiny_tokenizer()
    make_tiny_model("llama", vocab_size=len(tok), max_positions=160).save_pretrained(d / "target")
    tok.save_pretrained(d / "target")
    with open(d / "chat.jsonl", "w") as f:
        for i in range(24):
            f.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": f"what is {i} plus {i}? add them"},
                {"role": "assistant", "content": f"the answer is {2 * i}"}]}) + "\n")
    (d / "recipe.yaml").write_text(
        f"target: {{name_or_path: {d / 'target'}, dtype: float32}}\n"
        f"data: {{train_files: [{d / 'chat.jsonl'}], heldout_fraction: 0.25, max_length: 64, "
        f"cache_dir: {d / 'cache'}}}\n"
        "drafter: {kind: eagle3, eagle3: {draft_vocab_size: 64, ttt_steps: 2}}\n"
        "training: {global_batch_size: 4, micro_batch_size: 2, max_steps: 2, warmup_steps: 0, eval_every: 2, "
        "checkpoint_every: 1, keep_checkpoints: 3, precision: fp32, lr: 1.0e-3}\n"
        f"tracking: {{report_to: [jsonl]}}\noutput_dir: {d / 'run'}\n")
    assert cli_main(["train", str(d / "recipe.yaml")]) == 0
    assert cli_main(["export", str(d / "run"), "--format", "vllm-eagle3", "--out", str(d / "exp"),
                     "--target", str(d / "target")]) == 0
    return d


@pytest.fixture(scope="module")
def target(world):
    from spectrain import load_target

    return load_target(str(world / "target"), device="cpu")


def copy_run(world: Path, tmp: Path) -> Path:
    shutil.copytree(world / "run", tmp / "run", symlinks=True)
    return tmp / "run"


def flip(path: Path, at: float = 0.6) -> None:
    """Flip one byte in the data region (the header still parses: silent corruption)."""
    b = bytearray(path.read_bytes())
    b[int(len(b) * at)] ^= 0xFF
    path.write_bytes(bytes(b))


def payload(marker: Path) -> bytes:
    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    return pickle.dumps(Evil())


def refused(capsys, argv: list[str], pattern: str, status: int = 2) -> str:
    """Run the CLI in-process: exit status, ONE error line matching `pattern`, no traceback."""
    import re

    rc = cli_main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("spectrain ") and ("error" in x or "FAILED" in x)]
    assert rc == status, err
    assert len(lines) == 1, err
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in err
    if status == 2 and "FAILED" not in lines[0]:
        assert "SPECTRAIN_DEBUG=1" in lines[0]
    return lines[0]


def train_argv(world: Path, run: Path, *overrides: str) -> list[str]:
    return ["train", str(world / "recipe.yaml"), f"output_dir={run}", *overrides]


# ---- 1. no code runs from a checkpoint ---------------------------------------------------------------


def test_planted_pickle_runs_nothing_and_is_refused(world, tmp_path, capsys):
    run = copy_run(world, tmp_path)
    marker = tmp_path / "PWNED"
    (run / "step-2" / "accelerate" / "custom_checkpoint_0.pkl").write_bytes(payload(marker))
    refused(capsys, train_argv(world, run, "training.resume_from=auto", "training.max_steps=3"),
            r"custom_checkpoint_0\.pkl is not listed in .*SHA256SUMS: spectrain did not write it")
    assert not marker.exists()


def test_planted_pickle_with_a_resealed_manifest_is_still_refused(world, tmp_path, capsys):
    from spectrain.integrity import seal

    run = copy_run(world, tmp_path)
    marker = tmp_path / "PWNED"
    (run / "step-2" / "accelerate" / "custom_checkpoint_0.pkl").write_bytes(payload(marker))
    seal(run / "step-2")  # the attacker rewrote SHA256SUMS too
    refused(capsys, train_argv(world, run, "training.resume_from=auto"), r"custom_checkpoint_0\.pkl, a pickle "
            "spectrain did not write")
    rng = run / "step-2" / "accelerate" / "random_states_0.pkl"
    (run / "step-2" / "accelerate" / "custom_checkpoint_0.pkl").unlink()
    rng.write_bytes(payload(marker))
    seal(run / "step-2")
    refused(capsys, train_argv(world, run, "training.resume_from=auto"), r"random_states_0\.pkl is not plain RNG")
    assert not marker.exists()


def test_legacy_checkpoint_scheduler_pickle_read_as_data_only(world, tmp_path, capsys):
    """A checkpoint of an older spectrain (scheduler in accelerate's custom_checkpoint_0.pkl, no manifest):
    a plain-data one resumes, one holding objects is refused and runs nothing."""
    run = copy_run(world, tmp_path)
    step = run / "step-2"
    state = json.loads((step / "scheduler.json").read_text())
    for f in ("scheduler.json", "SHA256SUMS"):
        (step / f).unlink()
    torch.save(state, step / "accelerate" / "custom_checkpoint_0.pkl")
    assert cli_main(train_argv(world, run, "training.resume_from=auto", "training.max_steps=3")) == 0
    run2 = copy_run(world, tmp_path / "b")
    marker = tmp_path / "PWNED"
    for f in ("scheduler.json", "SHA256SUMS"):
        (run2 / "step-2" / f).unlink()
    (run2 / "step-2" / "accelerate" / "custom_checkpoint_0.pkl").write_bytes(payload(marker))
    refused(capsys, train_argv(world, run2, "training.resume_from=auto"), r"holds pickled objects, not plain data")
    assert not marker.exists()


def test_no_unsafe_load_in_the_codebase():
    """Every torch.load in spectrain and scripts passes weights_only=True; nothing calls pickle.load."""
    root = Path(__file__).resolve().parents[1]
    for f in [*root.glob("spectrain/**/*.py"), *root.glob("scripts/*.py")]:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            assert "pickle.load" not in line, f"{f}:{n}"
            if "torch.load(" in line:
                assert "weights_only=True" in line, f"{f}:{n}: {line.strip()}"


# ---- 2. integrity: flipped bytes refused by name everywhere --------------------------------------------


@pytest.mark.parametrize("where", ["step-2/model.safetensors", "step-2/accelerate/model.safetensors",
                                   "step-2/accelerate/optimizer.bin", "step-2/scheduler.json"])
def test_resume_refuses_a_corrupt_checkpoint_by_name(world, tmp_path, capsys, where):
    run = copy_run(world, tmp_path)
    flip(run / where)
    refused(capsys, train_argv(world, run, "training.resume_from=auto", "training.max_steps=3"),
            rf"{Path(where).name} is corrupt: its sha256 differs .*resume from another checkpoint")
    assert sorted(p.name for p in run.glob("step-*")) == ["step-1", "step-2"]


def test_an_earlier_checkpoint_never_overwrites_a_later_one(world, tmp_path, capsys):
    run = copy_run(world, tmp_path)
    before = (run / "step-2" / "SHA256SUMS").read_text()
    refused(capsys, train_argv(world, run, f"training.resume_from={run / 'step-1'}"),
            r"holds later checkpoints \(step-2\) that this resume would overwrite")
    flip(run / "step-1" / "accelerate" / "model.safetensors")
    refused(capsys, train_argv(world, run, f"output_dir={tmp_path / 'branch'}",
                               f"training.resume_from={run / 'step-1'}"), r"step-1.*model\.safetensors is corrupt")
    assert (run / "step-2" / "SHA256SUMS").read_text() == before


@pytest.mark.parametrize("ckpt", ["best", "init"])
def test_corrupt_best_or_init_refused_by_eval_export_and_load_drafter(world, target, tmp_path, capsys, ckpt):
    from spectrain import load_drafter

    run = copy_run(world, tmp_path)
    flip(run / ckpt / "model.safetensors")
    refused(capsys, ["eval", "--target", world / "target", "--drafter", run / ckpt, "--prompts", "mt_bench",
                     "--n", "1", "--max-new-tokens", "2", "--out", tmp_path / "ev"], r"model\.safetensors is corrupt")
    assert not (tmp_path / "ev").exists()
    refused(capsys, ["export", run / ckpt, "--format", "vllm-eagle3", "--out", tmp_path / "x"],
            r"model\.safetensors is corrupt")
    with pytest.raises(ValueError, match=r"model\.safetensors is corrupt.*another checkpoint"):
        load_drafter(str(run / ckpt), target)


def test_corrupt_or_incomplete_export_refused_by_validate(world, tmp_path, capsys):
    exp = tmp_path / "exp"
    shutil.copytree(world / "exp", exp)
    flip(exp / "model.safetensors")
    rc = cli_main(["export", str(exp), "--format", "vllm-eagle3", "--validate-only"])
    err = capsys.readouterr().err
    assert rc == 2 and "model.safetensors is corrupt" in err and "Traceback" not in err
    (exp / "model.safetensors").unlink()
    assert cli_main(["export", str(exp), "--format", "vllm-eagle3", "--validate-only"]) == 2
    assert "model.safetensors is listed in SHA256SUMS but missing" in capsys.readouterr().err


def test_every_checkpoint_and_export_carries_checksums(world):
    from spectrain.integrity import problems, read_manifest

    for d in ("run/step-1", "run/step-2", "run/best", "run/init", "exp"):
        listed = read_manifest(world / d)
        assert listed and "model.safetensors" in listed and problems(world / d) == [], d
    assert "accelerate/optimizer.bin" in read_manifest(world / "run/step-2")


# ---- 3. read errors of damaged files: one line, no traceback (no manifest to catch them first) ---------


def _strip(d: Path) -> Path:
    (d / "SHA256SUMS").unlink()
    return d


def test_truncated_weights_without_manifest(world, target, tmp_path, capsys):
    from spectrain import load_drafter

    run = copy_run(world, tmp_path)
    w = _strip(run / "best") / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    refused(capsys, ["export", run / "best", "--format", "vllm-eagle3", "--out", tmp_path / "x"],
            r"best/model\.safetensors is truncated or not a safetensors file")
    refused(capsys, ["eval", "--target", world / "target", "--drafter", run / "best", "--prompts", "mt_bench",
                     "--n", "1", "--max-new-tokens", "2"], r"best/model\.safetensors is truncated")
    with pytest.raises(ValueError, match="model.safetensors is truncated"):
        load_drafter(str(run / "best"), target)


def test_renamed_tensor_without_manifest(world, target, tmp_path):
    from safetensors.torch import load_file, save_file

    from spectrain import load_drafter

    run = copy_run(world, tmp_path)
    w = _strip(run / "best") / "model.safetensors"
    sd = load_file(str(w))
    sd["fc.weight_renamed"] = sd.pop("fc.weight")
    save_file(sd, str(w))
    with pytest.raises(ValueError, match=r"cannot load the drafter weights in .*best.*fc\.weight"):
        load_drafter(str(run / "best"), target)


def test_damaged_trainer_state_is_named(world, tmp_path, capsys):
    run = copy_run(world, tmp_path)
    _strip(run / "step-2")
    (run / "step-2" / "trainer_state.json").write_text("{not json")
    refused(capsys, train_argv(world, run, "training.resume_from=auto"), r"trainer_state\.json is not valid JSON")


def test_corrupt_tokenized_data_cache_is_named_discarded_and_rebuilt(world, tmp_path, capsys):
    from spectrain.data import build_dataset
    from spectrain.recipe import load_recipe

    r = load_recipe(world / "recipe.yaml", [f"data.cache_dir={tmp_path / 'c'}"])
    tok = _tiny_tokenizer()
    good = build_dataset(r.data, tok, "train", verbose=False)
    (cache,) = (tmp_path / "c").glob("train-*.pt")
    cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])
    again = build_dataset(r.data, tok, "train", verbose=False)
    assert f"tokenized-data cache {cache} is corrupt" in capsys.readouterr().err
    assert torch.equal(again.input_ids, good.input_ids) and cache.is_file()  # rebuilt and re-cached


# ---- 4. Python API inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, pattern", [
    ({"input_ids": [1, 2, 10**6]}, r"token id 1000000 \(input_ids position 2\) is outside the target's vocabulary of \d+"),
    ({"input_ids": [-1, 2]}, r"token id -1"),
    ({"input_ids": [[1, 2], [3, 99999]]}, r"token id 99999"),
    ({"input_ids": torch.tensor([1.0, 2.0])}, r"integer token ids"),
    ({"tree": {"topk": 0}}, r"tree option topk=0 must be a positive integer"),
    ({"tree": {"topkk": 4}}, r"unknown tree option 'topkk' \(did you mean 'topk'\?\)"),
    ({"tree": {"topk": 2, "depth": -1}}, r"depth=-1"),
    ({"tree": [4, 5]}, r"tree must be a dict"),
    ({"temperature": float("nan")}, r"temperature must be a finite number"),
    ({"temperature": float("inf")}, r"temperature must be a finite number"),
    ({"temperature": -1.0}, r"temperature must be >= 0"),
    ({"top_p": float("nan")}, r"top_p must be a finite number"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -3}, r"top_k must be an integer >= 0"),
    ({"k": 0}, r"k \(draft length / tree depth\) must be a positive integer"),
    ({"max_new_tokens": 0}, r"max_new_tokens must be a positive integer"),
])
def test_speculative_generate_refuses_bad_arguments(target, kw, pattern):
    from spectrain import speculative_generate
    from spectrain.drafters.ngram import NgramDrafter

    args = {"input_ids": [1, 5, 6, 7], "max_new_tokens": 4, "k": 2, **kw}
    with pytest.raises(ValueError, match=pattern):
        speculative_generate(target, NgramDrafter.from_spec("ngram"), **args)


def test_load_target_refuses_a_non_model_directory_or_file(tmp_path):
    from spectrain import load_target

    with pytest.raises(FileNotFoundError, match="directory without config.json"):
        load_target(str(tmp_path))
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        load_target(str(tmp_path / "f.txt"))
    with pytest.raises(ValueError, match="not a torch device"):
        load_target(str(tmp_path), device="gpu0")
