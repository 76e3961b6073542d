"""The catalogue of bad inputs and faults (issue 11): for every case, the exit status (CLI, run in-process)
or the exception type (API), a message naming the problem, and no traceback. Cases that must be *accepted*
(an extended run, --force onto a symlink, a rebuilt cache ...) are here too, with what they must produce.

One tiny trained EAGLE-3 run + one export per module (a few seconds); each case corrupts a copy.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from test_evaluate import _tiny_tokenizer, write_tiny_chat_world

from spectrain.cli import main as cli_main

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """target/ (tiny llama + chat tokenizer), chat.jsonl, recipe.yaml, run/ (2 steps: step-1, step-2, last,
    best, init) and exp/ (its vllm-eagle3 export)."""
    d = write_tiny_chat_world(tmp_path_factory.mktemp("bad-inputs"))
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
    from spectrain.io.integrity import seal

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
    refused(capsys, train_argv(world, run, "training.resume_from=auto"), r"random_states_0\.pkl is not plain data")
    shutil.copy(world / "run" / "step-2" / "accelerate" / rng.name, rng)
    (run / "step-2" / "accelerate" / "optimizer.bin").write_bytes(payload(marker))  # read by accelerate itself
    seal(run / "step-2")
    refused(capsys, train_argv(world, run, "training.resume_from=auto"),
            r"holds a pickled object.*not plain data, and is not unpickled \(it could run code\)")
    assert not marker.exists()


def test_legacy_checkpoint_scheduler_pickle_read_as_data_only(world, tmp_path, capsys, monkeypatch):
    """A checkpoint of an older spectrain (scheduler in accelerate's custom_checkpoint_0.pkl, no manifest):
    a plain-data one resumes, one holding objects is refused and runs nothing."""
    monkeypatch.setenv("SPECTRAIN_ALLOW_UNSEALED", "1")  # an older spectrain's checkpoint has no manifest
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
    refused(capsys, train_argv(world, run2, "training.resume_from=auto"), r"custom_checkpoint_0\.pkl is not plain data .*could run code")
    assert not marker.exists()


def test_no_unsafe_load_in_the_codebase():
    """Every torch.load in spectrain and scripts passes weights_only=True; nothing calls pickle.load."""
    root = Path(__file__).resolve().parents[1]
    for f in [*root.glob("spectrain/**/*.py"), *root.glob("scripts/**/*.py")]:
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
    from spectrain.io.integrity import problems, read_manifest

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


def test_renamed_tensor_without_manifest(world, target, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    from spectrain import load_drafter

    monkeypatch.setenv("SPECTRAIN_ALLOW_UNSEALED", "1")
    run = copy_run(world, tmp_path)
    w = _strip(run / "best") / "model.safetensors"
    sd = load_file(str(w))
    sd["fc.weight_renamed"] = sd.pop("fc.weight")
    save_file(sd, str(w))
    with pytest.raises(ValueError, match=r"cannot load the drafter weights in .*best.*fc\.weight"):
        load_drafter(str(run / "best"), target)


def test_damaged_trainer_state_is_named(world, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECTRAIN_ALLOW_UNSEALED", "1")
    run = copy_run(world, tmp_path)
    _strip(run / "step-2")
    (run / "step-2" / "trainer_state.json").write_text("{not json")
    refused(capsys, train_argv(world, run, "training.resume_from=auto"), r"trainer_state\.json is not valid JSON")


def test_corrupt_tokenized_data_cache_is_named_discarded_and_rebuilt(world, tmp_path, capsys):
    from spectrain.data.dataset import build_dataset
    from spectrain.recipe.load import load_recipe

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
    ({"temperature": 1e-40}, r"temperature=1e-40 is outside the supported range: use 0 \(greedy\) or a value in \[0\.0001, 10000\]"),
    ({"temperature": 1e300}, r"temperature=1e\+300 is outside the supported range"),
    ({"top_p": float("nan")}, r"top_p must be a finite number"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -3}, r"top_k must be an integer >= 0"),
    ({"k": 0}, r"k \(draft length / tree depth\) must be a positive integer"),
    ({"max_new_tokens": 0}, r"max_new_tokens must be a positive integer"),
    ({"max_new_tokens": True}, r"max_new_tokens must be a positive integer, got True"),
    ({"max_new_tokens": 2.0}, r"max_new_tokens must be a positive integer, got 2\.0"),
    ({"k": True}, r"k \(draft length / tree depth\) must be a positive integer, got True"),
    ({"top_k": False}, r"top_k must be an integer >= 0"),
    ({"temperature": True}, r"temperature must be a finite number, got True"),
    ({"seed": 1.5}, r"seed must be an integer"),
    ({"batch_size": 0}, r"batch_size must be a positive integer"),
    ({"batch_size": True}, r"batch_size must be a positive integer, got True"),
    ({"attention_mask": [1, 1]}, r"attention_mask does not match input_ids: prompt lengths \[4\], mask lengths \[2\]"),
    ({"attention_mask": [1, 1, 2, 1]}, r"attention_mask must hold only 0 .* and 1"),
    ({"input_ids": [[1, 2], [3]], "attention_mask": [[1, 1], [1, 1]]}, r"attention_mask does not match input_ids"),
    ({"attention_mask": 5}, r"attention_mask must be a tensor or a list"),
])
def test_speculative_generate_refuses_bad_arguments(target, kw, pattern):
    from spectrain import speculative_generate
    from spectrain.drafters.ngram import NgramDrafter

    args = {"input_ids": [1, 5, 6, 7], "max_new_tokens": 4, "k": 2, **kw}
    with pytest.raises(ValueError, match=pattern):
        speculative_generate(target, NgramDrafter.from_spec("ngram"), **args)


def test_load_drafter_names_a_missing_directory(target, tmp_path):
    from spectrain import load_drafter

    with pytest.raises(FileNotFoundError, match=r"drafter directory not found: .*nope/best"):
        load_drafter(str(tmp_path / "nope" / "best"), target)
    with pytest.raises(ValueError, match=r"bad ngram option 'maxn=3'"):
        load_drafter("ngram:maxn=3", target)


def test_load_target_refuses_a_non_model_directory_or_file(tmp_path):
    from spectrain import load_target

    with pytest.raises(FileNotFoundError, match="target model dir not found"):
        load_target(str(tmp_path / "missing"))

    with pytest.raises(FileNotFoundError, match="directory without config.json"):
        load_target(str(tmp_path))
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        load_target(str(tmp_path / "f.txt"))
    with pytest.raises(ValueError, match="not a torch device"):
        load_target(str(tmp_path), device="gpu0")


# ---- 5. recipes and `check`: what train would refuse, check refuses first -------------------------------


def _recipe_cases(world: Path, tmp: Path) -> list[tuple[list, str]]:
    (tmp / "empty.yaml").write_text("")
    (tmp / "adir").mkdir()
    r = world / "recipe.yaml"
    return [
        (["check", tmp / "empty.yaml"], r"empty\.yaml is empty"),
        (["train", tmp / "empty.yaml"], r"empty\.yaml is empty"),
        (["check", tmp / "adir"], r"adir is a directory: give a YAML recipe file"),
        (["train", tmp / "nope.yaml"], r"recipe not found: .*nope\.yaml"),
        (["check", r, "drafter.eagle3.aux_layers=1,5"], r"aux_layers=\[1, 5\]: give 3 layer ids in ascending order"),
        (["train", r, "drafter.eagle3.aux_layers=1,5"], r"give 3 layer ids .*vLLM, SGLang and TensorRT-LLM"),
        (["check", r, "drafter.eagle3.aux_layers=6,4,1"], r"ascending order"),
        (["check", r, "drafter.eagle3.aux_layers=1,4,8"], r"aux_layers \[8\] out of range: the target has 8 layers"),
        (["check", r, "drafter.kind=draft", "drafter.draft.init=layers:0,9"],
         r"init=layers:0,9: layer ids \[9\] are out of range; the target has 8 decoder layers"),
        (["check", r, "drafter.kind=draft", "drafter.draft.init=layers:3,1"], r"increasing order without repeats"),
        (["check", r, "drafter.eagle3.draft_vocab_size=100000"], r"draft_vocab_size=100000 exceeds the target vocab"),
        (["check", r, "training.lrr=1"], r"unknown key 'lrr' in section 'training': did you mean 'lr'"),
        (["check", r, "training.lr=abc"], r"training.lr: expected a number"),
        (["check", r, "training.lr=inf"], r"training.lr: 'inf' is not a finite number"),
        (["check", r, "training.lr=.nan"], r"training.lr: nan is not a finite number"),
        (["train", r, f"output_dir={tmp / 'r'}", "training.lr=1e999"], r"training.lr: '1e999' is not a finite number"),
        (["check", r, "training.lr=0"], r"training.lr=0.0 must be in \(0, 1\]"),
        (["check", r, "training.lr=-1e-3"], r"training.lr=-0.001 must be in \(0, 1\]"),
        (["check", r, "training.lr=5"], r"training.lr=5.0 must be in \(0, 1\]"),
        (["check", r, "training.grad_clip=inf"], r"training.grad_clip: 'inf' is not a finite number"),
        (["check", r, "data.heldout_fraction=nan"], r"data.heldout_fraction: 'nan' is not a finite number"),
        (["check", r, "drafter.eagle3.ttt_decay=-inf"], r"ttt_decay: '-inf' is not a finite number"),
        (["check", r, "training.features=offline", f"training.feature_cache={tmp / 'nofeat'}"],
         r"holds no feature cache \(manifest\.json\)"),
        (["check", r, f"target.name_or_path={tmp / 'adir'}"], r"cannot load target config/tokenizer"),
        (["train", r, f"output_dir={tmp / 'r'}", f"training.resume_from={tmp / 'adir'}"],
         r"resume_from=.*adir.* is not a checkpoint directory"),
        (["train", r, f"output_dir={tmp / 'r'}", "training.precision=fp16"], r"fp16 needs a CUDA device"),
        (["check", r, "training.precision=fp16"], r"fp16 needs a CUDA device"),
        (["train", r], r"already holds checkpoints of a run: continue it with training.resume_from=auto"),
        (["prepare-features", r, f"training.feature_cache={tmp / 'fc'}", f"target.name_or_path={tmp / 'none'}"],
         r"target model dir not found: .*none"),
        (["train", r, f"output_dir={tmp / 'r'}", "training.global_batch_size=400", "training.micro_batch_size=4"],
         r"the train split has 17 rows, fewer than training.global_batch_size=400"),
        (["check", r, f"data.train_files=[{tmp / 'nofile.jsonl'}]"], r"data file not found: .*nofile\.jsonl"),
    ]


def test_recipe_and_check_cases(world, tmp_path, capsys):
    for argv, pattern in _recipe_cases(world, tmp_path):
        line = refused(capsys, argv, pattern)
        assert ("FAILED" in line) == (argv[0] == "check"), line


# ---- 6. eval: --out checked before decoding, replaced whole only with --force ------------------------------


def _eval(world: Path, out: Path, *extra) -> list:
    return ["eval", "--target", world / "target", "--drafter", "ngram", "--prompts", "mt_bench", "--n", "1",
            "--max-new-tokens", "3", "--k", "2", "--temperature", "0", "--out", out, *extra]


def test_eval_cases(world, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "stale.png").write_text("a user's plot")
    old = tmp_path / "old"
    assert cli_main([str(a) for a in _eval(world, old)]) == 0  # an earlier report: --force may replace it
    (old / "stale.png").write_text("old plot")
    cases = [
        (_eval(world, tmp_path / "file"), r"--out .*file is an existing file"),
        (_eval(world, old), r"--out .*old already exists and is not empty: .*--force"),
        (_eval(world, mine, "--force"), r"--out .*mine is a non-empty directory that spectrain did not write"),
        (_eval(world, world / "run" / "best" / "ev"), r"is inside .*best, a checkpoint directory"),
        (_eval(world, tmp_path / "o", "--tree", "topkk=4,depth=2"), r"--tree 'topkk=4,depth=2'"),
        (_eval(world, tmp_path / "o", "--temperature", "nan"), r"--temperature"),
        (_eval(world, tmp_path / "o", "--top-p", "0"), r"--top-p must be in \(0, 1\]"),
        (_eval(world, tmp_path / "o", "--k", "0"), r"--k must be >= 1"),
        (_eval(world, tmp_path / "o", "--max-new-tokens", "100000"), r"leaves no room for a prompt .* 160 positions"),
        (_eval(world, tmp_path / "o", "--dtype", "float64"), r"unknown dtype 'float64'"),
        (_eval(world, tmp_path / "o", "--device", "cuda"), r"device 'cuda' is not available"),
        (_eval(world, tmp_path / "o", "--prompts", tmp_path / "missing.jsonl"), r"prompt file .*missing\.jsonl not found"),
        (_eval(world, tmp_path / "o", "--prompts", "nosuchset"), r"unknown prompt set 'nosuchset'"),
        (["eval", "--target", tmp_path / "old", "--drafter", "ngram", "--out", tmp_path / "o"],
         r"directory without config\.json: not an HF model directory"),
        (_eval(world, tmp_path / "o", "--drafter", tmp_path / "old"), r"holds neither drafter_config\.json"),
    ]
    for argv, pattern in cases:
        refused(capsys, argv, pattern)
    assert not (tmp_path / "o").exists()
    assert cli_main([str(a) for a in _eval(world, old, "--force")]) == 0
    assert sorted(p.name for p in old.iterdir() if p.suffix != ".png") == [".spectrain-output", "report.json",
                                                                           "report.md"]
    assert not (old / "stale.png").exists()  # replaced whole, never mixed
    assert (mine / "stale.png").read_text() == "a user's plot"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


# ---- 7. export: --out placement, symlinks, modes, family mix-ups --------------------------------------------


def test_export_cases(world, tmp_path, capsys):
    run = copy_run(world, tmp_path)
    (tmp_path / "afile").write_text("x")
    ex = ["export", run, "--format", "vllm-eagle3", "--out"]
    cases = [
        (ex + [run / "best" / "exp"], r"is inside .*best, a checkpoint directory"),
        (ex + [run / "step-2" / "accelerate" / "x"], r"is inside .*step-2, a checkpoint directory"),
        (ex + [run / "best", "--force"], r"is \(or contains\) the source .*best"),
        (ex + [run / "step-1", "--force"], r"is a checkpoint of the run"),
        (ex + [tmp_path / "afile"], r"afile is an existing file"),
        (ex + [world / "exp"], r"already exists and is not empty: .*pass --force to replace this export"),
        (["export", run, "--format", "vllm-medusa", "--out", tmp_path / "m"], r"holds a 'eagle3' drafter.*vllm-eagle3"),
        (["export", tmp_path / "nope", "--format", "vllm-eagle3", "--out", tmp_path / "m"], r"is not a directory"),
        (["export", run, "--format", "vllm-eagle3"], r"--out DIR is required"),
    ]
    for argv, pattern in cases:
        refused(capsys, argv, pattern)
    for src, fmt, pattern in [(run / "step-2", "vllm-eagle3", r"is a spectrain training checkpoint, not a vllm-eagle3 export"),
                              (world / "exp", "vllm-medusa", r"is a vllm-eagle3 export, not vllm-medusa"),
                              (world / "exp", "sglang-eagle3", r"validate it with --format vllm-eagle3")]:
        assert cli_main(["export", str(src), "--format", fmt, "--validate-only"]) == 2
        err = capsys.readouterr().err
        assert re.search(pattern, err) and "Traceback" not in err, err


def test_export_force_onto_a_symlink_and_readable_modes(world, tmp_path):
    real = tmp_path / "real"
    shutil.copytree(world / "exp", real)  # an earlier export: --force may replace it
    (real / "stale.bin").write_text("old")
    (tmp_path / "link").symlink_to(real)
    old = os.umask(0o022)
    try:
        assert cli_main(["export", str(world / "run"), "--format", "sglang-eagle3", "--out", str(tmp_path / "link"),
                         "--force"]) == 0
    finally:
        os.umask(old)
    assert (tmp_path / "link").is_symlink() and (tmp_path / "link").resolve() == real
    assert (real / "config.json").is_file() and not (real / "stale.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no .old / temp leftovers
    assert real.stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in real.iterdir()} == {0o644}
    assert (real / ".spectrain-output").is_file()


# ---- 8. runs: extend, refuse shrink / other changes, leftovers of a killed save ------------------------------


def test_extend_a_finished_run_and_clean_leftovers(world, tmp_path, capsys):
    from spectrain.io.outputs import record_temp

    run = copy_run(world, tmp_path)
    for name in (".tmp-step-7", ".tmp-best"):  # what kill -9 during a save leaves: recorded, then created
        record_temp(run, name)
    (run / ".tmp-step-7" / "accelerate").mkdir(parents=True)
    (run / ".tmp-best").mkdir()
    (run / ".tmp-mine").write_text("a user's file with a temp-like name: spectrain never recorded it")
    refused(capsys, train_argv(world, run, "training.resume_from=auto", "training.max_steps=1"),
            r"stops at step 1 but the checkpoint is at step 2: a resume can only keep or grow")
    refused(capsys, train_argv(world, run, "training.resume_from=auto", "training.lr=0.01"),
            r"different recipe.*training\.lr.*only training\.max_steps / training\.epochs may grow")
    assert cli_main(train_argv(world, run, "training.resume_from=auto", "training.max_steps=4")) == 0
    out = capsys.readouterr().out
    assert "length changed from 2 to 4 steps" in out
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(x)]
    assert steps == [1, 2, 3, 4]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == [".spectrain-output", ".spectrain-temps",
                                                                             ".tmp-mine"]
    assert json.loads((run / "last" / "trainer_state.json").read_text())["total_steps"] == 4
    # epochs may grow too (max_steps=0 = run the epochs): 17 train rows / 4 = 4 steps per epoch
    assert cli_main(train_argv(world, run, "training.resume_from=auto", "training.max_steps=0",
                               "training.epochs=2")) == 0
    assert json.loads((run / "last" / "trainer_state.json").read_text())["step"] == 8


def test_swap_in_replaces_atomically(tmp_path):
    from spectrain.io.outputs import _exchange, swap_in

    a, b = tmp_path / "new", tmp_path / "best"
    for d, tag in ((a, "new"), (b, "old")):
        d.mkdir()
        (d / "w").write_text(tag)
    assert _exchange(a, b)  # renameat2 works here: best/ is never absent
    assert (b / "w").read_text() == "new" and (a / "w").read_text() == "old"
    swap_in(a, b)
    assert (b / "w").read_text() == "old" and not a.exists()


# ---- 9. disk full and internal errors --------------------------------------------------------------------------


def test_disk_full_says_so_names_the_path_and_removes_partial_output(world, tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError

    import spectrain.export.eagle3 as ex

    def full(*a, **k):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    monkeypatch.setattr(ex, "save_file", full)
    refused(capsys, ["export", world / "run", "--format", "vllm-eagle3", "--out", tmp_path / "x"],
            r"disk full while writing .*/x \(no space left on the device\); the partial output was removed")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    run = copy_run(world, tmp_path)

    def torch_full(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 3120")

    monkeypatch.setattr(torch, "save", torch_full)
    refused(capsys, train_argv(world, run, "training.resume_from=auto", "training.max_steps=3"),
            r"disk full while writing .*run/step-3")
    assert not [p for p in run.iterdir() if p.name.startswith(".tmp")] and not (run / "step-3").exists()
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
    refused(capsys, train_argv(world, run, "training.resume_from=auto", "training.max_steps=3"), r"disk full")


def test_unexpected_errors_are_one_line_and_debug_shows_the_traceback(world, tmp_path, capsys, monkeypatch):
    import spectrain.export as ex

    monkeypatch.setattr(ex, "export", lambda *a, **k: [][1])
    argv = ["export", world / "run", "--format", "vllm-eagle3", "--out", tmp_path / "x"]
    refused(capsys, argv, r"internal error: IndexError: .* please report it", status=1)
    monkeypatch.setenv("SPECTRAIN_DEBUG", "1")
    with pytest.raises(IndexError):
        cli_main([str(a) for a in argv])
    monkeypatch.setattr(ex, "export", lambda *a, **k: (_ for _ in ()).throw(ValueError("bad thing")))
    with pytest.raises(ValueError, match="bad thing"):
        cli_main([str(a) for a in argv])


# ---- 10. fault test: a corrupt feature shard ----------------------------------------------------------------


def test_corrupt_or_truncated_feature_shard_refused(tmp_path):
    from conftest import make_tiny_target
    from test_train import make_rows

    from spectrain.data.feature_cache import FeatureCache
    from spectrain.data.features import write_feature_cache

    target = make_tiny_target("llama")
    write_feature_cache(target, {"train": make_rows(6)}, tmp_path, [1, 3, 5], "fp32", max_length=64, verbose=False)
    (shard,) = tmp_path.glob("*.safetensors")
    flip(shard)
    with pytest.raises(ValueError, match=rf"feature shard .*{shard.name} is corrupt \(sha256 differs"):
        FeatureCache(tmp_path, target, split="train").get([0])
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"{shard.name} is truncated or modified"):
        FeatureCache(tmp_path, target, split="train").get([0])


# ---- 11. output placement cannot destroy (issue 18): a sandbox of a user's files, links and foreign dirs -------


def snapshot(*roots: Path) -> dict:
    """Every entry under ``roots`` (links not followed): type, mode, link target or content hash."""
    import hashlib

    out = {}
    for root in roots:
        for p in sorted([root, *root.rglob("*")]):
            st = p.lstat()
            if p.is_symlink():
                out[str(p)] = ("link", os.readlink(p))
            elif p.is_dir():
                out[str(p)] = ("dir", st.st_mode)
            else:
                out[str(p)] = ("file", st.st_mode, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


@pytest.fixture
def sandbox(world, tmp_path, monkeypatch) -> Path:
    """home/ (HOME points here) with a user's project dir, a private file, links into it, a foreign eval report
    and another run; every writing command is pointed at them."""
    home = tmp_path / "home"
    user = home / "project"
    for d in ("init", "best", ".tmp-mine", ".old-best"):
        (user / d).mkdir(parents=True)
        (user / d / "keep.txt").write_text(f"the user's {d}")
    for name, text in (("recipe.yaml", "my notes"), ("metrics.jsonl", "my data\n"), ("last", "a file named last")):
        (user / name).write_text(text)
    private = home / "private.txt"
    private.write_text("secret")
    private.chmod(0o600)
    (home / "link-to-project").symlink_to(user)
    report = home / "reports" / "ev"
    report.mkdir(parents=True)
    for f in ("report.json", "report.md"):
        (report / f).write_text("{}")
    (report / ".spectrain-output").write_text('{"kind": "eval"}')
    shutil.copytree(world / "run", home / "runs" / "other", symlinks=True)
    monkeypatch.setenv("HOME", str(home))
    for var in ("MPLCONFIGDIR", "XDG_CACHE_HOME"):  # libraries' own caches (matplotlib's plots) stay out of it
        monkeypatch.setenv(var, str(tmp_path / "cache"))
    return home


def _placement_cases(world: Path, home: Path) -> list[tuple[list, str]]:
    user, runs, other, ev = home / "project", home / "runs", home / "runs" / "other", home / "reports" / "ev"
    tgt = world / "target"
    train = ["train", world / "recipe.yaml"]
    ex = ["export", other, "--format", "vllm-eagle3", "--force", "--out"]
    return [
        (train + ["output_dir=/"], r"output_dir / is the filesystem root"),
        (train + [f"output_dir={home}"], r"is your home directory"),
        (train + [f"output_dir={home.parent}"], r"is an ancestor of your home directory"),
        (train + [f"output_dir={user}"], r"project is a non-empty directory that spectrain did not write"),
        (train + [f"output_dir={home / 'link-to-project'}"], r"spectrain did not write"),
        (train + [f"output_dir={tgt}"], r"is \(or contains\) the target .* this command reads"),
        (train + [f"output_dir={world}"], r"is \(or contains\) the target"),
        (train + [f"output_dir={tgt / 'run'}"], r"is inside the target model directory"),
        (train + [f"output_dir={ev}"], r"is a spectrain eval report directory, not a training run"),
        (train + [f"output_dir={other / 'best'}"], r"is a checkpoint of the run"),
        (["check", world / "recipe.yaml", "output_dir=/"], r"FAILED: output_dir / is the filesystem root"),
        (["check", world / "recipe.yaml", f"output_dir={user}"], r"FAILED: .*spectrain did not write"),
        (["prepare-features", world / "recipe.yaml", f"training.feature_cache={user}"], r"spectrain did not write"),
        (["prepare-features", world / "recipe.yaml", f"training.feature_cache={other}"],
         r"is a spectrain training run directory, not a feature cache"),
        (_eval(world, other, "--force"), r"is a spectrain training run directory, not an eval report"),
        (_eval(world, runs, "--force"), r"runs is a non-empty directory that spectrain did not write"),
        (_eval(world, world, "--force"), r"is \(or contains\) the target"),
        (_eval(world, tgt, "--force"), r"is \(or contains\) the target"),
        (_eval(world, user, "--force"), r"spectrain did not write"),
        (_eval(world, home, "--force"), r"is your home directory"),
        (ex + [world / "run"], r"run is a spectrain training run directory, not an export"),
        (ex + [ev], r"is a spectrain eval report directory, not an export"),
        (ex + [user], r"spectrain did not write"),
        (ex + [runs], r"is \(or contains\) the source"),
        (ex + ["/"], r"is the filesystem root"),
        (["regenerate", world / "recipe.yaml", "--out", tgt / "regen.jsonl"], r"inside the target model directory"),
        (["regenerate", world / "recipe.yaml", "--out", home / "link.jsonl"], r"link\.jsonl is a symbolic link"),
        (["regenerate", world / "recipe.yaml", "--out", home / "r.jsonl"], r"r\.jsonl\.tmp is a symbolic link"),
        (["regenerate", world / "recipe.yaml", "--out", home / "private.txt"], r"use a \.jsonl name"),
    ]


def test_every_writing_command_refuses_a_destructive_place_and_changes_nothing(world, sandbox, capsys):
    (sandbox / "link.jsonl").symlink_to(sandbox / "not-yet.jsonl")  # dangling: writing it would create that file
    (sandbox / "r.jsonl.tmp").symlink_to(sandbox / "private.txt")  # a resumed part would be appended to
    before = snapshot(sandbox, world)
    for argv, pattern in _placement_cases(world, sandbox):
        refused(capsys, argv, pattern)
        assert snapshot(sandbox, world) == before, argv  # not one byte outside the intended output changed


def test_force_replaces_only_its_own_kind_and_demo_style_reruns_work(world, sandbox, tmp_path, capsys):
    """What the demo does twice (train into a run dir, eval --force into runs/X/eval) still works."""
    run = copy_run(world, tmp_path)
    ev = run / "eval"
    before = snapshot(sandbox)
    for _ in range(2):
        assert cli_main(train_argv(world, run, "training.resume_from=auto")) == 0
        assert cli_main([str(a) for a in _eval(world, ev, "--force")]) == 0
    exp = tmp_path / "exp"
    for _ in range(2):
        assert cli_main(["export", str(run), "--format", "vllm-eagle3", "--out", str(exp), "--force"]) == 0
    assert json.loads((exp / ".spectrain-output").read_text())["kind"] == "export"
    assert json.loads((ev / ".spectrain-output").read_text())["kind"] == "eval"
    assert snapshot(sandbox) == before
    capsys.readouterr()


def test_run_dir_lock_refuses_a_second_writer_and_takes_over_a_stale_lock(world, tmp_path, capsys):
    import platform
    import subprocess
    import sys

    from spectrain.io.outputs import LOCK, run_lock

    run = copy_run(world, tmp_path)
    with run_lock(run):  # another writer holds the run dir (here: this process)
        refused(capsys, train_argv(world, run, "training.resume_from=auto"),
                rf"is being written by process {os.getpid()} on host {re.escape(platform.node())}.*delete .*{LOCK}")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / LOCK).write_text(json.dumps({"pid": live.pid, "host": platform.node()}))
        refused(capsys, train_argv(world, run, "training.resume_from=auto"), rf"process {live.pid} on host")
    finally:
        live.kill()
        live.wait()
    with pytest.warns(UserWarning, match=rf"taking over the stale lock of process {live.pid}"):
        assert cli_main(train_argv(world, run, "training.resume_from=auto")) == 0
    assert not (run / LOCK).exists()  # released when the run ends


def test_symlinks_in_a_run_dir_are_replaced_never_written_through(world, tmp_path, capsys):
    run = copy_run(world, tmp_path)
    private = tmp_path / "private.txt"
    private.write_text("secret")
    for name in ("recipe.yaml", "metrics.jsonl"):
        (run / name).unlink()
        (run / name).symlink_to(private)
    assert cli_main(train_argv(world, run, "training.resume_from=auto", "training.max_steps=3")) == 0
    assert private.read_text() == "secret"
    assert not (run / "recipe.yaml").is_symlink() and "max_steps: 3" in (run / "recipe.yaml").read_text()
    assert not (run / "metrics.jsonl").is_symlink()
    from spectrain.io.outputs import append_text_safe

    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(private)
    with pytest.raises(FileExistsError, match=r"metrics\.jsonl is a symbolic link .*never writes through a link"):
        append_text_safe(run / "metrics.jsonl", "x\n")
    assert private.read_text() == "secret"


# ---- 12. no link followed out, manifests confined to their directory (issue 18) -------------------------------


def test_a_link_out_of_a_checkpoint_is_refused_by_export_eval_and_load(world, target, tmp_path, capsys):
    from spectrain import load_drafter
    from spectrain.io.integrity import seal

    run = copy_run(world, tmp_path)
    private = tmp_path / "private.txt"
    private.write_text("secret")
    private.chmod(0o600)
    (run / "best" / "tokenizer.json").symlink_to(private)
    with pytest.raises(ValueError, match=r"cannot seal .*tokenizer\.json is a symbolic link"):
        seal(run / "best")  # spectrain never seals a link out
    before = snapshot(tmp_path)
    refused(capsys, ["export", run / "best", "--format", "vllm-eagle3", "--out", tmp_path / "x"],
            r"tokenizer\.json is a symbolic link to .*private\.txt, outside .*best")
    refused(capsys, ["eval", "--target", world / "target", "--drafter", run / "best", "--prompts", "mt_bench",
                     "--n", "1", "--max-new-tokens", "2", "--out", tmp_path / "ev"], r"tokenizer\.json is a symbolic link")
    with pytest.raises(ValueError, match="symbolic link"):
        load_drafter(str(run / "best"), target)
    assert snapshot(tmp_path) == before


def test_hf_draft_copy_follows_a_link_only_inside_the_source(tmp_path):
    from spectrain.export.hf_draft import _copy_inside

    src = tmp_path / "src"
    src.mkdir()
    (src / "real.json").write_text("inside")
    (src / "tokenizer.json").symlink_to(src / "real.json")
    (tmp_path / "private.txt").write_text("secret")
    (src / "vocab.json").symlink_to(tmp_path / "private.txt")
    _copy_inside(src / "tokenizer.json", src, tmp_path / "a.json")
    assert (tmp_path / "a.json").read_text() == "inside" and not (tmp_path / "a.json").is_symlink()
    with pytest.raises(ValueError, match=r"vocab\.json is a symbolic link to .*private\.txt, outside"):
        _copy_inside(src / "vocab.json", src, tmp_path / "b.json")
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("entry", ["../../etc/hostname", "/etc/hostname", "a/../../x", "./model.safetensors"])
def test_manifest_paths_outside_the_directory_are_refused(world, target, tmp_path, capsys, entry):
    from spectrain import load_drafter

    run = copy_run(world, tmp_path)
    with open(run / "best" / "SHA256SUMS", "a") as f:
        f.write(f"{'0' * 64}  {entry}\n")
    refused(capsys, ["export", run / "best", "--format", "vllm-eagle3", "--out", tmp_path / "x"],
            rf"SHA256SUMS line \d+ names '{re.escape(entry)}', a path outside its directory")
    with pytest.raises(ValueError, match="a path outside its directory"):
        load_drafter(str(run / "best"), target)
    assert "hostname is corrupt" not in capsys.readouterr().err


# ---- 13. non-finite is an error (issue 18) ---------------------------------------------------------------------


def test_a_step_that_makes_weights_non_finite_stops_the_run_and_seals_nothing(world, tmp_path, capsys, monkeypatch):
    run = copy_run(world, tmp_path)
    before = snapshot(run)
    real = torch.optim.AdamW.step

    def poisoned(self, *a, **k):  # what an overflowing update does: the step itself writes NaN into a weight
        out = real(self, *a, **k)
        self.param_groups[0]["params"][0].data.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned)
    refused(capsys, train_argv(world, run, "training.resume_from=auto", "training.max_steps=4"),
            r"step 3: the update made the drafter's weights non-finite \(.*weight; training\.lr=0\.001\): the run "
            r"stops and nothing of this step is saved; lower training\.lr")
    after = snapshot(run)
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    assert all(Path(p).name in ("metrics.jsonl", "run_info.json", "recipe.yaml", ".spectrain-temps") for p in changed), \
        changed  # no new checkpoint, best/ untouched


def test_non_finite_weights_are_never_saved(tmp_path):
    from spectrain.train.checkpoint import save_drafter_dir

    head = torch.nn.Linear(2, 2)
    head.weight.data[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"refusing to save .*drafter weight weight holds NaN or Inf"):
        save_drafter_dir(head, tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("damage, pattern", [
    (lambda sd: sd["fc.weight"].fill_(float("nan")), r"tensor fc\.weight holds NaN or Inf values"),
    (lambda sd: sd.update({"fc.weight": sd["fc.weight"].to(torch.int32)}),
     r"tensor fc\.weight has dtype torch\.int32, expected a float dtype"),
    (lambda sd: sd.update({"d2t": sd["d2t"].to(torch.int32)}), r"tensor d2t has dtype torch\.int32, expected torch\.int64"),
    (lambda sd: sd.update({"fc.weight": sd["fc.weight"][:, :-1].contiguous()}),
     r"tensor fc\.weight has shape \[\d+, \d+\], its config implies"),
])
def test_a_resealed_head_with_bad_weights_is_refused_at_load(world, target, tmp_path, capsys, damage, pattern):
    from safetensors.torch import load_file, save_file

    from spectrain import load_drafter
    from spectrain.io.integrity import seal

    run = copy_run(world, tmp_path)
    w = run / "best" / "model.safetensors"
    sd = load_file(str(w))
    damage(sd)
    save_file(sd, str(w))
    seal(run / "best")  # the manifest agrees: only the weight check can catch it
    with pytest.raises(ValueError, match=pattern):
        load_drafter(str(run / "best"), target)
    refused(capsys, ["eval", "--target", world / "target", "--drafter", run / "best", "--prompts", "mt_bench",
                     "--n", "1", "--max-new-tokens", "2", "--out", tmp_path / "ev"], pattern)
    assert not (tmp_path / "ev").exists()


def test_decoding_refuses_non_finite_logits():
    from spectrain.decoding.sampling import Sampler

    logits = torch.tensor([0.0, 1.0, float("nan")])
    for s in (Sampler(), Sampler(temperature=1.0)):
        with pytest.raises(ValueError, match=r"NaN or \+Inf logits"):
            s.probs(logits)
    assert Sampler(temperature=1.0).probs(torch.tensor([0.0, float("-inf")])).tolist() == [1.0, 0.0]  # masked: fine


# ---- 14. API arguments checked at the door (issue 18) -------------------------------------------------------


@pytest.mark.parametrize("form", ["1d-tensor", "2d-tensor", "list", "list-of-lists"])
def test_attention_mask_is_honoured_for_every_prompt_form(target, form):
    """Padding masked out is never decoded: each form with a pad-carrying mask equals the unpadded prompt."""
    from spectrain.decoding.loop import plain_generate

    prompt, pad = [5, 6, 7, 8], [0, 0]
    ids, mask = pad + prompt, [0] * len(pad) + [1] * len(prompt)
    want = plain_generate(target, prompt, max_new_tokens=4).tokens
    arg = {"1d-tensor": (torch.tensor(ids), torch.tensor(mask)), "2d-tensor": (torch.tensor([ids]), torch.tensor([mask])),
           "list": (ids, mask), "list-of-lists": ([ids], [mask])}[form]
    out = plain_generate(target, arg[0], max_new_tokens=4, attention_mask=arg[1])
    got = out[0].tokens if isinstance(out, list) else out.tokens
    assert got == want


def test_a_wrong_drafter_argument_is_named(world, target):
    from spectrain import load_drafter, load_target, speculative_generate

    run = world / "run"
    cases = [
        (str(run / "best"), r"is a path, not a drafter: load it first with spectrain\.load_drafter"),
        (run / "best", r"is a path, not a drafter"),
        (target, r"the target was passed as the drafter"),
        (42, r"drafter must be a spectrain Drafter .* got int"),
    ]
    for drafter, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            speculative_generate(target, drafter, [1, 5, 6, 7], max_new_tokens=2, k=2)
    with pytest.raises(ValueError, match=r"the drafter spec is empty"):
        load_drafter("", target)
    with pytest.raises(ValueError, match=r"spec must be .* got FrozenTarget \(the target\?"):
        load_drafter(target, target)
    with pytest.raises(ValueError, match=r"target must be a loaded target"):
        load_drafter(str(run / "best"), str(world / "target"))
    with pytest.raises(ValueError, match=r"name_or_path must be a non-empty hub id"):
        load_target("")


def test_a_drafter_loaded_for_another_target_is_named(world, target):
    from conftest import make_tiny_target

    from spectrain import load_drafter, speculative_generate

    head = load_drafter(str(world / "run" / "best"), target)
    other = make_tiny_target("llama")
    if other.hidden_size == target.hidden_size and other.vocab_size == target.vocab_size:
        pytest.skip("the conftest target has the same sizes")
    with pytest.raises(ValueError, match=r"the drafter was loaded for another target .*: load it for this one"):
        speculative_generate(other, head, [1, 5, 6, 7], max_new_tokens=2, k=2)


# ---- 15. integrity cannot be switched off by deleting a file (issue 18) -----------------------------------------


def test_a_checkpoint_or_head_without_manifest_is_refused_until_sealed(world, target, tmp_path, capsys, monkeypatch):
    from spectrain import load_drafter

    run = copy_run(world, tmp_path)
    for d in ("best", "step-2"):
        (run / d / "SHA256SUMS").unlink()
    before = snapshot(run)
    fix = r"has no SHA256SUMS, so its files cannot be checked .*`spectrain seal .*`, or set SPECTRAIN_ALLOW_UNSEALED=1"
    refused(capsys, ["export", run / "best", "--format", "vllm-eagle3", "--out", tmp_path / "x"], fix)
    refused(capsys, ["eval", "--target", world / "target", "--drafter", run / "best", "--prompts", "mt_bench",
                     "--n", "1", "--max-new-tokens", "2", "--out", tmp_path / "ev"], fix)
    refused(capsys, train_argv(world, run, "training.resume_from=auto", "training.max_steps=3"), rf"step-2 {fix}")
    with pytest.raises(ValueError, match=fix):
        load_drafter(str(run / "best"), target)
    assert snapshot(run) == before and not (tmp_path / "x").exists()
    monkeypatch.setenv("SPECTRAIN_ALLOW_UNSEALED", "1")  # the explicit flag
    load_drafter(str(run / "best"), target)
    monkeypatch.delenv("SPECTRAIN_ALLOW_UNSEALED")
    assert cli_main(["seal", str(run / "best")]) == 0  # a directory the user trusts
    assert "sealed" in capsys.readouterr().out
    load_drafter(str(run / "best"), target)
    flip(run / "best" / "model.safetensors")
    refused(capsys, ["seal", run / "best"], r"cannot seal .*model\.safetensors is corrupt.*restore the file")


def test_heads_saved_through_save_pretrained_carry_a_manifest(world, target, tmp_path):
    from spectrain import load_drafter
    from spectrain.io.integrity import problems, read_manifest

    head = load_drafter(str(world / "run" / "best"), target).model
    head.save_pretrained(tmp_path / "h")
    assert set(read_manifest(tmp_path / "h")) >= {"model.safetensors", "drafter_config.json"}
    assert problems(tmp_path / "h") == []
    load_drafter(str(tmp_path / "h"), target)


def _changed_target(world: Path, dst: Path, copy: bool = True) -> Path:
    """A copy of the target whose one decoder-layer weight differs (embeddings, lm_head and norm unchanged)."""
    from safetensors.torch import load_file, save_file

    if copy:
        shutil.copytree(world / "target", dst)
    (w,) = dst.glob("*.safetensors")
    sd = load_file(str(w))
    key = next(k for k in sd if ".layers.3." in k and k.endswith("mlp.down_proj.weight"))
    sd[key] = sd[key] * 1.5
    save_file(sd, str(w), metadata={"format": "pt"})
    return dst


def test_target_fingerprint_covers_every_layer_and_resume_refuses_another_target(world, target, tmp_path, capsys):
    from spectrain import load_target
    from spectrain.targets.fingerprint import (
        FINGERPRINT_PREFIX,
        legacy_fingerprint,
        same_target,
        target_fingerprint,
    )

    other = load_target(str(_changed_target(world, tmp_path / "t2")), device="cpu")
    fp = target_fingerprint(target)
    assert fp.startswith(FINGERPRINT_PREFIX) and target_fingerprint(other) != fp
    assert legacy_fingerprint(other) == legacy_fingerprint(target)  # what v1 missed
    assert same_target(legacy_fingerprint(target), target) and same_target(None, target) is None  # old values still work
    t = tmp_path / "t"
    shutil.copytree(world / "target", t)
    argv = train_argv(world, tmp_path / "r", f"target.name_or_path={t}", "training.max_steps=1")
    assert cli_main(argv) == 0
    _changed_target(world, t, copy=False)  # the same path, a decoder layer rebuilt
    refused(capsys, [*argv, "training.resume_from=auto", "training.max_steps=2"],
            r"cannot resume from .*step-1: it was trained on another target .*start a fresh run")


def test_offline_feature_cache_refuses_a_target_with_other_layers(world, target, tmp_path):
    from test_train import make_rows

    from spectrain import load_target
    from spectrain.data.feature_cache import FeatureCache
    from spectrain.data.features import write_feature_cache

    write_feature_cache(target, {"train": make_rows(4)}, tmp_path / "fc", [1, 3, 5], "fp32", max_length=64,
                        verbose=False)
    FeatureCache(tmp_path / "fc", target, split="train")
    other = load_target(str(_changed_target(world, tmp_path / "t2")), device="cpu")
    with pytest.raises(ValueError, match=r"feature cache .* was written for target"):
        FeatureCache(tmp_path / "fc", other, split="train")
