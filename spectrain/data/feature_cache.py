"""Reading the offline target-feature cache that ``spectrain prepare-features`` writes (spectrain.data.features):
the same batches the online source serves, checked against the manifest, the target and the recipe's data."""

from __future__ import annotations

import bisect
import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from spectrain.data.dataset import collate
from spectrain.data.features import FORMAT_VERSION, _pad_id, aux_layers_for, data_hash
from spectrain.io.integrity import sha256
from spectrain.registry import FeatureSpec
from spectrain.targets.fingerprint import same_target, target_fingerprint


class FeatureCache:
    """Reads a cache written by ``write_feature_cache`` and serves exactly what the online source serves:
    ``get(indices) -> (batch, feats)`` with the same right-padded batch dicts (data.collate) and feats
    {"aux", "last_hidden"[, "final_hidden"]} in the target's dtype. Same row order as the dataset."""

    def __init__(self, path, target, recipe=None, split: str = "train", device=None, pad_id: int | None = None,
                 verify: str = "lazy"):
        self.path, self.target, self.split = Path(path), target, split
        mfile = self.path / "manifest.json"
        if not mfile.is_file():
            raise FileNotFoundError(f"no feature cache at {self.path} (manifest.json missing); write it with "
                                    "`spectrain prepare-features RECIPE`")
        m = self.manifest = json.loads(mfile.read_text())
        if m.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{mfile}: format version {m.get('format_version')}, this spectrain reads "
                             f"{FORMAT_VERSION}; rebuild the cache")
        fp = target_fingerprint(target)
        if same_target(m["target_fingerprint"], target) is False:
            raise ValueError(f"feature cache {self.path} was written for target {m['target']!r} (fingerprint "
                             f"{m['target_fingerprint']}), not for {target.name_or_path!r} ({fp}): rebuild it "
                             "with `spectrain prepare-features` for this target")
        if recipe is not None:
            want = aux_layers_for(recipe, target)
            if want and want != m["aux_layers"]:
                raise ValueError(f"feature cache {self.path} holds aux layers {m['aux_layers']}, the recipe's "
                                 f"drafter needs {want}: rebuild the cache or set drafter.eagle3.aux_layers")
            if recipe.data.max_length != m["max_length"]:
                raise ValueError(f"feature cache {self.path} was written with data.max_length={m['max_length']}, "
                                 f"the recipe says {recipe.data.max_length}: rebuild the cache")
        s = m["splits"].get(split)
        if s is None or not s.get("complete"):
            raise ValueError(f"feature cache {self.path} has no complete {split!r} split; run "
                             "`spectrain prepare-features RECIPE` (it resumes) to finish it")
        if verify not in ("lazy", "none", "full"):
            raise ValueError(f"verify={verify!r}: use lazy (checksum each shard on first use), full or none")
        self.shards, self.verify = s["shards"], verify
        self.starts = [sh["row_start"] for sh in self.shards]
        self.lengths = [n for sh in self.shards for n in sh["lengths"]]
        self.device = device if device is not None else target.device
        self.pad_id = _pad_id(target) if pad_id is None else pad_id
        self.spec = FeatureSpec()
        self._open: dict[int, tuple] = {}
        if verify == "full":
            for j in range(len(self.shards)):
                self._handle(j)

    def __len__(self) -> int:
        return len(self.lengths)

    def bind(self, spec: FeatureSpec | dict) -> None:
        """Check that the cache holds what the drafter asks for (``feature_spec()``)."""
        spec = FeatureSpec.of(spec)
        want = list(spec.aux_layers)
        if want and want != self.manifest["aux_layers"]:
            raise ValueError(f"the drafter needs aux layers {want}, feature cache {self.path} holds "
                             f"{self.manifest['aux_layers']}: rebuild the cache for this drafter")
        self.spec = spec

    def _handle(self, j: int):
        if j in self._open:
            return self._open[j]
        sh = self.shards[j]
        p = self.path / sh["file"]
        if not p.is_file():
            raise FileNotFoundError(f"feature shard {p} is missing; rerun `spectrain prepare-features` to rewrite it")
        if p.stat().st_size != sh["bytes"]:
            raise ValueError(f"feature shard {p} is truncated or modified ({p.stat().st_size} bytes, manifest "
                             f"says {sh['bytes']}); rerun `spectrain prepare-features` to rewrite it")
        if self.verify != "none" and sha256(p) != sh["sha256"]:
            raise ValueError(f"feature shard {p} is corrupt (sha256 differs from the manifest); rerun "
                             "`spectrain prepare-features` to rewrite it")
        try:
            f = safe_open(str(p), framework="pt")
            offsets = f.get_tensor("offsets")
        except Exception as e:  # safetensors raises its own error type on a damaged header
            raise ValueError(f"feature shard {p} cannot be read ({e}); rerun `spectrain prepare-features`") from e
        self._open[j] = (f, offsets)
        return self._open[j]

    def row(self, i: int) -> dict[str, torch.Tensor]:
        """One unpadded row: input_ids, loss_mask (long), last_hidden [n, H], aux [n, A] (target dtype)."""
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for the {self.split} split ({len(self)} rows)")
        j = bisect.bisect_right(self.starts, i) - 1
        f, offsets = self._handle(j)
        a, b = int(offsets[i - self.starts[j]]), int(offsets[i - self.starts[j] + 1])
        dt = self.target.dtype
        r = {"input_ids": f.get_slice("input_ids")[a:b].long(), "loss_mask": f.get_slice("loss_mask")[a:b].long(),
             "last_hidden": f.get_slice("last_hidden")[a:b].to(dt)}
        if self.manifest["aux_layers"]:
            aux = f.get_slice("aux")[a:b]
            if self.manifest["dtype"] == "fp8":
                aux = aux.float() * f.get_slice("aux_scale")[a:b][:, None]
            r["aux"] = aux.to(dt)
        return r

    def token_rows(self, indices: list[int]) -> list[dict]:
        """input_ids and loss_mask of rows, without their features (on-policy rollouts take the prompts)."""
        return [{k: v for k, v in self.row(int(i)).items() if k in ("input_ids", "loss_mask")} for i in indices]

    def get(self, indices: list[int]) -> tuple[dict, dict]:
        rows = [self.row(int(i)) for i in indices]
        batch = {k: v.to(self.device) for k, v in collate(rows, self.pad_id).items()}
        t = batch["input_ids"].shape[1]
        feats = {}
        for key in ("aux", "last_hidden"):
            if key not in rows[0]:
                continue
            x = rows[0][key].new_zeros(len(rows), t, rows[0][key].shape[-1])
            for r, row in enumerate(rows):
                x[r, : row[key].shape[0]] = row[key]
            feats[key] = x.to(self.device)
        if self.spec.final_hidden:
            with torch.no_grad():
                feats["final_hidden"] = self.target.norm(feats["last_hidden"])
        return batch, feats

    def _token_prefix(self, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shard j's input_ids, loss_mask and offsets, cut to the rows this cache serves (see ``match``)."""
        f, offsets = self._handle(j)
        n = max(0, min(len(self) - self.starts[j], len(offsets) - 1))
        end = int(offsets[n])
        return f.get_slice("input_ids")[:end].long(), f.get_slice("loss_mask")[:end].bool(), offsets[: n + 1]

    def match(self, rows) -> None:
        """Serve only ``rows`` (the recipe's tokenised split), which must be the cache's rows or their first
        len(rows): a recipe whose data is not what the cache was written from fails here instead of training
        silently on other data. A prefix is how ``data.max_rows`` takes a smaller sample of one cache."""
        n, have = len(rows), len(self.lengths)
        want = data_hash(rows)
        if n == have and want == self.manifest["splits"][self.split]["data_hash"]:
            return
        if n < have:
            kept, self.lengths = self.lengths, self.lengths[:n]
            if want == self._prefix_hash():
                return
            self.lengths = kept
        raise ValueError(f"the recipe's {self.split} data ({n} rows from data.train_files, max_rows, max_length) is "
                         f"not what feature cache {self.path} holds ({have} rows, or their first {n}): write a cache "
                         "for this data with `spectrain prepare-features RECIPE` into another "
                         "training.feature_cache, or train with the data the cache was written from")

    def _prefix_hash(self) -> str:
        h = hashlib.sha256()
        for j in range(len(self.shards)):
            if self.starts[j] >= len(self):
                break
            ids, mask, offsets = self._token_prefix(j)
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
                h.update(ids[a:b].numpy().tobytes())
                h.update(mask[a:b].to(torch.uint8).numpy().tobytes() + b"|")
        return h.hexdigest()[:32]

    def token_frequencies(self) -> torch.Tensor:
        """Counts over the target vocab of tokens under the loss mask (for the EAGLE-3 draft vocab)."""
        counts = torch.zeros(self.manifest["vocab_size"], dtype=torch.long)
        for j in range(len(self.shards)):
            if self.starts[j] >= len(self):
                break
            ids, mask, _ = self._token_prefix(j)
            counts += torch.bincount(ids[mask], minlength=counts.numel())
        return counts
