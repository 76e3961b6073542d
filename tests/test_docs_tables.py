"""The README is a front door and every measured table is generated (scripts/gen_tables.py).

Fast, no torch: (a) `gen_tables.py --check` passes on the committed tree; (b) one edited number in a
temporary copy makes it fail naming the table and the fix; (c) README.md is short and its first ```bash
block is the two quick-start commands `.ci/run` extracts; (d) every docs page the README links exists and
every relative link in README.md and docs/*.md resolves (file and heading).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GEN = ROOT / "scripts" / "gen_tables.py"
QUICK_START = ('bash scripts/setup.sh && bash scripts/demo.sh\n'
               'bash scripts/setup.sh && python -m pytest -q -m "not slow"\n')


def _gen(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GEN), *args], capture_output=True, text=True, timeout=120)


def _copy_tree(dst: Path) -> None:
    shutil.copy2(ROOT / "README.md", dst / "README.md")
    shutil.copytree(ROOT / "docs", dst / "docs", ignore=shutil.ignore_patterns("*.png"))
    shutil.copytree(ROOT / "eval" / "reference", dst / "eval" / "reference")


def test_generated_tables_match_their_reference_reports():
    r = _gen("--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "up to date" in r.stdout


def test_an_edited_number_is_named_as_a_stale_table(tmp_path):
    _copy_tree(tmp_path)
    readme = tmp_path / "docs" / "evaluation.md"  # where the demo's headline table lives
    text = readme.read_text()
    start = text.index("<!-- table:headline ")
    body_at = text.index("\n| EAGLE-3 (trained) | chain k=5 | 0 | ", start)
    cell = text.index("2.60 [2.31, 3.65]", body_at)
    readme.write_text(text[:cell] + "2.61" + text[cell + 4:])
    r = _gen("--check", "--root", str(tmp_path))
    assert r.returncode == 1
    assert "table 'headline' is stale" in r.stderr and "python scripts/gen_tables.py" in r.stderr
    assert "tiny_eagle3_tau" not in r.stderr  # only the edited table is named

    # a changed source makes its tables stale too, in the docs page where they live
    src = tmp_path / "eval" / "reference" / "bench_decode_cpu.json"
    src.write_text(src.read_text().replace("109.5", "109.6", 1))
    r = _gen("--check", "--root", str(tmp_path))
    assert r.returncode == 1 and "docs/evaluation.md: table 'bench_decode_cpu' is stale" in r.stderr

    # regenerating fixes both; --check then passes on the copy
    r = _gen("--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert _gen("--check", "--root", str(tmp_path)).returncode == 0
    assert "| HF `generate`, plain | 109.6 |" in (tmp_path / "docs" / "evaluation.md").read_text()


def test_a_measured_table_outside_markers_is_refused(tmp_path):
    _copy_tree(tmp_path)
    page = tmp_path / "docs" / "training.md"
    page.write_text(page.read_text() + "\n| steps | tokens/s |\n|---|---|\n| 10 | 123 |\n")
    r = _gen("--check", "--root", str(tmp_path))
    assert r.returncode == 1 and "docs/training.md: a table outside generated-table markers" in r.stderr


def test_readme_is_short_and_starts_with_the_quick_start():
    text = (ROOT / "README.md").read_text()
    assert text.count("\n") <= 260
    first = re.search(r"^```bash\n(.*?)^```", text, re.S | re.M)
    assert first is not None and first.group(1) == QUICK_START
    # what .ci/run extracts (the first ```bash block) is exactly these two commands
    awk = shutil.which("awk")
    if awk:
        out = subprocess.run([awk, '/^```bash/{f=1; next} /^```/{if (f) exit} f', str(ROOT / "README.md")],
                             capture_output=True, text=True, check=True).stdout
        assert out == QUICK_START


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _relative_links(path: Path):
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)  # links inside code are not links
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        yield target


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_readme_docs_index_and_every_relative_link_resolve():
    readme = ROOT / "README.md"
    linked_docs = {t.split("#", 1)[0] for t in _relative_links(readme) if t.startswith("docs/")}
    for page in ("training", "drafters", "decoding", "evaluation", "batching", "export", "reliability",
                 "real_model", "layout", "on_policy", "gpu_check_h200"):
        assert f"docs/{page}.md" in linked_docs, f"README.md does not link docs/{page}.md"
    missing = []
    for path in [readme, *sorted((ROOT / "docs").glob("*.md")), ROOT / "eval" / "README.md",
                 ROOT / "eval" / "reference" / "README.md"]:
        for link in _relative_links(path):
            target, _, anchor = link.partition("#")
            dest = path.parent / target
            if not dest.exists():
                missing.append(f"{path.relative_to(ROOT)}: {link}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                missing.append(f"{path.relative_to(ROOT)}: {link} (no such heading)")
    assert not missing, "links to missing files:\n" + "\n".join(missing)


def test_smollm2_labels_name_the_data_scaling_runs():
    sys.path.insert(0, str(ROOT))
    from scripts.gen_tables import smollm2_label

    assert smollm2_label("runs/data-scaling/rows5000/best") == "EAGLE-3 (5,000 rows)"
    assert smollm2_label("runs/data-scaling/rows5000-e2/best") == "EAGLE-3 (5,000 rows, 2 epochs)"
    assert smollm2_label("runs/smollm2-medusa/best") == "Medusa"
    assert smollm2_label("runs/smollm2-eagle3-pool/best") == "EAGLE-3 (12,121 rows)"
    assert smollm2_label("runs/x/rows-big/best") == "runs/x/rows-big/best"  # not a study run: the path itself


def test_greedy_cell_counts_near_ties_and_failures():
    sys.path.insert(0, str(ROOT))
    from scripts.gen_tables import greedy_cell

    assert greedy_cell({"greedy_check": {"identical": 6, "near_tie": 0, "fail": 0, "n": 6}}) == "; greedy 6/6 ="
    assert greedy_cell({"greedy_check": {"identical": 4, "near_tie": 1, "fail": 1, "n": 6}}) == \
        "; greedy 4/6 =, 1 near-tie, 1 FAIL"
    assert greedy_cell({}) == ""  # a T = 1 cell has no greedy check
