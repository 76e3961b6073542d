"""EAGLE-3 heads -> vLLM speculators format (``vllm-eagle3``) and the SGLang / TensorRT-LLM layout
(``sglang-eagle3``), with their validators.

- vllm-eagle3: weights keep spectrain's names (they are the speculators names); ``config.json`` carries
  ``transformer_layer_config``, ``draft_vocab_size``, ``target_hidden_size``, all four layout flags written
  explicitly (``norm_before_residual``: vLLM assumes true when the key is absent) and
  ``eagle_aux_hidden_state_layer_ids`` in vLLM's convention: id L = the *input* of layer L, as spectrain
  records them. ``embed_tokens.weight`` (the target's, read from a local --target) is written too: the
  speculators package under transformers 5 does not fill a missing one from the verifier (its NaN sentinel
  never reaches real memory), so without it speculators computes wrong logits; vLLM and SGLang use it
  as the (identical) draft embedding. Cost: vocab x hidden x dtype bytes (1.05 GB bf16 for Llama-3-8B).
- sglang-eagle3: ``LlamaForCausalLMEagle3`` with Llama fields; layer 0 is ``midlayer.*`` (what SGLang and
  TensorRT-LLM load; vLLM remaps it too). SGLang captures the input of layer id+1 for each explicit id
  (ids are layer *outputs*), so the ids written are spectrain's minus one. Single-layer heads only: SGLang
  (``additional_layers.*``) and TensorRT-LLM (``midlayer.{i}``) name further layers differently. Neither
  engine implements the extra layout norms, so heads using them are refused. TensorRT-LLM ignores the
  aux ids in config.json: it captures ``eagle3_layers_to_capture`` from its own decoding config (default
  {1, N//2-1, N-4} as layer outputs); the value this head needs is written to ``README.md`` and to
  ``config.json`` (``spectrain_export``), and printed when it differs from that default.
"""

from __future__ import annotations

import warnings as pywarnings
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from spectrain.drafters.eagle3.layout import LAYOUT_FLAGS, layout, sort_aux
from spectrain.drafters.eagle3.serve import engine_problems
from spectrain.export.common import (
    WEIGHTS_NAME,
    Spec,
    check_out,
    check_tensors,
    dtype_name,
    hf_target,
    load_export,
    problems_of,
    read_head,
    rope_keys,
    staged,
    summary,
    target_embedding,
    target_info,
    write_json,
)
from spectrain.recipe.deploy import sglang_default_capture, to_layer_outputs

SPECULATORS_VERSION = "0.3.0"  # the speculators config layout followed here; vLLM does not read it


def _layer_fields(cfg: dict) -> dict:
    """The draft decoder layer as Llama config fields, readable by transformers 4 and 5 alike."""
    return {
        "model_type": "llama", "vocab_size": cfg["target_vocab_size"], "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"], "num_hidden_layers": cfg["num_layers"],
        "num_attention_heads": cfg["num_attention_heads"], "num_key_value_heads": cfg["num_key_value_heads"],
        "head_dim": cfg["head_dim"], "hidden_act": cfg.get("hidden_act", "silu"), "rms_norm_eps": cfg["rms_norm_eps"],
        "max_position_embeddings": cfg["max_position_embeddings"], **rope_keys(cfg["rope_parameters"]),
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        **({"layer_types": cfg["layer_types"], "sliding_window": cfg["sliding_window"]} if cfg.get("layer_types") else {}),
    }


def _read_sorted(src: Path, fmt: str) -> tuple[dict, dict[str, torch.Tensor], list[str]]:
    """The head with ascending aux ids (fc's input blocks permuted alongside), and any warning that caused."""
    cfg, state = read_head(src, "eagle3", fmt)
    with pywarnings.catch_warnings(record=True) as caught:
        pywarnings.simplefilter("always")
        cfg, state = sort_aux(cfg, state, f"EAGLE-3 head {src}")
    return cfg, state, [str(w.message) for w in caught]


def trtllm_capture(aux: list[int], num_layers: int | None) -> tuple[list[int], list[int] | None]:
    """(TensorRT-LLM eagle3_layers_to_capture this head needs, TensorRT-LLM's default for the target or None)."""
    need = to_layer_outputs(aux)
    default = sglang_default_capture(num_layers) if num_layers and num_layers > 5 else None
    return need, default


def _sglang_config(cfg: dict, state: dict, aux: list[int], dtype: str, n_layers: int | None):
    # the same facts `spectrain check` applies to a recipe's deploy.engine (the family's serve.engine_problems)
    problems = engine_problems("sglang", layout(cfg), bool(cfg.get("layer_types")), cfg["num_layers"], aux)
    if problems:
        raise ValueError(f"sglang-eagle3 (SGLang, TensorRT-LLM) cannot represent this head: {'; '.join(problems)}: "
                         "use --format vllm-eagle3")
    state = {k.replace("layers.0.", "midlayer.", 1): v for k, v in state.items()}
    need, default = trtllm_capture(aux, n_layers)
    config = {**_layer_fields(cfg), "architectures": ["LlamaForCausalLMEagle3"],
              "draft_vocab_size": cfg["draft_vocab_size"], "target_hidden_size": cfg["target_hidden_size"],
              # SGLang captures the input of layer id+1 for each id: write output-of-layer ids
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": need, "use_aux_hidden_state": True},
              "torch_dtype": dtype, "spectrain_export": {"trtllm_eagle3_layers_to_capture": need,
                                                         "trtllm_default_layers_to_capture": default}}
    return config, state


def _trtllm_readme(need: list[int], default: list[int] | None) -> str:
    same = "equals TensorRT-LLM's default for this target" if need == default else (
        f"differs from TensorRT-LLM's default {default}" if default else "(target depth unknown: compare it with "
        "TensorRT-LLM's default {1, N//2-1, N-4})")
    return ("# EAGLE-3 head exported by spectrain (sglang-eagle3)\n\n"
            "SGLang reads the aux layer ids from config.json (eagle_config). TensorRT-LLM does not: it captures "
            "the layers named by `eagle3_layers_to_capture` in its EAGLE-3 decoding config.\n\n"
            f"This head needs `eagle3_layers_to_capture = {set(need)}` (layer outputs), which {same}.\n")


def _vllm_config(cfg: dict, aux: list[int], dtype: str, target: str, tcfg: dict | None) -> dict:
    verifier = {"name_or_path": target, "architectures": (tcfg or {}).get("architectures", [])}
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": _layer_fields(cfg),
            "draft_vocab_size": cfg["draft_vocab_size"], "target_hidden_size": cfg["target_hidden_size"],
            **layout(cfg), "eagle_aux_hidden_state_layer_ids": aux,
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "verifier_accept_k": 1,
                                                         "speculative_tokens": int(cfg.get("ttt_steps", 3)),
                                                         "accept_tolerance": 0.0}],
                                   "verifier": verifier},
            "torch_dtype": dtype, "tie_word_embeddings": False}


def _layout_notes(cfg: dict) -> list[str]:
    """The layout warning: about the head's layout, so printed whether or not the target's embedding was found."""
    flags = [k for k in ("norm_before_fc", "fc_norm", "norm_output") if cfg.get(k)]
    return [f"layout {flags}: the vLLM EAGLE-3 code read for this project implements norm_before_residual (and, "
            "in some versions, norm_before_fc) only; check that your vLLM computes this layout"] if flags else []


def _with_embedding(state: dict, cfg: dict, target: str, dtype: str) -> tuple[dict, list[str]]:
    emb = target_embedding(target, cfg["target_vocab_size"], cfg["hidden_size"])
    notes = _layout_notes(cfg)
    if emb is None:
        return state, [f"embed_tokens.weight not written (target {target!r} has no local safetensors): vLLM and "
                       "SGLang share the target's embedding, but the speculators package (evaluation, fine-tuning) "
                       "would compute wrong logits; re-export with --target pointing at the target's directory",
                       *notes]
    if cfg.get("embed_dtype"):  # an imported head that computed with rounded rows: store exactly those
        emb = emb.to(getattr(torch, cfg["embed_dtype"]))
    return {**state, "embed_tokens.weight": emb.to(getattr(torch, dtype))}, notes


def _export_eagle3(fmt: str, src_dir, out_dir, target_name: str | None, overwrite: bool, readme: str = "") -> dict:
    src, out = Path(src_dir), Path(out_dir)
    cfg, state, warnings = _read_sorted(src, fmt)
    check_out(src, out, overwrite)
    target = hf_target(target_name or cfg.get("target") or "")
    tcfg, more = target_info(target, cfg)
    warnings += more
    aux, dtype = list(cfg["aux_layers"]), dtype_name(state)
    n_layers = (tcfg or {}).get("num_hidden_layers") or cfg.get("target_num_layers")
    extra: dict = {}
    if fmt == "sglang-eagle3":
        config, state = _sglang_config(cfg, state, aux, dtype, n_layers)
        need, default = trtllm_capture(aux, n_layers)
        extra = {"trtllm_eagle3_layers_to_capture": need}
        if need != default:
            warnings.append(f"TensorRT-LLM: set eagle3_layers_to_capture={set(need)} in its EAGLE-3 decoding config "
                            f"(its default for this target is {set(default) if default else 'unknown here'}; it "
                            "ignores the ids in config.json)")
    else:
        config = _vllm_config(cfg, aux, dtype, target, tcfg)
        state, more = _with_embedding(state, cfg, target, dtype)
        warnings += more
        if "embed_tokens.weight" in state:
            extra = {"embed_tokens_bytes": state["embed_tokens.weight"].numel() * state["embed_tokens.weight"].element_size()}
    with staged(out, fmt, FORMAT_VALIDATORS[fmt], readme) as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        write_json(tmp / "config.json", config)
        if fmt == "sglang-eagle3":
            (tmp / "README.md").write_text(_trtllm_readme(*trtllm_capture(aux, n_layers)))
    written = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] if fmt == "sglang-eagle3" else aux
    return summary(fmt, src, out, target, warnings, {"aux_layer_ids_written": written, "tensors": len(state), **extra})


def export_vllm_eagle3(src_dir, out_dir, target_name: str | None = None, *, overwrite: bool = False,
                      readme: str = "") -> dict:
    return _export_eagle3("vllm-eagle3", src_dir, out_dir, target_name, overwrite, readme)


def export_sglang_eagle3(src_dir, out_dir, target_name: str | None = None, *, overwrite: bool = False,
                      readme: str = "") -> dict:
    return _export_eagle3("sglang-eagle3", src_dir, out_dir, target_name, overwrite, readme)


def _eagle3_spec(d: dict, layer: Callable[[int], str]) -> Spec:
    h, q, kv, i_ = d["H"], d["nh"] * d["hd"], d["nkv"] * d["hd"], d["I"]
    spec: Spec = {"fc.weight": ((h, len(d["aux"]) * d["Ht"]), "float"), "norm.weight": ((h,), "float"),
                  "lm_head.weight": ((d["D"], h), "float"), "d2t": ((d["D"],), "int64"), "t2d": ((d["V"],), "bool")}
    for n in range(d["L"]):
        p, w = layer(n), 2 * h if n == 0 else h  # layer 0 attends over cat(embedding, hidden)
        spec.update({f"{p}.self_attn.q_proj.weight": ((q, w), "float"), f"{p}.self_attn.k_proj.weight": ((kv, w), "float"),
                     f"{p}.self_attn.v_proj.weight": ((kv, w), "float"), f"{p}.self_attn.o_proj.weight": ((h, q), "float"),
                     f"{p}.mlp.gate_proj.weight": ((i_, h), "float"), f"{p}.mlp.up_proj.weight": ((i_, h), "float"),
                     f"{p}.mlp.down_proj.weight": ((h, i_), "float"), f"{p}.input_layernorm.weight": ((h,), "float"),
                     f"{p}.post_attention_layernorm.weight": ((h,), "float")})
        if n == 0:
            spec[f"{p}.hidden_norm.weight"] = ((h,), "float")
    n_aux = len(d["aux"])
    if d["flags"]["norm_before_fc"]:
        spec["input_norm.weight"] = ((n_aux * d["Ht"],), "float")
    if d["flags"]["fc_norm"]:
        spec.update({f"fc_norm.{i}.weight": ((d["Ht"],), "float") for i in range(n_aux)})
    return spec


def _vocab_map_problems(tensors: dict[str, torch.Tensor], d: dict) -> list[str]:
    """d2t must map draft ids to distinct in-range target ids, exactly the ones t2d marks."""
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None or t2d is None or d2t.shape != (d["D"],) or t2d.shape != (d["V"],) or t2d.dtype != torch.bool:
        return []  # already reported by the tensor check
    ids = torch.arange(d["D"]) + d2t
    if int(ids.min()) < 0 or int(ids.max()) >= d["V"]:
        return [f"d2t maps draft ids outside the target vocabulary [0, {d['V']})"]
    problems = [] if bool((ids[1:] > ids[:-1]).all()) else ["d2t target ids are not strictly increasing (duplicates?)"]
    unmarked = int((~t2d[ids]).sum())
    if int(t2d.sum()) != d["D"] or unmarked:
        problems.append(f"d2t and t2d disagree: t2d marks {int(t2d.sum())} target ids, {unmarked} of the "
                        f"{d['D']} ids d2t maps to are unmarked")
    return problems


def _dims(config: dict, sglang: bool) -> dict:
    """The sizes the config implies, read the way each engine reads them."""
    layer = config if sglang else config["transformer_layer_config"]
    aux = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] if sglang else \
        config["eagle_aux_hidden_state_layer_ids"]
    h, nh = layer["hidden_size"], layer["num_attention_heads"]
    return {"H": h, "Ht": config.get("target_hidden_size") or h, "D": config["draft_vocab_size"],
            "V": layer["vocab_size"], "L": layer["num_hidden_layers"], "nh": nh, "I": layer["intermediate_size"],
            "nkv": layer.get("num_key_value_heads") or nh, "hd": layer.get("head_dim") or h // nh, "aux": list(aux),
            "flags": layout({} if sglang else config)}


def _sglang_problems(config: dict, d: dict) -> list[str]:
    problems = []
    if config.get("architectures") != ["LlamaForCausalLMEagle3"]:
        problems.append(f"architectures {config.get('architectures')} != ['LlamaForCausalLMEagle3']")
    if d["L"] != 1:
        problems.append(f"num_hidden_layers {d['L']} != 1 (this layout holds one midlayer)")
    if config.get("tie_word_embeddings", True) is not False:
        problems.append("tie_word_embeddings must be false (SGLang would use the embeddings as lm_head)")
    if config["eagle_config"].get("use_aux_hidden_state") is not True:
        problems.append("eagle_config.use_aux_hidden_state must be true")
    return problems


def _speculators_problems(config: dict) -> list[str]:
    problems, sc = [], config["speculators_config"]
    if config.get("speculators_model_type") != "eagle3" or sc.get("algorithm") != "eagle3":
        problems.append("speculators_model_type and speculators_config.algorithm must be 'eagle3'")
    unset = [k for k in LAYOUT_FLAGS if not isinstance(config.get(k), bool)]
    if unset:
        problems.append(f"layout flags {unset} must be given explicitly (vLLM assumes norm_before_residual=true "
                        "when absent; speculators reads all four)")
    if not config["transformer_layer_config"].get("model_type") or not config.get("architectures"):
        problems.append("transformer_layer_config.model_type and architectures are required")
    if not sc["verifier"].get("name_or_path") or int(sc["proposal_methods"][0]["speculative_tokens"]) < 1:
        problems.append("speculators_config needs verifier.name_or_path and speculative_tokens >= 1")
    return problems


def _validate_eagle3(out_dir, sglang: bool) -> list[str]:
    def check() -> list[str]:
        config, tensors = load_export(Path(out_dir), "config.json", WEIGHTS_NAME)
        d = _dims(config, sglang)
        problems = _sglang_problems(config, d) if sglang else _speculators_problems(config)
        aux = d["aux"]
        if len(aux) != 3 or len(set(aux)) != 3 or min(aux) < 0:
            problems.append(f"aux layer ids {aux}: vLLM and SGLang expect 3 distinct ids >= 0 (fc is 3*target_hidden wide)")
        elif aux != sorted(aux):
            problems.append(f"aux layer ids {aux} are not ascending: engines feed fc the layers in ascending order")
        if d["H"] != d["Ht"] and "embed_tokens.weight" not in tensors:
            problems.append(f"hidden_size {d['H']} != target_hidden_size {d['Ht']} needs the draft's own embed_tokens")
        spec = _eagle3_spec(d, (lambda n: "midlayer") if sglang else (lambda n: f"layers.{n}"))
        optional = {"embed_tokens.weight": ((d["V"], d["H"]), "float")}  # absent: the target's is shared
        problems += check_tensors(tensors, spec, optional, config.get("torch_dtype") or config.get("dtype"))
        return problems + _vocab_map_problems(tensors, d)

    return problems_of(check)


def validate_vllm_eagle3(out_dir) -> list[str]:
    return _validate_eagle3(out_dir, sglang=False)


def validate_sglang_eagle3(out_dir) -> list[str]:
    return _validate_eagle3(out_dir, sglang=True)


FORMAT_VALIDATORS = {"vllm-eagle3": validate_vllm_eagle3, "sglang-eagle3": validate_sglang_eagle3}
