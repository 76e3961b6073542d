"""Serving engines as facts (no torch): their names, which drafter layouts each computes, the serve command
line each takes, and the aux-layer conventions.

Recipe validation refuses, through ``engine_problems`` (each family's ``serve.engine_problems`` hook), a
``deploy.engine`` that cannot serve the head the recipe would train, before any training. A family's
``serve.command`` hook builds its command from ``vllm_command`` / ``sglang_command`` / ``trtllm_command``; which
engines load an export, the decode setting served and the README: spectrain/export/serving.py. These pieces sit
here, below the families, because the hooks that use them live in the families' own modules."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from spectrain import registry

ENGINES = ("vllm", "sglang", "trtllm")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}


def engine_problems(engine: str, kind: str, flags: dict[str, bool], sliding: bool = False, num_layers: int = 1,
                    aux: list[int] | None = None) -> list[str]:
    """Why ``engine`` cannot serve a drafter of ``kind`` with this EAGLE-3 layout ([] = it can). flags: the four
    layout flags (spectrain/drafters/eagle3/layout.py LAYOUT_FLAGS); aux: the head's aux layer ids (layer inputs) if
    known. The family's record says (its ``serve.engine_problems`` hook); a family without one is served by every
    engine."""
    problems = registry.hook(kind, "serve.engine_problems") if engine else None
    return problems(engine, flags, sliding, num_layers, aux) if problems is not None else []


# ---- serve command lines ----------------------------------------------------------------------------------


@dataclass
class ServeCommand:
    engine: str
    argv: list[str]  # the serve command, one shell word per item
    config: dict | None = None  # TensorRT-LLM: the YAML written next to the command
    notes: list[str] = field(default_factory=list)

    @property
    def flags(self) -> dict:
        """The flag and config names the command uses -> values (for the table check and the tests)."""
        out: dict = {}
        words = self.argv
        for i, w in enumerate(words):
            if w.startswith("--"):
                out[w] = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else True
        spec = out.get("--speculative-config")
        if isinstance(spec, str):
            out.update(json.loads(spec))
        if self.config:
            out["speculative_config"] = True
            out.update(self.config["speculative_config"])
        return out

    def text(self) -> str:
        """Copy-paste shell: the YAML as a heredoc (TensorRT-LLM), then the command with one flag per line."""
        lines = []
        if self.config is not None:
            lines += [f"cat > {CONFIG_FILE} <<'EOF'", *_yaml(self.config), "EOF"]
        head, rest = [], list(self.argv)
        while rest and not rest[0].startswith("--"):
            head.append(rest.pop(0))
        parts = [" ".join(shlex.quote(w) if i else w for i, w in enumerate(head))]
        while rest:
            flag = rest.pop(0)
            val = [] if not rest or rest[0].startswith("--") else [shlex.quote(rest.pop(0))]
            parts.append(" ".join([flag, *val]))
        return "\n".join(lines + [" \\\n    ".join(parts)])


CONFIG_FILE = "spectrain-speculative.yaml"


def _yaml(config: dict, indent: str = "") -> list[str]:
    out = []
    for k, v in config.items():
        if isinstance(v, dict):
            out += [f"{indent}{k}:", *_yaml(v, indent + "  ")]
        else:
            out.append(f"{indent}{k}: {json.dumps(v)}")  # JSON scalars and lists are valid YAML
    return out


@dataclass
class Decode:
    """What was evaluated: a chain of ``k`` or an EAGLE-2 dynamic tree (``tree``: topk, depth, total_tokens)."""
    k: int
    tree: dict | None = None

    @property
    def label(self) -> str:
        t = self.tree
        return f"k={self.k}" if t is None else f"tree topk={t['topk']},depth={t['depth']},total={t['total_tokens']}"


def vllm_command(method: str, target: str, model_dir: str, k: int) -> ServeCommand:
    """`vllm serve TARGET --speculative-config {method, model, num_speculative_tokens}`."""
    spec = {"method": method, "model": model_dir, "num_speculative_tokens": k}
    return ServeCommand("vllm", ["vllm", "serve", target, "--speculative-config", json.dumps(spec)])


def sglang_command(algorithm: str, target: str, model_dir: str, steps: int, topk: int, nodes: int) -> ServeCommand:
    """`python -m sglang.launch_server`; ``nodes`` counts draft nodes, SGLang's flag the verified root too."""
    return ServeCommand("sglang", ["python", "-m", "sglang.launch_server", "--model-path", target,
                                   "--speculative-algorithm", algorithm, "--speculative-draft-model-path", model_dir,
                                   "--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
                                   "--speculative-num-draft-tokens", str(nodes + 1)])


def trtllm_command(backend: str, target: str, spec: dict) -> ServeCommand:
    """`trtllm-serve TARGET` with ``spec`` as the speculative_config of the YAML written beside it."""
    return ServeCommand("trtllm", ["trtllm-serve", target, "--backend", backend, "--extra_llm_api_options",
                                   CONFIG_FILE], config={"speculative_config": spec})


def static_tree_note(engine: str, d: Decode, what: str) -> str:
    """The note under a command that serves a chain where a dynamic tree was evaluated."""
    return (f"{ENGINE_NAMES[engine]}: the evaluated {d.label} is a dynamic tree, which {what}; this command serves "
            f"a chain of {d.k} (evaluate `--k {d.k}` to know what that gives)")


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
