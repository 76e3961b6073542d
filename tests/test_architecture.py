"""The package's shape as a specification: layered imports without cycles, small modules, few top-level files.

The import graph is read from the source (module-level and function-level imports, not ``if TYPE_CHECKING``
blocks), so an import hidden inside a function cannot smuggle in a cycle or an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "spectrain"

# Lower layers never import higher ones. Inside one layer, imports are free but acyclic.
LAYERS = [
    ["spectrain.registry", "spectrain.io"],
    ["spectrain.engines"],
    ["spectrain.recipe"],
    ["spectrain.targets"],
    ["spectrain.decoding"],
    ["spectrain.data"],
    ["spectrain.drafters"],
    ["spectrain.train"],
    ["spectrain.export"],
    ["spectrain.eval"],
    ["spectrain.cli", "spectrain.__main__", "spectrain"],
]
# Function-level imports of spectrain modules that are allowed, each for its reason.
LAZY_OK = {
    "spectrain.cli": "start-up time: `spectrain --help` must not import torch; each command imports what it runs",
}
# Function-level imports of other packages: optional or heavy dependencies only, each with its reason.
LAZY_THIRD_PARTY = {
    "deepspeed": "optional (`pip install spectrain[deepspeed]`); only ZeRO runs need it",
    "gguf": "optional (`spectrain[gguf]`); only GGUF targets need it",
    "wandb": "optional tracker",
    "torch.utils.tensorboard": "optional tracker (needs the tensorboard package)",
    "matplotlib": "heavy to import; only a report's PNG plots need it",
    "datasets": "optional: only a hub or saved HF dataset as training data",
    "huggingface_hub": "only a hub-hosted GGUF target",
}
# io/ (and the package front door) stay importable without torch, so `spectrain --help` starts fast
TORCH_FREE = {"spectrain.io", "spectrain.engines"}  # packages
TORCH_FREE_MODULES = {"spectrain", "spectrain.cli"}
MAX_LINES = 450
MAX_TOP_MODULES = 5


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _targets(mods: dict[str, Path], cur: str, node) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = cur.split(".") if mods[cur].name == "__init__.py" else cur.split(".")[:-1]
        mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) if node.level \
            else node.module or ""
        names = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
    return [n for n in names if n in mods and n != cur]


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    lazy: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        tree = ast.parse(p.read_text())
        skip = {id(n) for top in tree.body if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test)
                for n in ast.walk(top)}
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                for t in _targets(mods, m, node):
                    edges[m].add(t)
                    if id(node) not in top:
                        lazy[m].add(t)
    return edges, lazy


def _layer(mod: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for pre in prefixes:
            if mod == pre or mod.startswith(pre + "."):
                if best is None or len(pre) > best[1]:
                    best = (i, len(pre))
    assert best is not None, f"{mod} is in no layer: add it to LAYERS"
    return best[0]


def test_no_import_cycles():
    edges, _ = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if t == "spectrain" or m == "spectrain":
                continue  # the package's lazy front door imports nothing at import time
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_imports_only_go_down_the_layers():
    edges, _ = _graph()
    up = [f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})" for m in edges for t in edges[m]
          if _layer(t) > _layer(m)]
    assert not up, "imports against the layering:\n" + "\n".join(sorted(up))


def test_function_level_imports_are_the_listed_few():
    _, lazy = _graph()
    hidden = [f"{m}: {sorted(t)}" for m, t in lazy.items() if t and m not in LAZY_OK]
    assert not hidden, "function-level imports of spectrain modules (move them to the top):\n" + "\n".join(hidden)


def test_other_function_level_imports_are_optional_or_heavy_dependencies():
    hidden = []
    for p in PKG.rglob("*.py"):
        mod = ".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(p.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in top or getattr(node, "level", 0):
                continue
            name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if name.startswith("spectrain"):
                continue  # the spectrain rule is test_function_level_imports_are_the_listed_few
            lazy_ok = any(name == k or name.startswith(k + ".") for k in LAZY_THIRD_PARTY)
            torch_free = mod in TORCH_FREE_MODULES or any(mod == t or mod.startswith(t + ".") for t in TORCH_FREE)
            if not lazy_ok and not torch_free:
                hidden.append(f"{mod}:{node.lineno} {name}")
    assert not hidden, "function-level imports of hard dependencies (move them to the top):\n" + "\n".join(hidden)


def test_small_modules_and_a_short_top_level():
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules at spectrain/'s top level: {top}"


@pytest.mark.parametrize("folder,what", [("train", "loop.py"), ("decoding", "step.py"), ("drafters", "medusa.py"),
                                         ("export", "eagle3.py"), ("eval", "harness.py"), ("data", "features.py")])
def test_the_pipeline_shows_in_the_folders(folder, what):
    assert (PKG / folder / what).is_file() and (PKG / folder / "__init__.py").read_text().startswith('"""')


def test_the_docs_name_every_module_and_only_modules_that_exist():
    """docs/layout.md lists every module under its folder; every spectrain/....py path that the docs or a
    docstring / comment names exists (a moved module leaves no stale pointer behind)."""
    import re

    docs = PKG.parent / "docs"
    layout = (docs / "layout.md").read_text()
    for p in PKG.rglob("*.py"):
        folder = p.parent.relative_to(PKG.parent).as_posix() + "/"
        section = layout.split(f"### `{folder}`", 1)
        assert len(section) == 2 and f"- `{p.name}`" in section[1].split("### ", 1)[0], \
            f"docs/layout.md does not list {folder}{p.name} (add it under its folder)"
    for page in [PKG.parent / "README.md", *docs.glob("*.md"), *PKG.rglob("*.py")]:
        for path in set(re.findall(r"spectrain/[a-z_0-9/]+\.py", page.read_text())):
            assert (PKG.parent / path).is_file(), f"{page.name} names {path}, which does not exist"


def test_the_layout_page_is_generated_from_the_tree():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(PKG.parent / "scripts" / "gen_layout.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


# Files of other projects that docstrings and docs name (checked against their sources, not this tree).
EXTERNAL_FILES = {
    "convert_hf_to_gguf.py": "llama.cpp's converter",
    "server_args.py": "SGLang's server arguments",
    "llama_eagle3.py": "vLLM's and SGLang's EAGLE-3 model files",
    "export_spectrain_rows.py": "../shared/anchors/speculators_cpu",
    "make_offline_from_rows.py": "../shared/anchors/speculators_cpu",
}
EXTERNAL_TREES = ("vllm/", "sglang/", "tensorrt_llm/", "transformers/", "speculators/", "conversion/")


def test_bare_and_relative_py_names_point_at_files_that_exist():
    """A file name in a docstring, comment or doc page (``loop.py``, ``drafters/base.py``) names a file that
    exists: a bare name in a module lives in the module's own folder; in the docs, anywhere in the repository;
    a relative path is the end of a real path. Names of other projects' files are listed above; the layout
    page's old -> new table names old paths on purpose."""
    import re

    repo = PKG.parent
    files = [p.relative_to(repo).as_posix() for p in repo.rglob("*.py") if ".git" not in p.parts]
    names = {Path(f).name for f in files}
    pat = re.compile(r"(?<![\w/.\-:])((?:[\w.\-]+/)*[A-Za-z_]\w*\.py)\b")
    stale = []
    for page in [repo / "README.md", *(repo / "docs").glob("*.md"), *PKG.rglob("*.py")]:
        text = page.read_text()
        if page.name == "layout.md":
            text = text.split("## Old path -> new path")[0]
        for ref in sorted(set(pat.findall(text))):
            if ref.startswith(("spectrain/", *EXTERNAL_TREES)) or ref in EXTERNAL_FILES:
                continue  # spectrain/... paths: test_the_docs_name_every_module_and_only_modules_that_exist
            if "/" in ref:
                ok = any(f == ref or f.endswith("/" + ref) for f in files)
            elif page.suffix == ".py":
                ok = (page.parent / ref).is_file()
            else:
                ok = ref in names
            if not ok:
                stale.append(f"{page.relative_to(repo)} names {ref}")
    assert not stale, "stale file names (the file moved or never existed):\n" + "\n".join(stale)
