"""`spectrain ...` / `python -m spectrain ...`: thin dispatch to the modules that do the work."""

from __future__ import annotations

import argparse


def _recipe_cmd(sub, name: str, help: str):
    p = sub.add_parser(name, help=help)
    p.add_argument("recipe", help="path to a YAML recipe (see recipes/)")
    p.add_argument("overrides", nargs="*", help="typed overrides, e.g. training.lr=1e-4")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spectrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _recipe_cmd(sub, "check", "validate a recipe, load target config/tokenizer/data sample, print it")
    _recipe_cmd(sub, "train", "train the recipe's drafter (single process or under accelerate launch)")
    _recipe_cmd(sub, "prepare-features", "write the offline target-feature cache for a recipe")
    from spectrain.regenerate import add_regenerate_args

    add_regenerate_args(_recipe_cmd(sub, "regenerate", "answer the recipe's prompts with the frozen target "
                                    "(self-distillation data as JSONL)"))
    from spectrain.evaluate import add_eval_args

    add_eval_args(sub.add_parser("eval", help="lossless speculative decoding over prompt sets + report"))
    from spectrain.export import add_export_args

    add_export_args(sub.add_parser("export", help="write a serving-format directory (vLLM, SGLang, TensorRT-LLM, "
                                   "HF draft) and validate it"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "check":
            from spectrain.recipe import check_main

            return check_main(args.recipe, args.overrides)
        if args.command == "train":
            from spectrain.train import main as train_main

            return train_main(args.recipe, args.overrides)
        if args.command == "prepare-features":
            from spectrain.features import main as features_main

            return features_main(args.recipe, args.overrides)
        if args.command == "regenerate":
            from spectrain.regenerate import main as regenerate_main

            return regenerate_main(args)
        if args.command == "eval":
            from spectrain.evaluate import main as eval_main

            return eval_main(args)
        if args.command == "export":
            from spectrain.export import main as export_main

            return export_main(args)
    except BaseException as e:  # one line + exit 2 for bad input; traceback only with SPECTRAIN_DEBUG=1
        from spectrain.errors import report

        return report(args.command, e)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
