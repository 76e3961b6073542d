"""sha256 manifests: every checkpoint directory and every export carries ``SHA256SUMS`` (the
``sha256sum`` format, so ``sha256sum -c SHA256SUMS`` checks it without spectrain) listing every file in it.

``seal(dir)`` writes it (last, once every other file is in place) and makes the tree readable by other
users (files 0644, dirs 0755, minus the umask); ``verify(dir)`` refuses a directory whose files differ
from it, naming the file; resume, ``load_drafter``, ``spectrain eval`` and ``spectrain export`` call it.
A spectrain checkpoint or head without a manifest is refused (``spectrain seal DIR`` for one you trust,
or SPECTRAIN_ALLOW_UNSEALED=1); any other directory without one (an HF model) is accepted with a warning; a manifest that lists a missing file, or a weight / pickle file the manifest does not list, is
refused: spectrain wrote neither. A manifest names only relative paths inside its directory (no absolute
path, no ``..``), and a symlink in the directory that points outside it is refused: nothing outside the
directory is ever read, hashed or copied on its behalf.
"""

from __future__ import annotations

import hashlib
import os
import stat
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MANIFEST = "SHA256SUMS"
# Files that hold tensors or pickles: one that the manifest does not list was not written by spectrain.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".npy", ".npz")


class IntegrityError(ValueError):
    """A file differs from the directory's SHA256SUMS (or should not be there)."""


def sha256(path: Path) -> str:
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait forever for a writer; fstat then refuses it
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IntegrityError(_not_regular(Path(path), os.stat(path).st_mode))
    h = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> list[str]:
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            rel = (Path(dirpath) / n).relative_to(root).as_posix()
            if rel != MANIFEST and not n.startswith(f".{MANIFEST}"):
                out.append(rel)
    return sorted(out)


def link_inside(link: Path, root: Path) -> bool:
    """``link`` resolves to an existing file inside ``root`` (or, for a Hugging Face cache snapshot
    ``.../snapshots/<rev>/``, inside that repository's ``blobs/``, where the hub cache keeps the files)."""
    base, t = root.resolve(), link.resolve()
    bases = [base] + ([base.parent.parent / "blobs"] if base.parent.name == "snapshots" else [])
    return t.exists() and any(b in t.parents for b in bases)


def outside_links(root: Path) -> list[str]:
    """Symlinks under ``root`` whose target lies outside it (or dangles): spectrain never writes one."""
    out = []
    for dirpath, dirs, names in os.walk(root):
        for n in names + dirs:
            p = Path(dirpath) / n
            if p.is_symlink():
                if not link_inside(p, Path(root)):
                    out.append(f"{p} is a symbolic link to {os.readlink(p)}, outside {root}: spectrain never writes "
                               "one (it would read another file of yours); replace it with the file itself")
    return out


_KINDS = ((stat.S_ISFIFO, "named pipe (FIFO)"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"))


def _not_regular(p: Path, mode: int) -> str:
    kind = next((name for test, name in _KINDS if test(mode)), "special file")
    return (f"{p} is a {kind}, not a regular file: spectrain reads only regular files (reading it could wait "
            "forever); remove it from the directory")


def special_files(root: Path) -> list[str]:
    """Entries under ``root`` (links followed) that are neither regular files nor directories: FIFOs, sockets,
    devices. Hashing or loading one could block forever, so they are refused before anything is read."""
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            try:
                mode = os.stat(Path(dirpath) / n).st_mode  # follows a link: a link to a FIFO is one too
            except OSError:  # a dangling link: outside_links names it
                continue
            if not stat.S_ISREG(mode):
                out.append(_not_regular(Path(dirpath) / n, mode))
    return out


def _inside(rel: str) -> bool:
    """A manifest entry names a file inside its directory: relative, no '..', no empty or '.' parts."""
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and "\\" not in rel and not any(x in ("", ".", "..") for x in parts)


def make_readable(root: Path) -> None:
    """Files 0644 and dirs 0755 minus the umask (tempfile.mkdtemp creates 0700, which a serving engine
    running as another user cannot read)."""
    mask = os.umask(0)
    os.umask(mask)
    for dirpath, _dirs, names in os.walk(root):
        os.chmod(dirpath, 0o755 & ~mask)
        for n in names:
            p = Path(dirpath) / n
            if not p.is_symlink():
                os.chmod(p, 0o644 & ~mask)


def seal(root, readable: bool = True) -> Path:
    """Write ``root/SHA256SUMS`` over every file under ``root`` and (``readable``) make the tree readable."""
    root = Path(root)
    links = outside_links(root) + special_files(root)
    if links:
        raise IntegrityError(f"cannot seal {root}: {links[0]}")
    lines = [f"{sha256(root / rel)}  {rel}\n" for rel in _files(root)]
    tmp = root / f".{MANIFEST}.tmp{os.getpid()}"
    tmp.write_text("".join(lines))
    os.replace(tmp, root / MANIFEST)
    if readable:
        make_readable(root)
    return root / MANIFEST


def read_manifest(root: Path) -> dict[str, str] | None:
    f = root / MANIFEST
    if not f.is_file():
        return None
    out = {}
    for i, line in enumerate(f.read_text().splitlines(), 1):
        digest, sep, rel = line.partition("  ")
        if not sep or len(digest) != 64 or not rel:
            raise IntegrityError(f"{f} line {i} is malformed (expected '<sha256>  <file>'): the manifest itself is "
                                 "damaged; re-download or re-create the directory")
        rel = rel.lstrip("*")
        if not _inside(rel):
            raise IntegrityError(f"{f} line {i} names {rel!r}, a path outside its directory (absolute or with '..'): "
                                 "a manifest lists only files inside its own directory; it was damaged or tampered "
                                 "with, so re-create the directory from a good copy")
        out[rel] = digest
    return out


def problems(root) -> list[str]:
    """What is wrong with ``root`` against its manifest ([] = verified, or no manifest to verify)."""
    root = Path(root)
    listed, out, odd = read_manifest(root), outside_links(root), special_files(root)
    if listed is None or odd:  # a FIFO is never hashed (it would block): nothing more is read
        return out + odd
    for rel, digest in listed.items():
        p = root / rel
        if not p.is_file():
            out.append(f"{p} is listed in {MANIFEST} but missing")
        elif sha256(p) != digest:
            out.append(f"{p} is corrupt: its sha256 differs from {root / MANIFEST}")
    for rel in _files(root):
        if rel not in listed and rel.endswith(WEIGHT_SUFFIXES):
            out.append(f"{root / rel} is not listed in {root / MANIFEST}: spectrain did not write it")
    return out


def unreadable(root) -> list[str]:
    """safetensors files under ``root`` whose header does not parse or does not fit the file (truncated):
    checked with or without a manifest, so the error names the file instead of a library's raw message."""
    from safetensors import safe_open

    out = []
    for p in sorted(Path(root).rglob("*.safetensors")):
        try:
            with safe_open(str(p), framework="pt") as f:
                list(f.keys())
        except Exception as e:  # SafetensorError (header), OSError
            out.append(f"{p} is truncated or not a safetensors file ({' '.join(str(e).split())[:120]})")
    return out


ALLOW_UNSEALED_ENV = "SPECTRAIN_ALLOW_UNSEALED"


def allow_unsealed() -> bool:
    return os.environ.get(ALLOW_UNSEALED_ENV, "").strip().lower() not in ("", "0", "false", "no")


def verify(root, what: str = "directory", fix: str = "", warn_missing: bool = True, required: bool = False) -> bool:
    """Refuse ``root`` when a file differs from its manifest (IntegrityError naming the file and ``fix``);
    True when verified. Without a manifest: ``required`` (a spectrain checkpoint or head, which always carries
    one) refuses it, naming ``spectrain seal`` and SPECTRAIN_ALLOW_UNSEALED=1; otherwise False (with a warning
    unless ``warn_missing`` is off)."""
    root = Path(root)
    found = problems(root) or unreadable(root)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise IntegrityError(f"{what} {root} failed its integrity check: {found[0]}{more}; "
                             f"{fix or 'restore it from a good copy or re-create it'}")
    if read_manifest(root) is None:
        if required and not allow_unsealed():
            raise IntegrityError(f"{what} {root} has no {MANIFEST}, so its files cannot be checked (every checkpoint "
                                 "and head spectrain writes carries one; this one lost it or was made elsewhere): "
                                 f"if you trust it, seal it with `spectrain seal {root}`, or set "
                                 f"{ALLOW_UNSEALED_ENV}=1 to use it unchecked")
        if not warn_missing:
            return False
        warnings.warn(f"{what} {root} has no {MANIFEST} (saved outside spectrain's checkpointing and export, e.g. "
                      "save_pretrained directly, by an older spectrain or another tool): its files cannot be "
                      "checked for corruption", stacklevel=2)
        return False
    return True


_DEFERRED = []  # non-empty while a caller (a checkpoint save) seals the whole directory itself afterwards


@contextmanager
def deferred_seal() -> Iterator[None]:
    """Inside: ``seal_head`` does nothing (the caller seals once, over every file, at the end)."""
    _DEFERRED.append(True)
    try:
        yield
    finally:
        _DEFERRED.pop()


def seal_head(path) -> None:
    """Seal a head directory that ``save_pretrained`` just wrote (file modes left alone)."""
    if not _DEFERRED:
        seal(path, readable=False)


def add_seal_args(p):
    p.add_argument("dirs", nargs="+", metavar="DIR", help="checkpoint or head directories you trust")
    return p


def main(args) -> int:
    return seal_command(args.dirs)


def seal_command(dirs: list[str]) -> int:
    """`spectrain seal DIR ...`: write SHA256SUMS for directories you trust. A directory whose files differ
    from an existing manifest is refused (sealing would bless the damage); unreadable weights and links out of
    the directory are refused too. File modes are left as they are."""
    for d in map(Path, dirs):
        if not d.is_dir():
            raise FileNotFoundError(f"{d} is not a directory: give a checkpoint or head directory to seal")
        bad = problems(d) if read_manifest(d) is not None else outside_links(d) + special_files(d)
        bad = bad or unreadable(d)
        if bad:
            raise IntegrityError(f"cannot seal {d}: {bad[0]}; restore the file from a good copy (or, for a "
                                 f"manifest you know is stale, delete {d / MANIFEST} first)")
        if read_manifest(d) is not None:
            print(f"{d}: already sealed, every file matches {MANIFEST}")
            continue
        n = len(_files(d))
        seal(d, readable=False)
        print(f"sealed {d}: {n} files listed in {d / MANIFEST}")
    return 0


def untrusted_file(path: Path, st: os.stat_result) -> str | None:
    """Why a cached file cannot be trusted: another user owns it, or its group or others can write it (a shared
    cache directory), so someone else could have put what spectrain would load or run as you."""
    if st.st_uid != os.getuid():
        return f"{path} belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022 and not stat.S_ISLNK(st.st_mode):  # a link's own mode bits mean nothing
        return f"{path} is writable by its group or by other users"
    return None


def untrusted_entries(root: Path) -> list[str]:
    """``untrusted_file`` over ``root`` and everything under it (links not followed: a link is judged by its owner,
    and outside_links judges where it points)."""
    root, out = Path(root), []
    for dirpath, dirs, names in os.walk(root):
        for p in ([root] if dirpath == str(root) else []) + [Path(dirpath) / n for n in dirs + names]:
            why = untrusted_file(p, p.lstat())
            if why:
                out.append(why)
    return out


def untrusted_pickles(root, allowed: tuple[str, ...]) -> list[Path]:
    """Pickle-format files under ``root`` whose names are not in ``allowed`` (regex-free prefixes)."""
    root = Path(root)
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".pkl", ".pickle")
                  and not p.name.startswith(allowed)) if root.is_dir() else []

