"""Multi-process offline features and ZeRO-3 on CPU (gloo), through the users' launch lines.

- ``torchrun -m spectrain prepare-features`` on 2 ranks writes the same cache as one process
  (every shard byte-identical, one manifest), each rank computing every other shard.
- Training from that cache with 2 DDP processes equals 1 process with gradient accumulation 2.
- DeepSpeed ZeRO-3 (recipes/accelerate/zero3.yaml with CPU settings): the frozen target is
  partitioned (each rank holds part of it) and the trained drafter equals the 1-process run.
- A single process can spread the target with ``target.device_map`` (here: all on the CPU).
- FSDP: the loop shards the frozen target with FSDP2 too (``engine.shard_target_fsdp``). accelerate runs
  FSDP only on GPUs, so here the sharding function runs alone on 2 gloo ranks (this file's worker):
  features, embeddings, teacher logits and the target fingerprint equal an unsharded copy's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_distributed import (
    REPO,
    TOL,
    _run,
    build_tiny_assets,
    check_ok,
    free_port,
    load_drafter_weights,
    max_weight_diff,
    run_group,
    write_recipe,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("distfeat")
    return root, build_tiny_assets(root, 72)


def _spectrain(args: list[str], nproc: int = 1) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "spectrain"] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
         "127.0.0.1", "--master_port", str(free_port()), "-m", "spectrain"]
    return run_group(cmd + args, env, 600)


@pytest.fixture(scope="module")
def caches(assets):
    """The same recipe's cache written by 1 process and by 2 torchrun ranks (small shards: several per rank)."""
    root, paths = assets
    recipe = write_recipe(root, paths, "feat")
    out = {}
    for n in (1, 2):
        out[n] = root / f"cache-{n}"
        check_ok(_spectrain(["prepare-features", str(recipe), f"training.feature_cache={out[n]}",
                             "features.shard_mb=0.1", "features.dtype=fp32"], nproc=n))
    return out


def _shards(cache) -> tuple[dict, dict]:
    m = json.loads((cache / "manifest.json").read_text())
    return {s: [(sh["file"], sh["row_start"], sh["lengths"]) for sh in v["shards"]] for s, v in m["splits"].items()}, m


def assert_same_cache(a, b) -> None:
    """Same shard layout and identical tensors (file bytes may differ: safetensors' metadata order is not fixed)."""
    from safetensors.torch import load_file

    (sa, ma), (sb, mb) = _shards(a), _shards(b)
    assert sa == sb and ma["target_fingerprint"] == mb["target_fingerprint"]
    assert all(m["splits"][s]["complete"] for m in (ma, mb) for s in m["splits"])
    for split in sa:
        for name, _, _ in sa[split]:
            x, y = load_file(str(a / name)), load_file(str(b / name))
            assert sorted(x) == sorted(y) and all(x[k].equal(y[k]) for k in x), name


def test_two_ranks_write_the_same_cache_as_one_process(caches):
    assert len(_shards(caches[1])[0]["train"]) >= 4, "want several shards per rank"
    assert_same_cache(caches[1], caches[2])


def test_ddp_from_the_two_rank_cache_matches_one_process(assets, caches):
    root, paths = assets
    recipe = write_recipe(root, paths, "offline", max_steps=0, epochs=1, features="offline",
                          feature_cache=str(caches[2]))
    ref = _run(assets, recipe, "offline-1", "python", 1)
    ddp = _run(assets, recipe, "offline-2", "accelerate", 2, config=REPO / "recipes/accelerate/cpu_ddp.yaml",
               env={"ACCELERATE_USE_CPU": "1"})
    assert [r["world"] for r in ddp["records"]] == [2, 2]
    diff, key = max_weight_diff(load_drafter_weights(ref["out"]), load_drafter_weights(ddp["out"]))
    assert diff <= TOL, f"{key} differs by {diff:.3g}"


def test_zero3_shards_the_target_and_matches_one_process(assets):
    pytest.importorskip("deepspeed")
    root, paths = assets
    recipe = write_recipe(root, paths, "z3", max_steps=0, epochs=1, checkpoint_every=4, eval_every=4)
    cfg = yaml.safe_load((REPO / "recipes/accelerate/zero3.yaml").read_text())
    cfg.update(num_processes=2, use_cpu=True, mixed_precision="no", gpu_ids=None)
    (root / "zero3_cpu.yaml").write_text(yaml.safe_dump({k: v for k, v in cfg.items() if v is not None}))
    ref = _run(assets, recipe, "z3-ref", "python", 1)
    z3 = _run(assets, recipe, "z3", "accelerate", 2, config=root / "zero3_cpu.yaml")
    recs = z3["records"]
    assert all(r["type"] == "DistributedType.DEEPSPEED" and r["dist_world_size"] == 2 for r in recs), recs
    # each rank holds about half of the frozen target (ZeRO-3 partitions it; the loop makes it an engine)
    assert all(r["target_params_here"] <= 0.6 * r["target_params"] for r in recs), recs
    assert ref["records"][0]["target_params_here"] == ref["records"][0]["target_params"]
    diff, key = max_weight_diff(load_drafter_weights(ref["out"]), load_drafter_weights(z3["out"]))
    assert diff <= TOL, f"{key} differs by {diff:.3g}"
    for name in ("init", "best"):  # gathered before saving: whole, loadable weights
        from safetensors.torch import load_file

        a, b = (load_file(str(r["out"] / name / "model.safetensors")) for r in (ref, z3))
        assert max_weight_diff(a, b)[0] <= TOL
    evals = [[json.loads(x) for x in (r["out"] / "metrics.jsonl").read_text().splitlines()] for r in (ref, z3)]
    taus = [[e["eval/sim_tau_proxy"] for e in ev if e.get("split") == "heldout"] for ev in evals]
    assert taus[0] == pytest.approx(taus[1], abs=1e-6) and taus[0]


def test_device_map_on_one_process_gives_the_same_cache(assets, caches):
    root, paths = assets
    recipe = write_recipe(root, paths, "feat")
    out = root / "cache-devmap"
    proc = _spectrain(["prepare-features", str(recipe), f"training.feature_cache={out}", "features.shard_mb=0.1",
                       "features.dtype=fp32", "target.device_map=auto"])
    check_ok(proc)
    assert_same_cache(out, caches[1])
    bad = _spectrain(["prepare-features", str(recipe), f"training.feature_cache={root / 'x'}",
                      "target.device_map=auto"], nproc=2)
    assert bad.returncode != 0 and "device_map" in bad.stderr


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp2_sharded_target_gives_the_same_features(tmp_path, tied):
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}:{REPO / 'tests'}")
    proc = run_group([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                      "127.0.0.1", "--master_port", str(free_port()), __file__, str(tmp_path), str(int(tied))], env, 300)
    check_ok(proc)
    recs = [json.loads((tmp_path / f"fsdp{r}.json").read_text()) for r in (0, 1)]
    for r in recs:
        assert r["max_diff"] == 0.0 and r["fingerprint_equal"] and r["head_sharded"] and r["same_keys"], r
        assert r["local_params"] * 2 <= r["full_params"] + 64, r  # about half of the target on each rank


def _fsdp_worker(out: str, tied: bool) -> int:
    """torchrun worker: shard a tiny target with the loop's function and compare with an unsharded copy."""
    import torch
    import torch.distributed as dist
    from conftest import make_tiny_target

    from spectrain.targets.fingerprint import target_fingerprint
    from spectrain.train.distributed import shard_target_fsdp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ref, t = make_tiny_target("llama", tied=tied), make_tiny_target("llama", tied=tied)
    shard_target_fsdp(t, "cpu")
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    kw = dict(aux_layers=[1, 4, 6], want_last_hidden=True, want_final_hidden=True)
    a, b = ref.forward(ids, torch.ones_like(ids), **kw), t.forward(ids, torch.ones_like(ids), **kw)
    pairs = [(a.logits, b.logits), (a.final_hidden, b.final_hidden), *zip(a.aux_hidden, b.aux_hidden),
             (ref.embed(ids), t.embed(ids)),
             (ref.logits_from_last_hidden(a.last_hidden), t.logits_from_last_hidden(b.last_hidden))]
    # the drafter under FSDP2: the loop saves it from full_state_dict (every rank gathers)
    from test_eagle3 import make_head

    from spectrain.train.distributed import full_state_dict, is_sharded

    head = make_head(ref)
    want = {k: v.clone() for k, v in head.state_dict().items()}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(head, mesh=init_device_mesh("cpu", (2,)))
    got = full_state_dict(head)
    pairs += [(want[k].float(), got[k].float()) for k in want]
    rec = {"max_diff": max(float((x - y).abs().max()) for x, y in pairs), "head_sharded": is_sharded(head),
           "same_keys": sorted(want) == sorted(got),
           "fingerprint_equal": target_fingerprint(ref) == target_fingerprint(t),
           "local_params": sum(p.to_local().numel() for p in t.model.parameters()),
           "full_params": sum(p.numel() for p in ref.model.parameters()), "sizes": [t.hidden_size, t.vocab_size]}
    (Path(out) / f"fsdp{dist.get_rank()}.json").write_text(json.dumps(rec))
    # both ranks must be done with every collective before the group goes: a rank that tore gloo down
    # while its peer still had FSDP2 traffic in flight aborted once under load ("terminate called ...")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(_fsdp_worker(sys.argv[1], sys.argv[2] == "1"))
