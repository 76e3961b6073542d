"""Output directories that are safe to point anywhere: checked before any work, written into a temp
sibling, swapped in atomically (``--force`` replaces, never mixes), readable by other users.

Used by checkpoints (``best/``, ``init/``), ``spectrain eval --out`` and ``spectrain export --out``.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from spectrain.errors import writing

# A directory holding one of these belongs to a training run or a checkpoint (pruned / replaced by it).
RUN_MARKERS = ("drafter_config.json", "trainer_state.json", "run_info.json", "best.json")


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


def remove_leftovers(output_dir: Path) -> list[str]:
    """The temp dirs and links of a killed save (``.tmp-*``, ``.old-*``, ``.last.tmp*``); returns their names.
    Call it before a run writes anything."""
    if not output_dir.is_dir():
        return []
    gone = []
    for p in output_dir.iterdir():
        if p.name.startswith((".tmp-", ".old-", ".last.tmp")):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            gone.append(p.name)
    return gone


def resolve_out(out, force: bool, option: str = "--out") -> Path:
    """Check an output directory before any work: a file is refused; an existing directory needs ``force``
    (it is then replaced whole, never mixed with old files). A symlink is followed: its target is replaced
    and the link kept."""
    out = Path(out).expanduser()
    if out.is_symlink():
        out = out.resolve()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{option} {out} is an existing file, not a directory: choose a directory path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{option} {out} already exists and is not empty: choose a new directory, or pass "
                              "--force to replace it whole (its old files are removed, never mixed with new ones)")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"{option} {out}: cannot write to {parent} (permission denied); choose another path")
    return out


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
def staged_dir(out: Path) -> Iterator[Path]:
    """A temp dir next to ``out``; when the body succeeds it becomes ``out`` atomically (an existing ``out``
    is exchanged and removed), files readable by other users. On failure nothing of it remains."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}.", dir=out.parent))
    with writing(tmp, name=out):
        yield tmp
        from spectrain.integrity import make_readable

        make_readable(tmp)
        swap_in(tmp, out)


def guard_export(src: Path, out, force: bool) -> Path:
    """Before an export: the source's files match its SHA256SUMS, and ``out`` is a real place (a symlink is
    followed; never inside a checkpoint or run directory, which training prunes or replaces)."""
    from spectrain.integrity import verify

    verify(src, "checkpoint", fix="export another checkpoint of the run (e.g. last/ or a step-N/), or retrain")
    out = Path(out).expanduser()
    target = out.resolve() if out.is_symlink() else out.absolute()
    refuse_inside_run(target)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"--out {out} is an existing file, not a directory: choose a directory path")
    return target
