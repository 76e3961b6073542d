"""How engines serve a separate draft model, as the family's record names it (``serve.command``): an HF model
directory every engine loads as a standalone draft. Pure string building (no torch); the engine lines:
spectrain/recipe/deploy.py. Its training-side hooks: draft_lm_checks.py."""

from __future__ import annotations

from spectrain.recipe.deploy import (
    Decode,
    ServeCommand,
    sglang_command,
    static_tree_note,
    trtllm_command,
    vllm_command,
)


def serve_command(engine: str, target: str, model_dir: str, d: Decode, head: dict) -> ServeCommand:
    """The engine's separate-draft-model command (the evaluated tree is served as a chain, with a note)."""
    if engine == "vllm":
        cmd = vllm_command("draft_model", target, model_dir, d.k)
    elif engine == "sglang":
        cmd = sglang_command("STANDALONE", target, model_dir, d.k, 1, d.k)
    else:
        cmd = trtllm_command("pytorch", target, {"decoding_type": "DraftTarget", "max_draft_len": d.k,
                                                 "speculative_model": model_dir})
    if d.tree:
        cmd.notes.append(static_tree_note(engine, d, "is spectrain's own draft-model tree (top-m first tokens, "
                                                     "each extended greedily)"))
    return cmd
