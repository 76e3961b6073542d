"""The stock accelerate configs in recipes/accelerate/ load with accelerate's own parser and resolve,
through `accelerate launch`'s own validation, to the launcher and environment we document.

accelerate only checks top-level keys of a config file; a misspelt key inside `fsdp_config` or
`deepspeed_config` is silently ignored. So nested keys are checked against the launch command's
arguments here, and the checker itself is tested on a deliberately misspelt config.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "recipes" / "accelerate"

# name -> (distributed_type in the file, launcher accelerate picks, processes)
EXPECTED = {
    "single": ("NO", "simple", 1),
    "ddp": ("MULTI_GPU", "torchrun", 8),
    "multinode_ddp": ("MULTI_GPU", "torchrun", 16),
    "fsdp": ("FSDP", "torchrun", 8),
    "zero2": ("DEEPSPEED", "deepspeed", 8),
    "zero3": ("DEEPSPEED", "deepspeed", 8),
    "cpu_ddp": ("MULTI_GPU", "torchrun", 2),
}
# Keys that accelerate turns into environment variables which override the values the training
# loop passes to Accelerator (parse_choice_from_env wins over the argument).
FORBIDDEN_NESTED = {"gradient_accumulation_steps", "gradient_clipping"}


def _launch_args(path: Path):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(path), "-m", "spectrain", "train", "recipe.yaml"])
    args, defaults, _ = _validate_launch_command(args)
    return args, defaults


def _launcher(args) -> str:
    if args.use_deepspeed:
        return "deepspeed"
    if args.use_fsdp or args.multi_gpu:
        return "torchrun"
    return "simple"


def nested_key_problems(raw: dict) -> list[str]:
    """Nested keys of fsdp_config / deepspeed_config that `accelerate launch` has no argument for."""
    from accelerate.commands.launch import launch_command_parser

    known = {a.dest for a in launch_command_parser()._actions}
    problems = []
    for section, prefix in (("fsdp_config", "fsdp_"), ("deepspeed_config", "")):
        for key in (raw.get(section) or {}):
            dest = key if key.startswith(prefix) else prefix + key
            if dest not in known:
                problems.append(f"{section}.{key}")
            if key in FORBIDDEN_NESTED:
                problems.append(f"{section}.{key} (overrides the loop's value through the environment)")
    return problems


def test_every_expected_config_exists_and_nothing_else():
    assert sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_parses_with_accelerate(name):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    path = CONFIG_DIR / f"{name}.yaml"
    cfg = load_config_from_file(str(path))
    assert isinstance(cfg, ClusterConfig)
    dist_type, _, nproc = EXPECTED[name]
    assert str(cfg.distributed_type) in (dist_type, f"DistributedType.{dist_type}")
    assert cfg.num_processes == nproc
    assert f"recipes/accelerate/{name}.yaml" in path.read_text(), "the header must show its own launch line"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_header_launch_lines_run_the_spectrain_module(name):
    """Every `accelerate launch` / `torchrun` line of a config's header starts `-m spectrain train RECIPE` (no
    checkout-only script), and accelerate's own parser reads it as a module launch."""
    import shlex

    from accelerate.commands.launch import launch_command_parser

    header = (CONFIG_DIR / f"{name}.yaml").read_text().splitlines()
    lines = [line.lstrip("#").strip().strip("()") for line in header  # the indented command lines, not the prose
             if line.startswith("#   ") and ("accelerate launch" in line or "torchrun" in line)]
    launches = [line[line.index("accelerate launch"):] for line in lines if "accelerate launch" in line]
    assert launches, f"{name}: no `accelerate launch` line in the header"
    for line in lines:
        assert "-m spectrain train RECIPE" in line, f"{name}: {line!r}"
    for line in launches:
        args = launch_command_parser().parse_args(shlex.split(line)[2:])
        assert args.module and args.training_script == "spectrain" and args.training_script_args == ["train", "RECIPE"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_resolves_to_expected_launcher(name):
    args, defaults = _launch_args(CONFIG_DIR / f"{name}.yaml")
    _, launcher, nproc = EXPECTED[name]
    assert _launcher(args) == launcher
    assert args.num_processes == nproc
    raw = yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())
    assert nested_key_problems(raw) == []


@pytest.mark.parametrize("name,stage", [("zero2", "2"), ("zero3", "3")])
def test_deepspeed_environment(name, stage):
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args, defaults = _launch_args(CONFIG_DIR / f"{name}.yaml")
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    _, env = prepare_deepspeed_cmd_env(args)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == stage
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    # These would silently override the recipe's derived accumulation / clipping.
    assert "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" not in env
    assert "ACCELERATE_GRADIENT_CLIPPING" not in env


def test_fsdp_environment_is_full_shard_fsdp2():
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _ = _launch_args(CONFIG_DIR / "fsdp.yaml")
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true"
    assert env["FSDP_VERSION"] == "2"
    assert env["FSDP_SHARDING_STRATEGY"] == "FULL_SHARD"
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == "true"


def test_multinode_splits_processes_over_nodes():
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _ = _launch_args(CONFIG_DIR / "multinode_ddp.yaml")
    prepare_multi_gpu_env(args)
    assert int(args.nnodes) == 2 and int(args.nproc_per_node) == 8
    assert args.main_process_ip and args.main_process_port


def test_cpu_ddp_uses_torchrun_and_documents_the_cpu_switch():
    # accelerate's simple launcher (MULTI_CPU / --cpu) starts ONE process without mpirun;
    # the torchrun path plus ACCELERATE_USE_CPU=1 is what gives a real 2-rank gloo group
    # (tests/test_distributed.py checks the ranks from inside).
    args, _ = _launch_args(CONFIG_DIR / "cpu_ddp.yaml")
    assert args.multi_gpu and not args.use_deepspeed and args.num_processes == 2
    assert "ACCELERATE_USE_CPU=1" in (CONFIG_DIR / "cpu_ddp.yaml").read_text()


def test_nested_key_checker_catches_typos_and_overrides(tmp_path):
    bad = yaml.safe_load((CONFIG_DIR / "fsdp.yaml").read_text())
    bad["fsdp_config"]["fsdp_reshard_after_fwd"] = True
    bad["deepspeed_config"] = {"zero_stag": 2, "gradient_accumulation_steps": 4}
    problems = nested_key_problems(bad)
    assert "fsdp_config.fsdp_reshard_after_fwd" in problems
    assert "deepspeed_config.zero_stag" in problems
    assert any(p.startswith("deepspeed_config.gradient_accumulation_steps") for p in problems)
