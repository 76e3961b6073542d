"""Drafter families as a contract.

1. A fifth family added from outside the package: this file holds all of it (a bigram head, its decoding
   side, its recipe section and an export format) plus ONE ``registry.register`` line; it goes through
   ``spectrain check`` -> 2 training steps -> ``spectrain eval`` (lossless) -> ``spectrain export`` without a
   change to any spectrain module.
2. Every registered family keeps the record the pipeline relies on (parametrised over the registry).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_evaluate import write_tiny_chat_world
from torch import nn
from transformers import AutoConfig

from spectrain import registry
from spectrain.cli import main as cli_main
from spectrain.decoding.interface import Drafter, Proposal
from spectrain.export import export, validate
from spectrain.export.serving import ServeCommand
from spectrain.io.integrity import seal
from spectrain.recipe.load import load_recipe
from spectrain.train import loop as T
from spectrain.train import plan
from spectrain.train.check import main as check_main


# ---- the whole fake family -----------------------------------------------------------------------------
@dataclass
class BigramConfig:
    rank: int = 8  # the bigram table is embed(x) @ W: [V, rank] x [rank, V]


class BigramHead(nn.Module):
    """Next-token logits from the current token alone, distilled from the target's distribution."""

    def __init__(self, vocab: int, rank: int, target: str):
        super().__init__()
        self.a, self.b = nn.Embedding(vocab, rank), nn.Linear(rank, vocab)
        self.config = {"kind": "bigram", "vocab": vocab, "rank": rank, "target": target}

    @classmethod
    def from_recipe(cls, recipe, target, token_counts):
        return cls(target.vocab_size, recipe.drafter.sections["bigram"].rank, target.name_or_path)

    @classmethod
    def from_pretrained(cls, path: Path):
        cfg = json.loads((path / "drafter_config.json").read_text())
        head = cls(cfg["vocab"], cfg["rank"], cfg["target"])
        head.load_state_dict(load_file(str(path / "model.safetensors")))
        return head

    def feature_spec(self) -> dict:
        return {"want_last_hidden": True}

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(ids))

    def train_loss(self, batch, feats, target):
        ids, am, lm = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
        valid = torch.zeros_like(am)
        valid[:, :-1] = lm[:, 1:] & am[:, 1:] & am[:, :-1]
        student = self.logits(ids)[valid].float()
        with torch.no_grad():
            teacher = target.logits_from_last_hidden(feats["last_hidden"][valid]).float()
        loss = F.kl_div(student.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="batchmean")
        acc = float((student.argmax(-1) == teacher.argmax(-1)).float().mean())
        return loss, {"acc_0": acc, "tokens": float(valid.sum()), "loss": float(loss.detach())}

    def save_pretrained(self, path, state_dict: dict | None = None) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "drafter_config.json").write_text(json.dumps(self.config))
        save_file({k: v.contiguous() for k, v in (state_dict or self.state_dict()).items()},
                  str(path / "model.safetensors"))


class BigramDrafter(Drafter):
    name = "bigram"

    def __init__(self, head: BigramHead):
        self.head = head.eval()

    @torch.no_grad()
    def propose(self, ctx) -> Proposal:
        tok, toks, probs = ctx.tokens[-1:], [], []
        for _ in range(ctx.k):
            q = ctx.sampler.probs(self.head.logits(tok)[-1].float())
            tok = ctx.sampler.sample(q).reshape(1)
            toks.append(tok[0])
            probs.append(q)
        return Proposal(tokens=torch.stack(toks), probs=None if ctx.sampler.greedy else torch.stack(probs))


def load_bigram(path, target) -> BigramDrafter:
    return BigramDrafter(BigramHead.from_pretrained(Path(path)))


def export_bigram(src, out, target_name=None, *, overwrite=False, readme="") -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = BigramHead.from_pretrained(Path(src))
    with torch.no_grad():
        save_file({"bigram": (table.a.weight @ table.b.weight.T + table.b.bias).contiguous()},
                  str(out / "bigram.safetensors"))
    seal(out)  # like every built-in exporter: the export carries SHA256SUMS
    return {"out": str(out), "files": ["bigram.safetensors"]}


def validate_bigram(out) -> list[str]:
    f = Path(out) / "bigram.safetensors"
    return [] if f.is_file() and load_file(str(f))["bigram"].dim() == 2 else [f"{f}: missing or not a [V, V] table"]


FAMILY = registry.Family(
    "bigram", "bigram tables",
    train=registry.TrainSide(head=BigramHead, features=registry.FeatureSpec(last_hidden=True), section=BigramConfig),
    decode=registry.DecodeSide(drafter=load_bigram),
    serve=registry.ServeSide(exports={"bigram-table": (export_bigram, validate_bigram)}))


@pytest.fixture
def bigram_family(monkeypatch):
    monkeypatch.setattr(registry, "FAMILIES", dict(registry.FAMILIES))  # the registration ends with the test
    registry.register(FAMILY)  # the one registry line a new family needs
    return FAMILY


def test_a_fifth_family_runs_check_train_eval_export(tmp_path, bigram_family, monkeypatch):
    d = write_tiny_chat_world(tmp_path)
    recipe = tmp_path / "bigram.yaml"
    recipe.write_text(
        f"target:\n  name_or_path: {d / 'target'}\ndata:\n  train_files: [{d / 'chat.jsonl'}]\n  heldout_fraction: 0.25\n"
        "drafter:\n  kind: bigram\n  bigram:\n    rank: 4\n"
        "training:\n  global_batch_size: 4\n  micro_batch_size: 2\n  max_steps: 2\n  warmup_steps: 0\n"
        f"  eval_every: 2\n  checkpoint_every: 2\n  packing: false\noutput_dir: {tmp_path / 'run'}\n")
    assert load_recipe(recipe).drafter.sections["bigram"] == BigramConfig(rank=4)
    with pytest.raises(ValueError, match="unknown key 'width' in section 'drafter.bigram'"):  # strict like the others
        load_recipe(recipe, ["drafter.bigram.width=3"])
    assert check_main(str(recipe), []) == 0
    summary = T.main(str(recipe), [])
    assert summary == 0 and (tmp_path / "run" / "best" / "model.safetensors").is_file()
    out = tmp_path / "eval"
    assert cli_main(["eval", "--recipe", str(recipe), "--drafter", str(tmp_path / "run" / "best"),
                     "--prompts", "heldout", "--n", "2", "--max-new-tokens", "8", "--k", "2", "--out", str(out)]) == 0
    rec = [r for r in json.loads((out / "report.json").read_text())["records"] if r["drafter"] != "plain"]
    assert rec and all(r["greedy_identical_to_plain"] for r in rec if r["config"].endswith("T=0"))
    summary = export(tmp_path / "run", "bigram-table", tmp_path / "exported")
    assert summary["serve"] == [] and validate("bigram-table", tmp_path / "exported") == []


def test_unknown_family_and_format_are_named():
    with pytest.raises(ValueError, match="not a drafter family.*eagle3"):
        registry.family("trigram")
    assert registry.format_family("nope") is None and registry.format_family("hf-draft").kind == "draft"


@pytest.mark.parametrize("kind", sorted(registry.FAMILIES))
def test_every_family_record_resolves(kind):
    fam = registry.FAMILIES[kind]
    head = registry.resolve(fam.train.head)
    for method in ("feature_spec", "train_loss", "save_pretrained"):
        assert callable(getattr(head, method, None)), f"{kind}: {head.__name__}.{method} missing"
    assert callable(registry.resolve(fam.train.build) if fam.train.build else head.from_recipe)
    assert callable(registry.resolve(fam.decode.drafter))
    for fmt, (exporter, validator) in fam.serve.exports.items():
        assert callable(registry.resolve(exporter)) and callable(registry.resolve(validator)), fmt


# ---- the same family with its plan and serving hooks: parity with the built-ins, through the record alone ----
def bigram_cost(recipe, t, student, seq) -> plan.TrainingCost:
    rank = recipe.drafter.sections["bigram"].rank
    p = t.vocab * rank + rank * t.vocab + t.vocab  # a: [V, rank]; b: weight [V, rank] + bias [V]
    return plan.TrainingCost(p, p, 6.0 * p, 4 * 4 * t.vocab, 0.0, 0)


def serve_bigram(engine, target, model_dir, d, head) -> ServeCommand:
    spec = {"method": "bigram", "model": model_dir, "num_speculative_tokens": d.k}
    return ServeCommand(engine, ["vllm", "serve", target, "--speculative-config", json.dumps(spec)])


def bigram_k(head, k):
    return head["rank"] if k is None else k  # an arbitrary default, to see that it is the family's


SERVED = dataclasses.replace(
    FAMILY, train=dataclasses.replace(FAMILY.train, cost=bigram_cost),
    serve=dataclasses.replace(FAMILY.serve, engines={"bigram-table": ("vllm",)}, command=serve_bigram, k=bigram_k))


def test_a_fifth_family_gets_its_plan_and_serve_commands_from_its_record(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(registry, "FAMILIES", dict(registry.FAMILIES))
    registry.register(SERVED)
    d = write_tiny_chat_world(tmp_path)
    recipe = tmp_path / "bigram.yaml"
    recipe.write_text(
        f"target:\n  name_or_path: {d / 'target'}\ndata:\n  train_files: [{d / 'chat.jsonl'}]\n  heldout_fraction: 0.25\n"
        "drafter:\n  kind: bigram\n  bigram:\n    rank: 4\ntraining:\n  global_batch_size: 4\n  micro_batch_size: 4\n"
        f"  max_steps: 2\n  packing: false\noutput_dir: {tmp_path / 'run'}\n")
    vocab = AutoConfig.from_pretrained(str(d / "target")).vocab_size
    p = 2 * 4 * vocab + vocab
    assert check_main(str(recipe), [], plan="1xH100") == 0
    out = capsys.readouterr().out
    assert f"drafter fwd/bwd {6 * p / 1e9:.3g} G ({p / 1e6:.1f} M params, {p / 1e6:.1f} M trained)" in out, out
    monkeypatch.setitem(registry.FAMILIES, "bigram", dataclasses.replace(SERVED, train=FAMILY.train))
    assert check_main(str(recipe), [], plan="1xH100") == 2  # no cost hook: no plan, not another family's formula
    assert "declares no training cost" in capsys.readouterr().err
    monkeypatch.setitem(registry.FAMILIES, "bigram", SERVED)

    ckpt = tmp_path / "ckpt"
    BigramHead(vocab, 4, str(d / "target")).save_pretrained(ckpt)
    seal(ckpt)
    for k, want in ((None, 4), (2, 2)):  # the family's default k (its rank here), then --k
        summary = export(ckpt, "bigram-table", tmp_path / f"exported-{k}", target="TARGET", k=k)
        (cmd,) = summary["serve"]
        assert cmd.engine == "vllm" and cmd.argv[:3] == ["vllm", "serve", "TARGET"]
        assert json.loads(cmd.argv[-1])["num_speculative_tokens"] == want
