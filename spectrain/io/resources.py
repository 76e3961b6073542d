"""Where the shipped recipes, accelerate configs, prompt sets, chat data and reference target live.

Two layouts hold the same files:

- a git checkout or an editable install (``pip install -e .``): the repository root
  (``recipes/``, ``eval/prompts/``, ``assets/reference-target/``, ``data/train/``);
- an installed wheel: ``spectrain/_shipped/`` inside site-packages (pyproject.toml maps the same
  top-level folders there).

A shipped recipe is addressed by name (``tiny/eagle3``; ``recipes/tiny/eagle3.yaml`` also works from
any directory). Relative *input* paths inside a shipped recipe (target, data files, draft model) are
resolved against the data root when they exist there; outputs (``output_dir``, caches) stay relative
to the current directory. A user's own recipe file is read as written: relative paths against the
current directory.
"""

from __future__ import annotations

import functools
from pathlib import Path

VERSION = "0.1.0"  # spectrain.__version__ and the wheel's version (pyproject reads it here, without torch)
_HERE = Path(__file__).resolve().parent.parent  # the spectrain package dir (this file is spectrain/io/)
RECIPE_SUFFIX = ".yaml"
# Dotted recipe keys holding paths the recipe *reads*; only these are anchored to the data root.
INPUT_PATH_KEYS = (("target", "name_or_path"), ("data", "train_files"), ("drafter", "draft", "model"))


@functools.cache
def data_root() -> Path:
    """The folder holding recipes/, eval/, assets/ and data/ (wheel layout first, then the checkout)."""
    for root in (_HERE / "_shipped", _HERE.parent):
        if (root / "recipes").is_dir():
            return root
    raise FileNotFoundError(f"spectrain's shipped files are missing (looked in {_HERE / '_shipped'} and "
                            f"{_HERE.parent}); reinstall spectrain")


def recipes_dir() -> Path:
    return data_root() / "recipes"


def prompts_dir() -> Path:
    return data_root() / "eval" / "prompts"


def reference_target() -> Path:
    return data_root() / "assets" / "reference-target"


def _config_files(folder: Path, pattern: str) -> list[Path]:
    return sorted(p for p in folder.glob(pattern) if p.is_file())


def shipped_recipes() -> dict[str, Path]:
    """name -> file for every shipped training recipe (accelerate configs excluded), e.g. 'tiny/eagle3'."""
    root = recipes_dir()
    files = _config_files(root, "*" + RECIPE_SUFFIX) + _config_files(root, "*/*" + RECIPE_SUFFIX)
    return {p.relative_to(root).with_suffix("").as_posix(): p for p in files
            if p.parent.name != "accelerate"}


def accelerate_configs() -> dict[str, Path]:
    """name -> file of the stock accelerate configs (zero2, zero3, fsdp, ddp, cpu_ddp ...)."""
    return {p.stem: p for p in _config_files(recipes_dir() / "accelerate", "*" + RECIPE_SUFFIX)}


def _shipped_name(text: str) -> str:
    name = text.strip()
    name = name[len("recipes/"):] if name.startswith("recipes/") else name
    return name[: -len(RECIPE_SUFFIX)] if name.endswith(RECIPE_SUFFIX) else name


def resolve_recipe(text: str) -> tuple[Path, bool]:
    """(file, shipped?) for a recipe argument: an existing file wins (a user's recipe), else a shipped
    name. Raises FileNotFoundError listing the shipped names."""
    path = Path(text).expanduser()
    if path.is_file():
        shipped = path.resolve().is_relative_to(recipes_dir().resolve())
        return path, shipped
    known = shipped_recipes()
    name = _shipped_name(text)
    if name in known:
        return known[name], True
    raise FileNotFoundError(f"recipe not found: {text} is neither a file nor a shipped recipe "
                            f"({', '.join(known)}); `spectrain recipes` lists them")


def resolve_accelerate_config(text: str) -> Path:
    """A shipped accelerate config by name (zero2, ...) or a path to a user's config file."""
    path = Path(text).expanduser()
    if path.is_file():
        return path
    known = accelerate_configs()
    name = Path(text).stem if text.endswith(RECIPE_SUFFIX) else text
    if name in known:
        return known[name]
    raise FileNotFoundError(f"accelerate config not found: {text} is neither a file nor a shipped config "
                            f"({', '.join(known)})")


def _anchor(value: str) -> str:
    """An input path of a shipped recipe -> absolute under the data root when it exists there
    (a hub id such as Qwen/Qwen3-8B does not, and is left alone)."""
    if not value or Path(value).is_absolute():
        return value
    candidate = data_root() / value
    return str(candidate) if candidate.exists() else value


def anchor_shipped_paths(raw: dict) -> dict:
    """Rewrite the input paths of a shipped recipe's raw dict in place (see module doc)."""
    for keys in INPUT_PATH_KEYS:
        node = raw
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if not isinstance(node, dict) or keys[-1] not in node:
            continue
        value = node[keys[-1]]
        if isinstance(value, str):
            node[keys[-1]] = _anchor(value)
        elif isinstance(value, list):
            node[keys[-1]] = [_anchor(v) if isinstance(v, str) else v for v in value]
    return raw


def recipe_summary(path: Path, width: int = 110) -> str:
    """The first sentence of a recipe file's leading comment (its one-line description)."""
    words = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line[1:]
        if text.startswith("  ") or not text.strip():  # an indented example command ends the prose
            break
        words.append(text.strip())
    sentence = " ".join(words).split(". ")[0].rstrip(".:")
    return sentence if len(sentence) <= width else sentence[: width - 3].rstrip() + "..."
