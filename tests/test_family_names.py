"""The family record is the only description of a family: no module outside a family's own compares a value
with a family's name (``kind == "eagle3"``, ``kind in ("draft", "ngram")``, ...). What differs between families is
a hook or a capability of its record in spectrain/registry.py, so a new family reaches parity with the built-ins
without an edit elsewhere (tests/test_family_contract.py shows it).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from spectrain import registry

PKG = Path(__file__).resolve().parents[1] / "spectrain"
# A family's own modules: its drafters/ module or folder and its export/ module (plus the record itself).
OWN = ("registry.py", "drafters/eagle3/", "drafters/medusa.py", "drafters/draft_lm", "drafters/ngram.py",
       "export/eagle3.py", "export/medusa.py", "export/hf_draft.py")
# Comparisons with a serving format's own field values, which happen to be spelled like a family (the
# speculators config's `speculators_model_type: "eagle3"`, vLLM's `model_type: "medusa"`): facts of a file format.
FORMAT_FACTS = {("export/__init__.py", "speculators_model_type"), ("export/__init__.py", "model_type")}
# Modules written while issue 29 landed, by another change (the llama.cpp engine); their branches are the next
# to move into the records (a `llama.cpp` format per family). Listed so that the debt shows and only shrinks.
PENDING: set[str] = set()


def _strings(node) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_strings(e) for e in node.elts)) if node.elts else set()
    return set()


def family_branches(root: Path = PKG) -> list[str]:
    names = set(registry.FAMILIES) | set(registry.TRAINING_FREE)
    hits = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith(OWN) or (root == PKG and rel in PENDING):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            if any(names & _strings(s) for s in sides):
                text = ast.unparse(node)
                if not any(rel == f and key in text for f, key in FORMAT_FACTS):
                    hits.append(f"spectrain/{rel}:{node.lineno}: {text}")
    return hits


def test_no_module_outside_a_family_branches_on_its_name():
    hits = family_branches()
    assert not hits, ("branches on a family's name outside its own modules: make it a hook or a capability of "
                      "the family's record (spectrain/registry.py):\n" + "\n".join(hits))


def test_the_check_itself_finds_a_branch(tmp_path):
    (tmp_path / "mod.py").write_text('def f(r):\n    return r.drafter.kind in ("draft", "x") or 1 == 2\n')
    assert family_branches(tmp_path) == ['spectrain/mod.py:2: r.drafter.kind in (\'draft\', \'x\')']


HOOKS = ("serve.command", "serve.k", "serve.engine_problems", "train.preflight", "train.validate", "train.cost",
         "train.cost_config", "train.run_inputs", "decode.deploy_cost")


def test_every_hook_resolves_and_every_head_is_a_trainable_head():
    for kind, fam in registry.FAMILIES.items():
        for name in HOOKS:
            side, _, attr = name.partition(".")
            ref = getattr(getattr(fam, side), attr)
            assert not ref or callable(registry.resolve(ref)), f"{kind}.{name} = {ref!r} does not resolve"
        assert issubclass(registry.resolve(fam.train.head), registry.TrainableHead), kind
        assert set(fam.serve.engines) <= set(fam.serve.exports), f"{kind}: engines named for a format it does not export"
        assert not fam.serve.engines or fam.serve.command, f"{kind}: engines serve its formats but it has no serve hook"
        assert fam.capabilities <= {"packing", "rollout", "on_policy", "one_pass"}, kind


def test_built_in_hooks_live_in_their_family_and_exporters_in_export():
    """A built-in family's hooks point into spectrain/drafters/ (its own module or folder); only its exporters and
    validators point into spectrain/export/ (one module per format). A new family copies what it sees here."""
    stray = []
    for kind, fam in registry.FAMILIES.items():
        for side in ("train", "decode", "serve"):
            for f in dataclasses.fields(getattr(fam, side)):
                value = getattr(getattr(fam, side), f.name)
                refs = [r for pair in value.values() for r in pair] if f.name == "exports" else [value]
                home = "spectrain.export." if f.name == "exports" else "spectrain.drafters."
                stray += [f"{kind}.{side}.{f.name} = {r}" for r in refs
                          if isinstance(r, str) and ":" in r and not r.startswith(home)]
    assert not stray, "hooks outside the family's own modules:\n" + "\n".join(stray)
