"""`spectrain train RECIPE [--nproc N] [--accelerate-config NAME_OR_PATH] [a.b=value ...]`.

One process trains in place. With ``--nproc N`` (N > 1), ``--accelerate-config`` or a recipe
``launch:`` section, the command starts ``accelerate launch ... -m spectrain train RECIPE`` itself,
like axolotl / TRL / torchtune do; the child processes see ``SPECTRAIN_LAUNCHED=1`` and train.

- NAME is a shipped config (``spectrain recipes`` lists them: ddp, zero2, zero3, fsdp, single,
  cpu_ddp, multinode_ddp) or a path. Without one, N GPUs use the shipped ``ddp`` config.
- A shipped config's ``num_processes`` (8) is a placeholder: without --nproc the visible GPUs are used.
- Without CUDA, N ranks go through the shipped ``cpu_ddp`` config plus ``ACCELERATE_USE_CPU=1``: the
  only accelerate path that really starts N gloo ranks on CPU (``--cpu --num_processes N`` and
  MULTI_CPU configs start one process; see recipes/accelerate/cpu_ddp.yaml).
- Already under a launcher (``accelerate launch -m spectrain train ...``, torchrun, scripts/train.py)
  the launch settings are ignored and this process trains (on a machine without CUDA with
  ``ACCELERATE_USE_CPU=1`` set for it, so those forms need no environment variable either).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

LAUNCHED_ENV = "SPECTRAIN_LAUNCHED"
# Set by torchrun / accelerate launch in the processes they start.
_LAUNCHER_MARKERS = (LAUNCHED_ENV, "LOCAL_RANK", "WORLD_SIZE", "ACCELERATE_MIXED_PRECISION")


def add_launch_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to train on (GPUs, or CPU ranks without CUDA); > 1 starts accelerate launch "
                        "(default: the recipe's launch.nproc, else 1)")
    p.add_argument("--accelerate-config", default=None, metavar="NAME_OR_PATH",
                   help="a shipped accelerate config (ddp, zero2, zero3, fsdp, ...; `spectrain recipes`) or a "
                        "path; starts accelerate launch (default: the recipe's launch.accelerate_config)")
    return p


def inside_launcher(env: dict | None = None) -> bool:
    env = os.environ if env is None else env
    return any(k in env for k in _LAUNCHER_MARKERS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config_fields(path: Path) -> dict:
    import yaml

    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"accelerate config {path} is not valid YAML: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"accelerate config {path} must be a mapping (see recipes/accelerate/*.yaml)")
    return cfg


def plan_launch(recipe_arg: str, overrides: list[str], nproc: int | None, config: str | None, launch,
                cuda_devices: int) -> tuple[list[str], dict[str, str], int] | None:
    """(command, extra environment, processes) for `accelerate launch`, or None to train in this process.
    `launch` is the recipe's LaunchConfig; the flags win over it. `cuda_devices`: 0 = no CUDA."""
    from spectrain.resources import accelerate_configs, resolve_accelerate_config

    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc {nproc}: must be >= 1")
    nproc = nproc if nproc is not None else (launch.nproc or None)
    config = config if config is not None else launch.accelerate_config
    if (nproc or 1) <= 1 and not config:
        return None
    shipped = accelerate_configs()
    if config:
        path = resolve_accelerate_config(config)
    else:
        path = shipped["ddp" if cuda_devices else "cpu_ddp"]
    fields = _config_fields(path)
    if nproc is None and cuda_devices and path in shipped.values():
        nproc = cuda_devices  # the shipped configs' num_processes is a placeholder for "all the GPUs"
    procs = nproc or int(fields.get("num_processes", 1) or 1)
    if not cuda_devices and procs > 1 and fields.get("distributed_type") == "MULTI_CPU":
        raise ValueError(f"accelerate config {path} is MULTI_CPU: accelerate starts ONE process for it on a "
                         "machine without CUDA; use --accelerate-config cpu_ddp (or leave it out) for "
                         f"{procs} CPU ranks")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path)]
    if nproc is not None:
        cmd += ["--num_processes", str(nproc)]
    if procs > 1 and int(fields.get("num_machines", 1) or 1) == 1 and not fields.get("main_process_port"):
        cmd += ["--main_process_port", str(_free_port())]  # two runs on one machine must not collide on 29500
    cmd += ["-m", "spectrain", "train", recipe_arg, *overrides]
    env = {LAUNCHED_ENV: "1"}
    if not cuda_devices:
        env["ACCELERATE_USE_CPU"] = "1"  # without it every CPU rank believes it is alone (world size 1)
    return cmd, env, procs


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_launch(cmd: list[str], extra_env: dict[str, str]) -> int:
    """Run the launcher in the foreground; SIGTERM is passed on so the ranks checkpoint before stopping."""
    proc = subprocess.Popen(cmd, env={**os.environ, **extra_env})
    previous = signal.signal(signal.SIGTERM, lambda sig, _frame: proc.send_signal(sig))
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # the ranks got the same Ctrl-C: let them write their checkpoint
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)


def train_command(args: argparse.Namespace) -> int:
    from spectrain.recipe import load_recipe
    from spectrain.train import main as train_main

    if inside_launcher():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _cuda_devices():
            # torchrun / accelerate launch on a CPU machine: without this every rank believes it is alone
            os.environ.setdefault("ACCELERATE_USE_CPU", "1")
        return train_main(args.recipe, args.overrides)
    recipe = load_recipe(args.recipe, args.overrides)  # a bad recipe fails here, before any process starts
    wants = (args.nproc or recipe.launch.nproc or 1) > 1 or args.accelerate_config or recipe.launch.accelerate_config
    plan = plan_launch(args.recipe, args.overrides, args.nproc, args.accelerate_config, recipe.launch,
                       _cuda_devices() if wants else 0)
    if plan is None:
        return train_main(args.recipe, args.overrides)
    cmd, env, procs = plan
    shown = " ".join(["accelerate", "launch", *cmd[3:]])
    print(f"spectrain train: starting {procs} process(es): "
          f"{' '.join(f'{k}={v}' for k, v in env.items())} {shown}", file=sys.stderr, flush=True)
    return run_launch(cmd, env)
