"""The library users already have, in the same eval grid: HF ``generate`` plain, with prompt lookup, and with
assisted generation (a separate draft model), decoded on the same prompts, seeds and temperatures as
spectrain's own loop and timed against the same plain baseline.

    spectrain eval ... --drafter hf:plain --drafter hf:prompt-lookup --drafter hf:assisted=runs/smollm2-draft/best

Acceptance comes from HF's own bookkeeping: after each verification pass ``_assisted_decoding`` calls
``candidate_generator.update_candidate_strategy(input_ids, scores, num_matches)``, where ``scores`` holds
one row per drafted token plus the bonus row. Counting those calls gives the passes, the drafted tokens
and how many of them were accepted, so alpha_i and tau mean what they mean for spectrain's rows. Two
differences are HF's design and are stated in the report's notes: HF's first pass is the prefill and already
verifies a draft (spectrain's prefill drafts nothing), and prompt lookup may propose nothing on a pass
(draft coverage < 1, as for spectrain's n-gram drafter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectrain.decoding.stats import DecodeStats, SpecOutput
from spectrain.decoding.step import resolve_eos

HF_PREFIX = "hf:"
HF_KINDS = ("plain", "prompt-lookup", "assisted=DRAFT_MODEL_DIR")


def is_hf_spec(spec: str) -> bool:
    return spec.lower().startswith(HF_PREFIX)


def parse_hf_spec(spec: str) -> tuple[str, str]:
    """'hf:plain' -> ('plain', ''); 'hf:assisted=DIR' -> ('assisted', 'DIR'). Unknown kinds fail with the list."""
    body = spec[len(HF_PREFIX):]
    kind, _, arg = body.partition("=")
    if kind in ("plain", "prompt-lookup") and not arg:
        return kind, ""
    if kind == "assisted" and arg:
        return kind, arg
    raise ValueError(f"--drafter {spec!r}: HF baselines are {', '.join(HF_PREFIX + k for k in HF_KINDS)} "
                     "(assisted generation needs the draft model's directory)")


@dataclass
class HFBaseline:
    """One HF ``generate`` mode; ``generate`` has ``speculative_generate``'s signature (the eval grid calls both)."""

    name: str
    kind: str  # plain | prompt-lookup | assisted
    assistant: torch.nn.Module | None = None
    supports_tree = False

    def generate(self, target, input_ids: torch.Tensor, max_new_tokens: int, k: int = 1, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, eos_token_id=None, **_) -> SpecOutput:
        ids = input_ids.view(1, -1).to(target.device)
        eos = sorted(resolve_eos(target, eos_token_id))
        kw = sampling_kwargs(temperature, top_p, top_k)
        if self.kind == "prompt-lookup":
            kw["prompt_lookup_num_tokens"] = k
        elif self.kind == "assisted":
            cfg = self.assistant.generation_config  # a fixed k: the same chain length as spectrain's rows
            cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = k, "constant"
            cfg.assistant_confidence_threshold = 0.0
            kw["assistant_model"] = self.assistant
        stats = DecodeStats(k=0 if self.kind == "plain" else k, sequences=1, prefill_tokens=ids.shape[1])
        if seed is not None:
            torch.manual_seed(seed)
        with count_passes(target.model, stats, self.kind == "plain"):
            out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                        eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0, **kw)
        tokens = out[0, ids.shape[1]:].tolist()
        stop = "eos" if tokens and tokens[-1] in eos else "length"
        stats.emitted = len(tokens)
        return SpecOutput(tokens=tokens, stats=stats, stop_reason=stop)


def sampling_kwargs(temperature: float, top_p: float, top_k: int) -> dict:
    """Explicit values for every sampling knob, so a model's own generation_config (SmolLM2 ships
    temperature 0.2 / top_p 0.9) never changes what is compared."""
    if temperature == 0:
        return dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    return dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)  # top_k 0: off


class count_passes:
    """Counts verification passes and per-position outcomes from HF's own calls (module docstring)."""

    def __init__(self, model, stats: DecodeStats, plain: bool):
        self.model, self.stats, self.plain = model, stats, plain

    def __enter__(self):
        if self.plain:  # one forward per emitted token, the prefill's included (as HF's assisted rows count it)
            self.handle = self.model.register_forward_pre_hook(lambda *a: self._plain_pass())
            return self
        make = self.model._get_candidate_generator

        def wrapped(*a, **kw):
            gen = make(*a, **kw)
            update = gen.update_candidate_strategy

            def record(input_ids, scores, num_matches):
                drafted, accepted = scores.shape[1] - 1, int(num_matches)
                self.stats.target_passes += 1
                self.stats.drafted += drafted
                self.stats.record([True] * accepted + ([False] if accepted < drafted else []))
                return update(input_ids, scores, num_matches)

            gen.update_candidate_strategy = record
            return gen

        self.model._get_candidate_generator = wrapped  # an instance attribute: removed on exit
        return self

    def _plain_pass(self):
        self.stats.target_passes += 1

    def __exit__(self, *exc):
        if self.plain:
            self.handle.remove()
        else:
            del self.model._get_candidate_generator
        return False


def load_hf_baseline(spec: str, target, load_drafter) -> HFBaseline:
    """`load_drafter` is spectrain.drafters.load_drafter (passed in: eval owns this module, drafters load)."""
    kind, arg = parse_hf_spec(spec)
    if kind != "assisted":
        return HFBaseline(spec, kind)
    drafter = load_drafter(arg, target)
    model = getattr(drafter, "model", None)
    if model is None or not hasattr(model, "generate"):
        raise ValueError(f"--drafter {spec!r}: HF assisted generation needs a separate draft model (a spectrain "
                         f"draft-model run or an HF causal LM sharing the target's tokenizer); {arg} is a "
                         f"{type(drafter).__name__}")
    return HFBaseline(spec, kind, model)
