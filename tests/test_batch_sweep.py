"""`spectrain eval --batch-size ...`: the throughput sweep, the crossover and the prediction in the report."""

from __future__ import annotations

import json

import pytest
from test_evaluate import one_thread, workdir  # noqa: F401  (fixtures: a saved tiny target + prompt files)

from spectrain.cli import main as cli_main
from spectrain.eval.roofline import crossover


def test_sweep_report(workdir, tmp_path):  # noqa: F811
    out = tmp_path / "sweep"
    argv = ["eval", "--recipe", str(workdir / "recipe.yaml"), "--drafter", "ngram", "--prompts", "heldout",
            "--n", "3", "--max-new-tokens", "6", "--k", "3", "--tree", "topk=2,depth=3", "--temperature", "0",
            "--batch-size", "4", "--batch-size", "1", "--batch-size", "2", "--gpu", "a100", "--sweep-repeats", "2", "--cost-curve", "--out", str(out)]
    assert cli_main(argv) == 0
    sw = json.loads((out / "report.json").read_text())["batch_sweep"]
    assert sw["batch_sizes"] == [1, 2, 4] and sw["rows"] == 4 and sw["repeats"] == 2 and sw["distinct_prompts"] == 3
    cells = sw["cells"]
    assert [(c["config"], c["batch_size"]) for c in cells] == [
        (cfg, b) for b in (1, 2, 4) for cfg in ("k=3 T=0", "tree topk=2,depth=3,total=6 T=0")]
    for c in cells:
        assert c["greedy_identical_to_plain"] == "4/4"  # lossless at every batch size
        assert c["speedup"] == pytest.approx(c["tokens_per_s"] / c["plain_tokens_per_s"])
        assert c["tokens"] == 4 * 6 and c["latency_s"] > 0 and c["plain_latency_s"] > 0
        assert c["predicted_cpu"] > 0 and c["predicted_deployment"] > 0 and c["predicted_cost_curve"] > 0
        if c["batch_size"] == 1:  # a free drafter, memory-bound at B=1: the prediction is exactly tau
            assert c["predicted_deployment"] == pytest.approx(c["tau"])
    for x in sw["crossover"]:
        cs = [c for c in cells if c["config"] == x["config"]]
        assert x["measured"] == crossover([c["batch_size"] for c in cs], [c["speedup"] for c in cs])
        assert x["deployment_curve"]["accelerator"] == "A100-SXM4-80GB"
        assert x["predicted_cost_curve"] == crossover([c["batch_size"] for c in cs],
                                                      [c["predicted_cost_curve"] for c in cs])
    assert sw["cpu_peaks"]["bandwidth_GBps"] > 0.1 and sw["deployment"]["bandwidth_GBps"] == pytest.approx(2039)
    md = (out / "report.md").read_text()
    assert "## Batch size: throughput and the crossover" in md and "crossover, measured" in md and "predicted, measured cost curve" in md
    assert (out / "batch_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, msg", [
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--batch-size", "2", "--gpu", "tpu9"], "unknown --gpu"),
    (["--batch-size", "2", "--gpu-bandwidth", "-1"], "--gpu-bandwidth must be > 0"),
    (["--batch-size", "2", "--sweep-repeats", "0"], "--sweep-repeats must be >= 1"),
])
def test_bad_sweep_arguments_fail_before_loading(argv, msg, capsys):
    assert cli_main(["eval", "--target", "does/not/exist", *argv]) == 2
    assert msg in capsys.readouterr().err
