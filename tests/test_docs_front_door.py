"""The README is a front door and the docs describe the product, not its history."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "eval" / "README.md",
        ROOT / "recipes" / "README.md", ROOT / "data" / "README.md"]
HISTORY = re.compile(r"\bissues? #?\d+|\bitems? \d+ (?:and|of)\b|\bthis session\b|\bissue item\b", re.I)


def test_readme_is_short_and_opens_with_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1).strip().splitlines()
    assert block == ['bash scripts/setup.sh && bash scripts/demo.sh',
                     'bash scripts/setup.sh && python -m pytest -q -m "not slow"']


def test_no_doc_speaks_of_issues_or_sessions():
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}" for p in DOCS if p.is_file()
             for i, line in enumerate(p.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not found, "docs describe the product, not its history:\n" + "\n".join(found)


def test_the_layout_the_readme_names_is_the_package():
    text = (ROOT / "README.md").read_text()
    named = re.search(r"`spectrain/\{([^}]*)\}/`", text.replace("\n", "")).group(1)
    folders = {p.name for p in (ROOT / "spectrain").iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert {n.strip() for n in named.split(",")} == folders
