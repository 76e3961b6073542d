"""`spectrain train RECIPE --nproc N / --accelerate-config C / launch:` starts accelerate launch itself;
the slow test starts 2 real CPU ranks and reads the world size back from run_info.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from test_distributed import run_group

from spectrain.io import resources
from spectrain.recipe.load import load_recipe
from spectrain.recipe.schema import LaunchConfig
from spectrain.train import launch as L
from spectrain.train.run_dir import recipe_hash

NONE = LaunchConfig()


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_one_process_trains_in_place():
    assert L.plan_launch("tiny/eagle3", [], None, None, NONE, cuda_devices=0) is None
    assert L.plan_launch("tiny/eagle3", [], 1, None, NONE, cuda_devices=4) is None


def test_cpu_ranks_use_the_gloo_config_and_env():
    cmd, env, procs = L.plan_launch("tiny/eagle3", ["training.lr=1e-4"], 2, None, NONE, cuda_devices=0)
    assert procs == 2 and env == {"SPECTRAIN_LAUNCHED": "1", "ACCELERATE_USE_CPU": "1"}
    assert cmd[1:3] == ["-m", "accelerate.commands.launch"]
    assert Path(_flag(cmd, "--config_file")) == resources.accelerate_configs()["cpu_ddp"]
    assert _flag(cmd, "--num_processes") == "2" and int(_flag(cmd, "--main_process_port")) > 0
    assert cmd[-5:] == ["-m", "spectrain", "train", "tiny/eagle3", "training.lr=1e-4"]


def test_gpus_named_configs_and_the_recipe_section():
    cmd, env, procs = L.plan_launch("eagle3", [], None, "zero2", NONE, cuda_devices=4)
    assert Path(_flag(cmd, "--config_file")).name == "zero2.yaml" and procs == 4  # the shipped 8 is a placeholder
    assert "ACCELERATE_USE_CPU" not in env
    cmd, _, procs = L.plan_launch("eagle3", [], 8, None, NONE, cuda_devices=8)
    assert Path(_flag(cmd, "--config_file")).name == "ddp.yaml" and procs == 8
    section = LaunchConfig(nproc=2, accelerate_config="zero3")
    cmd, _, procs = L.plan_launch("eagle3", [], None, None, section, cuda_devices=8)
    assert Path(_flag(cmd, "--config_file")).name == "zero3.yaml" and procs == 2
    cmd, _, procs = L.plan_launch("eagle3", [], 4, "ddp", section, cuda_devices=8)  # flags win
    assert Path(_flag(cmd, "--config_file")).name == "ddp.yaml" and procs == 4


def test_user_config_and_bad_input(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("distributed_type: MULTI_GPU\nnum_processes: 3\nmain_process_port: 29999\n")
    cmd, _, procs = L.plan_launch("r", [], None, str(mine), NONE, cuda_devices=8)
    assert procs == 3 and _flag(cmd, "--num_processes") is None and "--main_process_port" not in cmd
    multi_cpu = tmp_path / "cpu.yaml"
    multi_cpu.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\n")
    with pytest.raises(ValueError, match="starts ONE process"):
        L.plan_launch("r", [], 2, str(multi_cpu), NONE, cuda_devices=0)
    with pytest.raises(FileNotFoundError, match="zero2"):
        L.plan_launch("r", [], 2, "zero5", NONE, cuda_devices=0)
    with pytest.raises(ValueError, match="--nproc 0"):
        L.plan_launch("r", [], 0, None, NONE, cuda_devices=0)


def test_launch_section_is_typed_and_outside_the_resume_hash():
    r = load_recipe("tiny/eagle3", ["launch.nproc=8", "launch.accelerate_config=zero2"])
    assert r.launch == LaunchConfig(8, "zero2")
    assert recipe_hash(r.to_dict()) == recipe_hash(load_recipe("tiny/eagle3").to_dict())  # resume on 1 process
    with pytest.raises(ValueError, match="launch.nproc=-1"):
        load_recipe("tiny/eagle3", ["launch.nproc=-1"])


def test_under_a_launcher_the_process_trains(monkeypatch):
    calls = []
    monkeypatch.setattr("spectrain.train.loop.main", lambda recipe, ov: calls.append((recipe, ov)) or 0)
    monkeypatch.setattr(L, "run_launch", lambda cmd, env: calls.append(("launched", cmd)) or 0)
    monkeypatch.setattr(L, "_cuda_devices", lambda: 0)
    for k in L._LAUNCHER_MARKERS:
        monkeypatch.delenv(k, raising=False)
    args = type("A", (), {"recipe": "tiny/eagle3", "overrides": ["launch.nproc=2"], "nproc": None,
                          "accelerate_config": None})()
    assert L.train_command(args) == 0 and calls[-1][0] == "launched"  # the recipe's launch section
    monkeypatch.setenv("LOCAL_RANK", "0")  # e.g. `accelerate launch -m spectrain train ...`
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "x")  # records the original state, restored after the test
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    assert L.train_command(args) == 0 and calls[-1] == ("tiny/eagle3", ["launch.nproc=2"])
    assert os.environ["ACCELERATE_USE_CPU"] == "1"  # no CUDA: the ranks form one gloo group without help


@pytest.mark.slow
def test_two_cpu_ranks(tmp_path):
    """`spectrain train tiny/eagle3 --nproc 2` on a machine without CUDA: 2 gloo ranks, one summary; and the
    documented `accelerate launch -m spectrain train` still works (its ranks ignore the launch section)."""
    env = {k: v for k, v in os.environ.items() if k not in L._LAUNCHER_MARKERS}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    common = ["training.max_steps=2", "data.max_rows=200", "training.eval_every=2"]
    p = run_group([sys.executable, "-m", "spectrain", "train", "tiny/eagle3", "--nproc", "2", *common,
                   "output_dir=runs/a"], env, 600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    info = json.loads((tmp_path / "runs/a/run_info.json").read_text())
    assert info["world_size"] == 2 and info["grad_accum"] == 1  # global 8 = micro 4 x 2 ranks
    assert p.stdout.count("done: 2 steps") == 1 and p.stdout.count("step 2: held-out") == 1  # rank 0 only
    assert "starting 2 process(es)" in p.stderr
    cfg = resources.accelerate_configs()["cpu_ddp"]
    p = run_group([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg), "-m",
                   "spectrain", "train", "tiny/eagle3", *common, "launch.nproc=8", "output_dir=runs/b"],
                  env, 600, cwd=tmp_path)  # no ACCELERATE_USE_CPU
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((tmp_path / "runs/b/run_info.json").read_text())["world_size"] == 2


def _train_args(*overrides: str, nproc=None, config=None):
    return type("A", (), {"recipe": "tiny/eagle3", "overrides": list(overrides), "nproc": nproc,
                          "accelerate_config": config})()


def test_all_visible_gpus_by_default_with_a_start_line(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr("spectrain.train.loop.main", lambda recipe, ov: calls.append(("in-place", recipe)) or 0)
    monkeypatch.setattr(L, "run_launch", lambda cmd, env: calls.append(("launched", cmd)) or 0)
    monkeypatch.setattr(L, "_cuda_devices", lambda: 8)  # 8 fake CUDA devices
    monkeypatch.setattr(L, "_gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    for k in L._LAUNCHER_MARKERS:
        monkeypatch.delenv(k, raising=False)
    batch = ("training.global_batch_size=64", "training.micro_batch_size=2", "data.max_rows=400")
    assert L.train_command(_train_args(*batch)) == 0
    kind, cmd = calls[-1]
    assert kind == "launched" and _flag(cmd, "--num_processes") == "8"
    assert Path(_flag(cmd, "--config_file")).name == "ddp.yaml"
    line = capsys.readouterr().err.splitlines()[0]
    assert line.startswith("spectrain train: world size 8 (all 8 visible GPUs; --nproc 1 for one), grad "
                           "accumulation 4 (global 64 = micro 2 x 8 x 4), ~800 optimizer steps, ETA ~")
    assert "estimate: 8xH100 at MFU" in line and "--plan 8xH100" in line
    assert L.train_command(_train_args(*batch, nproc=1)) == 0 and calls[-1] == ("in-place", "tiny/eagle3")
    assert "world size 1 (--nproc" in capsys.readouterr().err
    assert L.train_command(_train_args(*batch, "launch.nproc=1")) == 0 and calls[-1][0] == "in-place"
    capsys.readouterr()
    with pytest.raises(ValueError, match="not divisible by micro_batch_size"):  # 8 rows over 8 GPUs x micro 4
        L.train_command(_train_args())


def test_a_missing_engine_is_one_line_with_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    monkeypatch.setattr(L, "run_launch", lambda cmd, env: 0)
    with pytest.raises(ValueError, match=r"zero2 uses DeepSpeed, which is not installed: pip install 'spectrain\[deepspeed\]'"):
        L.train_command(_train_args(config="zero2"))
    with pytest.raises(ValueError, match="pip install 'spectrain"):
        L.train_command(_train_args("launch.accelerate_config=zero3"))
