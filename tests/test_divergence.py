"""Greedy losslessness judged per prompt (identical / near-tie / FAIL), fp32 logits from a bf16 target, and the
`dtype: auto` decision on a CPU (flags and timings injected: no test times anything for real)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model
from test_evaluate import one_thread, write_tiny_chat_world  # noqa: F401  (one_thread: autouse, 1 torch thread)

from spectrain.cli import main as cli_main
from spectrain.decoding import loop
from spectrain.decoding.interface import Drafter, Proposal
from spectrain.eval.divergence import judge_divergence, logit_scale, summarize
from spectrain.targets import auto_dtype
from spectrain.targets.model import FrozenTarget, load_target


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A saved tiny llama target with a tokenizer and chat template, and chat.jsonl prompts."""
    return write_tiny_chat_world(tmp_path_factory.mktemp("div"))


# ---- the pure judgement ---------------------------------------------------------------------------------------


def test_identical():
    rec = judge_divergence([1, 2, 3], [1, 2, 3], None, None)
    assert rec == {"identical": True, "first_divergence": None, "margin": None, "scale": None, "tolerance": None,
                   "near_tie": None, "verdict": "identical"}


def test_near_tie_within_four_ulps():
    scale = logit_scale(25.0, torch.bfloat16)  # bf16 eps 2**-7 at a logit of 25
    assert scale == pytest.approx(25 * 2 ** -7)
    rec = judge_divergence([1, 2, 3, 4], [1, 2, 9, 4], margin_at=0.125, scale=scale)
    assert rec["verdict"] == "near-tie" and rec["near_tie"] is True and rec["first_divergence"] == 2
    assert rec["tolerance"] == pytest.approx(4 * scale) and rec["margin"] == 0.125
    assert judge_divergence([1], [2], 0.0, scale)["verdict"] == "near-tie"  # an exact tie


def test_fail_far_above_the_scale():
    scale = logit_scale(25.0, torch.float32)
    rec = judge_divergence([5, 6], [5, 7], margin_at=0.125, scale=scale)  # a bf16 tie is not an fp32 one
    assert rec["verdict"] == "FAIL" and rec["near_tie"] is False and rec["first_divergence"] == 1
    assert judge_divergence([5, 6], [5, 7], 0.125, scale, ulps=64)["verdict"] == "FAIL"
    assert judge_divergence([5, 6], [5, 7], None, None)["verdict"] == "FAIL"  # no margin: cannot be excused
    assert judge_divergence([5, 6], [5], 0.0, 1.0)["first_divergence"] == 1  # shorter output parts where it ends


def test_summarize_counts_verdicts():
    recs = [judge_divergence([1], [1], None, None), judge_divergence([1], [2], 0.0, 1.0),
            judge_divergence([1], [2], 9.0, 1.0)]
    assert summarize(recs) == {"identical": 1, "near_tie": 1, "fail": 1, "n": 3}
    json.dumps(recs)  # plain values only


# ---- dtype: auto ------------------------------------------------------------------------------------------------

AMD_AVX2 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n"
INTEL_BF16 = "model name\t: Xeon\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"


def _seconds(f32_t, b16_t):
    return {"float32": {1: 0.040, 6: f32_t}, "bfloat16": {1: 0.047, 6: b16_t}}


def test_native_bf16_flags():
    assert auto_dtype.native_bf16_flags(AMD_AVX2) == []
    assert auto_dtype.native_bf16_flags(INTEL_BF16) == ["avx512_bf16", "amx_bf16"]
    assert auto_dtype.native_bf16_flags(ARM_BF16) == ["bf16"]
    assert auto_dtype.native_bf16_flags("") == []


def test_decide_both_branches():
    no = auto_dtype.decide([], None, 6)
    assert no.dtype == "float32" and "lacks native bf16" in no.reason
    fast = auto_dtype.decide(["avx512_bf16"], _seconds(0.080, 0.050), 6)
    assert fast.dtype == "bfloat16" and fast.reason.startswith("bf16: avx512_bf16 present") and "t=6" in fast.reason
    slow = auto_dtype.decide(["avx512_bf16"], _seconds(0.080, 0.078), 6)  # within MIN_GAIN: not worth the rounding
    assert slow.dtype == "float32" and "not 10% cheaper" in slow.reason


def test_auto_measures_once_per_target_and_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECTRAIN_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(auto_dtype, "measure_dtypes", lambda m, w, t: calls.append(t) or _seconds(0.08, 0.05))
    model = make_tiny_model()
    first = auto_dtype.auto_cpu_dtype(model, FrozenTarget, "t", 6, cpuinfo=INTEL_BF16)
    again = auto_dtype.auto_cpu_dtype(model, FrozenTarget, "t", 6, cpuinfo=INTEL_BF16)
    assert first.dtype == again.dtype == "bfloat16" and calls == [(1, 6)]  # the second came from the cache
    auto_dtype.auto_cpu_dtype(model, FrozenTarget, "other-target", 6, cpuinfo=INTEL_BF16)
    assert len(calls) == 2
    assert auto_dtype.auto_cpu_dtype(model, FrozenTarget, "t", 6, cpuinfo=AMD_AVX2).dtype == "float32"
    assert len(calls) == 2  # no native bf16: nothing measured


def test_measure_dtypes_times_both_and_leaves_the_fp32_model_alone():
    model = make_tiny_model(max_positions=64)  # shorter than the 200 cached tokens: the context shrinks to fit
    seconds = auto_dtype.measure_dtypes(model, FrozenTarget, (1, 3))  # what is timed, not how fast: no decision
    assert {k: sorted(v) for k, v in seconds.items()} == {"float32": [1, 3], "bfloat16": [1, 3]}
    assert all(s > 0 for v in seconds.values() for s in v.values())
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_load_target_auto_switches_to_bf16_and_reports_why(monkeypatch, world):
    choice = auto_dtype.decide(["avx512_bf16"], _seconds(0.08, 0.05), 6)
    monkeypatch.setattr("spectrain.targets.model.auto_cpu_dtype", lambda *a, **k: choice)
    t = load_target(str(world / "target"), device="cpu")
    assert t.dtype == torch.bfloat16 and t.dtype_choice is choice and t.upcasts_logits()
    t = load_target(str(world / "target"), device="cpu", dtype="fp32")
    assert t.dtype == torch.float32 and t.dtype_choice.reason == "float32: asked for (dtype=fp32)"


def test_auto_without_native_bf16_is_fp32_and_times_nothing(monkeypatch, world):
    # conftest shows every test a CPU without native bf16; nothing may be timed for it
    monkeypatch.setattr(auto_dtype, "measure_dtypes", lambda *a: pytest.fail("timed on a CPU without native bf16"))
    t = load_target(str(world / "target"), device="cpu")
    assert t.dtype == torch.float32 and t.dtype_choice.reason.startswith("fp32: CPU lacks native bf16")


def test_bad_dtype_is_one_clear_line(capsys):
    assert cli_main(["eval", "--target", "x", "--dtype", "bf17"]) != 0
    err = capsys.readouterr().err
    assert "--dtype: unknown dtype 'bf17'; use one of auto," in err and "Traceback" not in err


# ---- fp32 logits from a bf16 target -------------------------------------------------------------------------------


def test_bf16_target_logits_come_from_an_fp32_head():
    model = make_tiny_model(hidden=64).to(torch.bfloat16)
    t16 = FrozenTarget(model, logits="fp32")  # the screened default: tests/test_screened_logits.py
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    out = t16.forward(ids, want_last_hidden=True)
    assert out.logits.dtype == torch.float32 and out.last_hidden.dtype == torch.bfloat16
    norm = type(t16.norm)(64, eps=t16.norm.variance_epsilon).float()
    norm.load_state_dict({k: v.float() for k, v in t16.norm.state_dict().items()})
    want = out.last_hidden.float()
    want = norm(want) @ t16.lm_head.weight.float().T
    assert torch.allclose(out.logits, want, atol=1e-5)
    native = FrozenTarget(model, fp32_logits=False).forward(ids).logits
    assert native.dtype == torch.bfloat16 and not torch.equal(native.float(), out.logits)  # rounded to bf16
    assert not FrozenTarget(make_tiny_model()).upcasts_logits()  # an fp32 target is untouched


# ---- end to end: a broken accept rule FAILS loudly, a correct one is identical -------------------------------------


class NextIdDrafter(Drafter):
    """Always drafts last + 1 (mod V): the target almost never agrees, so a rule that accepts it anyway diverges."""

    name = "next-id"

    def propose(self, ctx):
        return Proposal(tokens=(ctx.tokens[-1:] + torch.arange(1, ctx.k + 1)) % 256)


def _accept_everything(logits, proposal, sampler):
    if proposal is None:  # plain decoding stays correct: only the speculative side is broken
        return [], [int(logits[0].argmax())], []
    n = len(proposal)
    return list(range(n)), proposal.tokens.tolist() + [int(logits[n].argmax())], [True] * n


def _eval(d, out, monkeypatch) -> int:
    monkeypatch.setattr("spectrain.eval.harness._load_drafters", lambda specs, target: {"next-id": NextIdDrafter()})
    return cli_main(["eval", "--target", str(d / "target"), "--prompts", str(d / "chat.jsonl"), "--n", "3",
                     "--max-new-tokens", "8", "--k", "2", "--temperature", "0", "--out", str(out)])



def test_correct_rule_is_identical(world, tmp_path, monkeypatch):
    assert _eval(world, tmp_path / "ok", monkeypatch) == 0
    (rec,) = json.loads((tmp_path / "ok" / "report.json").read_text())["records"]
    assert rec["greedy_check"]["identical"] == 3 and rec["greedy_identical_to_plain"] == "3/3"


def test_broken_accept_rule_fails_loudly(world, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loop, "accept_chain", _accept_everything)
    assert _eval(world, tmp_path / "bad", monkeypatch) == 1
    (rec,) = json.loads((tmp_path / "bad" / "report.json").read_text())["records"]
    checks = rec["greedy_check"]["prompts"]
    assert rec["greedy_check"]["fail"] == 3 and all(c["verdict"] == "FAIL" for c in checks)
    assert all(c["margin"] > c["tolerance"] > 0 for c in checks)  # judged against a real margin, not a missing one
    assert "FAILURE" in capsys.readouterr().err
    md = (tmp_path / "bad" / "report.md").read_text()
    assert "**FAILURE: greedy speculative output parted" in md and "a lossless-decoding bug" in md
