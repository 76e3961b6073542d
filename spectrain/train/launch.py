"""`spectrain train RECIPE [--nproc N] [--accelerate-config NAME_OR_PATH] [a.b=value ...]`.

One process trains in place. With ``--nproc N`` (N > 1), ``--accelerate-config`` or a recipe
``launch:`` section, the command starts ``accelerate launch ... -m spectrain train RECIPE`` itself,
like axolotl / TRL / torchtune do; the child processes see ``SPECTRAIN_LAUNCHED=1`` and train.

- By default every visible CUDA device trains: on a machine with N > 1 GPUs ``spectrain train RECIPE``
  starts N processes (the shipped ``ddp`` config), unless ``--nproc`` or the recipe's ``launch.nproc``
  says otherwise (``--nproc 1``: one process). One start line says the world size, the gradient
  accumulation, the optimizer steps and an ETA (an estimate: spectrain/train/plan.py, ``check --plan``).
- NAME is a shipped config (``spectrain recipes`` lists them: ddp, zero2, zero3, fsdp, single,
  cpu_ddp, multinode_ddp) or a path. Without one, N GPUs use the shipped ``ddp`` config. A DeepSpeed
  config without DeepSpeed installed is refused in one line naming ``pip install 'spectrain[deepspeed]'``.
- A shipped config's ``num_processes`` (8) is a placeholder: without --nproc the visible GPUs are used.
- Without CUDA, N ranks go through the shipped ``cpu_ddp`` config plus ``ACCELERATE_USE_CPU=1``: the
  only accelerate path that really starts N gloo ranks on CPU (``--cpu --num_processes N`` and
  MULTI_CPU configs start one process; see recipes/accelerate/cpu_ddp.yaml).
- Already under a launcher (``accelerate launch -m spectrain train ...``, ``torchrun -m spectrain train ...``)
  the launch settings are ignored and this process trains (on a machine without CUDA with
  ``ACCELERATE_USE_CPU=1`` set for it, so those forms need no environment variable either).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from transformers import AutoConfig, AutoTokenizer

from spectrain import registry
from spectrain.data.chat import is_heldout, load_conversations
from spectrain.io.resources import accelerate_configs, resolve_accelerate_config
from spectrain.recipe.load import load_recipe
from spectrain.train import loop
from spectrain.train.distributed import malloc_setting
from spectrain.train.plan import DEFAULT_MFU, data_size, estimate, gpu_from_device_name, parse_hardware

LAUNCHED_ENV = "SPECTRAIN_LAUNCHED"
# Set by torchrun / accelerate launch in the processes they start.
_LAUNCHER_MARKERS = (LAUNCHED_ENV, "LOCAL_RANK", "WORLD_SIZE", "ACCELERATE_MIXED_PRECISION")


def add_launch_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to train on (GPUs, or CPU ranks without CUDA); > 1 starts accelerate launch "
                        "(default: the recipe's launch.nproc, else every visible GPU, else 1)")
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
    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc {nproc}: must be >= 1")
    nproc = nproc if nproc is not None else (launch.nproc or None)
    config = config if config is not None else launch.accelerate_config
    if nproc is None and not config and cuda_devices > 1:
        nproc = cuda_devices  # all the GPUs, as `accelerate launch` itself would
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


def _require_backend(name: str, fields: dict) -> None:
    """An accelerate config whose backend is not installed: one line with the install command."""
    if fields.get("distributed_type") == "DEEPSPEED" and importlib.util.find_spec("deepspeed") is None:
        raise ValueError(f"accelerate config {name} uses DeepSpeed, which is not installed: "
                         "pip install 'spectrain[deepspeed]' (or use --accelerate-config ddp / fsdp)")


def start_line(recipe, world: int, cuda_devices: int, gpu_name: str, why: str) -> str:
    """World size, accumulation, optimizer steps and an ETA (estimated) in one line; raises ValueError when
    the global batch does not divide over `world` processes."""
    t = recipe.training
    accum = t.grad_accum(world)
    steps, eta = f"{t.max_steps}" if t.max_steps else "?", "n/a (no CUDA)" if not cuda_devices else "n/a"
    try:
        steps, eta = _steps_and_eta(recipe, world, gpu_name, cuda_devices)
    except Exception as e:  # an estimate must never stop a run (e.g. a hub dataset not reachable yet)
        eta += f" ({type(e).__name__})"
    return (f"spectrain train: world size {world} ({why}), grad accumulation {accum} (global "
            f"{t.global_batch_size} = micro {t.micro_batch_size} x {world} x {accum}), {steps} optimizer steps, "
            f"ETA {eta}")


def _steps_and_eta(recipe, world: int, gpu_name: str, cuda_devices: int) -> tuple[str, str]:
    t, d = recipe.training, recipe.data
    gpu = gpu_from_device_name(gpu_name) if cuda_devices else None
    if gpu is None:  # steps from the row count alone (the ETA needs a GPU with a known peak)
        rows, _ = load_conversations(d.train_files, d.format, d.max_rows)
        train = sum(not is_heldout(r["id"], d.heldout_fraction) for r in rows)
        steps = t.max_steps or t.epochs * (train // t.global_batch_size)
        return f"~{steps}", "n/a (no CUDA)" if not cuda_devices else f"n/a ({gpu_name}: not in the plan's GPU table)"

    src, trc = recipe.target.name_or_path, recipe.target.trust_remote_code
    cfg = AutoConfig.from_pretrained(src, trust_remote_code=trc)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    ds = data_size(recipe, AutoTokenizer.from_pretrained(src, trust_remote_code=trc))
    hw = parse_hardware(f"{world}x{gpu}")
    steps = t.max_steps or t.epochs * (ds.train_rows // t.global_batch_size)
    if registry.hook(recipe.drafter.kind, "train.cost") is None:
        return f"~{steps}", f"n/a (drafter.kind={recipe.drafter.kind} declares no training cost in its registry record)"
    seconds = estimate(recipe, cfg, ds, hw).wall_s
    return f"~{steps}", f"~{seconds / 3600:.1f} h (estimate: {world}x{gpu} at MFU {DEFAULT_MFU}; `spectrain check " \
        f"RECIPE --plan {world}x{gpu}` shows the formula)"


def _gpu_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""


def _cuda_devices() -> int:
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
    if inside_launcher():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _cuda_devices():
            # torchrun / accelerate launch on a CPU machine: without this every rank believes it is alone
            os.environ.setdefault("ACCELERATE_USE_CPU", "1")
        return loop.main(args.recipe, args.overrides)
    recipe = load_recipe(args.recipe, args.overrides)  # a bad recipe fails here, before any process starts
    malloc_setting()  # so does a mistyped $SPECTRAIN_MALLOC (every rank would refuse it)
    config = args.accelerate_config or recipe.launch.accelerate_config
    if config:
        _require_backend(config, _config_fields(resolve_accelerate_config(config)))
    cuda = _cuda_devices()
    plan = plan_launch(args.recipe, args.overrides, args.nproc, args.accelerate_config, recipe.launch, cuda)
    procs = plan[2] if plan else 1
    said = args.nproc is not None or recipe.launch.nproc or args.accelerate_config or recipe.launch.accelerate_config
    why = ("--nproc / launch: / accelerate config" if said else
           f"all {cuda} visible GPUs; --nproc 1 for one" if cuda > 1 else f"{cuda} GPU" if cuda else "no CUDA: CPU")
    print(start_line(recipe, procs, cuda, _gpu_name() if cuda else "", why), file=sys.stderr, flush=True)
    if plan is None:
        return loop.main(args.recipe, args.overrides)
    cmd, env, procs = plan
    shown = " ".join(["accelerate", "launch", *cmd[3:]])
    print(f"spectrain train: starting {procs} process(es): "
          f"{' '.join(f'{k}={v}' for k, v in env.items())} {shown}", file=sys.stderr, flush=True)
    return run_launch(cmd, env)
