"""Plan before paying: `spectrain check RECIPE --plan NxGPU` on a recipe with offline features whose cache does
not exist yet (a fresh machine right after fetching the target) prints the plan, including the feature cache it
will need, and names the next stage instead of failing; a plain `check` still refuses to call it ready."""

from __future__ import annotations

import json

from test_evaluate import write_tiny_chat_world

from spectrain.data import features
from spectrain.train import check


def test_plan_prints_the_cache_it_will_need_and_the_next_stage(tmp_path, capsys):
    d = write_tiny_chat_world(tmp_path)
    recipe = tmp_path / "offline.yaml"
    recipe.write_text(
        f"target:\n  name_or_path: {d / 'target'}\ndata:\n  train_files: [{d / 'chat.jsonl'}]\n  heldout_fraction: 0.25\n"
        "drafter:\n  kind: eagle3\n  eagle3:\n    draft_vocab_size: 32\n"
        f"training:\n  global_batch_size: 32\n  micro_batch_size: 4\n  max_steps: 2\n  features: offline\n"
        f"  feature_cache: {tmp_path / 'features'}\noutput_dir: {tmp_path / 'run'}\n")
    assert check.main(str(recipe), [], plan="8xH100") == 0
    out = capsys.readouterr().out
    assert "feature cache (used: training.features=offline): ~" in out and "plan for 8xH100" in out
    assert f"NEXT: the feature cache {tmp_path / 'features'} does not exist yet" in out
    assert f"`spectrain prepare-features {recipe}`" in out
    assert not (tmp_path / "features").exists()  # planning wrote nothing

    assert check.main(str(recipe), []) == 2  # without --plan: not ready to train, and it says what to run
    assert "write it with `spectrain prepare-features RECIPE`" in capsys.readouterr().err

    assert features.main(str(recipe), []) == 0  # the cache written: check says what it holds
    capsys.readouterr()
    assert check.main(str(recipe), []) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("OK feature cache"))
    assert "train " in line and "heldout " in line and "bf16 features of a float32 target" in line, line
    manifest = tmp_path / "features" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["splits"]["train"]["complete"] = False  # as an interrupted prepare-features leaves it
    manifest.write_text(json.dumps(m))
    assert check.main(str(recipe), []) == 2
    assert "unfinished 'train' split" in capsys.readouterr().err
