"""Which drafter layouts each serving engine can compute: recipe validation refuses, before any training, a
``deploy.engine`` that cannot serve the head the recipe would train. Pure facts (no torch); the serve
commands themselves are built in spectrain/export/serving.py."""

from __future__ import annotations

from spectrain import registry

ENGINES = ("vllm", "sglang", "trtllm")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}
NO_MEDUSA = {"vllm": "vLLM 0.33.0 has no Medusa support at all (read from its source)",
             "sglang": "SGLang has no Medusa algorithm (its SpeculativeAlgorithm lists EAGLE, EAGLE3, STANDALONE, NGRAM ...)"}


def engine_problems(engine: str, kind: str, flags: dict[str, bool], sliding: bool = False, num_layers: int = 1,
                    aux: list[int] | None = None) -> list[str]:
    """Why ``engine`` cannot serve a drafter of ``kind`` with this EAGLE-3 layout ([] = it can). flags: the four
    layout flags (spectrain/drafters/eagle3/layout.py LAYOUT_FLAGS); aux: the head's aux layer ids (layer inputs) if
    known. The family's record says (its ``engine_problems`` hook); a family without one is served by every engine."""
    problems = registry.hook(kind, "engine_problems") if engine else None
    return problems(engine, flags, sliding, num_layers, aux) if problems is not None else []


def medusa_problems(engine: str, flags: dict[str, bool], sliding: bool = False, num_layers: int = 1,
                    aux: list[int] | None = None) -> list[str]:
    """The Medusa family's ``engine_problems`` hook: only TensorRT-LLM computes Medusa heads."""
    return [f"{NO_MEDUSA[engine]}: serve Medusa heads with TensorRT-LLM or train an EAGLE-3 head"] \
        if engine in NO_MEDUSA else []


def eagle3_problems(engine: str, flags: dict[str, bool], sliding: bool = False, num_layers: int = 1,
                    aux: list[int] | None = None) -> list[str]:
    """The EAGLE-3 family's ``engine_problems`` hook: which layouts each engine's EAGLE-3 layer computes."""
    name = ENGINE_NAMES[engine]
    on = [k for k, v in flags.items() if v]
    if engine == "vllm":
        bad = [k for k in on if k in ("fc_norm", "norm_output")]
        return [f"layout {bad}: the vLLM EAGLE-3 layer read for this project implements norm_before_residual (and, in "
                "some versions, norm_before_fc) only, so it would compute another function"] if bad else []
    out = []
    if on:
        out.append(f"layout {on}: {name}'s EAGLE-3 layer implements none of the extra layout norms")
    if sliding:
        out.append(f"sliding-window draft layers: {name}'s EAGLE-3 layer does not apply a window")
    if num_layers != 1:
        out.append(f"{num_layers} draft layers: {name} loads single-layer heads only (it names further layers "
                   "differently)")
    if aux and min(aux) < 1:
        out.append(f"aux layer ids {aux} include the embeddings (input of layer 0), which {name}'s "
                   "output-of-layer ids cannot express")
    return out


# ---- aux-layer conventions ------------------------------------------------------------------------------
# spectrain (like speculators and vLLM) names an aux feature by the target layer whose INPUT it is; EAGLE /
# SGLang configs and TensorRT-LLM's eagle3_layers_to_capture name the layer whose OUTPUT it is.


def eagle_default_aux(num_layers: int) -> list[int]:
    """The EAGLE-3 convention for a target of ``num_layers`` layers, as layer inputs: [2, N//2, N-3]."""
    return [2, num_layers // 2, num_layers - 3]


def sglang_default_capture(num_layers: int) -> list[int]:
    """SGLang's and TensorRT-LLM's default capture, as layer outputs: {1, N//2-1, N-4}."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def to_layer_outputs(aux: list[int]) -> list[int]:
    """spectrain's layer-input ids -> the layer-output ids SGLang / TensorRT-LLM configs hold."""
    return [a - 1 for a in aux]


def from_layer_outputs(outputs: list[int]) -> list[int]:
    """Layer-output ids (EAGLE / SGLang ``eagle_config``) -> spectrain's layer-input ids."""
    return [a + 1 for a in outputs]
