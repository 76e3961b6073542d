"""The serve commands an export implies: which engines load a format (the families' ``serve.engines``), the
decode setting served (``resolve_decode``: --tree, --k or the family's ``serve.k``), each engine's command from
the family's ``serve.command`` hook, and the README section that prints them.

Pure facts and string building (no torch): `spectrain export` prints these commands and writes them into
the export's README.md. The engine command lines the hooks build from, and which drafter layouts each engine
computes (``engine_problems``, which `spectrain check` / `train` apply to a recipe's ``deploy.engine``):
spectrain/recipe/deploy.py.

Decode settings map onto the engines like this (``--k`` / ``--tree`` as ``spectrain eval`` takes them):

| spectrain            | vLLM `--speculative-config`  | SGLang                                                  | TensorRT-LLM `speculative_config`          |
|----------------------|------------------------------|---------------------------------------------------------|--------------------------------------------|
| `--k K` (chain)      | `num_speculative_tokens: K`  | `--speculative-num-steps K --speculative-eagle-topk 1 --speculative-num-draft-tokens K+1` | `max_draft_len: K` |
| `--tree topk=T,depth=D,total=N` (EAGLE-3) | none: vLLM's `speculative_token_tree` is a static tree, spectrain's the EAGLE-2 dynamic one; a chain of D is printed, labelled | `--speculative-num-steps D --speculative-eagle-topk T --speculative-num-draft-tokens N+1` | `max_draft_len: D, use_dynamic_tree: true, dynamic_tree_max_topK: T, max_total_draft_tokens: N` |

SGLang's ``speculative_num_draft_tokens`` counts the verified root token as well (SGLang requires
num_steps + 1 at topk 1), spectrain's ``total`` counts draft nodes only: hence the + 1.
"""

from __future__ import annotations

from collections.abc import Mapping

from spectrain import registry
from spectrain.recipe.deploy import ENGINE_NAMES, ENGINES, Decode, ServeCommand

# ServeCommand and Decode live below the families (spectrain/recipe/deploy.py), whose serve hooks build them
__all__ = ["ENGINES", "ENGINE_NAMES", "Decode", "ServeCommand", "parse_tree", "readme_section", "resolve_decode",
           "serve_commands"]

_VLLM_DOC = "vLLM docs features/speculative_decoding (`vllm serve MODEL --speculative-config JSON`)"
_VLLM_CFG = "vllm/config/speculative.py SpeculativeConfig"
_SGL_DOC = "SGLang docs advanced_features/speculative_decoding and server_args.py"
_TRT_CFG = "TensorRT-LLM tensorrt_llm/llmapi/llm_args.py (DecodingBaseConfig and its subclasses)"
# Every flag and config key a printed command uses, with where its name was read. tests/test_serving.py
# checks each printed command against this table.
ENGINE_FLAGS: dict[str, dict[str, str]] = {
    "vllm": {
        "vllm serve": _VLLM_DOC,
        "--speculative-config": _VLLM_DOC,
        "method": f"{_VLLM_CFG}.method (SpeculativeMethod: eagle3, draft_model; medusa in releases before 0.33)",
        "model": f"{_VLLM_CFG}.model",
        "num_speculative_tokens": f"{_VLLM_CFG}.num_speculative_tokens",
    },
    "sglang": {
        "python -m sglang.launch_server": _SGL_DOC,
        "--model-path": _SGL_DOC,
        "--speculative-algorithm": f"{_SGL_DOC}; SpeculativeAlgorithm: EAGLE, EAGLE3, STANDALONE, NGRAM ... (no Medusa)",
        "--speculative-draft-model-path": _SGL_DOC,
        "--speculative-num-steps": _SGL_DOC,
        "--speculative-eagle-topk": _SGL_DOC,
        "--speculative-num-draft-tokens": f"{_SGL_DOC} (counts the verified root token: num_steps + 1 at topk 1)",
    },
    "trtllm": {
        "trtllm-serve": "TensorRT-LLM docs (`trtllm-serve MODEL --backend B --extra_llm_api_options FILE.yaml`)",
        "--backend": "trtllm-serve --backend (pytorch; tensorrt for Medusa, whose config refuses pytorch)",
        "--extra_llm_api_options": "trtllm-serve option naming the YAML of LLM API arguments",
        "speculative_config": _TRT_CFG,
        "decoding_type": f"{_TRT_CFG}: Eagle3, Medusa, DraftTarget",
        "max_draft_len": f"{_TRT_CFG}.max_draft_len",
        "speculative_model": f"{_TRT_CFG}.speculative_model",
        "eagle3_layers_to_capture": f"{_TRT_CFG} EagleDecodingConfig (layer outputs; default {{1, N//2-1, N-4}})",
        "use_dynamic_tree": f"{_TRT_CFG} EagleDecodingConfig",
        "dynamic_tree_max_topK": f"{_TRT_CFG} EagleDecodingConfig",
        "max_total_draft_tokens": f"{_TRT_CFG} EagleDecodingConfig",
        "num_medusa_heads": f"{_TRT_CFG} MedusaDecodingConfig",
        "medusa_choices": f"{_TRT_CFG} MedusaDecodingConfig (static tree paths)",
    },
}

DEFAULT_K = 5  # `spectrain eval`'s default: the draft length served for a family that names none


class _FormatEngines(Mapping):
    """export format -> the engines that load it: a live view of the families' records (``serve.engines``)."""

    def __getitem__(self, fmt: str) -> tuple[str, ...]:
        if registry.format_family(fmt) is None or fmt not in registry.format_family(fmt).serve.engines:
            raise KeyError(fmt)
        return registry.format_engines(fmt)

    def __iter__(self):
        return iter([fmt for fam in registry.FAMILIES.values() for fmt in fam.serve.engines])

    def __len__(self) -> int:
        return sum(len(fam.serve.engines) for fam in registry.FAMILIES.values())


FORMAT_ENGINES = _FormatEngines()


def parse_tree(spec: str) -> dict:
    """'topk=4,depth=5,total=32' -> {'topk': 4, 'depth': 5, 'total_tokens': 32}."""
    names = {"topk": "topk", "depth": "depth", "total": "total_tokens", "total_tokens": "total_tokens"}
    tree = {}
    for part in filter(None, (s.strip() for s in spec.split(","))):
        key, _, val = part.partition("=")
        if key not in names or not val.isdigit() or int(val) <= 0:
            raise ValueError(f"--tree {spec!r}: expected positive integers for topk=,depth=,total=, "
                             f"e.g. topk=4,depth=5,total=32 (bad part {part!r})")
        tree[names[key]] = int(val)
    if "depth" not in tree or "topk" not in tree:
        raise ValueError(f"--tree {spec!r}: needs at least topk= and depth=, e.g. topk=4,depth=5,total=32")
    tree.setdefault("total_tokens", tree["topk"] * tree["depth"])
    return tree


def resolve_decode(head: dict, k: int | None = None, tree: dict | None = None) -> Decode:
    """The decode setting to serve: a tree (k = its depth), else --k, else what the head was trained for."""
    k = tree["depth"] if tree is not None else k
    family_k = registry.hook(head.get("kind"), "serve.k")  # the family's default and limit (spectrain/registry.py)
    k = family_k(head, k) if family_k is not None else DEFAULT_K if k is None else k
    if k < 1:
        raise ValueError(f"--k must be >= 1, got {k}")
    return Decode(k, tree)


def serve_commands(fmt: str, head: dict, model_dir: str, target: str, d: Decode,
                   engines: tuple[str, ...] | None = None) -> list[ServeCommand]:
    """The serve command of each engine that loads ``fmt`` (or just ``engines``) for the decode setting ``d``.

    head: the checkpoint's drafter_config.json; model_dir: where the export lands (absolute); target: what the
    engine loads as the target model."""
    loaders = FORMAT_ENGINES.get(fmt, ())  # () for a format no engine here serves (a family's own format)
    wanted = loaders if not engines else tuple(e for e in loaders if e in engines)
    if engines and not wanted:
        raise ValueError(f"--engine {', '.join(engines)}: the {fmt} format is served by "
                         f"{', '.join(loaders) or 'no engine spectrain knows'}; pick one of those or another --format")
    target = target or "TARGET"
    out = []
    serve = registry.hook(head.get("kind"), "serve.command")  # the family's command builder (spectrain/registry.py)
    if wanted and serve is None:
        raise ValueError(f"the {fmt} format names engines but its family declares no `serve.command` hook")
    for engine in wanted:
        out.append(serve(engine, target, model_dir, d, head))
    return out


def readme_section(commands: list[ServeCommand], d_label: str) -> str:
    """The export README's "Serve it" section: one fenced command per engine, with its notes."""
    md = ["## Serve it", "", f"Speculative settings: {d_label} (spectrain eval's `--k` / `--tree`; the mapping to each "
          "engine's flags is in spectrain's docs/export.md, \"Serve it\").", ""]
    for c in commands:
        md += [f"### {ENGINE_NAMES[c.engine]}", "", "```bash", c.text(), "```", ""]
        md += [f"- note: {n}" for n in c.notes] + ([""] if c.notes else [])
    return "\n".join(md)
