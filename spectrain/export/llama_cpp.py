"""GGUF files llama.cpp serves: EAGLE-3 heads (``llama.cpp-eagle3``) and draft models (``llama.cpp-draft``).

Both go through the engine's own converter (``convert_hf_to_gguf.py`` of the pinned llama.cpp that
`spectrain engine fetch llama.cpp` builds), from the ``vllm-eagle3`` / ``hf-draft`` export, and the GGUF's
metadata is read back before the export lands. Facts from that converter (llama.cpp 0c1e570,
``conversion/llama.py``): EAGLE-3 mode starts when the config has ``draft_vocab_size`` and one layer (line 50);
the aux ids are the top-level ``eagle_aux_hidden_state_layer_ids``, read verbatim as "input of layer k" and
silently replaced by [2, L//2, L-3] when absent (lines 77-80); ``norm_before_residual`` and
``norm_before_fc`` are carried (lines 96-104); ``d2t`` is stored as offsets, ``t2d`` dropped (modify_tensors).
The engine feeds the draft layer's pre-norm output back at the next step, so a head trained with
``norm_output`` (the normed state fed back) or ``fc_norm`` (one norm per aux state: no tensor mapping)
computes another function there: such heads are refused, naming the recipe key that trains a servable one.
llama.cpp has no Medusa.

The serve line the export prints (and writes to its README.md):

    llama-server -m TARGET.gguf -md OUT/model.gguf --spec-type draft-eagle3 --spec-draft-n-max K -np 1
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spectrain import registry
from spectrain.engines import llama_cpp
from spectrain.export.common import check_out, read_config, staged, summary
from spectrain.export.eagle3 import export_vllm_eagle3
from spectrain.export.hf_draft import export_hf_draft
from spectrain.export.serving import resolve_decode
from spectrain.targets.gguf import resolve_target_path

GGUF_NAME = "model.gguf"
# the converter's --outtype values a drafter may take: its weights beside a quantized target cost the engine less
# than fp32 (the largest tensors take the type; norms stay f32)
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
NOT_COMPUTED = {"norm_output": "llama.cpp feeds the draft layer's pre-norm output to the next step",
                "fc_norm": "llama.cpp has no tensor for per-aux-state norms (the converter maps no fc_norm.*)"}


@dataclass(frozen=True)
class GGUFFormat:
    """What differs between the two llama.cpp formats (one per family that llama.cpp can serve)."""

    hf_export: Callable  # the HF-layout export the converter reads
    spec_type: str  # llama-server --spec-type
    needs_target_dir: bool  # the converter reads the target's config / tokenizer (EAGLE-3 heads)
    refused: Callable[[dict], list[str]]  # layouts the engine cannot compute
    architecture: str | None  # general.architecture the GGUF must name (None: any)


def refused_layout(cfg: dict) -> list[str]:
    return [f"{k}: {why}" for k, why in NOT_COMPUTED.items() if cfg.get(k)]


FORMATS = {
    "llama.cpp-eagle3": GGUFFormat(export_vllm_eagle3, "draft-eagle3", True, refused_layout, "eagle3"),
    "llama.cpp-draft": GGUFFormat(export_hf_draft, "draft-simple", False, lambda cfg: [], None),
}


def _target_dir(target: str) -> Path:
    """The target's local HF directory; a GGUF target -> its cached dequantized checkpoint."""
    if not target:
        raise ValueError("the head records no target: pass --target (the target's .gguf file or HF directory)")
    local = Path(resolve_target_path(target)) if target.endswith(".gguf") or Path(target).is_dir() else None
    if local is None or not (local / "config.json").is_file():
        raise ValueError(f"target {target!r} is not a local model directory or .gguf file: llama.cpp's converter "
                         "reads the target's config.json and tokenizer; pass --target with a local path")
    return local


def _convert(hf_dir: Path, out_file: Path, target_dir: Path | None, gguf_type: str = "f32") -> None:
    engine = llama_cpp.require()
    # -B: no __pycache__ written into the verified engine entry (umask-made, group-writable dirs would be refused)
    cmd = [sys.executable, "-B", str(engine.converter), str(hf_dir), "--outtype", gguf_type, "--outfile",
           str(out_file)]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        log = out_file.with_suffix(".convert.log")
        log.write_text(done.stdout + done.stderr)
        missing = "ModuleNotFoundError" in done.stderr
        hint = ("the converter's Python packages are missing: pip install 'spectrain[llama-cpp]'" if missing
                else f"see {log}")
        raise RuntimeError(f"llama.cpp's convert_hf_to_gguf.py failed (exit {done.returncode}): "
                           f"{(done.stderr.strip().splitlines() or ['no output'])[-1][:200]}; {hint}")


def read_gguf_meta(path: Path) -> tuple[dict, list[str], str]:
    """(metadata key -> python value, tensor names, the storage type of the largest tensor) of a GGUF file."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    meta = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name != "tokenizer.ggml.model":
            continue
        try:
            meta[name] = field.contents()
        except Exception:  # a field type this gguf version cannot render: not one spectrain checks
            continue
    largest = max(reader.tensors, key=lambda t: int(t.n_elements), default=None)
    return meta, [t.name for t in reader.tensors], largest.tensor_type.name.lower() if largest else "none"


def gguf_problems(path: Path, fmt: str, cfg: dict | None, gguf_type: str | None = None) -> list[str]:
    """What the written GGUF says differently from the head it was converted from, or from the storage type it
    was asked for ([] = it matches)."""
    meta, tensors, stored = read_gguf_meta(path)
    arch, want_arch = meta.get("general.architecture"), FORMATS[fmt].architecture
    if not arch or (want_arch and arch != want_arch):
        return [f"general.architecture = {arch!r}, {fmt} needs {want_arch or 'one'}"]
    if gguf_type and stored != gguf_type:
        return [f"the largest tensor is stored as {stored}, --gguf-type asked for {gguf_type}"]
    if cfg is None or not want_arch:  # --validate-only, or a draft model (an ordinary LM: nothing head-specific)
        return []
    want = {"general.architecture": "eagle3", "eagle3.target_layers": list(cfg["aux_layers"]),
            "eagle3.target_hidden_size": cfg["target_hidden_size"],
            "eagle3.norm_before_residual": bool(cfg.get("norm_before_residual")),
            "eagle3.norm_before_fc": bool(cfg.get("norm_before_fc"))}
    problems = [f"{k} = {meta.get(k)!r}, the head has {v!r}" for k, v in want.items() if meta.get(k) != v]
    if "d2t" not in tensors and cfg["draft_vocab_size"] != cfg["target_vocab_size"]:
        problems.append("no d2t tensor: the engine would read draft ids as target ids")
    return problems


def serve_line(target: str, model: Path, spec_type: str, k: int) -> str:
    return (f"llama-server -m {shlex.quote(target)} -md {shlex.quote(str(model))} --spec-type {spec_type} "
            f"--spec-draft-n-max {k} --spec-draft-p-min 0 -np 1")


def _export(fmt: str, src_dir, out_dir, target_name: str | None, overwrite: bool, readme: str,
            gguf_type: str = "f32", k: int | None = None) -> dict:
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"--gguf-type {gguf_type!r}: choose one of {', '.join(GGUF_TYPES)}")
    src, out, form = Path(src_dir), Path(out_dir), FORMATS[fmt]
    cfg = read_config(src, registry.format_family(fmt).kind, fmt)
    check_out(src, out, overwrite)
    bad = form.refused(cfg)
    if bad:
        raise ValueError(f"llama.cpp cannot compute this EAGLE-3 head exactly ({'; '.join(bad)}): train it with "
                         "drafter.eagle3.norm_output=false drafter.eagle3.fc_norm=false to serve it in llama.cpp")
    target = target_name or cfg.get("target") or ""
    tdir = _target_dir(target)
    gguf_target = target if target.endswith(".gguf") else "TARGET.gguf"
    k = resolve_decode(cfg, k).k  # the family's served length unless given (spectrain export's --k / --tree depth)
    line = serve_line(gguf_target, out.resolve() / GGUF_NAME, form.spec_type, k)
    with tempfile.TemporaryDirectory(prefix=".llama-cpp-", dir=out.parent if out.parent.exists() else None) as t:
        hf = Path(t) / "hf"
        form.hf_export(src, hf, str(tdir))

        def validate(d: Path) -> list[str]:
            return validate_llama_cpp(d, fmt, cfg, gguf_type)

        text = (f"# {fmt} export by spectrain\n\nServe it with the llama.cpp that `spectrain engine fetch llama.cpp` "
                f"built ({llama_cpp.require().version}):\n\n    {line}\n\n{readme}")
        with staged(out, fmt, validate, text) as tmp:
            _convert(hf, tmp / GGUF_NAME, tdir if form.needs_target_dir else None, gguf_type)
    return {**summary(fmt, src, out, target, [], {"gguf": str(out / GGUF_NAME), "serve_line": line,
                                                  "gguf_type": gguf_type}),
            "aux_layer_ids_written": cfg.get("aux_layers")}


def validate_llama_cpp(out_dir, fmt: str, cfg: dict | None = None, gguf_type: str | None = None) -> list[str]:
    path = Path(out_dir) / GGUF_NAME
    return gguf_problems(path, fmt, cfg, gguf_type) if path.is_file() else [f"{path} is missing"]


def export_llama_cpp_eagle3(src_dir, out_dir, target_name: str | None = None, *, overwrite: bool = False,
                            readme: str = "", gguf_type: str = "f32", k: int | None = None) -> dict:
    return _export("llama.cpp-eagle3", src_dir, out_dir, target_name, overwrite, readme, gguf_type, k)


def export_llama_cpp_draft(src_dir, out_dir, target_name: str | None = None, *, overwrite: bool = False,
                           readme: str = "", gguf_type: str = "f32", k: int | None = None) -> dict:
    return _export("llama.cpp-draft", src_dir, out_dir, target_name, overwrite, readme, gguf_type, k)


def validate_llama_cpp_eagle3(out_dir) -> list[str]:
    return validate_llama_cpp(out_dir, "llama.cpp-eagle3")


def validate_llama_cpp_draft(out_dir) -> list[str]:
    return validate_llama_cpp(out_dir, "llama.cpp-draft")
