"""Import public EAGLE-3 heads: the speculators / vLLM format and the EAGLE / SGLang ``LlamaForCausalLMEagle3``
format, turned into a spectrain ``Eagle3Head`` that computes exactly the same function -- or refused, by
name, when spectrain cannot represent the head exactly (never loaded approximately).

- speculators (``config.json`` with ``speculators_model_type: eagle3``): ``transformer_layer_config`` holds the
  draft layer (a transformers config diff: missing keys take transformers' defaults, as speculators itself
  builds it), ``eagle_aux_hidden_state_layer_ids`` are inputs of target layers (spectrain's convention), the
  layout flags ``norm_before_fc`` / ``fc_norm`` / ``norm_before_residual`` / ``norm_output`` map one to one.
- EAGLE / SGLang (``architectures: [LlamaForCausalLMEagle3]``): Llama fields at the top level, layer 0 named
  ``midlayer.*`` (or ``layers.0.*``), aux ids in ``eagle_config`` are layer *outputs* (spectrain's id - 1;
  absent: SGLang's default outputs {1, N//2-1, N-4}); the EAGLE-3 layer of these engines has no extra norms.

Both may or may not store ``d2t`` / ``t2d`` (absent: the draft vocabulary is the whole target vocabulary) and
``embed_tokens.weight`` (present: it must equal the target's, which spectrain uses).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from spectrain.drafters.eagle3.decode import Eagle3Proposer
from spectrain.drafters.eagle3.layout import LAYOUT_FLAGS, build_draft_vocab, sort_aux
from spectrain.drafters.eagle3.model import Eagle3Head
from spectrain.drafters.head_io import CONFIG_NAME
from spectrain.recipe.deploy import eagle_default_aux, from_layer_outputs, sglang_default_capture
from spectrain.targets.fingerprint import target_fingerprint

SPECULATORS, EAGLE3_HF = "speculators", "eagle3-hf"
EAGLE3_HF_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def detect(path) -> str | None:
    """``speculators`` / ``eagle3-hf`` for a foreign EAGLE-3 head directory, else None."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError:
        return None
    if config.get("speculators_model_type") == "eagle3":
        return SPECULATORS
    if any(a in EAGLE3_HF_ARCHS for a in config.get("architectures") or []):
        return EAGLE3_HF
    return None


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The head's weights: model.safetensors (or its shards, per model.safetensors.index.json), else
    pytorch_model.bin (tensors only). Other files (e.g. recorded logits) are not weights."""
    index = path / "model.safetensors.index.json"
    files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.is_file() \
        else [path / "model.safetensors"] if (path / "model.safetensors").is_file() else []
    if files:
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path} holds no model.safetensors (or index) and no pytorch_model.bin weights")


# ---- config parsing ---------------------------------------------------------------------------
def _layer_config(fields: dict, where: str):
    """A transformers config of the draft layer; refuses what spectrain's Llama-style layer cannot compute."""
    fields = {k: v for k, v in fields.items() if k not in ("architectures", "transformers_version")}
    model_type = fields.pop("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"{where}: draft layer model_type={model_type!r}; spectrain's EAGLE-3 layer is Llama-style "
                         "(e.g. qwen3 adds q/k norms in attention), so this head cannot be loaded exactly")
    layer = AutoConfig.for_model(model_type, **fields)
    for key in ("attention_bias", "mlp_bias"):
        if getattr(layer, key, False):
            raise ValueError(f"{where}: {key}=true; spectrain's EAGLE-3 layer has no biases")
    if getattr(layer, "hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act={layer.hidden_act!r}; spectrain's EAGLE-3 MLP is SiLU-gated")
    types = getattr(layer, "layer_types", None) or []
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown or ("sliding_attention" in types and not getattr(layer, "sliding_window", None)):
        raise ValueError(f"{where}: layer_types {types} with sliding_window={getattr(layer, 'sliding_window', None)}; "
                         "spectrain implements full and windowed (sliding_attention + sliding_window) layers only")
    return layer


def _spectrain_config(layer, aux: list[int], draft_vocab: int, target_hidden: int | None, flags: dict,
                      ttt_steps: int, source: str) -> dict:
    rope = dict(layer.rope_parameters or {})
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", getattr(layer, "rope_theta", 10000.0))
    return {
        "kind": "eagle3", "target": "", "aux_layers": list(aux), "target_hidden_size": target_hidden or layer.hidden_size,
        "target_vocab_size": layer.vocab_size, "hidden_size": layer.hidden_size, "draft_vocab_size": draft_vocab,
        "num_layers": layer.num_hidden_layers, "num_attention_heads": layer.num_attention_heads,
        "num_key_value_heads": layer.num_key_value_heads or layer.num_attention_heads,
        "head_dim": getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads,
        "intermediate_size": layer.intermediate_size, "rms_norm_eps": layer.rms_norm_eps, "rope_parameters": rope,
        "max_position_embeddings": layer.max_position_embeddings, "hidden_act": "silu",
        **_windows(layer),
        "ttt_steps": ttt_steps, "ttt_decay": 0.8, "loss": "fkl", "imported_from": source,
        **{k: bool(flags.get(k, False)) for k in LAYOUT_FLAGS},
    }


def _windows(layer) -> dict:
    types = list(getattr(layer, "layer_types", None) or [])
    if "sliding_attention" not in types:
        return {}
    return {"layer_types": types, "sliding_window": int(layer.sliding_window)}


def _from_speculators(config: dict, where: str, num_target_layers: int) -> dict:
    layer = _layer_config(config["transformer_layer_config"], f"{where} transformer_layer_config")
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if not aux:  # what vLLM and speculators fall back to
        n = num_target_layers
        aux = eagle_default_aux(n)
        warnings.warn(f"{where}: no eagle_aux_hidden_state_layer_ids; using vLLM's default {aux}", stacklevel=3)
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return _spectrain_config(layer, aux, config.get("draft_vocab_size", layer.vocab_size),
                             config.get("target_hidden_size"), config, int(methods[0].get("speculative_tokens", 3)),
                             SPECULATORS)


def _from_eagle3_hf(config: dict, where: str, num_target_layers: int) -> dict:
    layer = _layer_config({k: v for k, v in config.items() if k not in ("eagle_config", "draft_vocab_size",
                                                                           "target_hidden_size")}, where)
    if layer.num_hidden_layers != 1:
        raise ValueError(f"{where}: num_hidden_layers={layer.num_hidden_layers}; the EAGLE/SGLang format's further "
                         "layers (additional_layers.*) are a different layer type that spectrain does not implement")
    outputs = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not outputs:
        n = num_target_layers
        outputs = sglang_default_capture(n)
        warnings.warn(f"{where}: no eagle_config.eagle_aux_hidden_state_layer_ids; using SGLang's default layer "
                      f"outputs {outputs}", stacklevel=3)
    draft_vocab = config.get("draft_vocab_size") or layer.vocab_size
    return _spectrain_config(layer, from_layer_outputs(outputs), draft_vocab, config.get("target_hidden_size"), {}, 3,
                             EAGLE3_HF)


# ---- weights ----------------------------------------------------------------------------------
def _weights(state: dict[str, torch.Tensor], cfg: dict, target, where: str) -> dict[str, torch.Tensor]:
    """Rename to spectrain's names, drop/verify the embedding, fill d2t/t2d, float32; refuse unknown tensors."""
    state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}
    emb = state.pop("embed_tokens.weight", None)
    if emb is not None:
        _check_embedding(emb, target, cfg, where)
    if ("d2t" in state) != ("t2d" in state):
        raise ValueError(f"{where}: holds only one of d2t / t2d; both or neither are needed")
    if "d2t" not in state:
        if cfg["draft_vocab_size"] != cfg["target_vocab_size"]:
            raise ValueError(f"{where}: draft_vocab_size {cfg['draft_vocab_size']} < vocab {cfg['target_vocab_size']} "
                             "but no d2t/t2d mapping is stored: which target ids the lm_head rows mean is unknown")
        state["d2t"], state["t2d"] = build_draft_vocab(None, cfg["draft_vocab_size"], cfg["target_vocab_size"])
    state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    names_cfg = {**cfg, "aux_layers": sorted(cfg["aux_layers"])}  # names do not depend on the aux order
    expected = set(Eagle3Head(names_cfg, state["d2t"], state["t2d"]).state_dict())
    extra = sorted(set(state) - expected)
    if extra:
        raise ValueError(f"{where}: tensors {extra[:4]} have no counterpart in spectrain's EAGLE-3 head (this "
                         "layout cannot be represented exactly)")
    missing = sorted(expected - set(state))
    if missing:
        raise ValueError(f"{where}: missing tensors {missing[:4]} that this config implies")
    return {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in state.items()}


def _check_embedding(emb: torch.Tensor, target, cfg: dict, where: str) -> None:
    """A stored embedding must be the target's, possibly rounded to a lower precision (speculators saves bf16;
    a spectrain export of such a head stores the rounded rows): then the head computed with the rounded rows,
    which ``embed_dtype`` reproduces exactly (rounding is elementwise)."""
    mine = target.embed_tokens.weight.detach().cpu()
    if tuple(emb.shape) == tuple(mine.shape):
        e = emb.float()
        if torch.equal(e, mine.float()):
            return
        for dt in (torch.bfloat16, torch.float16):
            if torch.equal(e, mine.to(dt).float()):
                cfg["embed_dtype"] = str(dt).removeprefix("torch.")
                return
    raise ValueError(f"{where}: embed_tokens.weight differs from target {target.name_or_path}'s embedding; "
                     "spectrain's EAGLE-3 head uses the target's embedding, so this head cannot be loaded "
                     "exactly (trained with embed_requires_grad, or for another target?)")


def _check_target(cfg: dict, target, where: str) -> None:
    for key, have in (("target_hidden_size", target.hidden_size), ("target_vocab_size", target.vocab_size)):
        if cfg[key] != have:
            raise ValueError(f"{where}: head has {key}={cfg[key]}, target {target.name_or_path} has {have}: wrong target?")
    if cfg["hidden_size"] != target.hidden_size:
        raise ValueError(f"{where}: draft hidden_size {cfg['hidden_size']} != target hidden size {target.hidden_size}; "
                         "spectrain feeds the target's embedding to the draft layer, which needs equal sizes")
    try:
        target.validate_aux_layers(cfg["aux_layers"])
    except ValueError as e:
        raise ValueError(f"{where}: aux layer ids {cfg['aux_layers']} do not fit this target: {e}") from None


def read_foreign(path, target) -> tuple[dict, dict[str, torch.Tensor]]:
    """(spectrain config, spectrain state) of a speculators or EAGLE/SGLang head directory, checked on ``target``."""
    path = Path(path)
    fmt = detect(path)
    if fmt is None:
        raise ValueError(f"{path} is not an EAGLE-3 head in the speculators (speculators_model_type: eagle3) or "
                         f"EAGLE/SGLang ({' / '.join(EAGLE3_HF_ARCHS)}) format")
    where = f"{fmt} EAGLE-3 head {path}"
    config = json.loads((path / "config.json").read_text())
    parse = _from_speculators if fmt == SPECULATORS else _from_eagle3_hf
    cfg = parse(config, where, target.num_layers)
    cfg.update(target=target.name_or_path, target_num_layers=target.num_layers)
    _check_target(cfg, target, where)
    state = _weights(load_weights(path), cfg, target, where)
    return sort_aux(cfg, state, where)


def import_eagle3(path, target) -> Eagle3Head:
    """A foreign EAGLE-3 head as a spectrain ``Eagle3Head`` (on the target's device)."""
    cfg, state = read_foreign(path, target)
    model = Eagle3Head(cfg, state["d2t"], state["t2d"])
    model.load_state_dict(state, strict=True)
    return model.to(target.device)


def load(path, target):
    """load_drafter entry for foreign EAGLE-3 directories: a decoding-ready drafter."""
    return Eagle3Proposer(import_eagle3(path, target), target)


# ---- training initialisation ------------------------------------------------------------------
ARCH_KEYS = ("aux_layers", "draft_vocab_size", "num_layers", "intermediate_size", "num_attention_heads", "sliding_window",
             *LAYOUT_FLAGS)


def init_from_head(cls, path, recipe, target) -> Eagle3Head:
    """``drafter.eagle3.init_from: DIR``: start training from an existing head (spectrain checkpoint or a foreign
    format). The head fixes the architecture; recipe keys that disagree with it are named in a warning."""
    e = recipe.drafter.eagle3
    if (Path(path) / CONFIG_NAME).is_file():
        head = Eagle3Head.from_pretrained(path, target)
    elif detect(path):
        head = import_eagle3(path, target)
    else:
        raise ValueError(f"drafter.eagle3.init_from={path!r}: not a spectrain EAGLE-3 checkpoint ({CONFIG_NAME}) nor a "
                         "speculators / EAGLE-SGLang EAGLE-3 head directory")
    cfg = head.config

    def differs(key: str) -> bool:
        mine, theirs = getattr(e, key), cfg.get(key, False)
        return bool(mine) != bool(theirs) if key in LAYOUT_FLAGS else mine not in ([], 0) and mine != theirs

    ignored = [f"{k}={getattr(e, k)!r} (head: {cfg.get(k, False)!r})" for k in ARCH_KEYS if differs(k)]
    if ignored:
        warnings.warn(f"drafter.eagle3.init_from={path}: the head fixes the architecture; recipe keys ignored: "
                      + ", ".join(ignored), stacklevel=2)
    if e.lm_head_init != "random":
        warnings.warn(f"drafter.eagle3.lm_head_init={e.lm_head_init} ignored: init_from={path} supplies the lm_head",
                      stacklevel=2)
    # training rules come from the recipe (speculators trains with a frozen lm_head: freeze_lm_head=true)
    cfg.update(ttt_steps=e.ttt_steps, ttt_decay=e.ttt_decay, loss=recipe.drafter.loss, init_from=str(path),
               freeze_lm_head=e.freeze_lm_head, loss_positions=e.loss_positions, out_of_vocab=e.out_of_vocab,
               target=target.name_or_path, target_fingerprint=target_fingerprint(target))
    model = cls(cfg, head.d2t, head.t2d)
    model.load_state_dict(head.state_dict(), strict=True)
    return model.to(target.device)


def build(recipe, target, token_counts):
    """The head a recipe trains: a fresh one (``Eagle3Head.from_recipe``), or, with
    ``drafter.eagle3.init_from``, an existing head (spectrain's, speculators' or the EAGLE / SGLang format)."""
    e = recipe.drafter.eagle3
    if not e.init_from:
        return Eagle3Head.from_recipe(recipe, target, token_counts)
    model = init_from_head(Eagle3Head, e.init_from, recipe, target)
    model.rollout_cfg = e.rollout
    return model
