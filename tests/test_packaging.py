"""Packaging: torch is never pinned down, shipped files are package data addressable by name, the CLI is
lazy and consistent. The slow test builds the wheel, installs it into a fresh venv and runs it from an
empty directory (and checks that pip would not touch an existing torch 2.14.1)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from spectrain.cli import main as cli_main
from spectrain.io import resources
from spectrain.recipe.load import load_recipe

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_torch_has_a_lower_bound_only():
    (torch,) = [Requirement(r) for r in PYPROJECT["project"]["dependencies"] if Requirement(r).name == "torch"]
    for v in ("2.13.0", "2.14.1", "2.15.0", "3.0.0"):
        assert torch.specifier.contains(v), f"torch {v} would be replaced by pip ({torch})"
    assert not torch.specifier.contains("2.0.0")
    for script in ("scripts/setup.sh", ".ci/run"):  # the CPU build is installed only where torch is absent
        text = (ROOT / script).read_text()
        assert 'python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"' in text, script


def test_dev_extra_runs_the_tracker_tests():
    dev = {Requirement(r).name for r in PYPROJECT["project"]["optional-dependencies"]["dev"]}
    assert {"wandb", "tensorboard", "packaging", "pytest"} <= dev


def test_package_list_covers_every_subpackage():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "spectrain").rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"
    mapped = PYPROJECT["tool"]["setuptools"]["package-dir"]
    assert {Path(v).name for v in mapped.values()} == {"recipes", "eval", "assets", "data"}


def test_shipped_names_and_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing of the checkout here
    names = resources.shipped_recipes()
    assert {"tiny/eagle3", "tiny/medusa", "tiny/draft", "eagle3", "qwen3-8b/eagle3"} <= set(names)
    assert {"zero2", "zero3", "fsdp", "ddp", "cpu_ddp"} <= set(resources.accelerate_configs())
    for text in ("tiny/eagle3", "recipes/tiny/eagle3.yaml", "tiny/eagle3.yaml"):
        r = load_recipe(text, ["training.lr=1e-4"])
        assert Path(r.target.name_or_path) == resources.reference_target()
        assert Path(r.data.train_files[0]).is_file() and r.output_dir == "runs/tiny-eagle3"  # output: the cwd
    assert load_recipe("qwen3-8b/eagle3").target.name_or_path == "Qwen/Qwen3-8B"  # a hub id stays a hub id
    # a user's own recipe: paths relative to the current directory, as written; overrides too
    (tmp_path / "mine.yaml").write_text("target:\n  name_or_path: assets/reference-target\n")
    assert load_recipe("mine.yaml").target.name_or_path == "assets/reference-target"
    assert load_recipe("tiny/eagle3", ["target.name_or_path=x/y"]).target.name_or_path == "x/y"
    with pytest.raises(FileNotFoundError, match="neither a file nor a shipped recipe.*tiny/eagle3"):
        load_recipe("tiny/eagle4")
    assert resources.resolve_accelerate_config("zero2").name == "zero2.yaml"
    with pytest.raises(FileNotFoundError, match="zero2"):
        resources.resolve_accelerate_config("zero9")
    assert (resources.prompts_dir() / "spec_bench_question.jsonl").is_file()


def test_recipes_command_lists_one_line_each(capsys):
    assert cli_main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [ln.split()[0] for ln in lines if ln.startswith("  ")]
    assert set(resources.shipped_recipes()) | set(resources.accelerate_configs()) == set(rows)
    assert len(rows) == len(lines) - 2
    assert any(ln.split()[0] == "tiny/eagle3" and "EAGLE-3" in ln for ln in lines if ln.startswith("  "))


def _spectrain(*args: str, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spectrain", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_help_and_version_import_nothing_heavy():
    code = ("import sys; from spectrain.cli import main\n"
            "for argv in (['--help'], ['--version']):\n"
            "    try: main(argv)\n"
            "    except SystemExit: pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'accelerate', 'datasets') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "HEAVY []" in out and "spectrain 0.1.0" in out and "commands:" in out


@pytest.mark.parametrize("argv, code", [
    (["nope"], 2), ([], 2), (["train"], 2), (["train", "tiny/eagle3", "--bogus"], 2),
    (["check", "tiny/eagle4"], 2), (["check", "tiny/eagle3", "training.lrr=1"], 2),
    (["check", "tiny/eagle3", "--nproc", "2"], 2), (["train", "tiny/eagle3", "--nproc", "0"], 2),
    (["regenerate", "tiny/eagle3", "--out", "x.txt"], 2), (["eval", "--k", "0", "--target", "x"], 2),
    (["export", "does/not/exist", "--format", "vllm-eagle3", "--out", "o"], 2), (["--version"], 0),
])
def test_exit_status_is_consistent(argv, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(argv) == code


def test_overrides_anywhere_after_the_recipe(monkeypatch):
    from spectrain import cli

    args = cli.parse(["regenerate", "tiny/eagle3", "a.b=1", "--out", "x.jsonl", "data.max_rows=3", "--n", "2", "c=d"])
    assert args.overrides == ["a.b=1", "data.max_rows=3", "c=d"] and args.out == "x.jsonl" and args.n == 2
    args = cli.parse(["train", "tiny/eagle3", "--nproc", "2", "training.max_steps=2"])
    assert args.overrides == ["training.max_steps=2"] and args.nproc == 2
    seen = {}
    monkeypatch.setattr("spectrain.data.regenerate.regenerate", lambda recipe, ov, out, cfg: seen.update(ov=ov))
    assert cli_main(["regenerate", "tiny/eagle3", "--out", "x.jsonl", "data.max_rows=3"]) == 0
    assert seen["ov"] == ["data.max_rows=3"]


# ---- the wheel, outside the checkout --------------------------------------------------------------------------


def _copy_sources(dst: Path) -> None:
    """The committed files (a clean clone), so build/ and egg-info never land in the checkout."""
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True,
                               timeout=60).stdout.split("\0")
    except (OSError, subprocess.CalledProcessError):
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)


def _venv(path: Path) -> dict:
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(path)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{path / 'bin'}{os.pathsep}{env['PATH']}", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


def _run(cmd: list[str], cwd: Path, env: dict, timeout: int = 600) -> str:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)} -> {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout + p.stderr


@pytest.mark.slow
def test_wheel_works_outside_the_checkout(tmp_path):
    src, dist, work = tmp_path / "src", tmp_path / "dist", tmp_path / "empty"
    src.mkdir()
    work.mkdir()
    _copy_sources(src)
    # --no-build-isolation: setuptools from this environment, nothing downloaded
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(src)], check=True, timeout=600, capture_output=True)
    (wheel,) = dist.glob("spectrain-*.whl")
    env = _venv(tmp_path / "venv")
    py = str(tmp_path / "venv" / "bin" / "python")
    # the venv sees this environment's torch, transformers ... (no multi-GB download); spectrain from the wheel
    _run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)], work, env)
    where = _run([py, "-c", "import spectrain, spectrain.io.resources as r; print(spectrain.__file__, r.data_root())"],
                 work, env)
    assert str(tmp_path / "venv") in where and "_shipped" in where, where
    assert "spectrain 0.1.0" in _run(["spectrain", "--version"], work, env)
    assert "tiny/eagle3" in _run(["spectrain", "recipes"], work, env)
    assert "OK recipe tiny/eagle3" in _run(["spectrain", "check", "tiny/eagle3", "data.max_rows=200"], work, env)
    hub = subprocess.run(["spectrain", "check", "qwen3-8b/eagle3"], cwd=work, env=env, capture_output=True, text=True,
                         timeout=300)  # found by name; its target is a hub id, unreachable offline: a clear exit 2
    assert hub.returncode == 2 and "Qwen/Qwen3-8B" in hub.stderr and "recipe not found" not in hub.stderr
    out = _run(["spectrain", "train", "tiny/eagle3", "training.max_steps=2", "data.max_rows=200",
                "training.eval_every=2", "output_dir=runs/w"], work, env)
    assert "done: 2 steps" in out and (work / "runs/w/best").is_dir()
    _run(["spectrain", "eval", "--recipe", "tiny/eagle3", "--drafter", "ngram", "--prompts", "humaneval", "--n", "1",
          "--k", "3", "--temperature", "0", "--max-new-tokens", "8", "--out", "ev"], work, env)
    rec = json.loads((work / "ev" / "report.json").read_text())["records"][0]
    assert rec["prompt_set"] == "humaneval" and rec["greedy_identical_to_plain"] == "1/1"
    assert sorted(p.name for p in work.iterdir()) == [".cache", "ev", "runs"]  # nothing else written here
    _dry_run_keeps_torch(tmp_path, wheel)


def _dry_run_keeps_torch(tmp_path: Path, wheel: Path) -> None:
    """pip's plan for the wheel in an environment whose torch is 2.14.1 (a dist-info stands in for the
    multi-GB install): no torch in the plan, nothing downloaded."""
    env = _venv(tmp_path / "venv214")
    site = subprocess.run([str(tmp_path / "venv214/bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, env=env, check=True).stdout.strip()
    info = Path(site) / "torch-2.14.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.14.1\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")
    shown = _run([str(tmp_path / "venv214/bin/python"), "-m", "pip", "show", "torch"], tmp_path, env)
    assert "Version: 2.14.1" in shown
    report = tmp_path / "plan.json"
    _run([str(tmp_path / "venv214/bin/python"), "-m", "pip", "install", "--dry-run", "--no-index", "--quiet",
          "--report", str(report), str(wheel)], tmp_path, env)
    planned = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert planned == {"spectrain": "0.1.0"}, planned


def test_accelerate_configs_parse():
    for name, path in resources.accelerate_configs().items():
        assert isinstance(yaml.safe_load(path.read_text()), dict), name
