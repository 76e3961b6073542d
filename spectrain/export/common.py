"""Shared pieces of the exporters: source resolution, target checks, staged (atomic) writes and the
tensor checks every validator runs."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from spectrain import registry
from spectrain.drafters.head_io import CONFIG_NAME, WEIGHTS_NAME
from spectrain.io.integrity import seal
from spectrain.io.outputs import check_placement, write_marker
from spectrain.targets.gguf import resolve_target_path

Spec = dict[str, tuple[tuple[int, ...], str]]  # tensor name -> (shape, "float" | "int64" | "bool")


class ExportError(ValueError):
    """The written files failed validation; ``problems`` names each one."""

    def __init__(self, fmt: str, problems: list[str]):
        super().__init__(f"{fmt} export failed validation: " + "; ".join(problems))
        self.problems = problems


def resolve_source(path) -> Path:
    """A checkpoint dir (holds drafter_config.json) as is; a run dir -> its best/, else last/."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{p} is not a directory: give a run directory or a checkpoint directory")
    if (p / CONFIG_NAME).is_file():
        return p
    for sub in ("best", "last"):
        if (p / sub / CONFIG_NAME).is_file():
            return p / sub
    if (p / "config.json").is_file():
        raise ValueError(f"{p} is a plain HF model directory (no {CONFIG_NAME}): it already is a standard HF "
                         "draft model directory; there is nothing to export")
    raise ValueError(f"{p} holds neither {CONFIG_NAME} (a checkpoint) nor best/ or last/ checkpoints (a run)")


def read_config(src: Path, kind: str, fmt: str) -> dict:
    cfg = json.loads((src / CONFIG_NAME).read_text())
    have = cfg.get("kind")
    if have != kind:
        fits = list(registry.FAMILIES[have].serve.exports) if have in registry.FAMILIES else []
        hint = f"use --format {' or '.join(fits)}" if fits else "no export format takes this kind"
        raise ValueError(f"{src} holds a {have!r} drafter, but --format {fmt} exports {registry.family(kind).title}: {hint}")
    return cfg


def read_head(src: Path, kind: str, fmt: str) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = read_config(src, kind, fmt)
    return cfg, load_file(str(src / WEIGHTS_NAME))


def hf_target(name: str) -> str:
    """A GGUF target (a local .gguf file) -> its cached dequantized checkpoint (absolute), which is what the head
    was trained against and what an HF-format engine loads; any other name unchanged."""
    if name and name.endswith(".gguf") and Path(name).is_file():
        return str(Path(resolve_target_path(name)).resolve())
    return name


def target_info(name: str, cfg: dict) -> tuple[dict | None, list[str]]:
    """The target's HF config when ``name`` is a local directory (checked against the head's sizes)."""
    file = Path(name) / "config.json" if name else None
    if file is None or not file.is_file():
        return None, [f"target {name!r} is not a local model directory: target sizes not checked and the "
                      "target's architectures not recorded (pass --target with a local path to check them)"]
    full = json.loads(file.read_text())
    # multimodal targets keep the language model's sizes in text_config
    tc = {**full.get("text_config", full), "architectures": full.get("architectures", [])}
    for key, have in (("target_hidden_size", tc.get("hidden_size")), ("target_vocab_size", tc.get("vocab_size"))):
        if key in cfg and have != cfg[key]:
            raise ValueError(f"the head was trained for {key}={cfg[key]}, target {name} has {have}: wrong --target?")
    aux = cfg.get("aux_layers", [])
    if aux and max(aux) >= tc.get("num_hidden_layers", max(aux) + 1):
        raise ValueError(f"aux layers {aux} do not fit target {name} with {tc['num_hidden_layers']} layers: "
                         "wrong --target?")
    if Path(name).is_absolute():
        return tc, []
    return tc, [f"target recorded as the relative path {name!r}, which a serving machine resolves from its own "
                "working directory: pass --target with a hub id or an absolute path"]


def check_out(src: Path, out: Path, overwrite: bool) -> None:
    """The placement rules of spectrain/io/outputs.py: never the source or a directory holding it, never a
    user's or another kind's directory; an existing export only with ``overwrite`` (--force)."""
    check_placement(out, "export", [("source", src)], force=overwrite)


@contextmanager
def staged(out: Path, fmt: str, validator: Callable[[Path], list[str]], readme: str = "") -> Iterator[Path]:
    """Yield a temp dir next to ``out``; on success add ``readme`` to its README.md, validate it and swap it
    into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        if readme:  # after the exporter's own README text (sglang-eagle3: the TensorRT-LLM capture layers)
            md = tmp / "README.md"
            head = md.read_text() if md.is_file() else f"# {fmt} export by spectrain\n"
            md.write_text(head.rstrip("\n") + "\n\n" + readme.rstrip("\n") + "\n")
        write_marker(tmp, "export")  # what lets a later --force know this directory is an export
        seal(tmp)  # SHA256SUMS of every file; files 0644 / dirs 0755 (mkdtemp made it private)
        problems = validator(tmp)
        if problems:
            raise ExportError(fmt, problems)
        if out.exists():  # --force: swap, and put the old export back if the swap fails
            old = tmp.with_name(tmp.name + ".old")
            out.rename(old)
            try:
                tmp.rename(out)
            except OSError:
                old.rename(out)
                raise
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename


def summary(fmt: str, src: Path, out: Path, target: str, warnings: list[str], extra: dict | None = None) -> dict:
    files = {f.name: f.stat().st_size for f in sorted(out.iterdir()) if f.is_file() and not f.name.startswith(".")}
    return {"format": fmt, "source": str(src), "out": str(out), "target": target, "files": files,
            "warnings": warnings, **(extra or {})}


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def dtype_name(state: dict[str, torch.Tensor]) -> str:
    floats = {str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()}
    return floats.pop() if len(floats) == 1 else "float32"


def check_tensors(tensors: dict[str, torch.Tensor], spec: Spec, optional: Spec | None = None,
                   dtype: str | None = None) -> list[str]:
    """Every tensor of ``spec`` present with its shape and kind; nothing else; floats finite, one dtype."""
    problems, optional = [], optional or {}
    for name, (shape, _kind) in spec.items():
        if name not in tensors:
            problems.append(f"missing tensor {name} (expected shape {list(shape)})")
    for name, t in tensors.items():
        if name not in spec and name not in optional:
            problems.append(f"unexpected tensor {name} {list(t.shape)}: not part of the format (loaders skip or reject it)")
            continue
        shape, kind = spec.get(name) or optional[name]
        if tuple(t.shape) != shape:
            hint = " (transposed?)" if tuple(t.shape) == shape[::-1] else ""
            problems.append(f"{name} has shape {list(t.shape)}, the config implies {list(shape)}{hint}")
        want_ok = {"float": t.is_floating_point(), "int64": t.dtype == torch.int64, "bool": t.dtype == torch.bool}
        if not want_ok[kind]:
            problems.append(f"{name} has dtype {t.dtype}, expected {kind}")
        elif kind == "float" and not bool(torch.isfinite(t).all()):
            problems.append(f"{name} holds NaN or Inf values")
    floats = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()})
    if len(floats) > 1:
        problems.append(f"mixed float dtypes {floats}: save all weights in one dtype")
    elif dtype and floats and floats[0] != dtype:
        problems.append(f"config says dtype {dtype} but the weights are {floats[0]}")
    return problems


def load_export(out: Path, config_name: str, weights_name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of an export; raises ExportError naming a missing or unreadable file."""
    try:
        return json.loads((out / config_name).read_text()), load_file(str(out / weights_name))
    except (OSError, ValueError) as e:
        raise ExportError("validate", [f"cannot read {out / config_name} / {out / weights_name}: {e}"]) from e


def problems_of(check: Callable[[], list[str]]) -> list[str]:
    """Run a validator body; a config lacking a key or holding a wrong type is a problem, not a crash."""
    try:
        return check()
    except ExportError as e:
        return e.problems
    except KeyError as e:
        return [f"config.json lacks a required field: {e.args[0]!r}"]
    except (TypeError, IndexError, AttributeError, ValueError) as e:
        return [f"config.json is malformed (a field has the wrong type or shape): {e}"]


def target_embedding(name: str, vocab: int, hidden: int) -> torch.Tensor | None:
    """The target's input embedding [vocab, hidden] read from its local safetensors (None when not local)."""
    root = Path(name) if name else None
    files = sorted(root.glob("*.safetensors")) if root and root.is_dir() else []
    for f in files:
        with safe_open(str(f), "pt") as st:
            # text LMs: model.embed_tokens.weight; multimodal: model.language_model.embed_tokens.weight
            keys = [k for k in st.keys() if k.endswith("embed_tokens.weight")]
            for k in keys:
                t = st.get_tensor(k)
                if tuple(t.shape) == (vocab, hidden):
                    return t
    return None


def rope_keys(rope: dict) -> dict:
    """One RoPE in both config styles: transformers 5 reads ``rope_parameters``, transformers 4.x (and engines
    built on it) ``rope_theta`` + ``rope_scaling`` (None for plain RoPE, else the scaling fields with rope_type)."""
    rope = dict(rope)
    rope.setdefault("rope_type", "default")
    scaling = None if rope["rope_type"] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"rope_theta": rope.get("rope_theta", 10000.0), "rope_scaling": scaling, "rope_parameters": rope}
