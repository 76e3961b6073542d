"""Output directories that are safe to point anywhere: checked before any work, written into a temp
sibling, swapped in atomically (``--force`` replaces, never mixes), readable by other users.

Used by checkpoints (``best/``, ``init/``), ``spectrain eval --out`` and ``spectrain export --out``; the
one-file outputs (``regenerate --out``, ``plot --out``, ``agreement --out``) by ``check_file_placement``.

Placement rules (``check_placement``, run by every writing command before it touches anything): never
``/``, the home directory or one of its ancestors; never an input (target, drafter, source, data) nor a
directory holding one; never inside a checkpoint; an existing non-empty directory only when it is
spectrain's output of the same kind (its ``.spectrain-output`` marker, or the files an older spectrain
wrote), and ``--force`` replaces only such a directory. A run directory is locked (``.spectrain-lock``:
pid + host) while a process writes it; temp entries are removed only when spectrain recorded their
names (``.spectrain-temps``); files are written by temp file + rename or ``O_NOFOLLOW``, never through a
symlink.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from spectrain.io.errors import writing
from spectrain.io.integrity import make_readable, verify
from spectrain.registry import TRAINING_FREE

# A directory holding one of these belongs to a training run or a checkpoint (pruned / replaced by it).
RUN_MARKERS = ("drafter_config.json", "trainer_state.json", "run_info.json", "best.json")
MARKER = ".spectrain-output"  # {"kind": "run" | "eval" | "export" | "features"}: what spectrain wrote here
LOCK = ".spectrain-lock"
JOURNAL = ".spectrain-temps"  # names of temp entries spectrain created here (the only ones cleanup removes)
KIND_NAMES = {"run": "training run", "eval": "eval report", "export": "export", "features": "feature cache",
              "checkpoint": "checkpoint"}


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    # EINVAL (a filesystem without exchange) / ENOSYS: the caller falls back to two renames
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def swap_in(tmp: Path, final: Path) -> None:
    """Put the complete directory ``tmp`` at ``final``. An existing ``final`` is exchanged with it in one
    atomic step (readers see the old or the new directory, never none), then removed."""
    if not final.exists():
        os.replace(tmp, final)
        return
    if _exchange(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)  # holds the old directory now
        return
    old = final.with_name(f".old-{final.name}")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


# ---- writing files without following links ------------------------------------------------------------


def _open_nofollow(path: Path, flags: int):
    """``os.open`` that refuses a symlink at ``path`` (O_NOFOLLOW) with a message naming it."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP or path.is_symlink():  # the last component is a symlink
            raise FileExistsError(f"{path} is a symbolic link (to {os.readlink(path)}): spectrain never writes "
                                  "through a link, which could point at another file of yours; remove the link "
                                  "or choose another output directory") from None
        raise


def write_text_safe(path, text: str) -> None:
    """Write ``path`` by a temp file and a rename: a symlink planted at ``path`` is replaced by the new file,
    never written through (the file it points to stays untouched)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with os.fdopen(_open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:
        f.write(text)
    os.replace(tmp, path)


def append_text_safe(path, text: str) -> None:
    """Append to ``path`` (created if missing); a symlink at ``path`` is refused, never followed."""
    path = Path(path)
    with os.fdopen(_open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "a") as f:
        f.write(text)


_MODE_FLAGS = {"a": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
               "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "r+b": os.O_RDWR}


def open_nofollow(path, mode: str = "a", encoding: str | None = "utf-8"):
    """``open(path, mode)`` for mode "a", "w", "wb" or "r+b" that refuses a symlink at ``path`` instead of writing
    through it (a link planted at a temp name between the placement check and the write)."""
    fd = _open_nofollow(Path(path), _MODE_FLAGS[mode])
    return os.fdopen(fd, mode, encoding=None if "b" in mode else encoding)


class OutputLocked(FileExistsError):
    """Another process holds the lock of this output."""


@contextmanager
def exclusive_lock(path, what: str) -> Iterator[Path]:
    """Hold an advisory ``flock`` on ``path`` (created, never through a symlink) while the body runs: a second
    process asking for it is refused at once, naming ``what``. The kernel drops the lock when the holder dies,
    so a killed run never leaves a stale lock; the file is removed on exit (while still held, so that a
    waiting process re-checks the inode it locked)."""
    import fcntl

    path = Path(path)
    while True:
        fd = _open_nofollow(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputLocked(f"{what} is being written by another spectrain process (it holds {path}): wait for "
                               "it to finish or choose another output path") from None
        try:  # the holder before us may have removed the file after we opened it: lock the one at the path
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


# ---- what a directory is: spectrain's marker, or the files an older spectrain left -----------------------


def write_marker(d: Path, kind: str) -> None:
    write_text_safe(d / MARKER, json.dumps({"kind": kind, "spectrain": 1}) + "\n")


def _marker(d: Path) -> str | None:
    m = d / MARKER
    try:
        kind = json.loads(m.read_text()).get("kind") if m.is_file() and not m.is_symlink() else None
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in KIND_NAMES else None


def _legacy_kind(d: Path) -> str | None:
    def has(name: str) -> bool:
        return (d / name).is_file() and not (d / name).is_symlink()

    if has("trainer_state.json") or has("best.json") or has("drafter_config.json"):
        return "checkpoint"
    if has("run_info.json") or has(LOCK) or (d / "init" / "drafter_config.json").is_file() or \
            any(re.match(r"^step-\d+$", p.name) and (p / "trainer_state.json").is_file() for p in d.iterdir()):
        return "run"
    if has("report.json") and has("report.md"):
        return "eval"
    if has("manifest.json") and any(p.name.endswith(".safetensors.json") for p in d.iterdir()):
        return "features"
    if has("SHA256SUMS") and has("config.json"):
        return "export"
    return None


def kind_of(d) -> str | None:
    """What spectrain wrote in directory ``d`` ("run", "eval", "export", "features", "checkpoint"), or None:
    not spectrain's output (a user's directory)."""
    d = Path(d)
    if not d.is_dir():
        return None
    return _marker(d) or _legacy_kind(d)


# ---- placement: checked before any work ------------------------------------------------------------------


def _local(p) -> Path | None:
    """An input given as a local path (a hub id or '' gives None)."""
    if not p or str(p) == "none" or str(p).split(":", 1)[0] in TRAINING_FREE:  # a drafter spec, not a path
        return None
    q = Path(str(p)).expanduser()
    return q.resolve() if q.exists() else None


def check_placement(out, kind: str, inputs: Iterable = (), *, force: bool = False, option: str = "--out") -> Path:
    """Refuse an output place that would destroy something (the module doc's rules); return it resolved.
    ``inputs``: (role, path) pairs the command reads; ``force``: an existing output of this kind may be
    replaced (eval/export); a run / feature cache of this kind is continued by its own logic instead."""
    given = Path(str(out)).expanduser()
    if given.exists() and not given.is_dir():
        raise FileExistsError(f"{option} {given} is an existing file, not a directory: choose a directory path")
    real = given.resolve()
    home = Path.home().resolve()
    if real == home or real in home.parents:
        what = "the filesystem root" if real == Path(real.anchor) else \
            "your home directory" if real == home else "an ancestor of your home directory"
        raise ValueError(f"{option} {given} is {what}: spectrain writes (and may replace) its output directory "
                         "whole; choose a new directory, e.g. runs/NAME")
    for role, path in inputs:
        src = _local(path)
        if src is None:
            continue
        if real == src or real in src.parents:
            raise ValueError(f"{option} {given} is (or contains) the {role} {path} this command reads: writing "
                             "there would destroy it; choose a directory outside it")
        if role == "target" and src.is_dir() and src in real.parents:
            raise ValueError(f"{option} {given} is inside the target model directory {path}: keep outputs out of "
                             "the model's files; choose a directory elsewhere")
    refuse_inside_run(real, option)
    if real.is_dir() and any(real.iterdir()):
        have = kind_of(real)
        name = KIND_NAMES[kind]
        if have is None:
            raise FileExistsError(f"{option} {given} is a non-empty directory that spectrain did not write (no "
                                  f"{MARKER}): spectrain never replaces or mixes into your files, with or without "
                                  "--force; choose a new or empty directory")
        if have != kind:
            a = "an" if name[0] in "aeiou" else "a"
            raise FileExistsError(f"{option} {given} is a spectrain {KIND_NAMES[have]} directory, not {a} {name}: "
                                  f"writing {a} {name} there would destroy it; choose another directory")
        if kind in ("eval", "export") and not force:
            raise FileExistsError(f"{option} {given} already exists and is not empty: choose a new directory, or "
                                  f"pass --force to replace this {name} whole (its old files are removed, never "
                                  "mixed with new ones)")
    parent = real.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"{option} {given}: cannot write to {parent} (permission denied); choose another path")
    return real


def check_file_placement(out, inputs: Iterable = (), temps: Iterable = (), option: str = "--out",
                         replace: bool = False) -> Path:
    """The rules for a command whose output is one file: no symlink at it or at its temp names (they would be
    written through), not inside the target's directory, a checkpoint, an export or a feature cache. Without
    ``replace`` (regenerate) an existing path is refused; with it (a plot's PNG, a summary JSON: small files a
    rerun rewrites) an existing file is replaced unless it is an input of the command or a run's / eval's own
    record (``OWN_FILES``)."""
    out = Path(str(out)).expanduser()
    for p in (out, *map(Path, temps)):
        if p.is_symlink():
            raise FileExistsError(f"{option} {out}: {p} is a symbolic link (to {os.readlink(p)}): spectrain never "
                                  "writes through a link; remove it or choose another path")
    if out.exists() and not replace:
        raise FileExistsError(f"{option} {out} already exists; delete it or choose another path")
    real = out.resolve()
    for role, path in inputs:
        src = _local(path)
        if src is not None and src.is_dir() and src in real.parents and role == "target":
            raise ValueError(f"{option} {out} is inside the target model directory {path}: keep outputs out of "
                             "the model's files; choose a path elsewhere")
    if replace:
        _refuse_replacing(out, real, inputs, option)
    return out


# A run's or an eval's own records: a one-file output never replaces them (the run would lose its history).
OWN_FILES = ("metrics.jsonl", "run_info.json", "recipe.yaml", "report.json", "report.md", "SHA256SUMS", MARKER,
             LOCK, JOURNAL)


def _refuse_replacing(out: Path, real: Path, inputs: Iterable, option: str) -> None:
    """``check_file_placement(replace=True)``: what an existing (or new) file at ``out`` must not be."""
    if real.is_dir():
        raise IsADirectoryError(f"{option} {out} is a directory: give a file path")
    if not real.parent.is_dir():
        raise FileNotFoundError(f"{option} {out}: the folder {real.parent} does not exist; create it or choose "
                                "another path")
    for role, path in inputs:
        src = _local(path)
        if src is not None and src.is_file() and real.exists() and os.path.samefile(src, real):  # also hard links
            raise ValueError(f"{option} {out} is the {role} {path} this command reads: writing there would destroy "
                             "it; choose another path")
    refuse_inside_run(real, option)  # a checkpoint's weights and manifest
    kind = kind_of(real.parent)
    if kind in ("export", "features"):  # sealed by a manifest: a file added or replaced breaks it
        raise ValueError(f"{option} {out} is inside {real.parent}, a spectrain {KIND_NAMES[kind]}: writing there "
                         "would break it; choose a path elsewhere")
    if kind is not None and real.name in OWN_FILES:
        raise ValueError(f"{option} {out} is the {KIND_NAMES[kind]}'s own {real.name}: replacing it would lose "
                         "that record; choose another file name")


def resolve_out(out, force: bool, option: str = "--out", kind: str = "eval", inputs: Iterable = ()) -> Path:
    """``check_placement`` for an ``--out`` directory (a symlink is followed: its target is checked and
    replaced, the link kept)."""
    return check_placement(out, kind, inputs, force=force, option=option)


# ---- run directories: the lock and the temp journal -------------------------------------------------------


def record_temp(d: Path, name: str) -> None:
    """Note a temp entry about to be created in run dir ``d``: only recorded names are ever cleaned up."""
    append_text_safe(Path(d) / JOURNAL, name + "\n")


def remove_leftovers(output_dir: Path) -> list[str]:
    """The temp dirs and links of a killed save that spectrain recorded in ``.spectrain-temps`` (names like
    ``.tmp-step-N``, ``.old-best``, ``.last.tmpPID``); returns their names. An entry spectrain did not record
    is never touched. Call it before a run writes anything."""
    journal = Path(output_dir) / JOURNAL
    if not journal.is_file() or journal.is_symlink():
        return []
    gone = []
    for name in dict.fromkeys(journal.read_text().split()):
        p = Path(output_dir) / name
        if "/" in name or not name.startswith(".") or name in (MARKER, LOCK, JOURNAL) or \
                not (p.exists() or p.is_symlink()):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        gone.append(name)
    if gone:  # the listed names are handled; a clean run's journal stays as it is
        journal.unlink()
    return gone


class RunLocked(FileExistsError):
    """Another live process writes this run directory."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


@contextmanager
def run_lock(d, what: str = "output_dir") -> Iterator[Path]:
    """Hold ``d/.spectrain-lock`` (pid + host) while the body writes ``d``. A lock of a live process is
    refused naming it; one whose process is gone (same host, dead pid) is taken over with a warning."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    lock = d / LOCK
    me = {"pid": os.getpid(), "host": platform.node(), "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for attempt in (0, 1):
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            break
        except FileExistsError:
            try:
                holder = json.loads(lock.read_text()) if not lock.is_symlink() else {}
            except (OSError, ValueError):
                holder = {}
            pid, host = holder.get("pid"), holder.get("host")
            if attempt == 0 and host == me["host"] and isinstance(pid, int) and not _alive(pid):
                warnings.warn(f"{what} {d}: taking over the stale lock of process {pid} on {host} (it is gone)",
                              stacklevel=3)
                lock.unlink(missing_ok=True)
                continue
            raise RunLocked(f"{what} {d} is being written by process {pid} on host {host} since "
                            f"{holder.get('since', '?')} (lock {lock}): wait for it to finish or choose another "
                            f"{what}; if that process is really gone, delete {lock}") from None
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(me) + "\n")
    try:
        yield lock
    finally:
        try:
            if json.loads(lock.read_text()).get("pid") == me["pid"]:
                lock.unlink()
        except (OSError, ValueError):
            pass


def refuse_inside_run(out: Path, option: str = "--out") -> None:
    """Training prunes step-N/ and replaces best/ and init/: an output inside a checkpoint, or in the place
    of one, would be deleted by it."""
    for d in out.parents:
        hit = next((m for m in RUN_MARKERS if m != "run_info.json" and (d / m).is_file()), None)
        if hit:
            raise ValueError(f"{option} {out} is inside {d}, a checkpoint directory ({hit}): training replaces "
                             "or prunes it, which would delete the output; write it elsewhere")
    own = next((m for m in ("trainer_state.json", "best.json") if (out / m).is_file()), None)
    if own or ((out.parent / "run_info.json").is_file() and re.match(r"^(best|last|init|step-\d+)$", out.name)):
        raise ValueError(f"{option} {out} is a checkpoint of the run {out.parent}: write the output elsewhere")


@contextmanager
def staged_dir(out: Path, kind: str = "eval") -> Iterator[Path]:
    """A temp dir next to ``out``; when the body succeeds it becomes ``out`` atomically (an existing ``out``
    is exchanged and removed), files readable by other users, with the ``kind`` marker. On failure nothing
    of it remains."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}.", dir=out.parent))
    with writing(tmp, name=out):
        yield tmp

        write_marker(tmp, kind)
        make_readable(tmp)
        swap_in(tmp, out)


def guard_export(src: Path, out, force: bool, target: str | None = None) -> Path:
    """Before an export: the source's files match its SHA256SUMS, and ``out`` is a safe place for an export
    (``check_placement``: a symlink is followed; never an input, a checkpoint or run, a user's directory)."""
    verify(src, "checkpoint", fix="export another checkpoint of the run (e.g. last/ or a step-N/), or retrain",
           required=True)
    return check_placement(out, "export", [("source", src), ("target", target)], force=force)
