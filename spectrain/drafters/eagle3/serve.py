"""How engines serve an EAGLE-3 head, as the family's record names it: which layouts each engine's EAGLE-3 layer
computes (``serve.engine_problems``, applied to a recipe's ``deploy.engine`` before any training and to the
sglang-eagle3 export), the command each engine takes (``serve.command``) and the draft length served
(``serve.k``). Pure facts and string building (no torch); the engine lines: spectrain/recipe/deploy.py."""

from __future__ import annotations

from spectrain.recipe.deploy import (
    ENGINE_NAMES,
    Decode,
    ServeCommand,
    sglang_command,
    static_tree_note,
    to_layer_outputs,
    trtllm_command,
    vllm_command,
)


def engine_problems(engine: str, flags: dict[str, bool], sliding: bool = False, num_layers: int = 1,
                    aux: list[int] | None = None) -> list[str]:
    """Why ``engine``'s EAGLE-3 layer cannot compute this layout ([] = it can)."""
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


def serve_command(engine: str, target: str, model_dir: str, d: Decode, head: dict) -> ServeCommand:
    """The engine's command for an EAGLE-3 export: TensorRT-LLM also needs the capture layers (layer outputs)."""
    capture = to_layer_outputs(sorted(head.get("aux_layers") or [])) or None
    t = d.tree
    if engine == "vllm":
        cmd = vllm_command("eagle3", target, model_dir, d.k)
        if t:
            cmd.notes.append(static_tree_note("vllm", d, "vLLM does not implement (its speculative_token_tree "
                                                         "is a static tree literal)"))
        return cmd
    if engine == "sglang":
        return sglang_command("EAGLE3", target, model_dir, d.k, t["topk"] if t else 1, t["total_tokens"] if t else d.k)
    spec = {"decoding_type": "Eagle3", "max_draft_len": d.k, "speculative_model": model_dir}
    if capture is not None:
        spec["eagle3_layers_to_capture"] = capture
    if t:
        spec.update(use_dynamic_tree=True, dynamic_tree_max_topK=t["topk"], max_total_draft_tokens=t["total_tokens"])
    return trtllm_command("pytorch", target, spec)


def serve_k(head: dict, k: int | None) -> int:
    """Served draft length: --k, else the TTT depth the head was trained for."""
    return int(head.get("ttt_steps", 3)) if k is None else k
