"""Every command in a shipped recipe's header comment is valid: it parses with the CLI and, for the recipe
commands, `spectrain check` (in-process) accepts the recipe with the header's overrides and flags. No header
gives a checkout-only `scripts/...` line (launchers run `-m spectrain train RECIPE`). The real targets are not
reachable here, so their config, tokenizer and data sample are stood in for (the recipe keys, values, batch and plan are what is checked)."""

from __future__ import annotations

import shlex
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from spectrain import cli
from spectrain.io.resources import shipped_recipes
from spectrain.train import check, plan

RECIPE_COMMANDS = ("check", "train", "prepare-features", "regenerate")
SHAPES = {  # the real targets' published configs (the fields the checks and the plan read)
    "meta-llama/Llama-3.1-8B-Instruct": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                             num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "Qwen/Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=151936, head_dim=128),
    "meta-llama/Llama-3.3-70B-Instruct": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                              num_attention_heads=64, num_key_value_heads=8, vocab_size=128256),
}

# SmolLM2-135M-Instruct (recipes/smollm2-135m): a GGUF fetched by `spectrain target fetch`, absent on CI
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)

STUDENT = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,  # Llama-3.2-1B
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)


def header_commands(path: Path) -> list[list[str]]:
    """The `spectrain ...` lines of the leading comment block, as argv lists (trailing `# ...` notes cut)."""
    out = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text.startswith("spectrain "):
            out.append(shlex.split(text, comments=True)[1:])
    return out


def _headers() -> list[tuple[str, Path]]:
    return sorted(shipped_recipes().items())


def test_every_recipe_header_names_its_commands_and_no_checkout_paths():
    for name, path in _headers():
        head = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
        assert "scripts/" not in head, f"{name}: header gives a checkout-only scripts/ line"
        assert any(c[0] == "check" for c in header_commands(path)), f"{name}: no `spectrain check` line"
        if not name.startswith("tiny/"):  # the real recipes name regeneration as their first stage
            cmds = [c[0] for c in header_commands(path)]
            assert "regenerate" in cmds and cmds.index("regenerate") < cmds.index("train"), name


@pytest.mark.parametrize("name,path", _headers(), ids=[n for n, _ in _headers()])
def test_header_commands_are_valid(name, path, monkeypatch, capsys):
    from transformers import AutoTokenizer, LlamaConfig

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(2**50, 0, 2**50))  # the plan's disk: a big NVMe
    ref_tok = AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parents[1] / "assets" / "reference-target"))
    # The feature cache is data the header's own prepare-features line writes: stood in even where the target
    # is reachable (a machine that fetched the GGUF need not have built every recipe's cache).
    monkeypatch.setattr(check, "_missing_cache", lambda r: "")
    for argv in header_commands(path):
        args = cli.parse(argv)  # valid command, flags and overrides (exits on a usage error)
        if args.command not in RECIPE_COMMANDS:
            continue
        recipe = check.load_recipe(args.recipe, args.overrides)
        shape = SHAPES.get(recipe.target.name_or_path)
        src = recipe.target.name_or_path
        if src.endswith(".gguf") and not Path(src).is_file():
            shape = SMOLLM2
        if shape is not None:  # not reachable here: stand in the published shape, the tokenizer and a data size
            monkeypatch.setattr(check, "_check_target", lambda r, s=shape: (LlamaConfig(**s), ref_tok))
            monkeypatch.setattr(check, "_check_data", lambda r, tok: [])
            monkeypatch.setattr(check, "data_size", lambda r, tok: plan.DataSize(50_000, 500, 1200))
            monkeypatch.setattr(check, "_student_config", lambda r: LlamaConfig(**STUDENT) if r.drafter.draft.model else None)
        rc = check.main(args.recipe, args.overrides, getattr(args, "plan", None), getattr(args, "mfu", None))
        assert rc == 0, f"{name}: `spectrain {' '.join(argv)}` fails check: {capsys.readouterr().err}"
