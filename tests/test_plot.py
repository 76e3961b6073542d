"""`spectrain plot RUN [--out PNG]` (spectrain/train/plot.py): a run's curves from a hand-written metrics.jsonl in
the records' shape the training loop writes (per-step: step, loss, sim_tau; held-out: step, split, eval/acc_i,
eval/sim_tau_proxy), and one-line errors for what is not a run. Nothing is trained here."""

from __future__ import annotations

import json
import os

from spectrain import cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(run, rows) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def a_run() -> list[dict]:
    rows = [{"step": 0, "event": "start"}]
    rows += [{"step": s, "loss": 5.0 / s, "sim_tau": 1 + 0.01 * s, "acc_0": 0.1} for s in range(1, 40)]
    rows += [{"step": s, "split": "heldout", "eval/acc_0": 0.1 * s, "eval/acc_1": 0.05 * s, "eval/acc_t1_0": 0.2,
              "eval/sim_tau_proxy": 1 + 0.1 * s} for s in (10, 20, 30)]
    return rows + [{"step": 39, "event": "end", "wall_s": 1.0}]


def test_plot_writes_the_png_into_the_run_and_to_out(tmp_path, capsys):
    run = tmp_path / "run"
    write_metrics(run, a_run())
    assert cli.main(["plot", str(run)]) == 0
    assert (run / "train_curve.png").read_bytes()[:8] == PNG_MAGIC
    assert capsys.readouterr().out.strip() == str(run / "train_curve.png")
    out = tmp_path / "elsewhere.png"
    assert cli.main(["plot", str(run), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.png", "run"]  # no temp file left behind


def test_plot_draws_held_out_only_or_training_only_runs(tmp_path):
    write_metrics(tmp_path / "evals", [r for r in a_run() if "split" in r])
    write_metrics(tmp_path / "steps", [r for r in a_run() if "loss" in r][:3])  # shorter than the average window
    for name in ("evals", "steps"):
        assert cli.main(["plot", str(tmp_path / name)]) == 0
        assert (tmp_path / name / "train_curve.png").read_bytes()[:8] == PNG_MAGIC


def test_plot_errors_are_one_line(tmp_path, capsys):
    def err(*argv) -> str:
        assert cli.main(["plot", *map(str, argv)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("spectrain plot: error: "), lines
        return lines[0]

    assert "does not exist" in err(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    assert "has no metrics.jsonl" in err(tmp_path / "empty")
    write_metrics(tmp_path / "started", [{"step": 0, "event": "start"}, {"step": 1, "lr": 1e-3}])
    assert "no training or held-out records" in err(tmp_path / "started")
    write_metrics(tmp_path / "damaged", a_run())
    with open(tmp_path / "damaged" / "metrics.jsonl", "a") as f:
        f.write('{"step": 40, "loss"\n{"step": 41}\n')
    assert "line 45 is not JSON" in err(tmp_path / "damaged")
    write_metrics(tmp_path / "ok", a_run())
    assert "does not exist" in err(tmp_path / "ok", "--out", tmp_path / "no" / "dir" / "x.png")
    assert not (tmp_path / "ok" / "train_curve.png").exists()


def test_a_run_cut_mid_line_still_plots(tmp_path):
    write_metrics(tmp_path, a_run())
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 40, "lo')  # the last line, cut by a stop mid-write
    assert cli.main(["plot", str(tmp_path)]) == 0


def _snapshot(root) -> dict:
    return {str(p.relative_to(root)): (p.readlink() if p.is_symlink() else p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def test_plot_out_never_replaces_a_checkpoint_the_runs_records_or_writes_through_a_link(tmp_path, capsys):
    run = tmp_path / "run"
    write_metrics(run, a_run())
    (run / "run_info.json").write_text("{}")
    (run / "best").mkdir()
    (run / "best" / "drafter_config.json").write_text("{}")
    (run / "best" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "mine.png").write_bytes(b"a user's file")
    (tmp_path / "link.png").symlink_to(tmp_path / "mine.png")
    before = _snapshot(tmp_path)
    for out, why in ((run / "best" / "model.safetensors", "a checkpoint directory"),
                     (run / "best" / "new.png", "a checkpoint directory"),
                     (run / "metrics.jsonl", "is the metrics file"), (run / "run_info.json", "own run_info.json"),
                     (tmp_path / "link.png", "is a symbolic link"), (run, "is a directory")):
        assert cli.main(["plot", str(run), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], (out, err)
    (run / f".train_curve.png.tmp{os.getpid()}.png").symlink_to(tmp_path / "mine.png")  # a link at the temp name
    assert cli.main(["plot", str(run)]) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    (run / f".train_curve.png.tmp{os.getpid()}.png").unlink()
    assert _snapshot(tmp_path) == before  # nothing written, nothing followed
    for _ in range(2):  # a rerun replaces its own PNG
        assert cli.main(["plot", str(run)]) == 0
    assert (run / "train_curve.png").read_bytes()[:8] == PNG_MAGIC


def test_nan_steps_and_null_steps_are_left_out_and_said_or_refused_when_nothing_remains(tmp_path, capsys):
    rows = a_run()
    for r in rows:
        if r.get("step") in (5, 6) and "loss" in r:  # steps skipped for a non-finite loss log NaN
            r.update(loss=float("nan"), sim_tau=float("nan"), skipped=1)
        if r.get("split") and r["step"] == 20:
            r["step"] = None
    write_metrics(tmp_path / "run", rows)
    assert cli.main(["plot", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("note: 7 of 87 points of "), err
    assert "4 with a NaN" in err[0] and "3 with a null or non-numeric step" in err[0]
    assert (tmp_path / "run" / "train_curve.png").read_bytes()[:8] == PNG_MAGIC

    nothing = [{"step": s, "loss": float("nan"), "sim_tau": float("nan")} for s in range(1, 4)]
    write_metrics(tmp_path / "diverged", nothing + [{"step": None, "eval/sim_tau_proxy": 1.5}])
    assert cli.main(["plot", str(tmp_path / "diverged")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing to plot: all 7 points are unusable" in err[0], err
    assert not (tmp_path / "diverged" / "train_curve.png").exists()
