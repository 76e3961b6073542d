"""EAGLE-3 heads -> vLLM speculators format (``vllm-eagle3``) and the SGLang / TensorRT-LLM layout
(``sglang-eagle3``), with their validators.

- vllm-eagle3: weights keep spectrain's names (they are the speculators names); ``config.json`` carries
  ``transformer_layer_config``, ``draft_vocab_size``, ``target_hidden_size``, an explicit
  ``norm_before_residual`` (vLLM assumes true when the key is absent) and
  ``eagle_aux_hidden_state_layer_ids`` in vLLM's convention: id L = the *input* of layer L, as spectrain
  records them.
- sglang-eagle3: ``LlamaForCausalLMEagle3`` with Llama fields; layer 0 is ``midlayer.*`` (what SGLang and
  TensorRT-LLM load; vLLM remaps it too). SGLang captures the input of layer id+1 for each explicit id
  (ids are layer *outputs*), so the ids written are spectrain's minus one. Single-layer heads only: SGLang
  (``additional_layers.*``) and TensorRT-LLM (``midlayer.{i}``) name further layers differently.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from spectrain.export.common import (
    WEIGHTS_NAME,
    Spec,
    check_out,
    check_tensors,
    dtype_name,
    load_export,
    problems_of,
    read_head,
    staged,
    summary,
    target_info,
    write_json,
)

SPECULATORS_VERSION = "0.3.0"  # the speculators config layout followed here; vLLM does not read it


def _layer_fields(cfg: dict) -> dict:
    """The draft decoder layer as Llama config fields, readable by transformers 4 and 5 alike."""
    rope = dict(cfg["rope_parameters"])
    default = rope.get("rope_type", "default") == "default"
    return {
        "model_type": "llama", "vocab_size": cfg["target_vocab_size"], "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"], "num_hidden_layers": cfg["num_layers"],
        "num_attention_heads": cfg["num_attention_heads"], "num_key_value_heads": cfg["num_key_value_heads"],
        "head_dim": cfg["head_dim"], "hidden_act": cfg.get("hidden_act", "silu"), "rms_norm_eps": cfg["rms_norm_eps"],
        "max_position_embeddings": cfg["max_position_embeddings"], "rope_theta": rope.get("rope_theta", 10000.0),
        "rope_scaling": None if default else {k: v for k, v in rope.items() if k != "rope_theta"},
        "rope_parameters": rope, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    }


def _export_eagle3(fmt: str, src_dir, out_dir, target_name: str | None, overwrite: bool) -> dict:
    src, out = Path(src_dir), Path(out_dir)
    cfg, state = read_head(src, "eagle3", fmt)
    check_out(src, out, overwrite)
    target = target_name or cfg.get("target") or ""
    tcfg, warnings = target_info(target, cfg)
    aux, dtype = list(cfg["aux_layers"]), dtype_name(state)
    written = [a - 1 for a in aux] if fmt == "sglang-eagle3" else aux
    if cfg.get("norm_before_residual", False):
        raise ValueError("this head was trained with norm_before_residual=true, which spectrain's EAGLE-3 layer "
                         "does not implement; it cannot be exported faithfully")
    if fmt == "sglang-eagle3":
        if cfg["num_layers"] != 1:
            raise ValueError(f"sglang-eagle3 takes single-layer heads (SGLang and TensorRT-LLM name further "
                             f"layers differently); this head has {cfg['num_layers']}: use --format vllm-eagle3")
        if min(aux) < 1:
            raise ValueError(f"aux layer ids {aux} include the embeddings (input of layer 0), which SGLang's "
                             "output-of-layer ids cannot express")
        state = {k.replace("layers.0.", "midlayer.", 1): v for k, v in state.items()}
        config = {**_layer_fields(cfg), "architectures": ["LlamaForCausalLMEagle3"],
                  "draft_vocab_size": cfg["draft_vocab_size"], "target_hidden_size": cfg["target_hidden_size"],
                  # SGLang captures the input of layer id+1 for each id: write output-of-layer ids
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": written,
                                   "use_aux_hidden_state": True}, "torch_dtype": dtype}
    else:
        verifier = {"name_or_path": target, "architectures": (tcfg or {}).get("architectures", [])}
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": _layer_fields(cfg),
                  "draft_vocab_size": cfg["draft_vocab_size"], "target_hidden_size": cfg["target_hidden_size"],
                  "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": aux,
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy", "verifier_accept_k": 1,
                                                               "speculative_tokens": int(cfg.get("ttt_steps", 3)),
                                                               "accept_tolerance": 0.0}],
                                         "verifier": verifier},
                  "torch_dtype": dtype, "tie_word_embeddings": False}
    with staged(out, fmt, FORMAT_VALIDATORS[fmt]) as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        write_json(tmp / "config.json", config)
    return summary(fmt, src, out, target, warnings, {"aux_layer_ids_written": written, "tensors": len(state)})


def export_vllm_eagle3(src_dir, out_dir, target_name: str | None = None, *, overwrite: bool = False) -> dict:
    return _export_eagle3("vllm-eagle3", src_dir, out_dir, target_name, overwrite)


def export_sglang_eagle3(src_dir, out_dir, target_name: str | None = None, *, overwrite: bool = False) -> dict:
    return _export_eagle3("sglang-eagle3", src_dir, out_dir, target_name, overwrite)


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
            "nkv": layer.get("num_key_value_heads") or nh, "hd": layer.get("head_dim") or h // nh, "aux": list(aux)}


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
    if not isinstance(config.get("norm_before_residual"), bool):
        problems.append("norm_before_residual must be given explicitly (vLLM assumes true when absent)")
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
