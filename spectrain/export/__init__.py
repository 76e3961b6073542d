"""`spectrain export RUN_OR_CKPT --format F --out DIR [--target T] [--force]`: one pure function per
serving format (``export_<fmt>(src_dir, out_dir, target_name) -> summary``) and one validator per format
(``validate_<fmt>(out_dir) -> problems``) that re-reads the files and checks every tensor the config implies.

| format          | for                                   | module     |
|-----------------|---------------------------------------|------------|
| `vllm-eagle3`   | vLLM (speculators format)             | eagle3.py  |
| `sglang-eagle3` | SGLang, TensorRT-LLM (EAGLE-3 "HF")   | eagle3.py  |
| `vllm-medusa`   | vLLM Medusa                           | medusa.py  |
| `medusa`        | TensorRT-LLM / original Medusa        | medusa.py  |
| `hf-draft`      | any engine's separate draft model     | hf_draft.py|
| `llama.cpp-eagle3`, `llama.cpp-draft` (`llama.cpp`: by the source's family) | llama.cpp (`llama-server`), GGUF | llama_cpp.py |

Every exporter writes into a temporary sibling of ``out_dir``, validates it, and only then renames it into
place: an invalid export never lands, and ``--force`` replaces an existing directory only with a valid one.

The export's README.md and the command's output give the serve command of each engine that loads the
format, with the speculative settings of ``--k K`` / ``--tree topk=,depth=,total=`` (as ``spectrain eval``
took them; spectrain/export/serving.py maps them onto each engine's flags).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from spectrain import registry
from spectrain.export.common import ExportError, hf_target, read_config, resolve_source
from spectrain.export.eagle3 import (
    export_sglang_eagle3,
    export_vllm_eagle3,
    validate_sglang_eagle3,
    validate_vllm_eagle3,
)
from spectrain.export.hf_draft import export_hf_draft, validate_hf_draft
from spectrain.export.llama_cpp import GGUF_TYPES
from spectrain.export.medusa import export_medusa, export_vllm_medusa, validate_medusa, validate_vllm_medusa
from spectrain.export.serving import (
    ENGINE_NAMES,
    ENGINES,
    parse_tree,
    readme_section,
    resolve_decode,
    serve_commands,
)
from spectrain.io.errors import writing
from spectrain.io.integrity import problems
from spectrain.io.outputs import guard_export

__all__ = ["formats", "ExportError", "add_export_args", "export", "main", "resolve_source", "validate",
           "export_vllm_eagle3", "export_sglang_eagle3", "export_vllm_medusa", "export_medusa",
           "export_hf_draft", "validate_vllm_eagle3", "validate_sglang_eagle3", "validate_vllm_medusa",
           "validate_medusa", "validate_hf_draft"]


def _format(fmt: str) -> tuple[Callable[..., dict], Callable[..., list[str]]]:
    fam = registry.format_family(fmt)
    if fam is None:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(formats())}")
    exporter, validator = fam.serve.exports[fmt]
    return registry.resolve(exporter), registry.resolve(validator)


def engine_format(src: Path, fmt: str) -> str:
    """``llama.cpp`` -> the llama.cpp format of the source's family (its ``llama.cpp-*`` export), or why none."""
    if fmt != "llama.cpp":
        return fmt
    kind = json.loads((src / "drafter_config.json").read_text()).get("kind", "")
    fam = registry.family(kind)
    found = [f for f in fam.serve.exports if f.startswith("llama.cpp-")]
    if not found:
        raise ValueError(f"llama.cpp serves no {fam.title}: it has EAGLE-3 heads, draft models and n-gram modes "
                         f"(no Medusa); export {src} with --format {' or '.join(fam.serve.exports)} for another engine")
    return found[0]


def formats() -> list[str]:
    """Every export format of every registered family (spectrain/registry.py)."""
    return [fmt for fam in registry.FAMILIES.values() for fmt in fam.serve.exports]


def export(source, fmt: str, out, target: str | None = None, force: bool = False, k: int | None = None,
           tree: dict | None = None, engines: tuple[str, ...] | None = None, gguf_type: str | None = None) -> dict:
    """Resolve a run or checkpoint dir, export it as ``fmt`` into ``out`` (validated before it lands), with the
    serve commands for a chain of ``k`` or a ``tree`` (summary["serve"], and the export's README.md);
    ``gguf_type``: the llama.cpp GGUF's weight type (f32 when not given)."""
    src = resolve_source(source)
    fmt = engine_format(src, fmt)
    exporter, gguf = _format(fmt)[0], fmt.startswith("llama.cpp-")
    if gguf_type and not gguf:
        raise ValueError(f"--gguf-type is the llama.cpp GGUF's weight type; --format {fmt} writes no GGUF "
                         "(use --format llama.cpp, or drop --gguf-type)")
    dest = guard_export(src, out, force, target)
    head = read_config(src, registry.format_family(fmt).kind, fmt)  # a drafter of the wrong kind fails here, naming the format
    d = resolve_decode(head, k, tree)
    # llama-server's draft length is the evaluated k (it has no tree), in the line the GGUF export prints
    extra = {"k": d.k, **({"gguf_type": gguf_type} if gguf_type else {})} if gguf else {}
    commands = serve_commands(fmt, head, str(dest), hf_target(target or head.get("target") or ""), d, engines)
    with writing(out, remove=False):  # names --out in a disk-full message (the staged temp dir is removed)
        summary = exporter(src, dest, target, overwrite=force, readme=readme_section(commands, d.label), **extra)
    return {**summary, "serve": commands, "decode": d.label}


def validate(fmt: str, out) -> list[str]:
    """Problems of ``out`` as a ``fmt`` directory: the wrong kind of directory, files that differ from its
    SHA256SUMS, then the format's own checks ([] = valid)."""
    misfit = _misfit(fmt, Path(out))
    return [misfit] if misfit else problems(out) + _format(fmt)[1](Path(out))


def _misfit(fmt: str, out: Path) -> str | None:
    """The real mistake when ``out`` is not a ``fmt`` export at all (a checkpoint, another format's export)."""
    if not out.is_dir():
        return f"{out} is not a directory"
    if any((out / f).is_file() for f in ("trainer_state.json", "best.json")) or \
            ((out / "drafter_config.json").is_file() and not (out / "config.json").is_file()):
        return (f"{out} is a spectrain training checkpoint, not a {fmt} export: write one with "
                f"`spectrain export {out} --format {fmt} --out DIR`")
    try:
        cfg = json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else {}
    except ValueError:
        return None  # the format's validator names the malformed file
    arch = " ".join(map(str, cfg.get("architectures") or []))
    found = ("vllm-eagle3" if cfg.get("speculators_model_type") == "eagle3" else "sglang-eagle3" if "Eagle3" in arch
             else "vllm-medusa" if cfg.get("model_type") == "medusa" else "medusa" if "medusa_num_heads" in cfg
             else "hf-draft" if arch else None)
    if found in formats() and found != fmt and not {found, fmt} <= {"hf-draft"}:
        return f"{out} is a {found} export, not {fmt}: validate it with --format {found}"
    return None


def add_export_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("source", help="run dir (its best/, else last/) or checkpoint dir with drafter_config.json; "
                                  "with --validate-only: an exported directory")
    p.add_argument("--format", required=True, choices=[*formats(), "llama.cpp"],
                   help="serving format (llama.cpp: the llama.cpp GGUF of the source's family)")
    p.add_argument("--out", help="output directory (must not exist unless --force)")
    p.add_argument("--target", help="target model name/path written into the export (default: the one the "
                                    "drafter was trained on); a local directory also lets export check sizes")
    p.add_argument("--force", action="store_true", help="replace an existing --out once the new export validates")
    p.add_argument("--validate-only", action="store_true", help="only validate SOURCE as a --format directory")
    p.add_argument("--k", type=int, default=None,
                   help="draft length the serve command uses, as evaluated with `spectrain eval --k` (default: the "
                        "head's training length: EAGLE-3 ttt_steps, Medusa num_heads; 5 for a draft model)")
    p.add_argument("--tree", default=None, help="tree the serve command uses, as evaluated with `spectrain eval "
                                                "--tree`, e.g. topk=4,depth=5,total=32 (overrides --k with depth)")
    p.add_argument("--gguf-type", choices=GGUF_TYPES, default=None,
                   help="--format llama.cpp: the GGUF's weight type (default f32); a drafter quantized like its "
                        "target costs the engine less per drafted token")
    p.add_argument("--engine", action="append", choices=list(ENGINES), default=None,
                   help="print the serve command of this engine only (default: every engine that loads --format); "
                        "repeatable")
    return p


def main(args: argparse.Namespace) -> int:
    if args.validate_only:
        problems = validate(args.format, args.source)
        for prob in problems:
            print(f"spectrain export: {args.source}: {prob}", file=sys.stderr)
        print(f"{args.source}: {'INVALID' if problems else 'valid'} {args.format} directory")
        return 2 if problems else 0
    if not args.out:
        raise ValueError("--out DIR is required (the directory to write the export to)")

    tree = parse_tree(args.tree) if args.tree else None
    try:
        summary = export(args.source, args.format, args.out, args.target, args.force, args.k, tree,
                         tuple(args.engine or ()), args.gguf_type)
    except ExportError as e:
        print(f"spectrain export: error: the {args.format} export did not validate; nothing was written "
              f"to {args.out}:", file=sys.stderr)
        for prob in e.problems:
            print(f"  - {prob}", file=sys.stderr)
        return 2
    for w in summary["warnings"]:
        print(f"spectrain export: warning: {w}", file=sys.stderr)
    size = sum(summary["files"].values())
    print(f"wrote {summary['format']} export of {summary['source']} to {summary['out']} "
          f"({len(summary['files'])} files, {size / 2**20:.1f} MiB), validated: OK")
    if "embed_tokens_bytes" in summary:
        print(f"  includes the target's embed_tokens.weight ({summary['embed_tokens_bytes'] / 2**20:.1f} MiB) so the "
              "speculators package computes the same logits; vLLM/SGLang would share the target's anyway")
    print(f"\nserve it ({summary['decode']}; also in {Path(summary['out']) / 'README.md'}):")
    if summary.get("serve_line"):  # llama.cpp-*: a GGUF for llama-server (spectrain/export/llama_cpp.py)
        print(f"\n# llama.cpp (llama-server)\n{summary['serve_line']}")
    for cmd in summary["serve"]:
        print(f"\n# {ENGINE_NAMES[cmd.engine]}\n{cmd.text()}")
        for note in cmd.notes:
            print(f"# note: {note}")
    return 0
