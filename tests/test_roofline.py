"""The roofline prediction (spectrain/eval/roofline.py) and the crossover computation."""

from __future__ import annotations

import pytest

from spectrain.drafters.eagle3.cost import head_cost as eagle3_cost
from spectrain.eval.roofline import (
    GPUS,
    Accelerator,
    ModelCost,
    Speculation,
    accelerator,
    crossover,
    curve,
    expected_tau,
    measure_cpu_peaks,
    predicted_speedup,
    target_cost,
)

LLAMA_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_hidden_layers=32,
                intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def test_llama_8b_costs_from_config():
    t = target_cost(LLAMA_8B)
    # 8.03B parameters in all; the input embedding table (128256 x 4096) is looked up, not read whole
    assert t.params + 128256 * 4096 == pytest.approx(8.03e9, rel=0.01)
    assert t.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072  # 128 KiB per token in bf16
    assert eagle3_cost(LLAMA_8B).params == pytest.approx(0.42e9, rel=0.02)


def test_memory_bound_limit_is_tau_over_one_plus_kc():
    acc = GPUS["H100"]
    t = target_cost(LLAMA_8B)
    free = Speculation(tau=2.7, verify_tokens=6)
    assert predicted_speedup(t, free, acc, 1, 0) == pytest.approx(2.7)  # free drafter, no KV: exactly tau
    head = eagle3_cost(LLAMA_8B)
    spec = Speculation(tau=2.7, verify_tokens=6, draft=head, draft_forwards=5)
    c = head.time(acc, 1, 1, 0) / t.time(acc, 1, 1, 0)
    assert 0.03 < c < 0.1
    assert predicted_speedup(t, spec, acc, 1, 0) == pytest.approx(2.7 / (1 + 5 * c))


def test_speedup_falls_with_batch_size_towards_tau_over_t():
    t = target_cost(LLAMA_8B)
    for verify, tau in ((6, 2.7), (33, 3.5)):  # a chain k=5 and a 32-node tree
        spec = Speculation(tau=tau, verify_tokens=verify, draft=eagle3_cost(LLAMA_8B), draft_forwards=5)
        ups = curve(t, spec, GPUS["H100"], BATCHES, context=0)["predicted_speedup"]
        assert all(a >= b - 1e-12 for a, b in zip(ups, ups[1:])), ups
        big = predicted_speedup(t, spec, GPUS["H100"], 1 << 16, 0)
        assert big < 1 and big == pytest.approx(tau / verify, rel=0.25)
    chain = curve(t, Speculation(2.7, 6, eagle3_cost(LLAMA_8B), 5), GPUS["H100"], BATCHES, 1024)
    tree = curve(t, Speculation(3.5, 33, eagle3_cost(LLAMA_8B), 5, 4), GPUS["H100"], BATCHES, 1024)
    assert tree["crossover"] < chain["crossover"]  # trees stop paying first


def test_crossover_on_a_synthetic_throughput_table():
    assert crossover([1, 2, 4, 8, 16], [1.6, 1.4, 1.1, 0.9, 0.7]) == 4
    assert crossover([1, 4, 16], [0.9, 0.8, 0.5]) is None
    assert crossover([1, 2, 4, 8], [1.2, 0.95, 1.02, 0.8]) == 4  # the largest B that still wins
    assert crossover([1, 2], [None, 1.3]) == 2


def test_expected_tau_and_accelerators():
    assert expected_tau([0.5, 0.5]) == pytest.approx(1.75)
    assert expected_tau([0.8, None, 1.0]) == pytest.approx(1.8)
    assert accelerator("h100").bandwidth == 3.35e12
    custom = accelerator(None, 1e12, 100e12)
    assert (custom.bandwidth, custom.flops) == (1e12, 100e12)
    assert accelerator("A100", flops=200e12).flops == 200e12
    with pytest.raises(ValueError, match="unknown --gpu"):
        accelerator("TPU9")
    with pytest.raises(ValueError, match="--gpu-bandwidth"):
        accelerator(None, 1e12, None)


def test_model_cost_roofline_regimes():
    m = ModelCost(weight_bytes=1e9, params=5e8, kv_bytes_per_token=0)
    acc = Accelerator("x", 1e12, 1e14)
    assert m.time(acc, 1, 1, 0) == pytest.approx(1e-3)  # memory-bound: bytes / bandwidth
    assert m.time(acc, 1000, 1, 0) == pytest.approx(1000 * 1e9 / 1e14)  # compute-bound: FLOPs / peak


def test_cpu_peaks_are_measured():
    cpu = measure_cpu_peaks(mb=16, n=256, repeats=1)
    assert cpu.bandwidth > 1e8 and cpu.flops > 1e8 and "measured" in cpu.name


def test_crossover_command(capsys):
    """`spectrain crossover` (spectrain/eval/crossover.py): the predicted table for a given tau, and a bad target
    refused in one line."""
    from spectrain import cli

    assert cli.main(["crossover", "--tau", "2.11", "--k", "5", "--gpu", "H100"]) == 0
    out = capsys.readouterr().out
    assert "PREDICTED" in out and "| given | 2.11 | 1.65 |" in out and "B = 256" in out
    assert cli.main(["crossover", "--target", "no/such/config.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "spectrain crossover: error: --target 'no/such/config.json'" in err[0]


def test_crossover_from_a_batch_sweep_report(tmp_path, capsys):
    """Every (drafter, config) of a report's batch sweep is one row, tau from its smallest batch size; a training-free
    drafter is charged no drafting cost (so it keeps more of its tau than a head with the same tau)."""
    import json

    from spectrain import cli

    cells = [dict(drafter=d, config="k=5 T=0", tau=tau, k=5, tree=None, batch_size=b)
             for d in ("runs/e3/best", "ngram") for b, tau in ((1, 2.0), (4, 1.5))]
    (tmp_path / "report.json").write_text(json.dumps({"batch_sweep": {"cells": cells}}))
    assert cli.main(["crossover", "--report", str(tmp_path / "report.json")]) == 0
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| runs/") or line.startswith("| ngram")}
    assert set(rows) == {"runs/e3/best k=5 T=0", "ngram k=5 T=0"}
    assert rows["runs/e3/best k=5 T=0"][1] == rows["ngram k=5 T=0"][1] == "2.00"
    assert float(rows["ngram k=5 T=0"][2]) > float(rows["runs/e3/best k=5 T=0"][2])  # B=1: no head to pay for
    (tmp_path / "plain.json").write_text(json.dumps({"records": []}))
    assert cli.main(["crossover", "--report", str(tmp_path / "plain.json")]) == 2
    assert "has no batch_sweep" in capsys.readouterr().err


@pytest.mark.parametrize("argv, msg", [
    (["--tau", "7", "--k", "5"], "tau 7.0 is impossible for k = 5"),
    (["--tau", "0.5"], "tau 0.5 is impossible"),
    (["--tau", "nan"], "tau nan is impossible"),
    (["--tau", "inf"], "tau inf is impossible"),
    (["--k", "0"], "k 0 must be an integer >= 1"),
    (["--draft-vocab", "0"], "--draft-vocab 0: must be >= 1"),
    (["--context", "-1"], "--context -1: must be >= 1"),
    (["--topk", "0"], "--topk 0: must be >= 1"),
    (["--tree-size", "-4"], "--tree-size -4: must be >= 0"),
    (["--tree-size", "3", "--k", "5"], "a tree of depth k has at least k nodes"),
    (["--gpu-bandwidth", "0"], "--gpu-bandwidth must be > 0 and finite, got 0.0"),  # not the H100's own
    (["--gpu-bandwidth", "-3350"], "--gpu-bandwidth must be > 0"),
    (["--gpu-flops", "nan"], "--gpu-flops must be > 0 and finite"),
])
def test_crossover_refuses_impossible_settings_in_one_line(argv, msg, capsys):
    from spectrain import cli

    assert cli.main(["crossover", *argv]) == 2
    out, err = capsys.readouterr()
    assert not out and len(err.strip().splitlines()) == 1 and msg in err, err


def test_crossover_refuses_a_report_whose_tau_is_impossible_for_its_k(tmp_path, capsys):
    import json

    from spectrain import cli

    for cell, msg in ((dict(tau=6.5, k=5), "batch_sweep.cells[1] (ngram k=5 T=0): tau 6.5 is impossible for k = 5"),
                      (dict(tau=0.9, k=5), "tau 0.9 is impossible"), (dict(tau=None, k=5), "tau None is impossible"),
                      (dict(tau=2.0, k=0), "k 0 must be an integer >= 1")):
        cells = [dict(drafter="ngram", config="k=5 T=0", tau=2.0, k=5, tree=None, batch_size=1),
                 dict(drafter="ngram", config="k=5 T=0", tree=None, batch_size=4, **cell)]
        (tmp_path / "report.json").write_text(json.dumps({"batch_sweep": {"cells": cells}}))
        assert cli.main(["crossover", "--report", str(tmp_path / "report.json")]) == 2
        out, err = capsys.readouterr()
        assert not out and len(err.strip().splitlines()) == 1 and msg in err and "re-run spectrain eval" in err, err
    (tmp_path / "report.json").write_text("not json")
    assert cli.main(["crossover", "--report", str(tmp_path / "report.json")]) == 2
    assert "not a spectrain eval report.json" in capsys.readouterr().err


def test_an_accelerator_peak_of_zero_is_refused_not_replaced_by_the_datasheet():
    with pytest.raises(ValueError, match="must be finite and > 0"):
        accelerator("H100", bandwidth=0.0)
    assert accelerator("H100", flops=100e12).bandwidth == GPUS["H100"].bandwidth
