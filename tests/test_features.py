"""Offline feature cache: online == offline features and first-step loss, resume, validation errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target
from test_eagle3 import make_head, make_recipe

from spectrain.data.chat import SkipReport
from spectrain.data.dataset import ChatDataset, collate
from spectrain.data.feature_cache import FeatureCache
from spectrain.data.features import bytes_per_token, main, write_feature_cache

torch.set_num_threads(1)
RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "tiny" / "eagle3.yaml")


def make_rows(n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(6, 20, (1,), generator=g))
        ids = torch.randint(3, 128, (length,), generator=g).tolist()
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        rows.append((f"row{i}", ids, mask))
    return ChatDataset.from_rows(rows, SkipReport())


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama")


@pytest.fixture(scope="module")
def head(target):
    return make_head(target, ttt_steps=3)


def online(target, head, rows, idx):
    batch = collate([rows[i] for i in idx], 0)
    out = target(batch["input_ids"], batch["attention_mask"], aux_layers=head.aux_layers,
                 want_last_hidden=True, want_logits=False)
    return batch, {"aux": torch.cat(out.aux_hidden, -1), "last_hidden": out.last_hidden}


# fp32 is exact up to batch-composition noise: the cache was computed with other rows padded alongside
@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-5), ("bf16", 1e-2), ("fp8", 1e-1)])
def test_offline_equals_online(target, head, tmp_path, dtype, tol):
    rows = make_rows()
    # tiny shards (~3 rows each) so batches span several shards
    write_feature_cache(target, {"train": rows}, tmp_path, head.aux_layers, dtype, max_length=512,
                        shard_mb=40 * bytes_per_token(32, 3, dtype) / 2**20, verbose=False)
    assert len(json.loads((tmp_path / "manifest.json").read_text())["splits"]["train"]["shards"]) > 2
    cache = FeatureCache(tmp_path, target, make_recipe(), pad_id=0)
    cache.bind(head.feature_spec())
    idx = [7, 0, 3, 9]
    b_on, f_on = online(target, head, rows, idx)
    b_off, f_off = cache.get(idx)
    for k in b_on:
        assert torch.equal(b_on[k], b_off[k]), k
    valid = b_on["attention_mask"].bool()
    for k in ("aux", "last_hidden"):
        a, b = f_on[k][valid], f_off[k][valid]
        assert ((a - b).abs().max() / a.abs().max()) < tol, k
    torch.manual_seed(0)
    loss_on, m_on = head.train_loss(b_on, f_on, target)
    loss_off, m_off = head.train_loss(b_off, f_off, target)
    rel = {"fp32": 1e-5, "bf16": 2e-2, "fp8": 5e-2}[dtype]
    print(f"{dtype}: first-step loss online {loss_on.item():.6f} offline {loss_off.item():.6f}")
    assert loss_off.item() == pytest.approx(loss_on.item(), rel=rel)
    assert cache.token_frequencies().sum() == rows.loss_mask.sum()


def test_resume_skips_finished_shards_and_rewrites_damaged(target, head, tmp_path):
    rows = make_rows()
    kw = dict(max_length=512, shard_mb=40 * bytes_per_token(32, 3, "bf16") / 2**20, verbose=False)
    m, stats = write_feature_cache(target, {"train": rows}, tmp_path, head.aux_layers, **kw)
    n = len(m["splits"]["train"]["shards"])
    assert stats == {"written": n, "skipped": 0}
    shard = tmp_path / m["splits"]["train"]["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # flip a feature byte: same size, different checksum
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{shard.name} is corrupt"):
        FeatureCache(tmp_path, target, verify="full")
    _, stats = write_feature_cache(target, {"train": rows}, tmp_path, head.aux_layers, **kw)
    assert stats == {"written": 1, "skipped": n - 1}
    shard.write_bytes(shard.read_bytes()[:-100])
    cache = FeatureCache(tmp_path, target)  # lazy: the damage shows up when the shard is first used
    with pytest.raises(ValueError, match=f"{shard.name} is truncated"):
        cache.get(list(range(len(cache))))
    with pytest.raises(ValueError, match="other settings"):
        write_feature_cache(target, {"train": rows}, tmp_path, head.aux_layers, "fp32", **kw)
    with pytest.raises(ValueError, match="data changed"):
        write_feature_cache(target, {"train": make_rows(seed=1)}, tmp_path, head.aux_layers, **kw)


def test_cache_for_another_target_or_layers_is_refused(target, head, tmp_path):
    write_feature_cache(target, {"train": make_rows(4)}, tmp_path, head.aux_layers, max_length=512, verbose=False)
    with pytest.raises(ValueError, match="was written for target"):
        FeatureCache(tmp_path, make_tiny_target("llama", seed=1))
    with pytest.raises(ValueError, match="aux layers"):
        FeatureCache(tmp_path, target, make_recipe(aux_layers=[1, 3, 5]))
    with pytest.raises(ValueError, match="aux layers"):
        FeatureCache(tmp_path, target).bind({"aux_layers": [1, 3, 5]})
    with pytest.raises(ValueError, match="heldout"):
        FeatureCache(tmp_path, target, split="heldout")
    with pytest.raises(FileNotFoundError, match="prepare-features"):
        FeatureCache(tmp_path / "nope", target)


def test_main_writes_both_splits(target, tmp_path, monkeypatch, capsys):
    import spectrain.data.features

    monkeypatch.setattr(spectrain.data.features, "load_target", lambda *a, **k: target)
    monkeypatch.setattr(spectrain.data.features, "build_dataset",
                        lambda cfg, tok, split, **k: make_rows(6 if split == "train" else 3, seed=int(split == "heldout")))
    out = tmp_path / "cache"
    assert main(RECIPE, [f"training.feature_cache={out}", "features.dtype=fp8",
                                             "drafter.eagle3.aux_layers=1,4,6"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["aux_layers"] == [1, 4, 6] and m["dtype"] == "fp8" and set(m["splits"]) == {"train", "heldout"}
    assert "bytes/token" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown key 'bogus' in section 'features'"):
        main(RECIPE, ["features.bogus=1"])
    with pytest.raises(ValueError, match="features.dtype: 'fp4' is not one of bf16, fp32, fp8"):
        main(RECIPE, ["features.dtype=fp4"])


def test_bytes_per_token_documented_numbers():
    assert bytes_per_token(4096, 3, "bf16") == 8 * 4096 + 5
    assert bytes_per_token(4096, 3, "fp32") == 16 * 4096 + 5
    assert bytes_per_token(4096, 3, "fp8") == 5 * 4096 + 9


def test_cache_serves_the_recipes_rows_or_their_prefix_and_refuses_other_data(target, head, tmp_path):
    """A recipe's data must be what the cache was written from (all its rows, or the first N: data.max_rows
    takes a smaller sample of one cache); other data is refused instead of training silently on the cache."""
    from spectrain.data.dataset import token_frequencies

    rows = make_rows(10)
    write_feature_cache(target, {"train": rows}, tmp_path, head.aux_layers, "bf16", max_length=512,
                        shard_mb=40 * bytes_per_token(32, 3, "bf16") / 2**20, verbose=False)  # shards of ~3 rows
    full = FeatureCache(tmp_path, target, pad_id=0)
    full.match(rows)
    assert len(full) == 10
    prefix = make_rows(10)  # the same rows, rebuilt; keep the first 5 (crosses a shard boundary)
    part = ChatDataset.from_rows([(f"row{i}", prefix[i]["input_ids"].tolist(), prefix[i]["loss_mask"].tolist())
                                  for i in range(5)], SkipReport())
    cache = FeatureCache(tmp_path, target, pad_id=0)
    cache.match(part)
    assert len(cache) == 5 and cache.lengths == full.lengths[:5]
    assert torch.equal(cache.token_frequencies(), token_frequencies(part, cache.manifest["vocab_size"]))
    with pytest.raises(IndexError):
        cache.row(5)
    for other in (make_rows(10, seed=1), make_rows(3, seed=1), make_rows(11)):
        with pytest.raises(ValueError, match="not what feature cache .* holds .*prepare-features"):
            FeatureCache(tmp_path, target, pad_id=0).match(other)


def test_a_finished_cache_grows_with_appended_rows_and_keeps_its_shards(target, head, tmp_path):
    """More data appended to the recipe's files: only the new rows are computed, the old shards are kept as they
    are, and the grown cache serves the same features as one written in one go; other changes are refused."""
    kw = dict(max_length=512, shard_mb=40 * bytes_per_token(32, 3, "fp32") / 2**20, verbose=False)
    small, grown = make_rows(10), make_rows(16)  # the same generator: grown's first 10 rows are small's
    m, stats = write_feature_cache(target, {"train": small}, tmp_path, head.aux_layers, "fp32", **kw)
    old = m["splits"]["train"]["shards"]
    assert m["target_dtype"] == "float32" and stats["skipped"] == 0
    m, stats = write_feature_cache(target, {"train": grown}, tmp_path, head.aux_layers, "fp32", **kw)
    split = m["splits"]["train"]
    assert stats["skipped"] == len(old) and stats["written"] >= 1
    assert split["shards"][:len(old)] == old and split["segments"] == [10, 6] and split["rows"] == 16
    assert split["shards"][len(old)]["row_start"] == 10  # the new segment starts its own shard
    _, stats = write_feature_cache(target, {"train": grown}, tmp_path, head.aux_layers, "fp32", **kw)
    assert stats["written"] == 0  # a rerun (or a resumed growth) keeps the segments' bounds
    one_go = tmp_path / "one_go"
    write_feature_cache(target, {"train": grown}, one_go, head.aux_layers, "fp32", **kw)
    a, b = FeatureCache(tmp_path, target, pad_id=0), FeatureCache(one_go, target, pad_id=0)
    a.match(grown)
    FeatureCache(tmp_path, target, pad_id=0).match(small)  # the old prefix still trains from the grown cache
    for i in (0, 9, 10, 15):
        for k, v in a.row(i).items():
            assert torch.allclose(v, b.row(i)[k], atol=1e-5), (i, k)
    with pytest.raises(ValueError, match="grows only when the new rows follow its 16 rows unchanged"):
        write_feature_cache(target, {"train": make_rows(20, seed=1)}, tmp_path, head.aux_layers, "fp32", **kw)
    bf16 = make_tiny_target("llama")
    bf16.model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="target_dtype"):  # features of two numerics never mix in one cache
        write_feature_cache(bf16, {"train": make_rows(20)}, tmp_path, head.aux_layers, "fp32", **kw)
    legacy = json.loads((one_go / "manifest.json").read_text())
    del legacy["target_dtype"]  # as written before the field existed
    (one_go / "manifest.json").write_text(json.dumps(legacy))
    m, _ = write_feature_cache(bf16, {"train": make_rows(20)}, one_go, head.aux_layers, "fp32", **kw)
    assert "target_dtype" not in m  # grown by a bf16 target: the older rows' dtype stays unknown, not mislabelled
