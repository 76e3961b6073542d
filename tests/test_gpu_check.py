"""The GPU check script's CPU dry run (GPU_CHECK_DEVICE=cpu): every step of scripts/gpu_check.sh runs the
same code paths at tiny sizes, so a broken step is caught here rather than on a rare lent GPU."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path):
    if not (REPO / "assets/reference-target/config.json").is_file():
        pytest.skip("needs the bundled reference target")
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    for kind in ("eagle3", "medusa", "draft"):
        assert f"tiny {kind} recipe" in summary
        assert f"tiny-{kind}/last: identical" in summary  # greedy losslessness of each trained drafter
    assert "synthetic" in summary and "not produced" not in summary
    wheel = (tmp_path / "wheel.log").read_text()  # the wheel in a venv that sees this torch, run from an empty dir
    assert "torch before: " + torch.__version__ in wheel and "torch after: " + torch.__version__ in wheel
    assert "2-step train + 1-prompt eval" in wheel
    sweep = json.loads((tmp_path / "sweep/report.json").read_text())["batch_sweep"]
    assert sweep["batch_sizes"] == [1, 4] and sweep["cells"]
